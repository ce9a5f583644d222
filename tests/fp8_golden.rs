//! The FP8 conversion against PyTorch's own casts (`tests/data/make_golden_fp8.py`, run on a
//! CUDA machine): `torch.clamp(x, -max, max).to(torch.float8_e4m3fn)` and `.to(torch.float8_e5m2)`.
//! The portable twin (`Fp8::from_f32`, on the CPU, every machine) and each architecture's
//! `Fp8::pack2` (on the GPU) must give PyTorch's codes bit for bit on the structured inputs
//! stored in the file and on 10^6 seeded random inputs checked by block digests. A NaN input's
//! code is compared as "a NaN encoding": the instruction returns 0x7F, PyTorch keeps the sign.

mod common;

use std::io::Write;

use common::{gpu, Reader};
use cust::memory::{CopyDestination, DeviceBuffer};
use cust::stream::Stream;
use rope_cuda::{archs, bench, Kernels};
use rope_cuda_kernels::fp8::Fp8;

const FILE: &str = "golden_fp8.bin";
const SCRIPT: &str = "tests/data/make_golden_fp8.py";
/// The formats in the file's order.
const FORMATS: [Fp8; 2] = [Fp8::E4M3, Fp8::E5M2];

/// `tests/data/golden_fp8.bin` (its format: the script's docstring).
struct Golden {
    seed: u64,
    producer: String,
    /// The structured inputs and PyTorch's codes for them, per format.
    xs: Vec<f32>,
    codes: [Vec<u8>; 2],
    /// The random inputs' count, the values per block, and per block the FNV-1a of the
    /// inputs, of the E4M3 codes and of the E5M2 codes.
    count: usize,
    block: usize,
    digests: Vec<[u64; 3]>,
}

/// Reads the golden file; a missing one fails, naming the script that makes it.
fn golden() -> Golden {
    let path = common::data_path(FILE);
    let bytes = std::fs::read(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}. The golden FP8 codes come from PyTorch on a CUDA machine: \
             python3 {SCRIPT} tests/data (then commit tests/data/{FILE})",
            path.display()
        )
    });
    let mut r = Reader(&bytes);
    assert_eq!(&r.take::<8>(), b"RPFP8GL1", "{FILE}: bad magic");
    let seed = r.u64();
    let n = r.u32();
    let (producer, rest) = r.0.split_at(n);
    r.0 = rest;
    let producer = String::from_utf8(producer.to_vec()).expect("producer: UTF-8");
    let n = r.u32();
    let xs = (0..n).map(|_| f32::from_bits(r.u32() as u32)).collect();
    let codes = [(); 2].map(|_| {
        let (c, rest) = r.0.split_at(n);
        r.0 = rest;
        c.to_vec()
    });
    let (count, block) = (r.u32(), r.u32());
    let digests = (0..count.div_ceil(block)).map(|_| [r.u64(), r.u64(), r.u64()]).collect();
    assert!(r.0.is_empty(), "{FILE}: trailing bytes");
    Golden { seed, producer, xs, codes, count, block, digests }
}

/// Whether `c` is a NaN of format `f` (E4M3: `S.1111.111`; E5M2: exponent all ones, mantissa
/// nonzero).
fn is_nan_code(f: Fp8, c: u8) -> bool {
    match f {
        Fp8::E4M3 => c & 0x7F == 0x7F,
        Fp8::E5M2 => c & 0x7C == 0x7C && c & 0x03 != 0,
    }
}

/// The code a digest counts for input `x`: a NaN input's NaN encoding as 0x7F.
fn canonical(f: Fp8, x: f32, c: u8) -> u8 {
    if x.is_nan() && is_nan_code(f, c) {
        0x7F
    } else {
        c
    }
}

/// 64-bit FNV-1a.
fn fnv1a(bytes: impl IntoIterator<Item = u8>) -> u64 {
    bytes.into_iter().fold(0xCBF2_9CE4_8422_2325, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01B3))
}

