//! cos/sin tables: angles formed in f64, stored in f32, built once per configuration.

use cust::memory::DeviceBuffer;
use rope_cuda_kernels::math::{inv_freq, split_f64};

use crate::error::{Error, Result};

/// Largest table the kernels index with 32-bit positions.
pub const MAX_POSITION_LIMIT: usize = i32::MAX as usize;

/// Host copy of a cos/sin table, row-major `[max_position, rotary_dim / 2]`:
/// `cos[p * half + i]` is the f32 nearest `cos(p * inv_freq[i])` (evaluated in f64) and
/// `cos_lo` the f32 nearest the residual; likewise for the sines. The kernels use the
/// residuals to keep each output within one f32 rounding of itself where products cancel.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTable {
    /// Pairs per row, `rotary_dim / 2`.
    pub half: usize,
    /// Number of positions.
    pub max_position: usize,
    /// The cosines.
    pub cos: Vec<f32>,
    /// The sines.
    pub sin: Vec<f32>,
    /// Residuals of the cosines.
    pub cos_lo: Vec<f32>,
    /// Residuals of the sines.
    pub sin_lo: Vec<f32>,
}

impl HostTable {
    /// Builds the table of plain RoPE: `inv_freq[i] = 1 / base^(2i / rotary_dim)`.
    ///
    /// Each angle `p * inv_freq[i]` is formed and reduced in f64, so every stored value is
    /// the correctly rounded f32 of a value within a few f64 ulps of the exact one, at any
    /// position (position 2^20 included).
    pub fn new(rotary_dim: usize, base: f64, max_position: usize) -> Result<Self> {
        check_table_args(rotary_dim, base, max_position)?;
        let half = rotary_dim / 2;
        let freqs: Vec<f64> = (0..half).map(|i| inv_freq(base, rotary_dim, i)).collect();
        let n = max_position * half;
        let (mut cos, mut sin, mut cos_lo, mut sin_lo) =
            (Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n));
        for p in 0..max_position {
            for &f in &freqs {
                let (s, c) = (p as f64 * f).sin_cos();
                let ((c, cl), (s, sl)) = (split_f64(c), split_f64(s));
                cos.push(c);
                sin.push(s);
                cos_lo.push(cl);
                sin_lo.push(sl);
            }
        }
        Ok(HostTable { half, max_position, cos, sin, cos_lo, sin_lo })
    }
}

/// A cos/sin table on the device.
#[derive(Debug)]
pub struct RopeTable {
    rotary_dim: usize,
    base: f64,
    max_position: usize,
    pub(crate) cos: DeviceBuffer<f32>,
    pub(crate) sin: DeviceBuffer<f32>,
    pub(crate) cos_lo: DeviceBuffer<f32>,
    pub(crate) sin_lo: DeviceBuffer<f32>,
}

impl RopeTable {
    /// Builds the table on the host (see [`HostTable::new`]) and uploads it to the current
    /// context.
    pub fn new(rotary_dim: usize, base: f64, max_position: usize) -> Result<Self> {
        let host = HostTable::new(rotary_dim, base, max_position)?;
        Ok(RopeTable {
            rotary_dim,
            base,
            max_position,
            cos: DeviceBuffer::from_slice(&host.cos)?,
            sin: DeviceBuffer::from_slice(&host.sin)?,
            cos_lo: DeviceBuffer::from_slice(&host.cos_lo)?,
            sin_lo: DeviceBuffer::from_slice(&host.sin_lo)?,
        })
    }

    /// The rotary dimension the table serves (twice its pairs per position).
    pub fn rotary_dim(&self) -> usize {
        self.rotary_dim
    }

    /// The base of the frequencies.
    pub fn base(&self) -> f64 {
        self.base
    }

    /// Number of positions the table holds: valid positions are `0..max_position`.
    pub fn max_position(&self) -> usize {
        self.max_position
    }
}

fn check_table_args(rotary_dim: usize, base: f64, max_position: usize) -> Result<()> {
    if rotary_dim < 2 || rotary_dim % 2 != 0 {
        return Err(Error::HeadDim { head_dim: rotary_dim });
    }
    if !(base.is_finite() && base > 0.0) {
        return Err(Error::Base { base });
    }
    if max_position > MAX_POSITION_LIMIT {
        return Err(Error::TooLarge {
            what: "max_position",
            value: max_position as u64,
            limit: MAX_POSITION_LIMIT as u64,
        });
    }
    Ok(())
}
