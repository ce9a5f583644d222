//! The angle arithmetic of in-kernel cos/sin (issue 18), run here on the CPU: the kernels'
//! own code (`rope_cuda_kernels::math`) against an arbitrary-precision reference
//! (`astro-float`, 320-bit), at positions up to `2^31 - 1`.
//!
//! - `1 / 2π`'s 256 bits (`INV_2PI`) and each frequency's 96-bit turns (`turns_of`) are exact;
//! - `turns_at(p, turns_of(f))` is `frac(p f / 2π)` within `2^-63` turns for every `p < 2^31`;
//! - the kernels' `(sin, cos)` of those turns (`sincos_turns_pair`: f32 arithmetic only, an
//!   angle table of 256 entries) is an f32 pair within `2^-46` of the exact value of `p f`, its
//!   leading f32 within `2^-24`; also at every octant boundary of the table and on 20,000
//!   random angles, also after the attention factor (`mul_pair`); and so is the f64 reference
//!   within `2^-50`, itself computed at two precisions (320 and 256 bits), which must agree to
//!   `2^-200`.

use astro_float::{BigFloat, Consts, Radix, RoundingMode};
use rope_cuda::reference::splitmix64;
use rope_cuda_kernels::math::{
    angle_table, mul_pair, sincos_turns_pair, split_f64, turns_at, turns_of, AngleEntry, INV_2PI,
};

const P: usize = 320;
const RM: RoundingMode = RoundingMode::ToEven;

fn big(v: f64, p: usize) -> BigFloat {
    BigFloat::from_f64(v, p)
}

/// `|a - b|` as f64 (through its decimal form: enough for error sizes).
fn diff(a: &BigFloat, b: &BigFloat, cc: &mut Consts) -> f64 {
    let d = a.sub(b, P, RM).abs();
    let s = d.format(Radix::Dec, RM, cc).expect("format");
    s.parse::<f64>().unwrap_or_else(|_| panic!("parse {s}"))
}

/// The exact `(sin, cos)` of `p f` at precision `prec`: the product is exact (at most 84
/// bits), the reduction and the functions carry `prec` bits.
fn exact(p: u32, f: f64, prec: usize, cc: &mut Consts) -> (BigFloat, BigFloat) {
    let theta = BigFloat::from_u32(p, prec).mul(&big(f, prec), prec, RM);
    let two_pi = cc.pi(prec, RM).mul(&BigFloat::from_u32(2, prec), prec, RM);
    let turns = theta.div(&two_pi, prec, RM);
    let reduced = turns.fract().mul(&two_pi, prec, RM);
    (reduced.sin(prec, RM, cc), reduced.cos(prec, RM, cc))
}

/// `frac(f / 2π)` at 320 bits.
fn exact_turns(f: f64, cc: &mut Consts) -> BigFloat {
    let two_pi = cc.pi(P, RM).mul(&BigFloat::from_u32(2, P), P, RM);
    big(f, P).div(&two_pi, P, RM).fract()
}

/// A 96-bit (or 64-bit) binary fraction as a BigFloat.
fn fraction(words: &[u32]) -> BigFloat {
    let mut v = BigFloat::from_u32(0, P);
    let mut scale = BigFloat::from_u32(1, P);
    let two32 = BigFloat::from_u64(1 << 32, P);
    for &w in words {
        scale = scale.div(&two32, P, RM);
        v = v.add(&BigFloat::from_u32(w, P).mul(&scale, P, RM), P, RM);
    }
    v
}

#[test]
fn inv_2pi_has_256_exact_bits() {
    let mut cc = Consts::new().unwrap();
    let two_pi = cc.pi(P, RM).mul(&BigFloat::from_u32(2, P), P, RM);
    let inv = BigFloat::from_u32(1, P).div(&two_pi, P, RM);
    let err = diff(&fraction(&INV_2PI), &inv, &mut cc);
    assert!(err < 2f64.powi(-256), "INV_2PI is off by {err:e}");
}

