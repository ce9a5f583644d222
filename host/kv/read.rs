//! The dequantizing read of FP8 cache rows ([`Rope::read_kv`]).

use cust::sys as cuda;
use rope_cuda_kernels::keys::ReadKey;
use rope_cuda_kernels::params::{FastDiv, ReadParams};
use rope_cuda_kernels::views::{CacheView, ErrorSink, ScalesView};

use crate::config::DType;
use crate::error::{Error, Result};
use crate::kernels::Geometry;
use crate::launch::{check_axis, check_disjoint, check_u32, check_view, check_written, flat_geometry, heads_view};
use crate::layout::Layout;
use crate::operand::{on_stream, Element, Hold, Operand, Queue};
use crate::rope::Rope;
use crate::tensor::{RawTensor, Tensor, TensorMut};

use super::call::{KvCall, KvOperand};
use super::plan::cache_layout;
use super::scales::check_scales;
use super::{KvCache, KvScales, RawKvCache};

/// FP8 cache rows read back into f32, f16 or bf16 ([`Rope::read_kv`]), for tests, debugging
/// and engines that need part of the cache in 16 bits: row `r` of each output (`[batch, seq,
/// kv_heads, head_dim]`, `r = b * seq + s`) is the row of slot `slots[r]` (`-1`: the output row
/// is left as it is), each code's value times its kv head's scale, an f32 product rounded to
/// the output's type. The caches are read, not written: [`KvRead::shared`] takes them through
/// shared borrows, [`KvRead::new`] through a [`KvCache`] an engine already holds.
#[derive(Debug)]
pub struct KvRead<'r, 'a> {
    cache: RawKvCache,
    /// The caches' holds and their scales' (k, v).
    holds: [Option<Hold<'a>>; 4],
    slots: (u64, usize, Hold<'a>),
    k: Option<&'r mut TensorMut<'a>>,
    v: Option<&'r mut TensorMut<'a>>,
}

impl<'r, 'a> KvRead<'r, 'a> {
    /// A read of `cache`'s rows at `slots` (one i64 per output row; a contiguous cache's slot
    /// of sequence `b`, position `p` is `b * seq_len + p`) into no output yet: add them with
    /// [`KvRead::k`] and [`KvRead::v`].
    pub fn new(cache: &KvCache<'a>, slots: impl Operand<'a, Elem = i64>) -> Self {
        let scales = cache.scales.as_ref();
        let holds = [Some(cache.k.hold), Some(cache.v.hold), scales.map(|s| s.k.2), scales.map(|s| s.v.2)];
        KvRead { cache: cache.raw(), holds, slots: slots.lend(), k: None, v: None }
    }

    /// A read of the FP8 caches `k` and `v` (of one `layout`, `[blocks, block_size, kv_heads,
    /// head_dim]` as [`KvCache`] takes it; rows named by slot) with their `scales`, through
    /// shared borrows: reading a cache does not need the exclusive ones a [`KvCache`] holds.
    ///
    /// ```
    /// # let Ok(_ctx) = cust::quick_init() else { return Ok(()) }; // no GPU: nothing to run
    /// # let kernels = rope_cuda::Kernels::load()?;
    /// # let stream = cust::stream::Stream::new(cust::stream::StreamFlags::NON_BLOCKING, None)?;
    /// use cust::memory::DeviceBuffer;
    /// use rope_cuda::{F8E4M3, KvRead, KvScales, Layout, Rope, RopeConfig, TensorMut};
    /// let rope = Rope::new(&kernels, RopeConfig::new(64, 32))?;
    /// let (k, v) = (DeviceBuffer::from_slice(&[F8E4M3(0x38); 4 * 8 * 64])?, DeviceBuffer::from_slice(&[F8E4M3(0x38); 4 * 8 * 64])?);
    /// let scale = DeviceBuffer::from_slice(&[0.5f32])?;
    /// let slots = DeviceBuffer::from_slice(&[3i64, 17])?;
    /// let mut out = DeviceBuffer::from_slice(&[0.0f32; 2 * 64])?;
    /// let mut rows = TensorMut::new(&mut out, Layout::bshd(1, 2, 1, 64));
    /// // `&k` and `&v`: the caches stay shared (an attention kernel may read them too).
    /// let read = KvRead::shared(&k, &v, Layout::bshd(4, 8, 1, 64), KvScales::per_tensor(&scale, &scale), &slots);
    /// rope.read_kv(read.k(&mut rows), &stream)?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn shared(
        k: impl Operand<'a, Elem: Element>,
        v: impl Operand<'a, Elem: Element>,
        layout: Layout,
        scales: KvScales<'a>,
        slots: impl Operand<'a, Elem = i64>,
    ) -> Self {
        let (k, v) = (Tensor::new(k, layout), Tensor::new(v, layout));
        let holds = [Some(k.hold), Some(v.hold), Some(scales.k.2), Some(scales.v.2)];
        let cache = RawKvCache::paged(k.raw, v.raw).scales(scales.raw());
        KvRead { cache, holds, slots: slots.lend(), k: None, v: None }
    }

    /// The key rows into `out`.
    pub fn k(mut self, out: &'r mut TensorMut<'a>) -> Self {
        self.k = Some(out);
        self
    }

    /// The value rows into `out`, of the key output's type where both are read.
    pub fn v(mut self, out: &'r mut TensorMut<'a>) -> Self {
        self.v = Some(out);
        self
    }

    /// The read as device addresses, for [`Rope::read_kv_raw`].
    pub fn raw(&self) -> RawKvRead {
        RawKvRead {
            cache: self.cache,
            slots: (self.slots.0, self.slots.1),
            k: self.k.as_ref().map(|t| t.raw),
            v: self.v.as_ref().map(|t| t.raw),
        }
    }

    /// Each buffer's name and hold.
    fn holds(&self) -> [(&'static str, Option<&Hold<'a>>); 7] {
        let h = &self.holds;
        [
            ("k cache", h[0].as_ref()),
            ("v cache", h[1].as_ref()),
            ("k scales", h[2].as_ref()),
            ("v scales", h[3].as_ref()),
            ("slots", Some(&self.slots.2)),
            ("k out", self.k.as_ref().map(|t| &t.hold)),
            ("v out", self.v.as_ref().map(|t| &t.hold)),
        ]
    }
}

/// A read of FP8 cache rows as device addresses ([`KvRead`]): built by [`KvRead::raw`] or by
/// [`RawKvRead::new`] and the `with_*` methods, so that a field added later breaks no caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct RawKvRead {
    /// The caches (FP8, with their scales; `paged` is ignored: rows are named by slot).
    pub cache: RawKvCache,
    /// Device address and length of the i64 slots, one per output row.
    pub slots: (u64, usize),
    /// The key rows' output.
    pub k: Option<RawTensor>,
    /// The value rows' output.
    pub v: Option<RawTensor>,
}

