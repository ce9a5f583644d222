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
//! [`rope`], [`rope_i`] and [`rope_thd`] are drop-ins for `candle_nn::rotary_emb`'s functions of
//! those names and signatures (the caller's cos and sin tables): a model switches with one
//! import.
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

use std::sync::{Arc, Mutex};

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::{CudaDType, CudaDevice};
use candle_core::{CpuStorage, CudaStorage, CustomOp3, DType as CDType, Device, Shape, Storage, StorageRef, WithDType};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DeviceRepr};

use crate::error::{Error, Result};
use crate::kernels::Kernels;
use crate::operand::{Element, Hold, Operand, OperandMut, Scalar};
use crate::{KvAppend, KvCache, Layout, Positions, Rope, RopeArgs, RopeStyle, TableRope, Tensor, TensorMut};

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

/// candle_nn's `rope`, on CUDA by this crate's kernels: `xs` `[b, h, t, d]`, rotated in
/// rotate-half (NeoX) pairs by the tables `cos` and `sin` (`[t', d / 2]`, `t' >= t`, for every
/// sequence, or `[b, t, d / 2]`, one per sequence; `xs`'s dtype), token `s` by row `s`. Returns
/// a new contiguous tensor.
///
/// Each output element is within 1 ulp of the rotation by the tables' entries (as given),
/// correctly rounded. `xs` may be any strided view whose last axis is contiguous; the tables
/// are contiguous. On the CPU, the same rotation in f64, rounded once. The kernels load into
/// the device's context on its first call (per context, kept for the process).
///
/// ```no_run
/// use candle_core::{DType, Device, Tensor};
/// let device = Device::new_cuda(0)?;
/// let xs = Tensor::randn(0f32, 1.0, (1, 32, 16, 128), &device)?.to_dtype(DType::BF16)?;
/// let angles = Tensor::arange(0f32, 16.0 * 64.0, &device)?.reshape((16, 64))?;
/// let (cos, sin) = (angles.cos()?.to_dtype(DType::BF16)?, angles.sin()?.to_dtype(DType::BF16)?);
/// let rotated = rope_cuda::candle::rope(&xs, &cos, &sin)?; // as candle_nn::rotary_emb::rope
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn rope(
    xs: &candle_core::Tensor,
    cos: &candle_core::Tensor,
    sin: &candle_core::Tensor,
) -> candle_core::Result<candle_core::Tensor> {
    xs.apply_op3_no_bwd(cos, sin, &DropIn { style: RopeStyle::NeoX, axes: Axes::Bhsd, name: "rope-cuda-rope" })
}

/// candle_nn's `rope_i`: as [`rope`], in interleaved (GPT-J) pairs.
pub fn rope_i(
    xs: &candle_core::Tensor,
    cos: &candle_core::Tensor,
    sin: &candle_core::Tensor,
) -> candle_core::Result<candle_core::Tensor> {
    xs.apply_op3_no_bwd(cos, sin, &DropIn { style: RopeStyle::GptJ, axes: Axes::Bhsd, name: "rope-cuda-rope-i" })
}

/// candle_nn's `rope_thd`: as [`rope`] (rotate-half pairs), `xs` laid out `[b, t, h, d]`.
pub fn rope_thd(
    xs: &candle_core::Tensor,
    cos: &candle_core::Tensor,
    sin: &candle_core::Tensor,
) -> candle_core::Result<candle_core::Tensor> {
    xs.apply_op3_no_bwd(cos, sin, &DropIn { style: RopeStyle::NeoX, axes: Axes::Bshd, name: "rope-cuda-rope-thd" })
}

/// The drop-ins' op: the style and `xs`'s axes.
struct DropIn {
    style: RopeStyle,
    axes: Axes,
    name: &'static str,
}

/// A table's layout as [`TableRope`] takes it, `[batch, rows, 1, half]`, from candle's
/// `[rows, half]` or `[batch, rows, half]` (its last axis contiguous).
fn table_layout(what: &'static str, l: &candle_core::Layout) -> Result<Layout> {
    let (d, st) = (l.dims(), l.stride());
    let ([b, rows, half], [sb, sr]) = match (d, st) {
        (&[rows, half], &[sr, _]) => ([1, rows, half], [rows * sr, sr]),
        (&[b, rows, half], &[sb, sr, _]) => ([b, rows, half], [sb, sr]),
        _ => return Err(Error::Rank { what, expected: 2, got: d.to_vec() }),
    };
    if st[st.len() - 1] != 1 && half > 1 {
        return Err(Error::Candle { what, why: format!("the last axis has stride {}, not 1", st[st.len() - 1]) });
    }
    Ok(Layout::strided([b, rows, 1, half], [sb, sr, half], l.start_offset()))
}

