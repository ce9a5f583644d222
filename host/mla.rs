//! MLA (multi-head latent attention: DeepSeek-V2 and V3, Kimi K2): one step's RoPE and latent
//! cache write in one launch ([`Rope::append_mla`]).
//!
//! An MLA layer caches one row per token, `[kv_c | k_pe]`: the compressed latent `kv_c`
//! (`kv_lora_rank` values, 512 in DeepSeek-V3) and the rotated positional key `k_pe`
//! (`qk_rope_head_dim`, 64) that every head shares; q carries a rotary part `q_pe` per head.
//! The append is the fused KV append ([`Rope::append_kv`]) through one view: `k_pe` is a key
//! cache of one head of `qk_rope_head_dim`, `kv_c` a value cache of one head of
//! `kv_lora_rank`, both views of the latent cache's rows (the value cache's head_dim is its
//! own), and `q_pe` the queries, rotated in place. The kernels, their checks and their
//! duplicate-slot rules are the append's.

use cust::sys as cuda;

use crate::error::{Error, Result};
use crate::kv::{plan_kv, Fp8Scale, KvCall, KvOperand, KvSpec, RawKvArgs, RawKvCache, RawScales};
use crate::launch::detached_source;
use crate::layout::Layout;
use crate::norm::{RawMlaNorm, RawWeight};
use crate::operand::{on_stream, Element, Hold, Operand, OperandMut, Queue};
use crate::rope::Rope;
use crate::tensor::{Positions, RawPositions, RawTensor, Tensor, TensorMut};
use crate::{MlaGeometry, RopeConfig};
use rope_cuda_kernels::views::ErrorSink;

/// An MLA latent cache: rows of `kv_lora_rank + rope_dim` elements, `[kv_c | k_pe]`, written
/// by [`Rope::append_mla`]. Its layout is `[blocks, block_size, 1, kv_lora_rank + rope_dim]`
/// with its own strides (the row contiguous): vLLM's paged `[num_blocks, block_size, 576]` is
/// `Layout::bshd(num_blocks, block_size, 1, 576)`, a contiguous `[batch, max_seq, 576]`
/// `Layout::bshd(batch, max_seq, 1, 576)`. `rope_dim` is the [`Rope`]'s head_dim
/// (`qk_rope_head_dim`).
///
/// The cache is any [`OperandMut`] of an [`Element`]: of the inputs' type, or of an FP8 format
/// ([`F8E4M3`](crate::F8E4M3), [`F8E5M2`](crate::F8E5M2)) with its one scale
/// ([`MlaCache::scale`]).
#[derive(Debug)]
pub struct MlaCache<'a> {
    pub(crate) rows: TensorMut<'a>,
    kv_lora_rank: usize,
    paged: bool,
    window: Option<usize>,
    pub(crate) scale: Option<(u64, usize, Hold<'a>)>,
}

impl<'a> MlaCache<'a> {
    /// A paged latent cache of the model `geometry` ([`HfConfig::mla`](crate::HfConfig::mla)):
    /// token `t` goes to slot `slots[t]`, row `slot % block_size` of block `slot /
    /// block_size`; each row holds `kv_lora_rank` values of `kv_c`, then `k_pe`.
    ///
    /// ```
    /// # let Ok(_ctx) = cust::quick_init() else { return Ok(()) }; // no GPU: nothing to run
    /// use cust::memory::DeviceBuffer;
    /// use rope_cuda::{HfConfig, Layout, MlaCache};
    /// let v3 = HfConfig::parse(r#"{"model_type": "deepseek_v3", "num_attention_heads": 128,
    ///     "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128}"#)?.mla()?;
    /// // DeepSeek-V3's: 4096 pages of 64 slots, rows of 512 + 64.
    /// let mut c = DeviceBuffer::from_slice(&vec![half::bf16::ZERO; 4096 * 64 * v3.latent_width()])?;
    /// let cache = MlaCache::paged(&mut c, Layout::bshd(4096, 64, 1, v3.latent_width()), &v3);
    /// assert!(cache.raw().paged && cache.raw().kv_lora_rank == 512);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn paged(cache: impl OperandMut<'a, Elem: Element>, layout: Layout, geometry: &MlaGeometry) -> Self {
        MlaCache { paged: true, ..Self::contiguous(cache, layout, geometry) }
    }

    /// A contiguous latent cache of the model `geometry`: token `s` of sequence `b` goes to
    /// row `position` of block `b`.
    pub fn contiguous(cache: impl OperandMut<'a, Elem: Element>, layout: Layout, geometry: &MlaGeometry) -> Self {
        let kv_lora_rank = geometry.kv_lora_rank;
        MlaCache { rows: TensorMut::new(cache, layout), kv_lora_rank, paged: false, window: None, scale: None }
    }

    /// A sliding-window latent cache of the model `geometry`: each sequence's block of
    /// `block_size` rows holds its first `sinks` positions, then its latest in a ring, as
    /// [`KvCache::window`](crate::KvCache::window)'s.
    pub fn window(
        cache: impl OperandMut<'a, Elem: Element>,
        layout: Layout,
        geometry: &MlaGeometry,
        sinks: usize,
    ) -> Self {
        MlaCache { window: Some(sinks), ..Self::contiguous(cache, layout, geometry) }
    }

    /// The scale of an FP8 cache (one f32 for the whole row, as vLLM's and FlashInfer's MLA
    /// caches keep it), which FP8 caches need and others refuse: the code stored for a value
    /// `x` is that of `x / scale` (the f32 quotient), `k_pe` rotated in f32 first and rounded
    /// once. Read from device memory at each launch.
    pub fn scale(mut self, scale: Fp8Scale<'a>) -> Self {
        self.scale = Some(scale.lend());
        self
    }

    /// The cache as device addresses, for [`Rope::append_mla_raw`].
    pub fn raw(&self) -> RawMlaCache {
        RawMlaCache {
            rows: self.rows.raw,
            kv_lora_rank: self.kv_lora_rank,
            paged: self.paged,
            window: self.window,
            scale: self.scale.as_ref().map(|&(ptr, len, _)| (ptr, len)),
        }
    }
}

