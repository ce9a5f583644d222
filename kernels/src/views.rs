//! The contract between host and kernels: views of the buffers a launch reads and writes,
//! embedded in the parameter structs, with the methods that decode them.
//!
//! The host builds each view through its constructor (the fields are private, so an
//! invariant a constructor establishes holds wherever the view is read); the kernels decode
//! it through the methods below. Both sides compile this module, and the host's unit tests run
//! the same methods on host memory ([`crate::mem`] supplies host versions of the loads and
//! atomics), so the meaning of every field is tested where it is defined.

use crate::div::FastDiv;
use crate::keys::{DType, TableSource};
use crate::mem::{atomic_add_u64, atomic_max_u64, atomic_min_u64, load_i32, load_i64};

/// One tensor of rows, viewed as `[batch, seq, heads, head_dim]`.
///
/// Strides are in elements; `head_dim` is contiguous (stride 1). The output uses its own
/// strides, so out-of-place results may have a different layout from the input; in place
/// means `output == input` with equal strides.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HeadsView {
    /// Device address of element `[0, 0, 0, 0]` of the input.
    pub input: u64,
    /// Device address of element `[0, 0, 0, 0]` of the output (0 where the kernel has none).
    pub output: u64,
    /// Input strides, in elements, of the batch, seq and head axes.
    pub in_strides: [u64; 3],
    /// Output strides, in elements, of the batch, seq and head axes.
    pub out_strides: [u64; 3],
    /// Number of heads; 0 means the tensor is absent.
    pub heads: u32,
    /// The input's element type.
    pub in_type: DType,
    /// The output's element type (the input's where there is no output).
    pub out_type: DType,
    /// Keeps the layout free of implicit padding.
    pub _pad: u16,
}

impl HeadsView {
    /// Element offset of row `(b, s, h)` in the input.
    #[inline(always)]
    pub fn in_offset(&self, b: u64, s: u64, h: u64) -> u64 {
        b * self.in_strides[0] + s * self.in_strides[1] + h * self.in_strides[2]
    }

    /// Element offset of row `(b, s, h)` in the output.
    #[inline(always)]
    pub fn out_offset(&self, b: u64, s: u64, h: u64) -> u64 {
        b * self.out_strides[0] + s * self.out_strides[1] + h * self.out_strides[2]
    }
}

/// The pairs a launch rotates: `half` per head (half the rotary dimension), each at an entry
/// `pos * half + i` of its source's rows, and, with multimodal RoPE (MRoPE), which of a
/// token's three positions (temporal, height, width) each pair turns by
/// ([`Pairs::stream`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Pairs {
    half: u32,
    /// [`MropeBands`] as three words (without MRoPE: every pair in stream 0).
    bands: [u32; 3],
}

/// How the pairs of a row are split among MRoPE's three position streams.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MropeBands {
    /// Qwen2-VL: contiguous bands of `sections[0]`, `sections[1]` and `sections[2]` pairs
    /// take streams 0, 1 and 2.
    Contiguous([u32; 3]),
    /// Qwen3-VL: pairs cycle through the streams (pair `i` takes stream `i % 3`) while each
    /// stream's section lasts: stream 1 for `i % 3 == 1, i < 3 * sections[1]`, stream 2 for
    /// `i % 3 == 2, i < 3 * sections[2]`, stream 0 for every other pair.
    Interleaved([u32; 3]),
}

impl MropeBands {
    /// The stream (0, 1 or 2) of pair `i` (what the kernels compute, through [`Pairs::stream`]).
    pub fn stream(self, i: u32) -> u32 {
        Pairs::new(0).with_mrope(self).stream(i)
    }
}

impl Pairs {
    /// `half` pairs per head, every one in stream 0.
    pub const fn new(half: u32) -> Self {
        Pairs { half, bands: [u32::MAX, u32::MAX, 0] }
    }

    /// The same pairs, split among three position streams as `bands` says (read only by the
    /// MRoPE kernels).
    pub const fn with_mrope(mut self, bands: MropeBands) -> Self {
        // Words: the boundaries where stream 1 and stream 2 start (contiguous), or
        // `3 * sections[1]`, `3 * sections[2]` with the third word 1 (interleaved).
        self.bands = match bands {
            MropeBands::Contiguous([s0, s1, _]) => [s0, s0 + s1, 0],
            MropeBands::Interleaved([_, s1, s2]) => [3 * s1, 3 * s2, 1],
        };
        self
    }

    /// Pairs per head: half the rotary dimension.
    #[inline(always)]
    pub fn half(&self) -> u32 {
        self.half
    }

    /// The entry index (within each of a source's arrays) of pair `i` at position `pos`.
    #[inline(always)]
    pub fn entry(&self, pos: usize, i: usize) -> usize {
        pos * self.half as usize + i
    }

    /// Whether pairs `i..=j` (`i <= j`) all take one stream: in one contiguous band (the
    /// interleaved layout changes streams from pair to pair, so there only `i == j`).
    #[inline(always)]
    pub fn one_band(&self, i: u32, j: u32) -> bool {
        i == j || (self.bands[2] == 0 && self.stream(i) == self.stream(j))
    }

    /// The MRoPE stream (0, 1 or 2) of pair `i`, as [`MropeBands::stream`] of the bands given
    /// to [`Pairs::with_mrope`].
    #[inline(always)]
    pub fn stream(&self, i: u32) -> u32 {
        let [a, b, interleaved] = self.bands;
        if interleaved == 0 {
            (i >= a) as u32 + (i >= b) as u32
        } else {
            let r = i % 3;
            if (r == 1 && i < a) || (r == 2 && i < b) {
                r
            } else {
                0
            }
        }
    }
}

/// Where a launch's cos and sin come from: each source with its own view (the variant is the
/// kernel key's [`TableSource`]).
#[repr(C, u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SourceView {
    /// The library's table.
    Table(TableView),
    /// Computed in the kernel from the library's frequencies.
    Computed(ComputedView),
    /// The caller's tables (the reference operation).
    Caller(CallerView),
}

