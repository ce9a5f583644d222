//! QK-norm in the fused append ([`QkNorm`], [`KvAppend::norm`](crate::KvAppend::norm)): the
//! RMS norm of each head of q and k, in the same launch as their rotation and the cache
//! writes.

use rope_cuda_kernels::keys::DType;
use rope_cuda_kernels::norm::NormView;

use crate::error::{Error, Result};
use crate::layout::Layout;
use crate::operand::{Element, Hold, Operand};
use crate::tensor::RawTensor;
use rope_cuda_kernels::params::{kv_segments, lane_slots, warp_align};

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
    /// RMSNorm with a weight over the whole q projection and the whole k projection, across
    /// heads (OLMo 2 and OLMo 3): one statistic per token for q (`mean(x²)` over its `q_heads ×
    /// head_dim` elements) and one for k, each element times its own weight (weights
    /// `[q_heads × head_dim]` and `[kv_heads × head_dim]`, in the projection's order: head
    /// `h`'s at `h × head_dim`). The launch keeps each token's q heads, and its k heads, in
    /// one block of at most 512 threads, one per 32 bytes of a rotated head (16 past
    /// `rotary_dim`): up to 16 KiB of a projection with full rotary, 8192 elements of
    /// f16/bf16 or 4096 of f32 ([`Error::Norm`](crate::Error::Norm) past that).
    RmsProjection,
}

/// A weight buffer as device memory: address, length (elements) and element type. Built by
/// [`RawWeight::new`] (or inside [`QkNorm::raw`]), so that a field added later breaks no caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct RawWeight {
    /// Device address.
    pub ptr: u64,
    /// Elements (must be `head_dim`; `heads × head_dim` for [`NormKind::RmsProjection`]).
    pub len: usize,
    /// Element type (f32, f16 or bf16; q's and k's the same).
    pub dtype: DType,
}

impl RawWeight {
    /// `len` weights of type `dtype` at device address `ptr`.
    pub const fn new(ptr: u64, len: usize, dtype: DType) -> Self {
        RawWeight { ptr, len, dtype }
    }

    /// The weights as a one-row tensor, for the overlap checks against the written buffers.
    pub(crate) fn tensor(self) -> RawTensor {
        RawTensor::new(self.ptr, self.len, self.dtype, Layout::bshd(1, 1, 1, self.len))
    }
}

/// A QK-norm as device addresses ([`RawKvArgs::norm`](crate::RawKvArgs::norm)): built by
/// [`QkNorm::raw`] or by [`RawNorm::new`] and [`RawNorm::with_weights`], so that a field added
/// later breaks no caller.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct RawNorm {
    /// The kind of norm.
    pub kind: NormKind,
    /// Added to the mean of the squares (finite and positive: the model's `rms_norm_eps`).
    pub eps: f32,
    /// q's weights (`[head_dim]`, `[q_heads × head_dim]` for [`NormKind::RmsProjection`];
    /// none for [`NormKind::RmsUnit`]).
    pub q_weight: Option<RawWeight>,
    /// k's weights (`[head_dim]`, `[kv_heads × head_dim]` for [`NormKind::RmsProjection`];
    /// none for [`NormKind::RmsUnit`]).
    pub k_weight: Option<RawWeight>,
}

impl RawNorm {
    /// A norm of `kind` with `eps` and no weights (as [`NormKind::RmsUnit`] takes them; add
    /// the weighted kinds' with [`RawNorm::with_weights`]).
    pub fn new(kind: NormKind, eps: f32) -> Self {
        RawNorm { kind, eps, q_weight: None, k_weight: None }
    }

    /// The weights of q's norm (`q_weight`) and of k's (`k_weight`).
    pub fn with_weights(self, q_weight: RawWeight, k_weight: RawWeight) -> Self {
        RawNorm { q_weight: Some(q_weight), k_weight: Some(k_weight), ..self }
    }
}

