//! The body of the KV shift's entry points (`shift_…`, [`ShiftParams`]): the cached keys of the
//! named rows rotated in place by their sequence's position delta. Thread mapping only: the
//! block's prologue is the computed source's (each of the block's sequences is a "token" whose
//! "position" is its `|Δ|`, [`DeltaRow`]), the rotation [`crate::rotate`]'s.

use crate::fp8::Fp8;
use crate::gpu::{block_dim, block_idx, thread_idx, Io};
use crate::params::{block_tokens, shift_heads_per_thread, work_item, ShiftParams};
use crate::rotate::{BlockInputs, Computed, OneLoad, OneRow, Prologue, Quant, Rows, Source, Style, Table};
use crate::views::{ComputedView, PositionsView, SlotOf};

/// The shift's stage of the block prologue's rows: sequence `token`'s `|Δ|` (`Δ` one id per
/// sequence) as its position. `i64::MIN` (no absolute value) reads as `i64::MAX`, which the
/// range check refuses.
#[derive(Clone, Copy, Default)]
pub(crate) struct AbsDelta;

impl OneLoad for AbsDelta {
    #[inline(always)]
    unsafe fn load(positions: &PositionsView, token: u32, _: u32, _: u32) -> i64 {
        // SAFETY: the caller's contract: the deltas hold sequence `token`'s.
        let delta = unsafe { positions.load_one(token, 0, 0) };
        delta.checked_abs().unwrap_or(i64::MAX)
    }
}

/// A sequence's pairs, every one at its `|Δ|`.
type DeltaRow = OneRow<AbsDelta>;

/// The block prologue of the shift's source (the computed one).
type ShiftPrologue = <Computed as Source>::Prologue;

