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
                Some(v) => assert_eq!(f.to_f32(c) as f64, v, "{f:?} {c:#04x}"),
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

/// `Fp8::margin` is a safe distance: every f32 nearer to `q` than it converts to `q`'s code
/// (checked at the nearest f32 on each side inside it: the conversion is monotone), and it is
/// not uselessly small (the kernels redo a lane whenever it is below the fast path's error).
#[test]
fn margins_keep_the_code() {
    use rope_cuda::reference::splitmix64;
    let seed = common::test_seed("fp8::margins_keep_the_code");
    let mut xs = common::fp8_inputs(seed);
    // Points right at and beside every midpoint and code, where the margin must be 0 or tiny.
    for f in [Fp8::E4M3, Fp8::E5M2] {
        for c in 0u8..0x7F {
            let v = f.to_f32(c);
            if v.is_finite() {
                xs.extend([v, f32::from_bits(v.to_bits() + 1), f32::from_bits(v.to_bits().max(1) - 1)]);
            }
        }
    }
    let (mut checked, mut tiny) = (0usize, 0usize);
    for f in [Fp8::E4M3, Fp8::E5M2] {
        for &q in &xs {
            let m = f.margin(q);
            assert!(m >= 0.0 && m <= q.abs() || q.is_nan(), "{f:?} margin({q:e}) = {m:e}");
            if m == 0.0 {
                continue;
            }
            let code = f.from_f32(q);
            for side in [1.0f32, -1.0] {
                // The f32 farthest from q on this side still strictly within the margin.
                // (q + side m is exact in f64; the f32 nearest it is at most half an ulp out,
                // so one step toward q brings it inside.)
                let mut inside = (q as f64 + side as f64 * m as f64) as f32;
                if (inside as f64 - q as f64).abs() >= m as f64 {
                    inside = if side > 0.0 { inside.next_down() } else { inside.next_up() };
                }
                assert_eq!(f.from_f32(inside), code, "{f:?}: q {q:e}, margin {m:e}, at {inside:e}");
                checked += 1;
            }
            if q.abs() > 1e-3 && q.abs() < f.max() && m < q.abs() * 2f32.powi(-20) {
                tiny += 1;
            }
        }
    }
    assert!(checked > 1_000_000, "{checked}");
    // Random values lie farther than 2^-20 of themselves from every midpoint except about
    // 2^-20 * 2^m of them; the structured points above are all tiny.
    assert!(tiny < 20_000, "{tiny} margins below 2^-20 of their value");
    let _ = splitmix64;
}

/// The exact `a * b + c * d + e * f + g * h` of f32 operands, rounded to the nearest f32:
/// each product is exact in f64, their sum is kept as a double-double, and a tie of the f32
/// rounding is settled by the low part.
fn exact_dot4(t: [(f32, f32); 4]) -> f32 {
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
        return if (lo > 0.0) == (diff > 0.0) { (hi + diff) as f32 } else { (hi - diff) as f32 };
    }
    r
}

/// `rotate_pair_rounded` is the f32 nearest the exact rotation by the split cos and sin,
/// unless the rotation cancels to below about 2^-20 of its inputs (then within an ulp and
/// 2^-46 of the terms: its sum before the last rounding is that close); the fast rotation
/// often misses it.
#[test]
fn the_rounded_rotation_is_the_nearest_f32() {
    use rope_cuda::reference::splitmix64;
    use rope_cuda_kernels::math::{rotate_pair_fast, rotate_pair_rounded, split_f64};
    let seed = common::test_seed("fp8::the_rounded_rotation_is_the_nearest_f32");
    let (mut fast_off, mut n, mut cancelled) = (0, 0, 0);
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
        let scale = (x0.abs() + x1.abs()) as f64;
        for (y, e) in [(y0, e0), (y1, e1)] {
            if (e.abs() as f64) < scale * 2f64.powi(-20) {
                cancelled += 1;
                // Within the sum's error (2^-46 of the terms), rounded: an ulp of the result.
                let (err, ulp) = ((y as f64 - e as f64).abs(), (e.abs().next_up() - e.abs()) as f64);
                assert!(err <= scale * 2f64.powi(-46) + ulp, "({x0:e}, {x1:e}) at {angle}: {y:e} vs {e:e}");
            } else {
                assert_eq!(y, e, "({x0:e}, {x1:e}) at {angle}");
            }
        }
        let (f0, f1) = rotate_pair_fast(x0, x1, cs.0, ss.0);
        fast_off += usize::from(f0 != e0) + usize::from(f1 != e1);
        n += 2;
    }
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
