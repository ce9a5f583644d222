//! KV cache on the GPU: the reference update against the seed's PyTorch loop (golden data)
//! and the f64 reference, and the fused RoPE + append against an f64 model of the caches.

#![allow(clippy::needless_range_loop)]

mod common;

use common::{
    check_close, data_file, download_t, gpu, row_at, test_seed, upload_t, CacheKind, Draw, Gpu, Reader, TestElem,
};
use cust::memory::DeviceBuffer;
use half::{bf16, f16};
use rope_cuda::reference::{relative_error, rope_row, splitmix64, uniform, uniform_vec};
use rope_cuda::seed::{KvShape, KvUpdate};
use rope_cuda::{
    CosSin, Direction, Error, KvCache, Layout, PositionKind, Positions, RawKvArgs, RawPositions, RawTensor, Rope,
    RopeConfig, RopeStyle, Tensor, TensorMut, KV_SCAN_MAX_TOKENS,
};

/// A golden file of `tests/data/make_golden_kv.py`.
struct GoldenKv {
    shape: KvShape,
    seed: u64,
    positions: Vec<i32>,
    cos: Vec<f32>,
    sin: Vec<f32>,
    /// The final key-cache row at each token's position, per token in order.
    k_rows: Vec<Vec<f64>>,
    moments: [f64; 3],
}

fn golden_kv(name: &str) -> GoldenKv {
    let bytes = data_file(name);
    let mut r = Reader(&bytes);
    assert_eq!(&r.take::<8>(), b"RPKVGLD1", "{name}: bad magic");
    let (b, t, h, d, s) = (r.u32(), r.u32(), r.u32(), r.u32(), r.u32());
    let seed = r.u64();
    let positions = (0..b * t).map(|_| i32::from_le_bytes(r.take())).collect();
    let cos = (0..s * d / 2).map(|_| f32::from_le_bytes(r.take())).collect();
    let sin = (0..s * d / 2).map(|_| f32::from_le_bytes(r.take())).collect();
    let k_rows = (0..b * t).map(|_| (0..h * d).map(|_| r.f64()).collect()).collect();
    let moments = [r.f64(), r.f64(), r.f64()];
    assert!(r.0.is_empty(), "{name}: trailing bytes");
    GoldenKv {
        shape: KvShape { batch: b, new_tokens: t, heads: h, head_dim: d, cache_len: s },
        seed,
        positions,
        cos,
        sin,
        k_rows,
        moments,
    }
}

/// The winner of each (sequence, position): the last token naming it.
fn winners(positions: &[i32], t: usize) -> std::collections::HashMap<(usize, usize), usize> {
    let mut w = std::collections::HashMap::new();
    for (i, &p) in positions.iter().enumerate() {
        w.insert((i / t, p as usize), i);
    }
    w
}

/// The f32 reference operation against the seed's PyTorch loop.
fn golden_case(g: &Gpu, name: &str) {
    let gk = golden_kv(name);
    let KvShape { batch: b, new_tokens: t, heads: h, head_dim: d, cache_len: s } = gk.shape;
    let (row, cache_n) = (h * d, b * s * h * d);
    let k_new = uniform_vec(gk.seed, 0, b * t * row);
    let v_new = uniform_vec(gk.seed, 1, b * t * row);
    let cache_k = uniform_vec(gk.seed, 2, cache_n);
    let cache_v = uniform_vec(gk.seed, 3, cache_n);
    let dev = |x: &[f32]| upload_t(x);
    let (dk, dv, dc, ds) = (dev(&k_new), dev(&v_new), dev(&gk.cos), dev(&gk.sin));
    let (dck, dcv, dp) = (dev(&cache_k), dev(&cache_v), upload_t(&gk.positions));
    let mut out = dev(&vec![f32::from_bits(common::POISON); 2 * cache_n]);
    let update = KvUpdate::new(&g.kernels).unwrap();
    update.update_kv_cache(gk.shape, &dk, &dv, &dc, &ds, &dck, &dcv, &dp, &mut out, &g.stream).unwrap();
    update.check_errors(&g.stream).unwrap();
    let out = download_t(&out);
    let win = winners(&gk.positions, t);
    for (i, &p) in gk.positions.iter().enumerate() {
        let at = (i / t * s + p as usize) * row;
        let err = relative_error(&out[at..at + row], &gk.k_rows[i]);
        assert!(err <= 2e-6, "{name}: token {i} key row: relative error {err:e}");
        let winner = win[&(i / t, p as usize)];
        let v_out = &out[cache_n + at..cache_n + at + row];
        assert!(
            v_out.iter().zip(&v_new[winner * row..]).all(|(a, b)| a.to_bits() == b.to_bits()),
            "{name}: value row {i}"
        );
    }
    // Every row no token targets is the input cache, bit for bit.
    for bb in 0..b {
        for pos in 0..s {
            if win.contains_key(&(bb, pos)) {
                continue;
            }
            let at = (bb * s + pos) * row;
            for (c, base) in [(&cache_k, 0), (&cache_v, cache_n)] {
                let same =
                    out[base + at..base + at + row].iter().zip(&c[at..]).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{name}: untouched row ({bb}, {pos}) changed");
            }
        }
    }
    // The moments of the whole stacked output.
    let w: Vec<f64> = (0..out.len() as u64).map(|i| uniform(gk.seed, 4, i) as f64).collect();
    let x: Vec<f64> = out.iter().map(|&v| v as f64).collect();
    let scale: f64 = x.iter().map(|v| v.abs()).sum();
    let got = [x.iter().sum::<f64>(), x.iter().map(|v| v * v).sum(), x.iter().zip(&w).map(|(a, b)| a * b).sum()];
    for (k, (g_, want)) in got.iter().zip(gk.moments).enumerate() {
        assert!((g_ - want).abs() <= 1e-6 * scale, "{name}: moment {k}: {g_} vs {want}");
    }
}

