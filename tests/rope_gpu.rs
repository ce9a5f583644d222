//! The general RoPE on the GPU against the f64 CPU reference: a generated matrix of styles,
//! dtypes, layouts, head counts, rotary dims, position kinds and in/out of place, each case
//! followed by the inverse rotation; then out-of-range positions.
//!
//! Bounds: f32 ‖out − ref‖ / ‖ref‖ ≤ 2e-6; f16 and bf16 every rotated element within 1 ulp
//! of the correctly rounded f64 result. After the inverse, the result is within those bounds
//! of the reference inverse of what the forward pass wrote, and within 2e-6 (f32) or two
//! unit roundoffs (2^-10 bf16, 2^-10 f16… see `roundtrip_bound`) norm-wise of the original
//! input: each 16-bit rounding adds at most one unit roundoff norm-wise, and a rotation
//! preserves norms.

mod common;

use common::{download_t, gpu, test_seed, upload_t, Gpu, TestElem};
use cust::memory::DeviceBuffer;
use rope_cuda::reference::{rope_row, rope_row_freqs, splitmix64, uniform};
use rope_cuda::{
    CosSin, DType, Direction, Error, HeadGrouping, Layout, Positions, Rope, RopeArgs, RopeConfig, RopeStyle, Tensor,
    TensorMut,
};

const MAX_POS: usize = 4096;
const F32_TOL: f64 = 2e-6;
const BATCH: usize = 2;
const SEQ: usize = 3;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Storage {
    /// Separate contiguous q `[B, S, Hq, D]` and k `[B, S, Hk, D]`.
    Bshd,
    /// Separate contiguous q `[B, Hq, S, D]` and k `[B, Hk, S, D]`.
    Bhsd,
    /// One buffer of rows `[q heads | k heads | v heads | 8 elements of padding]`.
    PackedQkv,
    /// As `PackedQkv` with one element of padding and the views starting at element 1: no
    /// 16-byte alignment, so the scalar kernels run.
    PackedOdd,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum PosKind {
    Ids32,
    Ids64,
    Offsets,
    Offsets64,
}

/// Where q and k live: buffer lengths, and each view as (buffer index, layout).
struct Plan {
    lens: Vec<usize>,
    q: (usize, Layout),
    k: (usize, Layout),
}

fn storage(kind: Storage, hq: usize, hk: usize, d: usize) -> Plan {
    match kind {
        Storage::Bshd => {
            let (q, k) = (Layout::bshd(BATCH, SEQ, hq, d), Layout::bshd(BATCH, SEQ, hk, d));
            Plan { lens: vec![q.extent().unwrap(), k.extent().unwrap()], q: (0, q), k: (1, k) }
        }
        Storage::Bhsd => {
            let (q, k) = (Layout::bhsd(BATCH, hq, SEQ, d), Layout::bhsd(BATCH, hk, SEQ, d));
            Plan { lens: vec![q.extent().unwrap(), k.extent().unwrap()], q: (0, q), k: (1, k) }
        }
        Storage::PackedQkv | Storage::PackedOdd => {
            let (pad, start) = if kind == Storage::PackedQkv { (8, 0) } else { (1, 1) };
            let row = (hq + 2 * hk) * d + pad;
            let strides = [SEQ * row, row, d];
            let q = Layout::strided([BATCH, SEQ, hq, d], strides, start);
            let k = Layout::strided([BATCH, SEQ, hk, d], strides, start + hq * d);
            Plan { lens: vec![BATCH * SEQ * row + start], q: (0, q), k: (0, k) }
        }
    }
}

/// The element indices of row `(b, s, h)` of `layout`.
fn row_range(l: &Layout, b: usize, s: usize, h: usize) -> std::ops::Range<usize> {
    let start = l.offset + b * l.strides[0] + s * l.strides[1] + h * l.strides[2];
    start..start + l.head_dim()
}

/// Positions for the case, as host values per token, and the device buffers holding them.
enum PosBuf {
    I32(DeviceBuffer<i32>),
    I64(DeviceBuffer<i64>),
}

fn positions(kind: PosKind, seed: u64) -> (Vec<i64>, PosBuf) {
    let rand = |i: u64, n: usize| (splitmix64(seed ^ 0xABCD ^ (i << 20)) % n as u64) as i64;
    match kind {
        PosKind::Ids32 | PosKind::Ids64 => {
            let mut ids: Vec<i64> = (0..BATCH * SEQ).map(|i| rand(i as u64, MAX_POS)).collect();
            ids[0] = 0;
            ids[BATCH * SEQ - 1] = MAX_POS as i64 - 1;
            let buf = if kind == PosKind::Ids32 {
                PosBuf::I32(upload_t(&ids.iter().map(|&p| p as i32).collect::<Vec<_>>()))
            } else {
                PosBuf::I64(upload_t(&ids))
            };
            (ids, buf)
        }
        PosKind::Offsets | PosKind::Offsets64 => {
            let mut offsets: Vec<i64> = (0..BATCH).map(|b| rand(b as u64, MAX_POS - SEQ + 1)).collect();
            offsets[0] = 0;
            offsets[BATCH - 1] = (MAX_POS - SEQ) as i64;
            let per_token = (0..BATCH * SEQ).map(|t| offsets[t / SEQ] + (t % SEQ) as i64).collect();
            let buf = if kind == PosKind::Offsets {
                PosBuf::I32(upload_t(&offsets.iter().map(|&p| p as i32).collect::<Vec<_>>()))
            } else {
                PosBuf::I64(upload_t(&offsets))
            };
            (per_token, buf)
        }
    }
}

fn as_positions(kind: PosKind, buf: &PosBuf) -> Positions<'_> {
    match (kind, buf) {
        (PosKind::Ids32, PosBuf::I32(b)) => Positions::ids_i32(b),
        (PosKind::Ids64, PosBuf::I64(b)) => Positions::ids_i64(b),
        (PosKind::Offsets, PosBuf::I32(b)) => Positions::offsets_i32(b),
        (PosKind::Offsets64, PosBuf::I64(b)) => Positions::offsets_i64(b),
        _ => unreachable!(),
    }
}