impl Default for SourceView {
    fn default() -> Self {
        SourceView::Table(TableView::default())
    }
}

impl SourceView {
    /// The library's table of a launch whose source it is.
    ///
    /// # Safety
    /// `self` is [`SourceView::Table`] (a kernel of that source is launched only with it).
    #[inline(always)]
    pub unsafe fn table_unchecked(&self) -> &TableView {
        match self {
            SourceView::Table(v) => v,
            // SAFETY: the caller's contract.
            _ => unsafe { core::hint::unreachable_unchecked() },
        }
    }

    /// The computed source of a launch whose source it is.
    ///
    /// # Safety
    /// `self` is [`SourceView::Computed`].
    #[inline(always)]
    pub unsafe fn computed_unchecked(&self) -> &ComputedView {
        match self {
            SourceView::Computed(v) => v,
            // SAFETY: the caller's contract.
            _ => unsafe { core::hint::unreachable_unchecked() },
        }
    }

    /// The caller's tables of a launch whose source they are.
    ///
    /// # Safety
    /// `self` is [`SourceView::Caller`].
    #[inline(always)]
    pub unsafe fn caller_unchecked(&self) -> &CallerView {
        match self {
            SourceView::Caller(v) => v,
            // SAFETY: the caller's contract.
            _ => unsafe { core::hint::unreachable_unchecked() },
        }
    }

    /// The computed source's view, if it is that one.
    pub fn computed(&self) -> Option<&ComputedView> {
        match self {
            SourceView::Computed(v) => Some(v),
            _ => None,
        }
    }

    /// The source, as the kernel keys name it.
    pub fn source(&self) -> TableSource {
        match self {
            SourceView::Table(_) => TableSource::Table,
            SourceView::Computed(_) => TableSource::Computed,
            SourceView::Caller(_) => TableSource::Caller,
        }
    }
}

/// The library's cos/sin table on the device: four f32 arrays of `[rows, half]` (the cosines,
/// the sines, and the residuals of each, `value_f64 - value`, rounded to f32), entries as
/// [`Pairs::entry`] says.
///
/// Which rows exist is the host's to guarantee: a launch's [`PositionsView`] admits only
/// positions below its limit, which the host makes at most the table's rows.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TableView {
    cos: u64,
    sin: u64,
    cos_lo: u64,
    sin_lo: u64,
}

impl TableView {
    /// The table at `[cos, sin, cos_lo, sin_lo]`.
    pub const fn new([cos, sin, cos_lo, sin_lo]: [u64; 4]) -> Self {
        TableView { cos, sin, cos_lo, sin_lo }
    }

    /// `[cos, sin, cos_lo, sin_lo]`.
    #[inline(always)]
    pub fn addresses(&self) -> [u64; 4] {
        [self.cos, self.sin, self.cos_lo, self.sin_lo]
    }
}

/// A caller's cos and sin tables, `[rows, half]` each in the element type of the kernel's
/// inputs, taken as exact (no residuals).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CallerView {
    cos: u64,
    sin: u64,
}

impl CallerView {
    /// The tables at `cos` and `sin`.
    pub const fn new(cos: u64, sin: u64) -> Self {
        CallerView { cos, sin }
    }

    /// `[cos, sin]`.
    #[inline(always)]
    pub fn addresses(&self) -> [u64; 2] {
        [self.cos, self.sin]
    }
}

/// [`ComputedView`]'s flags: the angle table is staged in shared memory.
const STAGED: u32 = 1;
/// [`ComputedView`]'s flags: the attention factor is 1.
const UNIT_ATTENTION: u32 = 2;

/// The library's source without a table: the frequencies, each 16 bytes (its
/// [`crate::math::Turns`] and a pad word), the angle table ([`crate::math::AngleEntry`] each,
/// [`crate::math::ANGLE_STEPS`] of them), and the attention factor both cos and sin are
/// multiplied by, as an f32 pair. Positions are limited by the launch's [`PositionsView`]
/// only.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ComputedView {
    freqs: u64,
    angles: u64,
    /// The attention factor's f32 pair, as bits.
    attention: [u32; 2],
    /// `ceil(2^31 / half)`, for [`ComputedView::pair_of`].
    recip: u32,
    flags: u32,
}

impl ComputedView {
    /// `half` frequencies at `freqs`, the angle table at `angles`, and the attention factor.
    pub fn new(freqs: u64, angles: u64, half: u32, attention: f64) -> Self {
        let hi = attention as f32;
        let lo = (attention - hi as f64) as f32;
        let recip = (1u64 << 31).div_ceil(half.max(1) as u64) as u32;
        let flags = if attention == 1.0 { UNIT_ATTENTION } else { 0 };
        ComputedView { freqs, angles, attention: [hi.to_bits(), lo.to_bits()], recip, flags }
    }

    /// The same source with the angle table copied into each block's shared memory before
    /// the block's cos and sin are computed (`on`): its loads then overlap the positions'
    /// instead of following them, for launches of few tokens, where that chain is the
    /// kernel's length (the host adds [`crate::params::ANGLE_BYTES`] of shared memory).
    pub fn with_staged(mut self, on: bool) -> Self {
        self.flags = if on { self.flags | STAGED } else { self.flags & !STAGED };
        self
    }

    /// Whether the angle table is staged in shared memory ([`ComputedView::with_staged`]).
    #[inline(always)]
    pub fn staged(&self) -> bool {
        self.flags & STAGED != 0
    }

    /// Whether the attention factor is exactly 1 (the computed cos and sin are then used as
    /// they are).
    #[inline(always)]
    pub fn unit_attention(&self) -> bool {
        self.flags & UNIT_ATTENTION != 0
    }

