//! The 8-bit floating-point formats of the OCP 8-bit floating point specification, for
//! caches stored in them: E4M3 (`float8_e4m3fn`: bias 7, no infinities, largest finite 448,
//! NaN `0x7F`/`0xFF`) and E5M2 (bias 15, largest finite 57344, infinities, NaNs).
//!
//! The conversion from f32 rounds to nearest even, saturates finite values beyond the largest
//! finite and infinities to ± the largest finite, keeps subnormals, and turns every NaN into
//! `0x7F`: what the `cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32` instruction of sm_89 and later does.
//! [`Fp8::pack2`] is that instruction where the kernel's architecture has it and its portable
//! twin ([`Fp8::from_f32`], integer arithmetic only) elsewhere, sm_80 and the host alike;
//! [`Fp8::unpack2`], the way back, is `cvt.rn.f16x2.{e4m3x2,e5m2x2}` or [`Fp8::to_f32`]. These
//! two are the only places an architecture-specific instruction enters the kernels, each with
//! a twin the host's tests check against an independent reference.

use crate::math::{abs, fma};

/// An 8-bit floating-point format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fp8 {
    /// 4 exponent bits (bias 7), 3 mantissa bits; no infinities; largest finite 448.
    E4M3,
    /// 5 exponent bits (bias 15), 2 mantissa bits; largest finite 57344.
    E5M2,
}

/// The canonical NaN both conversions return (`cvt.rn.satfinite` drops the sign of a NaN).
pub const NAN: u8 = 0x7F;

impl Fp8 {
    /// Mantissa bits.
    #[inline(always)]
    const fn mantissa(self) -> u32 {
        match self {
            Fp8::E4M3 => 3,
            Fp8::E5M2 => 2,
        }
    }

    /// The exponent bias.
    #[inline(always)]
    const fn bias(self) -> i32 {
        match self {
            Fp8::E4M3 => 7,
            Fp8::E5M2 => 15,
        }
    }

    /// The code of the largest finite value (sign bit clear).
    #[inline(always)]
    pub const fn max_code(self) -> u8 {
        match self {
            Fp8::E4M3 => 0x7E,
            Fp8::E5M2 => 0x7B,
        }
    }

    /// The largest finite value.
    pub const fn max(self) -> f32 {
        match self {
            Fp8::E4M3 => 448.0,
            Fp8::E5M2 => 57344.0,
        }
    }

    /// `x` in this format: rounded to nearest even, saturated to ± the largest finite, NaN to
    /// [`NAN`]. Integer arithmetic on the f32 bits only, so the same on every architecture.
    #[inline(always)]
    pub const fn from_f32(self, x: f32) -> u8 {
        let bits = x.to_bits();
        let sign = ((bits >> 24) & 0x80) as u8;
        let abs = bits & 0x7FFF_FFFF;
        if abs > 0x7F80_0000 {
            return NAN;
        }
        let m = self.mantissa();
        // The f32 exponent, unbiased; f32 subnormals (and zero) are far below half the
        // smallest subnormal of either format, so they need no exponent of their own.
        let exp = (abs >> 23) as i32 - 127;
        let min_normal = 1 - self.bias();
        let code = if exp >= min_normal {
            // Normal: drop `23 - m` mantissa bits, rebias the exponent; the rounding carry
            // runs into the exponent (and past the largest finite, caught below).
            let drop = 23 - m;
            let code = (abs >> drop) - (((127 - self.bias()) as u32) << m);
            round(code, abs & ((1 << drop) - 1), drop)
        } else {
            // Subnormal: the significand in units of the smallest subnormal,
            // `2^(min_normal - m)`: shifted right by `23 - m + (min_normal - exp)`.
            let shift = (23 - m) as i32 + (min_normal - exp);
            if shift > 25 {
                0 // below half the smallest subnormal (the significand is under 2^24)
            } else {
                let sig = (abs & 0x7F_FFFF) | 0x80_0000;
                let shift = shift as u32;
                round(sig >> shift, sig & ((1 << shift) - 1), shift)
            }
        };
        let max = self.max_code() as u32;
        sign | (if code > max { max } else { code }) as u8
    }

