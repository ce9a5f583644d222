//! Where cos and sin come from: the table rows a pair reads ([`PairRows`]), the sources
//! ([`Source`]: the library's table, the caller's, computed) with the block's prologue that
//! computes or stages them ([`Prologue`]), and a lane's table entries ([`Entries`]).

use crate::gpu::{
    block_dim, load_elem_nc, load_shared32, load_shared32_volatile, load_table, load_words_nc, shared_addr, thread_idx,
    unrolled, Elem, Lane,
};
use crate::math::{angle_index, mul_pair, sincos_turns_pair, turns_at, ANGLE_STEPS};
use crate::mem::sync_threads;
use crate::params::{row_stride, SharedLayout};
use crate::views::{ComputedView, Pairs, PositionsView, SourceView};
use core::marker::PhantomData;

/// Which table row each pair of a token reads: one row for every pair ([`OneRow`]), or, for
/// multimodal RoPE, the row of one of the token's three positions, chosen per pair by the
/// launch's [`Pairs`] ([`StreamRows`]).
pub(crate) trait PairRows: Copy + Default {
    /// Whether every pair reads the same row (a lane's entries are then contiguous).
    const ONE_ROW: bool;
    /// Token `token`'s raw position as the range check takes it ([`PositionsView::load`]; the
    /// one-position kernels read only one-position kinds).
    ///
    /// # Safety
    /// As [`PositionsView::load`]; the view's kind is one this kernel takes.
    unsafe fn load(positions: &PositionsView, token: u32, b: u32, s: u32) -> i64;
    /// The rows of token `t`, whose (first) position `pos` passed the range check.
    ///
    /// # Safety
    /// `positions` holds token `t`'s entries, and its [`PositionsView::load`] of `t` passed
    /// [`PositionsView::check`] (for streams: all three are in range).
    unsafe fn of(positions: &PositionsView, t: u32, pos: u32) -> Self;
    /// The position pair `i` turns by.
    fn pos(self, pairs: &Pairs, i: usize) -> u32;
    /// The table entry index of pair `i`.
    #[inline(always)]
    fn entry(self, pairs: &Pairs, i: usize) -> usize {
        pairs.entry(self.pos(pairs, i) as usize, i)
    }
    /// Whether pairs `i..i + n` all read one row.
    fn one_row(self, pairs: &Pairs, i: usize, n: usize) -> bool;
}

/// How a token of one position row reads that position ([`OneRow`]'s stage): the view's id
/// or offset as it is ([`Position`]), or what a feature makes of it (the KV shift's `|Δ|`).
pub(crate) trait OneLoad: Copy + Default {
    /// Token `token`'s raw position as the range check takes it.
    ///
    /// # Safety
    /// As [`PositionsView::load`]; the view's kind is one the kernel takes.
    unsafe fn load(positions: &PositionsView, token: u32, b: u32, s: u32) -> i64;
}

/// The token's position as the view holds it ([`PositionsView::load_one`]).
#[derive(Clone, Copy, Default)]
pub(crate) struct Position;

impl OneLoad for Position {
    #[inline(always)]
    unsafe fn load(positions: &PositionsView, token: u32, b: u32, s: u32) -> i64 {
        // SAFETY: the caller's contract.
        unsafe { positions.load_one(token, b, s) }
    }
}

/// Every pair at the token's one position, read as `L` says.
#[derive(Clone, Copy, Default)]
pub(crate) struct OneRow<L: OneLoad = Position>(u32, PhantomData<L>);

impl<L: OneLoad> OneRow<L> {
    /// Every pair at `pos`.
    #[inline(always)]
    pub(crate) fn at(pos: u32) -> Self {
        OneRow(pos, PhantomData)
    }
}

/// MRoPE: pair `i` at the token's position of stream [`Pairs::stream`]`(i)`.
#[derive(Clone, Copy, Default)]
pub(crate) struct StreamRows([u32; 3]);

