//! QK-norm with RoPE and no cache ([`RopeArgs::norm`]) on the GPU: q and k, in place or into
//! outputs, strided views into one fused qkv buffer, against an f64 model (norm over the whole
//! head, then the rotation, one rounding), over norm kinds x types x styles x head dims x
//! partial rotation x sources x weight types; a token at a position out of range stays as it
//! was, as does everything no head covers (v, the outputs' other rows). And the typed errors
//! of bad calls, before any launch, with nothing written.

#![allow(clippy::needless_range_loop)]

mod common;

use common::{changed, check_normed, download_t, gpu, norm_heads, test_seed, upload_t, Gpu, TestElem, TestNorm};
use half::{bf16, f16};
use rope_cuda::reference::uniform_vec;
use rope_cuda::{
    validate, CosSin, DType, Error, Layout, NormKind, PositionKind, Positions, QkNorm, RawArgs, RawNorm, RawPositions,
    RawTensor, RawWeight, Rope, RopeArgs, RopeConfig, RopeStyle, Tensor, TensorMut,
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
    /// 0: q alone.
    k_heads: usize,
    batch: usize,
    seq: usize,
    in_place: bool,
    source: CosSin,
    /// Weights in f32 (else in the inputs' type).
    f32_weights: bool,
}

/// One normed RoPE call: returns nothing, asserts everything.
fn rope_norm_case<T: TestElem>(g: &Gpu, c: Case, seed: u64) {
    let Case {
        kind, style, head_dim: d, rotary_dim: rot, q_heads: hq, k_heads: hk, batch, seq, in_place, source, ..
    } = c;
    let tokens = batch * seq;
    // q, k and v heads side by side in one buffer per token (a fused projection's output).
    let row = (hq + 2 * hk) * d;
    let conv = |v: Vec<f32>| v.into_iter().map(T::from_f32).collect::<Vec<T>>();
    // Whole-projection norms: every third token small (eps matters there).
    let unit = if kind == NormKind::RmsProjection { row } else { d };
    let qkv0 = conv(norm_heads(seed, 10, tokens * row, unit));
    let view = |h0: usize, heads: usize| Layout::strided([batch, seq, heads, d], [seq * row, row, d], h0 * d);
    let (q_l, k_l) = (view(0, hq), view(hq, hk));
    // Positions inside the table, but for one token past it (skipped, recorded).
    let mut positions: Vec<i32> =
        uniform_vec(seed, 11, tokens).iter().map(|u| ((u + 1.0) * 0.5 * (MAX_POS - 1) as f32) as i32).collect();
    let skipped = tokens / 2;
    positions[skipped] = MAX_POS as i32 + 7;
    let norm = TestNorm::<T>::new(kind, seed, (d, [hq, hk]), c.f32_weights);

    let config = RopeConfig::new(d, MAX_POS).rotary_dim(rot).style(style).dtype(T::DTYPE).base(BASE).cos_sin(source);
    let rope = Rope::new(&g.kernels, config).unwrap();
    let dqkv = upload_t(&qkv0);
    let dpos = upload_t(&positions);
    // Out of place: outputs [batch, seq, heads, d], filled with other values first.
    let (q_out0, k_out0) = (conv(uniform_vec(seed, 12, tokens * hq * d)), conv(uniform_vec(seed, 13, tokens * hk * d)));
    let (mut dq_out, mut dk_out) = (upload_t(&q_out0), upload_t(&k_out0.clone()));
    {
        let norm = norm.qk_norm(EPS);
        let pos = Positions::ids_i32(&dpos);
        let (out_q, out_k) = (Layout::bshd(batch, seq, hq, d), Layout::bshd(batch, seq, hk, d));
        let result = if in_place {
            // q and k in place: two views of one buffer (disjoint heads, which the plan checks),
            // so through the raw entry point.
            let (ptr, len) = (dqkv.as_device_ptr().as_raw(), dqkv.len());
            let raw = |l: Layout| RawTensor::new(ptr, len, T::DTYPE, l);
            let positions = RawPositions::new(PositionKind::IdsI32, dpos.as_device_ptr().as_raw(), tokens);
            let mut args = RawArgs::new(raw(q_l), positions).with_norm(norm.raw());
            args.k = (hk > 0).then(|| raw(k_l));
            // SAFETY: every buffer is live and holds the elements its view covers; the stream
            // is synchronized before any of them is read or freed.
            unsafe { rope.apply_raw(&args, g.stream.as_inner()) }
        } else {
            let qv = Tensor::new(&dqkv, q_l);
            let kv = Tensor::new(&dqkv, k_l);
            let mut qo = TensorMut::new(&mut dq_out, out_q);
            let mut ko = TensorMut::new(&mut dk_out, out_k);
            let mut args = RopeArgs::into(&qv, &mut qo, pos).norm(norm);
            if hk > 0 {
                args = args.k_into(&kv, &mut ko);
            }
            rope.apply(args, &g.stream)
        };
        result.unwrap();
        match rope.check_errors(&g.stream) {
            Err(Error::PositionOutOfRange { token, .. }) => assert_eq!(token, skipped),
            other => panic!("{c:?}: the skipped token is not reported: {other:?}"),
        }
    }
    let what = format!("{} {c:?}", T::NAME);
    // A token's heads of q or k, normalized and rotated in f64.
    let normed_rotated =
        |x: &[T], which: usize, pos: i32| norm.model_token(which, (x, d), pos as f64, (BASE, rot, style), EPS);
    // What each head should hold, at its offset in the buffer it is written to.
    let expect = |len: usize, out: &dyn Fn(usize, usize, usize) -> usize| {
        let mut want: Vec<Option<f64>> = vec![None; len];
        for t in (0..tokens).filter(|&t| t != skipped) {
            for (h0, heads, which) in [(0, hq, 0), (hq, hk, 1)] {
                let src = t * row + h0 * d;
                let y = normed_rotated(&qkv0[src..src + heads * d], which, positions[t]);
                for h in 0..heads {
                    let at = out(t, h0, h);
                    for i in 0..d {
                        want[at + i] = Some(y[h * d + i]);
                    }
                }
            }
        }
        want
    };
    let qkv = download_t(&dqkv);
    if in_place {
        let want = expect(qkv.len(), &|t, h0, h| t * row + (h0 + h) * d);
        check_normed(&qkv, &want, &qkv0, d, &format!("{what}: qkv in place"));
    } else {
        // The inputs are read only.
        assert!(qkv.iter().zip(&qkv0).all(|(a, b)| a.bits() == b.bits()), "{what}: the input changed");
        let (q_out, k_out): (Vec<T>, Vec<T>) = (download_t(&dq_out), download_t(&dk_out));
        // Both outputs as one [q_out | k_out] sequence.
        let (qn, kn) = (q_out.len(), k_out.len());
        let want = expect(qn + kn, &|t, h0, h| match h0 {
            0 => (t * hq + h) * d,
            _ => qn + (t * hk + h) * d,
        });
        let got: Vec<T> = q_out.iter().chain(&k_out).copied().collect();
        let before: Vec<T> = q_out0.iter().chain(&k_out0).copied().collect();
        let want = if hk == 0 { want[..qn].to_vec() } else { want };
        let (got, before) = if hk == 0 { (got[..qn].to_vec(), before[..qn].to_vec()) } else { (got, before) };
        check_normed(&got, &want, &before, d, &format!("{what}: outputs"));
    }
}

