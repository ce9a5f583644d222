//! The RoPE configuration: what cos and sin are made from and which kernels run.

use crate::error::{Error, Result};
use crate::scaling::RopeScaling;
use rope_cuda_kernels::keys::TableSource;
pub use rope_cuda_kernels::keys::{DType, RopeStyle};
pub use rope_cuda_kernels::views::MropeBands;

/// Multimodal RoPE (Qwen2-VL, Qwen2.5-VL, Qwen2.5-Omni, Qwen3-VL, GLM-4.1V): each token has
/// three positions (temporal, height, width), and each pair of the rotary dims turns by one
/// of them. Text tokens carry three equal positions, so they turn as in plain RoPE.
///
/// ```
/// use rope_cuda::Mrope;
/// // Qwen2-VL, head_dim 128: pairs 0..16 temporal, 16..40 height, 40..64 width.
/// let qwen2 = Mrope::new([16, 24, 24], false);
/// assert_eq!((qwen2.stream(15), qwen2.stream(16), qwen2.stream(40)), (0, 1, 2));
/// // Qwen3-VL: the streams interleave (t, h, w, t, h, w, ...) while their sections last.
/// let qwen3 = Mrope::new([24, 20, 20], true);
/// assert_eq!((qwen3.stream(0), qwen3.stream(1), qwen3.stream(2), qwen3.stream(61)), (0, 1, 2, 0));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Mrope {
    /// Pairs per stream (transformers' `mrope_section`); they add up to `rotary_dim / 2`.
    pub sections: [usize; 3],
    /// Qwen3-VL's layout (`mrope_interleaved`): the streams take pairs in turn; otherwise
    /// (Qwen2-VL) each takes a contiguous band, in order.
    pub interleaved: bool,
}

impl Mrope {
    /// Sections and layout.
    pub const fn new(sections: [usize; 3], interleaved: bool) -> Self {
        Mrope { sections, interleaved }
    }

    /// The bands as the kernels read them.
    pub fn bands(&self) -> MropeBands {
        let s = self.sections.map(|n| n.min(u32::MAX as usize / 4) as u32);
        match self.interleaved {
            false => MropeBands::Contiguous(s),
            true => MropeBands::Interleaved(s),
        }
    }

    /// The stream (0: temporal, 1: height, 2: width) of pair `i`.
    pub fn stream(&self, i: usize) -> usize {
        self.bands().stream(i as u32) as usize
    }

    /// Checks that the streams take exactly their sections' pairs of `half` pairs.
    pub fn validate(&self, half: usize) -> Result<()> {
        let mut counts = [0usize; 3];
        for i in 0..half {
            counts[self.stream(i)] += 1;
        }
        match counts == self.sections {
            true => Ok(()),
            false => Err(Error::MropeSections { sections: self.sections, interleaved: self.interleaved, half }),
        }
    }
}

/// Largest `max_position`: positions `0..=2^31 - 1` (every non-negative i32) are valid at
/// most. It is a limit the launches check, not a size: nothing is allocated per position.
pub const MAX_POSITION_LIMIT: usize = 1 << 31;

/// How many heads one thread of the RoPE kernels takes (where the views allow 16-byte
/// accesses; otherwise the element-by-element kernels run). A tuning choice: every choice
/// computes the same bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum HeadGrouping {
    /// Several heads a thread (the count measured fastest for the dtype and style), except
    /// for launches of few tokens (decode steps), where that would leave most of the GPU idle,
    /// and in place on heads whose rows share 128-byte lines: one head a thread there.
    #[default]
    Auto,
    /// One head a thread.
    One,
    /// The measured count, whatever the size and layout.
    Several,
}

/// Where the kernels take cos and sin from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum CosSin {
    /// [`CosSin::Computed`] where a table would be large (over [`AUTO_TABLE_BYTES`]) or for
    /// multimodal RoPE (faster computed: on the H200, 93% of copy bandwidth against 85%);
    /// [`CosSin::Table`] otherwise.
    #[default]
    Auto,
    /// f32 tables of `max_position` rows (16 bytes per position and pair, with the residuals
    /// of the exact path), built on the host in f64 when the `Rope` is made. Fastest for the
    /// decode step, f32, GPT-J and the fused append (BENCHMARKS.md).
    Table,
    /// Computed in the kernels from each pair's frequency (`rotary_dim / 2 * 16 + 4096` bytes
    /// whatever `max_position` is; no build time). Same accuracy contract at every position up
    /// to 2^31 - 1.
    Computed,
}