impl<L: OneLoad> PairRows for OneRow<L> {
    const ONE_ROW: bool = true;
    #[inline(always)]
    unsafe fn load(positions: &PositionsView, token: u32, b: u32, s: u32) -> i64 {
        // SAFETY: the caller's contract.
        unsafe { L::load(positions, token, b, s) }
    }
    #[inline(always)]
    unsafe fn of(_: &PositionsView, _: u32, pos: u32) -> Self {
        OneRow::at(pos)
    }
    #[inline(always)]
    fn pos(self, _: &Pairs, _: usize) -> u32 {
        self.0
    }
    #[inline(always)]
    fn one_row(self, _: &Pairs, _: usize, _: usize) -> bool {
        true
    }
}

impl PairRows for StreamRows {
    const ONE_ROW: bool = false;
    #[inline(always)]
    unsafe fn load(positions: &PositionsView, token: u32, _: u32, _: u32) -> i64 {
        // SAFETY: the caller's contract.
        unsafe { positions.load_streams(token) }
    }
    #[inline(always)]
    unsafe fn of(positions: &PositionsView, t: u32, _: u32) -> Self {
        // SAFETY: the caller's contract; all three passed the range check, so they fit u32.
        StreamRows(unsafe { positions.streams_of(t) }.map(|p| p as u32))
    }
    #[inline(always)]
    fn pos(self, pairs: &Pairs, i: usize) -> u32 {
        // A select, not an index: a dynamic index would put the array in local memory.
        let [p0, p1, p2] = self.0;
        match pairs.stream(i as u32) {
            0 => p0,
            1 => p1,
            _ => p2,
        }
    }
    #[inline(always)]
    fn one_row(self, pairs: &Pairs, i: usize, n: usize) -> bool {
        let [p0, p1, p2] = self.0;
        (p0 == p1 && p1 == p2) || pairs.one_band(i as u32, (i + n - 1) as u32)
    }
}

/// A launch's cos/sin source and the direction of its rotation, for one token.
#[derive(Clone, Copy)]
pub(crate) struct Table<'a> {
    /// The source's view (its variant the kernel's source's).
    pub src: &'a SourceView,
    /// The pairs rotated.
    pub pairs: &'a Pairs,
    /// `1.0`, or `-1.0` for the inverse rotation.
    pub sin_sign: f32,
    /// The library's source: the token's row of the block's cos and sin ([`BlockRows::row`]);
    /// unused with the caller's tables.
    pub row: u32,
}

