//! Kernel parameter structs, shared bit-for-bit between host and device.
//!
//! Device pointers travel as `u64` (`CUdeviceptr`), so the structs are plain data on both
//! sides. Every struct is passed by value as a kernel's single parameter.

/// One tensor of rows to rotate, viewed as `[batch, seq, heads, head_dim]`.
///
/// Strides are in elements; `head_dim` is contiguous (stride 1). The output uses its own
/// strides, so out-of-place results may have a different layout from the input; in place
/// means `output == input` with equal strides.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HeadsView {
    /// Device address of element `[0, 0, 0, 0]` of the input.
    pub input: u64,
    /// Device address of element `[0, 0, 0, 0]` of the output.
    pub output: u64,
    /// Input strides, in elements, of the batch, seq and head axes.
    pub in_strides: [u64; 3],
    /// Output strides, in elements, of the batch, seq and head axes.
    pub out_strides: [u64; 3],
    /// Number of heads; 0 means the tensor is absent.
    pub heads: u32,
    /// Keeps the layout free of implicit padding.
    pub _pad: u32,
}

impl HeadsView {
    /// Element offset of row `(b, s, h)` in the input.
    #[inline(always)]
    pub fn in_offset(&self, b: u64, s: u64, h: u64) -> u64 {
        b * self.in_strides[0] + s * self.in_strides[1] + h * self.in_strides[2]
    }

    /// Element offset of row `(b, s, h)` in the output.
    #[inline(always)]
    pub fn out_offset(&self, b: u64, s: u64, h: u64) -> u64 {
        b * self.out_strides[0] + s * self.out_strides[1] + h * self.out_strides[2]
    }
}

/// How a token's position is found (`RopeParams::position_mode`).
pub mod position_mode {
    /// The token's index within its sequence, `s`.
    pub const SEQUENTIAL: u32 = 0;
    /// `ids[b * seq + s]`, i32.
    pub const IDS_I32: u32 = 1;
    /// `ids[b * seq + s]`, i64.
    pub const IDS_I64: u32 = 2;
    /// `offsets[b] + s`, i32 offsets.
    pub const OFFSETS_I32: u32 = 3;
    /// `offsets[b] + s`, i64 offsets.
    pub const OFFSETS_I64: u32 = 4;
}

/// The device-side record of out-of-range positions, one per `Rope`.
///
/// `key` is the minimum over offending tokens of `token << 32 | position as i32 as u32`
/// (positions outside the i32 range saturate), `u64::MAX` when none; `count` counts offending
/// tokens. Reset by the host after it reads the record.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ErrorRecord {
    /// Packed first offending token and its position.
    pub key: u64,
    /// Number of offending tokens.
    pub count: u64,
}

impl ErrorRecord {
    /// The record with no error in it.
    pub const CLEAR: ErrorRecord = ErrorRecord { key: u64::MAX, count: 0 };

    /// Packs an offending token and its position into a `key`.
    #[inline(always)]
    pub fn key(token: u32, position: i64) -> u64 {
        let p = if position > i32::MAX as i64 {
            i32::MAX
        } else if position < i32::MIN as i64 {
            i32::MIN
        } else {
            position as i32
        };
        ((token as u64) << 32) | (p as u32 as u64)
    }

    /// The first offending token and its (saturated) position, if any.
    pub fn first(&self) -> Option<(u32, i64)> {
        (self.count > 0).then_some(((self.key >> 32) as u32, self.key as u32 as i32 as i64))
    }
}

/// Heads one thread handles (sharing its table entries among them), per kernel: `vector`
/// for the `_v` kernels, `elem_size` in bytes, `neox` for the style. Host and device both
/// read it, so the launch geometry matches the kernel. The choices are measured (see
/// BENCHMARKS.md): 16-bit kernels 8, NeoX f32 1, GPT-J f32 4.
///
/// `ROPE_CUDA_HEADS_PER_THREAD` (1 to 8) at build time overrides it for every `_v` kernel:
/// a tuning knob for benchmarks, not a setting for users.
pub const fn heads_per_thread(vector: bool, neox: bool, elem_size: usize) -> u32 {
    match (vector, neox, elem_size) {
        (false, _, _) => 1,
        _ if HEADS_PER_THREAD_OVERRIDE != 0 => HEADS_PER_THREAD_OVERRIDE,
        (true, _, 2) => 8,
        (true, true, _) => 1,
        (true, false, _) => 4,
    }
}

