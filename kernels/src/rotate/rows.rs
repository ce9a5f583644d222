//! The rows one thread moves ([`Rows`]): its heads' addresses, and the copy of the dims
//! that are not rotated.

use crate::fp8::Fp8;
use crate::gpu::{unrolled, Bits, Io};
use crate::math::div_by;
use crate::norm::NormLane;

use super::quant::{divide, Quant, Scale};

/// The rows one thread rotates: `count` heads of one token, head `h` at byte offset
/// `h * step` from the first.
#[derive(Clone, Copy)]
pub(crate) struct Rows {
    pub src: *const u8,
    pub dst: *mut u8,
    pub src_step: usize,
    pub dst_step: usize,
    pub count: usize,
}

impl Rows {
    /// The source address of byte `byte` of head `h`.
    #[inline(always)]
    pub fn src(&self, h: usize, byte: usize) -> *const u8 {
        self.src.wrapping_add(h * self.src_step + byte)
    }

    /// The destination address of byte `byte` of head `h`.
    #[inline(always)]
    pub fn dst(&self, h: usize, byte: usize) -> *mut u8 {
        self.dst.wrapping_add(h * self.dst_step + byte)
    }

    /// Copies the elements at byte `at` of every head's source (loaded by `C`; stored by `D`
    /// at the same element of the destination: the bits where both are of one type, else each
    /// value rounded to `D`'s type; FP8: divided by the head's scale, then converted, as
    /// `quant` says), given head 0's (`first`, loaded early); the next head's load goes ahead
    /// of each store.
    ///
    /// # Safety
    /// As [`Io::load_raw`] and [`Io::store_raw`] for every head's source and destination;
    /// `quant` as [`Quant::scale`] for every head, where `D` stores FP8.
    #[inline(always)]
    pub unsafe fn copy<C: Io, D: Io>(&self, first: Bits, at: usize, quant: Quant, norm: Option<&NormLane>) {
        const { assert!(C::E == D::E) };
        let to = if C::SIZE == D::SIZE { at } else { at / C::SIZE * D::SIZE };
        let mut cur = first;
        for h in 0..self.count {
            // SAFETY: the caller's contract, for heads `h` and `h + 1 < count`.
            let next = if h + 1 < self.count { unsafe { C::load_raw(self.src(h + 1, at)) } } else { cur };
            // SAFETY: the caller's contract: a norm's weights lie as the heads' elements do.
            let head = unsafe { NormLane::head_copy::<C>(norm, h, at) };
            // SAFETY: as above.
            unsafe {
                D::store_raw(
                    self.dst(h, to),
                    convert::<C, D>(cur, quant.of::<D>(h), (head.as_ref(), NormLane::r_of_head(norm, h))),
                )
            };
            cur = next;
        }
    }
}

/// Elements loaded by `C` as `D` stores them: the same bits where the types agree, else each
/// value rounded to `D`'s type (FP8: its quotient by the scale, in format `fmt`). One test of
/// the scale per access, not one branch per value: [`div_by`] where the scale and its
/// reciprocal are normal, else the IEEE division, out of line ([`divide`]).
#[inline(always)]
fn convert<C: Io, D: Io>(raw: Bits, (fmt, scale): (Fp8, Scale), (norm, r): (Option<&NormLane>, f32)) -> Bits {
    if !D::FP8 && C::DTYPE as u8 == D::DTYPE as u8 && !norm.is_some_and(|n| n.on) {
        return raw;
    }
    let mut xs = [0.0f32; 8];
    unrolled(C::E, |i| xs[i] = NormLane::get_of(norm, i, 0, C::get(&raw, i), r));
    if D::FP8 {
        xs = match scale.normal() {
            true => xs.map(|x| div_by(x, scale.s, scale.r)),
            false => xs.map(|x| divide(x, scale.s)),
        };
    }
    let (mut out, mut pending) = ([0u32; 4], 0.0f32);
    unrolled(C::E, |i| D::put(&mut out, &mut pending, i, xs[i], fmt));
    out
}
