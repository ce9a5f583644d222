//! QK-norm in the fused append ([`QkNorm`], `KvAppend::norm`) on the GPU: q, both caches and
//! every untouched element against an f64 model (norm, then rotation, one rounding), over
//! norm kinds x types x styles x caches x GQA x head dims x sources x decode/claimed calls;
//! and the typed errors of bad norms, before any launch, with nothing written.

#![allow(clippy::needless_range_loop)]

mod common;

use common::{
    changed, check_normed as check, download_t, gpu, norm_heads as heads, row_at, test_seed, upload_t, CacheKind, Draw,
    Gpu, TestElem, TestNorm,
};
use half::{bf16, f16};
use rope_cuda::reference::uniform_vec;
use rope_cuda::{
    validate_append, CosSin, DType, Error, KvAppend, KvCache, Layout, NormKind, PositionKind, Positions, QkNorm,
    RawKvArgs, RawKvCache, RawNorm, RawPositions, RawTensor, RawWeight, Rope, RopeConfig, RopeStyle, Tensor, TensorMut,
};

const MAX_POS: usize = 4096;
const BASE: f64 = 10_000.0;
const EPS: f32 = 1e-6;

#[derive(Debug, Clone, Copy)]
struct Case {
    kind: NormKind,
    style: RopeStyle,
    head_dim: usize,
    rotary_dim: usize,
    q_heads: usize,
    kv_heads: usize,
    batch: usize,
    seq: usize,
    cache: CacheKind,
    source: CosSin,
    /// Weights in f32 (else in the inputs' type).
    f32_weights: bool,
}

/// One normed append: returns nothing, asserts everything.
fn norm_case<T: TestElem>(g: &Gpu, c: Case, seed: u64) {
    let Case {
        kind, style, head_dim: d, rotary_dim: rot, q_heads: hq, kv_heads: hk, batch, seq, cache, source, ..
    } = c;
    let tokens = batch * seq;
    let (cache_layout, paged) = cache.layout(batch, hk, d);
    let (blocks, block_size) = (cache_layout.shape[0], cache_layout.shape[1]);
    let draw = Draw::new(seed, (batch, seq), paged, (blocks, block_size), MAX_POS);
    let conv = |v: Vec<f32>| v.into_iter().map(T::from_f32).collect::<Vec<T>>();
    let (q_l, k_l) = (Layout::bshd(batch, seq, hq, d), Layout::bshd(batch, seq, hk, d));
    // Whole-projection norms: every third token's projection small (eps matters there).
    let whole = kind == NormKind::RmsProjection;
    let unit = |h: usize| if whole { h.max(1) * d } else { d };
    let q_host = conv(heads(seed, 10, tokens * hq * d, unit(hq)));
    let k_host = conv(heads(seed, 11, tokens * hk * d, unit(hk)));
    let v_host = conv(uniform_vec(seed, 12, tokens * hk * d));
    let cache_len = cache_layout.extent().unwrap();
    let k_cache0 = conv(uniform_vec(seed, 13, cache_len));
    let v_cache0 = conv(uniform_vec(seed, 14, cache_len));
    let norm = TestNorm::<T>::new(kind, seed, (d, [hq, hk]), c.f32_weights);

    let config = RopeConfig::new(d, MAX_POS).rotary_dim(rot).style(style).dtype(T::DTYPE).base(BASE).cos_sin(source);
    let rope = Rope::new(&g.kernels, config).unwrap();
    let mut kc = upload_t(&k_cache0);
    let mut vc = upload_t(&v_cache0);
    let dpos = upload_t(&draw.positions);
    let dslots = draw.slots.as_ref().map(|s| upload_t(s));
    let mut dq = upload_t(&q_host);
    let (dk, dv) = (upload_t(&k_host), upload_t(&v_host));
    {
        let mut cache_view = match paged {
            true => KvCache::paged(&mut kc, &mut vc, cache_layout),
            false => KvCache::contiguous(&mut kc, &mut vc, cache_layout),
        };
        let mut q = TensorMut::new(&mut dq, q_l);
        let (k, v) = (Tensor::new(&dk, k_l), Tensor::new(&dv, k_l));
        let mut args = KvAppend::new(&k, &v, &mut cache_view, Positions::ids_i32(&dpos)).norm(norm.qk_norm(EPS));
        if hq > 0 {
            args = args.q(&mut q);
        }
        if let Some(slots) = dslots.as_deref() {
            args = args.slots(slots);
        }
        rope.append_kv(args, &g.stream).unwrap();
        rope.check_errors(&g.stream).unwrap();
    }
    let (q_out, kc, vc): (Vec<T>, Vec<T>, Vec<T>) = (download_t(&dq), download_t(&kc), download_t(&vc));
    let what = format!("{} {c:?}", T::NAME);
    // A token's heads of q or k, normalized and rotated in f64.
    let normed_rotated =
        |x: &[T], which: usize, pos: i32| norm.model_token(which, (x, d), pos as f64, (BASE, rot, style), EPS);

    // The caches: tokens in order, the last writer of a slot wins; every other element as it was.
    let mut want_k: Vec<Option<f64>> = vec![None; cache_len];
    let mut want_v = v_cache0.clone();
    for t in 0..tokens {
        let Some(n) = draw.target(t) else { continue };
        let (b, s) = (t / seq, t % seq);
        // (k's heads of a token lie together: `k_l` is contiguous.)
        let row = k_l.offset + b * k_l.strides[0] + s * k_l.strides[1];
        let y = normed_rotated(&k_host[row..row + hk * d], 1, draw.positions[t]);
        for h in 0..hk {
            let src = row + h * k_l.strides[2];
            let dst = row_at(&cache_layout, n / block_size, n % block_size, h);
            for i in 0..d {
                want_k[dst + i] = Some(y[h * d + i]);
            }
            want_v[dst..dst + d].copy_from_slice(&v_host[src..src + d]);
        }
    }
    check(&kc, &want_k, &k_cache0, d, &format!("{what}: key cache"));
    for i in 0..cache_len {
        assert_eq!(vc[i].bits(), want_v[i].bits(), "{what}: value cache element {i}");
    }
    let mut want_q: Vec<Option<f64>> = vec![None; q_host.len()];
    for t in 0..tokens {
        let at = t * hq * d;
        let y = normed_rotated(&q_host[at..at + hq * d], 0, draw.positions[t]);
        for (i, v) in y.into_iter().enumerate() {
            want_q[at + i] = Some(v);
        }
    }
    check(&q_out, &want_q, &q_host, d, &format!("{what}: q"));
}

