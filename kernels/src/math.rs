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

/// `a * (b_hi + b_lo) + c * (d_hi + d_lo)` rounded to the nearest f32: the two products'
/// rounding errors kept exactly (FMA two-products, a two-sum of the rounded products), so
/// the sum before the last rounding is within about 2^-47 of the terms of the exact value,
/// and the result is its correct rounding unless the exact value lies that close to a
/// midpoint between two f32.
#[inline(always)]
pub fn dot2_rounded(a: f32, b_hi: f32, b_lo: f32, c: f32, d_hi: f32, d_lo: f32) -> f32 {
    let (p1, e1) = two_prod(a, b_hi);
    let (p2, e2) = two_prod(c, d_hi);
    let (s, e3) = two_sum(p1, p2);
    s + (e3 + ((e1 + e2) + fma(a, b_lo, c * d_lo)))
}

/// [`rotate_pair`] with each output the f32 nearest the exact rotation ([`dot2_rounded`]):
/// the FP8 stores, which convert the rotated f32 once more, start from exactly the value
/// the host's reference computes.
#[inline(always)]
pub fn rotate_pair_rounded(x0: f32, x1: f32, c: (f32, f32), s: (f32, f32)) -> (f32, f32) {
    (dot2_rounded(x0, c.0, c.1, -x1, s.0, s.1), dot2_rounded(x1, c.0, c.1, x0, s.0, s.1))
}