/// An MLA latent cache as device addresses ([`MlaCache`]): built by [`MlaCache::raw`] or by
/// its constructors ([`RawMlaCache::contiguous`], [`RawMlaCache::paged`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct RawMlaCache {
    /// The rows, `[blocks, block_size, 1, kv_lora_rank + rope_dim]`.
    pub rows: RawTensor,
    /// Elements of `kv_c` at the start of each row; `k_pe` follows.
    pub kv_lora_rank: usize,
    /// Paged (slots given per token) or contiguous (positions name the rows).
    pub paged: bool,
    /// A contiguous cache's sliding-window form, `Some(sinks)` ([`MlaCache::window`]).
    pub window: Option<usize>,
    /// An FP8 cache's scale: device address and length (one f32).
    pub scale: Option<(u64, usize)>,
}

impl RawMlaCache {
    /// A contiguous latent cache of `rows` whose first `kv_lora_rank` elements are kv_c's
    /// ([`MlaCache::contiguous`]).
    pub fn contiguous(rows: RawTensor, kv_lora_rank: usize) -> Self {
        RawMlaCache { rows, kv_lora_rank, paged: false, window: None, scale: None }
    }

    /// A sliding-window latent cache after `sinks` fixed rows ([`MlaCache::window`]).
    pub fn window(rows: RawTensor, kv_lora_rank: usize, sinks: usize) -> Self {
        RawMlaCache { window: Some(sinks), ..Self::contiguous(rows, kv_lora_rank) }
    }

    /// A paged latent cache ([`MlaCache::paged`]).
    pub fn paged(rows: RawTensor, kv_lora_rank: usize) -> Self {
        RawMlaCache { paged: true, ..Self::contiguous(rows, kv_lora_rank) }
    }

    /// The same cache with an FP8 cache's scale: device address and length (one f32)
    /// ([`MlaCache::scale`]).
    pub fn scale(self, scale: (u64, usize)) -> Self {
        RawMlaCache { scale: Some(scale), ..self }
    }
}