/// The QK-norm of an append: its kind, `eps` and, for the weighted kinds, the weights of q's
/// and of k's norm (`[head_dim]` each, f32, f16 or bf16, as the model holds them).
///
/// One rule says which views it takes, in RoPE ([`RopeArgs::norm`](crate::RopeArgs::norm)) and
/// in the fused append ([`KvAppend::norm`](crate::KvAppend::norm)) alike:
/// - every view of the launch takes 16-byte accesses: addresses and strides multiples of 16
///   bytes, `head_dim` and `rotary_dim / 2` multiples of 16 bytes' elements;
/// - a head fits one warp's 32 lanes of 16 bytes: `(head_dim - rotary_dim / 2) × element size`
///   at most 512 bytes (fully rotated, head_dim up to 512 in f16/bf16 and 256 in f32).
///
/// Otherwise [`Error::Norm`](crate::Error::Norm), before any launch. (The append's decode
/// kernels move 8 bytes a lane where a head's lanes still fit a warp: the kernels' choice,
/// not a rule of the views.)
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
        Self::of_lent(kind, q.lend(), k.lend(), eps, dtype)
    }

    /// A weighted norm of the lent weights (address, length, hold) of q and k.
    fn of_lent(
        kind: NormKind,
        (qp, ql, qh): (u64, usize, Hold<'a>),
        (kp, kl, kh): (u64, usize, Hold<'a>),
        eps: f32,
        dtype: DType,
    ) -> Self {
        let raw = RawNorm::new(kind, eps).with_weights(RawWeight::new(qp, ql, dtype), RawWeight::new(kp, kl, dtype));
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

    /// RMSNorm with `1 + w` ([`NormKind::RmsOnePlus`]: Gemma 3 and Gemma 4), the sum rounded
    /// to f32 as transformers' `1.0 + weight.float()` rounds it.
    pub fn gemma<E: Element>(
        q_weight: impl Operand<'a, Elem = E>,
        k_weight: impl Operand<'a, Elem = E>,
        eps: f32,
    ) -> Self {
        Self::weighted(NormKind::RmsOnePlus, q_weight, k_weight, eps, E::DTYPE)
    }

    /// RMSNorm over the whole q and k projections with weights `q_weight` (`[q_heads ×
    /// head_dim]`) and `k_weight` (`[kv_heads × head_dim]`) ([`NormKind::RmsProjection`]:
    /// OLMo 2 and OLMo 3).
    pub fn olmo<E: Element>(
        q_weight: impl Operand<'a, Elem = E>,
        k_weight: impl Operand<'a, Elem = E>,
        eps: f32,
    ) -> Self {
        Self::weighted(NormKind::RmsProjection, q_weight, k_weight, eps, E::DTYPE)
    }

    /// RMSNorm without a weight ([`NormKind::RmsUnit`]: Llama 4's RoPE layers).
    pub fn unit(eps: f32) -> Self {
        QkNorm { raw: RawNorm::new(NormKind::RmsUnit, eps), holds: [None, None] }
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

/// A model's QK-norm as its `config.json` gives it ([`HfConfig::qk_norm`](crate::HfConfig::qk_norm)):
/// the kind, `eps` and, where the config has the sizes, the weights' lengths, which
/// [`QkNormSpec::weights`] checks when it makes the [`QkNorm`] of the model's weights. Engines
/// build any model's norm through it without matching on [`NormKind`].
///
/// ```
/// use rope_cuda::{Error, HfConfig, NormKind};
/// let olmo2 = HfConfig::parse(r#"{"model_type": "olmo2", "rms_norm_eps": 1e-6, "hidden_size": 4096,
///     "num_attention_heads": 32, "num_key_value_heads": 8}"#)?;
/// let spec = olmo2.qk_norm(0)?.expect("OLMo 2 normalizes q and k");
/// assert_eq!((spec.kind(), spec.eps(), spec.takes_weights()), (NormKind::RmsProjection, 1e-6, true));
/// // The whole projections' weights: [32 × 128] and [8 × 128]; per-head weights are refused.
/// assert_eq!(spec.weight_lens(), Some((4096, 1024)));
/// assert!(spec.check(4096, 1024).is_ok());
/// assert!(matches!(spec.check(128, 128), Err(Error::Length { what: "q norm weights", .. })));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QkNormSpec {
    kind: NormKind,
    eps: f32,
    lens: Option<(usize, usize)>,
}

impl QkNormSpec {
    /// A norm of `kind` with `eps`, its weights `lens` elements long (q's, k's) where known.
    pub(crate) fn new(kind: NormKind, eps: f32, lens: Option<(usize, usize)>) -> Self {
        let lens = if kind == NormKind::RmsUnit { None } else { lens };
        QkNormSpec { kind, eps, lens }
    }

    /// The kind of norm.
    pub fn kind(&self) -> NormKind {
        self.kind
    }

    /// The model's `rms_norm_eps`.
    pub fn eps(&self) -> f32 {
        self.eps
    }

    /// Whether the norm has weights (all kinds but [`NormKind::RmsUnit`]).
    pub fn takes_weights(&self) -> bool {
        self.kind != NormKind::RmsUnit
    }

    /// The lengths of q's and k's weights in elements, where the config gives the sizes:
    /// `head_dim` each, or the whole projections' `heads × head_dim` and `kv_heads × head_dim`
    /// ([`NormKind::RmsProjection`]); `None` for [`NormKind::RmsUnit`].
    pub fn weight_lens(&self) -> Option<(usize, usize)> {
        self.lens
    }

    /// Checks weights of `q_len` and `k_len` elements against [`QkNormSpec::weight_lens`]
    /// ([`Error::Length`] for a mismatch: per-head weights given to a whole-projection norm,
    /// or the other way round), and that the kind takes weights ([`Error::Norm`]).
    pub fn check(&self, q_len: usize, k_len: usize) -> Result<()> {
        if !self.takes_weights() {
            return Err(Error::Norm("this model's QK-norm has no weights: use QkNormSpec::unweighted"));
        }
        if let Some((q, k)) = self.lens {
            for (what, want, got) in [("q norm weights", q, q_len), ("k norm weights", k, k_len)] {
                if want != got {
                    return Err(Error::Length { what, shape: vec![want], expected: want, got });
                }
            }
        }
        Ok(())
    }

    /// The norm with the model's weights `q_weight` and `k_weight` (its `q_norm` and `k_norm`
    /// tensors), checked as [`QkNormSpec::check`] says.
    pub fn weights<'a, E: Element>(
        &self,
        q_weight: impl Operand<'a, Elem = E>,
        k_weight: impl Operand<'a, Elem = E>,
    ) -> Result<QkNorm<'a>> {
        let (q, k) = (q_weight.lend(), k_weight.lend());
        self.check(q.1, k.1)?;
        Ok(QkNorm::of_lent(self.kind, q, k, self.eps, E::DTYPE))
    }

    /// The norm of a kind without weights ([`NormKind::RmsUnit`]: Llama 4's); [`Error::Norm`]
    /// for the kinds that take them.
    pub fn unweighted<'a>(&self) -> Result<QkNorm<'a>> {
        match self.takes_weights() {
            true => Err(Error::Norm("this model's QK-norm takes weights: use QkNormSpec::weights")),
            false => Ok(QkNorm::unit(self.eps)),
        }
    }
}

/// Checks `norm` for heads of `head_dim` elements and makes its view: `eps` finite and
/// positive, weights where the kind takes them (and only there), each of one type (f32, f16
/// or bf16), aligned for it, of `head_dim` elements (a whole-projection norm: `heads[i] ×
/// head_dim` for q (`i == 0`) and k (1), unchecked where the call has no such operand,
/// `None`: its weights are not read).
pub(crate) fn norm_view(norm: &RawNorm, head_dim: usize, heads: [Option<usize>; 2], inputs: DType) -> Result<NormView> {
    if !(norm.eps.is_finite() && norm.eps > 0.0) {
        return Err(Error::NormEps { eps: norm.eps });
    }
    let weighted = norm.kind != NormKind::RmsUnit;
    let whole = norm.kind == NormKind::RmsProjection;
    let (q, k) = match (weighted, norm.q_weight, norm.k_weight) {
        (true, Some(q), Some(k)) => (Some(q), Some(k)),
        (false, None, None) => (None, None),
        (true, ..) => return Err(Error::Norm("this norm takes a weight for q and one for k")),
        (false, ..) => return Err(Error::Norm("NormKind::RmsUnit takes no weights")),
    };
    // The mean's divisor of q's and k's statistics.
    let dims = heads.map(|h| match (whole, h) {
        (true, Some(h)) if h > 0 => h.saturating_mul(head_dim),
        _ => head_dim,
    });
    let mut w_type = DType::F32;
    for (i, what, w) in [(0, "q norm weight", q), (1, "k norm weight", k)] {
        let Some(w) = w else { continue };
        if !matches!(w.dtype, DType::F32 | DType::F16 | DType::BF16) {
            return Err(Error::DType { what, expected: DType::F32, got: w.dtype });
        }
        if i == 1 && w.dtype != w_type {
            return Err(Error::DType { what, expected: w_type, got: w.dtype });
        }
        w_type = w.dtype;
        let expected = dims[i];
        if (!whole || heads[i].is_some()) && w.len != expected {
            let shape = match whole {
                true => vec![heads[i].unwrap_or(0), head_dim],
                false => vec![head_dim],
            };
            return Err(Error::Length { what, shape, expected, got: w.len });
        }
        let align = w.dtype.size() as u64;
        if w.ptr % align != 0 {
            return Err(Error::Alignment { what, address: w.ptr, align: align as usize });
        }
    }
    let head_step = if whole { (head_dim * w_type.size()) as u32 } else { 0 };
    Ok(NormView {
        weights: [q.map_or(0, |w| w.ptr), k.map_or(0, |w| w.ptr), 0],
        w_type,
        offset: if norm.kind == NormKind::RmsOnePlus { 1.0 } else { 0.0 },
        eps: norm.eps,
        // The mean's divisors' reciprocals, each rounded once to f32.
        inv_dim: [inv(dims[0]), inv(dims[1]), 0.0],
        // Vector loads where both weights are of the inputs' type and 16-byte aligned (each
        // head's, for a whole projection).
        vector: ([q, k].iter().flatten().all(|w| w.dtype == inputs && w.ptr % 16 == 0) && head_step % 16 == 0) as u32,
        head_step,
        projections: rope_cuda_kernels::norm::QK,
    })
}

/// `1 / n` rounded once to f32.
fn inv(n: usize) -> f32 {
    (1.0 / n as f64) as f32
}

/// The RMS norm of MLA's latent `kv_c` (its `kv_a_layernorm`) as device addresses
/// ([`RawMlaArgs::kv_c_norm`](crate::RawMlaArgs::kv_c_norm)): `x_i · r · w_i`, `r = 1 /
/// sqrt(mean(x²) + eps)` over the `kv_lora_rank` elements, the statistic in f32 and the
/// product rounded once, at the store. Built by [`RawMlaNorm::new`] (or inside
/// [`MlaAppend::raw`](crate::MlaAppend::raw)), so that a field added later breaks no caller.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct RawMlaNorm {
    /// The weights, `[kv_lora_rank]` (f32, f16 or bf16).
    pub weight: RawWeight,
    /// Added to the mean of the squares (finite and positive; transformers' DeepSeek and Kimi
    /// models take the norm class's default, 1e-6, not `rms_norm_eps`).
    pub eps: f32,
}

