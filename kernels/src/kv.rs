//! The bodies of the KV-cache entry points: RoPE on the new keys (and optionally the
//! queries) and the append of keys and values into a contiguous or paged cache, in one
//! launch (see [`KvParams`]); and the claims of the calls too large to scan.

use crate::fp8::Fp8;
use crate::gpu::{block_dim, block_idx, load_table, load_u8_nc, prefetch_l2, thread_idx, Elem, Io, One};
use crate::mem::sync_threads;
use crate::norm::NormLane;
use crate::norm_lane::{LaneAt, Whole};
use crate::params::{work_item, KvParams, ReadParams};
use crate::rotate::{BlockInputs, Entries, PairRows, Prologue, Quant, Rows, Source, Style, Table};
use crate::tuning::{KV_LOADS_AFTER_FILL, KV_PREFETCH_HEADS};
use crate::views::{ComputedView, Duplicates, HeadsView, SlotOf};

/// The launch's table for a token whose block row (library's source) is `row`; KV appends
/// always rotate forward.
#[inline(always)]
fn table(p: &KvParams, row: u32) -> Table<'_> {
    Table { src: &p.source, pairs: &p.pairs, sin_sign: 1.0, row }
}

/// Token `t`'s position from its raw position: `None` when out of range (recorded when
/// `report`).
///
/// # Safety
/// `p.errors` points at this launch's records (when `report`).
#[inline(always)]
unsafe fn checked(p: &KvParams, t: u32, raw_pos: i64, report: bool) -> Option<u32> {
    let pos = p.positions.check(raw_pos);
    if pos.is_none() && report {
        // SAFETY: the caller's contract.
        unsafe { p.errors.position(t, raw_pos) };
    }
    pos
}

/// Token `t`'s position and slot, from its raw position and raw slot entry: `None` when it
/// writes nothing. A bad position or slot is recorded as `report` says (positions, slots).
///
/// # Safety
/// As [`checked`].
#[inline(always)]
unsafe fn settle(p: &KvParams, t: u32, raw_pos: i64, raw_slot: i64, report: (bool, bool)) -> Option<(u32, u64)> {
    // SAFETY: the caller's contract.
    let pos = unsafe { checked(p, t, raw_pos, report.0) }?;
    match p.cache.slot(|| p.seq_div.div(t), pos, raw_slot) {
        SlotOf::Slot(n) => Some((pos, n)),
        SlotOf::Skip => None,
        SlotOf::OutOfRange(raw) => {
            if report.1 {
                // SAFETY: the caller's contract.
                unsafe { p.errors.slot(t, raw) };
            }
            None
        }
    }
}

/// Token `t`'s raw position and raw slot entry, the slot's load issued first.
///
/// # Safety
/// `t < p.tokens`; the host checked the positions' and slot mapping's lengths.
#[inline(always)]
unsafe fn load_token<P: PairRows>(p: &KvParams, t: u32) -> (i64, i64) {
    let (b, s) = p.seq_div.divmod(t);
    // SAFETY: the caller's contract.
    unsafe { (p.cache.raw_slot(t), P::load(&p.positions, t, b, s)) }
}

/// What the block-wide scan of the scanning kernels leaves in shared memory (see
/// [`KvParams::shared`]): each token's raw position and target slot (`u64::MAX` for
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
    crate::params::block_tokens(block_idx(), block_dim().0, p.items_div, p.chunk, p.tokens)
}

/// A token's (raw slot, raw position), if the token exists.
type Loaded = Option<(i64, i64)>;

/// The scan's loads for this thread's first two tokens (`thread`, `thread + block_dim`),
/// issued before anything waits on them: (raw slot, raw position) of each.
///
/// # Safety
/// As [`load_token`].
#[inline(always)]
unsafe fn scan_loads<P: PairRows>(p: &KvParams) -> (Loaded, Loaded) {
    let (tid, bd) = (thread_idx().0, block_dim().0);
    // SAFETY: only tokens below `p.tokens` are loaded.
    let load = |j: u32| (j < p.tokens).then(|| unsafe { load_token::<P>(p, j) });
    (load(tid), load(tid + bd))
}

