//! cudarc interop (cargo feature `cudarc`): RoPE, the fused append and the reference update
//! on cudarc's buffers (`CudaSlice`, `CudaView`, `CudaViewMut`: anything implementing its
//! `DevicePtr` / `DevicePtrMut`) and streams, with the same checks and typed errors as the
//! cust API, through the same raw launches.
//!
//! cudarc's `CudaContext` is the device's primary context, which cust uses too: load the
//! kernels into it with [`load`] (or call [`Kernels::load`] while it is bound to the thread).
//! The views below take each buffer's address through cudarc's `device_ptr` /
//! `device_ptr_mut`, so cudarc orders the launch after earlier work on the buffer from other
//! streams, and records it for later work, exactly as for its own launches.
//!
//! ```no_run
//! use cudarc::driver::CudaContext;
//! use rope_cuda::cudarc::{load, Positions, ViewMut};
//! use rope_cuda::{DType, Direction, Layout, Rope, RopeConfig};
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
//! let (mut q, mut k) = ViewMut::pair(&mut qkv, q, k, &stream);
//! let positions = Positions::ids_i32(&ids, &stream);
//! rope.apply_in_place_cudarc(&mut q, Some(&mut k), &positions, Direction::Forward, &stream)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop};
use cust::sys as cuda;

use crate::config::{DType, Direction};
use crate::error::{Error, Result};
use crate::kernels::Kernels;
use crate::kv::{RawKvArgs, RawKvCache};
use crate::layout::Layout;
use crate::rope::Rope;
use crate::seed::{KvShape, KvUpdate, UpdateBuffers};
use crate::tensor::{PositionKind, RawArgs, RawPositions, RawTensor};

/// Element types of cudarc buffers the kernels take: `f32`, and `f16` / `bf16` of `half` 2
/// (cudarc's) or of `half` 1.8 (cust's).
pub trait CudarcElement {
    /// The matching [`DType`].
    const DTYPE: DType;
}

impl CudarcElement for f32 {
    const DTYPE: DType = DType::F32;
}
impl CudarcElement for half2::f16 {
    const DTYPE: DType = DType::F16;
}
impl CudarcElement for half2::bf16 {
    const DTYPE: DType = DType::BF16;
}
impl CudarcElement for half::f16 {
    const DTYPE: DType = DType::F16;
}
impl CudarcElement for half::bf16 {
    const DTYPE: DType = DType::BF16;
}

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

/// The raw stream of `stream`, after checking that it belongs to the kernels' context and
/// binding that context to the calling thread (launches go to the current context).
fn raw_stream(kernels: &Kernels, stream: &CudaStream) -> Result<cuda::CUstream> {
    let ctx = stream.context();
    if !std::ptr::eq(ctx.cu_ctx().cast::<()>(), kernels.context().cast::<()>()) {
        return Err(Error::Device { what: "stream", expected: kernels.device(), got: ctx.ordinal() as i32 });
    }
    ctx.bind_to_thread().map_err(|e| driver_error("cuCtxSetCurrent", e))?;
    Ok(stream.cu_stream() as cuda::CUstream)
}

/// A read-only view of a cudarc buffer, `[batch, seq, heads, head_dim]` through a [`Layout`]
/// (checked against the buffer when used). Holds cudarc's read record until dropped: drop it
/// after the call that uses it.
#[derive(Debug)]
pub struct View<'a> {
    raw: RawTensor,
    _sync: SyncOnDrop<'a>,
}

impl<'a> View<'a> {
    /// Views `buf` through `layout`, for work on `stream`.
    pub fn new<T: CudarcElement>(buf: &'a impl DevicePtr<T>, layout: Layout, stream: &'a CudaStream) -> Self {
        let len = buf.len();
        let (ptr, sync) = buf.device_ptr(stream);
        View { raw: RawTensor::new(ptr, len, T::DTYPE, layout), _sync: sync }
    }
}

