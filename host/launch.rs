//! The launch core every operation goes through: the operand checks (bounds, alignment,
//! overlap, 32-bit limits, positions), the access width and lanes, the views handed to the
//! kernels, the geometry of the shared thread mapping, and the path from a planned launch to
//! the stream ([`Core`]: device checks, graph refusals, the launch, checked mode). An
//! operation's own file describes its arguments and its parameters in terms of these.

use std::sync::Arc;

use cust::sys as cuda;
use rope_cuda_kernels::entries::Key;
use rope_cuda_kernels::keys::{RopeStyle, TableSource};
use rope_cuda_kernels::params::gptj_lane;
use rope_cuda_kernels::support::{supported, Variant};
use rope_cuda_kernels::views::{
    CallerView, ComputedView, HeadsView, MropeBands, Pairs, PositionKind, PositionsView, SourceView, TableView,
};

use crate::driver;
use crate::error::{Error, Result};
use crate::kernels::{Geometry, Kernels};
use crate::layout::{disjoint, Layout};
use crate::records::Records;
use crate::tensor::{RawPositions, RawTensor};

use rope_cuda_kernels::tuning::BLOCK_THREADS;

/// The view lies inside its buffer, and its address is aligned to its elements.
pub(crate) fn check_view(what: &'static str, t: &RawTensor) -> Result<()> {
    let size = t.dtype.size();
    let extent = t.layout.extent().unwrap_or(usize::MAX);
    if extent > t.len {
        return Err(Error::OutOfBounds { what, extent, len: t.len });
    }
    if t.ptr % size as u64 != 0 {
        return Err(Error::Alignment { what, address: t.ptr, align: size });
    }
    Ok(())
}

/// A written view has no two elements at one address.
pub(crate) fn check_written(what: &'static str, l: &Layout) -> Result<()> {
    match l.is_non_overlapping() {
        true => Ok(()),
        false => Err(Error::Overlap { what, shape: l.shape, strides: l.strides }),
    }
}

/// Two views share no element (views of different element types: no byte).
pub(crate) fn check_disjoint(a: (&'static str, &RawTensor), b: (&'static str, &RawTensor)) -> Result<()> {
    let (sa, sb) = (a.1.dtype.size(), b.1.dtype.size());
    let ok = match sa == sb {
        true => disjoint((a.1.ptr, &a.1.layout), (b.1.ptr, &b.1.layout), sa),
        false => {
            let range = |t: &RawTensor, size: usize| match t.layout.extent() {
                _ if t.layout.is_empty() => None,
                Some(end) => Some((t.address() as u128, t.ptr as u128 + (end * size) as u128)),
                None => Some((t.address() as u128, u128::MAX)),
            };
            match (range(a.1, sa), range(b.1, sb)) {
                (Some((s0, e0)), Some((s1, e1))) => e0 <= s1 || e1 <= s0,
                _ => true,
            }
        }
    };
    match ok {
        true => Ok(()),
        false => Err(Error::Aliasing { a: a.0, b: b.0 }),
    }
}

/// Axis `axis` of `what` is `expected`.
pub(crate) fn check_axis(what: &'static str, axis: &'static str, expected: usize, got: usize) -> Result<()> {
    match expected == got {
        true => Ok(()),
        false => Err(Error::Shape { what, axis, expected, got }),
    }
}

