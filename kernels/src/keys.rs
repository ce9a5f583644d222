//! Typed kernel keys: what the host asks for (operation, style, dtype, width, …). The list in
//! [`crate::entries`] maps each key to its entry point; [`RopeKey::variant`],
//! [`KvKey::variant`] and [`ShiftKey::variant`] name a key's variant of the support table ([`crate::support`]), which
//! says whether the list has one.

use crate::support::{Elem, Norm, Op, Pairs, Rows, Source, Store, Variant, Width};

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

/// A RoPE kernel (`rope_…`), parameters [`crate::params::RopeParams`]; which keys have one is
/// [`crate::support`]'s table ([`RopeKey::variant`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RopeKey {
    /// Pairing.
    pub style: RopeStyle,
    /// Element types of the operands.
    pub types: RopeTypes,
    /// Access width and heads per thread.
    pub width: RopeWidth,
    /// Multimodal RoPE: three position streams per token (`_m`).
    pub mrope: bool,
    /// The library's table, computed cos and sin, or the caller's tables.
    pub source: TableSource,
    /// QK-norm of each head before the rotation (`_n`).
    pub norm: bool,
    /// With `norm`: the statistic over a token's whole q projection and whole k projection
    /// (`_w` rather than `_n`, OLMo 2's).
    pub whole: bool,
}

/// A fused RoPE + KV append kernel (`kv_…`), parameters [`crate::params::KvParams`]; which keys
/// have one is [`crate::support`]'s table ([`KvKey::variant`]).
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
    /// Multimodal RoPE: three position streams per token (`_m`).
    pub mrope: bool,
    /// QK-norm of q's and k's heads before the rotation (`_n`).
    pub norm: bool,
    /// With `norm`: the statistic over a token's whole q projection and whole k projection
    /// (`_w` rather than `_n`, OLMo 2's), or the values' one head alone (MLA's `kv_c`).
    pub whole: bool,
    /// GPT-J pairs written back de-interleaved (`kv_gptjd_…`): pair `i`'s two values at `i`
    /// and `rotary_dim / 2 + i` of q and of the key cache (transformers' DeepSeek-V3 order).
    pub deinterleave: bool,
}

/// A KV shift kernel (`shift_…`): cached keys of type `cache` rotated in place by their
/// sequence's position delta, parameters [`crate::params::ShiftParams`]; cos and sin always
/// computed from the delta's angle. Which keys have one is [`crate::support`]'s table
/// ([`ShiftKey::variant`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ShiftKey {
    /// Pairing.
    pub style: RopeStyle,
    /// The key cache's type (FP8: either format, one kernel for both).
    pub cache: DType,
    /// Element by element (`_s`), or 16 bytes: one head a thread (`_p`), FP8's 8 codes a lane
    /// over several heads a thread (`_v`, [`crate::params::shift_heads_per_thread`]).
    pub width: RopeWidth,
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

/// A key's operand types as the support table names them: one input type (q's, k's and v's
/// alike) and the outputs' (the inputs' again, or FP8: either format for each output, one
/// kernel serving both, the host checking they agree); `None` for a mix no kernel takes.
fn table_types(inputs: [DType; 3], outputs: [DType; 2]) -> Option<(Elem, Store)> {
    let elem = match inputs[0] {
        DType::F32 => Elem::F32,
        DType::F16 => Elem::F16,
        DType::BF16 => Elem::Bf16,
        DType::E4M3 | DType::E5M2 => return None,
    };
    if inputs[1] != inputs[0] || inputs[2] != inputs[0] {
        return None;
    }
    match outputs.map(|o| o.fp8().is_some()) {
        [true, true] => Some((elem, Store::Fp8)),
        [false, false] if outputs == [inputs[0]; 2] => Some((elem, Store::Input)),
        _ => None,
    }
}

