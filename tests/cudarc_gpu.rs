//! The cudarc API (feature `cudarc`): RoPE on a fused QKV buffer, out of place, the paged
//! append and the reference update on cudarc buffers and streams, against the f64
//! reference; the same typed errors as the cust API, with nothing written.
#![cfg(feature = "cudarc")]
#![allow(clippy::needless_range_loop)]

mod common;

use std::sync::Arc;

use common::{assert_rotated, or_skip, random_bf16, test_seed, PagedStep, TestElem};
use cudarc::driver::{CudaContext, CudaStream};
use rope_cuda::cudarc::load;
use rope_cuda::reference::{relative_error, rope_row_freqs, splitmix64, uniform};
use rope_cuda::seed::{KvShape, KvUpdate};
use rope_cuda::{
    DType, Direction, Error, Kernels, KvAppend, KvCache, Layout, Positions, Rope, RopeArgs, RopeConfig, RopeStyle,
    Tensor, TensorMut,
};

/// cudarc's context and stream of device 0 with the kernels loaded, or `None` after
/// printing that `test` skipped (a failure with `ROPE_CUDA_REQUIRE_GPU`).
fn cudarc_gpu(test: &str) -> Option<(Arc<CudaStream>, Arc<Kernels>)> {
    let ctx = or_skip(test, CudaContext::new(0))?;
    let kernels = load(&ctx).expect("loading the kernels into cudarc's context");
    Some((ctx.default_stream(), kernels))
}

/// cudarc's bf16 (half 2) from the reference's bf16 (half 1.8), bit for bit.
fn to2(x: &[half::bf16]) -> Vec<half2::bf16> {
    x.iter().map(|v| half2::bf16::from_bits(v.to_bits())).collect()
}

fn from2(x: &[half2::bf16]) -> Vec<half::bf16> {
    x.iter().map(|v| half::bf16::from_bits(v.to_bits())).collect()
}

#[test]
fn rope_in_place_on_a_fused_qkv_buffer() {
    let Some((stream, kernels)) = cudarc_gpu("rope_in_place_on_a_fused_qkv_buffer") else { return };
    let seed = test_seed("rope_in_place_on_a_fused_qkv_buffer");
    let (tokens, hq, hk, d) = (37, 8, 2, 128);
    let row = (hq + 2 * hk) * d;
    let config = RopeConfig::new(d, 4096).base(500_000.0).dtype(DType::BF16);
    let rope = Rope::new(&kernels, config.clone()).unwrap();
    let x = random_bf16(seed, 0, tokens * row);
    let ids: Vec<i32> = (0..tokens as u64).map(|t| (splitmix64(seed ^ t) % 4096) as i32).collect();
    let mut qkv = stream.clone_htod(&to2(&x)).unwrap();
    let dids = stream.clone_htod(&ids).unwrap();
    {
        let q = Layout::strided([1, tokens, hq, d], [tokens * row, row, d], 0);
        let k = Layout::strided([1, tokens, hk, d], [tokens * row, row, d], hq * d);
        let (mut q, mut k) = TensorMut::pair((&mut qkv, &stream), q, k);
        let positions = Positions::ids_i32((&dids, &stream));
        rope.apply(RopeArgs::in_place(&mut q, positions).k(&mut k), &stream).unwrap();
    }
    rope.check_errors(&stream).unwrap();
    let got = from2(&stream.clone_dtoh(&qkv).unwrap());
    for t in 0..tokens {
        let r = t * row;
        let qk = r..r + (hq + hk) * d;
        assert_rotated(&format!("token {t}"), &got[qk.clone()], &x[qk], ids[t] as i64, &config);
        assert_eq!(&got[r + (hq + hk) * d..r + row], &x[r + (hq + hk) * d..r + row], "token {t}: v changed");
    }
}

