//! Multimodal RoPE (MRoPE): three position streams per token, in `Rope` and in the fused
//! paged append, against the f64 reference; its typed errors without a GPU.

#![allow(clippy::needless_range_loop)]

mod common;

use common::{download_t, gpu, test_seed, upload_t, Gpu, TestElem};
use half::{bf16, f16};
use rope_cuda::reference::{rope_row_streams, splitmix64, uniform_vec};
use rope_cuda::{
    validate, validate_append, ConfigError, CosSin, DType, Direction, Error, HfConfig, KvAppend, KvCache, Layout,
    Mrope, PositionKind, Positions, RawArgs, RawKvArgs, RawKvCache, RawPositions, RawTensor, Rope, RopeArgs,
    RopeConfig, RopeStyle, StyleSource, Tensor, TensorMut,
};

/// `[3, tokens]` positions of `batch` sequences of `seq` tokens, image-like: each sequence has
/// text tokens (three equal positions), a `rows x cols` image grid at one temporal position
/// (height and width varying), then text again, starting at a random offset below `max / 2`.
fn streams(seed: u64, batch: usize, seq: usize, max: usize) -> Vec<i64> {
    let tokens = batch * seq;
    let mut p = vec![0i64; 3 * tokens];
    for b in 0..batch {
        let start = (splitmix64(seed ^ b as u64) % (max as u64 / 2)) as i64;
        let (text, cols) = (seq / 4, 4);
        let mut next = start;
        for s in 0..seq {
            let t = b * seq + s;
            let image = s >= text && s < seq - text;
            let v = if image {
                let i = (s - text) as i64;
                [start + text as i64, start + text as i64 + i / cols, start + text as i64 + i % cols]
            } else {
                [next; 3]
            };
            for k in 0..3 {
                p[k * tokens + t] = v[k];
            }
            next = if image { start + text as i64 + (seq as i64) } else { next + 1 };
            if s + 1 == seq - text {
                next = v.iter().copied().max().unwrap() + 1;
            }
        }
    }
    p
}

fn position_of(p: &[i64], tokens: usize, t: usize) -> [i64; 3] {
    [p[t], p[tokens + t], p[2 * tokens + t]]
}

fn reference(config: &RopeConfig, x: &[f64], pos: [i64; 3]) -> Vec<f64> {
    let (freqs, attention) = config.frequencies().unwrap();
    rope_row_streams(x, pos.map(|v| v as f64), &freqs, attention, config.style, config.mrope, Direction::Forward)
}

/// Out of place (outputs poisoned) on `[batch, seq, heads, head_dim]` q and k: every row within
/// one ulp (16-bit) or 2e-6 relative (f32) of the reference at its token's three positions.
fn rope_case<T: TestElem + cust::memory::DeviceCopy>(g: &Gpu, config: RopeConfig, seed: u64) {
    let (batch, seq, hq, hk) = (2, 12, 4, 2);
    let d = config.head_dim;
    let tokens = batch * seq;
    let config = config.dtype(T::DTYPE);
    let rope = Rope::new(&g.kernels, config.clone()).unwrap();
    let pos = streams(seed, batch, seq, config.max_position);
    let xq: Vec<T> = uniform_vec(seed, 0, tokens * hq * d).into_iter().map(T::from_f32).collect();
    let xk: Vec<T> = uniform_vec(seed, 1, tokens * hk * d).into_iter().map(T::from_f32).collect();
    let (q, k) = (upload_t(&xq), upload_t(&xk));
    let poison = T::from_bits(T::POISON_BITS);
    let (mut qo, mut ko) = (upload_t(&vec![poison; xq.len()]), upload_t(&vec![poison; xk.len()]));
    let ids = upload_t(&pos);
    let (lq, lk) = (Layout::bshd(batch, seq, hq, d), Layout::bshd(batch, seq, hk, d));
    let (qt, kt) = (Tensor::new(&q, lq), Tensor::new(&k, lk));
    let (mut qov, mut kov) = (TensorMut::new(&mut qo, lq), TensorMut::new(&mut ko, lk));
    rope.apply(RopeArgs::into(&qt, &mut qov, Positions::streams_i64(&ids)).k_into(&kt, &mut kov), &g.stream).unwrap();
    rope.check_errors(&g.stream).unwrap();
    for (x, got, heads) in [(&xq, download_t(&qo), hq), (&xk, download_t(&ko), hk)] {
        for t in 0..tokens {
            for h in 0..heads {
                let r = (t * heads + h) * d;
                let xs: Vec<f64> = x[r..r + d].iter().map(|v| v.to_f64()).collect();
                let want = reference(&config, &xs, position_of(&pos, tokens, t));
                let norm = want.iter().fold(0f64, |m, v| m.max(v.abs()));
                for j in 0..d {
                    let ok = match T::DTYPE {
                        DType::F32 => (got[r + j].to_f64() - want[j]).abs() <= 2e-6 * norm,
                        _ => got[r + j].ulps(T::round(want[j])) <= 1,
                    };
                    assert!(ok, "{} token {t} head {h} dim {j}: {:?} vs {}", T::NAME, got[r + j], want[j]);
                }
            }
        }
    }
}

