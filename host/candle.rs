//! candle interop (cargo feature `candle`): RoPE in place and the fused RoPE + KV append on
//! candle's CUDA tensors, queued on candle's own stream, so they order with candle's work.
//!
//! A candle tensor is taken as it is, strides and offset included: [`Axes`] says which of its
//! axes are batch, sequence, heads and head_dim (`[b, h, s, d]` as candle's attention keeps
//! q and k, `[b, s, h, d]` as the projections come out, `[t, h, d]` for packed tokens); the
//! last axis must be contiguous. Positions and slot mappings are contiguous integer tensors
//! (`i32` or `i64`; slots `i64`). Every check of the typed calls applies, and a refused call
//! is a `candle_core::Error` carrying this crate's [`Error`] (its message).
//!
//! Load the kernels into candle's device with [`load`] (the device's primary context, as
//! candle's own). Tensors written in place (q and k, the caches) are written through candle's
//! shared storage: candle gives no write access from outside its crate, so the call holds the
//! tensors' read locks while it queues the work, and the work goes on candle's stream, after
//! everything candle queued before on the tensors and before everything it queues after, as
//! candle's own kernels do. A tensor that shares its storage with another the call writes is
//! written through as well (the calls refuse overlapping views, [`Error::Aliasing`]). Views of
//! one storage (q and k of a fused QKV tensor) take its read lock once each: candle's public
//! `storage_and_layout` has no recursive read, so a thread that waits for that storage's write
//! lock meanwhile (an in-place op of candle's on another thread) would wait for the call, and
//! the call for it.
//!
//! ```no_run
//! use candle_core::{DType, Device, Tensor};
//! use rope_cuda::candle::{apply, load, Axes, Ids};
//! use rope_cuda::{Rope, RopeConfig};
//!
//! let device = Device::new_cuda(0)?;
//! let kernels = load(&device)?;
//! let rope = Rope::new(&kernels, RopeConfig::new(128, 4096).dtype(rope_cuda::DType::BF16))?;
//! // 4 tokens of 1 sequence, 32 q and 8 k heads, as candle's attention holds them.
//! let q = Tensor::randn(0f32, 1.0, (1, 32, 4, 128), &device)?.to_dtype(DType::BF16)?;
//! let k = Tensor::randn(0f32, 1.0, (1, 8, 4, 128), &device)?.to_dtype(DType::BF16)?;
//! let ids = Tensor::new(&[[7i64, 8, 9, 10]], &device)?;
//! apply(&rope, &q, Some(&k), Ids::Ids(&ids), Axes::Bhsd)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::{CudaStorage, DType as CDType, Device, Storage, StorageRef};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};

use crate::error::{Error, Result};
use crate::kernels::Kernels;
use crate::operand::{Hold, Operand, OperandMut, Scalar};
use crate::{KvAppend, KvCache, Layout, Positions, Rope, RopeArgs, Tensor, TensorMut};

/// Which axes of a candle tensor are its batch, sequence, heads and head_dim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Axes {
    /// `[batch, heads, seq, head_dim]`: candle's attention after its transpose.
    Bhsd,
    /// `[batch, seq, heads, head_dim]`: the projections' output, and most caches.
    Bshd,
    /// `[tokens, heads, head_dim]`: packed tokens (one sequence of `tokens`).
    Thd,
}

/// Where a call's tokens are: positions as candle tensors (contiguous, `i32` or `i64`).
#[derive(Debug, Clone, Copy)]
pub enum Ids<'t> {
    /// Token `s` of each sequence at position `s`.
    Sequential,
    /// One position per token, `[batch, seq]`.
    Ids(&'t candle_core::Tensor),
    /// One start per sequence: token `s` of sequence `b` at `offsets[b] + s`.
    Offsets(&'t candle_core::Tensor),
}

/// The key and value caches of [`append_kv`], as candle tensors of one layout.
#[derive(Debug, Clone, Copy)]
pub struct Cache<'t> {
    /// The key cache.
    pub k: &'t candle_core::Tensor,
    /// The value cache.
    pub v: &'t candle_core::Tensor,
    /// How both are laid out: `[blocks, block_size, heads, head_dim]` paged (vLLM's) with
    /// [`Axes::Bshd`], `[blocks, heads, block_size, head_dim]` with [`Axes::Bhsd`]; contiguous
    /// caches the same, a block per sequence.
    pub axes: Axes,
    /// Paged (rows from the slot mapping) or contiguous (rows from the positions).
    pub paged: bool,
}

