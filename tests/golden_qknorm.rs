//! QK-norm against transformers' own attention modules (tests/data/qknorm, made on the H200 by
//! tests/data/make_golden_qknorm.py): Qwen3 (w), Gemma 3 (1 + w), OLMo 2 (w over the whole
//! q and k projections) and Llama 4 (no weight, after the rotation), tiny random models in
//! f32. The f64 reference (norm, then rotation) and the fused append on the GPU (the
//! configuration and the norm read from the model's config.json by `HfConfig`) both within
//! 1e-5 of what the model computed, relative to each head's largest value.

mod common;

use common::{data_file, download_t, gpu, poisoned, upload_t, Gpu, Reader};
use rope_cuda::reference::{rms_norm_row, rope_row_freqs};
use rope_cuda::{
    DType, Direction, HfConfig, KvAppend, KvCache, Layout, NormKind, Positions, QkNormSpec, Rope, RopeConfig, Tensor,
    TensorMut,
};

const MODELS: [&str; 4] = ["qwen3", "gemma3_text", "olmo2", "llama4_text"];

/// q's or k's record of one layer: `[seq, heads, dim]` before and after the model's norm and
/// rotation, and the norm's weights.
struct Record {
    layer: usize,
    which: usize,
    heads: usize,
    dim: usize,
    weight: Option<Vec<f32>>,
    before: Vec<f32>,
    after: Vec<f32>,
}

fn load(model: &str) -> (HfConfig, Vec<i64>, Vec<Record>) {
    let json = String::from_utf8(data_file(&format!("qknorm/{model}.json"))).unwrap();
    let bytes = data_file(&format!("qknorm/{model}.bin"));
    let mut r = Reader(&bytes);
    assert_eq!(&r.take::<8>(), b"RPQKN1\0\0", "{model}: bad magic");
    let seq = r.u32();
    let positions = (0..seq).map(|_| r.i64()).collect();
    let f32s = |r: &mut Reader, n: usize| (0..n).map(|_| f32::from_le_bytes(r.take())).collect::<Vec<f32>>();
    let records = (0..r.u32())
        .map(|_| {
            let (layer, which, heads, dim, weighted) = (r.u32(), r.u32(), r.u32(), r.u32(), r.u32());
            // 1: a head's weights; 2: the whole projection's (OLMo 2).
            let weight = (weighted != 0).then(|| f32s(&mut r, if weighted == 2 { heads * dim } else { dim }));
            let (before, after) = (f32s(&mut r, seq * heads * dim), f32s(&mut r, seq * heads * dim));
            Record { layer, which, heads, dim, weight, before, after }
        })
        .collect();
    assert!(r.0.is_empty(), "{model}: trailing bytes");
    (HfConfig::parse(&json).unwrap(), positions, records)
}

/// `got` within 1e-5 of `want` relative to each `dim`-element head's largest value.
fn assert_close(what: &str, got: &[f64], want: &[f32], dim: usize) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (h, (g, w)) in got.chunks(dim).zip(want.chunks(dim)).enumerate() {
        let scale = w.iter().fold(0f64, |m, v| m.max(v.abs() as f64));
        for i in 0..dim {
            let err = (g[i] - w[i] as f64).abs();
            assert!(err <= 1e-5 * scale, "{what}: head {h} dim {i}: {} vs {} (error {err:e})", g[i], w[i]);
        }
    }
}

/// Each layer's (RoPE configuration in f32, its norm from the config, q's record, k's record).
fn layers(config: &HfConfig, records: &[Record]) -> Vec<(RopeConfig, QkNormSpec, usize, usize)> {
    let mut out = Vec::new();
    for (qi, q) in records.iter().enumerate().filter(|(_, r)| r.which == 0) {
        let ki = records.iter().position(|r| r.layer == q.layer && r.which == 1).expect("k's record");
        let rope = config.layer(q.layer).unwrap().expect("a recorded layer rotates").dtype(DType::F32);
        let norm = config.qk_norm(q.layer).unwrap().expect("a recorded layer normalizes");
        out.push((rope, norm, qi, ki));
    }
    out
}

