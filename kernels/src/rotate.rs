//! The rotation engine, shared by the RoPE and KV-cache kernels: table entries, lanes of
//! pairs (fast, and exact where a narrow output needs it), the rows a thread moves, and the
//! two pairing styles. The entry points' bodies ([`crate::rope`], [`crate::kv`]) only map
//! threads to work and call in here.

use crate::gpu::{load_elem_nc, load_table, Bits, Elem, Io, Lane};
use crate::math::{rotate_pair, rotate_pair_fast};
use crate::views::{PositionsView, TableView};

/// Which table row each pair of a token reads: one row for every pair ([`OneRow`]), or, for
/// multimodal RoPE, the row of one of the token's three positions, chosen per pair by the
/// table's bands ([`StreamRows`]).
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
    /// The entry index of pair `i`.
    fn entry(self, table: &TableView, i: usize) -> usize;
    /// Whether pairs `i..i + n` all read one row.
    fn one_row(self, table: &TableView, i: usize, n: usize) -> bool;
}

/// Every pair at the token's one position.
#[derive(Clone, Copy, Default)]
pub(crate) struct OneRow(u32);

/// MRoPE: pair `i` at the token's position of stream [`TableView::stream`]`(i)`.
#[derive(Clone, Copy, Default)]
pub(crate) struct StreamRows([u32; 3]);

impl PairRows for OneRow {
    const ONE_ROW: bool = true;
    #[inline(always)]
    unsafe fn load(positions: &PositionsView, token: u32, b: u32, s: u32) -> i64 {
        // SAFETY: the caller's contract.
        unsafe { positions.load_one(token, b, s) }
    }
    #[inline(always)]
    unsafe fn of(_: &PositionsView, _: u32, pos: u32) -> Self {
        OneRow(pos)
    }
    #[inline(always)]
    fn entry(self, table: &TableView, i: usize) -> usize {
        table.entry(self.0 as usize, i)
    }
    #[inline(always)]
    fn one_row(self, _: &TableView, _: usize, _: usize) -> bool {
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
    fn entry(self, table: &TableView, i: usize) -> usize {
        // A select, not an index: a dynamic index would put the array in local memory.
        let [p0, p1, p2] = self.0;
        let pos = match table.stream(i as u32) {
            0 => p0,
            1 => p1,
            _ => p2,
        };
        table.entry(pos as usize, i)
    }
    #[inline(always)]
    fn one_row(self, table: &TableView, i: usize, n: usize) -> bool {
        let [p0, p1, p2] = self.0;
        (p0 == p1 && p1 == p2) || table.one_band(i as u32, (i + n - 1) as u32)
    }
}

/// A launch's cos/sin table and the direction of its rotation.
#[derive(Clone, Copy)]
pub(crate) struct Table<'a> {
    /// The table.
    pub view: &'a TableView,
    /// `1.0`, or `-1.0` for the inverse rotation.
    pub sin_sign: f32,
}

/// How table entries are stored.
pub(crate) trait TableElem {
    /// Loads `n` entries at entry index `at` of the table at `base`.
    ///
    /// # Safety
    /// The table at `base` holds entries `at..at + n`, aligned for the access, and is not
    /// written during the kernel.
    unsafe fn load(base: u64, at: usize, n: usize) -> Lane;
    /// Whether residual tables exist (else the residuals are zero: the entries are exact).
    const RESIDUALS: bool;
}

/// The library's tables: f32, the nearest to the f64 values, with f32 residual tables.
pub(crate) struct F32Table;
/// A caller's tables in the element type `T` (taken as exact).
pub(crate) struct ElemTable<T>(core::marker::PhantomData<T>);

impl TableElem for F32Table {
    const RESIDUALS: bool = true;
    #[inline(always)]
    unsafe fn load(base: u64, at: usize, n: usize) -> Lane {
        // SAFETY: the trait method's contract.
        unsafe { load_table((base as *const f32).wrapping_add(at), n) }
    }
}

impl<T: Elem> TableElem for ElemTable<T> {
    const RESIDUALS: bool = false;
    #[inline(always)]
    unsafe fn load(base: u64, at: usize, n: usize) -> Lane {
        let mut v = [0.0f32; 8];
        unrolled(n, |j| {
            let p = (base as *const u8).wrapping_add((at + j) * T::SIZE);
            // SAFETY: the trait method's contract: entry `at + j` exists.
            v[j] = T::widen(unsafe { load_elem_nc::<T>(p) })
        });
        v
    }
}

/// The table entries of one lane: `n` pairs' cos and sin, the sine's sign set for the
/// direction.
pub(crate) struct Entries<P> {
    c: Lane,
    s: Lane,
    /// For the residuals: where the lane's entries start (one row), or the token's rows and
    /// the lane's first pair (MRoPE).
    at: usize,
    rows: P,
    i: usize,
}