    /// `(k / half, k % half)` for `k * half < 2^31` (`half` the one this view was made for),
    /// by one multiply: with `m = ceil(2^31 / half) = (2^31 + e) / half`, `e < half`,
    /// `k * m / 2^31` exceeds `k / half` by `k * e / (half * 2^31) < 1 / half`, less than the
    /// distance from `k / half` to the next integer.
    #[inline(always)]
    pub fn pair_of(&self, k: u32, half: u32) -> (u32, u32) {
        let t = ((k as u64 * self.recip as u64) >> 31) as u32;
        (t, k - t * half)
    }

    /// The frequencies' address.
    #[inline(always)]
    pub fn freqs(&self) -> u64 {
        self.freqs
    }

    /// The angle table's address.
    #[inline(always)]
    pub fn angles(&self) -> u64 {
        self.angles
    }

    /// The attention factor as an f32 pair `(hi, lo)`.
    #[inline(always)]
    pub fn attention(&self) -> (f32, f32) {
        (f32::from_bits(self.attention[0]), f32::from_bits(self.attention[1]))
    }
}

/// How a launch finds each token's position; one naming for the typed and raw host APIs.
#[repr(u32)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum PositionKind {
    /// Token `s` of each sequence is at position `s`; no buffer.
    #[default]
    Sequential = 0,
    /// One i32 id per token, `[batch, seq]` row-major.
    IdsI32 = 1,
    /// One i64 id per token, `[batch, seq]` row-major.
    IdsI64 = 2,
    /// One i32 start per sequence: token `s` of sequence `b` is at `offsets[b] + s`.
    OffsetsI32 = 3,
    /// One i64 start per sequence.
    OffsetsI64 = 4,
    /// MRoPE: three i32 positions per token (temporal, height, width), `[3, batch * seq]`
    /// row-major: stream `k` of token `t` at `k * batch * seq + t`.
    StreamsI32 = 5,
    /// MRoPE: three i64 positions per token, as [`PositionKind::StreamsI32`].
    StreamsI64 = 6,
    /// Token `s` of sequence `b` at position `b * stride + s`, the view's stride (no buffer):
    /// a caller's tables with a block of rows per sequence (candle's `[b, t, d / 2]` cos and
    /// sin). Made by [`PositionsView::sequence_rows`] only.
    SequenceRows = 7,
}

impl PositionKind {
    /// Elements the buffer holds for `batch` sequences of `seq` tokens (`None`: no buffer).
    pub fn buffer_len(self, batch: usize, seq: usize) -> Option<usize> {
        match self {
            PositionKind::Sequential | PositionKind::SequenceRows => None,
            PositionKind::IdsI32 | PositionKind::IdsI64 => Some(batch.saturating_mul(seq)),
            PositionKind::OffsetsI32 | PositionKind::OffsetsI64 => Some(batch),
            PositionKind::StreamsI32 | PositionKind::StreamsI64 => Some(batch.saturating_mul(seq).saturating_mul(3)),
        }
    }

    /// Whether a token's position depends on its (batch, sequence index) rather than on the
    /// token index alone (offsets, sequential).
    #[inline(always)]
    pub fn by_sequence(self) -> bool {
        matches!(
            self,
            PositionKind::OffsetsI32 | PositionKind::OffsetsI64 | PositionKind::Sequential | PositionKind::SequenceRows
        )
    }

    /// Whether the kind holds three position streams per token (MRoPE).
    pub fn is_streams(self) -> bool {
        matches!(self, PositionKind::StreamsI32 | PositionKind::StreamsI64)
    }

    /// Bytes per element of the buffer (and its alignment); 0 without one.
    pub fn elem_size(self) -> usize {
        match self {
            PositionKind::Sequential | PositionKind::SequenceRows => 0,
            PositionKind::IdsI32 | PositionKind::OffsetsI32 | PositionKind::StreamsI32 => 4,
            PositionKind::IdsI64 | PositionKind::OffsetsI64 | PositionKind::StreamsI64 => 8,
        }
    }
}

/// The positions of a launch's tokens, and the range it accepts: a token at a position
/// outside `0..limit` is skipped and recorded.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PositionsView {
    ptr: u64,
    kind: PositionKind,
    limit: u32,
    /// Elements between streams ([`PositionKind::StreamsI32`], [`PositionKind::StreamsI64`]):
    /// the launch's tokens.
    stride: u32,
    _pad: u32,
}

impl PositionsView {
    /// Positions read as `kind` says from `ptr` (ignored for [`PositionKind::Sequential`]),
    /// valid in `0..limit`.
    pub const fn new(kind: PositionKind, ptr: u64, limit: u32) -> Self {
        let ptr = match kind {
            PositionKind::Sequential | PositionKind::SequenceRows => 0,
            _ => ptr,
        };
        PositionsView { ptr, kind, limit, stride: 0, _pad: 0 }
    }

    /// Three streams per token, `stride` elements apart (the launch's tokens): a
    /// [`PositionKind::StreamsI32`] or [`PositionKind::StreamsI64`] view.
    pub const fn streams(wide: bool, ptr: u64, limit: u32, stride: u32) -> Self {
        let kind = if wide { PositionKind::StreamsI64 } else { PositionKind::StreamsI32 };
        PositionsView { ptr, kind, limit, stride, _pad: 0 }
    }

    /// Token `s` of sequence `b` at position `b * stride + s`, valid in `0..limit`: a
    /// [`PositionKind::SequenceRows`] view.
    pub const fn sequence_rows(stride: u32, limit: u32) -> Self {
        PositionsView { ptr: 0, kind: PositionKind::SequenceRows, limit, stride, _pad: 0 }
    }

    /// How the positions are read.
    pub fn kind(&self) -> PositionKind {
        self.kind
    }

    /// Valid positions are `0..limit`.
    pub fn limit(&self) -> u32 {
        self.limit
    }

