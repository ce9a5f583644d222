//! [`Rope`]: a configuration, its cos/sin source on the device, and its RoPE launches.

use std::sync::Arc;

use cust::sys as cuda;
use rope_cuda_kernels::keys::{RopeKey, RopeWidth, TableSource};
use rope_cuda_kernels::norm::NormView;
use rope_cuda_kernels::params::{groups, heads_per_thread, lane_slots, RopeParams};
use rope_cuda_kernels::tuning::{BLOCK_THREADS, ROPE_FEW_THREADS as FEW_THREADS};
use rope_cuda_kernels::views::{ErrorSink, SourceView};

use crate::config::{Direction, HeadGrouping, RopeConfig, RopeStyle};
use crate::error::{Error, Result};
use crate::kernels::{Geometry, Kernels};
use crate::launch::{
    block_geometry, check_axis, check_disjoint, check_supported, check_u32, check_view, check_written, detached_source,
    heads_view, lanes, pairs, positions, staged, vector_fits, Core,
};
use crate::norm::{check_head_lanes, norm_view, whole_rope_layout, QkNorm, RawNorm, RawWeight, WHOLE_TOO_LARGE};
use crate::operand::{on_stream, Hold, Queue};
use crate::table::RopeTable;
use crate::tensor::{Positions, RawPositions, RawTensor, Tensor, TensorMut};

/// RoPE for one configuration: its source of cos and sin built once ([`RopeTable`]: a table
/// with angles in f64, stored f32, or the frequencies the kernels compute them from, as
/// [`RopeConfig::cos_sin`] says), the device-side record of out-of-range positions, and the
/// launches.
///
/// q and k are `[batch, seq, heads, head_dim]` views with their own strides ([`Layout`](crate::Layout));
/// q and k may have different head counts (GQA/MQA), k may be absent, and they may be
/// slices of one fused QKV buffer. Positions come per token, per sequence start, or in
/// order ([`Positions`]). A token whose position is outside `0..max_position` is left
/// untouched and recorded; [`Rope::check_errors`] reports it (every call does, in checked
/// mode).
///
/// A `Rope` holds an [`Arc`] of its [`Kernels`] and no borrow: it is `Send + Sync + 'static`,
/// for an engine to keep in its model struct and share between threads.
///
/// ```no_run
/// use cust::memory::DeviceBuffer;
/// use cust::stream::{Stream, StreamFlags};
/// use half::bf16;
/// use rope_cuda::{DType, Kernels, Layout, Positions, Rope, RopeArgs, RopeConfig, TensorMut};
///
/// let _ctx = cust::quick_init()?;
/// let kernels = Kernels::load()?;
/// let stream = Stream::new(StreamFlags::NON_BLOCKING, None)?;
/// let rope = Rope::new(&kernels, RopeConfig::new(128, 8192).base(500_000.0).dtype(DType::BF16))?;
/// // 4 tokens of a fused QKV buffer: 32 q heads, 8 k heads, 8 v heads of 128.
/// let (tokens, row) = (4, 48 * 128);
/// let mut qkv = DeviceBuffer::from_slice(&vec![bf16::from_f32(0.5); tokens * row])?;
/// let positions = DeviceBuffer::from_slice(&[7i32, 8, 9, 10])?;
/// let q = Layout::strided([1, tokens, 32, 128], [tokens * row, row, 128], 0);
/// let k = Layout::strided([1, tokens, 8, 128], [tokens * row, row, 128], 32 * 128);
/// let (mut q, mut k) = TensorMut::pair(&mut qkv, q, k);
/// rope.apply(RopeArgs::in_place(&mut q, Positions::ids_i32(&positions)).k(&mut k), &stream)?;
/// rope.check_errors(&stream)?; // synchronises; Err names the first out-of-range token
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct Rope {
    pub(crate) config: RopeConfig,
    pub(crate) table: RopeTable,
    pub(crate) core: Core,
}

