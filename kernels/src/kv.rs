//! KV-cache entry points: RoPE on the new keys (and optionally the queries) and the append
//! of keys and values into a contiguous or paged cache, in one launch (see [`KvParams`]).

use crate::entry::{position, ElemTable, Entries, F32Table, GptJ, NeoX, Rows, Style, TableElem, Tables};
use crate::gpu::{
    atomic_add_u64, atomic_max_u64, atomic_min_u64, block_dim, block_idx, load_i32, load_i64, thread_idx, Bf16, Io,
    One, Two, Vec16, F16, F32,
};
use crate::params::{groups, kv_heads_per_thread, position_mode, work_item, ErrorRecord, KvParams};

impl Tables for KvParams {
    #[inline(always)]
    fn tables(&self) -> [u64; 4] {
        [self.cos, self.sin, self.cos_lo, self.sin_lo]
    }
    #[inline(always)]
    fn half(&self) -> u32 {
        self.half
    }
    #[inline(always)]
    fn sin_sign(&self) -> f32 {
        1.0
    }
}

/// Token `t`'s position, or `None` (after recording it when `report`) when out of range.
#[inline(always)]
unsafe fn checked_position(p: &KvParams, t: u32, report: bool) -> Option<u32> {
    let (b, s) = (t / p.seq, t % p.seq);
    let pos = position(p.position_mode, p.positions, t, b, s);
    if pos >= 0 && pos < p.max_position as i64 {
        return Some(pos as u32);
    }
    if report {
        record(p.error as *mut ErrorRecord, t, pos);
    }
    None
}

#[inline(always)]
unsafe fn record(r: *mut ErrorRecord, t: u32, value: i64) {
    atomic_min_u64(&raw mut (*r).key, ErrorRecord::key(t, value));
    atomic_add_u64(&raw mut (*r).count, 1);
}

/// Token `t`'s raw slot mapping entry (0 for contiguous caches), loaded before its position
/// is known: the two loads overlap.
#[inline(always)]
unsafe fn raw_slot(p: &KvParams, t: u32) -> i64 {
    if p.slots == 0 {
        0
    } else {
        load_i64((p.slots as *const i64).add(t as usize))
    }
}

/// Token `t`'s cache slot, given its (valid) position and raw slot entry: `None` for padding
/// (`-1`) and, after recording it when `report`, for a slot out of range.
#[inline(always)]
unsafe fn slot(p: &KvParams, t: u32, pos: u32, raw: i64, report: bool) -> Option<u64> {
    if p.slots == 0 {
        // Contiguous: the host checked `max_position <= block_size`.
        return Some((t / p.seq) as u64 * p.block_size as u64 + pos as u64);
    }
    if raw >= 0 && (raw as u64) < p.num_slots {
        return Some(raw as u64);
    }
    if report && raw != -1 {
        record((p.error as *mut ErrorRecord).add(1), t, raw);
    }
    None
}

/// The slot token `t` writes, if it writes one (no reports: for scanning other tokens).
#[inline(always)]
unsafe fn target(p: &KvParams, t: u32) -> Option<u64> {
    let raw = raw_slot(p, t);
    match checked_position(p, t, false) {
        Some(pos) => slot(p, t, pos, raw, false),
        None => None,
    }
}

