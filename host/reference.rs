//! The f64 CPU reference the tests compare the kernels with, and the seeded input generator
//! shared with the golden-data script (`tests/data/make_golden.py`).

use rope_cuda_kernels::math::inv_freq;

/// Rotate-half (NeoX) RoPE of one row in f64: `out = x * cos + rotate_half(x) * sin`, with
/// the angle of pair `i` equal to `position * inv_freq[i]`, `inv_freq[i] = 1 / base^(2i / D)`
/// and `D = x.len()`. Every value is computed from scratch in f64.
pub fn rope_neox_row(x: &[f64], position: f64, base: f64) -> Vec<f64> {
    let d = x.len();
    let half = d / 2;
    let mut out = vec![0.0; d];
    for i in 0..half {
        let (s, c) = (position * inv_freq(base, d, i)).sin_cos();
        out[i] = x[i] * c - x[i + half] * s;
        out[i + half] = x[i + half] * c + x[i] * s;
    }
    out
}

/// The SplitMix64 finaliser.
pub fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Element `index` of seeded test tensor `tensor`: uniform in [-1, 1) on a grid of 2^-23, so
/// exactly representable in f32 (and so equal in the f64 golden data and the f32 kernels).
pub fn uniform(seed: u64, tensor: u64, index: u64) -> f32 {
    let key = splitmix64(seed ^ (tensor << 32)).wrapping_add(index);
    let bits = splitmix64(key) >> 40; // 24 bits
    (bits as f64 * (1.0 / (1u64 << 23) as f64) - 1.0) as f32
}

/// `n` consecutive elements of seeded test tensor `tensor`.
pub fn uniform_vec(seed: u64, tensor: u64, n: usize) -> Vec<f32> {
    (0..n as u64).map(|i| uniform(seed, tensor, i)).collect()
}

/// `‖out − ref‖₂ / ‖ref‖₂`, in f64. A NaN in `out` gives NaN, which fails any bound.
///
/// # Panics
/// If the lengths differ.
pub fn relative_error(out: &[f32], reference: &[f64]) -> f64 {
    assert_eq!(out.len(), reference.len(), "relative_error: lengths differ");
    let (mut num, mut den) = (0.0, 0.0);
    for (&o, &r) in out.iter().zip(reference) {
        num += (o as f64 - r) * (o as f64 - r);
        den += r * r;
    }
    (num / den).sqrt()
}