#[test]
fn rope_out_of_place_and_typed_errors() {
    let Some((stream, kernels)) = cudarc_gpu("rope_out_of_place_and_typed_errors") else { return };
    let seed = test_seed("rope_out_of_place_and_typed_errors");
    let (b, s, h, d) = (2, 5, 3, 64);
    let n = b * s * h * d;
    let config = RopeConfig::new(d, 64).rotary_dim(32).style(RopeStyle::GptJ);
    let rope = Rope::new(&kernels, config.clone()).unwrap();
    let x: Vec<f32> = (0..n as u64).map(|i| uniform(seed, 1, i)).collect();
    let poison = vec![f32::from_bits(<f32 as TestElem>::POISON_BITS); n];
    let dx = stream.clone_htod(&x).unwrap();
    let mut out = stream.clone_htod(&poison).unwrap();
    let l = Layout::bshd(b, s, h, d);
    {
        let (q, mut q_out) = (Tensor::new((&dx, &stream), l), TensorMut::new((&mut out, &stream), l));
        rope.apply(RopeArgs::into(&q, &mut q_out, Positions::sequential()), &stream).unwrap();
    }
    let got = stream.clone_dtoh(&out).unwrap();
    // f32: the contract is a relative error, over the whole output.
    let (freqs, attention) = config.frequencies().unwrap();
    let want: Vec<f64> = x
        .chunks(d)
        .enumerate()
        .flat_map(|(row, xs)| {
            let xs: Vec<f64> = xs.iter().map(|&v| v as f64).collect();
            let pos = (row / h % s) as f64;
            rope_row_freqs(&xs, pos, &freqs, attention, config.style, Direction::Forward)
        })
        .collect();
    let err = relative_error(&got, &want);
    assert!(err < 2e-6, "relative error {err}");
    // Bad inputs: typed errors, and the output stays as it was.
    let mut fresh = stream.clone_htod(&poison).unwrap();
    let half_buf = stream.alloc_zeros::<half2::bf16>(n).unwrap();
    let cases = [
        (&dx, None, Layout::bshd(b, s, h, d + 2), "head_dim"),
        (&dx, None, Layout::bshd(b, 65, h, d), "past the buffer"),
        (&dx, Some(&half_buf), l, "dtype"),
    ];
    for (input, other, layout, what) in cases {
        let mut q_out = TensorMut::new((&mut fresh, &stream), layout);
        let e = match other {
            // A bf16 buffer given to an f32 Rope.
            Some(bf) => {
                let q = Tensor::new((bf, &stream), layout);
                rope.apply(RopeArgs::into(&q, &mut q_out, Positions::sequential()), &stream)
            }
            None => {
                let q = Tensor::new((input, &stream), layout);
                rope.apply(RopeArgs::into(&q, &mut q_out, Positions::sequential()), &stream)
            }
        };
        let ok = match what {
            "head_dim" => matches!(e, Err(Error::Shape { what: "q", axis: "head_dim", .. })),
            "past the buffer" => matches!(e, Err(Error::OutOfBounds { .. }) | Err(Error::MaxPosition { .. })),
            _ => matches!(e, Err(Error::DType { .. })),
        };
        assert!(ok, "{what}: {e:?}");
    }
    let untouched = stream.clone_dtoh(&fresh).unwrap();
    assert!(untouched.iter().all(|v| v.to_bits() == <f32 as TestElem>::POISON_BITS), "a refused call wrote");
}