/// A writable view of a cudarc buffer (see [`View`]).
#[derive(Debug)]
pub struct ViewMut<'a> {
    raw: RawTensor,
    _sync: Option<SyncOnDrop<'a>>,
}

impl<'a> ViewMut<'a> {
    /// Views `buf` through `layout`, for work on `stream`.
    pub fn new<T: CudarcElement>(buf: &'a mut impl DevicePtrMut<T>, layout: Layout, stream: &'a CudaStream) -> Self {
        let len = buf.len();
        let (ptr, sync) = buf.device_ptr_mut(stream);
        ViewMut { raw: RawTensor::new(ptr, len, T::DTYPE, layout), _sync: Some(sync) }
    }

    /// Two writable views of one buffer, such as q and k of a fused QKV buffer. Launches check
    /// that they share no element ([`Error::Aliasing`]).
    pub fn pair<T: CudarcElement>(
        buf: &'a mut impl DevicePtrMut<T>,
        a: Layout,
        b: Layout,
        stream: &'a CudaStream,
    ) -> (Self, Self) {
        let first = ViewMut::new(buf, a, stream);
        let second = ViewMut { raw: RawTensor { layout: b, ..first.raw }, _sync: None };
        (first, second)
    }
}

/// Where the kernels find each token's position (see [`crate::Positions`]), from cudarc
/// buffers.
#[derive(Debug)]
pub struct Positions<'a> {
    raw: RawPositions,
    _sync: Option<SyncOnDrop<'a>>,
}

impl<'a> Positions<'a> {
    /// Token `s` of each sequence is at position `s`.
    pub fn sequential() -> Self {
        Positions { raw: RawPositions::SEQUENTIAL, _sync: None }
    }

    /// One i32 id per token, `[batch, seq]` row-major.
    pub fn ids_i32(buf: &'a impl DevicePtr<i32>, stream: &'a CudaStream) -> Self {
        Self::of(PositionKind::IdsI32, buf, stream)
    }

    /// One i64 id per token.
    pub fn ids_i64(buf: &'a impl DevicePtr<i64>, stream: &'a CudaStream) -> Self {
        Self::of(PositionKind::IdsI64, buf, stream)
    }

    /// One i32 start per sequence: token `s` of sequence `b` is at `offsets[b] + s`.
    pub fn offsets_i32(buf: &'a impl DevicePtr<i32>, stream: &'a CudaStream) -> Self {
        Self::of(PositionKind::OffsetsI32, buf, stream)
    }

    /// One i64 start per sequence.
    pub fn offsets_i64(buf: &'a impl DevicePtr<i64>, stream: &'a CudaStream) -> Self {
        Self::of(PositionKind::OffsetsI64, buf, stream)
    }

    /// Multimodal RoPE: three i32 positions per token, `[3, batch * seq]`.
    pub fn streams_i32(buf: &'a impl DevicePtr<i32>, stream: &'a CudaStream) -> Self {
        Self::of(PositionKind::StreamsI32, buf, stream)
    }

    /// Multimodal RoPE: three i64 positions per token, `[3, batch * seq]`.
    pub fn streams_i64(buf: &'a impl DevicePtr<i64>, stream: &'a CudaStream) -> Self {
        Self::of(PositionKind::StreamsI64, buf, stream)
    }

    fn of<T>(kind: PositionKind, buf: &'a impl DevicePtr<T>, stream: &'a CudaStream) -> Self {
        let len = buf.len();
        let (ptr, sync) = buf.device_ptr(stream);
        Positions { raw: RawPositions { kind, ptr, len }, _sync: Some(sync) }
    }
}

/// A paged cache's i64 slot mapping, one per token (`-1`: padding), from a cudarc buffer.
#[derive(Debug)]
pub struct Slots<'a> {
    ptr: u64,
    len: usize,
    _sync: SyncOnDrop<'a>,
}

