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

/// `v` (exactly representable in `dtype`) as an ordered integer: adjacent values of the type
/// differ by 1.
fn ordered(v: f64, dtype: CDType) -> i64 {
    let (bits, sign) = match dtype {
        CDType::F32 => ((v as f32).to_bits() as i64, 1i64 << 31),
        CDType::F16 => (half2::f16::from_f64(v).to_bits() as i64, 1 << 15),
        _ => (half2::bf16::from_f64(v).to_bits() as i64, 1 << 15),
    };
    if bits & sign != 0 {
        -(bits & (sign - 1))
    } else {
        bits
    }
}

/// A candle tensor's values as f64, in its logical (row-major) order.
fn values(t: &CTensor) -> Vec<f64> {
    t.to_dtype(CDType::F64).and_then(|t| t.flatten_all()).and_then(|t| t.to_vec1()).expect("copy to host")
}

/// Seeded values in [-1, 1) of `shape` in `dtype` on `device`.
fn random(seed: u64, tensor: u64, shape: &[usize], dtype: CDType, device: &Device) -> CTensor {
    let n = shape.iter().product::<usize>() as u64;
    let v: Vec<f32> = (0..n).map(|i| rope_cuda::reference::uniform(seed, tensor, i)).collect();
    CTensor::from_vec(v, shape, device).and_then(|t| t.to_dtype(dtype)).expect("upload")
}

/// The rotation of `x` (`[b, h, t, d]` values, or `[b, t, h, d]` with `thd`) by the tables'
/// entries in f64; `gptj`: interleaved pairs. Tables `[tb, rows, d / 2]` (`tb` 1: shared).
#[allow(clippy::too_many_arguments)]
fn rotated(
    x: &[f64],
    [b, h, t, d]: [usize; 4],
    thd: bool,
    gptj: bool,
    cos: &[f64],
    sin: &[f64],
    tb: usize,
    rows: usize,
) -> Vec<f64> {
    let mut out = vec![0.0; x.len()];
    let half = d / 2;
    for (bi, hi, s) in (0..b).flat_map(|bi| (0..h).flat_map(move |hi| (0..t).map(move |s| (bi, hi, s)))) {
        let at = if thd { ((bi * t + s) * h + hi) * d } else { ((bi * h + hi) * t + s) * d };
        let row = ((if tb > 1 { bi } else { 0 }) * rows + s) * half;
        for i in 0..half {
            let (i1, i2) = if gptj { (2 * i, 2 * i + 1) } else { (i, i + half) };
            let (c, sn, x1, x2) = (cos[row + i], sin[row + i], x[at + i1], x[at + i2]);
            out[at + i1] = x1 * c - x2 * sn;
            out[at + i2] = x1 * sn + x2 * c;
        }
    }
    out
}

/// Every element of `got` within 1 ulp of `want` (f64) rounded to `dtype`; the worst distance.
fn within_one_ulp(what: &str, got: &[f64], want: &[f64], dtype: CDType) -> i64 {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let mut worst = 0;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let ulps = (ordered(g, dtype) - ordered(w, dtype)).abs();
        assert!(ulps <= 1, "{what}: element {i}: {g} against {w} ({ulps} ulps)");
        worst = worst.max(ulps);
    }
    worst
}

