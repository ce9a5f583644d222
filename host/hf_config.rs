//! A model's `config.json` (Hugging Face transformers) read into a [`RopeConfig`]: the base,
//! the rotary and head dimensions, the table length, the style, the element type and the
//! scaling, from either the older `rope_scaling` object or transformers 5's `rope_parameters`
//! (global, or one entry per layer type).

use serde_json::{Map, Value};

use crate::config::{DType, RopeConfig, RopeStyle};
use crate::error::{ConfigError, Result};
use crate::scaling::RopeScaling;

/// `model_type`s whose attention rotates interleaved pairs (GPT-J style). A config's
/// `rope_interleave` flag, where present, decides instead.
///
/// Llama 4 (`llama4`, and `llama4_text` of its `text_config`) multiplies interleaved pairs as
/// complex numbers (transformers' `apply_rotary_emb`, `view_as_complex` over pairs
/// `(x[2i], x[2i + 1])`); DeepSeek-V3 and Kimi K2 configs omit `rope_interleave`, whose default
/// in transformers' config classes is true (`apply_rotary_pos_emb_interleave`: interleaved
/// pairs, written back de-interleaved; see the README for why the library's interleaved
/// layout gives the same attention scores).
pub const INTERLEAVED_MODEL_TYPES: &[&str] = &[
    "gptj",
    "codegen",
    "chatglm",
    "glm",
    "cohere",
    "cohere2",
    "deepseek_v2",
    "deepseek_v3",
    "kimi_k2",
    "llama4",
    "llama4_text",
];

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
        let config = parse(json, None)?;
        config.validate()?;
        Ok(config)
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
        let config = parse(json, Some(layer_type))?;
        config.validate()?;
        Ok(config)
    }
}

fn parse(json: &str, layer_type: Option<&str>) -> Parse<RopeConfig> {
    let root: Value = serde_json::from_str(json).map_err(|e| ConfigError::Json(e.to_string()))?;
    let Value::Object(mut top) = root else { return Err(ConfigError::Json("the top level is not an object".into())) };
    // Multimodal models keep the language model's settings in `text_config`.
    let has_own = ["rope_theta", "rope_parameters", "rope_scaling", "num_attention_heads", "head_dim"]
        .iter()
        .any(|k| top.contains_key(*k));
    if !has_own {
        if let Some(Value::Object(text)) = top.remove("text_config") {
            top = text;
        }
    }
    let top = &top;

    let head_dim = match first_integer(top, &["qk_rope_head_dim", "head_dim"])? {
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
    let max_position = first_integer(top, &["max_position_embeddings", "n_positions", "max_sequence_length"])?
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

    let base = match number(params, "rope_theta")? {
        Some(b) => b,
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
        None => (head_dim as f64 * fraction) as usize,
    };

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
    let scaling = match rope_type {
        "default" => RopeScaling::Default,
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
            rotary_dim = head_dim;
            RopeScaling::Proportional {
                partial_rotary_factor: fraction,
                factor: number(params, "factor")?.unwrap_or(1.0),
            }
        }
        other => return Err(ConfigError::UnknownRopeType(other.to_string())),
    };

    let style = match top.get("rope_interleave") {
        Some(Value::Bool(true)) => RopeStyle::GptJ,
        Some(Value::Bool(false)) => RopeStyle::NeoX,
        None | Some(Value::Null) => {
            let model_type = top.get("model_type").and_then(Value::as_str).unwrap_or("");
            if INTERLEAVED_MODEL_TYPES.contains(&model_type) {
                RopeStyle::GptJ
            } else {
                RopeStyle::NeoX
            }
        }
        Some(_) => return Err(invalid("rope_interleave", "expected true or false")),
    };
    let dtype = match top.get("torch_dtype").or(top.get("dtype")).and_then(Value::as_str) {
        Some("bfloat16") => DType::BF16,
        Some("float16") => DType::F16,
        _ => DType::F32,
    };
    Ok(RopeConfig::new(head_dim, max_position)
        .rotary_dim(rotary_dim)
        .base(base)
        .style(style)
        .dtype(dtype)
        .scaling(scaling))
}
