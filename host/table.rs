//! The frequencies the kernels compute cos and sin from ([`RopeTable`]), and cos/sin tables on
//! the host ([`HostTable`]: angles formed in f64, stored in f32) for callers who want one.

use rope_cuda_kernels::keys::TableSource;
use rope_cuda_kernels::math::{angle_table, inv_freq, split_f64, turns_of, Turns, ANGLE_STEPS};
use rope_cuda_kernels::views::{ComputedView, SourceView, TableView};

use crate::alloc::DeviceAlloc;
use crate::config::{RopeConfig, MAX_POSITION_LIMIT};
use crate::error::{Error, Result};

/// Host copy of a cos/sin table, row-major `[max_position, rotary_dim / 2]`:
/// `cos[p * half + i]` is the f32 nearest `cos(p * inv_freq[i])` (evaluated in f64) and
/// `cos_lo` the f32 nearest the residual; likewise for the sines. The kernels use the
/// residuals to keep each output within one f32 rounding of itself where products cancel.
/// (The library's kernels need no table: [`RopeTable`].)
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
    /// Each angle `p * inv_freq[i]` is reduced exactly (the position times the frequency in
    /// 96-bit turns, whole turns dropped, as [`crate::reference::sin_cos`] does), and only the
    /// reduced angle, in `[-π, π)`, goes through f64 `sin_cos`: every stored value (high part
    /// plus residual) is within a few f64 ulps of the exact cosine or sine of the f64
    /// frequency times the position, at every position a table can have. (A plain f64 product
    /// would be off by up to 6e-11 rad below 2^20, and 1.25e-7 rad past it.)
    ///
    /// ```
    /// let table = rope_cuda::HostTable::new(64, 10_000.0, 16)?;
    /// assert_eq!((table.half, table.cos.len()), (32, 16 * 32));
    /// assert_eq!((table.cos[0], table.sin[0]), (1.0, 0.0)); // position 0
    /// // Position 1, pair 0: angle 1 (inv_freq[0] = 1); the residual carries what f32 rounds off.
    /// let c = table.cos[32] as f64 + table.cos_lo[32] as f64;
    /// assert!((c - 1f64.cos()).abs() < 1e-12);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn new(rotary_dim: usize, base: f64, max_position: usize) -> Result<Self> {
        check_table_args(rotary_dim, base, max_position)?;
        let freqs: Vec<f64> = (0..rotary_dim / 2).map(|i| inv_freq(base, rotary_dim, i)).collect();
        Self::from_frequencies(&freqs, 1.0, max_position)
    }

    /// Builds the table of `inv_freq` (one per pair, from [`crate::RopeScaling::frequencies`]
    /// or any other source) with both cos and sin multiplied by `attention`, in f64 before
    /// rounding, as [`HostTable::new`] does.
    ///
    /// ```
    /// let table = rope_cuda::HostTable::from_frequencies(&[1.0, 0.5], 2.0, 3)?;
    /// // cos and sin carry the attention factor 2.
    /// assert_eq!((table.cos[0], table.sin[0]), (2.0, 0.0));
    /// assert!((table.cos[2] as f64 - 2.0 * 1f64.cos()).abs() < 1e-6); // position 1, pair 0
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
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
        // Each frequency's turns once; every row from them (positions below 2^31: exact).
        let turns: Vec<Option<Turns>> = inv_freq.iter().map(|&f| turns_of(f)).collect();
        for p in 0..max_position {
            for (&f, r) in inv_freq.iter().zip(&turns) {
                let e = entry(f, *r, attention, p);
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
///
/// ```
/// // One row at a position far past any table: [cos, sin, cos_lo, sin_lo] per pair.
/// let row: Vec<[f32; 4]> = rope_cuda::table_row(&[1.0, 1e-4], 1.0, 1 << 30).collect();
/// assert_eq!(row.len(), 2);
/// assert!(((row[1][0] as f64 + row[1][2] as f64) - (1e-4 * (1u64 << 30) as f64).cos()).abs() < 1e-9);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn row(inv_freq: &[f64], attention: f64, p: usize) -> impl Iterator<Item = [f32; 4]> + '_ {
    inv_freq.iter().map(move |&f| entry(f, turns_of(f), attention, p))
}

/// One pair's `[cos, sin, cos_lo, sin_lo]` at position `p`: the angle reduced exactly
/// ([`crate::reference::sin_cos`]: `p` times the frequency's turns `r`, whole turns dropped)
/// wherever `p < 2^32` and `r` exists, the plain f64 product elsewhere.
fn entry(f: f64, r: Option<Turns>, attention: f64, p: usize) -> [f32; 4] {
    let (s, c) = match (u32::try_from(p), r) {
        (Ok(p), Some(r)) => crate::reference::sin_cos_turns(p, r, false),
        _ => crate::reference::sin_cos(p as f64, f),
    };
    let ((c, cl), (s, sl)) = (split_f64(attention * c), split_f64(attention * s));
    [c, s, cl, sl]
}

/// Where the kernels take cos and sin from, on the device: a cos/sin table of `max_position`
/// rows ([`TableSource::Table`]: [`HostTable`] uploaded, `max_position * rotary_dim / 2 * 16`
/// bytes), or ([`TableSource::Computed`]) each pair's frequency as exact turns per position
/// ([`rope_cuda_kernels::math::Turns`], from the f64 `inv_freq` after scaling and a 256-bit
/// `1 / 2π`), 16 bytes a pair, and the angle table of 256 steps of an octant (4 KiB):
/// `rotary_dim / 2 * 16 + 4096` bytes whatever `max_position` is, which then only limits the
/// positions a launch accepts.
#[derive(Debug)]
pub struct RopeTable {
    rotary_dim: usize,
    base: f64,
    attention: f64,
    max_position: usize,
    storage: Storage,
}

#[derive(Debug)]
enum Storage {
    /// The table, and the frequencies the KV shift computes from (`None` where a frequency
    /// has no exact turns: at least 2^32, which a table takes).
    Table {
        cos: DeviceAlloc<f32>,
        sin: DeviceAlloc<f32>,
        cos_lo: DeviceAlloc<f32>,
        sin_lo: DeviceAlloc<f32>,
        freqs: Option<DeviceAlloc<u32>>,
    },
    Computed {
        freqs: DeviceAlloc<u32>,
    },
}

impl RopeTable {
    /// The kernels' view of the table or the frequencies.
    pub(crate) fn view(&self) -> SourceView {
        let half = self.rotary_dim / 2;
        match &self.storage {
            Storage::Table { cos, sin, cos_lo, sin_lo, .. } => {
                SourceView::Table(TableView::new([cos, sin, cos_lo, sin_lo].map(|b| b.address())))
            }
            Storage::Computed { freqs } => {
                let angles = freqs.address() + 16 * half as u64;
                SourceView::Computed(ComputedView::new(freqs.address(), angles, half as u32, self.attention))
            }
        }
    }

    /// The KV shift's source, whatever the storage: cos and sin computed from the frequencies
    /// with the attention factor 1 (the shift turns cached keys by an angle; their factor is
    /// in them already). `None` for a table of frequencies without exact turns.
    pub(crate) fn shift_source(&self) -> Option<SourceView> {
        let half = self.rotary_dim / 2;
        let freqs = match &self.storage {
            Storage::Table { freqs, .. } => freqs.as_ref()?,
            Storage::Computed { freqs } => freqs,
        };
        let angles = freqs.address() + 16 * half as u64;
        Some(SourceView::Computed(ComputedView::new(freqs.address(), angles, half as u32, 1.0)))
    }

    /// Plain RoPE (`inv_freq[i] = 1 / base^(2i / rotary_dim)`) on the device, in the current
    /// context, from the source [`crate::CosSin::Auto`] picks (a table up to
    /// [`crate::AUTO_TABLE_BYTES`]).
    ///
    /// ```
    /// # let Ok(_ctx) = cust::quick_init() else { return Ok(()) }; // no GPU: nothing to run
    /// # let kernels = rope_cuda::Kernels::load()?;
    /// # let stream = cust::stream::Stream::new(cust::stream::StreamFlags::NON_BLOCKING, None)?;
    /// let table = rope_cuda::RopeTable::new(128, 500_000.0, 8192)?;
    /// assert_eq!((table.rotary_dim(), table.max_position(), table.attention_factor()), (128, 8192, 1.0));
    /// assert_eq!(table.device_bytes(), 8192 * 64 * 16 + 64 * 16 + 4096); // a table (and the frequencies)
    /// let long = rope_cuda::RopeTable::new(128, 500_000.0, 1 << 20)?;
    /// assert_eq!(long.device_bytes(), 64 * 16 + 4096); // computed
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn new(rotary_dim: usize, base: f64, max_position: usize) -> Result<Self> {
        Self::from_config(&RopeConfig::new(rotary_dim, max_position).base(base))
    }

    /// `config`'s frequencies (its scaling included, see [`RopeConfig::frequencies`]) and
    /// attention factor, on the device in the current context, as `config.cos_sin` says.
    ///
    /// ```
    /// # let Ok(_ctx) = cust::quick_init() else { return Ok(()) }; // no GPU: nothing to run
    /// # let kernels = rope_cuda::Kernels::load()?;
    /// # let stream = cust::stream::Stream::new(cust::stream::StreamFlags::NON_BLOCKING, None)?;
    /// use rope_cuda::{CosSin, RopeConfig, RopeScaling, RopeTable};
    /// let config = RopeConfig::new(64, 1024).scaling(RopeScaling::Linear { factor: 4.0 });
    /// let table = RopeTable::from_config(&config.clone().cos_sin(CosSin::Computed))?;
    /// assert_eq!((table.max_position(), table.device_bytes()), (1024, 32 * 16 + 4096));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn from_config(config: &RopeConfig) -> Result<Self> {
        let (freqs, attention) = config.frequencies()?;
        check_table_args(config.rotary_dim, config.base, config.max_position)?;
        let words = |freqs: &[f64]| -> Result<Vec<u32>> {
            let mut words = turn_words(freqs)?;
            words.extend(angle_table().iter().flatten().map(|v| v.to_bits()));
            Ok(words)
        };
        let storage = match config.source() {
            TableSource::Computed => Storage::Computed { freqs: DeviceAlloc::from_slice(&words(&freqs)?)? },
            _ => {
                let host = HostTable::from_frequencies(&freqs, attention, config.max_position)?;
                Storage::Table {
                    cos: DeviceAlloc::from_slice(&host.cos)?,
                    sin: DeviceAlloc::from_slice(&host.sin)?,
                    cos_lo: DeviceAlloc::from_slice(&host.cos_lo)?,
                    sin_lo: DeviceAlloc::from_slice(&host.sin_lo)?,
                    freqs: match words(&freqs) {
                        Ok(w) => Some(DeviceAlloc::from_slice(&w)?),
                        Err(_) => None,
                    },
                }
            }
        };
        let (rotary_dim, base, max_position) = (config.rotary_dim, config.base, config.max_position);
        Ok(RopeTable { rotary_dim, base, attention, max_position, storage })
    }

    /// Where the kernels take cos and sin from: [`TableSource::Table`] or
    /// [`TableSource::Computed`].
    pub fn source(&self) -> TableSource {
        match self.storage {
            Storage::Table { .. } => TableSource::Table,
            Storage::Computed { .. } => TableSource::Computed,
        }
    }

    /// The factor both cos and sin are multiplied by (1 without scaling).
    pub fn attention_factor(&self) -> f64 {
        self.attention
    }

    /// The rotary dimension served (twice the pairs).
    pub fn rotary_dim(&self) -> usize {
        self.rotary_dim
    }

    /// The base of the frequencies.
    pub fn base(&self) -> f64 {
        self.base
    }

    /// Valid positions are `0..max_position` (the table's rows, or, computed, a limit the
    /// launches check).
    pub fn max_position(&self) -> usize {
        self.max_position
    }

    /// Device memory held: 16 bytes per pair and the 4 KiB angle table
    /// ([`rope_cuda_kernels::math::angle_table`]), and, for a table, its 16 bytes per position
    /// and pair (the frequencies are there too: the KV shift computes its angles from them).
    pub fn device_bytes(&self) -> usize {
        let freqs = self.rotary_dim / 2 * 16 + ANGLE_STEPS * 16;
        match &self.storage {
            Storage::Table { freqs: None, .. } => self.max_position * self.rotary_dim / 2 * 16,
            Storage::Table { .. } => self.max_position * self.rotary_dim / 2 * 16 + freqs,
            Storage::Computed { .. } => freqs,
        }
    }
}

/// Each frequency's [`rope_cuda_kernels::math::Turns`] and a pad word: the kernels' 16 bytes
/// a pair.
pub(crate) fn turn_words(freqs: &[f64]) -> Result<Vec<u32>> {
    let mut words = Vec::with_capacity(4 * freqs.len());
    for &f in freqs {
        let [a, b, c] = turns_of(f).ok_or(Error::Scaling { field: "inv_freq", value: f })?;
        words.extend([a, b, c, 0]);
    }
    Ok(words)
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