/// The scan of the scanning kernels, which every thread of the block runs: the block loads
/// every token's position and slot once (`loaded`: this thread's first two, from
/// [`scan_loads`]), then its threads compare the later tokens' slots with the block's own
/// tokens' in parallel (a later token wins a repeated slot).
///
/// # Safety
/// Every thread of the block calls it (it holds barriers), with at least
/// [`KvParams::shared`] of dynamic shared memory; as [`load_token`].
#[inline(always)]
unsafe fn block_scan<P: PairRows, T>(
    p: &KvParams,
    loaded: (Loaded, Loaded),
    between: impl FnOnce() -> T,
) -> (Shared, T) {
    let base = core::intrinsics::gpu::gpu_launch_sized_workgroup_mem::<u64>();
    let tokens = p.tokens as usize;
    // SAFETY: the dynamic shared memory holds `2 * tokens` u64 and the flags after them.
    let s = unsafe {
        Shared {
            positions: base as *mut i64,
            targets: base.add(tokens),
            superseded: base.add(2 * tokens) as *mut u32,
            first: 0,
        }
    };
    let (first, count) = block_tokens(p);
    let (tid, bd) = (thread_idx().0, block_dim().0);
    let store = |j: u32, (raw_slot, raw_pos): (i64, i64)| {
        // No reports here: the scan sees every token in every block.
        // SAFETY: nothing is recorded without `report`.
        let n = unsafe { settle(p, j, raw_pos, raw_slot, (false, false)) }.map(|(_, n)| n);
        // SAFETY: `j < tokens`: inside the shared arrays.
        unsafe {
            *s.positions.add(j as usize) = raw_pos;
            *s.targets.add(j as usize) = n.unwrap_or(u64::MAX);
        }
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
        // SAFETY: `j < tokens`.
        store(j, unsafe { load_token::<P>(p, j) });
        j += bd;
    }
    if tid < count {
        // SAFETY: `tid < count <= block_dim`: a flag of the block's.
        unsafe { *s.superseded.add(tid as usize) = 0 };
    }
    // SAFETY: the caller's contract: every thread of the block is here.
    unsafe { sync_threads() };
    let between = between();
    let mut j = first + 1 + tid;
    while j < p.tokens {
        // SAFETY: `j < tokens`, and `k < count`: inside the shared arrays.
        unsafe {
            let n = *s.targets.add(j as usize);
            if n != u64::MAX {
                for k in 0..count.min(j - first) {
                    if *s.targets.add((first + k) as usize) == n {
                        s.superseded.add(k as usize).write_volatile(1);
                    }
                }
            }
        }
        j += bd;
    }
    // SAFETY: as above.
    unsafe { sync_threads() };
    (Shared { first, ..s }, between)
}

/// Where token `t` goes: its position and slot, unless it is skipped (out of range, padding,
/// or, for keys and values, a later token writes the same slot). Reports go to the records
/// as `report` says (positions, slots).
///
/// # Safety
/// `s` came from [`block_scan`] of this launch and `t` is one of the block's tokens.
#[inline(always)]
unsafe fn shared_target(p: &KvParams, s: &Shared, t: u32, kv: bool, report: (bool, bool)) -> Option<(u32, u64)> {
    // SAFETY: the caller's contract: `t` is inside the shared arrays; `errors` points at
    // this launch's records.
    let raw_pos = unsafe { *s.positions.add(t as usize) };
    // SAFETY: as above.
    let pos = unsafe { checked(p, t, raw_pos, report.0) }?;
    if !kv {
        return Some((pos, 0));
    }
    // SAFETY: as above.
    let n = unsafe { *s.targets.add(t as usize) };
    if n == u64::MAX {
        if report.1 {
            // Padding or out of range: only the latter is reported.
            // SAFETY: `t < tokens`; `errors` as above.
            unsafe { settle(p, t, raw_pos, p.cache.raw_slot(t), (false, true)) };
        }
        return None;
    }
    // SAFETY: `t` is one of the block's tokens: its flag exists.
    if unsafe { *s.superseded.add((t - s.first) as usize) } != 0 {
        return None;
    }
    Some((pos, n))
}