/// A drop-in's `xs` as this crate's layout.
fn xs_layout(axes: Axes, l: &candle_core::Layout) -> Result<Layout> {
    let (dims, st) = (l.dims(), l.stride());
    if dims.len() != 4 {
        return Err(Error::Rank { what: "xs", expected: 4, got: dims.to_vec() });
    }
    if st[3] != 1 && dims[3] > 1 {
        return Err(Error::Candle { what: "xs", why: format!("the last axis has stride {}, not 1", st[3]) });
    }
    Ok(match axes {
        Axes::Bhsd => Layout::strided([dims[0], dims[2], dims[1], dims[3]], [st[0], st[2], st[1]], l.start_offset()),
        _ => Layout::strided([dims[0], dims[1], dims[2], dims[3]], [st[0], st[1], st[2]], l.start_offset()),
    })
}

/// The drop-ins' [`TableRope`] of each context (kernels loaded on first use, kept).
static TABLE_ROPES: Mutex<Vec<(usize, Arc<TableRope>)>> = Mutex::new(Vec::new());

fn table_rope(stream: &Arc<CudaStream>) -> Result<Arc<TableRope>> {
    let ctx = stream.context();
    let key = ctx.cu_ctx() as usize;
    let mut all = TABLE_ROPES.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, t)) = all.iter().find(|(k, _)| *k == key) {
        return Ok(Arc::clone(t));
    }
    let kernels = crate::cudarc::load(ctx)?;
    let t = Arc::new(TableRope::new(&kernels)?);
    all.push((key, Arc::clone(&t)));
    Ok(t)
}

impl DropIn {
    /// The rotation on candle's CUDA buffers of element type `T`, into a new buffer.
    #[allow(clippy::too_many_arguments)]
    fn cuda<T: Scalar + Element + CudaDType + DeviceRepr>(
        &self,
        dev: &CudaDevice,
        x: &CudaSlice<T>,
        lx: &candle_core::Layout,
        cos: &CudaSlice<T>,
        lc: &candle_core::Layout,
        sin: &CudaSlice<T>,
        ls: &candle_core::Layout,
    ) -> Result<CudaSlice<T>> {
        let stream = dev.cuda_stream();
        let rope = table_rope(&stream)?;
        let (xl, cl, sl) = (xs_layout(self.axes, lx)?, table_layout("cos", lc)?, table_layout("sin", ls)?);
        let [b, t, h, d] = xl.shape;
        let out_layout = match self.axes {
            Axes::Bhsd => Layout::strided([b, t, h, d], [h * t * d, d, t * d], 0),
            _ => Layout::bshd(b, t, h, d),
        };
        let n = b * t * h * d;
        // SAFETY: every element is written by the rotation below before candle reads it (the
        // call returns an error, dropping the buffer, where the rotation is not queued).
        let out = unsafe { dev.alloc::<T>(n) }.map_err(|e| Error::Candle { what: "output", why: e.to_string() })?;
        let xt = Tensor::new(Shared::whole(x, &stream), xl);
        let (ct, st) = (Tensor::new(Shared::whole(cos, &stream), cl), Tensor::new(Shared::whole(sin, &stream), sl));
        {
            let mut ot = TensorMut::new(Shared::whole(&out, &stream), out_layout);
            let args = RopeArgs::into(&xt, &mut ot, Positions::sequential());
            rope.apply(self.style, args, &ct, &st, &*stream)?;
        }
        Ok(out)
    }

