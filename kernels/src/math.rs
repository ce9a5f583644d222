//! Arithmetic shared by the kernels and the host (table builder, CPU reference).

/// Rotates the pair `(x0, x1)` by the angle whose cosine and sine are `c` and `s`.
///
/// Rotate-half (NeoX) style pairs element `i` with `i + rotary_dim / 2`; interleaved (GPT-J)
/// style pairs `2i` with `2i + 1`. Either way the pair turns the same way:
/// `(x0 cos - x1 sin, x1 cos + x0 sin)`, which is `x * cos + rotate_half(x) * sin`.
#[inline(always)]
pub fn rotate_pair(x0: f32, x1: f32, c: f32, s: f32) -> (f32, f32) {
    (x0 * c - x1 * s, x1 * c + x0 * s)
}

/// `inv_freq[i] = 1 / base^(2i / dim)`, in f64, for pair `i` of a rotary dimension `dim`.
///
/// Host only in practice (the device reads tables), but pure, so it lives here beside the
/// rotation it feeds.
#[inline(always)]
#[cfg(not(target_arch = "nvptx64"))]
pub fn inv_freq(base: f64, dim: usize, i: usize) -> f64 {
    1.0 / base.powf((2 * i) as f64 / dim as f64)
}
