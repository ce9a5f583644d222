//! The pairing styles ([`Style`]): NeoX's rotate-half, GPT-J's interleaved pairs, and GPT-J's
//! pairs written back de-interleaved.

use crate::gpu::{prefetch_l2, thread_idx, Bits, Io};
use crate::mem::sync_warp;
use crate::norm::NormLane;

use super::lanes::rotate_lane;
use super::quant::Quant;
use super::rows::Rows;
use super::source::{Entries, PairRows, Source, Table};

/// Which elements form the pairs.
///
/// The methods' common contract (their `# Safety`): `lane` is a rotating lane of the launch's
/// geometry (its elements lie inside the rotary dims of every head of `rows`), every head of
/// `rows` lies inside its source and destination buffers with the alignment `R` needs, the
/// destination overlaps nothing else the launch touches, and the table holds row `pos`.
pub(crate) trait Style {
    /// The pairs of a lane of accesses `R`.
    fn lane_pairs<R: Io>() -> usize;
    /// Where pair `j`'s two elements are in a lane's loaded bits, as (vector, index).
    fn pair_at<R: Io>(j: usize) -> ((usize, usize), (usize, usize));
    /// The dims of the head that pair `j` of lane `lane` takes (`half`: rotary_dim / 2).
    fn pair_dims<R: Io>(lane: usize, half: usize, j: usize) -> (usize, usize);
    /// Loads the bits of lane `lane` of head `h` of `rows`.
    ///
    /// # Safety
    /// The trait's contract.
    unsafe fn load<R: Io>(rows: &Rows, h: usize, lane: usize, half: usize) -> [Bits; 2];
    /// Asks the L2 cache for what [`Style::load`] would load of head `h`.
    ///
    /// # Safety
    /// The trait's contract.
    unsafe fn prefetch<R: Io>(rows: &Rows, h: usize, lane: usize, half: usize);
    /// Loads the table entries of lane `lane` from the token's rows `rows`.
    ///
    /// # Safety
    /// The trait's contract.
    unsafe fn entries<R: Io, B: Source, P: PairRows>(lane: usize, rows: P, p: Table<'_>) -> Entries<P>;
    /// Rotates lane `lane` of every head of `rows` with its entries `t`, given head 0's data
    /// (loaded by `R`; stored by `W`, of as many elements, converted as `quant` says where
    /// `W` stores FP8). The next head's loads are issued before the current head's stores,
    /// so two heads' loads are in flight.
    ///
    /// # Safety
    /// The trait's contract; `t` came from [`Style::entries`] for this lane and `p`; `quant`
    /// as [`Quant::scale`] for every head where `W` stores FP8.
    unsafe fn apply<R: Io, W: Io, B: Source, P: PairRows>(
        rows: Rows,
        first: [Bits; 2],
        lane: usize,
        t: &Entries<P>,
        p: Table<'_>,
        quant: Quant,
        norm: Option<&NormLane>,
    );
    /// [`Style::entries`], then [`Style::apply`].
    ///
    /// # Safety
    /// The trait's contract.
    #[inline(always)]
    unsafe fn rotate<R: Io, W: Io, B: Source, P: PairRows>(
        rows: Rows,
        first: [Bits; 2],
        lane: usize,
        at: P,
        p: Table<'_>,
        (quant, norm): (Quant, Option<&NormLane>),
    ) {
        // SAFETY: the caller's contract.
        unsafe {
            let t = Self::entries::<R, B, P>(lane, at, p);
            Self::apply::<R, W, B, P>(rows, first, lane, &t, p, quant, norm)
        }
    }
}

/// Rotate-half: pair `i` is `(x[i], x[i + half])`; a lane takes `E` pairs.
pub(crate) struct NeoX;
/// Interleaved: pair `i` is `(x[2i], x[2i + 1])`; a lane takes [`gptj_width`] elements: two
/// vectors (`E` pairs, as a NeoX lane), or one `Two` access (one pair) element by element.
pub(crate) struct GptJ;

/// Interleaved pairs written back de-interleaved: pair `i` read at `(x[2i], x[2i + 1])` as
/// [`GptJ`]'s lanes read it, its two values written at `i` and `half + i` (transformers'
/// `apply_rotary_pos_emb_interleave`, DeepSeek-V3's order): a lane of `E` pairs reads two
/// vectors and writes one vector of each half, as a [`NeoX`] lane. In place, a lane writes
/// where other lanes of its head read: the head's lanes (one warp's, aligned) wait for each
/// other between their loads and their stores. Vector lanes only (8 or 16 bytes).
pub(crate) struct Deinterleaved;

/// Elements of an interleaved lane for accesses of `R` ([`crate::params::gptj_lane`]: two
/// vectors where `R` is one; H200, bf16 16x4096 in place: 93.7% of copy from the table against
/// 91.5% with one vector, 94.6% against 87.3% computed).
#[inline(always)]
const fn gptj_width<R: Io>() -> usize {
    crate::params::gptj_lane(R::VECTOR, R::E)
}

impl Style for NeoX {
    #[inline(always)]
    fn lane_pairs<R: Io>() -> usize {
        R::E
    }

