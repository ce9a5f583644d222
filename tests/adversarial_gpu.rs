//! Adversarial inputs on the GPU (issue 7): positions at and past the table's edges as i32 and
//! i64, every theta, head dim and partial rotary dim models use, token counts around powers
//! of two, 1 and 17 heads, q and k with different strides, padded, transposed and packed
//! views, aliasing, and random valid shapes (proptest). Every case runs on fresh seeded random
//! data, is compared with the f64 reference row by row, and every element no row covers must
//! keep its bits.

mod common;

use common::{gpu, test_seed, upload_t, Gpu, TestElem};
use cust::memory::CopyDestination;
use half::{bf16, f16};
use proptest::prelude::*;
use proptest::test_runner::{Config as RunnerConfig, TestRunner};
use rope_cuda::reference::{rope_row_freqs, uniform};
use rope_cuda::{
    DType, Direction, Error, Layout, PositionKind, Positions, RawArgs, RawPositions, RawTensor, Rope, RopeArgs,
    RopeConfig, RopeStyle, Tensor, TensorMut,
};

/// Positions of one call, as the kernels read them.
#[derive(Clone, Debug)]
enum Pos {
    I32(Vec<i32>),
    I64(Vec<i64>),
}

impl Pos {
    fn get(&self, t: usize) -> i64 {
        match self {
            Pos::I32(v) => v[t] as i64,
            Pos::I64(v) => v[t],
        }
    }
}

/// One call: q and k as views of one buffer of `len` elements, positions per token.
#[derive(Clone, Debug)]
struct Call {
    config: RopeConfig,
    q: Layout,
    k: Layout,
    len: usize,
    pos: Pos,
    in_place: bool,
}