/// A case of `kind` with heads `(q, kv, head_dim, rotary_dim)` and `(batch, seq)` tokens.
fn case(
    kind: NormKind,
    (hq, hk, d, rot): (usize, usize, usize, usize),
    (batch, seq): (usize, usize),
    (cache, source, style): (CacheKind, CosSin, RopeStyle),
    f32_weights: bool,
) -> Case {
    Case {
        kind,
        style,
        head_dim: d,
        rotary_dim: rot,
        q_heads: hq,
        kv_heads: hk,
        batch,
        seq,
        cache,
        source,
        f32_weights,
    }
}

fn cases() -> Vec<Case> {
    let mut v = Vec::new();
    let caches = [CacheKind::Bshd(64), CacheKind::PagedNhd(40, 16), CacheKind::PagedHnd(9, 32), CacheKind::Bhsd(300)];
    let kinds = [NormKind::Rms, NormKind::RmsOnePlus, NormKind::RmsUnit];
    let mut i = 0;
    for source in [CosSin::Table, CosSin::Computed] {
        for style in [RopeStyle::NeoX, RopeStyle::GptJ] {
            for (ci, cache) in caches.into_iter().enumerate() {
                for (hq, hk) in [(8, 2), (4, 4), (0, 1)] {
                    // Head dims of Llama/Qwen3 (128), Gemma (256), small ones, and partial rotary.
                    let (d, rot) = [(128, 128), (256, 256), (64, 32), (128, 64)][i % 4];
                    // Decode (15 tokens: the scanning `_d` kernels), or past the scan's limit
                    // (the claimed `_p` kernels) on the 300-row contiguous cache.
                    let tokens = if ci == 3 { (2, 150) } else { (3, 5) };
                    v.push(case(kinds[i % 3], (hq, hk, d, rot), tokens, (cache, source, style), i % 5 == 1));
                    i += 1;
                }
            }
        }
    }
    // Past the one-head limit (KV_PREFILL_MAX_TOKENS): the several-heads kernels (`_v`), with
    // a last group of fewer heads (6 q heads, 2 kv heads: groups of 4 in f32, 2 in f16/bf16).
    for (style, source, kind) in
        [(RopeStyle::NeoX, CosSin::Table, NormKind::Rms), (RopeStyle::GptJ, CosSin::Computed, NormKind::RmsOnePlus)]
    {
        v.push(case(kind, (6, 2, 128, 128), (3, 2800), (CacheKind::Bshd(2800), source, style), false));
    }
    // OLMo 2's whole-projection norm: decode (the `_d` kernels' 8-byte lanes where a token's q
    // heads fit a block, else `_p`), blocks of several tokens (small heads), a token's items
    // past one block (32 q heads of 128; 31: k's moved to the next block's start), MHA, k
    // alone, partial rotary, and past the scan's and the one-head limits (claimed `_p`, or
    // `_v` for NeoX pairs).
    let whole = |heads, tokens, cache, source, style, f32_weights| {
        case(NormKind::RmsProjection, heads, tokens, (cache, source, style), f32_weights)
    };
    let (neox, gptj) = (RopeStyle::NeoX, RopeStyle::GptJ);
    v.extend([
        whole((8, 2, 128, 128), (3, 5), CacheKind::PagedNhd(40, 16), CosSin::Table, neox, false),
        whole((4, 4, 64, 32), (3, 5), CacheKind::Bshd(64), CosSin::Computed, gptj, true),
        whole((32, 8, 128, 128), (2, 3), CacheKind::PagedHnd(9, 32), CosSin::Computed, neox, false),
        whole((31, 8, 128, 128), (3, 5), CacheKind::PagedNhd(40, 16), CosSin::Table, gptj, false),
        whole((16, 16, 128, 64), (3, 5), CacheKind::Bshd(64), CosSin::Table, gptj, false),
        whole((0, 2, 256, 256), (3, 5), CacheKind::PagedNhd(40, 16), CosSin::Table, neox, true),
        whole((6, 2, 128, 128), (2, 150), CacheKind::Bhsd(300), CosSin::Computed, neox, false),
        whole((6, 2, 128, 128), (3, 2800), CacheKind::Bshd(2800), CosSin::Table, gptj, false),
        // Past the one-head limit with NeoX pairs: several heads a thread (`_v_w`: groups of 4
        // in f32, 2 in f16/bf16, the last one short), each head's weights its own.
        whole((6, 2, 128, 128), (3, 2800), CacheKind::Bshd(2800), CosSin::Table, neox, false),
        whole((7, 3, 64, 64), (2, 4200), CacheKind::PagedHnd(264, 32), CosSin::Computed, neox, false),
    ]);
    v
}

