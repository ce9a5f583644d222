//! The KV shift ([`Rope::shift_kv`]): cached keys rotated in place by a position delta per
//! sequence, so that an engine that drops tokens from a conversation (a context shift) moves
//! the kept keys to their new positions without running the model again.

use std::ops::Range;

use cust::sys as cuda;
use rope_cuda_kernels::keys::{RopeStyle, RopeWidth, ShiftKey, TableSource};
use rope_cuda_kernels::params::{groups, shift_heads_per_thread, FastDiv, ShiftParams};
use rope_cuda_kernels::tuning::BLOCK_THREADS;
use rope_cuda_kernels::views::{CacheView, ErrorSink, PositionKind, PositionsView, ScalesView, SourceView};

use crate::config::{DType, RopeConfig};
use crate::error::{Error, Result};
use crate::kernels::Geometry;
use crate::launch::{
    check_axis, check_disjoint, check_supported, check_u32, check_view, check_written, detached_source, flat_geometry,
    lanes, pairs, vector_fits, Core,
};
use crate::layout::Layout;
use crate::mla::{mla_name, MlaCache, RawMlaCache};
use crate::operand::{on_stream, Hold, Operand, Queue};
use crate::rope::Rope;
use crate::scaling::RopeScaling;
use crate::tensor::{Positions, RawPositions, RawTensor};

use super::call::{KvCall, KvOperand};
use super::scales::{check_scales, scale_tensor};
use super::{KvCache, RawKvCache, RawScales};

/// The largest `|Δ|` a shift takes: `2^31 - 1` (the angle reduced exactly, as the computed
/// source reduces positions).
pub const SHIFT_MAX_DELTA: i64 = i32::MAX as i64;

