//! The kernels' FP8 conversion (`rope_cuda_kernels::fp8`, the portable twin of sm_89's
//! `cvt.rn.satfinite`, run here on the CPU) against an independent reference: the formats'
//! values from their definition in f64, and the nearest one to each input (ties to the even
//! code, saturating to the largest finite, every NaN to 0x7F). Runs on every machine; the
//! hardware conversion is compared with the twin on the GPU.

mod common;

use rope_cuda_kernels::fp8::{Fp8, NAN};

/// Code `c`'s value from the format's definition (`None`: NaN; E5M2's infinities as such).
fn value(f: Fp8, c: u8) -> Option<f64> {
    let (m, bias) = match f {
        Fp8::E4M3 => (3, 7),
        Fp8::E5M2 => (2, 15),
    };
    let sign = if c & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, frac) = (((c & 0x7F) >> m) as i32, (c & ((1 << m) - 1)) as f64);
    match f {
        Fp8::E4M3 if c & 0x7F == 0x7F => return None,
        Fp8::E5M2 if e == 31 => return (frac == 0.0).then_some(sign * f64::INFINITY),
        _ => {}
    }
    let scale = (1u32 << m) as f64;
    Some(match e {
        0 => sign * frac / scale * 2f64.powi(1 - bias),
        _ => sign * (1.0 + frac / scale) * 2f64.powi(e - bias),
    })
}

/// The reference conversion of `x`.
fn reference(f: Fp8, finite: &[(f64, u8)], x: f32) -> u8 {
    if x.is_nan() {
        return NAN;
    }
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = (x as f64).abs().min(f.max() as f64);
    // The nearest of the non-negative finite values; on a tie, the even code.
    let mut best = finite[0];
    for &(v, c) in finite {
        let (d, db) = ((v - a).abs(), (best.0 - a).abs());
        if d < db || (d == db && c & 1 == 0) {
            best = (v, c);
        }
    }
    sign | best.1
}

/// Checks every input of `xs` for both formats; returns how many were checked.
fn check(xs: impl IntoIterator<Item = f32> + Clone) -> usize {
    let mut n = 0;
    for f in [Fp8::E4M3, Fp8::E5M2] {
        let finite: Vec<(f64, u8)> =
            (0u8..0x80).filter_map(|c| value(f, c).filter(|v| v.is_finite()).map(|v| (v, c))).collect();
        for x in xs.clone() {
            let (got, want) = (f.from_f32(x), reference(f, &finite, x));
            assert_eq!(got, want, "{f:?}: {x:e} ({:#010x}) gave {got:#04x}, want {want:#04x}", x.to_bits());
            // The host's pack2 is the twin, packed as the instruction packs.
            assert_eq!(f.pack2(x, -x), ((want as u16) << 8) | f.from_f32(-x) as u16);
            n += 1;
        }
    }
    n
}

#[test]
fn decoding_matches_the_definition() {
    for f in [Fp8::E4M3, Fp8::E5M2] {
        for c in 0..=255u8 {
            match value(f, c) {
                None => assert!(f.to_f32(c).is_nan(), "{f:?} {c:#04x}"),
                Some(v) => {
                    assert_eq!(f.to_f32(c) as f64, v, "{f:?} {c:#04x}");
                    // Zeros too: the sign bit is the code's.
                    assert_eq!(f.to_f32(c).is_sign_negative(), c & 0x80 != 0, "{f:?} {c:#04x}");
                }
            }
        }
        assert_eq!(f.to_f32(f.max_code()), f.max());
    }
    assert_eq!(Fp8::E4M3.to_f32(0x01), 2f32.powi(-9)); // smallest subnormal
    assert_eq!(Fp8::E5M2.to_f32(0x01), 2f32.powi(-16));
}

