//! `extern "ptx-kernel"` entry points: thread-to-work mapping only (see [`RopeParams`]).

use crate::gpu::{
    atomic_add_u64, atomic_min_u64, block_dim, block_idx, load_elem_nc, load_i32, load_i64, load_table, thread_idx,
    Bf16, Bits, Elem, Io, Lane, One, Two, Vec16, F16, F32,
};
use crate::math::{rotate_pair, rotate_pair_fast};
use crate::params::{groups, heads_per_thread, position_mode, work_item, ErrorRecord, RopeParams};

/// The cos/sin tables a kernel's parameters name.
pub(crate) trait Tables {
    /// Device addresses of the cosines, sines and their residuals (the latter only read by
    /// [`F32Table`] kernels).
    fn tables(&self) -> [u64; 4];
    /// Pairs per table row.
    fn half(&self) -> u32;
    /// `1.0`, or `-1.0` for the inverse rotation.
    fn sin_sign(&self) -> f32;
}

impl Tables for RopeParams {
    #[inline(always)]
    fn tables(&self) -> [u64; 4] {
        [self.cos, self.sin, self.cos_lo, self.sin_lo]
    }
    #[inline(always)]
    fn half(&self) -> u32 {
        self.half
    }
    #[inline(always)]
    fn sin_sign(&self) -> f32 {
        self.sin_sign
    }
}

/// How table entries are stored.
pub(crate) trait TableElem {
    /// Loads `n` entries at entry index `at` of the table at `base`.
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
        load_table((base as *const f32).wrapping_add(at), n)
    }
}

impl<T: Elem> TableElem for ElemTable<T> {
    const RESIDUALS: bool = false;
    #[inline(always)]
    unsafe fn load(base: u64, at: usize, n: usize) -> Lane {
        let mut v = [0.0f32; 8];
        unrolled(n, |j| v[j] = T::widen(load_elem_nc::<T>((base as *const u8).wrapping_add((at + j) * T::SIZE))));
        v
    }
}

/// The table entries of one lane: `n` pairs' cos and sin, the sine's sign set for the
/// direction.
pub(crate) struct Entries {
    c: Lane,
    s: Lane,
    /// Where the lane's entries start, for the residuals.
    at: usize,
}

impl Entries {
    /// No entries (for lanes that do not rotate).
    #[inline(always)]
    pub(crate) fn none() -> Entries {
        Entries { c: [0.0; 8], s: [0.0; 8], at: 0 }
    }

    /// Loads `n` entries from pair `i` of the table row of position `pos`.
    #[inline(always)]
    unsafe fn load<B: TableElem>(p: &impl Tables, pos: usize, i: usize, n: usize) -> Entries {
        let at = pos * p.half() as usize + i;
        let [cos, sin, ..] = p.tables();
        let mut s = B::load(sin, at, n);
        for v in s.iter_mut().take(n) {
            *v *= p.sin_sign();
        }
        Entries { c: B::load(cos, at, n), s, at }
    }

    /// The residuals `(cos_lo, sin_lo)` of entry `j`, one at a time (few registers: this
    /// is the rare path).
    #[inline(always)]
    unsafe fn residual<B: TableElem>(&self, p: &impl Tables, j: usize) -> (f32, f32) {
        if !B::RESIDUALS {
            return (0.0, 0.0);
        }
        let [_, _, cos_lo, sin_lo] = p.tables();
        let c = load_table((cos_lo as *const f32).wrapping_add(self.at + j), 1)[0];
        let s = load_table((sin_lo as *const f32).wrapping_add(self.at + j), 1)[0];
        (c, s * p.sin_sign())
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
#[inline(always)]
unsafe fn rotate_lane<R: Io, B: TableElem>(
    t: &Entries,
    p: &impl Tables,
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
            let (c_lo, s_lo) = t.residual::<B>(p, j);
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
    #[inline(always)]
    pub fn src(&self, h: usize, byte: usize) -> *const u8 {
        self.src.wrapping_add(h * self.src_step + byte)
    }

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
            let next = if h + 1 < self.count { C::load_raw(self.src(h + 1, at)) } else { cur };
            C::store_raw(self.dst(h, at), cur);
            cur = next;
        }
    }
}

/// Which elements form the pairs.
pub(crate) trait Style {
    /// Loads the bits of lane `lane` of head `h` of `rows`.
    unsafe fn load<R: Io>(rows: &Rows, h: usize, lane: usize, half: usize) -> [Bits; 2];
    /// Loads the table entries of lane `lane` at position `pos`.
    unsafe fn entries<R: Io, B: TableElem>(lane: usize, pos: usize, p: &impl Tables) -> Entries;
    /// Rotates lane `lane` of every head of `rows` with its entries `t`, given head 0's data.
    /// The next head's loads are issued before the current head's stores, so two heads' loads
    /// are in flight.
    unsafe fn apply<R: Io, B: TableElem>(rows: Rows, first: [Bits; 2], lane: usize, t: &Entries, p: &impl Tables);
    /// [`Style::entries`], then [`Style::apply`].
    #[inline(always)]
    unsafe fn rotate<R: Io, B: TableElem>(rows: Rows, first: [Bits; 2], lane: usize, pos: usize, p: &impl Tables) {
        let t = Self::entries::<R, B>(lane, pos, p);
        Self::apply::<R, B>(rows, first, lane, &t, p)
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
        [R::load_raw(rows.src(h, i * R::SIZE)), R::load_raw(rows.src(h, (i + half) * R::SIZE))]
    }

