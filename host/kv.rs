//! KV cache: the fused RoPE + append of one decode or prefill step ([`Rope::append_kv`]) and
//! the project's reference operation ([`KvUpdate::update_kv_cache`]).

use std::marker::PhantomData;

use cust::memory::{DeviceBuffer, DeviceSlice};
use cust::stream::Stream;
use cust::sys as cuda;
use rope_cuda_kernels::params::{groups, kv_heads_per_thread, FastDiv, HeadsView, KvParams};

use crate::config::{DType, RopeStyle};
use crate::error::{driver, Error, Result};
use crate::kernels::{launch, Geometry, Kernels};
use crate::layout::{disjoint, Layout};
use crate::rope::{check_positions, dtype_index, flat_geometry, take_errors, Rope, CLEAR_RECORDS};
use crate::tensor::{Element, PositionKind, Positions, RawPositions, RawTensor, Tensor, TensorMut};

/// Calls with more tokens than this settle duplicate slots with a small claim launch before
/// the append (an owner array, one u64 per slot, kept by the [`Rope`]); smaller calls
/// (decode steps) settle them inside the one launch: each block compares its tokens' slots
/// with the later tokens' in shared memory.
pub const KV_SCAN_MAX_TOKENS: usize = 256;

/// Calls with at most this many tokens use one head per thread (more threads, shorter
/// chains: latency); larger calls share each table load across several heads (bandwidth).
const KV_PREFILL_MAX_TOKENS: usize = 8192;

/// A key cache and a value cache of one layout, written by [`Rope::append_kv`].
///
/// The layout is 4-D, `[blocks, block_size, heads, head_dim]` with its own strides (head_dim
/// contiguous): a contiguous cache's blocks are its sequences (`[batch, seq, heads, head_dim]`
/// is [`Layout::bshd`], `[batch, heads, seq, head_dim]` is [`Layout::bhsd`]); a paged cache's
/// are its pages (vLLM's flash layout `[num_blocks, block_size, heads, head_dim]` is
/// `Layout::bshd(num_blocks, block_size, heads, head_dim)`, and
/// `[num_blocks, heads, block_size, head_dim]` is `Layout::bhsd(num_blocks, heads, block_size,
/// head_dim)`).
#[derive(Debug)]
pub struct KvCache<'a, T> {
    pub(crate) raw: RawKvCache,
    _borrow: PhantomData<&'a mut [T]>,
}

impl<'a, T: Element> KvCache<'a, T> {
    /// A contiguous cache: token `s` of sequence `b` goes to row `position` of block `b`.
    pub fn contiguous(k: &'a mut DeviceSlice<T>, v: &'a mut DeviceSlice<T>, layout: Layout) -> Self {
        Self::new(k, v, layout, false)
    }

    /// A paged cache: token `t` goes to slot `slots[t]`, row `slot % block_size` of block
    /// `slot / block_size`.
    pub fn paged(k: &'a mut DeviceSlice<T>, v: &'a mut DeviceSlice<T>, layout: Layout) -> Self {
        Self::new(k, v, layout, true)
    }

    /// The cache as device addresses, for [`Rope::append_kv_raw`].
    pub fn raw(&self) -> RawKvCache {
        self.raw
    }

    fn new(k: &'a mut DeviceSlice<T>, v: &'a mut DeviceSlice<T>, layout: Layout, paged: bool) -> Self {
        let raw = RawKvCache {
            k: RawTensor { ptr: k.as_device_ptr().as_raw(), len: k.len(), layout },
            v: RawTensor { ptr: v.as_device_ptr().as_raw(), len: v.len(), layout },
            paged,
        };
        KvCache { raw, _borrow: PhantomData }
    }
}

/// A KV cache as device addresses (see [`KvCache`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawKvCache {
    /// The key cache.
    pub k: RawTensor,
    /// The value cache; its layout must equal the key cache's.
    pub v: RawTensor,
    /// Paged (slots given per token) or contiguous (positions name the rows).
    pub paged: bool,
}

/// Everything one KV append takes, as device addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawKvArgs {
    /// Element type of every tensor; must be the configuration's.
    pub dtype: DType,
    /// Queries `[batch, seq, q_heads, head_dim]` to rotate in place in the same launch.
    pub q: Option<RawTensor>,
    /// New keys `[batch, seq, kv_heads, head_dim]`, rotated into the key cache (not modified).
    pub k: RawTensor,
    /// New values, same shape as `k`, copied into the value cache.
    pub v: RawTensor,
    /// The caches.
    pub cache: RawKvCache,
    /// The tokens' positions (the rotation; and, for contiguous caches, the row).
    pub positions: RawPositions,
    /// Paged caches: device address and length of the i64 slot mapping, one per token
    /// (`-1`: padding, not written).
    pub slots: Option<(u64, usize)>,
}

