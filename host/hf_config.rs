//! A model's `config.json` (Hugging Face transformers) read into a [`RopeConfig`]: the base,
//! the rotary and head dimensions, the table length, the style, the element type and the
//! scaling, from either the older `rope_scaling` object or transformers 5's `rope_parameters`
//! (global, or one entry per layer type).

use serde_json::{Map, Value};

use crate::config::{DType, Mrope, RopeConfig, RopeStyle};
use crate::error::{ConfigError, Error, Result};
use crate::norm::{NormKind, QkNormSpec};
use crate::scaling::RopeScaling;

/// `model_type`s whose attention rotates interleaved pairs (GPT-J style), each checked
/// against its model's code in transformers (see docs/models.md). A config's
/// `rope_interleave` flag, where present, decides instead.
///
/// Llama 4 (`llama4`, and `llama4_text` of its `text_config`) multiplies interleaved pairs as
/// complex numbers (transformers' `apply_rotary_emb`, `view_as_complex` over pairs
/// `(x[2i], x[2i + 1])`); DeepSeek-V3 and Kimi K2 configs omit `rope_interleave`, whose default
/// in transformers' config classes is true (`apply_rotary_pos_emb_interleave`: interleaved
/// pairs, written back de-interleaved; see docs/models.md for why the library's interleaved
/// layout gives the same attention scores). `chatglm` (ChatGLM2/3, remote code) rotates
/// interleaved pairs of the first half of each head, as GLM does.
pub const INTERLEAVED_MODEL_TYPES: &[&str] = &[
    "gptj",
    "codegen",
    "chatglm",
    "glm",
    "glm4",
    "glm4v",
    "glm4v_text",
    "cohere",
    "cohere2",
    "deepseek_v2",
    "deepseek_v3",
    "kimi_k2",
    "llama4",
    "llama4_text",
    "ernie4_5",
    "ernie4_5_moe",
];

/// `model_type`s whose attention rotates halves (`rotate_half`, GPT-NeoX style), each checked
/// against its model's code in transformers (see docs/models.md). Any other
/// `model_type` also gets rotate-half pairs, but [`HfConfig::style_source`] says that it was
/// assumed, and [`HfConfig::strict`] refuses it.
pub const NEOX_MODEL_TYPES: &[&str] = &[
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
    "qwen2_vl",
    "qwen2_vl_text",
    "qwen2_5_vl",
    "qwen2_5_vl_text",
    "qwen3_vl",
    "qwen3_vl_text",
    "gemma",
    "gemma2",
    "gemma3",
    "gemma3_text",
    "gemma4",
    "gemma4_text",
    "phi3",
    "phi4_multimodal",
    "stablelm",
    "gpt_neox",
    "falcon",
    "olmo2",
    "glm4_moe",
    "gpt_oss",
    "granite",
];

/// `model_type`s without rotary embeddings (learned or sinusoidal absolute positions, or
/// ALiBi): reading one is [`ConfigError::NoRope`]. (`ernie` is the BERT-style ERNIE encoder;
/// ERNIE 4.5 is `ernie4_5`.)
pub const NO_ROPE_MODEL_TYPES: &[&str] = &["bert", "ernie", "gpt2", "opt", "bloom", "mpt"];

/// Where a configuration's pairing style came from ([`HfConfig::style_source`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StyleSource {
    /// The config's own `rope_interleave` flag.
    RopeInterleave,
    /// A `model_type` whose style this crate checked against the model's code (named).
    ModelType(String),
    /// A `model_type` this crate does not know (named; empty when the config has none):
    /// rotate-half pairs were assumed. Check the model's attention code, and set the style
    /// ([`RopeConfig::style`]) if it rotates interleaved pairs.
    Assumed(String),
}

type Parse<T> = std::result::Result<T, ConfigError>;

fn invalid(field: &str, problem: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { field: field.to_string(), problem: problem.into() }
}

/// A number field: `None` when absent or null.
fn number(obj: &Map<String, Value>, key: &str) -> Parse<Option<f64>> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_f64().map(Some).ok_or_else(|| invalid(key, "expected a number")),
    }
}

/// A non-negative integer field: `None` when absent or null.
fn integer(obj: &Map<String, Value>, key: &str) -> Parse<Option<usize>> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .and_then(|n| usize::try_from(n).ok())
            .map(Some)
            .ok_or_else(|| invalid(key, "expected a non-negative integer")),
    }
}

fn first_integer(obj: &Map<String, Value>, keys: &[&str]) -> Parse<Option<usize>> {
    for key in keys {
        if let Some(n) = integer(obj, key)? {
            return Ok(Some(n));
        }
    }
    Ok(None)
}

fn numbers(obj: &Map<String, Value>, key: &str) -> Parse<Vec<f64>> {
    match obj.get(key) {
        None | Some(Value::Null) => Err(ConfigError::Missing(key.to_string())),
        Some(Value::Array(items)) => {
            items.iter().map(|v| v.as_f64().ok_or_else(|| invalid(key, "expected an array of numbers"))).collect()
        }
        Some(_) => Err(invalid(key, "expected an array of numbers")),
    }
}

fn required(obj: &Map<String, Value>, key: &str) -> Parse<f64> {
    number(obj, key)?.ok_or_else(|| ConfigError::Missing(key.to_string()))
}