/// One KV shift ([`Rope::shift_kv`]): the keys of the named rows of a cache rotated in place by
/// their sequence's delta `Δ` (`deltas`, one i32 or i64 per sequence, given as
/// [`Positions::ids_i32`] or [`Positions::ids_i64`]). A key appended at position `p` is then the
/// key an append at `p + Δ` would have stored (up to the stored key's rounding): RoPE is a
/// rotation, `R(p + Δ) = R(Δ) R(p)` at every frequency.
///
/// Rows: a paged cache's by a slot list ([`KvShift::slots`], `[batch, n]` i64 row-major, `-1`
/// skipped), a contiguous or window cache's by a range of each sequence's block
/// ([`KvShift::rows`]; all of it by default), `batch` being the cache's sequences. The shift
/// moves no row: an engine that shifts a contiguous cache also moves the rows it keeps (or
/// keeps a paged cache, whose slot lists it rewrites). The value cache is not touched.
#[derive(Debug)]
pub struct KvShift<'r, 'a> {
    cache: ShiftCache,
    /// The key cache's hold and its scales'.
    holds: [Option<Hold<'a>>; 2],
    deltas: Positions<'a>,
    slots: Option<(u64, usize, Hold<'a>)>,
    rows: Option<Range<usize>>,
    deinterleaved: bool,
    length_dependent: bool,
    _cache: std::marker::PhantomData<&'r mut ()>,
}

impl<'r, 'a> KvShift<'r, 'a> {
    /// A shift of `cache`'s keys by `deltas` (one per sequence): every row of each sequence of a
    /// contiguous cache until [`KvShift::rows`] names fewer; a paged cache's rows are given by
    /// [`KvShift::slots`].
    pub fn new(cache: &'r mut KvCache<'a>, deltas: Positions<'a>) -> Self {
        let holds = [Some(cache.k.hold), cache.scales.as_ref().map(|s| s.k.2)];
        KvShift::of(ShiftCache::Kv(cache.raw()), holds, deltas)
    }

    /// A shift of an MLA latent cache's positional keys (each row's `k_pe`; its `kv_c` is not
    /// touched).
    pub fn mla(cache: &'r mut MlaCache<'a>, deltas: Positions<'a>) -> Self {
        let holds = [Some(cache.rows.hold), cache.scale.as_ref().map(|s| s.2)];
        KvShift::of(ShiftCache::Mla(cache.raw()), holds, deltas)
    }

    fn of(cache: ShiftCache, holds: [Option<Hold<'a>>; 2], deltas: Positions<'a>) -> Self {
        KvShift {
            cache,
            holds,
            deltas,
            slots: None,
            rows: None,
            deinterleaved: false,
            length_dependent: false,
            _cache: std::marker::PhantomData,
        }
    }

    /// A paged cache's rows: `[batch, n]` i64 slots, row-major (`-1`: skipped). The slots of
    /// one call must be distinct (each row is read and written by one thread; a slot named
    /// twice leaves that row's keys unspecified, and nothing else changes).
    pub fn slots(mut self, slots: impl Operand<'a, Elem = i64>) -> Self {
        self.slots = Some(slots.lend());
        self
    }

    /// A contiguous (or window) cache's rows `range` of each sequence's block.
    pub fn rows(mut self, range: Range<usize>) -> Self {
        self.rows = Some(range);
        self
    }

    /// An MLA cache written de-interleaved ([`MlaAppend::deinterleaved`](crate::MlaAppend::deinterleaved)):
    /// its keys are in NeoX order.
    pub fn deinterleaved(mut self) -> Self {
        self.deinterleaved = true;
        self
    }

    /// Shift under a `dynamic` or `longrope` scaling too (refused otherwise,
    /// [`Error::ShiftScaling`]): the keys are turned by `Δ` at this `Rope`'s frequencies, which
    /// is exact where each of them was appended by a `Rope` of this one's `seq_len`.
    pub fn length_dependent(mut self) -> Self {
        self.length_dependent = true;
        self
    }

    /// The shift as device addresses, for [`Rope::shift_kv_raw`].
    pub fn raw(&self) -> RawShiftArgs {
        RawShiftArgs {
            cache: self.cache,
            deltas: self.deltas.raw(),
            slots: self.slots.as_ref().map(|&(p, n, _)| (p, n)),
            rows: self.rows.as_ref().map(|r| (r.start, r.end)),
            deinterleaved: self.deinterleaved,
            length_dependent: self.length_dependent,
        }
    }

    /// Each buffer's name and hold.
    fn holds(&self) -> [(&'static str, Option<&Hold<'a>>); 4] {
        [
            ("k cache", self.holds[0].as_ref()),
            ("k scales", self.holds[1].as_ref()),
            ("deltas", Some(&self.deltas.hold)),
            ("slots", self.slots.as_ref().map(|s| &s.2)),
        ]
    }
}

/// The cache a shift turns: a KV cache's keys, or an MLA latent cache's `k_pe`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShiftCache {
    /// A KV cache (its value cache is not read).
    Kv(RawKvCache),
    /// An MLA latent cache (its `kv_c` is not read).
    Mla(RawMlaCache),
}

/// A KV shift as device addresses ([`KvShift`]): built by [`KvShift::raw`] or by
/// [`RawShiftArgs::new`] and the `with_*` methods, so that a field added later breaks no
/// caller.
///
/// ```compile_fail
/// # use rope_cuda::{RawShiftArgs, ShiftCache, RawPositions};
/// # fn f(cache: ShiftCache, deltas: RawPositions) {
/// // Not by a literal: the struct is non-exhaustive.
/// let _ = RawShiftArgs { cache, deltas, slots: None, rows: None, deinterleaved: false, length_dependent: false };
/// # }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct RawShiftArgs {
    /// The cache.
    pub cache: ShiftCache,
    /// One delta per sequence: [`PositionKind::IdsI32`] or [`PositionKind::IdsI64`].
    pub deltas: RawPositions,
    /// A paged cache's slots, `[batch, n]` i64: device address and length.
    pub slots: Option<(u64, usize)>,
    /// A contiguous cache's rows of each block, `(start, end)` (all of them where `None`).
    pub rows: Option<(usize, usize)>,
    /// Keys in NeoX order though the configuration's style is GPT-J (MLA's de-interleaved
    /// cache).
    pub deinterleaved: bool,
    /// Shift under a `dynamic` or `longrope` scaling ([`KvShift::length_dependent`]).
    pub length_dependent: bool,
}

impl RawShiftArgs {
    /// A shift of `cache` by `deltas` ([`KvShift::new`], [`KvShift::mla`]).
    pub fn new(cache: ShiftCache, deltas: RawPositions) -> Self {
        RawShiftArgs { cache, deltas, slots: None, rows: None, deinterleaved: false, length_dependent: false }
    }