    #[inline(always)]
    unsafe fn entries<R: Io, B: TableElem>(lane: usize, pos: usize, p: &impl Tables) -> Entries {
        Entries::load::<B>(p, pos, lane * R::E, R::E)
    }

    #[inline(always)]
    unsafe fn apply<R: Io, B: TableElem>(rows: Rows, first: [Bits; 2], lane: usize, t: &Entries, p: &impl Tables) {
        let half = p.half() as usize;
        let i = lane * R::E;
        let (lo, hi) = (i * R::SIZE, (i + half) * R::SIZE);
        let mut cur = first;
        for h in 0..rows.count {
            let next = if h + 1 < rows.count { Self::load::<R>(&rows, h + 1, lane, half) } else { cur };
            let mut y = [[0u32; 4]; 2];
            let reload = || Self::load::<R>(&rows, h, lane, half);
            rotate_lane::<R, B>(t, p, R::E, &cur, &mut y, |j| ((0, j), (1, j)), reload);
            R::store_raw(rows.dst(h, lo), y[0]);
            R::store_raw(rows.dst(h, hi), y[1]);
            cur = next;
        }
    }
}

impl Style for GptJ {
    #[inline(always)]
    unsafe fn load<R: Io>(rows: &Rows, h: usize, lane: usize, _: usize) -> [Bits; 2] {
        [R::load_raw(rows.src(h, lane * R::E * R::SIZE)), [0; 4]]
    }

    #[inline(always)]
    unsafe fn entries<R: Io, B: TableElem>(lane: usize, pos: usize, p: &impl Tables) -> Entries {
        Entries::load::<B>(p, pos, lane * R::E / 2, R::E / 2)
    }

    #[inline(always)]
    unsafe fn apply<R: Io, B: TableElem>(rows: Rows, first: [Bits; 2], lane: usize, t: &Entries, p: &impl Tables) {
        let i = lane * R::E;
        let mut cur = first;
        for h in 0..rows.count {
            let next = if h + 1 < rows.count { Self::load::<R>(&rows, h + 1, lane, 0) } else { cur };
            let mut y = [[0u32; 4]; 2];
            let reload = || Self::load::<R>(&rows, h, lane, 0);
            rotate_lane::<R, B>(t, p, R::E / 2, &cur, &mut y, |j| ((0, 2 * j), (0, 2 * j + 1)), reload);
            R::store_raw(rows.dst(h, i * R::SIZE), y[0]);
            cur = next;
        }
    }
}

/// The position of token `token` (batch `b`, index `s`), before the range check, from the
/// positions at `positions` read as `mode` says.
#[inline(always)]
pub(crate) unsafe fn position(mode: u32, positions: u64, token: u32, b: u32, s: u32) -> i64 {
    match mode {
        position_mode::IDS_I32 => load_i32((positions as *const i32).add(token as usize)) as i64,
        position_mode::IDS_I64 => load_i64((positions as *const i64).add(token as usize)),
        position_mode::OFFSETS_I32 => load_i32((positions as *const i32).add(b as usize)) as i64 + s as i64,
        position_mode::OFFSETS_I64 => load_i64((positions as *const i64).add(b as usize)).wrapping_add(s as i64),
        _ => s as i64,
    }
}

