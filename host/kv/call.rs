//! What one append asks beyond the configuration ([`KvCall`]): the MLA append's options, and
//! the names its caller knows the operands by ([`KvOperand`]).

use crate::norm::RawMlaNorm;

/// What an FP8 cache without scales is told.
pub(crate) const NEED_SCALES: &str = "FP8 caches need their scales (KvCache::scales)";

/// An append's operands, as its errors name them ([`KvCall::names`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum KvOperand {
    Q,
    QOut,
    QScale,
    K,
    V,
    /// Both caches' one layout.
    Cache,
    KCache,
    VCache,
    KScales,
    VScales,
    QNormWeight,
    KNormWeight,
    VNormWeight,
}

impl KvOperand {
    /// The KV append's own name of the operand.
    pub fn name(self) -> &'static str {
        match self {
            KvOperand::Q => "q",
            KvOperand::QOut => "q out",
            KvOperand::QScale => "q scale",
            KvOperand::K => "k",
            KvOperand::V => "v",
            KvOperand::Cache => "cache",
            KvOperand::KCache => "k cache",
            KvOperand::VCache => "v cache",
            KvOperand::KScales => "k scales",
            KvOperand::VScales => "v scales",
            KvOperand::QNormWeight => "q norm weight",
            KvOperand::KNormWeight => "k norm weight",
            KvOperand::VNormWeight => "kv_c norm weight",
        }
    }
}

/// What one call asks beyond the configuration: the MLA append's options, and the names its
/// caller knows the operands by (the KV append's, or MLA's).
#[derive(Debug, Clone, Copy)]
pub(crate) struct KvCall {
    /// GPT-J pairs written back de-interleaved (MLA's option, [`crate::MlaAppend::deinterleaved`]).
    pub deinterleave: bool,
    /// The RMS norm of the values' one head (MLA's `kv_c`, [`crate::MlaAppend::kv_c_norm`]);
    /// not with a QK-norm.
    pub v_norm: Option<RawMlaNorm>,
    /// Each operand's name in errors.
    pub names: fn(KvOperand) -> &'static str,
    /// What FP8 caches without scales are told.
    pub need_scales: &'static str,
}

impl KvCall {
    /// The KV append's: no MLA option, its own names.
    pub const APPEND: KvCall =
        KvCall { deinterleave: false, v_norm: None, names: KvOperand::name, need_scales: NEED_SCALES };
}
