//! QK-norm: the RMS norm of each head of q and k, applied in the fused launches before the
//! rotation (the `_n` kernels). Host and device share the view ([`NormView`]) and the
//! statistic's arithmetic ([`inv_rms`]); the device part reduces a head's sum of squares
//! across the lanes that hold it (one warp's shuffles) and scales each element as it is
//! rotated or copied.
//!
//! A head `x` of `dim` elements becomes `x_i * r * w_i`, `r = 1 / sqrt(sum(x^2) / dim + eps)`
//! in f32 (the sum in f32, as transformers computes it; the reciprocal square root within
//! 2 ulps of f32, see [`inv_rms`]), `w_i` the norm's weight (plus `offset`: Gemma's `1 + w`),
//! or 1 without a weight; the product is not rounded to the input's type before the rotation
//! (one rounding, at the store).
//!
//! A lane's weights are loaded with its inputs (`NormLane::load`, device code in `norm_lane`)
//! and its head's statistic taken later (`NormLane::of`), once the position's and slot's loads
//! are on their way: the norm's arithmetic then runs while they are in flight. This module
//! holds what both sides share and the factor a lane applies as it rotates or copies; the
//! loads and the statistic, which read rows in a style's pairs, are `norm_lane`'s.
//!
//! A whole-projection norm (OLMo 2 and 3: the statistic over all of a token's heads of q, and
//! of k, the weights `[heads × head_dim]`) runs in kernels of its own (`_w`: one head a thread,
//! or in the append's `_v_w` a group of heads, each head's weights loaded as it is rotated) on
//! blocks that hold each token's q heads, and its k heads, whole (the host's geometry): each
//! group's sum goes to shared memory, and after a barrier every lane adds its projection's
//! group sums in the same order (`Whole`), so that every head of a token gets the same factor.
//!
//! The same kernels normalize MLA's latent `kv_c` (the values' one head, its `kv_a_layernorm`)
//! with q and k left as they are ([`NormView::projections`]): a head of 512 elements spans two
//! to eight warps, so each warp's first lane puts its sum in shared memory and every lane adds
//! its group's warps in order.

use crate::keys::DType;

/// The norm of a fused launch: q's, k's and v's weights, their type, the offset added to each
/// weight, `eps`, the number of elements the mean divides by, and which of the three are
/// normalized.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct NormView {
    /// Device addresses of q's, k's and v's weights (`[head_dim]` each, of `w_type`); 0: no
    /// weight (every weight 1, the offset unused).
    pub weights: [u64; 3],
    /// The element type of the weights (f32, f16 or bf16).
    pub w_type: DType,
    /// Added to each weight in f32: 0 (`x r w`), or 1 (Gemma's `x r (1 + w)`).
    pub offset: f32,
    /// Added to the mean of the squares (positive, finite).
    pub eps: f32,
    /// `1 / n` in f32 for q's statistic (0), k's (1) and v's (2), `n` the mean's divisor:
    /// `head_dim`, or for a whole-projection norm the projection's `heads × head_dim`.
    pub inv_dim: [f32; 3],
    /// 1 where the weights are of the inputs' type and 16-byte aligned: a lane loads its
    /// weights with its own accesses (the weights lie as a head's elements do); 0: element
    /// by element.
    pub vector: u32,
    /// Bytes from one head's weights to the next: 0 where every head takes the same
    /// `[head_dim]` weights; `head_dim` weights' bytes for a whole-projection norm (weights
    /// `[heads × head_dim]`, the statistic over the token's heads: the `_w` kernels).
    pub head_step: u32,
    /// Bit `i` set: projection `i` (q 0, k 1, v 2) is normalized. The `_n` kernels normalize
    /// q and k (both bits); the `_w` kernels the projections set here, v only among them
    /// where v has one head (MLA's `kv_c`, whose 512 elements span two warps or more).
    pub projections: u32,
}