    /// The address read (0 for sequential positions).
    pub fn address(&self) -> u64 {
        self.ptr
    }

    /// Token `token`'s position (sequence `b`, index `s`), before the range check. With
    /// three streams: the first of them outside `0..limit` if any (so that the token is
    /// skipped and that value reported), else stream 0.
    ///
    /// # Safety
    /// The buffer holds the elements [`PositionKind::buffer_len`] names, and `token < batch *
    /// seq`, `b < batch`.
    #[inline(always)]
    pub unsafe fn load(&self, token: u32, b: u32, s: u32) -> i64 {
        // SAFETY: the caller's contract.
        unsafe {
            match self.kind.is_streams() {
                true => self.load_streams(token),
                false => self.load_one(token, b, s),
            }
        }
    }

    /// [`PositionsView::load`] of a view of one position per token (kernels that never take
    /// streams read only these kinds; a streams view reads as stream 0's ids).
    ///
    /// # Safety
    /// As [`PositionsView::load`].
    #[inline(always)]
    pub unsafe fn load_one(&self, token: u32, b: u32, s: u32) -> i64 {
        let (i32s, i64s) = (self.ptr as *const i32, self.ptr as *const i64);
        // SAFETY: the caller's contract: each index is within the buffer.
        unsafe {
            match self.kind {
                PositionKind::IdsI32 | PositionKind::StreamsI32 => load_i32(i32s.add(token as usize)) as i64,
                PositionKind::IdsI64 | PositionKind::StreamsI64 => load_i64(i64s.add(token as usize)),
                PositionKind::OffsetsI32 => load_i32(i32s.add(b as usize)) as i64 + s as i64,
                PositionKind::OffsetsI64 => load_i64(i64s.add(b as usize)).wrapping_add(s as i64),
                PositionKind::Sequential => s as i64,
                PositionKind::SequenceRows => b as i64 * self.stride as i64 + s as i64,
            }
        }
    }

    /// [`PositionsView::load`] of a streams view: the first stream out of range, else stream 0.
    ///
    /// # Safety
    /// As [`PositionsView::load`], for a streams view.
    #[inline(always)]
    pub unsafe fn load_streams(&self, token: u32) -> i64 {
        // SAFETY: the caller's contract.
        let [p0, p1, p2] = unsafe { self.streams_of(token) };
        if self.check(p0).is_none() {
            p0
        } else if self.check(p1).is_none() {
            p1
        } else if self.check(p2).is_none() {
            p2
        } else {
            p0
        }
    }

    /// Token `token`'s three positions (a streams view), before the range check.
    ///
    /// # Safety
    /// As [`PositionsView::load`], for a streams view.
    #[inline(always)]
    pub unsafe fn streams_of(&self, token: u32) -> [i64; 3] {
        let (t, n) = (token as usize, self.stride as usize);
        let (i32s, i64s) = (self.ptr as *const i32, self.ptr as *const i64);
        // SAFETY: the caller's contract: `[3, tokens]` elements, `token < tokens`.
        unsafe {
            if self.kind == PositionKind::StreamsI64 {
                [load_i64(i64s.add(t)), load_i64(i64s.add(t + n)), load_i64(i64s.add(t + 2 * n))]
            } else {
                [t, t + n, t + 2 * n].map(|i| load_i32(i32s.add(i)) as i64)
            }
        }
    }

    /// `pos` as a row index when it is in `0..limit`.
    #[inline(always)]
    pub fn check(&self, pos: i64) -> Option<u32> {
        (pos >= 0 && pos < self.limit as i64).then_some(pos as u32)
    }
}

/// One device-side record of offending tokens.
///
/// `key` is the minimum over offending tokens of `token << 32 | value as i32 as u32` (values
/// outside the i32 range saturate), `u64::MAX` when none; `count` counts offending tokens.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ErrorRecord {
    /// Packed first offending token and its value.
    pub key: u64,
    /// Number of offending tokens.
    pub count: u64,
}

impl ErrorRecord {
    /// The record with no error in it.
    pub const CLEAR: ErrorRecord = ErrorRecord { key: u64::MAX, count: 0 };

    /// Packs an offending token and its value into a `key`.
    #[inline(always)]
    pub fn key(token: u32, value: i64) -> u64 {
        let v = if value > i32::MAX as i64 {
            i32::MAX
        } else if value < i32::MIN as i64 {
            i32::MIN
        } else {
            value as i32
        };
        ((token as u64) << 32) | (v as u32 as u64)
    }

    /// The first offending token and its (saturated) value, if any.
    pub fn first(&self) -> Option<(u32, i64)> {
        (self.count > 0).then_some(((self.key >> 32) as u32, self.key as u32 as i32 as i64))
    }
}

/// The device-side error records of the launches of one `Rope` or reference update: tokens
/// skipped for their position, and tokens whose cache writes were skipped for their slot.
/// Reset by the host after it reads them.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ErrorRecords {
    /// Positions outside the launch's range.
    pub positions: ErrorRecord,
    /// Slots outside the cache (other than `-1`, padding).
    pub slots: ErrorRecord,
}

impl ErrorRecords {
    /// Both records clear.
    pub const CLEAR: ErrorRecords = ErrorRecords { positions: ErrorRecord::CLEAR, slots: ErrorRecord::CLEAR };
    /// The records as u64 words, in memory order (for hosts that move them as words).
    pub const WORDS: usize = 4;

    /// The records as they lie in memory.
    pub fn to_words(self) -> [u64; Self::WORDS] {
        [self.positions.key, self.positions.count, self.slots.key, self.slots.count]
    }

    /// The records from their words in memory.
    pub fn from_words(w: [u64; Self::WORDS]) -> Self {
        ErrorRecords {
            positions: ErrorRecord { key: w[0], count: w[1] },
            slots: ErrorRecord { key: w[2], count: w[3] },
        }
    }
}