#[test]
fn paged_append_on_cudarc_buffers() {
    let Some((stream, kernels)) = cudarc_gpu("paged_append_on_cudarc_buffers") else { return };
    let seed = test_seed("paged_append_on_cudarc_buffers");
    let (tokens, hq, hk, d, blocks, bs) = (9, 4, 2, 128, 6, 16);
    let config = RopeConfig::new(d, 1024).dtype(DType::BF16);
    let rope = Rope::new(&kernels, config.clone()).unwrap();
    let PagedStep { q, k, v, kc0, vc0, ids, slots } = PagedStep::draw(seed, (tokens, hq, hk, d), (blocks, bs), 1024);
    let (mut dq, dk, dv) = (
        stream.clone_htod(&to2(&q)).unwrap(),
        stream.clone_htod(&to2(&k)).unwrap(),
        stream.clone_htod(&to2(&v)).unwrap(),
    );
    let (mut dkc, mut dvc) = (stream.clone_htod(&to2(&kc0)).unwrap(), stream.clone_htod(&to2(&vc0)).unwrap());
    let (dids, dslots) = (stream.clone_htod(&ids).unwrap(), stream.clone_htod(&slots).unwrap());
    let cache_layout = Layout::bshd(blocks, bs, hk, d);
    // A slot mapping of the wrong length: refused, nothing written.
    {
        let short = stream.clone_htod(&slots[..tokens - 1]).unwrap();
        let (kv, vv) = (
            Tensor::new((&dk, &stream), Layout::packed(tokens, hk, d)),
            Tensor::new((&dv, &stream), Layout::packed(tokens, hk, d)),
        );
        let mut cache = KvCache::paged((&mut dkc, &stream), (&mut dvc, &stream), cache_layout);
        let positions = Positions::ids_i32((&dids, &stream));
        let args = KvAppend::new(&kv, &vv, &mut cache, positions).slots((&short, &stream));
        let e = rope.append_kv(args, &stream);
        assert!(matches!(e, Err(Error::Length { what: "slots", .. })), "{e:?}");
    }
    assert_eq!(from2(&stream.clone_dtoh(&dkc).unwrap()), kc0, "a refused append wrote the key cache");
    {
        let mut qv = TensorMut::new((&mut dq, &stream), Layout::packed(tokens, hq, d));
        let (kv, vv) = (
            Tensor::new((&dk, &stream), Layout::packed(tokens, hk, d)),
            Tensor::new((&dv, &stream), Layout::packed(tokens, hk, d)),
        );
        let mut cache = KvCache::paged((&mut dkc, &stream), (&mut dvc, &stream), cache_layout);
        let positions = Positions::ids_i32((&dids, &stream));
        let args = KvAppend::new(&kv, &vv, &mut cache, positions).q(&mut qv).slots((&dslots, &stream));
        rope.append_kv(args, &stream).unwrap();
    }
    let (gq, gkc, gvc) = (
        from2(&stream.clone_dtoh(&dq).unwrap()),
        from2(&stream.clone_dtoh(&dkc).unwrap()),
        from2(&stream.clone_dtoh(&dvc).unwrap()),
    );
    let mut written = vec![false; blocks * bs];
    for t in 0..tokens {
        let qr = t * hq * d..(t + 1) * hq * d;
        assert_rotated(&format!("q of token {t}"), &gq[qr.clone()], &q[qr], ids[t] as i64, &config);
        if slots[t] < 0 {
            continue;
        }
        let n = slots[t] as usize;
        written[n] = true;
        let (cr, kr) = (n * hk * d..(n + 1) * hk * d, t * hk * d..(t + 1) * hk * d);
        assert_rotated(&format!("k of token {t}"), &gkc[cr.clone()], &k[kr.clone()], ids[t] as i64, &config);
        assert_eq!(&gvc[cr], &v[kr], "v of token {t}");
    }
    for (n, w) in written.iter().enumerate() {
        let r = n * hk * d..(n + 1) * hk * d;
        if !w {
            assert_eq!((&gkc[r.clone()], &gvc[r.clone()]), (&kc0[r.clone()], &vc0[r]), "slot {n} changed");
        }
    }
}