const HEADS_PER_THREAD_OVERRIDE: u32 = match option_env!("ROPE_CUDA_HEADS_PER_THREAD") {
    Some(v) => parse_digit(v),
    None => 0,
};

/// `ROPE_CUDA_KV_HEADS_PER_THREAD` (1 to 8) at build time overrides [`kv_heads_per_thread`]
/// for the NeoX `_v` KV kernels: a tuning knob, as `ROPE_CUDA_HEADS_PER_THREAD`.
const KV_HEADS_PER_THREAD_OVERRIDE: u32 = match option_env!("ROPE_CUDA_KV_HEADS_PER_THREAD") {
    Some(v) => parse_digit(v),
    None => 0,
};

const fn parse_digit(v: &str) -> u32 {
    match v.as_bytes() {
        [] => 0,
        [d @ b'1'..=b'8'] => (*d - b'0') as u32,
        _ => panic!("ROPE_CUDA_HEADS_PER_THREAD must be empty or a digit from 1 to 8"),
    }
}

/// Unsigned 32-bit division by a divisor fixed at launch, as a multiply-high, an add and a
/// shift (Granlund and Montgomery, "Division by invariant integers using multiplication",
/// 1994): a hardware-free division costs some twenty dependent instructions, which the
/// few-token kernels, bound by latency, feel. Exact for every `n` and every divisor >= 1.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FastDiv {
    /// The divisor.
    pub divisor: u32,
    /// `floor(2^32 * (2^shift - divisor) / divisor) + 1`.
    pub mul: u32,
    /// `ceil(log2(divisor))`.
    pub shift: u32,
    /// Keeps the layout free of implicit padding.
    pub _pad: u32,
}

impl FastDiv {
    /// The constants for `divisor` (at least 1).
    pub const fn new(divisor: u32) -> Self {
        assert!(divisor >= 1, "FastDiv: the divisor must be at least 1");
        let shift = 32 - (divisor - 1).leading_zeros();
        let mul = ((1u64 << 32) * ((1u64 << shift) - divisor as u64) / divisor as u64 + 1) as u32;
        FastDiv { divisor, mul, shift, _pad: 0 }
    }

    /// `n / divisor`.
    #[inline(always)]
    pub fn div(&self, n: u32) -> u32 {
        let hi = (n as u64 * self.mul as u64) >> 32;
        ((hi + n as u64) >> self.shift) as u32
    }

    /// `(n / divisor, n % divisor)`.
    #[inline(always)]
    pub fn divmod(&self, n: u32) -> (u32, u32) {
        let q = self.div(n);
        (q, n - q * self.divisor)
    }
}

/// A divisor of [`work_item`]: plain, or a [`FastDiv`].
pub trait Divisor {
    /// `(n / d, n % d)`.
    fn divmod(&self, n: u32) -> (u32, u32);
}

impl Divisor for u32 {
    #[inline(always)]
    fn divmod(&self, n: u32) -> (u32, u32) {
        (n / self, n % self)
    }
}

impl Divisor for FastDiv {
    #[inline(always)]
    fn divmod(&self, n: u32) -> (u32, u32) {
        FastDiv::divmod(self, n)
    }
}

/// The (token, work item) of thread `thread` of block `(block_x, block_y)` of `block_dim`
/// threads, for `work` items per token and `chunk` tokens per grid row; `None` past the end.
/// Host and device share it: the host's tests check that a launch covers each pair once.
#[inline(always)]
pub fn work_item(
    (block_x, block_y): (u32, u32),
    block_dim: u32,
    thread: u32,
    work: impl Divisor,
    chunk: u32,
    tokens: u32,
) -> Option<(u32, u32)> {
    // Below 2^32: the host keeps `chunk * work` at most 2^31 and the grid row within a block of it.
    let i = block_x * block_dim + thread;
    let (local, w) = work.divmod(i);
    let token = block_y as u64 * chunk as u64 + local as u64;
    (local < chunk && token < tokens as u64).then_some((token as u32, w))
}

/// Number of head groups of `heads` heads taken `g` at a time.
#[inline(always)]
pub fn groups(heads: u32, g: u32) -> u32 {
    heads.div_ceil(g)
}