// The reference operation launches GPT-J kernels at the width `plan_kv` chose; its `_v_t`
// kernels serve both claimed widths, so they must take one head per thread like `_p`.
const _: () = assert!(kv_heads_per_thread(true, true, 2) == 1 && kv_heads_per_thread(true, true, 4) == 1);

/// What the launch needs from the configuration (a [`Rope`]'s, or the reference op's).
#[derive(Debug, Clone, Copy)]
pub(crate) struct KvSpec {
    pub dtype: DType,
    pub style: RopeStyle,
    pub head_dim: usize,
    pub rotary_dim: usize,
    pub max_position: usize,
}

/// Kernel widths, the index into `Functions::kv`'s last axis.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Width {
    /// Element by element; duplicates scanned or claimed.
    Scalar = 0,
    /// 16 bytes, several heads per thread; claimed.
    Vector = 1,
    /// 16 bytes, one head per thread; scanned (few tokens).
    Decode = 2,
    /// 16 bytes, one head per thread; claimed.
    Prefill = 3,
}

/// A validated KV launch, without the addresses of the tables, records and owner array.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct KvPlan {
    pub params: KvParams,
    pub width: Width,
    pub geometry: Geometry,
    /// Whether duplicates are settled by `kv_claim` (else by scanning).
    pub claim: bool,
}

/// The owner array of the claim path, and the tag of the next call's claims.
#[derive(Debug, Default)]
pub(crate) struct Owners {
    buf: Option<DeviceBuffer<u64>>,
    epoch: u32,
}

impl Owners {
    /// Queues `kv_claim` for `p`'s tokens and points `p` at the owner array, which grows to
    /// `p.num_slots` when short. Hold the lock until the launch that reads the claims is
    /// queued: calls from other threads must not reuse the epoch or the array in between.
    ///
    /// # Safety
    /// `plan_kv` made `p`: its positions and slots are valid for `p.tokens` tokens.
    unsafe fn claim(&mut self, kernels: &Kernels, p: &mut KvParams, stream: cuda::CUstream) -> Result<()> {
        // A graph would replay this call's epoch: the claims of one replay would then compete
        // with the last replay's for the same slots.
        let mut capturing = cuda::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        driver("cuStreamIsCapturing", cuda::cuStreamIsCapturing(stream, &mut capturing))?;
        if crate::graph::recording() || capturing != cuda::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
            return Err(Error::NotCapturable("a KV append or update of more than KV_SCAN_MAX_TOKENS tokens"));
        }
        let needed = (p.num_slots as usize).max(1);
        if self.buf.as_ref().is_none_or(|b| b.len() < needed) || self.epoch == u32::MAX {
            // Zeroed: epoch 0 is never used, so no stale entry matches.
            self.buf = Some(DeviceBuffer::zeroed(needed)?);
            self.epoch = 0;
        }
        self.epoch += 1;
        p.epoch = self.epoch;
        p.owner = self.buf.as_ref().map_or(0, |b| b.as_device_ptr().as_raw());
        let g = Geometry { grid: (p.tokens.div_ceil(128), 1), block: (128, 1) };
        // SAFETY: one thread per token; the owner array holds `num_slots` entries.
        launch(kernels.functions.kv_claim, g, 0, p, stream)
    }
}

/// Launches KV kernel `f`: with the dynamic shared memory of the block-wide scan when `p`
/// has no owner array.
///
/// # Safety
/// As [`launch`]; without an owner array, `f` is a scanning kernel and `p.tokens` is at most
/// [`KV_SCAN_MAX_TOKENS`].
unsafe fn launch_kv(f: cuda::CUfunction, geometry: Geometry, p: &KvParams, stream: cuda::CUstream) -> Result<()> {
    let shared = if p.owner == 0 { p.shared_bytes(geometry.block.0) } else { 0 };
    launch(f, geometry, shared, p, stream)
}

fn check_tensor(what: &'static str, t: &RawTensor, size: usize) -> Result<()> {
    let extent = t.layout.extent().unwrap_or(usize::MAX);
    if extent > t.len {
        return Err(Error::OutOfBounds { what, extent, len: t.len });
    }
    if t.ptr % size as u64 != 0 {
        return Err(Error::Alignment { what, address: t.ptr, align: size });
    }
    Ok(())
}

fn shape_err(what: &'static str, axis: &'static str, expected: usize, got: usize) -> Error {
    Error::Shape { what, axis, expected, got }
}