/// The MLA append on cudarc buffers: q_pe inside q's heads, kv_c and k_pe as views of one
/// projection, a paged latent cache; a refused call writes nothing.
#[test]
fn mla_append_on_cudarc_buffers() {
    let Some((stream, kernels)) = cudarc_gpu("mla_append_on_cudarc_buffers") else { return };
    let seed = test_seed("mla_append_on_cudarc_buffers");
    let (tokens, heads, nope, pe, rank, blocks, bs) = (9, 4, 32, 64, 128, 6, 16);
    let (qd, w) = (nope + pe, rank + pe);
    let config = RopeConfig::new(pe, 1024).dtype(DType::BF16).style(RopeStyle::GptJ);
    let rope = Rope::new(&kernels, config.clone()).unwrap();
    let (q, kv_a, c0) = (
        random_bf16(seed, 1, tokens * heads * qd),
        random_bf16(seed, 2, tokens * w),
        random_bf16(seed, 3, blocks * bs * w),
    );
    let ids: Vec<i32> = (0..tokens as u64).map(|t| (splitmix64(seed ^ t) % 1024) as i32).collect();
    let slots = common::distinct_slots(seed, blocks * bs, tokens, &[4]);
    let (mut dq, dkv, mut dc) = (
        stream.clone_htod(&to2(&q)).unwrap(),
        stream.clone_htod(&to2(&kv_a)).unwrap(),
        stream.clone_htod(&to2(&c0)).unwrap(),
    );
    let (dids, dslots) = (stream.clone_htod(&ids).unwrap(), stream.clone_htod(&slots).unwrap());
    let q_pe = Layout::strided([1, tokens, heads, pe], [tokens * heads * qd, heads * qd, qd], nope);
    let (cl, kl) = (
        Layout::strided([1, tokens, 1, rank], [tokens * w, w, w], 0),
        Layout::strided([1, tokens, 1, pe], [tokens * w, w, w], rank),
    );
    for bad in [true, false] {
        let mut qv = TensorMut::new((&mut dq, &stream), q_pe);
        let (kv_c, k_pe) = (Tensor::new((&dkv, &stream), cl), Tensor::new((&dkv, &stream), kl));
        // A bad call names the wrong kv_lora_rank.
        let mut cache = rope_cuda::MlaCache::paged(
            (&mut dc, &stream),
            Layout::bshd(blocks, bs, 1, w),
            &rope_cuda::MlaGeometry::new(rank - 8 * bad as usize, 64, 128, 128, 128),
        );
        let args = rope_cuda::MlaAppend::new(&kv_c, &k_pe, &mut cache, Positions::ids_i32((&dids, &stream)))
            .slots((&dslots, &stream))
            .q_pe(&mut qv);
        let e = rope.append_mla(args, &stream);
        match bad {
            true => assert!(matches!(e, Err(Error::Shape { what: "kv_c", .. })), "{e:?}"),
            false => e.unwrap(),
        }
        if bad {
            assert_eq!(from2(&stream.clone_dtoh(&dc).unwrap()), c0, "a refused append wrote the cache");
        }
    }
    let (gq, gc) = (from2(&stream.clone_dtoh(&dq).unwrap()), from2(&stream.clone_dtoh(&dc).unwrap()));
    for t in 0..tokens {
        for h in 0..heads {
            let at = (t * heads + h) * qd;
            assert_eq!(&gq[at..at + nope], &q[at..at + nope], "q's nope dims of token {t}");
            let r = at + nope..at + qd;
            assert_rotated(&format!("q_pe of token {t} head {h}"), &gq[r.clone()], &q[r], ids[t] as i64, &config);
        }
        if slots[t] < 0 {
            continue;
        }
        let n = slots[t] as usize * w;
        assert_eq!(&gc[n..n + rank], &kv_a[t * w..t * w + rank], "kv_c of token {t}");
        let k = t * w + rank..(t + 1) * w;
        assert_rotated(&format!("k_pe of token {t}"), &gc[n + rank..n + w], &kv_a[k], ids[t] as i64, &config);
    }
    for n in (0..blocks * bs).filter(|n| !slots.contains(&(*n as i64))) {
        assert_eq!(&gc[n * w..(n + 1) * w], &c0[n * w..(n + 1) * w], "row {n} changed");
    }
}