fn configs() -> Vec<RopeConfig> {
    vec![
        // Qwen2-VL: head_dim 128, sections [16, 24, 24].
        RopeConfig::new(128, 4096).base(1_000_000.0).mrope(Some(Mrope::new([16, 24, 24], false))),
        // Qwen3-VL: interleaved [24, 20, 20].
        RopeConfig::new(128, 4096).base(5_000_000.0).mrope(Some(Mrope::new([24, 20, 20], true))),
        // GLM-4.1V: interleaved pairs over half the head, sections [8, 12, 12].
        RopeConfig::new(128, 4096).rotary_dim(64).style(RopeStyle::GptJ).mrope(Some(Mrope::new([8, 12, 12], false))),
        // Sections whose bands cut 16-byte lanes (element-by-element and vector kernels alike).
        RopeConfig::new(64, 4096).mrope(Some(Mrope::new([5, 13, 14], false))),
        // Qwen2.5-VL with yarn scaling (its attention factor folded into cos and sin).
        RopeConfig::from_hf_config(YARN_VL).unwrap().seq_len(Some(4096)),
    ]
}

/// A Qwen2.5-VL config with long-context yarn scaling and MRoPE sections.
const YARN_VL: &str = r#"{"model_type": "qwen2_5_vl", "hidden_size": 2048, "num_attention_heads": 16,
    "max_position_embeddings": 4096, "rope_theta": 1000000.0,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                     "mrope_section": [16, 24, 24]}}"#;

#[test]
fn mrope_matches_the_reference_in_every_dtype() {
    let Some(g) = gpu("mrope_matches_the_reference_in_every_dtype") else { return };
    // Both sources of cos and sin: the library's table and computed.
    for source in [CosSin::Table, CosSin::Computed] {
        for (i, c) in configs().into_iter().enumerate() {
            let (seed, c) = (test_seed("mrope") + i as u64, c.cos_sin(source));
            rope_case::<f32>(&g, c.clone(), seed);
            rope_case::<f16>(&g, c.clone(), seed);
            rope_case::<bf16>(&g, c, seed);
        }
    }
    mrope_kernels_of_both_sources_ran(&g, "rope_");
}

/// The MRoPE entry points (`_m`) of both sources (`_m_c`: computed) that `prefix`'s tests
/// launched: at least one of each.
fn mrope_kernels_of_both_sources_ran(g: &Gpu, prefix: &str) {
    let loaded: Vec<&str> = g.kernels.loaded().map(|e| e.name()).filter(|n| n.starts_with(prefix)).collect();
    let table = loaded.iter().filter(|n| n.ends_with("_m")).count();
    let computed = loaded.iter().filter(|n| n.ends_with("_m_c")).count();
    eprintln!("{prefix}: MRoPE kernels launched: {table} from the table, {computed} computed: {loaded:?}");
    assert!(table > 0 && computed > 0, "{prefix}: MRoPE kernels of a source never ran: {loaded:?}");
}

