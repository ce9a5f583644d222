//! QK-norm in the fused append ([`QkNorm`], [`KvAppend::norm`](crate::KvAppend::norm)): the
//! RMS norm of each head of q and k, in the same launch as their rotation and the cache
//! writes.

use rope_cuda_kernels::keys::DType;
use rope_cuda_kernels::norm::NormView;

use crate::error::{Error, Result};
use crate::layout::Layout;
use crate::operand::{Element, Hold, Operand};
use crate::tensor::RawTensor;

/// Which norm a model applies to each head of q and k: `x_i · r · w_i` with
/// `r = 1 / sqrt(mean(x²) + eps)` over the head's `head_dim` elements, the statistic in f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum NormKind {
    /// RMSNorm with a weight per dim, `x · r · w` (Qwen3, Qwen3-MoE, and the models with
    /// `use_qk_norm`): the weights `[head_dim]` of q's norm and of k's.
    Rms,
    /// RMSNorm with `1 + w` (Gemma 3, Gemma 4), the sum taken in f32 as those models do.
    RmsOnePlus,
    /// No weight, `x · r` (Llama 4's norm of q and k on its RoPE layers). Llama 4 applies it
    /// after the rotation; a rotation keeps each pair's length, so the head's mean square, and
    /// with it the result, is the same before and after it (exactly, in real arithmetic):
    /// the launch normalizes first.
    RmsUnit,
}

/// A weight buffer as device memory: address, length (elements) and element type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawWeight {
    /// Device address.
    pub ptr: u64,
    /// Elements (must be `head_dim`).
    pub len: usize,
    /// Element type (f32, f16 or bf16; q's and k's the same).
    pub dtype: DType,
}

impl RawWeight {
    /// The weights as a one-row tensor, for the overlap checks against the written buffers.
    pub(crate) fn tensor(self) -> RawTensor {
        RawTensor::new(self.ptr, self.len, self.dtype, Layout::bshd(1, 1, 1, self.len))
    }
}

/// A QK-norm as device addresses ([`RawKvArgs::norm`](crate::RawKvArgs::norm)).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RawNorm {
    /// The kind of norm.
    pub kind: NormKind,
    /// Added to the mean of the squares (finite and positive: the model's `rms_norm_eps`).
    pub eps: f32,
    /// q's weights (`[head_dim]`; none for [`NormKind::RmsUnit`]).
    pub q_weight: Option<RawWeight>,
    /// k's weights (`[head_dim]`; none for [`NormKind::RmsUnit`]).
    pub k_weight: Option<RawWeight>,
}

/// The QK-norm of an append: its kind, `eps` and, for the weighted kinds, the weights of q's
/// and of k's norm (`[head_dim]` each, f32, f16 or bf16, as the model holds them).
///
/// ```
/// # let Ok(_ctx) = cust::quick_init() else { return Ok(()) }; // no GPU: nothing to run
/// use cust::memory::DeviceBuffer;
/// use half::bf16;
/// use rope_cuda::{NormKind, QkNorm};
/// // Qwen3's q_norm and k_norm weights (head_dim 128), rms_norm_eps 1e-6.
/// let (qw, kw) = (DeviceBuffer::from_slice(&[bf16::ONE; 128])?, DeviceBuffer::from_slice(&[bf16::ONE; 128])?);
/// let norm = QkNorm::rms(&qw, &kw, 1e-6);
/// assert_eq!(norm.raw().kind, NormKind::Rms);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct QkNorm<'a> {
    raw: RawNorm,
    holds: [Option<Hold<'a>>; 2],
}

impl<'a> QkNorm<'a> {
    fn weighted(
        kind: NormKind,
        q: impl Operand<'a, Elem: Element>,
        k: impl Operand<'a, Elem: Element>,
        eps: f32,
        dtype: DType,
    ) -> Self {
        let ((qp, ql, qh), (kp, kl, kh)) = (q.lend(), k.lend());
        let raw = RawNorm {
            kind,
            eps,
            q_weight: Some(RawWeight { ptr: qp, len: ql, dtype }),
            k_weight: Some(RawWeight { ptr: kp, len: kl, dtype }),
        };
        QkNorm { raw, holds: [Some(qh), Some(kh)] }
    }

