//! cos and sin computed in the kernels (issue 18) at every position a model can reach: up to
//! `2^31 - 1`, for every `rope_type` and both styles, in RoPE and the fused paged append,
//! against the f64 reference (its angle reduced in exact turns, `tests/angles.rs`): f32
//! within 2e-6 of each row's size, f16 and bf16 within one ulp of the correctly rounded
//! result, also on pairs built to cancel.

#![allow(clippy::needless_range_loop)]

mod common;

use common::{data_file, download_t, gpu, upload_t, Gpu, TestElem};
use half::{bf16, f16};
use rope_cuda::reference::{rope_row_freqs, sin_cos, splitmix64, uniform_vec};
use rope_cuda::{
    CosSin, DType, Direction, KvAppend, KvCache, Layout, Positions, Rope, RopeArgs, RopeConfig, RopeStyle, Tensor,
    TensorMut, MAX_POSITION_LIMIT,
};

/// One config of each `rope_type` (real models' files), with every position valid.
fn configs() -> Vec<(&'static str, RopeConfig)> {
    let files = [
        ("default", "qwen2.5-7b.json"),
        ("linear", "llama-linear.json"),
        ("dynamic", "llama-dynamic.json"),
        ("yarn", "qwen3-yarn.json"),
        ("yarn (mscale)", "deepseek-v2-lite.json"),
        ("longrope", "phi-3-mini-128k.json"),
        ("llama3", "llama-3.1-8b.json"),
    ];
    let mut out: Vec<_> = files
        .iter()
        .map(|&(name, file)| {
            let json = String::from_utf8(data_file(&format!("configs/{file}"))).unwrap();
            let mut c = RopeConfig::from_hf_config(&json).unwrap().cos_sin(CosSin::Computed);
            c.max_position = MAX_POSITION_LIMIT;
            (name, c)
        })
        .collect();
    let json = String::from_utf8(data_file("configs/per-layer.json")).unwrap();
    let mut c = RopeConfig::from_hf_config_layer(&json, "full_attention").unwrap().cos_sin(CosSin::Computed);
    c.max_position = MAX_POSITION_LIMIT;
    out.push(("proportional", c));
    out
}

/// The positions the issue names, and random ones up to the limit; below `max_position`
/// only (the largest first) where the configuration's is smaller.
fn positions(seed: u64, n: usize, max_position: usize) -> Vec<i64> {
    let mut p = vec![0, 1 << 20, 1 << 24, 1 << 28, (1 << 31) - 1, (1 << 31) - 2, (1 << 28) + 1];
    p.retain(|&v| v < max_position as i64);
    p.push(max_position as i64 - 1);
    p.extend((p.len()..n).map(|i| (splitmix64(seed ^ i as u64) % max_position as u64) as i64));
    p.truncate(n);
    p
}

/// Inputs of `tokens x heads` rows of `config`; odd rows built so that each pair's first
/// output nearly cancels at its token's position.
fn inputs<T: TestElem>(config: &RopeConfig, pos: &[i64], heads: usize, seed: u64) -> Vec<T> {
    let (freqs, _) = config.frequencies().unwrap();
    let (d, half) = (config.head_dim, config.rotary_dim / 2);
    let mut x: Vec<T> = uniform_vec(seed, 0, pos.len() * heads * d).into_iter().map(T::from_f32).collect();
    for (t, &p) in pos.iter().enumerate() {
        for h in (1..heads).step_by(2) {
            let row = (t * heads + h) * d;
            for i in 0..half {
                let (s, c) = sin_cos(p as f64, freqs[i]);
                let (a, b) = match config.style {
                    RopeStyle::NeoX => (i, i + half),
                    RopeStyle::GptJ => (2 * i, 2 * i + 1),
                };
                let v = T::round(x[row + a].to_f64() * c / s);
                if v.to_f64().is_finite() && v.to_f64().abs() < 4.0 {
                    x[row + b] = v;
                }
            }
        }
    }
    x
}

fn check_rows<T: TestElem>(what: &str, config: &RopeConfig, x: &[T], got: &[T], pos: &[i64], heads: usize) {
    let (freqs, attention) = config.frequencies().unwrap();
    let d = config.head_dim;
    for (t, &p) in pos.iter().enumerate() {
        for h in 0..heads {
            let r = (t * heads + h) * d;
            let xs: Vec<f64> = x[r..r + d].iter().map(|v| v.to_f64()).collect();
            let want = rope_row_freqs(&xs, p as f64, &freqs, attention, config.style, Direction::Forward);
            let norm = want.iter().fold(0f64, |m, v| m.max(v.abs())).max(xs.iter().fold(0f64, |m, v| m.max(v.abs())));
            for j in 0..d {
                let ok = match T::DTYPE {
                    DType::F32 => (got[r + j].to_f64() - want[j]).abs() <= 2e-6 * norm,
                    _ => got[r + j].ulps(T::round(want[j])) <= 1,
                };
                assert!(ok, "{what} {}: position {p} head {h} dim {j}: {:?} vs {}", T::NAME, got[r + j], want[j]);
            }
        }
    }
}