/// Whether a token after `t` (position `pos`) writes slot `n` (then `t` must not: the last
/// token wins). Without `SCAN`, only the owner array is consulted (the host passes one).
#[inline(always)]
unsafe fn superseded<const SCAN: bool>(p: &KvParams, t: u32, n: u64, pos: u32) -> bool {
    if !SCAN || p.owner != 0 {
        let mine = (p.epoch as u64) << 32 | t as u64;
        // Written by `kv_claim`, the previous launch: read-only here.
        return load_i64((p.owner as *const i64).add(n as usize)) as u64 != mine;
    }
    let confirm = |j: u32| target(p, j) == Some(n);
    if p.slots != 0 {
        return scan(t + 1, p.tokens, |j| load_i64((p.slots as *const i64).add(j as usize)) == n as i64, confirm);
    }
    // Contiguous caches: only a later token of the same sequence with the same position.
    // Offsets and sequential positions never repeat within a sequence.
    let end = (t / p.seq + 1) * p.seq;
    match p.position_mode {
        position_mode::IDS_I32 => {
            scan(t + 1, end, |j| load_i32((p.positions as *const i32).add(j as usize)) == pos as i32, confirm)
        }
        position_mode::IDS_I64 => {
            scan(t + 1, end, |j| load_i64((p.positions as *const i64).add(j as usize)) == pos as i64, confirm)
        }
        _ => false,
    }
}

/// Whether some `j` in `start..end` has `candidate(j) && confirm(j)`. Candidates are tested
/// sixteen at a time with independent loads (a chain of one load per token would cost a
/// cache round trip per token); `confirm`, the full check, runs only on candidates.
#[inline(always)]
unsafe fn scan(start: u32, end: u32, candidate: impl Fn(u32) -> bool, confirm: impl Fn(u32) -> bool) -> bool {
    let mut j = start;
    while j < end {
        let mut hits = 0u32;
        let mut test = |k: u32| {
            if j + k < end && candidate(j + k) {
                hits |= 1 << k;
            }
        };
        crate::entry::unrolled(8, |k| test(k as u32));
        crate::entry::unrolled(8, |k| test(k as u32 + 8));
        while hits != 0 {
            if confirm(j + hits.trailing_zeros()) {
                return true;
            }
            hits &= hits - 1;
        }
        j += 16;
    }
    false
}

