//! The f64 CPU reference against transformers' own rotary code (NeoX via Llama's
//! `apply_rotary_pos_emb`, GPT-J via its own), run in float64 on a CUDA machine by
//! `tests/data/make_golden_hf.py`. Runs on every machine.

mod common;

use common::{data_file, Reader};
use rope_cuda::reference::{rope_row, uniform};
use rope_cuda::{Direction, RopeStyle};

fn check(name: &str, style: RopeStyle, head_dim: usize, rotary_dim: usize) {
    let bytes = data_file(name);
    let mut r = Reader(&bytes);
    assert_eq!(&r.take::<8>(), b"RPHF1\0\0\0");
    let (s, d, rot) = (r.u32(), r.u32(), r.u32());
    assert_eq!((s, d, rot), ((style == RopeStyle::GptJ) as usize, head_dim, rotary_dim), "{name}: header");
    let (base, seed) = (r.f64(), r.u64());
    let (batch, seq, heads) = (r.u32(), r.u32(), r.u32());
    let positions: Vec<i64> = (0..batch * seq).map(|_| r.i64()).collect();
    assert!(positions.contains(&0), "{name}: position 0 covered");
    let mut rows = 0;
    for (t, &p) in positions.iter().enumerate() {
        for h in 0..heads {
            let start = ((t * heads) + h) * d;
            let x: Vec<f64> = (start..start + d).map(|i| uniform(seed, 0, i as u64) as f64).collect();
            let want: Vec<f64> = (0..d).map(|_| r.f64()).collect();
            let got = rope_row(&x, p as f64, base, rot, style, Direction::Forward);
            // Two f64 evaluations of angles up to 2^20 rad differ by a few ulps of the angle.
            let tol = 1e-14 + 4e-16 * p as f64;
            for j in 0..d {
                assert!(
                    (got[j] - want[j]).abs() <= tol,
                    "{name}: token {t} (position {p}) head {h} dim {j}: {} vs {}",
                    got[j],
                    want[j]
                );
                if j >= rot {
                    assert_eq!(got[j], x[j], "{name}: dims past rotary_dim are kept");
                }
            }
            rows += 1;
        }
    }
    assert!(r.0.is_empty(), "{name}: trailing bytes");
    assert_eq!(rows, batch * seq * heads);
}

#[test]
fn neox_matches_llama_apply_rotary_pos_emb() {
    check("golden_hf_neox_128.bin", RopeStyle::NeoX, 128, 128);
}

#[test]
fn neox_partial_matches_gpt_neox_style_partial_rotary() {
    check("golden_hf_neox_partial_96_24.bin", RopeStyle::NeoX, 96, 24);
}

#[test]
fn gptj_partial_matches_gptj_apply_rotary_pos_emb() {
    check("golden_hf_gptj_partial_256_64.bin", RopeStyle::GptJ, 256, 64);
}

#[test]
fn gptj_full_matches_at_positions_up_to_2_pow_20() {
    check("golden_hf_gptj_64.bin", RopeStyle::GptJ, 64, 64);
}