impl Rope {
    /// Validates `config`, builds its table (or frequencies) and uploads it, in the current
    /// context.
    ///
    /// ```
    /// # let Ok(_ctx) = cust::quick_init() else { return Ok(()) }; // no GPU: nothing to run
    /// # let kernels = rope_cuda::Kernels::load()?;
    /// # let stream = cust::stream::Stream::new(cust::stream::StreamFlags::NON_BLOCKING, None)?;
    /// use rope_cuda::{DType, Error, Rope, RopeConfig};
    /// let rope = Rope::new(&kernels, RopeConfig::new(128, 8192).base(500_000.0).dtype(DType::BF16))?;
    /// assert_eq!(rope.table().max_position(), 8192);
    /// // A bad configuration is a typed error, before anything is allocated.
    /// assert!(matches!(Rope::new(&kernels, RopeConfig::new(127, 8192)), Err(Error::HeadDim { head_dim: 127 })));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn new(kernels: &Arc<Kernels>, config: RopeConfig) -> Result<Self> {
        config.validate()?;
        let table = RopeTable::from_config(&config)?;
        Ok(Rope { config, table, core: Core::new(kernels)? })
    }

    /// The configuration.
    pub fn config(&self) -> &RopeConfig {
        &self.config
    }

    /// The table, or the frequencies the kernels compute cos and sin from.
    pub fn table(&self) -> &RopeTable {
        &self.table
    }

    /// The kernels this `Rope` launches.
    pub fn kernels(&self) -> &Arc<Kernels> {
        &self.core.kernels
    }

    /// Rotates q (and k) at their positions on `stream`: in place ([`RopeArgs::in_place`]) or
    /// into outputs ([`RopeArgs::into`], dims past `rotary_dim` copied bit for bit); forward,
    /// or as [`RopeArgs::direction`] says. The buffers are any [`Operand`](crate::Operand)s (cust's
    /// or cudarc's), the stream any [`Queue`].
    ///
    /// ```
    /// # let Ok(_ctx) = cust::quick_init() else { return Ok(()) }; // no GPU: nothing to run
    /// # let kernels = rope_cuda::Kernels::load()?;
    /// # let stream = cust::stream::Stream::new(cust::stream::StreamFlags::NON_BLOCKING, None)?;
    /// use cust::memory::{CopyDestination, DeviceBuffer};
    /// use rope_cuda::{Layout, Positions, Rope, RopeArgs, RopeConfig, TensorMut};
    /// let rope = Rope::new(&kernels, RopeConfig::new(64, 16))?;
    /// // [1 sequence, 2 tokens, 4 heads, 64]
    /// let x: Vec<f32> = (0..2 * 4 * 64).map(|i| (i % 13) as f32 - 6.0).collect();
    /// let mut q = DeviceBuffer::from_slice(&x)?;
    /// let mut qv = TensorMut::new(&mut q, Layout::bshd(1, 2, 4, 64));
    /// rope.apply(RopeArgs::in_place(&mut qv, Positions::sequential()), &stream)?;
    /// rope.check_errors(&stream)?; // synchronises
    /// let mut out = vec![0.0f32; x.len()];
    /// q.copy_to(&mut out[..])?;
    /// assert_eq!(out[..4 * 64], x[..4 * 64]); // token 0 is at position 0: no rotation
    /// assert_ne!(out[4 * 64..], x[4 * 64..]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// Out of place, with k, inverse:
    ///
    /// ```
    /// # let Ok(_ctx) = cust::quick_init() else { return Ok(()) }; // no GPU: nothing to run
    /// # let kernels = rope_cuda::Kernels::load()?;
    /// # let stream = cust::stream::Stream::new(cust::stream::StreamFlags::NON_BLOCKING, None)?;
    /// use cust::memory::{CopyDestination, DeviceBuffer};
    /// use rope_cuda::{Direction, Layout, Positions, Rope, RopeArgs, RopeConfig, Tensor, TensorMut};
    /// let rope = Rope::new(&kernels, RopeConfig::new(64, 16).rotary_dim(32))?;
    /// let l = Layout::bshd(1, 3, 2, 64);
    /// let x: Vec<f32> = (0..3 * 2 * 64).map(|i| (i % 7) as f32 - 3.0).collect();
    /// let (q, k) = (DeviceBuffer::from_slice(&x)?, DeviceBuffer::from_slice(&x)?);
    /// let mut q_out = DeviceBuffer::from_slice(&vec![0.0f32; x.len()])?;
    /// let mut k_out = DeviceBuffer::from_slice(&vec![0.0f32; x.len()])?;
    /// let ids = DeviceBuffer::from_slice(&[5i32, 6, 7])?;
    /// let (qt, kt) = (Tensor::new(&q, l), Tensor::new(&k, l));
    /// let (mut qo, mut ko) = (TensorMut::new(&mut q_out, l), TensorMut::new(&mut k_out, l));
    /// let args = RopeArgs::into(&qt, &mut qo, Positions::ids_i32(&ids)).k_into(&kt, &mut ko);
    /// rope.apply(args.direction(Direction::Inverse), &stream)?;
    /// stream.synchronize()?;
    /// let mut out = vec![0.0f32; x.len()];
    /// q_out.copy_to(&mut out[..])?;
    /// assert_eq!(out[32..64], x[32..64]); // dims past rotary_dim are copied bit for bit
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn apply(&self, args: RopeArgs<'_, '_>, stream: &impl Queue) -> Result<()> {
        let stream = stream.raw(self.kernels())?;
        // SAFETY: each view lends a live buffer of its element type, ordered for work on
        // `stream` (checked) by its borrow and its record, made after the launch is queued; the
        // `Queue` vouches for the stream; `plan` checks the rest.
        on_stream(args.holds(), stream, || unsafe { self.apply_raw(&args.raw(), stream) })
    }

    /// The launch behind every RoPE call, on device addresses and a raw stream: for engines
    /// whose buffers come from cudarc, candle or their own allocator.
    ///
    /// Everything that can be checked without reading device memory is checked first, and
    /// an `Err` means nothing was launched.
    ///
    /// # Safety
    /// Each `ptr` is the address of a live device allocation in this `Rope`'s context holding
    /// at least `len` elements of its own `dtype` (positions: of their kind's integer type), not
    /// freed or written by others until the work queued on `stream` completes; `stream` is a
    /// valid stream of that context (or null, the legacy default stream).
    ///
    /// ```
    /// # let Ok(_ctx) = cust::quick_init() else { return Ok(()) }; // no GPU: nothing to run
    /// # let kernels = rope_cuda::Kernels::load()?;
    /// # let stream = cust::stream::Stream::new(cust::stream::StreamFlags::NON_BLOCKING, None)?;
    /// use cust::memory::DeviceBuffer;
    /// use rope_cuda::{DType, Layout, RawArgs, RawPositions, RawTensor, Rope, RopeConfig};
    /// let rope = Rope::new(&kernels, RopeConfig::new(64, 16))?;
    /// let q = DeviceBuffer::from_slice(&vec![1.0f32; 2 * 64])?;
    /// let raw = RawTensor::new(q.as_device_ptr().as_raw(), q.len(), DType::F32, Layout::bshd(1, 2, 1, 64));
    /// let args = RawArgs::new(raw, RawPositions::SEQUENTIAL);
    /// // SAFETY: `q` is a live allocation of 128 f32 in this context, kept until the stream is
    /// // synchronised below.
    /// unsafe { rope.apply_raw(&args, stream.as_inner())? };
    /// stream.synchronize()?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub unsafe fn apply_raw(&self, args: &RawArgs, stream: cuda::CUstream) -> Result<()> {
        let Some(plan) = plan(&self.config, args, self.table.view(), self.core.records.sink())? else {
            return Ok(());
        };
        self.core.prepare(&buffers(args, plan.params.positions.address()), self.config.checked)?;
        let checked = self.config.checked.then_some(self.config.max_position);
        // SAFETY: `plan` checked every view against its buffer, outputs against overlap,
        // alignment for the chosen width, and the positions buffer's length; the table and
        // the error records belong to this Rope; the caller vouches for the addresses.
        unsafe { self.core.launch(plan.key, plan.geometry, plan.shared, &plan.params, stream, checked) }
    }

    /// Synchronises `stream`, then reports (and clears) the out-of-range positions (and, from
    /// KV appends, slots) recorded since the last check: `Err(PositionOutOfRange)` naming the
    /// lowest offending token.
    ///
    /// The record is shared by every stream this `Rope` launches on: with several streams,
    /// synchronise the others first so that their launches are reported too.
    ///
    /// ```
    /// # let Ok(_ctx) = cust::quick_init() else { return Ok(()) }; // no GPU: nothing to run
    /// # let kernels = rope_cuda::Kernels::load()?;
    /// # let stream = cust::stream::Stream::new(cust::stream::StreamFlags::NON_BLOCKING, None)?;
    /// use cust::memory::DeviceBuffer;
    /// use rope_cuda::{Error, Layout, Positions, Rope, RopeArgs, RopeConfig, TensorMut};
    /// let rope = Rope::new(&kernels, RopeConfig::new(64, 16))?;
    /// let mut q = DeviceBuffer::from_slice(&vec![1.0f32; 2 * 64])?;
    /// let ids = DeviceBuffer::from_slice(&[3i32, 99])?; // 99 is past max_position
    /// let mut qv = TensorMut::new(&mut q, Layout::bshd(1, 2, 1, 64));
    /// rope.apply(RopeArgs::in_place(&mut qv, Positions::ids_i32(&ids)), &stream)?;
    /// match rope.check_errors(&stream) {
    ///     Err(Error::PositionOutOfRange { token: 1, position: 99, max_position: 16, count: 1 }) => {}
    ///     other => panic!("{other:?}"),
    /// }
    /// rope.check_errors(&stream)?; // reported once: the record is clear again
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn check_errors(&self, stream: &impl Queue) -> Result<()> {
        self.core.check_errors_raw(stream.raw(self.kernels())?, self.config.max_position)
    }
}

/// One RoPE call ([`Rope::apply`]): q (and k), each rotated in place or into its output, at
/// `positions`, forward unless [`RopeArgs::direction`] says otherwise. Each tensor is a view
/// of its own buffer with its own element type; q and k are both rotated in place or both
/// out of place (else [`Error::InPlaceMismatch`]).
#[derive(Debug)]
pub struct RopeArgs<'r, 'a> {
    q: Rotated<'r, 'a>,
    k: Option<Rotated<'r, 'a>>,
    positions: Positions<'a>,
    direction: Direction,
    norm: Option<QkNorm<'a>>,
}

/// q or k, and where it goes.
#[derive(Debug)]
enum Rotated<'r, 'a> {
    InPlace(&'r mut TensorMut<'a>),
    Into(&'r Tensor<'a>, &'r mut TensorMut<'a>),
}

impl<'a> Rotated<'_, 'a> {
    /// The input and the output (`None`: in place).
    fn raw(&self) -> (RawTensor, Option<RawTensor>) {
        match self {
            Rotated::InPlace(t) => (t.raw, None),
            Rotated::Into(t, out) => (t.raw, Some(out.raw)),
        }
    }

    /// The input's and the output's holds (`None`: in place).
    fn holds(&self) -> (&Hold<'a>, Option<&Hold<'a>>) {
        match self {
            Rotated::InPlace(t) => (&t.hold, None),
            Rotated::Into(t, out) => (&t.hold, Some(&out.hold)),
        }
    }
}

