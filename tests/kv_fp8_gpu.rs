//! The fused RoPE + append into FP8 caches on the GPU, against an f64 model: each key rotated
//! exactly and rounded to f32, each value (and key past the rotary dims) taken as it is,
//! divided by its scale (f32 division) and converted as `Fp8::from_f32` does (round to nearest
//! even, saturate, NaN to 0x7F, subnormals kept). Every written byte must equal the model's
//! and every other byte of both caches (and of q's FP8 output, or q itself) stay as it was.
//! Styles × input types × both formats × the four cache layouts × scales per tensor and per
//! head × padding and duplicate slots × q in place or into FP8, from the library's table and
//! computed cos and sin; then MRoPE, the larger widths (claimed calls), the raw door, scales
//! updated between graph replays, and the errors.

#![allow(clippy::needless_range_loop)]

mod common;

use common::{code, download_t, gpu, noise, row_at, test_seed, upload_t, CacheKind, Code, Draw, Gpu, TestElem};
use cust::memory::DeviceBuffer;
use half::{bf16, f16};
use rope_cuda::reference::{rope_row, rope_row_streams, splitmix64, uniform_vec};
use rope_cuda::{
    CosSin, DType, Direction, Error, Fp8, Graph, KvAppend, KvCache, KvScales, Layout, Mrope, PositionKind, Positions,
    RawKvArgs, RawPositions, RawQFp8, RawTensor, Rope, RopeConfig, RopeStyle, Tensor, TensorMut, F8E4M3, F8E5M2,
};

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
    source: CosSin,
    /// One scale per kv head (else one for all).
    per_head: bool,
    /// q rotated into an FP8 buffer with its scale (else in place).
    q_fp8: bool,
    /// Through `append_kv_raw` (else `append_kv`).
    raw: bool,
}

const MAX_POS: usize = 4096;
const BASE: f64 = 10_000.0;

/// Scales that put the inputs (uniform in [-1, 1)) across each format's range: saturated
/// (E4M3 past 448), normal, and subnormal.
const SCALES: [f32; 5] = [3.7, 0.0019, 0.37, 41.0, 1.0];

