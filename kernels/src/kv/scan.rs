//! The scanning kernels' block-wide settling of duplicate slots: each block loads every
//! token's position and slot once into shared memory, and its threads find the tokens whose
//! slot a later token of the call writes ([`block_scan`]); a token's target then comes from
//! there ([`shared_target`]).

use super::{checked, load_token, settle};
use crate::gpu::{block_dim, block_idx, thread_idx};
use crate::mem::sync_threads;
use crate::params::KvParams;
use crate::rotate::PairRows;

/// What the block-wide scan of the scanning kernels leaves in shared memory (see
/// [`KvParams::shared`]): each token's raw position and target slot (`u64::MAX` for
/// none), and whether a later token writes the slot of each of the block's own tokens.
pub(super) struct Shared {
    positions: *mut i64,
    targets: *mut u64,
    superseded: *mut u32,
    /// The block's first token.
    first: u32,
}

/// The block's first token and number of tokens (0 for a block without work).
#[inline(always)]
pub(super) fn block_tokens(p: &KvParams) -> (u32, u32) {
    crate::params::block_tokens(block_idx(), block_dim().0, p.items_div, p.chunk, p.tokens)
}

/// A token's (raw slot, raw position), if the token exists.
pub(super) type Loaded = Option<(i64, i64)>;

/// The scan's loads for this thread's first two tokens (`thread`, `thread + block_dim`),
/// issued before anything waits on them: (raw slot, raw position) of each.
///
/// # Safety
/// As [`load_token`].
#[inline(always)]
pub(super) unsafe fn scan_loads<P: PairRows>(p: &KvParams) -> (Loaded, Loaded) {
    let (tid, bd) = (thread_idx().0, block_dim().0);
    // SAFETY: only tokens below `p.tokens` are loaded.
    let load = |j: u32| (j < p.tokens).then(|| unsafe { load_token::<P>(p, j) });
    (load(tid), load(tid + bd))
}

/// The scan of the scanning kernels, which every thread of the block runs: the block loads
/// every token's position and slot once (`loaded`: this thread's first two, from
/// [`scan_loads`]), then its threads compare the later tokens' slots with the block's own
/// tokens' in parallel (a later token wins a repeated slot).
///
/// # Safety
/// Every thread of the block calls it (it holds barriers), with at least
/// [`KvParams::shared`] of dynamic shared memory; as [`load_token`].
#[inline(always)]
pub(super) unsafe fn block_scan<P: PairRows, T>(
    p: &KvParams,
    loaded: (Loaded, Loaded),
    between: impl FnOnce() -> T,
) -> (Shared, T) {
    let base = core::intrinsics::gpu::gpu_launch_sized_workgroup_mem::<u64>();
    let tokens = p.tokens as usize;
    // SAFETY: the dynamic shared memory holds `2 * tokens` u64 and the flags after them.
    let s = unsafe {
        Shared {
            positions: base as *mut i64,
            targets: base.add(tokens),
            superseded: base.add(2 * tokens) as *mut u32,
            first: 0,
        }
    };
    let (first, count) = block_tokens(p);
    let (tid, bd) = (thread_idx().0, block_dim().0);
    let store = |j: u32, (raw_slot, raw_pos): (i64, i64)| {
        // No reports here: the scan sees every token in every block.
        // SAFETY: nothing is recorded without `report`.
        let n = unsafe { settle(p, j, raw_pos, raw_slot, (false, false)) }.map(|(_, n)| n);
        // SAFETY: `j < tokens`: inside the shared arrays.
        unsafe {
            *s.positions.add(j as usize) = raw_pos;
            *s.targets.add(j as usize) = n.unwrap_or(u64::MAX);
        }
    };
    if let Some(l) = loaded.0 {
        store(tid, l);
    }
    if let Some(l) = loaded.1 {
        store(tid + bd, l);
    }
    // Blocks smaller than half the scan's tokens: the rest, one at a time.
    let mut j = tid + 2 * bd;
    while j < p.tokens {
        // SAFETY: `j < tokens`.
        store(j, unsafe { load_token::<P>(p, j) });
        j += bd;
    }
    if tid < count {
        // SAFETY: `tid < count <= block_dim`: a flag of the block's.
        unsafe { *s.superseded.add(tid as usize) = 0 };
    }
    // SAFETY: the caller's contract: every thread of the block is here.
    unsafe { sync_threads() };
    let between = between();
    let mut j = first + 1 + tid;
    while j < p.tokens {
        // SAFETY: `j < tokens`, and `k < count`: inside the shared arrays.
        unsafe {
            let n = *s.targets.add(j as usize);
            if n != u64::MAX {
                for k in 0..count.min(j - first) {
                    if *s.targets.add((first + k) as usize) == n {
                        s.superseded.add(k as usize).write_volatile(1);
                    }
                }
            }
        }
        j += bd;
    }
    // SAFETY: as above.
    unsafe { sync_threads() };
    (Shared { first, ..s }, between)
}

/// Where token `t` goes: its position and slot, unless it is skipped (out of range, padding,
/// or, for keys and values, a later token writes the same slot). Reports go to the records
/// as `report` says (positions, slots).
///
/// # Safety
/// `s` came from [`block_scan`] of this launch and `t` is one of the block's tokens.
#[inline(always)]
pub(super) unsafe fn shared_target(
    p: &KvParams,
    s: &Shared,
    t: u32,
    kv: bool,
    report: (bool, bool),
) -> Option<(u32, u64)> {
    // SAFETY: the caller's contract: `t` is inside the shared arrays; `errors` points at
    // this launch's records.
    let raw_pos = unsafe { *s.positions.add(t as usize) };
    // SAFETY: as above.
    let pos = unsafe { checked(p, t, raw_pos, report.0) }?;
    if !kv {
        return Some((pos, 0));
    }
    // SAFETY: as above.
    let n = unsafe { *s.targets.add(t as usize) };
    if n == u64::MAX {
        if report.1 {
            // Padding or out of range: only the latter is reported.
            // SAFETY: `t < tokens`; `errors` as above.
            unsafe { settle(p, t, raw_pos, p.cache.raw_slot(t), (false, true)) };
        }
        return None;
    }
    // SAFETY: `t` is one of the block's tokens: its flag exists.
    if unsafe { *s.superseded.add((t - s.first) as usize) } != 0 {
        return None;
    }
    Some((pos, n))
}
