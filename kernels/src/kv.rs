//! KV-cache entry points: RoPE on the new keys (and optionally the queries) and the append
//! of keys and values into a contiguous or paged cache, in one launch (see [`KvParams`]).

use crate::entry::{position, ElemTable, Entries, F32Table, GptJ, NeoX, Rows, Style, TableElem, Tables};
use crate::gpu::{
    atomic_add_u64, atomic_max_u64, atomic_min_u64, block_dim, block_idx, load_i64, sync_threads, thread_idx, Bf16, Io,
    One, Two, Vec16, Vec8, F16, F32,
};
use crate::params::{groups, kv_heads_per_thread, work_item, ErrorRecord, HeadsView, KvParams};

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
    let (b, s) = p.seq_div.divmod(t);
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
        return Some(p.seq_div.div(t) as u64 * p.block_size as u64 + pos as u64);
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

/// Whether the owner array names a token other than `t` as the last to write slot `n`.
#[inline(always)]
unsafe fn not_owner(p: &KvParams, t: u32, n: u64) -> bool {
    let mine = (p.epoch as u64) << 32 | t as u64;
    // Written by `kv_claim`, the previous launch: read-only here.
    load_i64((p.owner as *const i64).add(n as usize)) as u64 != mine
}

/// What the block-wide scan of the scanning kernels leaves in shared memory (see
/// [`KvParams::shared_bytes`]): each token's raw position and target slot (`u64::MAX` for
/// none), and whether a later token writes the slot of each of the block's own tokens.
struct Shared {
    positions: *mut i64,
    targets: *mut u64,
    superseded: *mut u32,
    /// The block's first token.
    first: u32,
}

/// The block's first token and number of tokens (0 for a block without work).
#[inline(always)]
fn block_tokens(p: &KvParams) -> (u32, u32) {
    let ((bx, by), bd) = (block_idx(), block_dim().0);
    let row = by * p.chunk;
    let (lo, hi) = (p.items_div.div(bx * bd), p.items_div.div(bx * bd + bd - 1));
    let first = row + lo;
    let last = (row + hi.min(p.chunk - 1)).min(p.tokens.saturating_sub(1));
    (first, if first > last { 0 } else { last - first + 1 })
}

/// Token `j`'s raw slot entry and position, for the block-wide scan.
#[inline(always)]
unsafe fn scan_token(p: &KvParams, j: u32) -> (i64, i64) {
    let (seq, index) = p.seq_div.divmod(j);
    (raw_slot(p, j), position(p.position_mode, p.positions, j, seq, index))
}

/// The scan's loads for this thread's first two tokens (`thread`, `thread + block_dim`),
/// issued before anything waits on them.
#[inline(always)]
unsafe fn scan_loads(p: &KvParams) -> (Option<(i64, i64)>, Option<(i64, i64)>) {
    let (tid, bd) = (thread_idx().0, block_dim().0);
    let load = |j: u32| (j < p.tokens).then(|| scan_token(p, j));
    (load(tid), load(tid + bd))
}

