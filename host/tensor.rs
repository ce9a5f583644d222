//! Views of device buffers handed to the kernels: typed (over any [`Operand`], each with its
//! own element type) and raw (device addresses from any CUDA library).

use crate::config::DType;
use crate::layout::Layout;
use crate::operand::{Element, Hold, Operand, OperandMut};
pub use rope_cuda_kernels::views::PositionKind;

/// A device buffer of `len` elements of type `dtype` at address `ptr`, viewed through `layout`:
/// built by [`RawTensor::new`] (the typed doors' `raw()` give each [`Tensor`]'s), so that a
/// field added later breaks no caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct RawTensor {
    /// Device address (`CUdeviceptr`) of element 0 of the buffer.
    pub ptr: u64,
    /// Elements in the buffer: the view must stay inside it.
    pub len: usize,
    /// The elements' type.
    pub dtype: DType,
    /// The view.
    pub layout: Layout,
}

impl RawTensor {
    /// `len` elements of `dtype` at `ptr`, viewed through `layout`.
    pub const fn new(ptr: u64, len: usize, dtype: DType, layout: Layout) -> Self {
        RawTensor { ptr, len, dtype, layout }
    }

    /// The view's first element's address.
    pub(crate) fn address(&self) -> u64 {
        self.ptr + (self.layout.offset * self.dtype.size()) as u64
    }
}

/// A read-only view of a tensor (q, k, new keys or values) in a device buffer of any
/// [`Operand`] whose elements are an [`Element`], with the operand's [`Hold`].
#[derive(Debug, Clone, Copy)]
pub struct Tensor<'a> {
    pub(crate) raw: RawTensor,
    pub(crate) hold: Hold<'a>,
}

impl<'a> Tensor<'a> {
    /// Views `buf` through `layout` (checked against the buffer when used).
    ///
    /// ```
    /// # let Ok(_ctx) = cust::quick_init() else { return Ok(()) }; // no GPU: nothing to run
    /// # let kernels = rope_cuda::Kernels::load()?;
    /// # let stream = cust::stream::Stream::new(cust::stream::StreamFlags::NON_BLOCKING, None)?;
    /// use cust::memory::DeviceBuffer;
    /// use rope_cuda::{Layout, Tensor};
    /// let k = DeviceBuffer::from_slice(&vec![0.0f32; 2 * 8 * 64])?;
    /// let view = Tensor::new(&k, Layout::bhsd(1, 2, 8, 64)); // [1, 2 heads, 8 tokens, 64]
    /// # let _ = view;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn new<O: Operand<'a, Elem: Element>>(buf: O, layout: Layout) -> Self {
        let (ptr, len, hold) = buf.lend();
        Tensor { raw: RawTensor::new(ptr, len, O::Elem::DTYPE, layout), hold }
    }
}

/// A writable view of a tensor (q or k rotated in place, an output) in a device buffer of any
/// [`OperandMut`] whose elements are an [`Element`] (see [`Tensor`]).
#[derive(Debug)]
pub struct TensorMut<'a> {
    pub(crate) raw: RawTensor,
    pub(crate) hold: Hold<'a>,
}

impl<'a> TensorMut<'a> {
    /// Views `buf` through `layout` (checked against the buffer when used).
    ///
    /// ```
    /// # let Ok(_ctx) = cust::quick_init() else { return Ok(()) }; // no GPU: nothing to run
    /// # let kernels = rope_cuda::Kernels::load()?;
    /// # let stream = cust::stream::Stream::new(cust::stream::StreamFlags::NON_BLOCKING, None)?;
    /// use cust::memory::DeviceBuffer;
    /// use rope_cuda::{Layout, TensorMut};
    /// let mut q = DeviceBuffer::from_slice(&vec![0.0f32; 5 * 4 * 64])?;
    /// let view = TensorMut::new(&mut q, Layout::packed(5, 4, 64)); // 5 packed tokens, 4 heads
    /// let read_only = view.as_tensor();
    /// # let _ = read_only;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn new<O: OperandMut<'a, Elem: Element>>(buf: O, layout: Layout) -> Self {
        let (ptr, len, hold) = buf.lend();
        TensorMut { raw: RawTensor::new(ptr, len, O::Elem::DTYPE, layout), hold }
    }

    /// Two writable views of one buffer, such as q and k in a fused QKV buffer. Launches
    /// check that they share no element (else [`Error::Aliasing`](crate::Error::Aliasing)).
    ///
    /// ```
    /// # let Ok(_ctx) = cust::quick_init() else { return Ok(()) }; // no GPU: nothing to run
    /// # let kernels = rope_cuda::Kernels::load()?;
    /// # let stream = cust::stream::Stream::new(cust::stream::StreamFlags::NON_BLOCKING, None)?;
    /// use cust::memory::DeviceBuffer;
    /// use rope_cuda::{Layout, TensorMut};
    /// // Rows of 8 q heads, 2 k heads and 2 v heads of 64, 3 tokens.
    /// let row = 12 * 64;
    /// let mut qkv = DeviceBuffer::from_slice(&vec![0.0f32; 3 * row])?;
    /// let q = Layout::strided([1, 3, 8, 64], [3 * row, row, 64], 0);
    /// let k = Layout::strided([1, 3, 2, 64], [3 * row, row, 64], 8 * 64);
    /// let (q, k) = TensorMut::pair(&mut qkv, q, k);
    /// # let _ = (q, k);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn pair(buf: impl OperandMut<'a, Elem: Element>, a: Layout, b: Layout) -> (Self, Self) {
        let first = TensorMut::new(buf, a);
        let second = TensorMut { raw: RawTensor { layout: b, ..first.raw }, hold: first.hold };
        (first, second)
    }

    /// The same view, read-only.
    pub fn as_tensor(&self) -> Tensor<'_> {
        Tensor { raw: self.raw, hold: self.hold }
    }
}