impl RawMlaNorm {
    /// The norm with weights `weight` (`[kv_lora_rank]`) and `eps`.
    pub fn new(weight: RawWeight, eps: f32) -> Self {
        RawMlaNorm { weight, eps }
    }
}

/// Checks the values' norm for a head of `head_dim` elements of type `inputs` and makes its
/// view: the whole-projection kernels' (`_w`), the statistic over the value head's lanes,
/// which may span several warps; q and k are not normalized.
pub(crate) fn value_norm_view(norm: &RawMlaNorm, head_dim: usize, inputs: DType) -> Result<NormView> {
    const WHAT: &str = "kv_c norm weight";
    let w = norm.weight;
    if !(norm.eps.is_finite() && norm.eps > 0.0) {
        return Err(Error::NormEps { eps: norm.eps });
    }
    if !matches!(w.dtype, DType::F32 | DType::F16 | DType::BF16) {
        return Err(Error::DType { what: WHAT, expected: inputs, got: w.dtype });
    }
    if w.len != head_dim {
        return Err(Error::Length { what: WHAT, shape: vec![head_dim], expected: head_dim, got: w.len });
    }
    let align = w.dtype.size() as u64;
    if w.ptr % align != 0 {
        return Err(Error::Alignment { what: WHAT, address: w.ptr, align: align as usize });
    }
    let step = (head_dim * w.dtype.size()) as u32;
    Ok(NormView {
        weights: [0, 0, w.ptr],
        w_type: w.dtype,
        offset: 0.0,
        eps: norm.eps,
        inv_dim: [0.0, 0.0, inv(head_dim)],
        vector: (w.dtype == inputs && w.ptr % 16 == 0) as u32,
        // One head: its weights at 0 whatever the step, which marks the view whole.
        head_step: step,
        projections: rope_cuda_kernels::norm::V,
    })
}