/// Where a launch records offending tokens: the address of an [`ErrorRecords`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ErrorSink {
    records: u64,
}

impl ErrorSink {
    /// Records into the [`ErrorRecords`] at `records`.
    pub const fn new(records: u64) -> Self {
        ErrorSink { records }
    }

    /// The address of the records.
    pub fn address(&self) -> u64 {
        self.records
    }

    /// Records token `token`, skipped for its position `position`.
    ///
    /// # Safety
    /// The address holds an [`ErrorRecords`], only accessed atomically meanwhile.
    #[inline(always)]
    pub unsafe fn position(&self, token: u32, position: i64) {
        let r = self.records as *mut ErrorRecords;
        // SAFETY: the caller's contract.
        unsafe { record(&raw mut (*r).positions, token, position) }
    }

    /// Records token `token`, whose cache writes were skipped for its slot `slot`.
    ///
    /// # Safety
    /// As [`ErrorSink::position`].
    #[inline(always)]
    pub unsafe fn slot(&self, token: u32, slot: i64) {
        let r = self.records as *mut ErrorRecords;
        // SAFETY: the caller's contract.
        unsafe { record(&raw mut (*r).slots, token, slot) }
    }
}

/// # Safety
/// `r` points to an [`ErrorRecord`] only accessed atomically meanwhile.
#[inline(always)]
unsafe fn record(r: *mut ErrorRecord, token: u32, value: i64) {
    // SAFETY: the caller's contract; both fields are 8-byte aligned u64.
    unsafe {
        atomic_min_u64(&raw mut (*r).key, ErrorRecord::key(token, value));
        atomic_add_u64(&raw mut (*r).count, 1);
    }
}

/// How a KV cache maps tokens to rows.
#[repr(u32)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum CacheKind {
    /// Each sequence is a block: token of sequence `b` at position `p` goes to slot
    /// `b * block_size + p`.
    #[default]
    Contiguous = 0,
    /// Token `t` goes to slot `mapping[t]` (i64; `-1` is padding).
    Paged = 1,
    /// A sliding window: each sequence is a block of `block_size` rows, its first `sinks`
    /// positions at their own rows and the later ones in a ring over the rest, position `p` at
    /// row `sinks + (p - sinks) % (block_size - sinks)` (`mapping` holds `sinks`).
    Window = 2,
}

/// Where a token's keys and values go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotOf {
    /// Slot `n`, in `0..num_slots`.
    Slot(u64),
    /// `-1` in the slot mapping, or a contiguous row past the cache: nothing is written, and
    /// nothing reported.
    Skip,
    /// A slot mapping entry outside the cache: nothing is written, and it is reported.
    OutOfRange(i64),
}

/// A key cache and a value cache of one layout, `[blocks, block_size, heads, head_dim]` with
/// element strides (head_dim contiguous), and how tokens map to their slots: slot `n` is row
/// `(n / block_size, n % block_size)`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheView {
    k: u64,
    v: u64,
    strides: [u64; 3],
    mapping: u64,
    num_slots: u64,
    block_size: u32,
    kind: CacheKind,
    block_div: FastDiv,
    types: [DType; 2],
    _pad: [u8; 6],
}

impl CacheView {
    /// A contiguous cache of `blocks` sequences of `block_size` rows, at element addresses
    /// `k` and `v` (of row `(0, 0, 0)`).
    ///
    /// # Panics
    /// If `block_size` is 0 (the host checks it first).
    pub const fn contiguous(k: u64, v: u64, strides: [u64; 3], blocks: u32, block_size: u32) -> Self {
        Self::new(k, v, strides, 0, CacheKind::Contiguous, blocks, block_size)
    }

    /// A paged cache of `blocks` pages of `block_size` rows, with the i64 slot mapping at
    /// `mapping`.
    ///
    /// # Panics
    /// If `block_size` is 0.
    pub const fn paged(k: u64, v: u64, strides: [u64; 3], mapping: u64, blocks: u32, block_size: u32) -> Self {
        Self::new(k, v, strides, mapping, CacheKind::Paged, blocks, block_size)
    }

    /// A sliding-window cache of `blocks` sequences of `block_size` rows, the first `sinks` of
    /// them never overwritten ([`CacheKind::Window`]).
    ///
    /// # Panics
    /// If `block_size` is 0 (the host checks it, and `sinks < block_size`, first).
    pub const fn window(k: u64, v: u64, strides: [u64; 3], blocks: u32, block_size: u32, sinks: u32) -> Self {
        Self::new(k, v, strides, sinks as u64, CacheKind::Window, blocks, block_size)
    }

    const fn new(k: u64, v: u64, strides: [u64; 3], mapping: u64, kind: CacheKind, blocks: u32, size: u32) -> Self {
        let num_slots = blocks as u64 * size as u64;
        let block_div = FastDiv::new(size);
        CacheView {
            k,
            v,
            strides,
            mapping,
            num_slots,
            block_size: size,
            kind,
            block_div,
            types: [DType::F32; 2],
            _pad: [0; 6],
        }
    }

    /// The same caches, the key cache's elements of type `k` and the value cache's of `v`.
    pub const fn with_types(mut self, k: DType, v: DType) -> Self {
        self.types = [k, v];
        self
    }

    /// The element types of the key and value caches.
    #[inline(always)]
    pub fn types(&self) -> (DType, DType) {
        (self.types[0], self.types[1])
    }

    /// The element address of the key cache's row `(0, 0, 0)`.
    #[inline(always)]
    pub fn k(&self) -> u64 {
        self.k
    }

    /// The element address of the value cache's row `(0, 0, 0)`.
    #[inline(always)]
    pub fn v(&self) -> u64 {
        self.v
    }

    /// The element stride between heads of one row.
    #[inline(always)]
    pub fn head_stride(&self) -> u64 {
        self.strides[2]
    }

    /// Contiguous or paged.
    pub fn kind(&self) -> CacheKind {
        self.kind
    }

