//! FP8 elements on the host: the codes of a KV cache kept in E4M3 or E5M2
//! ([`Rope::append_kv`](crate::Rope::append_kv) with [`KvAppend::scales`](crate::KvAppend::scales)),
//! and the conversions the kernels make, for tests and for engines that fill or read such a
//! cache on the host.

use cust::memory::DeviceCopy;
use rope_cuda_kernels::fp8::Fp8;

macro_rules! fp8_element {
    ($(#[$doc:meta])* $name:ident => $fmt:ident) => {
        $(#[$doc])*
        #[repr(transparent)]
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
        pub struct $name(pub u8);

        impl $name {
            /// The format.
            pub const FORMAT: Fp8 = Fp8::$fmt;

            /// `x` rounded to nearest even, finite values past the largest finite and
            /// infinities saturated to ± the largest finite, NaN to the code `0x7F`: the
            /// kernels' conversion (sm_89's `cvt.rn.satfinite`), bit for bit.
            pub const fn from_f32(x: f32) -> Self {
                $name(Fp8::$fmt.from_f32(x))
            }

            /// The value of the code.
            pub const fn to_f32(self) -> f32 {
                Fp8::$fmt.to_f32(self.0)
            }
        }

        impl crate::operand::sealed::Sealed for $name {}

        // SAFETY: one byte, every bit pattern valid, no pointers.
        unsafe impl DeviceCopy for $name {}
    };
}

fp8_element!(
    /// An FP8 E4M3 code (`float8_e4m3fn`: no infinities, largest finite 448), the element of
    /// an E4M3 cache ([`DType::E4M3`](crate::DType::E4M3)).
    F8E4M3 => E4M3
);
fp8_element!(
    /// An FP8 E5M2 code (largest finite 57344), the element of an E5M2 cache
    /// ([`DType::E5M2`](crate::DType::E5M2)).
    F8E5M2 => E5M2
);

crate::operand::elements!(F8E4M3 => E4M3, F8E5M2 => E5M2);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_saturate() {
        assert_eq!(F8E4M3::from_f32(448.0).0, 0x7E);
        assert_eq!(F8E4M3::from_f32(1e9).0, 0x7E);
        assert_eq!(F8E4M3::from_f32(-f32::INFINITY).0, 0xFE);
        assert_eq!(F8E5M2::from_f32(57344.0).to_f32(), 57344.0);
        assert_eq!(F8E5M2::from_f32(f32::INFINITY).0, 0x7B);
        assert_eq!(F8E4M3::from_f32(f32::NAN).0, 0x7F);
        for c in 0..=255u8 {
            let v = F8E4M3(c).to_f32();
            if !v.is_nan() {
                assert_eq!(F8E4M3::from_f32(v).0, c, "{c:#04x}");
            }
        }
    }
}