/// Runs one append into FP8 caches and checks every byte of both caches, and q (in place:
/// within 1 ulp of the correctly rounded rotation, f32 within 2e-6; into FP8: every byte)
/// against the model. Returns how many bytes were checked against a written value.
fn append_case<T: TestElem, F: Code>(g: &Gpu, c: Case, seed: u64) -> usize {
    let Case { style, head_dim: d, rotary_dim: rot, q_heads: hq, kv_heads: hk, batch, seq, cache, source, .. } = c;
    let tokens = batch * seq;
    let (cache_layout, paged) = cache.layout(batch, hk, d);
    let (blocks, block_size) = (cache_layout.shape[0], cache_layout.shape[1]);
    // Positions and slots, with duplicates (and padding, paged).
    let draw = Draw::new(seed, (batch, seq), paged, (blocks, block_size), MAX_POS);
    let (positions, slots, target) = (&draw.positions, &draw.slots, |t| draw.target(t));
    let conv = |v: Vec<f32>| v.into_iter().map(T::from_f32).collect::<Vec<T>>();
    let (q_l, k_l) = (Layout::bshd(batch, seq, hq, d), Layout::bshd(batch, seq, hk, d));
    let q_host = conv(uniform_vec(seed, 10, tokens * hq * d));
    let k_host = conv(uniform_vec(seed, 11, tokens * hk * d));
    let v_host = conv(uniform_vec(seed, 12, tokens * hk * d));
    let cache_len = cache_layout.extent().unwrap();
    let (k0, v0) = (noise(seed ^ 13, cache_len), noise(seed ^ 14, cache_len));
    let q8_0 = noise(seed ^ 15, tokens * hq * d);
    // Scales: per head, a different one for each head and for k and v.
    let n_scales = if c.per_head { hk } else { 1 };
    let k_scales: Vec<f32> = (0..n_scales).map(|h| SCALES[(h + seed as usize) % SCALES.len()]).collect();
    let v_scales: Vec<f32> = (0..n_scales).map(|h| SCALES[(h + 2 + seed as usize) % SCALES.len()]).collect();
    let q_scale = [SCALES[(seed as usize + 1) % SCALES.len()]];

    let config = RopeConfig::new(d, MAX_POS).rotary_dim(rot).style(style).dtype(T::DTYPE).base(BASE).cos_sin(source);
    let rope = Rope::new(&g.kernels, config).unwrap();
    let as_codes = |b: &[u8]| b.iter().map(|&b| F::of(b)).collect::<Vec<F>>();
    let (mut kc, mut vc) = (upload_t(&as_codes(&k0)), upload_t(&as_codes(&v0)));
    let (dks, dvs, dqs) = (upload_t(&k_scales), upload_t(&v_scales), upload_t(&q_scale));
    let dpos = upload_t(positions);
    let dslots = slots.as_ref().map(|s| upload_t(s));
    let mut dq = upload_t(&q_host);
    let (dk, dv) = (upload_t(&k_host), upload_t(&v_host));
    let mut dq8 = upload_t(&as_codes(&q8_0));
    {
        let scales = match c.per_head {
            true => KvScales::per_head(&dks, &dvs),
            false => KvScales::per_tensor(&dks, &dvs),
        };
        let mut cache_view = match paged {
            true => KvCache::paged(&mut kc, &mut vc, cache_layout),
            false => KvCache::contiguous(&mut kc, &mut vc, cache_layout),
        }
        .scales(scales);
        if c.raw {
            let t = |b: &DeviceBuffer<T>, l| RawTensor::new(b.as_device_ptr().as_raw(), b.len(), T::DTYPE, l);
            let q8 = RawTensor::new(dq8.as_device_ptr().as_raw(), dq8.len(), F::DTYPE, q_l);
            let positions = RawPositions::new(PositionKind::IdsI32, dpos.as_device_ptr().as_raw(), tokens);
            let mut args = RawKvArgs::new(t(&dk, k_l), t(&dv, k_l), cache_view.raw(), positions);
            args.q = (hq > 0).then(|| t(&dq, q_l));
            args.q_fp8 = (hq > 0 && c.q_fp8).then(|| RawQFp8::new(q8, (dqs.as_device_ptr().as_raw(), 1)));
            args.slots = dslots.as_ref().map(|s| (s.as_device_ptr().as_raw(), s.len()));
            // SAFETY: every address is a live buffer of this context, alive until the sync.
            unsafe { rope.append_kv_raw(&args, g.stream.as_inner()) }.unwrap();
        } else {
            let (k, v) = (Tensor::new(&dk, k_l), Tensor::new(&dv, k_l));
            fn slotted<'r, 'a>(a: KvAppend<'r, 'a>, s: Option<&'a cust::memory::DeviceSlice<i64>>) -> KvAppend<'r, 'a> {
                match s {
                    Some(slots) => a.slots(slots),
                    None => a,
                }
            }
            let with_slots = |a| slotted(a, dslots.as_deref());
            let args = KvAppend::new(&k, &v, &mut cache_view, Positions::ids_i32(&dpos));
            if hq > 0 && c.q_fp8 {
                let q_in = Tensor::new(&dq, q_l);
                let mut q_out = TensorMut::new(&mut dq8, q_l);
                rope.append_kv(with_slots(args.q_fp8(&q_in, &mut q_out, rope_cuda::Fp8Scale::new(&dqs))), &g.stream)
                    .unwrap();
            } else if hq > 0 {
                let mut q = TensorMut::new(&mut dq, q_l);
                rope.append_kv(with_slots(args.q(&mut q)), &g.stream).unwrap();
            } else {
                rope.append_kv(with_slots(args), &g.stream).unwrap();
            }
        }
    }
    rope.check_errors(&g.stream).unwrap();
    let bytes = |v: Vec<F>| v.into_iter().map(Code::byte).collect::<Vec<u8>>();
    let (kc, vc, q8) = (bytes(download_t(&kc)), bytes(download_t(&vc)), bytes(download_t(&dq8)));
    let q_after: Vec<T> = download_t(&dq);
    let what = format!("{} -> {:?} {c:?}", T::NAME, F::FMT);

    // The model: tokens in order, the last writer of a slot wins.
    let (mut want_k, mut want_v) = (k0.clone(), v0.clone());
    let mut checked = 0;
    let scale = |s: &[f32], h: usize| s[if c.per_head { h } else { 0 }];
    for t in 0..tokens {
        let Some(n) = target(t) else { continue };
        let (blk, within) = (n / block_size, n % block_size);
        for h in 0..hk {
            let src = t * hk * d + h * d;
            let x: Vec<f64> = k_host[src..src + d].iter().map(|v| v.to_f64()).collect();
            let y = rope_row(&x, positions[t] as f64, BASE, rot, style, Direction::Forward);
            let dst = row_at(&cache_layout, blk, within, h);
            for i in 0..d {
                // The rotation rounded to f32 once; the dims past it as they are.
                let xk = if i < rot { y[i] as f32 } else { x[i] as f32 };
                want_k[dst + i] = code(F::FMT, xk, scale(&k_scales, h));
                want_v[dst + i] = code(F::FMT, v_host[src + i].to_f64() as f32, scale(&v_scales, h));
            }
        }
    }
    for i in 0..cache_len {
        checked += 2 * usize::from(want_k[i] != k0[i] || want_v[i] != v0[i]);
        let (kx, vx) = (want_k[i], want_v[i]);
        assert_eq!(kc[i], kx, "{what}: key cache byte {i}: {:#04x}, the model {kx:#04x}", kc[i]);
        assert_eq!(vc[i], vx, "{what}: value cache byte {i}: {:#04x}, the model {vx:#04x}", vc[i]);
    }
    // q: into FP8 (every byte; q itself unchanged), or in place.
    for t in 0..tokens {
        for h in 0..hq {
            let at = t * hq * d + h * d;
            let x: Vec<f64> = q_host[at..at + d].iter().map(|v| v.to_f64()).collect();
            let y = rope_row(&x, positions[t] as f64, BASE, rot, style, Direction::Forward);
            for i in 0..d {
                let (got, orig) = (q_after[at + i], q_host[at + i]);
                if c.q_fp8 {
                    let want = code(F::FMT, if i < rot { y[i] as f32 } else { x[i] as f32 }, q_scale[0]);
                    assert_eq!(q8[at + i], want, "{what}: q FP8 element {}", at + i);
                    assert_eq!(got.bits(), orig.bits(), "{what}: q changed with an FP8 output");
                    checked += 1;
                } else if i < rot {
                    match T::NAME {
                        "f32" => assert!((got.to_f64() - y[i]).abs() <= 2e-6, "{what}: q element {}", at + i),
                        _ => assert!(got.ulps(T::round(y[i])) <= 1, "{what}: q element {}", at + i),
                    }
                } else {
                    assert_eq!(got.bits(), orig.bits(), "{what}: q element {} past the rotary dims", at + i);
                }
            }
        }
    }
    if !c.q_fp8 {
        assert_eq!(q8, q8_0, "{what}: q's FP8 buffer written without an FP8 output");
    }
    checked
}

