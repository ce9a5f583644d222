//! Kernel parameter structs, shared bit-for-bit between host and device, and the thread
//! mapping both sides compute ([`work_item`]).
//!
//! Device pointers travel as `u64` (`CUdeviceptr`) inside the views of [`crate::views`], so
//! the structs are plain data on both sides. Every struct is passed by value as a kernel's
//! single parameter.

pub use crate::div::{Divisor, FastDiv};
use crate::keys::{KvTypes, RopeTypes};
use crate::norm::NormView;
use crate::views::{
    CacheView, ComputedView, ErrorSink, HeadsView, OwnerView, Pairs, PositionsView, ScalesView, SourceView,
};

/// Elements of one interleaved (GPT-J) lane for accesses of `e` elements (`vector`: one
/// vector instruction each): two vectors, so that a thread moves as many bytes of a head as a
/// NeoX lane (one 16-byte vector of each half); element by element, one pair (`e` = 2). Host
/// (the lanes it plans) and device (what a lane loads) both read it.
pub const fn gptj_lane(vector: bool, e: usize) -> usize {
    if vector {
        2 * e
    } else {
        e
    }
}

pub use crate::tuning::{heads_per_thread, kv_heads_per_thread, shift_heads_per_thread};

/// The threads a head group of `lanes` lanes takes in the thread mapping: `lanes` rounded up
/// to a power of two up to 32 lanes (so that a group starting at a multiple of its slots
/// stays inside one warp), to whole warps past that. The slots past `lanes` idle.
#[inline(always)]
pub const fn lane_slots(lanes: u64) -> u64 {
    if lanes <= 32 {
        lanes.next_power_of_two()
    } else {
        (lanes + 31) & !31
    }
}

/// `x` rounded up to where a group of `slots` slots ([`lane_slots`]) may start: a multiple of
/// `slots` up to 32, of 32 past that.
#[inline(always)]
pub const fn warp_align(x: u64, slots: u64) -> u64 {
    let a = if slots < 32 { slots } else { 32 };
    (x + a - 1) & !(a - 1)
}

/// The KV mapping's items per token for `gq` query and `gk` key/value head groups of
/// `[rot, k, v]` lanes: the q groups, then the k groups from a start each keeps inside one
/// warp ([`warp_align`]), then the v groups likewise, the total rounded so that every token
/// starts aligned for each: `(k_start, v_start, items)`.
#[inline(always)]
pub const fn kv_segments(gq: u64, gk: u64, [rot, k, v]: [u64; 3]) -> (u64, u64, u64) {
    let (sq, sk, sv) = (lane_slots(rot), lane_slots(k), lane_slots(v));
    let k_start = warp_align(gq * sq, sk);
    let v_start = warp_align(k_start + gk * sk, sv);
    let widest = if sq > sk { sq } else { sk };
    let widest = if widest > sv { widest } else { sv };
    (k_start, v_start, warp_align(v_start + gk * sv, widest))
}

/// The (token, work item) of thread `thread` of block `(block_x, block_y)` of `block_dim`
/// threads, for `work` items per token and `chunk` tokens per grid row; `None` past the end.
/// Host and device share it: the host's tests check that a launch covers each pair once.
#[inline(always)]
pub fn work_item(
    (block_x, block_y): (u32, u32),
    block_dim: u32,
    thread: u32,
    work: impl Divisor,
    chunk: u32,
    tokens: u32,
) -> Option<(u32, u32)> {
    // Below 2^32: the host keeps `chunk * work` at most 2^31 and the grid row within a block of it.
    let i = block_x * block_dim + thread;
    let (local, w) = work.divmod(i);
    let token = block_y as u64 * chunk as u64 + local as u64;
    (local < chunk && token < tokens as u64).then_some((token as u32, w))
}