/// RoPE of one lane of a group of up to `G` heads of one token: `R` moves the rotating lanes,
/// `C` the copying ones.
///
/// # Safety
/// The host checked that every row of both views lies inside its buffer, that outputs do
/// not overlap anything else the launch touches, that the table holds `max_position` rows of
/// `half` pairs, that addresses are aligned for `R` and `C`, and that the geometry was made
/// with this kernel's `G`.
#[inline(always)]
unsafe fn rope<S: Style, R: Io, C: Io, const G: usize>(p: &RopeParams) {
    let lanes = p.rot_lanes + p.copy_lanes;
    let (gq, gk) = (groups(p.q.heads, G as u32), groups(p.k.heads, G as u32));
    let items = (gq + gk) * lanes;
    // SAFETY: the host never launches without work (at most 2^31 items) or with `seq == 0`.
    core::hint::assert_unchecked(lanes != 0);
    core::hint::assert_unchecked(gq + gk != 0);
    core::hint::assert_unchecked(items != 0);
    core::hint::assert_unchecked(p.seq != 0);
    let Some((token, work)) = work_item(block_idx(), block_dim().0, thread_idx().0, items, p.chunk, p.tokens) else {
        return;
    };
    let (b, s) = (token / p.seq, token % p.seq);
    let (group, lane) = (work / lanes, work % lanes);
    let (view, h0, heads) =
        if group < gq { (&p.q, group * G as u32, p.q.heads) } else { (&p.k, (group - gq) * G as u32, p.k.heads) };
    let (b, s, h0) = (b as u64, s as u64, h0 as u64);
    let rows = Rows {
        src: (view.input as *const u8).wrapping_add(view.in_offset(b, s, h0) as usize * R::SIZE),
        dst: (view.output as *mut u8).wrapping_add(view.out_offset(b, s, h0) as usize * R::SIZE),
        src_step: view.in_strides[2] as usize * R::SIZE,
        dst_step: view.out_strides[2] as usize * R::SIZE,
        count: (heads - h0 as u32).min(G as u32) as usize,
    };
    // SAFETY: just computed; lets the compiler drop the head loop where G is 1.
    core::hint::assert_unchecked(rows.count >= 1 && rows.count <= G);
    // The first head's data does not depend on the position: load it before the position
    // (and the table entries that depend on it) arrive.
    let rotating = lane < p.rot_lanes;
    let first = if rotating { S::load::<R>(&rows, 0, lane as usize, p.half as usize) } else { [[0; 4]; 2] };
    // A copying lane's first head likewise.
    let copy_at = if rotating { 0 } else { (2 * p.half as usize + (lane - p.rot_lanes) as usize * C::E) * C::SIZE };
    let first_copy = if rotating { [0; 4] } else { C::load_raw(rows.src(0, copy_at)) };
    let pos = position(p.position_mode, p.positions, token, b as u32, s as u32);
    if pos < 0 || pos >= p.max_position as i64 {
        // Skip the token; one thread per token reports it.
        if work == 0 {
            let record = p.error as *mut ErrorRecord;
            atomic_min_u64(&raw mut (*record).key, ErrorRecord::key(token, pos));
            atomic_add_u64(&raw mut (*record).count, 1);
        }
        return;
    }
    if rotating {
        S::rotate::<R, F32Table>(rows, first, lane as usize, pos as usize, p);
    } else {
        // Dims past rotary_dim, out of place: copy the bits.
        rows.copy::<C>(first_copy, copy_at);
    }
}

/// Defines one entry point per (style, dtype, width). `_v`: 16-byte accesses, the measured
/// heads per thread ([`heads_per_thread`]); `_p`: 16-byte accesses, one head per thread (in
/// place on heads whose rows share cache lines); `_s`: scalar.
macro_rules! rope_kernels {
    ($($name:ident: $style:ty, $rot:ty, $copy:ty, $g:expr;)*) => {$(
        /// RoPE entry point; see [`RopeParams`] for the mapping and [`rope`] for the contract.
        ///
        /// # Safety
        /// Launched only by the host library, after its checks.
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(p: RopeParams) {
            const G: usize = $g as usize;
            rope::<$style, $rot, $copy, G>(&p)
        }
    )*};
}

const NEOX4: u32 = heads_per_thread(true, true, 4);
const NEOX2: u32 = heads_per_thread(true, true, 2);
const GPTJ4: u32 = heads_per_thread(true, false, 4);
const GPTJ2: u32 = heads_per_thread(true, false, 2);

rope_kernels! {
    rope_neox_f32_v: NeoX, Vec16<F32>, Vec16<F32>, NEOX4;
    rope_neox_f32_p: NeoX, Vec16<F32>, Vec16<F32>, 1;
    rope_neox_f32_s: NeoX, One<F32>, One<F32>, 1;
    rope_neox_f16_v: NeoX, Vec16<F16>, Vec16<F16>, NEOX2;
    rope_neox_f16_p: NeoX, Vec16<F16>, Vec16<F16>, 1;
    rope_neox_f16_s: NeoX, One<F16>, One<F16>, 1;
    rope_neox_bf16_v: NeoX, Vec16<Bf16>, Vec16<Bf16>, NEOX2;
    rope_neox_bf16_p: NeoX, Vec16<Bf16>, Vec16<Bf16>, 1;
    rope_neox_bf16_s: NeoX, One<Bf16>, One<Bf16>, 1;
    rope_gptj_f32_v: GptJ, Vec16<F32>, Vec16<F32>, GPTJ4;
    rope_gptj_f32_p: GptJ, Vec16<F32>, Vec16<F32>, 1;
    rope_gptj_f32_s: GptJ, Two<F32>, One<F32>, 1;
    rope_gptj_f16_v: GptJ, Vec16<F16>, Vec16<F16>, GPTJ2;
    rope_gptj_f16_p: GptJ, Vec16<F16>, Vec16<F16>, 1;
    rope_gptj_f16_s: GptJ, Two<F16>, One<F16>, 1;
    rope_gptj_bf16_v: GptJ, Vec16<Bf16>, Vec16<Bf16>, GPTJ2;
    rope_gptj_bf16_p: GptJ, Vec16<Bf16>, Vec16<Bf16>, 1;
    rope_gptj_bf16_s: GptJ, Two<Bf16>, One<Bf16>, 1;
}
