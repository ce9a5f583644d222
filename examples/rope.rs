//! The main job: the seed RoPE on the GPU, checked against the f64 CPU reference and timed
//! against a device-to-device copy of the same bytes in the same run.
//!
//! ```text
//! cargo run --release --example rope
//! ```

use std::process::ExitCode;

use cust::memory::{CopyDestination, DeviceBuffer};
use cust::stream::{Stream, StreamFlags};
use rope_cuda::bench::{copy_d2d, time_op, Timing};
use rope_cuda::reference::{relative_error, rope_neox_row, uniform_vec};
use rope_cuda::{Kernels, RotaryModel};

const BASE: f64 = 10_000.0;
const REL_TOL: f64 = 2e-6;

struct Row {
    shape: [usize; 4],
    mode: &'static str,
    rel_err: f64,
    rope: Timing,
    copy: Timing,
    bytes: u64,
}

fn main() -> ExitCode {
    let _ctx = match cust::quick_init() {
        Ok(ctx) => ctx,
        Err(e) => {
            eprintln!("rope: no usable CUDA device ({e}); this example needs an NVIDIA GPU and its driver.");
            return ExitCode::FAILURE;
        }
    };
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("rope: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<bool, Box<dyn std::error::Error>> {
    let device = cust::device::Device::get_device(0)?;
    println!("device: {}  (PTX for {})", device.name()?, rope_cuda::ARCH);
    let kernels = Kernels::load()?;
    let stream = Stream::new(StreamFlags::NON_BLOCKING, None)?;
    let mut rows = Vec::new();
    for (shape, runs) in [([4, 8, 256, 64], 500), ([16, 32, 4096, 128], 50)] {
        rows.extend(case(&kernels, &stream, shape, runs)?);
    }

    println!();
    println!(
        "{:<20} {:<13} {:>10} {:>10} {:>9} {:>9} {:>8} {:>9}",
        "shape [B,H,N,D]", "mode", "median us", "p90 us", "GB/s", "copy GB/s", "% copy", "rel err"
    );
    let mut ok = true;
    for r in &rows {
        let (gbs, copy) = (r.rope.gb_per_s(r.bytes), r.copy.gb_per_s(r.bytes));
        ok &= r.rel_err <= REL_TOL;
        println!(
            "{:<20} {:<13} {:>10.2} {:>10.2} {:>9.0} {:>9.0} {:>7.1}% {:>9.1e}",
            format!("{:?}", r.shape),
            r.mode,
            r.rope.median_us,
            r.rope.p90_us,
            gbs,
            copy,
            100.0 * gbs / copy,
            r.rel_err
        );
    }
    println!("accuracy: {} (bound {REL_TOL:e})", if ok { "ok" } else { "FAILED" });
    Ok(ok)
}

/// Checks and times one shape, out of place and in place.
fn case(
    kernels: &Kernels,
    stream: &Stream,
    shape: [usize; 4],
    runs: usize,
) -> Result<Vec<Row>, Box<dyn std::error::Error>> {
    let n: usize = shape.iter().product();
    let (qh, kh) = (uniform_vec(11, 0, n), uniform_vec(11, 1, n));
    let (q, k) = (DeviceBuffer::from_slice(&qh)?, DeviceBuffer::from_slice(&kh)?);
    // SAFETY: written by the first launch before any read.
    let (mut q_out, mut k_out) = unsafe { (DeviceBuffer::uninitialized(n)?, DeviceBuffer::uninitialized(n)?) };
    let model = RotaryModel::new(kernels, shape[3], shape[2], BASE)?;
    model.forward_into(&q, &shape, &k, &shape, &mut q_out, &mut k_out, stream)?;
    stream.synchronize()?;

    // Check against the f64 reference: every row of small shapes, a sample of large ones.
    let (d, rows) = (shape[3], n / shape[3]);
    let step = if rows > 100_000 { 997 } else { 1 };
    let picked: Vec<usize> = (0..rows).filter(|r| r % step == 0 || *r >= rows - 64).collect();
    let mut got = Vec::new();
    let mut want = Vec::new();
    for (x, out) in [(&qh, &q_out), (&kh, &k_out)] {
        let mut host = vec![0.0f32; n];
        out.copy_to(&mut host[..])?;
        for &r in &picked {
            let xs: Vec<f64> = x[r * d..(r + 1) * d].iter().map(|&v| v as f64).collect();
            want.extend(rope_neox_row(&xs, (r % shape[2]) as f64, BASE));
            got.extend_from_slice(&host[r * d..(r + 1) * d]);
        }
    }
    let rel_err = relative_error(&got, &want);

    // Each run reads q and k and writes them (out of place) or back (in place).
    let bytes = (4 * n * 4) as u64;
    let warmup = 10;
    let copy = time_op(stream, warmup, runs, || {
        copy_d2d(&q, &mut q_out, stream)?;
        copy_d2d(&k, &mut k_out, stream)
    })?;
    let out_of_place =
        time_op(stream, warmup, runs, || model.forward_into(&q, &shape, &k, &shape, &mut q_out, &mut k_out, stream))?;
    let (mut qi, mut ki) = (DeviceBuffer::from_slice(&qh)?, DeviceBuffer::from_slice(&kh)?);
    let in_place = time_op(stream, warmup, runs, || model.forward_in_place(&mut qi, &shape, &mut ki, &shape, stream))?;
    Ok(vec![
        Row { shape, mode: "out of place", rel_err, rope: out_of_place, copy, bytes },
        Row { shape, mode: "in place", rel_err, rope: in_place, copy, bytes },
    ])
}