/// Every combination of the matrix for inputs of type `T`, into caches of both formats.
fn matrix<T: TestElem>(test: &str) {
    let Some(g) = gpu(test) else { return };
    let seed = test_seed(test);
    let caches = [CacheKind::Bshd(64), CacheKind::Bhsd(40), CacheKind::PagedNhd(9, 16), CacheKind::PagedHnd(5, 32)];
    let (mut cases, mut checked) = (0u64, 0);
    for source in [CosSin::Table, CosSin::Computed] {
        for style in [RopeStyle::NeoX, RopeStyle::GptJ] {
            for (i, cache) in caches.into_iter().enumerate() {
                for per_head in [false, true] {
                    for q_fp8 in [false, true] {
                        // Head dims: vector accesses (64, 128 with rotary 96) and element by
                        // element (72 with rotary 36: the pairs do not fill a vector).
                        let (d, rot) = [(64, 64), (128, 96), (72, 36)][(i + cases as usize) % 3];
                        let (hq, hk) = [(8, 2), (4, 4), (0, 1)][cases as usize % 3];
                        let raw = cases % 5 == 2;
                        let c = Case {
                            style,
                            head_dim: d,
                            rotary_dim: rot,
                            q_heads: hq,
                            kv_heads: hk,
                            batch: 3,
                            seq: 5,
                            cache,
                            source,
                            per_head,
                            q_fp8,
                            raw,
                        };
                        cases += 1;
                        let s = seed.wrapping_add(cases);
                        checked += append_case::<T, F8E4M3>(&g, c, s);
                        checked += append_case::<T, F8E5M2>(&g, c, s ^ 0xF8);
                    }
                }
            }
        }
    }
    assert!(checked > 100_000, "{test}: only {checked} written bytes checked");
}

