//! The support table: the kernel axes, and the one rule set ([`supported`]) that says which of
//! their combinations have an entry point. Nothing else lists the combinations:
//! - the kernel crate's `build.rs` includes this file and generates one entry point for each
//!   supported [`Variant`] of the product of the axes ([`variants`]);
//! - the host asks [`supported`] why it refuses a call ([`Unsupported::reason`]);
//! - the tests check the entry-point list against [`variants`].
//!
//! A new feature is a value of an axis (or a new axis) and, if it does not combine with
//! everything, one rule below. This file names no other module (`build.rs` includes it as
//! text), so it is plain Rust: no `crate::` paths.

/// The operation an entry point runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Op {
    /// RoPE on q and k (`rope_…`, [`crate::params::RopeParams`]).
    Rope,
    /// RoPE on the new keys (and q) fused with the append to the caches (`kv_…`,
    /// [`crate::params::KvParams`]).
    Kv,
    /// The KV shift: cached keys rotated in place by their sequence's position delta
    /// (`shift_…`, [`crate::params::ShiftParams`]).
    Shift,
}

/// Which elements are paired.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Pairs {
    /// Rotate-half (GPT-NeoX, Llama, Qwen, …): `neox`.
    NeoX,
    /// Interleaved (GPT-J): `gptj`.
    GptJ,
    /// Interleaved pairs read, written back de-interleaved (pair `i`'s two values at `i` and
    /// `rotary_dim / 2 + i`, transformers' DeepSeek-V3 order): `gptjd`.
    Deinterleaved,
}

/// The element type of the inputs (q, k, v) and of outputs of the inputs' type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Elem {
    /// `f32`.
    F32,
    /// `f16`.
    F16,
    /// `bf16`.
    Bf16,
}

/// What the outputs (RoPE's q and k, the append's caches) hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Store {
    /// The inputs' type.
    Input,
    /// FP8, either format (the launch's): `_fp8`.
    Fp8,
}

/// How a kernel moves its rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Width {
    /// `_s`: element by element (views whose addresses, strides or dims forbid vectors).
    Scalar,
    /// `_d`: 8-byte accesses, one head a thread (the append's few-token kernels).
    Decode,
    /// `_p`: 16-byte accesses, one head a thread.
    Single,
    /// `_v`: 16-byte accesses, several heads a thread.
    Vector,
}

/// Which table row a pair reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Rows {
    /// The token's one position.
    One,
    /// MRoPE's three position streams (`_m`).
    Streams,
}

/// Where cos and sin come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Source {
    /// The library's f32 table.
    Table,
    /// Computed in the kernel from the library's frequencies (`_c`).
    Computed,
    /// The caller's tables in the inputs' type (`_t`: candle's drop-ins, the reference update).
    Caller,
}

/// The QK-norm before the rotation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Norm {
    /// None.
    None,
    /// Each head of q and k over its own `head_dim` (`_n`: Qwen3, Gemma 3, …).
    Head,
    /// Each token's whole q projection and whole k projection (`_w`: OLMo 2); with
    /// [`Op::Kv`], also the values' one head alone (MLA's `kv_c`).
    Whole,
}

/// One combination of the axes: an entry point where [`supported`] says so.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Variant {
    /// The operation.
    pub op: Op,
    /// The pairing.
    pub pairs: Pairs,
    /// The inputs' element type.
    pub elem: Elem,
    /// The outputs' type.
    pub store: Store,
    /// The access width.
    pub width: Width,
    /// The table rows a pair reads.
    pub rows: Rows,
    /// The source of cos and sin.
    pub source: Source,
    /// The QK-norm.
    pub norm: Norm,
}

/// A rule of the table that a variant breaks: [`supported`]'s answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Unsupported {
    /// RoPE writes q and k in their inputs' type.
    RopeFp8,
    /// RoPE moves single elements or 16 bytes.
    RopeDecode,
    /// The caller's tables: one position row, no norm; the append GPT-J only.
    Caller,
    /// De-interleaved pairs: the append only, one position row, vector widths.
    Deinterleaved,
    /// A QK-norm needs a vector width (views of 16-byte accesses; the append's decode
    /// kernels then move 8 bytes a lane).
    HeadNorm,
    /// A whole-projection norm needs one head a thread (or, in the append, NeoX pairs at
    /// several).
    WholeNorm,
    /// The KV shift: NeoX or GPT-J pairs, one position row, cos and sin computed, no norm,
    /// the element or one-head 16-byte width; FP8 caches by one kernel of each pairing and
    /// width.
    Shift,
}