/// Per block of `block` inputs: the FNV-1a of the inputs' f32 bits (little-endian), of their
/// E4M3 codes and of their E5M2 codes (each [`canonical`]).
fn digests(xs: &[f32], codes: &[Vec<u8>; 2], block: usize) -> Vec<[u64; 3]> {
    (0..xs.len().div_ceil(block))
        .map(|b| {
            let range = b * block..((b + 1) * block).min(xs.len());
            let xs = &xs[range.clone()];
            let code =
                |k: usize| fnv1a(xs.iter().zip(&codes[k][range.clone()]).map(|(&x, &c)| canonical(FORMATS[k], x, c)));
            [fnv1a(xs.iter().flat_map(|x| x.to_bits().to_le_bytes())), code(0), code(1)]
        })
        .collect()
}

/// The twin's codes of `xs`, per format.
fn twin_codes(xs: &[f32]) -> [Vec<u8>; 2] {
    FORMATS.map(|f| xs.iter().map(|&x| f.from_f32(x)).collect())
}

/// The random inputs of the golden file (`make_golden_fp8.py` makes the same).
fn random_inputs(g: &Golden) -> Vec<f32> {
    assert_eq!(g.count % 2, 0, "{FILE}: an odd random count");
    common::fp8_random(g.seed, g.count as u64 / 2).collect()
}