/// This crate's error as candle's: its message, and the error itself inside candle's
/// `Error::Cuda` (downcast to match on it; candle may wrap it with a backtrace).
impl From<Error> for candle_core::Error {
    fn from(e: Error) -> Self {
        candle_core::Error::Cuda(Box::new(e)).bt()
    }
}

/// This crate's error inside `e`, if `e` came from one (see the `From` conversion).
pub fn error_of(e: &candle_core::Error) -> Option<&Error> {
    match e {
        candle_core::Error::Cuda(inner) => inner.downcast_ref(),
        candle_core::Error::WithBacktrace { inner, .. } => error_of(inner),
        _ => None,
    }
}

/// Loads the kernels into `device`'s CUDA context (candle's), binding it to the calling thread.
pub fn load(device: &Device) -> candle_core::Result<Arc<Kernels>> {
    let stream = stream_of("device", device)?;
    Ok(crate::cudarc::load(stream.context())?)
}

/// Rotates `q` (and `k`) in place at `positions`, on candle's stream: [`Rope::apply`] on candle
/// tensors laid out as `axes` says.
pub fn apply(
    rope: &Rope,
    q: &candle_core::Tensor,
    k: Option<&candle_core::Tensor>,
    positions: Ids<'_>,
    axes: Axes,
) -> candle_core::Result<()> {
    let stream = stream_of("q", q.device())?;
    let q = Lent::of("q", q, axes)?;
    let k = k.map(|k| Lent::of("k", k, axes)).transpose()?;
    let ids = LentIds::of(positions)?;
    let mut qt = q.tensor_mut(&stream)?;
    let mut kt = k.as_ref().map(|k| k.tensor_mut(&stream)).transpose()?;
    let mut args = RopeArgs::in_place(&mut qt, ids.positions(&stream)?);
    if let Some(k) = kt.as_mut() {
        args = args.k(k);
    }
    Ok(rope.apply(args, &*stream)?)
}

/// The fused step on candle tensors, on candle's stream ([`Rope::append_kv`]): `k` rotated
/// into `cache.k`, `v` copied into `cache.v`, at `positions` (and, paged, the slots of
/// `slots`, `i64`, `-1` for padding), and `q`, if given, rotated in place; `q`, `k` and `v`
/// laid out as `axes` says.
#[allow(clippy::too_many_arguments)]
pub fn append_kv(
    rope: &Rope,
    q: Option<&candle_core::Tensor>,
    k: &candle_core::Tensor,
    v: &candle_core::Tensor,
    cache: Cache<'_>,
    positions: Ids<'_>,
    slots: Option<&candle_core::Tensor>,
    axes: Axes,
) -> candle_core::Result<()> {
    let stream = stream_of("k", k.device())?;
    let q = q.map(|q| Lent::of("q", q, axes)).transpose()?;
    let (k, v) = (Lent::of("k", k, axes)?, Lent::of("v", v, axes)?);
    let (ck, cv) = (Lent::of("k cache", cache.k, cache.axes)?, Lent::of("v cache", cache.v, cache.axes)?);
    let ids = LentIds::of(positions)?;
    let slots = slots.map(|s| LentInts::of("slots", s)).transpose()?;
    let mut qt = q.as_ref().map(|q| q.tensor_mut(&stream)).transpose()?;
    let (kt, vt) = (k.tensor(&stream)?, v.tensor(&stream)?);
    if ck.layout != cv.layout {
        return Err(Error::Candle {
            what: "v cache",
            why: format!("laid out as {:?}, the k cache as {:?}", cv.layout, ck.layout),
        }
        .into());
    }
    let (ck, cv) = (ck.tensor_mut(&stream)?, cv.tensor_mut(&stream)?);
    let mut kv = KvCache::of_views(ck, cv, cache.paged);
    let mut args = KvAppend::new(&kt, &vt, &mut kv, ids.positions(&stream)?);
    if let Some(q) = qt.as_mut() {
        args = args.q(q);
    }
    if let Some(s) = slots.as_ref() {
        args = args.slots(s.operand::<i64>(&stream)?);
    }
    Ok(rope.append_kv(args, &*stream)?)
}

