//! Arithmetic shared by the kernels and the host (table builder, CPU tests).

/// `a * b + c` with one rounding.
#[inline(always)]
pub fn fma(a: f32, b: f32, c: f32) -> f32 {
    #[cfg(target_arch = "nvptx64")]
    {
        let r: f32;
        // SAFETY: a register-only instruction.
        unsafe {
            core::arch::asm!("fma.rn.f32 {}, {}, {}, {};", out(reg32) r, in(reg32) a, in(reg32) b, in(reg32) c,
                options(pure, nomem, nostack));
        }
        r
    }
    #[cfg(not(target_arch = "nvptx64"))]
    {
        a.mul_add(b, c)
    }
}

/// `a * (b_hi + b_lo) + c * (d_hi + d_lo)` in f32 with an error of about one f32 rounding of
/// the *result* (plus ~2^-48 of the terms), however much the two products cancel.
///
/// `c * d_hi` is split into its rounded value and its exact error (an FMA two-product); the
/// FMA adding `a * b_hi` to the rounded value is then exact up to one rounding of the sum;
/// the remaining terms are each about 2^-24 of a product and are added last.
#[inline(always)]
pub fn dot2(a: f32, b_hi: f32, b_lo: f32, c: f32, d_hi: f32, d_lo: f32) -> f32 {
    let p = c * d_hi;
    let p_err = fma(c, d_hi, -p);
    fma(a, b_hi, p) + (p_err + fma(a, b_lo, c * d_lo))
}

/// Rotates the pair `(x0, x1)` by the angle whose cosine is `c_hi + c_lo` and sine
/// `s_hi + s_lo` (each an f32 pair split from an f64 value):
/// `(x0 cos - x1 sin, x1 cos + x0 sin)`, which is `x * cos + rotate_half(x) * sin`.
///
/// Rotate-half (NeoX) style pairs element `i` with `i + rotary_dim / 2`; interleaved (GPT-J)
/// style pairs `2i` with `2i + 1`. Each output is accurate to about one f32 rounding of
/// itself (see [`dot2`]), so narrowing it to f16 or bf16 lands within one unit in the last
/// place of the correctly rounded exact result, even where the products cancel.
#[inline(always)]
pub fn rotate_pair(x0: f32, x1: f32, c: (f32, f32), s: (f32, f32)) -> (f32, f32) {
    (dot2(x0, c.0, c.1, -x1, s.0, s.1), dot2(x1, c.0, c.1, x0, s.0, s.1))
}

/// `|v|`.
#[inline(always)]
pub fn abs(v: f32) -> f32 {
    f32::from_bits(v.to_bits() & 0x7FFF_FFFF)
}

/// The fast rotation: `(x0 c - x1 s, x1 c + x0 s)` with one FMA per output and the f32 table
/// entries `c`, `s` alone. Its error is at most about `2^-23.4 (|x0| + |x1|) + 2^-23 |y|` per
/// output `y`: fine for f32 outputs, and for narrow outputs unless `y` is small next to the
/// inputs (see [`Narrow::needs_precise`]).
#[inline(always)]
pub fn rotate_pair_fast(x0: f32, x1: f32, c: f32, s: f32) -> (f32, f32) {
    (fma(x0, c, -(x1 * s)), fma(x1, c, x0 * s))
}

/// A narrow output format (f16, bf16), for deciding when [`rotate_pair_fast`] is not enough
/// to land within one ulp of the correctly rounded result.
#[derive(Clone, Copy, Debug)]
pub struct Narrow {
    /// `2^(24 - p)`, `p` the format's significand bits: the fast result `y` is safe when
    /// `|y| * scale >= |x0| + |x1|`. The fast error is at most `2^-23.4 (|x0| + |x1|) +
    /// 2^-23 |y|` and half an ulp of `y` at least `2^-(p + 1) |y|`, so `2^(22.4 - p)` would
    /// just do; `2^(24 - p)` leaves a factor of 3.
    pub scale: f32,
    /// Results below this (the format's smallest normal) are always recomputed.
    pub min_normal: f32,
}

impl Narrow {
    /// bfloat16: 8 significand bits.
    pub const BF16: Narrow = Narrow { scale: 65_536.0, min_normal: 0.0 };
    /// binary16: 11 significand bits.
    pub const F16: Narrow = Narrow { scale: 8_192.0, min_normal: 6.103_515_6e-5 };

    /// Whether the fast output `y` of inputs `x0`, `x1` must be recomputed with [`rotate_pair`].
    #[inline(always)]
    pub fn needs_precise(&self, y: f32, x0: f32, x1: f32) -> bool {
        self.pair_needs_precise((y, y), x0, x1)
    }

    /// [`Narrow::needs_precise`] for both outputs of a pair at once: the smaller decides.
    #[inline(always)]
    pub fn pair_needs_precise(&self, y: (f32, f32), x0: f32, x1: f32) -> bool {
        let (slack, smallest) = self.slack(y, x0, x1);
        slack < 0.0 || smallest < self.min_normal
    }

    /// `(min(|y0|, |y1|) * scale - (|x0| + |x1|), min(|y0|, |y1|))`: the pair needs the exact
    /// path when the first is negative or the second below `min_normal`. Kernels take the
    /// minimum of each over a lane and test once.
    #[inline(always)]
    pub fn slack(&self, (y0, y1): (f32, f32), x0: f32, x1: f32) -> (f32, f32) {
        let y = abs(y0).min(abs(y1));
        (fma(y, self.scale, -(abs(x0) + abs(x1))), y)
    }
}

/// Splits `v` into `(hi, lo)` with `hi` the f32 nearest `v` and `lo` the f32 nearest `v - hi`.
#[inline(always)]
#[cfg(not(target_arch = "nvptx64"))]
pub fn split_f64(v: f64) -> (f32, f32) {
    let hi = v as f32;
    (hi, (v - hi as f64) as f32)
}

/// `inv_freq[i] = 1 / base^(2i / dim)`, in f64, for pair `i` of a rotary dimension `dim`.
#[inline(always)]
#[cfg(not(target_arch = "nvptx64"))]
pub fn inv_freq(base: f64, dim: usize, i: usize) -> f64 {
    1.0 / base.powf((2 * i) as f64 / dim as f64)
}