impl<'a> Slots<'a> {
    /// The mapping in `buf`, for work on `stream`.
    pub fn new(buf: &'a impl DevicePtr<i64>, stream: &'a CudaStream) -> Self {
        let len = buf.len();
        let (ptr, sync) = buf.device_ptr(stream);
        Slots { ptr, len, _sync: sync }
    }
}

/// A key cache and a value cache of one layout (see [`crate::KvCache`]), in cudarc buffers.
#[derive(Debug)]
pub struct KvCache<'a> {
    k: ViewMut<'a>,
    v: ViewMut<'a>,
    paged: bool,
}

impl<'a> KvCache<'a> {
    /// A contiguous cache: token `s` of sequence `b` goes to row `position` of block `b`.
    pub fn contiguous<T: CudarcElement>(
        k: &'a mut impl DevicePtrMut<T>,
        v: &'a mut impl DevicePtrMut<T>,
        layout: Layout,
        stream: &'a CudaStream,
    ) -> Self {
        KvCache { k: ViewMut::new(k, layout, stream), v: ViewMut::new(v, layout, stream), paged: false }
    }

    /// A paged cache: token `t` goes to slot `slots[t]`.
    pub fn paged<T: CudarcElement>(
        k: &'a mut impl DevicePtrMut<T>,
        v: &'a mut impl DevicePtrMut<T>,
        layout: Layout,
        stream: &'a CudaStream,
    ) -> Self {
        KvCache { k: ViewMut::new(k, layout, stream), v: ViewMut::new(v, layout, stream), paged: true }
    }
}

/// Everything one KV append takes (see [`crate::KvAppend`]), in cudarc buffers.
#[derive(Debug)]
pub struct Append<'r, 'a> {
    /// Queries to rotate in place in the same launch.
    pub q: Option<&'r mut ViewMut<'a>>,
    /// New keys, rotated into the key cache.
    pub k: &'r View<'a>,
    /// New values, copied into the value cache.
    pub v: &'r View<'a>,
    /// The caches.
    pub cache: &'r mut KvCache<'a>,
    /// The tokens' positions.
    pub positions: &'r Positions<'a>,
    /// Paged caches: the slot mapping.
    pub slots: Option<&'r Slots<'a>>,
}

impl Rope {
    /// [`Rope::apply_in_place`] on cudarc buffers and a cudarc stream of the kernels' context.
    pub fn apply_in_place_cudarc(
        &self,
        q: &mut ViewMut<'_>,
        k: Option<&mut ViewMut<'_>>,
        positions: &Positions<'_>,
        direction: Direction,
        stream: &CudaStream,
    ) -> Result<()> {
        let args =
            RawArgs { q: q.raw, q_out: None, k: k.map(|k| k.raw), k_out: None, positions: positions.raw, direction };
        let stream = raw_stream(self.kernels(), stream)?;
        // SAFETY: the views hold cudarc buffers of their dtype, borrowed (q and k mutably)
        // until they are dropped, after this call has queued its work; `raw_stream` checked
        // the stream's context.
        unsafe { self.apply_raw(&args, stream) }
    }