/// Frequencies as models have them: several bases and dims, linear and tiny ones, and a few
/// above one turn per position.
fn frequencies() -> Vec<f64> {
    let mut fs = vec![1.0, 0.5, 1e-9, 2.5, 7.0, 1234.5678];
    for (base, dim) in
        [(10_000.0f64, 128usize), (500_000.0, 128), (1_000_000.0, 64), (5_000_000.0, 128), (10_000.0, 96)]
    {
        for i in [0, 1, 2, dim / 8, dim / 4 - 1, dim / 2 - 1] {
            let f = 1.0 / base.powf((2 * i) as f64 / dim as f64);
            fs.extend([f, f / 8.0, f / 64.0]);
        }
    }
    fs
}

#[test]
fn frequencies_become_exact_96_bit_turns() {
    let mut cc = Consts::new().unwrap();
    for f in frequencies() {
        let r = turns_of(f).unwrap();
        let err = diff(&fraction(&r), &exact_turns(f, &mut cc), &mut cc);
        assert!(err < 2f64.powi(-96), "f = {f}: turns off by {err:e}");
    }
    assert_eq!(turns_of(0.0), Some([0; 3]));
    assert_eq!(turns_of(-1.0), None);
    assert_eq!(turns_of(f64::NAN), None);
    assert_eq!(turns_of(1e10), None);
}

/// The positions the issue names, and seeded random ones.
fn positions() -> Vec<u32> {
    let mut ps = vec![0, 1, 2, 3, 1 << 20, (1 << 20) - 1, 1 << 24, 1 << 28, (1 << 28) + 12_345, (1u32 << 31) - 1];
    ps.extend((0..24).map(|i| (splitmix64(0xA11CE ^ i) % (1u64 << 31)) as u32));
    ps
}

#[test]
fn angles_at_every_position_up_to_2_pow_31_match_the_exact_reference() {
    let mut cc = Consts::new().unwrap();
    let (mut worst, mut worst_turns) = ((0f64, 0f64), 0f64);
    let fs = frequencies();
    let table = angle_table();
    for (k, p) in positions().into_iter().enumerate() {
        // Every position with a third of the frequencies (all of them over the positions).
        for &f in fs.iter().skip(k % 3).step_by(3) {
            let t = turns_at(p, turns_of(f).unwrap());
            let (es, ec) = exact(p, f, P, &mut cc);
            // The turns themselves.
            let want = BigFloat::from_u32(p, P).mul(&exact_turns(f, &mut cc), P, RM).fract();
            let got = fraction(&[(t >> 32) as u32, t as u32]);
            let e = diff(&got, &want, &mut cc);
            let e = e.min(1.0 - e); // across the wrap
            assert!(e < 2f64.powi(-63), "p {p} f {f}: turns off by {e:e}");
            worst_turns = worst_turns.max(e);
            let got = sincos_turns_pair(t, |j| table[j]);
            check_sin_cos(got, (&es, &ec), &format!("p {p} f {f}"), &mut worst, &mut cc);
        }
    }
    println!(
        "worst: turns {worst_turns:e}, f32 {:e} ({:.2} ulp of 1), pair {:e} (2^{:.1})",
        worst.0,
        worst.0 / 2f64.powi(-24),
        worst.1,
        worst.1.log2()
    );
}

/// Checks `(sin, cos)` as f32 pairs `(hi, lo)` against the exact values: each `hi` within
/// `2^-24`, each `hi + lo` within `2^-46`; folds the errors into `worst` (`hi`, pair).
fn check_sin_cos(
    (s, c): ((f32, f32), (f32, f32)),
    (es, ec): (&BigFloat, &BigFloat),
    at: &str,
    worst: &mut (f64, f64),
    cc: &mut Consts,
) {
    for (what, (hi, lo), want) in [("sin", s, es), ("cos", c, ec)] {
        let pair = big(hi as f64, P).add(&big(lo as f64, P), P, RM);
        let (e32, e_pair) = (diff(&big(hi as f64, P), want, cc), diff(&pair, want, cc));
        assert!(e32 <= 2f64.powi(-24), "{at} {what}: f32 off by {e32:e}");
        assert!(e_pair <= 2f64.powi(-46), "{at} {what}: pair off by {e_pair:e}");
        *worst = (worst.0.max(e32), worst.1.max(e_pair));
    }
}