impl<P: PairRows> Entries<P> {
    /// No entries (for lanes that do not rotate).
    #[inline(always)]
    pub(crate) fn none() -> Entries<P> {
        Entries { c: [0.0; 8], s: [0.0; 8], at: 0, rows: P::default(), i: 0 }
    }

    /// Loads `n` entries from pair `i` of the token's table rows `rows`.
    ///
    /// # Safety
    /// The table holds the rows, and `i + n` is at most its pairs per row.
    #[inline(always)]
    unsafe fn load<B: TableElem>(p: Table<'_>, rows: P, i: usize, n: usize) -> Entries<P> {
        let [cos, sin, ..] = p.view.addresses();
        let (mut c, mut s) = ([0.0f32; 8], [0.0f32; 8]);
        let at = rows.entry(p.view, i);
        // MRoPE lanes whose pairs all read one row (text tokens; or, with contiguous bands,
        // lanes inside one band: Qwen2-VL's sections are multiples of the lane width) load
        // as one row too.
        let one_row = P::ONE_ROW || rows.one_row(p.view, i, n);
        if one_row {
            // SAFETY: the caller's contract: the row holds entries `i..i + n`.
            (c, s) = unsafe { (B::load(cos, at, n), B::load(sin, at, n)) };
        } else {
            unrolled(n, |j| {
                let at = rows.entry(p.view, i + j);
                // SAFETY: as above, pair by pair.
                (c[j], s[j]) = unsafe { (B::load(cos, at, 1)[0], B::load(sin, at, 1)[0]) };
            });
        }
        for v in s.iter_mut().take(n) {
            *v *= p.sin_sign;
        }
        Entries { c, s, at, rows, i }
    }

    /// The residuals `(cos_lo, sin_lo)` of entry `j`, one at a time (few registers: this
    /// is the rare path).
    ///
    /// # Safety
    /// `self` was loaded by [`Entries::load`] from `p`, and `j` is below its `n`.
    #[inline(always)]
    unsafe fn residual<B: TableElem>(&self, p: Table<'_>, j: usize) -> (f32, f32) {
        if !B::RESIDUALS {
            return (0.0, 0.0);
        }
        let [_, _, cos_lo, sin_lo] = p.view.addresses();
        let at = if P::ONE_ROW { self.at + j } else { self.rows.entry(p.view, self.i + j) };
        // SAFETY: the caller's contract: the residual tables hold the entries `load` read.
        let (c, s) = unsafe {
            (
                load_table((cos_lo as *const f32).wrapping_add(at), 1)[0],
                load_table((sin_lo as *const f32).wrapping_add(at), 1)[0],
            )
        };
        (c, s * p.sin_sign)
    }
}

/// Calls `f(j)` for each `j` in `0..n` (`n <= 8`), unrolled: after inlining every `j` is a
/// constant, so the lane arrays `f` indexes stay in registers. (LLVM does not unroll the
/// larger loop bodies by itself, and one dynamic index puts a whole array in local memory.)
#[inline(always)]
pub(crate) fn unrolled(n: usize, mut f: impl FnMut(usize)) {
    if n > 0 {
        f(0)
    }
    if n > 1 {
        f(1)
    }
    if n > 2 {
        f(2)
    }
    if n > 3 {
        f(3)
    }
    if n > 4 {
        f(4)
    }
    if n > 5 {
        f(5)
    }
    if n > 6 {
        f(6)
    }
    if n > 7 {
        f(7)
    }
}