#[test]
fn fp8_append_matrix_f32() {
    matrix::<f32>("fp8_append_matrix_f32");
}

#[test]
fn fp8_append_matrix_f16() {
    matrix::<f16>("fp8_append_matrix_f16");
}

#[test]
fn fp8_append_matrix_bf16() {
    matrix::<bf16>("fp8_append_matrix_bf16");
}

/// The claimed calls' widths (one head a thread past `KV_SCAN_MAX_TOKENS` tokens, several
/// past `KV_PREFILL_MAX_TOKENS`), with duplicates and padding, q into FP8 and in place.
#[test]
fn fp8_append_large_calls() {
    let Some(g) = gpu("fp8_append_large_calls") else { return };
    let seed = test_seed("fp8_append_large_calls");
    for (i, (batch, seq, cache)) in [
        (2, 300, CacheKind::PagedNhd(64, 16)),
        (1, 9000, CacheKind::PagedHnd(300, 32)),
        (2, 160, CacheKind::Bshd(256)),
        (1, 8500, CacheKind::PagedNhd(600, 16)),
    ]
    .into_iter()
    .enumerate()
    {
        for style in [RopeStyle::NeoX, RopeStyle::GptJ] {
            let c = Case {
                style,
                head_dim: 128,
                rotary_dim: 128,
                q_heads: 4,
                kv_heads: 2,
                batch,
                seq,
                cache,
                source: if i == 1 { CosSin::Computed } else { CosSin::Table },
                per_head: i == 0 || i == 1,
                q_fp8: i == 1 || i == 2,
                raw: false,
            };
            append_case::<bf16, F8E4M3>(&g, c, seed.wrapping_add(i as u64));
            append_case::<f16, F8E5M2>(&g, c, seed.wrapping_add(10 + i as u64));
        }
    }
}

