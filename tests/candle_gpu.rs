//! The candle API (feature `candle`): RoPE in place on strided candle views and the fused paged
//! append on candle tensors, on candle's stream, against the f64 reference; every element the
//! calls do not write bit-identical; typed errors before any launch, with nothing written.
#![cfg(feature = "candle")]

mod common;

use candle_core::{DType as CDType, Device, Tensor as CTensor};
use common::{assert_rotated, or_skip, random_bf16, test_seed, PagedStep};
use rope_cuda::candle::{append_kv, apply, error_of, load, Axes, Cache, Ids};
use rope_cuda::reference::splitmix64;
use rope_cuda::{DType, Error, Rope, RopeConfig};

/// candle's CUDA device 0 and a `Rope` of `config` loaded into it, or `None` after printing
/// that `test` skipped (a failure with `ROPE_CUDA_REQUIRE_GPU`).
fn candle_gpu(test: &str, config: RopeConfig) -> Option<(Device, Rope)> {
    let device = or_skip(test, Device::new_cuda(0))?;
    let kernels = load(&device).expect("loading the kernels into candle's context");
    Some((device, Rope::new(&kernels, config).expect("the Rope")))
}

fn to2(x: &[half::bf16]) -> Vec<half2::bf16> {
    x.iter().map(|v| half2::bf16::from_bits(v.to_bits())).collect()
}

/// A candle tensor's elements in storage order (the whole storage of a contiguous tensor).
fn host(t: &CTensor) -> Vec<half::bf16> {
    let v: Vec<half2::bf16> = t.flatten_all().and_then(|f| f.to_vec1()).expect("copy to host");
    v.iter().map(|v| half::bf16::from_bits(v.to_bits())).collect()
}

fn upload(x: &[half::bf16], shape: &[usize], device: &Device) -> CTensor {
    CTensor::from_vec(to2(x), shape, device).expect("upload")
}

#[test]
fn rope_in_place_on_strided_candle_views() {
    let (d, positions) = (128, 4096);
    let config = RopeConfig::new(d, positions).base(500_000.0).dtype(DType::BF16);
    let Some((device, rope)) = candle_gpu("rope_in_place_on_strided_candle_views", config.clone()) else { return };
    let seed = test_seed("rope_in_place_on_strided_candle_views");
    // A fused QKV projection [b, s, hq + 2 hk, d]: q and k are views into it (the Bshd axes),
    // v is left alone.
    let (b, s, hq, hk) = (2, 7, 8, 2);
    let row = hq + 2 * hk;
    let x = random_bf16(seed, 0, b * s * row * d);
    let qkv = upload(&x, &[b, s, row, d], &device);
    let ids: Vec<i64> = (0..(b * s) as u64).map(|t| (splitmix64(seed ^ t) % positions as u64) as i64).collect();
    let ids_t = CTensor::from_vec(ids.clone(), (b, s), &device).unwrap();
    let (q, k) = (qkv.narrow(2, 0, hq).unwrap(), qkv.narrow(2, hq, hk).unwrap());
    apply(&rope, &q, Some(&k), Ids::Ids(&ids_t), Axes::Bshd).unwrap();
    let got = host(&qkv);
    for (t, &pos) in ids.iter().enumerate() {
        let r = t * row * d;
        let qk = r..r + (hq + hk) * d;
        assert_rotated(&format!("token {t}"), &got[qk.clone()], &x[qk], pos, &config);
        assert_eq!(&got[r + (hq + hk) * d..r + row * d], &x[r + (hq + hk) * d..r + row * d], "token {t}: v changed");
    }

    // Candle's attention layout: [b, h, s, d] as a transposed (strided) view of [b, s, h, d],
    // at sequential positions, i32 offsets per sequence.
    let y = random_bf16(seed, 1, b * s * hq * d);
    let base = upload(&y, &[b, s, hq, d], &device);
    let bhsd = base.transpose(1, 2).unwrap();
    assert!(!bhsd.is_contiguous());
    let starts = [3i32, 1000];
    let offsets = CTensor::from_vec(starts.to_vec(), b, &device).unwrap();
    apply(&rope, &bhsd, None, Ids::Offsets(&offsets), Axes::Bhsd).unwrap();
    let got = host(&base);
    for t in 0..b * s {
        let r = t * hq * d..(t + 1) * hq * d;
        let pos = starts[t / s] as i64 + (t % s) as i64;
        assert_rotated(&format!("[b, h, s, d] token {t}"), &got[r.clone()], &y[r], pos, &config);
    }
}