#[test]
fn every_value_and_every_midpoint() {
    let mut xs = vec![];
    for f in [Fp8::E4M3, Fp8::E5M2] {
        // The non-negative values (the negative ones: `check` converts `-x` too).
        let mut vals: Vec<f64> = (0u8..0x80).filter_map(|c| value(f, c)).filter(|v| v.is_finite()).collect();
        vals.sort_by(f64::total_cmp);
        for w in vals.windows(2) {
            let (lo, hi) = (w[0], w[1]);
            let mid = ((lo + hi) / 2.0) as f32; // exact: both are short binary fractions
            assert_eq!(mid as f64, (lo + hi) / 2.0);
            xs.extend([lo as f32, mid, f32::from_bits(mid.to_bits() - 1), f32::from_bits(mid.to_bits() + 1)]);
        }
        // Around the largest finite: the step past it, its midpoint, and beyond.
        let (max, step) = (f.max(), f.max() - f.to_f32(f.max_code() - 1));
        for x in [max, max + step / 2.0, max + step, max * 2.0, f32::MAX] {
            xs.extend([x, -x, f32::from_bits(x.to_bits() - 1), f32::from_bits(x.to_bits() + 1)]);
        }
    }
    let specials = [
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::NAN,
        f32::from_bits(0x7F80_0001),
        f32::from_bits(0xFFC0_1234),
        f32::from_bits(1),
        f32::MIN_POSITIVE,
        -f32::MIN_POSITIVE,
    ];
    xs.extend(specials);
    let n = check(xs.iter().copied());
    assert!(n > 2000, "{n}");
    // Ties go to the even code, and NaN and saturation as the instruction does them.
    assert_eq!(Fp8::E4M3.from_f32(f32::NAN), 0x7F);
    assert_eq!(Fp8::E4M3.from_f32(-f32::NAN), 0x7F);
    assert_eq!(Fp8::E4M3.from_f32(f32::INFINITY), 0x7E);
    assert_eq!(Fp8::E4M3.from_f32(f32::NEG_INFINITY), 0xFE);
    assert_eq!(Fp8::E5M2.from_f32(f32::INFINITY), 0x7B);
    assert_eq!(Fp8::E4M3.from_f32(-0.0), 0x80);
    assert_eq!(Fp8::E4M3.from_f32(17.0), 0x58); // 17 is between 16 (0x58) and 18 (0x59): even
    assert_eq!(Fp8::E4M3.from_f32(19.0), 0x5A); // between 18 (0x59) and 20 (0x5A): even
    assert_eq!(Fp8::E4M3.from_f32(2f32.powi(-10)), 0x00); // half the smallest subnormal: even
    assert_eq!(Fp8::E4M3.from_f32(3.0 * 2f32.powi(-10)), 0x02); // 1.5 subnormal steps: even
}

#[test]
fn random_bits_and_random_values() {
    // The inputs the GPU test converts: every value and midpoint again, then 600,000 seeded
    // random bit patterns and values spread over both formats' ranges.
    let seed = common::test_seed("fp8::random_bits_and_random_values");
    let xs = common::fp8_inputs(seed);
    assert_eq!(check(xs.iter().copied()), 2 * xs.len());
}

