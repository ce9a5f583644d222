//! KV cache: the fused RoPE + append of one decode or prefill step ([`Rope::append_kv`]): the
//! caches and the append's arguments here, its planner in `plan` (a pipeline of stages, FP8's
//! in `scales`, a call's options and operand names in `call`), and the dequantizing read of FP8 caches in `read`.

use cust::sys as cuda;
use rope_cuda_kernels::views::ErrorSink;

use crate::config::RopeConfig;
use crate::error::Result;
use crate::launch::detached_source;
use crate::layout::Layout;
use crate::norm::{QkNorm, RawNorm};
use crate::operand::{on_stream, Element, Hold, Operand, OperandMut, Queue};
use crate::rope::Rope;
use crate::tensor::{Positions, RawPositions, RawTensor, Tensor, TensorMut};

mod call;
mod plan;
mod read;
mod scales;
mod shift;
#[cfg(test)]
mod tests;

pub(crate) use call::{KvCall, KvOperand};
#[cfg(test)]
pub(crate) use plan::KvPlan;
pub(crate) use plan::{plan_kv, KvSpec};
pub use read::{KvRead, RawKvRead};
pub use shift::{validate_shift, KvShift, RawShiftArgs, ShiftCache, SHIFT_MAX_DELTA};

/// Calls with more tokens than this settle duplicate slots with a small claim launch before
/// the append (an owner array, one u64 per slot, kept by the [`Rope`]); smaller calls
/// (decode steps) settle them inside the one launch: each block compares its tokens' slots
/// with the later tokens' in shared memory.
pub const KV_SCAN_MAX_TOKENS: usize = 256;

/// A key cache and a value cache of one layout, written by [`Rope::append_kv`].
///
/// The layout is 4-D, `[blocks, block_size, heads, head_dim]` with its own strides (head_dim
/// contiguous): a contiguous cache's blocks are its sequences (`[batch, seq, heads, head_dim]`
/// is [`Layout::bshd`], `[batch, heads, seq, head_dim]` is [`Layout::bhsd`]); a paged cache's
/// are its pages (vLLM's flash layout `[num_blocks, block_size, heads, head_dim]` is
/// `Layout::bshd(num_blocks, block_size, heads, head_dim)`, and
/// `[num_blocks, heads, block_size, head_dim]` is `Layout::bhsd(num_blocks, heads, block_size,
/// head_dim)`).
///
/// The key and the value cache are each any [`OperandMut`] of an [`Element`]: of the inputs'
/// type, or both of one FP8 format ([`F8E4M3`](crate::F8E4M3), [`F8E5M2`](crate::F8E5M2)) with
/// their scales ([`KvCache::scales`]).
#[derive(Debug)]
pub struct KvCache<'a> {
    k: TensorMut<'a>,
    v: TensorMut<'a>,
    paged: bool,
    window: Option<usize>,
    scales: Option<KvScales<'a>>,
}