impl RopeConfig {
    /// Reads a model's `config.json`: `rope_theta`, `rope_scaling` or `rope_parameters`
    /// (with `rope_type`, or `type`), `max_position_embeddings` (the table's length),
    /// `original_max_position_embeddings`, `partial_rotary_factor` (or `rotary_pct`, or an
    /// explicit `rotary_dim`), `head_dim` (or `hidden_size / num_attention_heads`; DeepSeek's
    /// `qk_rope_head_dim`), `torch_dtype` and the style (`rope_interleave`, else the
    /// `model_type`: see [`INTERLEAVED_MODEL_TYPES`]). Multimodal configs are read from
    /// their `text_config`.
    ///
    /// A config whose parameters differ per layer type needs
    /// [`RopeConfig::from_hf_config_layer`]. An unknown `rope_type` or a missing field is a
    /// [`ConfigError`] naming it; malformed JSON is an error too, never a panic.
    ///
    /// ```
    /// use rope_cuda::{RopeConfig, RopeScaling};
    /// let json = r#"{"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32,
    ///     "max_position_embeddings": 131072, "rope_theta": 500000.0,
    ///     "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
    ///                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}"#;
    /// let config = RopeConfig::from_hf_config(json)?;
    /// assert_eq!((config.head_dim, config.max_position), (128, 131072));
    /// assert!(matches!(config.scaling, RopeScaling::Llama3 { .. }));
    /// # Ok::<(), rope_cuda::Error>(())
    /// ```
    pub fn from_hf_config(json: &str) -> Result<RopeConfig> {
        HfConfig::parse(json)?.rope()
    }

    /// [`RopeConfig::from_hf_config`], refusing a `model_type` whose pairing style this crate
    /// has not checked ([`ConfigError::UnknownModelType`]) instead of assuming rotate-half.
    ///
    /// ```
    /// use rope_cuda::{ConfigError, Error, RopeConfig};
    /// let json = r#"{"model_type": "my_new_model", "head_dim": 64, "num_attention_heads": 8,
    ///     "max_position_embeddings": 4096}"#;
    /// assert!(RopeConfig::from_hf_config(json).is_ok()); // rotate-half, assumed
    /// assert!(matches!(RopeConfig::from_hf_config_strict(json), Err(Error::Config(ConfigError::UnknownModelType(_)))));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn from_hf_config_strict(json: &str) -> Result<RopeConfig> {
        HfConfig::parse(json)?.strict()?.rope()
    }

    /// Like [`RopeConfig::from_hf_config`], for the layers of type `layer_type`
    /// (`full_attention`, `sliding_attention`, …) of a config with per-layer parameters; a
    /// config with one set of parameters serves every layer type.
    ///
    /// ```
    /// use rope_cuda::{ConfigError, Error, RopeConfig};
    /// let json = r#"{"model_type": "gemma4_text", "hidden_size": 2560, "num_attention_heads": 8,
    ///     "head_dim": 256, "max_position_embeddings": 131072,
    ///     "layer_types": ["sliding_attention", "full_attention"],
    ///     "rope_parameters": {
    ///         "full_attention": {"rope_type": "proportional", "rope_theta": 1000000.0, "partial_rotary_factor": 0.25},
    ///         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}"#;
    /// let local = RopeConfig::from_hf_config_layer(json, "sliding_attention")?;
    /// let global = RopeConfig::from_hf_config_layer(json, "full_attention")?;
    /// assert_eq!((local.base, global.base), (10_000.0, 1_000_000.0));
    /// assert!(matches!(RopeConfig::from_hf_config(json), Err(Error::Config(ConfigError::LayerTypeNeeded { .. }))));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn from_hf_config_layer(json: &str, layer_type: &str) -> Result<RopeConfig> {
        HfConfig::parse(json)?.rope_for_type(layer_type)
    }
}

/// A model's `config.json`, read once: its text model's settings, for the RoPE
/// configuration of the model ([`HfConfig::rope`]), of a layer type
/// ([`HfConfig::rope_for_type`]) or of a layer ([`HfConfig::layer`], `None` for a layer
/// without RoPE), and where the pairing style came from ([`HfConfig::style_source`]).
///
/// ```
/// use rope_cuda::{HfConfig, RopeStyle, StyleSource};
/// // Llama 4: every fourth layer has no RoPE (`no_rope_layers`), pairs are interleaved.
/// let json = r#"{"model_type": "llama4", "text_config": {"model_type": "llama4_text",
///     "head_dim": 128, "num_attention_heads": 40, "num_hidden_layers": 8,
///     "max_position_embeddings": 10485760, "rope_theta": 500000.0,
///     "no_rope_layers": [1, 1, 1, 0, 1, 1, 1, 0]}}"#;
/// let model = HfConfig::parse(json)?;
/// assert_eq!(model.num_layers(), Some(8));
/// assert!(model.layer(3)?.is_none());
/// let layer0 = model.layer(0)?.expect("layer 0 rotates");
/// assert_eq!(layer0.style, RopeStyle::GptJ);
/// assert_eq!(model.style_source(), StyleSource::ModelType("llama4_text".into()));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct HfConfig {
    /// The text model's settings (the top level, or its `text_config`).
    text: Map<String, Value>,
    /// The top level's `model_type`.
    model_type: String,
}