/// The tokens of block `(block_x, block_y)` of `block_dim` threads under [`work_item`]'s
/// mapping: `(first, count)`, `count` 0 for a block without work. At most
/// [`block_tokens_max`]`(work, block_dim)` tokens.
#[inline(always)]
pub fn block_tokens(
    (block_x, block_y): (u32, u32),
    block_dim: u32,
    work: impl Divisor,
    chunk: u32,
    tokens: u32,
) -> (u32, u32) {
    let start = block_x * block_dim;
    let lo = work.divmod(start).0;
    let hi = work.divmod(start + block_dim - 1).0.min(chunk.saturating_sub(1));
    let row = block_y as u64 * chunk as u64;
    let (first, last) = (row + lo as u64, (row + hi as u64).min((tokens as u64).saturating_sub(1)));
    match lo >= chunk || first > last || tokens == 0 {
        true => (0, 0),
        false => (first as u32, (last - first + 1) as u32),
    }
}

/// The most tokens one block of `block_dim` threads touches under [`work_item`]'s mapping
/// with `work` items per token: a block's thread indices span `block_dim - 1`, so its first
/// and last tokens differ by at most `ceil((block_dim - 1) / work)`.
pub const fn block_tokens_max(work: u32, block_dim: u32) -> u32 {
    (block_dim - 1).div_ceil(work) + 1
}

/// Shared memory for the cos and sin the library's kernels compute once per token and pair
/// for their block (the block rows of `rotate.rs`): per token, `4 * row_stride(half)` f32
/// (cos, sin, and the residuals of each).
pub const fn block_rows_bytes(work: u32, block_dim: u32, tokens: u32, half: u32) -> u32 {
    let t = block_tokens_max(work, block_dim);
    let t = if t < tokens { t } else { tokens };
    t * 16 * row_stride(half)
}

/// Shared memory for the angle table when a launch stages it
/// ([`crate::views::ComputedView::with_staged`]), after the block rows.
pub const ANGLE_BYTES: u32 = 16 * crate::math::ANGLE_STEPS as u32;

/// A launch's dynamic shared memory, as byte offsets from its start: the scan's arrays of the
/// scanning KV kernels first, then, for computed cos and sin, the block's rows
/// ([`block_rows_bytes`]) and the staged angle table ([`ANGLE_BYTES`], when staged). Host
/// (the launch's size) and kernels (where each part is) take it from the same function of
/// the parameters ([`RopeParams::shared`], [`KvParams::shared`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SharedLayout {
    /// Where the block rows start.
    pub rows: u32,
    /// Where the staged angle table starts.
    pub angles: u32,
    /// The launch's dynamic shared memory (but a whole-projection norm's head sums, after it:
    /// [`SharedLayout::with_norm_sums`]).
    pub bytes: u32,
}

impl SharedLayout {
    /// `scan` bytes of scan arrays (0 without), then, with computed cos and sin (`computed`),
    /// the rows of `work` items per token for `tokens` tokens and `half` pairs, then the
    /// staged angle table.
    #[inline(always)]
    fn new(scan: u32, computed: Option<&ComputedView>, work: u32, block_dim: u32, tokens: u32, half: u32) -> Self {
        let rows = scan.next_multiple_of(16);
        match computed {
            Some(c) => {
                let angles = rows + block_rows_bytes(work, block_dim, tokens, half);
                let bytes = angles + if c.staged() { ANGLE_BYTES } else { 0 };
                SharedLayout { rows, angles, bytes }
            }
            None => SharedLayout { rows, angles: rows, bytes: rows },
        }
    }

    /// The launch's dynamic shared memory with, for a whole-projection norm (`whole`,
    /// [`crate::norm::NormView::whole`]), its head sums after the rest (at `bytes`, 16-byte
    /// aligned): one f32 per thread of blocks of `block_dim`.
    #[inline(always)]
    pub fn with_norm_sums(self, whole: bool, block_dim: u32) -> u32 {
        self.bytes + if whole { 4 * block_dim } else { 0 }
    }
}

/// The f32 per cos (and per sin) row of the block rows: `half` rounded up to 4, so that each
/// row stays 16-byte aligned.
#[inline(always)]
pub const fn row_stride(half: u32) -> u32 {
    (half + 3) & !3
}

/// Number of head groups of `heads` heads taken `g` at a time.
#[inline(always)]
pub fn groups(heads: u32, g: u32) -> u32 {
    heads.div_ceil(g)
}

