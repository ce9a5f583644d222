//! The FP8 conversion of each architecture's PTX on the GPU (`Fp8::pack2`: sm_89's
//! `cvt.rn.satfinite` in the sm_90 and sm_100 PTX, the portable twin in the sm_80 PTX)
//! against the twin on the host: the same bits for every input, NaN included (both give
//! 0x7F). tests/fp8.rs checks the twin itself against the formats' definition.

mod common;

use common::gpu;
use cust::memory::{CopyDestination, DeviceBuffer};
use rope_cuda::{archs, bench, Kernels};
use rope_cuda_kernels::fp8::Fp8;

#[test]
fn every_architecture_converts_like_the_twin() {
    let Some(g) = gpu("every_architecture_converts_like_the_twin") else { return };
    let seed = common::test_seed("fp8_gpu::every_architecture_converts_like_the_twin");
    let xs = common::fp8_inputs(seed);
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
