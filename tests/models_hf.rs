//! Every model family against its own code in transformers 5.x: `tests/data/models/`, written
//! by `tests/data/make_golden_models.py` on the GPU machine (a tiny random model of each
//! `model_type`, one forward pass, every call of the model's own apply function recorded).
//!
//! For each model type the config is read through [`HfConfig`] (strictly: its style must be
//! one the crate checked, not assumed); each layer's configuration comes from
//! [`HfConfig::layer`], which must be `None` exactly for the layers that did not call the apply
//! function. Then:
//! - on every machine: the f64 reference with that configuration matches transformers' output
//!   within 1e-5 of the row's largest input (transformers' f32 angles at positions below 64),
//!   so the reference agrees with the model on the pairing, the frequencies, the rotary dims
//!   and, for MRoPE, on which position stream each frequency takes;
//! - on a GPU: the library's f32 output matches transformers' at the same tolerance and the
//!   f64 reference within 2e-6 relative; its bf16 output (inputs rounded to bf16) is within one
//!   ulp of the correctly rounded f64 reference.

#![allow(clippy::needless_range_loop)]

mod common;

use common::{
    data_file, download_t, gpu, model_golden as golden, upload_t, ModelGolden as Golden, ModelRecord as Record,
    TestElem,
};
use cust::memory::DeviceBuffer;
use half::bf16;
use rope_cuda::reference::rope_row_streams;
use rope_cuda::{
    DType, Direction, HfConfig, Layout, Positions, Rope, RopeArgs, RopeConfig, StyleSource, TensorMut,
    INTERLEAVED_MODEL_TYPES, NEOX_MODEL_TYPES,
};

/// Every golden model, with the style its apply function uses (read from transformers'
/// source; the comparison below proves it) and whether it is multimodal.
const MODELS: &[(&str, bool, bool)] = &[
    // (name, interleaved, mrope)
    ("llama", false, false),
    ("llama4", true, false),
    ("mistral", false, false),
    ("mixtral", false, false),
    ("qwen2", false, false),
    ("qwen2_moe", false, false),
    ("qwen3", false, false),
    ("qwen3_moe", false, false),
    ("qwen2_vl", false, true),
    ("qwen2_5_vl", false, true),
    ("qwen3_vl", false, true),
    ("glm4v", true, true),
    ("gemma", false, false),
    ("gemma2", false, false),
    ("gemma3", false, false),
    ("gemma3_text", false, false),
    ("gemma4", false, false),
    ("phi3", false, false),
    ("phi4_mini", false, false),
    ("phi4_multimodal", false, false),
    ("stablelm", false, false),
    ("gpt_neox", false, false),
    ("gptj", true, false),
    ("falcon", false, false),
    ("olmo2", false, false),
    ("cohere", true, false),
    ("cohere2", true, false),
    ("glm", true, false),
    ("glm4", true, false),
    ("glm4_moe", false, false),
    ("deepseek_v2", true, false),
    ("deepseek_v3", true, false),
    ("kimi_k2", true, false),
    ("gpt_oss", false, false),
    ("granite", false, false),
    ("ernie4_5", true, false),
    ("ernie4_5_moe", true, false),
];

fn config_json(name: &str) -> String {
    String::from_utf8(data_file(&format!("models/{name}.json"))).expect("UTF-8")
}

/// The model's configuration of `record`'s layer; checks that the layers without a record are
/// exactly those without RoPE.
fn layer_config(name: &str, model: &HfConfig, record: &Record) -> RopeConfig {
    let layer = record.layer.unwrap_or_else(|| panic!("{name}: a call outside an attention layer"));
    model.layer(layer).unwrap_or_else(|e| panic!("{name}: layer {layer}: {e}")).unwrap_or_else(|| {
        panic!("{name}: layer {layer} rotated in transformers, but the config reads as a layer without RoPE")
    })
}

fn check_layers(name: &str, model: &HfConfig, golden: &Golden) {
    let layers = model.num_layers().unwrap_or_else(|| panic!("{name}: layer count"));
    for layer in 0..layers {
        let rotated = golden.records.iter().any(|r| r.layer == Some(layer));
        let config = model.layer(layer).unwrap_or_else(|e| panic!("{name}: layer {layer}: {e}"));
        assert_eq!(config.is_some(), rotated, "{name}: layer {layer} (RoPE in transformers: {rotated})");
    }
}