/// Where a lane's cos and sin come from: computed from the position and each pair's
/// frequency ([`Computed`], the library's), or read from a caller's tables ([`F32Table`],
/// [`ElemTable`], the reference update's).
pub(crate) trait Source {
    /// What every thread of a block runs before its own work, for this source.
    type Prologue: Prologue;
    /// Whether the kernel computes the block's cos and sin into shared memory first (its
    /// prologue, [`BlockRows`]) and reads them from there ([`Table::row`]).
    const BLOCK_ROWS: bool = <Self::Prologue as Prologue>::BARRIERS;
    /// Whether f32 outputs are rounded once from the exact rotation by the entries
    /// ([`rotate_pair_rounded`]) rather than by the fast FMAs: the drop-ins' promise of 1 ulp
    /// from the rotation by the caller's tables, which the fast path breaks where the two
    /// products cancel.
    const ROUNDED_F32: bool = false;
    /// The cos and sin (the attention factor in, the direction's sign not) of pairs
    /// `i..i + n` of a token whose rows are `rows`: the fast values.
    ///
    /// # Safety
    /// The view's arrays hold pairs `i..i + n` (tables: of the rows' positions), aligned for
    /// the access, and are not written during the kernel; with [`Source::BLOCK_ROWS`],
    /// `p.row` is the token's filled row, and `i` a multiple of `min(n, 4)`.
    unsafe fn load<P: PairRows>(p: Table<'_>, rows: P, i: usize, n: usize) -> (Lane, Lane);
    /// `((cos, cos_lo), (sin, sin_lo))` of pair `i` (table entry `at`), given its fast `c`
    /// and `s`: each the f32 pair of a value accurate to about `2^-46` (the library's
    /// residuals; the caller's tables' entries are taken as exact).
    ///
    /// # Safety
    /// As [`Source::load`], for pair `i`.
    unsafe fn exact(p: Table<'_>, i: usize, at: usize, c: f32, s: f32) -> ((f32, f32), (f32, f32));
}

/// What a block's [`Prologue`] reads: the block's tokens, the launch's views, and its dynamic
/// shared memory.
pub(crate) struct BlockInputs<'a, F, L> {
    /// Whether the kernel may stage the angle table (a constant of the kernel: its launches
    /// of few tokens).
    pub can_stage: bool,
    /// The block's first token and number of tokens ([`crate::params::block_tokens`]).
    pub tokens: (u32, u32),
    /// The launch's source of cos and sin.
    pub source: &'a SourceView,
    /// The pairs rotated.
    pub pairs: &'a Pairs,
    /// The tokens' positions.
    pub positions: &'a PositionsView,
    /// Token `t`'s (batch, sequence index).
    pub divmod: F,
    /// The block's dynamic shared memory.
    pub base: *mut u8,
    /// Its layout for a computed source ([`SharedLayout`], as the host sized it).
    pub layout: L,
}

/// The part of a source of cos and sin that every thread of a block runs before its own
/// work, in two halves so that a kernel can put other block-wide work between them (the KV
/// append's duplicate scan): the computed source's rows of the block's cos and sin in shared
/// memory ([`BlockRows`]); nothing for tables ([`NoPrologue`]).
pub(crate) trait Prologue {
    /// Whether it holds barriers and shared memory: every thread of the block runs it, idle
    /// or not.
    const BARRIERS: bool;
    /// What [`Prologue::start`] leaves for [`Prologue::fill`].
    type Start;
    /// What it leaves for the block's threads: where each token's cos and sin are
    /// ([`Prologue::row`]).
    type Rows: Copy;
    /// Issues this thread's loads and its first stores (call it after the loads that should
    /// go first).
    ///
    /// # Safety
    /// Every thread of the block calls it; the launch's source is this prologue's; with
    /// [`Prologue::BARRIERS`] the launch has `layout`'s dynamic shared memory, 16-byte aligned,
    /// the positions buffer holds the block's tokens' entries and the source's arrays their
    /// pairs.
    unsafe fn start<P: PairRows, F: Fn(u32) -> (u32, u32), L: Fn(&ComputedView) -> SharedLayout>(
        b: &BlockInputs<'_, F, L>,
    ) -> Self::Start;
    /// Completes the prologue. With `barriers` it holds its own barriers (after the first
    /// half's stores, after its own); without, the caller puts a barrier between the two
    /// halves and one after this.
    ///
    /// # Safety
    /// As [`Prologue::start`], whose result this thread passes.
    unsafe fn fill<P: PairRows, F: Fn(u32) -> (u32, u32), L: Fn(&ComputedView) -> SharedLayout>(
        b: &BlockInputs<'_, F, L>,
        start: Self::Start,
        barriers: bool,
    ) -> Self::Rows;
    /// Token `token`'s row (one of the block's), for [`Table::row`].
    fn row(rows: Self::Rows, token: u32) -> u32;
}

/// The tables' prologue: nothing.
pub(crate) struct NoPrologue;

impl Prologue for NoPrologue {
    const BARRIERS: bool = false;
    type Start = ();
    type Rows = ();
    #[inline(always)]
    unsafe fn start<P: PairRows, F: Fn(u32) -> (u32, u32), L: Fn(&ComputedView) -> SharedLayout>(
        _: &BlockInputs<'_, F, L>,
    ) {
    }
    #[inline(always)]
    unsafe fn fill<P: PairRows, F: Fn(u32) -> (u32, u32), L: Fn(&ComputedView) -> SharedLayout>(
        _: &BlockInputs<'_, F, L>,
        _: (),
        _: bool,
    ) {
    }
    #[inline(always)]
    fn row(_: (), _: u32) -> u32 {
        0
    }
}

impl Prologue for BlockRows {
    const BARRIERS: bool = true;
    type Start = FillStart;
    type Rows = BlockRows;
    #[inline(always)]
    unsafe fn start<P: PairRows, F: Fn(u32) -> (u32, u32), L: Fn(&ComputedView) -> SharedLayout>(
        b: &BlockInputs<'_, F, L>,
    ) -> FillStart {
        // SAFETY: the trait method's contract: the launch's source is computed, with its
        // shared memory.
        unsafe {
            let view = b.source.computed_unchecked();
            let start = BlockRows::start::<P>(b.can_stage, b.tokens, view, b.pairs, b.positions, &b.divmod);
            let angles = b.base.wrapping_add((b.layout)(view).angles as usize);
            BlockRows::stage(b.can_stage, &start, view, angles);
            start
        }
    }
    #[inline(always)]
    unsafe fn fill<P: PairRows, F: Fn(u32) -> (u32, u32), L: Fn(&ComputedView) -> SharedLayout>(
        b: &BlockInputs<'_, F, L>,
        start: FillStart,
        barriers: bool,
    ) -> BlockRows {
        // SAFETY: the trait method's contract; every thread of the block is here, after its
        // `start` (whose staged stores the first barrier orders before the fill's reads).
        unsafe {
            let view = b.source.computed_unchecked();
            let layout = (b.layout)(view);
            if barriers && b.can_stage && view.staged() {
                sync_threads();
            }
            let (rows, angles) =
                (b.base.wrapping_add(layout.rows as usize) as *mut f32, b.base.wrapping_add(layout.angles as usize));
            let r =
                BlockRows::fill::<P>(b.can_stage, rows, start, b.tokens, view, b.pairs, b.positions, &b.divmod, angles);
            if barriers {
                sync_threads();
            }
            r
        }
    }
    #[inline(always)]
    fn row(rows: BlockRows, token: u32) -> u32 {
        rows.row(token)
    }
}

/// The library's source: cos and sin of `position x inv_freq` computed in the kernel from each
/// pair's frequency in exact turns ([`crate::math::turns_at`]): f32 polynomials for the fast
/// values, f64 ones for the exact path, the attention factor multiplied in.
pub(crate) struct Computed;
/// The library's tables: f32 cos and sin of `max_position` rows, the nearest to the f64
/// values, with f32 residual tables that the exact path reads.
pub(crate) struct LibTable;
/// A caller's f32 tables (taken as exact; no residuals).
pub(crate) struct F32Table;
/// A caller's tables in the element type `T` (taken as exact).
pub(crate) struct ElemTable<T>(core::marker::PhantomData<T>);

/// Loads a table's entries of `n` pairs from pair `i`: one row where the pairs share it.
///
/// # Safety
/// As [`Source::load`].
#[inline(always)]
unsafe fn table_entries<P: PairRows>(
    [cos, sin]: [u64; 2],
    pairs: &Pairs,
    rows: P,
    i: usize,
    n: usize,
    load: impl Fn(u64, usize, usize) -> Lane,
) -> (Lane, Lane) {
    // MRoPE lanes whose pairs all read one row (text tokens; or, with contiguous bands,
    // lanes inside one band: Qwen2-VL's sections are multiples of the lane width) load as
    // one row too.
    if P::ONE_ROW || rows.one_row(pairs, i, n) {
        let at = rows.entry(pairs, i);
        (load(cos, at, n), load(sin, at, n))
    } else {
        let (mut c, mut s) = ([0.0f32; 8], [0.0f32; 8]);
        unrolled(n, |j| {
            let at = rows.entry(pairs, i + j);
            (c[j], s[j]) = (load(cos, at, 1)[0], load(sin, at, 1)[0]);
        });
        (c, s)
    }
}

/// [`Source::load`] of f32 tables at `[cos, sin]`.
///
/// # Safety
/// As [`Source::load`].
#[inline(always)]
unsafe fn f32_entries<P: PairRows>(cos_sin: [u64; 2], p: Table<'_>, rows: P, i: usize, n: usize) -> (Lane, Lane) {
    // SAFETY: the caller's contract: the tables hold the entries read.
    let load = |base: u64, at: usize, n: usize| unsafe { load_table((base as *const f32).wrapping_add(at), n) };
    // SAFETY: as above.
    unsafe { table_entries(cos_sin, p.pairs, rows, i, n, load) }
}

impl Source for F32Table {
    type Prologue = NoPrologue;
    #[inline(always)]
    unsafe fn load<P: PairRows>(p: Table<'_>, rows: P, i: usize, n: usize) -> (Lane, Lane) {
        // SAFETY: the trait method's contract (the launch's source is the caller's tables).
        unsafe { f32_entries(p.src.caller_unchecked().addresses(), p, rows, i, n) }
    }
    #[inline(always)]
    unsafe fn exact(_: Table<'_>, _: usize, _: usize, c: f32, s: f32) -> ((f32, f32), (f32, f32)) {
        ((c, 0.0), (s, 0.0))
    }
}

impl Source for LibTable {
    type Prologue = NoPrologue;
    #[inline(always)]
    unsafe fn load<P: PairRows>(p: Table<'_>, rows: P, i: usize, n: usize) -> (Lane, Lane) {
        // SAFETY: the trait method's contract (the launch's source is the library's table).
        let [cos, sin, ..] = unsafe { p.src.table_unchecked() }.addresses();
        // SAFETY: the trait method's contract.
        unsafe { f32_entries([cos, sin], p, rows, i, n) }
    }
    #[inline(always)]
    unsafe fn exact(p: Table<'_>, _: usize, at: usize, c: f32, s: f32) -> ((f32, f32), (f32, f32)) {
        // SAFETY: the trait method's contract (the launch's source is the library's table).
        let [_, _, cos_lo, sin_lo] = unsafe { p.src.table_unchecked() }.addresses();
        // SAFETY: the trait method's contract: the residual tables hold the entry the fast
        // values came from.
        unsafe {
            let lo = |base: u64| load_table((base as *const f32).wrapping_add(at), 1)[0];
            ((c, lo(cos_lo)), (s, lo(sin_lo)))
        }
    }
}

impl<T: Elem> Source for ElemTable<T> {
    type Prologue = NoPrologue;
    const ROUNDED_F32: bool = true;
    #[inline(always)]
    unsafe fn load<P: PairRows>(p: Table<'_>, rows: P, i: usize, n: usize) -> (Lane, Lane) {
        // SAFETY: the trait method's contract (the launch's source is the caller's tables).
        let cos_sin = unsafe { p.src.caller_unchecked() }.addresses();
        let load = |base: u64, at: usize, n: usize| {
            let mut v = [0.0f32; 8];
            unrolled(n, |j| {
                let p = (base as *const u8).wrapping_add((at + j) * T::SIZE);
                // SAFETY: the trait method's contract: entry `at + j` exists.
                v[j] = T::widen(unsafe { load_elem_nc::<T>(p) })
            });
            v
        };
        // SAFETY: as above.
        unsafe { table_entries(cos_sin, p.pairs, rows, i, n, load) }
    }
    #[inline(always)]
    unsafe fn exact(_: Table<'_>, _: usize, _: usize, c: f32, s: f32) -> ((f32, f32), (f32, f32)) {
        ((c, 0.0), (s, 0.0))
    }
}

/// Pair `i`'s angle, in turns, for the token's rows.
///
/// # Safety
/// The view's frequency array holds pair `i`.
#[inline(always)]
unsafe fn turns_of_pair<P: PairRows>(view: &ComputedView, pairs: &Pairs, rows: P, i: usize) -> u64 {
    // SAFETY: the caller's contract: 16 bytes per pair, 16-byte aligned.
    let [r0, r1, r2, _] = unsafe { load_words_nc((view.freqs() as *const u32).wrapping_add(4 * i)) };
    turns_at(rows.pos(pairs, i), [r0, r1, r2])
}

impl Source for Computed {
    type Prologue = BlockRows;
    #[inline(always)]
    unsafe fn load<P: PairRows>(p: Table<'_>, _: P, i: usize, n: usize) -> (Lane, Lane) {
        let stride = row_stride(p.pairs.half()) as usize;
        // SAFETY: the trait method's contract: the row holds the token's `half` cos, then
        // (from `stride`) its sines, 16-byte aligned, and `i` is a multiple of `min(n, 4)`.
        unsafe { (load_shared32(p.row + 4 * i as u32, n), load_shared32(p.row + 4 * (stride + i) as u32, n)) }
    }
    #[inline(always)]
    unsafe fn exact(p: Table<'_>, i: usize, _: usize, c: f32, s: f32) -> ((f32, f32), (f32, f32)) {
        // 32-bit offsets: pair `i`'s address and a column's step (the lane's pairs' addresses
        // differ by constants, folded into the loads, not held in registers ahead of the
        // exact path).
        let step = 4 * row_stride(p.pairs.half());
        // SAFETY: the trait method's contract: the row holds the residuals from `2 * stride`.
        unsafe {
            let at = |k: u32| load_shared32_volatile(p.row + 4 * i as u32 + k * step);
            let _ = (c, s);
            ((at(0), at(2)), (at(1), at(3)))
        }
    }
}

/// The library's cos and sin of one block's tokens, in shared memory: each token's row holds
/// [`row_stride`]`(half)` cos then as many sines (f32, the attention factor in, the
/// direction's sign not), computed once per token and pair by [`BlockRows::fill`] and read by
/// every thread of the block that rotates the token. Computing them per thread instead
/// repeats each pair's sine and cosine once per head group (measured on the H200: bf16 RoPE
/// at 84% of copy bandwidth with 8 heads a thread, against 94% from a table).
#[derive(Clone, Copy)]
pub(crate) struct BlockRows {
    base: *mut f32,
    first: u32,
    stride: u32,
}

/// What one thread of a block loads for [`BlockRows::fill`] before it waits on anything: its
/// first (token, pair) entry and that entry's angle in turns (the position's and the
/// frequency's loads), and, when the launch stages the angle table, its share of the table.
pub(crate) struct FillStart {
    t: u32,
    i: u32,
    turns: Option<u64>,
    angles: [AngleWords; 2],
}

/// One angle-table entry as loaded ([`crate::math::AngleEntry`]'s bits).
type AngleWords = [u32; 4];

/// Entry `j` of the angle table at `angles`.
///
/// # Safety
/// `angles` holds [`ANGLE_STEPS`] entries of 16 bytes, 16-byte aligned; `j` is below that.
#[inline(always)]
unsafe fn angle_words(angles: u64, j: u32) -> AngleWords {
    // SAFETY: the caller's contract.
    unsafe { load_words_nc((angles as *const u32).wrapping_add(4 * j as usize)) }
}

impl BlockRows {
    /// Issues this thread's loads for [`BlockRows::fill`] over the block's tokens
    /// `first..first + count` (see there): the first entry's position and frequency, and,
    /// when the kernel can stage (`can_stage`, a constant of the kernel: its launches of few
    /// tokens) and the view is staged, entries `thread` and `thread + block_dim` of the angle
    /// table. The first entry's angle waits on the position; call this after the loads that
    /// should go first.
    ///
    /// # Safety
    /// As [`BlockRows::fill`].
    #[inline(always)]
    pub(crate) unsafe fn start<P: PairRows>(
        can_stage: bool,
        (first, count): (u32, u32),
        view: &ComputedView,
        pairs: &Pairs,
        positions: &PositionsView,
        divmod: impl Fn(u32) -> (u32, u32),
    ) -> FillStart {
        let (tid, bd) = (thread_idx().0, block_dim().0);
        let mut angles = [[0; 4]; 2];
        if can_stage && view.staged() {
            // SAFETY: the view's angle table holds `ANGLE_STEPS` entries.
            unsafe {
                if tid < ANGLE_STEPS as u32 {
                    angles[0] = angle_words(view.angles(), tid);
                }
                if tid + bd < ANGLE_STEPS as u32 {
                    angles[1] = angle_words(view.angles(), tid + bd);
                }
            }
        }
        let (t, i) = view.pair_of(tid, pairs.half());
        let turns = if t < count {
            let token = first + t;
            // The (batch, sequence index) only where the position needs it.
            let (b, s) = if positions.kind().by_sequence() { divmod(token) } else { (0, 0) };
            // SAFETY: the caller's contract: the token's entries exist.
            let raw = unsafe { P::load(positions, token, b, s) };
            positions.check(raw).map(|pos| {
                // SAFETY: as above; `pos` passed the check; the frequencies hold the pair.
                unsafe { turns_of_pair(view, pairs, P::of(positions, token, pos), i as usize) }
            })
        } else {
            None
        };
        FillStart { t, i, turns, angles }
    }