    /// A paged cache's slots ([`KvShift::slots`]).
    pub fn with_slots(self, slots: (u64, usize)) -> Self {
        RawShiftArgs { slots: Some(slots), ..self }
    }

    /// A contiguous cache's rows ([`KvShift::rows`]).
    pub fn with_rows(self, rows: Range<usize>) -> Self {
        RawShiftArgs { rows: Some((rows.start, rows.end)), ..self }
    }

    /// Keys in NeoX order ([`KvShift::deinterleaved`]).
    pub fn with_deinterleaved(self, deinterleaved: bool) -> Self {
        RawShiftArgs { deinterleaved, ..self }
    }

    /// Shift under a length-dependent scaling ([`KvShift::length_dependent`]).
    pub fn with_length_dependent(self, length_dependent: bool) -> Self {
        RawShiftArgs { length_dependent, ..self }
    }
}

/// A validated shift.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct ShiftPlan {
    pub key: ShiftKey,
    pub params: ShiftParams,
    pub geometry: Geometry,
}

impl ShiftPlan {
    /// Launches the shift.
    ///
    /// # Safety
    /// As [`Core::launch`]; the plan's buffers passed [`Core::prepare`].
    pub unsafe fn launch(&self, core: &Core, stream: cuda::CUstream, checked: Option<usize>) -> Result<()> {
        core.records.note_num_slots(self.params.cache.num_slots());
        let shared = self.params.shared(self.geometry.block.0).bytes;
        // SAFETY: the caller's contract; `plan_shift` checked the rows, deltas, slots and
        // scales against their buffers, overlaps and alignment for the width.
        unsafe { core.launch(self.key, self.geometry, shared, &self.params, stream, checked) }
    }
}

/// The scaling stage: a shift is exact at fixed frequencies; `dynamic` and `longrope` change
/// theirs with the length (refused unless the caller says the keys share this `Rope`'s).
fn scaling_stage(config: &RopeConfig, args: &RawShiftArgs) -> Result<()> {
    match &config.scaling {
        s @ (RopeScaling::Dynamic { .. } | RopeScaling::LongRope { .. }) if !args.length_dependent => {
            Err(Error::ShiftScaling { rope_type: s.rope_type() })
        }
        _ => Ok(()),
    }
}

/// The cache stage's answer: the key cache (an MLA cache's `k_pe` rows), the names its errors
/// use, whether it is FP8, and its checked scales.
struct ShiftTarget {
    cache: RawKvCache,
    call: KvCall,
    fp8: bool,
    scales: Option<RawScales>,
}

/// The cache stage: the key cache of the configuration's head_dim, in its type or FP8, with its
/// scales (the value cache is not read).
fn cache_stage(config: &RopeConfig, args: &RawShiftArgs) -> Result<ShiftTarget> {
    let (cache, call) = match args.cache {
        ShiftCache::Kv(c) => (c, KvCall::APPEND),
        ShiftCache::Mla(c) => (
            c.kv_cache()?,
            KvCall {
                names: mla_name,
                need_scales: "an FP8 latent cache needs its scale (MlaCache::scale)",
                ..KvCall::APPEND
            },
        ),
    };
    let (k, what) = (cache.k, (call.names)(KvOperand::KCache));
    check_axis(what, "head_dim", config.head_dim, k.layout.shape[3])?;
    check_view(what, &k)?;
    check_written(what, &k.layout)?;
    let fp8 = k.dtype.fp8().is_some();
    if !fp8 && k.dtype != config.dtype {
        return Err(Error::DType { what, expected: config.dtype, got: k.dtype });
    }
    let scales = check_scales(&cache, fp8, k.layout.shape[2], &call)?;
    Ok(ShiftTarget { cache, call, fp8, scales })
}

/// The deltas stage: one i32 or i64 id per sequence, aligned; their number, the batch.
fn deltas_stage(d: &RawPositions) -> Result<usize> {
    if !matches!(d.kind, PositionKind::IdsI32 | PositionKind::IdsI64) {
        let expected = "one delta per sequence: Positions::ids_i32 or Positions::ids_i64";
        return Err(Error::PositionKind { expected, got: d.kind });
    }
    if d.ptr % d.kind.elem_size() as u64 != 0 {
        return Err(Error::Alignment { what: "deltas", address: d.ptr, align: d.kind.elem_size() });
    }
    Ok(d.len)
}

