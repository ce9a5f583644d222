//! The second reference operation, exactly: `update_kv_cache(k_new, v_new, cos, sin,
//! cache_k, cache_v, positions)`, built on the fused append's plan and kernels with the
//! caller's tables.

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;

use cust::sys as cuda;
use rope_cuda_kernels::keys::TableSource;
use rope_cuda_kernels::views::{CallerView, SourceView};

use crate::config::{DType, RopeStyle};
use crate::driver;
use crate::error::{Error, Result};
use crate::kernels::Kernels;
use crate::kv::{plan_kv, KvCall, KvSpec, RawKvArgs, RawKvCache};
use crate::launch::Core;
use crate::layout::Layout;
use crate::operand::{on_stream, Element, Operand, OperandMut, Queue};
use crate::tensor::{PositionKind, RawPositions, RawTensor};

/// The shape of the reference KV-cache update.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvShape {
    /// Sequences, `B`.
    pub batch: usize,
    /// New tokens per sequence, `T`.
    pub new_tokens: usize,
    /// Heads, `H`.
    pub heads: usize,
    /// Head dimension, `D` (even).
    pub head_dim: usize,
    /// Cache length, `S` (also the rows of the cos/sin tables).
    pub cache_len: usize,
}

/// The buffers of one reference update, each as its device address and its length in
/// elements ([`KvUpdate::update_kv_cache_raw`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UpdateBuffers {
    /// New keys `[B, T, H, D]`.
    pub k_new: (u64, usize),
    /// New values `[B, T, H, D]`.
    pub v_new: (u64, usize),
    /// Cosines `[S, D / 2]`.
    pub cos: (u64, usize),
    /// Sines `[S, D / 2]`.
    pub sin: (u64, usize),
    /// Key cache `[B, S, H, D]` (read only).
    pub cache_k: (u64, usize),
    /// Value cache `[B, S, H, D]` (read only).
    pub cache_v: (u64, usize),
    /// i32 positions `[B, T]`.
    pub positions: (u64, usize),
    /// Both caches, updated, stacked `[2, B, S, H, D]` (written).
    pub out: (u64, usize),
}

/// The project's second reference operation, exactly: `update_kv_cache(k_new, v_new, cos,
/// sin, cache_k, cache_v, positions)`.
///
/// ```no_run
/// # use rope_cuda::Kernels;
/// # use rope_cuda::seed::{KvShape, KvUpdate};
/// # use cust::memory::DeviceBuffer;
/// # use cust::stream::{Stream, StreamFlags};
/// let _ctx = cust::quick_init()?;
/// let kernels = Kernels::load()?;
/// let stream = Stream::new(StreamFlags::NON_BLOCKING, None)?;
/// let shape = KvShape { batch: 2, new_tokens: 16, heads: 4, head_dim: 32, cache_len: 128 };
/// let new = DeviceBuffer::from_slice(&vec![0.5f32; 2 * 16 * 4 * 32])?;
/// let table = DeviceBuffer::from_slice(&vec![1.0f32; 128 * 16])?;
/// let cache = DeviceBuffer::from_slice(&vec![0.0f32; 2 * 128 * 4 * 32])?;
/// let positions = DeviceBuffer::from_slice(&(0..32).map(|t| t % 16 + 7).collect::<Vec<i32>>())?;
/// let mut out = DeviceBuffer::from_slice(&vec![0.0f32; 2 * 2 * 128 * 4 * 32])?;
/// let update = KvUpdate::new(&kernels)?;
/// update.update_kv_cache(shape, &new, &new, &table, &table, &cache, &cache, &positions, &mut out, &stream)?;
/// update.check_errors(&stream)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct KvUpdate {
    core: Core,
    /// `S` of the last call, for error reports.
    cache_len: AtomicUsize,
}

impl KvUpdate {
    /// Allocates the error records, in the current context.
    pub fn new(kernels: &Arc<Kernels>) -> Result<Self> {
        Ok(KvUpdate { core: Core::new(kernels)?, cache_len: AtomicUsize::new(0) })
    }

    /// The kernels this update launches.
    pub fn kernels(&self) -> &Arc<Kernels> {
        &self.core.kernels
    }