/// The scan of the scanning kernels, which every thread of the block runs: the block loads
/// every token's position and slot once (`loaded`: this thread's first two, from
/// [`scan_loads`]), then its threads compare the later tokens' slots with the block's own
/// tokens' in parallel (a later token wins a repeated slot).
#[inline(always)]
unsafe fn block_scan(p: &KvParams, loaded: (Option<(i64, i64)>, Option<(i64, i64)>)) -> Shared {
    let base = core::intrinsics::gpu::gpu_launch_sized_workgroup_mem::<u64>();
    let tokens = p.tokens as usize;
    let s = Shared {
        positions: base as *mut i64,
        targets: base.add(tokens),
        superseded: base.add(2 * tokens) as *mut u32,
        first: 0,
    };
    let (first, count) = block_tokens(p);
    let (tid, bd) = (thread_idx().0, block_dim().0);
    let store = |j: u32, (raw, pos): (i64, i64)| {
        let valid = pos >= 0 && pos < p.max_position as i64;
        let n = if valid { slot(p, j, pos as u32, raw, false) } else { None };
        *s.positions.add(j as usize) = pos;
        *s.targets.add(j as usize) = n.unwrap_or(u64::MAX);
    };
    if let Some(l) = loaded.0 {
        store(tid, l);
    }
    if let Some(l) = loaded.1 {
        store(tid + bd, l);
    }
    // Blocks smaller than half the scan's tokens: the rest, one at a time.
    let mut j = tid + 2 * bd;
    while j < p.tokens {
        store(j, scan_token(p, j));
        j += bd;
    }
    if tid < count {
        *s.superseded.add(tid as usize) = 0;
    }
    sync_threads();
    let mut j = first + 1 + tid;
    while j < p.tokens {
        let n = *s.targets.add(j as usize);
        if n != u64::MAX {
            for k in 0..count.min(j - first) {
                if *s.targets.add((first + k) as usize) == n {
                    s.superseded.add(k as usize).write_volatile(1);
                }
            }
        }
        j += bd;
    }
    sync_threads();
    Shared { first, ..s }
}

/// Where token `t` goes: its position and slot, unless it is skipped (out of range, padding,
/// or, for keys and values, a later token writes the same slot). Reports go to the records
/// when `report_position` / `report_slot`.
struct Target {
    pos: u32,
    slot: u64,
}

/// [`Target`] from the block-wide scan.
#[inline(always)]
unsafe fn shared_target(p: &KvParams, s: &Shared, t: u32, kv: bool, report: (bool, bool)) -> Option<Target> {
    let pos = *s.positions.add(t as usize);
    if pos < 0 || pos >= p.max_position as i64 {
        if report.0 {
            record(p.error as *mut ErrorRecord, t, pos);
        }
        return None;
    }
    if !kv {
        return Some(Target { pos: pos as u32, slot: 0 });
    }
    let n = *s.targets.add(t as usize);
    if n == u64::MAX {
        if report.1 {
            // Padding or out of range: only the latter is reported.
            slot(p, t, pos as u32, raw_slot(p, t), true);
        }
        return None;
    }
    if *s.superseded.add((t - s.first) as usize) != 0 {
        return None;
    }
    Some(Target { pos: pos as u32, slot: n })
}