/// `(sin, cos)` of `2π t / 2^64`, exactly (320 bits).
fn exact_of_turns(t: u64, cc: &mut Consts) -> (BigFloat, BigFloat) {
    let two_pi = cc.pi(P, RM).mul(&BigFloat::from_u32(2, P), P, RM);
    let a = fraction(&[(t >> 32) as u32, t as u32]).mul(&two_pi, P, RM);
    (a.sin(P, RM, cc), a.cos(P, RM, cc))
}

/// The kernels' f32-only sine and cosine on angles of every kind: random turns, the table's
/// own steps and their neighbours (every octant, both ends of each step), and the octant and
/// quadrant boundaries, where the reduction reflects or the values cross zero.
#[test]
fn f32_pair_sin_cos_is_within_2_pow_46_everywhere() {
    let mut cc = Consts::new().unwrap();
    let table: [AngleEntry; 256] = angle_table();
    let mut ts: Vec<u64> = (0..20_000u64).map(|i| splitmix64(0x5EED ^ i)).collect();
    for o in 0..8u64 {
        for j in (0..256u64).step_by(17).chain([255]) {
            let at = (o << 61) | (j << 53);
            ts.extend([at, at.wrapping_add(1), at.wrapping_sub(1), at | ((1 << 53) - 1), at + (1 << 52)]);
        }
    }
    ts.extend([0, 1, u64::MAX, 1 << 62, (1 << 62) - 1, 1 << 63, 3 << 62]);
    let mut worst = (0f64, 0f64);
    for t in ts {
        let (es, ec) = exact_of_turns(t, &mut cc);
        check_sin_cos(sincos_turns_pair(t, |j| table[j]), (&es, &ec), &format!("t {t:#x}"), &mut worst, &mut cc);
    }
    println!("worst: f32 {:.3} ulp of 1, pair 2^{:.2}", worst.0 / 2f64.powi(-24), worst.1.log2());
}

/// The f64 reference the other tests use (`rope_cuda::reference::sin_cos`: exact product,
/// reduction in exact turns) is within `2^-50` of the exact values at every position.
#[test]
fn the_f64_reference_is_exact_to_2_pow_50_at_every_position() {
    let mut cc = Consts::new().unwrap();
    let mut worst = 0f64;
    for p in positions() {
        for f in frequencies() {
            let (s, c) = rope_cuda::reference::sin_cos(p as f64, f);
            let (es, ec) = exact(p, f, P, &mut cc);
            let e = diff(&big(s, P), &es, &mut cc).max(diff(&big(c, P), &ec, &mut cc));
            assert!(e <= 2f64.powi(-50), "p {p} f {f}: {e:e}");
            worst = worst.max(e);
        }
    }
    println!("f64 reference: worst {worst:e}");
}

/// The reference agrees with itself at two precisions, far below what it checks.
#[test]
fn the_reference_agrees_with_itself_at_two_precisions() {
    let mut cc = Consts::new().unwrap();
    for p in [(1u32 << 31) - 1, 1 << 28, 977] {
        for f in [1.0, 0.3, 1.0 / 10_000f64.powf(0.5)] {
            let (s320, c320) = exact(p, f, 320, &mut cc);
            let (s256, c256) = exact(p, f, 256, &mut cc);
            assert!(diff(&s320, &s256, &mut cc) < 2f64.powi(-200), "sin at {p}, {f}");
            assert!(diff(&c320, &c256, &mut cc) < 2f64.powi(-200), "cos at {p}, {f}");
        }
    }
}