const fn table_source(s: TableSource) -> Source {
    match s {
        TableSource::Table => Source::Table,
        TableSource::Computed => Source::Computed,
        TableSource::Caller => Source::Caller,
    }
}

/// The norm of a key's flags; `None` for `whole` without `norm`.
const fn table_norm(norm: bool, whole: bool) -> Option<Norm> {
    match (norm, whole) {
        (false, false) => Some(Norm::None),
        (false, true) => None,
        (true, false) => Some(Norm::Head),
        (true, true) => Some(Norm::Whole),
    }
}

const fn table_rows(mrope: bool) -> Rows {
    if mrope {
        Rows::Streams
    } else {
        Rows::One
    }
}

/// The pairing of a style (not de-interleaved).
const fn table_pairs(style: RopeStyle) -> Pairs {
    match style {
        RopeStyle::NeoX => Pairs::NeoX,
        RopeStyle::GptJ => Pairs::GptJ,
    }
}

const fn table_width(width: RopeWidth) -> Width {
    match width {
        RopeWidth::Scalar => Width::Scalar,
        RopeWidth::Vector => Width::Vector,
        RopeWidth::Single => Width::Single,
    }
}

impl RopeKey {
    /// The key as a variant of the support table; `None` where its operand types mix in a way
    /// no kernel takes (an input of another type than q's, an output of another type than its
    /// input's), or it sets `whole` without `norm`.
    pub fn variant(&self) -> Option<Variant> {
        let t = self.types;
        let (elem, store) = table_types([t.q, t.k, t.k], [t.q_out, t.k_out])?;
        Some(Variant {
            op: Op::Rope,
            pairs: table_pairs(self.style),
            elem,
            store,
            width: table_width(self.width),
            rows: table_rows(self.mrope),
            source: table_source(self.source),
            norm: table_norm(self.norm, self.whole)?,
        })
    }
}

impl ShiftKey {
    /// The key as a variant of the support table: an FP8 cache's kernel rotates in f32 and
    /// moves 8 codes a lane, as the bf16 append's FP8 kernels do.
    pub fn variant(&self) -> Option<Variant> {
        let (elem, store) = match self.cache {
            DType::F32 => (Elem::F32, Store::Input),
            DType::F16 => (Elem::F16, Store::Input),
            DType::BF16 => (Elem::Bf16, Store::Input),
            DType::E4M3 | DType::E5M2 => (Elem::Bf16, Store::Fp8),
        };
        Some(Variant {
            op: Op::Shift,
            pairs: table_pairs(self.style),
            elem,
            store,
            width: table_width(self.width),
            rows: Rows::One,
            source: Source::Computed,
            norm: Norm::None,
        })
    }
}

impl KvKey {
    /// The key as a variant of the support table; `None` where its operand types mix in a way
    /// no kernel takes (q, k and v of different types, caches of different types, or of a
    /// 16- or 32-bit type other than the inputs'), it asks NeoX pairs de-interleaved, or it sets
    /// `whole` without `norm`.
    pub fn variant(&self) -> Option<Variant> {
        let t = self.types;
        let (elem, store) = table_types([t.k, t.q, t.v], [t.cache_k, t.cache_v])?;
        Some(Variant {
            op: Op::Kv,
            pairs: match (self.style, self.deinterleave) {
                (RopeStyle::NeoX, false) => Pairs::NeoX,
                (RopeStyle::GptJ, false) => Pairs::GptJ,
                (RopeStyle::GptJ, true) => Pairs::Deinterleaved,
                (RopeStyle::NeoX, true) => return None,
            },
            elem,
            store,
            width: match self.width {
                KvWidth::Scalar => Width::Scalar,
                KvWidth::Decode => Width::Decode,
                KvWidth::Prefill => Width::Single,
                KvWidth::Vector => Width::Vector,
            },
            rows: table_rows(self.mrope),
            source: table_source(self.tables),
            norm: table_norm(self.norm, self.whole)?,
        })
    }
}