/// Fused RoPE + KV append for one lane of one head group of one token; `R` moves rotating
/// lanes, `C` copying lanes, `B` reads the tables, `G` heads per thread. Without `SCAN` the
/// kernel settles duplicates only through the owner array (the host always passes one).
///
/// # Safety
/// The host checked every view and both caches against their buffers, the slots and owner
/// arrays' lengths, that nothing written overlaps anything else the launch touches, the
/// tables' size, alignment for `R` and `C`, and that the geometry was made with this `G`.
#[inline(always)]
unsafe fn kv_append<S: Style, R: Io, C: Io, B: TableElem, const G: usize, const SCAN: bool>(p: &KvParams) {
    let (gq, gk) = (groups(p.q.heads, G as u32), groups(p.k.heads, G as u32));
    let (qi, ki, vi) = (gq * p.rot_lanes, gk * p.k_lanes, gk * p.v_lanes);
    let items = qi + ki + vi;
    // SAFETY: the host never launches without work or with `seq == 0` or zero lanes.
    core::hint::assert_unchecked(items != 0);
    core::hint::assert_unchecked(p.seq != 0);
    core::hint::assert_unchecked(p.rot_lanes != 0);
    core::hint::assert_unchecked(p.k_lanes != 0);
    core::hint::assert_unchecked(p.v_lanes != 0);
    core::hint::assert_unchecked(p.block_size != 0);
    let Some((t, w)) = work_item(block_idx(), block_dim().0, thread_idx().0, items, p.chunk, p.tokens) else {
        return;
    };
    let (b, s) = ((t / p.seq) as u64, (t % p.seq) as u64);
    let half = p.half as usize;
    if w < qi {
        // q, in place.
        let (group, lane) = (w / p.rot_lanes, (w % p.rot_lanes) as usize);
        let h0 = (group * G as u32) as u64;
        let base = (p.q.input as *mut u8).wrapping_add(p.q.in_offset(b, s, h0) as usize * R::SIZE);
        let step = p.q.in_strides[2] as usize * R::SIZE;
        let count = (p.q.heads - h0 as u32).min(G as u32) as usize;
        core::hint::assert_unchecked(count >= 1 && count <= G);
        let rows = Rows { src: base, dst: base, src_step: step, dst_step: step, count };
        let first = S::load::<R>(&rows, 0, lane, half);
        if let Some(pos) = checked_position(p, t, w == 0) {
            S::rotate::<R, B>(rows, first, lane, pos as usize, p);
        }
        return;
    }
    let is_k = w < qi + ki;
    let (view, cache, lanes, w) =
        if is_k { (&p.k, p.k_cache, p.k_lanes, w - qi) } else { (&p.v, p.v_cache, p.v_lanes, w - qi - ki) };
    let (group, lane) = (w / lanes, (w % lanes) as usize);
    let h0 = (group * G as u32) as u64;
    let count = (p.k.heads - h0 as u32).min(G as u32) as usize;
    core::hint::assert_unchecked(count >= 1 && count <= G);
    let src = (view.input as *const u8).wrapping_add(view.in_offset(b, s, h0) as usize * R::SIZE);
    let src_step = view.in_strides[2] as usize * R::SIZE;
    let rotating = is_k && lane < p.rot_lanes as usize;
    // The data does not depend on the position or slot: load it first.
    let first = if rotating {
        S::load::<R>(&Rows { src, dst: core::ptr::null_mut(), src_step, dst_step: 0, count }, 0, lane, half)
    } else {
        [[0; 4]; 2]
    };
    // Without q, the first k item reports positions; the first k item reports slots.
    let raw = raw_slot(p, t);
    let Some(pos) = checked_position(p, t, qi == 0 && w == 0 && is_k) else { return };
    let Some(n) = slot(p, t, pos, raw, is_k && w == 0) else { return };
    // Without a scan the table loads overlap the owner check. (Measured: with a scan, loading
    // them first costs more registers than it saves.)
    let early = rotating && !SCAN;
    let entries = if early { S::entries::<R, B>(lane, pos as usize, p) } else { Entries::none() };
    if superseded::<SCAN>(p, t, n, pos) {
        return;
    }
    let entries = if rotating && SCAN { S::entries::<R, B>(lane, pos as usize, p) } else { entries };
    let block = n as u32 / p.block_size;
    let within = n as u32 % p.block_size;
    let row = block as u64 * p.cache_strides[0] + within as u64 * p.cache_strides[1] + h0 * p.cache_strides[2];
    let dst = (cache as *mut u8).wrapping_add(row as usize * R::SIZE);
    let rows = Rows { src, dst, src_step, dst_step: p.cache_strides[2] as usize * R::SIZE, count };
    if rotating {
        S::apply::<R, B>(rows, first, lane, &entries, p);
    } else {
        // k past rotary_dim, and v: copy the bits.
        let start = if is_k { 2 * half + (lane - p.rot_lanes as usize) * C::E } else { lane * C::E };
        let i = start * C::SIZE;
        for h in 0..count {
            C::copy(rows.src(h, i), rows.dst(h, i));
        }
    }
}

/// Records, for each slot, the last token (of this call, tagged with `epoch`) that writes it.
///
/// # Safety
/// Launched by the host with one thread per token and an owner array of `num_slots` u64.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn kv_claim(p: KvParams) {
    core::hint::assert_unchecked(p.seq != 0);
    let t = block_idx().0 * block_dim().0 + thread_idx().0;
    if t >= p.tokens {
        return;
    }
    if let Some(n) = target(&p, t) {
        atomic_max_u64((p.owner as *mut u64).add(n as usize), (p.epoch as u64) << 32 | t as u64);
    }
}

/// Defines one entry point per (style, dtype, width, tables). `_v`: 16-byte accesses, several
/// heads per thread, owner array only; `_p`: one head per thread, owner array only; `_d`: one
/// head per thread, scan or owner array; `_s`: scalar, either.
macro_rules! kv_kernels {
    ($($name:ident: $style:ty, $rot:ty, $copy:ty, $table:ty, $g:expr, $scan:expr;)*) => {$(
        /// KV-cache entry point; see [`KvParams`] for the mapping and [`kv_append`] for the
        /// contract.
        ///
        /// # Safety
        /// Launched only by the host library, after its checks.
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(p: KvParams) {
            const G: usize = $g as usize;
            kv_append::<$style, $rot, $copy, $table, G, $scan>(&p)
        }
    )*};
}