/// The kernels' FP8 rotations keep the fast quotient (the fast rotation times the scale's
/// reciprocal) where both ends of its interval (`quotient_bound`) convert to one code: the
/// bound must hold the quotient of the exact path (the rounded rotation divided by the scale,
/// IEEE) and that code must be the exact path's. Pairs of every magnitude (f32 subnormals to
/// 2^20), angles at random and at zero (the inputs themselves, chosen next to FP8 midpoints),
/// scales across the range; the check settles most lanes (else the kernels would take the
/// slow path everywhere) and sends the ones next to a midpoint to the exact path.
#[test]
fn fast_quotients_within_their_bound_keep_the_code() {
    use rope_cuda::reference::splitmix64;
    use rope_cuda_kernels::fp8::quotient_bound;
    use rope_cuda_kernels::math::{rotate_pair_fast, rotate_pair_rounded, split_f64};
    let seed = common::test_seed("fp8::fast_quotients_within_their_bound_keep_the_code");
    let mut scales = vec![3.7f32, 1.0, 0.1, 1.5 / 224.0, 448.0, 1e-30, 1e30, -2.5, f32::MIN_POSITIVE, 1e-38];
    scales.extend((0..40u64).map(|i| f32::from_bits(0x2000_0000 + (splitmix64(seed ^ i) as u32 % 0x3F00_0000))));
    let (mut n, mut settled, mut near, mut near_redone) = (0usize, 0usize, 0usize, 0usize);
    let (mut typical, mut typical_settled) = (0usize, 0usize);
    for (si, &scale) in scales.iter().enumerate() {
        let r = 1.0 / scale;
        for i in 0..20_000u64 {
            let z = splitmix64(seed ^ ((si as u64) << 32) ^ i);
            let sign = |bit: u64| if z >> bit & 1 == 1 { -1.0f32 } else { 1.0 };
            let f = if z >> 60 & 1 == 0 { Fp8::E4M3 } else { Fp8::E5M2 };
            // Every fourth pair: angle zero, x0 next to a midpoint of the codes once divided.
            let tie = i % 4 == 0;
            let (x0, x1, angle) = if tie {
                let c = (z as u8 & 0x7E) as u8;
                let mid = (f.to_f32(c) as f64 + f.to_f32(c + 1) as f64) / 2.0 * scale as f64;
                let off = ((z >> 8) as u32 % 64) as i32 - 32;
                let x0 = f32::from_bits(((mid as f32).to_bits() as i32 + off) as u32) * sign(62);
                (x0, f32::from_bits(0x3F00_0000 | (z >> 20) as u32 & 0x7F_FFFF), 0.0)
            } else {
                // Magnitudes 2^-149 (bits) to 2^20, bf16-like or f32.
                let e = (z >> 8) as u32 % 170;
                let m = if z >> 61 & 1 == 0 { (z >> 16) as u32 & 0x7F_0000 } else { (z >> 16) as u32 & 0x7F_FFFF };
                let x0 = f32::from_bits((e << 23 | m).min(0x4980_0000)) * sign(62);
                let x1 =
                    f32::from_bits(((e + (z >> 40) as u32 % 7).min(170) << 23 | m >> 3).min(0x4980_0000)) * sign(63);
                (x0, x1, (z >> 32) as f64 / 2f64.powi(32) * std::f64::consts::TAU)
            };
            let (sa, ca) = angle.sin_cos();
            let (cs, ss) = (split_f64(ca), split_f64(sa));
            let fast = rotate_pair_fast(x0, x1, cs.0, ss.0);
            let exact = rotate_pair_rounded(x0, x1, cs, ss);
            let e = quotient_bound(x0, x1, r);
            for (k, (y, yx)) in [(fast.0, exact.0), (fast.1, exact.1)].into_iter().enumerate() {
                let (q, qx) = (y * r, yx / scale);
                n += 1;
                if q.is_finite() && qx.is_finite() && e.is_finite() {
                    assert!(
                        (q as f64 - qx as f64).abs() <= e as f64,
                        "({x0:e}, {x1:e}) / {scale:e}: {q:e} vs {qx:e}, bound {e:e}"
                    );
                }
                let (lo, hi) = (f.from_f32(q - e), f.from_f32(q + e));
                let exact_code = f.from_f32(qx);
                // Quotients of an FP8 value's size from inputs of a cache's (scales 2^-10 to
                // 2^10, |x| 2^-8 to 2^8): nearly all settle.
                let sized = |v: f32, lo: i32, hi: i32| v.abs() >= 2f32.powi(lo) && v.abs() <= 2f32.powi(hi);
                if !tie && sized(scale, -10, 10) && sized(x0, -8, 8) && sized(x1, -8, 8) && sized(qx, -6, 8) {
                    typical += 1;
                    typical_settled += usize::from(lo == hi);
                }
                if lo == hi {
                    assert_eq!(lo, exact_code, "{f:?}: ({x0:e}, {x1:e}) at {angle} / {scale:e}: {q:e} vs {qx:e}");
                    settled += 1;
                }
                // The tie cases' first output is x0 / scale, within 2^-18 of a midpoint: the
                // check must send many of them to the exact path.
                if tie && k == 0 {
                    near += 1;
                    near_redone += usize::from(lo != hi);
                }
            }
        }
    }
    eprintln!("settled {settled} of {n}; typical {typical_settled} of {typical}; near midpoints redone {near_redone} of {near}");
    assert!(settled > n / 2, "{settled} of {n} settled by the fast quotient");
    // (About 15,000 typical quotients a run; seed 2401745609 drew 9,801.)
    assert!(typical > 5_000 && typical_settled > typical / 100 * 99, "{typical_settled} of {typical} typical settled");
    assert!(near > 1000 && near_redone > near / 4, "{near_redone} of {near} near midpoints redone");
}