/// The stream of candle's CUDA device `device`, or an error naming `what`.
fn stream_of(what: &'static str, device: &Device) -> Result<Arc<CudaStream>> {
    match device {
        Device::Cuda(d) => Ok(d.cuda_stream()),
        other => Err(Error::Candle { what, why: format!("on {other:?}, not on a CUDA device") }),
    }
}

/// A candle tensor lent to one call: its storage's read lock, held while the call queues its
/// work, and this crate's layout of it.
struct Lent<'t> {
    what: &'static str,
    storage: StorageRef<'t>,
    layout: Layout,
}

/// `make(buffer, layout)` of a [`Lent`] tensor, its buffer taken as its dtype's slice.
macro_rules! by_dtype {
    ($lent:expr, $stream:expr, $make:path) => {{
        let (lent, what) = ($lent, $lent.what);
        let s = lent.cuda()?;
        Ok(match s.dtype() {
            CDType::F32 => $make(Shared::whole(slice::<f32>(what, s)?, $stream), lent.layout),
            CDType::F16 => $make(Shared::whole(slice::<half2::f16>(what, s)?, $stream), lent.layout),
            CDType::BF16 => $make(Shared::whole(slice::<half2::bf16>(what, s)?, $stream), lent.layout),
            other => return Err(unsupported(what, other)),
        })
    }};
}

impl<'t> Lent<'t> {
    fn of(what: &'static str, t: &'t candle_core::Tensor, axes: Axes) -> Result<Self> {
        let (storage, l) = t.storage_and_layout();
        let (dims, st) = (l.dims(), l.stride());
        let rank = if axes == Axes::Thd { 3 } else { 4 };
        if dims.len() != rank {
            return Err(Error::Rank { what, expected: rank, got: dims.to_vec() });
        }
        if st[rank - 1] != 1 && dims[rank - 1] > 1 {
            return Err(Error::Candle { what, why: format!("the last axis has stride {}, not 1", st[rank - 1]) });
        }
        let (shape, strides) = match axes {
            Axes::Bshd => ([dims[0], dims[1], dims[2], dims[3]], [st[0], st[1], st[2]]),
            Axes::Bhsd => ([dims[0], dims[2], dims[1], dims[3]], [st[0], st[2], st[1]]),
            Axes::Thd => ([1, dims[0], dims[1], dims[2]], [dims[0] * st[0], st[0], st[1]]),
        };
        Ok(Lent { what, storage, layout: Layout::strided(shape, strides, l.start_offset()) })
    }

    fn cuda(&self) -> Result<&CudaStorage> {
        match &*self.storage {
            Storage::Cuda(s) => Ok(s),
            _ => Err(Error::Candle { what: self.what, why: "not in CUDA storage".into() }),
        }
    }

    /// The tensor, read.
    fn tensor<'a>(&'a self, stream: &'a Arc<CudaStream>) -> Result<Tensor<'a>> {
        by_dtype!(self, stream, Tensor::new)
    }

    /// The tensor, written in place.
    fn tensor_mut<'a>(&'a self, stream: &'a Arc<CudaStream>) -> Result<TensorMut<'a>> {
        by_dtype!(self, stream, TensorMut::new)
    }
}

/// A contiguous integer tensor (positions or slots) lent to one call: its storage's read lock
/// and where its elements are.
struct LentInts<'t> {
    what: &'static str,
    storage: StorageRef<'t>,
    offset: usize,
    len: usize,
}

impl<'t> LentInts<'t> {
    fn of(what: &'static str, t: &'t candle_core::Tensor) -> Result<Self> {
        let (storage, l) = t.storage_and_layout();
        if !l.is_contiguous() {
            return Err(Error::Candle { what, why: format!("not contiguous (strides {:?})", l.stride()) });
        }
        Ok(LentInts { what, storage, offset: l.start_offset(), len: l.shape().elem_count() })
    }