impl<'r, 'a> RopeArgs<'r, 'a> {
    /// Rotates `q` in place.
    pub fn in_place(q: &'r mut TensorMut<'a>, positions: Positions<'a>) -> Self {
        RopeArgs { q: Rotated::InPlace(q), k: None, positions, direction: Direction::Forward, norm: None }
    }

    /// Writes `q` rotated into `q_out`.
    pub fn into(q: &'r Tensor<'a>, q_out: &'r mut TensorMut<'a>, positions: Positions<'a>) -> Self {
        RopeArgs { q: Rotated::Into(q, q_out), k: None, positions, direction: Direction::Forward, norm: None }
    }

    /// Also rotates `k` in place (with q in place).
    pub fn k(mut self, k: &'r mut TensorMut<'a>) -> Self {
        self.k = Some(Rotated::InPlace(k));
        self
    }

    /// Also writes `k` rotated into `k_out` (with q out of place).
    pub fn k_into(mut self, k: &'r Tensor<'a>, k_out: &'r mut TensorMut<'a>) -> Self {
        self.k = Some(Rotated::Into(k, k_out));
        self
    }

    /// Rotates forward (the default) or back.
    pub fn direction(mut self, direction: Direction) -> Self {
        self.direction = direction;
        self
    }

    /// Normalizes each head of q (and k) with `norm` before the rotation, in the same launch
    /// (QK-norm without a cache: for prefill engines that write the cache elsewhere, and for
    /// cross-checks; [`crate::KvAppend::norm`] fuses the cache write too). In place, the dims
    /// past `rotary_dim` are normalized as well; out of place they are normalized into the
    /// outputs. Each value is rounded once, to its output's type. The views it takes are
    /// [`QkNorm`]'s rule, the same as [`crate::KvAppend::norm`]'s ([`Error::Norm`] otherwise).
    /// A q-only call reads only q's weights.
    pub fn norm(mut self, norm: QkNorm<'a>) -> Self {
        self.norm = Some(norm);
        self
    }

    /// The call as device addresses, for [`Rope::apply_raw`] and [`validate`].
    pub fn raw(&self) -> RawArgs {
        let (q, q_out) = self.q.raw();
        let (k, k_out) = self.k.as_ref().map(Rotated::raw).unzip();
        let positions = self.positions.raw();
        let norm = self.norm.as_ref().map(QkNorm::raw);
        RawArgs { q, q_out, k, k_out: k_out.flatten(), positions, direction: self.direction, norm }
    }

    /// Each buffer's name and hold.
    pub(crate) fn holds(&self) -> [(&'static str, Option<&Hold<'a>>); 7] {
        let (q, q_out) = self.q.holds();
        let (k, k_out) = self.k.as_ref().map(Rotated::holds).unzip();
        let positions = Some(&self.positions.hold);
        let weights = self.norm.as_ref().map_or([None; 2], QkNorm::holds);
        [
            ("q", Some(q)),
            ("q_out", q_out),
            ("k", k),
            ("k_out", k_out.flatten()),
            ("positions", positions),
            ("q norm weight", weights[0]),
            ("k norm weight", weights[1]),
        ]
    }
}

/// Checks `args` against `config` exactly as [`Rope::apply_raw`] does before it launches,
/// without a GPU: `Ok` means that call would launch (or, with no work, return at once), `Err`
/// is the typed error it would return. Reads no device memory (positions are checked by the
/// kernels, which skip and record those out of range).
///
/// ```
/// use rope_cuda::{validate, DType, Error, Layout, RawArgs, RawPositions, RawTensor, RopeConfig};
/// let config = RopeConfig::new(128, 4096).dtype(DType::BF16);
/// let q = RawTensor::new(1 << 20, 2 * 8 * 128, DType::BF16, Layout::bshd(1, 2, 8, 128));
/// let args = RawArgs::new(q, RawPositions::SEQUENTIAL);
/// assert_eq!(validate(&config, &args), Ok(()));
/// let mut short = args;
/// short.q.len = 100;
/// assert!(matches!(validate(&config, &short), Err(Error::OutOfBounds { what: "q", .. })));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn validate(config: &RopeConfig, args: &RawArgs) -> Result<()> {
    config.validate()?;
    let table = detached_source(config.rotary_dim, config.source());
    plan(config, args, table, ErrorSink::default()).map(|_| ())
}

/// A validated launch.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Plan {
    pub key: RopeKey,
    pub params: RopeParams,
    pub geometry: Geometry,
    /// Dynamic shared memory: the block's cos and sin ([`RopeParams::shared`]).
    pub shared: u32,
}

/// The buffers a RoPE launch on `args` touches, named, with the positions' at `positions`
/// (0: none), for [`crate::launch::Core::prepare`].
pub(crate) fn buffers(args: &RawArgs, positions: u64) -> [(&'static str, u64); 7] {
    let weight = |w: Option<RawWeight>| w.map_or(0, |w| w.ptr);
    [
        ("q", args.q.ptr),
        ("q_out", args.q_out.map_or(0, |t| t.ptr)),
        ("k", args.k.map_or(0, |t| t.ptr)),
        ("k_out", args.k_out.map_or(0, |t| t.ptr)),
        ("positions", positions),
        ("q norm weight", weight(args.norm.and_then(|n| n.q_weight))),
        ("k norm weight", weight(args.norm.and_then(|n| n.k_weight))),
    ]
}

/// Everything one RoPE launch takes, as device addresses. Each tensor carries its element
/// type: q's and k's must be the configuration's, and each output's one a kernel writes from
/// them (so far: the same). Built by [`RopeArgs::raw`] or by its constructor
/// ([`RawArgs::new`]) and `with_*` methods, so that a field added later breaks no caller.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
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
    pub direction: Direction,
    /// QK-norm of each head of q and k before the rotation ([`crate::RopeArgs::norm`]).
    pub norm: Option<RawNorm>,
}

impl RawArgs {
    /// Rotates `q` in place at `positions`, forward: no k, no outputs, no norm
    /// ([`RopeArgs::in_place`]).
    pub fn new(q: RawTensor, positions: RawPositions) -> Self {
        RawArgs { q, q_out: None, k: None, k_out: None, positions, direction: Direction::Forward, norm: None }
    }

    /// Also rotates the keys `k` (in place unless [`RawArgs::with_k_out`] names an output).
    pub fn with_k(self, k: RawTensor) -> Self {
        RawArgs { k: Some(k), ..self }
    }

    /// Writes rotated q into `q_out` instead of in place.
    pub fn with_q_out(self, q_out: RawTensor) -> Self {
        RawArgs { q_out: Some(q_out), ..self }
    }

    /// Writes rotated k into `k_out` instead of in place (with q out of place).
    pub fn with_k_out(self, k_out: RawTensor) -> Self {
        RawArgs { k_out: Some(k_out), ..self }
    }

    /// Rotates forward (the default) or back.
    pub fn with_direction(self, direction: Direction) -> Self {
        RawArgs { direction, ..self }
    }

    /// QK-norm of each head of q and k before the rotation ([`RopeArgs::norm`]).
    pub fn with_norm(self, norm: RawNorm) -> Self {
        RawArgs { norm: Some(norm), ..self }
    }
}