/// Everything one MLA append takes ([`Rope::append_mla`]): the new latents `kv_c`
/// (`[batch, seq, 1, kv_lora_rank]`, copied into the cache bit for bit, or into FP8), the new
/// positional keys `k_pe` (`[batch, seq, 1, rope_dim]`, rotated into the cache; not
/// modified), the cache and the positions; then optionally the queries' rotary parts
/// ([`MlaAppend::q_pe`]), a paged cache's slot mapping ([`MlaAppend::slots`]), the pairs'
/// order ([`MlaAppend::deinterleaved`]) and kv_c's norm ([`MlaAppend::kv_c_norm`]).
///
/// ```no_run
/// # use rope_cuda::{Layout, MlaAppend, MlaCache, MlaGeometry, Positions, Rope, Tensor, TensorMut};
/// # use cust::memory::DeviceBuffer;
/// # use half::bf16;
/// # fn step(rope: &Rope, stream: &cust::stream::Stream, q: &mut DeviceBuffer<bf16>, kv_a: &DeviceBuffer<bf16>,
/// #         cache: &mut DeviceBuffer<bf16>, pos: &DeviceBuffer<i32>, slots: &DeviceBuffer<i64>) -> rope_cuda::Result<()> {
/// let t = 64; // tokens
/// // q: [t, 128 heads, 192], the rotary part the last 64 of each head.
/// let mut q_pe = TensorMut::new(q, Layout::strided([1, t, 128, 64], [t * 128 * 192, 128 * 192, 192], 128));
/// // The kv_a projection's output [t, 576]: kv_c the first 512 (after its norm), k_pe the last 64.
/// let kv_c = Tensor::new(kv_a, Layout::strided([1, t, 1, 512], [t * 576, 576, 576], 0));
/// let k_pe = Tensor::new(kv_a, Layout::strided([1, t, 1, 64], [t * 576, 576, 576], 512));
/// let mut cache = MlaCache::paged(cache, Layout::bshd(4096, 64, 1, 576), &MlaGeometry::new(512, 64, 128, 128, 128));
/// let append = MlaAppend::new(&kv_c, &k_pe, &mut cache, Positions::ids_i32(pos)).q_pe(&mut q_pe).slots(slots);
/// rope.append_mla(append, stream)
/// # }
/// ```
#[derive(Debug)]
pub struct MlaAppend<'r, 'a> {
    q_pe: Option<&'r mut TensorMut<'a>>,
    kv_c: &'r Tensor<'a>,
    k_pe: &'r Tensor<'a>,
    cache: &'r mut MlaCache<'a>,
    positions: Positions<'a>,
    slots: Option<(u64, usize, Hold<'a>)>,
    deinterleaved: bool,
    kv_c_norm: Option<(RawMlaNorm, Hold<'a>)>,
}

impl<'r, 'a> MlaAppend<'r, 'a> {
    /// An append of `kv_c` and `k_pe` into `cache` at `positions` (the rotation; and, for
    /// contiguous caches, the row): no queries, no slot mapping.
    pub fn new(
        kv_c: &'r Tensor<'a>,
        k_pe: &'r Tensor<'a>,
        cache: &'r mut MlaCache<'a>,
        positions: Positions<'a>,
    ) -> Self {
        MlaAppend { q_pe: None, kv_c, k_pe, cache, positions, slots: None, deinterleaved: false, kv_c_norm: None }
    }

    /// Also rotates the queries' rotary parts `q_pe` (`[batch, seq, heads, rope_dim]`, any
    /// strides: a view into q's `[tokens, heads, qk_nope_head_dim + rope_dim]`) in place, in
    /// the same launch.
    pub fn q_pe(mut self, q_pe: &'r mut TensorMut<'a>) -> Self {
        self.q_pe = Some(q_pe);
        self
    }

    /// The slot mapping of a paged cache: one i64 per token (`-1`: padding, not written).
    pub fn slots(mut self, slots: impl Operand<'a, Elem = i64>) -> Self {
        self.slots = Some(slots.lend());
        self
    }

    /// Writes each rotated pair de-interleaved, in q_pe and in the cache's k_pe: pair `i`
    /// (read at `2i`, `2i + 1`) at `i` and `rope_dim / 2 + i`, as transformers' DeepSeek-V3
    /// and Kimi K2 code (`apply_rotary_pos_emb_interleave`) writes it, for engines that compare
    /// their q and cache with transformers'. Without it the pairs stay where they were read
    /// (vLLM's order); q and k permuted alike give the same attention scores either way.
    /// The views must take 16-byte accesses (aligned addresses and strides), and a head of
    /// q_pe at most 32 lanes ([`Error::Deinterleave`] otherwise).
    pub fn deinterleaved(mut self) -> Self {
        self.deinterleaved = true;
        self
    }

    /// `kv_c` normalized in the same launch (the model's `kv_a_layernorm`, which transformers
    /// applies to the latent before it is cached): each token's `x_i · r · w_i`, `r = 1 /
    /// sqrt(mean(x²) + eps)` over its `kv_lora_rank` elements, with `weight`
    /// (`[kv_lora_rank]`, f32, f16 or bf16) and `eps` (the model's
    /// [`MlaGeometry::kv_norm_eps`]: the norm class's default in transformers' DeepSeek and
    /// Kimi models, 1e-6, not the config's `rms_norm_eps`). The statistic is summed in f32 and the
    /// product `x · r · w` rounded once, to the cache's type (FP8: its quotient by the scale),
    /// where transformers rounds `x · r` to the input's type before the weight: the two agree
    /// within one unit in the last place of the input's type. `kv_c` itself is not modified.
    pub fn kv_c_norm<E: Element>(mut self, weight: impl Operand<'a, Elem = E>, eps: f32) -> Self {
        let (ptr, len, hold) = weight.lend();
        self.kv_c_norm = Some((RawMlaNorm { weight: RawWeight { ptr, len, dtype: E::DTYPE }, eps }, hold));
        self
    }

    /// The append as device addresses, for [`Rope::append_mla_raw`] and [`validate_mla`].
    pub fn raw(&self) -> RawMlaArgs {
        RawMlaArgs {
            q_pe: self.q_pe.as_ref().map(|q| q.raw),
            kv_c: self.kv_c.raw,
            k_pe: self.k_pe.raw,
            cache: self.cache.raw(),
            positions: self.positions.raw(),
            slots: self.slots.as_ref().map(|&(ptr, len, _)| (ptr, len)),
            deinterleaved: self.deinterleaved,
            kv_c_norm: self.kv_c_norm.as_ref().map(|&(n, _)| n),
        }
    }

    /// Each buffer's name and hold.
    fn holds(&self) -> [(&'static str, Option<&Hold<'a>>); 8] {
        [
            ("q_pe", self.q_pe.as_ref().map(|q| &q.hold)),
            ("kv_c", Some(&self.kv_c.hold)),
            ("k_pe", Some(&self.k_pe.hold)),
            ("latent cache", Some(&self.cache.rows.hold)),
            ("cache scale", self.cache.scale.as_ref().map(|(_, _, hold)| hold)),
            ("positions", Some(&self.positions.hold)),
            ("slots", self.slots.as_ref().map(|(_, _, hold)| hold)),
            ("kv_c norm weight", self.kv_c_norm.as_ref().map(|(_, hold)| hold)),
        ]
    }
}

/// Everything one MLA append takes, as device addresses ([`Rope::append_mla_raw`]): built by
/// [`MlaAppend::raw`] or by [`RawMlaArgs::new`] and the `with_*` methods, so that a field added
/// later breaks no caller.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct RawMlaArgs {
    /// The queries' rotary parts `[batch, seq, heads, rope_dim]`, rotated in place.
    pub q_pe: Option<RawTensor>,
    /// The new latents `[batch, seq, 1, kv_lora_rank]`.
    pub kv_c: RawTensor,
    /// The new positional keys `[batch, seq, 1, rope_dim]` (not modified).
    pub k_pe: RawTensor,
    /// The latent cache.
    pub cache: RawMlaCache,
    /// The tokens' positions.
    pub positions: RawPositions,
    /// Paged caches: device address and length of the i64 slot mapping, one per token.
    pub slots: Option<(u64, usize)>,
    /// The rotated pairs written de-interleaved ([`MlaAppend::deinterleaved`]).
    pub deinterleaved: bool,
    /// `kv_c`'s RMS norm in the same launch ([`MlaAppend::kv_c_norm`]); `None`: copied as it is.
    pub kv_c_norm: Option<RawMlaNorm>,
}

impl RawMlaArgs {
    /// An append of the new latents `kv_c` and positional keys `k_pe` into `cache` at
    /// `positions`: no queries, no slot mapping, pairs where they were read, no norm
    /// ([`MlaAppend::new`]).
    pub fn new(kv_c: RawTensor, k_pe: RawTensor, cache: RawMlaCache, positions: RawPositions) -> Self {
        RawMlaArgs { q_pe: None, kv_c, k_pe, cache, positions, slots: None, deinterleaved: false, kv_c_norm: None }
    }