#[test]
fn reference_update_on_cudarc_buffers() {
    let Some((stream, kernels)) = cudarc_gpu("reference_update_on_cudarc_buffers") else { return };
    let seed = test_seed("reference_update_on_cudarc_buffers");
    let shape = KvShape { batch: 2, new_tokens: 3, heads: 2, head_dim: 16, cache_len: 32 };
    let KvShape { batch: b, new_tokens: t, heads: h, head_dim: d, cache_len: s } = shape;
    let f = |tensor: u64, n: usize| -> Vec<f32> { (0..n as u64).map(|i| uniform(seed, tensor, i)).collect() };
    let (k_new, v_new) = (f(0, b * t * h * d), f(1, b * t * h * d));
    let (cache_k, cache_v) = (f(2, b * s * h * d), f(3, b * s * h * d));
    let angles: Vec<f64> =
        (0..s).flat_map(|p| (0..d / 2).map(move |i| p as f64 / 10_000f64.powf(2.0 * i as f64 / d as f64))).collect();
    let (cos, sin): (Vec<f32>, Vec<f32>) = angles.iter().map(|a| (a.cos() as f32, a.sin() as f32)).unzip();
    let positions: Vec<i32> = (0..(b * t) as u64).map(|i| (splitmix64(seed ^ i) % s as u64) as i32).collect();
    let up = |x: &[f32]| stream.clone_htod(x).unwrap();
    let (dk, dv, dc, ds, dck, dcv) = (up(&k_new), up(&v_new), up(&cos), up(&sin), up(&cache_k), up(&cache_v));
    let dp = stream.clone_htod(&positions).unwrap();
    let mut out = up(&vec![f32::from_bits(<f32 as TestElem>::POISON_BITS); 2 * b * s * h * d]);
    let update = KvUpdate::new(&kernels).unwrap();
    let on = |buf| (buf, &stream);
    update
        .update_kv_cache(
            shape,
            on(&dk),
            on(&dv),
            on(&dc),
            on(&ds),
            on(&dck),
            on(&dcv),
            (&dp, &stream),
            (&mut out, &stream),
            &stream,
        )
        .unwrap();
    update.check_errors(&stream).unwrap();
    let got = stream.clone_dtoh(&out).unwrap();
    // The last token of a (sequence, position) wins; other rows are the old caches.
    let mut want_k = cache_k.iter().map(|&x| x as f64).collect::<Vec<_>>();
    let mut want_v = cache_v.iter().map(|&x| x as f64).collect::<Vec<_>>();
    for (i, &p) in positions.iter().enumerate() {
        let (seq, p) = (i / t, p as usize);
        for hh in 0..h {
            let src = (i * h + hh) * d;
            let dst = ((seq * s + p) * h + hh) * d;
            for j in 0..d / 2 {
                let (c, sn) = (cos[p * d / 2 + j] as f64, sin[p * d / 2 + j] as f64);
                let (x0, x1) = (k_new[src + 2 * j] as f64, k_new[src + 2 * j + 1] as f64);
                want_k[dst + 2 * j] = x0 * c - x1 * sn;
                want_k[dst + 2 * j + 1] = x1 * c + x0 * sn;
            }
            for j in 0..d {
                want_v[dst + j] = v_new[src + j] as f64;
            }
        }
    }
    let half = b * s * h * d;
    let err = relative_error(&got[..half], &want_k);
    assert!(err < 2e-6, "keys: relative error {err}");
    assert_eq!(got[half..].iter().map(|&x| x as f64).collect::<Vec<_>>(), want_v, "values");
    // A positions buffer of the wrong length: refused, `out` untouched.
    let short = stream.clone_htod(&positions[1..]).unwrap();
    let mut fresh = up(&vec![0.5f32; 2 * half]);
    let e = update.update_kv_cache(
        shape,
        on(&dk),
        on(&dv),
        on(&dc),
        on(&ds),
        on(&dck),
        on(&dcv),
        (&short, &stream),
        (&mut fresh, &stream),
        &stream,
    );
    assert!(matches!(e, Err(Error::Length { what: "positions", .. })), "{e:?}");
    assert!(stream.clone_dtoh(&fresh).unwrap().iter().all(|&x| x == 0.5));
}

#[test]
fn a_buffer_lent_for_another_stream_is_refused() {
    let Some((stream, kernels)) = cudarc_gpu("a_buffer_lent_for_another_stream_is_refused") else { return };
    let rope = Rope::new(&kernels, RopeConfig::new(64, 64)).unwrap();
    let other = stream.context().new_stream().unwrap();
    let x = vec![0.5f32; 4 * 64];
    let mut q = stream.clone_htod(&x).unwrap();
    let l = Layout::bshd(1, 4, 1, 64);
    // Lent for work on `other`, given to a call on `stream`: refused, nothing queued.
    let e = rope.apply(RopeArgs::in_place(&mut TensorMut::new((&mut q, &other), l), Positions::sequential()), &stream);
    assert!(matches!(e, Err(Error::Stream { what: "q" })), "{e:?}");
    // The same call on `other` is accepted.
    rope.apply(RopeArgs::in_place(&mut TensorMut::new((&mut q, &other), l), Positions::sequential()), &other).unwrap();
    rope.check_errors(&other).unwrap();
    assert_ne!(stream.clone_dtoh(&q).unwrap(), x);
}