/// Norm-wise bound of inverse(forward(x)) against x.
fn roundtrip_bound<T: TestElem>() -> f64 {
    match T::DTYPE {
        DType::F32 => F32_TOL,
        DType::F16 => 2.0 * 2f64.powi(-11),
        DType::BF16 => 2.0 * 2f64.powi(-8),
        DType::E4M3 | DType::E5M2 => unreachable!("RoPE outputs are not FP8"),
    }
}

/// What the output buffers must hold: exact bits, or a value to be met within tolerance.
#[derive(Clone, Copy)]
enum Want {
    Bits(u32),
    Value(f64),
}

/// Expected contents of the output buffers after rotating `input` in `direction`.
#[allow(clippy::too_many_arguments)]
fn expected<T: TestElem>(
    plan: &Plan,
    before: &[Vec<T>],
    input: &[Vec<T>],
    hq: usize,
    hk: usize,
    config: &RopeConfig,
    pos: &[i64],
    direction: Direction,
) -> Vec<Vec<Want>> {
    let mut want: Vec<Vec<Want>> = before.iter().map(|b| b.iter().map(|v| Want::Bits(v.bits())).collect()).collect();
    let (freqs, attention) = config.frequencies().unwrap();
    for ((buf, layout), heads) in [(plan.q, hq), (plan.k, hk)] {
        for b in 0..BATCH {
            for s in 0..SEQ {
                let p = pos[b * SEQ + s] as f64;
                for h in 0..heads {
                    let r = row_range(&layout, b, s, h);
                    let x: Vec<f64> = input[buf][r.clone()].iter().map(|v| v.to_f64()).collect();
                    let y = rope_row_freqs(&x, p, &freqs, attention, config.style, direction);
                    for (j, i) in r.enumerate() {
                        want[buf][i] =
                            if j < config.rotary_dim { Want::Value(y[j]) } else { Want::Bits(input[buf][i].bits()) };
                    }
                }
            }
        }
    }
    want
}