/// One of q and k: input, output (the input again in place) and names for errors.
struct Operand {
    input: RawTensor,
    output: RawTensor,
    name: &'static str,
    out_name: &'static str,
}

/// Checks `args` against `config` and works out the launch with cos and sin from `source` and
/// `errors`; `None` when there is no work. A pipeline: the operands' checks, the norm's stage,
/// the rows', one choice of width, the key against the support table, the geometry.
pub(crate) fn plan(config: &RopeConfig, args: &RawArgs, source: SourceView, errors: ErrorSink) -> Result<Option<Plan>> {
    let (q, k, in_place) = rope_operands(config, args)?;
    // q, then k if present (no allocation: this runs on every launch).
    let ops = || [Some(&q), k.as_ref()].into_iter().flatten();
    let norm = rope_norm(config, args, ops(), in_place)?;
    let qs = q.input.layout.shape;
    let (batch, seq) = (qs[0], qs[1]);
    let tokens = batch.saturating_mul(seq);
    let positions = positions(&args.positions, batch, seq, config.max_position, config.mrope.is_some())?;
    let pairs = pairs(config.rotary_dim, config.mrope.map(|m| m.bands()));
    check_u32(&[
        ("batch * seq", tokens),
        ("q heads", qs[2]),
        ("k heads", k.as_ref().map_or(0, |k| k.input.layout.heads())),
    ])?;

    let size = config.dtype.size();
    let (rot, hd) = (config.rotary_dim, config.head_dim);
    let vector = vector_fits(config.style, hd, rot, size, ops().flat_map(|op| [&op.input, &op.output]));
    let (rot_lanes, copy_width) = lanes(vector, config.style, rot, 16 / size);
    // In place the dims past rotary_dim stay, unless a norm scales them.
    let copy_lanes = if in_place && norm.is_none() { 0 } else { (hd - rot) / copy_width };
    // The normed kernels: a head's lanes inside one warp, in a power of two of slots.
    let slots = if norm.is_some() { lane_slots((rot_lanes + copy_lanes) as u64) as u32 } else { 0 };
    let view = |op: &Operand| heads_view(&op.input, Some(&op.output));
    let params = RopeParams {
        q: view(&q),
        k: k.as_ref().map(view).unwrap_or_default(),
        pairs,
        source,
        positions,
        errors,
        tokens: tokens as u32,
        seq: seq as u32,
        rot_lanes: rot_lanes as u32,
        copy_lanes: copy_lanes as u32,
        sin_sign: match args.direction {
            Direction::Forward => 1.0,
            Direction::Inverse => -1.0,
        },
        chunk: 0,
        slots,
        norm: norm.unwrap_or_default(),
        k_group: 0,
        items: 0,
    };
    let (width, g, few) = rope_width(config, &params, vector, ops().any(|op| shared_lines(op, size)), in_place);
    // Few tokens: the block copies the angle table into shared memory while the positions
    // load (the one-head kernels only; see `ComputedView::with_staged`).
    let params = RopeParams { source: staged(source, few && g == 1), ..params };
    let key = RopeKey {
        style: config.style,
        types: params.types(),
        width,
        mrope: config.mrope.is_some(),
        source: source.source(),
        norm: norm.is_some(),
        whole: norm.is_some_and(|n| n.whole()),
    };
    check_rope_key(config, args, &key)?;
    if norm.is_some() {
        check_head_lanes(rot_lanes + copy_lanes)?;
    }
    // A whole-projection norm's kernels take k's first group and the items per token from the
    // parameters, and blocks that hold a token's q heads and its k heads whole.
    let (params, block) = match key.whole {
        false => (params, BLOCK_THREADS),
        true => {
            let (q_heads, k_heads) = (params.q.heads as u64, params.k.heads as u64);
            let (k_group, items, block) =
                whole_rope_layout(q_heads, k_heads, params.slots as u64).ok_or(Error::Norm(WHOLE_TOO_LARGE))?;
            (RopeParams { k_group, items, ..params }, block)
        }
    };
    Ok(block_geometry(params.tokens, params.work(g) as u64, block)?.map(|(geometry, chunk)| {
        let params = RopeParams { chunk, ..params };
        let block = geometry.block.0;
        let layout = params.shared(block, params.work(g), params.source.computed());
        let shared = layout.with_norm_sums(params.norm.whole(), block);
        Plan { key, params, shared, geometry }
    }))
}

/// The operand stage: q's and k's types (the configuration's), shapes, views, and what each
/// writes kept apart from the rest; returns q, k, and whether they rotate in place.
fn rope_operands(config: &RopeConfig, args: &RawArgs) -> Result<(Operand, Option<Operand>, bool)> {
    // The inputs are of the configuration's type; the outputs of one a kernel writes from it
    // (checked with the key).
    for (what, t) in [("q", Some(&args.q)), ("k", args.k.as_ref())] {
        match t {
            Some(t) if t.dtype != config.dtype => {
                return Err(Error::DType { what, expected: config.dtype, got: t.dtype });
            }
            _ => {}
        }
    }
    if args.q_out.is_some() != args.k_out.is_some() && args.k.is_some() {
        return Err(Error::InPlaceMismatch);
    }
    if args.k.is_none() && args.k_out.is_some() {
        return Err(Error::InPlaceMismatch);
    }
    let q = Operand { input: args.q, output: args.q_out.unwrap_or(args.q), name: "q", out_name: "q_out" };
    let k = args.k.map(|input| Operand { input, output: args.k_out.unwrap_or(input), name: "k", out_name: "k_out" });
    let in_place = args.q_out.is_none();
    let qs = q.input.layout.shape;
    for op in [Some(&q), k.as_ref()].into_iter().flatten() {
        let shape = op.input.layout.shape;
        check_axis(op.name, "head_dim", config.head_dim, shape[3])?;
        for (axis, i) in [("batch", 0), ("seq", 1)] {
            check_axis(op.name, axis, qs[i], shape[i])?;
        }
        let out = op.output.layout.shape;
        for (axis, i) in [("batch", 0), ("seq", 1), ("heads", 2), ("head_dim", 3)] {
            check_axis(op.out_name, axis, shape[i], out[i])?;
        }
        check_view(op.name, &op.input)?;
        check_view(op.out_name, &op.output)?;
        check_written(if in_place { op.name } else { op.out_name }, &op.output.layout)?;
        // An output either is its input (in place) or shares nothing with it.
        if (op.output.ptr, op.output.layout) != (op.input.ptr, op.input.layout) {
            check_disjoint((op.name, &op.input), (op.out_name, &op.output))?;
        }
    }
    if let Some(k) = &k {
        // Nothing one tensor writes may be read or written through the other.
        let pairs = [
            (&q.output, q.out_name, &k.output, k.out_name),
            (&q.output, q.out_name, &k.input, k.name),
            (&k.output, k.out_name, &q.input, q.name),
        ];
        for (a, an, b, bn) in pairs {
            let (an, bn) = if in_place { (q.name, k.name) } else { (an, bn) };
            check_disjoint((an, a), (bn, b))?;
        }
    }
    Ok((q, k, in_place))
}

/// The norm stage: the QK-norm's view, its weights apart from every output.
fn rope_norm<'o>(
    config: &RopeConfig,
    args: &RawArgs,
    ops: impl Iterator<Item = &'o Operand> + Clone,
    in_place: bool,
) -> Result<Option<NormView>> {
    let Some(n) = &args.norm else { return Ok(None) };
    let mut heads = ops.clone().map(|op| op.input.layout.heads());
    let heads = [heads.next(), heads.next()];
    let view = norm_view(n, config.head_dim, heads, config.dtype)?;
    // The weights are read, never written: nothing an output covers.
    let weights = [("q norm weight", n.q_weight), ("k norm weight", n.k_weight)];
    for (what, w) in weights {
        let Some(w) = w else { continue };
        for op in ops.clone() {
            check_disjoint((what, &w.tensor()), (if in_place { op.name } else { op.out_name }, &op.output))?;
        }
    }
    Ok(Some(view))
}