#[test]
fn reference_update_matches_the_seed_loop() {
    let Some(g) = gpu("reference_update_matches_the_seed_loop") else { return };
    golden_case(&g, "golden_kv_seed.bin");
    golden_case(&g, "golden_kv_large.bin");
}

/// The 16-bit reference operation against the f64 reference on the rounded inputs and tables:
/// every key within 1 ulp, values and untouched rows bit-exact. `t` new tokens per sequence:
/// more than `KV_SCAN_MAX_TOKENS` in all take the claim path, with many repeated positions.
fn reference_16<T: TestElem>(g: &Gpu, seed: u64, t: usize) {
    let (b, h, d, s) = (3, 4, 64, 96);
    let shape = KvShape { batch: b, new_tokens: t, heads: h, head_dim: d, cache_len: s };
    let row = h * d;
    let mut rng = seed;
    let mut next = |n: usize| {
        rng = splitmix64(rng);
        (rng % n as u64) as usize
    };
    let mut positions: Vec<i32> = (0..b * t).map(|_| next(s) as i32).collect();
    positions[5] = positions[3]; // a duplicate: token 5 wins
    let conv = |v: Vec<f32>| v.into_iter().map(T::from_f32).collect::<Vec<T>>();
    let k_new = conv(uniform_vec(seed, 0, b * t * row));
    let v_new = conv(uniform_vec(seed, 1, b * t * row));
    let cache_k = conv(uniform_vec(seed, 2, b * s * row));
    let cache_v = conv(uniform_vec(seed, 3, b * s * row));
    let angle = |p: usize, i: usize| p as f64 / 10_000f64.powf(2.0 * i as f64 / d as f64);
    let cos: Vec<T> = (0..s * d / 2).map(|j| T::round(angle(j / (d / 2), j % (d / 2)).cos())).collect();
    let sin: Vec<T> = (0..s * d / 2).map(|j| T::round(angle(j / (d / 2), j % (d / 2)).sin())).collect();
    let mut out = upload_t(&vec![T::from_bits(T::POISON_BITS); 2 * b * s * row]);
    let update = KvUpdate::new(&g.kernels).unwrap();
    let (dk, dv, dc, ds) = (upload_t(&k_new), upload_t(&v_new), upload_t(&cos), upload_t(&sin));
    let (dck, dcv, dp) = (upload_t(&cache_k), upload_t(&cache_v), upload_t(&positions));
    update.update_kv_cache(shape, &dk, &dv, &dc, &ds, &dck, &dcv, &dp, &mut out, &g.stream).unwrap();
    update.check_errors(&g.stream).unwrap();
    let out: Vec<T> = download_t(&out);
    let mut want_k = cache_k.clone();
    let mut want_v = cache_v.clone();
    let mut exact_k = vec![None; cache_k.len()];
    for (i, &p) in positions.iter().enumerate() {
        let p = p as usize;
        let at = (i / t * s + p) * row;
        for hh in 0..h {
            let x = &k_new[i * row + hh * d..][..d];
            for j in 0..d / 2 {
                let (c, sn) = (cos[p * d / 2 + j].to_f64(), sin[p * d / 2 + j].to_f64());
                let (x0, x1) = (x[2 * j].to_f64(), x[2 * j + 1].to_f64());
                exact_k[at + hh * d + 2 * j] = Some(x0 * c - x1 * sn);
                exact_k[at + hh * d + 2 * j + 1] = Some(x1 * c + x0 * sn);
            }
        }
        want_v[at..at + row].copy_from_slice(&v_new[i * row..(i + 1) * row]);
    }
    for (i, e) in exact_k.iter().enumerate() {
        if let Some(e) = e {
            want_k[i] = T::round(*e);
        }
    }
    let cache_n = b * s * row;
    for i in 0..cache_n {
        let ulps = out[i].ulps(want_k[i]);
        let allowed = if exact_k[i].is_some() { 1 } else { 0 };
        assert!(ulps <= allowed, "{}: key element {i}: {:?} vs {:?}", T::NAME, out[i], want_k[i]);
        assert_eq!(out[cache_n + i].bits(), want_v[i].bits(), "{}: value element {i}", T::NAME);
    }
}