    /// Slots in the cache, `blocks * block_size`.
    pub fn num_slots(&self) -> u64 {
        self.num_slots
    }

    /// Rows per block.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// The address of the slot mapping (0 for contiguous caches; a window's `sinks`).
    pub fn mapping(&self) -> u64 {
        self.mapping
    }

    /// Token `t`'s raw slot mapping entry (0 for contiguous caches), to load before its
    /// position is known so that the two loads overlap.
    ///
    /// # Safety
    /// A paged cache's mapping holds an entry for token `t`.
    #[inline(always)]
    pub unsafe fn raw_slot(&self, t: u32) -> i64 {
        match self.kind {
            CacheKind::Contiguous | CacheKind::Window => 0,
            // SAFETY: the caller's contract.
            CacheKind::Paged => unsafe { load_i64((self.mapping as *const i64).add(t as usize)) },
        }
    }

    /// The slot of a token at valid position `pos` whose raw mapping entry is `raw`
    /// ([`CacheView::raw_slot`]); `seq` gives its sequence (called only for contiguous caches).
    #[inline(always)]
    pub fn slot(&self, seq: impl FnOnce() -> u32, pos: u32, raw: i64) -> SlotOf {
        match self.kind {
            CacheKind::Contiguous | CacheKind::Window => {
                // A contiguous cache is a window whose sinks fill the block: a row past it is
                // never written, whatever the positions' limit. A window's later positions
                // wrap in the ring after its sinks (the host keeps `sinks` below the block;
                // `max(1)`: no division by zero). One arm for both kinds: an arm of its own
                // for the window changed the contiguous kernels' registers (`_v_w` 128 -> 134).
                let window = self.kind == CacheKind::Window;
                let sinks = if window { self.mapping as u32 } else { self.block_size };
                let row = if pos < sinks {
                    pos
                } else if window {
                    sinks + (pos - sinks) % (self.block_size - sinks).max(1)
                } else {
                    return SlotOf::Skip;
                };
                SlotOf::Slot(seq() as u64 * self.block_size as u64 + row as u64)
            }
            CacheKind::Paged if raw >= 0 && (raw as u64) < self.num_slots => SlotOf::Slot(raw as u64),
            CacheKind::Paged if raw == -1 => SlotOf::Skip,
            CacheKind::Paged => SlotOf::OutOfRange(raw),
        }
    }

    /// The element offset (from [`CacheView::k`] or [`CacheView::v`]) of head `h` of slot
    /// `n`'s row.
    #[inline(always)]
    pub fn row(&self, n: u64, h: u64) -> u64 {
        let (block, within) = self.block_div.divmod(n as u32);
        block as u64 * self.strides[0] + within as u64 * self.strides[1] + h * self.strides[2]
    }
}

/// The scales of an append into FP8 caches (vLLM's and FlashInfer's): the code stored for a
/// value `x` of kv head `h` is that of `x / scale` (the f32 quotient, an IEEE division),
/// `scale` one f32 for every head or one per kv head, and likewise for q where it is written
/// to an FP8 buffer (one f32). Read from device memory at launch: an engine updates them in
/// place, and a replayed graph sees the new values. All zero for caches of other types.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ScalesView {
    k: u64,
    v: u64,
    q: u64,
    step: u32,
    _pad: u32,
}

impl ScalesView {
    /// The f32 scales of the key cache at `k` and of the value cache at `v`: one each, or
    /// (`per_head`) one per kv head each.
    pub const fn new(k: u64, v: u64, per_head: bool) -> Self {
        ScalesView { k, v, q: 0, step: per_head as u32, _pad: 0 }
    }

    /// The same, with q's one f32 scale at `q` (q written to an FP8 buffer).
    pub const fn with_q(mut self, q: u64) -> Self {
        self.q = q;
        self
    }

    /// The address of kv head `h`'s scale, of the key cache or (`value`) the value cache, and
    /// the f32 step to the next head's (0 with one scale for all).
    #[inline(always)]
    pub fn head(&self, value: bool, h: u64) -> (u64, u32) {
        let base = if value { self.v } else { self.k };
        (base + 4 * h * self.step as u64, self.step)
    }

    /// The address of q's scale (0: q is not written to an FP8 buffer).
    #[inline(always)]
    pub fn q(&self) -> u64 {
        self.q
    }

    /// Whether the keys and values have one scale per kv head.
    pub fn per_head(&self) -> bool {
        self.step == 1
    }
}

/// How a KV launch settles tokens that name the same slot (the last one writes).
#[repr(u32)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Duplicates {
    /// Each block compares its tokens' slots with the later tokens' in shared memory (calls of
    /// few tokens, in the scanning kernels).
    #[default]
    Scan = 0,
    /// A claim launch has written, per slot, the tag of the last token that writes it.
    Claimed = 1,
}

/// The owner array of the claimed path: one u64 per slot, `epoch << 32 | token` of the last
/// token of the call tagged `epoch` that writes the slot.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OwnerView {
    owners: u64,
    epoch: u32,
    mode: Duplicates,
}

impl OwnerView {
    /// No owner array: duplicates are scanned.
    pub const SCAN: OwnerView = OwnerView { owners: 0, epoch: 0, mode: Duplicates::Scan };

    /// Claims tagged `epoch` (never 0: a zeroed array then holds no claim) in the array at
    /// `owners`.
    pub const fn claimed(owners: u64, epoch: u32) -> Self {
        OwnerView { owners, epoch, mode: Duplicates::Claimed }
    }

    /// How duplicates are settled.
    #[inline(always)]
    pub fn mode(&self) -> Duplicates {
        self.mode
    }

    /// The tag of this call's claims.
    pub fn epoch(&self) -> u32 {
        self.epoch
    }

    /// The address of the owner array.
    pub fn address(&self) -> u64 {
        self.owners
    }

