//! Bodies of the benchmark entry points, not used by the library's operations: an empty
//! kernel (the launch's own cost, the yardstick of the smallest steps), a copy with one
//! 16-byte load and store per thread (the least a step that reads before it writes can cost),
//! a spin that keeps the stream busy while the host queues the work to time (so events
//! measure the device alone), and the FP8 conversion of the kernel's architecture (tested
//! against its portable twin).

use core::arch::asm;

use crate::fp8::Fp8;
use crate::gpu::{block_dim, block_idx, thread_idx, Io, Vec16, F32};
use crate::params::{Touch, TouchRows};

/// Does nothing (`bench_empty`; its parameter is unused).
///
/// # Safety
/// None needed; `unsafe` only because every entry point's body is.
#[inline(always)]
pub(crate) unsafe fn empty(_: &u64) {}

/// Spins until `ns` nanoseconds of the global timer have passed (`bench_spin`). Launch one
/// thread.
///
/// # Safety
/// None needed.
#[inline(always)]
pub(crate) unsafe fn spin(ns: &u64) {
    let now = || {
        let t: u64;
        // SAFETY: reading a special register.
        unsafe { asm!("mov.u64 {}, %globaltimer;", out(reg64) t, options(nomem, nostack, preserves_flags)) };
        t
    };
    let start = now();
    while now().wrapping_sub(start) < *ns {}
}

/// Copies `p.chunks` 16-byte chunks from `p.src` to `p.dst`, one per thread (`bench_touch`).
///
/// # Safety
/// Both addresses are 16-byte aligned and hold `p.chunks` chunks (`Touch::new` checks the
/// alignment).
#[inline(always)]
pub(crate) unsafe fn touch(p: &Touch) {
    let i = block_idx().0 as u64 * block_dim().0 as u64 + thread_idx().0 as u64;
    if i < p.chunks {
        // SAFETY: the caller's contract: chunk `i` exists in both.
        unsafe {
            let v = Vec16::<F32>::load_raw((p.src as *const u8).wrapping_add(16 * i as usize));
            Vec16::<F32>::store_raw((p.dst as *mut u8).wrapping_add(16 * i as usize), v);
        }
    }
}

/// Copies chunk `i` of `p.chunks` 16-byte chunks of strided rows, one per thread
/// (`bench_touch_rows`): row `i / row_chunks`, chunk `i % row_chunks` of it.
///
/// # Safety
/// Both addresses hold every row (`TouchRows::new` checks the alignment); fewer than 2^32
/// chunks.
#[inline(always)]
pub(crate) unsafe fn touch_rows(p: &TouchRows) {
    let i = block_idx().0 * block_dim().0 + thread_idx().0;
    if (i as u64) < p.chunks {
        let (row, c) = p.row_chunks.divmod(i);
        let at = (row as u64 * p.pitch + 16 * c as u64) as usize;
        // SAFETY: the caller's contract: chunk `c` of row `row` exists in both.
        unsafe {
            let v = Vec16::<F32>::load_raw((p.src as *const u8).wrapping_add(at));
            Vec16::<F32>::store_raw((p.dst as *mut u8).wrapping_add(at), v);
        }
    }
}

/// Converts f32 pair `i` of `p.src` (`p.chunks` pairs) to E4M3 and to E5M2 with
/// [`Fp8::pack2`], into `u16` `2 i` and `2 i + 1` of `p.dst`, one pair per thread
/// (`bench_fp8`).
///
/// # Safety
/// `p.src` holds `2 * p.chunks` f32, `p.dst` `2 * p.chunks` u16.
#[inline(always)]
pub(crate) unsafe fn fp8(p: &Touch) {
    let i = block_idx().0 as u64 * block_dim().0 as u64 + thread_idx().0 as u64;
    if i < p.chunks {
        let (src, dst) = (p.src as *const f32, p.dst as *mut u16);
        // SAFETY: the caller's contract: pair `i` and its two outputs exist.
        unsafe {
            let (hi, lo) = (*src.add(2 * i as usize), *src.add(2 * i as usize + 1));
            *dst.add(2 * i as usize) = Fp8::E4M3.pack2(hi, lo);
            *dst.add(2 * i as usize + 1) = Fp8::E5M2.pack2(hi, lo);
        }
    }
}
