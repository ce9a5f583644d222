//! Timing with CUDA events, for the example and the benchmarks (not used by the kernels).
//! Not part of the library's API (hidden from its documentation; may change at any time),
//! and only with the feature `bench-kernels` (this crate's own tests, benches and examples).

use std::time::Instant;

use cust::event::{Event, EventFlags};
use cust::memory::{DeviceCopy, DeviceSlice};
use cust::stream::Stream;

use rope_cuda_kernels::keys::{BenchEmpty, BenchFp8, BenchSpin, BenchTouch, BenchTouchRows};
use rope_cuda_kernels::params::Touch;

use crate::driver;
use crate::error::{Error, Result};
use crate::kernels::{Geometry, Kernels};
use crate::launch::check_u32;

/// Summary of repeated timings of one operation, in microseconds of device time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Timing {
    /// Median.
    pub median_us: f64,
    /// 90th percentile.
    pub p90_us: f64,
    /// Number of timed runs.
    pub runs: usize,
}

impl Timing {
    /// Achieved bandwidth in GB/s (10^9 bytes per second) for `bytes` moved per run.
    pub fn gb_per_s(&self, bytes: u64) -> f64 {
        bytes as f64 / (self.median_us * 1e3)
    }
}

/// Runs `op` `warmup` times, then times each of `runs` runs with a pair of CUDA events on
/// `stream`, and returns the median and 90th percentile. The host queues `op` between the
/// events, so an operation shorter than its own queueing counts the host's time too (as a
/// caller that launches and waits sees it); [`time_device`] leaves that out.
pub fn time_op(stream: &Stream, warmup: usize, runs: usize, op: impl FnMut() -> Result<()>) -> Result<Timing> {
    time_after(stream, warmup, runs, || Ok(()), op)
}

/// Like [`time_op`], but before each timed run the stream spins on the device long enough for
/// the host to queue the run: the events then measure the device's time alone, launch
/// latency included (what a step costs inside a busy stream).
pub fn time_device(
    kernels: &Kernels,
    stream: &Stream,
    warmup: usize,
    runs: usize,
    op: impl FnMut() -> Result<()>,
) -> Result<Timing> {
    time_after(stream, warmup, runs, || spin(kernels, stream, 200_000), op)
}

/// Like [`time_op`], with `before` queued ahead of each timed run, outside the events (a
/// spin, an L2 flush).
pub fn time_after(
    stream: &Stream,
    warmup: usize,
    runs: usize,
    mut before: impl FnMut() -> Result<()>,
    mut op: impl FnMut() -> Result<()>,
) -> Result<Timing> {
    assert!(runs > 0, "time_op: runs must be positive");
    let (warmup, runs) = capped(warmup, runs);
    for _ in 0..warmup {
        op()?;
    }
    stream.synchronize()?;
    let mut times = Vec::with_capacity(runs);
    let (start, stop) = (Event::new(EventFlags::DEFAULT)?, Event::new(EventFlags::DEFAULT)?);
    for _ in 0..runs {
        before()?;
        start.record(stream)?;
        op()?;
        stop.record(stream)?;
        stop.synchronize()?;
        times.push(stop.elapsed_time_f32(&start)? as f64 * 1e3);
    }
    Ok(summary(times))
}

/// `ROPE_CUDA_BENCH_RUNS=N` caps every timing at N runs after one warm-up: for running the
/// example under compute-sanitizer (`.ci/sanitize` sets it), where each launch is checked and
/// the figures mean nothing.
fn capped(warmup: usize, runs: usize) -> (usize, usize) {
    static CAP: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    let cap = CAP.get_or_init(|| std::env::var("ROPE_CUDA_BENCH_RUNS").ok()?.parse().ok().filter(|&n| n > 0));
    match *cap {
        Some(n) => (warmup.min(1), runs.min(n)),
        None => (warmup, runs),
    }
}

fn summary(mut times: Vec<f64>) -> Timing {
    times.sort_by(f64::total_cmp);
    let at = |q: f64| times[((times.len() - 1) as f64 * q).round() as usize];
    Timing { median_us: at(0.5), p90_us: at(0.9), runs: times.len() }
}