/// The shapes of multi-head latent attention ([`HfConfig::mla`], or [`MlaGeometry::new`]):
/// what the latent cache ([`MlaCache`](crate::MlaCache)) and q's rotary parts look like, and
/// the `eps` of `kv_a_layernorm` ([`MlaAppend::kv_c_norm`](crate::MlaAppend::kv_c_norm)).
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct MlaGeometry {
    /// `kv_lora_rank`: the compressed latent `kv_c` per token (512 in DeepSeek-V3).
    pub kv_lora_rank: usize,
    /// `qk_rope_head_dim`: the rotary part of each head of q, and `k_pe` (64).
    pub qk_rope_head_dim: usize,
    /// `qk_nope_head_dim`: each head of q before its rotary part (128).
    pub qk_nope_head_dim: usize,
    /// `v_head_dim`: each head's value (128).
    pub v_head_dim: usize,
    /// `num_attention_heads` (128).
    pub num_heads: usize,
    /// The `eps` of `kv_a_layernorm`, the norm of `kv_c`: 1e-6, the RMS norm class's default
    /// that DeepSeek-V2/V3 and Kimi K2 build it with (not the config's `rms_norm_eps`).
    pub kv_norm_eps: f32,
}

impl MlaGeometry {
    /// A geometry of these sizes (for models without a `config.json` at hand), with
    /// `kv_a_layernorm`'s `eps` of 1e-6.
    ///
    /// ```
    /// use rope_cuda::MlaGeometry;
    /// let v3 = MlaGeometry::new(512, 64, 128, 128, 128);
    /// assert_eq!((v3.latent_width(), v3.kv_norm_eps), (576, 1e-6));
    /// ```
    pub const fn new(
        kv_lora_rank: usize,
        qk_rope_head_dim: usize,
        qk_nope_head_dim: usize,
        v_head_dim: usize,
        num_heads: usize,
    ) -> Self {
        MlaGeometry { kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim, num_heads, kv_norm_eps: 1e-6 }
    }

    /// Elements of a latent cache row, `kv_lora_rank + qk_rope_head_dim` (576).
    pub const fn latent_width(&self) -> usize {
        self.kv_lora_rank + self.qk_rope_head_dim
    }

    /// Elements of a head of q, `qk_nope_head_dim + qk_rope_head_dim` (192): the rotary part
    /// is its last `qk_rope_head_dim`.
    pub const fn q_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }
}

impl HfConfig {
    /// Reads `config.json`'s text (multimodal configs: their `text_config`, or Qwen2.5-Omni's
    /// `thinker_config.text_config`). Malformed JSON is a [`ConfigError`], never a panic.
    pub fn parse(json: &str) -> Result<HfConfig> {
        Ok(text_of(json)?)
    }

    /// The top level's `model_type` (empty if absent).
    pub fn model_type(&self) -> &str {
        &self.model_type
    }

    /// The text model's `model_type` (its `text_config`'s, else the top level's).
    pub fn text_model_type(&self) -> &str {
        self.text.get("model_type").and_then(Value::as_str).unwrap_or(&self.model_type)
    }

    /// Where the pairing style comes from: `rope_interleave`, a checked `model_type` (the text
    /// model's or the top level's), or an assumption.
    pub fn style_source(&self) -> StyleSource {
        if matches!(self.text.get("rope_interleave"), Some(Value::Bool(_))) {
            return StyleSource::RopeInterleave;
        }
        for t in [self.text_model_type(), self.model_type()] {
            if INTERLEAVED_MODEL_TYPES.contains(&t) || NEOX_MODEL_TYPES.contains(&t) {
                return StyleSource::ModelType(t.to_string());
            }
        }
        StyleSource::Assumed(self.text_model_type().to_string())
    }

    /// `self`, or [`ConfigError::UnknownModelType`] when the style would be assumed.
    pub fn strict(self) -> Result<HfConfig> {
        match self.style_source() {
            StyleSource::Assumed(t) => Err(ConfigError::UnknownModelType(t).into()),
            _ => Ok(self),
        }
    }

    /// Number of layers (`num_hidden_layers`, `n_layer`, `num_layers`), if the config says.
    pub fn num_layers(&self) -> Option<usize> {
        first_integer(&self.text, &["num_hidden_layers", "n_layer", "num_layers"]).ok().flatten()
    }

    /// Layer `layer`'s type: `layer_types[layer]`, or for Gemma 3 and Cohere 2 configs
    /// without it, their `sliding_window_pattern` rule (every `pattern`-th layer full
    /// attention, the others sliding; Gemma 3's default pattern is 6, Cohere 2's 4).
    pub fn layer_type(&self, layer: usize) -> Result<Option<String>> {
        match self.text.get("layer_types") {
            Some(Value::Array(types)) => {
                return match types.get(layer) {
                    Some(Value::String(t)) => Ok(Some(t.clone())),
                    _ => Err(self.no_such_layer(layer, types.len())),
                };
            }
            None | Some(Value::Null) => {}
            Some(_) => return Err(invalid("layer_types", "expected an array of strings").into()),
        }
        let default_pattern = match self.text_model_type() {
            "gemma3" | "gemma3_text" => 6,
            "cohere2" => 4,
            _ => return Ok(None),
        };
        let pattern = integer(&self.text, "sliding_window_pattern")?.unwrap_or(default_pattern).max(1);
        let full = (layer + 1) % pattern == 0;
        Ok(Some(if full { "full_attention" } else { "sliding_attention" }.to_string()))
    }