/// The most threads of a block that holds a token's q heads or k heads for a whole-projection
/// norm: every kernel takes 512 (at most 128 registers a thread; `Kernels::check_block` checks
/// it at launch), where 1024 would need at most 64, which most `_w` kernels exceed.
pub(crate) const WHOLE_BLOCK_MAX: u64 = 512;

/// A QK-norm's head inside one warp: at most 32 lanes of 16 bytes, the rotating lanes (each
/// 16 bytes of both halves, or of interleaved pairs) and the rest's, the same in RoPE and in
/// the append ([`QkNorm`]'s rule); `lanes` counted at 16 bytes.
pub(crate) fn check_head_lanes(lanes: usize) -> Result<()> {
    match lane_slots(lanes as u64) <= 32 {
        true => Ok(()),
        false => Err(Error::Norm(
            "a head takes more than 32 lanes of 16 bytes: (head_dim - rotary_dim / 2) x the element size is above 512 bytes",
        )),
    }
}

/// [`Error::Norm`]'s message for a projection past WHOLE_BLOCK_MAX lanes.
pub(crate) const WHOLE_TOO_LARGE: &str = "a whole-projection norm takes a token's q heads (and its k heads) in one \
     block of at most 512 threads, one per 32 bytes of a rotated head: up to 16 KiB of a projection";