/// Parameters of the RoPE kernels (`rope_…`: which exist is [`crate::support`]'s table; with a
/// QK-norm, each head of q and k, or each token's whole q and k projections, normalized first,
/// [`NormView`], in place too, the dims past `rotary_dim` then taken by copying lanes).
///
/// Thread mapping ([`work_item`]): one-dimensional blocks walk the (token, work item) pairs in
/// order, `work = (q_groups + k_groups) * lanes` items per token, `chunk` tokens per row of
/// the grid (`blockIdx.y`), so that indices stay 32-bit; token `t` is batch `t / seq`,
/// sequence index `t % seq`. `lanes = rot_lanes + copy_lanes`, and the heads of q, then of k,
/// are taken in groups of `G` ([`heads_per_thread`]): item `w` is group `w / slots`, lane
/// `w % slots` ([`RopeParams::group_slots`]: `lanes`, or for the `_n` and `_w` kernels [`lane_slots`]
/// of them, the slots past `lanes` idle). With a power of two of lanes up to 32 (head dims 64, 128, 256) each group
/// lies inside one warp; others may straddle two (the KV kernels' mapping, [`kv_segments`],
/// keeps every group in one warp; measured on RoPE's own, it cost 1 to 1.7 points of copy
/// bandwidth on the bf16 rows). A thread loads its lane's table entries once and applies them to each head of
/// its group. A rotating lane turns `E` elements (`E / 2` pairs in GPT-J style, `E` pairs in
/// NeoX style, whose lane reads `E` elements from each half), `E` being the kernel's access
/// width (16 bytes in the `_v` and `_p` kernels, 1 element (NeoX) or one pair (GPT-J) in the
/// `_s` kernels). A copying lane (out of place with `rotary_dim < head_dim`) copies the bits
/// of the dims past `rotary_dim`. A token whose position the [`PositionsView`] rejects is
/// skipped and recorded in `errors`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RopeParams {
    /// The queries.
    pub q: HeadsView,
    /// The keys (`heads == 0`: none).
    pub k: HeadsView,
    /// The pairs rotated.
    pub pairs: Pairs,
    /// Where cos and sin come from (the library's table or computed).
    pub source: SourceView,
    /// The tokens' positions and their valid range (at most the table's rows).
    pub positions: PositionsView,
    /// Where skipped tokens are recorded.
    pub errors: ErrorSink,
    /// Number of tokens, `batch * seq`.
    pub tokens: u32,
    /// Sequence length.
    pub seq: u32,
    /// Rotating lanes per head.
    pub rot_lanes: u32,
    /// Copying lanes per head (0 in place).
    pub copy_lanes: u32,
    /// `1.0` to rotate by +theta, `-1.0` for the inverse rotation.
    pub sin_sign: f32,
    /// Tokens per row of the grid (see [`work_item`]).
    pub chunk: u32,
    /// Items a head group takes in the mapping: 0 for `rot_lanes + copy_lanes` (no idle
    /// slots); the QK-norm kernels (`_n`, `_w`) take [`lane_slots`] of them, so that each group lies
    /// inside one warp (its lanes sum their squares with the warp's shuffles).
    pub slots: u32,
    /// The QK-norm of the `_n` and `_w` kernels (ignored by the others).
    pub norm: NormView,
    /// The `_n` and `_w` kernels' first group of k among a token's items: q's groups, or, for
    /// a whole-projection norm (`_w`) whose q and k would straddle a block's end, the next block's
    /// first (the groups between idle). 0 for the others.
    pub k_group: u32,
    /// The `_n` and `_w` kernels' items per token: `(k_group + k_groups) * slots`, or for a
    /// whole-projection norm in blocks of fewer threads, that rounded up to the block (the
    /// items past the last group idle). 0 for the others.
    pub items: u32,
}

