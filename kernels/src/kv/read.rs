//! The KV entry points beside the append: the claims of the calls too large to scan
//! ([`claim`]) and the dequantizing read of FP8 caches ([`read`]).

use super::settle;
use crate::fp8::Fp8;
use crate::gpu::{block_dim, block_idx, load_table, load_u8_nc, thread_idx, Elem, Io, One};
use crate::params::{work_item, KvParams, ReadParams};
use crate::views::SlotOf;

/// Records, for each slot, the last token of this call that writes it (`kv_claim`).
///
/// # Safety
/// Launched by the host with one thread per token and an owner array of `num_slots` u64
/// tagged for this call.
#[inline(always)]
pub(crate) unsafe fn claim(p: &KvParams) {
    // SAFETY: the host never launches with `seq == 0`.
    unsafe { core::hint::assert_unchecked(p.seq != 0) };
    let t = block_idx().0 * block_dim().0 + thread_idx().0;
    if t >= p.tokens {
        return;
    }
    // SAFETY: `t < tokens`; nothing is recorded without `report`.
    // One claim kernel serves both kinds of positions: the general load.
    let target = unsafe {
        let (b, s) = p.seq_div.divmod(t);
        let (raw_slot, raw_pos) = (p.cache.raw_slot(t), p.positions.load(t, b, s));
        settle(p, t, raw_pos, raw_slot, (false, false))
    };
    if let Some((_, n)) = target {
        // SAFETY: `n < num_slots`, the owner array's length.
        unsafe { p.owners.claim(n, t) };
    }
}

/// Reads one element of an FP8 cache row back (`kv_read_*`, see [`ReadParams`]): the code's
/// value times its head's scale, rounded to `T`.
///
/// # Safety
/// The host checked the caches and outputs against their buffers, the slots' length, that
/// the outputs overlap nothing the launch reads, and the scales' lengths.
#[inline(always)]
pub(crate) unsafe fn read<T: Elem>(p: &ReadParams) {
    // SAFETY: the host never launches with zero items, heads or dims, or `seq == 0`.
    unsafe {
        core::hint::assert_unchecked(p.items_div.divisor != 0);
        core::hint::assert_unchecked(p.cache_div.divisor != 0);
        core::hint::assert_unchecked(p.dim_div.divisor != 0);
        core::hint::assert_unchecked(p.seq_div.divisor != 0);
        core::hint::assert_unchecked(p.cache.block_size() != 0);
    }
    let Some((r, w)) = work_item(block_idx(), block_dim().0, thread_idx().0, p.items_div, p.chunk, p.rows) else {
        return;
    };
    let (which, rest) = p.cache_div.divmod(w);
    let (h, e) = p.dim_div.divmod(rest);
    // SAFETY: the slots hold an entry per row.
    let raw = unsafe { p.cache.raw_slot(r) };
    let n = match p.cache.slot(|| 0, 0, raw) {
        SlotOf::Slot(n) => n,
        SlotOf::Skip => return,
        SlotOf::OutOfRange(raw) => {
            // The row's first item reports, whichever outputs are read.
            if w == 0 {
                // SAFETY: `errors` points at this launch's records.
                unsafe { p.errors.slot(r, raw) };
            }
            return;
        }
    };
    let out = if which == 0 { &p.k } else { &p.v };
    if out.output == 0 {
        return;
    }
    let cache = if which == 0 { p.cache.k() } else { p.cache.v() };
    let (scale, _) = p.scales.head(which == 1, h as u64);
    let fmt = p.cache.types().0.fp8().unwrap_or(Fp8::E4M3);
    // SAFETY: slot `n` and head `h` are in the cache, element `e` in the row; the scale is in
    // its buffer (one, or one per head: `head` gives 0 steps for one).
    let (code, scale) = unsafe {
        (
            load_u8_nc((cache as *const u8).wrapping_add((p.cache.row(n, h as u64) + e as u64) as usize)),
            load_table(scale as *const f32, 1)[0],
        )
    };
    let v = fmt.to_f32(code) * scale;
    let (b, s) = p.seq_div.divmod(r);
    let at = out.out_offset(b as u64, s as u64, h as u64) + e as u64;
    let (mut bits, mut pending) = ([0u32; 4], 0.0);
    One::<T>::put(&mut bits, &mut pending, 0, v, fmt);
    // SAFETY: the element is in the output's buffer, written by this thread alone.
    unsafe { One::<T>::store_raw((out.output as *mut u8).wrapping_add(at as usize * T::SIZE), bits) };
}
