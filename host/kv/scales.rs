//! The FP8 stage of the append: the caches' one format, their scales, and q's FP8 output with
//! its scale, checked before anything is planned ([`fp8_stage`]).

use crate::config::DType;
use crate::error::{Error, Result};
use crate::launch::{check_axis, check_view, check_written};

use super::call::{KvCall, KvOperand};
use super::{RawKvArgs, RawKvCache, RawQFp8, RawScales};

/// The FP8 stage's result: the caches' scales (FP8 caches only) and q's FP8 output.
#[derive(Debug, Clone, Copy)]
pub(super) struct Fp8Stage {
    pub scales: Option<RawScales>,
    pub q_fp8: Option<RawQFp8>,
}

/// The caches' one format, their scales, and q's FP8 output: the caches both of one FP8 format
/// or neither, the scales given exactly for FP8 caches, an FP8 output of q only with q and
/// FP8 caches, of their format and q's shape, with one scale.
pub(super) fn fp8_stage(call: &KvCall, args: &RawKvArgs, kv_heads: usize) -> Result<Fp8Stage> {
    let (cache, n) = (&args.cache, call.names);
    let fp8 = cache.k.dtype.fp8();
    if fp8.is_some() && cache.v.dtype != cache.k.dtype {
        return Err(Error::DType { what: n(KvOperand::VCache), expected: cache.k.dtype, got: cache.v.dtype });
    }
    let scales = check_scales(cache, fp8.is_some(), kv_heads, call)?;
    let q_fp8 = match (args.q_fp8, &args.q) {
        (None, _) => None,
        (Some(_), None) => return Err(Error::Scales("an FP8 output of q needs q (RawKvArgs::q)")),
        (Some(_), Some(_)) if fp8.is_none() => {
            return Err(Error::Scales("an FP8 output of q needs FP8 caches, of its format"));
        }
        (Some(o), Some(q)) => {
            if o.out.dtype != cache.k.dtype {
                return Err(Error::DType { what: n(KvOperand::QOut), expected: cache.k.dtype, got: o.out.dtype });
            }
            for (axis, i) in [("batch", 0), ("seq", 1), ("heads", 2), ("head_dim", 3)] {
                check_axis(n(KvOperand::QOut), axis, q.layout.shape[i], o.out.layout.shape[i])?;
            }
            check_view(n(KvOperand::QOut), &o.out)?;
            check_written(n(KvOperand::QOut), &o.out.layout)?;
            check_scale(n(KvOperand::QScale), o.scale, 1)?;
            Some(o)
        }
    };
    Ok(Fp8Stage { scales, q_fp8 })
}

/// The scales of `cache`, checked: FP8 caches (`fp8`) need them, others take none; each
/// buffer holds one f32, or, per head, one per kv head, and is aligned for f32 (named as
/// `call` names them).
pub(super) fn check_scales(cache: &RawKvCache, fp8: bool, kv_heads: usize, call: &KvCall) -> Result<Option<RawScales>> {
    match (cache.scales, fp8) {
        (None, false) => Ok(None),
        (None, true) => Err(Error::Scales(call.need_scales)),
        (Some(_), false) => Err(Error::Scales("only FP8 caches take scales")),
        (Some(s), true) => {
            let n = if s.per_head { kv_heads } else { 1 };
            check_scale((call.names)(KvOperand::KScales), s.k, n)?;
            check_scale((call.names)(KvOperand::VScales), s.v, n)?;
            Ok(Some(s))
        }
    }
}

/// A scale buffer `(address, length)` holds `n` f32 and is aligned for them.
fn check_scale(what: &'static str, (ptr, len): (u64, usize), n: usize) -> Result<()> {
    if len != n {
        return Err(Error::Length { what, shape: vec![n], expected: n, got: len });
    }
    match ptr % 4 {
        0 => Ok(()),
        _ => Err(Error::Alignment { what, address: ptr, align: 4 }),
    }
}

/// A scale buffer as a flat f32 tensor, for the overlap checks.
pub(super) fn scale_tensor((ptr, len): (u64, usize)) -> crate::tensor::RawTensor {
    crate::tensor::RawTensor::new(ptr, len, DType::F32, crate::layout::Layout::bshd(1, 1, 1, len))
}