/// A text-only call (three equal positions) gives the plain RoPE result bit for bit.
#[test]
fn mrope_of_text_tokens_is_plain_rope() {
    let Some(g) = gpu("mrope_of_text_tokens_is_plain_rope") else { return };
    let (seq, h, d) = (9, 4, 128);
    let plain = RopeConfig::new(d, 4096).dtype(DType::BF16);
    let multi = plain.clone().mrope(Some(Mrope::new([16, 24, 24], false)));
    let x: Vec<bf16> = uniform_vec(5, 0, seq * h * d).into_iter().map(bf16::from_f32).collect();
    let ids: Vec<i32> = (0..seq as i32).map(|s| 3 * s + 100).collect();
    let three: Vec<i32> = ids.iter().chain(&ids).chain(&ids).copied().collect();
    let l = Layout::bshd(1, seq, h, d);
    let mut out = Vec::new();
    for (config, pos) in [(plain, upload_t(&ids)), (multi, upload_t(&three))] {
        let rope = Rope::new(&g.kernels, config.clone()).unwrap();
        let mut q = upload_t(&x);
        let positions = if config.mrope.is_some() { Positions::streams_i32(&pos) } else { Positions::ids_i32(&pos) };
        rope.apply(RopeArgs::in_place(&mut TensorMut::new(&mut q, l), positions), &g.stream).unwrap();
        rope.check_errors(&g.stream).unwrap();
        out.push(download_t(&q));
    }
    assert!(out[0].iter().zip(&out[1]).all(|(a, b)| a.to_bits() == b.to_bits()));
    assert!(out[0].iter().zip(&x).any(|(a, b)| a != b), "rotated");
}

/// A token with any stream out of range is skipped (its rows untouched) and reported with that
/// stream's value; the other tokens rotate.
#[test]
fn mrope_out_of_range_streams_are_skipped_and_reported() {
    let Some(g) = gpu("mrope_out_of_range_streams_are_skipped_and_reported") else { return };
    let (seq, h, d) = (4, 2, 64);
    let config = RopeConfig::new(d, 64).mrope(Some(Mrope::new([8, 12, 12], false)));
    let rope = Rope::new(&g.kernels, config.clone()).unwrap();
    // Token 1's height position is 64 (out of range); token 3's width is -2.
    let pos: Vec<i32> = vec![1, 2, 3, 4, 1, 64, 3, 4, 1, 2, 3, -2];
    let ids = upload_t(&pos);
    let x = uniform_vec(9, 0, seq * h * d);
    let mut q = upload_t(&x);
    let l = Layout::bshd(1, seq, h, d);
    rope.apply(RopeArgs::in_place(&mut TensorMut::new(&mut q, l), Positions::streams_i32(&ids)), &g.stream).unwrap();
    match rope.check_errors(&g.stream) {
        Err(Error::PositionOutOfRange { token: 1, position: 64, max_position: 64, count: 2 }) => {}
        other => panic!("{other:?}"),
    }
    let got = download_t(&q);
    for t in 0..seq {
        let r = t * h * d..(t + 1) * h * d;
        if t == 1 || t == 3 {
            assert!(got[r.clone()].iter().zip(&x[r]).all(|(a, b)| a.to_bits() == b.to_bits()), "token {t} untouched");
        } else {
            for hh in 0..h {
                let s = (t * h + hh) * d;
                let xs: Vec<f64> = x[s..s + d].iter().map(|&v| v as f64).collect();
                let want =
                    reference(&config, &xs, position_of(&pos.iter().map(|&v| v as i64).collect::<Vec<_>>(), seq, t));
                assert!((0..d).all(|j| (got[s + j] as f64 - want[j]).abs() <= 2e-6 * 2.0), "token {t}");
            }
        }
    }
}