#[test]
fn drop_ins_match_the_rotation_by_the_callers_tables() {
    let Some(device) = or_skip("drop_ins_match_the_rotation_by_the_callers_tables", Device::new_cuda(0)) else {
        return;
    };
    let seed = test_seed("drop_ins_match_the_rotation_by_the_callers_tables");
    let (b, h, t, d) = (3, 4, 9, 128);
    let mut case = 0u64;
    for dtype in [CDType::F32, CDType::F16, CDType::BF16] {
        for (name, thd, gptj) in [("rope", false, false), ("rope_i", false, true), ("rope_thd", true, false)] {
            // Tables shared by every sequence (more rows than tokens) and one per sequence.
            for (tb, rows) in [(1, t + 5), (b, t)] {
                case += 1;
                let what = format!("{name} {dtype:?} tables [{tb}, {rows}]");
                let shape = if thd { [b, t, h, d] } else { [b, h, t, d] };
                let xs = random(seed, 3 * case, &shape, dtype, &device);
                let table_shape: Vec<usize> = if tb > 1 { vec![tb, rows, d / 2] } else { vec![rows, d / 2] };
                let angles = random(seed, 3 * case + 1, &table_shape, CDType::F32, &device).affine(4.0, 0.0).unwrap();
                let (cos, sin) =
                    (angles.cos().unwrap().to_dtype(dtype).unwrap(), angles.sin().unwrap().to_dtype(dtype).unwrap());
                let x0 = values(&xs);
                let f = match name {
                    "rope" => rope_cuda::candle::rope,
                    "rope_i" => rope_cuda::candle::rope_i,
                    _ => rope_cuda::candle::rope_thd,
                };
                let got = f(&xs, &cos, &sin).unwrap();
                assert_eq!(got.dims(), xs.dims(), "{what}");
                assert!(got.is_contiguous(), "{what}");
                let want = rotated(&x0, [b, h, t, d], thd, gptj, &values(&cos), &values(&sin), tb, rows);
                within_one_ulp(&what, &values(&got), &want, dtype);
                assert_eq!(values(&xs), x0, "{what}: xs changed");
                // The CPU path: the same rotation, rounded once.
                let on_cpu = |t: &CTensor| t.to_device(&Device::Cpu).unwrap();
                let cpu = f(&on_cpu(&xs), &on_cpu(&cos), &on_cpu(&sin)).unwrap();
                assert_eq!(within_one_ulp(&format!("{what} (cpu)"), &values(&cpu), &want, dtype), 0);
            }
        }
    }
    // A strided xs (candle's own rope takes only contiguous ones): [b, h, t, d] as a transposed
    // view of [b, t, h, d].
    let base = random(seed, 1000, &[b, t, h, d], CDType::BF16, &device);
    let xs = base.transpose(1, 2).unwrap();
    assert!(!xs.is_contiguous());
    let angles = random(seed, 1001, &[t, d / 2], CDType::F32, &device).affine(4.0, 0.0).unwrap();
    let (cos, sin) =
        (angles.cos().unwrap().to_dtype(CDType::BF16).unwrap(), angles.sin().unwrap().to_dtype(CDType::BF16).unwrap());
    let got = rope_cuda::candle::rope(&xs, &cos, &sin).unwrap();
    let want = rotated(&values(&xs), [b, h, t, d], false, false, &values(&cos), &values(&sin), 1, t);
    within_one_ulp("rope on a strided view", &values(&got), &want, CDType::BF16);
}

#[test]
fn drop_ins_refuse_tables_that_do_not_fit() {
    let Some(device) = or_skip("drop_ins_refuse_tables_that_do_not_fit", Device::new_cuda(0)) else { return };
    let seed = test_seed("drop_ins_refuse_tables_that_do_not_fit");
    let (b, h, t, d) = (2, 3, 6, 64);
    let xs = random(seed, 0, &[b, h, t, d], CDType::BF16, &device);
    let x0 = values(&xs);
    let table = |rows: usize, half: usize, dtype: CDType| random(seed, 1, &[rows, half], dtype, &device);
    let ok = table(t, d / 2, CDType::BF16);
    let cases = [
        ("fewer rows than tokens", table(t - 1, d / 2, CDType::BF16), table(t - 1, d / 2, CDType::BF16)),
        ("wider than head_dim", table(t, d / 2 + 8, CDType::BF16), table(t, d / 2 + 8, CDType::BF16)),
        ("dtype", table(t, d / 2, CDType::F32), ok.clone()),
        (
            "batch",
            random(seed, 2, &[b + 1, t, d / 2], CDType::BF16, &device),
            random(seed, 3, &[b + 1, t, d / 2], CDType::BF16, &device),
        ),
        ("rank", random(seed, 4, &[1, 1, t, d / 2], CDType::BF16, &device), ok.clone()),
    ];
    for (what, cos, sin) in cases {
        let e = rope_cuda::candle::rope(&xs, &cos, &sin).expect_err(what);
        let ours = error_of(&e);
        let fits = match what {
            "fewer rows than tokens" => matches!(ours, Some(Error::MaxPosition { needed: 6, max_position: 5 })),
            "wider than head_dim" => matches!(ours, Some(Error::RotaryDim { rotary_dim: 80, head_dim: 64 })),
            "dtype" => matches!(ours, Some(Error::DType { what: "cos", .. })),
            "batch" => matches!(ours, Some(Error::Shape { what: "cos", axis: "batch", .. })),
            _ => matches!(ours, Some(Error::Rank { what: "cos", .. })),
        };
        assert!(fits, "{what}: {e}");
    }
    let f64s = xs.to_dtype(CDType::F64).unwrap();
    let e = rope_cuda::candle::rope(&f64s, &ok.to_dtype(CDType::F64).unwrap(), &ok.to_dtype(CDType::F64).unwrap());
    assert!(matches!(e.as_ref().map_err(error_of), Err(Some(Error::Candle { .. }))), "{e:?}");
    assert_eq!(values(&xs), x0, "xs changed");
}
