//! The f64 CPU reference against golden vectors from the seed's PyTorch module, run in
//! float64 on a CUDA machine (`tests/data/make_golden.py`). Runs on every machine.

mod common;

use approx::assert_relative_eq;
use common::{golden, row_start};
use rope_cuda::reference::{rope_neox_row, uniform, uniform_vec};

/// The Rust generator reproduces the script's (values printed by numpy's version).
#[test]
fn generator_matches_the_python_script() {
    let expected = [-0.2636209726333618, 0.05343592166900635, 0.4753984212875366];
    for (i, e) in expected.iter().enumerate() {
        assert_eq!(uniform(1, 0, i as u64) as f64, *e);
    }
    assert_eq!(uniform(3, 1, 1 << 26) as f64, -0.9194824695587158);
}

/// Compares every stored row, and the whole-output moments where stored.
fn check(name: &str) {
    let g = golden(name);
    assert!(!g.rows.is_empty());
    for (t, [b, h, n], want) in &g.rows {
        let shape = if *t == 0 { g.q_shape } else { g.k_shape };
        let start = row_start(shape, *b, *h, *n) as u64;
        let x: Vec<f64> = (0..g.dim as u64).map(|i| uniform(g.seed, *t as u64, start + i) as f64).collect();
        let got = rope_neox_row(&x, *n as f64, g.base);
        // Angles reach 2^20 rad: two f64 computations of them differ by a few ulps of the
        // angle, about 2e-16 * n, on unit-sized values.
        let tol = 1e-14 + 4e-16 * *n as f64;
        for (d, (g_, w)) in got.iter().zip(want).enumerate() {
            assert!((g_ - w).abs() <= tol, "{name}: tensor {t} row ({b},{h},{n}) dim {d}: {g_} vs golden {w}");
        }
    }
    if let Some(moments) = g.moments {
        for (t, shape) in [g.q_shape, g.k_shape].into_iter().enumerate() {
            let [bs, hs, ns, d] = shape;
            let x = uniform_vec(g.seed, t as u64, bs * hs * ns * d);
            let w = uniform_vec(g.seed, 2 + t as u64, x.len());
            let (mut sum, mut sumsq, mut wsum) = (0.0, 0.0, 0.0);
            for row in 0..bs * hs * ns {
                let n = row % ns;
                let xs: Vec<f64> = x[row * d..(row + 1) * d].iter().map(|&v| v as f64).collect();
                for (i, o) in rope_neox_row(&xs, n as f64, g.base).into_iter().enumerate() {
                    sum += o;
                    sumsq += o * o;
                    wsum += o * w[row * d + i] as f64;
                }
            }
            let [gs, gq, gw] = moments[t];
            assert_relative_eq!(sumsq, gq, max_relative = 1e-12);
            // Sums of signed terms: compare against the scale of the terms.
            let scale = (sumsq * x.len() as f64).sqrt();
            assert!((sum - gs).abs() <= 1e-12 * scale, "{name} tensor {t}: sum {sum} vs {gs}");
            assert!((wsum - gw).abs() <= 1e-12 * scale, "{name} tensor {t}: weighted sum {wsum} vs {gw}");
        }
    }
}

#[test]
fn seed_shape_matches_golden() {
    check("golden_seed.bin");
}

#[test]
fn odd_shape_matches_golden() {
    check("golden_odd.bin");
}

#[test]
fn positions_up_to_2_pow_20_match_golden() {
    let g = golden("golden_large_pos.bin");
    assert!(g.rows.iter().any(|(_, [_, _, n], _)| *n == 1 << 20));
    check("golden_large_pos.bin");
}
