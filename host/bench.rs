//! Timing with CUDA events, for the example and the benchmarks (not used by the kernels).

use cust::event::{Event, EventFlags};
use cust::memory::DeviceSlice;
use cust::stream::Stream;
use cust::sys as cuda;

use crate::error::{driver, Result};

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
/// `stream`, and returns the median and 90th percentile.
pub fn time_op(stream: &Stream, warmup: usize, runs: usize, mut op: impl FnMut() -> Result<()>) -> Result<Timing> {
    assert!(runs > 0, "time_op: runs must be positive");
    for _ in 0..warmup {
        op()?;
    }
    stream.synchronize()?;
    let mut times = Vec::with_capacity(runs);
    let (start, stop) = (Event::new(EventFlags::DEFAULT)?, Event::new(EventFlags::DEFAULT)?);
    for _ in 0..runs {
        start.record(stream)?;
        op()?;
        stop.record(stream)?;
        stop.synchronize()?;
        times.push(stop.elapsed_time_f32(&start)? as f64 * 1e3);
    }
    times.sort_by(f64::total_cmp);
    let at = |q: f64| times[((times.len() - 1) as f64 * q).round() as usize];
    Ok(Timing { median_us: at(0.5), p90_us: at(0.9), runs })
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
    driver("cuMemcpyDtoDAsync", unsafe {
        cuda::cuMemcpyDtoDAsync_v2(dst.as_device_ptr().as_raw(), src.as_device_ptr().as_raw(), bytes, stream.as_inner())
    })
}
