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