/// A `[seq, heads, head_dim]` input for the library from a record: the record's rows, or
/// where the model passed only the rotary dims, those dims first and seeded values after.
fn head_rows(config: &RopeConfig, record: &Record, name: &str) -> Vec<f32> {
    let (d, hd) = (record.dim, config.head_dim);
    if d == hd {
        return record.input.clone();
    }
    assert_eq!(d, config.rotary_dim, "{name}: the apply function saw {d} dims: neither head_dim {hd} nor rotary_dim");
    let mut x = Vec::with_capacity(record.input.len() / d * hd);
    for (i, row) in record.input.chunks(d).enumerate() {
        x.extend_from_slice(row);
        x.extend((d..hd).map(|j| rope_cuda::reference::uniform(17, i as u64, j as u64)));
    }
    x
}

fn reference(config: &RopeConfig, x: &[f64], positions: [i64; 3]) -> Vec<f64> {
    let (freqs, attention) = config.frequencies().expect("frequencies");
    let p = positions.map(|p| p as f64);
    rope_row_streams(x, p, &freqs, attention, config.style, config.mrope, Direction::Forward)
}

/// Models whose apply function writes the rotated pairs back de-interleaved (DeepSeek-V3's
/// `apply_rotary_pos_emb_interleave`: pair `i`'s two outputs at `i` and `d / 2 + i`), where the
/// library writes them where it read them (`2i`, `2i + 1`). The attention scores are the same
/// (q and k are permuted alike; see docs/models.md).
const DEINTERLEAVED: &[&str] = &["deepseek_v3", "kimi_k2"];

/// Asserts `got` (first `record.dim` dims of each row) is within 1e-5 of the row's largest
/// input of transformers' output (read in the library's layout: see [`DEINTERLEAVED`]).
fn assert_matches_transformers(what: &str, record: &Record, hd: usize, got: impl Fn(usize, usize) -> f64) {
    let d = record.dim;
    let deinterleaved = DEINTERLEAVED.iter().any(|n| what.starts_with(&format!("{n} ")));
    let at = |j: usize| match deinterleaved {
        true if j < d / 2 => 2 * j,
        true => 2 * (j - d / 2) + 1,
        false => j,
    };
    for (row, (x, want)) in record.input.chunks(d).zip(record.output.chunks(d)).enumerate() {
        let scale = x.iter().fold(0f64, |m, v| m.max(v.abs() as f64)).max(1e-30);
        for j in 0..d {
            let g = got(row * hd + at(j), row);
            assert!(
                (g - want[j] as f64).abs() <= 1e-5 * scale,
                "{what}: row {row} dim {j}: {g} vs transformers {} (scale {scale})",
                want[j]
            );
        }
    }
}

