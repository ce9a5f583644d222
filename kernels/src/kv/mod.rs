//! The bodies of the KV-cache entry points: RoPE on the new keys (and optionally the
//! queries) and the append of keys and values into a contiguous or paged cache, in one
//! launch (see [`KvParams`]); the claims of the calls too large to scan and the FP8 read
//! ([`read`]).
//!
//! The append is a pipeline of stages, each in its module: [`kv_append`] decodes the item
//! into a [`Lane`] and issues its first loads; [`norm`] loads the norm's weights (the stage
//! `N`, nothing for `NoNorm`); [`target`] runs the block's prologue and finds the token's
//! position and slot (through the block's [`scan`], or loaded while the norm's statistic is
//! computed); [`store`] writes the rows (in the caches' type `W` and `D`: the plain store or
//! FP8's quantizing one). Each stage ends by calling the next, and each is
//! `#[rustc_force_inline]`: inlined in the body's MIR, a callee's blocks go after its
//! caller's, so a stage called last keeps the code's order, where one called in the middle of
//! the body moved its blocks past the end and changed the code LLVM made of the whole
//! (`kv_neox_bf16_p_n` 69 registers, not 64; the `#[inline(always)]` functions of this size
//! are inlined only by LLVM, after it has optimized each alone, which changed it more).

mod lane;
mod norm;
mod read;
mod scan;
mod store;
mod target;

use lane::Lane;
pub(crate) use read::{claim, read};

use crate::gpu::{block_dim, block_idx, thread_idx, Io};
use crate::norm_lane::NormStage;
use crate::params::{work_item, KvParams};
use crate::rotate::{PairRows, Prologue, Source, Style, Table};
use crate::tuning::{KV_LOADS_AFTER_FILL, KV_PREFETCH_HEADS};
use crate::views::{Duplicates, HeadsView, SlotOf};

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

/// Tells the compiler what the host guarantees of every launch.
///
/// # Safety
/// The host never launches without work or with `seq == 0` or zero lanes.
#[inline(always)]
unsafe fn assume_launch(p: &KvParams) {
    // SAFETY: the caller's contract.
    unsafe {
        core::hint::assert_unchecked(p.items_div.divisor != 0);
        core::hint::assert_unchecked(p.seq != 0);
        core::hint::assert_unchecked(p.rot_lanes != 0);
        core::hint::assert_unchecked(p.k_lanes != 0);
        core::hint::assert_unchecked(p.v_lanes != 0);
        core::hint::assert_unchecked(p.cache.block_size() != 0);
        core::hint::assert_unchecked(p.chunk != 0);
    }
}

/// Fused RoPE + KV append for one lane of one head group of one token, its first stage (see
/// the module's note): the item decoded into a [`Lane`], its first FP8 scale, its first head's
/// data and the later heads' prefetches; then [`norm::stage`]. `R` loads the rotating
/// lanes of q, k and v's type and `W` stores them in the caches' type (q: in place, by `R`),
/// `C` and `D` likewise for the copying lanes, `B` reads the tables, `P` picks each pair's
/// table row (one position, or MRoPE's three streams), `N` is the norm, `G` heads per thread.
/// With `SCAN` and [`Duplicates::Scan`], the block settles duplicates itself
/// ([`scan::block_scan`]); otherwise the owner array does (the host claims for the kernels
/// without `SCAN`).
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
    N: NormStage,
    const G: usize,
    const SCAN: bool,
>(
    p: &KvParams,
) {
    const { assert!(R::SIZE == C::SIZE && W::SIZE == D::SIZE) };
    // SAFETY: the caller's contract.
    unsafe { assume_launch(p) };
    let item = work_item(block_idx(), block_dim().0, thread_idx().0, p.items_div, p.chunk, p.tokens);
    let shared = SCAN && p.owners.mode() == Duplicates::Scan;
    // Decode the item and load the data it reads: neither depends on the position or slot.
    let [k_start, v_start] = p.starts;
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
    let q_fp8 = W::FP8 && p.q.output != 0;
    let (heads, lanes, slots, w) = if is_q {
        (p.q.heads, if q_fp8 || N::ON { p.k_lanes } else { p.rot_lanes }, p.lanes_div[0], w)
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
    // q's lanes all rotate unless q takes copying lanes (into FP8, or normalized in
    // place): written so, ptxas keeps the computed `_v_c` in 72 registers, not 99 (with
    // the weights' load taken only with a norm; either alone leaves 99).
    let rotating = match q_fp8 || N::ON {
        true => (is_q || is_k) && lane < p.rot_lanes as usize,
        false => is_q || (is_k && lane < p.rot_lanes as usize),
    };
    let copy_at = match (rotating, is_q || is_k) {
        (true, _) => 0,
        (false, true) => (2 * half + (lane - p.rot_lanes as usize) * C::E) * C::SIZE,
        (false, false) => lane * C::E * C::SIZE,
    };
    let slots = slots.divisor;
    let l = Lane {
        item,
        t,
        b,
        s,
        w,
        is_q,
        is_k,
        q_fp8,
        heads,
        lanes,
        slots,
        lane,
        h0,
        count,
        half,
        src,
        src_step,
        rotating,
        copy_at,
    };
    let (quant, rows) = (l.quant::<W>(p), l.rows());
    // The kernels that fill block rows without scanning load after the rows
    // (`KV_LOADS_AFTER_FILL`). (Not with a norm: its statistic needs the loads before
    // anything returns.)
    let late = KV_LOADS_AFTER_FILL && B::Prologue::BARRIERS && !shared && !N::ON;
    // SAFETY: the host checked the views against their buffers.
    let (first, first_copy) = if late { ([[0; 4]; 2], [0; 4]) } else { unsafe { l.load::<S, R, C>(&rows) } };
    // The later heads' rows asked of L2 now. (Not in the one-head kernels, nor with a norm:
    // ptxas then gave `kv_neox_bf16_p_n` 69 registers, not 64, and `_v_n` 102, not 96.)
    if KV_PREFETCH_HEADS && G > 1 && !N::ON && l.item.is_some() {
        // SAFETY: as above, for each of the group's heads.
        crate::gpu::unrolled(G, |h| {
            if h >= 1 && h < count {
                // SAFETY: as above, for head `h` of the item's rows.
                unsafe {
                    if rotating {
                        S::prefetch::<R>(&rows, h, lane, half)
                    } else {
                        crate::gpu::prefetch_l2(rows.src(h, copy_at))
                    }
                }
            }
        });
    }
    // SAFETY: the caller's contract.
    unsafe { norm::stage::<S, R, W, C, D, B, P, N, G, SCAN>(p, l, (shared, late), rows, (first, first_copy), quant) };
}