impl Unsupported {
    /// The rule, in words.
    pub const fn reason(self) -> &'static str {
        match self {
            Unsupported::RopeFp8 => {
                "RoPE writes q and k in their inputs' type (FP8 outputs are the KV append's caches)"
            }
            Unsupported::RopeDecode => "RoPE moves single elements or 16 bytes (8-byte accesses are the KV append's)",
            Unsupported::Caller => {
                "the caller's tables take one position row and no norm; in the KV append (the reference update), \
                 GPT-J pairs into caches of the inputs' type, at the element, 8-byte and several-heads widths"
            }
            Unsupported::Deinterleaved => {
                "de-interleaved pairs: the KV append of GPT-J pairs, one position row, views of 16-byte accesses, \
                 no per-head QK-norm"
            }
            Unsupported::HeadNorm => {
                "a QK-norm takes views of 16-byte accesses (addresses, strides, head_dim and rotary_dim / 2 \
                 in whole 16 bytes), in RoPE and in the KV append alike: a head's lanes sum inside one warp"
            }
            Unsupported::WholeNorm => {
                "a whole-projection norm takes views of 16-byte accesses (addresses, strides, head_dim and \
                 rotary_dim / 2 in whole 16 bytes), in RoPE and in the KV append alike, one head a thread \
                 (or, in the append, several heads a thread of NeoX pairs)"
            }
            Unsupported::Shift => {
                "the KV shift rotates cached keys in place: NeoX or GPT-J pairs (de-interleaved keys are \
                 NeoX-ordered), one position row (a sequence's delta), cos and sin computed from the delta's \
                 angle, no norm, element by element or 16 bytes (one head a thread; FP8 caches of either format, \
                 8 codes a lane, several heads a thread)"
            }
        }
    }
}

impl core::fmt::Display for Unsupported {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(self.reason())
    }
}

/// The rules: whether `v` has an entry point, else the first rule it breaks.
pub const fn supported(v: &Variant) -> Result<(), Unsupported> {
    // The shift first: the rules below read "not RoPE" as the append.
    if matches!(v.op, Op::Shift) {
        let ok = !matches!(v.pairs, Pairs::Deinterleaved)
            && matches!(v.rows, Rows::One)
            && matches!(v.source, Source::Computed)
            && matches!(v.norm, Norm::None)
            && match v.store {
                // 16 bytes: one head a thread, FP8's 8 codes a lane several.
                Store::Input => matches!(v.width, Width::Scalar | Width::Single),
                Store::Fp8 => matches!(v.width, Width::Scalar | Width::Vector) && matches!(v.elem, Elem::Bf16),
            };
        return if ok { Ok(()) } else { Err(Unsupported::Shift) };
    }
    let rope = matches!(v.op, Op::Rope);
    let vector = matches!(v.width, Width::Single | Width::Vector);
    let one_head = matches!(v.width, Width::Single) || (!rope && matches!(v.width, Width::Decode));
    let several_neox = !rope && matches!(v.width, Width::Vector) && matches!(v.pairs, Pairs::NeoX);
    if rope && matches!(v.store, Store::Fp8) {
        return Err(Unsupported::RopeFp8);
    }
    if rope && matches!(v.width, Width::Decode) {
        return Err(Unsupported::RopeDecode);
    }
    if matches!(v.source, Source::Caller)
        && !(matches!(v.rows, Rows::One)
            && matches!(v.norm, Norm::None)
            && (rope
                || (matches!(v.pairs, Pairs::GptJ)
                    && matches!(v.store, Store::Input)
                    && !matches!(v.width, Width::Single))))
    {
        return Err(Unsupported::Caller);
    }
    if matches!(v.pairs, Pairs::Deinterleaved)
        && (rope || !matches!(v.rows, Rows::One) || matches!(v.width, Width::Scalar) || matches!(v.norm, Norm::Head))
    {
        return Err(Unsupported::Deinterleaved);
    }
    match v.norm {
        Norm::Head if !(vector || (matches!(v.width, Width::Decode) && !rope)) => Err(Unsupported::HeadNorm),
        Norm::Whole if !(one_head || several_neox) => Err(Unsupported::WholeNorm),
        _ => Ok(()),
    }
}