/// Each quantity fits the kernels' 32-bit arithmetic.
pub(crate) fn check_u32(values: &[(&'static str, usize)]) -> Result<()> {
    for &(what, value) in values {
        if value > u32::MAX as usize {
            return Err(Error::TooLarge { what, value: value as u64, limit: u32::MAX as u64 });
        }
    }
    Ok(())
}

/// Checks `positions` for `batch` sequences of `seq` tokens (what can be checked without
/// reading them: the kind, which `mrope` decides, length, alignment, and for sequential
/// positions the range) and returns the kernels' view of them, admitting `0..limit`.
pub(crate) fn positions(
    positions: &RawPositions,
    batch: usize,
    seq: usize,
    limit: usize,
    mrope: bool,
) -> Result<PositionsView> {
    let kind = positions.kind;
    if kind == PositionKind::SequenceRows {
        let expected = "ids, offsets, sequential or streams (sequence rows are the caller's tables' own)";
        return Err(Error::PositionKind { expected, got: kind });
    }
    if kind.is_streams() != mrope {
        let expected = match mrope {
            true => "three position streams per token (StreamsI32 or StreamsI64, [3, batch * seq])",
            false => "one position per token (ids, offsets or sequential); streams are for MRoPE configurations",
        };
        return Err(Error::PositionKind { expected, got: kind });
    }
    match kind.buffer_len(batch, seq) {
        None if seq > limit => return Err(Error::MaxPosition { needed: seq, max_position: limit }),
        None => {}
        Some(n) if n != positions.len => {
            let shape = match kind {
                PositionKind::OffsetsI32 | PositionKind::OffsetsI64 => vec![batch],
                PositionKind::StreamsI32 | PositionKind::StreamsI64 => vec![3, batch, seq],
                _ => vec![batch, seq],
            };
            return Err(Error::Length { what: "positions", shape, expected: n, got: positions.len });
        }
        Some(_) if positions.ptr % kind.elem_size() as u64 != 0 => {
            return Err(Error::Alignment { what: "positions", address: positions.ptr, align: kind.elem_size() });
        }
        Some(_) => {}
    }
    let limit = u32::try_from(limit).map_err(|_| Error::TooLarge {
        what: "max_position",
        value: limit as u64,
        limit: u32::MAX as u64,
    })?;
    Ok(match mrope {
        // More tokens than u32 holds are refused by the caller's `check_u32` before a launch.
        true => PositionsView::streams(
            kind == PositionKind::StreamsI64,
            positions.ptr,
            limit,
            batch.saturating_mul(seq).min(u32::MAX as usize) as u32,
        ),
        false => PositionsView::new(kind, positions.ptr, limit),
    })
}

/// Whether 16-byte accesses fit: the style's pairs come in whole lanes (NeoX: 16 bytes of
/// each half; GPT-J: [`gptj_lane`]), head_dim is whole 16-byte vectors, and every view's
/// address and strides are multiples of 16 bytes.
pub(crate) fn vector_fits<'t>(
    style: RopeStyle,
    head_dim: usize,
    rotary_dim: usize,
    size: usize,
    views: impl IntoIterator<Item = &'t RawTensor>,
) -> bool {
    // `e` elements of the inputs' `size` per access: 16 bytes of the inputs; each view's
    // accesses are `e` of its own elements.
    let e = 16 / size;
    let pairs_ok = match style {
        RopeStyle::NeoX => (rotary_dim / 2) % e == 0,
        RopeStyle::GptJ => rotary_dim % gptj_lane(true, e) == 0,
    };
    let aligned =
        |t: &RawTensor| t.address() % (e * t.dtype.size()) as u64 == 0 && t.layout.strides.iter().all(|s| s % e == 0);
    pairs_ok && head_dim % e == 0 && views.into_iter().all(aligned)
}

/// `(rot_lanes, copy_width)`: rotating lanes per head and elements per copying lane, for
/// accesses of `e` elements (`vector`) or element by element.
pub(crate) fn lanes(vector: bool, style: RopeStyle, rotary_dim: usize, e: usize) -> (usize, usize) {
    match (vector, style) {
        (true, RopeStyle::NeoX) => (rotary_dim / 2 / e, e),
        (true, RopeStyle::GptJ) => (rotary_dim / gptj_lane(true, e), e),
        (false, _) => (rotary_dim / 2, 1),
    }
}

/// A source view without addresses, for planning a launch without a GPU (`validate`, tests).
pub(crate) fn detached_source(rotary_dim: usize, source: TableSource) -> SourceView {
    match source {
        TableSource::Table => SourceView::Table(TableView::new([0; 4])),
        TableSource::Computed => SourceView::Computed(ComputedView::new(0, 0, (rotary_dim / 2) as u32, 1.0)),
        TableSource::Caller => SourceView::Caller(CallerView::new(0, 0)),
    }
}

/// The pairs of a rotation of `rotary_dim` dims, split among MRoPE's streams by `bands`.
pub(crate) fn pairs(rotary_dim: usize, bands: Option<MropeBands>) -> Pairs {
    let pairs = Pairs::new((rotary_dim / 2) as u32);
    match bands {
        Some(b) => pairs.with_mrope(b),
        None => pairs,
    }
}

/// `source`, its angle table staged in shared memory where it is computed and `on`
/// ([`ComputedView::with_staged`]).
pub(crate) fn staged(source: SourceView, on: bool) -> SourceView {
    match source {
        SourceView::Computed(c) => SourceView::Computed(c.with_staged(on)),
        other => other,
    }
}

/// The kernels' view of `input` (and `output`, where the kernel writes through the view).
pub(crate) fn heads_view(input: &RawTensor, output: Option<&RawTensor>) -> HeadsView {
    HeadsView {
        input: input.address(),
        output: output.map_or(0, RawTensor::address),
        in_strides: input.layout.strides.map(|s| s as u64),
        out_strides: output.map_or([0; 3], |o| o.layout.strides.map(|s| s as u64)),
        heads: input.layout.heads() as u32,
        in_type: input.dtype,
        out_type: output.map_or(input.dtype, |o| o.dtype),
        _pad: 0,
    }
}

/// The geometry of [`work_item`](rope_cuda_kernels::params::work_item)'s mapping for
/// `tokens` tokens of `work` items each, and the tokens per grid row; `None` when there is no
/// work.
pub(crate) fn flat_geometry(tokens: u32, work: u64) -> Result<Option<(Geometry, u32)>> {
    block_geometry(tokens, work, BLOCK_THREADS)
}

/// [`flat_geometry`] in blocks of `block` threads (a whole-projection norm's: a multiple of
/// `work`, or `work` a multiple of them, so that each block starts at a token's first item).
pub(crate) fn block_geometry(tokens: u32, work: u64, block: u32) -> Result<Option<(Geometry, u32)>> {
    if work == 0 || tokens == 0 {
        return Ok(None);
    }
    // One grid row holds at most 2^31 thread indices, so the kernel's index math stays 32-bit.
    let row = 1u64 << 31;
    let too_large = |what, value, limit| Error::TooLarge { what, value, limit };
    if work > row {
        return Err(too_large("heads * lanes", work, row));
    }
    let chunk = (row / work).min(tokens as u64);
    let rows = (tokens as u64).div_ceil(chunk);
    if rows > 65_535 {
        return Err(too_large("grid rows (tokens * heads * lanes / 2^31)", rows, 65_535));
    }
    let blocks = (chunk * work).div_ceil(block as u64);
    Ok(Some((Geometry { grid: (blocks as u32, rows as u32), block: (block, 1) }, chunk as u32)))
}

/// What an operation object holds to launch: the kernels and its device records.
#[derive(Debug)]
pub(crate) struct Core {
    pub kernels: Arc<Kernels>,
    pub records: Records,
}

impl Core {
    /// The core of a new operation object on `kernels`, in the current context.
    pub fn new(kernels: &Arc<Kernels>) -> Result<Self> {
        Ok(Core { kernels: Arc::clone(kernels), records: Records::new()? })
    }

    /// What comes between a planned launch and the stream: every named buffer is memory of
    /// the kernels' device, and a checked call (`checked`) is not being recorded.
    pub fn prepare(&self, buffers: &[(&'static str, u64)], checked: bool) -> Result<()> {
        self.kernels.check_devices(buffers)?;
        match checked {
            // A checked call synchronises after the launch: while recording a graph nothing
            // has run, so it would report nothing (a capture fails anyway).
            true => crate::graph::not_while_recording("a call of a checked configuration"),
            false => Ok(()),
        }
    }

    /// Launches `key`; with `checked` (the positions' limit, for the report), then
    /// synchronises `stream` and reports the records.
    ///
    /// # Safety
    /// As [`Kernels::launch`]; [`Core::prepare`] passed for this launch's buffers.
    pub unsafe fn launch<K: Key>(
        &self,
        key: K,
        geometry: Geometry,
        shared_bytes: u32,
        params: &K::Params,
        stream: cuda::CUstream,
        checked: Option<usize>,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.kernels.launch(key, geometry, shared_bytes, params, stream) }?;
        if let Some(max_position) = checked {
            // SAFETY: `stream` is a live stream of the kernels' context.
            unsafe { driver::stream_synchronize(stream) }?;
            self.records.take(max_position)?;
        }
        Ok(())
    }

    /// Synchronises `stream` (a live stream of the kernels' context), then reports (and
    /// clears) what the records hold.
    pub fn check_errors_raw(&self, stream: cuda::CUstream, max_position: usize) -> Result<()> {
        crate::graph::not_while_recording("check_errors")?;
        // SAFETY: the callers pass a live stream of the kernels' context.
        unsafe { driver::stream_synchronize(stream) }?;
        self.records.take(max_position)
    }
}

/// Whether the kernel list has `key`'s entry point (the launch's one lookup); if not, why:
/// the support table's rule that refuses its `variant`, or `types()` where its operand types
/// mix in a way the table has no variant for.
pub(crate) fn check_supported<K: Key>(
    key: K,
    variant: impl FnOnce() -> Option<Variant>,
    types: impl FnOnce() -> Error,
) -> Result<()> {
    if key.entry_point().is_some() {
        return Ok(());
    }
    match variant() {
        // Supported yet listless: a bug of the generator, which the PTX tests would catch.
        Some(v) => Err(supported(&v).map_or_else(Error::from, |()| Error::NoKernel { key: format!("{key:?}") })),
        None => Err(types()),
    }
}