impl RawKvRead {
    /// A read of `cache`'s rows at `slots` (device address and length of the i64 slots, one
    /// per output row): no outputs yet; add them with [`RawKvRead::with_k`] and
    /// [`RawKvRead::with_v`] ([`KvRead::new`]).
    pub fn new(cache: RawKvCache, slots: (u64, usize)) -> Self {
        RawKvRead { cache, slots, k: None, v: None }
    }

    /// Reads the key rows into `k` ([`KvRead::k`]).
    pub fn with_k(self, k: RawTensor) -> Self {
        RawKvRead { k: Some(k), ..self }
    }

    /// Reads the value rows into `v` ([`KvRead::v`]).
    pub fn with_v(self, v: RawTensor) -> Self {
        RawKvRead { v: Some(v), ..self }
    }
}

/// Checks a read and works out its launch; `None` when there is nothing to read.
pub(super) fn plan_read(args: &RawKvRead, errors: ErrorSink) -> Result<Option<(ReadKey, ReadParams, Geometry)>> {
    let cache = &args.cache;
    if cache.k.dtype.fp8().is_none() {
        return Err(Error::DType { what: "k cache", expected: DType::E4M3, got: cache.k.dtype });
    }
    if cache.v.dtype != cache.k.dtype {
        return Err(Error::DType { what: "v cache", expected: cache.k.dtype, got: cache.v.dtype });
    }
    let cl = cache_layout(cache, false, KvOperand::name)?;
    check_view("k cache", &cache.k)?;
    check_view("v cache", &cache.v)?;
    let (blocks, block_size, heads, hd) = (cl.shape[0], cl.shape[1], cl.shape[2], cl.shape[3]);
    let scales = check_scales(cache, true, heads, &KvCall::APPEND)?.expect("FP8 caches have checked scales");
    let (slots, rows) = args.slots;
    if slots % 8 != 0 {
        return Err(Error::Alignment { what: "slots", address: slots, align: 8 });
    }
    let outs = [("k out", args.k), ("v out", args.v)];
    let mut out_type = None;
    for (what, out) in outs {
        let Some(o) = out else { continue };
        if o.dtype.fp8().is_some() || out_type.is_some_and(|t| t != o.dtype) {
            return Err(Error::DType { what, expected: out_type.unwrap_or(DType::BF16), got: o.dtype });
        }
        out_type = Some(o.dtype);
        let s = o.layout.shape;
        check_axis(what, "heads", heads, s[2])?;
        check_axis(what, "head_dim", hd, s[3])?;
        if s[0] * s[1] != rows {
            return Err(Error::Length { what: "slots", shape: vec![s[0], s[1]], expected: s[0] * s[1], got: rows });
        }
        check_view(what, &o)?;
        check_written(what, &o.layout)?;
    }
    let Some(out_type) = out_type else { return Ok(None) };
    // The outputs share nothing with each other or with what the launch reads.
    let flat = |ptr, len: usize, dtype| RawTensor::new(ptr, len, dtype, Layout::bshd(1, 1, 1, len));
    let read = [
        ("k cache", cache.k),
        ("v cache", cache.v),
        ("k scales", flat(scales.k.0, scales.k.1, DType::F32)),
        ("v scales", flat(scales.v.0, scales.v.1, DType::F32)),
        ("slots", flat(slots, 2 * rows, DType::F32)),
    ];
    for (what, o) in outs {
        let Some(o) = o else { continue };
        for (other, t) in read {
            check_disjoint((what, &o), (other, &t))?;
        }
    }
    if let (Some(k), Some(v)) = (args.k, args.v) {
        // One row index for both: the same batch and seq.
        check_axis("v out", "batch", k.layout.shape[0], v.layout.shape[0])?;
        check_axis("v out", "seq", k.layout.shape[1], v.layout.shape[1])?;
        check_disjoint(("v out", &v), ("k out", &k))?;
    }
    let num_slots = blocks.saturating_mul(block_size);
    check_u32(&[("rows", rows), ("kv heads", heads), ("cache slots (blocks * block_size)", num_slots)])?;
    let work = 2 * (heads * hd) as u64;
    let Some((geometry, chunk)) = flat_geometry(rows as u32, work)? else { return Ok(None) };
    let strides = cl.strides.map(|s| s as u64);
    let view = CacheView::paged(cache.k.address(), cache.v.address(), strides, slots, blocks as u32, block_size as u32);
    let seq = args.k.or(args.v).map_or(1, |o| o.layout.shape[1]);
    // Each output as a view's output (its rows' strides and type).
    let out = |o: Option<RawTensor>| o.map(|o| heads_view(&o, Some(&o))).unwrap_or_default();
    let params = ReadParams {
        cache: view.with_types(cache.k.dtype, cache.v.dtype),
        scales: ScalesView::new(scales.k.0, scales.v.0, scales.per_head),
        k: out(args.k),
        v: out(args.v),
        errors,
        rows: rows as u32,
        chunk,
        items_div: FastDiv::new(work as u32),
        cache_div: FastDiv::new((heads * hd) as u32),
        dim_div: FastDiv::new(hd as u32),
        seq_div: FastDiv::new(seq.max(1) as u32),
    };
    Ok(Some((ReadKey { out: out_type }, params, geometry)))
}