/// The attention factor on an f32 pair (`mul_pair`, as the kernels apply it to each sine and
/// cosine): within `2^-46` of the exact product of the two pairs, relative to the product.
#[test]
fn attention_factor_on_a_pair_keeps_its_precision() {
    let mut cc = Consts::new().unwrap();
    let table = angle_table();
    // No scaling, YaRN's `0.1 ln(s) + 1` for s = 8 and 40, and a factor below one.
    for a in [1.0, 0.1 * 8f64.ln() + 1.0, 0.1 * 40f64.ln() + 1.0, std::f64::consts::FRAC_1_SQRT_2] {
        let (ah, al) = split_f64(a);
        let exact_a = big(ah as f64, P).add(&big(al as f64, P), P, RM);
        for i in 0..2_000u64 {
            let (s, c) = sincos_turns_pair(splitmix64(0xA77E ^ i), |j| table[j]);
            for v in [s, c] {
                let got = mul_pair(v, (ah, al));
                let want = big(v.0 as f64, P).add(&big(v.1 as f64, P), P, RM).mul(&exact_a, P, RM);
                let pair = big(got.0 as f64, P).add(&big(got.1 as f64, P), P, RM);
                let e = diff(&pair, &want, &mut cc);
                let size = (v.0 as f64 * a).abs();
                assert!(e <= 2f64.powi(-46) * size + 2f64.powi(-100), "a {a} v {v:?}: off by {e:e}");
                assert!(got.1.abs() <= got.0.abs() * 2f32.powi(-23), "not renormalised: {got:?}");
            }
        }
    }
}

/// The kernels' rotation with cos and sin computed from turns (the fast f32 values, the
/// decision, the exact path on the f32 pairs), on half random and half cancelling pairs at positions up to
/// `2^31 - 1`: every 16-bit output within one ulp of the correctly rounded exact result (the
/// f64 reference above), the f32 ones within 2e-6 of the pair's size.
fn rotation_sweep<T: rope_cuda::reference::RefElem>() {
    use rope_cuda::reference::{sin_cos, uniform};
    use rope_cuda::DType;
    use rope_cuda_kernels::math::{rotate_pair, rotate_pair_fast, Narrow};
    let narrow = if T::DTYPE == DType::BF16 { Narrow::BF16 } else { Narrow::F16 };
    let fs = frequencies();
    let table = angle_table();
    let (mut flagged, mut failures) = (0usize, Vec::new());
    let cases = 200_000u64;
    for i in 0..cases {
        let p = (splitmix64(i ^ 0xBEEF) % (1u64 << 31)) as u32;
        let f = fs[(i % fs.len() as u64) as usize];
        let t = turns_at(p, turns_of(f).unwrap());
        let (s_ref, c_ref) = sin_cos(p as f64, f);
        let x0 = T::from_f32(uniform(3, 0, i));
        let x1 = if i % 2 == 0 { T::from_f32(uniform(3, 1, i)) } else { T::round(x0.to_f64() * c_ref / s_ref) };
        if !x1.to_f64().is_finite() {
            continue;
        }
        let (a, b) = (x0.to_f64() as f32, x1.to_f64() as f32);
        let (s, c) = sincos_turns_pair(t, |j| table[j]);
        let fast = rotate_pair_fast(a, b, c.0, s.0);
        let y = if narrow.pair_needs_precise(fast, a, b) {
            flagged += 1;
            rotate_pair(a, b, c, s)
        } else {
            fast
        };
        let exact = (a as f64 * c_ref - b as f64 * s_ref, b as f64 * c_ref + a as f64 * s_ref);
        for (got, want) in [(y.0, exact.0), (y.1, exact.1)] {
            let (g, w) = (T::from_f32(got), T::round(want));
            if g.ulps(w) > 1 {
                failures.push(format!("{} p {p} f {f} x=({a}, {b}): {g:?} vs {w:?} ({want:e})", T::NAME));
            }
        }
        // f32: the fast values alone.
        let err = (fast.0 as f64 - exact.0).abs().max((fast.1 as f64 - exact.1).abs());
        assert!(err <= 2e-6 * (a.abs() + b.abs()) as f64 + 1e-30, "f32 p {p} f {f}: {err:e}");
    }
    assert!(failures.is_empty(), "{} failures, e.g.\n{}", failures.len(), failures[..failures.len().min(5)].join("\n"));
    assert!(flagged > 1000, "the cancelling half takes the exact path ({flagged})");
    println!("{}: {flagged} of {} pairs took the exact path", T::NAME, cases);
}