/// The rows stage: a paged cache's slots (`[batch, n]`), or a range of each block of a
/// contiguous or window cache (one delta a block): `(rows per sequence, first row, slots'
/// address)`.
fn rows_stage(cache: &RawKvCache, args: &RawShiftArgs, batch: usize) -> Result<(usize, usize, u64)> {
    let [blocks, block_size, ..] = cache.k.layout.shape;
    match (cache.paged, args.slots, args.rows) {
        (true, None, _) => Err(Error::SlotMapping("a paged cache's shift needs its slots (KvShift::slots)")),
        (true, Some(_), Some(_)) => {
            Err(Error::SlotMapping("a paged cache's rows are named by slots, not by a range (KvShift::rows)"))
        }
        (true, Some((ptr, n)), None) => {
            if ptr % 8 != 0 {
                return Err(Error::Alignment { what: "slots", address: ptr, align: 8 });
            }
            let seq = n.checked_div(batch).unwrap_or(0);
            if seq * batch != n {
                let shape = vec![batch, n.div_ceil(batch.max(1))];
                return Err(Error::Length { what: "slots", shape, expected: batch * seq.max(1), got: n });
            }
            Ok((seq, 0, ptr))
        }
        (false, Some(_), _) => {
            Err(Error::SlotMapping("a contiguous cache's rows are named by a range (KvShift::rows), not slots"))
        }
        (false, None, rows) => {
            let (start, end) = rows.unwrap_or((0, block_size));
            if end > block_size {
                return Err(Error::TooLarge { what: "rows (end)", value: end as u64, limit: block_size as u64 });
            }
            if start > end {
                return Err(Error::TooLarge { what: "rows (start)", value: start as u64, limit: end as u64 });
            }
            check_axis("deltas", "length (one per sequence of the cache)", blocks, batch)?;
            Ok((end - start, start, 0))
        }
    }
}

/// The apart stage: the key cache shares nothing with what the launch reads (the deltas, the
/// slots, the scales).
fn apart_stage(t: &ShiftTarget, args: &RawShiftArgs) -> Result<()> {
    let flat = |ptr, len: usize| RawTensor::new(ptr, len, DType::F32, Layout::bshd(1, 1, 1, len));
    let d = args.deltas;
    // (As f32 words: i64 deltas and slots are two each.)
    let words = if d.kind == PositionKind::IdsI64 { 2 } else { 1 };
    let mut read = vec![("deltas", flat(d.ptr, words * d.len))];
    if let Some((ptr, n)) = args.slots {
        read.push(("slots", flat(ptr, 2 * n)));
    }
    if let Some(s) = t.scales {
        read.push(((t.call.names)(KvOperand::KScales), scale_tensor(s.k)));
    }
    read.into_iter()
        .try_for_each(|(what, r)| check_disjoint(((t.call.names)(KvOperand::KCache), &t.cache.k), (what, &r)))
}

/// The width stage: 16 bytes a lane where the views allow (FP8: 8 codes), else element by
/// element; de-interleaved keys are NeoX-ordered. The key, against the support table, the
/// rotating lanes per head and the heads per thread ([`shift_heads_per_thread`]).
fn width_stage(config: &RopeConfig, args: &RawShiftArgs, t: &ShiftTarget) -> Result<(ShiftKey, usize, u32)> {
    let k = t.cache.k;
    let style = if args.deinterleaved { RopeStyle::NeoX } else { config.style };
    let size = if t.fp8 { 2 } else { k.dtype.size() };
    let vector = vector_fits(style, config.head_dim, config.rotary_dim, size, [&k]);
    let (rot_lanes, _) = lanes(vector, style, config.rotary_dim, 16 / size);
    let width = match (vector, t.fp8) {
        (false, _) => RopeWidth::Scalar,
        (true, false) => RopeWidth::Single,
        (true, true) => RopeWidth::Vector,
    };
    let key = ShiftKey { style, cache: k.dtype, width };
    let types = || Error::DType { what: "k cache", expected: config.dtype, got: k.dtype };
    check_supported(key, || key.variant(), types)?;
    Ok((key, rot_lanes, shift_heads_per_thread(vector, t.fp8)))
}

