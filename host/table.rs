//! cos/sin tables: angles formed in f64, stored in f32, built once per configuration.

use rope_cuda_kernels::math::{inv_freq, split_f64};
use rope_cuda_kernels::views::TableView;

use crate::alloc::DeviceAlloc;
use crate::config::{RopeConfig, MAX_POSITION_LIMIT};
use crate::error::{Error, Result};

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
        let freqs: Vec<f64> = (0..rotary_dim / 2).map(|i| inv_freq(base, rotary_dim, i)).collect();
        Self::from_frequencies(&freqs, 1.0, max_position)
    }

    /// Builds the table of `inv_freq` (one per pair, from [`crate::RopeScaling::frequencies`]
    /// or any other source) with both cos and sin multiplied by `attention`, in f64 before
    /// rounding, as [`HostTable::new`] does.
    pub fn from_frequencies(inv_freq: &[f64], attention: f64, max_position: usize) -> Result<Self> {
        if inv_freq.is_empty() {
            return Err(Error::HeadDim { head_dim: 0 });
        }
        check_table_args(2 * inv_freq.len(), 1.0, max_position)?;
        if let Some(&f) = inv_freq.iter().find(|f| !(f.is_finite() && **f >= 0.0)) {
            return Err(Error::Scaling { field: "inv_freq", value: f });
        }
        if !(attention.is_finite() && attention > 0.0) {
            return Err(Error::Scaling { field: "attention_factor", value: attention });
        }
        let half = inv_freq.len();
        let n = max_position * half;
        let (mut cos, mut sin, mut cos_lo, mut sin_lo) =
            (Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n));
        for p in 0..max_position {
            for e in row(inv_freq, attention, p) {
                cos.push(e[0]);
                sin.push(e[1]);
                cos_lo.push(e[2]);
                sin_lo.push(e[3]);
            }
        }
        Ok(HostTable { half, max_position, cos, sin, cos_lo, sin_lo })
    }
}

/// The table row of position `p`: for each pair, `[cos, sin, cos_lo, sin_lo]` as
/// [`HostTable::from_frequencies`] stores them (for checking single rows at any position).
pub fn row(inv_freq: &[f64], attention: f64, p: usize) -> impl Iterator<Item = [f32; 4]> + '_ {
    inv_freq.iter().map(move |&f| {
        let (s, c) = (p as f64 * f).sin_cos();
        let ((c, cl), (s, sl)) = (split_f64(attention * c), split_f64(attention * s));
        [c, s, cl, sl]
    })
}

/// A cos/sin table on the device.
#[derive(Debug)]
pub struct RopeTable {
    rotary_dim: usize,
    base: f64,
    attention: f64,
    max_position: usize,
    cos: DeviceAlloc<f32>,
    sin: DeviceAlloc<f32>,
    cos_lo: DeviceAlloc<f32>,
    sin_lo: DeviceAlloc<f32>,
}

impl RopeTable {
    /// The kernels' view of the table.
    pub(crate) fn view(&self) -> TableView {
        let addresses = [&self.cos, &self.sin, &self.cos_lo, &self.sin_lo].map(|b| b.address());
        TableView::new(addresses, (self.rotary_dim / 2) as u32)
    }

    /// Builds the table of plain RoPE on the host (see [`HostTable::new`]) and uploads it
    /// to the current context.
    pub fn new(rotary_dim: usize, base: f64, max_position: usize) -> Result<Self> {
        Self::upload(&HostTable::new(rotary_dim, base, max_position)?, base, 1.0)
    }

    /// Builds the table of `config` (its scaling included, see [`RopeConfig::frequencies`])
    /// and uploads it to the current context.
    pub fn from_config(config: &RopeConfig) -> Result<Self> {
        let (freqs, attention) = config.frequencies()?;
        let host = HostTable::from_frequencies(&freqs, attention, config.max_position)?;
        Self::upload(&host, config.base, attention)
    }

    fn upload(host: &HostTable, base: f64, attention: f64) -> Result<Self> {
        Ok(RopeTable {
            rotary_dim: 2 * host.half,
            base,
            attention,
            max_position: host.max_position,
            cos: DeviceAlloc::from_slice(&host.cos)?,
            sin: DeviceAlloc::from_slice(&host.sin)?,
            cos_lo: DeviceAlloc::from_slice(&host.cos_lo)?,
            sin_lo: DeviceAlloc::from_slice(&host.sin_lo)?,
        })
    }

    /// The factor both cos and sin are multiplied by (1 without scaling).
    pub fn attention_factor(&self) -> f64 {
        self.attention
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