/// Fused RoPE + KV append for one lane of one head group of one token; `R` loads the rotating
/// lanes of q, k and v's type and `W` stores them in the caches' type (q: in place, by `R`),
/// `C` and `D` likewise for the copying lanes, `B` reads the tables, `P` picks each pair's table row (one
/// position, or MRoPE's three streams), `G` heads per thread. With `SCAN` and
/// [`Duplicates::Scan`], the block settles duplicates itself ([`block_scan`]); otherwise the
/// owner array does (the host claims for the kernels without `SCAN`).
///
/// # Safety
/// The host checked every view and both caches against their buffers, the positions' and
/// slot mapping's lengths and the owner array's, that nothing written overlaps anything else
/// the launch touches, that the positions view admits only rows of the table, alignment for
/// `R` and `C`, that the geometry was made with this `G`, that there is work, and, for the
/// scan, at least [`KvParams::shared`] of dynamic shared memory.
#[inline(always)]
pub(crate) unsafe fn kv_append<
    S: Style,
    R: Io,
    W: Io,
    C: Io,
    D: Io,
    B: Source,
    P: PairRows,
    const G: usize,
    const SCAN: bool,
    const NORM: bool,
    const WHOLE: bool,
>(
    p: &KvParams,
) {
    const { assert!(R::SIZE == C::SIZE && W::SIZE == D::SIZE) };
    // The q groups, then the k and v groups from `starts`, each on slots inside one warp
    // (`kv_segments`, computed by the host).
    let [k_start, v_start] = p.starts;
    let items = p.items_div.divisor;
    // SAFETY: the host never launches without work or with `seq == 0` or zero lanes.
    unsafe {
        core::hint::assert_unchecked(items != 0);
        core::hint::assert_unchecked(p.seq != 0);
        core::hint::assert_unchecked(p.rot_lanes != 0);
        core::hint::assert_unchecked(p.k_lanes != 0);
        core::hint::assert_unchecked(p.v_lanes != 0);
        core::hint::assert_unchecked(p.cache.block_size() != 0);
        core::hint::assert_unchecked(p.chunk != 0);
    }
    let item = work_item(block_idx(), block_dim().0, thread_idx().0, p.items_div, p.chunk, p.tokens);
    let shared = SCAN && p.owners.mode() == Duplicates::Scan;
    // Decode the item and load the data it reads: neither depends on the position or slot.
    let (t, w) = item.unwrap_or((0, 0));
    let (b, s) = p.seq_div.divmod(t);
    let (b, s) = (b as u64, s as u64);
    let half = p.pairs.half() as usize;
    let (is_q, is_k) = (w < k_start, w >= k_start && w < v_start);
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
    // q into an FP8 buffer takes the copying lanes of the dims past rotary_dim too, as k; and
    // so does q normalized in place.
    let q_fp8 = W::FP8 && p.q.output != 0;
    let (heads, lanes, slots, w) = if is_q {
        (p.q.heads, if q_fp8 || NORM { p.k_lanes } else { p.rot_lanes }, p.lanes_div[0], w)
    } else if is_k {
        (p.k.heads, p.k_lanes, p.lanes_div[1], w - k_start)
    } else {
        (p.v.heads, p.v_lanes, p.lanes_div[2], w - v_start)
    };
    let (group, lane) = slots.divmod(w);
    let h0 = (group * G as u32) as u64;
    // Idle: a slot past its group's lanes, or between the segments (past the last group).
    let item = item.filter(|_| lane < lanes && h0 < heads as u64);
    let lane = lane as usize;
    let count = (heads.saturating_sub(h0 as u32)).min(G as u32) as usize;
    let offset = b * strides[0] + s * strides[1] + h0 * strides[2];
    let src = (input as *const u8).wrapping_add(offset as usize * R::SIZE);
    let src_step = strides[2] as usize * R::SIZE;
    // q's lanes all rotate unless q takes copying lanes (into FP8, or normalized in place):
    // written so, ptxas keeps the computed `_v_c` in 72 registers, not 99 (with the weights'
    // load below taken only with a norm; either alone leaves 99).
    let rotating = match q_fp8 || NORM {
        true => (is_q || is_k) && lane < p.rot_lanes as usize,
        false => is_q || (is_k && lane < p.rot_lanes as usize),
    };
    // FP8 stores: the format (one for both caches, checked by the host), and this item's first
    // scale, loaded now, off the stores' path.
    let fmt = if W::FP8 { p.cache.types().0.fp8().unwrap_or(Fp8::E4M3) } else { Fp8::E4M3 };
    let quant = match item {
        Some(_) if W::FP8 && (!is_q || q_fp8) => {
            let (at, step) = if is_q { (p.scales.q(), 0) } else { p.scales.head(!is_k, h0) };
            // SAFETY: the host checked the scale buffers: one f32 (q's, or one for all kv
            // heads) or one per kv head, and `h0` is a head of the launch.
            unsafe { Quant::new::<W>(fmt, at as *const f32, step as usize) }
        }
        _ => Quant::NONE,
    };
    let rows = Rows { src, dst: core::ptr::null_mut(), src_step, dst_step: 0, count };
    let load_first = || {
        if item.is_some() && rotating {
            // SAFETY: the host checked the views against their buffers: a rotating lane's
            // elements lie in the row.
            unsafe { S::load::<R>(&rows, 0, lane, half) }
        } else {
            [[0; 4]; 2]
        }
    };
    // A copying lane's first head is loaded now too: its store then waits on the position,
    // slot and owner only, not on a load issued after them.
    let copy_at = match (rotating, is_q || is_k) {
        (true, _) => 0,
        (false, true) => (2 * half + (lane - p.rot_lanes as usize) * C::E) * C::SIZE,
        (false, false) => lane * C::E * C::SIZE,
    };
    // SAFETY: a copying lane's elements lie in the row (past the rotary dims for q and k).
    let load_copy = || if item.is_some() && !rotating { unsafe { C::load_raw(rows.src(0, copy_at)) } } else { [0; 4] };
    // The kernels that fill block rows without scanning load after the rows
    // (`KV_LOADS_AFTER_FILL`).
    // (Not with a norm: its statistic needs the loads before anything returns.)
    let late = KV_LOADS_AFTER_FILL && B::Prologue::BARRIERS && !shared && !NORM;
    let (first, first_copy) = if late { ([[0; 4]; 2], [0; 4]) } else { (load_first(), load_copy()) };
    // The later heads' rows asked of L2 now: their loads, one head ahead inside the stores'
    // loop, come after the position's, slot's and owner's round trips (`KV_PREFETCH_HEADS`).
    // (Not in the one-head kernels, nor with a norm: ptxas then gave `kv_neox_bf16_p_n` 69
    // registers, not 64, and `_v_n` 102, not 96. Written out here: through a helper function,
    // it gave the computed `_v_c` 104 registers, not 72.)
    if KV_PREFETCH_HEADS && G > 1 && !NORM && item.is_some() {
        crate::gpu::unrolled(G, |h| {
            if h >= 1 && h < count {
                // SAFETY: as the loads above, for head `h` of the item's rows.
                unsafe {
                    if rotating {
                        S::prefetch::<R>(&rows, h, lane, half)
                    } else {
                        prefetch_l2(rows.src(h, copy_at))
                    }
                }
            }
        });
    }
    // The norm of q's and k's heads: the lane's weights now, with its inputs; the statistic
    // once the position's and slot's loads are issued or the scan has settled them (every
    // thread of the block stays until then: the `_n` kernels' heads lie inside one warp, whose
    // every lane takes part).
    // (The `_n` kernels normalize q and k; the `_w` kernels the projections the view names.)
    let which = if is_q {
        0
    } else if is_k {
        1
    } else {
        2
    };
    let normed = NORM
        && item.is_some()
        && match WHOLE {
            true => p.norm.projections >> which & 1 != 0,
            false => is_q || is_k,
        };
    let norm_at = LaneAt { rotating, lane, half, copy_at, head: h0 as usize };
    // The lane's weights, loaded only with a norm (ptxas gave the computed `_v_c` 99 registers
    // with the call whose result went unused, 72 without it).
    let norm_bits = match NORM {
        // SAFETY: the host checked the weights' buffers (`head_dim` elements of their type for
        // each head of a whole projection, 16-byte aligned where `vector`); `lane` is a lane of
        // the launch's geometry.
        true => unsafe { NormLane::load::<S, R, C, WHOLE>(&p.norm, which, normed, norm_at) },
        false => [[0; 4]; 2],
    };
    // A whole-projection norm's head sums: this thread's, and its projection's first group
    // (`w` is the item's index in its segment).
    let whole = move || Whole {
        parts: core::intrinsics::gpu::gpu_launch_sized_workgroup_mem::<u8>()
            .wrapping_add(p.shared(block_dim().0, shared, p.source.computed()).bytes as usize)
            as *mut f32,
        thread: thread_idx().0,
        first: thread_idx().0.wrapping_sub(w),
        groups: heads,
        lanes,
    };
    // SAFETY: every thread of the block calls it at once (one of two call sites runs).
    let norm_of = move || unsafe {
        let data = (&rows, &first, &first_copy);
        NormLane::of::<S, R, C, G, WHOLE>(&p.norm, which, normed, norm_at, data, norm_bits, slots.divisor, whole)
    };
    // Reports: the first q item reports positions (the first k item without q); the first k
    // item reports slots.
    let report = (w == 0 && (is_q || (k_start == 0 && is_k)), w == 0 && is_k);
    let mut entries = Entries::<P>::none();
    // The block's prologue (computed source: the block's cos and sin in shared memory, after
    // the scan's arrays when it scans, then the staged angle table: [`KvParams::shared`]).
    let inputs = BlockInputs {
        can_stage: SCAN,
        tokens: block_tokens(p),
        source: &p.source,
        pairs: &p.pairs,
        positions: &p.positions,
        divmod: |t| p.seq_div.divmod(t),
        base: core::intrinsics::gpu::gpu_launch_sized_workgroup_mem::<u8>(),
        layout: |view: &ComputedView| p.shared(block_dim().0, shared, Some(view)),
    };
    let (block_rows, target, norm) = if shared {
        // The scan's loads first; then the prologue between the scan's barriers (or, from the
        // caller's tables, the rotating items' entries before the scan).
        // SAFETY: the host checked the positions' and slot mapping's lengths.
        let loaded = unsafe { scan_loads::<P>(p) };
        if !B::Prologue::BARRIERS && item.is_some() && rotating {
            // SAFETY: `t` is a token of the launch.
            let own = unsafe { P::load(&p.positions, t, b as u32, s as u32) };
            if let Some(pos) = p.positions.check(own) {
                // SAFETY: the positions view admits only rows of the table; `pos` passed its
                // check.
                entries = unsafe { S::entries::<R, B, P>(lane, P::of(&p.positions, t, pos), table(p, 0)) };
            }
        }
        // SAFETY: the host gives the scanning kernels `KvParams::shared` of shared memory,
        // the positions buffer holds every token's entry, and the frequencies `half` pairs;
        // every thread of the block reaches the prologue and the scan (none has returned); the
        // prologue's first stores go before the scan's first barrier, its rows are read after
        // the second.
        let (scan, rows) = unsafe {
            let start = B::Prologue::start::<P, _, _>(&inputs);
            block_scan::<P, _>(p, loaded, || B::Prologue::fill::<P, _, _>(&inputs, start, false))
        };
        // Every thread of the block is here.
        let norm = if NORM { norm_of() } else { NormLane::OFF };
        if item.is_none() {
            return;
        }
        // SAFETY: `t` is one of the block's tokens.
        (rows, unsafe { shared_target(p, &scan, t, !is_q, report) }, norm)
    } else {
        // SAFETY: as above, with the shared memory the host gives the kernels that do not
        // scan; the prologue holds its own barriers.
        let rows = unsafe {
            let start = B::Prologue::start::<P, _, _>(&inputs);
            B::Prologue::fill::<P, _, _>(&inputs, start, true)
        };
        if !NORM && item.is_none() {
            return;
        }
        // The position's and slot's loads, then the norm's statistic while they are in flight
        // (every thread of the block is here), then their checks.
        // SAFETY: `t` is a token of the launch.
        let raw = item.map(|_| unsafe {
            let raw_slot = if is_q { 0 } else { p.cache.raw_slot(t) };
            (raw_slot, P::load(&p.positions, t, b as u32, s as u32))
        });
        let norm = if NORM { norm_of() } else { NormLane::OFF };
        let Some((raw_slot, raw_pos)) = raw else { return };
        // SAFETY: `errors` points at this launch's records.
        let target = unsafe {
            match is_q {
                true => checked(p, t, raw_pos, report.0).map(|pos| (pos, 0)),
                false => settle(p, t, raw_pos, raw_slot, report),
            }
        };
        (rows, target, norm)
    };
    let Some((pos, n)) = target else { return };
    let (first, first_copy) = if late { (load_first(), load_copy()) } else { (first, first_copy) };
    // SAFETY: as computed above.
    unsafe { core::hint::assert_unchecked(count >= 1 && count <= G) };
    let row = B::Prologue::row(block_rows, t);
    if rotating && (B::Prologue::BARRIERS || !shared) {
        // Without the scan the caller's table loads overlap the owner check.
        // SAFETY: the positions view admits only rows of the table; `pos` passed its check;
        // the block's rows were filled before a barrier.
        entries = unsafe { S::entries::<R, B, P>(lane, P::of(&p.positions, t, pos), table(p, row)) };
    }
    if is_q && !q_fp8 {
        // q, in place (with a norm, its dims past rotary_dim too).
        let rows = Rows { src, dst: src as *mut u8, src_step, dst_step: src_step, count };
        // SAFETY: q's rows are in its buffer, written by this item alone.
        unsafe {
            match rotating {
                true => S::apply::<R, R, B, P>(
                    rows,
                    first,
                    lane,
                    &entries,
                    table(p, row),
                    Quant::NONE,
                    NORM.then_some(&norm),
                ),
                false => rows.copy::<C, C>(first_copy, copy_at, Quant::NONE, NORM.then_some(&norm)),
            }
        };
        return;
    }
    // SAFETY: the host claimed for this call in an owner array of `num_slots` entries.
    if !is_q && !shared && !unsafe { p.owners.owns(n, t) } {
        return;
    }
    // Where the stores of `W` and `D` go: q's FP8 buffer (its dims past rotary_dim copied, as
    // k's), or slot `n` of a cache. One call site for each kind of store, whichever the rows.
    let (dst, dst_step) = if is_q {
        ((p.q.output as *mut u8).wrapping_add(p.q.out_offset(b, s, h0) as usize * W::SIZE), p.q.out_strides[2])
    } else {
        let cache = if is_k { p.cache.k() } else { p.cache.v() };
        ((cache as *mut u8).wrapping_add(p.cache.row(n, h0) as usize * W::SIZE), p.cache.head_stride())
    };
    let rows = Rows { src, dst, src_step, dst_step: dst_step as usize * W::SIZE, count };
    if rotating {
        // SAFETY: q's output rows are in their buffer, or slot `n` is in the cache; this item
        // alone writes them (this token alone writes slot `n`); the host checked the scale
        // buffers of FP8 outputs (one f32, or one per kv head).
        unsafe { S::apply::<R, W, B, P>(rows, first, lane, &entries, table(p, row), quant, NORM.then_some(&norm)) };
    } else {
        // k and q past rotary_dim, and v: copy (the bits, where the types agree; FP8: divided by
        // the scale and converted).
        // SAFETY: as above.
        unsafe { rows.copy::<C, D>(first_copy, copy_at, quant, NORM.then_some(&norm)) };
    }
}