/// Every value of each axis, in the order the entry-point list takes them.
pub mod axes {
    use super::*;
    /// Operations.
    pub const OPS: [Op; 3] = [Op::Rope, Op::Kv, Op::Shift];
    /// Pairings.
    pub const PAIRS: [Pairs; 3] = [Pairs::NeoX, Pairs::GptJ, Pairs::Deinterleaved];
    /// Input types.
    pub const ELEMS: [Elem; 3] = [Elem::F32, Elem::F16, Elem::Bf16];
    /// Output types.
    pub const STORES: [Store; 2] = [Store::Input, Store::Fp8];
    /// Widths.
    pub const WIDTHS: [Width; 4] = [Width::Scalar, Width::Decode, Width::Single, Width::Vector];
    /// Position rows.
    pub const ROWS: [Rows; 2] = [Rows::One, Rows::Streams];
    /// Sources of cos and sin.
    pub const SOURCES: [Source; 3] = [Source::Table, Source::Computed, Source::Caller];
    /// QK-norms.
    pub const NORMS: [Norm; 3] = [Norm::None, Norm::Head, Norm::Whole];
}

/// Every variant of the product of the axes, supported or not.
pub fn product() -> impl Iterator<Item = Variant> {
    use axes::*;
    OPS.into_iter().flat_map(|op| {
        PAIRS.into_iter().flat_map(move |pairs| {
            ELEMS.into_iter().flat_map(move |elem| {
                STORES.into_iter().flat_map(move |store| {
                    WIDTHS.into_iter().flat_map(move |width| {
                        ROWS.into_iter().flat_map(move |rows| {
                            SOURCES.into_iter().flat_map(move |source| {
                                NORMS.into_iter().map(move |norm| Variant {
                                    op,
                                    pairs,
                                    elem,
                                    store,
                                    width,
                                    rows,
                                    source,
                                    norm,
                                })
                            })
                        })
                    })
                })
            })
        })
    })
}

/// Every supported variant: one entry point each.
pub fn variants() -> impl Iterator<Item = Variant> {
    product().filter(|v| supported(v).is_ok())
}

impl Variant {
    /// The parts of the entry point's name: `{op}_{pairs}_{types}_{width}{rows}{source}{norm}`
    /// (the shift's FP8 kernels name no input type: `shift_{pairs}_fp8_…`).
    pub const fn parts(&self) -> [&'static str; 8] {
        let shift_fp8 = matches!(self.op, Op::Shift) && matches!(self.store, Store::Fp8);
        [
            match self.op {
                Op::Rope => "rope",
                Op::Kv => "kv",
                Op::Shift => "shift",
            },
            match self.pairs {
                Pairs::NeoX => "neox",
                Pairs::GptJ => "gptj",
                Pairs::Deinterleaved => "gptjd",
            },
            match self.elem {
                _ if shift_fp8 => "fp8",
                Elem::F32 => "f32",
                Elem::F16 => "f16",
                Elem::Bf16 => "bf16",
            },
            match self.store {
                _ if shift_fp8 => "",
                Store::Input => "",
                Store::Fp8 => "_fp8",
            },
            match self.width {
                Width::Scalar => "s",
                Width::Decode => "d",
                Width::Single => "p",
                Width::Vector => "v",
            },
            match self.rows {
                Rows::One => "",
                Rows::Streams => "_m",
            },
            match self.source {
                Source::Table => "",
                Source::Computed => "_c",
                Source::Caller => "_t",
            },
            match self.norm {
                Norm::None => "",
                Norm::Head => "_n",
                Norm::Whole => "_w",
            },
        ]
    }

    /// The entry point's name (host side: the generator's and the tests').
    #[cfg(not(target_arch = "nvptx64"))]
    pub fn name(&self) -> String {
        let [op, pairs, elem, store, width, rows, source, norm] = self.parts();
        [op, "_", pairs, "_", elem, store, "_", width, rows, source, norm].concat()
    }

    /// Whether `name` is this variant's entry point's name.
    #[cfg(not(target_arch = "nvptx64"))]
    pub fn is_named(&self, name: &str) -> bool {
        self.name() == name
    }
}