/// RoPE of `tokens x 4` heads in each style, checked against the reference; returns the
/// outputs (NeoX, GPT-J).
fn rope_case<T: TestElem + cust::memory::DeviceCopy>(
    g: &Gpu,
    name: &str,
    config: &RopeConfig,
    seed: u64,
    tokens: usize,
) -> Vec<Vec<T>> {
    rope_case_at(g, name, config, seed, &positions(seed, tokens, config.max_position))
}

/// [`rope_case`] at the positions `pos`.
fn rope_case_at<T: TestElem + cust::memory::DeviceCopy>(
    g: &Gpu,
    name: &str,
    config: &RopeConfig,
    seed: u64,
    pos: &[i64],
) -> Vec<Vec<T>> {
    let (heads, tokens, pos) = (4, pos.len(), pos.to_vec());
    let mut outs = Vec::new();
    for style in [RopeStyle::NeoX, RopeStyle::GptJ] {
        let config = config.clone().style(style).dtype(T::DTYPE);
        let rope = Rope::new(&g.kernels, config.clone()).unwrap();
        let x: Vec<T> = inputs(&config, &pos, heads, seed);
        let q = upload_t(&x);
        let mut out = upload_t(&vec![T::from_bits(T::POISON_BITS); x.len()]);
        let ids = upload_t(&pos);
        let l = Layout::bshd(1, tokens, heads, config.head_dim);
        let qt = Tensor::new(&q, l);
        let mut ov = TensorMut::new(&mut out, l);
        rope.apply(RopeArgs::into(&qt, &mut ov, Positions::ids_i64(&ids)), &g.stream).unwrap();
        rope.check_errors(&g.stream).unwrap();
        let got = download_t(&out);
        check_rows(&format!("{name} {style:?} rope"), &config, &x, &got, &pos, heads);
        outs.push(got);
    }
    outs
}

#[test]
fn every_rope_type_and_style_is_exact_up_to_position_2_pow_31() {
    let Some(g) = gpu("every_rope_type_and_style_is_exact_up_to_position_2_pow_31") else { return };
    for (i, (name, config)) in configs().into_iter().enumerate() {
        let seed = 900 + i as u64;
        rope_case::<f32>(&g, name, &config, seed, 24);
        rope_case::<bf16>(&g, name, &config, seed, 24);
        rope_case::<f16>(&g, name, &config, seed, 24);
    }
}

/// The fused paged append at the same positions: q in place and k into its slot, exact as
/// above; v copied; every other slot untouched. Returns q and the keys' rows as written.
fn append_case<T: TestElem + cust::memory::DeviceCopy>(
    g: &Gpu,
    name: &str,
    config: &RopeConfig,
    seq: usize,
) -> (Vec<T>, Vec<T>) {
    append_case_at(g, name, config, &positions(77 + seq as u64, 2 * seq, config.max_position))
}