/// Queues a one-thread kernel that spins for `ns` nanoseconds on `stream`.
pub fn spin(kernels: &Kernels, stream: &Stream, ns: u64) -> Result<()> {
    let g = Geometry { grid: (1, 1), block: (1, 1) };
    // SAFETY: `bench_spin` touches no memory.
    unsafe { kernels.launch(BenchSpin, g, 0, &ns, stream.as_inner()) }
}

/// Queues an empty kernel of `blocks` blocks of 128 threads on `stream`: the launch's own
/// cost.
pub fn empty(kernels: &Kernels, stream: &Stream, blocks: u32) -> Result<()> {
    let g = Geometry { grid: (blocks, 1), block: (128, 1) };
    // SAFETY: `bench_empty` does nothing.
    unsafe { kernels.launch(BenchEmpty, g, 0, &0u64, stream.as_inner()) }
}

/// Queues a copy of `src` into `dst` (the shorter length, in whole 16-byte chunks) with one
/// 16-byte load and store per thread, in blocks of 128: the least a step that reads its
/// inputs before it writes can cost. Both slices must start on 16 bytes ([`Error::Alignment`]
/// otherwise: a slice taken inside a buffer need not).
pub fn touch<T: DeviceCopy>(
    kernels: &Kernels,
    stream: &Stream,
    src: &DeviceSlice<T>,
    dst: &mut DeviceSlice<T>,
) -> Result<()> {
    let bytes = src.len().min(dst.len()) * std::mem::size_of::<T>();
    let p = touch_params(src.as_device_ptr().as_raw(), dst.as_device_ptr().as_raw(), bytes)?;
    if p.chunks() == 0 {
        return Ok(());
    }
    let g = Geometry { grid: (p.chunks().div_ceil(128) as u32, 1), block: (128, 1) };
    // SAFETY: both addresses are 16-byte aligned (checked) and hold `chunks` whole chunks.
    unsafe { kernels.launch(BenchTouch, g, 0, &p, stream.as_inner()) }
}

/// Queues a copy of `rows` rows of `row_bytes` bytes, `pitch` bytes apart, from device address
/// `src` to `dst` (the same offsets), one 16-byte load and store per thread, in blocks of 128:
/// a strided view's own copy (MLA's q_pe: 128 bytes of every 384). [`Error::Alignment`]
/// unless both addresses, `row_bytes` and `pitch` are multiples of 16.
///
/// # Safety
/// Both addresses are device memory of the kernels' context holding every row, not freed
/// until the copy completes.
pub unsafe fn touch_rows(
    kernels: &Kernels,
    stream: &Stream,
    (src, dst): (u64, u64),
    (row_bytes, pitch, rows): (u64, u64, u64),
) -> Result<()> {
    let Some(p) = rope_cuda_kernels::params::TouchRows::new(src, dst, row_bytes, pitch, rows) else {
        return Err(Error::Alignment { what: "touch_rows", address: src | dst | pitch | row_bytes, align: 16 });
    };
    if p.chunks() == 0 {
        return Ok(());
    }
    check_u32(&[("touch_rows chunks", p.chunks() as usize)])?;
    let g = Geometry { grid: (p.chunks().div_ceil(128) as u32, 1), block: (128, 1) };
    // SAFETY: the caller's contract; the addresses and pitch are 16-byte aligned (checked).
    unsafe { kernels.launch(BenchTouchRows, g, 0, &p, stream.as_inner()) }
}

