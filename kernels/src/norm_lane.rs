//! The norm's stage in the bodies (device code), a type parameter of theirs ([`NormStage`]:
//! [`NoNorm`], [`HeadNorm`], [`WholeNorm`]): a lane's weights loaded with its inputs
//! ([`NormLane::load`]), its head's statistic once the position's and slot's loads are on
//! their way ([`NormLane::of`]), through the warp's shuffles or, for a whole projection, the
//! block's shared memory ([`Whole`]).

use crate::gpu::{unrolled, Bits, Io};
use crate::keys::DType;
use crate::norm::{group_sum, inv_rms, NormLane, NormView, NORM_HEADS};
use crate::rotate::{Rows, Style};

/// Where a lane's elements lie in its head: rotating (with the style's pairs), or copying the
/// elements at byte `copy_at` of the row.
#[derive(Clone, Copy)]
pub(crate) struct LaneAt {
    pub rotating: bool,
    pub lane: usize,
    pub half: usize,
    pub copy_at: usize,
    /// The first head of the lane's group (the weights' head for a whole-projection norm).
    pub head: usize,
}

/// Where a lane of a whole-projection norm finds its projection's head sums: `parts`, one f32
/// per thread of the block in its dynamic shared memory; the thread's index in the block;
/// the block index of its projection's first lane, the projection's groups (of `G` heads),
/// `slots` apart, and each group's `lanes` (past 32, its warps each put a sum: a head of
/// MLA's `kv_c`).
#[derive(Clone, Copy)]
pub(crate) struct Whole {
    pub parts: *mut f32,
    pub thread: u32,
    pub first: u32,
    pub groups: u32,
    pub lanes: u32,
}

/// The norm stage of the RoPE and KV bodies: what the body asks of it, whichever the norm.
/// [`NoNorm`]'s hooks are constants and compile away (the plain kernels hold nothing of a
/// norm); [`HeadNorm`] is QK-norm (each head its own statistic, the `_n` kernels),
/// [`WholeNorm`] a whole projection's (the one-head `_w` kernels). The bodies call the hooks
/// under `if N::ON`: an unconditional call, even of [`NoNorm`]'s constant, changed the code
/// LLVM made of the plain kernels (the trait's methods are inlined later than the bodies'
/// own calls).
pub(crate) trait NormStage {
    /// Whether the stage normalizes: every thread of a block then stays for the statistic
    /// (none returns before it), and q, normalized in place, takes copying lanes as k does.
    const ON: bool;
    /// Whether the statistic spans a whole projection (the projections a view names, each
    /// token's q and k heads in their own blocks).
    const WHOLE: bool;

    /// [`NormLane::load`], or nothing.
    ///
    /// # Safety
    /// As [`NormLane::load`].
    unsafe fn load<S: Style, R: Io, C: Io>(view: &NormView, which: usize, on: bool, at: LaneAt) -> [Bits; 2];

    /// [`NormLane::of`], or [`NormLane::OFF`].
    ///
    /// # Safety
    /// As [`NormLane::of`].
    #[allow(clippy::too_many_arguments)]
    unsafe fn of<S: Style, R: Io, C: Io, const G: usize>(
        view: &NormView,
        which: usize,
        on: bool,
        at: LaneAt,
        data: (&Rows, &[Bits; 2], &Bits),
        bits: [Bits; 2],
        slots: u32,
        whole: impl Fn() -> Whole,
    ) -> NormLane;
}

/// No norm.
pub(crate) struct NoNorm;
/// QK-norm: each of q's and k's heads normalized by its own statistic.
pub(crate) struct HeadNorm;
/// A whole projection's norm: the statistic over all of a token's heads of the projection.
pub(crate) struct WholeNorm;

impl NormStage for NoNorm {
    const ON: bool = false;
    const WHOLE: bool = false;
    #[inline(always)]
    unsafe fn load<S: Style, R: Io, C: Io>(_: &NormView, _: usize, _: bool, _: LaneAt) -> [Bits; 2] {
        [[0; 4]; 2]
    }
    #[inline(always)]
    unsafe fn of<S: Style, R: Io, C: Io, const G: usize>(
        _: &NormView,
        _: usize,
        _: bool,
        _: LaneAt,
        _: (&Rows, &[Bits; 2], &Bits),
        _: [Bits; 2],
        _: u32,
        _: impl Fn() -> Whole,
    ) -> NormLane {
        NormLane::OFF
    }
}