#[test]
fn every_model_type_reads_its_style_and_layers_and_the_reference_matches_transformers() {
    let mut checked = 0;
    for &(name, interleaved, mrope) in MODELS {
        let model = HfConfig::parse(&config_json(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        let source = model.style_source();
        assert!(!matches!(source, StyleSource::Assumed(_)), "{name}: style assumed ({source:?})");
        let model = model.strict().unwrap();
        let g = golden(name);
        assert_eq!(g.streams == 3, mrope, "{name}: position streams");
        check_layers(name, &model, &g);
        assert!(!g.records.is_empty(), "{name}: no records");
        for record in &g.records {
            let config = layer_config(name, &model, record);
            let want_style = if interleaved { rope_cuda::RopeStyle::GptJ } else { rope_cuda::RopeStyle::NeoX };
            assert_eq!(config.style, want_style, "{name}: style");
            assert_eq!(config.mrope.is_some(), mrope, "{name}: MRoPE");
            let x = head_rows(&config, record, name);
            let hd = config.head_dim;
            let mut ys = Vec::with_capacity(x.len());
            for (row, xs) in x.chunks(hd).enumerate() {
                let xs: Vec<f64> = xs.iter().map(|&v| v as f64).collect();
                ys.extend(reference(&config, &xs, g.positions[row / record.heads]));
            }
            assert_matches_transformers(&format!("{name} layer {:?} reference", record.layer), record, hd, |i, _| {
                ys[i]
            });
            checked += 1;
        }
    }
    assert!(checked >= 2 * MODELS.len(), "{checked} records");
}

/// The crate's lists of checked model types name every golden model's type.
#[test]
fn every_golden_model_type_is_in_the_checked_lists() {
    for &(name, interleaved, _) in MODELS {
        let model = HfConfig::parse(&config_json(name)).unwrap();
        let t = model.text_model_type().to_string();
        let list = if interleaved { INTERLEAVED_MODEL_TYPES } else { NEOX_MODEL_TYPES };
        assert!(list.contains(&t.as_str()) || list.contains(&model.model_type()), "{name}: {t}");
    }
}

fn run<T: TestElem + cust::memory::DeviceCopy>(
    gpu: &common::Gpu,
    config: &RopeConfig,
    x: &[T],
    heads: usize,
    g: &Golden,
) -> Vec<T> {
    let seq = g.positions.len();
    let rope = Rope::new(&gpu.kernels, config.clone()).expect("Rope::new");
    let mut q = upload_t(x);
    let mut qv = TensorMut::new(&mut q, Layout::bshd(1, seq, heads, config.head_dim));
    let (ids, streams): (DeviceBuffer<i32>, bool) = match config.mrope {
        Some(_) => {
            let flat: Vec<i32> = (0..3).flat_map(|k| g.positions.iter().map(move |p| p[k] as i32)).collect();
            (upload_t(&flat), true)
        }
        None => (upload_t(&g.positions.iter().map(|p| p[0] as i32).collect::<Vec<_>>()), false),
    };
    let positions = if streams { Positions::streams_i32(&ids) } else { Positions::ids_i32(&ids) };
    rope.apply(RopeArgs::in_place(&mut qv, positions), &gpu.stream).expect("apply");
    rope.check_errors(&gpu.stream).expect("no position errors");
    download_t(&q)
}

#[test]
fn every_model_type_on_the_gpu_matches_transformers_in_f32_and_the_reference_in_bf16() {
    let Some(gpu) = gpu("every_model_type_on_the_gpu_matches_transformers_in_f32_and_the_reference_in_bf16") else {
        return;
    };
    let mut checked = 0;
    for &(name, _, _) in MODELS {
        let model = HfConfig::parse(&config_json(name)).unwrap();
        let g = golden(name);
        for record in &g.records {
            let config = layer_config(name, &model, record);
            let x = head_rows(&config, record, name);
            let hd = config.head_dim;
            let what = format!("{name} layer {:?}", record.layer);
            // f32: transformers, and the f64 reference (2e-6 relative to the row).
            let y = run(&gpu, &config.clone().dtype(DType::F32), &x, record.heads, &g);
            assert_matches_transformers(&format!("{what} f32"), record, hd, |i, _| y[i] as f64);
            for (row, (xs, ys)) in x.chunks(hd).zip(y.chunks(hd)).enumerate() {
                let xs: Vec<f64> = xs.iter().map(|&v| v as f64).collect();
                let want = reference(&config, &xs, g.positions[row / record.heads]);
                let norm = want.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-30);
                for j in 0..hd {
                    let err = (ys[j] as f64 - want[j]).abs() / norm;
                    assert!(err <= 2e-6, "{what} f32 row {row} dim {j}: {} vs {} ({err:e})", ys[j], want[j]);
                }
            }
            // bf16: one ulp of the correctly rounded reference of the rounded inputs.
            let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
            let yb = run(&gpu, &config.clone().dtype(DType::BF16), &xb, record.heads, &g);
            for (row, (xs, ys)) in xb.chunks(hd).zip(yb.chunks(hd)).enumerate() {
                let xs: Vec<f64> = xs.iter().map(|v| v.to_f64()).collect();
                let want = reference(&config, &xs, g.positions[row / record.heads]);
                for j in 0..hd {
                    let r = <bf16 as TestElem>::round(want[j]);
                    assert!(ys[j].ulps(r) <= 1, "{what} bf16 row {row} dim {j}: {} vs {}", ys[j], want[j]);
                }
            }
            checked += 1;
        }
    }
    assert!(checked >= 2 * MODELS.len(), "{checked} records");
}
