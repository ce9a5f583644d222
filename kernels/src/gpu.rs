//! The slice of `cuda_std` these kernels need, on rustc's own NVPTX backend.
//!
//! `cuda_std` targets `rustc_codegen_nvvm`, which is not usable with a current toolchain
//! (see the README); `core::arch::nvptx` offers the same special registers directly.

use core::arch::{asm, nvptx};

/// `threadIdx.x`, `threadIdx.y`.
#[inline(always)]
pub fn thread_idx() -> (u32, u32) {
    // SAFETY: reading special registers has no preconditions.
    unsafe { (nvptx::_thread_idx_x() as u32, nvptx::_thread_idx_y() as u32) }
}

/// `blockIdx.x`, `blockIdx.y`.
#[inline(always)]
pub fn block_idx() -> (u32, u32) {
    // SAFETY: as above.
    unsafe { (nvptx::_block_idx_x() as u32, nvptx::_block_idx_y() as u32) }
}

/// `blockDim.x`, `blockDim.y`.
#[inline(always)]
pub fn block_dim() -> (u32, u32) {
    // SAFETY: as above.
    unsafe { (nvptx::_block_dim_x() as u32, nvptx::_block_dim_y() as u32) }
}

/// Four f32 with 16-byte alignment, moved with one `ld.global.v4` / `st.global.v4`.
#[repr(C, align(16))]
#[derive(Clone, Copy)]
pub struct F32x4(pub [f32; 4]);

/// A vector of `N` f32 moved with one memory access where the width allows.
pub trait Vector: Copy {
    /// Elements per vector.
    const N: usize;
    /// Reads `N` elements at `p`.
    ///
    /// # Safety
    /// `p` is valid for `N` reads and aligned to the vector's size.
    unsafe fn load(p: *const f32) -> Self;
    /// Writes `N` elements at `p`; same contract as [`Vector::load`].
    unsafe fn store(self, p: *mut f32);
    /// Element `i`.
    fn get(&self, i: usize) -> f32;
    /// Sets element `i`.
    fn set(&mut self, i: usize, v: f32);
}

impl Vector for F32x4 {
    const N: usize = 4;
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        let (a, b, c, d): (f32, f32, f32, f32);
        // Kernel arguments arrive inside a params struct, so LLVM cannot prove the pointer
        // global and would emit a generic `ld`; name the state space explicitly.
        asm!(
            "ld.global.v4.f32 {{{}, {}, {}, {}}}, [{}];",
            out(reg32) a, out(reg32) b, out(reg32) c, out(reg32) d,
            in(reg64) p,
            options(readonly, nostack, preserves_flags),
        );
        F32x4([a, b, c, d])
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        let v = self.0;
        asm!(
            "st.global.v4.f32 [{}], {{{}, {}, {}, {}}};",
            in(reg64) p,
            in(reg32) v[0], in(reg32) v[1], in(reg32) v[2], in(reg32) v[3],
            options(nostack, preserves_flags),
        );
    }
    #[inline(always)]
    fn get(&self, i: usize) -> f32 {
        self.0[i]
    }
    #[inline(always)]
    fn set(&mut self, i: usize, v: f32) {
        self.0[i] = v;
    }
}

impl Vector for f32 {
    const N: usize = 1;
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        let v: f32;
        asm!("ld.global.f32 {}, [{}];", out(reg32) v, in(reg64) p, options(readonly, nostack, preserves_flags));
        v
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        asm!("st.global.f32 [{}], {};", in(reg64) p, in(reg32) self, options(nostack, preserves_flags));
    }
    #[inline(always)]
    fn get(&self, _: usize) -> f32 {
        *self
    }
    #[inline(always)]
    fn set(&mut self, _: usize, v: f32) {
        *self = v;
    }
}

#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    // SAFETY: `trap` aborts the kernel; nothing runs after it.
    unsafe { nvptx::trap() }
}