/// MRoPE into an FP8 paged cache: each pair turned by its stream's position.
#[test]
fn fp8_append_mrope() {
    let Some(g) = gpu("fp8_append_mrope") else { return };
    let seed = test_seed("fp8_append_mrope");
    let (d, hk, tokens) = (128, 2, 12);
    let config = RopeConfig::new(d, MAX_POS).dtype(DType::BF16).base(BASE).mrope(Some(Mrope::new([16, 24, 24], false)));
    let rope = Rope::new(&g.kernels, config.clone()).unwrap();
    let layout = Layout::bshd(4, 8, hk, d);
    let cache_len = layout.extent().unwrap();
    let k_host: Vec<bf16> = uniform_vec(seed, 1, tokens * hk * d).into_iter().map(bf16::from_f32).collect();
    let v_host: Vec<bf16> = uniform_vec(seed, 2, tokens * hk * d).into_iter().map(bf16::from_f32).collect();
    // Three position streams, [3, tokens].
    let pos: Vec<i64> = (0..3 * tokens as u64).map(|i| (splitmix64(seed ^ i) % MAX_POS as u64) as i64).collect();
    let slots: Vec<i64> = (0..tokens as i64).map(|t| if t == 5 { -1 } else { (t * 7) % 32 }).collect();
    let k0 = noise(seed, cache_len);
    let (mut kc, mut vc) =
        (upload_t(&k0.iter().map(|&b| F8E4M3(b)).collect::<Vec<_>>()), upload_t(&vec![F8E4M3(1); cache_len]));
    let scales = upload_t(&[0.37f32, 3.7]);
    let (dk, dv, dpos, dslots) = (upload_t(&k_host), upload_t(&v_host), upload_t(&pos), upload_t(&slots));
    let l = Layout::bshd(1, tokens, hk, d);
    let (k, v) = (Tensor::new(&dk, l), Tensor::new(&dv, l));
    let mut cache = KvCache::paged(&mut kc, &mut vc, layout).scales(KvScales::per_head(&scales, &scales));
    let positions = Positions::streams_i64(&dpos);
    rope.append_kv(KvAppend::new(&k, &v, &mut cache, positions).slots(&dslots), &g.stream).unwrap();
    rope.check_errors(&g.stream).unwrap();
    let kc: Vec<u8> = download_t(&kc).into_iter().map(|c: F8E4M3| c.0).collect();
    let mut want = k0.clone();
    for t in 0..tokens {
        if slots[t] < 0 {
            continue;
        }
        let n = slots[t] as usize;
        for h in 0..hk {
            let x: Vec<f64> = k_host[(t * hk + h) * d..][..d].iter().map(|v| v.to_f64()).collect();
            let p = [pos[t], pos[tokens + t], pos[2 * tokens + t]].map(|p| p as f64);
            let (freqs, attention) = config.frequencies().unwrap();
            let y = rope_row_streams(&x, p, &freqs, attention, config.style, config.mrope, Direction::Forward);
            let dst = row_at(&layout, n / 8, n % 8, h);
            for i in 0..d {
                want[dst + i] = code(Fp8::E4M3, y[i] as f32, [0.37f32, 3.7][h]);
            }
        }
    }
    for i in 0..cache_len {
        assert_eq!(kc[i], want[i], "MRoPE key cache byte {i}");
    }
}

/// Scales are read when the launch runs: a graph recorded once and replayed after the
/// engine changes them in place writes with the new values.
#[test]
fn fp8_scales_are_read_at_launch_and_by_graph_replays() {
    let Some(g) = gpu("fp8_scales_are_read_at_launch_and_by_graph_replays") else { return };
    let (d, hk, tokens) = (128, 2, 4);
    let rope = Rope::new(&g.kernels, RopeConfig::new(d, MAX_POS).dtype(DType::BF16)).unwrap();
    let k_host: Vec<bf16> = uniform_vec(7, 1, tokens * hk * d).into_iter().map(bf16::from_f32).collect();
    let (dk, dv) = (upload_t(&k_host), upload_t(&k_host));
    let dpos = upload_t(&[3i32, 9, 40, 41]);
    let dslots = upload_t(&[0i64, 1, 2, 3]);
    let layout = Layout::bshd(1, 16, hk, d);
    let n = layout.extent().unwrap();
    let (mut kc, mut vc) = (upload_t(&vec![F8E4M3(0); n]), upload_t(&vec![F8E4M3(0); n]));
    let mut scales = upload_t(&[1.0f32]);
    let l = Layout::bshd(1, tokens, hk, d);
    let (k, v) = (Tensor::new(&dk, l), Tensor::new(&dv, l));
    let graph = Graph::record(|| {
        let mut cache = KvCache::paged(&mut kc, &mut vc, layout).scales(KvScales::per_tensor(&scales, &scales));
        rope.append_kv(KvAppend::new(&k, &v, &mut cache, Positions::ids_i32(&dpos)).slots(&dslots), &g.stream)
    })
    .unwrap();
    for s in [1.0f32, 0.01, 7.5] {
        use cust::memory::CopyDestination;
        scales.copy_from(&[s][..]).unwrap();
        // SAFETY: every buffer the graph names lives until the synchronisation below.
        unsafe { graph.launch(&g.stream) }.unwrap();
        g.stream.synchronize().unwrap();
        let vc: Vec<F8E4M3> = download_t(&vc);
        for i in 0..tokens * hk * d {
            assert_eq!(vc[i].0, code(Fp8::E4M3, k_host[i].to_f32(), s), "scale {s}: value byte {i}");
        }
    }
}