/// Checks `args` against `spec` and works out the launch; `None` when there is no work.
pub(crate) fn plan_kv(spec: &KvSpec, args: &RawKvArgs) -> Result<Option<KvPlan>> {
    if args.dtype != spec.dtype {
        return Err(Error::DType { expected: spec.dtype, got: args.dtype });
    }
    let size = spec.dtype.size();
    let (hd, rot) = (spec.head_dim, spec.rotary_dim);
    let ks = args.k.layout.shape;
    let (batch, seq, kv_heads) = (ks[0], ks[1], ks[2]);
    if ks[3] != hd {
        return Err(shape_err("k", "head_dim", hd, ks[3]));
    }
    for (axis, i) in [("batch", 0), ("seq", 1), ("heads", 2), ("head_dim", 3)] {
        if args.v.layout.shape[i] != ks[i] {
            return Err(shape_err("v", axis, ks[i], args.v.layout.shape[i]));
        }
    }
    if let Some(q) = &args.q {
        for (axis, i, want) in [("batch", 0, batch), ("seq", 1, seq), ("head_dim", 3, hd)] {
            if q.layout.shape[i] != want {
                return Err(shape_err("q", axis, want, q.layout.shape[i]));
            }
        }
        check_tensor("q", q, size)?;
        if !q.layout.is_non_overlapping() {
            return Err(Error::Overlap { what: "q", shape: q.layout.shape, strides: q.layout.strides });
        }
    }
    check_tensor("k", &args.k, size)?;
    check_tensor("v", &args.v, size)?;

    let cache = &args.cache;
    let cl = cache.k.layout;
    if cache.v.layout != cl {
        return Err(Error::Shape {
            what: "v cache",
            axis: "layout (must equal the key cache's)",
            expected: cl.extent().unwrap_or(0),
            got: cache.v.layout.extent().unwrap_or(0),
        });
    }
    let (blocks, block_size) = (cl.shape[0], cl.shape[1]);
    if cl.shape[2] != kv_heads {
        return Err(shape_err("cache", "heads", kv_heads, cl.shape[2]));
    }
    if cl.shape[3] != hd {
        return Err(shape_err("cache", "head_dim", hd, cl.shape[3]));
    }
    check_tensor("k cache", &cache.k, size)?;
    check_tensor("v cache", &cache.v, size)?;
    if !cl.is_non_overlapping() {
        return Err(Error::Overlap { what: "cache", shape: cl.shape, strides: cl.strides });
    }
    // What is written (q in place, both caches) shares nothing with anything else.
    let entries = [
        ("q", args.q, true),
        ("k", Some(args.k), false),
        ("v", Some(args.v), false),
        ("k cache", Some(cache.k), true),
        ("v cache", Some(cache.v), true),
    ];
    for (i, &(wn, w, written)) in entries.iter().enumerate() {
        for (j, &(on, o, o_written)) in entries.iter().enumerate() {
            let (Some(w), Some(o)) = (w, o) else { continue };
            let pair = written && i != j && (!o_written || i < j);
            if pair && !disjoint((w.ptr, &w.layout), (o.ptr, &o.layout), size) {
                return Err(Error::Aliasing { a: wn, b: on });
            }
        }
    }

    let tokens = batch.saturating_mul(seq);
    let num_slots = blocks.saturating_mul(block_size);
    let max_position = if cache.paged {
        match args.slots {
            None => return Err(Error::SlotMapping("a paged cache needs a slot mapping (one i64 per token)")),
            Some((_, len)) if len != tokens => {
                return Err(Error::Length { what: "slots", shape: vec![batch, seq], expected: tokens, got: len });
            }
            Some((ptr, _)) if ptr % 8 != 0 => {
                return Err(Error::Alignment { what: "slots", address: ptr, align: 8 });
            }
            Some(_) => spec.max_position,
        }
    } else {
        if args.slots.is_some() {
            return Err(Error::SlotMapping("a contiguous cache takes its rows from the positions, not slots"));
        }
        if blocks != batch {
            return Err(shape_err("cache", "batch", batch, blocks));
        }
        spec.max_position.min(block_size)
    };
    let mode = check_positions(&args.positions, batch, seq, max_position)?;
    let q_heads = args.q.map_or(0, |q| q.layout.shape[2]);
    for (what, value, limit) in [
        ("batch * seq", tokens as u64, u32::MAX as u64),
        ("q heads", q_heads as u64, u32::MAX as u64),
        ("kv heads", kv_heads as u64, u32::MAX as u64),
        ("cache slots (blocks * block_size)", num_slots as u64, u32::MAX as u64),
    ] {
        if value > limit {
            return Err(Error::TooLarge { what, value, limit });
        }
    }
    if tokens == 0 || kv_heads == 0 {
        return Ok(None);
    }

    // Width: 16-byte accesses when every address and stride allows them.
    let e = 16 / size;
    let half = rot / 2;
    let pairs_ok = match spec.style {
        RopeStyle::NeoX => half % e == 0,
        RopeStyle::GptJ => rot % e == 0,
    };
    let aligned = |t: &RawTensor| {
        (t.ptr + (t.layout.offset * size) as u64) % 16 == 0 && t.layout.strides.iter().all(|s| s % e == 0)
    };
    let views_ok = [args.q, Some(args.k), Some(args.v), Some(cache.k), Some(cache.v)].iter().flatten().all(aligned);
    let vector = pairs_ok && hd % e == 0 && views_ok;
    let claim = tokens > KV_SCAN_MAX_TOKENS;
    let width = match vector {
        false => Width::Scalar,
        true if !claim => Width::Decode,
        true if tokens <= KV_PREFILL_MAX_TOKENS => Width::Prefill,
        true => Width::Vector,
    };
    // The decode kernels move 8 bytes per access (half the work per thread: few tokens are
    // bound by each thread's chain of latencies, not by bandwidth).
    let e = if width == Width::Decode { e / 2 } else { e };
    let (rot_lanes, cw) = match (vector, spec.style) {
        (true, RopeStyle::NeoX) => (half / e, e),
        (true, RopeStyle::GptJ) => (rot / e, e),
        (false, _) => (half, 1),
    };
    let g = match width {
        Width::Vector => kv_heads_per_thread(true, spec.style == RopeStyle::GptJ, size),
        _ => 1,
    };
    let (k_lanes, v_lanes) = (rot_lanes + (hd - rot) / cw, hd / cw);
    let work = groups(q_heads as u32, g) as u64 * rot_lanes as u64
        + groups(kv_heads as u32, g) as u64 * (k_lanes + v_lanes) as u64;
    let Some((geometry, chunk)) = flat_geometry(tokens as u32, work)? else { return Ok(None) };

    let view = |t: &RawTensor| HeadsView {
        input: t.ptr + (t.layout.offset * size) as u64,
        output: 0,
        in_strides: t.layout.strides.map(|s| s as u64),
        out_strides: [0; 3],
        heads: t.layout.shape[2] as u32,
        _pad: 0,
    };
    let params = KvParams {
        q: args.q.as_ref().map(view).unwrap_or_default(),
        k: view(&args.k),
        v: view(&args.v),
        k_cache: cache.k.ptr + (cl.offset * size) as u64,
        v_cache: cache.v.ptr + (cl.offset * size) as u64,
        cache_strides: cl.strides.map(|s| s as u64),
        slots: args.slots.map_or(0, |(ptr, _)| ptr),
        positions: args.positions.ptr,
        num_slots: num_slots as u64,
        tokens: tokens as u32,
        seq: seq as u32,
        half: half as u32,
        rot_lanes: rot_lanes as u32,
        k_lanes: k_lanes as u32,
        v_lanes: v_lanes as u32,
        block_size: block_size as u32,
        max_position: max_position as u32,
        position_mode: mode,
        chunk,
        items_div: FastDiv::new(work as u32),
        seq_div: FastDiv::new(seq as u32),
        lanes_div: [rot_lanes, k_lanes, v_lanes].map(|l| FastDiv::new(l as u32)),
        block_div: FastDiv::new(block_size as u32),
        ..Default::default()
    };
    Ok(Some(KvPlan { params, width, geometry, claim }))
}

