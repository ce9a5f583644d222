//! QK-norm: the RMS norm of each head of q and k, applied in the fused launches before the
//! rotation (the `_n` kernels). Host and device share the view ([`NormView`]) and the
//! statistic's arithmetic ([`inv_rms`]); the device part reduces a head's sum of squares
//! across the lanes that hold it (one warp's shuffles) and scales each element as it is
//! rotated or copied.
//!
//! A head `x` of `dim` elements becomes `x_i * r * w_i`, `r = 1 / sqrt(sum(x^2) / dim + eps)`
//! in f32 (the sum in f32, as transformers computes it), `w_i` the norm's weight (plus
//! `offset`: Gemma's `1 + w`), or 1 without a weight; the product is not rounded to the
//! input's type before the rotation (one rounding, at the store).

use crate::keys::DType;

/// The norm of a fused launch: q's and k's weights, their type, the offset added to each
/// weight, `eps`, and the number of elements the mean divides by.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct NormView {
    /// Device addresses of q's and k's weights (`[head_dim]` each, of `w_type`); 0: no
    /// weight (every weight 1, the offset unused).
    pub weights: [u64; 2],
    /// The element type of the weights (f32, f16 or bf16).
    pub w_type: DType,
    /// Added to each weight in f32: 0 (`x r w`), or 1 (Gemma's `x r (1 + w)`).
    pub offset: f32,
    /// Added to the mean of the squares (positive, finite).
    pub eps: f32,
    /// Elements of a head (the mean's divisor).
    pub dim: u32,
    /// 1 where the weights are of the inputs' type and 16-byte aligned: a lane loads its
    /// weights with its own accesses (the weights lie as a head's elements do); 0: element
    /// by element.
    pub vector: u32,
}

/// `1 / sqrt(sum / dim + eps)` in f32, each operation rounded (IEEE square root and
/// division): the factor of every element of a head whose squares sum to `sum`.
#[inline(always)]
pub fn inv_rms(sum: f32, dim: u32, eps: f32) -> f32 {
    1.0 / sqrt(sum / dim as f32 + eps)
}

/// The IEEE square root of `x`.
#[inline(always)]
fn sqrt(x: f32) -> f32 {
    #[cfg(target_arch = "nvptx64")]
    {
        let r: f32;
        // SAFETY: a register-only instruction.
        unsafe {
            core::arch::asm!("sqrt.rn.f32 {}, {};", out(reg32) r, in(reg32) x, options(pure, nomem, nostack));
        }
        r
    }
    #[cfg(not(target_arch = "nvptx64"))]
    {
        x.sqrt()
    }
}

/// The sum of `v` over the aligned groups of `slots` (a power of two up to 32) consecutive
/// lanes of the warp: xor shuffles 1, 2, 4, 8 and 16, each taken only below `slots`. Every
/// lane of the warp must call it at once, whatever its own `slots` (each step's shuffle is
/// executed by all 32 lanes; a lane adds only its group's values), and the sum is the same
/// in every lane of a group (the butterfly's order is symmetric).
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
pub(crate) fn group_sum(mut v: f32, slots: u32) -> f32 {
    let mut o = 1u32;
    while o < 32 {
        let other: f32;
        // SAFETY: every lane of the warp executes this shuffle (the function's contract);
        // register-only otherwise.
        unsafe {
            core::arch::asm!(
                "shfl.sync.bfly.b32 {}, {}, {}, 0x1f, 0xffffffff;",
                out(reg32) other, in(reg32) v, in(reg32) o,
                options(nomem, nostack, preserves_flags),
            );
        }
        if o < slots {
            v += other;
        }
        o <<= 1;
    }
    v
}

/// The norm of one lane of one head, as its rotation and copies apply it: the head's factor
/// `r` and the lane's weights, `w[0][j]` and `w[1][j]` for the two elements of its pair `j`
/// (a copying lane's element `j`: `w[0][j]`). Off (`on == false`, [`NormLane::OFF`]) it
/// leaves every value as it is, and folds away where the kernel has no norm.
#[cfg(target_arch = "nvptx64")]
#[derive(Clone, Copy)]
pub(crate) struct NormLane {
    pub on: bool,
    pub r: f32,
    pub w: [[f32; 8]; 2],
}

#[cfg(target_arch = "nvptx64")]
impl NormLane {
    /// No norm.
    pub const OFF: NormLane = NormLane { on: false, r: 1.0, w: [[1.0; 8]; 2] };

    /// Element `e` (0 or 1) of pair `j`: `x r w`, rounded to f32 (two products).
    #[inline(always)]
    pub fn get(&self, j: usize, e: usize, x: f32) -> f32 {
        if self.on {
            x * self.r * self.w[e][j]
        } else {
            x
        }
    }

    /// The same value as an unevaluated sum `hi + lo` within about 2^-46 of `x r w` (FMA
    /// two-products): the exact rotation's inputs, so that rounding the normalized value to
    /// f32 adds no error where the rotation cancels.
    #[inline(always)]
    pub fn exact(&self, j: usize, e: usize, x: f32) -> (f32, f32) {
        if !self.on {
            return (x, 0.0);
        }
        let w = self.w[e][j];
        let p = x * self.r;
        let pe = crate::math::fma(x, self.r, -p);
        let q = p * w;
        let qe = crate::math::fma(p, w, -q);
        (q, crate::math::fma(pe, w, qe))
    }
}

/// The weight of element `d` of the norm `view`'s weights for q (`which == 0`) or k (1), in
/// f32 with the offset added; 1 without weights.
///
/// # Safety
/// The weights' buffer holds element `d` of `view.w_type`, aligned for it, not written during
/// the kernel.
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
pub(crate) unsafe fn weight(view: &NormView, which: usize, d: usize) -> f32 {
    use crate::gpu::{load_elem_nc, Bf16, Elem, F16, F32};
    let base = view.weights[which];
    if base == 0 {
        return 1.0;
    }
    let at = (base as *const u8).wrapping_add(d * view.w_type.size());
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