/// The KV shift's fast path for FP8 inputs (`rotate_lane`'s, `rope_cuda_kernels::rotate`): the
/// codes' values rotated as they are, the scale left out both ways, the bound
/// `quotient_bound(x0, x1, 1)` where `fp8::scale_cancels(scale)` (else infinite). Every code it
/// settles (both ends of the bound convert to it) must be the exact path's: the code of the
/// rounded rotation of the decoded pair (each code's value times the scale, an f32 product),
/// divided by the scale. Pairs of every code of both formats (NaN, E5M2's infinities and zeros
/// among them), random angles of both signs, every fourth first output next to an FP8
/// midpoint (its angle 2^-12 to 2^-43 radians off); scales across `[2^-64, 2^64]`, its ends,
/// and outside it (where nothing but a NaN may settle). Most typical pairs settle (else the
/// kernel would take the exact path everywhere) and many of those next to a midpoint do not.
#[test]
fn shifted_codes_settled_without_the_scale_keep_the_code() {
    use rope_cuda::reference::splitmix64;
    use rope_cuda_kernels::fp8::{quotient_bound, scale_cancels};
    use rope_cuda_kernels::math::{rotate_pair_fast, rotate_pair_rounded, split_f64};
    let seed = common::test_seed("fp8::shifted_codes_settled_without_the_scale_keep_the_code");
    let p2 = |e: i32| 2f32.powi(e);
    let mut scales = vec![1.0f32, 3.7, 0.1, 1.5 / 224.0, 448.0, p2(-64), p2(64), p2(-64).next_up(), p2(64).next_down()];
    // log-uniform in [2^-64, 2^64]
    scales.extend((0..40u64).map(|i| 2f32.powf((splitmix64(seed ^ !i) >> 11) as f32 / 2f32.powi(53) * 128.0 - 64.0)));
    let outside = [p2(-64).next_down(), p2(64).next_up(), 1e-30, 1e30, 0.0, -1.0, f32::NAN, f32::INFINITY];
    scales.extend(outside);
    let (mut settled, mut typical, mut typical_settled, mut near, mut near_redone) = (0usize, 0, 0, 0, 0);
    for (si, &scale) in scales.iter().enumerate() {
        let cancels = scale_cancels(scale);
        assert_eq!(cancels, !outside.iter().any(|o| o.to_bits() == scale.to_bits()), "{scale:e}");
        for i in 0..20_000u64 {
            let z = splitmix64(seed ^ ((si as u64) << 32) ^ i);
            let f = if z >> 63 == 0 { Fp8::E4M3 } else { Fp8::E5M2 };
            let (mut c0, c1) = (z as u8, (z >> 8) as u8);
            let mut angle = (z >> 16 & 0xFFFF_FFFF) as f64 / 2f64.powi(32) * std::f64::consts::TAU;
            let tie = i % 4 == 0;
            let (a, b) = if tie {
                // x1 = 0 and cos(angle) = m / x0 (a midpoint m below |x0|): y0 = x0 cos at m.
                c0 = (c0 & 0x7F).clamp(2, f.max_code()) | (c0 & 0x80);
                let k = ((z >> 48) as u8) % (c0 & 0x7F);
                let m = (f.to_f32(k) as f64 + f.to_f32(k + 1) as f64) / 2.0;
                // Off by 2^-12 to 2^-43 radians: from clearly settled to inside the bound.
                let off = 2f64.powi(-12 - (z >> 56 & 31) as i32) * if z >> 55 & 1 == 1 { -1.0 } else { 1.0 };
                angle = (m / f.to_f32(c0 & 0x7F) as f64).acos() + off;
                (f.to_f32(c0), 0.0)
            } else {
                (f.to_f32(c0), f.to_f32(c1))
            };
            let negative = z >> 62 & 1 == 1;
            let (sa, ca) = angle.sin_cos();
            let (cs, ss) = (split_f64(ca), split_f64(if negative { -sa } else { sa }));
            let fast = rotate_pair_fast(a, b, cs.0, ss.0);
            let e = if cancels { quotient_bound(a, b, 1.0) } else { f32::INFINITY };
            let exact = rotate_pair_rounded(a * scale, b * scale, cs, ss);
            for (k, (q, y)) in [(fast.0, exact.0), (fast.1, exact.1)].into_iter().enumerate() {
                let (lo, hi) = (f.from_f32(q - e), f.from_f32(q + e));
                let want = f.from_f32(y / scale);
                if lo == hi {
                    assert_eq!(lo, want, "{f:?} codes ({c0:#04x}, {c1:#04x}) at {angle} / {scale:e}: {q:e} vs {y:e}");
                    assert!(cancels || q.is_nan(), "settled outside the range: {scale:e}, {q:e}");
                    settled += 1;
                }
                let sized = |v: f32| v.abs() >= p2(-6) && v.abs() <= p2(8);
                if !tie && cancels && sized(a) && sized(b) && sized(q) {
                    typical += 1;
                    typical_settled += usize::from(lo == hi);
                }
                if tie && k == 0 && cancels {
                    near += 1;
                    near_redone += usize::from(lo != hi);
                }
            }
        }
    }
    eprintln!(
        "settled {settled}; typical {typical_settled} of {typical}; near midpoints redone {near_redone} of {near}"
    );
    assert!(
        typical > 100_000 && typical_settled > typical / 100 * 99,
        "{typical_settled} of {typical} typical settled"
    );
    assert!(near > 100_000 && near_redone > near / 4, "{near_redone} of {near} near midpoints redone");
}

