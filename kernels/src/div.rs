//! Division by divisors fixed at launch, for the thread mapping and the views (both sides).

/// Unsigned 32-bit division by a divisor fixed at launch, as a multiply-high, an add and a
/// shift (Granlund and Montgomery, "Division by invariant integers using multiplication",
/// 1994): a hardware-free division costs some twenty dependent instructions, which the
/// few-token kernels, bound by latency, feel. Exact for every `n` and every divisor >= 1.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FastDiv {
    /// The divisor.
    pub divisor: u32,
    /// `floor(2^32 * (2^shift - divisor) / divisor) + 1`.
    pub mul: u32,
    /// `ceil(log2(divisor))`.
    pub shift: u32,
    /// Keeps the layout free of implicit padding.
    pub _pad: u32,
}

impl FastDiv {
    /// The constants for `divisor` (at least 1).
    pub const fn new(divisor: u32) -> Self {
        assert!(divisor >= 1, "FastDiv: the divisor must be at least 1");
        let shift = 32 - (divisor - 1).leading_zeros();
        let mul = ((1u64 << 32) * ((1u64 << shift) - divisor as u64) / divisor as u64 + 1) as u32;
        FastDiv { divisor, mul, shift, _pad: 0 }
    }

    /// `n / divisor`.
    #[inline(always)]
    pub fn div(&self, n: u32) -> u32 {
        let hi = (n as u64 * self.mul as u64) >> 32;
        ((hi + n as u64) >> self.shift) as u32
    }

    /// `(n / divisor, n % divisor)`.
    #[inline(always)]
    pub fn divmod(&self, n: u32) -> (u32, u32) {
        let q = self.div(n);
        (q, n - q * self.divisor)
    }
}

/// A divisor of [`work_item`](crate::params::work_item): plain, or a [`FastDiv`].
pub trait Divisor {
    /// `(n / d, n % d)`.
    fn divmod(&self, n: u32) -> (u32, u32);
}

impl Divisor for u32 {
    #[inline(always)]
    fn divmod(&self, n: u32) -> (u32, u32) {
        (n / self, n % self)
    }
}

impl Divisor for FastDiv {
    #[inline(always)]
    fn divmod(&self, n: u32) -> (u32, u32) {
        FastDiv::divmod(self, n)
    }
}
