//! The f64 CPU reference the tests compare the kernels with, and the seeded input generator
//! shared with the golden-data script (`tests/data/make_golden.py`).

use rope_cuda_kernels::math::{inv_freq, turns_at, turns_of, Turns};

use crate::config::{Direction, Mrope, RopeStyle};

/// RoPE of one row (one head of one token) in f64, computed from scratch.
///
/// Pair `i < rotary_dim / 2` turns by `position * inv_freq[i]` (negated for
/// [`Direction::Inverse`]), `inv_freq[i] = 1 / base^(2i / rotary_dim)`; elements past
/// `rotary_dim` are copied.
///
/// ```
/// use rope_cuda::reference::rope_row;
/// use rope_cuda::{Direction, RopeStyle};
/// let x = [1.0, 0.0, 0.0, 1.0];
/// let y = rope_row(&x, 2.0, 10_000.0, 4, RopeStyle::GptJ, Direction::Forward);
/// // Pair 0 turns by 2 rad: (cos 2, sin 2).
/// assert!((y[0] - 2f64.cos()).abs() < 1e-15 && (y[1] - 2f64.sin()).abs() < 1e-15);
/// let back = rope_row(&y, 2.0, 10_000.0, 4, RopeStyle::GptJ, Direction::Inverse);
/// assert!(back.iter().zip(x).all(|(a, b)| (a - b).abs() < 1e-15));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn rope_row(
    x: &[f64],
    position: f64,
    base: f64,
    rotary_dim: usize,
    style: RopeStyle,
    direction: Direction,
) -> Vec<f64> {
    let freqs: Vec<f64> = (0..rotary_dim / 2).map(|i| inv_freq(base, rotary_dim, i)).collect();
    rope_row_freqs(x, position, &freqs, 1.0, style, direction)
}

/// The RMS norm of one head in f64: `x_i · r · (w_i + offset)`, `r = 1 / sqrt(mean(x²) + eps)`
/// (each weight 1 without `weight`, the offset then unused; with an offset, `w_i + offset`
/// rounded to f32, as the kernels and transformers compute Gemma's `1.0 + weight.float()`):
/// the QK-norm ([`QkNorm`](crate::QkNorm)) the fused append applies before the rotation.
///
/// ```
/// use rope_cuda::reference::rms_norm_row;
/// // mean(x²) = 12.5, eps 0: r = 1 / sqrt(12.5); Gemma's (1 + w) with w = (1, 0).
/// let y = rms_norm_row(&[3.0, 4.0], Some(&[1.0, 0.0]), 1.0, 0.0);
/// let r = 1.0 / 12.5f64.sqrt();
/// assert!((y[0] - 6.0 * r).abs() < 1e-15 && (y[1] - 4.0 * r).abs() < 1e-15);
/// // 1 + 2^-30 is 1 in f32, as in the kernels and in transformers.
/// assert_eq!(rms_norm_row(&[1.0], Some(&[2f64.powi(-30)]), 1.0, 0.0), [1.0]);
/// ```
pub fn rms_norm_row(x: &[f64], weight: Option<&[f64]>, offset: f64, eps: f64) -> Vec<f64> {
    let mean = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let r = 1.0 / (mean + eps).sqrt();
    let w = |i: usize| weight.map_or(1.0, |w| if offset == 0.0 { w[i] } else { (w[i] as f32 + offset as f32) as f64 });
    x.iter().enumerate().map(|(i, v)| v * r * w(i)).collect()
}

/// [`rope_row`] for any frequencies (one per pair, `2 * inv_freq.len()` rotary dims) with
/// cos and sin multiplied by `attention` (see [`crate::RopeScaling::frequencies`]).
///
/// ```
/// use rope_cuda::reference::rope_row_freqs;
/// use rope_cuda::{Direction, RopeStyle};
/// // NeoX pairs (x[0], x[1]) with frequency 0.5, and cos and sin scaled by 2.
/// let y = rope_row_freqs(&[1.0, 0.0], 1.0, &[0.5], 2.0, RopeStyle::NeoX, Direction::Forward);
/// assert!((y[0] - 2.0 * 0.5f64.cos()).abs() < 1e-15 && (y[1] - 2.0 * 0.5f64.sin()).abs() < 1e-15);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn rope_row_freqs(
    x: &[f64],
    position: f64,
    inv_freq: &[f64],
    attention: f64,
    style: RopeStyle,
    direction: Direction,
) -> Vec<f64> {
    rope_row_streams(x, [position; 3], inv_freq, attention, style, None, direction)
}

