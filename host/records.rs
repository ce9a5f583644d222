//! The device-side state every operation keeps beside its launches: the error records its
//! kernels write, and the owner array of the claimed KV path. One [`Records`] per
//! [`Rope`](crate::Rope) or reference update.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Mutex, MutexGuard};

use cust::memory::CopyDestination;
use cust::sys as cuda;
use rope_cuda_kernels::keys::ClaimKey;
use rope_cuda_kernels::params::KvParams;
use rope_cuda_kernels::views::{ErrorRecords, ErrorSink, OwnerView};

use crate::alloc::DeviceAlloc;
use crate::driver;
use crate::error::{Error, Result};
use crate::kernels::{Geometry, Kernels};

/// The error records and the owner array of one operation object.
#[derive(Debug)]
pub(crate) struct Records {
    /// One [`ErrorRecords`], as its words.
    errors: DeviceAlloc<u64>,
    /// The claimed KV path's owner array, allocated on first use.
    owners: Mutex<Owners>,
    /// The number of cache slots of the last KV launch, for slot error reports.
    num_slots: AtomicU64,
}

impl Records {
    /// Clear records, in the current context.
    pub fn new() -> Result<Self> {
        let errors = DeviceAlloc::from_slice(&ErrorRecords::CLEAR.to_words())?;
        Ok(Records { errors, owners: Mutex::default(), num_slots: AtomicU64::new(0) })
    }

    /// Where this object's launches record skipped tokens.
    pub fn sink(&self) -> ErrorSink {
        ErrorSink::new(self.errors.address())
    }

    /// Notes the cache size of a KV launch, for its slot error reports.
    pub fn note_num_slots(&self, num_slots: u64) {
        self.num_slots.store(num_slots, Relaxed);
    }

    /// The owner array, locked: hold the guard from the claims to the launch that reads them,
    /// so that calls from other threads reuse neither the epoch nor the array in between.
    pub fn owners(&self) -> MutexGuard<'_, Owners> {
        self.owners.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Reads and clears the records (the work that wrote them has completed): the first that
    /// holds an error becomes `Err`. `max_position` is reported with position errors.
    pub fn take(&self, max_position: usize) -> Result<()> {
        let mut words = [0u64; ErrorRecords::WORDS];
        self.errors.buffer().copy_to(&mut words[..])?;
        let records = ErrorRecords::from_words(words);
        if records == ErrorRecords::CLEAR {
            return Ok(());
        }
        let clear = ErrorRecords::CLEAR.to_words();
        // SAFETY: the allocation holds the records' words; the copy is synchronous.
        unsafe { driver::memcpy_htod(self.errors.address(), &clear) }?;
        report(records, max_position, self.num_slots.load(Relaxed))
    }
}

/// The error a set of records stands for (positions first), if any.
fn report(records: ErrorRecords, max_position: usize, num_slots: u64) -> Result<()> {
    if let Some((token, position)) = records.positions.first() {
        return Err(Error::PositionOutOfRange {
            token: token as usize,
            position,
            max_position,
            count: records.positions.count,
        });
    }
    match records.slots.first() {
        Some((token, slot)) => {
            Err(Error::SlotOutOfRange { token: token as usize, slot, num_slots, count: records.slots.count })
        }
        None => Ok(()),
    }
}

/// The owner array of the claim path, and the tag of the last call's claims.
#[derive(Debug, Default)]
pub(crate) struct Owners {
    buf: Option<DeviceAlloc<u64>>,
    epoch: u32,
}

impl Owners {
    /// Queues `kv_claim` for `p`'s tokens and points `p` at the owner array (grown to
    /// `num_slots` when short), tagged for this call.
    ///
    /// # Safety
    /// `p` passed the KV checks: its positions and slot mapping hold `p.tokens` entries, and
    /// `stream` is a stream of `kernels`' context.
    pub unsafe fn claim(&mut self, kernels: &Kernels, p: &mut KvParams, stream: cuda::CUstream) -> Result<()> {
        // A graph would replay this call's epoch: the claims of one replay would then compete
        // with the last replay's for the same slots.
        // SAFETY: `stream` is a live stream (the caller's contract).
        let capturing = unsafe { driver::stream_is_capturing(stream) }?;
        if crate::graph::recording() || capturing != cuda::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
            return Err(Error::NotCapturable("a KV append or update of more than KV_SCAN_MAX_TOKENS tokens"));
        }
        let needed = (p.cache.num_slots() as usize).max(1);
        if self.buf.as_ref().is_none_or(|b| b.len() < needed) || self.epoch == u32::MAX {
            // Zeroed: epoch 0 is never used, so no stale entry matches.
            self.buf = Some(DeviceAlloc::filled(needed)?);
            self.epoch = 0;
        }
        self.epoch += 1;
        let owners = self.buf.as_ref().map_or(0, |b| b.address());
        p.owners = OwnerView::claimed(owners, self.epoch);
        let g = Geometry { grid: (p.tokens.div_ceil(128), 1), block: (128, 1) };
        // SAFETY: one thread per token; the owner array holds `num_slots` entries; the
        // caller's checks cover the positions and slots.
        unsafe { kernels.launch(ClaimKey, g, 0, p, stream) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rope_cuda_kernels::views::ErrorRecord;

    #[test]
    fn records_report_positions_first_then_slots() {
        assert_eq!(report(ErrorRecords::CLEAR, 10, 5), Ok(()));
        let mut r = ErrorRecords::CLEAR;
        let sink = ErrorSink::new(&raw mut r as u64);
        // SAFETY: `r` is a live ErrorRecords on the host; the sink's atomics run on the host.
        unsafe {
            sink.slot(9, 1 << 40);
            sink.slot(4, -7);
        }
        let e = report(r, 10, 5).unwrap_err();
        assert_eq!(e, Error::SlotOutOfRange { token: 4, slot: -7, num_slots: 5, count: 2 });
        // SAFETY: as above.
        unsafe {
            sink.position(3, 12);
            sink.position(2, i64::MAX);
        }
        let e = report(r, 10, 5).unwrap_err();
        assert_eq!(e, Error::PositionOutOfRange { token: 2, position: i32::MAX as i64, max_position: 10, count: 2 });
        assert_eq!(ErrorRecords::from_words(r.to_words()), r);
        assert_eq!(r.slots, ErrorRecord { key: ErrorRecord::key(4, -7), count: 2 });
    }
}
