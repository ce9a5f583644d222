//! The kernels' pair rotation (shared code, run here on the CPU) against f64: every output,
//! narrowed to bf16 or f16, is within one ulp of the correctly rounded exact result, also
//! where the two products cancel. The kernels take the fast form unless `needs_precise`
//! flags an output, then the compensated form: both branches are checked. Runs on every
//! machine. Also the kernels' fast division.

use rope_cuda::reference::{splitmix64, uniform, RefElem};
use rope_cuda::DType;
use rope_cuda_kernels::math::{rotate_pair, rotate_pair_fast, split_f64, Narrow};
use rope_cuda_kernels::params::FastDiv;

/// Rotates with the kernels' arithmetic and decision and checks both outputs for `T`.
fn check<T: RefElem>(x0: T, x1: T, angle: f64, flagged: &mut usize) -> Result<(), String> {
    let narrow = if T::DTYPE == DType::BF16 { Narrow::BF16 } else { Narrow::F16 };
    let (s, c) = angle.sin_cos();
    let (a, b) = (x0.to_f64(), x1.to_f64());
    let ((ch, cl), (sh, sl)) = (split_f64(c), split_f64(s));
    let fast = rotate_pair_fast(a as f32, b as f32, ch, sh);
    let precise = rotate_pair(a as f32, b as f32, (ch, cl), (sh, sl));
    let use_precise = narrow.pair_needs_precise(fast, a as f32, b as f32);
    assert_eq!(
        use_precise,
        narrow.needs_precise(fast.0, a as f32, b as f32) || narrow.needs_precise(fast.1, a as f32, b as f32)
    );
    *flagged += use_precise as usize;
    let kernel = if use_precise { precise } else { fast };
    for (name, (y0, y1)) in [("kernel", kernel), ("precise", precise)] {
        for (got, exact) in [(y0, a * c - b * s), (y1, b * c + a * s)] {
            let (got, want) = (T::from_f32(got), T::round(exact));
            if got.ulps(want) > 1 {
                return Err(format!(
                    "{} {name} x=({a}, {b}) angle {angle}: {got:?} vs {want:?} (exact {exact:e})",
                    T::NAME
                ));
            }
        }
    }
    Ok(())
}

fn sweep<T: RefElem>() {
    let (mut failures, mut flagged) = (Vec::new(), 0);
    for i in 0..200_000u64 {
        let angle = (splitmix64(i) >> 11) as f64 * 2f64.powi(-53) * 2.0e6;
        let x0 = T::from_f32(uniform(1, 0, i));
        // Half the cases: x1 chosen so that x0 cos - x1 sin nearly cancels.
        let x1 = if i % 2 == 0 {
            T::from_f32(uniform(1, 1, i))
        } else {
            let (s, c) = angle.sin_cos();
            T::round(x0.to_f64() * c / s)
        };
        if x1.to_f64().is_finite() {
            if let Err(e) = check(x0, x1, angle, &mut flagged) {
                failures.push(e);
            }
        }
    }
    assert!(failures.is_empty(), "{} failures, e.g.\n{}", failures.len(), failures[..failures.len().min(5)].join("\n"));
    // The cancelling half must exercise the exact path; random data rarely does.
    assert!(flagged > 1000, "only {flagged} cases took the exact path");
}

/// On random data the exact path is rare (it costs a reload where it runs).
#[test]
fn exact_path_is_rare_on_random_data() {
    for (narrow, max_rate) in [(Narrow::BF16, 1e-4), (Narrow::F16, 1e-3)] {
        let n = 1_000_000u64;
        let hits = (0..n)
            .filter(|&i| {
                let (x0, x1) = (uniform(3, 0, i), uniform(3, 1, i));
                let (s, c) = ((splitmix64(i) % 100_000) as f64 * 0.37).sin_cos();
                let (y0, y1) = rotate_pair_fast(x0, x1, c as f32, s as f32);
                narrow.pair_needs_precise((y0, y1), x0, x1)
            })
            .count();
        assert!((hits as f64 / n as f64) < max_rate, "{narrow:?}: {hits} of {n} pairs need the exact path");
    }
}

#[test]
fn bf16_within_one_ulp_under_cancellation() {
    sweep::<half::bf16>();
}

#[test]
fn f16_within_one_ulp_under_cancellation() {
    sweep::<half::f16>();
}

/// The plain f32 evaluation with an f32 table misses by many ulps on such inputs: the
/// compensated form is what makes the bound hold.
#[test]
fn naive_f32_evaluation_would_fail() {
    let mut worst = 0;
    for i in 0..20_000u64 {
        let angle = 0.3 + i as f64 * 1e-3;
        let (s, c) = angle.sin_cos();
        let x0 = half::bf16::from_f32(uniform(2, 0, i));
        let x1 = <half::bf16 as RefElem>::round(x0.to_f64() * c / s);
        let naive = x0.to_f32() * c as f32 - x1.to_f32() * s as f32;
        let exact = x0.to_f64() * c - x1.to_f64() * s;
        worst = worst.max(half::bf16::from_f32(naive).ulps(<half::bf16 as RefElem>::round(exact)));
    }
    assert!(worst > 1, "the cancelling inputs do not stress the arithmetic");
}

/// The multiply-and-shift division the KV kernels use equals `/` and `%`: every divisor up to
/// 4096 and the edges of the range against numerators at the edges and spread over `u32`.
#[test]
fn fast_division_is_exact() {
    let mut divisors: Vec<u32> = (1..=4096).collect();
    for k in 12..32 {
        divisors.extend([(1u32 << k) - 1, 1 << k, (1 << k) + 1]);
    }
    divisors.extend([u32::MAX - 1, u32::MAX, 0x8000_0001, 641, 6_700_417]);
    let mut state = 0x5eed_u64;
    for &d in &divisors {
        let f = FastDiv::new(d);
        let mut numerators = vec![0, 1, d - 1, d, d.wrapping_add(1), u32::MAX, u32::MAX - 1, 1 << 31, (1 << 31) - 1];
        numerators.extend((1..8).map(|m| d.wrapping_mul(m)).flat_map(|x| [x.wrapping_sub(1), x, x.wrapping_add(1)]));
        for _ in 0..64 {
            state = splitmix64(state);
            numerators.push(state as u32);
        }
        for n in numerators {
            assert_eq!(f.divmod(n), (n / d, n % d), "{n} / {d}");
        }
    }
}