fn matrix<T: TestElem>(test: &str) {
    common::each_case(test, cases(), norm_case::<T>);
}

#[test]
fn norm_append_matrix_f32() {
    matrix::<f32>("norm_append_matrix_f32");
}

#[test]
fn norm_append_matrix_f16() {
    matrix::<f16>("norm_append_matrix_f16");
}

#[test]
fn norm_append_matrix_bf16() {
    matrix::<bf16>("norm_append_matrix_bf16");
}

/// Addresses far apart for the plan-only checks (nothing is launched or read).
const GB: u64 = 1 << 30;

fn raw_args(norm: Option<RawNorm>) -> RawKvArgs {
    let t = |i: u64, layout: Layout| RawTensor::new(i * GB, layout.extent().unwrap(), DType::BF16, layout);
    let new = Layout::bshd(4, 1, 8, 128);
    let cache = Layout::bshd(64, 16, 8, 128);
    let positions = RawPositions::new(PositionKind::IdsI32, 6 * GB, 4);
    let mut args = RawKvArgs::new(t(2, new), t(3, new), RawKvCache::paged(t(4, cache), t(5, cache)), positions)
        .with_q(t(1, Layout::bshd(4, 1, 32, 128)))
        .with_slots((7 * GB, 4));
    args.norm = norm;
    args
}

