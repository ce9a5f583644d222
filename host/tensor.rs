//! Views of device buffers handed to the kernels: typed (borrowing cust buffers) and raw
//! (device addresses from any CUDA library).

use std::marker::PhantomData;

use cust::memory::{DeviceCopy, DeviceSlice};

use crate::config::DType;
use crate::layout::Layout;
pub use rope_cuda_kernels::views::PositionKind;

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
}

/// Element types the kernels take: `f32`, `half::f16`, `half::bf16`.
pub trait Element: DeviceCopy + sealed::Sealed {
    /// The matching [`DType`].
    const DTYPE: DType;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
}
impl Element for half::f16 {
    const DTYPE: DType = DType::F16;
}
impl Element for half::bf16 {
    const DTYPE: DType = DType::BF16;
}

/// A device buffer of `len` elements of type `dtype` at address `ptr`, viewed through `layout`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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

/// A read-only view of q or k in a cust buffer.
#[derive(Debug)]
pub struct Tensor<'a, T> {
    pub(crate) raw: RawTensor,
    /// Borrows the buffer (a `DeviceSlice<T>`) for `'a`.
    _borrow: PhantomData<&'a [T]>,
}

impl<T> Clone for Tensor<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Tensor<'_, T> {}

impl<'a, T: Element> Tensor<'a, T> {
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
    pub fn new(buf: &'a DeviceSlice<T>, layout: Layout) -> Self {
        Tensor { raw: RawTensor::new(buf.as_device_ptr().as_raw(), buf.len(), T::DTYPE, layout), _borrow: PhantomData }
    }
}

/// A writable view of q or k (or of an output) in a cust buffer.
#[derive(Debug)]
pub struct TensorMut<'a, T> {
    pub(crate) raw: RawTensor,
    /// Borrows the buffer mutably for `'a`.
    _borrow: PhantomData<&'a mut [T]>,
}

impl<'a, T: Element> TensorMut<'a, T> {
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
    pub fn new(buf: &'a mut DeviceSlice<T>, layout: Layout) -> Self {
        let raw = RawTensor::new(buf.as_device_ptr().as_raw(), buf.len(), T::DTYPE, layout);
        TensorMut { raw, _borrow: PhantomData }
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
    pub fn pair(buf: &'a mut DeviceSlice<T>, a: Layout, b: Layout) -> (Self, Self) {
        let (ptr, len) = (buf.as_device_ptr().as_raw(), buf.len());
        let view = |layout| TensorMut { raw: RawTensor::new(ptr, len, T::DTYPE, layout), _borrow: PhantomData };
        (view(a), view(b))
    }

    /// The same view, read-only.
    pub fn as_tensor(&self) -> Tensor<'_, T> {
        Tensor { raw: self.raw, _borrow: PhantomData }
    }
}

/// Where the kernels find each token's position: the typed form of [`RawPositions`], with
/// the same names as [`PositionKind`].
#[derive(Debug, Clone, Copy)]
pub enum Positions<'a> {
    /// Token `s` of each sequence is at position `s`.
    Sequential,
    /// One i32 id per token, `[batch, seq]` row-major.
    IdsI32(&'a DeviceSlice<i32>),
    /// One i64 id per token, `[batch, seq]` row-major.
    IdsI64(&'a DeviceSlice<i64>),
    /// One i32 start per sequence: token `s` of sequence `b` is at `offsets[b] + s`.
    OffsetsI32(&'a DeviceSlice<i32>),
    /// One i64 start per sequence.
    OffsetsI64(&'a DeviceSlice<i64>),
    /// Multimodal RoPE: three i32 positions per token (temporal, height, width), `[3, batch *
    /// seq]` row-major, as transformers' `position_ids` of shape `[3, batch, seq]`.
    StreamsI32(&'a DeviceSlice<i32>),
    /// Multimodal RoPE: three i64 positions per token, as [`Positions::StreamsI32`].
    StreamsI64(&'a DeviceSlice<i64>),
}

/// Positions as a device address, for the raw entry points
/// ([`Rope::apply_raw`](crate::Rope::apply_raw), [`Rope::append_kv_raw`](crate::Rope::append_kv_raw)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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
}

impl Positions<'_> {
    pub(crate) fn raw(&self) -> RawPositions {
        fn of<T: DeviceCopy>(kind: PositionKind, s: &DeviceSlice<T>) -> RawPositions {
            RawPositions { kind, ptr: s.as_device_ptr().as_raw(), len: s.len() }
        }
        match self {
            Positions::Sequential => RawPositions::SEQUENTIAL,
            Positions::IdsI32(s) => of(PositionKind::IdsI32, s),
            Positions::IdsI64(s) => of(PositionKind::IdsI64, s),
            Positions::OffsetsI32(s) => of(PositionKind::OffsetsI32, s),
            Positions::OffsetsI64(s) => of(PositionKind::OffsetsI64, s),
            Positions::StreamsI32(s) => of(PositionKind::StreamsI32, s),
            Positions::StreamsI64(s) => of(PositionKind::StreamsI64, s),
        }
    }
}

/// Everything one RoPE launch takes, as device addresses. Each tensor carries its element
/// type: q's and k's must be the configuration's, and each output's one a kernel writes from
/// them (so far: the same).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawArgs {
    /// The queries.
    pub q: RawTensor,
    /// Where rotated q goes; `None`: in place.
    pub q_out: Option<RawTensor>,
    /// The keys, if any.
    pub k: Option<RawTensor>,
    /// Where rotated k goes; `None`: in place. Present exactly when `q_out` is.
    pub k_out: Option<RawTensor>,
    /// The positions.
    pub positions: RawPositions,
    /// Forward or inverse rotation.
    pub direction: crate::config::Direction,
}
