//! RoPE scaling and model configs: each `config.json` in `tests/data/configs` read into a
//! `RopeConfig`, its frequencies and attention factor against transformers' own numbers
//! (`tests/data/golden_scaling.json`, made by `make_golden_scaling.py`), the f32 table
//! against f64 up to position 2^20, typed errors for bad configs, a parser that never
//! panics, and the scaled tables applied on the GPU.

mod common;

use common::{data_file, download_t, gpu, test_seed, upload_t, TestElem};
use proptest::prelude::*;
use rope_cuda::reference::{rope_row_freqs, uniform};
use rope_cuda::{
    table_row, ConfigError, DType, Direction, Error, Layout, Positions, Rope, RopeArgs, RopeConfig, RopeStyle,
    TensorMut,
};
use serde_json::Value;

fn config_json(name: &str) -> String {
    String::from_utf8(data_file(&format!("configs/{name}"))).unwrap()
}

struct Case {
    config: String,
    seq_len: Option<usize>,
    attention: f64,
    inv_freq: Vec<f64>,
    cos: Vec<Vec<f64>>,
    sin: Vec<Vec<f64>>,
}

fn golden() -> (Vec<usize>, Vec<Case>) {
    let v: Value = serde_json::from_slice(&data_file("golden_scaling.json")).unwrap();
    let floats = |v: &Value| -> Vec<f64> { v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect() };
    let rows = |v: &Value| -> Vec<Vec<f64>> { v.as_array().unwrap().iter().map(floats).collect() };
    let positions = v["positions"].as_array().unwrap().iter().map(|p| p.as_u64().unwrap() as usize).collect();
    let cases = v["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| Case {
            config: c["config"].as_str().unwrap().to_string(),
            seq_len: c["seq_len"].as_u64().map(|s| s as usize),
            attention: c["attention"].as_f64().unwrap(),
            inv_freq: floats(&c["inv_freq"]),
            cos: rows(&c["cos"]),
            sin: rows(&c["sin"]),
        })
        .collect();
    (positions, cases)
}

fn config_of(case: &Case) -> RopeConfig {
    RopeConfig::from_hf_config(&config_json(&case.config)).unwrap().seq_len(case.seq_len)
}