/// An E4M3 cache on cudarc buffers: the append quantizes with the scales (per kv head), q
/// goes to an FP8 buffer, and the dequantizing read brings the values back in f32.
#[test]
fn fp8_cache_on_cudarc_buffers() {
    use rope_cuda::{KvRead, KvScales, F8E4M3};
    let Some((stream, kernels)) = cudarc_gpu("fp8_cache_on_cudarc_buffers") else { return };
    let seed = test_seed("fp8_cache_on_cudarc_buffers");
    let (tokens, hq, hk, d, blocks, bs) = (5, 4, 2, 64, 4, 8);
    let rope = Rope::new(&kernels, RopeConfig::new(d, 1024).dtype(DType::BF16)).unwrap();
    let (q, k, v) = (
        random_bf16(seed, 2, tokens * hq * d),
        random_bf16(seed, 3, tokens * hk * d),
        random_bf16(seed, 4, tokens * hk * d),
    );
    let (dq, dk, dv) = (
        stream.clone_htod(&to2(&q)).unwrap(),
        stream.clone_htod(&to2(&k)).unwrap(),
        stream.clone_htod(&to2(&v)).unwrap(),
    );
    let cache_n = blocks * bs * hk * d;
    let (mut dkc, mut dvc) = (
        stream.clone_htod(&vec![F8E4M3(0x11); cache_n]).unwrap(),
        stream.clone_htod(&vec![F8E4M3(0x11); cache_n]).unwrap(),
    );
    let mut dq8 = stream.clone_htod(&vec![F8E4M3(0); tokens * hq * d]).unwrap();
    let (ks, vs, qs) = ([0.37f32, 3.7], [0.01f32, 2.0], [0.5f32]);
    let (dks, dvs, dqs) =
        (stream.clone_htod(&ks).unwrap(), stream.clone_htod(&vs).unwrap(), stream.clone_htod(&qs).unwrap());
    let ids: Vec<i32> = (0..tokens as i32).map(|t| 100 + 3 * t).collect();
    let slots: Vec<i64> = vec![3, 9, 20, 31, 0];
    let (dids, dslots) = (stream.clone_htod(&ids).unwrap(), stream.clone_htod(&slots).unwrap());
    let layout = Layout::bshd(blocks, bs, hk, d);
    let mut out = stream.clone_htod(&vec![0.0f32; tokens * hk * d]).unwrap();
    {
        let l = |h| Layout::packed(tokens, h, d);
        let (qv, kv, vv) = (
            Tensor::new((&dq, &stream), l(hq)),
            Tensor::new((&dk, &stream), l(hk)),
            Tensor::new((&dv, &stream), l(hk)),
        );
        let mut q8 = TensorMut::new((&mut dq8, &stream), l(hq));
        let mut cache = KvCache::paged((&mut dkc, &stream), (&mut dvc, &stream), layout)
            .scales(KvScales::per_head((&dks, &stream), (&dvs, &stream)));
        let args = KvAppend::new(&kv, &vv, &mut cache, Positions::ids_i32((&dids, &stream)))
            .q_fp8(&qv, &mut q8, rope_cuda::Fp8Scale::new((&dqs, &stream)))
            .slots((&dslots, &stream));
        rope.append_kv(args, &stream).unwrap();
        let mut o = TensorMut::new((&mut out, &stream), Layout::packed(tokens, hk, d));
        rope.read_kv(KvRead::new(&cache, (&dslots, &stream)).v(&mut o), &stream).unwrap();
        rope.check_errors(&stream).unwrap();
    }
    let (gv, gq8, back) =
        (stream.clone_dtoh(&dvc).unwrap(), stream.clone_dtoh(&dq8).unwrap(), stream.clone_dtoh(&out).unwrap());
    for t in 0..tokens {
        for h in 0..hk {
            for e in 0..d {
                let (x, at) = (v[(t * hk + h) * d + e].to_f32(), (slots[t] as usize * hk + h) * d + e);
                let code = F8E4M3::from_f32(x / vs[h]);
                assert_eq!(gv[at].0, code.0, "v code of token {t}, head {h}, element {e}");
                assert_eq!(back[(t * hk + h) * d + e], code.to_f32() * vs[h], "v read back");
            }
        }
        // q's FP8 output: its dims are the rotation's, quantized (the codes of values within an
        // ulp of the exact rotation, divided by the scale).
        for h in 0..hq {
            let at = (t * hq + h) * d;
            let x: Vec<f64> = q[at..at + d].iter().map(|v| v.to_f64()).collect();
            let y = rope_row_freqs(
                &x,
                ids[t] as f64,
                &rope.config().frequencies().unwrap().0,
                1.0,
                RopeStyle::NeoX,
                Direction::Forward,
            );
            for e in 0..d {
                assert_eq!(
                    gq8[at + e].0,
                    F8E4M3::from_f32(y[e] as f32 / qs[0]).0,
                    "q code of token {t}, head {h}, element {e}"
                );
            }
        }
    }
}