#[test]
fn the_f64_reference_matches_transformers() {
    for model in MODELS {
        let (config, positions, records) = load(model);
        let found = layers(&config, &records);
        assert!(!found.is_empty(), "{model}: no layer recorded");
        for (rope, spec, qi, ki) in found {
            let (kind, eps) = (spec.kind(), spec.eps());
            // The recorded weights have the lengths the config's sizes give.
            let len = |r: &Record| r.weight.as_ref().map(|w| w.len());
            match (len(&records[qi]), len(&records[ki])) {
                (Some(q), Some(k)) => spec.check(q, k).unwrap(),
                _ => assert!(!spec.takes_weights(), "{model}: a weighted norm without recorded weights"),
            }
            let (freqs, attention) = rope.frequencies().unwrap();
            let offset = if kind == NormKind::RmsOnePlus { 1.0 } else { 0.0 };
            for r in [&records[qi], &records[ki]] {
                let w: Option<Vec<f64>> = r.weight.as_ref().map(|w| w.iter().map(|&v| v as f64).collect());
                let mut got = Vec::new();
                // Each head normalized alone, or (a whole-projection norm) a token's heads at once.
                let unit = if kind == NormKind::RmsProjection { r.heads * r.dim } else { r.dim };
                for (t, &pos) in positions.iter().enumerate() {
                    let row = &r.before[t * r.heads * r.dim..(t + 1) * r.heads * r.dim];
                    for x in row.chunks(unit) {
                        let x: Vec<f64> = x.iter().map(|&v| v as f64).collect();
                        let y = rms_norm_row(&x, w.as_deref(), offset, eps as f64);
                        for h in y.chunks(r.dim) {
                            got.extend(rope_row_freqs(
                                h,
                                pos as f64,
                                &freqs,
                                attention,
                                rope.style,
                                Direction::Forward,
                            ));
                        }
                    }
                }
                assert_close(&format!("{model} layer {} {}", r.layer, ["q", "k"][r.which]), &got, &r.after, r.dim);
            }
        }
    }
}

fn gpu_model(g: &Gpu, model: &str) {
    let (config, positions, records) = load(model);
    let seq = positions.len();
    let ids: Vec<i32> = positions.iter().map(|&p| p as i32).collect();
    let slots: Vec<i64> = (0..seq as i64).collect();
    let (dpos, dslots) = (upload_t(&ids), upload_t(&slots));
    for (rope_config, spec, qi, ki) in layers(&config, &records) {
        let (q, k) = (&records[qi], &records[ki]);
        let (d, hq, hk) = (q.dim, q.heads, k.heads);
        let rope = Rope::new(&g.kernels, rope_config).unwrap();
        let (mut dq, dk, dv) = (upload_t(&q.before), upload_t(&k.before), upload_t(&k.before));
        // The caches poisoned: every row is written (one slot a token), so a NaN left is a miss.
        let (mut kc, mut vc) = (poisoned(seq * hk * d), poisoned(seq * hk * d));
        let w = |r: &Record| upload_t(r.weight.as_deref().unwrap_or(&[0.0]));
        let (qw, kw) = (w(q), w(k));
        {
            let mut cache = KvCache::paged(&mut kc, &mut vc, Layout::bshd(seq, 1, hk, d));
            let mut qt = TensorMut::new(&mut dq, Layout::bshd(1, seq, hq, d));
            let (kt, vt) =
                (Tensor::new(&dk, Layout::bshd(1, seq, hk, d)), Tensor::new(&dv, Layout::bshd(1, seq, hk, d)));
            // The config's norm with the recorded weights (checked against the config's
            // sizes), as an engine builds it: no match on the kind.
            let norm = match spec.takes_weights() {
                true => spec.weights(&qw, &kw).unwrap(),
                false => spec.unweighted().unwrap(),
            };
            let args =
                KvAppend::new(&kt, &vt, &mut cache, Positions::ids_i32(&dpos)).q(&mut qt).slots(&dslots).norm(norm);
            rope.append_kv(args, &g.stream).unwrap();
            rope.check_errors(&g.stream).unwrap();
        }
        let f64s = |v: Vec<f32>| v.into_iter().map(|x| x as f64).collect::<Vec<f64>>();
        assert_close(&format!("{model} layer {} q (GPU)", q.layer), &f64s(download_t(&dq)), &q.after, d);
        assert_close(&format!("{model} layer {} k cache (GPU)", k.layer), &f64s(download_t(&kc)), &k.after, d);
        let v: Vec<f32> = download_t(&vc);
        assert!(v.iter().zip(&k.before).all(|(a, b)| a.to_bits() == b.to_bits()), "{model}: values");
    }
}

#[test]
fn the_fused_append_matches_transformers() {
    let Some(g) = gpu("the_fused_append_matches_transformers") else { return };
    for model in MODELS {
        gpu_model(&g, model);
    }
}