/// Runs `call` on random data from `seed` and checks it; `Err` describes the first mismatch.
/// Out-of-range positions must be skipped (their rows untouched) and reported.
fn run<T: TestElem>(g: &Gpu, rope: &Rope, call: &Call, seed: u64) -> Result<(), String> {
    let c = &call.config;
    let orig: Vec<T> = (0..call.len as u64).map(|i| T::from_f32(uniform(seed, 0, i))).collect();
    let poison = T::from_bits(T::POISON_BITS);
    let mut buf = upload_t(&orig);
    let mut out = upload_t(&vec![poison; call.len]);
    let tokens = call.q.batch() * call.q.seq();
    let (d32, d64) = match &call.pos {
        Pos::I32(v) => (Some(upload_t(v)), None),
        Pos::I64(v) => (None, Some(upload_t(v))),
    };
    let positions = match (&d32, &d64) {
        (Some(b), _) => Positions::ids_i32(b),
        (_, Some(b)) => Positions::ids_i64(b),
        _ => unreachable!(),
    };
    let fwd = Direction::Forward;
    let launched = if call.in_place {
        let (mut q, mut k) = TensorMut::pair(&mut buf, call.q, call.k);
        rope.apply(RopeArgs::in_place(&mut q, positions).k(&mut k).direction(fwd), &g.stream)
    } else {
        let (q, k) = (Tensor::new(&buf, call.q), Tensor::new(&buf, call.k));
        let (mut qo, mut ko) = TensorMut::pair(&mut out, call.q, call.k);
        rope.apply(RopeArgs::into(&q, &mut qo, positions).k_into(&k, &mut ko).direction(fwd), &g.stream)
    };
    launched.map_err(|e| format!("launch: {e}"))?;
    let reported = rope.check_errors(&g.stream);
    g.stream.synchronize().map_err(|e| e.to_string())?;
    let bad = (0..tokens).filter(|&t| !(0..c.max_position as i64).contains(&call.pos.get(t))).count();
    match (&reported, bad) {
        (Ok(()), 0) => {}
        (Err(Error::PositionOutOfRange { count, .. }), n) if n > 0 && *count == n as u64 => {}
        (r, n) => return Err(format!("{n} positions out of range, reported {r:?}")),
    }
    let got = {
        let mut h = vec![T::default(); call.len];
        let src = if call.in_place { &buf } else { &out };
        src.copy_to(&mut h[..]).map_err(|e| e.to_string())?;
        h
    };
    let (freqs, attention) = c.frequencies().map_err(|e| e.to_string())?;
    let (d, rot) = (c.head_dim, c.rotary_dim);
    let mut covered = vec![false; call.len];
    for l in [call.q, call.k] {
        for b in 0..l.batch() {
            for s in 0..l.seq() {
                let t = b * l.seq() + s;
                let p = call.pos.get(t);
                for h in 0..l.heads() {
                    let at = l.offset + b * l.strides[0] + s * l.strides[1] + h * l.strides[2];
                    let x: Vec<f64> = orig[at..at + d].iter().map(|v| v.to_f64()).collect();
                    let skipped = !(0..c.max_position as i64).contains(&p);
                    let want = if skipped {
                        None
                    } else {
                        Some(rope_row_freqs(&x, p as f64, &freqs, attention, c.style, fwd))
                    };
                    let scale = x.iter().fold(1e-30f64, |m, v| m.max(v.abs()));
                    for i in 0..d {
                        covered[at + i] = true;
                        let g_ = got[at + i];
                        let ok = match &want {
                            // Skipped: untouched in place, never written out of place.
                            None => g_.bits() == if call.in_place { orig[at + i] } else { poison }.bits(),
                            // Past rotary_dim: the input's bits (copied out of place).
                            Some(_) if i >= rot => g_.bits() == orig[at + i].bits(),
                            Some(w) if T::DTYPE == DType::F32 => (g_.to_f64() - w[i]).abs() <= 2e-6 * scale,
                            Some(w) => g_.ulps(T::round(w[i])) <= 1,
                        };
                        if !ok {
                            return Err(format!(
                                "token {t} head {h} dim {i} at {p}: got {g_:?}, want {:?}",
                                want.as_ref().map(|w| w[i])
                            ));
                        }
                    }
                }
            }
        }
    }
    let expect_rest = |i: usize| if call.in_place { orig[i] } else { poison };
    if let Some(i) = (0..call.len).find(|&i| !covered[i] && got[i].bits() != expect_rest(i).bits()) {
        return Err(format!("element {i}, in no view, changed: {:?}", got[i]));
    }
    Ok(())
}

/// [`run`] in the configuration's element type.
fn run_with(g: &Gpu, rope: &Rope, call: &Call, seed: u64) -> Result<(), String> {
    match call.config.dtype {
        DType::F32 => run::<f32>(g, rope, call, seed),
        DType::F16 => run::<f16>(g, rope, call, seed),
        DType::BF16 => run::<bf16>(g, rope, call, seed),
        DType::E4M3 | DType::E5M2 => Err("configurations are not FP8".into()),
    }
}

/// [`run_with`] a `Rope` of the call's configuration.
fn run_any(g: &Gpu, call: &Call, seed: u64) -> Result<(), String> {
    let rope = Rope::new(&g.kernels, call.config.clone()).map_err(|e| e.to_string())?;
    run_with(g, &rope, call, seed)
}

/// q `[1, tokens, hq, d]` then k `[1, tokens, hk, d]`, contiguous, in one buffer.
fn contiguous(config: RopeConfig, tokens: usize, hq: usize, hk: usize, pos: Pos, in_place: bool) -> Call {
    let d = config.head_dim;
    let q = Layout::bshd(1, tokens, hq, d);
    let k = Layout::strided([1, tokens, hk, d], [tokens * hk * d, hk * d, d], tokens * hq * d);
    Call { config, q, k, len: tokens * (hq + hk) * d, pos, in_place }
}

fn report(test: &str, failures: Vec<String>, cases: usize) {
    assert!(
        failures.is_empty(),
        "{test}: {} of {cases} cases failed:\n{}",
        failures.len(),
        failures[..failures.len().min(20)].join("\n")
    );
}