/// Parameters of the RoPE kernels, `rope_{neox,gptj}_{f32,f16,bf16}_{v,s}`.
///
/// Thread mapping ([`work_item`]): one-dimensional blocks walk the (token, work item) pairs in
/// order, `work = (q_groups + k_groups) * lanes` items per token, `chunk` tokens per row of
/// the grid (`blockIdx.y`), so that indices stay 32-bit; token `t` is batch `t / seq`,
/// sequence index `t % seq`. `lanes = rot_lanes + copy_lanes`, and the heads of q, then of k,
/// are taken in groups of `G` ([`heads_per_thread`]): item `w` is group `w / lanes`, lane
/// `w % lanes`. A thread loads its lane's
/// table entries once and applies them to each head of its group. A rotating
/// lane turns `E` elements (`E / 2` pairs in GPT-J style, `E` pairs in NeoX style, whose lane
/// reads `E` elements from each half), `E` being the kernel's access width (16 bytes in the
/// `_v` kernels, 1 element (NeoX) or one pair (GPT-J) in the `_s` kernels). A copying lane
/// (out of place with `rotary_dim < head_dim`) copies the bits of the dims past `rotary_dim`.
/// A token whose position is outside `0..max_position` is skipped and recorded in `error`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RopeParams {
    /// The queries.
    pub q: HeadsView,
    /// The keys (`heads == 0`: none).
    pub k: HeadsView,
    /// Device address of the cosine table, f32 `[max_position, rotary_dim / 2]`: the f32
    /// nearest each f64 cosine.
    pub cos: u64,
    /// Device address of the sine table, likewise.
    pub sin: u64,
    /// Device address of the cosines' residuals (`cos_f64 - cos`, rounded to f32).
    pub cos_lo: u64,
    /// Device address of the sines' residuals.
    pub sin_lo: u64,
    /// Device address of the positions (see `position_mode`); unused when sequential.
    pub positions: u64,
    /// Device address of the [`ErrorRecord`].
    pub error: u64,
    /// Number of tokens, `batch * seq`.
    pub tokens: u32,
    /// Sequence length.
    pub seq: u32,
    /// Half the rotary dimension: pairs per row, and the table's row length.
    pub half: u32,
    /// Rotating lanes per head.
    pub rot_lanes: u32,
    /// Copying lanes per head (0 in place).
    pub copy_lanes: u32,
    /// Positions are valid in `0..max_position`.
    pub max_position: u32,
    /// One of [`position_mode`]'s constants.
    pub position_mode: u32,
    /// `1.0` to rotate by +theta, `-1.0` for the inverse rotation.
    pub sin_sign: f32,
    /// Tokens per row of the grid (see [`work_item`]).
    pub chunk: u32,
}