/// [`append_case`] at the positions `pos` (two sequences of half of them each).
fn append_case_at<T: TestElem + cust::memory::DeviceCopy>(
    g: &Gpu,
    name: &str,
    config: &RopeConfig,
    pos: &[i64],
) -> (Vec<T>, Vec<T>) {
    let (batch, hq, hk) = (2, 4, 2);
    let (tokens, seq, pos) = (pos.len(), pos.len() / 2, pos.to_vec());
    assert_eq!(tokens, batch * seq);
    let config = config.clone().dtype(T::DTYPE);
    let d = config.head_dim;
    let rope = Rope::new(&g.kernels, config.clone()).unwrap();
    let slots: Vec<i64> = (0..tokens as i64).map(|t| (t * 7 + 1) % (4 * tokens as i64)).collect();
    let xq: Vec<T> = inputs(&config, &pos, hq, 5);
    let xk: Vec<T> = inputs(&config, &pos, hk, 6);
    let xv: Vec<T> = uniform_vec(7, 0, tokens * hk * d).into_iter().map(T::from_f32).collect();
    let cache0: Vec<T> = uniform_vec(8, 0, 4 * tokens * hk * d).into_iter().map(T::from_f32).collect();
    let (mut q, k, v) = (upload_t(&xq), upload_t(&xk), upload_t(&xv));
    let (mut kc, mut vc) = (upload_t(&cache0), upload_t(&cache0));
    let (ids, sl) = (upload_t(&pos), upload_t(&slots));
    let mut qv = TensorMut::new(&mut q, Layout::bshd(batch, seq, hq, d));
    let (kt, vt) = (Tensor::new(&k, Layout::bshd(batch, seq, hk, d)), Tensor::new(&v, Layout::bshd(batch, seq, hk, d)));
    let mut cache = KvCache::paged(&mut kc, &mut vc, Layout::bshd(4 * tokens / 8, 8, hk, d));
    let args = KvAppend::new(&kt, &vt, &mut cache, Positions::ids_i64(&ids)).q(&mut qv).slots(&sl);
    rope.append_kv(args, &g.stream).unwrap();
    rope.check_errors(&g.stream).unwrap();
    let (gq, gk, gv) = (download_t(&q), download_t(&kc), download_t(&vc));
    check_rows(&format!("{name} append q"), &config, &xq, &gq, &pos, hq);
    let mut k_rows = vec![T::default(); xk.len()];
    let mut written = vec![false; 4 * tokens];
    for t in 0..tokens {
        let n = slots[t] as usize;
        written[n] = true;
        let (r, c) = (t * hk * d, n * hk * d);
        k_rows[r..r + hk * d].copy_from_slice(&gk[c..c + hk * d]);
        assert!(gv[c..c + hk * d].iter().zip(&xv[r..r + hk * d]).all(|(a, b)| a.bits() == b.bits()), "v token {t}");
    }
    check_rows(&format!("{name} append k"), &config, &xk, &k_rows, &pos, hk);
    for n in (0..4 * tokens).filter(|&n| !written[n]) {
        let r = n * hk * d..(n + 1) * hk * d;
        for c in [&gk, &gv] {
            assert!(c[r.clone()].iter().zip(&cache0[r.clone()]).all(|(a, b)| a.bits() == b.bits()), "slot {n}");
        }
    }
    (gq, k_rows)
}

#[test]
fn the_fused_append_is_exact_up_to_position_2_pow_31() {
    let Some(g) = gpu("the_fused_append_is_exact_up_to_position_2_pow_31") else { return };
    for (name, config) in configs().into_iter().filter(|(n, _)| ["default", "yarn (mscale)", "llama3"].contains(n)) {
        for style in [RopeStyle::NeoX, RopeStyle::GptJ] {
            let c = config.clone().style(style);
            // Decode-sized (scanned) and prefill-sized (claimed).
            for seq in [1, 300] {
                append_case::<bf16>(&g, name, &c, seq);
                append_case::<f32>(&g, name, &c, seq);
            }
            append_case::<f16>(&g, name, &c, 4);
        }
    }
}

/// The library's table (`CosSin::Table`) is exact where products cancel, at table positions
/// from `2^16` to the table's end, for every `rope_type` and both styles, in RoPE and the
/// fused append: its rows come from the exactly reduced angle (rows formed from a plain f64
/// product gave bf16 outputs several ulps off from about `2^17` up).
#[test]
fn table_rows_are_exact_under_cancellation_to_the_table_end() {
    let Some(g) = gpu("table_rows_are_exact_under_cancellation_to_the_table_end") else { return };
    let end: i64 = 3 << 16;
    for (i, (name, config)) in configs().into_iter().enumerate() {
        let config = RopeConfig { max_position: end as usize, ..config }.cos_sin(CosSin::Table);
        let seed = 2900 + i as u64;
        // 2^16, 2^17, the table's last rows, and random rows between.
        let mut pos = vec![1 << 16, (1 << 17) + 1, end - 1, end - 2];
        pos.extend(
            (pos.len()..24).map(|j| (1 << 16) + (splitmix64(seed ^ j as u64) % (end as u64 - (1 << 16))) as i64),
        );
        rope_case_at::<bf16>(&g, name, &config, seed, &pos);
        rope_case_at::<f16>(&g, name, &config, seed, &pos);
        rope_case_at::<f32>(&g, name, &config, seed, &pos);
        for style in [RopeStyle::NeoX, RopeStyle::GptJ] {
            append_case_at::<bf16>(&g, name, &config.clone().style(style), &pos);
        }
    }
}

/// `max_position` is a limit, not a size: a `Rope` for every position holds 16 bytes a pair.
#[test]
fn a_rope_for_every_position_holds_no_table() {
    let Some(g) = gpu("a_rope_for_every_position_holds_no_table") else { return };
    let config = RopeConfig::new(128, MAX_POSITION_LIMIT).dtype(DType::BF16);
    let start = std::time::Instant::now();
    let rope = Rope::new(&g.kernels, config).unwrap();
    let elapsed = start.elapsed();
    assert_eq!(rope.table().device_bytes(), 64 * 16 + 4096);
    assert!(elapsed.as_millis() < 1000, "Rope::new took {elapsed:?}");
}