/// The fused paged append with MRoPE, decode-sized and prefill-sized: q rotated in place at
/// three streams, k rotated into its slot, v copied, every other cache row bit-identical.
fn append_case<T: TestElem + cust::memory::DeviceCopy>(g: &Gpu, config: RopeConfig, seq: usize, seed: u64) {
    let (batch, hq, hk) = (2, 4, 2);
    let d = config.head_dim;
    let tokens = batch * seq;
    let config = config.dtype(T::DTYPE);
    let rope = Rope::new(&g.kernels, config.clone()).unwrap();
    let pos = streams(seed, batch, seq, config.max_position);
    let (blocks, bs) = (tokens.div_ceil(16) * 2 + 2, 16);
    // Slots: a permutation of distinct slots, one token padding (-1).
    let mut slots: Vec<i64> = (0..tokens as i64).map(|t| (t * 7 + 3) % (blocks * bs) as i64).collect();
    slots[tokens / 2] = -1;
    let xq: Vec<T> = uniform_vec(seed, 0, tokens * hq * d).into_iter().map(T::from_f32).collect();
    let xk: Vec<T> = uniform_vec(seed, 1, tokens * hk * d).into_iter().map(T::from_f32).collect();
    let xv: Vec<T> = uniform_vec(seed, 2, tokens * hk * d).into_iter().map(T::from_f32).collect();
    let cache0: Vec<T> = uniform_vec(seed, 3, blocks * bs * hk * d).into_iter().map(T::from_f32).collect();
    let (mut q, k, v) = (upload_t(&xq), upload_t(&xk), upload_t(&xv));
    let (mut kc, mut vc) = (upload_t(&cache0), upload_t(&cache0));
    let (ids, sl) = (upload_t(&pos.iter().map(|&p| p as i32).collect::<Vec<_>>()), upload_t(&slots));
    let mut qv = TensorMut::new(&mut q, Layout::bshd(batch, seq, hq, d));
    let (kt, vt) = (Tensor::new(&k, Layout::bshd(batch, seq, hk, d)), Tensor::new(&v, Layout::bshd(batch, seq, hk, d)));
    let mut cache = KvCache::paged(&mut kc, &mut vc, Layout::bshd(blocks, bs, hk, d));
    let args = KvAppend::new(&kt, &vt, &mut cache, Positions::streams_i32(&ids)).q(&mut qv).slots(&sl);
    rope.append_kv(args, &g.stream).unwrap();
    rope.check_errors(&g.stream).unwrap();
    let (gq, gk, gv) = (download_t(&q), download_t(&kc), download_t(&vc));
    let check = |got: &[T], x: &[T], p: [i64; 3], what: &str| {
        let xs: Vec<f64> = x.iter().map(|v| v.to_f64()).collect();
        let want = reference(&config, &xs, p);
        let norm = want.iter().fold(0f64, |m, v| m.max(v.abs()));
        for j in 0..d {
            let ok = match T::DTYPE {
                DType::F32 => (got[j].to_f64() - want[j]).abs() <= 2e-6 * norm,
                _ => got[j].ulps(T::round(want[j])) <= 1,
            };
            assert!(ok, "{} {what} dim {j}: {:?} vs {}", T::NAME, got[j], want[j]);
        }
    };
    let mut written = vec![false; blocks * bs];
    for t in 0..tokens {
        let p = position_of(&pos, tokens, t);
        for h in 0..hq {
            let r = (t * hq + h) * d;
            check(&gq[r..r + d], &xq[r..r + d], p, &format!("q token {t} head {h}"));
        }
        if slots[t] < 0 {
            continue;
        }
        let n = slots[t] as usize;
        written[n] = true;
        for h in 0..hk {
            let (r, c) = ((t * hk + h) * d, (n * hk + h) * d);
            check(&gk[c..c + d], &xk[r..r + d], p, &format!("k token {t} head {h}"));
            assert!(gv[c..c + d].iter().zip(&xv[r..r + d]).all(|(a, b)| a.bits() == b.bits()), "v token {t}");
        }
    }
    for n in (0..blocks * bs).filter(|&n| !written[n]) {
        let r = n * hk * d..(n + 1) * hk * d;
        for c in [&gk, &gv] {
            assert!(c[r.clone()].iter().zip(&cache0[r.clone()]).all(|(a, b)| a.bits() == b.bits()), "slot {n}");
        }
    }
}