/// [`CosSin::Auto`]'s limit: tables larger than this (bytes) are not built. 256 MiB: 262,144
/// positions of head_dim 128 (a 128K-context model's table is 134 MB and builds in 0.35 s on
/// two cores; 2^20 positions would take 1.07 GB and 4.9 s).
pub const AUTO_TABLE_BYTES: usize = 256 << 20;

/// Rotate by `+theta` (the forward embedding) or by `-theta` (its inverse: the backward pass,
/// or moving cached keys to earlier positions).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Direction {
    /// `x * cos + rotate(x) * sin`.
    #[default]
    Forward,
    /// `x * cos - rotate(x) * sin`: undoes [`Direction::Forward`] at the same position.
    Inverse,
}

/// Everything a [`Rope`](crate::Rope) is built from.
///
/// ```
/// use rope_cuda::{DType, RopeConfig, RopeStyle};
/// let config = RopeConfig::new(128, 8192).base(500_000.0).dtype(DType::BF16);
/// assert_eq!(config.rotary_dim, 128);
/// let neox_partial = RopeConfig::new(256, 2048).rotary_dim(64).style(RopeStyle::GptJ);
/// assert!(neox_partial.validate().is_ok());
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct RopeConfig {
    /// Elements per head (even, at most [`RopeConfig::MAX_HEAD_DIM`]).
    pub head_dim: usize,
    /// Leading elements of each head that are rotated (even, at most `head_dim`); the rest
    /// are left as they are.
    pub rotary_dim: usize,
    /// Base of the frequencies: `inv_freq[i] = 1 / base^(2i / rotary_dim)`.
    pub base: f64,
    /// Pairing of elements.
    pub style: RopeStyle,
    /// Positions `0..max_position` are valid (a limit the launches check; nothing is allocated
    /// per position).
    pub max_position: usize,
    /// Element type of q, k and v: f32, f16 or bf16 (FP8 is a cache's type, not the
    /// inputs').
    pub dtype: DType,
    /// Whether every call synchronises its stream and returns position errors at once
    /// (see [`Rope::check_errors`](crate::Rope::check_errors)).
    pub checked: bool,
    /// Long-context scaling of the frequencies, and the attention factor.
    pub scaling: RopeScaling,
    /// The sequence length the table is built for: dynamic NTK and LongRoPE choose their
    /// frequencies by it (`None`: the model's trained length). Build one [`Rope`](crate::Rope)
    /// per length the engine serves with.
    pub seq_len: Option<usize>,
    /// Heads per thread of the RoPE kernels.
    pub grouping: HeadGrouping,
    /// Multimodal RoPE: positions come as three streams ([`Positions::streams_i32`](crate::Positions::streams_i32),
    /// [`Positions::streams_i64`](crate::Positions::streams_i64)), each pair turning by one of them.
    pub mrope: Option<Mrope>,
    /// Where the kernels take cos and sin from.
    pub cos_sin: CosSin,
}

impl RopeConfig {
    /// The largest head dimension accepted.
    pub const MAX_HEAD_DIM: usize = 512;

    /// NeoX style, f32, base 10000, full rotation, unchecked.
    pub fn new(head_dim: usize, max_position: usize) -> Self {
        RopeConfig {
            head_dim,
            rotary_dim: head_dim,
            base: 10_000.0,
            style: RopeStyle::NeoX,
            max_position,
            dtype: DType::F32,
            checked: false,
            scaling: RopeScaling::Default,
            seq_len: None,
            grouping: HeadGrouping::Auto,
            mrope: None,
            cos_sin: CosSin::Auto,
        }
    }

    /// Sets where the kernels take cos and sin from.
    pub fn cos_sin(mut self, cos_sin: CosSin) -> Self {
        self.cos_sin = cos_sin;
        self
    }

    /// The kernels' source of cos and sin: [`CosSin::Auto`] resolved for this configuration.
    pub fn source(&self) -> TableSource {
        let table_bytes = (self.max_position as u128) * (self.rotary_dim as u128 / 2) * 16;
        match self.cos_sin {
            CosSin::Table => TableSource::Table,
            CosSin::Computed => TableSource::Computed,
            CosSin::Auto if self.mrope.is_some() || table_bytes > AUTO_TABLE_BYTES as u128 => TableSource::Computed,
            CosSin::Auto => TableSource::Table,
        }
    }