#[test]
fn computed_rotation_is_within_one_ulp_in_bf16() {
    rotation_sweep::<half::bf16>();
}

#[test]
fn computed_rotation_is_within_one_ulp_in_f16() {
    rotation_sweep::<half::f16>();
}

/// The host's table rows (`table_row`, the rows `HostTable` and the library's table source
/// hold) are exact at every position a table can have: for every `rope_type`'s frequencies,
/// `cos + cos_lo` and `sin + sin_lo` within `2^-46` (the two-f32 split's own rounding) of the
/// exact cosine and sine of the position times the f64 frequency, times the attention
/// factor, at positions from `2^16` to `2^31 - 1`. (Rows formed from the plain f64 product
/// are off by about `1e-11` here already at `2^17`.) And `HostTable` stores those rows.
#[test]
fn table_rows_are_exact_at_every_position() {
    use rope_cuda::{table_row, HostTable, RopeConfig};
    let files = [
        include_str!("data/configs/qwen2.5-7b.json"),
        include_str!("data/configs/llama-linear.json"),
        include_str!("data/configs/llama-dynamic.json"),
        include_str!("data/configs/qwen3-yarn.json"),
        include_str!("data/configs/deepseek-v2-lite.json"),
        include_str!("data/configs/phi-3-mini-128k.json"),
        include_str!("data/configs/llama-3.1-8b.json"),
        include_str!("data/configs/gpt-j-6b.json"),
    ];
    let mut configs: Vec<RopeConfig> = files.iter().map(|j| RopeConfig::from_hf_config(j).unwrap()).collect();
    configs
        .push(RopeConfig::from_hf_config_layer(include_str!("data/configs/per-layer.json"), "full_attention").unwrap());
    let mut cc = Consts::new().unwrap();
    let mut worst = 0f64;
    for (k, config) in configs.iter().enumerate() {
        let (freqs, attention) = config.frequencies().unwrap();
        let mut positions = vec![1u32 << 16, (1 << 17) + 3, 1 << 20, (1 << 24) - 1, (1 << 31) - 1];
        positions
            .extend((0..4).map(|i| (1 << 16) + (splitmix64(77 + k as u64 * 8 + i) % ((1 << 31) - (1 << 16))) as u32));
        for &p in &positions {
            let row: Vec<[f32; 4]> = table_row(&freqs, attention, p as usize).collect();
            // Every fourth pair, and the last: the high and low frequencies both.
            for i in (0..freqs.len()).step_by(4).chain([freqs.len() - 1]) {
                let (s, c) = exact(p, freqs[i], P, &mut cc);
                let a = big(attention, P);
                let [ch, sh, cl, sl] = row[i];
                let got_c = big(ch as f64, P).add(&big(cl as f64, P), P, RM);
                let got_s = big(sh as f64, P).add(&big(sl as f64, P), P, RM);
                let ec = diff(&got_c, &c.mul(&a, P, RM), &mut cc) / attention;
                let es = diff(&got_s, &s.mul(&a, P, RM), &mut cc) / attention;
                worst = worst.max(ec).max(es);
                assert!(ec.max(es) < 2f64.powi(-46), "config {k} position {p} pair {i}: off by {ec:e} / {es:e}");
            }
        }
        // A table holds the same rows (its last rows, past 2^16).
        let table = HostTable::from_frequencies(&freqs, attention, (1 << 16) + 2).unwrap();
        let p = (1 << 16) + 1;
        for (i, e) in table_row(&freqs, attention, p).enumerate() {
            let at = p * table.half + i;
            assert_eq!([table.cos[at], table.sin[at], table.cos_lo[at], table.sin_lo[at]], e, "config {k} pair {i}");
        }
    }
    assert!(worst > 0.0, "the comparison measured nothing");
}