    /// RMSNorm with weights `q_weight` and `k_weight` ([`NormKind::Rms`]: Qwen3 and the
    /// models with `use_qk_norm`).
    pub fn rms<E: Element>(
        q_weight: impl Operand<'a, Elem = E>,
        k_weight: impl Operand<'a, Elem = E>,
        eps: f32,
    ) -> Self {
        Self::weighted(NormKind::Rms, q_weight, k_weight, eps, E::DTYPE)
    }

    /// RMSNorm with `1 + w` ([`NormKind::RmsOnePlus`]: Gemma 3 and Gemma 4).
    pub fn gemma<E: Element>(
        q_weight: impl Operand<'a, Elem = E>,
        k_weight: impl Operand<'a, Elem = E>,
        eps: f32,
    ) -> Self {
        Self::weighted(NormKind::RmsOnePlus, q_weight, k_weight, eps, E::DTYPE)
    }

    /// RMSNorm without a weight ([`NormKind::RmsUnit`]: Llama 4's RoPE layers).
    pub fn unit(eps: f32) -> Self {
        QkNorm { raw: RawNorm { kind: NormKind::RmsUnit, eps, q_weight: None, k_weight: None }, holds: [None, None] }
    }

    /// The norm as device addresses.
    pub fn raw(&self) -> RawNorm {
        self.raw
    }

    /// The weights' holds (q's, k's).
    pub(crate) fn holds(&self) -> [Option<&Hold<'a>>; 2] {
        [self.holds[0].as_ref(), self.holds[1].as_ref()]
    }
}

/// Checks `norm` for heads of `head_dim` elements and makes its view: `eps` finite and
/// positive, weights where the kind takes them (and only there), each of `head_dim`
/// elements of one type (f32, f16 or bf16), aligned for it.
pub(crate) fn norm_view(norm: &RawNorm, head_dim: usize, inputs: DType) -> Result<NormView> {
    if !(norm.eps.is_finite() && norm.eps > 0.0) {
        return Err(Error::NormEps { eps: norm.eps });
    }
    let weighted = norm.kind != NormKind::RmsUnit;
    let (q, k) = match (weighted, norm.q_weight, norm.k_weight) {
        (true, Some(q), Some(k)) => (Some(q), Some(k)),
        (false, None, None) => (None, None),
        (true, ..) => return Err(Error::Norm("this norm takes a weight for q and one for k")),
        (false, ..) => return Err(Error::Norm("NormKind::RmsUnit takes no weights")),
    };
    let mut w_type = DType::F32;
    for (what, w) in [("q norm weight", q), ("k norm weight", k)] {
        let Some(w) = w else { continue };
        if !matches!(w.dtype, DType::F32 | DType::F16 | DType::BF16) {
            return Err(Error::DType { what, expected: DType::F32, got: w.dtype });
        }
        if what == "k norm weight" && w.dtype != w_type {
            return Err(Error::DType { what, expected: w_type, got: w.dtype });
        }
        w_type = w.dtype;
        if w.len != head_dim {
            return Err(Error::Length { what, shape: vec![head_dim], expected: head_dim, got: w.len });
        }
        let align = w.dtype.size() as u64;
        if w.ptr % align != 0 {
            return Err(Error::Alignment { what, address: w.ptr, align: align as usize });
        }
    }
    Ok(NormView {
        weights: [q.map_or(0, |w| w.ptr), k.map_or(0, |w| w.ptr)],
        w_type,
        offset: if norm.kind == NormKind::RmsOnePlus { 1.0 } else { 0.0 },
        eps: norm.eps,
        // The mean's divisor's reciprocal, rounded once to f32.
        inv_dim: (1.0 / head_dim as f64) as f32,
        // Vector loads where both weights are of the inputs' type and 16-byte aligned.
        vector: [q, k].iter().flatten().all(|w| w.dtype == inputs && w.ptr % 16 == 0) as u32,
    })
}