/// Each misuse is refused before any launch, and nothing is written.
#[test]
fn fp8_misuse_is_refused_before_launch() {
    let Some(g) = gpu("fp8_misuse_is_refused_before_launch") else { return };
    let rope = Rope::new(&g.kernels, RopeConfig::new(64, MAX_POS).dtype(DType::BF16)).unwrap();
    let l = Layout::bshd(1, 2, 2, 64);
    let k = upload_t(&vec![bf16::from_f32(0.5); 256]);
    let dpos = upload_t(&[1i32, 2]);
    let layout = Layout::bshd(1, 8, 2, 64);
    let n = layout.extent().unwrap();
    let (mut kc, mut vc) = (upload_t(&vec![F8E4M3(0x11); n]), upload_t(&vec![F8E5M2(0x22); n]));
    let mut kc5 = upload_t(&vec![F8E5M2(0x33); n]);
    let (one, two) = (upload_t(&[1.0f32]), upload_t(&[1.0f32, 2.0]));
    let kt = Tensor::new(&k, l);
    let pos = || Positions::ids_i32(&dpos);
    let mut q8 = upload_t(&vec![F8E4M3(0x44); 256]);
    {
        // Mixed formats.
        let mut cache = KvCache::contiguous(&mut kc, &mut vc, layout).scales(KvScales::per_tensor(&one, &one));
        let e = rope.append_kv(KvAppend::new(&kt, &kt, &mut cache, pos()), &g.stream);
        assert!(matches!(e, Err(Error::DType { what: "v cache", .. })), "{e:?}");
    }
    {
        // No scales; then scales of the wrong length.
        let mut cache = KvCache::contiguous(&mut kc, &mut kc5, layout);
        let e = rope.append_kv(KvAppend::new(&kt, &kt, &mut cache, pos()), &g.stream);
        assert!(matches!(e, Err(Error::DType { .. }) | Err(Error::Scales(_))), "{e:?}");
    }
    {
        let mut cache = KvCache::contiguous(&mut kc5, &mut vc, layout).scales(KvScales::per_head(&one, &two));
        let e = rope.append_kv(KvAppend::new(&kt, &kt, &mut cache, pos()), &g.stream);
        assert!(matches!(e, Err(Error::Length { what: "k scales", .. })), "{e:?}");
    }
    {
        // q's FP8 output of the other format.
        let mut cache = KvCache::contiguous(&mut kc5, &mut vc, layout).scales(KvScales::per_tensor(&one, &one));
        let q = Tensor::new(&k, l);
        let mut out = TensorMut::new(&mut q8, l);
        let e = rope.append_kv(
            KvAppend::new(&kt, &kt, &mut cache, pos()).q_fp8(&q, &mut out, rope_cuda::Fp8Scale::new(&one)),
            &g.stream,
        );
        assert!(matches!(e, Err(Error::DType { what: "q out", .. })), "{e:?}");
    }
    g.stream.synchronize().unwrap();
    assert!(download_t(&kc).iter().all(|c: &F8E4M3| c.0 == 0x11), "a refused call wrote the key cache");
    assert!(download_t(&vc).iter().all(|c: &F8E5M2| c.0 == 0x22), "a refused call wrote the value cache");
    assert!(download_t(&kc5).iter().all(|c: &F8E5M2| c.0 == 0x33), "a refused call wrote a cache");
    assert!(download_t(&q8).iter().all(|c: &F8E4M3| c.0 == 0x44), "a refused call wrote q's output");
}

