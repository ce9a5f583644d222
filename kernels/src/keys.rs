//! Typed kernel keys: what the host asks for (operation, style, dtype, width, …). The list in
//! [`crate::entries`] maps each key to its entry point.

/// Which elements of a head are paired and rotated together.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RopeStyle {
    /// Rotate-half (GPT-NeoX, Llama, Qwen, …): pair `i` is `(x[i], x[i + rotary_dim / 2])`.
    NeoX,
    /// Interleaved (GPT-J, …): pair `i` is `(x[2i], x[2i + 1])`.
    GptJ,
}

/// Element type of one operand (q, k, v, an output, a cache). The arithmetic is f32 in every
/// case.
#[repr(u8)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum DType {
    /// `f32`.
    #[default]
    F32,
    /// IEEE binary16 (`half::f16`).
    F16,
    /// bfloat16 (`half::bf16`).
    BF16,
    /// 8-bit floating point E4M3 (`float8_e4m3fn`: no infinities, largest finite 448), for
    /// KV caches ([`crate::fp8::Fp8::E4M3`]).
    E4M3,
    /// 8-bit floating point E5M2 (largest finite 57344), for KV caches
    /// ([`crate::fp8::Fp8::E5M2`]).
    E5M2,
}

impl DType {
    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::E4M3 | DType::E5M2 => 1,
        }
    }

    /// The 8-bit format of an FP8 type.
    pub const fn fp8(self) -> Option<crate::fp8::Fp8> {
        match self {
            DType::E4M3 => Some(crate::fp8::Fp8::E4M3),
            DType::E5M2 => Some(crate::fp8::Fp8::E5M2),
            _ => None,
        }
    }
}

/// The element type of each operand of a RoPE launch. An absent k takes q's types; in place,
/// each output's type is its input's.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct RopeTypes {
    /// The queries read.
    pub q: DType,
    /// The keys read.
    pub k: DType,
    /// The queries written.
    pub q_out: DType,
    /// The keys written.
    pub k_out: DType,
}

impl RopeTypes {
    /// Every operand of type `d`.
    pub const fn uniform(d: DType) -> Self {
        RopeTypes { q: d, k: d, q_out: d, k_out: d }
    }
}

/// The element type of each operand of a fused RoPE + KV append. An absent q takes k's type;
/// q is rotated in place, in its own type, or, with an FP8 cache, optionally into an FP8
/// buffer of the cache's format (chosen at launch: the key does not name it). The two caches'
/// types are one, the inputs' or an FP8 format (one kernel serves both formats, read from the
/// cache view at launch).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct KvTypes {
    /// The queries.
    pub q: DType,
    /// The new keys.
    pub k: DType,
    /// The new values.
    pub v: DType,
    /// The key cache.
    pub cache_k: DType,
    /// The value cache.
    pub cache_v: DType,
}

impl KvTypes {
    /// Every operand of type `d`.
    pub const fn uniform(d: DType) -> Self {
        KvTypes { q: d, k: d, v: d, cache_k: d, cache_v: d }
    }
}

/// How a RoPE kernel moves its rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RopeWidth {
    /// `_s`: element by element (views whose addresses, strides or dims forbid vectors).
    Scalar,
    /// `_v`: 16-byte accesses, [`crate::params::heads_per_thread`] heads per thread.
    Vector,
    /// `_p`: 16-byte accesses, one head per thread.
    Single,
}

/// How a KV kernel moves its rows, and how it settles duplicate slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvWidth {
    /// `_s`: element by element; duplicates scanned or claimed.
    Scalar,
    /// `_v`: 16 bytes, [`crate::params::kv_heads_per_thread`] heads per thread; claimed.
    Vector,
    /// `_d`: 8 bytes, one head per thread; scanned or claimed (few tokens).
    Decode,
    /// `_p`: 16 bytes, one head per thread; claimed.
    Prefill,
}

/// Where a kernel's cos and sin come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TableSource {
    /// The library's f32 tables of `max_position` rows, with residual tables for the exact
    /// path.
    Table,
    /// No table: cos and sin computed in the kernel from the library's frequencies (`_c`).
    Computed,
    /// The caller's tables in the element type, taken as exact (the reference operation, KV
    /// only).
    Caller,
}

/// A RoPE kernel (`rope_{style}_{types}_{width}[_m][_c][_n|_w]`), parameters
/// [`crate::params::RopeParams`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RopeKey {
    /// Pairing.
    pub style: RopeStyle,
    /// Element types of the operands.
    pub types: RopeTypes,
    /// Access width and heads per thread.
    pub width: RopeWidth,
    /// Multimodal RoPE: three position streams per token (`_m`; widths `_s` and `_p` only).
    pub mrope: bool,
    /// The library's table or computed cos and sin (never the caller's).
    pub source: TableSource,
    /// QK-norm of each head before the rotation (`_n`; widths `_v` and `_p`).
    pub norm: bool,
    /// With `norm`: the statistic over a token's whole q projection and whole k projection
    /// (`_w` rather than `_n`, OLMo 2's; width `_p`).
    pub whole: bool,
}

/// A fused RoPE + KV append kernel (`kv_{style}_{types}_{width}[_t|_m][_c][_n|_w]`), parameters
/// [`crate::params::KvParams`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvKey {
    /// Pairing.
    pub style: RopeStyle,
    /// Element types of the operands.
    pub types: KvTypes,
    /// Access width, heads per thread and duplicate handling.
    pub width: KvWidth,
    /// The library's table, computed cos and sin, or the caller's tables.
    pub tables: TableSource,
    /// Multimodal RoPE: three position streams per token (`_m`; library tables, widths `_s`,
    /// `_d` and `_p` only).
    pub mrope: bool,
    /// QK-norm of q's and k's heads before the rotation (`_n`; the library's sources, widths
    /// `_d`, `_p` and `_v`).
    pub norm: bool,
    /// With `norm`: the statistic over a token's whole q projection and whole k projection
    /// (`_w` rather than `_n`, OLMo 2's; widths `_d` and `_p`).
    pub whole: bool,
    /// GPT-J pairs written back de-interleaved (`kv_gptjd_…`): pair `i`'s two values at `i`
    /// and `rotary_dim / 2 + i` of q and of the key cache (transformers' DeepSeek-V3 order;
    /// widths `_d`, `_p` and `_v`, one position row, the library's sources, no norm).
    pub deinterleave: bool,
}

/// `kv_read_{f32,f16,bf16}`: rows of FP8 caches read back, dequantized into the output's type
/// ([`crate::params::ReadParams`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ReadKey {
    /// The output's element type (f32, f16 or bf16).
    pub out: DType,
}

/// `kv_claim`: records the last token of each slot before a claimed KV launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ClaimKey;

/// `bench_empty`: does nothing (a launch's own cost).
#[cfg(feature = "bench")]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BenchEmpty;

/// `bench_spin`: spins for a number of nanoseconds.
#[cfg(feature = "bench")]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BenchSpin;

/// `bench_touch`: copies 16-byte chunks, one per thread.
#[cfg(feature = "bench")]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BenchTouch;

/// `bench_touch_rows`: copies 16-byte chunks of strided rows, one per thread.
#[cfg(feature = "bench")]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BenchTouchRows;

/// `bench_fp8`: converts f32 pairs to both FP8 formats with [`crate::fp8::Fp8::pack2`] (the
/// architecture's conversion), for the tests that compare it with the portable twin.
#[cfg(feature = "bench")]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BenchFp8;
