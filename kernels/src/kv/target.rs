//! The KV append's target stage: the block's prologue (the computed source's rows of cos and
//! sin), the token's position and slot (settled by the block's scan, or loaded with the
//! norm's statistic computed while they are in flight), the loads that wait for the rows, the
//! rotating lane's entries; then the store stage.

use super::scan::{block_scan, scan_loads, shared_target};
use super::{checked, lane::Lane, settle, store, table};
use crate::gpu::{Bits, Io};
use crate::norm::NormLane;
use crate::norm_lane::NormStage;
use crate::params::{KvParams, SharedLayout};
use crate::rotate::{BlockInputs, Entries, PairRows, Prologue, Quant, Rows, Source, Style};
use crate::views::ComputedView;

/// The target stage of [`super::kv_append`] for the lane `l` (`shared`: the block settles
/// duplicate slots; `late`: the first head's loads wait for the block's rows; `report`: which
/// errors the lane records), with the prologue's `inputs`, the lane's `entries` so far (the
/// caller's tables' before the scan) and the norm's statistic `norm_of`, which every thread of
/// the block reaches here; ends in [`store::stage`] for the lanes that write.
///
/// # Safety
/// As [`super::kv_append`]'s; every thread of the block calls it, `inputs` of this launch.
#[rustc_force_inline]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn stage<
    S: Style,
    R: Io,
    W: Io,
    C: Io,
    D: Io,
    B: Source,
    P: PairRows,
    N: NormStage,
    const G: usize,
    F: Fn(u32) -> (u32, u32),
    L: Fn(&ComputedView) -> SharedLayout,
>(
    p: &KvParams,
    l: Lane,
    (shared, late, report): (bool, bool, (bool, bool)),
    inputs: &BlockInputs<'_, F, L>,
    mut entries: Entries<P>,
    norm_of: impl Fn() -> NormLane,
    rows: Rows,
    (first, first_copy): ([Bits; 2], Bits),
    quant: Quant,
) {
    let (t, item) = (l.t, l.item);
    let (block_rows, target, norm) = if shared {
        // The scan's loads first; then the prologue between the scan's barriers (or, from the
        // caller's tables, the rotating items' entries before the scan).
        // SAFETY: the host checked the positions' and slot mapping's lengths.
        let loaded = unsafe { scan_loads::<P>(p) };
        if !B::Prologue::BARRIERS && item.is_some() && l.rotating {
            // SAFETY: `t` is a token of the launch.
            let own = unsafe { P::load(&p.positions, t, l.b as u32, l.s as u32) };
            if let Some(pos) = p.positions.check(own) {
                // SAFETY: the positions view admits only rows of the table; `pos` passed its
                // check.
                entries = unsafe { S::entries::<R, B, P>(l.lane, P::of(&p.positions, t, pos), table(p, 0)) };
            }
        }
        // SAFETY: the host gives the scanning kernels `KvParams::shared` of shared memory,
        // the positions buffer holds every token's entry, and the frequencies `half` pairs;
        // every thread of the block reaches the prologue and the scan (none has returned); the
        // prologue's first stores go before the scan's first barrier, its rows are read after
        // the second.
        let (scan, rows) = unsafe {
            let start = B::Prologue::start::<P, _, _>(inputs);
            block_scan::<P, _>(p, loaded, || B::Prologue::fill::<P, _, _>(inputs, start, false))
        };
        // Every thread of the block is here.
        let norm = if N::ON { norm_of() } else { NormLane::OFF };
        if item.is_none() {
            return;
        }
        // SAFETY: `t` is one of the block's tokens.
        (rows, unsafe { shared_target(p, &scan, t, !l.is_q, report) }, norm)
    } else {
        // SAFETY: as above, with the shared memory the host gives the kernels that do not
        // scan; the prologue holds its own barriers.
        let rows = unsafe {
            let start = B::Prologue::start::<P, _, _>(inputs);
            B::Prologue::fill::<P, _, _>(inputs, start, true)
        };
        if !N::ON && item.is_none() {
            return;
        }
        // The position's and slot's loads, then the norm's statistic while they are in flight
        // (every thread of the block is here), then their checks.
        // SAFETY: `t` is a token of the launch.
        let raw = item.map(|_| unsafe {
            let raw_slot = if l.is_q { 0 } else { p.cache.raw_slot(t) };
            (raw_slot, P::load(&p.positions, t, l.b as u32, l.s as u32))
        });
        let norm = if N::ON { norm_of() } else { NormLane::OFF };
        let Some((raw_slot, raw_pos)) = raw else { return };
        // SAFETY: `errors` points at this launch's records.
        let target = unsafe {
            match l.is_q {
                true => checked(p, t, raw_pos, report.0).map(|pos| (pos, 0)),
                false => settle(p, t, raw_pos, raw_slot, report),
            }
        };
        (rows, target, norm)
    };
    let Some((pos, n)) = target else { return };
    // SAFETY: as the loads above.
    let (first, first_copy) = if late { unsafe { l.load::<S, R, C>(&rows) } } else { (first, first_copy) };
    // SAFETY: as decoded.
    unsafe { core::hint::assert_unchecked(l.count >= 1 && l.count <= G) };
    let row = B::Prologue::row(block_rows, l.t);
    if l.rotating && (B::Prologue::BARRIERS || !shared) {
        // Without the scan the caller's table loads overlap the owner check.
        // SAFETY: the positions view admits only rows of the table; `pos` passed its check;
        // the block's rows were filled before a barrier.
        entries = unsafe { S::entries::<R, B, P>(l.lane, P::of(&p.positions, l.t, pos), table(p, row)) };
    }
    // SAFETY: the item's rows and slot `n` as the host checked them; the scan or the owner
    // array settles which token writes the slot.
    unsafe {
        store::stage::<S, R, W, C, D, B, P, N>(p, l, (n, shared), (first, first_copy), &entries, row, quant, &norm)
    };
}