fn weight(i: u64, len: usize, dtype: DType) -> Option<RawWeight> {
    Some(RawWeight::new(i * GB, len, dtype))
}

/// Every bad norm is a typed error from the plan alone (no GPU needed).
#[test]
fn bad_norms_are_typed_errors() {
    let config = RopeConfig::new(128, 4096).dtype(DType::BF16);
    let good = RawNorm::new(NormKind::Rms, 1e-6)
        .with_weights(RawWeight::new(8 * GB, 128, DType::BF16), RawWeight::new(9 * GB, 128, DType::BF16));
    validate_append(&config, &raw_args(Some(good))).unwrap();
    validate_append(&config, &raw_args(Some(RawNorm::new(NormKind::RmsUnit, good.eps)))).unwrap();
    type Expect = fn(&Error) -> bool;
    let cases: Vec<(&str, RawKvArgs, Expect)> = vec![
        ("eps 0", raw_args(Some(changed(good, |n| n.eps = 0.0))), |e| matches!(e, Error::NormEps { .. })),
        ("eps NaN", raw_args(Some(changed(good, |n| n.eps = f32::NAN))), |e| matches!(e, Error::NormEps { .. })),
        ("eps < 0", raw_args(Some(changed(good, |n| n.eps = -1e-6))), |e| matches!(e, Error::NormEps { .. })),
        ("eps inf", raw_args(Some(changed(good, |n| n.eps = f32::INFINITY))), |e| matches!(e, Error::NormEps { .. })),
        ("no k weight", raw_args(Some(changed(good, |n| n.k_weight = None))), |e| matches!(e, Error::Norm(_))),
        ("unit with weights", raw_args(Some(changed(good, |n| n.kind = NormKind::RmsUnit))), |e| {
            matches!(e, Error::Norm(_))
        }),
        ("short weight", raw_args(Some(changed(good, |n| n.q_weight = weight(8, 64, DType::BF16)))), |e| {
            matches!(e, Error::Length { what: "q norm weight", .. })
        }),
        ("mixed weight types", raw_args(Some(changed(good, |n| n.k_weight = weight(9, 128, DType::F32)))), |e| {
            matches!(e, Error::DType { what: "k norm weight", .. })
        }),
        ("FP8 weight", raw_args(Some(changed(good, |n| n.q_weight = weight(8, 128, DType::E4M3)))), |e| {
            matches!(e, Error::DType { what: "q norm weight", .. })
        }),
        (
            "misaligned weight",
            raw_args(Some(changed(good, |n| n.q_weight = Some(RawWeight::new(8 * GB + 1, 128, DType::BF16))))),
            |e| matches!(e, Error::Alignment { what: "q norm weight", .. }),
        ),
        (
            "weight inside the key cache",
            raw_args(Some(changed(good, |n| n.k_weight = Some(RawWeight::new(4 * GB, 128, DType::BF16))))),
            |e| matches!(e, Error::Aliasing { .. }),
        ),
        (
            "views without 8-byte accesses",
            {
                let mut a = raw_args(Some(good));
                a.k.ptr += 2;
                a
            },
            |e| matches!(e, Error::Norm(_)),
        ),
    ];
    for (what, args, ok) in cases {
        match validate_append(&config, &args) {
            Err(e) if ok(&e) => {}
            other => panic!("{what}: {other:?}"),
        }
    }
    // Heads wider than 32 lanes of 16 bytes.
    let wide = RopeConfig::new(512, 4096).dtype(DType::F32);
    let t = |i: u64, layout: Layout| RawTensor::new(i * GB, layout.extent().unwrap(), DType::F32, layout);
    let mut a = raw_args(None);
    let (new, cache) = (Layout::bshd(4, 1, 8, 512), Layout::bshd(64, 16, 8, 512));
    (a.q, a.k, a.v) = (Some(t(1, Layout::bshd(4, 1, 32, 512))), t(2, new), t(3, new));
    a.cache = RawKvCache::paged(t(4, cache), t(5, cache));
    a.norm = Some(RawNorm::new(NormKind::RmsUnit, 1e-6));
    assert!(matches!(validate_append(&wide, &a), Err(Error::Norm(_))), "{:?}", validate_append(&wide, &a));

    // A whole-projection norm: weights of the projections' lengths (32 q heads, 8 kv heads of
    // 128), a token's q heads in one block of at most 1024 threads.
    let olmo = RawNorm::new(NormKind::RmsProjection, 1e-6)
        .with_weights(RawWeight::new(8 * GB, 32 * 128, DType::BF16), RawWeight::new(9 * GB, 8 * 128, DType::BF16));
    validate_append(&config, &raw_args(Some(olmo))).unwrap();
    let head_sized = raw_args(Some(changed(olmo, |n| n.k_weight = weight(9, 128, DType::BF16))));
    assert!(
        matches!(
            validate_append(&config, &head_sized),
            Err(Error::Length { what: "k norm weight", expected: 1024, .. })
        ),
        "{:?}",
        validate_append(&config, &head_sized)
    );
    let no_weights = raw_args(Some(changed(olmo, |n| (n.q_weight, n.k_weight) = (None, None))));
    assert!(matches!(validate_append(&config, &no_weights), Err(Error::Norm(_))));
    // 80 q heads of 128 in f32: 40 KiB, past one block's 512 lanes of 32 bytes.
    let f32_config = RopeConfig::new(128, 4096).dtype(DType::F32);
    let t = |i: u64, layout: Layout| RawTensor::new(i * GB, layout.extent().unwrap(), DType::F32, layout);
    let mut a = raw_args(None);
    let (new, cache) = (Layout::bshd(4, 1, 8, 128), Layout::bshd(64, 16, 8, 128));
    (a.q, a.k, a.v) = (Some(t(1, Layout::bshd(4, 1, 80, 128))), t(2, new), t(3, new));
    a.cache = RawKvCache::paged(t(4, cache), t(5, cache));
    a.norm = Some(changed(olmo, |n| {
        (n.q_weight, n.k_weight) = (weight(8, 80 * 128, DType::F32), weight(9, 8 * 128, DType::F32));
    }));
    assert!(matches!(validate_append(&f32_config, &a), Err(Error::Norm(_))), "{:?}", validate_append(&f32_config, &a));
    // OLMo 2 32B's 40 q heads of 128 in bf16: 320 lanes of 16 bytes a block.
    let mut a = raw_args(None);
    a.q = Some(RawTensor::new(GB, 4 * 40 * 128, DType::BF16, Layout::bshd(4, 1, 40, 128)));
    a.norm = Some(changed(olmo, |n| n.q_weight = weight(8, 40 * 128, DType::BF16)));
    validate_append(&config, &a).unwrap();
}