/// Positions 0, max - 1 (= 2^20), 65536, 131071 and 2^20 - 1 as i32 and as i64, next to
/// out-of-range ones (-1, max, i32::MAX, i32::MIN; i64: 2^33, i64::MIN), every dtype, both
/// styles: the valid ones rotate exactly, the others are skipped and counted, and no table
/// read goes past the end (compute-sanitizer's memcheck runs this too).
#[test]
fn positions_at_and_past_the_table_edges() {
    let test = "positions_at_and_past_the_table_edges";
    let Some(g) = gpu(test) else { return };
    let seed = test_seed(test);
    let max = (1 << 20) + 1;
    let valid = [0i64, max as i64 - 1, 65536, 131071, (1 << 20) - 1, 4095, 4096];
    let (mut failures, mut cases) = (Vec::new(), 0);
    for style in [RopeStyle::NeoX, RopeStyle::GptJ] {
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let config = RopeConfig::new(64, max).style(style).dtype(dtype).base(10_000.0);
            let rope = Rope::new(&g.kernels, config.clone()).unwrap();
            let mut i32s: Vec<i32> = valid.iter().map(|&p| p as i32).collect();
            let mut i64s = valid.to_vec();
            for (name, pos) in [
                ("i32", Pos::I32(i32s.clone())),
                ("i64", Pos::I64(i64s.clone())),
                ("i32 out of range", {
                    i32s.extend([-1, max as i32, i32::MAX, i32::MIN]);
                    Pos::I32(i32s.clone())
                }),
                ("i64 out of range", {
                    i64s.extend([-1, max as i64, 1 << 33, i64::MIN]);
                    Pos::I64(i64s.clone())
                }),
            ] {
                let tokens = match &pos {
                    Pos::I32(v) => v.len(),
                    Pos::I64(v) => v.len(),
                };
                for in_place in [true, false] {
                    cases += 1;
                    let call = contiguous(config.clone(), tokens, 3, 1, pos.clone(), in_place);
                    if let Err(e) = run_with(&g, &rope, &call, seed + cases as u64) {
                        failures.push(format!("{style:?} {dtype:?} {name} in_place {in_place}: {e}"));
                    }
                }
            }
        }
    }
    report(test, failures, cases);
}

/// theta 1e4, 5e5 and 1e6; head_dim 64, 80, 96, 128, 192, 256 and 512, each full and with
/// rotary dims 32 and 96 where they fit (rotary dims that are not powers of two: vllm-ascend
/// #12723); both styles; f32 and bf16; in place and out of place.
#[test]
fn thetas_head_dims_and_partial_rotary() {
    let test = "thetas_head_dims_and_partial_rotary";
    let Some(g) = gpu(test) else { return };
    let seed = test_seed(test);
    let (mut failures, mut cases) = (Vec::new(), 0);
    for base in [1e4, 5e5, 1e6] {
        for hd in [64, 80, 96, 128, 192, 256, 512] {
            for rot in [hd, 32, 96].into_iter().filter(|&r| r <= hd) {
                for style in [RopeStyle::NeoX, RopeStyle::GptJ] {
                    for dtype in [DType::F32, DType::BF16] {
                        cases += 1;
                        let s = seed + cases as u64;
                        let config = RopeConfig::new(hd, 2048).rotary_dim(rot).style(style).dtype(dtype).base(base);
                        let pos =
                            Pos::I32((0..5).map(|t| (rope_cuda::reference::splitmix64(s + t) % 2048) as i32).collect());
                        let call = contiguous(config, 5, 2, 1, pos, cases % 2 == 0);
                        if let Err(e) = run_any(&g, &call, s) {
                            failures.push(format!("base {base} hd {hd} rot {rot} {style:?} {dtype:?}: {e}"));
                        }
                    }
                }
            }
        }
    }
    assert!(cases >= 3 * 17 * 4);
    report(test, failures, cases);
}