impl<'a> KvCache<'a> {
    /// A contiguous cache: token `s` of sequence `b` goes to row `position` of block `b`.
    ///
    /// ```
    /// # let Ok(_ctx) = cust::quick_init() else { return Ok(()) }; // no GPU: nothing to run
    /// # let kernels = rope_cuda::Kernels::load()?;
    /// # let stream = cust::stream::Stream::new(cust::stream::StreamFlags::NON_BLOCKING, None)?;
    /// use cust::memory::DeviceBuffer;
    /// use rope_cuda::{KvCache, Layout};
    /// // [batch 4, 2 kv heads, 1024 positions, 128], as many engines keep it.
    /// let (mut k, mut v) = (DeviceBuffer::from_slice(&vec![0.0f32; 4 * 2 * 1024 * 128])?, DeviceBuffer::from_slice(&vec![0.0f32; 4 * 2 * 1024 * 128])?);
    /// let cache = KvCache::contiguous(&mut k, &mut v, Layout::bhsd(4, 2, 1024, 128));
    /// # let _ = cache;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn contiguous(
        k: impl OperandMut<'a, Elem: Element>,
        v: impl OperandMut<'a, Elem: Element>,
        layout: Layout,
    ) -> Self {
        KvCache { k: TensorMut::new(k, layout), v: TensorMut::new(v, layout), paged: false, window: None, scales: None }
    }

    /// A sliding-window cache (Gemma's, Mistral's and gpt-oss's sliding layers): each
    /// sequence's block of `block_size` rows holds its first `sinks` positions (StreamingLLM's
    /// attention sinks, never overwritten; 0 for none) and then its latest `block_size - sinks`
    /// in a ring: position `p` goes to row `p` below `sinks`, else to row
    /// `sinks + (p - sinks) % (block_size - sinks)`. A call whose tokens meet at one row (a
    /// prefill chunk longer than the ring) writes it once, from the call's last token there
    /// (the latest position when positions rise). `sinks` must be below `block_size`
    /// ([`Error::TooLarge`](crate::Error::TooLarge)); positions run up to the configuration's
    /// `max_position`.
    ///
    /// ```
    /// # let Ok(_ctx) = cust::quick_init() else { return Ok(()) }; // no GPU: nothing to run
    /// use cust::memory::DeviceBuffer;
    /// use rope_cuda::{KvCache, Layout};
    /// // A 4096-token window of 2 sequences, 8 kv heads of 128, 4 sink rows.
    /// let n = 2 * 4096 * 8 * 128;
    /// let (mut k, mut v) = (DeviceBuffer::from_slice(&vec![0.0f32; n])?, DeviceBuffer::from_slice(&vec![0.0f32; n])?);
    /// let cache = KvCache::window(&mut k, &mut v, Layout::bshd(2, 4096, 8, 128), 4);
    /// assert_eq!(cache.raw().window, Some(4));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn window(
        k: impl OperandMut<'a, Elem: Element>,
        v: impl OperandMut<'a, Elem: Element>,
        layout: Layout,
        sinks: usize,
    ) -> Self {
        KvCache { window: Some(sinks), ..Self::contiguous(k, v, layout) }
    }

    /// A cache of the views `k` and `v` (of one layout: the caller checks), paged or
    /// contiguous.
    #[cfg(feature = "candle")]
    pub(crate) fn of_views(k: TensorMut<'a>, v: TensorMut<'a>, paged: bool) -> Self {
        KvCache { k, v, paged, window: None, scales: None }
    }

    /// A paged cache: token `t` goes to slot `slots[t]`, row `slot % block_size` of block
    /// `slot / block_size`.
    ///
    /// ```
    /// # let Ok(_ctx) = cust::quick_init() else { return Ok(()) }; // no GPU: nothing to run
    /// # let kernels = rope_cuda::Kernels::load()?;
    /// # let stream = cust::stream::Stream::new(cust::stream::StreamFlags::NON_BLOCKING, None)?;
    /// use cust::memory::DeviceBuffer;
    /// use rope_cuda::{KvCache, Layout};
    /// // vLLM's flash layout: [num_blocks 256, block_size 16, 8 kv heads, 128].
    /// let n = 256 * 16 * 8 * 128;
    /// let (mut k, mut v) = (DeviceBuffer::from_slice(&vec![0.0f32; n])?, DeviceBuffer::from_slice(&vec![0.0f32; n])?);
    /// let cache = KvCache::paged(&mut k, &mut v, Layout::bshd(256, 16, 8, 128));
    /// assert!(cache.raw().paged);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn paged(k: impl OperandMut<'a, Elem: Element>, v: impl OperandMut<'a, Elem: Element>, layout: Layout) -> Self {
        KvCache { paged: true, ..Self::contiguous(k, v, layout) }
    }

    /// The scales of FP8 caches, which FP8 caches need and others refuse: the code stored
    /// for a value `x` is that of `x / scale` (the f32 quotient).
    ///
    /// ```
    /// # let Ok(_ctx) = cust::quick_init() else { return Ok(()) }; // no GPU: nothing to run
    /// use cust::memory::DeviceBuffer;
    /// use rope_cuda::{F8E4M3, KvCache, KvScales, Layout};
    /// // An E4M3 cache of 64 pages of 16 slots, 8 kv heads, with one scale per kv head.
    /// let n = 64 * 16 * 8 * 128;
    /// let (mut k, mut v) = (DeviceBuffer::from_slice(&vec![F8E4M3(0); n])?, DeviceBuffer::from_slice(&vec![F8E4M3(0); n])?);
    /// let (ks, vs) = (DeviceBuffer::from_slice(&[0.5f32; 8])?, DeviceBuffer::from_slice(&[0.25f32; 8])?);
    /// let cache = KvCache::paged(&mut k, &mut v, Layout::bshd(64, 16, 8, 128)).scales(KvScales::per_head(&ks, &vs));
    /// assert!(cache.raw().scales.is_some_and(|s| s.per_head));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn scales(mut self, scales: KvScales<'a>) -> Self {
        self.scales = Some(scales);
        self
    }

    /// The value cache viewed through `layout` rather than the key cache's: values of a
    /// head_dim of their own (DeepSeek's MHA-style attention has 192-wide keys and 128-wide
    /// values); the rest of the layout (blocks, block size, heads, strides) must stay the key
    /// cache's.
    ///
    /// ```
    /// # let Ok(_ctx) = cust::quick_init() else { return Ok(()) }; // no GPU: nothing to run
    /// use cust::memory::DeviceBuffer;
    /// use rope_cuda::{KvCache, Layout};
    /// // 64 pages of 16 slots, 16 kv heads; keys of 192, values of 128 in rows of 192.
    /// let n = 64 * 16 * 16 * 192;
    /// let (mut k, mut v) = (DeviceBuffer::from_slice(&vec![0.0f32; n])?, DeviceBuffer::from_slice(&vec![0.0f32; n])?);
    /// let keys = Layout::bshd(64, 16, 16, 192);
    /// let values = Layout::strided([64, 16, 16, 128], keys.strides, 0);
    /// let cache = KvCache::paged(&mut k, &mut v, keys).v_layout(values);
    /// assert_eq!(cache.raw().v.layout.head_dim(), 128);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn v_layout(mut self, layout: Layout) -> Self {
        self.v.raw.layout = layout;
        self
    }

    /// The cache as device addresses, for [`Rope::append_kv_raw`].
    pub fn raw(&self) -> RawKvCache {
        RawKvCache {
            k: self.k.raw,
            v: self.v.raw,
            paged: self.paged,
            window: self.window,
            scales: self.scales.as_ref().map(KvScales::raw),
        }
    }
}

