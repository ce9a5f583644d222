//! cudarc interop (cargo feature `cudarc`): cudarc's buffers are [`Operand`]s, its streams
//! [`Queue`]s and half 2's `f16` / `bf16` [`Element`]s, so every typed call ([`Rope::apply`],
//! [`Rope::append_kv`], [`KvUpdate::update_kv_cache`](crate::seed::KvUpdate::update_kv_cache),
//! `check_errors`) takes them as it takes cust's, with the same checks and typed errors.
//!
//! cudarc's `CudaContext` is the device's primary context, which cust uses too: load the
//! kernels into it with [`load`] (or call [`Kernels::load`] while it is bound to the thread).
//! A cudarc buffer is lent together with the stream the work goes on: `(&buf, &stream)` to
//! read a `CudaSlice` or `CudaView`, `(&mut buf, &stream)` to write a `CudaSlice` or
//! `CudaViewMut` (the stream a `CudaStream` or its `Arc`). Its address is taken through
//! cudarc's `device_ptr` / `device_ptr_mut`, so cudarc orders the work after earlier work on
//! the buffer from other streams, and each call that uses the view records its work for later
//! work on the buffer (and its free), exactly as cudarc's own launches do. A call on another
//! stream than its buffers were lent for is refused ([`Error::Stream`]). A
//! cudarc stream given as the [`Queue`] must be of the kernels' context
//! ([`Error::Device`]), which the call binds to the thread.
//!
//! ```no_run
//! use cudarc::driver::CudaContext;
//! use rope_cuda::cudarc::load;
//! use rope_cuda::{DType, Layout, Positions, Rope, RopeArgs, RopeConfig, TensorMut};
//!
//! let ctx = CudaContext::new(0)?;
//! let stream = ctx.default_stream();
//! let kernels = load(&ctx)?;
//! let rope = Rope::new(&kernels, RopeConfig::new(128, 8192).dtype(DType::F32))?;
//! // 4 tokens of a fused QKV buffer: 32 q heads, 8 k heads, 8 v heads of 128.
//! let (tokens, row) = (4, 48 * 128);
//! let mut qkv = stream.alloc_zeros::<f32>(tokens * row)?;
//! let ids = stream.clone_htod(&[7i32, 8, 9, 10])?;
//! let q = Layout::strided([1, tokens, 32, 128], [tokens * row, row, 128], 0);
//! let k = Layout::strided([1, tokens, 8, 128], [tokens * row, row, 128], 32 * 128);
//! let (mut q, mut k) = TensorMut::pair((&mut qkv, &stream), q, k);
//! let positions = Positions::ids_i32((&ids, &stream));
//! rope.apply(RopeArgs::in_place(&mut q, positions).k(&mut k), &stream)?;
//! rope.check_errors(&stream)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::borrow::Borrow;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut};
use cust::sys as cuda;

use crate::error::{Error, Result};
use crate::kernels::Kernels;
use crate::operand::{elements, sealed::Sealed, Hold, Operand, OperandMut, Queue, Scalar};
#[cfg(doc)]
use crate::{operand::Element, rope::Rope};

impl Sealed for half2::f16 {}
impl Sealed for half2::bf16 {}
elements!(half2::f16 => F16, half2::bf16 => BF16);

// SAFETY: one byte, every bit pattern valid (zero is +0), no pointers.
unsafe impl cudarc::driver::DeviceRepr for crate::F8E4M3 {}
// SAFETY: as above.
unsafe impl cudarc::driver::ValidAsZeroBits for crate::F8E4M3 {}
// SAFETY: as above.
unsafe impl cudarc::driver::DeviceRepr for crate::F8E5M2 {}
// SAFETY: as above.
unsafe impl cudarc::driver::ValidAsZeroBits for crate::F8E5M2 {}

/// Binds `ctx` to the calling thread and loads the kernels into it.
///
/// ```
/// let Ok(ctx) = cudarc::driver::CudaContext::new(0) else { return Ok(()) }; // no GPU
/// let kernels = rope_cuda::cudarc::load(&ctx)?;
/// assert_eq!(kernels.device(), 0);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn load(ctx: &Arc<CudaContext>) -> Result<Arc<Kernels>> {
    ctx.bind_to_thread().map_err(|e| driver_error("cuCtxSetCurrent", e))?;
    Kernels::load()
}

fn driver_error(call: &'static str, e: cudarc::driver::DriverError) -> Error {
    Error::Driver { call, code: e.0 as u32 }
}

// SAFETY: the stream is checked to be of the kernels' context, which is bound to the thread.
unsafe impl Queue for CudaStream {
    /// The raw stream, after checking that it belongs to the kernels' context and binding that
    /// context to the calling thread (launches go to the current context).
    fn raw(&self, kernels: &Kernels) -> Result<cuda::CUstream> {
        let ctx = self.context();
        if !std::ptr::eq(ctx.cu_ctx().cast::<()>(), kernels.context().cast::<()>()) {
            return Err(Error::Device { what: "stream", expected: kernels.device(), got: ctx.ordinal() as i32 });
        }
        ctx.bind_to_thread().map_err(|e| driver_error("cuCtxSetCurrent", e))?;
        Ok(handle(self))
    }
}

// SAFETY: as for `CudaStream`.
unsafe impl Queue for Arc<CudaStream> {
    fn raw(&self, kernels: &Kernels) -> Result<cuda::CUstream> {
        (**self).raw(kernels)
    }
}

/// `stream`'s handle, as cust's type.
fn handle(stream: &CudaStream) -> cuda::CUstream {
    stream.cu_stream() as cuda::CUstream
}

/// A cudarc buffer read by work on a stream (`&CudaStream` or `&Arc<CudaStream>`).
macro_rules! readable {
    ($($buf:ty),*) => {$(
        // SAFETY: `device_ptr` makes `stream` wait for the buffer's earlier writes, and its record
        // (the hold's, made by each call after queueing) orders later writes and the buffer's
        // free after the work; the shared borrow for `'a` keeps it allocated meanwhile.
        unsafe impl<'a, T: Scalar, S: Borrow<CudaStream>> Operand<'a> for (&'a $buf, &'a S) {
            type Elem = T;
            fn lend(self) -> (u64, usize, Hold<'a>) {
                let (buf, stream) = (self.0, self.1.borrow());
                let (ptr, sync) = buf.device_ptr(stream);
                (ptr, buf.len(), Hold::record(sync, handle(stream)))
            }
        }
    )*};
}

/// A cudarc buffer written by work on a stream.
macro_rules! writable {
    ($($buf:ty),*) => {$(
        // SAFETY: as for reads, `device_ptr_mut` ordering the work after every earlier access
        // and every later access after it; the borrow for `'a` is exclusive.
        unsafe impl<'a, T: Scalar, S: Borrow<CudaStream>> Operand<'a> for (&'a mut $buf, &'a S) {
            type Elem = T;
            fn lend(self) -> (u64, usize, Hold<'a>) {
                let (buf, stream) = (self.0, self.1.borrow());
                let len = buf.len();
                let (ptr, sync) = buf.device_ptr_mut(stream);
                (ptr, len, Hold::record(sync, handle(stream)))
            }
        }

        // SAFETY: as above.
        unsafe impl<'a, T: Scalar, S: Borrow<CudaStream>> OperandMut<'a> for (&'a mut $buf, &'a S) {}
    )*};
}

readable!(CudaSlice<T>, CudaView<'_, T>);
writable!(CudaSlice<T>, CudaViewMut<'_, T>);