/// Rotates the `n` pairs of a lane from `raw` (as loaded) into `out` (as stored); `pair(j)`
/// says where pair `j`'s two elements are (as (vector, index)), in increasing index order per
/// vector. Fast evaluation first; for narrow outputs, if any output of the lane is too small
/// next to its inputs for the fast form to round correctly, the inputs are read again
/// (`reload`: the source is not yet written) with the residuals, and every pair of the lane
/// is recomputed with [`rotate_pair`]. That happens for about one output in 10^4 on random
/// data.
///
/// # Safety
/// `t` was loaded from `p` for `n` pairs, and `reload` may be called (its source is still
/// unwritten and readable).
#[inline(always)]
unsafe fn rotate_lane<R: Io, B: TableElem, P: PairRows>(
    t: &Entries<P>,
    p: Table<'_>,
    n: usize,
    raw: &[Bits; 2],
    out: &mut [Bits; 2],
    pair: impl Fn(usize) -> ((usize, usize), (usize, usize)),
    reload: impl Fn() -> [Bits; 2],
) {
    debug_assert!(n <= 8);
    let (mut slack, mut smallest) = (f32::INFINITY, f32::INFINITY);
    let mut pending = [0.0f32; 2];
    unrolled(n, |j| {
        let ((l0, i0), (l1, i1)) = pair(j);
        let (a, b) = (R::get(&raw[l0], i0), R::get(&raw[l1], i1));
        let (y0, y1) = rotate_pair_fast(a, b, t.c[j], t.s[j]);
        if let Some(narrow) = R::NARROW {
            let (sl, sm) = narrow.slack((y0, y1), a, b);
            slack = slack.min(sl);
            if narrow.min_normal > 0.0 {
                smallest = smallest.min(sm);
            }
        }
        R::put(&mut out[l0], &mut pending[l0], i0, y0);
        R::put(&mut out[l1], &mut pending[l1], i1, y1);
    });
    if R::NARROW.is_some_and(|narrow| slack < 0.0 || smallest < narrow.min_normal) {
        let orig = reload();
        unrolled(n, |j| {
            let ((l0, i0), (l1, i1)) = pair(j);
            let (a, b) = (R::get(&orig[l0], i0), R::get(&orig[l1], i1));
            // SAFETY: the caller's contract: `t` holds `n > j` entries loaded from `p`.
            let (c_lo, s_lo) = unsafe { t.residual::<B>(p, j) };
            let (y0, y1) = rotate_pair(a, b, (t.c[j], c_lo), (t.s[j], s_lo));
            R::put(&mut out[l0], &mut pending[l0], i0, y0);
            R::put(&mut out[l1], &mut pending[l1], i1, y1);
        });
    }
}

/// The rows one thread rotates: `count` heads of one token, head `h` at byte offset
/// `h * step` from the first.
#[derive(Clone, Copy)]
pub(crate) struct Rows {
    pub src: *const u8,
    pub dst: *mut u8,
    pub src_step: usize,
    pub dst_step: usize,
    pub count: usize,
}

impl Rows {
    /// The source address of byte `byte` of head `h`.
    #[inline(always)]
    pub fn src(&self, h: usize, byte: usize) -> *const u8 {
        self.src.wrapping_add(h * self.src_step + byte)
    }

    /// The destination address of byte `byte` of head `h`.
    #[inline(always)]
    pub fn dst(&self, h: usize, byte: usize) -> *mut u8 {
        self.dst.wrapping_add(h * self.dst_step + byte)
    }

    /// Copies the bits at byte `at` of every head, given head 0's (`first`, loaded early);
    /// the next head's load goes ahead of each store.
    ///
    /// # Safety
    /// As [`Io::load_raw`] and [`Io::store_raw`] for every head's source and destination.
    #[inline(always)]
    pub unsafe fn copy<C: Io>(&self, first: Bits, at: usize) {
        let mut cur = first;
        for h in 0..self.count {
            // SAFETY: the caller's contract, for heads `h` and `h + 1 < count`.
            let next = if h + 1 < self.count { unsafe { C::load_raw(self.src(h + 1, at)) } } else { cur };
            // SAFETY: as above.
            unsafe { C::store_raw(self.dst(h, at), cur) };
            cur = next;
        }
    }
}

/// Which elements form the pairs.
///
/// The methods' common contract (their `# Safety`): `lane` is a rotating lane of the launch's
/// geometry (its elements lie inside the rotary dims of every head of `rows`), every head of
/// `rows` lies inside its source and destination buffers with the alignment `R` needs, the
/// destination overlaps nothing else the launch touches, and the table holds row `pos`.
pub(crate) trait Style {
    /// Loads the bits of lane `lane` of head `h` of `rows`.
    ///
    /// # Safety
    /// The trait's contract.
    unsafe fn load<R: Io>(rows: &Rows, h: usize, lane: usize, half: usize) -> [Bits; 2];
    /// Loads the table entries of lane `lane` from the token's rows `rows`.
    ///
    /// # Safety
    /// The trait's contract.
    unsafe fn entries<R: Io, B: TableElem, P: PairRows>(lane: usize, rows: P, p: Table<'_>) -> Entries<P>;
    /// Rotates lane `lane` of every head of `rows` with its entries `t`, given head 0's data.
    /// The next head's loads are issued before the current head's stores, so two heads' loads
    /// are in flight.
    ///
    /// # Safety
    /// The trait's contract; `t` came from [`Style::entries`] for this lane and `p`.
    unsafe fn apply<R: Io, B: TableElem, P: PairRows>(
        rows: Rows,
        first: [Bits; 2],
        lane: usize,
        t: &Entries<P>,
        p: Table<'_>,
    );
    /// [`Style::entries`], then [`Style::apply`].
    ///
    /// # Safety
    /// The trait's contract.
    #[inline(always)]
    unsafe fn rotate<R: Io, B: TableElem, P: PairRows>(rows: Rows, first: [Bits; 2], lane: usize, at: P, p: Table<'_>) {
        // SAFETY: the caller's contract.
        unsafe {
            let t = Self::entries::<R, B, P>(lane, at, p);
            Self::apply::<R, B, P>(rows, first, lane, &t, p)
        }
    }
}

/// Rotate-half: pair `i` is `(x[i], x[i + half])`; a lane takes `E` pairs.
pub(crate) struct NeoX;
/// Interleaved: pair `i` is `(x[2i], x[2i + 1])`; a lane takes `E / 2` pairs.
pub(crate) struct GptJ;

impl Style for NeoX {
    #[inline(always)]
    unsafe fn load<R: Io>(rows: &Rows, h: usize, lane: usize, half: usize) -> [Bits; 2] {
        let i = lane * R::E;
        // SAFETY: the trait's contract: the lane's elements of both halves are in the row.
        unsafe { [R::load_raw(rows.src(h, i * R::SIZE)), R::load_raw(rows.src(h, (i + half) * R::SIZE))] }
    }