    /// The sliding window of layer `layer`: the keys it attends to, `Some(window)` for a layer
    /// that sees only its last `sliding_window` positions, `None` for one that sees them all.
    /// A layer's cache then needs `window` rows per sequence
    /// ([`KvCache::window`](crate::KvCache::window)). By the config: none where
    /// `sliding_window` is absent or null, or `use_sliding_window` is false (Qwen2 and Qwen3);
    /// else the layers of type `sliding_attention` ([`HfConfig::layer_type`]: `layer_types`,
    /// or Gemma 3's and Cohere 2's pattern) where the config types its layers; Gemma 2 without
    /// `layer_types`: its even layers (transformers' default); Qwen2 and Qwen3: the layers from
    /// `max_window_layers` on; every other model (Mistral, Phi-3): every layer.
    ///
    /// ```
    /// use rope_cuda::HfConfig;
    /// // gpt-oss: sliding layers of 128 alternate with full ones.
    /// let json = r#"{"model_type": "gpt_oss", "num_hidden_layers": 4, "sliding_window": 128,
    ///     "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]}"#;
    /// let model = HfConfig::parse(json)?;
    /// assert_eq!((model.sliding_window(0)?, model.sliding_window(1)?), (Some(128), None));
    /// let mistral = HfConfig::parse(r#"{"model_type": "mistral", "sliding_window": 4096}"#)?;
    /// assert_eq!(mistral.sliding_window(31)?, Some(4096));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn sliding_window(&self, layer: usize) -> Result<Option<usize>> {
        if let Some(n) = self.num_layers() {
            if layer >= n {
                return Err(self.no_such_layer(layer, n));
            }
        }
        let Some(window) = integer(&self.text, "sliding_window")? else { return Ok(None) };
        if window == 0 {
            return Err(invalid("sliding_window", "a window of no positions").into());
        }
        match self.text.get("use_sliding_window") {
            Some(Value::Bool(false)) => return Ok(None),
            None | Some(Value::Null) | Some(Value::Bool(true)) => {}
            Some(_) => return Err(invalid("use_sliding_window", "expected a boolean").into()),
        }
        if let Some(t) = self.layer_type(layer)? {
            return Ok((t == "sliding_attention").then_some(window));
        }
        Ok(match self.text_model_type() {
            "gemma2" => (layer % 2 == 0).then_some(window),
            "qwen2" | "qwen2_moe" | "qwen3" | "qwen3_moe" => {
                let from = integer(&self.text, "max_window_layers")?.unwrap_or(0);
                (layer >= from).then_some(window)
            }
            _ => Some(window),
        })
    }

    /// Whether layer `layer` applies RoPE: `no_rope_layers[layer]` where the config lists it
    /// (Llama 4, SmolLM3: nonzero means RoPE); Llama 4 without the list: all but every
    /// `no_rope_layer_interval`-th layer (default 4); Cohere 2: only its sliding-window
    /// layers; every other model: every layer.
    pub fn layer_uses_rope(&self, layer: usize) -> Result<bool> {
        if let Some(n) = self.num_layers() {
            if layer >= n {
                return Err(self.no_such_layer(layer, n));
            }
        }
        match self.text.get("no_rope_layers") {
            Some(Value::Array(flags)) if !flags.is_empty() => {
                return match flags.get(layer) {
                    Some(Value::Bool(b)) => Ok(*b),
                    Some(v) if v.as_f64().is_some() => Ok(v.as_f64() != Some(0.0)),
                    Some(_) => Err(invalid("no_rope_layers", "expected numbers or booleans").into()),
                    None => Err(self.no_such_layer(layer, flags.len())),
                };
            }
            None | Some(Value::Null) | Some(Value::Array(_)) => {}
            Some(_) => return Err(invalid("no_rope_layers", "expected an array").into()),
        }
        Ok(match self.text_model_type() {
            "llama4" | "llama4_text" => {
                let interval = integer(&self.text, "no_rope_layer_interval")?.unwrap_or(4).max(1);
                (layer + 1) % interval != 0
            }
            "cohere2" => self.layer_type(layer)?.as_deref() != Some("full_attention"),
            _ => true,
        })
    }

    /// Layer `layer`'s RoPE configuration, or `None` for a layer without RoPE
    /// ([`HfConfig::layer_uses_rope`]); parameters per layer type where the config has them
    /// ([`HfConfig::layer_type`]).
    pub fn layer(&self, layer: usize) -> Result<Option<RopeConfig>> {
        if !self.layer_uses_rope(layer)? {
            return Ok(None);
        }
        let layer_type = self.layer_type(layer)?;
        let head_dim = self.head_dim_of(Some(layer), layer_type.as_deref())?;
        let config = parse(&self.text, layer_type.as_deref(), &self.model_type, head_dim)?;
        config.validate()?;
        Ok(Some(config))
    }

    /// A layer's own head dimension, where it differs from `head_dim`: transformers'
    /// `per_layer_config[layer].head_dim`, or Gemma 4's full-attention layers' `global_head_dim`
    /// (512 where the config leaves it out, as transformers' `Gemma4TextConfig`).
    fn head_dim_of(&self, layer: Option<usize>, layer_type: Option<&str>) -> Parse<Option<usize>> {
        if let (Some(layer), Some(Value::Object(per))) = (layer, self.text.get("per_layer_config")) {
            if let Some(Value::Object(own)) = per.get(&layer.to_string()) {
                if let Some(d) = integer(own, "head_dim")? {
                    return Ok(Some(d));
                }
            }
        }
        let gemma4 = matches!(self.text_model_type(), "gemma4" | "gemma4_text");
        if gemma4 && layer_type == Some("full_attention") {
            if let Some(d) = integer(&self.text, "global_head_dim")? {
                return Ok(Some(d));
            }
            // A saved config carries the override per layer: take a full-attention layer's.
            if let Some(Value::Object(per)) = self.text.get("per_layer_config") {
                for (k, v) in per {
                    let full = k.parse().ok().and_then(|l| self.layer_type(l).ok().flatten());
                    if let (Some("full_attention"), Value::Object(own)) = (full.as_deref(), v) {
                        if let Some(d) = integer(own, "head_dim")? {
                            return Ok(Some(d));
                        }
                    }
                }
            }
            return Ok(Some(512));
        }
        Ok(None)
    }

    /// The QK-norm layer `layer` applies to q and k before attention, as the fused append
    /// takes it ([`QkNorm`](crate::QkNorm)): its kind, `eps` (`rms_norm_eps`, default 1e-6)
    /// and the lengths of its weights where the config gives the sizes, as a [`QkNormSpec`]
    /// that makes the [`QkNorm`](crate::QkNorm) of the model's weights
    /// ([`QkNormSpec::weights`], [`QkNormSpec::unweighted`]); `None` for a model (or layer)
    /// without one. By the text model's type: Qwen3,
    /// Qwen3-MoE, Qwen3-Next and Qwen3-VL's text models normalize each head with a weight
    /// ([`NormKind::Rms`]), as do models with `use_qk_norm` that transformers builds that way
    /// (GLM-4.5's `glm4_moe`); Gemma 3 and Gemma 4 with `1 + w` ([`NormKind::RmsOnePlus`]);
    /// Llama 4 with `use_qk_norm`, on its RoPE layers only, without a weight
    /// ([`NormKind::RmsUnit`]); OLMo 2 and 3 normalize the whole q and k projections, across
    /// heads ([`NormKind::RmsProjection`]). Models with `qk_layernorm` use a LayerNorm: the
    /// fused append does not take those ([`Error::Norm`](crate::Error::Norm)); neither does
    /// `use_qk_norm` on a model type whose kind of norm is not known here.
    ///
    /// ```
    /// use rope_cuda::{HfConfig, NormKind};
    /// let qwen3 = HfConfig::parse(r#"{"model_type": "qwen3", "head_dim": 128, "rms_norm_eps": 1e-6}"#)?;
    /// let spec = qwen3.qk_norm(0)?.expect("Qwen3 normalizes each head");
    /// assert_eq!((spec.kind(), spec.eps(), spec.weight_lens()), (NormKind::Rms, 1e-6, Some((128, 128))));
    /// let olmo2 = HfConfig::parse(r#"{"model_type": "olmo2", "rms_norm_eps": 1e-6}"#)?;
    /// assert_eq!(olmo2.qk_norm(0)?.map(|s| s.kind()), Some(NormKind::RmsProjection));
    /// let llama = HfConfig::parse(r#"{"model_type": "llama", "rms_norm_eps": 1e-5}"#)?;
    /// assert_eq!(llama.qk_norm(0)?, None);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn qk_norm(&self, layer: usize) -> Result<Option<QkNormSpec>> {
        let flag = |key: &str| match self.text.get(key) {
            Some(Value::Bool(b)) => Ok(*b),
            None | Some(Value::Null) => Ok(false),
            Some(_) => Err(invalid(key, "expected a boolean")),
        };
        let eps = number(&self.text, "rms_norm_eps")?.unwrap_or(1e-6);
        if !(eps.is_finite() && eps > 0.0) {
            return Err(invalid("rms_norm_eps", "expected a finite number greater than 0").into());
        }
        let kind = match self.text_model_type() {
            "qwen3" | "qwen3_moe" | "qwen3_next" | "qwen3_vl_text" | "qwen3_vl_moe_text" | "qwen3_vl"
            | "qwen3_vl_moe" => NormKind::Rms,
            "gemma3" | "gemma3_text" | "gemma4" | "gemma4_text" => NormKind::RmsOnePlus,
            "llama4" | "llama4_text" if flag("use_qk_norm")? => match self.layer_uses_rope(layer)? {
                true => NormKind::RmsUnit,
                false => return Ok(None),
            },
            "olmo2" | "olmo3" => NormKind::RmsProjection,
            "glm4_moe" if flag("use_qk_norm")? => NormKind::Rms,
            _ if flag("qk_layernorm")? => return Err(Error::Norm("qk_layernorm: a LayerNorm, not an RMS norm")),
            _ if flag("use_qk_norm")? => {
                return Err(Error::Norm("use_qk_norm: the norm of this model type is not known"))
            }
            _ => return Ok(None),
        };
        // The weights' lengths: a head's, or the whole projections'.
        let heads = integer(&self.text, "num_attention_heads")?;
        let kv_heads = integer(&self.text, "num_key_value_heads")?.or(heads);
        let layer_type = self.layer_type(layer)?;
        let head_dim = match self.head_dim_of(Some(layer), layer_type.as_deref())? {
            Some(d) => Some(d),
            None => match (integer(&self.text, "head_dim")?, integer(&self.text, "hidden_size")?, heads) {
                (Some(d), _, _) => Some(d),
                (None, Some(hidden), Some(h)) if h > 0 => Some(hidden / h),
                _ => None,
            },
        };
        let lens = match kind {
            NormKind::RmsProjection => head_dim.zip(heads.zip(kv_heads)).map(|(d, (h, kv))| (h * d, kv * d)),
            _ => head_dim.map(|d| (d, d)),
        };
        Ok(Some(QkNormSpec::new(kind, eps as f32, lens)))
    }

    /// The multi-head latent attention geometry of a model that has it (DeepSeek-V2 and V3,
    /// Kimi K2, and any config with `kv_lora_rank`): [`ConfigError::NoMla`] for one without.
    /// Its RoPE is [`HfConfig::rope`]'s (head_dim `qk_rope_head_dim`, the interleaved pairs,
    /// DeepSeek's yarn with `mscale` and `mscale_all_dim`), the [`Rope`](crate::Rope) that
    /// [`Rope::append_mla`](crate::Rope::append_mla) takes.
    ///
    /// ```
    /// use rope_cuda::{ConfigError, Error, HfConfig, MlaGeometry};
    /// let v3 = HfConfig::parse(r#"{"model_type": "deepseek_v3", "num_attention_heads": 128,
    ///     "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128}"#)?;
    /// let g = v3.mla()?;
    /// assert_eq!((g.latent_width(), g.q_head_dim(), g.kv_norm_eps), (576, 192, 1e-6));
    /// let llama = HfConfig::parse(r#"{"model_type": "llama", "num_attention_heads": 32}"#)?;
    /// assert!(matches!(llama.mla(), Err(Error::Config(ConfigError::NoMla(_)))));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn mla(&self) -> Result<MlaGeometry> {
        let Some(kv_lora_rank) = integer(&self.text, "kv_lora_rank")? else {
            return Err(ConfigError::NoMla(self.text_model_type().to_string()).into());
        };
        let need = |key: &str| -> Result<usize> {
            match integer(&self.text, key)? {
                Some(0) => Err(invalid(key, "expected an integer above 0").into()),
                Some(n) => Ok(n),
                None => Err(ConfigError::Missing(key.to_string()).into()),
            }
        };
        if kv_lora_rank == 0 {
            return Err(invalid("kv_lora_rank", "expected an integer above 0").into());
        }
        Ok(MlaGeometry {
            kv_lora_rank,
            qk_rope_head_dim: need("qk_rope_head_dim")?,
            qk_nope_head_dim: need("qk_nope_head_dim")?,
            v_head_dim: need("v_head_dim")?,
            num_heads: need("num_attention_heads")?,
            kv_norm_eps: 1e-6,
        })
    }

    /// The model's RoPE configuration (as [`RopeConfig::from_hf_config`]).
    pub fn rope(&self) -> Result<RopeConfig> {
        let config = parse(&self.text, None, &self.model_type, None)?;
        config.validate()?;
        Ok(config)
    }

    /// The RoPE configuration of the layers of type `layer_type` (as
    /// [`RopeConfig::from_hf_config_layer`]).
    pub fn rope_for_type(&self, layer_type: &str) -> Result<RopeConfig> {
        let head_dim = self.head_dim_of(None, Some(layer_type))?;
        let config = parse(&self.text, Some(layer_type), &self.model_type, head_dim)?;
        config.validate()?;
        Ok(config)
    }

    fn no_such_layer(&self, layer: usize, layers: usize) -> crate::Error {
        ConfigError::NoSuchLayer { layer, layers }.into()
    }
}