#[test]
fn reference_update_16_bit_within_one_ulp() {
    let Some(g) = gpu("reference_update_16_bit_within_one_ulp") else { return };
    let seed = test_seed("reference_update_16_bit_within_one_ulp");
    for t in [24, KV_SCAN_MAX_TOKENS / 3 + 5] {
        reference_16::<f16>(&g, seed, t);
        reference_16::<bf16>(&g, seed ^ 1, t);
    }
}

#[test]
fn reference_update_rejects_bad_lengths_and_aliasing_before_launch() {
    let Some(g) = gpu("reference_update_rejects_bad_lengths_and_aliasing_before_launch") else { return };
    let shape = KvShape { batch: 1, new_tokens: 2, heads: 1, head_dim: 4, cache_len: 8 };
    let new = upload_t(&[0.5f32; 8]);
    let table = upload_t(&[1.0f32; 16]);
    let short = upload_t(&[1.0f32; 15]);
    let cache = upload_t(&[0.25f32; 32]);
    let pos = upload_t(&[0i32, 1]);
    let mut out = upload_t(&[7.0f32; 64]);
    let u = KvUpdate::new(&g.kernels).unwrap();
    let err = u.update_kv_cache(shape, &new, &new, &short, &table, &cache, &cache, &pos, &mut out, &g.stream);
    assert!(matches!(err, Err(Error::Length { what: "cos", .. })), "{err:?}");
    let odd = KvShape { head_dim: 3, ..shape };
    let err = u.update_kv_cache(odd, &new, &new, &table, &table, &cache, &cache, &pos, &mut out, &g.stream);
    assert!(matches!(err, Err(Error::HeadDim { head_dim: 3 })), "{err:?}");
    let three = upload_t(&[0i32, 1, 2]);
    let err = u.update_kv_cache(shape, &new, &new, &table, &table, &cache, &cache, &three, &mut out, &g.stream);
    assert!(matches!(err, Err(Error::Length { what: "positions", .. })), "{err:?}");
    g.stream.synchronize().unwrap();
    assert!(download_t(&out).iter().all(|&v| v == 7.0), "a rejected call wrote");
    // A position past the cache: skipped and reported.
    let bad = upload_t(&[0i32, 8]);
    u.update_kv_cache(shape, &new, &new, &table, &table, &cache, &cache, &bad, &mut out, &g.stream).unwrap();
    let err = u.check_errors(&g.stream);
    assert!(
        matches!(err, Err(Error::PositionOutOfRange { token: 1, position: 8, max_position: 8, count: 1 })),
        "{err:?}"
    );
    let out = download_t(&out);
    assert!(out[4..32].iter().chain(&out[36..]).all(|&v| v == 0.25), "only position 0 may change");
}

#[derive(Debug, Clone, Copy)]
struct Case {
    style: RopeStyle,
    head_dim: usize,
    rotary_dim: usize,
    q_heads: usize,
    kv_heads: usize,
    batch: usize,
    seq: usize,
    cache: CacheKind,
    /// q, k and v as slices of one fused QKV buffer (else separate buffers).
    fused: bool,
    /// Where the kernels take cos and sin from (the library's table, or computed).
    source: CosSin,
}

const MAX_POS: usize = 4096;
const BASE: f64 = 10_000.0;

