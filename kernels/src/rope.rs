//! The body of the RoPE entry points: thread-to-work mapping only (see [`RopeParams`]); the
//! rotation itself is [`crate::rotate`]'s.

use crate::gpu::{block_dim, block_idx, thread_idx, Io};
use crate::norm_lane::{LaneAt, NormStage, Whole};
use crate::params::{block_tokens, groups, work_item, RopeParams};
use crate::rotate::{BlockInputs, PairRows, Prologue, Quant, Rows, Source, Style, Table};
use crate::tuning::ROPE_16BIT_LOADS_BEFORE_FILL;
use crate::views::ComputedView;

/// Tells the compiler what the host guarantees of every launch: lanes, slots (at least the
/// lanes), groups and items, k's first group past q's, `seq`.
///
/// # Safety
/// The host never launches without work (at most 2^31 items) or with `seq == 0`.
#[inline(always)]
unsafe fn assume_launch(p: &RopeParams, lanes: u32, slots: u32, (gq, gk, k_group): (u32, u32, u32), items: u32) {
    // SAFETY: the caller's contract.
    unsafe {
        core::hint::assert_unchecked(lanes != 0);
        core::hint::assert_unchecked(slots != 0 && slots >= lanes);
        core::hint::assert_unchecked(gq + gk != 0);
        core::hint::assert_unchecked(items != 0);
        core::hint::assert_unchecked(k_group >= gq);
        core::hint::assert_unchecked(p.seq != 0);
    }
}

/// RoPE of one lane of a group of up to `G` heads of one token: `R` loads the rotating lanes
/// and `W` stores them (q's and k's input and output types), `C` and `D` likewise for the
/// copying lanes, `B` is where cos and sin come from (the library's table, or computed
/// into the block's rows first), `P` says which table row each pair reads (one position, or
/// MRoPE's three streams).
///
/// # Safety
/// The host checked that every row of both views lies inside its buffer, that outputs do
/// not overlap anything else the launch touches, that the positions view admits only rows of
/// the table and its buffer holds every token's entry, that the table holds `half` pairs per
/// row, that addresses are aligned for `R` and `C`, that the geometry was made with this
/// kernel's `G`, and that there is work (`seq`, lanes and heads not zero); with
/// a prologue's barriers ([`Prologue::BARRIERS`]), that the launch has [`RopeParams::shared`]
/// of dynamic shared memory.
#[inline(always)]
pub(crate) unsafe fn rope<
    S: Style,
    R: Io,
    W: Io,
    C: Io,
    D: Io,
    B: Source,
    P: PairRows,
    N: NormStage,
    const G: usize,
