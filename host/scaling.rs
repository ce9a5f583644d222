//! RoPE scaling: the frequencies and attention factor of every `rope_type` models ship with,
//! following transformers' `modeling_rope_utils.py` (5.x) formula for formula, in f64.
//!
//! [`RopeScaling::frequencies`] gives `inv_freq` (one per pair) and the attention factor that
//! multiplies both cos and sin; the table builder ([`crate::HostTable`]) turns them into the
//! table the kernels read.

use std::f64::consts::PI;

use rope_cuda_kernels::math::inv_freq;

use crate::error::{Error, Result};

/// How the frequencies of plain RoPE are changed for long contexts (`rope_type` in a model's
/// `config.json`). Lengths are in positions.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum RopeScaling {
    /// Plain RoPE: `inv_freq[i] = 1 / base^(2i / rotary_dim)`, attention factor 1.
    #[default]
    Default,
    /// Position interpolation: every frequency divided by `factor`.
    Linear {
        /// The divisor.
        factor: f64,
    },
    /// Dynamic NTK-aware scaling: for a sequence of `seq_len > max_position_embeddings`
    /// positions the base becomes `base * (factor * seq_len / max_position_embeddings -
    /// (factor - 1))^(dim / (dim - 2))`; shorter sequences use the plain base. The sequence
    /// length is the configuration's ([`crate::RopeConfig::seq_len`]).
    Dynamic {
        /// The scaling factor.
        factor: f64,
        /// The model's `max_position_embeddings`, the length trained with.
        max_position_embeddings: usize,
    },
    /// YaRN: interpolated low frequencies, extrapolated high ones, a linear ramp between
    /// (over the pair indices where a wavelength makes `beta_fast` to `beta_slow` rotations in
    /// `original_max_position_embeddings`), and an attention factor `0.1 ln(factor) + 1`, or
    /// DeepSeek's `mscale(factor, mscale) / mscale(factor, mscale_all_dim)` when both are set,
    /// or the configured `attention_factor`.
    Yarn {
        /// The scaling factor.
        factor: f64,
        /// The pretraining length.
        original_max_position_embeddings: usize,
        /// Rotations that mark the extrapolated end of the ramp (default 32).
        beta_fast: f64,
        /// Rotations that mark the interpolated end of the ramp (default 1).
        beta_slow: f64,
        /// DeepSeek's `mscale`.
        mscale: Option<f64>,
        /// DeepSeek's `mscale_all_dim`.
        mscale_all_dim: Option<f64>,
        /// An explicit attention factor, overriding the formulas.
        attention_factor: Option<f64>,
        /// Whether the ramp's ends are rounded outwards to whole pair indices (default true).
        truncate: bool,
    },
    /// LongRoPE (Phi-3): per-pair factors dividing the frequencies, `short_factor` for
    /// sequences up to `original_max_position_embeddings` and `long_factor` beyond (the
    /// configuration's [`crate::RopeConfig::seq_len`] decides); attention factor
    /// `sqrt(1 + ln(factor) / ln(original_max_position_embeddings))` with `factor =
    /// max_position_embeddings / original_max_position_embeddings` unless configured.
    LongRope {
        /// Factors for short sequences, one per pair.
        short_factor: Vec<f64>,
        /// Factors for long sequences, one per pair.
        long_factor: Vec<f64>,
        /// The pretraining length.
        original_max_position_embeddings: usize,
        /// The scaling factor (for the attention factor only).
        factor: f64,
        /// An explicit attention factor, overriding the formula.
        attention_factor: Option<f64>,
    },
    /// Llama 3.1: wavelengths longer than `original_max_position_embeddings /
    /// low_freq_factor` are divided by `factor`, shorter than `… / high_freq_factor` kept, and
    /// a smooth blend between (no band at all where the two factors are equal, as in Llama 4
    /// Scout's config).
    Llama3 {
        /// The scaling factor (8 for Llama 3.1).
        factor: f64,
        /// 1 for Llama 3.1.
        low_freq_factor: f64,
        /// 4 for Llama 3.1.
        high_freq_factor: f64,
        /// The pretraining length (8192 for Llama 3.1).
        original_max_position_embeddings: usize,
    },
    /// Proportional RoPE (the Gemma 4 family's full-attention layers): pairs span the whole
    /// head (`rotary_dim` must equal `head_dim`); the first `partial_rotary_factor *
    /// head_dim / 2` pairs have `inv_freq[i] = 1 / base^(2i / head_dim)`, the rest 0 (left as
    /// they are); all divided by `factor`.
    Proportional {
        /// The fraction of pairs that rotate.
        partial_rotary_factor: f64,
        /// Divides every frequency (default 1).
        factor: f64,
    },
}