/// [`NormView::projections`]' bits of QK-norm: q's and k's.
pub const QK: u32 = 0b011;
/// [`NormView::projections`]' bit of the values' norm (MLA's `kv_c`, `_w` kernels only).
pub const V: u32 = 0b100;

impl NormView {
    /// Whether the statistic is taken over all of a token's heads (a whole-projection norm).
    #[inline(always)]
    pub fn whole(&self) -> bool {
        self.head_step != 0
    }

    /// The weights' address of projection `which` (q 0, k 1, v 2), chosen by selects; the
    /// kernels without a whole-projection norm (`WHOLE` false) normalize q and k only, and
    /// hold no select of v's.
    #[inline(always)]
    pub fn weights_of<const WHOLE: bool>(&self, which: usize) -> u64 {
        match which {
            0 => self.weights[0],
            1 => self.weights[1],
            _ if WHOLE => self.weights[2],
            _ => self.weights[1],
        }
    }

    /// The statistic's `1 / n` of projection `which`: each its own for a whole-projection norm
    /// (`WHOLE`), q's (every head's `head_dim`) in the others.
    #[inline(always)]
    pub fn inv_dim_of<const WHOLE: bool>(&self, which: usize) -> f32 {
        match which {
            _ if !WHOLE => self.inv_dim[0],
            0 => self.inv_dim[0],
            1 => self.inv_dim[1],
            _ => self.inv_dim[2],
        }
    }
}

/// `1 / sqrt(sum * inv_dim + eps)` in f32, without calls or branches: the mean plus `eps` in
/// one FMA, the hardware's reciprocal square root, then one Newton step (within 2 ulps of the
/// correctly rounded value; 0 where the sum of squares overflowed, as transformers' f32
/// `rsqrt` gives). The f64 references of the tests hold the outputs within 1 ulp of the
/// exact norm and rotation.
#[inline(always)]
pub fn inv_rms(sum: f32, inv_dim: f32, eps: f32) -> f32 {
    let x = crate::math::fma(sum, inv_dim, eps);
    let y = rsqrt_approx(x);
    // y (1 + (1 - x y^2) / 2): the product x y first keeps x y^2 from overflowing.
    let e = crate::math::fma(-(x * y), y, 1.0);
    let r = crate::math::fma(0.5 * y, e, y);
    if x == f32::INFINITY {
        0.0
    } else {
        r
    }
}

/// The hardware's approximate reciprocal square root (subnormal inputs kept).
#[inline(always)]
fn rsqrt_approx(x: f32) -> f32 {
    #[cfg(target_arch = "nvptx64")]
    {
        let r: f32;
        // SAFETY: a register-only instruction.
        unsafe {
            core::arch::asm!("rsqrt.approx.f32 {}, {};", out(reg32) r, in(reg32) x, options(pure, nomem, nostack));
        }
        r
    }
    #[cfg(not(target_arch = "nvptx64"))]
    {
        1.0 / x.sqrt()
    }
}

/// The sum of `v` over the aligned groups of `slots` (a power of two; 32 or more: the whole
/// warp) consecutive lanes of the warp: xor shuffles 1, 2, 4, 8 and 16, each taken only below `slots`. Every
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