/// A bad norm through the launching API: an error, and q and both caches bit-unchanged.
#[test]
fn bad_norm_launches_nothing() {
    let Some(g) = gpu("bad_norm_launches_nothing") else { return };
    let seed = test_seed("bad_norm_launches_nothing");
    let (d, hq, hk, tokens) = (128, 4, 2, 3);
    let rope = Rope::new(&g.kernels, RopeConfig::new(d, MAX_POS).dtype(DType::BF16)).unwrap();
    let conv = |v: Vec<f32>| v.into_iter().map(bf16::from_f32).collect::<Vec<bf16>>();
    let (q0, kc0) = (conv(uniform_vec(seed, 1, tokens * hq * d)), conv(uniform_vec(seed, 2, 8 * hk * d)));
    let (mut dq, dk, dv) = (
        upload_t(&q0),
        upload_t(&conv(uniform_vec(seed, 3, tokens * hk * d))),
        upload_t(&conv(uniform_vec(seed, 4, tokens * hk * d))),
    );
    let (mut kc, mut vc) = (upload_t(&kc0), upload_t(&kc0));
    let (pos, slots) = (upload_t(&[1i32, 2, 3]), upload_t(&[0i64, 1, 2]));
    let short = upload_t(&conv(uniform_vec(seed, 5, d - 2)));
    let full = upload_t(&conv(uniform_vec(seed, 6, d)));
    for (what, norm) in [("short weight", QkNorm::rms(&short, &full, EPS)), ("eps 0", QkNorm::rms(&full, &full, 0.0))] {
        let mut cache = KvCache::paged(&mut kc, &mut vc, Layout::bshd(2, 4, hk, d));
        let mut q = TensorMut::new(&mut dq, Layout::bshd(1, tokens, hq, d));
        let (k, v) =
            (Tensor::new(&dk, Layout::bshd(1, tokens, hk, d)), Tensor::new(&dv, Layout::bshd(1, tokens, hk, d)));
        let args = KvAppend::new(&k, &v, &mut cache, Positions::ids_i32(&pos)).q(&mut q).slots(&slots).norm(norm);
        assert!(rope.append_kv(args, &g.stream).is_err(), "{what}");
    }
    g.stream.synchronize().unwrap();
    let same = |a: &[bf16], b: &[bf16]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
    assert!(same(&download_t(&dq), &q0), "q changed");
    assert!(same(&download_t(&kc), &kc0) && same(&download_t(&vc), &kc0), "a cache changed");
}