#[test]
fn mrope_fused_paged_append_matches_the_reference() {
    let Some(g) = gpu("mrope_fused_paged_append_matches_the_reference") else { return };
    for source in [CosSin::Table, CosSin::Computed] {
        for (i, c) in configs().into_iter().enumerate() {
            let c = c.cos_sin(source);
            // Decode-sized (scanned) and prefill-sized (claimed) calls.
            for seq in [1, 3, 200] {
                let seed = test_seed("mrope_append") + (i * 10 + seq) as u64;
                append_case::<f32>(&g, c.clone(), seq, seed);
                append_case::<bf16>(&g, c.clone(), seq, seed);
            }
            append_case::<f16>(&g, c, 5, 77);
        }
    }
    mrope_kernels_of_both_sources_ran(&g, "kv_");
}

const BASE: u64 = 1 << 32;

fn raw(i: u64, layout: Layout) -> RawTensor {
    RawTensor::new(i * BASE, layout.extent().unwrap(), DType::F32, layout)
}

/// Every MRoPE misuse is a typed error before any launch (no GPU needed).
#[test]
fn mrope_misuse_is_a_typed_error() {
    // Sections that do not split the rotary dims.
    let bad = RopeConfig::new(128, 4096).mrope(Some(Mrope::new([16, 24, 20], false)));
    assert!(matches!(bad.validate(), Err(Error::MropeSections { sections: [16, 24, 20], half: 64, .. })));
    // Interleaved: the height section cannot take more than every third pair.
    let bad = RopeConfig::new(128, 4096).mrope(Some(Mrope::new([2, 40, 22], true)));
    assert!(matches!(bad.validate(), Err(Error::MropeSections { interleaved: true, .. })));
    // Positions of the wrong kind or shape.
    let config = RopeConfig::new(128, 4096).mrope(Some(Mrope::new([16, 24, 24], false)));
    let q = raw(1, Layout::bshd(2, 3, 4, 128));
    let args = |kind, len| RawArgs::new(q, RawPositions::new(kind, 9 * BASE, len));
    assert_eq!(validate(&config, &args(PositionKind::StreamsI32, 18)), Ok(()));
    assert!(matches!(validate(&config, &args(PositionKind::IdsI32, 6)), Err(Error::PositionKind { .. })));
    let plain = RopeConfig::new(128, 4096);
    assert!(matches!(validate(&plain, &args(PositionKind::StreamsI32, 18)), Err(Error::PositionKind { .. })));
    match validate(&config, &args(PositionKind::StreamsI64, 6)) {
        Err(Error::Length { what: "positions", shape, expected: 18, got: 6 }) => assert_eq!(shape, vec![3, 2, 3]),
        other => panic!("{other:?}"),
    }
    // The fused append needs a paged cache.
    let new = Layout::bshd(2, 3, 2, 128);
    let cache = Layout::bshd(2, 64, 2, 128);
    let streams = RawPositions::new(PositionKind::StreamsI32, 9 * BASE, 18);
    let append =
        RawKvArgs::new(raw(2, new), raw(3, new), RawKvCache::contiguous(raw(4, cache), raw(5, cache)), streams)
            .with_q(q);
    assert_eq!(validate_append(&config, &append), Err(Error::MropeCache));
    let mut paged = append.with_slots((10 * BASE, 6));
    paged.cache = RawKvCache::paged(append.cache.k, append.cache.v);
    assert_eq!(validate_append(&config, &paged), Ok(()));
    let mut wrong = paged;
    wrong.positions = RawPositions::new(PositionKind::IdsI32, 9 * BASE, 6);
    assert!(matches!(validate_append(&config, &wrong), Err(Error::PositionKind { .. })));
}