fn text_of(json: &str) -> Parse<HfConfig> {
    let root: Value = serde_json::from_str(json).map_err(|e| ConfigError::Json(e.to_string()))?;
    let Value::Object(mut top) = root else { return Err(ConfigError::Json("the top level is not an object".into())) };
    let model_type = top.get("model_type").and_then(Value::as_str).unwrap_or("").to_string();
    // Multimodal models keep the language model's settings in `text_config` (Qwen2.5-Omni:
    // in its thinker's).
    let has_own = ["rope_theta", "rope_parameters", "rope_scaling", "num_attention_heads", "head_dim"]
        .iter()
        .any(|k| top.contains_key(*k));
    if !has_own {
        if let Some(Value::Object(mut thinker)) = top.remove("thinker_config") {
            if let Some(Value::Object(text)) = thinker.remove("text_config") {
                top = text;
            }
        } else if let Some(Value::Object(text)) = top.remove("text_config") {
            top = text;
        }
    }
    Ok(HfConfig { text: top, model_type })
}

fn parse(
    top: &Map<String, Value>,
    layer_type: Option<&str>,
    outer_type: &str,
    head_dim: Option<usize>,
) -> Parse<RopeConfig> {
    let own_head_dim = head_dim;
    let model_type = top.get("model_type").and_then(Value::as_str).unwrap_or(outer_type);
    if NO_ROPE_MODEL_TYPES.contains(&model_type) {
        return Err(ConfigError::NoRope(model_type.to_string()));
    }
    // ChatGLM2/3 (remote code, `modeling_chatglm.py`): `kv_channels` per head, RoPE on the
    // first half of each head, `seq_length` positions, base `10000 * rope_ratio`.
    let chatglm = model_type == "chatglm";
    let head_keys: &[&str] = if chatglm { &["kv_channels"] } else { &["qk_rope_head_dim", "head_dim"] };
    let head_dim = match own_head_dim.map_or_else(|| first_integer(top, head_keys), |d| Ok(Some(d)))? {
        Some(d) => d,
        None => {
            let hidden = first_integer(top, &["hidden_size", "n_embd", "d_model"])?
                .ok_or_else(|| ConfigError::Missing("head_dim or hidden_size".into()))?;
            let heads = first_integer(top, &["num_attention_heads", "n_head", "num_heads"])?
                .ok_or_else(|| ConfigError::Missing("num_attention_heads".into()))?;
            if heads == 0 {
                return Err(invalid("num_attention_heads", "must be at least 1"));
            }
            hidden / heads
        }
    };
    let max_position =
        first_integer(top, &["max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"])?
            .ok_or_else(|| ConfigError::Missing("max_position_embeddings".into()))?;

    // transformers: `rope_scaling` wins over `rope_parameters` where both are set.
    let empty = Map::new();
    let mut params = &empty;
    for key in ["rope_parameters", "rope_scaling"] {
        match top.get(key) {
            None | Some(Value::Null) => {}
            Some(Value::Object(p)) => params = p,
            Some(_) => return Err(invalid(key, "expected an object")),
        }
    }
    // Per-layer parameters: every value an object (or null), keyed by layer type.
    let nested = !params.is_empty()
        && params.values().all(|v| v.is_object() || v.is_null())
        && !params.contains_key("rope_type")
        && !params.contains_key("type");
    if nested {
        let available = params.keys().cloned().collect::<Vec<_>>().join(", ");
        let Some(layer) = layer_type else { return Err(ConfigError::LayerTypeNeeded { available }) };
        params = match params.get(layer) {
            Some(Value::Object(p)) => p,
            _ => return Err(ConfigError::NoSuchLayerType { asked: layer.to_string(), available }),
        };
    }

    // Gemma 3's older configs: sliding layers rotate with `rope_local_base_freq` and no
    // scaling; the scaling and `rope_theta` are the full-attention layers'.
    let local_base = match layer_type {
        Some("sliding_attention") if !nested => number(top, "rope_local_base_freq")?,
        _ => None,
    };
    if local_base.is_some() {
        params = &empty;
    }
    let base = match local_base.or(number(params, "rope_theta")?) {
        Some(b) => b,
        None if chatglm => 10_000.0 * number(top, "rope_ratio")?.unwrap_or(1.0),
        None => number(top, "rope_theta")?.or(number(top, "rotary_emb_base")?).unwrap_or(10_000.0),
    };
    let fraction = match number(params, "partial_rotary_factor")? {
        Some(f) => f,
        None => number(top, "partial_rotary_factor")?.or(number(top, "rotary_pct")?).unwrap_or(1.0),
    };
    if !(fraction.is_finite() && fraction > 0.0 && fraction <= 1.0) {
        return Err(invalid("partial_rotary_factor", "must be in (0, 1]"));
    }
    // transformers: `int(head_dim * partial_rotary_factor)`; GPT-J names it outright.
    let mut rotary_dim = match integer(top, "rotary_dim")? {
        Some(r) => r,
        None if chatglm => head_dim / 2,
        None => (head_dim as f64 * fraction) as usize,
    };

    let mrope = mrope_of(top, params)?;
    let rope_type = match (params.get("rope_type"), params.get("type")) {
        (Some(Value::String(t)), _) | (None, Some(Value::String(t))) => t.as_str(),
        (None | Some(Value::Null), None | Some(Value::Null)) => "default",
        _ => return Err(invalid("rope_type", "expected a string")),
    };
    // The pretraining length: a top-level `original_max_position_embeddings` wins (Phi-3
    // keeps it there), then the parameters', then `max_position_embeddings`.
    let original = match integer(top, "original_max_position_embeddings")? {
        Some(o) => o,
        None => integer(params, "original_max_position_embeddings")?.unwrap_or(max_position),
    };
    let scaling = scaling_of(rope_type, params, (max_position, original), (head_dim, fraction), &mut rotary_dim)?;
    let (style, dtype) = (style_of(top, outer_type)?, dtype_of(top));
    Ok(RopeConfig::new(head_dim, max_position)
        .rotary_dim(rotary_dim)
        .base(base)
        .style(style)
        .dtype(dtype)
        .scaling(scaling)
        .mrope(mrope))
}