    #[inline(always)]
    fn pair_at<R: Io>(j: usize) -> ((usize, usize), (usize, usize)) {
        ((0, j), (1, j))
    }

    #[inline(always)]
    fn pair_dims<R: Io>(lane: usize, half: usize, j: usize) -> (usize, usize) {
        (lane * R::E + j, half + lane * R::E + j)
    }

    #[inline(always)]
    unsafe fn load<R: Io>(rows: &Rows, h: usize, lane: usize, half: usize) -> [Bits; 2] {
        let i = lane * R::E;
        // SAFETY: the trait's contract: the lane's elements of both halves are in the row.
        unsafe { [R::load_raw(rows.src(h, i * R::SIZE)), R::load_raw(rows.src(h, (i + half) * R::SIZE))] }
    }

    #[inline(always)]
    unsafe fn prefetch<R: Io>(rows: &Rows, h: usize, lane: usize, half: usize) {
        let i = lane * R::E;
        // SAFETY: as in `load`.
        unsafe {
            prefetch_l2(rows.src(h, i * R::SIZE));
            prefetch_l2(rows.src(h, (i + half) * R::SIZE));
        }
    }

    #[inline(always)]
    unsafe fn entries<R: Io, B: Source, P: PairRows>(lane: usize, rows: P, p: Table<'_>) -> Entries<P> {
        // SAFETY: the trait's contract: the lane's `E` pairs are in the rows.
        unsafe { Entries::load::<B>(p, rows, lane * R::E, R::E) }
    }