/// The blocks of a whole-projection norm, which keep each token's q heads and its k heads
/// inside one block: a token's items (`items(k_start)`, k's segment placed at `k_start`) in
/// one block where they are at most WHOLE_BLOCK_MAX (several tokens a block up to the
/// library's usual 128 threads); else blocks of the longer of q's `q_len` items and k's
/// `k_len` rounded to a warp, k's segment moved from `k_start` to the next block's start where
/// it would straddle one, and the items rounded up to whole blocks. `(k start, items,
/// block)`; `None` past WHOLE_BLOCK_MAX.
fn whole_blocks(q_len: u64, k_len: u64, k_start: u64, items: impl Fn(u64) -> u64) -> Option<(u64, u64, u32)> {
    let base = rope_cuda_kernels::tuning::BLOCK_THREADS as u64;
    let packed = items(k_start);
    if packed <= WHOLE_BLOCK_MAX {
        return Some((k_start, packed, (packed * (base / packed).max(1)) as u32));
    }
    let block = q_len.max(k_len).next_multiple_of(32);
    if block > WHOLE_BLOCK_MAX {
        return None;
    }
    let straddles = k_len > 0 && k_start / block != (k_start + k_len - 1) / block;
    let k_start = if straddles { k_start.next_multiple_of(block) } else { k_start };
    Some((k_start, items(k_start).next_multiple_of(block), block as u32))
}