/// Compares `got` (codes of the structured inputs, then of the random inputs `rs`) with the
/// golden file; panics listing what differs.
fn compare(what: &str, g: &Golden, structured: &[Vec<u8>; 2], rs: &[f32], random: &[Vec<u8>; 2]) {
    let mut wrong = vec![];
    for (k, f) in FORMATS.into_iter().enumerate() {
        for (i, &x) in g.xs.iter().enumerate() {
            let (got, want) = (structured[k][i], g.codes[k][i]);
            let same = if x.is_nan() { is_nan_code(f, got) && is_nan_code(f, want) } else { got == want };
            if !same {
                wrong.push(format!("{f:?} {x:e} ({:#010x}): {got:#04x}, PyTorch {want:#04x}", x.to_bits()));
            }
        }
    }
    let ours = digests(rs, random, g.block);
    for (b, (ours, theirs)) in ours.iter().zip(&g.digests).enumerate() {
        let inputs = b * g.block..((b + 1) * g.block).min(rs.len());
        assert_eq!(
            ours[0], theirs[0],
            "{what}: the random inputs {inputs:?} are not the script's (tests/common fp8_random against \
             {SCRIPT}'s random_inputs)"
        );
        for (k, f) in FORMATS.into_iter().enumerate() {
            if ours[k + 1] != theirs[k + 1] {
                wrong.push(format!("{f:?} random inputs {inputs:?}: a code differs (block digest)"));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "{what}: {} differences from PyTorch ({}), the first:\n{}",
        wrong.len(),
        g.producer,
        wrong[..wrong.len().min(20)].join("\n")
    );
}

/// The file holds what the script's docstring says: an even number of structured inputs with
/// every value of both formats, every midpoint with its f32 neighbours (both signs), the
/// specials, and 10^6 random inputs in blocks.
#[test]
fn the_golden_file_covers_the_formats() {
    let g = golden();
    // Written past libtest's capture: what made the file.
    let _ = writeln!(std::io::stderr(), "{FILE}: {}", g.producer);
    assert_eq!(g.xs.len() % 2, 0, "the GPU converts pairs");
    assert_eq!((g.count, g.block, g.digests.len()), (1_000_000, 4096, 1_000_000usize.div_ceil(4096)));
    let have: std::collections::HashSet<u32> = g.xs.iter().map(|x| x.to_bits()).collect();
    let has = |x: f32| have.contains(&x.to_bits()) && have.contains(&(-x).to_bits());
    for f in FORMATS {
        let vals: Vec<f32> = (0u8..0x80).map(|c| f.to_f32(c)).filter(|v| v.is_finite()).collect();
        for w in vals.windows(2) {
            let mid = (w[0] + w[1]) / 2.0;
            for x in [w[0], w[1], mid, f32::from_bits(mid.to_bits() - 1), f32::from_bits(mid.to_bits() + 1)] {
                assert!(has(x), "{f:?}: {x:e} (either sign) missing");
            }
        }
        let step = f.max() - f.to_f32(f.max_code() - 1);
        for x in [f.max() + step / 2.0, f.max() + step, 2.0 * f.max(), f32::MAX] {
            assert!(has(x) && has(f32::from_bits(x.to_bits() - 1)), "{f:?}: {x:e} missing");
        }
    }
    assert!(has(0.0) && has(f32::INFINITY) && has(f32::from_bits(1)) && has(f32::MIN_POSITIVE));
    assert!(
        g.xs.iter().any(|x| x.is_nan() && x.is_sign_negative())
            && g.xs.iter().any(|x| x.is_nan() && x.is_sign_positive())
    );
}

/// The portable twin, on the CPU: PyTorch's codes.
#[test]
fn the_twin_converts_like_pytorch() {
    let g = golden();
    let rs = random_inputs(&g);
    compare("the twin", &g, &twin_codes(&g.xs), &rs, &twin_codes(&rs));
}

/// The check can fail: one wrong code changes its block's digest and no other; a NaN input's
/// code counts as any NaN encoding, but not as a number.
#[test]
fn a_wrong_code_changes_its_block_digest() {
    let block = 4096;
    let rs: Vec<f32> = common::fp8_random(26, 3 * block as u64 / 2 + 50).collect();
    let mut codes = twin_codes(&rs);
    let right = digests(&rs, &codes, block);
    assert_eq!(right.len(), 4);
    for (k, i) in [(0, block + 17), (1, 3 * block + 3)] {
        assert!(!rs[i].is_nan());
        let mut wrong = codes.clone();
        wrong[k][i] ^= 1;
        let d = digests(&rs, &wrong, block);
        for (b, (d, r)) in d.iter().zip(&right).enumerate() {
            assert_eq!(d[1 + k] != r[1 + k], b == i / block, "{:?} code {i}: block {b}", FORMATS[k]);
            assert_eq!((d[0], d[2 - k]), (r[0], r[2 - k]));
        }
    }
    let nan = rs.iter().position(|x| x.is_nan()).expect("NaNs among the random bit patterns");
    for (k, f) in FORMATS.into_iter().enumerate() {
        let other_nan = if f == Fp8::E4M3 { 0xFF } else { 0xFE };
        for (c, counts_same) in [(other_nan, true), (0x7C, false), (0x00, false)] {
            codes[k][nan] = c;
            assert_eq!(digests(&rs, &codes, block) == right, counts_same, "{f:?}: NaN input coded {c:#04x}");
        }
        codes[k][nan] = 0x7F;
    }
}

/// `xs` (an even number) converted on the GPU by `kernels`' [`Fp8::pack2`], per format.
fn gpu_codes(kernels: &Kernels, stream: &Stream, xs: &[f32]) -> [Vec<u8>; 2] {
    let src = DeviceBuffer::from_slice(xs).unwrap();
    let mut dst = DeviceBuffer::from_slice(&vec![0xDEADu16; xs.len()]).unwrap();
    bench::fp8(kernels, stream, &src, &mut dst).unwrap();
    stream.synchronize().unwrap();
    let mut got = vec![0u16; xs.len()];
    dst.copy_to(&mut got[..]).unwrap();
    // Pair p: E4M3 in u16 2p, E5M2 in 2p + 1, each with x[2p]'s code in the upper byte.
    let mut codes = [vec![0u8; xs.len()], vec![0u8; xs.len()]];
    for (p, pair) in got.chunks(2).enumerate() {
        for (k, &v) in pair.iter().enumerate() {
            codes[k][2 * p] = (v >> 8) as u8;
            codes[k][2 * p + 1] = v as u8;
        }
    }
    codes
}

/// Each architecture's PTX the device runs (sm_89's `cvt.rn.satfinite` in the sm_90 and sm_100
/// PTX, the twin in the sm_80 PTX), on the GPU: PyTorch's codes.
#[test]
fn every_architecture_converts_like_pytorch() {
    let Some(gpu) = gpu("every_architecture_converts_like_pytorch") else { return };
    let g = golden();
    let rs = random_inputs(&g);
    let mut ran = vec![];
    for arch in archs() {
        let Ok(kernels) = Kernels::load_arch(arch) else { continue };
        let structured = gpu_codes(&kernels, &gpu.stream, &g.xs);
        let random = gpu_codes(&kernels, &gpu.stream, &rs);
        compare(arch, &g, &structured, &rs, &random);
        ran.push(arch);
    }
    assert!(ran.contains(&"sm_80") && ran.contains(&gpu.kernels.arch()), "architectures run: {ran:?}");
}
