//! Entry points for benchmarks, not used by the library's operations: an empty kernel (the
//! launch's own cost, the yardstick of the smallest steps), a copy with one 16-byte load and
//! store per thread (the least a step that reads before it writes can cost), and a spin that
//! keeps the stream busy while the host queues the work to time (so events measure the device
//! alone).

use core::arch::asm;

use crate::gpu::{block_dim, block_idx, thread_idx, Io, Vec16, F32};
use crate::params::Touch;

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

/// Copies `p.chunks` 16-byte chunks from `p.src` to `p.dst`, one per thread.
///
/// # Safety
/// Both addresses are 16-byte aligned and hold `p.chunks` chunks; launched by `bench::touch`.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn bench_touch(p: Touch) {
    let i = block_idx().0 as u64 * block_dim().0 as u64 + thread_idx().0 as u64;
    if i < p.chunks {
        let v = Vec16::<F32>::load_raw((p.src as *const u8).wrapping_add(16 * i as usize));
        Vec16::<F32>::store_raw((p.dst as *mut u8).wrapping_add(16 * i as usize), v);
    }
}