/// `x / b` rounded to the nearest f32, from `r`, the f32 nearest `1 / b`: `q = x r`, then one
/// correction by the exact residual `x - q b` (an FMA), which Markstein's theorem makes the
/// correctly rounded quotient where `b`, `r` and the quotient are normal and the residual does
/// not underflow (`x` above about 2^-100; smaller quotients are far below either FP8 format's
/// smallest subnormal, where only their sign, kept, matters). A zero or non-finite
/// `x r` is returned as it is (the correction would lose a zero's sign or make a NaN of an
/// infinity): the quotient's FP8 code is the same there. Three FMA-class instructions where
/// IEEE division takes a reciprocal, a Newton step and a range check of its own per value.
#[inline(always)]
pub fn div_by(x: f32, b: f32, r: f32) -> f32 {
    let q = x * r;
    let e = fma(-q, b, x);
    let q1 = fma(e, r, q);
    if q1 != 0.0 && abs(q1) < f32::INFINITY {
        q1
    } else {
        q
    }
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

/// The octant of angle `t` (turns, 64-bit fraction) and the angle's distance, in 64-bit
/// fractions of an octant, from the octant's start (even octants) or end (odd ones): reduced
/// to `[0, π/4]`, where the polynomials are accurate.
#[inline(always)]
fn octant(t: u64) -> (u32, u64) {
    let o = (t >> 61) as u32;
    let u = t << 3;
    (o, if o & 1 == 1 { !u } else { u })
}

/// `(sin θ, cos θ)` from `(sin x, cos x)` of the reduced angle of octant `o` ([`octant`]), as
/// f32 pairs. Within the quadrant `q = o / 2`, odd octants measure from the quadrant's end (a
/// swap); then quadrant `q` maps `(s, c)` to `(s, c)`, `(c, -s)`, `(-s, -c)`, `(-c, s)`: a swap
/// when `q` is odd and sign flips, all by selects and sign bits (no branch: the lanes of a warp
/// take different octants).
#[inline(always)]
fn unfold(o: u32, s: (f32, f32), c: (f32, f32)) -> ((f32, f32), (f32, f32)) {
    let q = o >> 1;
    let (s, c) = if (o ^ q) & 1 == 1 { (c, s) } else { (s, c) };
    let (s_neg, c_neg) = ((q >> 1) & 1, (q ^ (q >> 1)) & 1);
    let flip = |v: (f32, f32), neg: u32| {
        (f32::from_bits(v.0.to_bits() ^ (neg << 31)), f32::from_bits(v.1.to_bits() ^ (neg << 31)))
    };
    (flip(s, s_neg), flip(c, c_neg))
}

/// `a + b` as `(s, e)`: `s` the rounded sum, `e` its exact error (Knuth's two-sum).
#[inline(always)]
fn two_sum(a: f32, b: f32) -> (f32, f32) {
    let s = a + b;
    let bb = s - a;
    (s, (a - (s - bb)) + (b - bb))
}

/// `a * b` as `(p, e)`: `p` the rounded product, `e` its exact error (an FMA).
#[inline(always)]
fn two_prod(a: f32, b: f32) -> (f32, f32) {
    let p = a * b;
    (p, fma(a, b, -p))
}

/// `hi + lo` renormalised, for `|hi| >= |lo|`: the f32 nearest the sum, and what it rounds off.
#[inline(always)]
fn fast_two_sum(hi: f32, lo: f32) -> (f32, f32) {
    let s = hi + lo;
    (s, lo - (s - hi))
}

/// Steps of [`sincos_turns_pair`]'s angle table over one octant: entry `j` holds the cos and
/// sin of `j π / 1024`.
pub const ANGLE_STEPS: usize = 256;

/// An entry of the angle table: `[cos_hi, cos_lo, sin_hi, sin_lo]`, each value as the f32 pair
/// `(hi, lo)` of its f64 ([`angle_table`] on the host).
pub type AngleEntry = [f32; 4];

/// The angle table entry [`sincos_turns_pair`] reads for angle `t` (for loading it ahead).
#[inline(always)]
pub fn angle_index(t: u64) -> usize {
    (octant(t).1 >> 56) as usize
}

/// `π/4 · 2^-32` as an f32 pair: the octant's fraction, in units of `2^-32`, to radians.
const PI4_2M32: (f32, f32) = {
    let v = core::f64::consts::FRAC_PI_4 / 4_294_967_296.0;
    let hi = v as f32;
    (hi, (v - hi as f64) as f32)
};

/// `(sin, cos)` of `2π t / 2^64`, each as an f32 pair `(hi, lo)` whose sum is within about
/// `2^-46` of the exact value, in f32 arithmetic only (no FP64: GPUs other than the data-centre
/// ones run it at 1/64 rate); `hi` is the f32 nearest that sum, within half an ulp and `2^-46`
/// of the exact value. `entry(j)` reads the angle table ([`AngleEntry`], `j < ANGLE_STEPS`).
///
/// The angle sum: the reduction to an octant is exact (integer bits of `t`); the octant's top
/// 8 bits pick `A = j π/1024` from the table, the other 56 bits give `B < π/1024`, formed as an
/// f32 pair from exact integer halves. `sin B` and `cos B` need few terms at that size (`B^5/120
/// < 2^-48`, `B^6/720 < 2^-60`); the products and sums whose rounding would show (above about
/// `2^-50`) are carried exactly (FMA two-products, two-sums) and the rest in f32.
#[inline(always)]
pub fn sincos_turns_pair(t: u64, entry: impl Fn(usize) -> AngleEntry) -> ((f32, f32), (f32, f32)) {
    let (o, u) = octant(t);
    let [cah, cal, sah, sal] = entry(angle_index(t));
    // B = r π/4 2^-64, r the low 56 bits: r = r_hi 2^32 + r_lo.
    let r = u & ((1 << 56) - 1);
    let (r_hi, r_lo) = ((r >> 32) as u32 as f32, r as u32 as f32);
    let (bh, be) = two_prod(r_hi, PI4_2M32.0);
    let bl = be + fma(r_hi, PI4_2M32.1, r_lo * (PI4_2M32.0 * f32::from_bits(0x2F80_0000)));
    let (bh, bl) = fast_two_sum(bh, bl);
    // cos B = 1 + d, d = -B^2/2 + B^4/24; sin B = bh + sb_lo.
    let (z, ze) = two_prod(bh, bh);
    let dh = -0.5 * z;
    let dl = fma(-0.5, ze, fma(-bh, bl, z * z * (1.0 / 24.0)));
    let sb_lo = fma(bh * z, fma(z, 1.0 / 120.0, -1.0 / 6.0), fma(-0.5 * z, bl, bl));
    // cos(A + B) = cA + cA d - sA sin B; sin(A + B) = sA + sA d + cA sin B.
    let cos = {
        let (p1, e1) = two_prod(sah, bh);
        let (p2, e2) = two_prod(cah, dh);
        let (h, eh) = two_sum(cah, -p1);
        let (h, eh2) = two_sum(h, p2);
        let small = cal + (fma(cah, dl, fma(cal, dh, -(sah * sb_lo))) - sal * bh);
        fast_two_sum(h, ((eh + eh2) + (e2 - e1)) + small)
    };
    let sin = {
        let (p1, e1) = two_prod(cah, bh);
        let (p2, e2) = two_prod(sah, dh);
        let (h, eh) = two_sum(sah, p1);
        let (h, eh2) = two_sum(h, p2);
        let small = sal + (fma(sah, dl, fma(sal, dh, cah * sb_lo)) + cal * bh);
        fast_two_sum(h, ((eh + eh2) + (e1 + e2)) + small)
    };
    unfold(o, sin, cos)
}

/// `(hi, lo) * (a_hi, a_lo)` as an f32 pair (the attention factor on a [`sincos_turns_pair`]
/// value): the leading product exact, the cross terms in f32.
#[inline(always)]
pub fn mul_pair((hi, lo): (f32, f32), (a_hi, a_lo): (f32, f32)) -> (f32, f32) {
    let (p, e) = two_prod(hi, a_hi);
    fast_two_sum(p, e + fma(hi, a_lo, lo * a_hi))
}

/// The angle table [`sincos_turns_pair`] reads: `cos` and `sin` of `j π/1024` for each
/// `j < ANGLE_STEPS`, evaluated in f64 and split into f32 pairs (within about `2^-52` of the
/// exact values). 4 KiB; the host uploads it once per operation object.
#[cfg(not(target_arch = "nvptx64"))]
pub fn angle_table() -> [AngleEntry; ANGLE_STEPS] {
    core::array::from_fn(|j| {
        let (s, c) = (j as f64 * core::f64::consts::PI / 1024.0).sin_cos();
        let ((ch, cl), (sh, sl)) = (split_f64(c), split_f64(s));
        [ch, cl, sh, sl]
    })
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