const V4: u32 = kv_heads_per_thread(true, false, 4);
const V2: u32 = kv_heads_per_thread(true, false, 2);
const GPTJ: u32 = kv_heads_per_thread(true, true, 2);

kv_kernels! {
    kv_neox_f32_v: NeoX, Vec16<F32>, Vec16<F32>, F32Table, V4, false;
    kv_neox_f32_p: NeoX, Vec16<F32>, Vec16<F32>, F32Table, 1, false;
    kv_neox_f32_d: NeoX, Vec16<F32>, Vec16<F32>, F32Table, 1, true;
    kv_neox_f32_s: NeoX, One<F32>, One<F32>, F32Table, 1, true;
    kv_neox_f16_v: NeoX, Vec16<F16>, Vec16<F16>, F32Table, V2, false;
    kv_neox_f16_p: NeoX, Vec16<F16>, Vec16<F16>, F32Table, 1, false;
    kv_neox_f16_d: NeoX, Vec16<F16>, Vec16<F16>, F32Table, 1, true;
    kv_neox_f16_s: NeoX, One<F16>, One<F16>, F32Table, 1, true;
    kv_neox_bf16_v: NeoX, Vec16<Bf16>, Vec16<Bf16>, F32Table, V2, false;
    kv_neox_bf16_p: NeoX, Vec16<Bf16>, Vec16<Bf16>, F32Table, 1, false;
    kv_neox_bf16_d: NeoX, Vec16<Bf16>, Vec16<Bf16>, F32Table, 1, true;
    kv_neox_bf16_s: NeoX, One<Bf16>, One<Bf16>, F32Table, 1, true;
    kv_gptj_f32_v: GptJ, Vec16<F32>, Vec16<F32>, F32Table, GPTJ, false;
    kv_gptj_f32_p: GptJ, Vec16<F32>, Vec16<F32>, F32Table, 1, false;
    kv_gptj_f32_d: GptJ, Vec16<F32>, Vec16<F32>, F32Table, 1, true;
    kv_gptj_f32_s: GptJ, Two<F32>, One<F32>, F32Table, 1, true;
    kv_gptj_f16_v: GptJ, Vec16<F16>, Vec16<F16>, F32Table, GPTJ, false;
    kv_gptj_f16_p: GptJ, Vec16<F16>, Vec16<F16>, F32Table, 1, false;
    kv_gptj_f16_d: GptJ, Vec16<F16>, Vec16<F16>, F32Table, 1, true;
    kv_gptj_f16_s: GptJ, Two<F16>, One<F16>, F32Table, 1, true;
    kv_gptj_bf16_v: GptJ, Vec16<Bf16>, Vec16<Bf16>, F32Table, GPTJ, false;
    kv_gptj_bf16_p: GptJ, Vec16<Bf16>, Vec16<Bf16>, F32Table, 1, false;
    kv_gptj_bf16_d: GptJ, Vec16<Bf16>, Vec16<Bf16>, F32Table, 1, true;
    kv_gptj_bf16_s: GptJ, Two<Bf16>, One<Bf16>, F32Table, 1, true;
    kv_gptj_f16_v_t: GptJ, Vec16<F16>, Vec16<F16>, ElemTable<F16>, GPTJ, true;
    kv_gptj_f16_s_t: GptJ, Two<F16>, One<F16>, ElemTable<F16>, 1, true;
    kv_gptj_bf16_v_t: GptJ, Vec16<Bf16>, Vec16<Bf16>, ElemTable<Bf16>, GPTJ, true;
    kv_gptj_bf16_s_t: GptJ, Two<Bf16>, One<Bf16>, ElemTable<Bf16>, 1, true;
}