/// A case of `kind` with heads `(q, k, head_dim, rotary_dim)` and `(batch, seq)` tokens.
fn case(
    kind: NormKind,
    (hq, hk, d, rot): (usize, usize, usize, usize),
    (batch, seq): (usize, usize),
    (in_place, source, style): (bool, CosSin, RopeStyle),
    f32_weights: bool,
) -> Case {
    Case {
        kind,
        style,
        head_dim: d,
        rotary_dim: rot,
        q_heads: hq,
        k_heads: hk,
        batch,
        seq,
        in_place,
        source,
        f32_weights,
    }
}

fn cases() -> Vec<Case> {
    let mut v = Vec::new();
    let kinds = [NormKind::Rms, NormKind::RmsOnePlus, NormKind::RmsUnit];
    let mut i = 0;
    for source in [CosSin::Table, CosSin::Computed] {
        for style in [RopeStyle::NeoX, RopeStyle::GptJ] {
            for in_place in [true, false] {
                for (hq, hk) in [(8, 2), (4, 0), (3, 3)] {
                    // Head dims of Llama/Qwen3 (128), Gemma (256), small ones, and partial rotary.
                    let (d, rot) = [(128, 128), (256, 256), (64, 32), (128, 64)][i % 4];
                    let tokens = if i % 3 == 0 { (2, 333) } else { (3, 7) };
                    v.push(case(kinds[i % 3], (hq, hk, d, rot), tokens, (in_place, source, style), i % 5 == 1));
                    i += 1;
                }
            }
        }
    }
    // Enough tokens for several heads a thread (`_v`), with a last group of fewer heads (6 q
    // heads: groups of 8 in f16/bf16, 4 in f32 NeoX).
    for (style, source, in_place, kind) in [
        (RopeStyle::NeoX, CosSin::Table, true, NormKind::Rms),
        (RopeStyle::GptJ, CosSin::Computed, false, NormKind::RmsOnePlus),
        (RopeStyle::NeoX, CosSin::Computed, false, NormKind::RmsUnit),
    ] {
        v.push(case(kind, (6, 2, 128, 128), (2, 2100), (in_place, source, style), false));
    }
    // OLMo 2's whole-projection norm (one head a thread): blocks of several tokens (small
    // heads), GQA, q alone, partial rotary, a token's q and k past one block in f32 (17 and 20
    // heads of 128: k's moved to the next block's start), and many tokens.
    for (i, (heads, tokens)) in [
        ((8, 2, 128, 128), (3, 7)),
        ((4, 0, 64, 32), (3, 7)),
        ((3, 3, 256, 256), (2, 5)),
        ((16, 4, 128, 64), (2, 9)),
        ((17, 20, 128, 128), (2, 5)),
        ((6, 2, 128, 128), (2, 2100)),
    ]
    .into_iter()
    .enumerate()
    {
        let style = if i % 2 == 0 { RopeStyle::NeoX } else { RopeStyle::GptJ };
        let source = if i < 3 { CosSin::Table } else { CosSin::Computed };
        v.push(case(NormKind::RmsProjection, heads, tokens, (i % 3 != 1, source, style), i == 2));
    }
    v
}