/// [`rope_row_freqs`] for multimodal RoPE: pair `i` turns by `positions[mrope.stream(i)] *
/// inv_freq[i]` (every pair by `positions[0]` without `mrope`).
///
/// ```
/// use rope_cuda::reference::rope_row_streams;
/// use rope_cuda::{Direction, Mrope, RopeStyle};
/// // Two pairs, one temporal and one height: positions (t, h, w) = (1, 2, 3).
/// let m = Mrope::new([1, 1, 0], false);
/// let y = rope_row_streams(&[1.0, 1.0, 0.0, 0.0], [1.0, 2.0, 3.0], &[1.0, 1.0], 1.0, RopeStyle::NeoX, Some(m), Direction::Forward);
/// assert!((y[1] - 2f64.cos()).abs() < 1e-15 && (y[3] - 2f64.sin()).abs() < 1e-15);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn rope_row_streams(
    x: &[f64],
    positions: [f64; 3],
    inv_freq: &[f64],
    attention: f64,
    style: RopeStyle,
    mrope: Option<Mrope>,
    direction: Direction,
) -> Vec<f64> {
    let half = inv_freq.len();
    let sign = if direction == Direction::Inverse { -1.0 } else { 1.0 };
    let mut out = x.to_vec();
    for (i, &f) in inv_freq.iter().enumerate() {
        let position = positions[mrope.map_or(0, |m| m.stream(i))];
        let (s, c) = sin_cos(position, f);
        let (s, c) = (sign * attention * s, attention * c);
        let (a, b) = match style {
            RopeStyle::NeoX => (i, i + half),
            RopeStyle::GptJ => (2 * i, 2 * i + 1),
        };
        out[a] = x[a] * c - x[b] * s;
        out[b] = x[b] * c + x[a] * s;
    }
    out
}

/// `(sin, cos)` of `position * f` to about `2^-51` at every integer position below `2^32`:
/// the product is formed exactly and reduced modulo `2π` in exact turns (a 96-bit frequency in
/// turns, a 256-bit `1 / 2π`), and only the reduced angle goes through f64 `sin_cos`. (A plain
/// f64 product at position `2^31` is already about `2^-22` rad off.) Other positions take the
/// plain f64 product. `tests/angles.rs` checks it against an arbitrary-precision reference.
///
/// ```
/// use rope_cuda::reference::sin_cos;
/// let (s, c) = sin_cos(3.0, 0.5);
/// assert!((s - 1.5f64.sin()).abs() < 1e-15 && (c - 1.5f64.cos()).abs() < 1e-15);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn sin_cos(position: f64, f: f64) -> (f64, f64) {
    if (0.0..4_294_967_296.0).contains(&position) && position.fract() == 0.0 {
        if let Some(r) = turns_of(f.abs()) {
            return sin_cos_turns(position as u32, r, f < 0.0);
        }
    }
    (position * f).sin_cos()
}

/// `(sin, cos)` of position `p` times the frequency whose turns are `r` ([`turns_of`] of its
/// magnitude; `negative` for a negative frequency): [`sin_cos`] with the turns computed once
/// per frequency (the host's tables call it for every row).
pub(crate) fn sin_cos_turns(p: u32, r: Turns, negative: bool) -> (f64, f64) {
    let t = turns_at(p, r);
    // Signed turns: the angle in [-π, π), where the f64 product rounds least.
    let (s, c) = (t as i64 as f64 * (std::f64::consts::TAU / 18_446_744_073_709_551_616.0)).sin_cos();
    (if negative { -s } else { s }, c)
}

/// Rotate-half (NeoX) RoPE of one row in f64: `out = x * cos + rotate_half(x) * sin`, with
/// the angle of pair `i` equal to `position * inv_freq[i]`, `inv_freq[i] = 1 / base^(2i / D)`
/// and `D = x.len()`. Every value is computed from scratch in f64.
///
/// ```
/// let y = rope_cuda::reference::rope_neox_row(&[3.0, 4.0], 0.0, 10_000.0);
/// assert_eq!(y, vec![3.0, 4.0]); // position 0
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn rope_neox_row(x: &[f64], position: f64, base: f64) -> Vec<f64> {
    rope_row(x, position, base, x.len(), RopeStyle::NeoX, Direction::Forward)
}

/// What comparing kernel outputs with the f64 reference needs of an element type.
pub trait RefElem: crate::operand::CustElement + Copy + Default + std::fmt::Debug {
    /// `f32`, `f16` or `bf16`.
    const NAME: &'static str;
    /// A NaN bit pattern no arithmetic produces.
    const POISON_BITS: u32;
    /// The element nearest `v`.
    fn from_f32(v: f32) -> Self;
    /// The exact value.
    fn to_f64(self) -> f64;
    /// The correctly rounded (to nearest, ties to even) element of `v`.
    fn round(v: f64) -> Self;
    /// The bit pattern.
    fn bits(self) -> u32;
    /// The element of bit pattern `b` (low bits).
    fn from_bits(b: u32) -> Self;
    /// Distance in units in the last place (through the ordered integer line).
    fn ulps(self, other: Self) -> u64;
}

