//! The KV append's norm stage: the lane's weights loaded with its inputs, and the statistic
//! (as a closure the target stage calls where every thread of the block is: after the scan,
//! or while the position's and slot's loads are in flight); then the block prologue's inputs
//! and the lane's reports, for the target stage it ends in.

use super::{lane::Lane, scan::block_tokens, target};
use crate::gpu::{block_dim, thread_idx, Bits, Io};
use crate::norm_lane::{NormStage, Whole};
use crate::params::KvParams;
use crate::rotate::{BlockInputs, Entries, PairRows, Quant, Rows, Source, Style};
use crate::views::ComputedView;

/// The norm stage of [`super::kv_append`] (`N`'s hooks, compiled away for [`crate::norm_lane::NoNorm`]),
/// for the lane `l` whose first head's data (`first`, `first_copy`) and rows were loaded;
/// ends in [`target::stage`].
///
/// # Safety
/// As [`super::kv_append`]'s; every thread of the block calls it.
#[rustc_force_inline]
pub(super) unsafe fn stage<
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
    l: Lane,
    (shared, late): (bool, bool),
    rows: Rows,
    (first, first_copy): ([Bits; 2], Bits),
    quant: Quant,
) {
    // The norm of q's and k's heads (`_n` kernels), or of the projections the view names
    // (`_w`): the lane's weights now, with its inputs; the statistic once the position's and
    // slot's loads are issued or the scan has settled them (every thread of the block stays
    // until then: the `_n` kernels' heads lie inside one warp, whose every lane takes part).
    let which = if l.is_q {
        0
    } else if l.is_k {
        1
    } else {
        2
    };
    let normed = N::ON
        && l.item.is_some()
        && match N::WHOLE {
            true => p.norm.projections >> which & 1 != 0,
            false => l.is_q || l.is_k,
        };
    // The lane's weights, loaded only with a norm (ptxas gave the computed `_v_c` 99 registers
    // with the call whose result went unused, 72 without it).
    let norm_bits = match N::ON {
        // SAFETY: the host checked the weights' buffers (`head_dim` elements of their type for
        // each head of a whole projection, 16-byte aligned where `vector`); `lane` is a lane of
        // the launch's geometry.
        true => unsafe { N::load::<S, R, C>(&p.norm, which, normed, l.at()) },
        false => [[0; 4]; 2],
    };
    // A whole-projection norm's head sums: this thread's, and its projection's first group.
    let whole = move || Whole {
        parts: core::intrinsics::gpu::gpu_launch_sized_workgroup_mem::<u8>()
            .wrapping_add(p.shared(block_dim().0, shared, p.source.computed()).bytes as usize)
            as *mut f32,
        thread: thread_idx().0,
        first: thread_idx().0.wrapping_sub(l.w),
        groups: l.heads.div_ceil(G as u32),
        lanes: l.lanes,
    };
    // SAFETY: every thread of the block calls it at once (one of two call sites runs).
    let norm_of = move || unsafe {
        let data = (&rows, &first, &first_copy);
        N::of::<S, R, C, G>(&p.norm, which, normed, l.at(), data, norm_bits, l.slots, whole)
    };
    // Reports: the first q item reports positions (the first k item without q); the first k
    // item reports slots.
    let report = (l.w == 0 && (l.is_q || (p.starts[0] == 0 && l.is_k)), l.w == 0 && l.is_k);
    let entries = Entries::<P>::none();
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
    // SAFETY: the caller's contract; every thread of the block is here.
    unsafe {
        target::stage::<S, R, W, C, D, B, P, N, G, _, _>(
            p,
            l,
            (shared, late, report),
            &inputs,
            entries,
            norm_of,
            rows,
            (first, first_copy),
            quant,
        )
    };
}
