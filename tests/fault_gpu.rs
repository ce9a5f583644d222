//! A device fault surfaces as a typed error at the next synchronisation, not as a panic
//! (issue 7). The fault leaves the context unusable, so this test has a binary of its own,
//! and compute-sanitizer (`.ci/sanitize`) leaves it out: the fault is the point.

mod common;

use common::{gpu, upload_t};
use rope_cuda::{DType, Error, Layout, PositionKind, RawArgs, RawPositions, RawTensor, Rope, RopeConfig};

/// A raw call whose q lies in no allocation (the caller broke `apply_raw`'s contract):
/// the launch is queued (`Ok`), and the fault comes back from `check_errors` as `Err`.
#[test]
fn device_fault_is_a_typed_error_at_the_next_sync() {
    let test = "device_fault_is_a_typed_error_at_the_next_sync";
    let Some(g) = gpu(test) else { return };
    let rope = Rope::new(&g.kernels, RopeConfig::new(64, 64).dtype(DType::BF16)).unwrap();
    let ids = upload_t(&[1i32; 64]);
    // The first page of the address space: aligned, and never mapped (an address further up
    // may happen to fall in a mapping, and then nothing faults).
    let bogus = RawTensor::new(0x1000, 64 * 4 * 64, DType::BF16, Layout::bshd(1, 64, 4, 64));
    let args = RawArgs::new(bogus, RawPositions::new(PositionKind::IdsI32, ids.as_device_ptr().as_raw(), 64));
    // SAFETY: deliberately not: `q` is no allocation. The kernel faults on the device; the
    // host must only see errors.
    let launched = unsafe { rope.apply_raw(&args, g.stream.as_inner()) };
    assert!(launched.is_ok(), "the launch itself is queued: {launched:?}");
    let checked = rope.check_errors(&g.stream);
    assert!(matches!(checked, Err(Error::Cuda(_) | Error::Driver { .. })), "{checked:?}");
    // Later calls on the faulted context return rather than panic (the H200's driver
    // reported this second synchronisation as a success).
    let _ = g.stream.synchronize();
    // The context is now unusable: dropping the handle and its buffers must not panic. (The
    // context itself is left to the process's exit.)
    drop(rope);
    drop(ids);
    std::mem::forget(g);
}