/// Checks `got` against `want`; returns a failure message, if any.
fn compare<T: TestElem>(got: &[Vec<T>], want: &[Vec<Want>]) -> Option<String> {
    let (mut num, mut den, mut worst_ulps) = (0.0f64, 0.0f64, 0u64);
    for (g, w) in got.iter().zip(want) {
        for (i, (g, w)) in g.iter().zip(w).enumerate() {
            match *w {
                Want::Bits(bits) if g.bits() != bits => {
                    return Some(format!(
                        "element {i}: bits {:#x}, expected {bits:#x} (untouched or copied)",
                        g.bits()
                    ));
                }
                Want::Bits(_) => {}
                Want::Value(v) => {
                    num += (g.to_f64() - v).powi(2);
                    den += v * v;
                    if T::DTYPE != DType::F32 {
                        worst_ulps = worst_ulps.max(g.ulps(T::round(v)));
                    }
                }
            }
        }
    }
    let rel = (num / den).sqrt();
    match T::DTYPE {
        DType::F32 if rel.is_nan() || rel > F32_TOL => Some(format!("relative error {rel:e} > {F32_TOL:e}")),
        DType::F16 | DType::BF16 if worst_ulps > 1 => Some(format!("{worst_ulps} ulps from the rounded reference")),
        _ => None,
    }
}

/// Norm-wise distance of the rotated elements of `got` from `orig`.
fn roundtrip_error<T: TestElem>(got: &[Vec<T>], orig: &[Vec<T>], want: &[Vec<Want>]) -> f64 {
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for ((g, o), w) in got.iter().zip(orig).zip(want) {
        for ((g, o), w) in g.iter().zip(o).zip(w) {
            if let Want::Value(_) = w {
                num += (g.to_f64() - o.to_f64()).powi(2);
                den += o.to_f64().powi(2);
            }
        }
    }
    (num / den).sqrt()
}

/// Runs `direction` over the case's buffers, in place on `bufs` or from `bufs` into `outs`.
fn run<T: TestElem>(
    g: &Gpu,
    rope: &Rope,
    plan: &Plan,
    bufs: &mut [DeviceBuffer<T>],
    outs: Option<&mut [DeviceBuffer<T>]>,
    positions: Positions,
    direction: Direction,
) -> rope_cuda::Result<()> {
    let (q, k) = (plan.q, plan.k);
    match outs {
        None if q.0 == k.0 => {
            let (mut qv, mut kv) = TensorMut::pair(&mut bufs[q.0], q.1, k.1);
            rope.apply(RopeArgs::in_place(&mut qv, positions).k(&mut kv).direction(direction), &g.stream)
        }
        None => {
            let (a, b) = bufs.split_at_mut(1);
            let (mut qv, mut kv) = (TensorMut::new(&mut a[0], q.1), TensorMut::new(&mut b[0], k.1));
            rope.apply(RopeArgs::in_place(&mut qv, positions).k(&mut kv).direction(direction), &g.stream)
        }
        Some(outs) => {
            let (qi, ki) = (Tensor::new(&bufs[q.0], q.1), Tensor::new(&bufs[k.0], k.1));
            if q.0 == k.0 {
                let (mut qo, mut ko) = TensorMut::pair(&mut outs[q.0], q.1, k.1);
                rope.apply(RopeArgs::into(&qi, &mut qo, positions).k_into(&ki, &mut ko).direction(direction), &g.stream)
            } else {
                let (a, b) = outs.split_at_mut(1);
                let (mut qo, mut ko) = (TensorMut::new(&mut a[0], q.1), TensorMut::new(&mut b[0], k.1));
                rope.apply(RopeArgs::into(&qi, &mut qo, positions).k_into(&ki, &mut ko).direction(direction), &g.stream)
            }
        }
    }
}