/// Parameters of the KV-cache kernels (`kv_…`: which exist is [`crate::support`]'s table; with
/// a QK-norm, q's lanes include the copying ones, as k's, [`NormView`]) and of `kv_claim`.
///
/// One launch per step: token `t` (batch `t / seq`) has its position (from `positions`) and
/// a cache slot ([`CacheView::slot`]). The work items of a token (see [`work_item`] and
/// [`kv_segments`]) are, in order: q's head groups of `rot_lanes` (q rotated in place), k's
/// head groups of `k_lanes` (rotated from `k` into the key cache; the lanes past `rot_lanes`
/// copy the dims past `rotary_dim`), and v's head groups (as many heads as k) of `v_lanes`
/// (copied into the value cache); each group takes [`lane_slots`] of its lanes and starts
/// where it stays inside one warp, the slots between idle.
///
/// A position the [`PositionsView`] rejects skips the whole token (recorded); a slot outside
/// the cache other than `-1` skips the cache writes (recorded). When several tokens target
/// one slot, the last one writes: with [`Duplicates::Scan`](crate::views::Duplicates) each
/// block loads every token's position and slot into shared memory and compares its own
/// tokens' slots with the later ones' (the scanning kernels, launched with
/// [`KvParams::shared`] of dynamic shared memory); with `Claimed`, `kv_claim` has
/// stored each slot's last token in the owner array, and a token writes only if it finds
/// itself there.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct KvParams {
    /// The queries, rotated in place (`heads == 0`: none), or, with FP8 caches and a nonzero
    /// `output`, into an FP8 buffer of the caches' format (`out_type`).
    pub q: HeadsView,
    /// The new keys (`input`; `output` unused).
    pub k: HeadsView,
    /// The new values (`input`; `output` unused), as many heads as `k`.
    pub v: HeadsView,
    /// The caches and the slot mapping.
    pub cache: CacheView,
    /// FP8 caches: the scales of k and v (and of q, written to an FP8 buffer: `q.output`).
    pub scales: ScalesView,
    /// How duplicate slots are settled.
    pub owners: OwnerView,
    /// The pairs rotated.
    pub pairs: Pairs,
    /// Where cos and sin come from (the library's table, computed, or the caller's tables).
    pub source: SourceView,
    /// The RMS norm of q's and k's heads before the rotation (the `_n` and `_w` kernels; unread by
    /// the others).
    pub norm: NormView,
    /// The tokens' positions and their valid range.
    pub positions: PositionsView,
    /// Where skipped tokens are recorded.
    pub errors: ErrorSink,
    /// Number of tokens, `batch * seq`.
    pub tokens: u32,
    /// New tokens per sequence.
    pub seq: u32,
    /// Rotating lanes per head.
    pub rot_lanes: u32,
    /// Lanes per key head: `rot_lanes` plus the copying lanes past `rotary_dim`.
    pub k_lanes: u32,
    /// Lanes per value head.
    pub v_lanes: u32,
    /// Tokens per grid row (see [`work_item`]).
    pub chunk: u32,
    /// Division by the work items per token.
    pub items_div: FastDiv,
    /// Division by `seq`.
    pub seq_div: FastDiv,
    /// Division by the slots ([`lane_slots`]) of `rot_lanes`, `k_lanes` and `v_lanes`.
    pub lanes_div: [FastDiv; 3],
    /// Where the k and the v groups start among a token's items ([`kv_segments`]).
    pub starts: [u32; 2],
}

/// Parameters of the KV shift (`shift_…`): the cached keys of the named rows rotated in place
/// by their sequence's position delta `Δ` (cos and sin of `|Δ| x inv_freq` computed, the
/// attention factor left out, the sine negated for a negative `Δ`). Row `r = b * seq + s` is
/// slot `slots[r]` of a paged cache (`-1`: skipped; outside the cache: skipped and recorded),
/// or row `first_row + s` of sequence `b` of a contiguous one. A `Δ` of 0 leaves its rows as
/// they are; one outside `-(2^31 - 1)..=2^31 - 1` too, and its sequence is recorded (as a
/// position, the sequence index as the token).
///
/// Thread mapping ([`work_item`]): one thread per (row, group of `G` heads, rotating lane),
/// `groups(heads, G) * rot_lanes` items per row, `chunk` rows per grid row, `G` the kernel's
/// [`shift_heads_per_thread`] (the last group of a row may hold fewer); the block's prologue
/// computes each of its sequences' cos and sin once (the block rows of the computed source,
/// the deltas as positions), and a thread's heads share its entries.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ShiftParams {
    /// The key cache (the value cache's address 0: never touched), paged by the slots, or
    /// contiguous.
    pub cache: CacheView,
    /// The key cache's scales (FP8).
    pub scales: ScalesView,
    /// The pairs rotated.
    pub pairs: Pairs,
    /// The computed source, its attention factor 1.
    pub source: SourceView,
    /// One delta per sequence (i32 or i64 ids), admitted below `2^31` in absolute value.
    pub deltas: PositionsView,
    /// Where bad slots and deltas are recorded.
    pub errors: ErrorSink,
    /// Rows shifted, `batch * seq`.
    pub rows: u32,
    /// A contiguous cache's first row shifted in each sequence.
    pub first_row: u32,
    /// Rows per grid row (see [`work_item`]).
    pub chunk: u32,
    /// Division by the items per row, `heads * rot_lanes`.
    pub items_div: FastDiv,
    /// Division by `seq`, the rows per sequence.
    pub seq_div: FastDiv,
    /// Division by `rot_lanes`.
    pub lanes_div: FastDiv,
    /// The cache's kv heads.
    pub heads: u32,
}

