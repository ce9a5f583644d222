//! The FP8 conversion of each architecture's PTX on the GPU (`Fp8::pack2`: sm_89's
//! `cvt.rn.satfinite` in the sm_90 and sm_100 PTX, the portable twin in the sm_80 PTX)
//! against the twin on the host: the same bits for every input, NaN included (both give
//! 0x7F). tests/fp8.rs checks the twin itself against the formats' definition.

mod common;

use common::gpu;
use cust::memory::{CopyDestination, DeviceBuffer};
use rope_cuda::reference::splitmix64;
use rope_cuda::{archs, bench, Kernels};
use rope_cuda_kernels::fp8::Fp8;

/// Every value of both formats and the midpoints between neighbours (with the f32 on either
/// side), the saturation points, specials, and seeded random bits and values.
fn inputs(seed: u64) -> Vec<f32> {
    let mut xs = vec![0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, -f32::NAN, f32::MAX, f32::MIN_POSITIVE];
    xs.push(f32::from_bits(0x7F80_0001));
    xs.push(f32::from_bits(1));
    for f in [Fp8::E4M3, Fp8::E5M2] {
        let mut vals: Vec<f32> = (0u8..0x80).map(|c| f.to_f32(c)).filter(|v| v.is_finite()).collect();
        vals.sort_by(f32::total_cmp);
        vals.push(2.0 * f.max());
        for w in vals.windows(2) {
            let mid = (w[0] + w[1]) / 2.0;
            for x in [w[0], mid, f32::from_bits(mid.to_bits() - 1), f32::from_bits(mid.to_bits() + 1)] {
                xs.extend([x, -x]);
            }
        }
    }
    for i in 0..300_000u64 {
        let r = splitmix64(seed ^ i);
        xs.push(f32::from_bits(r as u32));
        let e = (r >> 40) as i32 % 40 - 22; // 2^-22 .. 2^17: both formats' ranges and past them
        xs.push(f32::from_bits((((e + 127) as u32) << 23) | (r >> 32) as u32 & 0x7F_FFFF | ((r >> 63) as u32) << 31));
    }
    if xs.len() % 2 == 1 {
        xs.push(1.0);
    }
    xs
}

#[test]
fn every_architecture_converts_like_the_twin() {
    let Some(g) = gpu("every_architecture_converts_like_the_twin") else { return };
    let seed = common::test_seed("fp8_gpu::every_architecture_converts_like_the_twin");
    let xs = inputs(seed);
    let want: Vec<u16> = xs
        .chunks(2)
        .flat_map(|p| [Fp8::E4M3, Fp8::E5M2].map(|f| ((f.from_f32(p[0]) as u16) << 8) | f.from_f32(p[1]) as u16))
        .collect();
    let src = DeviceBuffer::from_slice(&xs).unwrap();
    let mut ran = vec![];
    for arch in archs() {
        // The architectures the device runs (the H200 runs all but sm_100's).
        let Ok(kernels) = Kernels::load_arch(arch) else { continue };
        let mut dst = DeviceBuffer::from_slice(&vec![0xDEADu16; xs.len()]).unwrap();
        bench::fp8(&kernels, &g.stream, &src, &mut dst).unwrap();
        g.stream.synchronize().unwrap();
        let mut got = vec![0u16; xs.len()];
        dst.copy_to(&mut got[..]).unwrap();
        for (i, (&got, &want)) in got.iter().zip(&want).enumerate() {
            let (x0, x1) = (xs[2 * (i / 2)], xs[2 * (i / 2) + 1]);
            let f = if i % 2 == 0 { "E4M3" } else { "E5M2" };
            assert_eq!(got, want, "{arch} {f}: ({x0:e}, {x1:e}) gave {got:#06x}, the twin {want:#06x}");
        }
        ran.push(arch);
    }
    // sm_80's twin, and the newest PTX the device runs (on sm_89 and later devices, the
    // instruction).
    assert!(ran.contains(&"sm_80") && ran.contains(&g.kernels.arch()), "architectures run: {ran:?}");
    // A wrong length is refused before any launch.
    let mut short = DeviceBuffer::from_slice(&[0u16; 2]).unwrap();
    assert!(bench::fp8(&g.kernels, &g.stream, &src, &mut short).is_err());
}
