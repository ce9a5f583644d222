//! Tuning constants, for host and device alike. Every choice here computes the same bits; only
//! the speed differs. They are constants of the code, not of the build: no environment
//! variable changes them, so every build of a given version ships the same kernels. The values
//! were measured on an H200 (BENCHMARKS.md); a machine of another architecture that measures
//! otherwise makes its value a new arm of a `match` here.

/// Threads per block of every kernel: small blocks leave the fewest registers unused per SM.
pub const BLOCK_THREADS: u32 = 128;

/// Heads one thread handles (sharing its table entries among them), per RoPE kernel: `vector`
/// for the `_v` kernels, `elem_size` in bytes, `neox` for the style, `computed` for the
/// kernels computing cos and sin (`_c`). Host and device both read it, so the launch geometry
/// matches the kernel. Measured on the H200: 16-bit kernels 8, GPT-J f32 4, NeoX f32 1 from
/// the table and 4 computed (96.1% of copy, 1 head 85.8%).
pub const fn heads_per_thread(vector: bool, neox: bool, elem_size: usize, computed: bool) -> u32 {
    match (vector, neox, elem_size) {
        (false, _, _) => 1,
        (true, _, 2) => 8,
        (true, true, _) => {
            if computed {
                4
            } else {
                1
            }
        }
        (true, false, _) => 4,
    }
}

/// Heads one thread of a KV-cache kernel handles (see [`heads_per_thread`]) in its `_v`
/// entry point (the `_d` and `_s` ones take 1). GPT-J `_v` kernels take 1 too: with more,
/// LLVM keeps their lane arrays in local memory inside this larger kernel. So do the `_v`
/// kernels with a per-head norm (`head_norm`, QK-norm): at one head NeoX bf16 `_v_n` takes 64
/// registers on sm_90, at two 96 (20 warps an SM, latency-bound: docs/bench-log/2026-12-06.md).
pub const fn kv_heads_per_thread(vector: bool, gptj: bool, elem_size: usize, head_norm: bool) -> u32 {
    match (vector, gptj, elem_size) {
        (false, _, _) | (_, true, _) => 1,
        _ if head_norm => 1,
        // Measured on the H200 (65536 tokens, 32/8 heads of 128, paged): 2 heads 83.1% of
        // copy bandwidth, 1 head 82.9%, 8 heads 69.9%.
        (true, false, 2) => 2,
        (true, false, _) => 4,
    }
}

/// Heads one thread of the KV shift handles (`vector`: its 16-byte kernels; `fp8`: an FP8
/// cache), sharing its sequence's cos and sin, its slot and its setup among them, its later
/// heads asked of the L2 cache before the block's cos and sin are computed. 16-bit and f32
/// caches take 1 (`_p`; H100, bf16 32,768 tokens x 8 kv heads of 128, paged: 89.5–90.8% of
/// copy). FP8 takes 2 (`_v`): a lane moves 16 bytes of codes a head where a bf16 one moves 32,
/// so one head a thread keeps half as many bytes in flight (H100 at 1 head: 26.5% of copy,
/// before the hardware decode). The 2 is chosen by that count, not yet measured.
pub const fn shift_heads_per_thread(vector: bool, fp8: bool) -> u32 {
    if vector && fp8 {
        2
    } else {
        1
    }
}

/// RoPE calls of fewer threads than this at [`heads_per_thread`] heads each take one head a
/// thread instead (256 blocks of 128: about two per multiprocessor of an H200).
pub const ROPE_FEW_THREADS: u64 = 1 << 15;

/// KV calls of at most this many tokens take one head a thread (`_p`, `_d`: more threads,
/// shorter chains, for latency); larger ones share each table load across several heads
/// (`_v`, for bandwidth).
pub const KV_PREFILL_MAX_TOKENS: usize = 8192;

/// Whether a 16-bit RoPE kernel that computes its block's cos and sin loads its first head
/// before them (the loads overlap the arithmetic). f32 kernels load after: the rows'
/// arithmetic would otherwise hold the loaded head in registers (56 instead of 48 for NeoX
/// `_v`), and f32 rows are wide enough that a later load still keeps the memory busy (H200:
/// 96.5% of copy against 96.1%).
pub const ROPE_16BIT_LOADS_BEFORE_FILL: bool = true;

/// Whether the KV kernels that compute their block rows without scanning load their first
/// head after the rows: the head is then not held in registers across the rows' arithmetic
/// (H200: the fused 16x4096 prefill at 74.4–75.4% of copy against 71.1%, NeoX bf16 `_v` 72
/// registers against 78).
pub const KV_LOADS_AFTER_FILL: bool = true;

/// Whether a KV kernel's thread of several heads asks the L2 cache for its later heads' rows
/// as soon as it has loaded its first (`prefetch.global.L2`, no register held): their loads,
/// issued one head ahead inside the stores' loop after the position's, slot's and owner's
/// round trips, then find them in L2 (H200, the fused 16x4096 prefill, NeoX bf16 `_v` at 2
/// heads: 88.5% of copy against 83.1% in one run, same registers). The RoPE kernels do not:
/// tried at their 8 heads a thread, GPT-J bf16 in place fell from 93.5% to 87.7%.
pub const KV_PREFETCH_HEADS: bool = true;

/// Whether the KV kernels' 16-byte loads and stores of q, k, v and the caches are marked
/// streaming (`.cs`: likely touched once, evicted first), so that the L2 keeps the tables,
/// positions, slots and owner entries every thread reads (H200, fused 16x4096 prefill with
/// [`KV_PREFETCH_HEADS`]: 91.8% of copy against 88.4% in one run; the loads or the stores
/// alone: no gain). The RoPE kernels' stay plain: marked so, NeoX f32 out of place fell from
/// 98.6% to 96.5% of copy.
pub const KV_STREAMING: bool = true;