/// Checks `args` against `config` and works out the launch with `source` (computed, attention
/// factor 1) and `errors`; `None` when there is no work. The stages in order: scaling, cache,
/// deltas, rows, apart, the 32-bit limits, width.
pub(crate) fn plan_shift(
    config: &RopeConfig,
    args: &RawShiftArgs,
    source: SourceView,
    errors: ErrorSink,
) -> Result<Option<ShiftPlan>> {
    scaling_stage(config, args)?;
    let t = cache_stage(config, args)?;
    let batch = deltas_stage(&args.deltas)?;
    let (seq, first_row, mapping) = rows_stage(&t.cache, args, batch)?;
    apart_stage(&t, args)?;
    let k = t.cache.k;
    let [blocks, block_size, heads, _] = k.layout.shape;
    let rows = batch * seq;
    let num_slots = blocks.saturating_mul(block_size);
    check_u32(&[("rows", rows), ("kv heads", heads), ("cache slots (blocks * block_size)", num_slots)])?;
    if rows == 0 || heads == 0 {
        return Ok(None);
    }
    let (key, rot_lanes, group) = width_stage(config, args, &t)?;
    let work = groups(heads as u32, group) as u64 * rot_lanes as u64;
    let Some((geometry, chunk)) = flat_geometry(rows as u32, work)? else { return Ok(None) };
    let strides = k.layout.strides.map(|s| s as u64);
    let (blocks, size) = (blocks as u32, block_size as u32);
    let view = match t.cache.paged {
        true => CacheView::paged(k.address(), 0, strides, mapping, blocks, size),
        false => CacheView::contiguous(k.address(), 0, strides, blocks, size),
    };
    let params = ShiftParams {
        cache: view.with_types(k.dtype, k.dtype),
        scales: t.scales.map_or_else(ScalesView::default, |s| ScalesView::new(s.k.0, s.k.0, s.per_head)),
        pairs: pairs(config.rotary_dim, None),
        source,
        deltas: PositionsView::new(args.deltas.kind, args.deltas.ptr, 1 << 31),
        errors,
        rows: rows as u32,
        first_row: first_row as u32,
        chunk,
        items_div: FastDiv::new(work as u32),
        seq_div: FastDiv::new(seq as u32),
        lanes_div: FastDiv::new(rot_lanes as u32),
        heads: heads as u32,
    };
    debug_assert!(geometry.block.0 == BLOCK_THREADS);
    Ok(Some(ShiftPlan { key, params, geometry }))
}

/// Checks `args` against `config` exactly as [`Rope::shift_kv_raw`] does before it launches,
/// without a GPU: `Ok` means that call would launch (or, with no work, return at once).
///
/// ```
/// use rope_cuda::{validate_shift, DType, Error, Layout, PositionKind, RawKvCache, RawPositions, RawShiftArgs};
/// use rope_cuda::{RawTensor, RopeConfig, ShiftCache};
/// let config = RopeConfig::new(128, 4096).dtype(DType::BF16);
/// let t = |i: u64, layout: Layout| RawTensor::new(i << 30, layout.extent().unwrap(), DType::BF16, layout);
/// let cache = Layout::bshd(2048, 16, 8, 128); // 2048 pages of 16 slots, 8 kv heads
/// let deltas = RawPositions::new(PositionKind::IdsI32, 6 << 30, 4); // 4 sequences
/// let args = RawShiftArgs::new(ShiftCache::Kv(RawKvCache::paged(t(1, cache), t(2, cache))), deltas)
///     .with_slots((7 << 30, 4 * 8192)); // 8192 rows each
/// assert_eq!(validate_shift(&config, &args), Ok(()));
/// let ranged = args.with_rows(0..100);
/// assert!(matches!(validate_shift(&config, &ranged), Err(Error::SlotMapping(_))));
/// ```
pub fn validate_shift(config: &RopeConfig, args: &RawShiftArgs) -> Result<()> {
    config.validate()?;
    let source = detached_source(config.rotary_dim, TableSource::Computed);
    plan_shift(config, args, source, ErrorSink::default()).map(|_| ())
}