/// In place, whether `op`'s heads share 128-byte lines (see [`rope_width`]).
fn shared_lines(op: &Operand, size: usize) -> bool {
    (op.input.layout.strides[2] * size) % 128 != 0
}

/// The width, the heads per thread and whether the launch is of few tokens.
fn rope_width(
    config: &RopeConfig,
    params: &RopeParams,
    vector: bool,
    shared_lines: bool,
    in_place: bool,
) -> (RopeWidth, u32, bool) {
    let size = config.dtype.size();
    let computed = params.source.source() == TableSource::Computed;
    let g = heads_per_thread(vector, config.style == RopeStyle::NeoX, size, computed);
    // In place with several heads per thread, heads whose rows share 128-byte lines run far
    // slower (the H200, Phi-3's head_dim 96 in bf16: 20.7% of copy bandwidth against 75% with
    // one head per thread; the same heads out of place: 87.6%), so those take one head each.
    // Few tokens (decode): several heads a thread would leave most of the GPU idle (64 tokens
    // of 32/8 heads of 128 in bf16: 20 blocks), and the launch is one thread's latency chain
    // long; one head a thread makes g times the threads and a g times shorter chain.
    let few = params.tokens as u64 * work_per_token(params, g) < FEW_THREADS;
    let one = match config.grouping {
        HeadGrouping::Auto => few || (in_place && shared_lines),
        HeadGrouping::One => true,
        HeadGrouping::Several => false,
    };
    // A whole-projection norm: one head a thread (its blocks hold a token's q heads, and its
    // k heads, whole). (The one-head kernels where `g` is 1 too: `_p`, not `_v` with one head,
    // for the whole-projection norm, whose kernels are `_p` alone.)
    let whole = params.norm.whole();
    let width = match (vector, (g > 1 && (one || whole)) || whole) {
        (false, _) => RopeWidth::Scalar,
        (true, false) => RopeWidth::Vector,
        (true, true) => RopeWidth::Single,
    };
    (width, if width == RopeWidth::Single { 1 } else { g }, few)
}

/// The key against the support table: its rule where no kernel takes it. Only the outputs'
/// types can mix beyond the table: the inputs' are the configuration's.
fn check_rope_key(config: &RopeConfig, args: &RawArgs, key: &RopeKey) -> Result<()> {
    check_supported(
        *key,
        || key.variant(),
        || {
            let outputs = [("q_out", args.q_out.as_ref()), ("k_out", args.k_out.as_ref())];
            let bad =
                outputs.into_iter().find_map(|(what, t)| t.filter(|t| t.dtype != config.dtype).map(|t| (what, t)));
            let (what, got) = bad.map_or(("q", config.dtype), |(what, t)| (what, t.dtype));
            Error::DType { what, expected: config.dtype, got }
        },
    )
}

/// The launch geometry of [`RopeParams`]'s thread mapping (without a norm) for a kernel taking
/// `g` heads per thread, and the tokens per grid row; `None` when there is no work.
#[cfg(test)]
fn geometry(p: &RopeParams, g: u32) -> Result<Option<(Geometry, u32)>> {
    crate::launch::flat_geometry(p.tokens, work_per_token(p, g))
}