/// Token counts 0, 1 and 2^k - 1, 2^k + 1 up to 4097, with 1 and 17 heads for q and k.
#[test]
fn token_counts_and_head_counts() {
    let test = "token_counts_and_head_counts";
    let Some(g) = gpu(test) else { return };
    let seed = test_seed(test);
    let (mut failures, mut cases) = (Vec::new(), 0);
    let mut counts = vec![0usize, 1];
    for k in 1..=12 {
        counts.extend([(1usize << k) - 1, (1 << k) + 1]);
    }
    counts.dedup();
    for &tokens in &counts {
        for (hq, hk) in [(1, 1), (17, 17), (17, 1)] {
            for dtype in [DType::BF16, DType::F32] {
                cases += 1;
                let s = seed + cases as u64;
                let config = RopeConfig::new(64, 8192).dtype(dtype).base(500_000.0);
                let pos = Pos::I32(
                    (0..tokens).map(|t| (rope_cuda::reference::splitmix64(s + t as u64) % 8192) as i32).collect(),
                );
                let mut call = contiguous(config, tokens, hq, hk, pos, cases % 2 == 1);
                // Room past the views, which must keep its bits (and a buffer even at 0 tokens).
                call.len += 64;
                if let Err(e) = run_any(&g, &call, s) {
                    failures.push(format!("{tokens} tokens heads {hq}/{hk} {dtype:?}: {e}"));
                }
            }
        }
    }
    report(test, failures, cases);
}

/// q and k with different strides (a kernel reading k with q's strides fails: SGLang
/// #20559): q row-major with padded rows, k transposed `[B, H, S, D]`; the reverse; both
/// inside a packed QKV row with v between them; odd padding that breaks 16-byte alignment
/// (the scalar kernels).
#[test]
fn q_and_k_with_different_strides() {
    let test = "q_and_k_with_different_strides";
    let Some(g) = gpu(test) else { return };
    let seed = test_seed(test);
    let (b, s, hq, hk, d) = (2, 7, 5, 3, 128);
    let (mut failures, mut cases) = (Vec::new(), 0);
    let padded_q =
        |pad: usize| Layout::strided([b, s, hq, d], [s * (hq * (d + pad) + 16), hq * (d + pad) + 16, d + pad], 0);
    let q_len = |pad: usize| b * s * (hq * (d + pad) + 16);
    let views: Vec<(&str, Layout, Layout, usize)> = vec![
        (
            "q padded bshd, k bhsd",
            padded_q(8),
            Layout::strided([b, s, hk, d], [hk * s * d, d, s * d], q_len(8)),
            q_len(8) + b * s * hk * d,
        ),
        (
            "q bhsd, k padded bshd",
            Layout::bhsd(b, hq, s, d),
            Layout::strided([b, s, hk, d], [s * hk * (d + 8), hk * (d + 8), d + 8], b * s * hq * d),
            b * s * hq * d + b * s * hk * (d + 8),
        ),
        (
            "packed q | v | k",
            Layout::strided([b, s, hq, d], [s * (hq + 2 * hk) * d, (hq + 2 * hk) * d, d], 0),
            Layout::strided([b, s, hk, d], [s * (hq + 2 * hk) * d, (hq + 2 * hk) * d, d], (hq + hk) * d),
            b * s * (hq + 2 * hk) * d,
        ),
        (
            "odd padding (scalar path)",
            padded_q(1),
            Layout::strided([b, s, hk, d], [hk * s * (d + 3), d + 3, s * (d + 3)], q_len(1) + 1),
            q_len(1) + 1 + b * s * hk * (d + 3),
        ),
    ];
    for (name, q, k, len) in views {
        for style in [RopeStyle::NeoX, RopeStyle::GptJ] {
            for dtype in [DType::F32, DType::F16, DType::BF16] {
                for in_place in [true, false] {
                    cases += 1;
                    let sd = seed + cases as u64;
                    let config = RopeConfig::new(d, 4096).rotary_dim(96).style(style).dtype(dtype);
                    let pos = Pos::I64(
                        (0..(b * s) as u64).map(|t| (rope_cuda::reference::splitmix64(sd + t) % 4096) as i64).collect(),
                    );
                    let call = Call { config, q, k, len, pos, in_place };
                    if let Err(e) = run_any(&g, &call, sd) {
                        failures.push(format!("{name} {style:?} {dtype:?} in_place {in_place}: {e}"));
                    }
                }
            }
        }
    }
    report(test, failures, cases);
}