/// The KV mapping of a whole-projection norm: [`kv_segments`]'s q, k and v groups (of the
/// width's heads a thread) of `lanes` (`[q, k, v]` lanes a head), k's start moved where it would straddle a
/// block and v's following it ([`whole_blocks`]): `(k_start, v_start, items, block)`.
pub(crate) fn whole_kv_layout(q_heads: u64, kv_heads: u64, lanes: [u64; 3]) -> Option<(u64, u64, u64, u32)> {
    let [sq, sk, sv] = lanes.map(lane_slots);
    let (k_start, _, _) = kv_segments(q_heads, kv_heads, lanes);
    let widest = sq.max(sk).max(sv);
    // v's start and the token's items after k's segment at `k`, as `kv_segments` places them.
    let v_at = move |k: u64| warp_align(k + kv_heads * sk, sv);
    let items = move |k: u64| warp_align(v_at(k) + kv_heads * sv, widest);
    let (k_start, items, block) = whole_blocks(q_heads * sq, kv_heads * sk, k_start, items)?;
    Some((k_start, v_at(k_start), items, block))
}

/// The KV mapping of the values' norm alone (MLA's `kv_c`, one value head): [`kv_segments`]'s
/// groups, v's segment (`kv_heads` groups of `lanes[2]`) moved to the next block's start where
/// it would straddle one ([`whole_blocks`], q's and k's segments wherever they fall):
/// `(k_start, v_start, items, block)`.
pub(crate) fn whole_v_layout(q_heads: u64, kv_heads: u64, lanes: [u64; 3]) -> Option<(u64, u64, u64, u32)> {
    let widest = lanes.map(lane_slots).into_iter().max().unwrap_or(1);
    let (k_start, v_start, _) = kv_segments(q_heads, kv_heads, lanes);
    let v_len = kv_heads * lane_slots(lanes[2]);
    let (v_start, items, block) = whole_blocks(0, v_len, v_start, |v| warp_align(v + v_len, widest))?;
    Some((k_start, v_start, items, block))
}