/// The norm of one lane of up to [`NORM_HEADS`] heads, as its rotation and copies apply it:
/// each head's factor (`r[h]`, [`NormLane::r_of`]) and the lane's weights, `w[0][j]` and
/// `w[1][j]` for the two elements of its pair `j` (a copying lane's element `j`: `w[0][j]`),
/// the same for every head (or head 0's, each later head's loaded for it: `per_head`). Off (`on == false`, [`NormLane::OFF`]: the lanes of v, idle
/// lanes) it leaves every value as it is. The kernels without a norm pass `None` where a norm
/// goes (`get_of` and the like), so that their code holds nothing of it: a `NormLane` that is
/// off but not a constant LLVM folds cost the plain KV kernels 5 to 8 registers.
#[cfg(target_arch = "nvptx64")]
#[derive(Clone, Copy)]
pub(crate) struct NormLane {
    pub on: bool,
    pub r: [f32; NORM_HEADS],
    pub w: [[f32; 8]; 2],
    /// Each head its own weights (a whole projection's norm at several heads a thread): `w`
    /// holds none of them; each head's are loaded as it is rotated or copied
    /// ([`NormLane::head`], in `norm_lane`), from `weights` (the lane's first head's,
    /// `step` bytes to the next head's, plus `offset`). False, with a null `weights`, in the
    /// kernels whose heads share `w`.
    pub per_head: bool,
    pub weights: *const u8,
    pub step: usize,
    pub offset: f32,
}

/// The most heads one thread normalizes (the `_v` groups: up to 8 in RoPE's 16-bit kernels).
pub const NORM_HEADS: usize = 8;

#[cfg(target_arch = "nvptx64")]
impl NormLane {
    /// No norm.
    pub const OFF: NormLane = NormLane::shared(false);

    /// A lane whose heads share `w` (`on` as given, every factor and weight 1 until set).
    #[inline(always)]
    pub const fn shared(on: bool) -> NormLane {
        NormLane {
            on,
            r: [1.0; NORM_HEADS],
            w: [[1.0; 8]; 2],
            per_head: false,
            weights: core::ptr::null(),
            step: 0,
            offset: 0.0,
        }
    }

    /// The factor of head `h` of the thread's group, chosen by selects (no indexing of
    /// registers by a runtime value).
    #[inline(always)]
    pub fn r_of(&self, h: usize) -> f32 {
        let mut r = self.r[0];
        for (i, &ri) in self.r.iter().enumerate().skip(1) {
            if h == i {
                r = ri;
            }
        }
        r
    }

    /// [`NormLane::r_of`] of a norm, 1 without one (`None`: the kernels without a norm, whose
    /// code then holds nothing of it).
    #[inline(always)]
    pub fn r_of_head(norm: Option<&NormLane>, h: usize) -> f32 {
        match norm {
            Some(n) if n.on => n.r_of(h),
            _ => 1.0,
        }
    }

    /// [`NormLane::get`] of a norm; `x` without one.
    #[inline(always)]
    pub fn get_of(norm: Option<&NormLane>, j: usize, e: usize, x: f32, r: f32) -> f32 {
        match norm {
            Some(n) => n.get(j, e, x, r),
            None => x,
        }
    }

    /// [`NormLane::exact`] of a norm; `(x, 0)` without one.
    #[inline(always)]
    pub fn exact_of(norm: Option<&NormLane>, j: usize, e: usize, x: f32, r: f32) -> (f32, f32) {
        match norm {
            Some(n) => n.exact(j, e, x, r),
            None => (x, 0.0),
        }
    }

    /// Element `e` (0 or 1) of pair `j` of a head of factor `r`: `x r w`, rounded to f32 (two
    /// products).
    #[inline(always)]
    pub fn get(&self, j: usize, e: usize, x: f32, r: f32) -> f32 {
        if self.on {
            x * r * self.w[e][j]
        } else {
            x
        }
    }

    /// The same value as an unevaluated sum `hi + lo` within about 2^-46 of `x r w` (FMA
    /// two-products): the exact rotation's inputs, so that rounding the normalized value to
    /// f32 adds no error where the rotation cancels.
    #[inline(always)]
    pub fn exact(&self, j: usize, e: usize, x: f32, r: f32) -> (f32, f32) {
        if !self.on {
            return (x, 0.0);
        }
        let w = self.w[e][j];
        let p = x * r;
        let pe = crate::math::fma(x, r, -p);
        let q = p * w;
        let qe = crate::math::fma(p, w, -q);
        (q, crate::math::fma(pe, w, qe))
    }
}