/// One case: forward, checked; then inverse of the result, checked. Returns failures.
#[allow(clippy::too_many_arguments)]
fn case<T: TestElem>(
    g: &Gpu,
    rope: &Rope,
    kind: Storage,
    (hq, hk): (usize, usize),
    pos_kind: PosKind,
    in_place: bool,
    seed: u64,
) -> Option<String> {
    let config = rope.config();
    let plan = storage(kind, hq, hk, config.head_dim);
    let input: Vec<Vec<T>> = plan
        .lens
        .iter()
        .enumerate()
        .map(|(i, &n)| (0..n as u64).map(|j| T::from_f32(uniform(seed, 10 + i as u64, j))).collect())
        .collect();
    let (pos, pos_buf) = positions(pos_kind, seed);
    let mut bufs: Vec<DeviceBuffer<T>> = input.iter().map(|h| upload_t(h)).collect();
    let poison: Vec<Vec<T>> = plan.lens.iter().map(|&n| vec![T::from_bits(T::POISON_BITS); n]).collect();
    let mut outs: Option<Vec<DeviceBuffer<T>>> = (!in_place).then(|| poison.iter().map(|h| upload_t(h)).collect());

    // Forward.
    let positions = as_positions(pos_kind, &pos_buf);
    run(g, rope, &plan, &mut bufs, outs.as_deref_mut(), positions, Direction::Forward).unwrap();
    rope.check_errors(&g.stream).unwrap();
    let result = |bufs: &[DeviceBuffer<T>], outs: &Option<Vec<DeviceBuffer<T>>>| -> Vec<Vec<T>> {
        outs.as_deref().unwrap_or(bufs).iter().map(|b| download_t(b)).collect()
    };
    let forward = result(&bufs, &outs);
    let before = if in_place { &input } else { &poison };
    let want = expected(&plan, before, &input, hq, hk, config, &pos, Direction::Forward);
    if let Some(e) = compare(&forward, &want) {
        return Some(format!("forward: {e}"));
    }
    // Input untouched out of place.
    if !in_place && result(&bufs, &None).iter().flatten().zip(input.iter().flatten()).any(|(a, b)| a.bits() != b.bits())
    {
        return Some("out of place modified its input".into());
    }

    // Inverse of what forward wrote, in place where forward wrote it.
    let target = outs.as_deref_mut().unwrap_or(&mut bufs);
    run(g, rope, &plan, target, None, positions, Direction::Inverse).unwrap();
    let back: Vec<Vec<T>> = target.iter().map(|b| download_t(b)).collect();
    let want_back = expected(&plan, &forward, &forward, hq, hk, config, &pos, Direction::Inverse);
    if let Some(e) = compare(&back, &want_back) {
        return Some(format!("inverse: {e}"));
    }
    let err = roundtrip_error(&back, &input, &want_back);
    if err.is_nan() || err > roundtrip_bound::<T>() {
        return Some(format!("inverse(forward(x)) is {err:e} from x (bound {:e})", roundtrip_bound::<T>()));
    }
    None
}

/// The whole matrix for one dtype.
fn matrix<T: TestElem>(test: &str) {
    let Some(g) = gpu(test) else { return };
    let seed = test_seed(test);
    let mut failures = Vec::new();
    let mut cases = 0;
    // Both sources of cos and sin (the library's table, computed), both styles.
    for (source, style) in
        [CosSin::Table, CosSin::Computed].into_iter().flat_map(|s| [(s, RopeStyle::NeoX), (s, RopeStyle::GptJ)])
    {
        // Both kernel families at this size: one head a thread (what few tokens get) and
        // several (what many tokens get).
        for ((hd, rot), grouping) in [(128, 128), (128, 64), (80, 32), (256, 256), (64, 64)]
            .into_iter()
            .flat_map(|d| [(d, HeadGrouping::One), (d, HeadGrouping::Several)])
        {
            let config = RopeConfig::new(hd, MAX_POS)
                .rotary_dim(rot)
                .style(style)
                .dtype(T::DTYPE)
                .base(10_000.0)
                .grouping(grouping)
                .cos_sin(source);
            let rope = Rope::new(&g.kernels, config).unwrap();
            for heads in [(32, 8), (17, 1), (8, 8)] {
                for kind in [Storage::Bshd, Storage::Bhsd, Storage::PackedQkv, Storage::PackedOdd] {
                    for pos_kind in [PosKind::Ids32, PosKind::Ids64, PosKind::Offsets, PosKind::Offsets64] {
                        for in_place in [true, false] {
                            cases += 1;
                            let case_seed = seed.wrapping_add(cases);
                            if let Some(e) = case::<T>(&g, &rope, kind, heads, pos_kind, in_place, case_seed) {
                                failures.push(format!(
                                    "{} {source:?} {style:?} hd {hd} rot {rot} {grouping:?} heads {heads:?} {kind:?} {pos_kind:?} in_place {in_place} seed {case_seed}: {e}",
                                    T::NAME
                                ));
                            }
                        }
                    }
                }
            }
        }
    }
    assert_eq!(cases, 2 * 2 * 5 * 2 * 3 * 4 * 4 * 2);
    assert!(
        failures.is_empty(),
        "{} of {cases} cases failed:\n{}",
        failures.len(),
        failures[..failures.len().min(20)].join("\n")
    );
}