impl Rope {
    /// Reads rows of FP8 caches back into f32, f16 or bf16 ([`KvRead`]). A slot outside the
    /// cache skips its row and is recorded ([`Rope::check_errors`] reports it).
    ///
    /// ```
    /// # let Ok(_ctx) = cust::quick_init() else { return Ok(()) }; // no GPU: nothing to run
    /// # let kernels = rope_cuda::Kernels::load()?;
    /// # let stream = cust::stream::Stream::new(cust::stream::StreamFlags::NON_BLOCKING, None)?;
    /// use cust::memory::{CopyDestination, DeviceBuffer};
    /// use rope_cuda::{F8E4M3, KvCache, KvRead, KvScales, Layout, Rope, RopeConfig, TensorMut};
    /// let rope = Rope::new(&kernels, RopeConfig::new(64, 32))?;
    /// // An E4M3 cache of 4 pages of 8 slots, 1 kv head; its codes 0x38 (1.0), scales 0.5.
    /// let (mut k, mut v) = (DeviceBuffer::from_slice(&[F8E4M3(0x38); 4 * 8 * 64])?, DeviceBuffer::from_slice(&[F8E4M3(0x38); 4 * 8 * 64])?);
    /// let scale = DeviceBuffer::from_slice(&[0.5f32])?;
    /// let cache = KvCache::paged(&mut k, &mut v, Layout::bshd(4, 8, 1, 64)).scales(KvScales::per_tensor(&scale, &scale));
    /// let slots = DeviceBuffer::from_slice(&[3i64, 17])?;
    /// let mut out = DeviceBuffer::from_slice(&[0.0f32; 2 * 64])?;
    /// let mut rows = TensorMut::new(&mut out, Layout::bshd(1, 2, 1, 64));
    /// rope.read_kv(KvRead::new(&cache, &slots).k(&mut rows), &stream)?;
    /// rope.check_errors(&stream)?;
    /// let mut host = [0.0f32; 128];
    /// out.copy_to(&mut host[..])?;
    /// assert!(host.iter().all(|&x| x == 0.5));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn read_kv(&self, read: KvRead<'_, '_>, stream: &impl Queue) -> Result<()> {
        let stream = stream.raw(self.kernels())?;
        // SAFETY: as in `Rope::apply`, for every buffer of the read.
        on_stream(read.holds(), stream, || unsafe { self.read_kv_raw(&read.raw(), stream) })
    }

    /// [`Rope::read_kv`] on device addresses and a raw stream; an `Err` means nothing was
    /// launched.
    ///
    /// # Safety
    /// As [`Rope::append_kv_raw`], for every address of the read.
    pub unsafe fn read_kv_raw(&self, args: &RawKvRead, stream: cuda::CUstream) -> Result<()> {
        let Some((key, params, geometry)) = plan_read(args, self.core.records.sink())? else { return Ok(()) };
        let c = args.cache;
        let buffers = [
            ("k cache", c.k.ptr),
            ("v cache", c.v.ptr),
            ("k scales", c.scales.map_or(0, |s| s.k.0)),
            ("v scales", c.scales.map_or(0, |s| s.v.0)),
            ("slots", args.slots.0),
            ("k out", args.k.map_or(0, |t| t.ptr)),
            ("v out", args.v.map_or(0, |t| t.ptr)),
        ];
        self.core.prepare(&buffers, self.config.checked)?;
        let checked = self.config.checked.then_some(self.config.max_position);
        // SAFETY: the caller's contract; `plan_read` checked the caches, scales and outputs
        // against their buffers, the slots' length and alignment, and the outputs' overlaps;
        // `prepare` passed.
        unsafe { self.core.launch(key, geometry, 0, &params, stream, checked) }
    }
}