impl Rope {
    /// Rotates cached keys in place by a position delta per sequence ([`KvShift`]): the
    /// context shift of an engine that drops tokens and keeps going. A key stored for position
    /// `p` becomes the key for `p + Δ`: its pairs turned by `Δ`'s angles, computed exactly as
    /// the computed source computes a position's (whatever this `Rope`'s source), without the
    /// attention factor (YaRN's, LongRoPE's), which the key holds already. bf16 and f16 keys
    /// come within 1 ulp of the correctly rounded rotation of the stored key, f32 keys within
    /// `2e-7` of the row's largest value; FP8 codes are those of the f32 rotation of the
    /// decoded key (code times the head's scale), divided by the scale and encoded once, as
    /// the append encodes.
    ///
    /// `|Δ|` up to `2^31 - 1` ([`SHIFT_MAX_DELTA`]), whatever `max_position`; a sequence whose
    /// delta is outside that range keeps its rows and is reported by [`Rope::check_errors`] as
    /// [`Error::PositionOutOfRange`] (its sequence index as the token); a slot outside the cache
    /// skips its row and is reported; `-1` is skipped. A `Δ` of 0 leaves its rows bit for bit.
    /// `dynamic` and `longrope` configurations are refused ([`Error::ShiftScaling`]) unless the
    /// shift says [`KvShift::length_dependent`]. Multimodal (MRoPE) keys turn every pair by `Δ`
    /// (every stream moves).
    ///
    /// One launch, which allocates nothing and claims nothing: it may be recorded into a
    /// [`Graph`](crate::Graph) at any size, the deltas and slots read when it replays.
    ///
    /// ```
    /// # let Ok(_ctx) = cust::quick_init() else { return Ok(()) }; // no GPU: nothing to run
    /// # let kernels = rope_cuda::Kernels::load()?;
    /// # let stream = cust::stream::Stream::new(cust::stream::StreamFlags::NON_BLOCKING, None)?;
    /// use cust::memory::DeviceBuffer;
    /// use rope_cuda::{KvCache, KvShift, Layout, Positions, Rope, RopeConfig};
    /// let rope = Rope::new(&kernels, RopeConfig::new(64, 4096))?;
    /// // 2 sequences of 32 rows, 2 kv heads; the second's keys move 7 positions back.
    /// let n = 2 * 32 * 2 * 64;
    /// let (mut k, mut v) = (DeviceBuffer::from_slice(&vec![1.0f32; n])?, DeviceBuffer::from_slice(&vec![0.0f32; n])?);
    /// let deltas = DeviceBuffer::from_slice(&[0i32, -7])?;
    /// let mut cache = KvCache::contiguous(&mut k, &mut v, Layout::bshd(2, 32, 2, 64));
    /// rope.shift_kv(KvShift::new(&mut cache, Positions::ids_i32(&deltas)).rows(7..32), &stream)?;
    /// rope.check_errors(&stream)?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn shift_kv(&self, shift: KvShift<'_, '_>, stream: &impl Queue) -> Result<()> {
        let stream = stream.raw(self.kernels())?;
        // SAFETY: as in `Rope::apply`, for every buffer of the shift.
        on_stream(shift.holds(), stream, || unsafe { self.shift_kv_raw(&shift.raw(), stream) })
    }

    /// [`Rope::shift_kv`] on device addresses and a raw stream; an `Err` means nothing was
    /// launched.
    ///
    /// # Safety
    /// As [`Rope::append_kv_raw`], for every address of the shift.
    pub unsafe fn shift_kv_raw(&self, args: &RawShiftArgs, stream: cuda::CUstream) -> Result<()> {
        let source = self.table.shift_source().ok_or(Error::Scaling { field: "inv_freq", value: f64::INFINITY })?;
        let Some(plan) = plan_shift(&self.config, args, source, self.core.records.sink())? else { return Ok(()) };
        let c = &plan.params;
        let buffers = [
            ("k cache", c.cache.k()),
            ("deltas", args.deltas.ptr),
            ("slots", args.slots.map_or(0, |s| s.0)),
            ("k scales", c.scales.head(false, 0).0),
        ];
        self.core.prepare(&buffers, self.config.checked)?;
        let checked = self.config.checked.then_some(self.config.max_position);
        // SAFETY: the caller's contract; `plan_shift` checked the operands; `prepare` passed.
        unsafe { plan.launch(&self.core, stream, checked) }
    }
}