    /// Token `t`'s claim value.
    #[inline(always)]
    pub fn tag(&self, t: u32) -> u64 {
        (self.epoch as u64) << 32 | t as u64
    }

    /// Claims slot `n` for token `t` (the largest tag wins: the last token).
    ///
    /// # Safety
    /// The owner array holds slot `n`, and is only accessed atomically during the launch.
    #[inline(always)]
    pub unsafe fn claim(&self, n: u64, t: u32) {
        // SAFETY: the caller's contract.
        unsafe { atomic_max_u64((self.owners as *mut u64).add(n as usize), self.tag(t)) }
    }

    /// Whether token `t` holds slot `n`'s claim.
    ///
    /// # Safety
    /// The owner array holds slot `n`, written by an earlier launch and read-only now.
    #[inline(always)]
    pub unsafe fn owns(&self, n: u64, t: u32) -> bool {
        // SAFETY: the caller's contract.
        unsafe { load_i64((self.owners as *const i64).add(n as usize)) as u64 == self.tag(t) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pair_of_divides_exactly() {
        // Every half a rotary dim can have, every k the kernels step through (k * half < 2^31,
        // sampled densely near each multiple of half), and the flags beside the reciprocal.
        for half in 1..=4096u32 {
            for attention in [1.0, 0.5] {
                let v = ComputedView::new(0, 0, half, attention).with_staged(half % 2 == 0);
                assert_eq!(v.staged(), half % 2 == 0);
                assert_eq!(v.unit_attention(), attention == 1.0);
                let limit = (1u64 << 31) / half as u64;
                let check = |k: u32| assert_eq!(v.pair_of(k, half), (k / half, k % half), "half {half} k {k}");
                for k in (0..4096.min(limit as u32)).chain([(limit - 1) as u32]) {
                    check(k);
                }
                for m in [1u64, 2, 3, 1000, limit / half as u64].into_iter().filter(|&m| m * half as u64 + 1 < limit) {
                    let at = (m * half as u64) as u32;
                    check(at - 1);
                    check(at);
                    check(at + 1);
                }
            }
        }
    }

    #[test]
    fn positions_decode_each_kind_and_check_the_range() {
        let ids32 = [5i32, -1, 9, 3];
        let ids64 = [7i64, 1 << 40, 2, 0];
        let a32 = ids32.as_ptr() as u64;
        let a64 = ids64.as_ptr() as u64;
        // Token 2 is sequence 1, index 0 of sequences of 2 tokens.
        let cases = [
            (PositionKind::Sequential, 0, 0),
            (PositionKind::IdsI32, a32, 9),
            (PositionKind::IdsI64, a64, 2),
            (PositionKind::OffsetsI32, a32, -1),
            (PositionKind::OffsetsI64, a64, 1 << 40),
        ];
        for (kind, ptr, want) in cases {
            let v = PositionsView::new(kind, ptr, 8);
            // SAFETY: both arrays hold four entries; token 2 and sequence 1 are inside.
            assert_eq!(unsafe { v.load(2, 1, 0) }, want, "{kind:?}");
        }
        // SAFETY: as above; index 1 of sequence 1 (offsets add the index).
        assert_eq!(unsafe { PositionsView::new(PositionKind::OffsetsI32, a32, 8).load(3, 1, 1) }, 0);
        // Sequence rows: sequence 3's block of 5 rows, index 2; no buffer read.
        let rows = PositionsView::sequence_rows(5, 40);
        assert_eq!((rows.kind(), rows.address(), rows.limit()), (PositionKind::SequenceRows, 0, 40));
        // SAFETY: the kind reads no buffer.
        assert_eq!(unsafe { rows.load(17, 3, 2) }, 17);
        assert_eq!(PositionKind::SequenceRows.buffer_len(3, 5), None);
        let v = PositionsView::new(PositionKind::IdsI32, a32, 8);
        assert_eq!(
            (v.check(-1), v.check(0), v.check(7), v.check(8), v.check(1 << 40)),
            (None, Some(0), Some(7), None, None)
        );
        assert_eq!(PositionsView::new(PositionKind::Sequential, a32, 8).address(), 0, "no buffer is read");
        assert_eq!(PositionKind::OffsetsI64.buffer_len(3, 5), Some(3));
        assert_eq!(PositionKind::IdsI32.buffer_len(3, 5), Some(15));
        assert_eq!(PositionKind::Sequential.buffer_len(3, 5), None);
    }

    #[test]
    fn caches_map_tokens_to_slots_and_rows() {
        let strides = [1000, 100, 10];
        let c = CacheView::contiguous(0, 0, strides, 3, 16);
        assert_eq!(c.slot(|| 2, 5, 0), SlotOf::Slot(2 * 16 + 5));
        assert_eq!(c.slot(|| 2, 16, 0), SlotOf::Skip, "a row past the block is never written");
        assert_eq!(c.num_slots(), 48);
        // SAFETY: a contiguous cache reads no mapping.
        assert_eq!(unsafe { c.raw_slot(7) }, 0);
        let mapping = [3i64, -1, 47, 48, -2];
        let p = CacheView::paged(0, 0, strides, mapping.as_ptr() as u64, 3, 16);
        let slot = |t: u32| {
            // SAFETY: the mapping holds five entries.
            let raw = unsafe { p.raw_slot(t) };
            p.slot(|| unreachable!("paged caches ignore the sequence"), 0, raw)
        };
        assert_eq!(
            (slot(0), slot(1), slot(2), slot(3), slot(4)),
            (SlotOf::Slot(3), SlotOf::Skip, SlotOf::Slot(47), SlotOf::OutOfRange(48), SlotOf::OutOfRange(-2))
        );
        // Slot 35 is row 3 of block 2.
        assert_eq!(p.row(35, 4), 2 * 1000 + 3 * 100 + 4 * 10);
        // A window of 16 rows, 4 sinks: positions 0..4 at their rows, then a ring of 12.
        let w = CacheView::window(0, 0, strides, 3, 16, 4);
        let rows: [_; 7] = [0, 3, 4, 15, 16, 17, 4 + 12 * 1000 + 5].map(|pos| w.slot(|| 2, pos, 0));
        let want = [0, 3, 4, 15, 4, 5, 9].map(|row| SlotOf::Slot(2 * 16 + row));
        assert_eq!(rows, want);
        // SAFETY: a window reads no mapping.
        assert_eq!((w.kind(), w.mapping(), unsafe { w.raw_slot(7) }), (CacheKind::Window, 4, 0));
        // No sinks: a ring over the whole block.
        assert_eq!(CacheView::window(0, 0, strides, 3, 16, 0).slot(|| 1, 35, 0), SlotOf::Slot(16 + 3));
    }

    #[test]
    fn owners_keep_the_last_claim_of_the_call() {
        let mut owners = [0u64; 4];
        let o = OwnerView::claimed(owners.as_mut_ptr() as u64, 7);
        // SAFETY: slots 0..4 exist; only these calls touch the array.
        unsafe {
            o.claim(2, 5);
            o.claim(2, 9);
            o.claim(2, 6);
            assert!(o.owns(2, 9) && !o.owns(2, 6) && !o.owns(1, 0));
        }
        // A later call's tag supersedes every claim of an earlier one.
        let later = OwnerView::claimed(o.address(), 8);
        // SAFETY: as above.
        unsafe {
            later.claim(2, 0);
            assert!(later.owns(2, 0) && !o.owns(2, 9));
        }
        assert_eq!(OwnerView::SCAN.mode(), Duplicates::Scan);
        assert_eq!(o.mode(), Duplicates::Claimed);
    }

    #[test]
    fn tables_index_rows_of_pairs() {
        let pairs = Pairs::new(64);
        assert_eq!((pairs.entry(0, 5), pairs.entry(3, 5)), (5, 3 * 64 + 5));
        assert_eq!(TableView::new([1, 2, 3, 4]).addresses(), [1, 2, 3, 4]);
        assert_eq!(CallerView::new(1, 2).addresses(), [1, 2]);
        let sources = [
            SourceView::Table(TableView::new([1, 2, 3, 4])),
            SourceView::Computed(ComputedView::new(1, 2, 64, 1.0)),
            SourceView::Caller(CallerView::new(1, 2)),
        ];
        let got = sources.map(|s| s.source());
        assert_eq!(got, [TableSource::Table, TableSource::Computed, TableSource::Caller]);
    }

    /// Qwen2-VL's contiguous bands and Qwen3-VL's interleaved ones, pair by pair, as
    /// transformers lays them out: `cat([m[i % 3] for i, m in enumerate(split(sections))])`
    /// over the frequencies, and `freqs[..., k:3 * s_k:3]` taken from stream k for k = 1, 2.
    #[test]
    fn mrope_bands_give_each_pair_its_stream() {
        let contiguous = MropeBands::Contiguous([16, 24, 24]);
        let want: Vec<u32> = (0..64)
            .map(|i| {
                if i < 16 {
                    0
                } else if i < 40 {
                    1
                } else {
                    2
                }
            })
            .collect();
        assert_eq!((0..64).map(|i| contiguous.stream(i)).collect::<Vec<_>>(), want);
        let interleaved = MropeBands::Interleaved([24, 20, 20]);
        let mut want = [0u32; 64];
        for k in 1..3u32 {
            for i in (k as usize..60).step_by(3) {
                want[i] = k;
            }
        }
        assert_eq!((0..64).map(|i| interleaved.stream(i)).collect::<Vec<_>>(), want);
        let counts = |b: MropeBands| (0..3).map(|k| (0..64).filter(|&i| b.stream(i) == k).count()).collect::<Vec<_>>();
        assert_eq!(counts(contiguous), [16, 24, 24]);
        assert_eq!(counts(interleaved), [24, 20, 20]);
        // The plain table has no bands: every pair takes stream 0.
        assert!((0..64).all(|i| Pairs::new(64).stream(i) == 0));
        // One band: lanes inside a contiguous band, never across the interleaving.
        let (c, il) = (Pairs::new(64).with_mrope(contiguous), Pairs::new(64).with_mrope(interleaved));
        assert!(c.one_band(16, 23) && c.one_band(32, 39) && !c.one_band(12, 19) && !c.one_band(36, 43));
        assert!(!il.one_band(0, 3) && !il.one_band(60, 63) && il.one_band(5, 5));
    }

    #[test]
    fn position_streams_are_read_per_token_and_the_first_bad_one_reported() {
        // [3, 4]: token t's streams at t, 4 + t, 8 + t.
        let s32: [i32; 12] = [0, 1, 2, 3, 10, 11, 99, 13, 20, -5, 22, 23];
        let s64: Vec<i64> = s32.iter().map(|&v| v as i64).collect();
        for (wide, ptr) in [(false, s32.as_ptr() as u64), (true, s64.as_ptr() as u64)] {
            let v = PositionsView::streams(wide, ptr, 50, 4);
            assert!(v.kind().is_streams());
            // SAFETY: 12 elements: tokens 0..4 of three streams.
            unsafe {
                assert_eq!(v.streams_of(0), [0, 10, 20]);
                assert_eq!(v.streams_of(3), [3, 13, 23]);
                assert_eq!(v.load(0, 0, 0), 0, "in range: stream 0");
                assert_eq!(v.load(1, 0, 1), -5, "stream 2 out of range");
                assert_eq!(v.load(2, 0, 2), 99, "stream 1 out of range");
            }
        }
        assert_eq!(PositionKind::StreamsI64.buffer_len(2, 5), Some(30));
        assert_eq!((PositionKind::StreamsI32.elem_size(), PositionKind::StreamsI64.elem_size()), (4, 8));
    }
}