fn matrix<T: TestElem>(test: &str) {
    common::each_case(test, cases(), rope_norm_case::<T>);
}

#[test]
fn norm_rope_matrix_f32() {
    matrix::<f32>("norm_rope_matrix_f32");
}

#[test]
fn norm_rope_matrix_f16() {
    matrix::<f16>("norm_rope_matrix_f16");
}

#[test]
fn norm_rope_matrix_bf16() {
    matrix::<bf16>("norm_rope_matrix_bf16");
}

/// Addresses far apart for the plan-only checks (nothing is launched or read).
const GB: u64 = 1 << 30;

/// A bf16 call on q `[2, 3, 8, 128]` and k `[2, 3, 2, 128]` in place, with `norm`.
fn raw_args(norm: Option<RawNorm>) -> RawArgs {
    let t = |i: u64, layout: Layout| RawTensor::new(i * GB, layout.extent().unwrap(), DType::BF16, layout);
    let positions = RawPositions::new(PositionKind::IdsI32, 3 * GB, 6);
    let mut args = RawArgs::new(t(1, Layout::bshd(2, 3, 8, 128)), positions).with_k(t(2, Layout::bshd(2, 3, 2, 128)));
    args.norm = norm;
    args
}

fn weight(i: u64, len: usize, dtype: DType) -> Option<RawWeight> {
    Some(RawWeight::new(i * GB, len, dtype))
}