/// MRoPE's sections and order (`mrope_section`, `mrope_interleaved` in the parameters or at the
/// top level), if the parameters name sections.
fn mrope_of(top: &Map<String, Value>, params: &Map<String, Value>) -> Parse<Option<Mrope>> {
    Ok(match params.get("mrope_section") {
        None | Some(Value::Null) => None,
        Some(Value::Array(items)) if items.len() == 3 => {
            let mut sections = [0usize; 3];
            for (s, v) in sections.iter_mut().zip(items) {
                *s = v
                    .as_u64()
                    .and_then(|n| usize::try_from(n).ok())
                    .ok_or_else(|| invalid("mrope_section", "expected three non-negative integers"))?;
            }
            let interleaved = match params.get("mrope_interleaved").or(top.get("mrope_interleaved")) {
                None | Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(_) => return Err(invalid("mrope_interleaved", "expected true or false")),
            };
            Some(Mrope::new(sections, interleaved))
        }
        Some(_) => return Err(invalid("mrope_section", "expected three non-negative integers")),
    })
}

/// The scaling of `rope_type` from its parameters, with the model's `max_position_embeddings`
/// and pretraining length (`original`), its head dim and rotary fraction; `proportional`
/// rotates pairs across the whole head (`rotary_dim` set to `head_dim`).
fn scaling_of(
    rope_type: &str,
    params: &Map<String, Value>,
    (max_position, original): (usize, usize),
    (head_dim, fraction): (usize, f64),
    rotary_dim: &mut usize,
) -> Parse<RopeScaling> {
    Ok(match rope_type {
        // Qwen2-VL's older configs name MRoPE as the type; its sections say the rest.
        "default" | "mrope" => RopeScaling::Default,
        "linear" => RopeScaling::Linear { factor: required(params, "factor")? },
        "dynamic" => {
            RopeScaling::Dynamic { factor: required(params, "factor")?, max_position_embeddings: max_position }
        }
        "yarn" => {
            let factor = match number(params, "factor")? {
                Some(f) => f,
                None if original > 0 => max_position as f64 / original as f64,
                None => return Err(ConfigError::Missing("factor".into())),
            };
            // transformers: `get("beta_fast") or 32`: zero counts as unset.
            let or = |v: Option<f64>, d: f64| v.filter(|x| *x != 0.0).unwrap_or(d);
            let truncate = match params.get("truncate") {
                None | Some(Value::Null) => true,
                Some(Value::Bool(b)) => *b,
                Some(_) => return Err(invalid("truncate", "expected true or false")),
            };
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: original,
                beta_fast: or(number(params, "beta_fast")?, 32.0),
                beta_slow: or(number(params, "beta_slow")?, 1.0),
                mscale: number(params, "mscale")?,
                mscale_all_dim: number(params, "mscale_all_dim")?,
                attention_factor: number(params, "attention_factor")?,
                truncate,
            }
        }
        "longrope" => {
            let factor = match number(params, "factor")? {
                Some(f) => f,
                None if original > 0 => max_position as f64 / original as f64,
                None => return Err(ConfigError::Missing("factor".into())),
            };
            RopeScaling::LongRope {
                short_factor: numbers(params, "short_factor")?,
                long_factor: numbers(params, "long_factor")?,
                original_max_position_embeddings: original,
                factor,
                attention_factor: number(params, "attention_factor")?,
            }
        }
        "llama3" => RopeScaling::Llama3 {
            factor: required(params, "factor")?,
            low_freq_factor: required(params, "low_freq_factor")?,
            high_freq_factor: required(params, "high_freq_factor")?,
            original_max_position_embeddings: original,
        },
        "proportional" => {
            // Pairs span the whole head; the fraction decides how many rotate.
            *rotary_dim = head_dim;
            RopeScaling::Proportional {
                partial_rotary_factor: fraction,
                factor: number(params, "factor")?.unwrap_or(1.0),
            }
        }
        other => return Err(ConfigError::UnknownRopeType(other.to_string())),
    })
}

/// The pairing style: `rope_interleave`, else the model types known to pair interleaved.
fn style_of(top: &Map<String, Value>, outer_type: &str) -> Parse<RopeStyle> {
    Ok(match top.get("rope_interleave") {
        Some(Value::Bool(true)) => RopeStyle::GptJ,
        Some(Value::Bool(false)) => RopeStyle::NeoX,
        None | Some(Value::Null) => {
            let model_type = top.get("model_type").and_then(Value::as_str).unwrap_or("");
            if INTERLEAVED_MODEL_TYPES.contains(&model_type) || INTERLEAVED_MODEL_TYPES.contains(&outer_type) {
                RopeStyle::GptJ
            } else {
                RopeStyle::NeoX
            }
        }
        Some(_) => return Err(invalid("rope_interleave", "expected true or false")),
    })
}

/// The checkpoint's element type (`torch_dtype` or `dtype`; f32 where neither names a half type).
fn dtype_of(top: &Map<String, Value>) -> DType {
    match top.get("torch_dtype").or(top.get("dtype")).and_then(Value::as_str) {
        Some("bfloat16") => DType::BF16,
        Some("float16") => DType::F16,
        _ => DType::F32,
    }
}
