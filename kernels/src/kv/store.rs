//! The store stage of the KV append: a lane's rotated or copied elements written where they
//! go: q in place or into its FP8 buffer, k and v into their slot of the caches, in the
//! caches' type (`W` and `D`: the plain store, or the quantizing one of FP8 caches).

use super::{lane::Lane, table};
use crate::gpu::{Bits, Io};
use crate::norm::NormLane;
use crate::norm_lane::NormStage;
use crate::params::KvParams;
use crate::rotate::{Entries, PairRows, Quant, Rows, Source, Style};

/// Stores the lane's elements of its group's heads: `first` (a rotating lane's first head)
/// or `first_copy` (a copying lane's), the later heads loaded on the way; q in place, or into
/// its FP8 buffer; k and v into slot `n` of their cache, unless the owner array gives the
/// slot to a later token (kernels that do not settle duplicates in the block: `shared`
/// false). Rotated with `entries` (the table's `row`), normalized as `norm` says, FP8 stores
/// divided by `quant`'s scales.
///
/// # Safety
/// As [`super::kv_append`]'s, with `l` decoded from the thread's item; `n` is the token's
/// slot in the caches (k and v), `entries` the rotating lane's.
#[rustc_force_inline]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn stage<S: Style, R: Io, W: Io, C: Io, D: Io, B: Source, P: PairRows, N: NormStage>(
    p: &KvParams,
    l: Lane,
    (n, shared): (u64, bool),
    (first, first_copy): ([Bits; 2], Bits),
    entries: &Entries<P>,
    row: u32,
    quant: Quant,
    norm: &NormLane,
) {
    let Lane { t, b, s, h0, is_q, is_k, q_fp8, rotating, lane, copy_at, src, src_step, count, .. } = l;
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
                    entries,
                    table(p, row),
                    Quant::NONE,
                    N::ON.then_some(norm),
                ),
                false => rows.copy::<C, C>(first_copy, copy_at, Quant::NONE, N::ON.then_some(norm)),
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
        unsafe { S::apply::<R, W, B, P>(rows, first, lane, entries, table(p, row), quant, N::ON.then_some(norm)) };
    } else {
        // k and q past rotary_dim, and v: copy (the bits, where the types agree; FP8: divided by
        // the scale and converted).
        // SAFETY: as above.
        unsafe { rows.copy::<C, D>(first_copy, copy_at, quant, N::ON.then_some(norm)) };
    }
}