impl ShiftParams {
    /// The dynamic shared memory of a launch with blocks of `block_threads`: the block rows
    /// of as many sequences as a block may touch.
    pub fn shared(&self, block_threads: u32) -> SharedLayout {
        let half = self.pairs.half();
        SharedLayout::new(0, self.source.computed(), self.items_div.divisor, block_threads, self.rows, half)
    }
}

/// Parameters of `kv_read_{f32,f16,bf16}`: rows of FP8 caches read back. Row `r` of the
/// outputs (`[batch, seq, heads, head_dim]` views, `r = b * seq + s`) is slot `slots[r]`'s row
/// of the key cache (into `k`) and of the value cache (into `v`; an output without `output`
/// is not read): each code's value times its kv head's scale, an f32 product rounded to the
/// output's type. Slot `-1` leaves its row as it is; a slot outside the cache is skipped and
/// recorded.
///
/// Thread mapping ([`work_item`]): one thread per element, `2 * heads * head_dim` items per
/// row (the key cache's, then the value cache's).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ReadParams {
    /// The caches, paged by the slots read (the slot mapping is the slots).
    pub cache: CacheView,
    /// The caches' scales.
    pub scales: ScalesView,
    /// The key rows' output (`output`, `out_strides`, `out_type`; `heads`: the kv heads).
    pub k: HeadsView,
    /// The value rows' output.
    pub v: HeadsView,
    /// Where slots outside the cache are recorded.
    pub errors: ErrorSink,
    /// Rows read.
    pub rows: u32,
    /// Rows per grid row (see [`work_item`]).
    pub chunk: u32,
    /// Division by the items per row, `2 * heads * head_dim`.
    pub items_div: FastDiv,
    /// Division by `heads * head_dim`.
    pub cache_div: FastDiv,
    /// Division by `head_dim`.
    pub dim_div: FastDiv,
    /// Division by the outputs' `seq`.
    pub seq_div: FastDiv,
}

impl KvParams {
    /// The element types of the operands, as the views hold them (an absent q takes k's).
    pub fn types(&self) -> KvTypes {
        let q = if self.q.heads == 0 { self.k.in_type } else { self.q.in_type };
        let (cache_k, cache_v) = self.cache.types();
        KvTypes { q, k: self.k.in_type, v: self.v.in_type, cache_k, cache_v }
    }

    /// Shared memory the scan of a scanning kernel needs with blocks of `block_threads`: each
    /// token's position and slot (8 bytes each), and a flag for each token of the block (at
    /// most `block_threads`).
    pub fn scan_bytes(&self, block_threads: u32) -> u32 {
        16 * self.tokens + 4 * block_threads
    }

    /// The dynamic shared memory of a launch with blocks of `block_threads` ([`SharedLayout`]):
    /// the scan's arrays when it scans (`scan`), then the block's rows and staged angle table
    /// of computed cos and sin (`computed`: the launch's source, [`SourceView::computed`]).
    #[inline(always)]
    pub fn shared(&self, block_threads: u32, scan: bool, computed: Option<&ComputedView>) -> SharedLayout {
        let scan = if scan { self.scan_bytes(block_threads) } else { 0 };
        let (work, half) = (self.items_div.divisor, self.pairs.half());
        SharedLayout::new(scan, computed, work, block_threads, self.tokens, half)
    }
}

