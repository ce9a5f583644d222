//! `extern "ptx-kernel"` entry points: thread-to-work mapping only (see [`RopeParams`]).

use crate::gpu::{block_dim, block_idx, thread_idx, F32x4, Vector};
use crate::math::rotate_pair;
use crate::params::{HeadsView, RopeParams};

/// Rotate-half RoPE of one lane of one row, `V::N` pairs wide.
///
/// # Safety
/// The host checked that every row of both views lies inside its buffer, that the table
/// holds `seq` positions of `half` pairs, and that addresses are aligned for `V`.
#[inline(always)]
unsafe fn rope_neox<V: Vector>(p: &RopeParams) {
    let (tx, ty) = thread_idx();
    let (bx, by) = block_idx();
    let (dx, dy) = block_dim();
    let token = bx * dy + ty;
    let work = by * dx + tx;
    let heads = p.q.heads + p.k.heads;
    if token >= p.tokens || work >= heads * p.lanes {
        return;
    }
    // SAFETY: the host never launches with `lanes == 0` or `seq == 0`.
    core::hint::assert_unchecked(p.lanes != 0 && p.seq != 0);
    let head = work / p.lanes;
    let lane = work % p.lanes;
    let (view, h): (&HeadsView, u32) = if head < p.q.heads { (&p.q, head) } else { (&p.k, head - p.q.heads) };
    let (b, s) = ((token / p.seq) as u64, (token % p.seq) as u64);
    let half = p.half as usize;
    let i = lane as usize * V::N;
    let src = (view.input as *const f32).add(view.in_offset(b, s, h as u64) as usize + i);
    let dst = (view.output as *mut f32).add(view.out_offset(b, s, h as u64) as usize + i);
    let t = s as usize * half + i;
    let c = V::load((p.cos as *const f32).add(t));
    let sn = V::load((p.sin as *const f32).add(t));
    let mut x0 = V::load(src);
    let mut x1 = V::load(src.add(half));
    for j in 0..V::N {
        let (y0, y1) = rotate_pair(x0.get(j), x1.get(j), c.get(j), sn.get(j));
        x0.set(j, y0);
        x1.set(j, y1);
    }
    x0.store(dst);
    x1.store(dst.add(half));
}

/// RoPE, rotate-half style, f32, 4 pairs per lane with 16-byte accesses.
///
/// # Safety
/// See [`RopeParams`]; additionally every row start and `half` are multiples of 4 elements
/// and the buffers are 16-byte aligned.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn rope_neox_f32_v4(p: RopeParams) {
    rope_neox::<F32x4>(&p)
}

/// RoPE, rotate-half style, f32, one pair per lane (any alignment).
///
/// # Safety
/// See [`RopeParams`].
#[no_mangle]
pub unsafe extern "ptx-kernel" fn rope_neox_f32_v1(p: RopeParams) {
    rope_neox::<f32>(&p)
}