#[test]
fn matrix_f32() {
    matrix::<f32>("matrix_f32");
}

#[test]
fn matrix_f16() {
    matrix::<half::f16>("matrix_f16");
}

#[test]
fn matrix_bf16() {
    matrix::<half::bf16>("matrix_bf16");
}

/// Tokens with positions outside the table are left untouched and reported; the rest are
/// rotated; checked mode reports at the call.
#[test]
fn out_of_range_positions_are_skipped_and_reported() {
    let test = "out_of_range_positions_are_skipped_and_reported";
    let Some(g) = gpu(test) else { return };
    let seed = test_seed(test);
    let (tokens, heads, d) = (8, 4, 64);
    let layout = Layout::packed(tokens, heads, d);
    let n = layout.extent().unwrap();
    let x: Vec<half::bf16> = (0..n as u64).map(|i| half::bf16::from_f32(uniform(seed, 0, i))).collect();
    let config = RopeConfig::new(d, 100).dtype(DType::BF16);
    let rope = Rope::new(&g.kernels, config.clone()).unwrap();
    // Tokens 2, 5 and 7 are out of range (i64 ids, one past 2^32).
    let ids: Vec<i64> = vec![0, 99, 100, 3, 4, -1, 6, 1 << 40];
    let bad = [2usize, 5, 7];
    let ids_buf = upload_t(&ids);
    let mut q = upload_t(&x);
    let mut out = upload_t(&vec![half::bf16::from_bits(0x7FA5); n]);
    for in_place in [true, false] {
        if in_place {
            let mut qv = TensorMut::new(&mut q, layout);
            rope.apply(RopeArgs::in_place(&mut qv, Positions::ids_i64(&ids_buf)), &g.stream).unwrap();
        } else {
            let q_in = upload_t(&x);
            let mut ov = TensorMut::new(&mut out, layout);
            rope.apply(RopeArgs::into(&Tensor::new(&q_in, layout), &mut ov, Positions::ids_i64(&ids_buf)), &g.stream)
                .unwrap();
        }
        let err = rope.check_errors(&g.stream).unwrap_err();
        assert!(
            matches!(err, Error::PositionOutOfRange { token: 2, position: 100, max_position: 100, count: 3 }),
            "{err:?}"
        );
        rope.check_errors(&g.stream).expect("the record is cleared once read");
        let got = download_t(if in_place { &q } else { &out });
        for (t, &id) in ids.iter().enumerate() {
            for h in 0..heads {
                let r = row_range(&layout, 0, t, h);
                if bad.contains(&t) {
                    let untouched =
                        if in_place { x[r.clone()].to_vec() } else { vec![half::bf16::from_bits(0x7FA5); d] };
                    assert!(
                        got[r.clone()].iter().zip(&untouched).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "token {t} was written"
                    );
                } else {
                    let xs: Vec<f64> = x[r.clone()].iter().map(|v| v.to_f64()).collect();
                    let y = rope_row(&xs, id as f64, 10_000.0, d, RopeStyle::NeoX, Direction::Forward);
                    for (j, i) in r.enumerate() {
                        assert!(got[i].ulps(<half::bf16 as TestElem>::round(y[j])) <= 1, "token {t} head {h} dim {j}");
                    }
                }
            }
        }
    }
    // Position 2^40 saturates in the report; checked mode reports at the call.
    let checked = Rope::new(&g.kernels, config.checked(true)).unwrap();
    let only_huge = upload_t(&[1i64 << 40]);
    let one = Layout::packed(1, heads, d);
    let mut q1 = upload_t(&x[..one.extent().unwrap()]);
    let err = checked
        .apply(RopeArgs::in_place(&mut TensorMut::new(&mut q1, one), Positions::ids_i64(&only_huge)), &g.stream)
        .unwrap_err();
    assert!(
        matches!(err, Error::PositionOutOfRange { token: 0, position, count: 1, .. } if position == i32::MAX as i64),
        "{err:?}"
    );
    // Offsets that run past the table: sequence 1 starts at 98, so its tokens 2.. are out.
    let offsets = upload_t(&[0i32, 98]);
    let two = Layout::bshd(2, 4, heads, d);
    let mut q2 = upload_t(&vec![half::bf16::from_f32(0.5); two.extent().unwrap()]);
    let err = checked
        .apply(RopeArgs::in_place(&mut TensorMut::new(&mut q2, two), Positions::offsets_i32(&offsets)), &g.stream)
        .unwrap_err();
    assert!(matches!(err, Error::PositionOutOfRange { token: 6, position: 100, count: 2, .. }), "{err:?}");
}