    /// Sets multimodal RoPE.
    pub fn mrope(mut self, mrope: Option<Mrope>) -> Self {
        self.mrope = mrope;
        self
    }

    /// Sets the scaling.
    pub fn scaling(mut self, scaling: RopeScaling) -> Self {
        self.scaling = scaling;
        self
    }

    /// Sets the sequence length the table is built for (see [`RopeConfig::seq_len`]).
    pub fn seq_len(mut self, seq_len: Option<usize>) -> Self {
        self.seq_len = seq_len;
        self
    }

    /// `(inv_freq, attention_factor)`: one frequency per pair and the factor both cos and
    /// sin are multiplied by, from the base, the rotary dimension and the scaling, in f64.
    pub fn frequencies(&self) -> Result<(Vec<f64>, f64)> {
        self.scaling.frequencies(self.rotary_dim, self.head_dim, self.base, self.seq_len)
    }

    /// Sets the head dimension. A full rotation stays full (the rotary dimension follows
    /// the head dimension where it equalled it); a partial one keeps its rotary dimension.
    ///
    /// ```
    /// use rope_cuda::RopeConfig;
    /// let c = RopeConfig::new(64, 4096).head_dim(128).max_position(8192);
    /// assert_eq!((c.head_dim, c.rotary_dim, c.max_position), (128, 128, 8192));
    /// let partial = RopeConfig::new(128, 4096).rotary_dim(32).head_dim(256);
    /// assert_eq!((partial.head_dim, partial.rotary_dim), (256, 32));
    /// ```
    pub fn head_dim(mut self, head_dim: usize) -> Self {
        if self.rotary_dim == self.head_dim {
            self.rotary_dim = head_dim;
        }
        self.head_dim = head_dim;
        self
    }

    /// Sets the largest position plus one (see [`RopeConfig::max_position`]).
    pub fn max_position(mut self, max_position: usize) -> Self {
        self.max_position = max_position;
        self
    }

    /// Sets the rotary dimension.
    pub fn rotary_dim(mut self, rotary_dim: usize) -> Self {
        self.rotary_dim = rotary_dim;
        self
    }

    /// Sets the base.
    pub fn base(mut self, base: f64) -> Self {
        self.base = base;
        self
    }

    /// Sets the style.
    pub fn style(mut self, style: RopeStyle) -> Self {
        self.style = style;
        self
    }

    /// Sets the element type.
    pub fn dtype(mut self, dtype: DType) -> Self {
        self.dtype = dtype;
        self
    }

    /// Sets how many heads a thread of the RoPE kernels takes.
    pub fn grouping(mut self, grouping: HeadGrouping) -> Self {
        self.grouping = grouping;
        self
    }

    /// Sets checked mode.
    pub fn checked(mut self, checked: bool) -> Self {
        self.checked = checked;
        self
    }

    /// Checks every field.
    pub fn validate(&self) -> Result<()> {
        self.validate_dims()?;
        self.frequencies().map(drop)
    }

    /// [`RopeConfig::validate`] but for the frequencies (their scaling's parameters): what a
    /// launch by the caller's tables, which never reads them, checks on every call (the
    /// frequencies cost a `powf` a pair).
    pub(crate) fn validate_dims(&self) -> Result<()> {
        if self.head_dim < 2 || self.head_dim % 2 != 0 || self.head_dim > Self::MAX_HEAD_DIM {
            return Err(Error::HeadDim { head_dim: self.head_dim });
        }
        if self.rotary_dim < 2 || self.rotary_dim % 2 != 0 || self.rotary_dim > self.head_dim {
            return Err(Error::RotaryDim { rotary_dim: self.rotary_dim, head_dim: self.head_dim });
        }
        if !(self.base.is_finite() && self.base > 0.0) {
            return Err(Error::Base { base: self.base });
        }
        if self.max_position == 0 {
            return Err(Error::MaxPosition { needed: 1, max_position: 0 });
        }
        if self.max_position > MAX_POSITION_LIMIT {
            return Err(Error::TooLarge {
                what: "max_position",
                value: self.max_position as u64,
                limit: MAX_POSITION_LIMIT as u64,
            });
        }
        if let Some(m) = &self.mrope {
            m.validate(self.rotary_dim / 2)?;
        }
        if self.dtype.fp8().is_some() {
            // FP8 is a cache's type (`KvCache` with scales), never the inputs'.
            return Err(Error::DType { what: "configuration (q, k and v)", expected: DType::BF16, got: self.dtype });
        }
        Ok(())
    }
}