#[test]
fn configs_read_into_the_models_settings() {
    use DType::*;
    use RopeStyle::*;
    type Expected = (&'static str, usize, usize, RopeStyle, usize, f64, DType, &'static str);
    let cases: [Expected; 10] = [
        ("llama-3.1-8b.json", 128, 128, NeoX, 131072, 5e5, BF16, "llama3"),
        ("qwen2.5-7b.json", 128, 128, NeoX, 32768, 1e6, BF16, "default"),
        ("phi-3-mini-128k.json", 96, 96, NeoX, 131072, 1e4, BF16, "longrope"),
        ("deepseek-v2-lite.json", 64, 64, GptJ, 163840, 1e4, BF16, "yarn"),
        ("qwen3-yarn.json", 128, 128, NeoX, 131072, 1e6, BF16, "yarn"),
        ("gpt-neox-20b.json", 96, 24, NeoX, 2048, 1e4, F16, "default"),
        ("gpt-j-6b.json", 256, 64, GptJ, 2048, 1e4, F32, "default"),
        ("llama-linear.json", 128, 128, NeoX, 16384, 1e4, F16, "linear"),
        ("llama-dynamic.json", 128, 128, NeoX, 4096, 1e4, F16, "dynamic"),
        ("proportional.json", 256, 256, NeoX, 131072, 1e6, BF16, "proportional"),
    ];
    for (file, head_dim, rotary_dim, style, max_position, base, dtype, rope_type) in cases {
        let c = RopeConfig::from_hf_config(&config_json(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
        let got = (c.head_dim, c.rotary_dim, c.style, c.max_position, c.base, c.dtype, c.scaling.rope_type());
        assert_eq!(got, (head_dim, rotary_dim, style, max_position, base, dtype, rope_type), "{file}");
    }
    // Per-layer parameters (transformers 5): one layer type at a time.
    let json = config_json("per-layer.json");
    // Gemma 4's full-attention layers have their own head dim (`global_head_dim`).
    let full = RopeConfig::from_hf_config_layer(&json, "full_attention").unwrap();
    assert_eq!((full.head_dim, full.rotary_dim, full.base, full.scaling.rope_type()), (512, 512, 1e6, "proportional"));
    let sliding = RopeConfig::from_hf_config_layer(&json, "sliding_attention").unwrap();
    assert_eq!(
        (sliding.head_dim, sliding.rotary_dim, sliding.base, sliding.scaling.rope_type()),
        (256, 256, 1e4, "default")
    );
    assert!(matches!(RopeConfig::from_hf_config(&json), Err(Error::Config(ConfigError::LayerTypeNeeded { .. }))));
    assert!(matches!(
        RopeConfig::from_hf_config_layer(&json, "chunked_attention"),
        Err(Error::Config(ConfigError::NoSuchLayerType { .. }))
    ));
    // A config with one set of parameters serves every layer type.
    let llama = config_json("llama-3.1-8b.json");
    assert_eq!(RopeConfig::from_hf_config_layer(&llama, "full_attention"), RopeConfig::from_hf_config(&llama));
    // DeepSeek's yarn: mscale equal to mscale_all_dim gives an attention factor of exactly 1.
    let ds = RopeConfig::from_hf_config(&config_json("deepseek-v2-lite.json")).unwrap();
    assert_eq!(ds.frequencies().unwrap().1, 1.0);
}

/// inv_freq and the attention factor against transformers, which computes inv_freq in f32
/// (a power, a division and, for the blends, a few more roundings: 8 f32 ulps allowed) and
/// the attention factor in Python floats (f64).
#[test]
fn frequencies_match_transformers() {
    let (_, cases) = golden();
    assert_eq!(cases.len(), 12);
    for case in &cases {
        let what = format!("{} seq_len {:?}", case.config, case.seq_len);
        let (freqs, attention) = config_of(case).frequencies().unwrap();
        assert!((attention - case.attention).abs() <= 1e-12 * case.attention, "{what}: attention {attention}");
        assert_eq!(freqs.len(), case.inv_freq.len(), "{what}");
        for (i, (&ours, &theirs)) in freqs.iter().zip(&case.inv_freq).enumerate() {
            let bound = ours * 2f64.powi(-20);
            assert!((ours - theirs).abs() <= bound, "{what}: inv_freq[{i}] {ours:e} vs {theirs:e}");
        }
    }
}

/// The table's cos and sin at the golden positions against transformers' f32 values. Theirs
/// rounds `p * inv_freq` to f32 (an angle error up to 2^-24 of the angle), starts from their
/// f32 inv_freq (`p * |their - our inv_freq|` more), and rounds cos, sin and the product with
/// the attention factor (2^-23 and 2^-24, relative to the attention factor): the bound below
/// is the sum, written out.
#[test]
fn tables_match_transformers_within_its_f32_rounding() {
    let (positions, cases) = golden();
    for case in &cases {
        let (freqs, attention) = config_of(case).frequencies().unwrap();
        for (k, &p) in positions.iter().enumerate() {
            for (i, entry) in table_row(&freqs, attention, p).enumerate() {
                let (ours, theirs) = (&freqs[i], &case.inv_freq[i]);
                let angle_error = p as f64 * (ours - theirs).abs() + 2f64.powi(-24) * p as f64 * theirs;
                let bound = attention * (angle_error + 2f64.powi(-23) + 2f64.powi(-24)) + 2f64.powi(-24);
                for (what, got, want) in [("cos", entry[0], case.cos[k][i]), ("sin", entry[1], case.sin[k][i])] {
                    let err = (got as f64 - want).abs();
                    assert!(
                        err <= bound,
                        "{} seq_len {:?}: {what} at position {p}, pair {i}: {got} vs {want} (bound {bound:e})",
                        case.config,
                        case.seq_len
                    );
                }
            }
        }
    }
}

/// Against the f64 reference of the same frequencies (its angle reduced exactly,
/// `reference::sin_cos`), the stored f32 table is within 2e-7 (and the hi + lo pair within
/// 1e-13) at every position up to 2^20. (Against the plain f64 product `p * f` the pair is
/// off by that product's own rounding: about 1e-12 already at position 4095.)
#[test]
fn f32_tables_are_within_2e_7_of_f64_up_to_2_20() {
    let (_, cases) = golden();
    for case in &cases {
        let (freqs, attention) = config_of(case).frequencies().unwrap();
        for p in [0usize, 1, 4095, 4096, 32767, 131071, 524287, (1 << 20) - 1, 1 << 20] {
            for (entry, &f) in table_row(&freqs, attention, p).zip(&freqs) {
                let (s, c) = rope_cuda::reference::sin_cos(p as f64, f);
                for (hi, lo, exact) in [(entry[0], entry[2], attention * c), (entry[1], entry[3], attention * s)] {
                    assert!((hi as f64 - exact).abs() <= 2e-7, "{}: position {p}", case.config);
                    assert!((hi as f64 + lo as f64 - exact).abs() <= 1e-13, "{}: position {p}", case.config);
                }
            }
        }
    }
}

#[test]
fn bad_configs_get_typed_errors() {
    let llama = |scaling: &str| {
        format!(
            r#"{{"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32,
                "max_position_embeddings": 131072, "rope_scaling": {scaling}}}"#
        )
    };
    let err = |json: &str| RopeConfig::from_hf_config(json).expect_err(json);
    let cfg = |json: &str| match err(json) {
        Error::Config(c) => c,
        other => panic!("{json}: expected a config error, got {other:?}"),
    };
    assert!(matches!(cfg("{"), ConfigError::Json(_)));
    assert!(matches!(cfg("[1, 2]"), ConfigError::Json(_)));
    assert_eq!(
        cfg(&llama(r#"{"rope_type": "su-magic", "factor": 2}"#)),
        ConfigError::UnknownRopeType("su-magic".into())
    );
    let missing = llama(r#"{"rope_type": "llama3", "factor": 8, "high_freq_factor": 4}"#);
    assert_eq!(cfg(&missing), ConfigError::Missing("low_freq_factor".into()));
    assert_eq!(
        cfg(r#"{"hidden_size": 64, "num_attention_heads": 2}"#),
        ConfigError::Missing("max_position_embeddings".into())
    );
    assert!(matches!(cfg(r#"{"max_position_embeddings": 8}"#), ConfigError::Missing(_)));
    let zero_heads = r#"{"hidden_size": 64, "num_attention_heads": 0, "max_position_embeddings": 8}"#;
    assert!(matches!(cfg(zero_heads), ConfigError::Invalid { .. }));
    assert!(
        matches!(cfg(&llama(r#"{"type": "linear", "factor": "four"}"#)), ConfigError::Invalid { field, .. } if field == "factor")
    );
    assert!(matches!(cfg(&llama(r#"{"type": "yarn", "factor": 4, "truncate": 1}"#)), ConfigError::Invalid { .. }));
    assert!(matches!(cfg(&llama(r#""yes""#)), ConfigError::Invalid { .. }));
    let short = llama(r#"{"type": "longrope", "short_factor": [1, 2], "long_factor": [1, 2]}"#);
    assert!(matches!(err(&short), Error::ScalingLength { field: "short_factor", expected: 64, got: 2 }));
    assert!(matches!(err(&llama(r#"{"type": "yarn", "factor": -4}"#)), Error::Scaling { field: "factor", .. }));
    assert!(matches!(err(&llama(r#"{"type": "linear", "factor": 0}"#)), Error::Scaling { field: "factor", .. }));
    let odd = r#"{"head_dim": 7, "num_attention_heads": 2, "max_position_embeddings": 8}"#;
    assert!(matches!(err(odd), Error::HeadDim { head_dim: 7 }));
}

/// JSON whose keys are the ones the parser reads, with values of every kind: deep paths.
fn json_value() -> impl Strategy<Value = Value> {
    const KEYS: &[&str] = &[
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "rope_type",
        "type",
        "factor",
        "head_dim",
        "hidden_size",
        "num_attention_heads",
        "max_position_embeddings",
        "original_max_position_embeddings",
        "partial_rotary_factor",
        "rotary_pct",
        "rotary_dim",
        "short_factor",
        "long_factor",
        "low_freq_factor",
        "high_freq_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "attention_factor",
        "truncate",
        "rope_interleave",
        "model_type",
        "torch_dtype",
        "text_config",
        "full_attention",
        "qk_rope_head_dim",
        "n_embd",
        "n_head",
    ];
    const WORDS: &[&str] =
        &["default", "linear", "dynamic", "yarn", "longrope", "llama3", "proportional", "gptj", "bfloat16", "x"];
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        prop_oneof![Just(0.0), Just(1.0), Just(-1.0), Just(0.5), Just(2.0), Just(64.0), Just(1e300), any::<f64>()]
            .prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
        prop_oneof![Just(0u64), Just(1), Just(2), Just(4), Just(128), Just(4096), Just(1 << 40), any::<u64>()]
            .prop_map(|n| Value::Number(n.into())),
        proptest::sample::select(WORDS).prop_map(|w| Value::String(w.into())),
        proptest::collection::vec(prop_oneof![Just(1.0f64), Just(0.0), Just(-2.0), Just(4.0)], 0..70)
            .prop_map(|v| serde_json::json!(v)),
    ];
    leaf.prop_recursive(3, 64, 12, |inner| {
        proptest::collection::vec((proptest::sample::select(KEYS), inner), 0..12)
            .prop_map(|kv| Value::Object(kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect()))
    })
}

/// The committed model configs (`tests/data/configs/*.json`).
const MODEL_CONFIGS: [&str; 11] = [
    "deepseek-v2-lite",
    "gpt-j-6b",
    "gpt-neox-20b",
    "llama-3.1-8b",
    "llama-dynamic",
    "llama-linear",
    "per-layer",
    "phi-3-mini-128k",
    "proportional",
    "qwen2.5-7b",
    "qwen3-yarn",
];

/// Both parsers on `text`: a typed error, or a config whose frequencies are usable.
fn check_parses(text: &str) -> Result<(), TestCaseError> {
    for layer in ["full_attention", "sliding_attention"] {
        let parsed = [RopeConfig::from_hf_config(text), RopeConfig::from_hf_config_layer(text, layer)];
        for config in parsed.into_iter().flatten() {
            let (freqs, attention) = config.frequencies().map_err(|e| TestCaseError::fail(format!("{e}")))?;
            prop_assert_eq!(freqs.len(), config.rotary_dim / 2);
            prop_assert!(freqs.iter().all(|f| f.is_finite() && *f >= 0.0));
            prop_assert!(attention.is_finite() && attention > 0.0);
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4000))]

    /// Any text: a config or a typed error, never a panic.
    #[test]
    fn arbitrary_text_never_panics(text in ".{0,200}") {
        let _ = RopeConfig::from_hf_config(&text);
    }

    /// Arbitrary bytes (read as UTF-8, invalid sequences replaced): never a panic, and a
    /// config that parses has usable frequencies.
    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..1024)) {
        let text = String::from_utf8_lossy(&bytes);
        check_parses(&text)?;
    }

    /// The committed model configs with random bytes overwritten, inserted or deleted (a
    /// mutation fuzzer): never a panic.
    #[test]
    fn mutated_model_configs_never_panic(
        file in proptest::sample::select(&MODEL_CONFIGS[..]),
        edits in proptest::collection::vec((any::<proptest::sample::Index>(), any::<u8>(), 0u8..3), 1..12),
    ) {
        let mut bytes = config_json(&format!("{file}.json")).into_bytes();
        for (at, byte, kind) in edits {
            let i = at.index(bytes.len() + 1);
            match kind {
                0 if i < bytes.len() => bytes[i] = byte,
                1 => bytes.insert(i, byte),
                _ if i < bytes.len() => {
                    bytes.remove(i);
                }
                _ => {}
            }
        }
        check_parses(&String::from_utf8_lossy(&bytes))?;
    }

    /// Arbitrary JSON over the fields the parser reads: a config whose frequencies are usable,
    /// or a typed error; never a panic.
    #[test]
    fn arbitrary_json_never_panics(value in json_value(), layer in proptest::sample::select(&["full_attention", "x"][..])) {
        let text = value.to_string();
        let parsed = [RopeConfig::from_hf_config(&text), RopeConfig::from_hf_config_layer(&text, layer)];
        for config in parsed.into_iter().flatten() {
            let (freqs, attention) = config.frequencies().unwrap();
            prop_assert_eq!(freqs.len(), config.rotary_dim / 2);
            prop_assert!(freqs.iter().all(|f| f.is_finite() && *f >= 0.0));
            prop_assert!(attention.is_finite() && attention > 0.0);
        }
    }
}

/// Each scaled config applied on the GPU (q and k in place, at the golden positions) against
/// the f64 reference of the same frequencies: f32 within 2e-6 relative per row, 16-bit
/// within one ulp of the correctly rounded result, dims past rotary_dim untouched.
fn apply_case<T: TestElem>(g: &common::Gpu, file: &str, seq_len: Option<usize>, seed: u64) -> Option<String> {
    let positions: [i32; 6] = [0, 1, 4095, 4096, 32767, 131071];
    let mut config = RopeConfig::from_hf_config(&config_json(file)).unwrap().seq_len(seq_len).dtype(T::DTYPE);
    config.max_position = 131072;
    let (freqs, attention) = config.frequencies().unwrap();
    let rope = Rope::new(&g.kernels, config.clone()).unwrap();
    let (n, d, hq, hk) = (positions.len(), config.head_dim, 3, 1);
    let q: Vec<T> = (0..n * hq * d).map(|i| T::from_f32(uniform(seed, 0, i as u64))).collect();
    let k: Vec<T> = (0..n * hk * d).map(|i| T::from_f32(uniform(seed, 1, i as u64))).collect();
    let (mut dq, mut dk, dp) = (upload_t(&q), upload_t(&k), upload_t(&positions));
    let mut tq = TensorMut::new(&mut dq, Layout::bshd(1, n, hq, d));
    let mut tk = TensorMut::new(&mut dk, Layout::bshd(1, n, hk, d));
    rope.apply(RopeArgs::in_place(&mut tq, Positions::ids_i32(&dp)).k(&mut tk), &g.stream).unwrap();
    rope.check_errors(&g.stream).unwrap();
    for (input, out, heads) in [(&q, download_t(&dq), hq), (&k, download_t(&dk), hk)] {
        for (t, &position) in positions.iter().enumerate() {
            for h in 0..heads {
                let at = (t * heads + h) * d;
                let x: Vec<f64> = input[at..at + d].iter().map(|v| v.to_f64()).collect();
                let want = rope_row_freqs(&x, position as f64, &freqs, attention, config.style, Direction::Forward);
                let got = &out[at..at + d];
                if T::DTYPE == DType::F32 {
                    let num: f64 = got.iter().zip(&want).map(|(a, b)| (a.to_f64() - b).powi(2)).sum();
                    let den: f64 = want.iter().map(|b| b * b).sum();
                    if (num / den).sqrt() > 2e-6 {
                        return Some(format!("token {t} head {h}: relative error {:e}", (num / den).sqrt()));
                    }
                } else if let Some(j) = (0..config.rotary_dim).find(|&j| got[j].ulps(T::round(want[j])) > 1) {
                    return Some(format!("token {t} head {h} dim {j}: {:?} vs {}", got[j], want[j]));
                }
                if got[config.rotary_dim..]
                    .iter()
                    .zip(&input[at + config.rotary_dim..at + d])
                    .any(|(a, b)| a.bits() != b.bits())
                {
                    return Some(format!("token {t} head {h}: a dim past rotary_dim changed"));
                }
            }
        }
    }
    None
}

#[test]
fn scaled_configs_on_the_gpu() {
    let test = "scaled_configs_on_the_gpu";
    let Some(g) = gpu(test) else { return };
    let seed = test_seed(test);
    let cases = [
        ("llama-3.1-8b.json", None),
        ("phi-3-mini-128k.json", Some(131072)),
        ("deepseek-v2-lite.json", None),
        ("qwen3-yarn.json", None),
        ("gpt-neox-20b.json", None),
        ("gpt-j-6b.json", None),
        ("llama-dynamic.json", Some(16384)),
        ("proportional.json", None),
    ];
    let mut failures = Vec::new();
    for (i, (file, seq_len)) in cases.into_iter().enumerate() {
        let s = seed.wrapping_add(i as u64);
        for (dtype, e) in [
            ("f32", apply_case::<f32>(&g, file, seq_len, s)),
            ("f16", apply_case::<half::f16>(&g, file, seq_len, s)),
            ("bf16", apply_case::<half::bf16>(&g, file, seq_len, s)),
        ] {
            if let Some(e) = e {
                failures.push(format!("{file} {dtype} seed {s}: {e}"));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // The scaling reached the table: llama3 at position 131071 differs from plain RoPE.
    let plain = RopeConfig::new(128, 131072).base(5e5).frequencies().unwrap().0;
    let llama = RopeConfig::from_hf_config(&config_json("llama-3.1-8b.json")).unwrap().frequencies().unwrap().0;
    assert!(plain.iter().zip(&llama).filter(|(a, b)| a != b).count() > 10);
}

/// Llama 4 Scout's config (`llama3` scaling with `low_freq_factor` = `high_freq_factor` = 1, in
/// its `text_config`): accepted, every frequency either kept (wavelength up to the original
/// context) or divided by the factor, as transformers' `_compute_llama3_parameters` gives
/// where its blend band is empty; interleaved pairs (Llama 4 multiplies them as complex
/// numbers).
#[test]
fn llama4_scout_config_is_read() {
    let json = r#"{"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4",
        "text_config": {"model_type": "llama4_text", "hidden_size": 5120, "num_attention_heads": 40,
            "head_dim": 128, "max_position_embeddings": 10485760, "rope_theta": 500000.0,
            "rope_scaling": {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0,
                "high_freq_factor": 1.0, "original_max_position_embeddings": 8192},
            "no_rope_layers": [1, 1, 1, 0]}}"#;
    let config = RopeConfig::from_hf_config(json).unwrap();
    assert_eq!((config.head_dim, config.rotary_dim, config.max_position), (128, 128, 10_485_760));
    assert_eq!(config.style, RopeStyle::GptJ);
    let (freqs, attention) = config.frequencies().unwrap();
    assert_eq!(attention, 1.0);
    for (i, f) in freqs.iter().enumerate() {
        let plain = 1.0 / 500_000f64.powf(2.0 * i as f64 / 128.0);
        let want = if 2.0 * std::f64::consts::PI / plain > 8192.0 { plain / 16.0 } else { plain };
        assert_eq!(*f, want, "pair {i}");
    }
    assert!(freqs.iter().any(|f| *f < 1.0 / 500_000f64.powf(0.5)), "some frequencies are divided");
    // A high factor below the low one is still refused.
    let bad = json.replace(r#""high_freq_factor": 1.0"#, r#""high_freq_factor": 0.5"#);
    assert!(matches!(RopeConfig::from_hf_config(&bad), Err(Error::Scaling { field: "high_freq_factor", .. })));
}

/// The pairing each model family's attention code uses, where its config does not say:
/// DeepSeek-V3 and Kimi K2 interleave (`rope_interleave` defaults to true), Llama 4 too; an
/// explicit `rope_interleave` wins either way.
#[test]
fn model_families_get_their_pairing() {
    let config = |model_type: &str, extra: &str| {
        let json = format!(
            r#"{{"model_type": "{model_type}", "hidden_size": 1024, "num_attention_heads": 8,
                "max_position_embeddings": 4096{extra}}}"#
        );
        RopeConfig::from_hf_config(&json).unwrap().style
    };
    for t in ["deepseek_v3", "kimi_k2", "llama4_text", "deepseek_v2", "gptj", "cohere2", "glm"] {
        assert_eq!(config(t, ""), RopeStyle::GptJ, "{t}");
    }
    for t in ["llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3", "gpt_neox", "gpt_oss"] {
        assert_eq!(config(t, ""), RopeStyle::NeoX, "{t}");
    }
    assert_eq!(config("deepseek_v3", r#", "rope_interleave": false"#), RopeStyle::NeoX);
    assert_eq!(config("llama", r#", "rope_interleave": true"#), RopeStyle::GptJ);
}