    fn cuda(&self) -> Result<&CudaStorage> {
        match &*self.storage {
            Storage::Cuda(s) => Ok(s),
            _ => Err(Error::Candle { what: self.what, why: "not in CUDA storage".into() }),
        }
    }

    fn operand<'a, T: Scalar + candle_core::cuda_backend::CudaDType>(
        &'a self,
        stream: &'a Arc<CudaStream>,
    ) -> Result<Shared<'a, T>> {
        Ok(Shared { slice: slice::<T>(self.what, self.cuda()?)?, stream, offset: self.offset, len: self.len })
    }
}

/// A call's positions, lent: none (sequential), one per token, or one start per sequence.
enum LentIds<'t> {
    Sequential,
    Ids(LentInts<'t>),
    Offsets(LentInts<'t>),
}

impl<'t> LentIds<'t> {
    fn of(ids: Ids<'t>) -> Result<Self> {
        Ok(match ids {
            Ids::Sequential => LentIds::Sequential,
            Ids::Ids(t) => LentIds::Ids(LentInts::of("positions", t)?),
            Ids::Offsets(t) => LentIds::Offsets(LentInts::of("offsets", t)?),
        })
    }

    fn positions<'a>(&'a self, stream: &'a Arc<CudaStream>) -> Result<Positions<'a>> {
        let (ints, offsets) = match self {
            LentIds::Sequential => return Ok(Positions::sequential()),
            LentIds::Ids(ints) => (ints, false),
            LentIds::Offsets(ints) => (ints, true),
        };
        Ok(match (ints.cuda()?.dtype(), offsets) {
            (CDType::I32, false) => Positions::ids_i32(ints.operand::<i32>(stream)?),
            (CDType::I64, false) => Positions::ids_i64(ints.operand::<i64>(stream)?),
            (CDType::I32, true) => Positions::offsets_i32(ints.operand::<i32>(stream)?),
            (CDType::I64, true) => Positions::offsets_i64(ints.operand::<i64>(stream)?),
            (other, _) => return Err(unsupported(ints.what, other)),
        })
    }
}

fn slice<'s, T: candle_core::cuda_backend::CudaDType>(
    what: &'static str,
    s: &'s CudaStorage,
) -> Result<&'s CudaSlice<T>> {
    s.as_cuda_slice::<T>().map_err(|_| unsupported(what, s.dtype()))
}

fn unsupported(what: &'static str, dtype: CDType) -> Error {
    Error::Candle { what, why: format!("dtype {dtype:?} is not one this call takes") }
}

/// Part of a candle CUDA buffer (`len` elements from `offset`), lent for work on candle's
/// stream; read or written (see the module's documentation).
struct Shared<'a, T> {
    slice: &'a CudaSlice<T>,
    stream: &'a Arc<CudaStream>,
    offset: usize,
    len: usize,
}

impl<'a, T> Shared<'a, T> {
    fn whole(slice: &'a CudaSlice<T>, stream: &'a Arc<CudaStream>) -> Self {
        Shared { slice, stream, offset: 0, len: slice.len() }
    }
}

// SAFETY: `device_ptr` makes the stream wait for the buffer's earlier work and its record (the
// hold's, made after each call queues its work) orders later work and the buffer's free after
// it; the storage's read lock, held for `'a`, keeps the buffer allocated; `offset + len` is
// inside the slice (a candle layout's contiguous elements, or the whole slice).
unsafe impl<'a, T: Scalar> Operand<'a> for Shared<'a, T> {
    type Elem = T;
    fn lend(self) -> (u64, usize, Hold<'a>) {
        let (ptr, sync) = self.slice.device_ptr(self.stream);
        let at = ptr + (self.offset * std::mem::size_of::<T>()) as u64;
        (at, self.len, Hold::record(sync, self.stream.cu_stream() as cust::sys::CUstream))
    }
}

// SAFETY: as above. Writes go through candle's shared storage: candle's own work on it is
// queued on the same stream, before and after the call's, and the read lock keeps candle's
// in-place operations (which take the write lock) out while the call queues.
unsafe impl<'a, T: Scalar> OperandMut<'a> for Shared<'a, T> {}