/// Work items (threads) per token of [`RopeParams`]'s mapping at `g` heads per thread.
fn work_per_token(p: &RopeParams, g: u32) -> u64 {
    (groups(p.q.heads, g) as u64 + groups(p.k.heads, g) as u64) * p.group_slots() as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::DType;
    use crate::layout::Layout;
    use crate::tensor::{PositionKind, RawPositions};
    use rope_cuda_kernels::entries::Key;
    use rope_cuda_kernels::keys::RopeTypes;
    use rope_cuda_kernels::params::{block_tokens, block_tokens_max, work_item};
    use rope_cuda_kernels::views::ErrorRecord;

    /// [`super::plan`] without a table or records, as [`validate`] plans.
    fn plan(config: &RopeConfig, args: &RawArgs) -> Result<Option<Plan>> {
        super::plan(config, args, detached_source(config.rotary_dim, config.source()), ErrorSink::default())
    }

    const BASE: u64 = 1 << 20;

    fn tensor(ptr: u64, layout: Layout) -> RawTensor {
        RawTensor::new(ptr, layout.extent().unwrap(), DType::BF16, layout)
    }

    /// bf16, head_dim 128, 4 tokens of q (8 heads) and k (2 heads) in separate buffers, ids.
    fn args() -> (RopeConfig, RawArgs) {
        let config = RopeConfig::new(128, 4096).dtype(DType::BF16);
        let args = RawArgs {
            q: tensor(BASE, Layout::bshd(2, 2, 8, 128)),
            q_out: None,
            k: Some(tensor(2 * BASE, Layout::bshd(2, 2, 2, 128))),
            k_out: None,
            positions: RawPositions { kind: PositionKind::IdsI32, ptr: 3 * BASE, len: 4 },
            direction: Direction::Forward,
            norm: None,
        };
        (config, args)
    }

    fn err(config: &RopeConfig, args: &RawArgs) -> Error {
        plan(config, args).expect_err("expected an error")
    }

    #[test]
    fn plans_vector_launches_for_aligned_views() {
        let (config, args) = args();
        let p = plan(&config, &args).unwrap().unwrap();
        assert_ne!(p.key.width, RopeWidth::Scalar);
        assert_eq!((p.params.rot_lanes, p.params.copy_lanes, p.params.tokens, p.params.seq), (8, 0, 4, 2));
        assert_eq!((p.params.q.heads, p.params.k.heads), (8, 2));
        assert_eq!(p.params.q.in_strides, [2 * 8 * 128, 8 * 128, 128]);
        // GPT-J, partial rotary, out of place: rotating lanes of two vectors (16 elements),
        // copy lanes of one (8) for the rest.
        let config = config.style(RopeStyle::GptJ).rotary_dim(64);
        let out = Some(tensor(4 * BASE, Layout::bshd(2, 2, 8, 128)));
        let k_out = Some(tensor(5 * BASE, Layout::bshd(2, 2, 2, 128)));
        let p = plan(&config, &RawArgs { q_out: out, k_out, ..args }).unwrap().unwrap();
        assert_eq!((p.params.rot_lanes, p.params.copy_lanes), (64 / 16, 64 / 8));
        assert_eq!(p.params.sin_sign, 1.0);
    }

    /// A whole-projection norm: the one-head `_p` kernels (`_w`) in every type and style, also
    /// where the planner would take `_v` with one head (f32 NeoX from the table), blocks that
    /// hold a token's q and k heads, and `k_group` and `items` for the kernel.
    #[test]
    fn plans_whole_projection_norms() {
        use crate::norm::{NormKind, RawNorm};
        use crate::RawWeight;
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            for style in [RopeStyle::NeoX, RopeStyle::GptJ] {
                let (config, args) = args_tokens(RopeConfig::new(128, 4096).style(style), dtype, 4096);
                let weight = |ptr: u64, heads: usize| Some(RawWeight { ptr: ptr << 36, len: heads * 128, dtype });
                let norm = RawNorm {
                    kind: NormKind::RmsProjection,
                    eps: 1e-6,
                    q_weight: weight(4, 32),
                    k_weight: weight(5, 8),
                };
                let p = plan(&config, &RawArgs { norm: Some(norm), ..args }).unwrap().unwrap();
                let what = format!("{dtype:?} {style:?}");
                assert_eq!((p.key.width, p.key.norm, p.key.whole), (RopeWidth::Single, true, true), "{what}");
                assert!(p.key.entry_point().is_some(), "{what}");
                // Lanes of 32 bytes: 8 a head in 16-bit types, 16 in f32. A token's 32 + 8 heads
                // fit one block in 16 bits (320 items); in f32 (640) q's 512 and k's 128 take
                // blocks of 512, k's in the second.
                let (k_group, items, block) = if dtype == DType::F32 { (32, 1024, 512) } else { (32, 320, 320) };
                assert_eq!((p.params.k_group, p.params.items, p.geometry.block.0), (k_group, items, block), "{what}");
                let layout = p.params.shared(block, items, p.params.source.computed());
                assert_eq!(p.shared, layout.bytes + 4 * block, "{what}");
            }
        }
    }

    /// [`args_with`] for 2 sequences of `seq` tokens, 32 q and 8 k heads, far-apart buffers.
    fn args_tokens(config: RopeConfig, dtype: DType, seq: usize) -> (RopeConfig, RawArgs) {
        let (config, mut args) = args_with(config, dtype);
        let (d, at) = (config.head_dim, |i: u64| i << 36);
        args.q = RawTensor { dtype, ..tensor(at(1), Layout::bshd(2, seq, 32, d)) };
        args.k = Some(RawTensor { dtype, ..tensor(at(2), Layout::bshd(2, seq, 8, d)) });
        args.positions = RawPositions { kind: PositionKind::IdsI32, ptr: at(3), len: 2 * seq };
        (config, args)
    }

    #[test]
    fn in_place_heads_sharing_lines_take_one_head_per_thread() {
        // bf16 head_dim 96: rows of 192 bytes share 128-byte lines.
        let (config, mut args) = args_tokens(RopeConfig::new(96, 4096), DType::BF16, 4096);
        let p = plan(&config, &args).unwrap().unwrap();
        assert_eq!(p.key.width, RopeWidth::Single);
        assert_eq!(p.geometry, geometry(&p.params, 1).unwrap().unwrap().0);
        // Out of place, or rows of whole lines: the measured heads per thread.
        args.q_out = Some(tensor(4 << 36, args.q.layout));
        args.k_out = Some(tensor(5 << 36, args.k.unwrap().layout));
        assert_eq!(plan(&config, &args).unwrap().unwrap().key.width, RopeWidth::Vector);
        let (config, args) = args_tokens(RopeConfig::new(128, 4096), DType::BF16, 4096);
        assert_eq!(plan(&config, &args).unwrap().unwrap().key.width, RopeWidth::Vector);
    }

    #[test]
    fn few_tokens_take_one_head_per_thread() {
        // A decode step: 64 tokens of 32/8 heads of 128, in place and out.
        let (config, mut args) = args_tokens(RopeConfig::new(128, 4096), DType::BF16, 32);
        let p = plan(&config, &args).unwrap().unwrap();
        assert_eq!(p.key.width, RopeWidth::Single);
        assert_eq!(p.geometry, geometry(&p.params, 1).unwrap().unwrap().0);
        assert!(
            p.params.tokens as u64 * work_per_token(&p.params, heads_per_thread(true, true, 2, false)) < FEW_THREADS
        );
        args.q_out = Some(tensor(4 << 36, args.q.layout));
        args.k_out = Some(tensor(5 << 36, args.k.unwrap().layout));
        assert_eq!(plan(&config, &args).unwrap().unwrap().key.width, RopeWidth::Single);
        // Where the measured count is one head (f32 NeoX), its `_v` kernel stays.
        let (config, args) = args_tokens(RopeConfig::new(128, 4096), DType::F32, 32);
        let want = if heads_per_thread(true, true, 4, false) == 1 { RopeWidth::Vector } else { RopeWidth::Single };
        assert_eq!(plan(&config, &args).unwrap().unwrap().key.width, want);
        // Enough tokens to fill the GPU at several heads a thread: the vector kernel.
        let (config, args) = args_tokens(RopeConfig::new(128, 4096), DType::BF16, 512);
        assert_eq!(plan(&config, &args).unwrap().unwrap().key.width, RopeWidth::Vector);
        // Chosen by the configuration instead.
        let (config, args) = args_tokens(RopeConfig::new(128, 4096).grouping(HeadGrouping::One), DType::BF16, 512);
        assert_eq!(plan(&config, &args).unwrap().unwrap().key.width, RopeWidth::Single);
        let (config, args) = args_tokens(RopeConfig::new(96, 4096).grouping(HeadGrouping::Several), DType::BF16, 32);
        let p = plan(&config, &args).unwrap().unwrap();
        assert_eq!(p.key.width, RopeWidth::Vector, "few tokens, in place on rows sharing lines");
        assert_eq!(p.geometry, geometry(&p.params, heads_per_thread(true, true, 2, false)).unwrap().unwrap().0);
    }

    #[test]
    fn falls_back_to_scalar_when_alignment_or_dims_forbid_vectors() {
        let (config, mut args) = args();
        args.q.layout.offset = 1; // 2-byte aligned only
        args.q.len += 1;
        let p = plan(&config, &args).unwrap().unwrap();
        assert_eq!(p.key.width, RopeWidth::Scalar);
        assert_eq!(p.params.rot_lanes, 64);
        let (config, args) = args_with(RopeConfig::new(80, 64).rotary_dim(20), DType::F32);
        let p = plan(&config, &args).unwrap().unwrap();
        assert_eq!(p.key.width, RopeWidth::Scalar, "half = 10 is not a multiple of 4");
        assert_eq!(p.params.rot_lanes, 10);
        // GPT-J lanes are two vectors: bf16 rotary_dim 24 is three vectors, not whole lanes;
        // 32 is two lanes.
        for (rot, vector, lanes) in [(24, false, 12), (32, true, 2)] {
            let config = RopeConfig::new(128, 64).rotary_dim(rot).style(RopeStyle::GptJ);
            let (config, args) = args_with(config, DType::BF16);
            let p = plan(&config, &args).unwrap().unwrap();
            assert_eq!((p.key.width != RopeWidth::Scalar, p.params.rot_lanes), (vector, lanes), "rotary_dim {rot}");
        }
    }

    fn args_with(config: RopeConfig, dtype: DType) -> (RopeConfig, RawArgs) {
        let (_, mut args) = args();
        let config = config.dtype(dtype);
        let d = config.head_dim;
        args.q = RawTensor { dtype, ..tensor(BASE, Layout::bshd(2, 2, 8, d)) };
        args.k = Some(RawTensor { dtype, ..tensor(2 * BASE, Layout::bshd(2, 2, 2, d)) });
        (config, args)
    }

    #[test]
    fn fused_qkv_views_in_place_are_accepted() {
        let (config, mut args) = args();
        let row = (8 + 2 + 2) * 128 + 8; // padded rows
        args.q = RawTensor::new(BASE, 4 * row, DType::BF16, Layout::strided([2, 2, 8, 128], [2 * row, row, 128], 0));
        args.k = Some(RawTensor::new(
            BASE,
            4 * row,
            DType::BF16,
            Layout::strided([2, 2, 2, 128], [2 * row, row, 128], 8 * 128),
        ));
        let p = plan(&config, &args).unwrap().unwrap();
        assert_ne!(p.key.width, RopeWidth::Scalar, "row stride {row} keeps 16-byte alignment");
        // k shifted by one head onto q's last head.
        args.k.as_mut().unwrap().layout.offset = 7 * 128;
        assert!(matches!(err(&config, &args), Error::Aliasing { a: "q", b: "k" }));
    }

    #[test]
    fn each_bad_input_has_its_own_error() {
        let (config, args) = args();
        // Each operand's type: q and k the configuration's; an output one a kernel writes
        // from it (so far only the inputs' own).
        let f16 = |t: RawTensor| RawTensor { dtype: DType::F16, ..t };
        let oop = |a: RawArgs| RawArgs { q_out: Some(tensor(5 * BASE, a.q.layout)), k_out: a.k, ..a };
        for (name, bad) in [
            ("q", RawArgs { q: f16(args.q), ..args }),
            ("k", RawArgs { k: args.k.map(f16), ..args }),
            ("q_out", RawArgs { q_out: Some(f16(tensor(5 * BASE, args.q.layout))), ..oop(args) }),
            ("k_out", RawArgs { k_out: args.k.map(|k| f16(RawTensor { ptr: 6 * BASE, ..k })), ..oop(args) }),
        ] {
            let e = err(&config, &bad);
            assert!(
                matches!(e, Error::DType { what, expected: DType::BF16, got: DType::F16 } if what == name),
                "{e:?}"
            );
        }
        let good = oop(args);
        let good = RawArgs { k_out: good.k_out.map(|k| RawTensor { ptr: 6 * BASE, ..k }), ..good };
        assert_eq!(plan(&config, &good).unwrap().unwrap().key.types, RopeTypes::uniform(DType::BF16));

        let mut a = args;
        a.q.layout.shape[3] = 64;
        assert!(matches!(err(&config, &a), Error::Shape { what: "q", axis: "head_dim", expected: 128, got: 64 }));
        let mut a = args;
        a.k.as_mut().unwrap().layout.shape[1] = 3;
        assert!(matches!(err(&config, &a), Error::Shape { what: "k", axis: "seq", expected: 2, got: 3 }));
        let mut a = args;
        a.k.as_mut().unwrap().layout.shape[0] = 1;
        assert!(matches!(err(&config, &a), Error::Shape { what: "k", axis: "batch", .. }));

        let mut a = args;
        a.q.len -= 1;
        assert!(matches!(err(&config, &a), Error::OutOfBounds { what: "q", .. }));
        let mut a = args;
        a.q.ptr += 1;
        assert!(matches!(err(&config, &a), Error::Alignment { what: "q", align: 2, .. }));

        let mut a = args;
        a.q.layout.strides[2] = 64; // heads overlap, written in place
        assert!(matches!(err(&config, &a), Error::Overlap { what: "q", .. }));

        // Out of place: shapes, bounds and aliasing of the outputs.
        let q_out = tensor(4 * BASE, Layout::bshd(2, 2, 8, 128));
        let k_out = tensor(5 * BASE, Layout::bshd(2, 2, 2, 128));
        let oop = RawArgs { q_out: Some(q_out), k_out: Some(k_out), ..args };
        plan(&config, &oop).unwrap();
        let e = err(&config, &RawArgs { k_out: None, ..oop });
        assert!(matches!(e, Error::InPlaceMismatch), "{e:?}");
        let mut a = oop;
        a.q_out.as_mut().unwrap().layout.shape[2] = 7;
        assert!(matches!(err(&config, &a), Error::Shape { what: "q_out", axis: "heads", expected: 8, got: 7 }));
        let mut a = oop;
        a.k_out.as_mut().unwrap().len = 10;
        assert!(matches!(err(&config, &a), Error::OutOfBounds { what: "k_out", .. }));
        let mut a = oop;
        a.k_out = Some(q_out);
        a.k_out.as_mut().unwrap().layout.shape[2] = 2;
        assert!(matches!(err(&config, &a), Error::Aliasing { a: "q_out", b: "k_out" }));
        let mut a = oop;
        a.q_out.as_mut().unwrap().ptr = BASE + 256; // overlaps q, not equal to it
        assert!(matches!(err(&config, &a), Error::Aliasing { a: "q", b: "q_out" }));
        let mut a = oop;
        a.q_out = Some(a.k.unwrap()); // writes k's input
        a.q_out.as_mut().unwrap().layout = Layout::bshd(2, 2, 8, 128);
        a.q_out.as_mut().unwrap().len = usize::MAX;
        assert!(matches!(err(&config, &a), Error::Aliasing { a: "q_out", b: "k" }));

        // Positions.
        let mut a = args;
        a.positions.len = 3;
        assert!(matches!(err(&config, &a), Error::Length { what: "positions", expected: 4, got: 3, .. }));
        let mut a = args;
        a.positions = RawPositions { kind: PositionKind::OffsetsI64, ptr: 3 * BASE + 4, len: 2 };
        assert!(matches!(err(&config, &a), Error::Alignment { what: "positions", align: 8, .. }));
        let mut a = args;
        a.positions = RawPositions::SEQUENTIAL;
        a.q.layout = Layout::bshd(1, 5000, 8, 128);
        a.q.len = a.q.layout.extent().unwrap();
        a.k = None;
        assert!(matches!(err(&config, &a), Error::MaxPosition { needed: 5000, max_position: 4096 }));
    }

    /// The launch path allocates nothing: planning in place, out of place and on fused views.
    #[test]
    fn planning_a_launch_allocates_nothing() {
        let (config, args) = args();
        let row = (8 + 2 + 2) * 128;
        let fused = RawArgs {
            q: RawTensor::new(BASE, 4 * row, DType::BF16, Layout::strided([2, 2, 8, 128], [2 * row, row, 128], 0)),
            k: Some(RawTensor::new(
                BASE,
                4 * row,
                DType::BF16,
                Layout::strided([2, 2, 2, 128], [2 * row, row, 128], 8 * 128),
            )),
            ..args
        };
        let oop = RawArgs {
            q_out: Some(tensor(4 * BASE, Layout::bshd(2, 2, 8, 128))),
            k_out: Some(tensor(5 * BASE, Layout::bshd(2, 2, 2, 128))),
            ..args
        };
        for a in [args, fused, oop] {
            let (plan, allocations) = crate::alloc_count::count(|| plan(&config, &a));
            assert!(plan.unwrap().is_some());
            assert_eq!(allocations, 0, "{a:?}");
        }
        // The counter does count.
        let (_, n) = crate::alloc_count::count(|| vec![1u8; 10]);
        assert_eq!(n, 1);
    }

    /// Every layout of the GPU matrix (tests/rope_gpu.rs) is accepted, in and out of place.
    #[test]
    fn matrix_layouts_are_accepted() {
        let (b, s) = (2, 3);
        for (hq, hk) in [(32, 8), (17, 1), (8, 8)] {
            let dims =
                [(128, 128), (128, 64), (80, 32), (256, 256), (64, 64), (96, 32), (112, 112), (192, 96), (512, 128)];
            for (hd, rot) in dims {
                let config = RopeConfig::new(hd, 4096).rotary_dim(rot).dtype(DType::BF16);
                let mut storages = vec![
                    (Layout::bshd(b, s, hq, hd), Layout::bshd(b, s, hk, hd), false),
                    (Layout::bhsd(b, hq, s, hd), Layout::bhsd(b, hk, s, hd), false),
                ];
                for (pad, start) in [(8, 0), (1, 1)] {
                    let row = (hq + 2 * hk) * hd + pad;
                    let q = Layout::strided([b, s, hq, hd], [s * row, row, hd], start);
                    storages.push((q, Layout::strided([b, s, hk, hd], [s * row, row, hd], start + hq * hd), true));
                }
                for (ql, kl, fused) in storages {
                    let kptr = if fused { BASE } else { 2 * BASE };
                    let len = |l: &Layout| l.extent().unwrap() + 8;
                    let q = RawTensor::new(BASE, len(&ql).max(len(&kl)), DType::BF16, ql);
                    let k = RawTensor::new(kptr, len(&ql).max(len(&kl)), DType::BF16, kl);
                    let positions = RawPositions { kind: PositionKind::IdsI64, ptr: 8 * BASE, len: b * s };
                    let dir = Direction::Forward;
                    let in_place =
                        RawArgs { q, q_out: None, k: Some(k), k_out: None, positions, direction: dir, norm: None };
                    plan(&config, &in_place).unwrap_or_else(|e| panic!("{ql:?} {kl:?}: {e}"));
                    let (qo, ko) = (RawTensor { ptr: 16 * BASE, ..q }, RawTensor { ptr: 16 * BASE + kptr - BASE, ..k });
                    let oop = RawArgs { q_out: Some(qo), k_out: Some(ko), ..in_place };
                    plan(&config, &oop).unwrap_or_else(|e| panic!("out of place {ql:?} {kl:?}: {e}"));
                }
            }
        }
    }

    #[test]
    fn configs_are_validated() {
        let ok = RopeConfig::new(128, 16);
        ok.validate().unwrap();
        assert!(matches!(RopeConfig::new(130 + 512, 16).validate(), Err(Error::HeadDim { .. })));
        assert!(matches!(RopeConfig::new(127, 16).validate(), Err(Error::HeadDim { head_dim: 127 })));
        assert!(matches!(ok.clone().rotary_dim(130).validate(), Err(Error::RotaryDim { rotary_dim: 130, .. })));
        assert!(matches!(ok.clone().rotary_dim(31).validate(), Err(Error::RotaryDim { .. })));
        assert!(matches!(ok.clone().base(0.0).validate(), Err(Error::Base { .. })));
        assert!(matches!(RopeConfig::new(128, 0).validate(), Err(Error::MaxPosition { .. })));
        assert!(matches!(
            RopeConfig::new(128, (1 << 31) + 1).validate(),
            Err(Error::TooLarge { what: "max_position", .. })
        ));
    }

    #[test]
    fn empty_work_plans_nothing_but_is_still_checked() {
        let (config, mut args) = args();
        args.q.layout.shape[0] = 0;
        args.k.as_mut().unwrap().layout.shape[0] = 0;
        args.positions.len = 0;
        assert_eq!(plan(&config, &args).unwrap(), None);
        args.positions.len = 1;
        assert!(matches!(err(&config, &args), Error::Length { what: "positions", .. }));
    }

    #[test]
    fn error_keys_order_by_token_and_saturate_positions() {
        assert!(ErrorRecord::key(3, 1 << 40) < ErrorRecord::key(4, -5));
        let r = ErrorRecord { key: ErrorRecord::key(7, -(1 << 40)), count: 2 };
        assert_eq!(r.first(), Some((7, i32::MIN as i64)));
        assert_eq!(ErrorRecord::CLEAR.first(), None);
    }

    fn params(qh: u32, kh: u32, lanes: u32, tokens: u32) -> RopeParams {
        let mut p = RopeParams { tokens, seq: 1, rot_lanes: lanes, ..Default::default() };
        p.pairs = rope_cuda_kernels::views::Pairs::new(lanes);
        p.q.heads = qh;
        p.k.heads = kh;
        p
    }

    /// Every (token, work item) pair gets exactly one thread, and blocks stay within 1024.
    #[test]
    fn geometry_covers_all_work_once() {
        let cases = [
            (32, 8, 16, 5, 1),
            (1, 0, 1, 3, 1),
            (17, 1, 10, 7, 2),
            (3, 3, 8, 1, 4),
            (64, 64, 32, 2, 4),
            (33, 7, 8, 9, 4),
            (32, 8, 8, 3, 1),
            (200, 57, 16, 2, 1),
        ];
        for (qh, kh, lanes, tokens, heads_per_thread) in cases {
            let p = params(qh, kh, lanes, tokens);
            let (g, chunk) = geometry(&p, heads_per_thread).unwrap().unwrap();
            assert!(g.block.0 <= 1024 && g.block.1 == 1);
            let work = (groups(qh, heads_per_thread) + groups(kh, heads_per_thread)) * lanes;
            let mut seen = vec![0u32; (work * tokens) as usize];
            for gx in 0..g.grid.0 {
                for gy in 0..g.grid.1 {
                    // The block's tokens (its shared cos/sin rows) hold every token its threads
                    // take, and no more than the shared memory is sized for.
                    let (first, count) = block_tokens((gx, gy), g.block.0, work, chunk, tokens);
                    assert!(count <= block_tokens_max(work, g.block.0), "{count} tokens in a block");
                    let mut taken = 0;
                    for tx in 0..g.block.0 {
                        if let Some((t, w)) = work_item((gx, gy), g.block.0, tx, work, chunk, tokens) {
                            assert!(t < tokens && w < work);
                            assert!(t >= first && t < first + count, "token {t} outside {first} + {count}");
                            seen[(t * work + w) as usize] += 1;
                            taken += 1;
                        }
                    }
                    assert_eq!(count == 0, taken == 0);
                }
            }
            assert!(seen.iter().all(|&c| c == 1), "{qh}/{kh} heads, {lanes} lanes, {tokens} tokens");
        }
        assert_eq!(geometry(&params(0, 0, 4, 9), 2).unwrap(), None);
        assert_eq!(geometry(&params(4, 0, 4, 0), 2).unwrap(), None);
    }

    /// Past 2^31 thread indices the grid gets more rows; each row's first and last threads map
    /// to the rows' token ranges, and the index math stays below 2^32.
    #[test]
    fn geometry_rows_keep_indices_32_bit() {
        let (tokens, work) = (3_000_000u32, 4_096u32);
        let (g, chunk) = geometry(&params(64, 64, 32, tokens), 1).unwrap().unwrap();
        assert_eq!(chunk, (1 << 31) / work);
        assert_eq!(g.grid.1, tokens.div_ceil(chunk));
        assert!(g.grid.0 as u64 * g.block.0 as u64 <= (1 << 31) + g.block.0 as u64);
        for y in 0..g.grid.1 {
            assert_eq!(work_item((0, y), g.block.0, 0, work, chunk, tokens), Some((y * chunk, 0)));
            let end = ((y + 1) as u64 * chunk as u64).min(tokens as u64) as u32;
            // The row's last item, and the thread after it (none past the row or the tokens).
            let i = (end - y * chunk) * work - 1;
            let (bx, tx) = (i / g.block.0, i % g.block.0);
            assert!(bx < g.grid.0);
            assert_eq!(work_item((bx, y), g.block.0, tx, work, chunk, tokens), Some((end - 1, work - 1)));
            let (bx, tx) = ((i + 1) / g.block.0, (i + 1) % g.block.0);
            assert_eq!(work_item((bx, y), g.block.0, tx, work, chunk, tokens), None, "row {y}");
        }
        // Absurd sizes are refused, not wrapped.
        assert!(matches!(geometry(&params(1 << 20, 0, 1 << 12, 1), 1), Err(Error::TooLarge { .. })));
        assert!(matches!(geometry(&params(1 << 12, 0, 1 << 12, u32::MAX), 1), Err(Error::TooLarge { .. })));
    }
}