#[cfg(test)]
mod tests {
    //! The shift's planner without a GPU.

    use super::*;
    use crate::kv::RawScales;
    use crate::scaling::RopeScaling;
    use rope_cuda_kernels::entries::Key;

    const BASE: u64 = 1 << 30;

    fn tensor(i: u64, layout: Layout, dtype: DType) -> RawTensor {
        RawTensor::new(i * BASE, layout.extent().unwrap(), dtype, layout)
    }

    fn config() -> RopeConfig {
        RopeConfig::new(128, 4096).dtype(DType::BF16)
    }

    /// 4 sequences of 8192 rows in a paged cache of 2048 pages of 16 slots, 8 kv heads.
    fn paged(dtype: DType) -> RawShiftArgs {
        let l = Layout::bshd(2048, 16, 8, 128);
        let mut cache = RawKvCache::paged(tensor(1, l, dtype), tensor(2, l, dtype));
        if dtype.fp8().is_some() {
            cache = cache.scales(RawScales::per_head((5 * BASE, 8), (6 * BASE, 8)));
        }
        RawShiftArgs::new(ShiftCache::Kv(cache), RawPositions::new(PositionKind::IdsI32, 3 * BASE, 4))
            .with_slots((4 * BASE, 4 * 8192))
    }

    /// 2 sequences of a contiguous cache of 64 rows, rows 10..40.
    fn contiguous() -> RawShiftArgs {
        let l = Layout::bhsd(2, 8, 64, 128);
        let cache = RawKvCache::contiguous(tensor(1, l, DType::BF16), tensor(2, l, DType::BF16));
        RawShiftArgs::new(ShiftCache::Kv(cache), RawPositions::new(PositionKind::IdsI64, 3 * BASE, 2)).with_rows(10..40)
    }

    fn plan(config: &RopeConfig, args: &RawShiftArgs) -> Result<Option<ShiftPlan>> {
        plan_shift(config, args, detached_source(config.rotary_dim, TableSource::Computed), ErrorSink::default())
    }

    #[test]
    fn plans_rows_lanes_and_widths() {
        let p = plan(&config(), &paged(DType::BF16)).unwrap().unwrap();
        assert_eq!(p.key, ShiftKey { style: RopeStyle::NeoX, cache: DType::BF16, width: RopeWidth::Single });
        let s = p.params;
        assert_eq!((s.rows, s.first_row, s.seq_div.divisor, s.lanes_div.divisor), (4 * 8192, 0, 8192, 8));
        assert_eq!((s.items_div.divisor, s.cache.num_slots(), s.cache.mapping()), (64, 2048 * 16, 4 * BASE));
        assert_eq!(s.deltas.limit(), 1 << 31);
        // The block rows of as many sequences as a block may touch: at most 3 of 128 threads.
        assert_eq!(s.shared(BLOCK_THREADS).bytes, 3 * 16 * 64);
        let c = plan(&config(), &contiguous()).unwrap().unwrap().params;
        assert_eq!((c.rows, c.first_row, c.seq_div.divisor), (60, 10, 30));
        // FP8: 8 codes a lane, two heads a thread; GPT-J; an odd cache offset takes the
        // element kernel.
        let f = plan(&config(), &paged(DType::E4M3)).unwrap().unwrap();
        assert_eq!((f.key.width, f.params.lanes_div.divisor, f.params.items_div.divisor), (RopeWidth::Vector, 8, 32));
        let g = plan(&config().style(RopeStyle::GptJ), &paged(DType::BF16)).unwrap().unwrap();
        assert_eq!((g.key.style, g.params.lanes_div.divisor), (RopeStyle::GptJ, 8));
        let mut odd = paged(DType::BF16);
        let ShiftCache::Kv(mut cache) = odd.cache else { unreachable!() };
        cache.k.layout.offset = 1;
        cache.k.len += 1;
        odd.cache = ShiftCache::Kv(cache);
        let s = plan(&config(), &odd).unwrap().unwrap();
        assert_eq!((s.key.width, s.params.lanes_div.divisor), (RopeWidth::Scalar, 64));
        // No rows: nothing to launch.
        assert_eq!(plan(&config(), &contiguous().with_rows(5..5)).unwrap(), None);
    }