/// Runs one fused append and checks q, both caches (every element) against the model.
fn append_case<T: TestElem>(g: &Gpu, c: Case, seed: u64) {
    let Case { style, head_dim: d, rotary_dim: rot, q_heads: hq, kv_heads: hk, batch, seq, cache, fused, source } = c;
    let tokens = batch * seq;
    let (cache_layout, paged) = cache.layout(batch, hk, d);
    let (blocks, block_size) = (cache_layout.shape[0], cache_layout.shape[1]);
    // Positions and slots, with duplicates (and padding, paged).
    let draw = Draw::new(seed, (batch, seq), paged, (blocks, block_size), MAX_POS);
    let (positions, slots, target) = (&draw.positions, &draw.slots, |t| draw.target(t));
    // Inputs: separate [B, S, H, D] buffers, or views of one fused QKV buffer with padding.
    let conv = |v: Vec<f32>| v.into_iter().map(T::from_f32).collect::<Vec<T>>();
    let row_elems = (hq + 2 * hk) * d + 8;
    let (q_l, k_l, v_l, qkv_len) = if fused {
        let strides = [seq * row_elems, row_elems, d];
        (
            Layout::strided([batch, seq, hq, d], strides, 0),
            Layout::strided([batch, seq, hk, d], strides, hq * d),
            Layout::strided([batch, seq, hk, d], strides, (hq + hk) * d),
            tokens * row_elems,
        )
    } else {
        (Layout::bshd(batch, seq, hq, d), Layout::bshd(batch, seq, hk, d), Layout::bshd(batch, seq, hk, d), 0)
    };
    let (q_host, k_host, v_host) = if fused {
        let all = conv(uniform_vec(seed, 10, qkv_len));
        (all.clone(), all.clone(), all)
    } else {
        (
            conv(uniform_vec(seed, 10, tokens * hq * d)),
            conv(uniform_vec(seed, 11, tokens * hk * d)),
            conv(uniform_vec(seed, 12, tokens * hk * d)),
        )
    };
    let cache_len = cache_layout.extent().unwrap();
    let k_cache0 = conv(uniform_vec(seed, 13, cache_len));
    let v_cache0 = conv(uniform_vec(seed, 14, cache_len));

    let config = RopeConfig::new(d, MAX_POS).rotary_dim(rot).style(style).dtype(T::DTYPE).base(BASE).cos_sin(source);
    let rope = Rope::new(&g.kernels, config).unwrap();
    let mut kc = upload_t(&k_cache0);
    let mut vc = upload_t(&v_cache0);
    let dpos = upload_t(positions);
    let dslots = slots.as_ref().map(|s| upload_t(s));
    let (q_out, k_in, v_in);
    {
        let mut cache_view = if paged {
            KvCache::paged(&mut kc, &mut vc, cache_layout)
        } else {
            KvCache::contiguous(&mut kc, &mut vc, cache_layout)
        };
        if fused {
            // q is written in place and k and v read from one QKV buffer: the raw entry,
            // since one cust borrow cannot be both.
            let buf = upload_t(&q_host);
            let raw = |layout| RawTensor::new(buf.as_device_ptr().as_raw(), buf.len(), T::DTYPE, layout);
            let positions = RawPositions::new(PositionKind::IdsI32, dpos.as_device_ptr().as_raw(), tokens);
            let mut args = RawKvArgs::new(raw(k_l), raw(v_l), cache_view.raw(), positions);
            args.q = (hq > 0).then(|| raw(q_l));
            args.slots = dslots.as_ref().map(|s| (s.as_device_ptr().as_raw(), s.len()));
            // SAFETY: every address is a live buffer of this context, alive until the sync.
            unsafe { rope.append_kv_raw(&args, g.stream.as_inner()) }.unwrap();
            rope.check_errors(&g.stream).unwrap();
            q_out = download_t(&buf);
            k_in = q_host.clone();
            v_in = q_host.clone();
        } else {
            let mut dq = upload_t(&q_host);
            let dk = upload_t(&k_host);
            let dv = upload_t(&v_host);
            let mut q = TensorMut::new(&mut dq, q_l);
            let (k, v) = (Tensor::new(&dk, k_l), Tensor::new(&dv, v_l));
            let mut args = rope_cuda::KvAppend::new(&k, &v, &mut cache_view, Positions::ids_i32(&dpos));
            if hq > 0 {
                args = args.q(&mut q);
            }
            if let Some(slots) = dslots.as_deref() {
                args = args.slots(slots);
            }
            rope.append_kv(args, &g.stream).unwrap();
            rope.check_errors(&g.stream).unwrap();
            q_out = download_t(&dq);
            k_in = k_host.clone();
            v_in = v_host.clone();
        }
    }
    let kc: Vec<T> = download_t(&kc);
    let vc: Vec<T> = download_t(&vc);
    let what = format!("{} {c:?}", T::NAME);

    // The model: tokens in order, the last writer of a slot wins.
    let mut want_k = k_cache0.clone();
    let mut want_v = v_cache0.clone();
    let mut exact = vec![None::<f64>; cache_len];
    for t in 0..tokens {
        let Some(n) = target(t) else { continue };
        let (blk, within) = (n / block_size, n % block_size);
        let (b, s) = (t / seq, t % seq);
        for h in 0..hk {
            let src = k_l.offset + b * k_l.strides[0] + s * k_l.strides[1] + h * k_l.strides[2];
            let x: Vec<f64> = k_in[src..src + d].iter().map(|v| v.to_f64()).collect();
            let y = rope_row(&x, positions[t] as f64, BASE, rot, style, Direction::Forward);
            let dst = row_at(&cache_layout, blk, within, h);
            for i in 0..d {
                exact[dst + i] = (i < rot).then_some(y[i]);
                want_k[dst + i] = if i < rot { T::round(y[i]) } else { k_in[src + i] };
            }
            let vsrc = v_l.offset + b * v_l.strides[0] + s * v_l.strides[1] + h * v_l.strides[2];
            want_v[dst..dst + d].copy_from_slice(&v_in[vsrc..vsrc + d]);
        }
    }
    check_close::<T>(&kc, &want_k, &exact, &format!("{what}: key cache"));
    for i in 0..cache_len {
        assert_eq!(vc[i].bits(), want_v[i].bits(), "{what}: value cache element {i}");
    }
    // q rotated in place.
    let mut want_q = q_host.clone();
    let mut exact_q = vec![None::<f64>; q_host.len()];
    for t in 0..tokens {
        let (b, s) = (t / seq, t % seq);
        for h in 0..hq {
            let at = q_l.offset + b * q_l.strides[0] + s * q_l.strides[1] + h * q_l.strides[2];
            let x: Vec<f64> = q_host[at..at + d].iter().map(|v| v.to_f64()).collect();
            let y = rope_row(&x, positions[t] as f64, BASE, rot, style, Direction::Forward);
            for i in 0..rot {
                exact_q[at + i] = Some(y[i]);
                want_q[at + i] = T::round(y[i]);
            }
        }
    }
    if hq > 0 {
        check_close::<T>(&q_out, &want_q, &exact_q, &format!("{what}: q"));
    }
}