/// Where the kernels find each token's position: the typed form of [`RawPositions`], built
/// from an [`Operand`] of the kind's integer type.
#[derive(Debug, Clone, Copy)]
pub struct Positions<'a> {
    raw: RawPositions,
    pub(crate) hold: Hold<'a>,
}

impl<'a> Positions<'a> {
    /// Token `s` of each sequence is at position `s`.
    pub fn sequential() -> Self {
        Positions { raw: RawPositions::SEQUENTIAL, hold: Hold::none() }
    }

    /// One i32 id per token, `[batch, seq]` row-major.
    pub fn ids_i32(buf: impl Operand<'a, Elem = i32>) -> Self {
        Self::of(PositionKind::IdsI32, buf)
    }

    /// One i64 id per token, `[batch, seq]` row-major.
    pub fn ids_i64(buf: impl Operand<'a, Elem = i64>) -> Self {
        Self::of(PositionKind::IdsI64, buf)
    }

    /// One i32 start per sequence: token `s` of sequence `b` is at `offsets[b] + s`.
    pub fn offsets_i32(buf: impl Operand<'a, Elem = i32>) -> Self {
        Self::of(PositionKind::OffsetsI32, buf)
    }

    /// One i64 start per sequence.
    pub fn offsets_i64(buf: impl Operand<'a, Elem = i64>) -> Self {
        Self::of(PositionKind::OffsetsI64, buf)
    }

    /// Multimodal RoPE: three i32 positions per token (temporal, height, width), `[3, batch *
    /// seq]` row-major, as transformers' `position_ids` of shape `[3, batch, seq]`.
    pub fn streams_i32(buf: impl Operand<'a, Elem = i32>) -> Self {
        Self::of(PositionKind::StreamsI32, buf)
    }

    /// Multimodal RoPE: three i64 positions per token, as [`Positions::streams_i32`].
    pub fn streams_i64(buf: impl Operand<'a, Elem = i64>) -> Self {
        Self::of(PositionKind::StreamsI64, buf)
    }

    /// The positions as a device address, for the raw entry points.
    pub fn raw(&self) -> RawPositions {
        self.raw
    }

    fn of(kind: PositionKind, buf: impl Operand<'a>) -> Self {
        let (ptr, len, hold) = buf.lend();
        Positions { raw: RawPositions { kind, ptr, len }, hold }
    }
}

/// Positions as a device address, for the raw entry points
/// ([`Rope::apply_raw`](crate::Rope::apply_raw), [`Rope::append_kv_raw`](crate::Rope::append_kv_raw)):
/// built by [`RawPositions::new`] or [`Positions::raw`] (or [`RawPositions::SEQUENTIAL`]), so
/// that a field added later breaks no caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct RawPositions {
    /// How they are read.
    pub kind: PositionKind,
    /// Device address of the first id or offset (ignored for [`PositionKind::Sequential`]).
    pub ptr: u64,
    /// Number of ids (`batch * seq`), offsets (`batch`) or streamed positions (`3 * batch *
    /// seq`).
    pub len: usize,
}

impl RawPositions {
    /// Positions `0..seq` in every sequence.
    pub const SEQUENTIAL: RawPositions = RawPositions { kind: PositionKind::Sequential, ptr: 0, len: 0 };

    /// `len` ids, offsets or streamed positions of `kind` at device address `ptr`.
    pub const fn new(kind: PositionKind, ptr: u64, len: usize) -> Self {
        RawPositions { kind, ptr, len }
    }
}