/// Two outputs of the same inputs, each within the contract of the reference: within 4e-6 of
/// the largest (f32), or within 2 ulps of each other (16-bit: each within 1 of the correctly
/// rounded value).
fn agree<T: TestElem>(what: &str, a: &[T], b: &[T]) {
    assert_eq!(a.len(), b.len());
    let norm = a.iter().fold(0f64, |m, v| m.max(v.to_f64().abs()));
    for (j, (x, y)) in a.iter().zip(b).enumerate() {
        let ok = match T::DTYPE {
            DType::F32 => (x.to_f64() - y.to_f64()).abs() <= 4e-6 * norm,
            _ => x.ulps(*y) <= 2,
        };
        assert!(ok, "{what} {}: element {j}: {x:?} (table) vs {y:?} (computed)", T::NAME);
    }
}

/// The library's two sources of cos and sin on the same inputs, at positions up to a table's
/// size, for every `rope_type` and both styles: each within the contract of the reference,
/// and the two within it of each other. Few tokens (the one-head kernels, the scanning
/// append), a prefill's (the several-head kernels, the claimed append) and more than the
/// one-head append takes (its `_v` kernels).
#[test]
fn table_and_computed_agree_on_the_same_inputs() {
    let Some(g) = gpu("table_and_computed_agree_on_the_same_inputs") else { return };
    for (i, (name, config)) in configs().into_iter().enumerate() {
        let config = RopeConfig { max_position: 8192, ..config };
        let seed = 1900 + i as u64;
        for tokens in [6, 600] {
            let run = |s: CosSin| rope_case::<bf16>(&g, name, &config.clone().cos_sin(s), seed, tokens);
            for (a, b) in run(CosSin::Table).iter().zip(&run(CosSin::Computed)) {
                agree(&format!("{name} rope, {tokens} tokens"), a, b);
            }
            let run = |s: CosSin| rope_case::<f32>(&g, name, &config.clone().cos_sin(s), seed, tokens);
            for (a, b) in run(CosSin::Table).iter().zip(&run(CosSin::Computed)) {
                agree(&format!("{name} rope, {tokens} tokens"), a, b);
            }
        }
        let run = |s: CosSin| rope_case::<f16>(&g, name, &config.clone().cos_sin(s), seed, 40);
        for (a, b) in run(CosSin::Table).iter().zip(&run(CosSin::Computed)) {
            agree(&format!("{name} rope"), a, b);
        }
    }
    for (name, config) in configs().into_iter().filter(|(n, _)| ["default", "yarn (mscale)"].contains(n)) {
        for style in [RopeStyle::NeoX, RopeStyle::GptJ] {
            let c = RopeConfig { max_position: 8192, ..config.clone() }.style(style);
            for seq in [1, 300, 4201] {
                let (tq, tk) = append_case::<bf16>(&g, name, &c.clone().cos_sin(CosSin::Table), seq);
                let (cq, ck) = append_case::<bf16>(&g, name, &c.clone().cos_sin(CosSin::Computed), seq);
                agree(&format!("{name} append q, seq {seq}"), &tq, &cq);
                agree(&format!("{name} append k, seq {seq}"), &tk, &ck);
            }
            let (tq, tk) = append_case::<f32>(&g, name, &c.clone().cos_sin(CosSin::Table), 300);
            let (cq, ck) = append_case::<f32>(&g, name, &c.clone().cos_sin(CosSin::Computed), 300);
            agree(&format!("{name} append q"), &tq, &cq);
            agree(&format!("{name} append k"), &tk, &ck);
        }
    }
}

/// [`CosSin::Auto`]: a table up to `AUTO_TABLE_BYTES`, computed beyond it and for MRoPE.
#[test]
fn auto_builds_a_table_only_where_it_is_small() {
    let Some(g) = gpu("auto_builds_a_table_only_where_it_is_small") else { return };
    let small = Rope::new(&g.kernels, RopeConfig::new(128, 4096)).unwrap();
    assert_eq!(small.table().device_bytes(), 4096 * 64 * 16 + 64 * 16 + 4096);
    let limit = rope_cuda::AUTO_TABLE_BYTES / (64 * 16);
    let edge = Rope::new(&g.kernels, RopeConfig::new(128, limit)).unwrap();
    assert_eq!(edge.table().device_bytes(), rope_cuda::AUTO_TABLE_BYTES + 64 * 16 + 4096);
    let long = Rope::new(&g.kernels, RopeConfig::new(128, limit + 1)).unwrap();
    assert_eq!(long.table().device_bytes(), 64 * 16 + 4096);
}