>(
    p: &RopeParams,
) {
    const { assert!(R::SIZE == C::SIZE && W::SIZE == D::SIZE) };
    let lanes = p.rot_lanes + p.copy_lanes;
    // The normed kernels' groups take a power of two of slots (inside one warp).
    let slots = if N::ON { p.slots } else { lanes };
    let (gq, gk) = (groups(p.q.heads, G as u32), groups(p.k.heads, G as u32));
    // The whole-projection kernels take k's first group and the items per token from the host
    // (which keeps q's and k's groups each inside one block).
    let (k_group, items) = if N::WHOLE { (p.k_group, p.items) } else { (gq, (gq + gk) * slots) };
    // SAFETY: the host never launches without work (at most 2^31 items) or with `seq == 0`.
    unsafe { assume_launch(p, lanes, slots, (gq, gk, k_group), items) };
    let item = work_item(block_idx(), block_dim().0, thread_idx().0, items, p.chunk, p.tokens);
    // (With a norm, every thread stays for the statistic's shuffles.)
    if !N::ON && !B::Prologue::BARRIERS && item.is_none() {
        return;
    }
    // Threads past the end still take part in the block's prologue.
    let (token, work) = item.unwrap_or((0, 0));
    let (b, s) = (token / p.seq, token % p.seq);
    let (group, lane) = (work / slots, work % slots);
    let is_k = group >= k_group;
    let (view, h0, heads) = match is_k {
        false => (&p.q, group * G as u32, p.q.heads),
        // (The whole-projection kernels' groups between q's and k's: idle, below.)
        true => (&p.k, (group - k_group) * G as u32, p.k.heads),
    };
    // Idle: a slot past its group's lanes, or a whole-projection kernel's group past its heads.
    let item = item.filter(|_| lane < lanes && (!N::WHOLE || h0 < heads));
    let (b, s, h0) = (b as u64, s as u64, h0 as u64);
    let rows = Rows {
        src: (view.input as *const u8).wrapping_add(view.in_offset(b, s, h0) as usize * R::SIZE),
        dst: (view.output as *mut u8).wrapping_add(view.out_offset(b, s, h0) as usize * W::SIZE),
        src_step: view.in_strides[2] as usize * R::SIZE,
        dst_step: view.out_strides[2] as usize * W::SIZE,
        // (Every group has a head but the whole-projection kernels' idle ones.)
        count: if N::WHOLE { heads.saturating_sub(h0 as u32) } else { heads - h0 as u32 }.min(G as u32) as usize,
    };
    // SAFETY: just computed (a head where there is an item, and in every group but the
    // whole-projection kernels' idle ones); lets the compiler drop the head loop where G is 1.
    unsafe { core::hint::assert_unchecked(rows.count <= G && (!N::WHOLE || item.is_none() || rows.count >= 1)) };
    if !N::WHOLE {
        // SAFETY: as above.
        unsafe { core::hint::assert_unchecked(rows.count >= 1) };
    }
    let half = p.pairs.half();
    // The first head's data does not depend on the position: load it before the position
    // (and the table entries that depend on it) arrive.
    let rotating = lane < p.rot_lanes;
    // SAFETY: the host checked the rows against their buffers: a rotating lane's elements
    // lie in the row.
    let load_first = || {
        if item.is_some() && rotating {
            // SAFETY: as above.
            unsafe { S::load::<R>(&rows, 0, lane as usize, half as usize) }
        } else {
            [[0; 4]; 2]
        }
    };
    // A copying lane's first head likewise.
    let copy_at = if rotating { 0 } else { (2 * half as usize + (lane - p.rot_lanes) as usize * C::E) * C::SIZE };
    // SAFETY: a copying lane's elements lie past the rotary dims, inside the row.
    let load_copy = || if item.is_some() && !rotating { unsafe { C::load_raw(rows.src(0, copy_at)) } } else { [0; 4] };
    // 16-bit kernels load before the rows, f32 ones after (see the constant's reasons).
    let early = !B::Prologue::BARRIERS || (ROPE_16BIT_LOADS_BEFORE_FILL && R::SIZE == 2);
    let (first, first_copy) = if early { (load_first(), load_copy()) } else { ([[0; 4]; 2], [0; 4]) };
    // The block's cos and sin (computed source), computed once per token and pair while
    // those loads are in flight; only the one-head kernels (the launches of few tokens) stage
    // the angle table.
    let inputs = BlockInputs {
        can_stage: G == 1,
        tokens: block_tokens(block_idx(), block_dim().0, items, p.chunk, p.tokens),
        source: &p.source,
        pairs: &p.pairs,
        positions: &p.positions,
        divmod: |t| (t / p.seq, t % p.seq),
        base: core::intrinsics::gpu::gpu_launch_sized_workgroup_mem::<u8>(),
        layout: |view: &ComputedView| p.shared(block_dim().0, items, Some(view)),
    };
    // SAFETY: the host gives every computing launch `RopeParams::shared` of shared memory
    // (16-byte aligned), the positions buffer holds every token's entry, and the frequencies
    // `half` pairs; every thread of the block is here; the launch's source is the kernel's.
    let block_rows = unsafe {
        let start = B::Prologue::start::<P, _, _>(&inputs);
        B::Prologue::fill::<P, _, _>(&inputs, start, true)
    };
    if !N::ON && item.is_none() {
        return;
    }
    let (first, first_copy) = if early { (first, first_copy) } else { (load_first(), load_copy()) };
    let norm_at = LaneAt { rotating, lane: lane as usize, half: half as usize, copy_at, head: h0 as usize };
    // The lane's norm weights with its inputs.
    // SAFETY: the host checked the weights' buffers (`head_dim` elements of their type for
    // each head of a whole projection, 16-byte aligned where `vector`); `lane` is a lane of the
    // launch's geometry.
    let norm_bits = unsafe { N::load::<S, R, C>(&p.norm, is_k as usize, N::ON && item.is_some(), norm_at) };
    // A whole-projection norm's head sums: this thread's, and its projection's first group.
    let whole = || Whole {
        parts: inputs.base.wrapping_add(p.shared(block_dim().0, items, p.source.computed()).bytes as usize) as *mut f32,
        thread: thread_idx().0,
        first: thread_idx().0.wrapping_sub(work.wrapping_sub(if is_k { k_group * slots } else { 0 })),
        groups: heads,
        lanes,
    };
    // SAFETY: the positions buffer holds every token's entry.
    let raw = item.map(|_| unsafe { P::load(&p.positions, token, b as u32, s as u32) });
    // The statistic while the position is in flight: every thread of the block is here.
    let norm = match N::ON {
        // SAFETY: as above; every lane of the warp calls it.
        true => unsafe {
            let data = (&rows, &first, &first_copy);
            N::of::<S, R, C, G>(&p.norm, is_k as usize, item.is_some(), norm_at, data, norm_bits, slots, whole)
        },
        false => crate::norm::NormLane::OFF,
    };
    let Some(raw) = raw else { return };
    let Some(pos) = p.positions.check(raw) else {
        // Skip the token; one thread per token reports it.
        if work == 0 {
            // SAFETY: the host points `errors` at this launch's records.
            unsafe { p.errors.position(token, raw) };
        }
        return;
    };
    if rotating {
        let row = B::Prologue::row(block_rows, token);
        let table = Table { src: &p.source, pairs: &p.pairs, sin_sign: p.sin_sign, row };
        // SAFETY: the positions view admits only rows of the table, and `pos` passed its
        // check; the rest as above.
        unsafe {
            let at = P::of(&p.positions, token, pos);
            S::rotate::<R, W, B, P>(rows, first, lane as usize, at, table, (Quant::NONE, N::ON.then_some(&norm)))
        };
    } else {
        // Dims past rotary_dim: copied (out of place), or normalized (in place too).
        // SAFETY: as above; the output rows overlap nothing else (or are the input's own).
        unsafe { rows.copy::<C, D>(first_copy, copy_at, Quant::NONE, N::ON.then_some(&norm)) };
    }
}