impl Rope<'_> {
    /// One decode or prefill step in one launch: rotates `k` into the key cache and copies
    /// `v` into the value cache at each token's slot, and, with `q`, rotates `q` in place.
    ///
    /// Contiguous caches take each token's row from its position (`slots` must be `None`);
    /// paged caches from `slots` (one i64 per token, `-1` for padding, which is skipped).
    /// A token whose position is outside the table (or, contiguous, the cache) is skipped
    /// entirely and a slot outside the cache skips its writes; both are recorded and reported
    /// by [`Rope::check_errors`]. When several tokens name one slot, the last one's key and
    /// value are written. Values are copied bit for bit; nothing else in the caches changes.
    #[allow(clippy::too_many_arguments)]
    pub fn append_kv<T: Element>(
        &self,
        q: Option<&mut TensorMut<'_, T>>,
        k: &Tensor<'_, T>,
        v: &Tensor<'_, T>,
        cache: &mut KvCache<'_, T>,
        positions: Positions<'_>,
        slots: Option<&DeviceSlice<i64>>,
        stream: &Stream,
    ) -> Result<()> {
        let args = RawKvArgs {
            dtype: T::DTYPE,
            q: q.map(|q| q.raw),
            k: k.raw,
            v: v.raw,
            cache: cache.raw,
            positions: positions.raw(),
            slots: slots.map(|s| (s.as_device_ptr().as_raw(), s.len())),
        };
        // SAFETY: the views borrow live cust buffers of `T` for the call; `plan_kv` checks
        // the rest.
        unsafe { self.append_kv_raw(&args, stream.as_inner()) }
    }

    /// [`Rope::append_kv`] on device addresses and a raw stream.
    ///
    /// Everything that can be checked without reading device memory is checked first, and
    /// an `Err` means nothing was launched.
    ///
    /// # Safety
    /// As [`Rope::apply_raw`]: each address is a live allocation of this context holding at
    /// least `len` elements of its type, not freed or written by others until the work
    /// queued on `stream` completes.
    pub unsafe fn append_kv_raw(&self, args: &RawKvArgs, stream: cuda::CUstream) -> Result<()> {
        let spec = KvSpec {
            dtype: self.config.dtype,
            style: self.config.style,
            head_dim: self.config.head_dim,
            rotary_dim: self.config.rotary_dim,
            max_position: self.config.max_position,
        };
        let Some(plan) = plan_kv(&spec, args)? else { return Ok(()) };
        self.kernels.check_devices(&[
            ("q", args.q.map_or(0, |t| t.ptr)),
            ("k", args.k.ptr),
            ("v", args.v.ptr),
            ("k cache", args.cache.k.ptr),
            ("v cache", args.cache.v.ptr),
            ("positions", args.positions.read_address()),
            ("slots", args.slots.map_or(0, |s| s.0)),
        ])?;
        self.not_checked_in_a_graph()?;
        let mut p = plan.params;
        [p.cos, p.sin, p.cos_lo, p.sin_lo] = self.table.addresses();
        p.error = self.errors.as_device_ptr().as_raw();
        self.last_num_slots.store(p.num_slots, std::sync::atomic::Ordering::Relaxed);
        // Held from the claims to the launch that reads them.
        let mut owners = plan.claim.then(|| self.owners.lock().unwrap_or_else(|e| e.into_inner()));
        if let Some(owners) = owners.as_mut() {
            owners.claim(self.kernels, &mut p, stream)?;
        }
        let f = self.kernels.functions.kv[(self.config.style == RopeStyle::GptJ) as usize]
            [dtype_index(self.config.dtype)][plan.width as usize];
        // SAFETY: `plan_kv` checked every view and both caches against their buffers,
        // overlaps, alignment for the width, and the positions' and slots' lengths; the
        // tables, records and owner array belong to this Rope; only scanning widths go
        // without claims, and only up to `KV_SCAN_MAX_TOKENS`.
        launch_kv(f, plan.geometry, &p, stream)?;
        drop(owners);
        if self.config.checked {
            driver("cuStreamSynchronize", cuda::cuStreamSynchronize(stream))?;
            self.take_errors()?;
        }
        Ok(())
    }
}

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