/// q and k aliasing one buffer (overlapping views), or an output overlapping the other
/// tensor's input: a typed error before any launch, and the buffer keeps every bit.
#[test]
fn aliasing_q_and_k_is_a_typed_error() {
    let test = "aliasing_q_and_k_is_a_typed_error";
    let Some(g) = gpu(test) else { return };
    let seed = test_seed(test);
    let d = 64;
    let rope = Rope::new(&g.kernels, RopeConfig::new(d, 64).dtype(DType::BF16)).unwrap();
    let n = 48 * d;
    let orig: Vec<bf16> = (0..n as u64).map(|i| bf16::from_f32(uniform(seed, 0, i))).collect();
    let mut buf = upload_t(&orig);
    let ids = upload_t(&[1i32, 2, 3, 4]);
    let q = Layout::bshd(1, 4, 4, d);
    // k starts inside q's last row.
    let k = Layout::strided([1, 4, 1, d], [4 * d, d, d], 4 * 4 * d - d / 2);
    {
        let (mut tq, mut tk) = TensorMut::pair(&mut buf, q, k);
        let e = rope.apply(RopeArgs::in_place(&mut tq, Positions::ids_i32(&ids)).k(&mut tk), &g.stream);
        assert!(matches!(e, Err(Error::Aliasing { .. })), "{e:?}");
    }
    // Out of place, through the raw API (the safe one cannot express it): q's output over
    // k's input, and k's output over q's input.
    let base = buf.as_device_ptr().as_raw();
    let t = |layout| RawTensor::new(base, n, DType::BF16, layout);
    let out_at = |offset| Layout::strided([1, 4, 4, d], [4 * 4 * d, 4 * d, d], offset);
    let k_view = |offset| t(Layout::strided([1, 4, 1, d], [4 * d, d, d], offset));
    let cases = [
        // q's output over k's input.
        (t(q), t(out_at(16 * d)), k_view(16 * d), k_view(32 * d)),
        // k's output over q's input.
        (t(q), t(out_at(16 * d)), k_view(32 * d), k_view(d)),
    ];
    for (q_in, q_out, k_in, k_out) in cases {
        let positions = RawPositions::new(PositionKind::IdsI32, ids.as_device_ptr().as_raw(), 4);
        let args = RawArgs::new(q_in, positions).with_q_out(q_out).with_k(k_in).with_k_out(k_out);
        // SAFETY: every address is inside `buf` or `ids`; the call is refused before launch.
        let e = unsafe { rope.apply_raw(&args, g.stream.as_inner()) };
        assert!(matches!(e, Err(Error::Aliasing { .. })), "{e:?}");
    }
    g.stream.synchronize().unwrap();
    let mut host = vec![bf16::ZERO; n];
    buf.copy_to(&mut host[..]).unwrap();
    assert!(host.iter().zip(&orig).all(|(a, b)| a.to_bits() == b.to_bits()), "a refused call wrote");
}