    #[inline(always)]
    unsafe fn apply<R: Io, W: Io, B: Source, P: PairRows>(
        rows: Rows,
        first: [Bits; 2],
        lane: usize,
        t: &Entries<P>,
        p: Table<'_>,
        quant: Quant,
        norm: Option<&NormLane>,
    ) {
        const { assert!(R::E == W::E) };
        // SAFETY: the trait's contract.
        unsafe { apply_halves::<Self, R, W, B, P, false>(rows, first, lane, t, p, quant, norm) }
    }
}

/// The rotation of [`NeoX`]'s lanes and of [`Deinterleaved`]'s (`S`, whose lanes read their
/// pairs where `S::pair_at` says): each lane's `E` pairs written as one access in each half of
/// the head, `i` and `half + i`. With `MEET`, in place, the head's lanes (`half / E` of them
/// from its first, inside one warp at a multiple of their slots: the host's mapping) meet
/// between their loads and their stores, since a lane writes where another reads.
///
/// # Safety
/// [`Style::apply`]'s contract; with `MEET`, in place, every lane of the head reaches the
/// stores of every head (none returns between).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn apply_halves<S: Style, R: Io, W: Io, B: Source, P: PairRows, const MEET: bool>(
    rows: Rows,
    first: [Bits; 2],
    lane: usize,
    t: &Entries<P>,
    p: Table<'_>,
    quant: Quant,
    norm: Option<&NormLane>,
) {
    let half = p.pairs.half() as usize;
    let i = lane * R::E;
    let (lo, hi) = (i * W::SIZE, (i + half) * W::SIZE);
    let meet = MEET && core::ptr::eq(rows.src, rows.dst as *const u8);
    let lanes = (half / R::E) as u32;
    let at = thread_idx().0 % 32 - lane as u32;
    let mask = if lanes >= 32 { u32::MAX } else { ((1u32 << lanes) - 1) << at };
    let mut cur = first;
    for h in 0..rows.count {
        // SAFETY: the trait's contract, for heads `h` and `h + 1 < count`; head `h` is
        // reloaded only before its store (in place with `MEET`, before any lane's store).
        let next = if h + 1 < rows.count { unsafe { S::load::<R>(&rows, h + 1, lane, half) } } else { cur };
        let mut y = [[0u32; 4]; 2];
        // SAFETY: as above.
        let reload = || unsafe { S::load::<R>(&rows, h, lane, half) };
        // SAFETY: as above.
        let q = unsafe { quant.of::<W>(h) };
        // SAFETY: the caller's contract: a norm's weights lie as the heads' elements do.
        let head = unsafe { NormLane::head::<S, R>(norm, h, lane, half) };
        // SAFETY: as above.
        unsafe {
            rotate_lane::<R, W, B, P>(
                t,
                p,
                R::E,
                (&cur, &mut y),
                (S::pair_at::<R>, |j| ((0, j), (1, j))),
                reload,
                (q, (head.as_ref(), NormLane::r_of_head(norm, h))),
            )
        };
        if meet {
            // SAFETY: the caller's contract: every lane of `mask` is here, for this head.
            unsafe { sync_warp(mask) };
        }
        // SAFETY: as above.
        unsafe {
            W::store_raw(rows.dst(h, lo), y[0]);
            W::store_raw(rows.dst(h, hi), y[1]);
        }
        cur = next;
    }
}

impl Style for GptJ {
    #[inline(always)]
    fn lane_pairs<R: Io>() -> usize {
        gptj_width::<R>() / 2
    }

    #[inline(always)]
    fn pair_at<R: Io>(j: usize) -> ((usize, usize), (usize, usize)) {
        let per = R::E / 2;
        let (v, k) = if gptj_width::<R>() > R::E && j >= per { (1, j - per) } else { (0, j) };
        ((v, 2 * k), (v, 2 * k + 1))
    }

    #[inline(always)]
    fn pair_dims<R: Io>(lane: usize, _: usize, j: usize) -> (usize, usize) {
        let d = lane * gptj_width::<R>() + 2 * j;
        (d, d + 1)
    }

    #[inline(always)]
    unsafe fn load<R: Io>(rows: &Rows, h: usize, lane: usize, _: usize) -> [Bits; 2] {
        let at = lane * gptj_width::<R>() * R::SIZE;
        // SAFETY: the trait's contract: the lane's pairs are in the row.
        unsafe {
            let second = if gptj_width::<R>() > R::E { R::load_raw(rows.src(h, at + R::E * R::SIZE)) } else { [0; 4] };
            [R::load_raw(rows.src(h, at)), second]
        }
    }

    #[inline(always)]
    unsafe fn prefetch<R: Io>(rows: &Rows, h: usize, lane: usize, _: usize) {
        let at = lane * gptj_width::<R>() * R::SIZE;
        // SAFETY: as in `load`.
        unsafe {
            prefetch_l2(rows.src(h, at));
            if gptj_width::<R>() > R::E {
                prefetch_l2(rows.src(h, at + R::E * R::SIZE));
            }
        }
    }

    #[inline(always)]
    unsafe fn entries<R: Io, B: Source, P: PairRows>(lane: usize, rows: P, p: Table<'_>) -> Entries<P> {
        let pairs = gptj_width::<R>() / 2;
        // SAFETY: the trait's contract: the lane's pairs are in the rows.
        unsafe { Entries::load::<B>(p, rows, lane * pairs, pairs) }
    }