/// The f32 scales of FP8 caches ([`KvCache::scales`]), engines' two ways: one for all keys
/// and one for all values, or one per kv head each. Read from device memory when each launch
/// runs: an engine may update them in place between calls, and a replayed [`Graph`](crate::Graph)
/// sees the new values.
#[derive(Debug)]
pub struct KvScales<'a> {
    k: (u64, usize, Hold<'a>),
    v: (u64, usize, Hold<'a>),
    per_head: bool,
}

impl<'a> KvScales<'a> {
    /// One scale for all keys (`k`, one f32) and one for all values (`v`).
    pub fn per_tensor(k: impl Operand<'a, Elem = f32>, v: impl Operand<'a, Elem = f32>) -> Self {
        KvScales { k: k.lend(), v: v.lend(), per_head: false }
    }

    /// One scale per kv head for the keys (`k`, one f32 per kv head) and for the values.
    pub fn per_head(k: impl Operand<'a, Elem = f32>, v: impl Operand<'a, Elem = f32>) -> Self {
        KvScales { k: k.lend(), v: v.lend(), per_head: true }
    }

    /// The scales as device addresses.
    pub fn raw(&self) -> RawScales {
        RawScales { k: (self.k.0, self.k.1), v: (self.v.0, self.v.1), per_head: self.per_head }
    }
}

/// The one f32 scale of an FP8 buffer that has one ([`MlaCache::scale`](crate::MlaCache::scale),
/// [`KvAppend::q_fp8`]): the code stored for a value `x` is that of `x / scale` (the f32
/// quotient), as for each of [`KvScales`]' scales. Read from device memory when each launch
/// runs.
///
/// ```
/// # let Ok(_ctx) = cust::quick_init() else { return Ok(()) }; // no GPU: nothing to run
/// use cust::memory::DeviceBuffer;
/// use rope_cuda::Fp8Scale;
/// let q_scale = DeviceBuffer::from_slice(&[0.125f32])?;
/// let scale = Fp8Scale::new(&q_scale);
/// assert_eq!(scale.raw().1, 1);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Copy)]
pub struct Fp8Scale<'a> {
    scale: (u64, usize, Hold<'a>),
}

impl<'a> Fp8Scale<'a> {
    /// The scale in `scale` (one f32).
    pub fn new(scale: impl Operand<'a, Elem = f32>) -> Self {
        Fp8Scale { scale: scale.lend() }
    }

    /// The scale's device address and length in f32.
    pub fn raw(&self) -> (u64, usize) {
        (self.scale.0, self.scale.1)
    }

    /// Address, length and hold.
    pub(crate) fn lend(self) -> (u64, usize, Hold<'a>) {
        self.scale
    }
}

/// The scales of FP8 caches as device addresses and lengths in f32 ([`KvScales`]): built by
/// [`KvScales::raw`] or by its constructors ([`RawScales::per_tensor`], [`RawScales::per_head`]),
/// so that a field added later breaks no caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct RawScales {
    /// The keys' scales: one f32, or one per kv head.
    pub k: (u64, usize),
    /// The values' scales, as many.
    pub v: (u64, usize),
    /// One scale per kv head (else one for all heads).
    pub per_head: bool,
}