/// The dequantizing read: rows of an FP8 cache at a list of slots (`-1`: left as it is; one
/// outside the cache: skipped and reported), into each output type, every element the code's
/// value times its head's scale rounded to the output's type.
fn read_case<T: TestElem, F: Code>(g: &Gpu, seed: u64, per_head: bool, paged: bool) {
    let (hk, d) = (4, 64);
    let layout = if paged { Layout::bhsd(6, hk, 16, d) } else { Layout::bshd(3, 32, hk, d) };
    let n = layout.extent().unwrap();
    let (k0, v0) = (noise(seed, n), noise(seed ^ 1, n));
    let (mut kc, mut vc) = (
        upload_t(&k0.iter().map(|&b| F::of(b)).collect::<Vec<_>>()),
        upload_t(&v0.iter().map(|&b| F::of(b)).collect::<Vec<_>>()),
    );
    let ks: Vec<f32> = (0..if per_head { hk } else { 1 }).map(|h| SCALES[h % 5]).collect();
    let vs: Vec<f32> = ks.iter().map(|s| s * 0.5).collect();
    let (dks, dvs) = (upload_t(&ks), upload_t(&vs));
    let slots_n = (layout.shape[0] * layout.shape[1]) as u64;
    let (b, s) = (2, 9);
    let slots: Vec<i64> = (0..(b * s) as u64)
        .map(|i| match i {
            4 => -1,
            _ => (splitmix64(seed ^ i) % slots_n) as i64,
        })
        .collect();
    let dslots = upload_t(&slots);
    let out_l = Layout::bshd(b, s, hk, d);
    let poison = T::from_bits(T::POISON_BITS);
    let (mut ko, mut vo) = (upload_t(&vec![poison; b * s * hk * d]), upload_t(&vec![poison; b * s * hk * d]));
    let rope = Rope::new(&g.kernels, RopeConfig::new(d, MAX_POS)).unwrap();
    let scales = if per_head { KvScales::per_head(&dks, &dvs) } else { KvScales::per_tensor(&dks, &dvs) };
    {
        let (mut kt, mut vt) = (TensorMut::new(&mut ko, out_l), TensorMut::new(&mut vo, out_l));
        // A paged cache read through shared borrows (`KvRead::shared`), the contiguous one
        // through the `KvCache` an append writes.
        let read = match paged {
            true => rope_cuda::KvRead::shared(&kc, &vc, layout, scales, &dslots),
            false => rope_cuda::KvRead::new(&KvCache::contiguous(&mut kc, &mut vc, layout).scales(scales), &dslots),
        };
        rope.read_kv(read.k(&mut kt).v(&mut vt), &g.stream).unwrap();
    }
    rope.check_errors(&g.stream).unwrap();
    let (ko, vo): (Vec<T>, Vec<T>) = (download_t(&ko), download_t(&vo));
    let (bs, what) = (layout.shape[1], format!("{} from {:?}, per head {per_head}, paged {paged}", T::NAME, F::FMT));
    for (r, &slot) in slots.iter().enumerate() {
        for h in 0..hk {
            for e in 0..d {
                let i = (r * hk + h) * d + e;
                if slot < 0 {
                    assert_eq!((ko[i].bits(), vo[i].bits()), (poison.bits(), poison.bits()), "{what}: row {r} written");
                    continue;
                }
                let at = row_at(&layout, slot as usize / bs, slot as usize % bs, h) + e;
                let sc = |s: &[f32]| s[if per_head { h } else { 0 }];
                for (got, code, scale) in [(ko[i], k0[at], sc(&ks)), (vo[i], v0[at], sc(&vs))] {
                    let want = F::FMT.to_f32(code) * scale;
                    if want.is_nan() {
                        assert!(got.to_f64().is_nan(), "{what}: row {r} element {i}: {got:?} for NaN");
                    } else {
                        assert_eq!(
                            got.bits(),
                            T::from_f32(want).bits(),
                            "{what}: row {r} element {i}: code {code:#04x}"
                        );
                    }
                }
            }
        }
    }
    // The caches were only read.
    let same =
        |dev: &DeviceBuffer<F>, host: &[u8]| download_t(dev).iter().zip(host).all(|(c, &b): (&F, _)| c.byte() == b);
    assert!(same(&kc, &k0) && same(&vc, &v0), "{what}: a cache changed");
}