/// QK-norm in the append on cudarc buffers (weights lent as cudarc views too): q and the key
/// rows within one ulp of the f64 norm-then-rotation, values bit for bit.
#[test]
fn normed_append_on_cudarc_buffers() {
    let Some((stream, kernels)) = cudarc_gpu("normed_append_on_cudarc_buffers") else { return };
    let seed = test_seed("normed_append_on_cudarc_buffers");
    let (tokens, hq, hk, d, blocks, bs) = (9, 4, 2, 128, 6, 16);
    let config = RopeConfig::new(d, 1024).dtype(DType::BF16);
    let (freqs, attention) = config.frequencies().unwrap();
    let rope = Rope::new(&kernels, config.clone()).unwrap();
    let PagedStep { q, k, v, kc0, vc0, ids, slots } = PagedStep::draw(seed, (tokens, hq, hk, d), (blocks, bs), 1024);
    let (qw, kw) = (random_bf16(seed, 30, d), random_bf16(seed, 31, d));
    let up = |x: &[half::bf16]| stream.clone_htod(&to2(x)).unwrap();
    let (mut dq, dk, dv, dqw, dkw) = (up(&q), up(&k), up(&v), up(&qw), up(&kw));
    let (mut dkc, mut dvc) = (up(&kc0), up(&vc0));
    let (dids, dslots) = (stream.clone_htod(&ids).unwrap(), stream.clone_htod(&slots).unwrap());
    {
        let mut qv = TensorMut::new((&mut dq, &stream), Layout::packed(tokens, hq, d));
        let (kv, vv) = (
            Tensor::new((&dk, &stream), Layout::packed(tokens, hk, d)),
            Tensor::new((&dv, &stream), Layout::packed(tokens, hk, d)),
        );
        let mut cache = KvCache::paged((&mut dkc, &stream), (&mut dvc, &stream), Layout::bshd(blocks, bs, hk, d));
        let norm = rope_cuda::QkNorm::rms((&dqw, &stream), (&dkw, &stream), 1e-6);
        let args = KvAppend::new(&kv, &vv, &mut cache, Positions::ids_i32((&dids, &stream)))
            .q(&mut qv)
            .slots((&dslots, &stream))
            .norm(norm);
        rope.append_kv(args, &stream).unwrap();
        rope.check_errors(&stream).unwrap();
    }
    let (gq, gkc, gvc) = (
        from2(&stream.clone_dtoh(&dq).unwrap()),
        from2(&stream.clone_dtoh(&dkc).unwrap()),
        from2(&stream.clone_dtoh(&dvc).unwrap()),
    );
    let check = |what: &str, got: &[half::bf16], x: &[half::bf16], w: &[half::bf16], pos: i32| {
        for (h, (g, x)) in got.chunks(d).zip(x.chunks(d)).enumerate() {
            let x: Vec<f64> = x.iter().map(|v| v.to_f64()).collect();
            let w: Vec<f64> = w.iter().map(|v| v.to_f64()).collect();
            let y = rope_cuda::reference::rms_norm_row(&x, Some(&w), 0.0, 1e-6f32 as f64);
            let y = rope_row_freqs(&y, pos as f64, &freqs, attention, RopeStyle::NeoX, Direction::Forward);
            for i in 0..d {
                assert!(g[i].ulps(half::bf16::round(y[i])) <= 1, "{what}: head {h} dim {i}: {:?} vs {}", g[i], y[i]);
            }
        }
    };
    let mut written = vec![false; blocks * bs];
    for t in 0..tokens {
        let qr = t * hq * d..(t + 1) * hq * d;
        check(&format!("q of token {t}"), &gq[qr.clone()], &q[qr], &qw, ids[t]);
        if slots[t] < 0 {
            continue;
        }
        let n = slots[t] as usize;
        written[n] = true;
        let (cr, kr) = (n * hk * d..(n + 1) * hk * d, t * hk * d..(t + 1) * hk * d);
        check(&format!("k of token {t}"), &gkc[cr.clone()], &k[kr.clone()], &kw, ids[t]);
        assert_eq!(&gvc[cr], &v[kr], "v of token {t}");
    }
    for (n, w) in written.iter().enumerate() {
        let r = n * hk * d..(n + 1) * hk * d;
        if !w {
            assert_eq!((&gkc[r.clone()], &gvc[r.clone()]), (&kc0[r.clone()], &vc0[r]), "slot {n} changed");
        }
    }
}