    /// [`Rope::apply`] on cudarc buffers and a cudarc stream of the kernels' context.
    ///
    /// ```
    /// # let Ok(ctx) = cudarc::driver::CudaContext::new(0) else { return Ok(()) }; // no GPU
    /// # let stream = ctx.default_stream();
    /// # let kernels = rope_cuda::cudarc::load(&ctx)?;
    /// use rope_cuda::cudarc::{Positions, View, ViewMut};
    /// use rope_cuda::{Direction, Layout, Rope, RopeConfig};
    /// let rope = Rope::new(&kernels, RopeConfig::new(64, 128))?;
    /// let l = Layout::bshd(1, 4, 2, 64);
    /// let q = stream.clone_htod(&vec![0.5f32; 4 * 2 * 64])?;
    /// let mut q_out = stream.alloc_zeros::<f32>(4 * 2 * 64)?;
    /// let offsets = stream.clone_htod(&[10i32])?;
    /// {
    ///     let (qv, mut ov) = (View::new(&q, l, &stream), ViewMut::new(&mut q_out, l, &stream));
    ///     let positions = Positions::offsets_i32(&offsets, &stream);
    ///     rope.apply_cudarc(&qv, &mut ov, None, &positions, Direction::Forward, &stream)?;
    /// }
    /// rope.check_errors_cudarc(&stream)?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn apply_cudarc(
        &self,
        q: &View<'_>,
        q_out: &mut ViewMut<'_>,
        k: Option<(&View<'_>, &mut ViewMut<'_>)>,
        positions: &Positions<'_>,
        direction: Direction,
        stream: &CudaStream,
    ) -> Result<()> {
        let (k, k_out) = k.map(|(k, o)| (k.raw, o.raw)).unzip();
        let args = RawArgs { q: q.raw, q_out: Some(q_out.raw), k, k_out, positions: positions.raw, direction };
        let stream = raw_stream(self.kernels(), stream)?;
        // SAFETY: as in `apply_in_place_cudarc`.
        unsafe { self.apply_raw(&args, stream) }
    }

    /// [`Rope::append_kv`] on cudarc buffers and a cudarc stream of the kernels' context.
    ///
    /// ```
    /// # let Ok(ctx) = cudarc::driver::CudaContext::new(0) else { return Ok(()) }; // no GPU
    /// # let stream = ctx.default_stream();
    /// # let kernels = rope_cuda::cudarc::load(&ctx)?;
    /// use rope_cuda::cudarc::{Append, KvCache, Positions, Slots, View};
    /// use rope_cuda::{Layout, Rope, RopeConfig};
    /// let rope = Rope::new(&kernels, RopeConfig::new(64, 128))?;
    /// let new = Layout::packed(2, 1, 64); // 2 tokens, 1 kv head
    /// let (k, v) = (stream.clone_htod(&vec![1.0f32; 128])?, stream.clone_htod(&vec![2.0f32; 128])?);
    /// let (mut kc, mut vc) = (stream.alloc_zeros::<f32>(4 * 16 * 64)?, stream.alloc_zeros::<f32>(4 * 16 * 64)?);
    /// let (ids, slots) = (stream.clone_htod(&[7i32, 8])?, stream.clone_htod(&[23i64, -1])?); // token 1 is padding
    /// {
    ///     let (kv, vv) = (View::new(&k, new, &stream), View::new(&v, new, &stream));
    ///     let mut cache = KvCache::paged(&mut kc, &mut vc, Layout::bshd(4, 16, 1, 64), &stream);
    ///     let (positions, slots) = (Positions::ids_i32(&ids, &stream), Slots::new(&slots, &stream));
    ///     let args = Append { q: None, k: &kv, v: &vv, cache: &mut cache, positions: &positions, slots: Some(&slots) };
    ///     rope.append_kv_cudarc(args, &stream)?;
    /// }
    /// rope.check_errors_cudarc(&stream)?;
    /// let values = stream.clone_dtoh(&vc)?;
    /// assert!(values[23 * 64..24 * 64].iter().all(|&x| x == 2.0));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn append_kv_cudarc(&self, args: Append<'_, '_>, stream: &CudaStream) -> Result<()> {
        let raw = RawKvArgs {
            q: args.q.map(|q| q.raw),
            k: args.k.raw,
            v: args.v.raw,
            cache: RawKvCache { k: args.cache.k.raw, v: args.cache.v.raw, paged: args.cache.paged },
            positions: args.positions.raw,
            slots: args.slots.map(|s| (s.ptr, s.len)),
        };
        let stream = raw_stream(self.kernels(), stream)?;
        // SAFETY: as in `apply_in_place_cudarc`, for every buffer of the append.
        unsafe { self.append_kv_raw(&raw, stream) }
    }
}

