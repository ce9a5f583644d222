//! The few memory operations the contract's views perform, compiled for both sides: on the
//! device as the PTX instructions the kernels need (read-only loads through the
//! non-coherent cache, reductions without a return value), on the host as plain reads and
//! `core` atomics, so that the views' methods run in the host's unit tests unchanged. And the
//! block barrier, which safe code cannot call.

/// Loads a read-only i32.
///
/// # Safety
/// `p` is valid for reads and aligned; on the device, a global address not written during
/// the kernel.
#[inline(always)]
pub unsafe fn load_i32(p: *const i32) -> i32 {
    #[cfg(target_arch = "nvptx64")]
    {
        let v: i32;
        // SAFETY: the caller's contract; one global load.
        unsafe {
            core::arch::asm!("ld.global.nc.s32 {}, [{}];", out(reg32) v, in(reg64) p,
                options(readonly, nostack, preserves_flags));
        }
        v
    }
    #[cfg(not(target_arch = "nvptx64"))]
    // SAFETY: the caller's contract.
    unsafe {
        p.read()
    }
}

/// Loads a read-only i64.
///
/// # Safety
/// As [`load_i32`].
#[inline(always)]
pub unsafe fn load_i64(p: *const i64) -> i64 {
    #[cfg(target_arch = "nvptx64")]
    {
        let v: i64;
        // SAFETY: the caller's contract; one global load.
        unsafe {
            core::arch::asm!("ld.global.nc.s64 {}, [{}];", out(reg64) v, in(reg64) p,
                options(readonly, nostack, preserves_flags));
        }
        v
    }
    #[cfg(not(target_arch = "nvptx64"))]
    // SAFETY: the caller's contract.
    unsafe {
        p.read()
    }
}

/// The atomic reductions, by name of the PTX operation.
#[derive(Clone, Copy)]
enum Reduce {
    Min,
    Max,
    Add,
}

/// `*p = op(*p, v)`, atomically, without returning the old value.
///
/// # Safety
/// `p` is valid for reads and writes and 8-byte aligned; on the device, a global address.
#[inline(always)]
unsafe fn reduce(op: Reduce, p: *mut u64, v: u64) {
    #[cfg(target_arch = "nvptx64")]
    // SAFETY: the caller's contract; one global reduction.
    unsafe {
        use core::arch::asm;
        match op {
            Reduce::Min => {
                asm!("red.global.min.u64 [{}], {};", in(reg64) p, in(reg64) v, options(nostack, preserves_flags))
            }
            Reduce::Max => {
                asm!("red.global.max.u64 [{}], {};", in(reg64) p, in(reg64) v, options(nostack, preserves_flags))
            }
            Reduce::Add => {
                asm!("red.global.add.u64 [{}], {};", in(reg64) p, in(reg64) v, options(nostack, preserves_flags))
            }
        }
    }
    #[cfg(not(target_arch = "nvptx64"))]
    {
        use core::sync::atomic::{AtomicU64, Ordering::Relaxed};
        // SAFETY: the caller's contract: valid, aligned, and only accessed atomically meanwhile.
        let a = unsafe { AtomicU64::from_ptr(p) };
        match op {
            Reduce::Min => a.fetch_min(v, Relaxed),
            Reduce::Max => a.fetch_max(v, Relaxed),
            Reduce::Add => a.fetch_add(v, Relaxed),
        };
    }
}

/// `atomicMin` on a u64, without the old value.
///
/// # Safety
/// `p` is valid for reads and writes and 8-byte aligned; on the device, a global address.
#[inline(always)]
pub unsafe fn atomic_min_u64(p: *mut u64, v: u64) {
    // SAFETY: the caller's contract.
    unsafe { reduce(Reduce::Min, p, v) }
}

/// `atomicMax` on a u64, without the old value.
///
/// # Safety
/// As [`atomic_min_u64`].
#[inline(always)]
pub unsafe fn atomic_max_u64(p: *mut u64, v: u64) {
    // SAFETY: the caller's contract.
    unsafe { reduce(Reduce::Max, p, v) }
}

/// `atomicAdd` on a u64, without the old value.
///
/// # Safety
/// As [`atomic_min_u64`].
#[inline(always)]
pub unsafe fn atomic_add_u64(p: *mut u64, v: u64) {
    // SAFETY: the caller's contract.
    unsafe { reduce(Reduce::Add, p, v) }
}

/// `__syncthreads()`: waits for every thread of the block, and makes their shared-memory
/// writes visible to each other. (On the host, where a "block" is the one calling thread,
/// it does nothing.)
///
/// A barrier that some threads of a block skip is undefined behaviour, so it is an `unsafe
/// fn`: safe code cannot call it.
///
/// ```compile_fail,E0133
/// rope_cuda_kernels::mem::sync_threads();
/// ```
///
/// # Safety
/// Every thread of the block reaches this call (no thread has returned, none branches
/// around it).
#[inline(always)]
pub unsafe fn sync_threads() {
    #[cfg(target_arch = "nvptx64")]
    // SAFETY: the caller's contract.
    unsafe {
        core::arch::nvptx::_syncthreads()
    }
}

/// Waits until every lane of `mask` of this thread's warp reaches this call, and orders the
/// memory accesses those lanes made before it before the ones they make after it
/// (`bar.warp.sync`).
///
/// # Safety
/// `mask` holds this lane, and every lane of `mask` reaches this call with the same `mask`
/// (none has exited or branches around it).
#[inline(always)]
pub unsafe fn sync_warp(mask: u32) {
    #[cfg(target_arch = "nvptx64")]
    // SAFETY: the caller's contract.
    unsafe {
        core::arch::asm!("bar.warp.sync {};", in(reg32) mask, options(nostack, preserves_flags));
    }
    #[cfg(not(target_arch = "nvptx64"))]
    let _ = mask;
}