/// The project's second reference operation, exactly: `update_kv_cache(k_new, v_new, cos,
/// sin, cache_k, cache_v, positions)`.
///
/// ```no_run
/// # use rope_cuda::{Kernels, KvShape, KvUpdate};
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
pub struct KvUpdate<'k> {
    kernels: &'k Kernels,
    errors: DeviceBuffer<u64>,
    /// `S` of the last call, for error reports.
    cache_len: std::sync::atomic::AtomicUsize,
    /// Claims of calls with more than [`KV_SCAN_MAX_TOKENS`] tokens.
    owners: std::sync::Mutex<Owners>,
}

impl<'k> KvUpdate<'k> {
    /// Allocates the error record, in the current context.
    pub fn new(kernels: &'k Kernels) -> Result<Self> {
        let errors = DeviceBuffer::from_slice(&CLEAR_RECORDS)?;
        Ok(KvUpdate { kernels, errors, cache_len: Default::default(), owners: Default::default() })
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
    #[allow(clippy::too_many_arguments)]
    pub fn update_kv_cache<T: Element>(
        &self,
        shape: KvShape,
        k_new: &DeviceSlice<T>,
        v_new: &DeviceSlice<T>,
        cos: &DeviceSlice<T>,
        sin: &DeviceSlice<T>,
        cache_k: &DeviceSlice<T>,
        cache_v: &DeviceSlice<T>,
        positions: &DeviceSlice<i32>,
        out: &mut DeviceSlice<T>,
        stream: &Stream,
    ) -> Result<()> {
        let KvShape { batch: b, new_tokens: t, heads: h, head_dim: d, cache_len: s } = shape;
        if d < 2 || d % 2 != 0 {
            return Err(Error::HeadDim { head_dim: d });
        }
        let size = T::DTYPE.size();
        let n = |dims: &[usize]| dims.iter().try_fold(1usize, |a, &x| a.checked_mul(x)).unwrap_or(usize::MAX);
        let addr = |x: &DeviceSlice<T>| x.as_device_ptr().as_raw();
        let lengths: [(&'static str, &[usize], usize); 8] = [
            ("k_new", &[b, t, h, d], k_new.len()),
            ("v_new", &[b, t, h, d], v_new.len()),
            ("cos", &[s, d / 2], cos.len()),
            ("sin", &[s, d / 2], sin.len()),
            ("cache_k", &[b, s, h, d], cache_k.len()),
            ("cache_v", &[b, s, h, d], cache_v.len()),
            ("positions", &[b, t], positions.len()),
            ("out", &[2, b, s, h, d], out.len()),
        ];
        for (what, dims, got) in lengths {
            if n(dims) != got {
                return Err(Error::Length { what, shape: dims.to_vec(), expected: n(dims), got });
            }
        }
        let out_range = (addr(out), out.len() * size);
        let inputs = [
            ("k_new", addr(k_new), k_new.len()),
            ("v_new", addr(v_new), v_new.len()),
            ("cos", addr(cos), cos.len()),
            ("sin", addr(sin), sin.len()),
            ("cache_k", addr(cache_k), cache_k.len()),
            ("cache_v", addr(cache_v), cache_v.len()),
        ];
        let pos_range = (positions.as_device_ptr().as_raw(), positions.len() * 4);
        for (what, ptr, len) in
            inputs.iter().map(|&(w, p, l)| (w, p, l * size)).chain([("positions", pos_range.0, pos_range.1)])
        {
            let (a0, a1, b0, b1) = (out_range.0, out_range.0 + out_range.1 as u64, ptr, ptr + len as u64);
            if len > 0 && out_range.1 > 0 && a0 < b1 && b0 < a1 {
                return Err(Error::Aliasing { a: "out", b: what });
            }
        }
        let cache_elems = b * s * h * d;
        let half_out = addr(out) + (cache_elems * size) as u64;
        let new_layout = Layout::bshd(b, t, h, d);
        let cache_layout = Layout::bshd(b, s, h, d);
        let args = RawKvArgs {
            dtype: T::DTYPE,
            q: None,
            k: RawTensor { ptr: addr(k_new), len: k_new.len(), layout: new_layout },
            v: RawTensor { ptr: addr(v_new), len: v_new.len(), layout: new_layout },
            cache: RawKvCache {
                k: RawTensor { ptr: addr(out), len: cache_elems, layout: cache_layout },
                v: RawTensor { ptr: half_out, len: cache_elems, layout: cache_layout },
                paged: false,
            },
            positions: RawPositions { kind: PositionKind::IdsI32, ptr: pos_range.0, len: positions.len() },
            slots: None,
        };
        let spec = KvSpec { dtype: T::DTYPE, style: RopeStyle::GptJ, head_dim: d, rotary_dim: d, max_position: s };
        let plan = plan_kv(&spec, &args)?;
        self.kernels.check_devices(&[
            ("k_new", addr(k_new)),
            ("v_new", addr(v_new)),
            ("cos", addr(cos)),
            ("sin", addr(sin)),
            ("cache_k", addr(cache_k)),
            ("cache_v", addr(cache_v)),
            ("positions", pos_range.0),
            ("out", addr(out)),
        ])?;
        let raw_stream = stream.as_inner();
        let bytes = cache_elems * size;
        // SAFETY: the lengths were checked above: both caches hold `cache_elems` elements and
        // `out` twice that, and `out` overlaps no input.
        unsafe {
            for (dst, src) in [(addr(out), addr(cache_k)), (half_out, addr(cache_v))] {
                match crate::graph::record_copy(dst, src, bytes) {
                    Some(recorded) => recorded?,
                    None => driver("cuMemcpyDtoDAsync", cuda::cuMemcpyDtoDAsync_v2(dst, src, bytes, raw_stream))?,
                }
            }
        }
        let Some(plan) = plan else { return Ok(()) };
        self.cache_len.store(s, std::sync::atomic::Ordering::Relaxed);
        let mut p = plan.params;
        p.cos = addr(cos);
        p.sin = addr(sin);
        p.error = self.errors.as_device_ptr().as_raw();
        let f = &self.kernels.functions;
        // The width `plan_kv` chose (GPT-J kernels take one head per thread at every width);
        // 16-bit elements read the caller's tables through the `_t` kernels.
        let function = match T::DTYPE {
            DType::F32 => f.kv[1][0][plan.width as usize],
            dt => {
                let width = match plan.width {
                    Width::Scalar => 0,
                    Width::Vector | Width::Prefill => 1,
                    Width::Decode => 2,
                };
                f.kv_elem_table[dtype_index(dt) - 1][width]
            }
        };
        let mut owners = plan.claim.then(|| self.owners.lock().unwrap_or_else(|e| e.into_inner()));
        // SAFETY: `plan_kv` checked the views against the lengths above; the table lengths
        // were checked against `S * D / 2`, which covers every position below `S`; without
        // claims, the call has at most `KV_SCAN_MAX_TOKENS` tokens.
        unsafe {
            if let Some(owners) = owners.as_mut() {
                owners.claim(self.kernels, &mut p, raw_stream)?;
            }
            launch_kv(function, plan.geometry, &p, raw_stream)
        }
    }

    /// Synchronises `stream`, then reports (and clears) the out-of-range positions recorded
    /// since the last check.
    pub fn check_errors(&self, stream: &Stream) -> Result<()> {
        crate::graph::not_while_recording("check_errors")?;
        stream.synchronize()?;
        take_errors(&self.errors, self.cache_len.load(std::sync::atomic::Ordering::Relaxed), None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: u64 = 1 << 28;

    fn tensor(i: u64, layout: Layout) -> RawTensor {
        RawTensor { ptr: i * BASE, len: layout.extent().unwrap(), layout }
    }

    fn spec() -> KvSpec {
        KvSpec { dtype: DType::BF16, style: RopeStyle::NeoX, head_dim: 128, rotary_dim: 128, max_position: 4096 }
    }

    /// 2 sequences x 3 tokens, 8 q heads, 2 kv heads, a paged cache of 10 blocks of 16.
    fn args() -> RawKvArgs {
        RawKvArgs {
            dtype: DType::BF16,
            q: Some(tensor(1, Layout::bshd(2, 3, 8, 128))),
            k: tensor(2, Layout::bshd(2, 3, 2, 128)),
            v: tensor(3, Layout::bshd(2, 3, 2, 128)),
            cache: RawKvCache {
                k: tensor(4, Layout::bshd(10, 16, 2, 128)),
                v: tensor(5, Layout::bshd(10, 16, 2, 128)),
                paged: true,
            },
            positions: RawPositions { kind: PositionKind::IdsI32, ptr: 6 * BASE, len: 6 },
            slots: Some((7 * BASE, 6)),
        }
    }

    fn err(a: &RawKvArgs) -> Error {
        plan_kv(&spec(), a).expect_err("expected an error")
    }

    #[test]
    fn plans_lanes_items_and_widths() {
        let p = plan_kv(&spec(), &args()).unwrap().unwrap();
        assert_eq!(p.width, Width::Decode);
        // 8-byte lanes (4 bf16) for the decode width.
        assert_eq!((p.params.rot_lanes, p.params.k_lanes, p.params.v_lanes), (16, 16, 32));
        assert_eq!((p.params.block_size, p.params.num_slots, p.params.max_position), (16, 160, 4096));
        assert_eq!(p.params.cache_strides, [16 * 2 * 128, 2 * 128, 128]);
        assert!(!p.claim);
        // Contiguous [B, H, S, D]: rows come from positions, capped by the cache length.
        let mut a = args();
        a.cache.k = tensor(4, Layout::bhsd(2, 2, 100, 128));
        a.cache.v = tensor(5, Layout::bhsd(2, 2, 100, 128));
        a.cache.paged = false;
        a.slots = None;
        let p = plan_kv(&spec(), &a).unwrap().unwrap();
        assert_eq!((p.params.block_size, p.params.max_position, p.params.slots), (100, 100, 0));
        assert_eq!(p.params.cache_strides, [2 * 100 * 128, 128, 100 * 128]);
        // Partial rotary, odd alignment: scalar lanes, copy lanes past rotary_dim.
        let s = KvSpec { rotary_dim: 64, ..spec() };
        let mut a = args();
        a.k.ptr += 2;
        let p = plan_kv(&s, &a).unwrap().unwrap();
        assert_eq!(p.width, Width::Scalar);
        assert_eq!((p.params.rot_lanes, p.params.k_lanes, p.params.v_lanes), (32, 32 + 64, 128));
    }

    /// The plan of every launch (decode and claimed sizes, paged and contiguous) allocates
    /// nothing: the launch path is safe inside stream capture and adds no allocator time.
    #[test]
    fn planning_allocates_nothing() {
        let mut contiguous = args();
        contiguous.cache.k = tensor(4, Layout::bshd(2, 100, 2, 128));
        contiguous.cache.v = tensor(5, Layout::bshd(2, 100, 2, 128));
        contiguous.cache.paged = false;
        contiguous.slots = None;
        let mut large = args();
        large.q = Some(tensor(1, Layout::bshd(2, 300, 8, 128)));
        large.k = tensor(2, Layout::bshd(2, 300, 2, 128));
        large.v = tensor(3, Layout::bshd(2, 300, 2, 128));
        large.cache.k = tensor(4, Layout::bshd(100, 16, 2, 128));
        large.cache.v = tensor(5, Layout::bshd(100, 16, 2, 128));
        large.positions.len = 600;
        large.slots = Some((7 * BASE, 600));
        for a in [args(), contiguous, large] {
            let (plan, allocations) = crate::alloc_count::count(|| plan_kv(&spec(), &a));
            assert!(plan.unwrap().is_some());
            assert_eq!(allocations, 0, "{a:?}");
        }
    }

    #[test]
    fn each_bad_input_has_its_own_error() {
        let a = args();
        assert!(matches!(err(&RawKvArgs { dtype: DType::F16, ..a }), Error::DType { .. }));
        let mut b = a;
        b.k.layout = Layout::bshd(2, 3, 2, 64);
        assert!(matches!(err(&b), Error::Shape { what: "k", axis: "head_dim", .. }));
        let mut b = a;
        b.v.layout = Layout::bshd(2, 3, 3, 128);
        assert!(matches!(err(&b), Error::Shape { what: "v", axis: "heads", .. }));
        let mut b = a;
        b.q = Some(tensor(1, Layout::bshd(1, 3, 8, 128)));
        assert!(matches!(err(&b), Error::Shape { what: "q", axis: "batch", .. }));
        let mut b = a;
        b.cache.k.layout = Layout::bshd(10, 16, 4, 128);
        b.cache.v.layout = b.cache.k.layout;
        assert!(matches!(err(&b), Error::Shape { what: "cache", axis: "heads", .. }));
        let mut b = a;
        b.cache.v.layout = Layout::bhsd(10, 2, 16, 128);
        assert!(matches!(err(&b), Error::Shape { what: "v cache", .. }));
        let mut b = a;
        b.cache.k.len -= 1;
        assert!(matches!(err(&b), Error::OutOfBounds { what: "k cache", .. }));
        let mut b = a;
        b.cache.v.ptr += 1;
        assert!(matches!(err(&b), Error::Alignment { what: "v cache", .. }));
        let mut b = a;
        b.slots = None;
        assert!(matches!(err(&b), Error::SlotMapping(_)));
        let mut b = a;
        b.slots = Some((7 * BASE, 5));
        assert!(matches!(err(&b), Error::Length { what: "slots", expected: 6, got: 5, .. }));
        let mut b = a;
        b.slots = Some((7 * BASE + 4, 6));
        assert!(matches!(err(&b), Error::Alignment { what: "slots", .. }));
        let mut b = a;
        b.cache.paged = false;
        assert!(matches!(err(&b), Error::SlotMapping(_)));
        let mut b = a;
        (b.cache.paged, b.slots) = (false, None);
        assert!(matches!(err(&b), Error::Shape { what: "cache", axis: "batch", expected: 2, got: 10 }));
        let mut b = a;
        b.positions.len = 5;
        assert!(matches!(err(&b), Error::Length { what: "positions", .. }));
        // The key cache overlapping the values it reads, or q overlapping the new keys.
        let mut b = a;
        b.cache.k.ptr = b.v.ptr;
        assert!(matches!(err(&b), Error::Aliasing { a: "k cache", b: "v" }));
        let mut b = a;
        b.k.ptr = b.q.unwrap().ptr;
        assert!(matches!(err(&b), Error::Aliasing { a: "q", b: "k" }));
        let mut b = a;
        b.cache.v.ptr = b.cache.k.ptr;
        assert!(matches!(err(&b), Error::Aliasing { a: "k cache", b: "v cache" }));
        // A cache layout whose rows overlap.
        let mut b = a;
        let l = Layout::strided([10, 16, 2, 128], [16 * 128, 128, 128], 0);
        (b.cache.k.layout, b.cache.v.layout) = (l, l);
        assert!(matches!(err(&b), Error::Overlap { what: "cache", .. }));
        // More slots than the kernel's 32-bit slot arithmetic takes.
        let mut b = a;
        let l = Layout::strided([1 << 20, 1 << 13, 2, 128], [0, 0, 128], 0);
        (b.cache.k.layout, b.cache.v.layout) = (l, l);
        assert!(matches!(plan_kv(&spec(), &b), Err(Error::TooLarge { .. }) | Err(Error::Overlap { .. })));
    }

    #[test]
    fn large_calls_claim_and_share_table_loads() {
        let call = |n: usize| {
            let mut a = args();
            a.q = Some(tensor(1, Layout::bshd(1, n, 8, 128)));
            a.k = tensor(2, Layout::bshd(1, n, 2, 128));
            a.v = tensor(3, Layout::bshd(1, n, 2, 128));
            a.positions.len = n;
            a.slots = Some((7 * BASE, n));
            plan_kv(&spec(), &a).unwrap().unwrap()
        };
        let p = call(KV_SCAN_MAX_TOKENS);
        assert!(!p.claim);
        let p = call(KV_SCAN_MAX_TOKENS + 1);
        assert!(p.claim);
        assert_eq!(p.width, Width::Prefill);
        let p = call(KV_PREFILL_MAX_TOKENS + 1);
        assert!(p.claim);
        assert_eq!(p.width, Width::Vector);
    }
}