impl RawScales {
    /// One scale for all keys (`k`: device address and length, one f32) and one for all
    /// values (`v`) ([`KvScales::per_tensor`]).
    pub fn per_tensor(k: (u64, usize), v: (u64, usize)) -> Self {
        RawScales { k, v, per_head: false }
    }

    /// One scale per kv head for the keys (`k`, one f32 per kv head) and for the values
    /// ([`KvScales::per_head`]).
    pub fn per_head(k: (u64, usize), v: (u64, usize)) -> Self {
        RawScales { k, v, per_head: true }
    }
}

/// q rotated into an FP8 buffer ([`KvAppend::q_fp8`]), as device addresses: built by
/// [`RawQFp8::new`] (or [`RawKvArgs::with_q_fp8`]), so that a field added later breaks no caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct RawQFp8 {
    /// The FP8 output, of q's shape and the caches' format.
    pub out: RawTensor,
    /// q's scale: device address and length (one f32).
    pub scale: (u64, usize),
}

impl RawQFp8 {
    /// q's FP8 output `out` and its scale `scale` (device address and length, one f32).
    pub fn new(out: RawTensor, scale: (u64, usize)) -> Self {
        RawQFp8 { out, scale }
    }
}

/// A KV cache as device addresses (see [`KvCache`]): built by [`KvCache::raw`] or by its
/// constructors ([`RawKvCache::contiguous`], [`RawKvCache::window`], [`RawKvCache::paged`]),
/// so that a field added for a new cache form breaks no caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct RawKvCache {
    /// The key cache.
    pub k: RawTensor,
    /// The value cache; its layout must equal the key cache's but in its head_dim, the
    /// values' (the two may be views of one buffer that share no element: MLA's latent rows).
    pub v: RawTensor,
    /// Paged (slots given per token) or contiguous (positions name the rows).
    pub paged: bool,
    /// A contiguous cache's sliding-window form, `Some(sinks)` ([`KvCache::window`]).
    pub window: Option<usize>,
    /// FP8 caches' scales (none for other caches).
    pub scales: Option<RawScales>,
}

impl RawKvCache {
    /// A contiguous cache of the views `k` and `v` ([`KvCache::contiguous`]).
    pub fn contiguous(k: RawTensor, v: RawTensor) -> Self {
        RawKvCache { k, v, paged: false, window: None, scales: None }
    }

    /// A sliding-window cache of the views `k` and `v` after `sinks` fixed rows
    /// ([`KvCache::window`]).
    pub fn window(k: RawTensor, v: RawTensor, sinks: usize) -> Self {
        RawKvCache { window: Some(sinks), ..Self::contiguous(k, v) }
    }

    /// A paged cache of the views `k` and `v` ([`KvCache::paged`]).
    pub fn paged(k: RawTensor, v: RawTensor) -> Self {
        RawKvCache { paged: true, ..Self::contiguous(k, v) }
    }

    /// The same caches with FP8 scales ([`KvCache::scales`]).
    pub fn scales(self, scales: RawScales) -> Self {
        RawKvCache { scales: Some(scales), ..self }
    }
}

/// Everything one KV append takes ([`Rope::append_kv`]), built: new keys and values, the
/// caches and the positions, then the optional parts where there are any (queries to rotate
/// in the same launch, a paged cache's slot mapping). Each tensor is a view of its own
/// buffer with its own element type.
///
/// ```no_run
/// # use rope_cuda::{KvAppend, KvCache, Layout, Positions, Rope, Tensor, TensorMut};
/// # use cust::memory::DeviceBuffer;
/// # fn step(rope: &Rope, stream: &cust::stream::Stream, qkv: &mut DeviceBuffer<f32>, k: &DeviceBuffer<f32>,
/// #         v: &DeviceBuffer<f32>, kc: &mut DeviceBuffer<f32>, vc: &mut DeviceBuffer<f32>,
/// #         pos: &DeviceBuffer<i32>, slots: &DeviceBuffer<i64>) -> rope_cuda::Result<()> {
/// let mut q = TensorMut::new(qkv, Layout::bshd(1, 4, 32, 128));
/// let (k, v) = (Tensor::new(k, Layout::bshd(1, 4, 8, 128)), Tensor::new(v, Layout::bshd(1, 4, 8, 128)));
/// let mut cache = KvCache::paged(kc, vc, Layout::bshd(64, 16, 8, 128));
/// let append = KvAppend::new(&k, &v, &mut cache, Positions::ids_i32(pos)).q(&mut q).slots(slots);
/// rope.append_kv(append, stream)
/// # }
/// ```
#[derive(Debug)]
pub struct KvAppend<'r, 'a> {
    q: Option<QArg<'r, 'a>>,
    k: &'r Tensor<'a>,
    v: &'r Tensor<'a>,
    cache: &'r mut KvCache<'a>,
    positions: Positions<'a>,
    /// Address, length and hold of the slot mapping.
    slots: Option<(u64, usize, Hold<'a>)>,
    norm: Option<QkNorm<'a>>,
}

impl<'r, 'a> KvAppend<'r, 'a> {
    /// An append of the new keys `k` (`[batch, seq, kv_heads, head_dim]`, rotated into the key
    /// cache, not modified) and values `v` (the same but for their own head_dim, the value
    /// cache's; copied into the value cache) into `cache` at `positions` (the rotation; and,
    /// for contiguous caches, the row): no queries, no slot mapping (a contiguous cache). Add
    /// them with [`KvAppend::q`] and [`KvAppend::slots`].
    pub fn new(k: &'r Tensor<'a>, v: &'r Tensor<'a>, cache: &'r mut KvCache<'a>, positions: Positions<'a>) -> Self {
        KvAppend { q: None, k, v, cache, positions, slots: None, norm: None }
    }