    /// Stores this thread's share of the staged angle table ([`BlockRows::start`]) at `at`,
    /// when the view is staged; a barrier follows before [`BlockRows::fill`].
    ///
    /// # Safety
    /// `at` is the block's shared memory of [`crate::params::ANGLE_BYTES`], 16-byte aligned;
    /// every thread of the block calls it with its own `start`.
    #[inline(always)]
    pub(crate) unsafe fn stage(can_stage: bool, start: &FillStart, view: &ComputedView, at: *mut u8) {
        if !(can_stage && view.staged()) {
            return;
        }
        let (tid, bd) = (thread_idx().0, block_dim().0);
        let at = at as *mut AngleWords;
        // SAFETY: the caller's contract: entries below `ANGLE_STEPS` lie in `at`.
        unsafe {
            if tid < ANGLE_STEPS as u32 {
                at.add(tid as usize).write(start.angles[0]);
            }
            if tid + bd < ANGLE_STEPS as u32 {
                at.add((tid + bd) as usize).write(start.angles[1]);
            }
            // Blocks of fewer than half the table's entries: the rest, one at a time.
            let mut j = tid + 2 * bd;
            while j < ANGLE_STEPS as u32 {
                at.add(j as usize).write(angle_words(view.angles(), j));
                j += bd;
            }
        }
    }