/// Parameters of the KV-cache kernels `kv_{neox,gptj}_{f32,f16,bf16}_{v,s}` (library tables),
/// `kv_gptj_{f16,bf16}_{v,s}_t` (the caller's tables, in the element type) and `kv_claim`.
///
/// One launch per step: token `t` (batch `t / seq`) has its position (see `position_mode`)
/// and a cache slot: `slots[t]` (i64, paged caches; `-1` marks padding), or
/// `b * block_size + position` (contiguous caches, whose "blocks" are the sequences). Slot
/// `n` is row `(n / block_size, n % block_size, h)` of each cache, at element offset
/// `block * cache_strides[0] + (n % block_size) * cache_strides[1] + h * cache_strides[2]`.
/// The work items of a token (see [`work_item`]) are, in order: q's head groups x
/// `rot_lanes` (q rotated in place), k's head groups x `k_lanes` (rotated from `k` into the
/// key cache; the lanes past `rot_lanes` copy the dims past `rotary_dim`), and v's head
/// groups (as many heads as k) x `v_lanes` (copied into the value cache).
///
/// A position outside `0..max_position` skips the whole token (recorded in the first
/// [`ErrorRecord`] at `error`); a slot outside `0..num_slots` other than `-1` skips the cache
/// writes (recorded in the second). When several tokens target one slot, the last one
/// writes: with `owner == 0` each block loads every token's position and slot into shared
/// memory and compares its own tokens' slots with the later ones' (the scanning kernels,
/// launched with [`KvParams::shared_bytes`] of dynamic shared memory); otherwise `kv_claim`
/// has stored, for each slot, `epoch << 32 | t` of its last token in the u64 array at
/// `owner`, and a token writes only if it finds itself there.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct KvParams {
    /// The queries, rotated in place (`heads == 0`: none).
    pub q: HeadsView,
    /// The new keys (`input`; `output` unused).
    pub k: HeadsView,
    /// The new values (`input`; `output` unused), as many heads as `k`.
    pub v: HeadsView,
    /// Device address of the key cache.
    pub k_cache: u64,
    /// Device address of the value cache (same layout as the key cache).
    pub v_cache: u64,
    /// Element strides of the caches' block, slot-in-block and head axes.
    pub cache_strides: [u64; 3],
    /// Device address of the i64 slot mapping; 0 for contiguous caches.
    pub slots: u64,
    /// Device address of the u64 owner array (one per slot); 0: scan for duplicates.
    pub owner: u64,
    /// Cosine table, `[max_position, half]`.
    pub cos: u64,
    /// Sine table.
    pub sin: u64,
    /// Cosine residuals (library tables only).
    pub cos_lo: u64,
    /// Sine residuals (library tables only).
    pub sin_lo: u64,
    /// Device address of the positions (see `position_mode`).
    pub positions: u64,
    /// Device address of two [`ErrorRecord`]s: positions, then slots.
    pub error: u64,
    /// Number of slots: `num_blocks * block_size`.
    pub num_slots: u64,
    /// Number of tokens, `batch * seq`.
    pub tokens: u32,
    /// New tokens per sequence.
    pub seq: u32,
    /// Half the rotary dimension.
    pub half: u32,
    /// Rotating lanes per head.
    pub rot_lanes: u32,
    /// Lanes per key head: `rot_lanes` plus the copying lanes past `rotary_dim`.
    pub k_lanes: u32,
    /// Lanes per value head.
    pub v_lanes: u32,
    /// Slots per block (contiguous caches: the cache's sequence length).
    pub block_size: u32,
    /// Positions are valid in `0..max_position`.
    pub max_position: u32,
    /// One of [`position_mode`]'s constants.
    pub position_mode: u32,
    /// Tag of this call's claims in the owner array.
    pub epoch: u32,
    /// Tokens per grid row (see [`work_item`]).
    pub chunk: u32,
    /// Keeps the layout free of implicit padding.
    pub _pad: u32,
    /// Division by the work items per token.
    pub items_div: FastDiv,
    /// Division by `seq`.
    pub seq_div: FastDiv,
    /// Division by `rot_lanes`, `k_lanes` and `v_lanes`.
    pub lanes_div: [FastDiv; 3],
    /// Division by `block_size`.
    pub block_div: FastDiv,
}

impl KvParams {
    /// Dynamic shared memory a scanning kernel (`owner == 0`) needs with blocks of
    /// `block_threads`: each token's position and slot (8 bytes each), and a flag for each
    /// token of the block (at most `block_threads`).
    pub fn shared_bytes(&self, block_threads: u32) -> u32 {
        16 * self.tokens + 4 * block_threads
    }
}

/// Heads one thread of a KV-cache kernel handles (see [`heads_per_thread`]) in its `_v`
/// entry point (the `_d` and `_s` ones take 1). GPT-J `_v` kernels take 1 too: with more,
/// LLVM keeps their lane arrays in local memory inside this larger kernel.
pub const fn kv_heads_per_thread(vector: bool, gptj: bool, elem_size: usize) -> u32 {
    match (vector, gptj, elem_size) {
        (false, _, _) | (_, true, _) => 1,
        _ if KV_HEADS_PER_THREAD_OVERRIDE != 0 => KV_HEADS_PER_THREAD_OVERRIDE,
        // Measured on the H200 (65536 tokens, 32/8 heads of 128, paged): 2 heads 83.1% of
        // copy bandwidth, 1 head 82.9%, 8 heads 69.9%.
        (true, false, 2) => 2,
        (true, false, _) => 4,
    }
}

/// Parameters of the `bench_touch` benchmark kernel: `chunks` 16-byte chunks from `src` to `dst`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Touch {
    /// Source address.
    pub src: u64,
    /// Destination address.
    pub dst: u64,
    /// Number of 16-byte chunks.
    pub chunks: u64,
}