    /// Also rotates the queries `q` (`[batch, seq, q_heads, head_dim]`) in place, in the same
    /// launch.
    pub fn q(mut self, q: &'r mut TensorMut<'a>) -> Self {
        self.q = Some(QArg::InPlace(q));
        self
    }

    /// Also rotates the queries `q` into `out`, an FP8 buffer of q's shape and the caches'
    /// format (FP8 caches only), each value divided by `scale` before the conversion, as the
    /// caches' are: FP8 attention's queries. `q` itself is not modified.
    pub fn q_fp8(mut self, q: &'r Tensor<'a>, out: &'r mut TensorMut<'a>, scale: Fp8Scale<'a>) -> Self {
        self.q = Some(QArg::Fp8(q, out, scale.lend()));
        self
    }

    /// The slot mapping of a paged cache: one i64 per token (`-1`: padding, not written).
    pub fn slots(mut self, slots: impl Operand<'a, Elem = i64>) -> Self {
        self.slots = Some(slots.lend());
        self
    }

    /// Normalizes each head of q and of k with `norm` before the rotation, in the same
    /// launch (QK-norm: Qwen3, Gemma 3 and 4, Llama 4, …): the keys written to the cache and
    /// q are normalized and rotated, with one rounding to their type; `k` is read, not
    /// modified. The views it takes are [`QkNorm`](crate::QkNorm)'s rule, the same as
    /// [`RopeArgs::norm`](crate::RopeArgs::norm)'s ([`Error::Norm`](crate::Error::Norm) otherwise).
    pub fn norm(mut self, norm: QkNorm<'a>) -> Self {
        self.norm = Some(norm);
        self
    }

    /// The append as device addresses, for [`Rope::append_kv_raw`] and [`validate_append`].
    pub fn raw(&self) -> RawKvArgs {
        RawKvArgs {
            q: self.q.as_ref().map(|q| match q {
                QArg::InPlace(q) => q.raw,
                QArg::Fp8(q, ..) => q.raw,
            }),
            q_fp8: match &self.q {
                Some(QArg::Fp8(_, out, (ptr, len, _))) => Some(RawQFp8 { out: out.raw, scale: (*ptr, *len) }),
                _ => None,
            },
            k: self.k.raw,
            v: self.v.raw,
            cache: self.cache.raw(),
            positions: self.positions.raw(),
            slots: self.slots.as_ref().map(|&(ptr, len, _)| (ptr, len)),
            norm: self.norm.as_ref().map(QkNorm::raw),
        }
    }