    /// The rotation on the CPU, in f64, each output rounded once.
    fn cpu<T: WithDType>(
        &self,
        x: &[T],
        lx: &candle_core::Layout,
        cos: &[T],
        lc: &candle_core::Layout,
        sin: &[T],
        ls: &candle_core::Layout,
    ) -> Result<Vec<T>> {
        let (xl, cl, sl) = (xs_layout(self.axes, lx)?, table_layout("cos", lc)?, table_layout("sin", ls)?);
        let [b, t, h, d] = xl.shape;
        let [tb, rows, _, half] = cl.shape;
        if sl.shape != cl.shape {
            return Err(Error::Shape { what: "sin", axis: "rows", expected: rows, got: sl.shape[1] });
        }
        if 2 * half != d || t > rows || (tb != 1 && tb != b) {
            return Err(Error::Candle {
                what: "cos",
                why: format!("tables of shape {:?} for xs {:?}", lc.dims(), lx.dims()),
            });
        }
        let mut out = vec![T::zero(); b * t * h * d];
        for (bi, s, hi) in (0..b).flat_map(|bi| (0..t).flat_map(move |s| (0..h).map(move |hi| (bi, s, hi)))) {
            let at = xl.offset + bi * xl.strides[0] + s * xl.strides[1] + hi * xl.strides[2];
            let o = match self.axes {
                Axes::Bhsd => ((bi * h + hi) * t + s) * d,
                _ => ((bi * t + s) * h + hi) * d,
            };
            let tab = (if tb > 1 { bi } else { 0 }) * cl.strides[0] + s * cl.strides[1];
            for i in 0..half {
                let (c, sn) = (cos[cl.offset + tab + i].to_f64(), sin[sl.offset + tab + i].to_f64());
                let (i1, i2) = match self.style {
                    RopeStyle::NeoX => (i, i + half),
                    RopeStyle::GptJ => (2 * i, 2 * i + 1),
                };
                let (x1, x2) = (x[at + i1].to_f64(), x[at + i2].to_f64());
                out[o + i1] = T::from_f64(x1 * c - x2 * sn);
                out[o + i2] = T::from_f64(x1 * sn + x2 * c);
            }
        }
        Ok(out)
    }

    /// The output's shape: `xs`'s.
    fn shape(lx: &candle_core::Layout) -> Shape {
        lx.shape().clone()
    }
}

impl CustomOp3 for DropIn {
    fn name(&self) -> &'static str {
        self.name
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &candle_core::Layout,
        s2: &CpuStorage,
        l2: &candle_core::Layout,
        s3: &CpuStorage,
        l3: &candle_core::Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        fn run<T: WithDType>(
            op: &DropIn,
            [s1, s2, s3]: [&CpuStorage; 3],
            [l1, l2, l3]: [&candle_core::Layout; 3],
        ) -> candle_core::Result<CpuStorage> {
            let out = op.cpu(s1.as_slice::<T>()?, l1, s2.as_slice::<T>()?, l2, s3.as_slice::<T>()?, l3)?;
            Ok(T::to_cpu_storage_owned(out))
        }
        let (s, l) = ([s1, s2, s3], [l1, l2, l3]);
        for (what, t) in [("cos", s2), ("sin", s3)] {
            if t.dtype() != s1.dtype() {
                return Err(Error::Candle { what, why: format!("dtype {:?}, xs {:?}", t.dtype(), s1.dtype()) }.into());
            }
        }
        let out = match s1.dtype() {
            CDType::F32 => run::<f32>(self, s, l)?,
            CDType::F64 => run::<f64>(self, s, l)?,
            CDType::F16 => run::<half2::f16>(self, s, l)?,
            CDType::BF16 => run::<half2::bf16>(self, s, l)?,
            other => return Err(unsupported("xs", other).into()),
        };
        Ok((out, Self::shape(l1)))
    }

    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &candle_core::Layout,
        s2: &CudaStorage,
        l2: &candle_core::Layout,
        s3: &CudaStorage,
        l3: &candle_core::Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let dev = s1.device();
        for (what, t) in [("cos", s2), ("sin", s3)] {
            if t.dtype() != s1.dtype() {
                let e = Error::DType { what, expected: dtype_of(s1.dtype())?, got: dtype_of(t.dtype())? };
                return Err(e.into());
            }
        }
        let (x, c, s) = (s1, s2, s3);
        let out = match s1.dtype() {
            CDType::F32 => CudaStorage::wrap_cuda_slice(
                self.cuda(dev, slice::<f32>("xs", x)?, l1, slice("cos", c)?, l2, slice("sin", s)?, l3)?,
                dev.clone(),
            ),
            CDType::F16 => CudaStorage::wrap_cuda_slice(
                self.cuda(dev, slice::<half2::f16>("xs", x)?, l1, slice("cos", c)?, l2, slice("sin", s)?, l3)?,
                dev.clone(),
            ),
            CDType::BF16 => CudaStorage::wrap_cuda_slice(
                self.cuda(dev, slice::<half2::bf16>("xs", x)?, l1, slice("cos", c)?, l2, slice("sin", s)?, l3)?,
                dev.clone(),
            ),
            other => return Err(unsupported("xs", other).into()),
        };
        Ok((out, Self::shape(l1)))
    }
}

/// This crate's element type of a candle dtype the kernels take.
fn dtype_of(d: CDType) -> Result<crate::DType> {
    Ok(match d {
        CDType::F32 => crate::DType::F32,
        CDType::F16 => crate::DType::F16,
        CDType::BF16 => crate::DType::BF16,
        other => return Err(unsupported("xs", other)),
    })
}