    /// Also rotates the queries' rotary parts `q_pe` in place, in the same launch
    /// ([`MlaAppend::q_pe`]).
    pub fn with_q_pe(self, q_pe: RawTensor) -> Self {
        RawMlaArgs { q_pe: Some(q_pe), ..self }
    }

    /// The slot mapping of a paged cache: device address and length of the i64 slots, one
    /// per token ([`MlaAppend::slots`]).
    pub fn with_slots(self, slots: (u64, usize)) -> Self {
        RawMlaArgs { slots: Some(slots), ..self }
    }

    /// Writes the rotated pairs de-interleaved (`true`) or where they were read (`false`, the
    /// default) ([`MlaAppend::deinterleaved`]).
    pub fn with_deinterleaved(self, deinterleaved: bool) -> Self {
        RawMlaArgs { deinterleaved, ..self }
    }

    /// `kv_c`'s RMS norm in the same launch ([`MlaAppend::kv_c_norm`]).
    pub fn with_kv_c_norm(self, kv_c_norm: RawMlaNorm) -> Self {
        RawMlaArgs { kv_c_norm: Some(kv_c_norm), ..self }
    }

    /// The append as the KV append it is: `k_pe` into a key cache of one head (the rows'
    /// last `rope_dim` elements), `kv_c` into a value cache of one head of `kv_lora_rank`
    /// (their first), one scale for both.
    pub fn kv_args(&self) -> Result<RawKvArgs> {
        let cache = self.cache.kv_cache()?;
        let r = self.cache.kv_lora_rank;
        for (what, t) in [("kv_c", &self.kv_c), ("k_pe", &self.k_pe)] {
            if t.layout.heads() != 1 {
                return Err(Error::Shape { what, axis: "heads (one a token)", expected: 1, got: t.layout.heads() });
            }
        }
        if self.kv_c.layout.head_dim() != r {
            return Err(Error::Shape {
                what: "kv_c",
                axis: "head_dim (kv_lora_rank)",
                expected: r,
                got: self.kv_c.layout.head_dim(),
            });
        }
        Ok(RawKvArgs {
            q: self.q_pe,
            q_fp8: None,
            k: self.k_pe,
            v: self.kv_c,
            cache,
            positions: self.positions,
            slots: self.slots,
            norm: None,
        })
    }
}

impl RawMlaCache {
    /// The latent cache as the KV cache its append writes: a key cache of one head, the rows'
    /// last `rope_dim` elements (`k_pe`), and a value cache of one head of `kv_lora_rank`, their
    /// first (`kv_c`), one scale for both. Errors: a row of more than one head, or a
    /// `kv_lora_rank` of 0 or of the whole row.
    pub fn kv_cache(&self) -> Result<RawKvCache> {
        let l = self.rows.layout;
        let width = l.head_dim();
        let (r, heads) = (self.kv_lora_rank, l.heads());
        if heads != 1 {
            return Err(Error::Shape {
                what: "latent cache",
                axis: "heads (one latent row a token)",
                expected: 1,
                got: heads,
            });
        }
        if r == 0 || r >= width {
            return Err(Error::Shape {
                what: "latent cache",
                axis: "kv_lora_rank (at least 1, and below the row's width)",
                expected: width.saturating_sub(1).max(1),
                got: r,
            });
        }
        let [b, s, h, _] = l.shape;
        let view =
            |d, offset| RawTensor { layout: Layout::strided([b, s, h, d], l.strides, l.offset + offset), ..self.rows };
        let scales = self.scale.map(|s| RawScales { k: s, v: s, per_head: false });
        Ok(RawKvCache { k: view(width - r, r), v: view(r, 0), paged: self.paged, window: self.window, scales })
    }
}

/// Checks `args` against `config` exactly as [`Rope::append_mla_raw`] does before it launches,
/// without a GPU: `Ok` means that call would launch (or, with no work, return at once).
///
/// ```
/// use rope_cuda::{validate_mla, DType, Error, Layout, PositionKind, RawMlaArgs, RawMlaCache, RawPositions, RawTensor};
/// use rope_cuda::{RopeConfig, RopeStyle};
/// // DeepSeek-V3's RoPE part: 64 dims, interleaved pairs.
/// let config = RopeConfig::new(64, 4096).dtype(DType::BF16).style(RopeStyle::GptJ);
/// let t = |i: u64, layout: Layout| RawTensor::new(i << 30, layout.extent().unwrap(), DType::BF16, layout);
/// let (kv_c, k_pe) = (t(2, Layout::bshd(1, 64, 1, 512)), t(3, Layout::bshd(1, 64, 1, 64)));
/// let cache = RawMlaCache::paged(t(4, Layout::bshd(4096, 64, 1, 576)), 512);
/// let positions = RawPositions::new(PositionKind::IdsI32, 5 << 30, 64);
/// let args = RawMlaArgs::new(kv_c, k_pe, cache, positions)
///     .with_q_pe(t(1, Layout::strided([1, 64, 128, 64], [64 * 128 * 192, 128 * 192, 192], 128)))
///     .with_slots((6 << 30, 64));
/// assert_eq!(validate_mla(&config, &args), Ok(()));
/// // A latent row of 512 + 32 does not hold this RoPE's 64 dims.
/// let mut narrow = args;
/// narrow.cache = RawMlaCache::paged(t(4, Layout::bshd(4096, 64, 1, 544)), 512);
/// assert!(matches!(validate_mla(&config, &narrow), Err(Error::Shape { .. })));
/// ```
pub fn validate_mla(config: &RopeConfig, args: &RawMlaArgs) -> Result<()> {
    config.validate()?;
    let table = detached_source(config.rotary_dim, config.source());
    plan_kv(&KvSpec::of(config), &mla_call(args), &args.kv_args()?, table, ErrorSink::default()).map(|_| ())
}

/// The MLA append as a call of the KV append: its options, and its operands' names.
fn mla_call(args: &RawMlaArgs) -> KvCall {
    KvCall {
        deinterleave: args.deinterleaved,
        v_norm: args.kv_c_norm,
        names: mla_name,
        need_scales: "an FP8 latent cache needs its scale (MlaCache::scale)",
    }
}

/// The KV append's operands as the MLA append's caller knows them.
pub(crate) fn mla_name(operand: KvOperand) -> &'static str {
    match operand {
        KvOperand::Q => "q_pe",
        KvOperand::K => "k_pe",
        KvOperand::V => "kv_c",
        KvOperand::Cache | KvOperand::KCache | KvOperand::VCache => "latent cache",
        KvOperand::KScales | KvOperand::VScales => "cache scale",
        other => other.name(),
    }
}