fn cases() -> Vec<Case> {
    let mut v = Vec::new();
    let caches = [
        CacheKind::Bshd(64),
        CacheKind::Bhsd(40),
        CacheKind::PagedNhd(9, 16),
        CacheKind::PagedHnd(5, 32),
        CacheKind::PagedNhd(70, 1),
        CacheKind::PagedHnd(33, 1),
    ];
    for source in [CosSin::Table, CosSin::Computed] {
        for style in [RopeStyle::NeoX, RopeStyle::GptJ] {
            for (i, cache) in caches.into_iter().enumerate() {
                for (j, (hq, hk)) in [(8, 2), (4, 4), (0, 1)].into_iter().enumerate() {
                    let (d, rot) = [(64, 64), (128, 96), (80, 32)][(i + j) % 3];
                    let fused = (i + j) % 2 == 1;
                    v.push(Case {
                        style,
                        head_dim: d,
                        rotary_dim: rot,
                        q_heads: hq,
                        kv_heads: hk,
                        batch: 3,
                        seq: 5,
                        cache,
                        fused,
                        source,
                    });
                }
            }
        }
    }
    v
}

fn matrix<T: TestElem>(test: &str) {
    common::each_case(test, cases(), append_case::<T>);
}

#[test]
fn append_matrix_f32() {
    matrix::<f32>("append_matrix_f32");
}

#[test]
fn append_matrix_f16() {
    matrix::<f16>("append_matrix_f16");
}

#[test]
fn append_matrix_bf16() {
    matrix::<bf16>("append_matrix_bf16");
}