/// The two norms' hooks: [`NormLane`]'s, with `WHOLE` as the stage says.
macro_rules! norm_stage {
    ($ty:ty, $whole:literal) => {
        impl NormStage for $ty {
            const ON: bool = true;
            const WHOLE: bool = $whole;
            #[inline(always)]
            unsafe fn load<S: Style, R: Io, C: Io>(view: &NormView, which: usize, on: bool, at: LaneAt) -> [Bits; 2] {
                // SAFETY: the caller's contract.
                unsafe { NormLane::load::<S, R, C, $whole>(view, which, on, at) }
            }
            #[inline(always)]
            unsafe fn of<S: Style, R: Io, C: Io, const G: usize>(
                view: &NormView,
                which: usize,
                on: bool,
                at: LaneAt,
                data: (&Rows, &[Bits; 2], &Bits),
                bits: [Bits; 2],
                slots: u32,
                whole: impl Fn() -> Whole,
            ) -> NormLane {
                // SAFETY: the caller's contract.
                unsafe { NormLane::of::<S, R, C, G, $whole>(view, which, on, at, data, bits, slots, whole) }
            }
        }
    };
}
norm_stage!(HeadNorm, false);
norm_stage!(WholeNorm, true);

impl NormLane {
    /// The bits of the lane's weights for q (`which == 0`), k (1) or v (2), loaded with the lane's
    /// own accesses where the view says they lie as a head's elements do (`vector`); zeros
    /// otherwise (`on` false, no weights, or element by element: [`NormLane::of`] loads them).
    /// Issued with the inputs' loads, so that the statistic does not wait on them.
    ///
    /// # Safety
    /// Where `on`, the weights' buffers hold `head_dim` elements as the host checked them
    /// (16-byte aligned where `vector`; for a whole-projection norm, `head_dim` for each head
    /// of the projection), and `at` is a lane of the launch's geometry.
    #[inline(always)]
    pub unsafe fn load<S: Style, R: Io, C: Io, const WHOLE: bool>(
        view: &NormView,
        which: usize,
        on: bool,
        at: LaneAt,
    ) -> [Bits; 2] {
        let base = view.weights_of::<WHOLE>(which);
        if !on || base == 0 || view.vector == 0 {
            return [[0; 4]; 2];
        }
        let src = (base as *const u8).wrapping_add(head_offset::<WHOLE>(view, at.head));
        let rows = Rows { src, dst: core::ptr::null_mut(), src_step: 0, dst_step: 0, count: 1 };
        // SAFETY: the caller's contract: the weights lie as a head's elements, aligned as the
        // inputs' accesses.
        unsafe {
            match at.rotating {
                true => S::load::<R>(&rows, 0, at.lane, at.half),
                false => [C::load_raw(rows.src(0, at.copy_at)), [0; 4]],
            }
        }
    }