    /// Computes the rows of the block's tokens `first..first + count` at `base`: every thread
    /// of the block takes every `block_dim`-th (token, pair), from `start` (this thread's
    /// [`BlockRows::start`]). Tokens whose position fails the check are left unwritten (their
    /// threads read nothing). `divmod(t)` is token `t`'s (batch, sequence index). With a
    /// staged view the angle table is read at `angles_at` ([`BlockRows::stage`], then a
    /// barrier), else from the view's global table.
    ///
    /// Every thread of the block calls it, and a barrier follows before any row is read.
    ///
    /// # Safety
    /// `base` is the shared memory of at least [`crate::params::block_rows_bytes`] for this
    /// launch, 16-byte aligned; `count` is at most [`crate::params::block_tokens_max`]; the
    /// positions buffer holds the tokens' entries; the view's frequencies hold `half` pairs.
    #[inline(always)]
    #[expect(
        clippy::too_many_arguments,
        reason = "the fill's inputs, each a different kind; inlined into every kernel"
    )]
    pub(crate) unsafe fn fill<P: PairRows>(
        can_stage: bool,
        base: *mut f32,
        start: FillStart,
        (first, count): (u32, u32),
        view: &ComputedView,
        pairs: &Pairs,
        positions: &PositionsView,
        divmod: impl Fn(u32) -> (u32, u32),
        angles_at: *const u8,
    ) -> BlockRows {
        let half = pairs.half();
        let stride = row_stride(half);
        let bd = block_dim().0;
        // SAFETY: the host never launches without rotary pairs.
        unsafe { core::hint::assert_unchecked(half != 0) };
        // Entry `k = token * half + pair`, stepped by `block_dim` without dividing.
        let (step_t, step_i) = view.pair_of(bd, half);
        let FillStart { mut t, mut i, turns, .. } = start;
        let mut turns = turns;
        let a = view.attention();
        let unit = view.unit_attention();
        let stride_u = stride as usize;
        let (staged, angles, shared_angles) =
            (can_stage && view.staged(), view.angles(), shared_addr(angles_at as *const f32));
        while t < count {
            if let Some(tj) = turns {
                let j = angle_index(tj) as u32;
                // SAFETY: the staged table (or the view's) holds `ANGLE_STEPS` entries of 16
                // bytes, 16-byte aligned; `angle_index` is below that.
                let e = unsafe {
                    match staged {
                        true => {
                            let v = load_shared32(shared_angles + 16 * j, 4);
                            [v[0], v[1], v[2], v[3]]
                        }
                        false => angle_words(angles, j).map(f32::from_bits),
                    }
                };
                let (mut sn, mut cs) = sincos_turns_pair(tj, |_| e);
                if !unit {
                    (cs, sn) = (mul_pair(cs, a), mul_pair(sn, a));
                }
                let row = base.wrapping_add((4 * t * stride) as usize);
                let i = i as usize;
                // SAFETY: `t < count`: the row is inside the shared memory.
                unsafe {
                    row.add(i).write(cs.0);
                    row.add(stride_u + i).write(sn.0);
                    row.add(2 * stride_u + i).write(cs.1);
                    row.add(3 * stride_u + i).write(sn.1);
                }
            }
            i += step_i;
            t += step_t;
            if i >= half {
                i -= half;
                t += 1;
            }
            turns = None;
            if t < count {
                let token = first + t;
                // The (batch, sequence index) only where the position needs it.
                let (b, s) = if positions.kind().by_sequence() { divmod(token) } else { (0, 0) };
                // SAFETY: the caller's contract: the token's entries exist.
                let raw = unsafe { P::load(positions, token, b, s) };
                turns = positions.check(raw).map(|pos| {
                    // SAFETY: as above; `pos` passed the check; the frequencies hold the pair.
                    unsafe { turns_of_pair(view, pairs, P::of(positions, token, pos), i as usize) }
                });
            }
        }
        BlockRows { base, first, stride }
    }

    /// Token `token`'s row (one of the block's), as a shared-window address.
    #[inline(always)]
    pub(crate) fn row(&self, token: u32) -> u32 {
        shared_addr(self.base) + 16 * (token - self.first) * self.stride
    }
}