#[test]
fn fp8_read_back_dequantizes_each_row() {
    let Some(g) = gpu("fp8_read_back_dequantizes_each_row") else { return };
    let seed = test_seed("fp8_read_back_dequantizes_each_row");
    for (i, (per_head, paged)) in [(false, true), (true, true), (true, false)].into_iter().enumerate() {
        let s = seed.wrapping_add(i as u64);
        read_case::<f32, F8E4M3>(&g, s, per_head, paged);
        read_case::<f16, F8E5M2>(&g, s, per_head, paged);
        read_case::<bf16, F8E4M3>(&g, s, per_head, paged);
        read_case::<bf16, F8E5M2>(&g, s, per_head, paged);
    }
    // A slot outside the cache: skipped and reported.
    let layout = Layout::bshd(2, 8, 1, 64);
    let (mut kc, mut vc) = (upload_t(&vec![F8E4M3(0x38); 1024]), upload_t(&vec![F8E4M3(0x38); 1024]));
    let one = upload_t(&[1.0f32]);
    let cache = KvCache::paged(&mut kc, &mut vc, layout).scales(KvScales::per_tensor(&one, &one));
    let slots = upload_t(&[1i64, 16]);
    let mut out = upload_t(&vec![7.0f32; 128]);
    let rope = Rope::new(&g.kernels, RopeConfig::new(64, MAX_POS)).unwrap();
    {
        let mut t = TensorMut::new(&mut out, Layout::bshd(1, 2, 1, 64));
        rope.read_kv(rope_cuda::KvRead::new(&cache, &slots).k(&mut t), &g.stream).unwrap();
    }
    let e = rope.check_errors(&g.stream);
    assert!(matches!(e, Err(Error::SlotOutOfRange { token: 1, slot: 16, .. })), "{e:?}");
    let got: Vec<f32> = download_t(&out);
    assert!(got[..64].iter().all(|&x| x == 1.0) && got[64..].iter().all(|&x| x == 7.0));
    // Refused before any launch: a cache that is not FP8, too few rows for the slots.
    let mut t = TensorMut::new(&mut out, Layout::bshd(1, 2, 1, 64));
    let (mut bf, mut bf2) = (upload_t(&vec![bf16::ZERO; 1024]), upload_t(&vec![bf16::ZERO; 1024]));
    let plain = KvCache::paged(&mut bf, &mut bf2, layout);
    let e = rope.read_kv(rope_cuda::KvRead::new(&plain, &slots).k(&mut t), &g.stream);
    assert!(matches!(e, Err(Error::DType { what: "k cache", .. })), "{e:?}");
    let mut three = upload_t(&vec![0.0f32; 3 * 64]);
    let mut short = TensorMut::new(&mut three, Layout::bshd(1, 3, 1, 64));
    let e = rope.read_kv(rope_cuda::KvRead::new(&cache, &slots).k(&mut short), &g.stream);
    assert!(matches!(e, Err(Error::Length { what: "slots", .. })), "{e:?}");
    g.stream.synchronize().unwrap();
    assert!(download_t(&three).iter().all(|&x: &f32| x == 0.0), "a refused read wrote");
}
