//! Two entry points for benchmarks, not used by the library's operations: an empty kernel
//! (the launch's own cost, the yardstick of the smallest steps) and a spin that keeps the
//! stream busy while the host queues the work to time (so events measure the device alone).

use core::arch::asm;

/// Does nothing.
///
/// # Safety
/// None needed; `unsafe` only because every entry point is.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn bench_empty() {}

/// Spins until `ns` nanoseconds of the global timer have passed. Launch one thread.
///
/// # Safety
/// None needed.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn bench_spin(ns: u64) {
    let now = || {
        let t: u64;
        // SAFETY: reading a special register.
        unsafe { asm!("mov.u64 {}, %globaltimer;", out(reg64) t, options(nomem, nostack, preserves_flags)) };
        t
    };
    let start = now();
    while now().wrapping_sub(start) < ns {}
}