/// The cos and sin of one lane: `n` pairs', the sine's sign set for the direction.
pub(crate) struct Entries<P> {
    c: Lane,
    s: Lane,
    /// For the exact path: the lane's first pair, and (tables) where its entries start (one
    /// row) or the token's rows (MRoPE).
    i: usize,
    at: usize,
    rows: P,
}

impl<P: PairRows> Entries<P> {
    /// No entries (for lanes that do not rotate).
    #[inline(always)]
    pub(crate) fn none() -> Entries<P> {
        Entries { c: [0.0; 8], s: [0.0; 8], i: 0, at: 0, rows: P::default() }
    }

    /// The cos and sin of `n` pairs from pair `i`, for a token whose rows are `rows`.
    ///
    /// # Safety
    /// As [`Source::load`].
    #[inline(always)]
    pub(super) unsafe fn load<B: Source>(p: Table<'_>, rows: P, i: usize, n: usize) -> Entries<P> {
        if B::BLOCK_ROWS {
            // Read again for each head ([`Entries::lane`]): from shared memory that is cheap,
            // and the lane's values are not held in registers across the heads.
            return Entries { c: [0.0; 8], s: [0.0; 8], i, at: 0, rows };
        }
        // SAFETY: the caller's contract.
        let (c, mut s) = unsafe { B::load(p, rows, i, n) };
        for v in s.iter_mut().take(n) {
            *v *= p.sin_sign;
        }
        Entries { c, s, i, at: rows.entry(p.pairs, i), rows }
    }