    /// The lane's norm for the `count` heads of `rows` (at most `G`), given head 0's data
    /// (`first` for a rotating lane, `first_copy` for a copying one; the others are loaded
    /// here) and its weights' bits from [`NormLane::load`]: the squares of the lane's elements
    /// of each head summed over its group of `slots` lanes ([`group_sum`]), each head's factor
    /// ([`inv_rms`]), and the lane's weights plus the offset. Lanes not `on` add nothing and
    /// get [`NormLane::OFF`]'s values. A whole-projection norm (`WHOLE`, the one-head `_w`
    /// kernels): each group's first lane (and, in a group past 32 lanes, each warp's) puts its
    /// sum in `whole()`'s `parts`, and after a barrier each lane adds its projection's, in
    /// order.
    ///
    /// # Safety
    /// Every lane of the warp calls it at once (the shuffles: `G` sums each), and with `WHOLE`
    /// every thread of the block (the barrier), with `whole()` as
    /// [`Whole`] says, its projection's groups inside the block; `on` lanes as
    /// [`NormLane::load`]'s contract, and the `count` heads of `rows` lie in their buffer.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn of<S: Style, R: Io, C: Io, const G: usize, const WHOLE: bool>(
        view: &NormView,
        which: usize,
        on: bool,
        at: LaneAt,
        (rows, first, first_copy): (&Rows, &[Bits; 2], &Bits),
        bits: [Bits; 2],
        slots: u32,
        whole: impl Fn() -> Whole,
    ) -> NormLane {
        const { assert!(G <= NORM_HEADS) };
        let mut norm = NormLane::shared(on);
        // (The projections' divisors differ only for a whole projection.)
        let inv_dim = view.inv_dim_of::<WHOLE>(which);
        // The squares of the lane's elements of head `h` (0 where it is not `on` or past the
        // group's heads).
        let squares = |h: usize| {
            let mut sum = 0.0f32;
            let live = on && h < rows.count;
            if live && at.rotating {
                // SAFETY: the caller's contract: head `h` lies in its buffer.
                let data = if h == 0 { *first } else { unsafe { S::load::<R>(rows, h, at.lane, at.half) } };
                unrolled(S::lane_pairs::<R>(), |j| {
                    let ((l0, i0), (l1, i1)) = S::pair_at::<R>(j);
                    let (a, b) = (R::get(&data[l0], i0), R::get(&data[l1], i1));
                    sum = crate::math::fma(a, a, sum);
                    sum = crate::math::fma(b, b, sum);
                });
            } else if live {
                // SAFETY: as above.
                let data = if h == 0 { *first_copy } else { unsafe { C::load_raw(rows.src(h, at.copy_at)) } };
                unrolled(C::E, |i| {
                    let x = C::get(&data, i);
                    sum = crate::math::fma(x, x, sum);
                });
            }
            sum
        };
        if WHOLE && G > 1 {
            // A whole projection at several heads a thread: one statistic for the group's
            // heads; head 0's weights below, the others' loaded as each is rotated
            // ([`NormLane::head`]; the host takes these kernels only with weights that lie as
            // the heads' elements do).
            let mut sum = 0.0f32;
            unrolled(G, |h| sum += squares(h));
            // SAFETY: the caller's contract: every lane of the warp, and every thread of the
            // block, is here; `parts` holds one f32 per thread, the projection's groups lie in
            // the block.
            let sum = unsafe { whole_sum(whole(), on && at.lane % 32 == 0, on, group_sum(sum, slots), slots) };
            norm.r = [inv_rms(sum, inv_dim, view.eps); NORM_HEADS];
            let base = view.weights_of::<WHOLE>(which);
            norm.per_head = base != 0;
            norm.weights = (base as *const u8).wrapping_add(head_offset::<WHOLE>(view, at.head));
            norm.step = view.head_step as usize;
            norm.offset = view.offset;
        } else {
            // Unrolled (constant indices: the factors stay in registers).
            unrolled(G, |h| {
                // The caller's contract: every lane of the warp is here.
                let sum = group_sum(squares(h), slots);
                norm.r[h] = if WHOLE {
                    // SAFETY: the caller's contract: every thread of the block is here, `parts`
                    // holds one f32 per thread, and the projection's groups lie in the block.
                    unsafe { inv_rms(whole_sum(whole(), on && at.lane % 32 == 0, on, sum, slots), inv_dim, view.eps) }
                } else {
                    inv_rms(sum, inv_dim, view.eps)
                };
            });
        }
        let base = view.weights_of::<WHOLE>(which);
        let head = at.head;
        if on && base != 0 && view.vector != 0 {
            if at.rotating {
                unrolled(S::lane_pairs::<R>(), |j| {
                    let ((l0, i0), (l1, i1)) = S::pair_at::<R>(j);
                    norm.w[0][j] = R::get(&bits[l0], i0) + view.offset;
                    norm.w[1][j] = R::get(&bits[l1], i1) + view.offset;
                });
            } else {
                unrolled(C::E, |i| norm.w[0][i] = C::get(&bits[0], i) + view.offset);
            }
        } else if on && at.rotating {
            unrolled(S::lane_pairs::<R>(), |j| {
                let (d0, d1) = S::pair_dims::<R>(at.lane, at.half, j);
                // SAFETY: the caller's contract: `d0` and `d1` are dims of the head, inside the
                // weights' buffers.
                unsafe {
                    norm.w[0][j] = weight::<WHOLE>(view, which, head, d0);
                    norm.w[1][j] = weight::<WHOLE>(view, which, head, d1);
                }
            });
        } else if on {
            let d = at.copy_at / C::SIZE;
            unrolled(C::E, |i| {
                // SAFETY: as above: the copying lane's dims are the head's.
                norm.w[0][i] = unsafe { weight::<WHOLE>(view, which, head, d + i) };
            });
        }
        norm
    }

    /// The norm of head `h` of a rotating lane's group (`lane` of a head of `half` pairs):
    /// the lane itself where its heads share its weights, else with head `h`'s weights in `w`
    /// (head 0's are the lane's own; a later head's loaded here, as the lane's data is).
    ///
    /// # Safety
    /// With `per_head`, the weights of head `h` lie `h × step` bytes past `weights`, as a
    /// head's elements do (aligned for `R`).
    #[inline(always)]
    pub unsafe fn head<S: Style, R: Io>(
        norm: Option<&NormLane>,
        h: usize,
        lane: usize,
        half: usize,
    ) -> Option<NormLane> {
        let n = norm?;
        if !(n.on && n.per_head) || h == 0 {
            return Some(*n);
        }
        let rows = Rows { src: n.weights, dst: core::ptr::null_mut(), src_step: n.step, dst_step: 0, count: h + 1 };
        // SAFETY: the caller's contract.
        let bits = unsafe { S::load::<R>(&rows, h, lane, half) };
        let mut m = *n;
        unrolled(S::lane_pairs::<R>(), |j| {
            let ((l0, i0), (l1, i1)) = S::pair_at::<R>(j);
            m.w[0][j] = R::get(&bits[l0], i0) + n.offset;
            m.w[1][j] = R::get(&bits[l1], i1) + n.offset;
        });
        Some(m)
    }

    /// [`NormLane::head`] for a copying lane's elements at byte `at` of each head (loaded by
    /// `C`).
    ///
    /// # Safety
    /// As [`NormLane::head`], the weights aligned for `C`.
    #[inline(always)]
    pub unsafe fn head_copy<C: Io>(norm: Option<&NormLane>, h: usize, at: usize) -> Option<NormLane> {
        let n = norm?;
        if !(n.on && n.per_head) || h == 0 {
            return Some(*n);
        }
        // SAFETY: the caller's contract.
        let bits = unsafe { C::load_raw(n.weights.wrapping_add(h * n.step + at)) };
        let mut m = *n;
        unrolled(C::E, |i| m.w[0][i] = C::get(&bits, i) + n.offset);
        Some(m)
    }
}