/// Fused RoPE + KV append for one lane of one head group of one token; `R` moves rotating
/// lanes, `C` copying lanes, `B` reads the tables, `G` heads per thread. With `SCAN` and no
/// owner array, the block settles duplicates itself ([`block_scan`]); otherwise the owner
/// array does (the host passes one to the kernels without `SCAN`).
///
/// # Safety
/// The host checked every view and both caches against their buffers, the slots and owner
/// arrays' lengths, that nothing written overlaps anything else the launch touches, the
/// tables' size, alignment for `R` and `C`, that the geometry was made with this `G`, and,
/// for the scan, at least [`KvParams::shared_bytes`] of dynamic shared memory.
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
    core::hint::assert_unchecked(p.chunk != 0);
    let item = work_item(block_idx(), block_dim().0, thread_idx().0, p.items_div, p.chunk, p.tokens);
    let shared = SCAN && p.owner == 0;
    // Decode the item and load the data it reads: neither depends on the position or slot.
    let (t, w) = item.unwrap_or((0, 0));
    let (b, s) = p.seq_div.divmod(t);
    let (b, s) = (b as u64, s as u64);
    let half = p.half as usize;
    let (is_q, is_k) = (w < qi, w >= qi && w < qi + ki);
    // Chosen by value: a reference into one of three views would put the parameters in
    // local memory.
    let pick = |f: &dyn Fn(&HeadsView) -> u64| {
        if is_q {
            f(&p.q)
        } else if is_k {
            f(&p.k)
        } else {
            f(&p.v)
        }
    };
    let (input, strides) = (pick(&|v| v.input), [0, 1, 2].map(|i| pick(&|v| v.in_strides[i])));
    let (heads, lanes, w) = if is_q {
        (p.q.heads, p.lanes_div[0], w)
    } else if is_k {
        (p.k.heads, p.lanes_div[1], w - qi)
    } else {
        (p.v.heads, p.lanes_div[2], w - qi - ki)
    };
    let (group, lane) = lanes.divmod(w);
    let lane = lane as usize;
    let h0 = (group * G as u32) as u64;
    let count = (heads.saturating_sub(h0 as u32)).min(G as u32) as usize;
    let offset = b * strides[0] + s * strides[1] + h0 * strides[2];
    let src = (input as *const u8).wrapping_add(offset as usize * R::SIZE);
    let src_step = strides[2] as usize * R::SIZE;
    let rotating = is_q || (is_k && lane < p.rot_lanes as usize);
    let rows = Rows { src, dst: core::ptr::null_mut(), src_step, dst_step: 0, count };
    let first = if item.is_some() && rotating { S::load::<R>(&rows, 0, lane, half) } else { [[0; 4]; 2] };
    // A copying lane's first head is loaded now too: its store then waits on the position,
    // slot and owner only, not on a load issued after them.
    let copy_at = match (rotating, is_k) {
        (true, _) => 0,
        (false, true) => (2 * half + (lane - p.rot_lanes as usize) * C::E) * C::SIZE,
        (false, false) => lane * C::E * C::SIZE,
    };
    let first_copy = if item.is_some() && !rotating { C::load_raw(rows.src(0, copy_at)) } else { [0; 4] };
    // Reports: the first q item reports positions (the first k item without q); the first k
    // item reports slots.
    let report = (w == 0 && (is_q || (qi == 0 && is_k)), w == 0 && is_k);
    let mut entries = Entries::none();
    let target = if shared {
        // The scan's loads first; then the rotating items load their position and table
        // entries, which overlap the scan's barriers.
        let loaded = scan_loads(p);
        if item.is_some() && rotating {
            let own = position(p.position_mode, p.positions, t, b as u32, s as u32);
            if own >= 0 && own < p.max_position as i64 {
                entries = S::entries::<R, B>(lane, own as usize, p);
            }
        }
        let scan = block_scan(p, loaded);
        if item.is_none() {
            return;
        }
        shared_target(p, &scan, t, !is_q, report)
    } else {
        if item.is_none() {
            return;
        }
        let raw = if is_q { 0 } else { raw_slot(p, t) };
        match checked_position(p, t, report.0) {
            Some(pos) if is_q => Some(Target { pos, slot: 0 }),
            Some(pos) => slot(p, t, pos, raw, report.1).map(|slot| Target { pos, slot }),
            None => None,
        }
    };
    let Some(Target { pos, slot: n }) = target else { return };
    core::hint::assert_unchecked(count >= 1 && count <= G);
    if rotating && !shared {
        // Without the scan the table loads overlap the owner check.
        entries = S::entries::<R, B>(lane, pos as usize, p);
    }
    if is_q {
        // q, in place.
        let base = src as *mut u8;
        let rows = Rows { src, dst: base, src_step, dst_step: src_step, count };
        S::apply::<R, B>(rows, first, lane, &entries, p);
        return;
    }
    if !shared && not_owner(p, t, n) {
        return;
    }
    let cache = if is_k { p.k_cache } else { p.v_cache };
    let (block, within) = p.block_div.divmod(n as u32);
    let row = block as u64 * p.cache_strides[0] + within as u64 * p.cache_strides[1] + h0 * p.cache_strides[2];
    let dst = (cache as *mut u8).wrapping_add(row as usize * R::SIZE);
    let rows = Rows { src, dst, src_step, dst_step: p.cache_strides[2] as usize * R::SIZE, count };
    if rotating {
        S::apply::<R, B>(rows, first, lane, &entries, p);
    } else {
        // k past rotary_dim, and v: copy the bits.
        rows.copy::<C>(first_copy, copy_at);
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
/// heads per thread, owner array only; `_p`: 16 bytes, one head per thread, owner array only;
/// `_d`: 8 bytes, one head per thread, block scan or owner array (few tokens: half the work
/// per thread); `_s`: element by element, either. `_t`: the caller's tables (the reference
/// operation).
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
    kv_neox_f32_d: NeoX, Vec8<F32>, Vec8<F32>, F32Table, 1, true;
    kv_neox_f32_s: NeoX, One<F32>, One<F32>, F32Table, 1, true;
    kv_neox_f16_v: NeoX, Vec16<F16>, Vec16<F16>, F32Table, V2, false;
    kv_neox_f16_p: NeoX, Vec16<F16>, Vec16<F16>, F32Table, 1, false;
    kv_neox_f16_d: NeoX, Vec8<F16>, Vec8<F16>, F32Table, 1, true;
    kv_neox_f16_s: NeoX, One<F16>, One<F16>, F32Table, 1, true;
    kv_neox_bf16_v: NeoX, Vec16<Bf16>, Vec16<Bf16>, F32Table, V2, false;
    kv_neox_bf16_p: NeoX, Vec16<Bf16>, Vec16<Bf16>, F32Table, 1, false;
    kv_neox_bf16_d: NeoX, Vec8<Bf16>, Vec8<Bf16>, F32Table, 1, true;
    kv_neox_bf16_s: NeoX, One<Bf16>, One<Bf16>, F32Table, 1, true;
    kv_gptj_f32_v: GptJ, Vec16<F32>, Vec16<F32>, F32Table, GPTJ, false;
    kv_gptj_f32_p: GptJ, Vec16<F32>, Vec16<F32>, F32Table, 1, false;
    kv_gptj_f32_d: GptJ, Vec8<F32>, Vec8<F32>, F32Table, 1, true;
    kv_gptj_f32_s: GptJ, Two<F32>, One<F32>, F32Table, 1, true;
    kv_gptj_f16_v: GptJ, Vec16<F16>, Vec16<F16>, F32Table, GPTJ, false;
    kv_gptj_f16_p: GptJ, Vec16<F16>, Vec16<F16>, F32Table, 1, false;
    kv_gptj_f16_d: GptJ, Vec8<F16>, Vec8<F16>, F32Table, 1, true;
    kv_gptj_f16_s: GptJ, Two<F16>, One<F16>, F32Table, 1, true;
    kv_gptj_bf16_v: GptJ, Vec16<Bf16>, Vec16<Bf16>, F32Table, GPTJ, false;
    kv_gptj_bf16_p: GptJ, Vec16<Bf16>, Vec16<Bf16>, F32Table, 1, false;
    kv_gptj_bf16_d: GptJ, Vec8<Bf16>, Vec8<Bf16>, F32Table, 1, true;
    kv_gptj_bf16_s: GptJ, Two<Bf16>, One<Bf16>, F32Table, 1, true;
    kv_gptj_f16_v_t: GptJ, Vec16<F16>, Vec16<F16>, ElemTable<F16>, GPTJ, false;
    kv_gptj_f16_d_t: GptJ, Vec8<F16>, Vec8<F16>, ElemTable<F16>, 1, true;
    kv_gptj_f16_s_t: GptJ, Two<F16>, One<F16>, ElemTable<F16>, 1, true;
    kv_gptj_bf16_v_t: GptJ, Vec16<Bf16>, Vec16<Bf16>, ElemTable<Bf16>, GPTJ, false;
    kv_gptj_bf16_d_t: GptJ, Vec8<Bf16>, Vec8<Bf16>, ElemTable<Bf16>, 1, true;
    kv_gptj_bf16_s_t: GptJ, Two<Bf16>, One<Bf16>, ElemTable<Bf16>, 1, true;
}