impl RopeParams {
    /// The element types of the operands, as the views hold them (an absent k takes q's).
    pub fn types(&self) -> RopeTypes {
        let k = if self.k.heads == 0 { &self.q } else { &self.k };
        RopeTypes { q: self.q.in_type, k: k.in_type, q_out: self.q.out_type, k_out: k.out_type }
    }

    /// The work items per token of the mapping at `g` heads per thread: `(q_groups +
    /// k_groups) * slots` ([`RopeParams::group_slots`]), or the `_n` and `_w` kernels' `items`.
    #[inline(always)]
    pub fn work(&self, g: u32) -> u32 {
        match self.items {
            0 => (groups(self.q.heads, g) + groups(self.k.heads, g)) * self.group_slots(),
            items => items,
        }
    }

    /// The items a head group takes: `slots`, or without it `rot_lanes + copy_lanes`.
    #[inline(always)]
    pub fn group_slots(&self) -> u32 {
        if self.slots == 0 {
            self.rot_lanes + self.copy_lanes
        } else {
            self.slots
        }
    }

    /// The dynamic shared memory of a launch with blocks of `block_threads` and `work` items
    /// per token ([`RopeParams::work`]) ([`SharedLayout`]): with computed cos and sin
    /// (`computed`: the launch's source, [`SourceView::computed`]), the block's rows, then the
    /// staged angle table.
    #[inline(always)]
    pub fn shared(&self, block_threads: u32, work: u32, computed: Option<&ComputedView>) -> SharedLayout {
        SharedLayout::new(0, computed, work, block_threads, self.tokens, self.pairs.half())
    }
}

/// Parameters of the `bench_touch_rows` benchmark kernel: `rows` rows of `row_chunks` 16-byte
/// chunks, `pitch` bytes apart, from `src` to `dst` (the same offsets in both): a strided
/// view's own copy, such as MLA's q_pe (128 bytes of every 384 of q).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TouchRows {
    pub(crate) src: u64,
    pub(crate) dst: u64,
    pub(crate) pitch: u64,
    pub(crate) chunks: u64,
    pub(crate) row_chunks: FastDiv,
}

impl TouchRows {
    /// `rows` rows of `row_bytes` (a nonzero multiple of 16 below 2^32) `pitch` bytes apart;
    /// `None` unless both addresses and the pitch are multiples of 16.
    pub fn new(src: u64, dst: u64, row_bytes: u64, pitch: u64, rows: u64) -> Option<TouchRows> {
        let ok = (src | dst | pitch | row_bytes) & 15 == 0 && row_bytes > 0 && row_bytes < 1 << 32;
        ok.then(|| TouchRows {
            src,
            dst,
            pitch,
            chunks: rows * (row_bytes / 16),
            row_chunks: FastDiv::new((row_bytes / 16) as u32),
        })
    }

    /// Number of 16-byte chunks (one thread each).
    pub fn chunks(&self) -> u64 {
        self.chunks
    }
}

/// Parameters of the `bench_touch` benchmark kernel: `chunks` 16-byte chunks from `src` to `dst`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Touch {
    pub(crate) src: u64,
    pub(crate) dst: u64,
    pub(crate) chunks: u64,
}

impl Touch {
    /// A copy of the whole 16-byte chunks of `bytes` bytes from `src` to `dst`; `None` unless
    /// both addresses are 16-byte aligned (the kernel's accesses are).
    pub const fn new(src: u64, dst: u64, bytes: u64) -> Option<Touch> {
        match (src | dst) & 15 == 0 {
            true => Some(Touch { src, dst, chunks: bytes / 16 }),
            false => None,
        }
    }

    /// `bench_fp8`'s parameters: `pairs` f32 pairs at `src`, twice as many u16 at `dst`.
    pub const fn pairs(src: u64, dst: u64, pairs: u64) -> Touch {
        Touch { src, dst, chunks: pairs }
    }

    /// Number of 16-byte chunks (one thread each).
    pub fn chunks(&self) -> u64 {
        self.chunks
    }
}