impl Rope {
    /// [`Rope::check_errors`] after the work on a cudarc stream: synchronises it, then reports
    /// (and clears) what the records hold.
    pub fn check_errors_cudarc(&self, stream: &CudaStream) -> Result<()> {
        let raw = raw_stream(self.kernels(), stream)?;
        self.core.check_errors_raw(raw, self.config().max_position)
    }
}

impl KvUpdate {
    /// [`KvUpdate::check_errors`] after the work on a cudarc stream.
    pub fn check_errors_cudarc(&self, stream: &CudaStream) -> Result<()> {
        let raw = raw_stream(self.kernels(), stream)?;
        self.check_errors_raw(raw)
    }

    /// [`KvUpdate::update_kv_cache`] on cudarc buffers and a cudarc stream of the kernels'
    /// context.
    ///
    /// ```
    /// # let Ok(ctx) = cudarc::driver::CudaContext::new(0) else { return Ok(()) }; // no GPU
    /// # let stream = ctx.default_stream();
    /// # let kernels = rope_cuda::cudarc::load(&ctx)?;
    /// use rope_cuda::seed::{KvShape, KvUpdate};
    /// let shape = KvShape { batch: 1, new_tokens: 1, heads: 1, head_dim: 2, cache_len: 4 };
    /// let (x, table) = (stream.clone_htod(&[1.0f32, 0.0])?, stream.clone_htod(&[1.0f32; 4])?);
    /// let cache = stream.alloc_zeros::<f32>(8)?;
    /// let positions = stream.clone_htod(&[2i32])?;
    /// let mut out = stream.alloc_zeros::<f32>(16)?;
    /// let update = KvUpdate::new(&kernels)?;
    /// update.update_kv_cache_cudarc(shape, &x, &x, &table, &table, &cache, &cache, &positions, &mut out, &stream)?;
    /// update.check_errors_cudarc(&stream)?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[allow(clippy::too_many_arguments)]
    pub fn update_kv_cache_cudarc<T: CudarcElement>(
        &self,
        shape: KvShape,
        k_new: &impl DevicePtr<T>,
        v_new: &impl DevicePtr<T>,
        cos: &impl DevicePtr<T>,
        sin: &impl DevicePtr<T>,
        cache_k: &impl DevicePtr<T>,
        cache_v: &impl DevicePtr<T>,
        positions: &impl DevicePtr<i32>,
        out: &mut impl DevicePtrMut<T>,
        stream: &CudaStream,
    ) -> Result<()> {
        let raw = raw_stream(self.kernels(), stream)?;
        let (out_len, (out_ptr, _out_sync)) = (out.len(), out.device_ptr_mut(stream));
        let (k_new_ptr, _s0) = k_new.device_ptr(stream);
        let (v_new_ptr, _s1) = v_new.device_ptr(stream);
        let (cos_ptr, _s2) = cos.device_ptr(stream);
        let (sin_ptr, _s3) = sin.device_ptr(stream);
        let (cache_k_ptr, _s4) = cache_k.device_ptr(stream);
        let (cache_v_ptr, _s5) = cache_v.device_ptr(stream);
        let (positions_ptr, _s6) = positions.device_ptr(stream);
        let buffers = UpdateBuffers {
            k_new: (k_new_ptr, k_new.len()),
            v_new: (v_new_ptr, v_new.len()),
            cos: (cos_ptr, cos.len()),
            sin: (sin_ptr, sin.len()),
            cache_k: (cache_k_ptr, cache_k.len()),
            cache_v: (cache_v_ptr, cache_v.len()),
            positions: (positions_ptr, positions.len()),
            out: (out_ptr, out_len),
        };
        // SAFETY: every buffer is a cudarc allocation of its type, borrowed (`out` mutably)
        // until the records drop at the end of this call, after the work is queued;
        // `raw_stream` checked the stream's context.
        unsafe { self.update_kv_cache_raw(T::DTYPE, shape, &buffers, raw) }
    }
}