/// RoPE's mapping of a whole-projection norm, one head a thread, `slots` items a head:
/// `(k_group, items, block)` ([`whole_blocks`]).
pub(crate) fn whole_rope_layout(q_heads: u64, k_heads: u64, slots: u64) -> Option<(u32, u32, u32)> {
    let (q_len, k_len) = (q_heads * slots, k_heads * slots);
    let (k_start, items, block) = whole_blocks(q_len, k_len, q_len, |k| k + k_len)?;
    Some(((k_start / slots) as u32, items as u32, block))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Checks a whole-projection mapping: `segments` (start, length, slots) of a token's
    /// `items` in blocks of `block`: blocks start at tokens' starts, the normalized ones (the
    /// first two) each inside one block, every group inside one warp, nothing overlapping.
    fn check(segments: [(u64, u64, u64); 3], items: u64, block: u32, what: &str) {
        let block = block as u64;
        assert!(block <= WHOLE_BLOCK_MAX && block > 0, "{what}: block {block}");
        match items <= block {
            true => assert_eq!(block % items, 0, "{what}: {block} threads of tokens of {items}"),
            false => assert!(items % block == 0 && block % 32 == 0, "{what}: {items} items, blocks of {block}"),
        }
        let mut end = 0;
        for (i, &(start, len, slots)) in segments.iter().enumerate() {
            assert!(start >= end && start + len <= items, "{what}: segment {i} at {start} (+{len}) of {items}");
            end = start + len;
            for token in 0..5 {
                let first = token * items + start;
                if i < 2 && len > 0 {
                    assert_eq!(first / block, (first + len - 1) / block, "{what}: segment {i} of token {token}");
                }
                for g in 0..len / slots {
                    let at = first + g * slots;
                    if slots <= 32 {
                        assert_eq!(at / 32, (at + slots - 1) / 32, "{what}: group {g} of segment {i}");
                    }
                }
            }
        }
    }

    #[test]
    fn whole_layouts_keep_each_projection_in_one_block() {
        for (hq, hk) in [(0, 1), (1, 1), (4, 2), (8, 8), (32, 8), (36, 40), (40, 8), (61, 8), (64, 8), (64, 64), (7, 3)]
        {
            for lanes in [[8u64, 8, 16], [16, 16, 32], [32, 32, 64], [12, 12, 16], [5, 5, 8], [1, 1, 2]] {
                let what = format!("KV {hq}/{hk} {lanes:?}");
                let [sq, sk, sv] = lanes.map(lane_slots);
                match whole_kv_layout(hq, hk, lanes) {
                    Some((k_start, v_start, items, block)) => {
                        check([(0, hq * sq, sq), (k_start, hk * sk, sk), (v_start, hk * sv, sv)], items, block, &what);
                        // Fits one block unpacked, or each projection does.
                        let packed = kv_segments(hq, hk, lanes).2;
                        assert!(packed <= WHOLE_BLOCK_MAX || (hq * sq).max(hk * sk) <= WHOLE_BLOCK_MAX, "{what}");
                    }
                    None => assert!((hq * sq).max(hk * sk).next_multiple_of(32) > WHOLE_BLOCK_MAX, "{what}"),
                }
            }
            for slots in [1u64, 2, 4, 8, 16, 32] {
                let what = format!("RoPE {hq}/{hk} slots {slots}");
                match whole_rope_layout(hq, hk, slots) {
                    Some((k_group, items, block)) => {
                        let k = k_group as u64 * slots;
                        check(
                            [(0, hq * slots, slots), (k, hk * slots, slots), (items as u64, 0, slots)],
                            items as u64,
                            block,
                            &what,
                        );
                        assert!(k_group as u64 >= hq, "{what}");
                    }
                    None => assert!((hq * slots).max(hk * slots).next_multiple_of(32) > WHOLE_BLOCK_MAX, "{what}"),
                }
            }
        }
        // A token of 32/8 heads of 8 lanes (bf16, 16-byte lanes) fits one block: 640 threads.
        assert_eq!(whole_kv_layout(32, 8, [8, 8, 16]), Some((256, 320, 448, 448)));
        // 31 q heads of 16 lanes: blocks of 512, k moved from 496 to 512, v after it, two
        // blocks a token.
        assert_eq!(whole_kv_layout(31, 8, [16, 16, 32]), Some((512, 640, 1024, 512)));
        // 33 q heads of 16 lanes: past one block.
        assert_eq!(whole_kv_layout(33, 8, [16, 16, 32]), None);
        // Small heads: several tokens a block.
        assert_eq!(whole_rope_layout(2, 1, 8), Some((2, 24, 120)));
    }

    /// The views of the norms: a whole projection's weights of `heads × head_dim`, its
    /// divisors, and the step between heads' weights.
    #[test]
    fn whole_projection_views() {
        let w = |ptr, len| Some(RawWeight { ptr, len, dtype: DType::BF16 });
        let norm = RawNorm {
            kind: NormKind::RmsProjection,
            eps: 1e-6,
            q_weight: w(1 << 20, 4 * 64),
            k_weight: w(1 << 21, 2 * 64),
        };
        let view = norm_view(&norm, 64, [Some(4), Some(2)], DType::BF16).unwrap();
        assert_eq!(view.head_step, 128);
        assert_eq!(view.inv_dim, [1.0 / 256.0, 1.0 / 128.0, 0.0]);
        assert_eq!(view.vector, 1);
        assert!(view.whole());
        // k's weights unchecked without k; a per-head norm's step 0.
        let q_only = RawNorm { k_weight: w(1 << 21, 7), ..norm };
        assert!(norm_view(&q_only, 64, [Some(4), None], DType::BF16).is_ok());
        assert!(matches!(
            norm_view(&q_only, 64, [Some(4), Some(2)], DType::BF16),
            Err(Error::Length { what: "k norm weight", expected: 128, got: 7, .. })
        ));
        let per_head = RawNorm { kind: NormKind::Rms, q_weight: w(1 << 20, 64), k_weight: w(1 << 21, 64), ..norm };
        let view = norm_view(&per_head, 64, [Some(4), Some(2)], DType::BF16).unwrap();
        assert_eq!((view.head_step, view.inv_dim), (0, [1.0 / 64.0, 1.0 / 64.0, 0.0]));
    }
}