/// The attention factor YaRN derives from `scale` and an `mscale`.
fn yarn_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

fn positive(field: &'static str, value: f64) -> Result<f64> {
    if value.is_finite() && value > 0.0 {
        Ok(value)
    } else {
        Err(Error::Scaling { field, value })
    }
}

impl RopeScaling {
    /// The `rope_type` name transformers gives it.
    pub fn rope_type(&self) -> &'static str {
        match self {
            RopeScaling::Default => "default",
            RopeScaling::Linear { .. } => "linear",
            RopeScaling::Dynamic { .. } => "dynamic",
            RopeScaling::Yarn { .. } => "yarn",
            RopeScaling::LongRope { .. } => "longrope",
            RopeScaling::Llama3 { .. } => "llama3",
            RopeScaling::Proportional { .. } => "proportional",
        }
    }

    /// `(inv_freq, attention_factor)` for `rotary_dim / 2` pairs of a head of `head_dim`,
    /// frequencies base `base`, for sequences of `seq_len` positions (`None`: the model's
    /// trained length; only `Dynamic` and `LongRope` look at it). In f64 throughout.
    pub fn frequencies(
        &self,
        rotary_dim: usize,
        head_dim: usize,
        base: f64,
        seq_len: Option<usize>,
    ) -> Result<(Vec<f64>, f64)> {
        let dim = rotary_dim as f64;
        let half = rotary_dim / 2;
        let plain = |base: f64| -> Vec<f64> { (0..half).map(|i| inv_freq(base, rotary_dim, i)).collect() };
        Ok(match self {
            RopeScaling::Default => (plain(base), 1.0),
            RopeScaling::Linear { factor } => {
                let factor = positive("factor", *factor)?;
                (plain(base).into_iter().map(|f| f / factor).collect(), 1.0)
            }
            RopeScaling::Dynamic { factor, max_position_embeddings } => {
                let factor = positive("factor", *factor)?;
                let max = positive("max_position_embeddings", *max_position_embeddings as f64)?;
                if rotary_dim <= 2 {
                    return Err(Error::RotaryDim { rotary_dim, head_dim });
                }
                let len = seq_len.map_or(max, |s| (s as f64).max(max));
                let base = base * (factor * len / max - (factor - 1.0)).powf(dim / (dim - 2.0));
                (plain(positive("dynamic base", base)?), 1.0)
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                mscale,
                mscale_all_dim,
                attention_factor,
                truncate,
            } => {
                let factor = positive("factor", *factor)?;
                let original = positive("original_max_position_embeddings", *original_max_position_embeddings as f64)?;
                let (fast, slow) = (positive("beta_fast", *beta_fast)?, positive("beta_slow", *beta_slow)?);
                let attention = match (attention_factor, mscale, mscale_all_dim) {
                    (Some(a), _, _) => positive("attention_factor", *a)?,
                    // transformers tests truthiness: a zero mscale counts as unset.
                    (None, Some(m), Some(all)) if *m != 0.0 && *all != 0.0 => {
                        yarn_mscale(factor, *m) / yarn_mscale(factor, *all)
                    }
                    _ => yarn_mscale(factor, 1.0),
                };
                let correction = |rotations: f64| (dim * (original / (rotations * 2.0 * PI)).ln()) / (2.0 * base.ln());
                let (mut low, mut high) = (correction(fast), correction(slow));
                if *truncate {
                    (low, high) = (low.floor(), high.ceil());
                }
                let (low, mut high) = (low.max(0.0), high.min(dim - 1.0));
                if low == high {
                    high += 0.001;
                }
                let freqs = (0..half)
                    .map(|i| {
                        let pos_freq = base.powf((2 * i) as f64 / dim);
                        let (extrapolation, interpolation) = (1.0 / pos_freq, 1.0 / (factor * pos_freq));
                        let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                        let extrapolation_factor = 1.0 - ramp;
                        interpolation * (1.0 - extrapolation_factor) + extrapolation * extrapolation_factor
                    })
                    .collect();
                (freqs, attention)
            }
            RopeScaling::LongRope {
                short_factor,
                long_factor,
                original_max_position_embeddings,
                factor,
                attention_factor,
            } => {
                let original = *original_max_position_embeddings;
                positive("original_max_position_embeddings", original as f64)?;
                for (field, list) in [("short_factor", short_factor), ("long_factor", long_factor)] {
                    if list.len() != half {
                        return Err(Error::ScalingLength { field, expected: half, got: list.len() });
                    }
                    for &f in list {
                        positive(field, f)?;
                    }
                }
                let attention = match attention_factor {
                    Some(a) => positive("attention_factor", *a)?,
                    None if *factor <= 1.0 => 1.0,
                    None => (1.0 + factor.ln() / (original as f64).ln()).sqrt(),
                };
                let ext = if seq_len.is_some_and(|s| s > original) { long_factor } else { short_factor };
                (plain(base).into_iter().zip(ext).map(|(f, e)| f / e).collect(), attention)
            }
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
                let factor = positive("factor", *factor)?;
                let (low, high) =
                    (positive("low_freq_factor", *low_freq_factor)?, positive("high_freq_factor", *high_freq_factor)?);
                // `high == low` (Llama 4 Scout: both 1) leaves no band between the two
                // wavelengths: every frequency is kept or divided, none blended.
                if high < low {
                    return Err(Error::Scaling { field: "high_freq_factor", value: high });
                }
                let old = positive("original_max_position_embeddings", *original_max_position_embeddings as f64)?;
                let (low_wavelen, high_wavelen) = (old / low, old / high);
                let freqs = plain(base)
                    .into_iter()
                    .map(|f| {
                        let wavelen = 2.0 * PI / f;
                        if wavelen < high_wavelen || (wavelen <= low_wavelen && high == low) {
                            // (At a wavelength exactly on an empty band's edge transformers
                            // divides 0 by 0; the frequency is kept here.)
                            f
                        } else if wavelen > low_wavelen {
                            f / factor
                        } else {
                            let smooth = (old / wavelen - low) / (high - low);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect();
                (freqs, 1.0)
            }
            RopeScaling::Proportional { partial_rotary_factor, factor } => {
                let factor = positive("factor", *factor)?;
                let fraction = *partial_rotary_factor;
                if !(fraction.is_finite() && (0.0..=1.0).contains(&fraction)) {
                    return Err(Error::Scaling { field: "partial_rotary_factor", value: fraction });
                }
                if rotary_dim != head_dim {
                    return Err(Error::RotaryDim { rotary_dim, head_dim });
                }
                let rotating = (fraction * head_dim as f64 / 2.0).floor() as usize;
                let freqs = (0..half)
                    .map(
                        |i| if i < rotating { 1.0 / base.powf((2 * i) as f64 / head_dim as f64) / factor } else { 0.0 },
                    )
                    .collect();
                (freqs, 1.0)
            }
        })
    }
}