/// The exact `a * b + c * d + e * f + g * h` of f32 operands, rounded to the nearest f32,
/// and the exact value itself as a double-double `(hi, lo)`: each product is exact in f64,
/// their sum is kept in two parts, and a tie of the f32 rounding is settled by the low part.
fn exact_dot4(t: [(f32, f32); 4]) -> (f32, f64, f64) {
    let two_sum = |a: f64, b: f64| {
        let s = a + b;
        let bb = s - a;
        (s, (a - (s - bb)) + (b - bb))
    };
    let (mut hi, mut lo) = (0.0f64, 0.0f64);
    for (a, b) in t {
        let (s, e) = two_sum(hi, a as f64 * b as f64);
        let (s2, e2) = two_sum(s, lo + e);
        (hi, lo) = (s2, e2);
    }
    let r = hi as f32;
    let diff = hi - r as f64;
    let half = (r.next_up() as f64 - r as f64).min(r as f64 - r.next_down() as f64) / 2.0;
    if diff.abs() == half && lo != 0.0 {
        // hi is a midpoint: the low part decides.
        let r = if (lo > 0.0) == (diff > 0.0) { (hi + diff) as f32 } else { (hi - diff) as f32 };
        return (r, hi, lo);
    }
    (r, hi, lo)
}

/// `rotate_pair_rounded` is the f32 nearest the exact rotation by the split cos and sin
/// unless the exact value lies within the sum's error of a rounding boundary: its sum before
/// the last rounding is within a few 2^-48 of the terms (five roundings of error terms, each
/// at most 2^-48 of them; `math::dot2_rounded`), so the result may be any f32 that a value
/// that close rounds to, and no other. Most cases are away from every boundary and must be
/// the nearest f32 itself; half of them cancel, where the window spans ulps of the result.
/// The fast rotation often misses the nearest f32.
#[test]
fn the_rounded_rotation_is_the_nearest_f32() {
    use rope_cuda::reference::splitmix64;
    use rope_cuda_kernels::math::{rotate_pair_fast, rotate_pair_rounded, split_f64};
    let seed = common::test_seed("fp8::the_rounded_rotation_is_the_nearest_f32");
    let (mut fast_off, mut n, mut cancelled, mut not_nearest) = (0, 0, 0, 0);
    for i in 0..200_000u64 {
        let r = splitmix64(seed ^ i);
        let x0 = f32::from_bits(0x3F00_0000 | (r as u32 & 0x7F_FFFF)) * if r >> 63 == 1 { -1.0 } else { 1.0 };
        let angle = (r >> 32) as f64 / 2f64.powi(32) * std::f64::consts::TAU;
        let (s, c) = angle.sin_cos();
        // Half the cases cancel: x1 chosen so that x0 cos nearly equals x1 sin.
        let x1 = match i % 2 {
            0 => (x0 as f64 * c / s) as f32,
            _ => f32::from_bits(0x3F00_0000 | (r >> 8) as u32 & 0x7F_FFFF),
        };
        let (cs, ss) = (split_f64(c), split_f64(s));
        let (y0, y1) = rotate_pair_rounded(x0, x1, cs, ss);
        let e0 = exact_dot4([(x0, cs.0), (x0, cs.1), (-x1, ss.0), (-x1, ss.1)]);
        let e1 = exact_dot4([(x1, cs.0), (x1, cs.1), (x0, ss.0), (x0, ss.1)]);
        // |cos|, |sin| <= 1: the terms are at most |x0| + |x1|.
        let window = (x0.abs() + x1.abs()) as f64 * 2f64.powi(-45);
        for (y, (nearest, hi, lo)) in [(y0, e0), (y1, e1)] {
            let cancels = nearest.abs() < (x0.abs() + x1.abs()) * 2f32.powi(-20);
            cancelled += usize::from(cancels);
            if y == nearest {
                continue;
            }
            // y is allowed only if every boundary between it and the nearest f32 lies within
            // the window of the exact value; the farthest is the midpoint next to y.
            not_nearest += usize::from(!cancels);
            let inward = if nearest > y { y.next_up() } else { y.next_down() };
            let boundary = (y as f64 + inward as f64) / 2.0;
            let distance = ((hi - boundary) + lo).abs();
            assert!(
                distance <= window,
                "({x0:e}, {x1:e}) at {angle}: {y:e}, nearest {nearest:e}, {distance:e} from a boundary"
            );
        }
        let (f0, f1) = rotate_pair_fast(x0, x1, cs.0, ss.0);
        fast_off += usize::from(f0 != e0.0) + usize::from(f1 != e1.0);
        n += 2;
    }
    eprintln!("{not_nearest} of {n} not cancelled and not the nearest f32, {cancelled} cancelled, fast {fast_off} off");
    // Where the rotation does not cancel, the window is a few millionths of an ulp.
    assert!(not_nearest <= n / 10_000, "{not_nearest} of {n}");
    // The fast rotation is not enough for FP8's double rounding: it misses often.
    assert!(fast_off > n / 100, "{fast_off} of {n}");
    assert!(cancelled > 1000 && cancelled <= n / 2, "{cancelled}");
}