/// Rotates lane `lane` of a group of kv heads of one named row by its sequence's `Δ`, in
/// place: `R` loads and `W` stores the cache's type (FP8: the code's value times the head's
/// scale, rotated in f32, encoded once as the append encodes, [`crate::rotate`]'s lanes).
///
/// # Safety
/// The host checked that every named row (a paged cache's slots in range, a contiguous one's
/// `first_row + seq` within its block) lies inside the key cache's buffer, aligned for `R`,
/// that the deltas hold `rows / seq` entries and the slots `rows`, that the scales hold the
/// cache's (FP8), that the written keys overlap nothing else the launch reads, that the named
/// rows are distinct slots, that the source is computed with the frequencies of `half` pairs,
/// that there is work, and that the launch has [`ShiftParams::shared`] of dynamic shared
/// memory.
#[inline(always)]
pub(crate) unsafe fn shift<S: Style, R: Io, W: Io>(p: &ShiftParams) {
    const { assert!(R::SIZE == W::SIZE && R::E == W::E && R::FP8 == W::FP8) };
    // SAFETY: the host never launches without work.
    unsafe {
        core::hint::assert_unchecked(p.items_div.divisor != 0);
        core::hint::assert_unchecked(p.seq_div.divisor != 0);
        core::hint::assert_unchecked(p.lanes_div.divisor != 0);
        core::hint::assert_unchecked(p.chunk != 0);
        core::hint::assert_unchecked(p.cache.block_size() != 0);
    }
    let (block, bd) = (block_idx(), block_dim().0);
    let item = work_item(block, bd, thread_idx().0, p.items_div, p.chunk, p.rows);
    // Threads past the end still take part in the block's prologue.
    let (r, w) = item.unwrap_or((0, 0));
    let (b, s) = p.seq_div.divmod(r);
    // The thread's heads: `count` from `h0` (an item's group starts inside the row; the host
    // maps items with the same constant).
    let group = shift_heads_per_thread(R::VECTOR, W::FP8);
    let (g, lane) = p.lanes_div.divmod(w);
    let h0 = g * group;
    let count = group.min(p.heads.saturating_sub(h0)).max(1) as usize;
    let half = p.pairs.half() as usize;
    // The slot's and the delta's loads first: nothing waits on them to be issued.
    // SAFETY: the slots hold an entry per row, the deltas one per sequence.
    let raw = item.map(|_| unsafe { (p.cache.raw_slot(r), p.deltas.load_one(b, 0, 0)) });
    let slot = raw.and_then(|(raw_slot, _)| match p.cache.slot(|| b, p.first_row + s, raw_slot) {
        SlotOf::Slot(n) => Some(n),
        SlotOf::Skip => None,
        SlotOf::OutOfRange(v) => {
            // The row's first item reports.
            if w == 0 {
                // SAFETY: `errors` points at this launch's records.
                unsafe { p.errors.slot(r, v) };
            }
            None
        }
    });
    let at = slot.map_or(0, |n| p.cache.row(n, h0 as u64)) as usize * R::SIZE;
    let k = (p.cache.k() as *mut u8).wrapping_add(at);
    let step = p.cache.head_stride() as usize * R::SIZE;
    let rows = Rows { src: k as *const u8, dst: k, src_step: step, dst_step: step, count };
    // The first head's data and its scale, while the block's cos and sin are computed; the
    // later heads asked of the L2 cache (no register held), loaded one ahead in the stores'
    // loop.
    let first = match slot {
        Some(_) => {
            // SAFETY: the host checked the named rows: the lane's elements of every head of
            // the row lie in the cache.
            unsafe {
                let first = S::load::<R>(&rows, 0, lane as usize, half);
                for h in 1..count {
                    S::prefetch::<R>(&rows, h, lane as usize, half);
                }
                first
            }
        }
        None => [[0; 4]; 2],
    };
    let fmt = if W::FP8 { p.cache.types().0.fp8().unwrap_or(Fp8::E4M3) } else { Fp8::E4M3 };
    let quant = match slot {
        Some(_) if W::FP8 => {
            let (scale, step) = p.scales.head(false, h0 as u64);
            // SAFETY: the host checked the scales: one f32, or one per kv head.
            unsafe { Quant::new::<W>(fmt, scale as *const f32, step as usize) }
        }
        _ => Quant::NONE,
    };
    // The block's sequences: its rows' first and last.
    let (first_row, count) = block_tokens(block, bd, p.items_div, p.chunk, p.rows);
    let sequences = match count {
        0 => (0, 0),
        _ => {
            let f = p.seq_div.div(first_row);
            (f, p.seq_div.div(first_row + count - 1) - f + 1)
        }
    };
    let inputs = BlockInputs {
        can_stage: false,
        tokens: sequences,
        source: &p.source,
        pairs: &p.pairs,
        positions: &p.deltas,
        divmod: |t| (t, 0),
        base: core::intrinsics::gpu::gpu_launch_sized_workgroup_mem::<u8>(),
        layout: |_: &ComputedView| p.shared(bd),
    };
    // SAFETY: the host gives every launch `ShiftParams::shared` of shared memory (16-byte
    // aligned), the deltas hold every sequence's entry and the frequencies `half` pairs; every
    // thread of the block is here.
    let block_rows = unsafe {
        let start = <ShiftPrologue as Prologue>::start::<DeltaRow, _, _>(&inputs);
        <ShiftPrologue as Prologue>::fill::<DeltaRow, _, _>(&inputs, start, true)
    };
    let Some((_, delta)) = raw else { return };
    let Some(d) = p.deltas.check(delta.checked_abs().unwrap_or(i64::MAX)) else {
        // The sequence's rows stay as they are; its first row's first item reports.
        if s == 0 && w == 0 {
            // SAFETY: `errors` points at this launch's records.
            unsafe { p.errors.position(b, delta) };
        }
        return;
    };
    let Some(_) = slot else { return };
    if d == 0 {
        return;
    }
    let table = Table {
        src: &p.source,
        pairs: &p.pairs,
        sin_sign: if delta < 0 { -1.0 } else { 1.0 },
        row: <ShiftPrologue as Prologue>::row(block_rows, b),
    };
    let at = DeltaRow::at(d);
    macro_rules! rotate {
        ($quant:expr) => {
            S::rotate::<R, W, Computed, DeltaRow>(rows, first, lane as usize, at, table, ($quant, None))
        };
    }
    // SAFETY: the row's sequence is one of the block's, its `|Δ|` passed the check (its block
    // row filled before the prologue's barrier); the rest as above. In place: the lane writes
    // only the elements it read (and reloads them only before its store). FP8: a copy of the
    // rotation per format, each decoding and encoding with its format's instructions alone.
    unsafe {
        if W::FP8 && quant.fmt == Fp8::E5M2 {
            rotate!(quant.with_fmt(Fp8::E5M2))
        } else if W::FP8 {
            rotate!(quant.with_fmt(Fp8::E4M3))
        } else {
            rotate!(quant)
        }
    }
}