/// A typed error from the GPU path too: the wrong dtype for the configuration.
#[test]
fn dtype_must_match_the_configuration() {
    let Some(g) = gpu("dtype_must_match_the_configuration") else { return };
    let rope = Rope::new(&g.kernels, RopeConfig::new(64, 16).dtype(DType::F16)).unwrap();
    let layout = Layout::packed(2, 1, 64);
    let mut q = upload_t(&[0.5f32; 128]);
    let err = rope
        .apply(RopeArgs::in_place(&mut TensorMut::new(&mut q, layout), Positions::sequential()), &g.stream)
        .unwrap_err();
    assert!(matches!(err, Error::DType { what: "q", expected: DType::F16, got: DType::F32 }), "{err:?}");
    g.stream.synchronize().unwrap();
    assert!(download_t(&q).iter().all(|&v| v == 0.5));
}

/// The other head dims models use (96, 112, 192, 512), full and partial, both styles, in
/// every dtype: the same checks as the matrix on a smaller grid.
#[test]
fn head_dims_96_112_192_512() {
    let test = "head_dims_96_112_192_512";
    let Some(g) = gpu(test) else { return };
    let seed = test_seed(test);
    let mut failures = Vec::new();
    let mut cases = 0u64;
    for style in [RopeStyle::NeoX, RopeStyle::GptJ] {
        for (hd, rot) in [(96, 96), (96, 32), (112, 112), (192, 192), (192, 96), (512, 512), (512, 128)] {
            let dtypes = [DType::F32, DType::F16, DType::BF16];
            for (dtype, grouping) in
                dtypes.into_iter().flat_map(|d| [(d, HeadGrouping::One), (d, HeadGrouping::Several)])
            {
                let config = RopeConfig::new(hd, MAX_POS).rotary_dim(rot).style(style).dtype(dtype).grouping(grouping);
                let rope = Rope::new(&g.kernels, config).unwrap();
                for kind in [Storage::Bshd, Storage::PackedQkv, Storage::PackedOdd] {
                    for in_place in [true, false] {
                        cases += 1;
                        let s = seed.wrapping_add(cases);
                        let e = match dtype {
                            DType::F32 => case::<f32>(&g, &rope, kind, (4, 2), PosKind::Ids32, in_place, s),
                            DType::F16 => case::<half::f16>(&g, &rope, kind, (4, 2), PosKind::Ids32, in_place, s),
                            DType::BF16 => case::<half::bf16>(&g, &rope, kind, (4, 2), PosKind::Ids32, in_place, s),
                            DType::E4M3 | DType::E5M2 => unreachable!("not in the list"),
                        };
                        if let Some(e) = e {
                            failures.push(format!(
                                "{dtype:?} {style:?} hd {hd} rot {rot} {grouping:?} {kind:?} in_place {in_place} seed {s}: {e}"
                            ));
                        }
                    }
                }
            }
        }
    }
    assert_eq!(cases, 2 * 7 * 3 * 2 * 3 * 2);
    assert!(failures.is_empty(), "{} of {cases} cases failed:\n{}", failures.len(), failures.join("\n"));
}
