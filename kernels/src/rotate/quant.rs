//! Quantization of FP8 outputs: a head's scale ([`Scale`]) and the stores' quotient
//! ([`Quant`]).

use crate::fp8::Fp8;
use crate::gpu::{load_table, Io};
use crate::math::div_by;

/// A head's scale and its reciprocal, the f32 nearest `1 / s`.
#[derive(Clone, Copy)]
pub(crate) struct Scale {
    pub s: f32,
    pub r: f32,
}

impl Scale {
    /// For outputs that are not FP8 (never divided by).
    const ONE: Scale = Scale { s: 1.0, r: 1.0 };

    #[inline(always)]
    pub(super) fn of(s: f32) -> Scale {
        Scale { s, r: 1.0 / s }
    }

    /// Whether the scale and its reciprocal are normal ([`div_by`] then gives the quotient).
    #[inline(always)]
    pub(super) fn normal(self) -> bool {
        self.s.is_normal() && self.r.is_normal()
    }

    /// Whether a rotation of FP8 codes may skip the scale on its fast path
    /// ([`crate::fp8::scale_cancels`]).
    #[inline(always)]
    pub(super) fn codes_fast(self) -> bool {
        crate::fp8::scale_cancels(self.s)
    }

    /// `x / s`, the quotient rounded to the nearest f32 ([`div_by`] where the scale and its
    /// reciprocal are normal, the IEEE division otherwise, out of line).
    #[inline(always)]
    pub fn div(self, x: f32) -> f32 {
        if self.normal() {
            div_by(x, self.s, self.r)
        } else {
            divide(x, self.s)
        }
    }
}

/// `x / s`, the IEEE division: for scales whose reciprocal is not normal (one copy of its code
/// in each kernel, not one per value).
#[inline(never)]
pub(super) fn divide(x: f32, s: f32) -> f32 {
    x / s
}

/// How the stores of FP8 outputs convert: the format, and each head's scale (the code stored
/// is that of `x / scale`, the quotient rounded to f32 first). Outputs of other types ignore
/// it ([`Quant::NONE`]).
#[derive(Clone, Copy)]
pub(crate) struct Quant {
    /// The format.
    pub fmt: Fp8,
    /// The scale of the rows' first head; head `h`'s is `h * step` f32 further (0: one for
    /// every head).
    scales: *const f32,
    step: usize,
    /// The first head's, loaded when the quantizer is made (early, off the stores' path; its
    /// reciprocal is taken where it is used, so that nothing waits on the load before then).
    first: f32,
}

impl Quant {
    /// For outputs that are not FP8.
    pub const NONE: Quant = Quant { fmt: Fp8::E4M3, scales: core::ptr::null(), step: 0, first: 1.0 };

    /// The quantizer of rows whose first head's scale is at `scales`, the next heads' `step`
    /// f32 apart; loads the first where `W` stores FP8.
    ///
    /// # Safety
    /// Where `W` stores FP8: `scales` is a global address valid for the first head's f32, not
    /// written during the kernel.
    #[inline(always)]
    pub unsafe fn new<W: Io>(fmt: Fp8, scales: *const f32, step: usize) -> Quant {
        // SAFETY: the caller's contract.
        let first = if W::FP8 { unsafe { load_table(scales, 1)[0] } } else { 1.0 };
        Quant { fmt, scales, step, first }
    }

    /// This quantizer with format `fmt` (a constant where the caller names one: a copy of the
    /// rotation per format, each converting with its own instructions alone).
    #[inline(always)]
    pub fn with_fmt(self, fmt: Fp8) -> Quant {
        Quant { fmt, ..self }
    }

    /// The format and head `h`'s scale where `W` stores FP8 (read from memory at launch, so an
    /// engine updates it in place).
    ///
    /// # Safety
    /// Where `W` stores FP8, `scales` is valid for head `h`'s f32 and not written during the
    /// kernel.
    #[inline(always)]
    pub(super) unsafe fn of<W: Io>(&self, h: usize) -> (Fp8, Scale) {
        if !W::FP8 {
            return (self.fmt, Scale::ONE);
        }
        if h == 0 || self.step == 0 {
            return (self.fmt, Scale::of(self.first));
        }
        // SAFETY: the caller's contract.
        (self.fmt, Scale::of(unsafe { load_table(self.scales.wrapping_add(h * self.step), 1)[0] }))
    }
}