/// Every bad norm of a RoPE call is a typed error from the plan alone (no GPU needed).
#[test]
fn bad_rope_norms_are_typed_errors() {
    let config = RopeConfig::new(128, 4096).dtype(DType::BF16);
    let good = RawNorm::new(NormKind::Rms, EPS)
        .with_weights(RawWeight::new(5 * GB, 128, DType::BF16), RawWeight::new(6 * GB, 128, DType::BF16));
    assert_eq!(validate(&config, &raw_args(Some(good))), Ok(()));
    // f32 weights for both are fine; one of each type is not.
    let f32_weights =
        changed(good, |n| (n.q_weight, n.k_weight) = (weight(5, 128, DType::F32), weight(6, 128, DType::F32)));
    assert_eq!(validate(&config, &raw_args(Some(f32_weights))), Ok(()));
    let mixed = changed(good, |n| n.k_weight = weight(6, 128, DType::F32));
    assert!(matches!(validate(&config, &raw_args(Some(mixed))), Err(Error::DType { .. })));
    // A weighted kind without k's weights.
    assert!(matches!(validate(&config, &raw_args(Some(changed(good, |n| n.k_weight = None)))), Err(Error::Norm(_))));
    for eps in [0.0, -1e-6, f32::NAN, f32::INFINITY] {
        let bad = raw_args(Some(changed(good, |n| n.eps = eps)));
        assert!(matches!(validate(&config, &bad), Err(Error::NormEps { .. })), "eps {eps}");
    }
    let short = raw_args(Some(changed(good, |n| n.q_weight = weight(5, 127, DType::BF16))));
    assert!(matches!(validate(&config, &short), Err(Error::Length { .. })));
    let unit_with_weights = raw_args(Some(changed(good, |n| n.kind = NormKind::RmsUnit)));
    assert!(matches!(validate(&config, &unit_with_weights), Err(Error::Norm(_))));
    // A weight inside q (written in place).
    let inside = raw_args(Some(changed(good, |n| n.q_weight = weight(1, 128, DType::BF16))));
    assert!(validate(&config, &inside).is_err());
    // Views without 16-byte accesses: q two elements off alignment.
    let mut odd = raw_args(Some(good));
    odd.q.ptr += 4;
    assert!(matches!(validate(&config, &odd), Err(Error::Norm(_))), "{:?}", validate(&config, &odd));
    // Heads of more than 32 lanes: head_dim 512 in bf16, half of it rotated (16 rotating
    // lanes, 32 copying).
    let wide = RopeConfig::new(512, 4096).rotary_dim(256).dtype(DType::BF16);
    let t = |i: u64, layout: Layout| RawTensor::new(i * GB, layout.extent().unwrap(), DType::BF16, layout);
    let norm = changed(good, |n| (n.q_weight, n.k_weight) = (weight(5, 512, DType::BF16), weight(6, 512, DType::BF16)));
    let args = changed(raw_args(Some(norm)), |a| (a.q, a.k) = (t(1, Layout::bshd(1, 2, 2, 512)), None));
    let args = changed(args, |a| a.positions.len = 2);
    assert!(matches!(validate(&wide, &args), Err(Error::Norm(_))), "{:?}", validate(&wide, &args));
    // Without the norm the same calls plan.
    assert_eq!(validate(&wide, &changed(args, |a| a.norm = None)), Ok(()));
}

/// A bad norm launches nothing: q as it was.
#[test]
fn bad_rope_norm_launches_nothing() {
    let Some(g) = gpu("bad_rope_norm_launches_nothing") else { return };
    let seed = test_seed("bad_rope_norm_launches_nothing");
    let (d, hq, tokens) = (128, 4, 3);
    let rope = Rope::new(&g.kernels, RopeConfig::new(d, MAX_POS).dtype(DType::BF16)).unwrap();
    let conv = |v: Vec<f32>| v.into_iter().map(bf16::from_f32).collect::<Vec<bf16>>();
    let q0 = conv(uniform_vec(seed, 1, tokens * hq * d));
    let mut dq = upload_t(&q0);
    let pos = upload_t(&[1i32, 2, 3]);
    let short = upload_t(&conv(uniform_vec(seed, 5, d - 2)));
    let full = upload_t(&conv(uniform_vec(seed, 6, d)));
    for (what, norm) in [("short weight", QkNorm::rms(&short, &full, EPS)), ("eps 0", QkNorm::rms(&full, &full, 0.0))] {
        let mut q = TensorMut::new(&mut dq, Layout::bshd(1, tokens, hq, d));
        let args = RopeArgs::in_place(&mut q, Positions::ids_i32(&pos)).norm(norm);
        assert!(rope.apply(args, &g.stream).is_err(), "{what}");
    }
    g.stream.synchronize().unwrap();
    assert!(download_t(&dq).iter().zip(&q0).all(|(x, y)| x.to_bits() == y.to_bits()), "q changed");
}