/// MRoPE read from configs: Qwen2-VL's older `"type": "mrope"`, Qwen3-VL's interleaved sections
/// in `rope_scaling`, GLM-4.1V's partial rotary, Qwen2.5-Omni's thinker, and bad sections.
#[test]
fn mrope_is_read_from_configs() {
    let qwen2 = r#"{"model_type": "qwen2_vl", "hidden_size": 3584, "num_attention_heads": 28,
        "max_position_embeddings": 32768, "rope_theta": 1000000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}}"#;
    let c = RopeConfig::from_hf_config_strict(qwen2).unwrap();
    assert_eq!((c.head_dim, c.style, c.mrope), (128, RopeStyle::NeoX, Some(Mrope::new([16, 24, 24], false))));
    let qwen3 = r#"{"model_type": "qwen3_vl", "text_config": {"model_type": "qwen3_vl_text", "head_dim": 128,
        "num_attention_heads": 32, "max_position_embeddings": 262144, "rope_theta": 5000000,
        "rope_scaling": {"rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": true}}}"#;
    let c = RopeConfig::from_hf_config_strict(qwen3).unwrap();
    assert_eq!((c.base, c.mrope), (5e6, Some(Mrope::new([24, 20, 20], true))));
    let glm = r#"{"model_type": "glm4v", "text_config": {"model_type": "glm4v_text", "hidden_size": 4096,
        "num_attention_heads": 32, "max_position_embeddings": 65536, "partial_rotary_factor": 0.5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000, "mrope_section": [8, 12, 12]}}}"#;
    let c = RopeConfig::from_hf_config_strict(glm).unwrap();
    assert_eq!((c.rotary_dim, c.style, c.mrope.unwrap().sections), (64, RopeStyle::GptJ, [8, 12, 12]));
    let omni = r#"{"model_type": "qwen2_5_omni", "thinker_config": {"model_type": "qwen2_5_omni_thinker",
        "text_config": {"model_type": "qwen2_5_omni_text", "hidden_size": 3584, "num_attention_heads": 28,
        "max_position_embeddings": 32768, "rope_theta": 1000000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}}}}"#;
    let model = HfConfig::parse(omni).unwrap();
    assert_eq!(model.rope().unwrap().mrope, Some(Mrope::new([16, 24, 24], false)));
    assert!(matches!(model.style_source(), StyleSource::Assumed(t) if t == "qwen2_5_omni_text"));
    let yarn = RopeConfig::from_hf_config_strict(YARN_VL).unwrap();
    assert_eq!((yarn.scaling.rope_type(), yarn.mrope), ("yarn", Some(Mrope::new([16, 24, 24], false))));
    assert!(yarn.frequencies().unwrap().1 > 1.0, "yarn's attention factor");
    let bad = qwen2.replace("[16, 24, 24]", "[16, 24]");
    assert!(matches!(RopeConfig::from_hf_config(&bad), Err(Error::Config(ConfigError::Invalid { .. }))));
    let bad = qwen2.replace("[16, 24, 24]", "[16, 24, 32]");
    assert!(matches!(RopeConfig::from_hf_config(&bad), Err(Error::MropeSections { .. })));
}