    /// Each buffer's name and hold.
    fn holds(&self) -> [(&'static str, Option<&Hold<'a>>); 13] {
        let (q, q_out, q_scale) = match &self.q {
            None => (None, None, None),
            Some(QArg::InPlace(q)) => (Some(&q.hold), None, None),
            Some(QArg::Fp8(q, out, (_, _, scale))) => (Some(&q.hold), Some(&out.hold), Some(scale)),
        };
        let scales = self.cache.scales.as_ref();
        [
            ("q", q),
            ("q out", q_out),
            ("q scale", q_scale),
            ("k", Some(&self.k.hold)),
            ("v", Some(&self.v.hold)),
            ("k cache", Some(&self.cache.k.hold)),
            ("v cache", Some(&self.cache.v.hold)),
            ("k scales", scales.map(|s| &s.k.2)),
            ("v scales", scales.map(|s| &s.v.2)),
            ("positions", Some(&self.positions.hold)),
            ("slots", self.slots.as_ref().map(|(_, _, hold)| hold)),
            ("q norm weight", self.norm.as_ref().and_then(|n| n.holds()[0])),
            ("k norm weight", self.norm.as_ref().and_then(|n| n.holds()[1])),
        ]
    }
}

/// The queries of an append: rotated in place, or into an FP8 buffer with their scale.
#[derive(Debug)]
enum QArg<'r, 'a> {
    InPlace(&'r mut TensorMut<'a>),
    Fp8(&'r Tensor<'a>, &'r mut TensorMut<'a>, (u64, usize, Hold<'a>)),
}

/// Everything one KV append takes, as device addresses ([`Rope::append_kv_raw`]). Each
/// tensor carries its element type: q's, k's and v's must be the configuration's, and the
/// caches' the same, or both one FP8 format (with scales).
///
/// Built by [`KvAppend::raw`] or by [`RawKvArgs::new`] and the `with_*` methods, so that a
/// field added later breaks no caller; the fields stay public to read and to assign:
///
/// ```
/// use rope_cuda::{DType, Layout, PositionKind, RawKvArgs, RawKvCache, RawPositions, RawTensor};
/// let t = |i: u64, layout: Layout| RawTensor::new(i << 30, layout.extent().unwrap(), DType::BF16, layout);
/// let (new, cache) = (Layout::bshd(4, 1, 8, 128), Layout::bshd(64, 16, 8, 128));
/// let positions = RawPositions::new(PositionKind::IdsI32, 6 << 30, 4);
/// let args = RawKvArgs::new(t(2, new), t(3, new), RawKvCache::paged(t(4, cache), t(5, cache)), positions)
///     .with_q(t(1, Layout::bshd(4, 1, 32, 128)))
///     .with_slots((7 << 30, 4));
/// assert_eq!(args.slots, Some((7 << 30, 4)));
/// let mut unpaged = args;
/// unpaged.slots = None;
/// assert!(unpaged.q.is_some() && unpaged.norm.is_none());
/// ```
///
/// A struct expression does not compile outside the crate, so that adding a field breaks no
/// caller:
///
/// ```compile_fail,E0639
/// use rope_cuda::{DType, Layout, RawKvArgs, RawKvCache, RawPositions, RawTensor};
/// let t = RawTensor::new(1 << 30, 8 * 128, DType::BF16, Layout::bshd(1, 1, 8, 128));
/// let args = RawKvArgs {
///     q: None,
///     q_fp8: None,
///     k: t,
///     v: t,
///     cache: RawKvCache::contiguous(t, t),
///     positions: RawPositions::SEQUENTIAL,
///     slots: None,
///     norm: None,
/// };
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct RawKvArgs {
    /// Queries `[batch, seq, q_heads, head_dim]` to rotate in the same launch: in place, or,
    /// with `q_fp8`, into an FP8 buffer.
    pub q: Option<RawTensor>,
    /// q's FP8 output and scale (FP8 caches only; needs `q`).
    pub q_fp8: Option<RawQFp8>,
    /// New keys `[batch, seq, kv_heads, head_dim]`, rotated into the key cache (not modified).
    pub k: RawTensor,
    /// New values, `k`'s shape but their own head_dim (the value cache's), copied into the
    /// value cache.
    pub v: RawTensor,
    /// The caches.
    pub cache: RawKvCache,
    /// The tokens' positions (the rotation; and, for contiguous caches, the row).
    pub positions: RawPositions,
    /// Paged caches: device address and length of the i64 slot mapping, one per token
    /// (`-1`: padding, not written).
    pub slots: Option<(u64, usize)>,
    /// QK-norm of q's and k's heads before the rotation ([`KvAppend::norm`]).
    pub norm: Option<RawNorm>,
}

impl RawKvArgs {
    /// An append of the new keys `k` and values `v` into `cache` at `positions`: no queries,
    /// no slot mapping (a contiguous cache), no norm ([`KvAppend::new`]).
    pub fn new(k: RawTensor, v: RawTensor, cache: RawKvCache, positions: RawPositions) -> Self {
        RawKvArgs { q: None, q_fp8: None, k, v, cache, positions, slots: None, norm: None }
    }

    /// Also rotates the queries `q` in place, in the same launch ([`KvAppend::q`]).
    pub fn with_q(self, q: RawTensor) -> Self {
        RawKvArgs { q: Some(q), ..self }
    }

    /// Also rotates the queries `q` into the FP8 buffer `out` with q's `scale` (device address
    /// and length, one f32), in the same launch ([`KvAppend::q_fp8`]).
    pub fn with_q_fp8(self, q: RawTensor, out: RawTensor, scale: (u64, usize)) -> Self {
        RawKvArgs { q: Some(q), q_fp8: Some(RawQFp8::new(out, scale)), ..self }
    }

    /// The slot mapping of a paged cache: device address and length of the i64 slots, one
    /// per token ([`KvAppend::slots`]).
    pub fn with_slots(self, slots: (u64, usize)) -> Self {
        RawKvArgs { slots: Some(slots), ..self }
    }

    /// QK-norm of q's and k's heads before the rotation ([`KvAppend::norm`]).
    pub fn with_norm(self, norm: RawNorm) -> Self {
        RawKvArgs { norm: Some(norm), ..self }
    }
}

/// Checks `args` against `config` exactly as [`Rope::append_kv_raw`] does before it
/// launches, without a GPU: `Ok` means that call would launch (or, with no work, return at
/// once), `Err` is the typed error it would return. Reads no device memory (positions and
/// slots are checked by the kernels, which skip and record those out of range).
///
/// ```
/// use rope_cuda::{
///     validate_append, DType, Error, Layout, PositionKind, RawKvArgs, RawKvCache, RawPositions, RawTensor, RopeConfig,
/// };
/// let config = RopeConfig::new(128, 4096).dtype(DType::BF16);
/// let t = |i: u64, layout: Layout| RawTensor::new(i << 30, layout.extent().unwrap(), DType::BF16, layout);
/// let new = Layout::bshd(4, 1, 8, 128); // 4 sequences, one new token each, 8 kv heads
/// let cache = Layout::bshd(64, 16, 8, 128); // 64 pages of 16 slots
/// let positions = RawPositions::new(PositionKind::IdsI32, 6 << 30, 4);
/// let args = RawKvArgs::new(t(2, new), t(3, new), RawKvCache::paged(t(4, cache), t(5, cache)), positions)
///     .with_q(t(1, Layout::bshd(4, 1, 32, 128)))
///     .with_slots((7 << 30, 4));
/// assert_eq!(validate_append(&config, &args), Ok(()));
/// let mut unpaged = args;
/// unpaged.slots = None;
/// assert!(matches!(validate_append(&config, &unpaged), Err(Error::SlotMapping(_))));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn validate_append(config: &RopeConfig, args: &RawKvArgs) -> Result<()> {
    config.validate()?;
    let table = detached_source(config.rotary_dim, config.source());
    plan_kv(&KvSpec::of(config), &KvCall::APPEND, args, table, ErrorSink::default()).map(|_| ())
}

impl Rope {
    /// One decode or prefill step in one launch: rotates `k` into the key cache and copies
    /// `v` into the value cache at each token's slot, and, with `q`, rotates `q` in place.
    ///
    /// Contiguous caches take each token's row from its position (no slot mapping); paged
    /// caches from the slot mapping ([`KvAppend::slots`]: one i64 per token, `-1` for padding,
    /// which is skipped). The buffers are any [`Operand`]s (cust's or cudarc's), the stream any
    /// [`Queue`].
    /// A token whose position is outside the table (or, contiguous, the cache) is skipped
    /// entirely and a slot outside the cache skips its writes; both are recorded and reported
    /// by [`Rope::check_errors`]. When several tokens name one slot, the last one's key and
    /// value are written. Values are copied bit for bit; nothing else in the caches changes.
    ///
    /// ```
    /// # let Ok(_ctx) = cust::quick_init() else { return Ok(()) }; // no GPU: nothing to run
    /// # let kernels = rope_cuda::Kernels::load()?;
    /// # let stream = cust::stream::Stream::new(cust::stream::StreamFlags::NON_BLOCKING, None)?;
    /// use cust::memory::{CopyDestination, DeviceBuffer};
    /// use rope_cuda::{KvAppend, KvCache, Layout, Positions, Rope, RopeConfig, Tensor};
    /// let rope = Rope::new(&kernels, RopeConfig::new(64, 32))?;
    /// // 2 sequences, 1 new token each, 2 kv heads; a contiguous cache of 32 positions.
    /// let new = Layout::bshd(2, 1, 2, 64);
    /// let (k, v) = (DeviceBuffer::from_slice(&vec![1.0f32; 256])?, DeviceBuffer::from_slice(&vec![2.0f32; 256])?);
    /// let mut kc = DeviceBuffer::from_slice(&vec![0.0f32; 2 * 32 * 2 * 64])?;
    /// let mut vc = DeviceBuffer::from_slice(&vec![0.0f32; 2 * 32 * 2 * 64])?;
    /// let pos = DeviceBuffer::from_slice(&[0i32, 5])?;
    /// let (kt, vt) = (Tensor::new(&k, new), Tensor::new(&v, new));
    /// let mut cache = KvCache::contiguous(&mut kc, &mut vc, Layout::bshd(2, 32, 2, 64));
    /// rope.append_kv(KvAppend::new(&kt, &vt, &mut cache, Positions::ids_i32(&pos)), &stream)?;
    /// rope.check_errors(&stream)?;
    /// let mut values = vec![0.0f32; 2 * 32 * 2 * 64];
    /// vc.copy_to(&mut values[..])?;
    /// // Sequence 1's token went to row 5: its values are there, the row before is untouched.
    /// let row = |s: usize, p: usize| (s * 32 + p) * 2 * 64;
    /// assert!(values[row(1, 5)..row(1, 6)].iter().all(|&x| x == 2.0));
    /// assert!(values[row(1, 4)..row(1, 5)].iter().all(|&x| x == 0.0));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn append_kv(&self, args: KvAppend<'_, '_>, stream: &impl Queue) -> Result<()> {
        let stream = stream.raw(self.kernels())?;
        // SAFETY: as in `Rope::apply`, for every buffer of the append.
        on_stream(args.holds(), stream, || unsafe { self.append_kv_raw(&args.raw(), stream) })
    }