/// Random valid shapes (batch, seq, heads, head_dim, rotary_dim, layout, style, dtype, in
/// place or not, i32 or i64 positions) against the f64 reference: 48 cases a run, the seed
/// printed.
#[test]
fn random_valid_shapes_match_the_reference() {
    let test = "random_valid_shapes_match_the_reference";
    let Some(g) = gpu(test) else { return };
    let seed = test_seed(test);
    let strategy = (
        (1usize..=3, 1usize..=9, 1usize..=9, 1usize..=4),
        (1usize..=64).prop_map(|h| 4 * h),
        0usize..4,
        any::<bool>(),
        0usize..3,
        any::<bool>(),
        any::<bool>(),
        0usize..3,
    );
    let mut bytes = [0u8; 32];
    bytes[..8].copy_from_slice(&seed.to_le_bytes());
    let rng = proptest::test_runner::TestRng::from_seed(proptest::test_runner::RngAlgorithm::ChaCha, &bytes);
    let mut runner =
        TestRunner::new_with_rng(RunnerConfig { cases: 48, failure_persistence: None, ..RunnerConfig::default() }, rng);
    let result = runner.run(&strategy, |((b, s, hq, hk), d, rot_pick, gptj, dt, in_place, i64s, pad)| {
        let rot = [d, d / 2 - (d / 2) % 2, 2, d - 2][rot_pick].max(2);
        let style = if gptj { RopeStyle::GptJ } else { RopeStyle::NeoX };
        let dtype = [DType::F32, DType::F16, DType::BF16][dt];
        let config = RopeConfig::new(d, 1 << 16).rotary_dim(rot).style(style).dtype(dtype).base(1e4);
        let row = hq * (d + pad) + pad;
        let q = Layout::strided([b, s, hq, d], [s * row, row, d + pad], 0);
        let k = Layout::strided([b, s, hk, d], [hk * d, b * hk * d, d], b * s * row);
        let tokens = b * s;
        let ps: Vec<i64> =
            (0..tokens as u64).map(|t| (rope_cuda::reference::splitmix64(seed ^ (t + 1)) % (1 << 16)) as i64).collect();
        let pos = if i64s { Pos::I64(ps) } else { Pos::I32(ps.iter().map(|&p| p as i32).collect()) };
        let call = Call { config, q, k, len: b * s * row + tokens * hk * d, pos, in_place };
        run_any(&g, &call, seed).map_err(|e| TestCaseError::fail(format!("{call:?}: {e}")))
    });
    if let Err(e) = result {
        panic!("{test}: {e}");
    }
}

/// Keys and values of `tokens` tokens, 2 kv heads of 64, bf16, NeoX, into a paged cache of
/// 16 blocks of 16: token `t` writes slot `slot(t)` (`-1`: padding).
struct Append {
    k: Vec<bf16>,
    v: Vec<bf16>,
    cache: Vec<bf16>,
    positions: Vec<i32>,
    slots: Vec<i64>,
}

const KV_HEADS: usize = 2;
const KV_D: usize = 64;

fn append_data(tokens: usize, seed: u64, slot: impl Fn(usize) -> i64) -> Append {
    let n = tokens * KV_HEADS * KV_D;
    let r = |tensor, n: usize| (0..n as u64).map(|i| bf16::from_f32(uniform(seed, tensor, i))).collect::<Vec<_>>();
    Append {
        k: r(1, n),
        v: r(2, n),
        cache: r(3, 16 * 16 * KV_HEADS * KV_D),
        positions: (0..tokens).map(|t| (rope_cuda::reference::splitmix64(seed + t as u64) % 4096) as i32).collect(),
        slots: (0..tokens).map(slot).collect(),
    }
}

/// Runs the append of `a` (its first `slots_len` slots) on fresh copies of the caches;
/// returns the call's result and the k and v caches after it.
fn append(g: &Gpu, rope: &Rope, a: &Append, slots_len: usize) -> (rope_cuda::Result<()>, Vec<bf16>, Vec<bf16>) {
    let tokens = a.positions.len();
    let (dk, dv) = (upload_t(&a.k), upload_t(&a.v));
    let (mut kc, mut vc) = (upload_t(&a.cache), upload_t(&a.cache));
    let (pos, slots) = (upload_t(&a.positions), upload_t(&a.slots[..slots_len]));
    let l = Layout::bshd(tokens, 1, KV_HEADS, KV_D);
    let layout = Layout::bshd(16, 16, KV_HEADS, KV_D);
    let result = {
        let mut cache = rope_cuda::KvCache::paged(&mut kc, &mut vc, layout);
        let (k, v) = (Tensor::new(&dk, l), Tensor::new(&dv, l));
        rope.append_kv(rope_cuda::KvAppend::new(&k, &v, &mut cache, Positions::ids_i32(&pos)).slots(&slots), &g.stream)
    };
    g.stream.synchronize().unwrap();
    let (mut hk, mut hv) = (vec![bf16::ZERO; a.cache.len()], vec![bf16::ZERO; a.cache.len()]);
    kc.copy_to(&mut hk[..]).unwrap();
    vc.copy_to(&mut hv[..]).unwrap();
    (result, hk, hv)
}