/// The inverse of [`ordered`].
fn from_ordered(o: i64, width: u32) -> u32 {
    let sign = 1u32 << (width - 1);
    if o < 0 {
        sign | (-o) as u32
    } else {
        o as u32
    }
}

/// The correctly rounded 16-bit value of `v`, from `approx` (at most one step off): the
/// nearest of its neighbours, ties to the even bit pattern.
fn round16(v: f64, approx: u32, to_f64: impl Fn(u32) -> f64) -> u32 {
    let o = ordered(approx, 16);
    let mut best = approx;
    for cand in [from_ordered(o - 1, 16), from_ordered(o + 1, 16)] {
        let (d_best, d_cand) = ((to_f64(best) - v).abs(), (to_f64(cand) - v).abs());
        if d_cand < d_best || (d_cand == d_best && cand & 1 == 0) {
            best = cand;
        }
    }
    best
}

fn ordered(bits: u32, width: u32) -> i64 {
    let sign = 1u32 << (width - 1);
    if bits & sign != 0 {
        -((bits & (sign - 1)) as i64)
    } else {
        bits as i64
    }
}

impl RefElem for f32 {
    const NAME: &'static str = "f32";
    const POISON_BITS: u32 = 0x7FA5_A5A5;
    fn from_f32(v: f32) -> Self {
        v
    }
    fn to_f64(self) -> f64 {
        self as f64
    }
    fn round(v: f64) -> Self {
        v as f32
    }
    fn bits(self) -> u32 {
        self.to_bits()
    }
    fn from_bits(b: u32) -> Self {
        f32::from_bits(b)
    }
    fn ulps(self, other: Self) -> u64 {
        ordered(self.to_bits(), 32).abs_diff(ordered(other.to_bits(), 32))
    }
}

/// [`RefElem`] for a 16-bit `half` type, with its name and a NaN poison pattern.
macro_rules! ref_elem_16 {
    ($t:ty, $name:literal, $poison:literal) => {
        impl RefElem for $t {
            const NAME: &'static str = $name;
            const POISON_BITS: u32 = $poison;
            fn from_f32(v: f32) -> Self {
                <$t>::from_f32(v)
            }
            fn to_f64(self) -> f64 {
                <$t>::to_f64(self)
            }
            fn round(v: f64) -> Self {
                let approx = <$t>::from_f64(v).to_bits() as u32;
                <$t>::from_bits(round16(v, approx, |b| <$t>::from_bits(b as u16).to_f64()) as u16)
            }
            fn bits(self) -> u32 {
                self.to_bits() as u32
            }
            fn from_bits(b: u32) -> Self {
                <$t>::from_bits(b as u16)
            }
            fn ulps(self, other: Self) -> u64 {
                ordered(self.to_bits() as u32, 16).abs_diff(ordered(other.to_bits() as u32, 16))
            }
        }
    };
}

ref_elem_16!(half::f16, "f16", 0x7DA5);
ref_elem_16!(half::bf16, "bf16", 0x7FA5);

#[doc(hidden)]
/// The SplitMix64 finaliser.
pub fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[doc(hidden)]
/// Element `index` of seeded test tensor `tensor`: uniform in [-1, 1) on a grid of 2^-23, so
/// exactly representable in f32 (and so equal in the f64 golden data and the f32 kernels).
pub fn uniform(seed: u64, tensor: u64, index: u64) -> f32 {
    let key = splitmix64(seed ^ (tensor << 32)).wrapping_add(index);
    let bits = splitmix64(key) >> 40; // 24 bits
    (bits as f64 * (1.0 / (1u64 << 23) as f64) - 1.0) as f32
}

#[doc(hidden)]
/// `n` consecutive elements of seeded test tensor `tensor`.
pub fn uniform_vec(seed: u64, tensor: u64, n: usize) -> Vec<f32> {
    (0..n as u64).map(|i| uniform(seed, tensor, i)).collect()
}

/// `‖out − ref‖₂ / ‖ref‖₂`, in f64. A NaN in `out` gives NaN, which fails any bound.
///
/// # Panics
/// If the lengths differ.
///
/// ```
/// let e = rope_cuda::reference::relative_error(&[1.0, 2.0], &[1.0, 2.0 + 1e-3]);
/// assert!((e - 1e-3 / (1.0 + 2.001f64.powi(2)).sqrt()).abs() < 1e-12);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn relative_error(out: &[f32], reference: &[f64]) -> f64 {
    assert_eq!(out.len(), reference.len(), "relative_error: lengths differ");
    let (mut num, mut den) = (0.0, 0.0);
    for (&o, &r) in out.iter().zip(reference) {
        num += (o as f64 - r) * (o as f64 - r);
        den += r * r;
    }
    (num / den).sqrt()
}