    /// [`Rope::append_kv`] on device addresses and a raw stream.
    ///
    /// Everything that can be checked without reading device memory is checked first, and
    /// an `Err` means nothing was launched.
    ///
    /// # Safety
    /// As [`Rope::apply_raw`]: each address is a live allocation of this context holding at
    /// least `len` elements of its type, not freed or written by others until the work
    /// queued on `stream` completes.
    ///
    /// ```
    /// # let Ok(_ctx) = cust::quick_init() else { return Ok(()) }; // no GPU: nothing to run
    /// # let kernels = rope_cuda::Kernels::load()?;
    /// # let stream = cust::stream::Stream::new(cust::stream::StreamFlags::NON_BLOCKING, None)?;
    /// use cust::memory::DeviceBuffer;
    /// use rope_cuda::{DType, KvCache, Layout, PositionKind, RawKvArgs, RawPositions, RawTensor, Rope, RopeConfig};
    /// let rope = Rope::new(&kernels, RopeConfig::new(64, 32))?;
    /// let new = Layout::bshd(1, 2, 1, 64);
    /// let (k, v) = (DeviceBuffer::from_slice(&vec![1.0f32; 128])?, DeviceBuffer::from_slice(&vec![2.0f32; 128])?);
    /// let mut kc = DeviceBuffer::from_slice(&vec![0.0f32; 4 * 8 * 64])?;
    /// let mut vc = DeviceBuffer::from_slice(&vec![0.0f32; 4 * 8 * 64])?;
    /// let (pos, slots) = (DeviceBuffer::from_slice(&[3i32, 4])?, DeviceBuffer::from_slice(&[9i64, 10])?);
    /// let raw = |b: &DeviceBuffer<f32>| RawTensor::new(b.as_device_ptr().as_raw(), b.len(), DType::F32, new);
    /// let cache = KvCache::paged(&mut kc, &mut vc, Layout::bshd(4, 8, 1, 64)).raw();
    /// let positions = RawPositions::new(PositionKind::IdsI32, pos.as_device_ptr().as_raw(), 2);
    /// let args = RawKvArgs::new(raw(&k), raw(&v), cache, positions).with_slots((slots.as_device_ptr().as_raw(), 2));
    /// // SAFETY: every address is a live allocation of this context of the length given, kept until
    /// // `check_errors` synchronises.
    /// unsafe { rope.append_kv_raw(&args, stream.as_inner())? };
    /// rope.check_errors(&stream)?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub unsafe fn append_kv_raw(&self, args: &RawKvArgs, stream: cuda::CUstream) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.append_kv_call(&KvCall::APPEND, args, stream) }
    }

    /// [`Rope::append_kv_raw`] with `call`'s options and names (the MLA append's).
    ///
    /// # Safety
    /// As [`Rope::append_kv_raw`].
    pub(crate) unsafe fn append_kv_call(&self, call: &KvCall, args: &RawKvArgs, stream: cuda::CUstream) -> Result<()> {
        let spec = KvSpec::of(&self.config);
        let Some(plan) = plan_kv(&spec, call, args, self.table.view(), self.core.records.sink())? else {
            return Ok(());
        };
        self.core.prepare(&plan.buffers(args), self.config.checked)?;
        let checked = self.config.checked.then_some(self.config.max_position);
        // SAFETY: the caller's contract; `prepare` passed.
        unsafe { plan.launch(&self.core, stream, checked) }
    }
}