/// Queues the conversion of the f32 pairs of `src` to E4M3 and E5M2 by the kernels'
/// architecture's [`Fp8::pack2`](rope_cuda_kernels::fp8::Fp8::pack2): pair `i` into `dst[2 i]`
/// (E4M3) and `dst[2 i + 1]` (E5M2), each packed as `cvt.rn.satfinite.*x2.f32` packs (the
/// first value in the upper byte). `src` must hold an even number of f32 and `dst` as many
/// `u16` ([`Error::Length`] otherwise).
pub fn fp8(kernels: &Kernels, stream: &Stream, src: &DeviceSlice<f32>, dst: &mut DeviceSlice<u16>) -> Result<()> {
    let shape = vec![src.len() / 2, 2];
    if src.len() % 2 != 0 {
        return Err(Error::Length { what: "fp8 input", shape, expected: src.len() - 1, got: src.len() });
    }
    if dst.len() != src.len() {
        return Err(Error::Length { what: "fp8 output", shape, expected: src.len(), got: dst.len() });
    }
    let p = Touch::pairs(src.as_device_ptr().as_raw(), dst.as_device_ptr().as_raw(), src.len() as u64 / 2);
    if src.is_empty() {
        return Ok(());
    }
    let g = Geometry { grid: ((src.len() / 2).div_ceil(128) as u32, 1), block: (128, 1) };
    // SAFETY: `src` holds `2 * pairs` f32 and `dst` as many u16 (checked above).
    unsafe { kernels.launch(BenchFp8, g, 0, &p, stream.as_inner()) }
}

/// The copy's parameters, or the alignment error that refuses it.
fn touch_params(src: u64, dst: u64, bytes: usize) -> Result<Touch> {
    Touch::new(src, dst, bytes as u64).ok_or_else(|| {
        let (what, address) = if src % 16 != 0 { ("src", src) } else { ("dst", dst) };
        Error::Alignment { what, address, align: 16 }
    })
}

/// The host's time to queue one call of `op`, in microseconds (median of `runs` batches of
/// `batch` calls queued behind a spin, so the stream never pushes back).
pub fn host_time(
    kernels: &Kernels,
    stream: &Stream,
    runs: usize,
    batch: usize,
    mut op: impl FnMut() -> Result<()>,
) -> Result<Timing> {
    let (_, runs) = capped(0, runs);
    let mut times = Vec::with_capacity(runs);
    for _ in 0..runs {
        spin(kernels, stream, 100_000 + 20_000 * batch as u64)?;
        let t = Instant::now();
        for _ in 0..batch {
            op()?;
        }
        times.push(t.elapsed().as_secs_f64() * 1e6 / batch as f64);
        stream.synchronize()?;
    }
    Ok(summary(times))
}

/// Like [`time_op`], but each timed run queues `batch` back-to-back calls of `op` between one
/// pair of events and reports the time per call: for operations of a few microseconds, where
/// the host's time to queue one call would otherwise be counted (the device stays busy as
/// long as queueing a call is quicker than running it).
pub fn time_batched(
    stream: &Stream,
    warmup: usize,
    runs: usize,
    batch: usize,
    mut op: impl FnMut() -> Result<()>,
) -> Result<Timing> {
    assert!(batch > 0, "time_batched: batch must be positive");
    let t = time_op(stream, warmup, runs, || (0..batch).try_for_each(|_| op()))?;
    Ok(Timing { median_us: t.median_us / batch as f64, p90_us: t.p90_us / batch as f64, runs })
}

/// Queues a device-to-device copy of `src` into `dst` (equal lengths) on `stream`: the
/// bandwidth yardstick.
pub fn copy_d2d<T: cust::memory::DeviceCopy>(
    src: &DeviceSlice<T>,
    dst: &mut DeviceSlice<T>,
    stream: &Stream,
) -> Result<()> {
    assert_eq!(src.len(), dst.len(), "copy_d2d: lengths differ");
    let bytes = src.len() * std::mem::size_of::<T>();
    // SAFETY: both ranges are live device allocations of `bytes` bytes.
    unsafe {
        driver::memcpy_dtod_async(dst.as_device_ptr().as_raw(), src.as_device_ptr().as_raw(), bytes, stream.as_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `touch` moves 16-byte chunks: slices that do not start on 16 bytes are refused.
    #[test]
    fn touch_refuses_unaligned_slices() {
        assert_eq!(touch_params(256, 512, 100).unwrap().chunks(), 6);
        let e = touch_params(256 + 4, 512, 100).unwrap_err();
        assert_eq!(e, Error::Alignment { what: "src", address: 260, align: 16 });
        let e = touch_params(256, 512 + 8, 100).unwrap_err();
        assert_eq!(e, Error::Alignment { what: "dst", address: 520, align: 16 });
    }
}