/// Duplicate destination slots (beellama.cpp #151): many tokens naming a few slots, in the
/// block-scan kernels (40 tokens) and the claiming ones (300), run 20 times each: the last
/// token naming a slot wins every time, bit for bit; padding slots (-1) write nothing; every
/// other slot keeps its bits.
#[test]
fn duplicate_slots_resolve_the_same_way_every_time() {
    let test = "duplicate_slots_resolve_the_same_way_every_time";
    let Some(g) = gpu(test) else { return };
    let seed = test_seed(test);
    let rope = Rope::new(&g.kernels, RopeConfig::new(KV_D, 4096).dtype(DType::BF16)).unwrap();
    let (freqs, _) = rope.config().frequencies().unwrap();
    for tokens in [40usize, 300] {
        // Slots 3, 20, 37, .. (seven of them) and every eleventh token padding.
        let a = append_data(tokens, seed + tokens as u64, |t| if t % 11 == 10 { -1 } else { 3 + 17 * (t % 7) as i64 });
        let row = KV_HEADS * KV_D;
        let mut want_k = a.cache.clone();
        let mut want_v = a.cache.clone();
        for t in 0..tokens {
            if a.slots[t] < 0 {
                continue;
            }
            let at = a.slots[t] as usize * row;
            for h in 0..KV_HEADS {
                let x: Vec<f64> = a.k[t * row + h * KV_D..][..KV_D].iter().map(|v| v.to_f64()).collect();
                let y = rope_row_freqs(&x, a.positions[t] as f64, &freqs, 1.0, RopeStyle::NeoX, Direction::Forward);
                for i in 0..KV_D {
                    want_k[at + h * KV_D + i] = bf16::round(y[i]);
                }
            }
            want_v[at..at + row].copy_from_slice(&a.v[t * row..(t + 1) * row]);
        }
        for run in 0..20 {
            let (r, k, v) = append(&g, &rope, &a, tokens);
            r.unwrap();
            for i in 0..k.len() {
                assert!(
                    k[i].ulps(want_k[i]) <= 1,
                    "{tokens} tokens, run {run}: k cache element {i}: {:?} vs {:?}",
                    k[i],
                    want_k[i]
                );
                assert_eq!(v[i].to_bits(), want_v[i].to_bits(), "{tokens} tokens, run {run}: v cache element {i}");
            }
        }
    }
}

/// A slot mapping shorter than the tokens (vLLM #13922: padded batches), or longer: a typed
/// error before any launch, and both caches keep every bit.
#[test]
fn slot_mapping_of_the_wrong_length_is_a_typed_error() {
    let test = "slot_mapping_of_the_wrong_length_is_a_typed_error";
    let Some(g) = gpu(test) else { return };
    let seed = test_seed(test);
    let rope = Rope::new(&g.kernels, RopeConfig::new(KV_D, 4096).dtype(DType::BF16)).unwrap();
    let a = append_data(12, seed, |t| t as i64);
    for len in [0, 11] {
        let (e, k, v) = append(&g, &rope, &a, len);
        assert!(matches!(e, Err(Error::Length { what: "slots", expected: 12, .. })), "{len} slots: {e:?}");
        let same = |c: &[bf16]| c.iter().zip(&a.cache).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same(&k) && same(&v), "{len} slots: a refused call wrote");
    }
}