    /// The value of `code` (NaN codes: NaN; E5M2's infinities: infinities). Without branches
    /// (the KV shift decodes 16 codes a lane): a normal code's exponent and mantissa bits moved
    /// into an f32's and the exponent rebased, a subnormal's mantissa times the smallest
    /// subnormal, selected; every value of either format is an exact f32.
    pub const fn to_f32(self, code: u8) -> f32 {
        let m = self.mantissa();
        let a = (code & 0x7F) as u32;
        let normal = f32::from_bits((a << (23 - m)) + (((127 - self.bias()) as u32) << 23));
        let subnormal = a as f32 * pow2(1 - self.bias() - m as i32);
        let v = if a < (1 << m) { subnormal } else { normal };
        let (top, inf) = match self {
            Fp8::E4M3 => (a == 0x7F, false),
            Fp8::E5M2 => (a >= 0x7C, a == 0x7C),
        };
        let sign = ((code & 0x80) as u32) << 24;
        match (top, inf) {
            (false, _) => f32::from_bits(v.to_bits() | sign),
            (true, true) => f32::from_bits(f32::INFINITY.to_bits() | sign),
            (true, false) => f32::NAN,
        }
    }

    /// Two values packed as `cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32` packs them: `hi`'s code in
    /// the upper byte, `lo`'s in the lower. The instruction where the kernel's architecture
    /// has it (sm_89 and later), [`Fp8::from_f32`] elsewhere: the same bits.
    #[inline(always)]
    pub fn pack2(self, hi: f32, lo: f32) -> u16 {
        #[cfg(all(target_arch = "nvptx64", target_feature = "sm_89"))]
        {
            let (e4, e5): (u16, u16);
            // SAFETY: register-only conversions, available from sm_89 (PTX ISA 7.8). Both
            // formats, then a select: no branch where the format is chosen at launch.
            unsafe {
                core::arch::asm!(
                    "cvt.rn.satfinite.e4m3x2.f32 {}, {}, {};",
                    out(reg16) e4, in(reg32) hi, in(reg32) lo,
                    options(pure, nomem, nostack, preserves_flags),
                );
                core::arch::asm!(
                    "cvt.rn.satfinite.e5m2x2.f32 {}, {}, {};",
                    out(reg16) e5, in(reg32) hi, in(reg32) lo,
                    options(pure, nomem, nostack, preserves_flags),
                );
            }
            if self == Fp8::E4M3 {
                e4
            } else {
                e5
            }
        }
        #[cfg(not(all(target_arch = "nvptx64", target_feature = "sm_89")))]
        {
            ((self.from_f32(hi) as u16) << 8) | self.from_f32(lo) as u16
        }
    }

    /// The values of two codes as a 16-bit load gives them: the low byte's first. Where the
    /// kernel's architecture has it (sm_89 and later), `cvt.rn.f16x2.{e4m3x2,e5m2x2}` and two
    /// widenings (every value of either format is an f16, and an f16 an f32, exactly), with the
    /// format's instruction alone where the format is known at compile time; [`Fp8::to_f32`]
    /// elsewhere: the same values (NaN codes: NaN).
    #[inline(always)]
    pub fn unpack2(self, pair: u16) -> (f32, f32) {
        #[cfg(all(target_arch = "nvptx64", target_feature = "sm_89"))]
        {
            // One format's conversion, and both halves widened.
            macro_rules! widen2 {
                ($cvt:literal) => {{
                    let (lo, hi): (f32, f32);
                    // SAFETY: register-only conversions, available from sm_89 (PTX ISA 7.8):
                    // the low byte's code in the low half, each half widened.
                    unsafe {
                        core::arch::asm!(
                            "{{ .reg .b32 t; .reg .b16 l, h;",
                            concat!($cvt, " t, {p};"),
                            "mov.b32 {{l, h}}, t;",
                            "cvt.f32.f16 {lo}, l;",
                            "cvt.f32.f16 {hi}, h; }}",
                            p = in(reg16) pair, lo = out(reg32) lo, hi = out(reg32) hi,
                            options(pure, nomem, nostack, preserves_flags),
                        )
                    };
                    (lo, hi)
                }};
            }
            // Both formats, then a select: no branch where the format is chosen at launch.
            let (e4, e5) = (widen2!("cvt.rn.f16x2.e4m3x2"), widen2!("cvt.rn.f16x2.e5m2x2"));
            if self == Fp8::E4M3 {
                e4
            } else {
                e5
            }
        }
        #[cfg(not(all(target_arch = "nvptx64", target_feature = "sm_89")))]
        {
            (self.to_f32(pair as u8), self.to_f32((pair >> 8) as u8))
        }
    }
}