#[test]
fn fused_paged_append_on_candle_tensors() {
    let (d, positions) = (128, 1024);
    let config = RopeConfig::new(d, positions).dtype(DType::BF16);
    let Some((device, rope)) = candle_gpu("fused_paged_append_on_candle_tensors", config.clone()) else { return };
    let seed = test_seed("fused_paged_append_on_candle_tensors");
    let (tokens, hq, hk, blocks, bs) = (9, 4, 2, 6, 16);
    let PagedStep { q, k, v, kc0, vc0, ids, slots } =
        PagedStep::draw(seed, (tokens, hq, hk, d), (blocks, bs), positions);
    let (tq, tk, tv) = (
        upload(&q, &[tokens, hq, d], &device),
        upload(&k, &[tokens, hk, d], &device),
        upload(&v, &[tokens, hk, d], &device),
    );
    let (tkc, tvc) = (upload(&kc0, &[blocks, bs, hk, d], &device), upload(&vc0, &[blocks, bs, hk, d], &device));
    let ids_t = CTensor::from_vec(ids.clone(), tokens, &device).unwrap();
    let slots_t = CTensor::from_vec(slots.clone(), tokens, &device).unwrap();
    let cache = Cache { k: &tkc, v: &tvc, axes: Axes::Bshd, paged: true };
    append_kv(&rope, Some(&tq), &tk, &tv, cache, Ids::Ids(&ids_t), Some(&slots_t), Axes::Thd).unwrap();
    let (gq, gkc, gvc) = (host(&tq), host(&tkc), host(&tvc));
    for (t, &pos) in ids.iter().enumerate() {
        let r = t * hq * d..(t + 1) * hq * d;
        assert_rotated(&format!("q of token {t}"), &gq[r.clone()], &q[r], pos as i64, &config);
    }
    let (mut want_k, mut want_v) = (kc0.clone(), vc0.clone());
    for t in 0..tokens {
        let Ok(slot) = usize::try_from(slots[t]) else { continue };
        let (at, src) = (slot * hk * d..(slot + 1) * hk * d, t * hk * d..(t + 1) * hk * d);
        assert_rotated(&format!("k of token {t}"), &gkc[at.clone()], &k[src.clone()], ids[t] as i64, &config);
        want_k[at.clone()].copy_from_slice(&gkc[at.clone()]);
        want_v[at].copy_from_slice(&v[src]);
    }
    // Every other row of the key cache as it was; the value cache the values' bits.
    assert!(gkc.iter().zip(&want_k).all(|(a, b)| a.to_bits() == b.to_bits()), "an untouched key row changed");
    assert!(gvc.iter().zip(&want_v).all(|(a, b)| a.to_bits() == b.to_bits()), "the value cache differs");
}

#[test]
fn typed_errors_and_nothing_written() {
    let config = RopeConfig::new(64, 256).dtype(DType::BF16);
    let Some((device, rope)) = candle_gpu("typed_errors_and_nothing_written", config) else { return };
    let seed = test_seed("typed_errors_and_nothing_written");
    let (b, s, h, d) = (1, 5, 4, 64);
    let x = random_bf16(seed, 7, b * s * h * d);
    let q = upload(&x, &[b, s, h, d], &device);
    let on_cpu = CTensor::from_vec(to2(&x), (b, s, h, d), &Device::Cpu).unwrap();
    let as_f32 = q.to_dtype(CDType::F32).unwrap();
    let ids_f32 = CTensor::zeros(s, CDType::F32, &device).unwrap();
    let ids_short = CTensor::zeros(s - 1, CDType::I64, &device).unwrap();
    let cases: [(&CTensor, Ids, Axes, &str); 5] = [
        (&on_cpu, Ids::Sequential, Axes::Bshd, "cpu"),
        (&as_f32, Ids::Sequential, Axes::Bshd, "dtype"),
        (&q, Ids::Ids(&ids_f32), Axes::Bshd, "positions dtype"),
        (&q, Ids::Ids(&ids_short), Axes::Bshd, "positions length"),
        (&q, Ids::Sequential, Axes::Thd, "rank"),
    ];
    for (t, ids, axes, what) in cases {
        let e = apply(&rope, t, None, ids, axes).expect_err(what);
        let ours = error_of(&e);
        let ok = match what {
            "cpu" | "positions dtype" => matches!(ours, Some(Error::Candle { .. })),
            "dtype" => matches!(ours, Some(Error::DType { .. })),
            "positions length" => matches!(ours, Some(Error::Length { .. })),
            _ => matches!(ours, Some(Error::Rank { .. })),
        };
        assert!(ok, "{what}: {e}");
        assert!(!e.to_string().is_empty());
    }
    assert_eq!(host(&q), x, "a refused call wrote");
    // Caches of two layouts: refused before any launch.
    let (k, v) = (upload(&x, &[b * s, h, d], &device), upload(&x, &[b * s, h, d], &device));
    let kc = upload(&random_bf16(seed, 8, 2 * 8 * h * d), &[2, 8, h, d], &device);
    let vc_t = upload(&random_bf16(seed, 9, 2 * 8 * h * d), &[2, h, 8, d], &device);
    let (kc0, vc0) = (host(&kc), host(&vc_t));
    let slots = CTensor::from_vec((0..(b * s) as i64).collect::<Vec<_>>(), b * s, &device).unwrap();
    let vc = vc_t.transpose(1, 2).unwrap();
    let cache = Cache { k: &kc, v: &vc, axes: Axes::Bshd, paged: true };
    let e = append_kv(&rope, None, &k, &v, cache, Ids::Sequential, Some(&slots), Axes::Thd).expect_err("layouts");
    assert!(matches!(error_of(&e), Some(Error::Candle { what: "v cache", .. })), "{e}");
    assert_eq!((host(&kc), host(&vc_t)), (kc0, vc0), "a refused append wrote");
}