    #[inline(always)]
    unsafe fn entries<R: Io, B: TableElem, P: PairRows>(lane: usize, rows: P, p: Table<'_>) -> Entries<P> {
        // SAFETY: the trait's contract: the lane's `E` pairs are in the rows.
        unsafe { Entries::load::<B>(p, rows, lane * R::E, R::E) }
    }

    #[inline(always)]
    unsafe fn apply<R: Io, B: TableElem, P: PairRows>(
        rows: Rows,
        first: [Bits; 2],
        lane: usize,
        t: &Entries<P>,
        p: Table<'_>,
    ) {
        let half = p.view.half() as usize;
        let i = lane * R::E;
        let (lo, hi) = (i * R::SIZE, (i + half) * R::SIZE);
        let mut cur = first;
        for h in 0..rows.count {
            // SAFETY: the trait's contract, for heads `h` and
            // `h + 1 < count`; head `h` is reloaded only before its store.
            let next = if h + 1 < rows.count { unsafe { Self::load::<R>(&rows, h + 1, lane, half) } } else { cur };
            let mut y = [[0u32; 4]; 2];
            // SAFETY: as above.
            let reload = || unsafe { Self::load::<R>(&rows, h, lane, half) };
            // SAFETY: as above.
            unsafe { rotate_lane::<R, B, P>(t, p, R::E, &cur, &mut y, |j| ((0, j), (1, j)), reload) };
            // SAFETY: as above.
            unsafe {
                R::store_raw(rows.dst(h, lo), y[0]);
                R::store_raw(rows.dst(h, hi), y[1]);
            }
            cur = next;
        }
    }
}

impl Style for GptJ {
    #[inline(always)]
    unsafe fn load<R: Io>(rows: &Rows, h: usize, lane: usize, _: usize) -> [Bits; 2] {
        // SAFETY: the trait's contract: the lane's pairs are in the row.
        [unsafe { R::load_raw(rows.src(h, lane * R::E * R::SIZE)) }, [0; 4]]
    }

    #[inline(always)]
    unsafe fn entries<R: Io, B: TableElem, P: PairRows>(lane: usize, rows: P, p: Table<'_>) -> Entries<P> {
        // SAFETY: the trait's contract: the lane's `E / 2` pairs are in the rows.
        unsafe { Entries::load::<B>(p, rows, lane * R::E / 2, R::E / 2) }
    }

    #[inline(always)]
    unsafe fn apply<R: Io, B: TableElem, P: PairRows>(
        rows: Rows,
        first: [Bits; 2],
        lane: usize,
        t: &Entries<P>,
        p: Table<'_>,
    ) {
        let i = lane * R::E;
        let mut cur = first;
        for h in 0..rows.count {
            // SAFETY: the trait's contract, for heads `h` and
            // `h + 1 < count`; head `h` is reloaded only before its store.
            let next = if h + 1 < rows.count { unsafe { Self::load::<R>(&rows, h + 1, lane, 0) } } else { cur };
            let mut y = [[0u32; 4]; 2];
            // SAFETY: as above.
            let reload = || unsafe { Self::load::<R>(&rows, h, lane, 0) };
            // SAFETY: as above.
            unsafe { rotate_lane::<R, B, P>(t, p, R::E / 2, &cur, &mut y, |j| ((0, 2 * j), (0, 2 * j + 1)), reload) };
            // SAFETY: as above.
            unsafe { R::store_raw(rows.dst(h, i * R::SIZE), y[0]) };
            cur = next;
        }
    }
}