    /// Each bad input is refused with its own error.
    #[test]
    fn each_bad_input_has_its_own_error() {
        let err = |c: &RopeConfig, a: &RawShiftArgs| plan(c, a).expect_err("expected an error");
        let c = config();
        let dynamic = c.clone().scaling(RopeScaling::Dynamic { factor: 2.0, max_position_embeddings: 2048 });
        assert_eq!(err(&dynamic, &paged(DType::BF16)), Error::ShiftScaling { rope_type: "dynamic" });
        assert!(plan(&dynamic, &paged(DType::BF16).with_length_dependent(true)).unwrap().is_some());
        let mut a = paged(DType::BF16);
        a.deltas.kind = PositionKind::OffsetsI32;
        assert!(matches!(err(&c, &a), Error::PositionKind { .. }));
        a = paged(DType::BF16);
        a.deltas.ptr += 2;
        assert!(matches!(err(&c, &a), Error::Alignment { what: "deltas", .. }));
        a = paged(DType::BF16);
        a.slots = None;
        assert!(matches!(err(&c, &a), Error::SlotMapping(_)));
        assert!(matches!(err(&c, &paged(DType::BF16).with_rows(0..4)), Error::SlotMapping(_)));
        assert!(matches!(err(&c, &paged(DType::BF16).with_slots((4 * BASE, 4 * 8192 + 1))), Error::Length { .. }));
        assert!(matches!(err(&c, &paged(DType::BF16).with_slots((4 * BASE + 4, 8))), Error::Alignment { .. }));
        assert!(matches!(err(&c, &contiguous().with_slots((4 * BASE, 60))), Error::SlotMapping(_)));
        assert!(matches!(err(&c, &contiguous().with_rows(0..65)), Error::TooLarge { what: "rows (end)", .. }));
        let mut reversed = contiguous();
        reversed.rows = Some((9, 8));
        assert!(matches!(err(&c, &reversed), Error::TooLarge { what: "rows (start)", .. }));
        let mut three = contiguous();
        three.deltas.len = 3;
        assert!(matches!(err(&c, &three), Error::Shape { what: "deltas", .. }));
        assert!(matches!(err(&c.clone().dtype(DType::F16), &contiguous()), Error::DType { .. }));
        assert!(matches!(err(&RopeConfig::new(64, 4096).dtype(DType::BF16), &contiguous()), Error::Shape { .. }));
        // FP8 without scales, and scales on a bf16 cache.
        let mut f = paged(DType::E4M3);
        let ShiftCache::Kv(mut cache) = f.cache else { unreachable!() };
        cache.scales = None;
        f.cache = ShiftCache::Kv(cache);
        assert!(matches!(err(&c, &f), Error::Scales(_)));
        cache.k.dtype = DType::BF16;
        cache.scales = Some(RawScales::per_tensor((5 * BASE, 1), (6 * BASE, 1)));
        f.cache = ShiftCache::Kv(cache);
        assert!(matches!(err(&c, &f), Error::Scales(_)));
        // The key cache over the deltas.
        let mut over = paged(DType::BF16);
        over.deltas.ptr = BASE + 64;
        assert!(matches!(err(&c, &over), Error::Aliasing { .. }));
        // validate_shift says the same.
        assert_eq!(validate_shift(&c, &over), Err(err(&c, &over)));
        assert_eq!(validate_shift(&c, &paged(DType::BF16)), Ok(()));
    }

    /// Every key the planner makes has an entry point.
    #[test]
    fn every_planned_key_has_an_entry_point() {
        for style in [RopeStyle::NeoX, RopeStyle::GptJ] {
            for dtype in [DType::F32, DType::F16, DType::BF16, DType::E4M3, DType::E5M2] {
                let config = config().style(style).dtype(if dtype.fp8().is_some() { DType::BF16 } else { dtype });
                for rotary in [128, 96, 36] {
                    let config = config.clone().rotary_dim(rotary);
                    let p = plan(&config, &paged(dtype)).unwrap().unwrap();
                    assert!(p.key.entry_point().is_some(), "{:?}", p.key);
                }
            }
        }
    }
}