/// The norms `HfConfig::qk_norm` reads from model configs, and its typed refusals.
#[test]
fn hf_configs_give_the_models_norms() {
    use rope_cuda::HfConfig;
    let norm = |json: &str, layer: usize| {
        HfConfig::parse(json).unwrap().qk_norm(layer).map(|s| s.map(|s| (s.kind(), s.eps())))
    };
    let qwen3 = r#"{"model_type": "qwen3", "head_dim": 128, "rms_norm_eps": 1e-6}"#;
    assert_eq!(norm(qwen3, 3).unwrap(), Some((NormKind::Rms, 1e-6)));
    let vl = r#"{"model_type": "qwen3_vl", "text_config": {"model_type": "qwen3_vl_text", "rms_norm_eps": 1e-5}}"#;
    assert_eq!(norm(vl, 0).unwrap(), Some((NormKind::Rms, 1e-5)));
    let gemma = r#"{"model_type": "gemma3", "text_config": {"model_type": "gemma3_text", "rms_norm_eps": 1e-6}}"#;
    assert_eq!(norm(gemma, 0).unwrap(), Some((NormKind::RmsOnePlus, 1e-6)));
    // Llama 4: the norm on its RoPE layers only (every fourth layer has none).
    let llama4 = r#"{"model_type": "llama4", "text_config": {"model_type": "llama4_text", "use_qk_norm": true,
        "rms_norm_eps": 1e-5, "num_hidden_layers": 8, "no_rope_layers": [1, 1, 1, 0, 1, 1, 1, 0]}}"#;
    assert_eq!(norm(llama4, 0).unwrap(), Some((NormKind::RmsUnit, 1e-5)));
    assert_eq!(norm(llama4, 3).unwrap(), None);
    let llama4_off = r#"{"model_type": "llama4_text", "use_qk_norm": false}"#;
    assert_eq!(norm(llama4_off, 0).unwrap(), None);
    let glm = r#"{"model_type": "glm4_moe", "use_qk_norm": true, "rms_norm_eps": 1e-5}"#;
    assert_eq!(norm(glm, 0).unwrap(), Some((NormKind::Rms, 1e-5)));
    assert_eq!(norm(r#"{"model_type": "llama", "rms_norm_eps": 1e-5}"#, 0).unwrap(), None);
    // OLMo 2 and 3: the whole q and k projections.
    for olmo in [r#"{"model_type": "olmo2", "rms_norm_eps": 1e-6}"#, r#"{"model_type": "olmo3", "rms_norm_eps": 1e-6}"#]
    {
        assert_eq!(norm(olmo, 0).unwrap(), Some((NormKind::RmsProjection, 1e-6)));
    }
    for json in [
        r#"{"model_type": "persimmon", "qk_layernorm": true}"#,
        r#"{"model_type": "somebody_new", "use_qk_norm": true}"#,
    ] {
        assert!(matches!(norm(json, 0), Err(Error::Norm(_))), "{json}");
    }
    assert!(matches!(norm(r#"{"model_type": "qwen3", "rms_norm_eps": 0}"#, 0), Err(Error::Config(_))));
    assert!(matches!(norm(r#"{"model_type": "glm4_moe", "use_qk_norm": 1}"#, 0), Err(Error::Config(_))));
}

/// `HfConfig::qk_norm`'s spec knows the weights' lengths from the config's sizes and refuses a
/// mix-up (a head's weights for a whole projection's norm, or the other way round) and weights
/// where the kind has none, before any buffer is touched.
#[test]
fn qk_norm_specs_check_the_weights_lengths() {
    use rope_cuda::HfConfig;
    let spec = |json: &str| HfConfig::parse(json).unwrap().qk_norm(0).unwrap().expect("a norm");
    let qwen3 = spec(
        r#"{"model_type": "qwen3", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "rms_norm_eps": 1e-6}"#,
    );
    assert_eq!((qwen3.kind(), qwen3.weight_lens()), (NormKind::Rms, Some((128, 128))));
    assert!(qwen3.takes_weights() && qwen3.check(128, 128).is_ok());
    assert!(matches!(qwen3.check(4096, 1024), Err(Error::Length { what: "q norm weights", expected: 128, .. })));
    assert!(matches!(qwen3.unweighted(), Err(Error::Norm(_))));
    // OLMo 2: head_dim from hidden_size / heads; the projections' lengths.
    let olmo2 = spec(
        r#"{"model_type": "olmo2", "hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 16,
        "rms_norm_eps": 1e-6}"#,
    );
    assert_eq!((olmo2.kind(), olmo2.weight_lens()), (NormKind::RmsProjection, Some((2048, 2048))));
    assert!(matches!(olmo2.check(128, 128), Err(Error::Length { what: "q norm weights", got: 128, .. })));
    assert!(matches!(olmo2.check(2048, 128), Err(Error::Length { what: "k norm weights", got: 128, .. })));
    // Llama 4's norm has no weights: `unweighted`, and weights refused.
    let llama4 = spec(r#"{"model_type": "llama4_text", "use_qk_norm": true, "rms_norm_eps": 1e-5}"#);
    assert_eq!((llama4.kind(), llama4.takes_weights(), llama4.weight_lens()), (NormKind::RmsUnit, false, None));
    assert_eq!(llama4.unweighted().unwrap().raw().kind, NormKind::RmsUnit);
    assert!(matches!(llama4.check(128, 128), Err(Error::Norm(_))));
    // Without the sizes, the lengths are not known and not checked.
    let bare = spec(r#"{"model_type": "gemma3_text", "rms_norm_eps": 1e-6}"#);
    assert_eq!((bare.kind(), bare.weight_lens()), (NormKind::RmsOnePlus, None));
    assert!(bare.check(7, 9).is_ok());
}

/// A normed decode step recorded with `Graph::record` and replayed gives the bits of the same
/// step launched eagerly (fresh inputs each time).
#[test]
fn normed_step_replays_from_a_recorded_graph() {
    let Some(g) = gpu("normed_step_replays_from_a_recorded_graph") else { return };
    let seed = test_seed("normed_step_replays_from_a_recorded_graph");
    let (d, hq, hk, tokens) = (128, 8, 2, 4);
    let rope = Rope::new(&g.kernels, RopeConfig::new(d, MAX_POS).dtype(DType::BF16)).unwrap();
    let conv = |v: Vec<f32>| v.into_iter().map(bf16::from_f32).collect::<Vec<bf16>>();
    let q0 = conv(heads(seed, 1, tokens * hq * d, d));
    let (k0, v0) = (conv(heads(seed, 2, tokens * hk * d, d)), conv(uniform_vec(seed, 3, tokens * hk * d)));
    let c0 = conv(uniform_vec(seed, 4, 4 * 16 * hk * d));
    let (qw, kw) = (upload_t(&conv(uniform_vec(seed, 5, d))), upload_t(&conv(uniform_vec(seed, 6, d))));
    let (pos, slots) = (upload_t(&[5i32, 900, 17, 3000]), upload_t(&[3i64, 40, -1, 63]));
    let (dk, dv) = (upload_t(&k0), upload_t(&v0));
    let run = |record: bool| {
        let (mut dq, mut kc, mut vc) = (upload_t(&q0), upload_t(&c0), upload_t(&c0));
        {
            let mut step = || {
                let mut cache = KvCache::paged(&mut kc, &mut vc, Layout::bshd(4, 16, hk, d));
                let mut q = TensorMut::new(&mut dq, Layout::bshd(tokens, 1, hq, d));
                let (k, v) = (
                    Tensor::new(&dk, Layout::bshd(tokens, 1, hk, d)),
                    Tensor::new(&dv, Layout::bshd(tokens, 1, hk, d)),
                );
                let args = KvAppend::new(&k, &v, &mut cache, Positions::ids_i32(&pos))
                    .q(&mut q)
                    .slots(&slots)
                    .norm(QkNorm::gemma(&qw, &kw, 1e-6));
                rope.append_kv(args, &g.stream)
            };
            if record {
                let graph = rope_cuda::Graph::record(step).unwrap();
                // SAFETY: every buffer the graph names lives past the synchronisation below.
                unsafe { graph.launch(&g.stream) }.unwrap();
            } else {
                step().unwrap();
            }
            rope.check_errors(&g.stream).unwrap();
        }
        (download_t(&dq), download_t(&kc), download_t(&vc))
    };
    let (eager, replayed): ((Vec<bf16>, Vec<bf16>, Vec<bf16>), _) = (run(false), run(true));
    let bits = |v: &[bf16]| v.iter().map(|x| x.to_bits()).collect::<Vec<u16>>();
    assert_eq!(bits(&eager.0), bits(&replayed.0), "q");
    assert_eq!(bits(&eager.1), bits(&replayed.1), "key cache");
    assert_eq!(bits(&eager.2), bits(&replayed.2), "value cache");
    assert_ne!(bits(&eager.0), bits(&q0), "q was not normed and rotated");
}

/// Every case of the matrix plans in each type (the plan alone, no GPU needed): a case the
/// planner refuses fails here, on any machine, before the GPU run.
#[test]
fn every_case_plans() {
    for c in cases() {
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let (d, hq, hk, tokens) = (c.head_dim, c.q_heads, c.kv_heads, c.batch * c.seq);
            let (cache, paged) = c.cache.layout(c.batch, hk, d);
            let t = |i: u64, layout: Layout| RawTensor::new(i * GB, layout.extent().unwrap(), dtype, layout);
            let new = |i, h| t(i, Layout::bshd(c.batch, c.seq, h, d));
            let w_type = if c.f32_weights { DType::F32 } else { dtype };
            let len = |h: usize| if c.kind == NormKind::RmsProjection { h.max(1) * d } else { d };
            let (q_weight, k_weight) = match c.kind {
                NormKind::RmsUnit => (None, None),
                _ => (weight(8, len(hq), w_type), weight(9, len(hk), w_type)),
            };
            let kv_cache = if paged {
                RawKvCache::paged(t(4, cache), t(5, cache))
            } else {
                RawKvCache::contiguous(t(4, cache), t(5, cache))
            };
            let positions = RawPositions::new(PositionKind::IdsI32, 6 * GB, tokens);
            let norm = changed(RawNorm::new(c.kind, EPS), |n| (n.q_weight, n.k_weight) = (q_weight, k_weight));
            let mut args = RawKvArgs::new(new(2, hk), new(3, hk), kv_cache, positions).with_norm(norm);
            args.q = (hq > 0).then(|| new(1, hq));
            args.slots = paged.then_some((7 * GB, tokens));
            let config = RopeConfig::new(d, MAX_POS)
                .rotary_dim(c.rotary_dim)
                .style(c.style)
                .dtype(dtype)
                .base(BASE)
                .cos_sin(c.source);
            if let Err(e) = validate_append(&config, &args) {
                panic!("{dtype:?} {c:?}: {e}");
            }
        }
    }
}
