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
    /// `2^(23 - p)`, `p` the format's significand bits: the fast result `y` is safe when
    /// `|y| * scale >= |x0| + |x1|`. With cos and sin computed in the kernel (each within
    /// `1.5 2^-24` of the exact value, `tests/angles.rs`) the fast error is at most about
    /// `2^-22.9 (|x0| + |x1|) + 2^-24 |y|`, which stays below one ulp of `y`, `2^(1 - p) |y|`,
    /// for `|x0| + |x1| <= 2^(23.9 - p) |y|`; `2^(23 - p)` leaves a factor of about 2.
    pub scale: f32,
    /// Results below this (the format's smallest normal) are always recomputed.
    pub min_normal: f32,
}

impl Narrow {
    /// bfloat16: 8 significand bits.
    pub const BF16: Narrow = Narrow { scale: 32_768.0, min_normal: 0.0 };
    /// binary16: 11 significand bits.
    pub const F16: Narrow = Narrow { scale: 4_096.0, min_normal: 6.103_515_6e-5 };

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

/// A frequency in turns per position: `frac(inv_freq / 2π)` as a 96-bit binary fraction,
/// most significant word first (`r[0] 2^-32 + r[1] 2^-64 + r[2] 2^-96`). The host computes it
/// once per pair from the f64 frequency and a 256-bit `1 / 2π`
/// ([`crate::math::turns_of`] on the host).
pub type Turns = [u32; 3];

/// `frac(p * r)`, the angle of position `p` in turns, as a 64-bit binary fraction: the exact
/// product of the integer position and the 96-bit frequency, its whole turns dropped. Integer
/// arithmetic only (three 32 x 32 -> 64-bit products). Its error is below `2^-64 + p 2^-96`
/// turns (the dropped low bits, and `r`'s own truncation): under `2^-63` turns, `2^-60.3` rad,
/// for every `p < 2^31`.
#[inline(always)]
pub fn turns_at(p: u32, r: Turns) -> u64 {
    let (lo, mid, hi) = (p as u64 * r[2] as u64, p as u64 * r[1] as u64, p as u64 * r[0] as u64);
    // In units of 2^-96 the product is hi 2^64 + mid 2^32 + lo; its fraction's top 64 bits are
    // (hi 2^32 + mid + lo / 2^32) mod 2^64.
    let a = (lo >> 32) + (mid & 0xFFFF_FFFF);
    let b = (mid >> 32) + hi + (a >> 32);
    (b << 32) | (a & 0xFFFF_FFFF)
}

/// `π/4 · 2^-64` (f32): turns an octant's 64-bit fraction into radians.
const PI4_2M64_F32: f32 = f32::from_bits(0x1F49_0FDB);
/// `π/4 · 2^-64` (f64).
const PI4_2M64_F64: f64 = f64::from_bits(0x3BE9_21FB_5444_2D18);

/// The octant of angle `t` (turns, 64-bit fraction) and the angle's distance, in 64-bit
/// fractions of an octant, from the octant's start (even octants) or end (odd ones): reduced
/// to `[0, π/4]`, where the polynomials are accurate.
#[inline(always)]
fn octant(t: u64) -> (u32, u64) {
    let o = (t >> 61) as u32;
    let u = t << 3;
    (o, if o & 1 == 1 { !u } else { u })
}

/// `(sin θ, cos θ)` from `(sin x, cos x)` of the reduced angle of octant `o` ([`octant`]).
#[inline(always)]
fn unfold<T: core::ops::Neg<Output = T>>(o: u32, s: T, c: T) -> (T, T) {
    // Within the quadrant: odd octants measure from the quadrant's end.
    let (s, c) = if o & 1 == 1 { (c, s) } else { (s, c) };
    match (o >> 1) & 3 {
        0 => (s, c),
        1 => (c, -s),
        2 => (-s, -c),
        _ => (-c, s),
    }
}

/// `(sin, cos)` of `2π t / 2^64` in f32, for the fast rotation: each within about two units
/// in the last place (the reduction is exact; the reduced angle carries about 1.5 ulp, the
/// polynomials, Cephes' `sinf`/`cosf` on `[0, π/4]`, about one).
#[inline(always)]
pub fn sincos_turns(t: u64) -> (f32, f32) {
    let (o, u) = octant(t);
    let x = u as f32 * PI4_2M64_F32;
    let z = x * x;
    let s = fma(x * z, fma(fma(-1.951_529_6e-4, z, 8.332_161e-3), z, -1.666_665_5e-1), x);
    let c = fma(z * z, fma(fma(2.443_315_7e-5, z, -1.388_731_6e-3), z, 4.166_664_6e-2), fma(-0.5, z, 1.0));
    unfold(o, s, c)
}

/// `(sin, cos)` of `2π t / 2^64` in f64 (Taylor series of the reduced angle to `x^17` and
/// `x^16`), each within about `2^-52`: the values the exact rotation splits into f32 pairs.
#[inline(always)]
pub fn sincos_turns_f64(t: u64) -> (f64, f64) {
    let (o, u) = octant(t);
    let x = u as f64 * PI4_2M64_F64;
    let z = x * x;
    // 1/k! for the odd (sine) and even (cosine) terms, highest first.
    const S: [f64; 8] = [
        1.0 / 355_687_428_096_000.0,
        -1.0 / 1_307_674_368_000.0,
        1.0 / 6_227_020_800.0,
        -1.0 / 39_916_800.0,
        1.0 / 362_880.0,
        -1.0 / 5_040.0,
        1.0 / 120.0,
        -1.0 / 6.0,
    ];
    const C: [f64; 8] = [
        1.0 / 20_922_789_888_000.0,
        -1.0 / 87_178_291_200.0,
        1.0 / 479_001_600.0,
        -1.0 / 3_628_800.0,
        1.0 / 40_320.0,
        -1.0 / 720.0,
        1.0 / 24.0,
        -0.5,
    ];
    let (mut ps, mut pc) = (0.0f64, 0.0f64);
    let mut k = 0;
    while k < 8 {
        ps = ps * z + S[k];
        pc = pc * z + C[k];
        k += 1;
    }
    unfold(o, x + x * z * ps, 1.0 + z * pc)
}

/// Splits `v` into `(hi, lo)`: `hi` the f32 nearest `v`, `lo` the f32 nearest `v - hi`.
#[inline(always)]
pub fn split(v: f64) -> (f32, f32) {
    let hi = v as f32;
    (hi, (v - hi as f64) as f32)
}

/// `frac(f / 2π)` as [`Turns`], for a frequency `0 <= f < 2^32` (else `None`): the f64 value
/// times a 256-bit `1 / 2π`, exactly, its whole turns dropped, truncated to 96 bits (an error
/// below `2^-96` turns).
#[cfg(not(target_arch = "nvptx64"))]
pub fn turns_of(f: f64) -> Option<Turns> {
    if !(f.is_finite() && (0.0..4_294_967_296.0).contains(&f)) {
        return None;
    }
    if f == 0.0 {
        return Some([0; 3]);
    }
    // f = m 2^e, m a 53-bit integer.
    let bits = f.to_bits();
    let exp = ((bits >> 52) & 0x7FF) as i32;
    let (m, e) =
        if exp == 0 { (bits & ((1 << 52) - 1), -1074) } else { (bits & ((1 << 52) - 1) | 1 << 52, exp - 1075) };
    // m * C as little-endian u32 limbs; C = INV_2PI 2^-256.
    let mut prod = [0u64; 10];
    for (k, &w) in INV_2PI.iter().rev().enumerate() {
        let t = m as u128 * w as u128;
        let mut carry = t;
        let mut j = k;
        while carry != 0 {
            let sum = prod[j] as u128 + (carry & 0xFFFF_FFFF);
            prod[j] = (sum & 0xFFFF_FFFF) as u64;
            carry = (carry >> 32) + (sum >> 32);
            j += 1;
        }
    }
    // f / 2π = prod 2^(e - 256); its fraction's top 96 bits: bits [160 - e, 256 - e) of prod.
    let shift = 160 - e;
    let bit = |i: i32| -> u32 {
        if !(0..320).contains(&i) {
            0
        } else {
            ((prod[(i / 32) as usize] >> (i % 32)) & 1) as u32
        }
    };
    let mut r = [0u32; 3];
    for (w, word) in r.iter_mut().enumerate() {
        for b in 0..32 {
            // Word 0 holds the most significant bits.
            let i = shift + 96 - 32 * w as i32 - 32 + b;
            *word |= bit(i) << b;
        }
    }
    Some(r)
}

/// `1 / 2π` as a 256-bit binary fraction, most significant word first (`2 / π`'s well-known
/// digits, `0xA2F9836E 4E441529 …`, shifted right by two bits); `tests/math.rs` checks it
/// against an arbitrary-precision `π`.
#[cfg(not(target_arch = "nvptx64"))]
pub const INV_2PI: [u32; 8] =
    [0x28BE60DB, 0x9391054A, 0x7F09D5F4, 0x7D4D3770, 0x36D8A566, 0x4F10E410, 0x7F9458EA, 0xF7AEF158];