/// The per-layer entry point: Llama 4's `no_rope_layers` and its default interval, Cohere 2's
/// full-attention layers without RoPE, Gemma 3's older configs (`rope_local_base_freq` and the
/// sliding pattern), and layers past the config.
#[test]
fn layers_get_their_own_configuration_or_none() {
    let llama4 = r#"{"model_type": "llama4_text", "head_dim": 128, "num_attention_heads": 40,
        "num_hidden_layers": 8, "max_position_embeddings": 10485760, "rope_theta": 500000.0}"#;
    let m = HfConfig::parse(llama4).unwrap();
    let rope: Vec<bool> = (0..8).map(|i| m.layer(i).unwrap().is_some()).collect();
    assert_eq!(rope, [true, true, true, false, true, true, true, false]);
    assert!(matches!(m.layer(8), Err(Error::Config(ConfigError::NoSuchLayer { layer: 8, layers: 8 }))));
    let listed =
        llama4.replace(r#""num_hidden_layers": 8"#, r#""num_hidden_layers": 3, "no_rope_layers": [0, 1, true]"#);
    let m = HfConfig::parse(&listed).unwrap();
    assert_eq!((0..3).map(|i| m.layer(i).unwrap().is_some()).collect::<Vec<_>>(), [false, true, true]);

    let cohere2 = r#"{"model_type": "cohere2", "hidden_size": 4096, "num_attention_heads": 32,
        "num_hidden_layers": 8, "max_position_embeddings": 8192, "rope_theta": 50000.0, "sliding_window_pattern": 4}"#;
    let m = HfConfig::parse(cohere2).unwrap();
    assert_eq!(m.layer_type(3).unwrap().as_deref(), Some("full_attention"));
    let rope: Vec<bool> = (0..8).map(|i| m.layer(i).unwrap().is_some()).collect();
    assert_eq!(rope, [true, true, true, false, true, true, true, false]);
    assert_eq!(m.layer(0).unwrap().unwrap().style, RopeStyle::GptJ);

    let gemma3 = r#"{"model_type": "gemma3_text", "head_dim": 256, "num_attention_heads": 8,
        "num_hidden_layers": 12, "max_position_embeddings": 131072, "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}"#;
    let m = HfConfig::parse(gemma3).unwrap();
    let local = m.layer(0).unwrap().unwrap();
    let global = m.layer(5).unwrap().unwrap();
    assert_eq!((local.base, local.scaling.rope_type()), (10_000.0, "default"));
    assert_eq!((global.base, global.scaling.rope_type()), (1_000_000.0, "linear"));

    // An unknown model type: read, flagged, refused when strict.
    let unknown =
        r#"{"model_type": "brand_new", "head_dim": 64, "num_attention_heads": 8, "max_position_embeddings": 4096}"#;
    let m = HfConfig::parse(unknown).unwrap();
    assert_eq!(m.style_source(), StyleSource::Assumed("brand_new".into()));
    assert_eq!(m.layer(0).unwrap().unwrap().style, RopeStyle::NeoX);
    assert!(matches!(m.strict(), Err(Error::Config(ConfigError::UnknownModelType(t))) if t == "brand_new"));
    let explicit = unknown.replace(r#""head_dim""#, r#""rope_interleave": true, "head_dim""#);
    assert_eq!(HfConfig::parse(&explicit).unwrap().style_source(), StyleSource::RopeInterleave);
    // A model without RoPE is said so.
    let ernie = r#"{"model_type": "ernie", "hidden_size": 768, "num_attention_heads": 12,
        "max_position_embeddings": 513, "position_embedding_type": "absolute"}"#;
    assert!(matches!(RopeConfig::from_hf_config(ernie), Err(Error::Config(ConfigError::NoRope(t))) if t == "ernie"));
}

/// ChatGLM3-6B-32K's config (remote code: `modeling_chatglm.py` rotates interleaved pairs of
/// the first half of each `kv_channels` head, base `10000 * rope_ratio`, `seq_length`
/// positions).
#[test]
fn chatglm_rotates_half_of_each_head_in_interleaved_pairs() {
    let json = r#"{"model_type": "chatglm", "hidden_size": 4096, "num_attention_heads": 32,
        "kv_channels": 128, "multi_query_group_num": 2, "num_layers": 28, "seq_length": 32768,
        "rope_ratio": 50, "torch_dtype": "float16"}"#;
    let c = RopeConfig::from_hf_config_strict(json).unwrap();
    assert_eq!((c.head_dim, c.rotary_dim, c.style, c.max_position), (128, 64, RopeStyle::GptJ, 32768));
    assert_eq!((c.base, c.dtype), (500_000.0, DType::F16));
    assert_eq!(HfConfig::parse(json).unwrap().num_layers(), Some(28));
}
