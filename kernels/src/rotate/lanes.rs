//! A lane's pairs rotated: fast, and exact where a narrow output needs it, into the
//! inputs' type or an FP8 code.

use crate::fp8::{quotient_bound, Fp8};
use crate::gpu::{unrolled, Bits, Io};
use crate::math::fma;
use crate::math::{rotate_pair, rotate_pair_fast, rotate_pair_rounded};
use crate::norm::NormLane;

use super::quant::Scale;
use super::source::{Entries, PairRows, Source, Table};

/// Rotates the `n` pairs of a lane from `raw` (as loaded by `R`) into `out` (as stored by
/// `W`, of as many elements); `pair(j)` says where pair `j`'s two elements are (as (vector,
/// index)), in increasing index order per vector. Fast evaluation first; for narrow outputs, if any output of the lane is too small
/// next to its inputs for the fast form to round correctly, the inputs are read again
/// (`reload`: the source is not yet written) with the residuals, and every pair of the lane
/// is recomputed with [`rotate_pair`]. That happens for about one output in 10^4 on random
/// data.
///
/// FP8 outputs (`W::FP8`) store the code of `y / scale` in format `fmt`, `y` the f32 nearest
/// the exact rotation: the fast quotient `q` (the fast rotation times the scale's reciprocal)
/// lies within `e` ([`quotient_bound`]) of that quotient, and the conversion is monotone, so
/// where `q - e` and `q + e` convert to one code the exact quotient does too. The lane stores
/// the lower ends' codes where every value's two ends agree, and is otherwise redone with
/// [`rotate_pair_rounded`] and the exact quotient ([`Scale::div`]): every code is the one of the
/// correctly rounded rotation. (Quotients nearer zero than `e` take the exact path, their ends'
/// signs differing; NaN inputs or scales give NaN either way.)
///
/// FP8 inputs (the KV shift's, in place) are read on the exact path as their code's value times
/// the head's scale ([`Io::value`]), the scale the stores divide by; the fast path rotates the
/// codes' values as they are, its quotient the rotation itself (the scale cancels, within the
/// same bound: [`quotient_bound`]), where the scale lies in `[2^-64, 2^64]`
/// ([`Scale::codes_fast`]; any other sends the lane to the exact path).
///
/// With a norm (`norm.on`), each input is first `x r w` ([`NormLane`], `r` the head's factor): rounded to f32 on the
/// fast path, and on the exact path kept as `hi + lo`, the `lo` parts' rotation added to the
/// `hi` parts' exact one, so that the normalized value's rounding adds nothing where the
/// rotation cancels.
///
/// # Safety
/// `t` was loaded from `p` for `n` pairs, and `reload` may be called (its source is still
/// unwritten and readable).
#[inline(always)]
pub(super) unsafe fn rotate_lane<R: Io, W: Io, B: Source, P: PairRows>(
    t: &Entries<P>,
    p: Table<'_>,
    n: usize,
    (raw, out): (&[Bits; 2], &mut [Bits; 2]),
    (pair, out_at): (
        impl Fn(usize) -> ((usize, usize), (usize, usize)),
        impl Fn(usize) -> ((usize, usize), (usize, usize)),
    ),
    reload: impl Fn() -> [Bits; 2],
    ((fmt, scale), (norm, r)): ((Fp8, Scale), (Option<&NormLane>, f32)),
) {
    debug_assert!(n <= 8);
    let (mut slack, mut smallest) = (f32::INFINITY, f32::INFINITY);
    // FP8: the codes of each value's upper end (`out` takes the lower ends').
    let (mut upper, mut pending_up) = ([[0u32; 4]; 2], [0.0f32; 2]);
    let mut pending = [0.0f32; 2];
    // SAFETY: the caller's contract: `t` was loaded from `p` for `n` pairs.
    let (c, s) = unsafe { t.lane::<B>(p, n) };
    // The fast path's reciprocal: FP8 inputs' values are read unscaled, so their quotient is
    // the rotation itself. (Other inputs ignore the scale they are read with.)
    let (fast_r, fast) = if R::FP8 { (1.0, scale.codes_fast()) } else { (scale.r, true) };
    unrolled(n, |j| {
        let ((l0, i0), (l1, i1)) = pair(j);
        let (a, b) = (
            NormLane::get_of(norm, j, 0, R::value(&raw[l0], i0, fmt, 1.0), r),
            NormLane::get_of(norm, j, 1, R::value(&raw[l1], i1, fmt, 1.0), r),
        );
        let ((l0, i0), (l1, i1)) = out_at(j);
        let (y0, y1) = match B::ROUNDED_F32 && W::NARROW.is_none() && !W::FP8 {
            true => rotate_pair_rounded(a, b, (c[j], 0.0), (s[j], 0.0)),
            false => rotate_pair_fast(a, b, c[j], s[j]),
        };
        if let Some(narrow) = W::NARROW {
            let (sl, sm) = narrow.slack((y0, y1), a, b);
            slack = slack.min(sl);
            if narrow.min_normal > 0.0 {
                smallest = smallest.min(sm);
            }
        }
        if W::FP8 {
            let (q0, q1) = (y0 * fast_r, y1 * fast_r);
            // (An infinite bound: the two ends' codes differ, but for NaN, which both take.)
            let e = if fast { quotient_bound(a, b, fast_r) } else { f32::INFINITY };
            W::put(&mut out[l0], &mut pending[l0], i0, q0 - e, fmt);
            W::put(&mut out[l1], &mut pending[l1], i1, q1 - e, fmt);
            W::put(&mut upper[l0], &mut pending_up[l0], i0, q0 + e, fmt);
            W::put(&mut upper[l1], &mut pending_up[l1], i1, q1 + e, fmt);
        } else {
            W::put(&mut out[l0], &mut pending[l0], i0, y0, fmt);
            W::put(&mut out[l1], &mut pending[l1], i1, y1, fmt);
        }
    });
    // Word by word (an array comparison is a call to `memcmp`).
    let mut differ = 0;
    for v in 0..2 {
        for w in 0..4 {
            differ |= out[v][w] ^ upper[v][w];
        }
    }
    let redo = W::FP8 && differ != 0;
    if W::NARROW.is_some_and(|narrow| slack < 0.0 || smallest < narrow.min_normal) || redo {
        let orig = reload();
        unrolled(n, |j| {
            let ((l0, i0), (l1, i1)) = pair(j);
            // Normalized inputs as `hi + lo`: the rotation of the `hi` parts, then the `lo`
            // parts' (tiny) rotation added (only with a norm: adding zero would turn a
            // result of -0 into +0).
            let ((a, al), (b, bl)) = (
                NormLane::exact_of(norm, j, 0, R::value(&orig[l0], i0, fmt, scale.s), r),
                NormLane::exact_of(norm, j, 1, R::value(&orig[l1], i1, fmt, scale.s), r),
            );
            let ((l0, i0), (l1, i1)) = out_at(j);
            // SAFETY: the caller's contract: `t` holds `n > j` entries loaded from `p`.
            let (c, s) = unsafe { t.exact::<B>(p, j) };
            let (y0, y1) = match W::FP8 {
                true => rotate_pair_rounded(a, b, c, s),
                false => rotate_pair(a, b, c, s),
            };
            let (y0, y1) = match norm.is_some_and(|n| n.on) {
                true => (y0 + fma(al, c.0, -(bl * s.0)), y1 + fma(bl, c.0, al * s.0)),
                false => (y0, y1),
            };
            let (y0, y1) = if W::FP8 { (scale.div(y0), scale.div(y1)) } else { (y0, y1) };
            W::put(&mut out[l0], &mut pending[l0], i0, y0, fmt);
            W::put(&mut out[l1], &mut pending[l1], i1, y1, fmt);
        });
    }
}