    #[inline(always)]
    unsafe fn apply<R: Io, W: Io, B: Source, P: PairRows>(
        rows: Rows,
        first: [Bits; 2],
        lane: usize,
        t: &Entries<P>,
        p: Table<'_>,
        quant: Quant,
        norm: Option<&NormLane>,
    ) {
        const { assert!(R::E == W::E) };
        let width = gptj_width::<R>();
        let at = lane * width * W::SIZE;
        // Pair `j` of the lane: in the first vector, or (two vectors) the second.
        let pair = Self::pair_at::<R>;
        let mut cur = first;
        for h in 0..rows.count {
            // SAFETY: the trait's contract, for heads `h` and
            // `h + 1 < count`; head `h` is reloaded only before its store.
            let next = if h + 1 < rows.count { unsafe { Self::load::<R>(&rows, h + 1, lane, 0) } } else { cur };
            let mut y = [[0u32; 4]; 2];
            // SAFETY: as above.
            let reload = || unsafe { Self::load::<R>(&rows, h, lane, 0) };
            // SAFETY: as above.
            let q = unsafe { quant.of::<W>(h) };
            // SAFETY: the trait's contract: a norm's weights lie as the heads' elements do.
            let head = unsafe { NormLane::head::<Self, R>(norm, h, lane, 0) };
            // SAFETY: as above.
            unsafe {
                rotate_lane::<R, W, B, P>(
                    t,
                    p,
                    width / 2,
                    (&cur, &mut y),
                    (pair, pair),
                    reload,
                    (q, (head.as_ref(), NormLane::r_of_head(norm, h))),
                )
            };
            // SAFETY: as above.
            unsafe {
                W::store_raw(rows.dst(h, at), y[0]);
                if width > R::E {
                    W::store_raw(rows.dst(h, at + R::E * W::SIZE), y[1]);
                }
            }
            cur = next;
        }
    }
}

impl Style for Deinterleaved {
    #[inline(always)]
    fn lane_pairs<R: Io>() -> usize {
        GptJ::lane_pairs::<R>()
    }

    #[inline(always)]
    fn pair_at<R: Io>(j: usize) -> ((usize, usize), (usize, usize)) {
        GptJ::pair_at::<R>(j)
    }

    #[inline(always)]
    fn pair_dims<R: Io>(lane: usize, half: usize, j: usize) -> (usize, usize) {
        GptJ::pair_dims::<R>(lane, half, j)
    }

    #[inline(always)]
    unsafe fn load<R: Io>(rows: &Rows, h: usize, lane: usize, half: usize) -> [Bits; 2] {
        // SAFETY: the trait's contract.
        unsafe { GptJ::load::<R>(rows, h, lane, half) }
    }

    #[inline(always)]
    unsafe fn prefetch<R: Io>(rows: &Rows, h: usize, lane: usize, half: usize) {
        // SAFETY: the trait's contract.
        unsafe { GptJ::prefetch::<R>(rows, h, lane, half) }
    }

    #[inline(always)]
    unsafe fn entries<R: Io, B: Source, P: PairRows>(lane: usize, rows: P, p: Table<'_>) -> Entries<P> {
        // SAFETY: the trait's contract.
        unsafe { GptJ::entries::<R, B, P>(lane, rows, p) }
    }

    #[inline(always)]
    unsafe fn apply<R: Io, W: Io, B: Source, P: PairRows>(
        rows: Rows,
        first: [Bits; 2],
        lane: usize,
        t: &Entries<P>,
        p: Table<'_>,
        quant: Quant,
        norm: Option<&NormLane>,
    ) {
        const { assert!(R::E == W::E && R::VECTOR && gptj_width::<R>() == 2 * R::E) };
        // SAFETY: the trait's contract; the host launches this style in place only with a
        // head's lanes inside one warp, all rotating, each reaching the stores for every head
        // (one token's, none returns between).
        unsafe { apply_halves::<Self, R, W, B, P, true>(rows, first, lane, t, p, quant, norm) }
    }
}