    /// `k_new`, `v_new`: `[B, T, H, D]`; `cos`, `sin`: `[S, D / 2]` (the caller's, in the
    /// element type; the math is f32); `cache_k`, `cache_v`: `[B, S, H, D]`, not modified;
    /// `positions`: i32 `[B, T]`; `out`: `[2, B, S, H, D]`, both caches stacked, with each
    /// token's key rotated in interleaved (GPT-J) pairs by the table row at its position and
    /// written with its value at that position. A later token wins a repeated position, as
    /// in the sequential reference. A position outside `0..S` is skipped and recorded
    /// ([`KvUpdate::check_errors`]).
    ///
    /// Every buffer's length must be exactly its shape's; an `Err` means nothing was queued.
    /// The buffers are any [`Operand`]s of one element type (positions: i32), cust's or
    /// cudarc's, the stream any [`Queue`].
    ///
    /// ```
    /// # let Ok(_ctx) = cust::quick_init() else { return Ok(()) }; // no GPU: nothing to run
    /// # let kernels = rope_cuda::Kernels::load()?;
    /// # let stream = cust::stream::Stream::new(cust::stream::StreamFlags::NON_BLOCKING, None)?;
    /// use cust::memory::{CopyDestination, DeviceBuffer};
    /// use rope_cuda::seed::{KvShape, KvUpdate};
    /// let shape = KvShape { batch: 1, new_tokens: 2, heads: 1, head_dim: 4, cache_len: 8 };
    /// let new = DeviceBuffer::from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])?;
    /// // Tables of angle 0 at every position (cos 1, sin 0): keys are written unrotated.
    /// let (cos, sin) = (DeviceBuffer::from_slice(&[1.0f32; 16])?, DeviceBuffer::from_slice(&[0.0f32; 16])?);
    /// let cache = DeviceBuffer::from_slice(&[0.0f32; 32])?;
    /// let positions = DeviceBuffer::from_slice(&[6i32, 2])?;
    /// let mut out = DeviceBuffer::from_slice(&[-1.0f32; 64])?;
    /// let update = KvUpdate::new(&kernels)?;
    /// update.update_kv_cache(shape, &new, &new, &cos, &sin, &cache, &cache, &positions, &mut out, &stream)?;
    /// update.check_errors(&stream)?;
    /// let mut host = [0.0f32; 64];
    /// out.copy_to(&mut host[..])?;
    /// assert_eq!(host[24..28], [1.0, 2.0, 3.0, 4.0]); // token 0 at position 6 of the key cache
    /// assert_eq!(host[32 + 8..32 + 12], [5.0, 6.0, 7.0, 8.0]); // token 1 at position 2 of the values
    /// assert_eq!(host[0..4], [0.0; 4]); // the rest is the old cache
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[allow(clippy::too_many_arguments)]
    pub fn update_kv_cache<'a, T: Element>(
        &self,
        shape: KvShape,
        k_new: impl Operand<'a, Elem = T>,
        v_new: impl Operand<'a, Elem = T>,
        cos: impl Operand<'a, Elem = T>,
        sin: impl Operand<'a, Elem = T>,
        cache_k: impl Operand<'a, Elem = T>,
        cache_v: impl Operand<'a, Elem = T>,
        positions: impl Operand<'a, Elem = i32>,
        out: impl OperandMut<'a, Elem = T>,
        stream: &impl Queue,
    ) -> Result<()> {
        let stream = stream.raw(self.kernels())?;
        let lent = [
            ("k_new", k_new.lend()),
            ("v_new", v_new.lend()),
            ("cos", cos.lend()),
            ("sin", sin.lend()),
            ("cache_k", cache_k.lend()),
            ("cache_v", cache_v.lend()),
            ("positions", positions.lend()),
            ("out", out.lend()),
        ];
        let [k_new, v_new, cos, sin, cache_k, cache_v, positions, out] = lent.map(|(_, (ptr, len, _))| (ptr, len));
        let buffers = UpdateBuffers { k_new, v_new, cos, sin, cache_k, cache_v, positions, out };
        let holds = lent.each_ref().map(|(what, (_, _, hold))| (*what, Some(hold)));
        // SAFETY: each operand lends a live buffer of its type (`out` exclusively), ordered for
        // work on `stream` (checked) by its borrow and its record, made after the work is
        // queued; the `Queue` vouches for the stream; the raw update checks the rest.
        on_stream(holds, stream, || unsafe { self.update_kv_cache_raw(T::DTYPE, shape, &buffers, stream) })
    }

    /// [`KvUpdate::update_kv_cache`] on device addresses (each buffer as its address and its
    /// length in elements) and a raw stream.
    ///
    /// # Safety
    /// Each address is a live device allocation of this update's context holding `len`
    /// elements of `dtype` (positions: i32), not freed, and (`out`) not read or written by
    /// others, until the work queued on `stream` completes; `stream` is a stream of that
    /// context.
    ///
    /// ```
    /// # let Ok(_ctx) = cust::quick_init() else { return Ok(()) }; // no GPU: nothing to run
    /// # let kernels = rope_cuda::Kernels::load()?;
    /// # let stream = cust::stream::Stream::new(cust::stream::StreamFlags::NON_BLOCKING, None)?;
    /// use cust::memory::DeviceBuffer;
    /// use rope_cuda::seed::{KvShape, KvUpdate, UpdateBuffers};
    /// use rope_cuda::DType;
    /// let shape = KvShape { batch: 1, new_tokens: 1, heads: 1, head_dim: 2, cache_len: 4 };
    /// let x = DeviceBuffer::from_slice(&[1.0f32, 0.0])?;
    /// let table = DeviceBuffer::from_slice(&[1.0f32; 4])?;
    /// let cache = DeviceBuffer::from_slice(&[0.0f32; 8])?;
    /// let positions = DeviceBuffer::from_slice(&[3i32])?;
    /// let out = DeviceBuffer::from_slice(&[0.0f32; 16])?;
    /// let of = |b: &DeviceBuffer<f32>| (b.as_device_ptr().as_raw(), b.len());
    /// let buffers = UpdateBuffers {
    ///     k_new: of(&x),
    ///     v_new: of(&x),
    ///     cos: of(&table),
    ///     sin: of(&table),
    ///     cache_k: of(&cache),
    ///     cache_v: of(&cache),
    ///     positions: (positions.as_device_ptr().as_raw(), 1),
    ///     out: of(&out),
    /// };
    /// let update = KvUpdate::new(&kernels)?;
    /// // SAFETY: every address is a live allocation of this context of the length given, `out`
    /// // used by nothing else, all kept until `check_errors` synchronises.
    /// unsafe { update.update_kv_cache_raw(DType::F32, shape, &buffers, stream.as_inner())? };
    /// update.check_errors(&stream)?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub unsafe fn update_kv_cache_raw(
        &self,
        dtype: DType,
        shape: KvShape,
        buffers: &UpdateBuffers,
        raw_stream: cuda::CUstream,
    ) -> Result<()> {
        let KvShape { batch: b, new_tokens: t, heads: h, head_dim: d, cache_len: s } = shape;
        if d < 2 || d % 2 != 0 {
            return Err(Error::HeadDim { head_dim: d });
        }
        let size = dtype.size();
        let n = |dims: &[usize]| dims.iter().try_fold(1usize, |a, &x| a.checked_mul(x)).unwrap_or(usize::MAX);
        let UpdateBuffers { k_new, v_new, cos, sin, cache_k, cache_v, positions, out } = *buffers;
        let lengths: [(&'static str, &[usize], usize); 8] = [
            ("k_new", &[b, t, h, d], k_new.1),
            ("v_new", &[b, t, h, d], v_new.1),
            ("cos", &[s, d / 2], cos.1),
            ("sin", &[s, d / 2], sin.1),
            ("cache_k", &[b, s, h, d], cache_k.1),
            ("cache_v", &[b, s, h, d], cache_v.1),
            ("positions", &[b, t], positions.1),
            ("out", &[2, b, s, h, d], out.1),
        ];
        for (what, dims, got) in lengths {
            if n(dims) != got {
                return Err(Error::Length { what, shape: dims.to_vec(), expected: n(dims), got });
            }
        }
        let out_range = (out.0, out.1 * size);
        let inputs = [
            ("k_new", k_new.0, k_new.1 * size),
            ("v_new", v_new.0, v_new.1 * size),
            ("cos", cos.0, cos.1 * size),
            ("sin", sin.0, sin.1 * size),
            ("cache_k", cache_k.0, cache_k.1 * size),
            ("cache_v", cache_v.0, cache_v.1 * size),
            ("positions", positions.0, positions.1 * 4),
        ];
        for (what, ptr, len) in inputs {
            let (a0, a1, b0, b1) = (out_range.0, out_range.0 + out_range.1 as u64, ptr, ptr + len as u64);
            if len > 0 && out_range.1 > 0 && a0 < b1 && b0 < a1 {
                return Err(Error::Aliasing { a: "out", b: what });
            }
        }
        for (what, ptr, _) in inputs.iter().chain([&("out", out.0, 0)]) {
            let align = if *what == "positions" { 4 } else { size };
            if ptr % align as u64 != 0 {
                return Err(Error::Alignment { what, address: *ptr, align });
            }
        }
        let cache_elems = b * s * h * d;
        let half_out = out.0 + (cache_elems * size) as u64;
        let new_layout = Layout::bshd(b, t, h, d);
        let cache_layout = Layout::bshd(b, s, h, d);
        let args = RawKvArgs {
            q: None,
            q_fp8: None,
            k: RawTensor::new(k_new.0, k_new.1, dtype, new_layout),
            v: RawTensor::new(v_new.0, v_new.1, dtype, new_layout),
            cache: RawKvCache::contiguous(
                RawTensor::new(out.0, cache_elems, dtype, cache_layout),
                RawTensor::new(half_out, cache_elems, dtype, cache_layout),
            ),
            positions: RawPositions { kind: PositionKind::IdsI32, ptr: positions.0, len: positions.1 },
            slots: None,
            norm: None,
        };
        let spec = KvSpec {
            dtype,
            style: RopeStyle::GptJ,
            head_dim: d,
            rotary_dim: d,
            max_position: s,
            tables: TableSource::Caller,
            mrope: None,
        };
        let table = SourceView::Caller(CallerView::new(cos.0, sin.0));
        let plan = plan_kv(&spec, &KvCall::APPEND, &args, table, self.core.records.sink())?;
        let devices = inputs.map(|(what, ptr, _)| (what, ptr));
        self.core.prepare(&devices, false)?;
        self.core.prepare(&[("out", out.0)], false)?;
        let bytes = cache_elems * size;
        for (dst, src) in [(out.0, cache_k.0), (half_out, cache_v.0)] {
            match crate::graph::record_copy(dst, src, bytes) {
                Some(recorded) => recorded?,
                None => {
                    // SAFETY: the lengths were checked above: both caches hold `cache_elems`
                    // elements and `out` twice that, and `out` overlaps no input.
                    unsafe { driver::memcpy_dtod_async(dst, src, bytes, raw_stream) }?
                }
            }
        }
        let Some(plan) = plan else { return Ok(()) };
        self.cache_len.store(s, Relaxed);
        // SAFETY: `plan_kv` checked the views against the lengths above; the table lengths
        // were checked against `S * D / 2`, which covers every position below `S`.
        unsafe { plan.launch(&self.core, raw_stream, None) }
    }

    /// Synchronises `stream`, then reports (and clears) the out-of-range positions recorded
    /// since the last check.
    ///
    /// ```
    /// # let Ok(_ctx) = cust::quick_init() else { return Ok(()) }; // no GPU: nothing to run
    /// # let kernels = rope_cuda::Kernels::load()?;
    /// # let stream = cust::stream::Stream::new(cust::stream::StreamFlags::NON_BLOCKING, None)?;
    /// use cust::memory::DeviceBuffer;
    /// use rope_cuda::seed::{KvShape, KvUpdate};
    /// use rope_cuda::Error;
    /// let shape = KvShape { batch: 1, new_tokens: 1, heads: 1, head_dim: 2, cache_len: 4 };
    /// let (x, table) = (DeviceBuffer::from_slice(&[1.0f32, 0.0])?, DeviceBuffer::from_slice(&[1.0f32; 4])?);
    /// let cache = DeviceBuffer::from_slice(&[0.0f32; 8])?;
    /// let positions = DeviceBuffer::from_slice(&[4i32])?; // the cache holds 0..4
    /// let mut out = DeviceBuffer::from_slice(&[0.0f32; 16])?;
    /// let update = KvUpdate::new(&kernels)?;
    /// update.update_kv_cache(shape, &x, &x, &table, &table, &cache, &cache, &positions, &mut out, &stream)?;
    /// let e = update.check_errors(&stream);
    /// assert!(matches!(e, Err(Error::PositionOutOfRange { token: 0, position: 4, max_position: 4, .. })), "{e:?}");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn check_errors(&self, stream: &impl Queue) -> Result<()> {
        self.core.check_errors_raw(stream.raw(self.kernels())?, self.cache_len.load(Relaxed))
    }
}