/// 2^-19 per unit of `|x0| + |x1|`: above the error of a fast FP8 quotient (the fast rotation
/// times the scale's reciprocal), 2^-20.5 (|x0| + |x1|) / scale ([`quotient_bound`]).
pub const QUOTIENT_SLACK: f32 = 1.0 / 524_288.0;

/// A bound on the distance between the fast quotient of a rotated pair, `rotate_pair_fast(x0,
/// x1, c, s) * r` (`r` the f32 nearest `1 / scale`), and the correctly rounded quotient of the
/// correctly rounded rotation: [`QUOTIENT_SLACK`] `(|x0| + |x1|) |r|`, plus 2^-140 |r| for the
/// f32 subnormals' steps in the rotation, and at least 2^-126 (the quotient's own subnormal
/// steps). The conversion is monotone, so where `q - bound` and `q + bound` convert to one code,
/// the exact quotient converts to it too (the kernels' FP8 rotations check that per lane, and
/// redo a lane that fails it exactly). NaN inputs give 2^-126; a zero times an infinite
/// reciprocal too.
#[inline(always)]
pub fn quotient_bound(x0: f32, x1: f32, r: f32) -> f32 {
    // 2^-140, an f32 subnormal: 2^9 of their steps.
    const STEPS: f32 = f32::from_bits(1 << 9);
    (fma(abs(x0) + abs(x1), QUOTIENT_SLACK, STEPS) * abs(r)).max(f32::MIN_POSITIVE)
}

/// Whether `scale` cancels out of a fast FP8 quotient of FP8 inputs (the KV shift's): `2^-64 <=
/// scale <= 2^64`. The exact path decodes each code times the scale (an f32 product),
/// rotates, rounds to f32 and divides by the scale (the quotient rounded). A nonzero code's
/// value `x` lies in `[2^-16, 2^16)`, so every product `x * scale` is a normal f32: those three
/// roundings move the quotient at most `3 * 2^-24 (|x0| + |x1|)`, plus `2^-150 / scale <=
/// 2^-86` where the rounded rotation is an f32 subnormal, from the rotation of the codes'
/// values `x0`, `x1` themselves; the fast rotation of those values lies within `2^-22.2 (|x0| +
/// |x1|)` of that. [`quotient_bound`] with a reciprocal of 1, `2^-19 (|x0| + |x1|)` (at least
/// `2^-35` for a pair that is not zero), bounds the sum: the fast rotation is the fast quotient.
/// (A pair of zeros has a bound of 2^-126 about a zero quotient, and takes the exact path.)
/// Any other scale, NaN among them, sends every lane to the exact path.
#[inline(always)]
pub fn scale_cancels(scale: f32) -> bool {
    const LO: f32 = f32::from_bits((127 - 64) << 23);
    const HI: f32 = f32::from_bits((127 + 64) << 23);
    (LO..=HI).contains(&scale)
}

/// `code` (the kept bits) rounded to nearest even by the `drop` bits below it, `rest`.
#[inline(always)]
const fn round(code: u32, rest: u32, drop: u32) -> u32 {
    let half = 1 << (drop - 1);
    if rest > half || (rest == half && code & 1 == 1) {
        code + 1
    } else {
        code
    }
}

/// `2^e` for the exponents of either format's values (`-23 ..= 13`),
/// exactly.
const fn pow2(e: i32) -> f32 {
    f32::from_bits(((e + 127) as u32) << 23)
}