impl Rope {
    /// One MLA step in one launch: `k_pe` rotated and `kv_c` copied into each token's latent
    /// row (`[kv_c | k_pe]`), and, with `q_pe`, every head's rotary part rotated in place. The
    /// [`Rope`]'s head_dim is the rotary part's (`qk_rope_head_dim`; from a DeepSeek or Kimi
    /// `config.json`, [`HfConfig::rope`](crate::HfConfig::rope) gives it, with its interleaved
    /// pairs and its yarn attention factor).
    ///
    /// As [`Rope::append_kv`]: contiguous caches take each token's row from its position,
    /// paged ones from the slot mapping (`-1`: padding, skipped); a position outside the
    /// table or a slot outside the cache is skipped and recorded ([`Rope::check_errors`]);
    /// when several tokens name one slot, the last one's row is written; nothing else in the
    /// cache changes. `kv_c` is copied bit for bit into a cache of its own type, or normalized
    /// in the same launch ([`MlaAppend::kv_c_norm`]).
    ///
    /// ```
    /// # let Ok(_ctx) = cust::quick_init() else { return Ok(()) }; // no GPU: nothing to run
    /// # let kernels = rope_cuda::Kernels::load()?;
    /// # let stream = cust::stream::Stream::new(cust::stream::StreamFlags::NON_BLOCKING, None)?;
    /// use cust::memory::{CopyDestination, DeviceBuffer};
    /// use rope_cuda::{Layout, MlaAppend, MlaCache, MlaGeometry, Positions, Rope, RopeConfig, RopeStyle, Tensor};
    /// let rope = Rope::new(&kernels, RopeConfig::new(64, 128).style(RopeStyle::GptJ))?;
    /// // 2 tokens of one sequence: kv_c of 512, k_pe of 64; a paged cache of 4 pages of 8.
    /// let kv_c = DeviceBuffer::from_slice(&vec![2.0f32; 2 * 512])?;
    /// let k_pe = DeviceBuffer::from_slice(&vec![1.0f32; 2 * 64])?;
    /// let mut rows = DeviceBuffer::from_slice(&vec![0.0f32; 4 * 8 * 576])?;
    /// let (pos, slots) = (DeviceBuffer::from_slice(&[0i32, 1])?, DeviceBuffer::from_slice(&[9i64, 10])?);
    /// let (c, k) = (Tensor::new(&kv_c, Layout::bshd(1, 2, 1, 512)), Tensor::new(&k_pe, Layout::bshd(1, 2, 1, 64)));
    /// let mut cache = MlaCache::paged(&mut rows, Layout::bshd(4, 8, 1, 576), &MlaGeometry::new(512, 64, 128, 128, 128));
    /// rope.append_mla(MlaAppend::new(&c, &k, &mut cache, Positions::ids_i32(&pos)).slots(&slots), &stream)?;
    /// rope.check_errors(&stream)?;
    /// let mut host = vec![0.0f32; 4 * 8 * 576];
    /// rows.copy_to(&mut host[..])?;
    /// // Slot 9: kv_c, then k_pe at position 0 (unrotated: cos 1, sin 0).
    /// assert!(host[9 * 576..9 * 576 + 512].iter().all(|&x| x == 2.0));
    /// assert!(host[9 * 576 + 512..10 * 576].iter().all(|&x| x == 1.0));
    /// assert!(host[8 * 576..9 * 576].iter().all(|&x| x == 0.0));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn append_mla(&self, args: MlaAppend<'_, '_>, stream: &impl Queue) -> Result<()> {
        let stream = stream.raw(self.kernels())?;
        // SAFETY: as in `Rope::apply`, for every buffer of the append.
        on_stream(args.holds(), stream, || unsafe { self.append_mla_raw(&args.raw(), stream) })
    }

    /// [`Rope::append_mla`] on device addresses and a raw stream; an `Err` means nothing was
    /// launched.
    ///
    /// # Safety
    /// As [`Rope::append_kv_raw`], for every address of the append.
    pub unsafe fn append_mla_raw(&self, args: &RawMlaArgs, stream: cuda::CUstream) -> Result<()> {
        let kv = args.kv_args()?;
        // SAFETY: the caller's contract, for the same buffers seen as a KV append.
        unsafe { self.append_kv_call(&mla_call(args), &kv, stream) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{DType, RopeStyle};
    use crate::tensor::PositionKind;
    use rope_cuda_kernels::entries::Key;
    use rope_cuda_kernels::keys::KvWidth;
    use rope_cuda_kernels::views::CacheKind;

    const BASE: u64 = 1 << 32;

    fn tensor(i: u64, layout: Layout) -> RawTensor {
        RawTensor::new(i * BASE, layout.extent().unwrap(), DType::BF16, layout)
    }

    fn config() -> RopeConfig {
        RopeConfig::new(64, 4096).dtype(DType::BF16).style(RopeStyle::GptJ)
    }

    /// DeepSeek-V3's step: `t` tokens, q `[t, 128, 192]` with the rotary part last, kv_c and
    /// k_pe as views of the kv_a projection's `[t, 576]`, a paged cache `[4096, 64, 576]`.
    fn args(t: usize) -> RawMlaArgs {
        RawMlaArgs {
            q_pe: Some(tensor(1, Layout::strided([1, t, 128, 64], [t * 128 * 192, 128 * 192, 192], 128))),
            kv_c: tensor(2, Layout::strided([1, t, 1, 512], [t * 576, 576, 576], 0)),
            k_pe: tensor(2, Layout::strided([1, t, 1, 64], [t * 576, 576, 576], 512)),
            cache: RawMlaCache::paged(tensor(3, Layout::bshd(4096, 64, 1, 576)), 512),
            positions: RawPositions { kind: PositionKind::IdsI32, ptr: 4 * BASE, len: t },
            slots: Some((5 * BASE, t)),
            deinterleaved: false,
            kv_c_norm: None,
        }
    }

    fn plan(a: &RawMlaArgs) -> crate::kv::KvPlan {
        let c = config();
        let source = detached_source(c.rotary_dim, c.source());
        plan_kv(&KvSpec::of(&c), &mla_call(a), &a.kv_args().unwrap(), source, ErrorSink::default()).unwrap().unwrap()
    }

    fn err(a: &RawMlaArgs) -> Error {
        validate_mla(&config(), a).expect_err("expected an error")
    }

    /// The append's plan: k_pe a key head of 64 at the row's end, kv_c a value head of 512 at
    /// its start, q_pe's heads of 64 at a stride of 192; decode and prefill widths.
    #[test]
    fn plans_the_latent_row_as_one_key_and_one_value_head() {
        let p = plan(&args(64));
        assert_eq!((p.key.width, p.key.style, p.claim), (KvWidth::Decode, RopeStyle::GptJ, false));
        // 8-byte lanes: a GPT-J lane of two 4-element accesses, 8 lanes a head of 64; kv_c 128.
        assert_eq!((p.params.rot_lanes, p.params.k_lanes, p.params.v_lanes), (8, 8, 128));
        assert_eq!((p.params.q.heads, p.params.k.heads, p.params.v.heads), (128, 1, 1));
        assert_eq!(p.params.q.in_strides, [64 * 128 * 192, 128 * 192, 192]);
        let c = p.params.cache;
        assert_eq!((c.k(), c.v()), (3 * BASE + 512 * 2, 3 * BASE));
        assert_eq!((c.kind(), c.num_slots(), c.row(65, 0)), (CacheKind::Paged, 4096 * 64, 64 * 576 + 576));
        assert!(p.key.entry_point().is_some());
        // Prefill: claimed, 16-byte lanes (4 a head of 64, 64 for kv_c).
        let p = plan(&args(16384));
        assert_eq!((p.key.width, p.claim), (KvWidth::Vector, true));
        assert_eq!((p.params.rot_lanes, p.params.k_lanes, p.params.v_lanes), (4, 4, 64));
        assert!(p.key.entry_point().is_some());
        // FP8: one scale for the row, given to both halves.
        let mut a = args(64);
        a.cache.rows.dtype = DType::E4M3;
        a.cache.scale = Some((6 * BASE, 1));
        let kv = a.kv_args().unwrap();
        assert_eq!(kv.cache.scales, Some(RawScales { k: (6 * BASE, 1), v: (6 * BASE, 1), per_head: false }));
        assert!(plan(&a).key.entry_point().is_some());
        // Contiguous `[batch, max_seq, 576]`: rows from positions.
        let mut a = args(8);
        a.cache = RawMlaCache { rows: tensor(3, Layout::bshd(1, 1024, 1, 576)), paged: false, ..a.cache };
        a.slots = None;
        assert_eq!(plan(&a).params.cache.kind(), CacheKind::Contiguous);
        // De-interleaved pairs: their own kernels, at each width.
        for t in [64, 1000, 16384] {
            let p = plan(&RawMlaArgs { deinterleaved: true, ..args(t) });
            assert!(p.key.deinterleave && p.key.entry_point().is_some(), "{t}: {:?}", p.key);
            let plain = plan(&args(t));
            assert_ne!(p.key.entry_point(), plain.key.entry_point());
        }
    }

    /// kv_c's norm: the whole-projection kernels, v's one head normalized alone, its lanes
    /// (past a warp) inside one block of every token, in both pair orders, decode to prefill.
    #[test]
    fn plans_kv_c_norm_with_its_head_in_one_block() {
        use rope_cuda_kernels::norm::V;
        for dtype in [DType::BF16, DType::F32] {
            for t in [64, 1000, 16384] {
                for deinterleaved in [false, true] {
                    let mut a = args(t);
                    for x in [&mut a.kv_c, &mut a.k_pe, &mut a.cache.rows] {
                        x.dtype = dtype;
                    }
                    a.q_pe = a.q_pe.map(|q| RawTensor { dtype, ..q });
                    let weight = RawWeight { ptr: 7 * BASE, len: 512, dtype: DType::BF16 };
                    a = RawMlaArgs { deinterleaved, kv_c_norm: Some(RawMlaNorm { weight, eps: 1e-6 }), ..a };
                    let c = config().dtype(dtype);
                    let source = detached_source(c.rotary_dim, c.source());
                    let (spec, call) = (KvSpec::of(&c), mla_call(&a));
                    let what = format!("{dtype:?} {t} {deinterleaved}");
                    let p =
                        plan_kv(&spec, &call, &a.kv_args().unwrap(), source, ErrorSink::default()).unwrap().unwrap();
                    assert!(p.key.norm && p.key.whole && p.key.entry_point().is_some(), "{what}: {:?}", p.key);
                    assert_eq!(p.key.deinterleave, deinterleaved, "{what}");
                    assert_eq!((p.params.norm.projections, p.params.norm.weights[2]), (V, 7 * BASE), "{what}");
                    assert_eq!(p.params.norm.inv_dim[2], 1.0 / 512.0, "{what}");
                    let (items, block) = (p.params.items_div.divisor as u64, p.geometry.block.0 as u64);
                    let (v_start, v_slots) = (p.params.starts[1] as u64, p.params.lanes_div[2].divisor as u64);
                    assert!(items % block == 0 || block % items == 0, "{what}: {items} items, block {block}");
                    assert!(v_start % 32 == 0 && v_slots >= p.params.v_lanes as u64, "{what}");
                    for token in 0..4 {
                        let first = token * items + v_start;
                        assert_eq!(first / block, (first + v_slots - 1) / block, "{what}: token {token}'s kv_c");
                    }
                }
            }
        }
        // Lanes element by element (kv_c of 36 bf16): refused.
        let mut a = args(64);
        a.cache.rows.layout = Layout::bshd(4096, 64, 1, 100);
        (a.cache.kv_lora_rank, a.kv_c.layout) = (36, Layout::bshd(1, 64, 1, 36));
        let weight = RawWeight { ptr: 7 * BASE, len: 36, dtype: DType::BF16 };
        a.kv_c_norm = Some(RawMlaNorm { weight, eps: 1e-6 });
        assert!(matches!(err(&a), Error::Norm(m) if m.contains("16-byte accesses")));
        // Weights over kv_c's input: read only, accepted; over the cache: refused.
        let mut a = args(64);
        let weight = RawWeight { ptr: 2 * BASE, len: 512, dtype: DType::BF16 };
        a.kv_c_norm = Some(RawMlaNorm { weight, eps: 1e-6 });
        assert_eq!(validate_mla(&config(), &a), Ok(()));
        a.kv_c_norm = Some(RawMlaNorm { weight: RawWeight { ptr: 3 * BASE, ..weight }, eps: 1e-6 });
        assert!(matches!(err(&a), Error::Aliasing { .. }));
    }

    /// Each bad input has its error, the operands named as MLA names them.
    #[test]
    fn each_bad_input_has_its_error() {
        let a = args(64);
        assert_eq!(validate_mla(&config(), &a), Ok(()));
        let mut b = a;
        b.cache.rows.layout = Layout::bshd(4096, 64, 2, 576);
        assert!(matches!(err(&b), Error::Shape { what: "latent cache", expected: 1, got: 2, .. }));
        for rank in [0, 576, 600] {
            let b = RawMlaArgs { cache: RawMlaCache { kv_lora_rank: rank, ..a.cache }, ..a };
            assert!(matches!(err(&b), Error::Shape { what: "latent cache", .. }), "{rank}");
        }
        // The rows' rotary part is not the Rope's head_dim.
        let b = RawMlaArgs { cache: RawMlaCache { kv_lora_rank: 448, ..a.cache }, ..a };
        assert!(matches!(err(&b), Error::Shape { what: "kv_c", .. }));
        let mut b = a;
        b.cache.rows.layout = Layout::bshd(4096, 64, 1, 544);
        assert!(matches!(err(&b), Error::Shape { what: "latent cache", axis: "head_dim", expected: 64, got: 32 }));
        let mut b = a;
        b.k_pe.layout = Layout::bshd(1, 64, 1, 32);
        assert!(matches!(err(&b), Error::Shape { what: "k_pe", axis: "head_dim", .. }));
        let mut b = a;
        b.kv_c.layout = Layout::bshd(1, 64, 2, 256);
        assert!(matches!(err(&b), Error::Shape { what: "kv_c", axis: "heads (one a token)", .. }));
        let mut b = a;
        b.kv_c.layout = Layout::bshd(1, 32, 1, 512);
        assert!(matches!(err(&b), Error::Shape { what: "kv_c", axis: "seq", .. }));
        let mut b = a;
        b.q_pe = Some(tensor(1, Layout::bshd(1, 64, 128, 32)));
        assert!(matches!(err(&b), Error::Shape { what: "q_pe", axis: "head_dim", .. }));
        let mut b = a;
        b.kv_c.dtype = DType::F16;
        assert!(matches!(err(&b), Error::DType { what: "kv_c", .. }));
        // FP8 without its scale, a scale without FP8, a scale of two.
        let mut b = a;
        b.cache.rows.dtype = DType::E4M3;
        assert!(matches!(err(&b), Error::Scales(m) if m.contains("MlaCache::scale")));
        b.cache.scale = Some((6 * BASE, 2));
        assert!(matches!(err(&b), Error::Length { what: "cache scale", expected: 1, got: 2, .. }));
        let b = RawMlaArgs { cache: RawMlaCache { scale: Some((6 * BASE, 1)), ..a.cache }, ..a };
        assert!(matches!(err(&b), Error::Scales(_)));
        // The cache past its buffer; kv_c inside the cache; q_pe over k_pe.
        let mut b = a;
        b.cache.rows.len -= 1;
        assert!(matches!(err(&b), Error::OutOfBounds { what: "latent cache", .. }));
        let b = RawMlaArgs { kv_c: RawTensor { ptr: 3 * BASE, len: 64 * 576, ..a.kv_c }, ..a };
        assert!(matches!(err(&b), Error::Aliasing { .. }));
        let b = RawMlaArgs { q_pe: a.q_pe.map(|q| RawTensor { ptr: 2 * BASE, ..q }), ..a };
        assert!(matches!(err(&b), Error::Aliasing { a: "q_pe", .. }));
        // The slot mapping: its length; none for a paged cache; one for a contiguous cache.
        let b = RawMlaArgs { slots: Some((5 * BASE, 63)), ..a };
        assert!(matches!(err(&b), Error::Length { what: "slots", expected: 64, got: 63, .. }));
        let b = RawMlaArgs { slots: None, ..a };
        assert!(matches!(err(&b), Error::SlotMapping(_)));
        let b = RawMlaArgs { cache: RawMlaCache { paged: false, ..a.cache }, ..a };
        assert!(matches!(err(&b), Error::SlotMapping(_)));
        // De-interleaved pairs need vector lanes: a kv_c of 36 bf16 takes element by element.
        let mut b = RawMlaArgs { deinterleaved: true, ..a };
        b.cache.rows.layout = Layout::bshd(4096, 64, 1, 100);
        (b.cache.kv_lora_rank, b.kv_c.layout) = (36, Layout::bshd(1, 64, 1, 36));
        assert!(matches!(err(&b), Error::Deinterleave(m) if m.contains("16-byte accesses")));
        assert_eq!(validate_mla(&config(), &RawMlaArgs { deinterleaved: false, ..b }), Ok(()));
        // A head of q_pe past 32 lanes, in place (rope_dim 512 in f32 at 8 bytes a lane).
        let big = RopeConfig::new(512, 4096).dtype(DType::F32).style(RopeStyle::GptJ);
        let f32_of = |t: RawTensor| RawTensor { dtype: DType::F32, ..t };
        let mut b = RawMlaArgs { deinterleaved: true, ..a };
        b.q_pe = Some(f32_of(tensor(1, Layout::bshd(1, 64, 2, 512))));
        (b.kv_c, b.k_pe) =
            (f32_of(tensor(2, Layout::bshd(1, 64, 1, 512))), f32_of(tensor(6, Layout::bshd(1, 64, 1, 512))));
        b.cache.rows = f32_of(tensor(3, Layout::bshd(64, 64, 1, 1024)));
        let e = validate_mla(&big, &b);
        assert!(matches!(e, Err(Error::Deinterleave(m)) if m.contains("32 lanes")), "{e:?}");
        assert_eq!(validate_mla(&big, &RawMlaArgs { deinterleaved: false, ..b }), Ok(()));
    }
}