/// `div_by` (the kernels' division by a scale: the reciprocal's product and one exact
/// correction) is the IEEE quotient wherever it is normal and the dividend above 2^-100 (so
/// the residual is normal), and converts to the same FP8 code everywhere (tiny quotients keep
/// their sign, overflows saturate, NaN stays NaN).
#[test]
fn division_by_the_reciprocal_is_exact() {
    use rope_cuda::reference::splitmix64;
    use rope_cuda_kernels::math::div_by;
    let seed = common::test_seed("fp8::division_by_the_reciprocal_is_exact");
    let mut scales = vec![3.7f32, 1.0, 0.1, 1.5 / 224.0, 448.0, 1e-30, 1e30, -2.5, f32::MIN_POSITIVE];
    scales.extend((0..200u64).map(|i| f32::from_bits(0x3000_0000 + (splitmix64(seed ^ i) as u32 % 0x1F00_0000))));
    let mut xs = common::fp8_inputs(seed);
    xs.truncate(300_000);
    let (mut exact, mut n) = (0usize, 0usize);
    for &b in &scales {
        let r = 1.0 / b;
        for &x in &xs {
            let (got, want) = (div_by(x, b, r), x / b);
            n += 1;
            if want.is_normal() && x.abs() >= 2f32.powi(-100) {
                assert_eq!(got.to_bits(), want.to_bits(), "{x:e} / {b:e}");
                exact += 1;
            }
            for f in [Fp8::E4M3, Fp8::E5M2] {
                assert_eq!(f.from_f32(got), f.from_f32(want), "{f:?}: {x:e} / {b:e}: {got:e} vs {want:e}");
            }
        }
    }
    assert!(exact > n / 2, "{exact} of {n}");
}