/// The sum of a whole projection's head sums for a lane (`on`: of a normalized projection) of
/// the block: `head_sum` (its warp's part of its group's sum) put in `parts` where `leader`
/// (its group's first lane, or a later warp's first lane of a group past 32 lanes), a
/// barrier, then the projection's sums added in order, group by group and warp by warp
/// (every lane of a projection the same value).
///
/// # Safety
/// Every thread of the block calls it (the barrier); `w.parts` holds one f32 per thread of
/// the block, and the projection's groups (`w.first + g * slots + 32 c`, `g < w.groups`,
/// `32 c < w.lanes`) are threads of the block whose leaders are `on`; a group past 32 lanes
/// starts a warp.
#[inline(always)]
unsafe fn whole_sum(w: Whole, leader: bool, on: bool, head_sum: f32, slots: u32) -> f32 {
    // SAFETY: the caller's contract.
    unsafe {
        if leader {
            *w.parts.add(w.thread as usize) = head_sum;
        }
        crate::mem::sync_threads();
        let mut total = 0.0f32;
        if on {
            // One warp's sum a group up to 32 lanes (q's and k's heads).
            let warps = w.lanes.div_ceil(32);
            for g in 0..w.groups {
                for c in 0..warps {
                    total += *w.parts.add((w.first + g * slots + 32 * c) as usize);
                }
            }
        }
        total
    }
}

/// The byte offset of head `head`'s weights: `head × head_step` in the whole-projection
/// kernels (`WHOLE`), 0 in the others.
#[inline(always)]
fn head_offset<const WHOLE: bool>(view: &NormView, head: usize) -> usize {
    if WHOLE {
        head * view.head_step as usize
    } else {
        0
    }
}

/// The weight of element `d` of head `head` of the norm `view`'s weights for q (`which == 0`),
/// k (1) or v (2) (every head's the same but for a whole-projection norm, [`head_offset`]), in f32
/// with the offset added; 1 without weights.
///
/// # Safety
/// The weights' buffer holds that element of `view.w_type`, aligned for it, not written during
/// the kernel.
#[inline(always)]
pub(crate) unsafe fn weight<const WHOLE: bool>(view: &NormView, which: usize, head: usize, d: usize) -> f32 {
    use crate::gpu::{load_elem_nc, Bf16, Elem, F16, F32};
    let base = view.weights_of::<WHOLE>(which);
    if base == 0 {
        return 1.0;
    }
    let at = (base as *const u8).wrapping_add(head_offset::<WHOLE>(view, head) + d * view.w_type.size());
    // SAFETY: the caller's contract.
    let w = unsafe {
        match view.w_type {
            DType::F16 => F16::widen(load_elem_nc::<F16>(at)),
            DType::BF16 => Bf16::widen(load_elem_nc::<Bf16>(at)),
            _ => F32::widen(load_elem_nc::<F32>(at)),
        }
    };
    w + view.offset
}