/// Larger calls: scans over many later tokens (160 and 240 tokens), the claim path (more
/// than `KV_SCAN_MAX_TOKENS` tokens) with one head per thread and, past 8192 tokens, with
/// several; with duplicates and padding.
#[test]
fn append_large_calls_and_claims() {
    let Some(g) = gpu("append_large_calls_and_claims") else { return };
    let seed = test_seed("append_large_calls_and_claims");
    let big = KV_SCAN_MAX_TOKENS / 4 + 7;
    for (i, (seq, cache)) in [
        (40, CacheKind::Bshd(48)),
        (60, CacheKind::PagedNhd(20, 16)),
        (100, CacheKind::PagedNhd(40, 16)),
        (big, CacheKind::PagedHnd(200, 16)),
        (big, CacheKind::Bshd(big + 3)),
        (2100, CacheKind::PagedNhd(600, 16)),
    ]
    .into_iter()
    .enumerate()
    {
        for (style, source) in [
            (RopeStyle::NeoX, CosSin::Table),
            (RopeStyle::GptJ, CosSin::Table),
            (RopeStyle::NeoX, CosSin::Computed),
            (RopeStyle::GptJ, CosSin::Computed),
        ] {
            let c = Case {
                style,
                head_dim: 64,
                rotary_dim: 64,
                q_heads: 8,
                kv_heads: 2,
                batch: 4,
                seq,
                cache,
                fused: false,
                source,
            };
            append_case::<bf16>(&g, c, seed.wrapping_add(i as u64));
            append_case::<f32>(&g, c, seed.wrapping_add(i as u64 + 100));
        }
    }
}

/// Out-of-range positions skip the token (q too), out-of-range slots the writes; both are
/// reported, and nothing else changes.
#[test]
fn append_out_of_range_is_skipped_and_reported() {
    let Some(g) = gpu("append_out_of_range_is_skipped_and_reported") else { return };
    let d = 64;
    let rope = Rope::new(&g.kernels, RopeConfig::new(d, 100)).unwrap();
    let layout = Layout::bshd(4, 16, 1, d);
    let k0 = uniform_vec(5, 0, 4 * 16 * d);
    let mut kc = upload_t(&k0);
    let mut vc = upload_t(&k0);
    let q0 = uniform_vec(5, 1, 4 * d);
    let mut dq = upload_t(&q0);
    let k = upload_t(&uniform_vec(5, 2, 4 * d));
    let pos = upload_t(&[3i32, 100, 5, 6]);
    let slots = upload_t(&[0i64, 1, 64, -1]);
    let l = Layout::bshd(1, 4, 1, d);
    let append = |pos: &DeviceBuffer<i32>,
                  kc: &mut DeviceBuffer<f32>,
                  vc: &mut DeviceBuffer<f32>,
                  dq: &mut DeviceBuffer<f32>| {
        let mut cache = KvCache::paged(kc, vc, layout);
        let mut q = TensorMut::new(dq, l);
        let (k, ids) = (Tensor::new(&k, l), Positions::ids_i32(pos));
        rope.append_kv(rope_cuda::KvAppend::new(&k, &k, &mut cache, ids).q(&mut q).slots(&slots), &g.stream).unwrap();
    };
    append(&pos, &mut kc, &mut vc, &mut dq);
    let err = rope.check_errors(&g.stream);
    assert!(
        matches!(err, Err(Error::PositionOutOfRange { token: 1, position: 100, max_position: 100, count: 1 })),
        "{err:?}"
    );
    // The slot error was recorded too; the first check reported positions and cleared both.
    let kc_h = download_t(&kc);
    assert!(kc_h[d..].iter().zip(&k0[d..]).all(|(a, b)| a.to_bits() == b.to_bits()), "only slot 0 may change");
    assert!(kc_h[..d].iter().zip(&k0[..d]).any(|(a, b)| a != b), "slot 0 was not written");
    let q_h = download_t(&dq);
    assert_eq!(&q_h[d..2 * d], &q0[d..2 * d], "token 1's q was rotated");
    assert_ne!(
        &q_h[2 * d..3 * d],
        &q0[2 * d..3 * d],
        "token 2's q was not rotated (its slot is bad, its position fine)"
    );
    // Now only a bad slot.
    let pos = upload_t(&[3i32, 4, 5, 6]);
    append(&pos, &mut kc, &mut vc, &mut dq);
    let err = rope.check_errors(&g.stream);
    assert!(matches!(err, Err(Error::SlotOutOfRange { token: 2, slot: 64, num_slots: 64, count: 1 })), "{err:?}");
    rope.check_errors(&g.stream).unwrap();
}