/// QK-norm + RoPE recorded with `Graph::record` and replayed: the same bits as the eager call.
#[test]
fn normed_rope_replays_from_a_recorded_graph() {
    let Some(g) = gpu("normed_rope_replays_from_a_recorded_graph") else { return };
    let seed = test_seed("normed_rope_replays_from_a_recorded_graph");
    let (d, hq, hk, tokens) = (128, 8, 2, 4);
    let rope = Rope::new(&g.kernels, RopeConfig::new(d, MAX_POS).dtype(DType::BF16)).unwrap();
    let conv = |v: Vec<f32>| v.into_iter().map(bf16::from_f32).collect::<Vec<bf16>>();
    let (q0, k0) = (conv(norm_heads(seed, 1, tokens * hq * d, d)), conv(norm_heads(seed, 2, tokens * hk * d, d)));
    let (qw, kw) = (upload_t(&conv(uniform_vec(seed, 5, d))), upload_t(&conv(uniform_vec(seed, 6, d))));
    let pos = upload_t(&[5i32, 900, 17, 3000]);
    let run = |record: bool| {
        let (mut dq, mut dk) = (upload_t(&q0), upload_t(&k0));
        {
            let mut call = || {
                let mut q = TensorMut::new(&mut dq, Layout::bshd(tokens, 1, hq, d));
                let mut k = TensorMut::new(&mut dk, Layout::bshd(tokens, 1, hk, d));
                let args =
                    RopeArgs::in_place(&mut q, Positions::ids_i32(&pos)).k(&mut k).norm(QkNorm::gemma(&qw, &kw, EPS));
                rope.apply(args, &g.stream)
            };
            if record {
                let graph = rope_cuda::Graph::record(call).unwrap();
                // SAFETY: every buffer the graph names lives past the synchronisation below.
                unsafe { graph.launch(&g.stream) }.unwrap();
            } else {
                call().unwrap();
            }
            rope.check_errors(&g.stream).unwrap();
        }
        (download_t(&dq), download_t(&dk))
    };
    let (eager, replayed): ((Vec<bf16>, Vec<bf16>), _) = (run(false), run(true));
    let bits = |v: &[bf16]| v.iter().map(|x| x.to_bits()).collect::<Vec<u16>>();
    assert_eq!(bits(&eager.0), bits(&replayed.0), "q");
    assert_eq!(bits(&eager.1), bits(&replayed.1), "k");
    assert_ne!(bits(&eager.0), bits(&q0), "q was not normed and rotated");
}

/// Every case of the matrix plans in each type (the plan alone, no GPU needed): a case the
/// planner refuses fails here, on any machine, before the GPU run.
#[test]
fn every_case_plans() {
    for c in cases() {
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let (d, hq, hk, tokens) = (c.head_dim, c.q_heads, c.k_heads, c.batch * c.seq);
            // q and k as views of one qkv buffer, as the GPU test lays them out.
            let row = (hq + 2 * hk) * d;
            let qkv = |h0: usize, heads: usize| {
                let l = Layout::strided([c.batch, c.seq, heads, d], [c.seq * row, row, d], h0 * d);
                RawTensor::new(GB, tokens * row, dtype, l)
            };
            let out = |i: u64, heads: usize| {
                let l = Layout::bshd(c.batch, c.seq, heads, d);
                RawTensor::new(i * GB, l.extent().unwrap(), dtype, l)
            };
            let w_type = if c.f32_weights { DType::F32 } else { dtype };
            let len = |h: usize| if c.kind == NormKind::RmsProjection { h.max(1) * d } else { d };
            let (q_weight, k_weight) = match c.kind {
                NormKind::RmsUnit => (None, None),
                _ => (weight(5, len(hq), w_type), weight(6, len(hk), w_type)),
            };
            let norm = changed(RawNorm::new(c.kind, EPS), |n| (n.q_weight, n.k_weight) = (q_weight, k_weight));
            let mut args =
                RawArgs::new(qkv(0, hq), RawPositions::new(PositionKind::IdsI32, 4 * GB, tokens)).with_norm(norm);
            args.q_out = (!c.in_place).then(|| out(2, hq));
            args.k = (hk > 0).then(|| qkv(hq, hk));
            args.k_out = (!c.in_place && hk > 0).then(|| out(3, hk));
            let config = RopeConfig::new(d, MAX_POS)
                .rotary_dim(c.rotary_dim)
                .style(c.style)
                .dtype(dtype)
                .base(BASE)
                .cos_sin(c.source);
            if let Err(e) = validate(&config, &args) {
                panic!("{dtype:?} {c:?}: {e}");
            }
        }
    }
}