    /// The lane's `n` cos and sin (the sine's sign set), for one head.
    ///
    /// # Safety
    /// `self` was loaded by [`Entries::load`] from `p` with this `n`.
    #[inline(always)]
    pub(super) unsafe fn lane<B: Source>(&self, p: Table<'_>, n: usize) -> (Lane, Lane) {
        if !B::BLOCK_ROWS {
            return (self.c, self.s);
        }
        // SAFETY: the caller's contract; block rows ignore the token's rows.
        let (c, mut s) = unsafe { B::load(p, P::default(), self.i, n) };
        for v in s.iter_mut().take(n) {
            *v *= p.sin_sign;
        }
        (c, s)
    }

    /// The exact `((cos, cos_lo), (sin, sin_lo))` of entry `j`, one at a time (few
    /// registers: this is the rare path).
    ///
    /// # Safety
    /// `self` was loaded by [`Entries::load`] from `p`, and `j` is below its `n`.
    #[inline(always)]
    pub(super) unsafe fn exact<B: Source>(&self, p: Table<'_>, j: usize) -> ((f32, f32), (f32, f32)) {
        if !B::BLOCK_ROWS {
            // Tables: the fast values as held (the sine's sign set), the residuals read at
            // the entry (zero for the caller's tables).
            let at = if P::ONE_ROW { self.at + j } else { self.rows.entry(p.pairs, self.i + j) };
            // SAFETY: the caller's contract: the tables hold entry `at`.
            let ((c, c_lo), (_, s_lo)) = unsafe { B::exact(p, self.i + j, at, self.c[j], 0.0) };
            return ((c, c_lo), (self.s[j], s_lo * p.sin_sign));
        }
        // SAFETY: the caller's contract (block rows read theirs from shared memory).
        let (c, s) = unsafe { B::exact(p, self.i + j, 0, self.c[j], self.s[j] * p.sin_sign) };
        (c, (s.0 * p.sin_sign, s.1 * p.sin_sign))
    }
}