/// Records, for each slot, the last token of this call that writes it (`kv_claim`).
///
/// # Safety
/// Launched by the host with one thread per token and an owner array of `num_slots` u64
/// tagged for this call.
#[inline(always)]
pub(crate) unsafe fn claim(p: &KvParams) {
    // SAFETY: the host never launches with `seq == 0`.
    unsafe { core::hint::assert_unchecked(p.seq != 0) };
    let t = block_idx().0 * block_dim().0 + thread_idx().0;
    if t >= p.tokens {
        return;
    }
    // SAFETY: `t < tokens`; nothing is recorded without `report`.
    // One claim kernel serves both kinds of positions: the general load.
    let target = unsafe {
        let (b, s) = p.seq_div.divmod(t);
        let (raw_slot, raw_pos) = (p.cache.raw_slot(t), p.positions.load(t, b, s));
        settle(p, t, raw_pos, raw_slot, (false, false))
    };
    if let Some((_, n)) = target {
        // SAFETY: `n < num_slots`, the owner array's length.
        unsafe { p.owners.claim(n, t) };
    }
}

/// Reads one element of an FP8 cache row back (`kv_read_*`, see [`ReadParams`]): the code's
/// value times its head's scale, rounded to `T`.
///
/// # Safety
/// The host checked the caches and outputs against their buffers, the slots' length, that
/// the outputs overlap nothing the launch reads, and the scales' lengths.
#[inline(always)]
pub(crate) unsafe fn read<T: Elem>(p: &ReadParams) {
    // SAFETY: the host never launches with zero items, heads or dims, or `seq == 0`.
    unsafe {
        core::hint::assert_unchecked(p.items_div.divisor != 0);
        core::hint::assert_unchecked(p.cache_div.divisor != 0);
        core::hint::assert_unchecked(p.dim_div.divisor != 0);
        core::hint::assert_unchecked(p.seq_div.divisor != 0);
        core::hint::assert_unchecked(p.cache.block_size() != 0);
    }
    let Some((r, w)) = work_item(block_idx(), block_dim().0, thread_idx().0, p.items_div, p.chunk, p.rows) else {
        return;
    };
    let (which, rest) = p.cache_div.divmod(w);
    let (h, e) = p.dim_div.divmod(rest);
    // SAFETY: the slots hold an entry per row.
    let raw = unsafe { p.cache.raw_slot(r) };
    let n = match p.cache.slot(|| 0, 0, raw) {
        SlotOf::Slot(n) => n,
        SlotOf::Skip => return,
        SlotOf::OutOfRange(raw) => {
            // The row's first item reports, whichever outputs are read.
            if w == 0 {
                // SAFETY: `errors` points at this launch's records.
                unsafe { p.errors.slot(r, raw) };
            }
            return;
        }
    };
    let out = if which == 0 { &p.k } else { &p.v };
    if out.output == 0 {
        return;
    }
    let cache = if which == 0 { p.cache.k() } else { p.cache.v() };
    let (scale, _) = p.scales.head(which == 1, h as u64);
    let fmt = p.cache.types().0.fp8().unwrap_or(Fp8::E4M3);
    // SAFETY: slot `n` and head `h` are in the cache, element `e` in the row; the scale is in
    // its buffer (one, or one per head: `head` gives 0 steps for one).
    let (code, scale) = unsafe {
        (
            load_u8_nc((cache as *const u8).wrapping_add((p.cache.row(n, h as u64) + e as u64) as usize)),
            load_table(scale as *const f32, 1)[0],
        )
    };
    let v = fmt.to_f32(code) * scale;
    let (b, s) = p.seq_div.divmod(r);
    let at = out.out_offset(b as u64, s as u64, h as u64) + e as u64;
    let (mut bits, mut pending) = ([0u32; 4], 0.0);
    One::<T>::put(&mut bits, &mut pending, 0, v, fmt);
    // SAFETY: the element is in the output's buffer, written by this thread alone.
    unsafe { One::<T>::store_raw((out.output as *mut u8).wrapping_add(at as usize * T::SIZE), bits) };
}
