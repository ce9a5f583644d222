//! KV cache: the fused RoPE + append of one decode or prefill step ([`Rope::append_kv`]).

use cust::sys as cuda;
use rope_cuda_kernels::entries::Key;
use rope_cuda_kernels::keys::{KvKey, KvWidth, ReadKey, TableSource};
use rope_cuda_kernels::params::{groups, kv_heads_per_thread, kv_segments, lane_slots, FastDiv, KvParams, ReadParams};
use rope_cuda_kernels::tuning::KV_PREFILL_MAX_TOKENS;
use rope_cuda_kernels::views::{CacheView, ErrorSink, OwnerView, ScalesView, SourceView};

use crate::config::{DType, Mrope, RopeConfig, RopeStyle};
use crate::error::{Error, Result};
use crate::kernels::Geometry;
use crate::launch::{
    block_geometry, check_axis, check_disjoint, check_u32, check_view, check_written, detached_source, flat_geometry,
    heads_view, lanes, pairs, positions, staged, vector_fits, Core, BLOCK_THREADS,
};
use crate::layout::Layout;
use crate::norm::{
    norm_view, value_norm_view, whole_kv_layout, whole_v_layout, QkNorm, RawMlaNorm, RawNorm, RawWeight,
    WHOLE_TOO_LARGE,
};
use crate::operand::{on_stream, Element, Hold, Operand, OperandMut, Queue};
use crate::rope::Rope;
use crate::tensor::{Positions, RawPositions, RawTensor, Tensor, TensorMut};

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
        KvCache { k: TensorMut::new(k, layout), v: TensorMut::new(v, layout), paged: false, scales: None }
    }

    /// A cache of the views `k` and `v` (of one layout: the caller checks), paged or
    /// contiguous.
    #[cfg(feature = "candle")]
    pub(crate) fn of_views(k: TensorMut<'a>, v: TensorMut<'a>, paged: bool) -> Self {
        KvCache { k, v, paged, scales: None }
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
        KvCache { k: TensorMut::new(k, layout), v: TensorMut::new(v, layout), paged: true, scales: None }
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
        RawKvCache { k: self.k.raw, v: self.v.raw, paged: self.paged, scales: self.scales.as_ref().map(KvScales::raw) }
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

/// The scales of FP8 caches as device addresses and lengths in f32 ([`KvScales`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawScales {
    /// The keys' scales: one f32, or one per kv head.
    pub k: (u64, usize),
    /// The values' scales, as many.
    pub v: (u64, usize),
    /// One scale per kv head (else one for all heads).
    pub per_head: bool,
}

/// q rotated into an FP8 buffer ([`KvAppend::q_fp8`]), as device addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawQFp8 {
    /// The FP8 output, of q's shape and the caches' format.
    pub out: RawTensor,
    /// q's scale: device address and length (one f32).
    pub scale: (u64, usize),
}

/// A KV cache as device addresses (see [`KvCache`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawKvCache {
    /// The key cache.
    pub k: RawTensor,
    /// The value cache; its layout must equal the key cache's but in its head_dim, the
    /// values' (the two may be views of one buffer that share no element: MLA's latent rows).
    pub v: RawTensor,
    /// Paged (slots given per token) or contiguous (positions name the rows).
    pub paged: bool,
    /// FP8 caches' scales (none for other caches).
    pub scales: Option<RawScales>,
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
    /// format (FP8 caches only), each value divided by `scale`'s one f32 before the
    /// conversion, as the caches' are: FP8 attention's queries. `q` itself is not modified.
    pub fn q_fp8(mut self, q: &'r Tensor<'a>, out: &'r mut TensorMut<'a>, scale: impl Operand<'a, Elem = f32>) -> Self {
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
    /// modified. The views must take 8- or 16-byte accesses (aligned addresses and strides,
    /// as the fast kernels ask) and a head at most 32 lanes of 16 bytes (head_dim up to 512 in
    /// f16/bf16, 256 in f32): otherwise [`Error::Norm`].
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
#[derive(Debug, Clone, Copy, PartialEq)]
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

// The reference operation launches GPT-J kernels at the width `plan_kv` chose; its `_v_t`
// kernels serve both claimed widths, so they must take one head per thread like `_p`.
const _: () = assert!(kv_heads_per_thread(true, true, 2) == 1 && kv_heads_per_thread(true, true, 4) == 1);

/// What the launch needs from the configuration (a [`Rope`]'s, or the reference op's).
#[derive(Debug, Clone, Copy)]
pub(crate) struct KvSpec {
    pub dtype: DType,
    pub style: RopeStyle,
    pub head_dim: usize,
    pub rotary_dim: usize,
    pub max_position: usize,
    pub tables: TableSource,
    pub mrope: Option<Mrope>,
    /// GPT-J pairs written back de-interleaved (MLA's option, [`crate::MlaAppend::deinterleaved`]).
    pub deinterleave: bool,
    /// The RMS norm of the values' one head (MLA's `kv_c`, [`crate::MlaAppend::kv_c_norm`]);
    /// not with a QK-norm.
    pub v_norm: Option<RawMlaNorm>,
}

impl KvSpec {
    /// A [`Rope`]'s: its configuration, and the library's cos and sin as it says.
    pub fn of(config: &RopeConfig) -> Self {
        KvSpec {
            dtype: config.dtype,
            style: config.style,
            head_dim: config.head_dim,
            rotary_dim: config.rotary_dim,
            max_position: config.max_position,
            tables: config.source(),
            mrope: config.mrope,
            deinterleave: false,
            v_norm: None,
        }
    }
}

/// A validated KV launch.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct KvPlan {
    pub key: KvKey,
    pub params: KvParams,
    pub geometry: Geometry,
    /// Whether duplicates are settled by `kv_claim` (else by scanning).
    pub claim: bool,
}

impl KvPlan {
    /// The buffers the launch touches, for the device check.
    pub fn buffers(&self, args: &RawKvArgs) -> [(&'static str, u64); 14] {
        let scales = args.cache.scales;
        [
            ("q", args.q.map_or(0, |t| t.ptr)),
            ("q out", args.q_fp8.map_or(0, |q| q.out.ptr)),
            ("q scale", args.q_fp8.map_or(0, |q| q.scale.0)),
            ("k", args.k.ptr),
            ("v", args.v.ptr),
            ("k cache", args.cache.k.ptr),
            ("v cache", args.cache.v.ptr),
            ("k scales", scales.map_or(0, |s| s.k.0)),
            ("v scales", scales.map_or(0, |s| s.v.0)),
            ("positions", self.params.positions.address()),
            ("slots", self.params.cache.mapping()),
            ("q norm weight", self.params.norm.weights[0]),
            ("k norm weight", self.params.norm.weights[1]),
            ("kv_c norm weight", self.params.norm.weights[2]),
        ]
    }

    /// Queues the launch (after the claims, on the claimed path) through `core`; `checked`:
    /// the positions' limit to report with, in checked mode.
    ///
    /// # Safety
    /// The buffers of the planned arguments are live allocations of the kernels' context, not
    /// freed or written by others until the work completes, and `stream` is a stream of it;
    /// [`Core::prepare`] passed.
    pub unsafe fn launch(&self, core: &Core, stream: cuda::CUstream, checked: Option<usize>) -> Result<()> {
        let mut p = self.params;
        // The block's size before the claims (the launch checks it otherwise): a kernel that
        // cannot take it launches nothing.
        if self.claim {
            core.kernels.check_block(self.key, self.geometry)?;
        }
        core.records.note_num_slots(p.cache.num_slots());
        // Held from the claims to the launch that reads them.
        let mut owners = self.claim.then(|| core.records.owners());
        if let Some(owners) = owners.as_mut() {
            // SAFETY: `plan_kv` checked the positions' and slots' lengths.
            unsafe { owners.claim(&core.kernels, &mut p, stream) }?;
        }
        let block = self.geometry.block.0;
        let shared = p.shared(block, !self.claim, p.source.computed()).with_norm_sums(p.norm.whole(), block);
        // SAFETY: `plan_kv` checked every view and both caches against their buffers,
        // overlaps, alignment for the width, and the positions' and slots' lengths; the
        // tables, records and owner array belong to the caller; scanning kernels get their
        // shared memory and at most `KV_SCAN_MAX_TOKENS` tokens.
        unsafe { core.launch(self.key, self.geometry, shared, &p, stream, checked) }
    }
}

/// The caches' one layout (the key cache's): the value cache's must equal it but in its
/// head_dim where `v_head_dim` is free (the append: values may be wider or narrower than
/// keys, as MLA's latent rows, [`MlaCache`](crate::MlaCache), whose two views share a buffer).
fn cache_layout(cache: &RawKvCache, v_head_dim: bool) -> Result<Layout> {
    let (cl, vl) = (cache.k.layout, cache.v.layout);
    let same = match v_head_dim {
        true => vl.shape[..3] == cl.shape[..3] && vl.strides == cl.strides,
        false => vl.shape == cl.shape && vl.strides == cl.strides,
    };
    if !same {
        return Err(Error::Shape {
            what: "v cache",
            axis: match v_head_dim {
                true => "layout (blocks, block size, heads and strides must equal the key cache's)",
                false => "layout (must equal the key cache's)",
            },
            expected: cl.extent().unwrap_or(0),
            got: vl.extent().unwrap_or(0),
        });
    }
    Ok(cl)
}

/// What an FP8 cache without scales is told.
pub(crate) const NEED_SCALES: &str = "FP8 caches need their scales (KvCache::scales)";

/// The scales of `cache`, checked: FP8 caches (`fp8`) need them, others take none; each
/// buffer holds one f32, or, per head, one per kv head, and is aligned for f32.
fn check_scales(cache: &RawKvCache, fp8: bool, kv_heads: usize) -> Result<Option<RawScales>> {
    match (cache.scales, fp8) {
        (None, false) => Ok(None),
        (None, true) => Err(Error::Scales(NEED_SCALES)),
        (Some(_), false) => Err(Error::Scales("only FP8 caches take scales")),
        (Some(s), true) => {
            let n = if s.per_head { kv_heads } else { 1 };
            check_scale("k scales", s.k, n)?;
            check_scale("v scales", s.v, n)?;
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

/// Checks `args` against `spec` and works out the launch with cos and sin from `source` (of
/// `spec.tables`) and `errors`; `None` when there is no work.
pub(crate) fn plan_kv(
    spec: &KvSpec,
    args: &RawKvArgs,
    source: SourceView,
    errors: ErrorSink,
) -> Result<Option<KvPlan>> {
    debug_assert_eq!(source.source(), spec.tables);
    // The inputs are of the configuration's type; the caches of one a kernel writes from it
    // (checked with the key, below).
    for (what, t) in [("q", args.q.as_ref()), ("k", Some(&args.k)), ("v", Some(&args.v))] {
        match t {
            Some(t) if t.dtype != spec.dtype => return Err(Error::DType { what, expected: spec.dtype, got: t.dtype }),
            _ => {}
        }
    }
    let size = spec.dtype.size();
    let (hd, rot) = (spec.head_dim, spec.rotary_dim);
    let ks = args.k.layout.shape;
    let (batch, seq, kv_heads) = (ks[0], ks[1], ks[2]);
    check_axis("k", "head_dim", hd, ks[3])?;
    for (axis, i) in [("batch", 0), ("seq", 1), ("heads", 2)] {
        check_axis("v", axis, ks[i], args.v.layout.shape[i])?;
    }
    // The values' own head_dim (copied, never rotated): the value cache's.
    let v_hd = args.v.layout.shape[3];
    if v_hd == 0 {
        return Err(Error::Shape { what: "v", axis: "head_dim", expected: hd, got: 0 });
    }
    if let Some(q) = &args.q {
        for (axis, i, want) in [("batch", 0, batch), ("seq", 1, seq), ("head_dim", 3, hd)] {
            check_axis("q", axis, want, q.layout.shape[i])?;
        }
        check_view("q", q)?;
        check_written("q", &q.layout)?;
    }
    check_view("k", &args.k)?;
    check_view("v", &args.v)?;
    let norm = match (&args.norm, &spec.v_norm) {
        (Some(_), _) | (_, Some(_)) if spec.tables == TableSource::Caller => {
            return Err(Error::Norm("the reference update (the caller's tables) takes no norm"));
        }
        (Some(_), Some(_)) => return Err(Error::Norm("a QK-norm and the values' norm are not taken together")),
        (Some(n), None) => Some(norm_view(n, hd, [args.q.map(|q| q.layout.shape[2]), Some(ks[2])], spec.dtype)?),
        (None, Some(n)) => {
            check_axis("v", "heads (one, normalized: MLA's kv_c)", 1, kv_heads)?;
            Some(value_norm_view(n, v_hd, spec.dtype)?)
        }
        (None, None) => None,
    };
    // Only the values normalized (MLA's kv_c): q's and k's lanes and kernels as without a norm
    // but for the `_w` kernels' geometry.
    let v_only = spec.v_norm.is_some();

    let cache = &args.cache;
    let cl = cache_layout(cache, true)?;
    let (blocks, block_size) = (cl.shape[0], cl.shape[1]);
    check_axis("cache", "heads", kv_heads, cl.shape[2])?;
    check_axis("cache", "head_dim", hd, cl.shape[3])?;
    check_axis("v cache", "head_dim", v_hd, cache.v.layout.shape[3])?;
    check_view("k cache", &cache.k)?;
    check_view("v cache", &cache.v)?;
    check_written("cache", &cl)?;
    check_written("v cache", &cache.v.layout)?;
    // FP8 caches: one format for both, their scales, and q's FP8 output.
    let fp8 = cache.k.dtype.fp8();
    if fp8.is_some() && cache.v.dtype != cache.k.dtype {
        return Err(Error::DType { what: "v cache", expected: cache.k.dtype, got: cache.v.dtype });
    }
    let scales = check_scales(cache, fp8.is_some(), kv_heads)?;
    let q_fp8 = match (args.q_fp8, &args.q) {
        (None, _) => None,
        (Some(_), None) => return Err(Error::Scales("an FP8 output of q needs q (RawKvArgs::q)")),
        (Some(_), Some(_)) if fp8.is_none() => {
            return Err(Error::Scales("an FP8 output of q needs FP8 caches, of its format"));
        }
        (Some(o), Some(q)) => {
            if o.out.dtype != cache.k.dtype {
                return Err(Error::DType { what: "q out", expected: cache.k.dtype, got: o.out.dtype });
            }
            for (axis, i) in [("batch", 0), ("seq", 1), ("heads", 2), ("head_dim", 3)] {
                check_axis("q out", axis, q.layout.shape[i], o.out.layout.shape[i])?;
            }
            check_view("q out", &o.out)?;
            check_written("q out", &o.out.layout)?;
            check_scale("q scale", o.scale, 1)?;
            Some(o)
        }
    };
    // What is written (q in place or its FP8 output, both caches) shares nothing with anything
    // else, the scales included.
    let scale_tensor = |(ptr, len): (u64, usize)| RawTensor::new(ptr, len, DType::F32, Layout::bshd(1, 1, 1, len));
    let entries = [
        ("q", args.q, q_fp8.is_none()),
        ("q out", q_fp8.map(|o| o.out), true),
        ("k", Some(args.k), false),
        ("v", Some(args.v), false),
        ("k cache", Some(cache.k), true),
        ("v cache", Some(cache.v), true),
        ("k scales", cache.scales.map(|s| scale_tensor(s.k)), false),
        ("v scales", cache.scales.map(|s| scale_tensor(s.v)), false),
        ("q scale", q_fp8.map(|o| scale_tensor(o.scale)), false),
        ("q norm weight", args.norm.and_then(|n| n.q_weight).map(RawWeight::tensor), false),
        ("k norm weight", args.norm.and_then(|n| n.k_weight).map(RawWeight::tensor), false),
        ("kv_c norm weight", spec.v_norm.map(|n| n.weight.tensor()), false),
    ];
    for (i, &(wn, w, written)) in entries.iter().enumerate() {
        for (j, &(on, o, o_written)) in entries.iter().enumerate() {
            let (Some(w), Some(o)) = (w, o) else { continue };
            if written && i != j && (!o_written || i < j) {
                check_disjoint((wn, &w), (on, &o))?;
            }
        }
    }

    let tokens = batch.saturating_mul(seq);
    let num_slots = blocks.saturating_mul(block_size);
    if spec.mrope.is_some() && !cache.paged {
        return Err(Error::MropeCache);
    }
    let limit = if cache.paged {
        match args.slots {
            None => return Err(Error::SlotMapping("a paged cache needs a slot mapping (one i64 per token)")),
            Some((_, len)) if len != tokens => {
                return Err(Error::Length { what: "slots", shape: vec![batch, seq], expected: tokens, got: len });
            }
            Some((ptr, _)) if ptr % 8 != 0 => {
                return Err(Error::Alignment { what: "slots", address: ptr, align: 8 });
            }
            Some(_) => spec.max_position,
        }
    } else {
        if args.slots.is_some() {
            return Err(Error::SlotMapping("a contiguous cache takes its rows from the positions, not slots"));
        }
        check_axis("cache", "batch", batch, blocks)?;
        spec.max_position.min(block_size)
    };
    let positions = positions(&args.positions, batch, seq, limit, spec.mrope.is_some())?;
    let pairs = pairs(rot, spec.mrope.map(|m| m.bands()));
    let q_heads = args.q.map_or(0, |q| q.layout.shape[2]);
    check_u32(&[
        ("batch * seq", tokens),
        ("q heads", q_heads),
        ("kv heads", kv_heads),
        ("cache slots (blocks * block_size)", num_slots),
    ])?;
    if tokens == 0 || kv_heads == 0 {
        return Ok(None);
    }

    let views = [args.q, q_fp8.map(|o| o.out), Some(args.k), Some(args.v), Some(cache.k), Some(cache.v)];
    let vector = vector_fits(spec.style, hd, rot, size, views.iter().flatten()) && v_hd % (16 / size) == 0;
    let mut claim = tokens > KV_SCAN_MAX_TOKENS;
    let mut width = match vector {
        false => KvWidth::Scalar,
        true if !claim => KvWidth::Decode,
        // The caller's tables come in `_v_t` kernels only, one head per thread like `_p`.
        true if tokens <= KV_PREFILL_MAX_TOKENS && spec.tables != TableSource::Caller => KvWidth::Prefill,
        true => KvWidth::Vector,
    };
    // The decode kernels move 8 bytes per access (half the work per thread: few tokens are
    // bound by each thread's chain of latencies, not by bandwidth).
    let lanes_of = |width| {
        let e = if width == KvWidth::Decode { 8 / size } else { 16 / size };
        let (rot_lanes, cw) = lanes(vector, spec.style, rot, e);
        (rot_lanes, cw, rot_lanes + (hd - rot) / cw)
    };
    if norm.is_some() {
        // The normed kernels: a head's lanes inside one warp (`_d`; `_p` and `_v`, which
        // claim their slots, where the decode kernel's 8-byte lanes would be too many).
        if !vector {
            return Err(Error::Norm("the views must take 8- or 16-byte accesses (aligned addresses and strides)"));
        }
        // (The values' norm alone sums a head of v over several warps: no bound here.)
        if !v_only && width == KvWidth::Decode && lane_slots(lanes_of(KvWidth::Decode).2 as u64) > 32 {
            (width, claim) = (KvWidth::Prefill, true);
        }
        if !v_only && lane_slots(lanes_of(width).2 as u64) > 32 {
            return Err(Error::Norm(
                "a head takes more than 32 lanes of 16 bytes (head_dim above 512 in f16/bf16, 256 in f32)",
            ));
        }
    }
    // A whole-projection norm: one head a thread, each token's q heads and its k heads inside
    // one block (`whole_kv_layout`): the decode kernel's 8-byte lanes where they fit, else
    // 16-byte ones (claimed), whatever the number of tokens.
    let whole = norm.is_some_and(|n| n.whole());
    let layout_of = |width| {
        let (_, cw, k_lanes) = lanes_of(width);
        let counts = [k_lanes, k_lanes, v_hd / cw].map(|l| l as u64);
        match v_only {
            true => whole_v_layout(q_heads as u64, kv_heads as u64, counts),
            false => whole_kv_layout(q_heads as u64, kv_heads as u64, counts),
        }
    };
    if whole && (width == KvWidth::Vector || (width == KvWidth::Decode && layout_of(width).is_none())) {
        (width, claim) = (KvWidth::Prefill, true);
    }
    let (rot_lanes, cw, k_lanes) = lanes_of(width);
    if spec.deinterleave {
        // Each lane writes one access of each half; in place, a head's lanes meet inside one
        // warp between their loads and their stores.
        let why = match () {
            _ if spec.style != RopeStyle::GptJ => Some("GPT-J (interleaved) pairs only"),
            _ if (norm.is_some() && !v_only) || spec.mrope.is_some() => Some("no QK-norm or MRoPE with them"),
            _ if width == KvWidth::Scalar => Some("the views must take 8- or 16-byte accesses"),
            _ if args.q.is_some() && q_fp8.is_none() && lane_slots(rot_lanes as u64) > 32 => {
                Some("q in place with a head above 32 lanes")
            }
            _ => None,
        };
        if let Some(why) = why {
            return Err(Error::Deinterleave(why));
        }
    }
    let g = match width {
        KvWidth::Vector => kv_heads_per_thread(true, spec.style == RopeStyle::GptJ, size),
        _ => 1,
    };
    let v_lanes = v_hd / cw;
    // q into an FP8 buffer copies its dims past rotary_dim too: k's lanes; as does q
    // normalized in place.
    let q_lanes = if q_fp8.is_some() || norm.is_some() { k_lanes } else { rot_lanes };
    let lane_counts = [q_lanes, k_lanes, v_lanes].map(|l| l as u64);
    let (k_start, v_start, work, block) = match whole {
        false => {
            let (k, v, work) =
                kv_segments(groups(q_heads as u32, g) as u64, groups(kv_heads as u32, g) as u64, lane_counts);
            (k, v, work, BLOCK_THREADS)
        }
        true => layout_of(width).ok_or(Error::Norm(match v_only {
            true => {
                "the values' norm takes a value head in one block of at most 512 threads, one per 16 bytes: \
                     up to 8 KiB (kv_lora_rank 4096 in f16/bf16)"
            }
            false => WHOLE_TOO_LARGE,
        }))?,
    };
    let Some((geometry, chunk)) = block_geometry(tokens as u32, work, block)? else { return Ok(None) };

    let strides = cl.strides.map(|s| s as u64);
    let (kc, vc, nb, bs) = (cache.k.address(), cache.v.address(), blocks as u32, block_size as u32);
    let cache_view = match args.slots {
        Some((mapping, _)) => CacheView::paged(kc, vc, strides, mapping, nb, bs),
        None => CacheView::contiguous(kc, vc, strides, nb, bs),
    };
    let params = KvParams {
        q: args.q.as_ref().map(|q| heads_view(q, q_fp8.as_ref().map(|o| &o.out))).unwrap_or_default(),
        k: heads_view(&args.k, None),
        v: heads_view(&args.v, None),
        cache: cache_view.with_types(cache.k.dtype, cache.v.dtype),
        scales: match (scales, q_fp8) {
            (Some(s), q) => ScalesView::new(s.k.0, s.v.0, s.per_head).with_q(q.map_or(0, |o| o.scale.0)),
            (None, _) => ScalesView::default(),
        },
        owners: OwnerView::SCAN,
        // The scanning kernels (few tokens) copy the angle table into shared memory while
        // the positions load (see `ComputedView::with_staged`).
        pairs,
        source: staged(source, !claim),
        norm: norm.unwrap_or_default(),
        positions,
        errors,
        tokens: tokens as u32,
        seq: seq as u32,
        rot_lanes: rot_lanes as u32,
        k_lanes: k_lanes as u32,
        v_lanes: v_lanes as u32,
        chunk,
        items_div: FastDiv::new(work as u32),
        seq_div: FastDiv::new(seq as u32),
        lanes_div: lane_counts.map(|l| FastDiv::new(lane_slots(l) as u32)),
        // Below `work`, checked below 2^31 by `flat_geometry`.
        starts: [k_start as u32, v_start as u32],
    };
    let key = KvKey {
        style: spec.style,
        types: params.types(),
        width,
        tables: source.source(),
        mrope: spec.mrope.is_some(),
        norm: norm.is_some(),
        whole,
        deinterleave: spec.deinterleave,
    };
    if key.entry_point().is_none() {
        // Only the caches' types can be without a kernel: the inputs' are the configuration's.
        let caches = [("k cache", cache.k.dtype), ("v cache", cache.v.dtype)];
        let (what, got) = caches.into_iter().find(|&(_, d)| d != spec.dtype).unwrap_or(("k cache", spec.dtype));
        return Err(Error::DType { what, expected: spec.dtype, got });
    }
    Ok(Some(KvPlan { key, params, geometry, claim }))
}

/// FP8 cache rows read back into f32, f16 or bf16 ([`Rope::read_kv`]), for tests, debugging
/// and engines that need part of the cache in 16 bits: row `r` of each output (`[batch, seq,
/// kv_heads, head_dim]`, `r = b * seq + s`) is the row of slot `slots[r]` (`-1`: the output row
/// is left as it is), each code's value times its kv head's scale, an f32 product rounded to
/// the output's type. The caches are read, not written.
#[derive(Debug)]
pub struct KvRead<'r, 'a> {
    cache: &'r KvCache<'a>,
    slots: (u64, usize, Hold<'a>),
    k: Option<&'r mut TensorMut<'a>>,
    v: Option<&'r mut TensorMut<'a>>,
}

impl<'r, 'a> KvRead<'r, 'a> {
    /// A read of `cache`'s rows at `slots` (one i64 per output row; a contiguous cache's slot
    /// of sequence `b`, position `p` is `b * seq_len + p`) into no output yet: add them with
    /// [`KvRead::k`] and [`KvRead::v`].
    pub fn new(cache: &'r KvCache<'a>, slots: impl Operand<'a, Elem = i64>) -> Self {
        KvRead { cache, slots: slots.lend(), k: None, v: None }
    }

    /// The key rows into `out`.
    pub fn k(mut self, out: &'r mut TensorMut<'a>) -> Self {
        self.k = Some(out);
        self
    }

    /// The value rows into `out`, of the key output's type where both are read.
    pub fn v(mut self, out: &'r mut TensorMut<'a>) -> Self {
        self.v = Some(out);
        self
    }

    /// The read as device addresses, for [`Rope::read_kv_raw`].
    pub fn raw(&self) -> RawKvRead {
        RawKvRead {
            cache: self.cache.raw(),
            slots: (self.slots.0, self.slots.1),
            k: self.k.as_ref().map(|t| t.raw),
            v: self.v.as_ref().map(|t| t.raw),
        }
    }

    /// Each buffer's name and hold.
    fn holds(&self) -> [(&'static str, Option<&Hold<'a>>); 7] {
        let scales = self.cache.scales.as_ref();
        [
            ("k cache", Some(&self.cache.k.hold)),
            ("v cache", Some(&self.cache.v.hold)),
            ("k scales", scales.map(|s| &s.k.2)),
            ("v scales", scales.map(|s| &s.v.2)),
            ("slots", Some(&self.slots.2)),
            ("k out", self.k.as_ref().map(|t| &t.hold)),
            ("v out", self.v.as_ref().map(|t| &t.hold)),
        ]
    }
}

/// A read of FP8 cache rows as device addresses ([`KvRead`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawKvRead {
    /// The caches (FP8, with their scales; `paged` is ignored: rows are named by slot).
    pub cache: RawKvCache,
    /// Device address and length of the i64 slots, one per output row.
    pub slots: (u64, usize),
    /// The key rows' output.
    pub k: Option<RawTensor>,
    /// The value rows' output.
    pub v: Option<RawTensor>,
}

/// Checks a read and works out its launch; `None` when there is nothing to read.
fn plan_read(args: &RawKvRead, errors: ErrorSink) -> Result<Option<(ReadKey, ReadParams, Geometry)>> {
    let cache = &args.cache;
    if cache.k.dtype.fp8().is_none() {
        return Err(Error::DType { what: "k cache", expected: DType::E4M3, got: cache.k.dtype });
    }
    if cache.v.dtype != cache.k.dtype {
        return Err(Error::DType { what: "v cache", expected: cache.k.dtype, got: cache.v.dtype });
    }
    let cl = cache_layout(cache, false)?;
    check_view("k cache", &cache.k)?;
    check_view("v cache", &cache.v)?;
    let (blocks, block_size, heads, hd) = (cl.shape[0], cl.shape[1], cl.shape[2], cl.shape[3]);
    let scales = check_scales(cache, true, heads)?.expect("FP8 caches have checked scales");
    let (slots, rows) = args.slots;
    if slots % 8 != 0 {
        return Err(Error::Alignment { what: "slots", address: slots, align: 8 });
    }
    let outs = [("k out", args.k), ("v out", args.v)];
    let mut out_type = None;
    for (what, out) in outs {
        let Some(o) = out else { continue };
        if o.dtype.fp8().is_some() || out_type.is_some_and(|t| t != o.dtype) {
            return Err(Error::DType { what, expected: out_type.unwrap_or(DType::BF16), got: o.dtype });
        }
        out_type = Some(o.dtype);
        let s = o.layout.shape;
        check_axis(what, "heads", heads, s[2])?;
        check_axis(what, "head_dim", hd, s[3])?;
        if s[0] * s[1] != rows {
            return Err(Error::Length { what: "slots", shape: vec![s[0], s[1]], expected: s[0] * s[1], got: rows });
        }
        check_view(what, &o)?;
        check_written(what, &o.layout)?;
    }
    let Some(out_type) = out_type else { return Ok(None) };
    // The outputs share nothing with each other or with what the launch reads.
    let flat = |ptr, len: usize, dtype| RawTensor::new(ptr, len, dtype, Layout::bshd(1, 1, 1, len));
    let read = [
        ("k cache", cache.k),
        ("v cache", cache.v),
        ("k scales", flat(scales.k.0, scales.k.1, DType::F32)),
        ("v scales", flat(scales.v.0, scales.v.1, DType::F32)),
        ("slots", flat(slots, 2 * rows, DType::F32)),
    ];
    for (what, o) in outs {
        let Some(o) = o else { continue };
        for (other, t) in read {
            check_disjoint((what, &o), (other, &t))?;
        }
    }
    if let (Some(k), Some(v)) = (args.k, args.v) {
        // One row index for both: the same batch and seq.
        check_axis("v out", "batch", k.layout.shape[0], v.layout.shape[0])?;
        check_axis("v out", "seq", k.layout.shape[1], v.layout.shape[1])?;
        check_disjoint(("v out", &v), ("k out", &k))?;
    }
    let num_slots = blocks.saturating_mul(block_size);
    check_u32(&[("rows", rows), ("kv heads", heads), ("cache slots (blocks * block_size)", num_slots)])?;
    let work = 2 * (heads * hd) as u64;
    let Some((geometry, chunk)) = flat_geometry(rows as u32, work)? else { return Ok(None) };
    let strides = cl.strides.map(|s| s as u64);
    let view = CacheView::paged(cache.k.address(), cache.v.address(), strides, slots, blocks as u32, block_size as u32);
    let seq = args.k.or(args.v).map_or(1, |o| o.layout.shape[1]);
    // Each output as a view's output (its rows' strides and type).
    let out = |o: Option<RawTensor>| o.map(|o| heads_view(&o, Some(&o))).unwrap_or_default();
    let params = ReadParams {
        cache: view.with_types(cache.k.dtype, cache.v.dtype),
        scales: ScalesView::new(scales.k.0, scales.v.0, scales.per_head),
        k: out(args.k),
        v: out(args.v),
        errors,
        rows: rows as u32,
        chunk,
        items_div: FastDiv::new(work as u32),
        cache_div: FastDiv::new((heads * hd) as u32),
        dim_div: FastDiv::new(hd as u32),
        seq_div: FastDiv::new(seq.max(1) as u32),
    };
    Ok(Some((ReadKey { out: out_type }, params, geometry)))
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
/// let args = RawKvArgs {
///     q: Some(t(1, Layout::bshd(4, 1, 32, 128))),
///     q_fp8: None,
///     k: t(2, new),
///     v: t(3, new),
///     cache: RawKvCache { k: t(4, cache), v: t(5, cache), paged: true, scales: None },
///     positions: RawPositions { kind: PositionKind::IdsI32, ptr: 6 << 30, len: 4 },
///     slots: Some((7 << 30, 4)),
///     norm: None,
/// };
/// assert_eq!(validate_append(&config, &args), Ok(()));
/// let unpaged = RawKvArgs { slots: None, ..args };
/// assert!(matches!(validate_append(&config, &unpaged), Err(Error::SlotMapping(_))));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn validate_append(config: &RopeConfig, args: &RawKvArgs) -> Result<()> {
    config.validate()?;
    let table = detached_source(config.rotary_dim, config.source());
    plan_kv(&KvSpec::of(config), args, table, ErrorSink::default()).map(|_| ())
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
    /// let args = RawKvArgs {
    ///     q: None,
    ///     q_fp8: None,
    ///     k: raw(&k),
    ///     v: raw(&v),
    ///     cache: KvCache::paged(&mut kc, &mut vc, Layout::bshd(4, 8, 1, 64)).raw(),
    ///     positions: RawPositions { kind: PositionKind::IdsI32, ptr: pos.as_device_ptr().as_raw(), len: 2 },
    ///     slots: Some((slots.as_device_ptr().as_raw(), 2)),
    ///     norm: None,
    /// };
    /// // SAFETY: every address is a live allocation of this context of the length given, kept until
    /// // `check_errors` synchronises.
    /// unsafe { rope.append_kv_raw(&args, stream.as_inner())? };
    /// rope.check_errors(&stream)?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub unsafe fn append_kv_raw(&self, args: &RawKvArgs, stream: cuda::CUstream) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.append_kv_spec(KvSpec::of(&self.config), args, stream) }
    }

    /// [`Rope::append_kv_raw`] with `spec` (the configuration's, and MLA's pair order).
    ///
    /// # Safety
    /// As [`Rope::append_kv_raw`].
    pub(crate) unsafe fn append_kv_spec(&self, spec: KvSpec, args: &RawKvArgs, stream: cuda::CUstream) -> Result<()> {
        let Some(plan) = plan_kv(&spec, args, self.table.view(), self.core.records.sink())? else { return Ok(()) };
        self.core.prepare(&plan.buffers(args), self.config.checked)?;
        let checked = self.config.checked.then_some(self.config.max_position);
        // SAFETY: the caller's contract; `prepare` passed.
        unsafe { plan.launch(&self.core, stream, checked) }
    }

    /// Reads rows of FP8 caches back into f32, f16 or bf16 ([`KvRead`]). A slot outside the
    /// cache skips its row and is recorded ([`Rope::check_errors`] reports it).
    ///
    /// ```
    /// # let Ok(_ctx) = cust::quick_init() else { return Ok(()) }; // no GPU: nothing to run
    /// # let kernels = rope_cuda::Kernels::load()?;
    /// # let stream = cust::stream::Stream::new(cust::stream::StreamFlags::NON_BLOCKING, None)?;
    /// use cust::memory::{CopyDestination, DeviceBuffer};
    /// use rope_cuda::{F8E4M3, KvCache, KvRead, KvScales, Layout, Rope, RopeConfig, TensorMut};
    /// let rope = Rope::new(&kernels, RopeConfig::new(64, 32))?;
    /// // An E4M3 cache of 4 pages of 8 slots, 1 kv head; its codes 0x38 (1.0), scales 0.5.
    /// let (mut k, mut v) = (DeviceBuffer::from_slice(&[F8E4M3(0x38); 4 * 8 * 64])?, DeviceBuffer::from_slice(&[F8E4M3(0x38); 4 * 8 * 64])?);
    /// let scale = DeviceBuffer::from_slice(&[0.5f32])?;
    /// let cache = KvCache::paged(&mut k, &mut v, Layout::bshd(4, 8, 1, 64)).scales(KvScales::per_tensor(&scale, &scale));
    /// let slots = DeviceBuffer::from_slice(&[3i64, 17])?;
    /// let mut out = DeviceBuffer::from_slice(&[0.0f32; 2 * 64])?;
    /// let mut rows = TensorMut::new(&mut out, Layout::bshd(1, 2, 1, 64));
    /// rope.read_kv(KvRead::new(&cache, &slots).k(&mut rows), &stream)?;
    /// rope.check_errors(&stream)?;
    /// let mut host = [0.0f32; 128];
    /// out.copy_to(&mut host[..])?;
    /// assert!(host.iter().all(|&x| x == 0.5));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn read_kv(&self, read: KvRead<'_, '_>, stream: &impl Queue) -> Result<()> {
        let stream = stream.raw(self.kernels())?;
        // SAFETY: as in `Rope::apply`, for every buffer of the read.
        on_stream(read.holds(), stream, || unsafe { self.read_kv_raw(&read.raw(), stream) })
    }

    /// [`Rope::read_kv`] on device addresses and a raw stream; an `Err` means nothing was
    /// launched.
    ///
    /// # Safety
    /// As [`Rope::append_kv_raw`], for every address of the read.
    pub unsafe fn read_kv_raw(&self, args: &RawKvRead, stream: cuda::CUstream) -> Result<()> {
        let Some((key, params, geometry)) = plan_read(args, self.core.records.sink())? else { return Ok(()) };
        let c = args.cache;
        let buffers = [
            ("k cache", c.k.ptr),
            ("v cache", c.v.ptr),
            ("k scales", c.scales.map_or(0, |s| s.k.0)),
            ("v scales", c.scales.map_or(0, |s| s.v.0)),
            ("slots", args.slots.0),
            ("k out", args.k.map_or(0, |t| t.ptr)),
            ("v out", args.v.map_or(0, |t| t.ptr)),
        ];
        self.core.prepare(&buffers, self.config.checked)?;
        let checked = self.config.checked.then_some(self.config.max_position);
        // SAFETY: the caller's contract; `plan_read` checked the caches, scales and outputs
        // against their buffers, the slots' length and alignment, and the outputs' overlaps;
        // `prepare` passed.
        unsafe { self.core.launch(key, geometry, 0, &params, stream, checked) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::PositionKind;
    use rope_cuda_kernels::keys::KvTypes;
    use rope_cuda_kernels::views::CacheKind;

    /// [`super::plan_kv`] without tables or records, as [`validate_append`] plans.
    fn plan_kv(spec: &KvSpec, args: &RawKvArgs) -> Result<Option<KvPlan>> {
        super::plan_kv(spec, args, detached_source(spec.rotary_dim, spec.tables), ErrorSink::default())
    }

    const BASE: u64 = 1 << 28;

    fn tensor(i: u64, layout: Layout) -> RawTensor {
        RawTensor::new(i * BASE, layout.extent().unwrap(), DType::BF16, layout)
    }

    fn spec() -> KvSpec {
        KvSpec::of(&RopeConfig::new(128, 4096).dtype(DType::BF16))
    }

    /// 2 sequences x 3 tokens, 8 q heads, 2 kv heads, a paged cache of 10 blocks of 16.
    fn args() -> RawKvArgs {
        RawKvArgs {
            q: Some(tensor(1, Layout::bshd(2, 3, 8, 128))),
            q_fp8: None,
            k: tensor(2, Layout::bshd(2, 3, 2, 128)),
            v: tensor(3, Layout::bshd(2, 3, 2, 128)),
            cache: RawKvCache {
                k: tensor(4, Layout::bshd(10, 16, 2, 128)),
                v: tensor(5, Layout::bshd(10, 16, 2, 128)),
                paged: true,
                scales: None,
            },
            positions: RawPositions { kind: PositionKind::IdsI32, ptr: 6 * BASE, len: 6 },
            slots: Some((7 * BASE, 6)),
            norm: None,
        }
    }

    fn err(a: &RawKvArgs) -> Error {
        plan_kv(&spec(), a).expect_err("expected an error")
    }

    /// A whole-projection norm: the one-head `_w` kernels, blocks that start at a token's q
    /// and k segments, the decode kernel while its blocks fit and the claimed `_p` past that,
    /// with the items the layout gives.
    #[test]
    fn plans_whole_projection_norms() {
        use crate::norm::NormKind;
        use crate::RawWeight;
        let weights = |q: usize, k: usize| RawNorm {
            kind: NormKind::RmsProjection,
            eps: 1e-6,
            q_weight: Some(RawWeight { ptr: 8 * BASE, len: q * 128, dtype: DType::BF16 }),
            k_weight: Some(RawWeight { ptr: 9 * BASE, len: k * 128, dtype: DType::BF16 }),
        };
        // 8/2 heads of 128 in bf16, decode: 16 lanes a head, one block of a token (a q
        // segment of 128, k's from 128, v's from 160; 224 items, blocks of 224 threads).
        let a = RawKvArgs { norm: Some(weights(8, 2)), ..args() };
        let p = plan_kv(&spec(), &a).unwrap().unwrap();
        assert_eq!((p.key.width, p.key.norm, p.key.whole, p.claim), (KvWidth::Decode, true, true, false));
        assert_eq!((p.params.starts, p.params.items_div.divisor, p.geometry.block.0), ([128, 160], 224, 224));
        assert!(p.key.entry_point().is_some());
        // 31/8 heads: the decode kernel's 496 q lanes and k's 128 take blocks of 512, k's moved
        // to the second block; two blocks a token.
        let mut a = args();
        a.q = Some(tensor(1, Layout::bshd(2, 3, 31, 128)));
        (a.k, a.v) = (tensor(2, Layout::bshd(2, 3, 8, 128)), tensor(3, Layout::bshd(2, 3, 8, 128)));
        a.cache.k = tensor(4, Layout::bshd(10, 16, 8, 128));
        a.cache.v = tensor(5, Layout::bshd(10, 16, 8, 128));
        a.norm = Some(weights(31, 8));
        let p = plan_kv(&spec(), &a).unwrap().unwrap();
        assert_eq!((p.key.width, p.params.starts, p.params.items_div.divisor), (KvWidth::Decode, [512, 640], 1024));
        assert_eq!(p.geometry.block.0, 512);
        assert_eq!(p.geometry.grid.0 as usize, 6 * 2);
        // 40 q heads: past the decode kernel's block, the claimed one-head kernel's 8 lanes.
        a.q = Some(tensor(1, Layout::bshd(2, 3, 40, 128)));
        a.norm = Some(weights(40, 8));
        let p = plan_kv(&spec(), &a).unwrap().unwrap();
        assert_eq!((p.key.width, p.key.whole, p.claim), (KvWidth::Prefill, true, true));
        assert!(p.geometry.block.0 as u64 <= crate::norm::WHOLE_BLOCK_MAX);
        // Every type and style, decode and past the scan (claimed), into its own caches and
        // into FP8 ones: a `_w` kernel.
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            for style in [RopeStyle::NeoX, RopeStyle::GptJ] {
                for (seq, fp8) in [(3, false), (300, false), (3, true)] {
                    let s = KvSpec { style, dtype, ..spec() };
                    let typed = |t: RawTensor, dtype| RawTensor { dtype, ..t };
                    let mut a = RawKvArgs { norm: Some(weights(8, 2)), ..args() };
                    let new = |i, h| typed(tensor(i, Layout::bshd(2, seq, h, 128)), dtype);
                    (a.q, a.k, a.v) = (Some(new(1, 8)), new(2, 2), new(3, 2));
                    a.positions.len = 2 * seq;
                    a.slots = Some((7 * BASE, 2 * seq));
                    let cache_type = if fp8 { DType::E4M3 } else { dtype };
                    (a.cache.k, a.cache.v) = (typed(a.cache.k, cache_type), typed(a.cache.v, cache_type));
                    if fp8 {
                        a.cache.scales = Some(RawScales { k: (10 * BASE, 2), v: (11 * BASE, 2), per_head: true });
                    }
                    let retyped = |w: Option<RawWeight>| w.map(|w| RawWeight { dtype, ..w });
                    let n = weights(8, 2);
                    a.norm = Some(RawNorm { q_weight: retyped(n.q_weight), k_weight: retyped(n.k_weight), ..n });
                    let p = plan_kv(&s, &a).unwrap().unwrap();
                    let what = format!("{dtype:?} {style:?} {seq} {fp8}");
                    assert!(p.key.whole && p.key.entry_point().is_some(), "{what}: {:?}", p.key);
                    assert_eq!(p.claim, seq > KV_SCAN_MAX_TOKENS, "{what}");
                }
            }
        }
        // The per-head norm keeps the `_n` kernels.
        let per_head = RawNorm { kind: NormKind::Rms, ..weights(1, 1) };
        let p = plan_kv(&spec(), &RawKvArgs { norm: Some(per_head), ..args() }).unwrap().unwrap();
        assert_eq!((p.key.norm, p.key.whole, p.geometry.block.0), (true, false, BLOCK_THREADS));
    }

    #[test]
    fn plans_lanes_items_and_widths() {
        let p = plan_kv(&spec(), &args()).unwrap().unwrap();
        assert_eq!(p.key.width, KvWidth::Decode);
        // 8-byte lanes (4 bf16) for the decode width.
        assert_eq!((p.params.rot_lanes, p.params.k_lanes, p.params.v_lanes), (16, 16, 32));
        let c = p.params.cache;
        assert_eq!((c.block_size(), c.num_slots(), p.params.positions.limit()), (16, 160, 4096));
        assert_eq!((c.kind(), c.mapping(), c.row(17, 1)), (CacheKind::Paged, 7 * BASE, 16 * 2 * 128 + 2 * 128 + 128));
        assert!(!p.claim);
        // Contiguous [B, H, S, D]: rows come from positions, capped by the cache length.
        let mut a = args();
        a.cache.k = tensor(4, Layout::bhsd(2, 2, 100, 128));
        a.cache.v = tensor(5, Layout::bhsd(2, 2, 100, 128));
        a.cache.paged = false;
        a.slots = None;
        let p = plan_kv(&spec(), &a).unwrap().unwrap();
        let c = p.params.cache;
        assert_eq!(
            (c.block_size(), p.params.positions.limit(), c.mapping(), c.kind()),
            (100, 100, 0, CacheKind::Contiguous)
        );
        assert_eq!(c.row(100 + 3, 1), 2 * 100 * 128 + 3 * 128 + 100 * 128);
        // Partial rotary, odd alignment: scalar lanes, copy lanes past rotary_dim.
        let s = KvSpec { rotary_dim: 64, ..spec() };
        let mut a = args();
        a.k.ptr += 2;
        let p = plan_kv(&s, &a).unwrap().unwrap();
        assert_eq!(p.key.width, KvWidth::Scalar);
        assert_eq!((p.params.rot_lanes, p.params.k_lanes, p.params.v_lanes), (32, 32 + 64, 128));
    }

    /// The plan of every launch (decode and claimed sizes, paged and contiguous) allocates
    /// nothing: the launch path is safe inside stream capture and adds no allocator time.
    #[test]
    fn planning_allocates_nothing() {
        let mut contiguous = args();
        contiguous.cache.k = tensor(4, Layout::bshd(2, 100, 2, 128));
        contiguous.cache.v = tensor(5, Layout::bshd(2, 100, 2, 128));
        contiguous.cache.paged = false;
        contiguous.slots = None;
        let mut large = args();
        large.q = Some(tensor(1, Layout::bshd(2, 300, 8, 128)));
        large.k = tensor(2, Layout::bshd(2, 300, 2, 128));
        large.v = tensor(3, Layout::bshd(2, 300, 2, 128));
        large.cache.k = tensor(4, Layout::bshd(100, 16, 2, 128));
        large.cache.v = tensor(5, Layout::bshd(100, 16, 2, 128));
        large.positions.len = 600;
        large.slots = Some((7 * BASE, 600));
        for a in [args(), contiguous, large] {
            let (plan, allocations) = crate::alloc_count::count(|| plan_kv(&spec(), &a));
            assert!(plan.unwrap().is_some());
            assert_eq!(allocations, 0, "{a:?}");
        }
    }

    #[test]
    fn each_bad_input_has_its_own_error() {
        let a = args();
        // Each operand's type: q, k and v the configuration's; the caches one a kernel writes
        // from it (so far only the inputs' own).
        let f16 = |t: RawTensor| RawTensor { dtype: DType::F16, ..t };
        for (name, bad) in [
            ("q", RawKvArgs { q: a.q.map(f16), ..a }),
            ("k", RawKvArgs { k: f16(a.k), ..a }),
            ("v", RawKvArgs { v: f16(a.v), ..a }),
            ("k cache", RawKvArgs { cache: RawKvCache { k: f16(a.cache.k), ..a.cache }, ..a }),
            ("v cache", RawKvArgs { cache: RawKvCache { v: f16(a.cache.v), ..a.cache }, ..a }),
        ] {
            let e = err(&bad);
            assert!(
                matches!(e, Error::DType { what, expected: DType::BF16, got: DType::F16 } if what == name),
                "{e:?}"
            );
        }
        assert_eq!(plan_kv(&spec(), &a).unwrap().unwrap().key.types, KvTypes::uniform(DType::BF16));
        let mut b = a;
        b.k.layout = Layout::bshd(2, 3, 2, 64);
        assert!(matches!(err(&b), Error::Shape { what: "k", axis: "head_dim", .. }));
        let mut b = a;
        b.v.layout = Layout::bshd(2, 3, 3, 128);
        assert!(matches!(err(&b), Error::Shape { what: "v", axis: "heads", .. }));
        let mut b = a;
        b.q = Some(tensor(1, Layout::bshd(1, 3, 8, 128)));
        assert!(matches!(err(&b), Error::Shape { what: "q", axis: "batch", .. }));
        let mut b = a;
        b.cache.k.layout = Layout::bshd(10, 16, 4, 128);
        b.cache.v.layout = b.cache.k.layout;
        assert!(matches!(err(&b), Error::Shape { what: "cache", axis: "heads", .. }));
        let mut b = a;
        b.cache.v.layout = Layout::bhsd(10, 2, 16, 128);
        assert!(matches!(err(&b), Error::Shape { what: "v cache", .. }));
        let mut b = a;
        b.cache.k.len -= 1;
        assert!(matches!(err(&b), Error::OutOfBounds { what: "k cache", .. }));
        let mut b = a;
        b.cache.v.ptr += 1;
        assert!(matches!(err(&b), Error::Alignment { what: "v cache", .. }));
        let mut b = a;
        b.slots = None;
        assert!(matches!(err(&b), Error::SlotMapping(_)));
        let mut b = a;
        b.slots = Some((7 * BASE, 5));
        assert!(matches!(err(&b), Error::Length { what: "slots", expected: 6, got: 5, .. }));
        let mut b = a;
        b.slots = Some((7 * BASE + 4, 6));
        assert!(matches!(err(&b), Error::Alignment { what: "slots", .. }));
        let mut b = a;
        b.cache.paged = false;
        assert!(matches!(err(&b), Error::SlotMapping(_)));
        let mut b = a;
        (b.cache.paged, b.slots) = (false, None);
        assert!(matches!(err(&b), Error::Shape { what: "cache", axis: "batch", expected: 2, got: 10 }));
        let mut b = a;
        b.positions.len = 5;
        assert!(matches!(err(&b), Error::Length { what: "positions", .. }));
        // The key cache overlapping the values it reads, or q overlapping the new keys.
        let mut b = a;
        b.cache.k.ptr = b.v.ptr;
        assert!(matches!(err(&b), Error::Aliasing { a: "k cache", b: "v" }));
        let mut b = a;
        b.k.ptr = b.q.unwrap().ptr;
        assert!(matches!(err(&b), Error::Aliasing { a: "q", b: "k" }));
        let mut b = a;
        b.cache.v.ptr = b.cache.k.ptr;
        assert!(matches!(err(&b), Error::Aliasing { a: "k cache", b: "v cache" }));
        // A cache layout whose rows overlap.
        let mut b = a;
        let l = Layout::strided([10, 16, 2, 128], [16 * 128, 128, 128], 0);
        (b.cache.k.layout, b.cache.v.layout) = (l, l);
        assert!(matches!(err(&b), Error::Overlap { what: "cache", .. }));
        // More slots than the kernel's 32-bit slot arithmetic takes.
        let mut b = a;
        let l = Layout::strided([1 << 20, 1 << 13, 2, 128], [0, 0, 128], 0);
        (b.cache.k.layout, b.cache.v.layout) = (l, l);
        assert!(matches!(plan_kv(&spec(), &b), Err(Error::TooLarge { .. }) | Err(Error::Overlap { .. })));
    }

    #[test]
    fn large_calls_claim_and_share_table_loads() {
        let call = |n: usize| {
            let mut a = args();
            a.q = Some(tensor(1, Layout::bshd(1, n, 8, 128)));
            a.k = tensor(2, Layout::bshd(1, n, 2, 128));
            a.v = tensor(3, Layout::bshd(1, n, 2, 128));
            a.positions.len = n;
            a.slots = Some((7 * BASE, n));
            plan_kv(&spec(), &a).unwrap().unwrap()
        };
        let p = call(KV_SCAN_MAX_TOKENS);
        assert!(!p.claim);
        let p = call(KV_SCAN_MAX_TOKENS + 1);
        assert!(p.claim);
        assert_eq!(p.key.width, KvWidth::Prefill);
        let p = call(KV_PREFILL_MAX_TOKENS + 1);
        assert!(p.claim);
        assert_eq!(p.key.width, KvWidth::Vector);
    }

    /// The KV mapping's segments: the q, k and v groups in order, each group's slots inside
    /// one warp (whole warps past 32 lanes) wherever the token starts, every item once.
    #[test]
    fn kv_segments_keep_each_group_in_one_warp() {
        for gq in [0u64, 1, 3, 4, 32] {
            for gk in [1u64, 2, 5, 8] {
                for lanes in [[8u64, 8, 8], [4, 12, 16], [5, 6, 10], [1, 1, 2], [3, 40, 64], [16, 16, 32]] {
                    let (k_start, v_start, items) = kv_segments(gq, gk, lanes);
                    let slots = lanes.map(lane_slots);
                    assert!(gq * slots[0] <= k_start && k_start + gk * slots[1] <= v_start);
                    assert!(v_start + gk * slots[2] <= items);
                    for (start, n, i) in [(0, gq, 0), (k_start, gk, 1), (v_start, gk, 2)] {
                        for token in 0..5 {
                            for group in 0..n {
                                let first = token * items + start + group * slots[i];
                                let last = first + lanes[i] - 1;
                                if slots[i] <= 32 {
                                    assert_eq!(first / 32, last / 32, "{gq} {gk} {lanes:?}: segment {i}");
                                } else {
                                    assert_eq!(first % 32, 0, "{gq} {gk} {lanes:?}: segment {i}");
                                }
                            }
                        }
                    }
                }
            }
        }
        // Lanes already powers of two, segments already aligned: nothing added (the decode
        // step's 32/8 heads of 8 lanes).
        assert_eq!(kv_segments(32, 8, [8, 8, 8]), (256, 320, 384));
    }

    /// Every key the planners can make names an entry point of the kernel list: RoPE at every
    /// style, dtype and width; KV with the library's tables at every width; the caller's
    /// tables (the reference operation: GPT-J, 16-bit) at every width `plan_kv` picks for them.
    #[test]
    fn every_planned_key_has_an_entry_point() {
        use rope_cuda_kernels::entries::Key;
        use rope_cuda_kernels::keys::{RopeKey, RopeTypes, RopeWidth};
        for style in [RopeStyle::NeoX, RopeStyle::GptJ] {
            for dtype in [DType::F32, DType::F16, DType::BF16] {
                // Both of the library's sources, with and without MRoPE, at every width.
                for source in [TableSource::Table, TableSource::Computed] {
                    for mrope in [false, true] {
                        for width in [RopeWidth::Scalar, RopeWidth::Vector, RopeWidth::Single] {
                            let key = RopeKey {
                                style,
                                types: RopeTypes::uniform(dtype),
                                width,
                                mrope,
                                source,
                                norm: false,
                                whole: false,
                            };
                            assert!(key.entry_point().is_some(), "{key:?}");
                            // QK-norm: the 16-byte widths, every type.
                            let normed = RopeKey { norm: true, ..key };
                            assert_eq!(normed.entry_point().is_some(), width != RopeWidth::Scalar, "{normed:?}");
                            // A whole-projection norm: one head a thread, 16 bytes.
                            let whole = RopeKey { whole: true, ..normed };
                            assert_eq!(whole.entry_point().is_some(), width == RopeWidth::Single, "{whole:?}");
                        }
                        for width in [KvWidth::Scalar, KvWidth::Vector, KvWidth::Decode, KvWidth::Prefill] {
                            let key = KvKey {
                                style,
                                types: KvTypes::uniform(dtype),
                                width,
                                tables: source,
                                mrope,
                                norm: false,
                                whole: false,
                                deinterleave: false,
                            };
                            assert!(key.entry_point().is_some(), "{key:?}");
                            // De-interleaved GPT-J pairs: the 8- and 16-byte widths, one
                            // position row, the library's sources, no norm.
                            let d = KvKey { deinterleave: true, ..key };
                            let has = style == RopeStyle::GptJ && width != KvWidth::Scalar && !mrope;
                            assert_eq!(d.entry_point().is_some(), has, "{d:?}");
                            // QK-norm: the 8- and 16-byte widths, every type.
                            let normed = KvKey { norm: true, ..key };
                            let has = width != KvWidth::Scalar;
                            assert_eq!(normed.entry_point().is_some(), has, "{normed:?}");
                            // A whole-projection norm: one head a thread (8 or 16 bytes).
                            let whole = KvKey { whole: true, ..normed };
                            let has = matches!(width, KvWidth::Decode | KvWidth::Prefill);
                            assert_eq!(whole.entry_point().is_some(), has, "{whole:?}");
                            // FP8 caches of either format: one entry point for both, at every
                            // width.
                            let [e4, e5] = [DType::E4M3, DType::E5M2].map(|f| {
                                let types = KvTypes { cache_k: f, cache_v: f, ..KvTypes::uniform(dtype) };
                                KvKey { types, ..key }.entry_point()
                            });
                            assert_eq!(e4, e5, "{key:?}");
                            assert!(e4.is_some(), "{key:?}");
                        }
                    }
                }
            }
        }
        let spec = KvSpec { style: RopeStyle::GptJ, tables: TableSource::Caller, ..spec() };
        for (n, want) in [(4, KvWidth::Decode), (300, KvWidth::Vector), (9000, KvWidth::Vector)] {
            let mut a = args();
            a.q = None;
            a.k = tensor(2, Layout::bshd(1, n, 2, 128));
            a.v = tensor(3, Layout::bshd(1, n, 2, 128));
            a.positions.len = n;
            a.slots = Some((7 * BASE, n));
            let p = plan_kv(&spec, &a).unwrap().unwrap();
            assert_eq!(p.key.width, want);
            assert!(p.key.entry_point().is_some(), "{:?}", p.key);
            a.k.ptr += 2; // element by element
            let p = plan_kv(&spec, &a).unwrap().unwrap();
            assert!(p.key.entry_point().is_some(), "{:?}", p.key);
        }
        for dtype in [DType::F16, DType::BF16] {
            for width in [KvWidth::Scalar, KvWidth::Vector, KvWidth::Decode] {
                let types = KvTypes::uniform(dtype);
                let key = KvKey {
                    style: RopeStyle::GptJ,
                    types,
                    width,
                    tables: TableSource::Caller,
                    mrope: false,
                    norm: false,
                    whole: false,
                    deinterleave: false,
                };
                assert!(key.entry_point().is_some(), "{key:?}");
            }
        }
    }

    /// [`args`] with E4M3 caches and per-head scales (and, `q_fp8`, q into an FP8 buffer).
    fn fp8_args(q_fp8: bool) -> RawKvArgs {
        let mut a = args();
        let cache = |i| RawTensor { dtype: DType::E4M3, ..tensor(i, Layout::bshd(10, 16, 2, 128)) };
        a.cache.k = cache(4);
        a.cache.v = cache(5);
        a.cache.scales = Some(RawScales { k: (8 * BASE, 2), v: (9 * BASE, 2), per_head: true });
        if q_fp8 {
            let out = RawTensor { dtype: DType::E4M3, ..tensor(10, Layout::bshd(2, 3, 8, 128)) };
            a.q_fp8 = Some(RawQFp8 { out, scale: (11 * BASE, 1) });
        }
        a
    }

    #[test]
    fn fp8_caches_plan_with_their_scales() {
        for q_fp8 in [false, true] {
            let a = fp8_args(q_fp8);
            let p = plan_kv(&spec(), &a).unwrap().unwrap();
            assert_eq!((p.key.types.cache_k, p.key.types.cache_v), (DType::E4M3, DType::E4M3));
            assert!(p.key.entry_point().is_some_and(|e| e.name().contains("_bf16_fp8_")), "{:?}", p.key);
            assert_eq!(p.params.scales.head(false, 1), (8 * BASE + 4, 1));
            assert_eq!(p.params.scales.head(true, 0), (9 * BASE, 1));
            assert_eq!(p.params.scales.q(), if q_fp8 { 11 * BASE } else { 0 });
            assert_eq!(
                (p.params.q.output, p.params.q.out_type),
                match q_fp8 {
                    true => (10 * BASE, DType::E4M3),
                    false => (0, DType::BF16),
                }
            );
            // The same decode width as 16-bit caches: the FP8 rows are 8-byte aligned.
            assert_eq!(p.key.width, KvWidth::Decode);
        }
        // One scale for all heads.
        let mut a = fp8_args(false);
        a.cache.scales = Some(RawScales { k: (8 * BASE, 1), v: (9 * BASE, 1), per_head: false });
        assert_eq!(plan_kv(&spec(), &a).unwrap().unwrap().params.scales.head(false, 1), (8 * BASE, 0));
    }

    #[test]
    fn fp8_misuse_has_its_own_error() {
        let scales = |k: (u64, usize), v: (u64, usize), per_head| Some(RawScales { k, v, per_head });
        type Case = (&'static str, RawKvArgs, fn(&Error) -> bool);
        let cases: Vec<Case> = vec![
            (
                "no scales",
                RawKvArgs { cache: RawKvCache { scales: None, ..fp8_args(false).cache }, ..fp8_args(false) },
                |e| matches!(e, Error::Scales(_)),
            ),
            (
                "scales on a bf16 cache",
                RawKvArgs { cache: RawKvCache { scales: fp8_args(false).cache.scales, ..args().cache }, ..args() },
                |e| matches!(e, Error::Scales(_)),
            ),
            (
                "k scales per head, one",
                RawKvArgs {
                    cache: RawKvCache { scales: scales((8 * BASE, 1), (9 * BASE, 2), true), ..fp8_args(false).cache },
                    ..fp8_args(false)
                },
                |e| matches!(e, Error::Length { what: "k scales", expected: 2, got: 1, .. }),
            ),
            (
                "v scales per tensor, two",
                RawKvArgs {
                    cache: RawKvCache { scales: scales((8 * BASE, 1), (9 * BASE, 2), false), ..fp8_args(false).cache },
                    ..fp8_args(false)
                },
                |e| matches!(e, Error::Length { what: "v scales", expected: 1, got: 2, .. }),
            ),
            (
                "misaligned scales",
                RawKvArgs {
                    cache: RawKvCache {
                        scales: scales((8 * BASE + 2, 2), (9 * BASE, 2), true),
                        ..fp8_args(false).cache
                    },
                    ..fp8_args(false)
                },
                |e| matches!(e, Error::Alignment { what: "k scales", .. }),
            ),
            (
                "scales inside the cache",
                RawKvArgs {
                    cache: RawKvCache {
                        scales: scales((4 * BASE + 64, 2), (9 * BASE, 2), true),
                        ..fp8_args(false).cache
                    },
                    ..fp8_args(false)
                },
                |e| matches!(e, Error::Aliasing { .. }),
            ),
            (
                "mixed formats",
                RawKvArgs {
                    cache: RawKvCache {
                        v: RawTensor { dtype: DType::E5M2, ..fp8_args(false).cache.v },
                        ..fp8_args(false).cache
                    },
                    ..fp8_args(false)
                },
                |e| matches!(e, Error::DType { what: "v cache", expected: DType::E4M3, got: DType::E5M2 }),
            ),
            ("q out without FP8 caches", RawKvArgs { q_fp8: fp8_args(true).q_fp8, ..args() }, |e| {
                matches!(e, Error::Scales(_))
            }),
            ("q out without q", RawKvArgs { q: None, ..fp8_args(true) }, |e| matches!(e, Error::Scales(_))),
            (
                "q out of the other format",
                {
                    let mut a = fp8_args(true);
                    a.q_fp8.as_mut().unwrap().out.dtype = DType::E5M2;
                    a
                },
                |e| matches!(e, Error::DType { what: "q out", expected: DType::E4M3, got: DType::E5M2 }),
            ),
            (
                "q out of the wrong shape",
                {
                    let mut a = fp8_args(true);
                    a.q_fp8.as_mut().unwrap().out.layout = Layout::bshd(2, 3, 4, 128);
                    a
                },
                |e| matches!(e, Error::Shape { what: "q out", axis: "heads", .. }),
            ),
            (
                "q scale of two",
                {
                    let mut a = fp8_args(true);
                    a.q_fp8.as_mut().unwrap().scale.1 = 2;
                    a
                },
                |e| matches!(e, Error::Length { what: "q scale", .. }),
            ),
            (
                "q out over the key cache",
                {
                    let mut a = fp8_args(true);
                    a.q_fp8.as_mut().unwrap().out.ptr = 4 * BASE;
                    a
                },
                |e| matches!(e, Error::Aliasing { .. }),
            ),
        ];
        for (what, a, want) in cases {
            let e = err(&a);
            assert!(want(&e), "{what}: {e:?}");
        }
        // FP8 is never the inputs' type.
        let config = RopeConfig::new(128, 4096).dtype(DType::E4M3);
        assert!(matches!(config.validate(), Err(Error::DType { got: DType::E4M3, .. })));
    }

    #[test]
    fn reads_check_their_outputs() {
        let a = fp8_args(false);
        let out = |i, b, s| RawTensor { dtype: DType::F32, ..tensor(i, Layout::bshd(b, s, 2, 128)) };
        let read = RawKvRead { cache: a.cache, slots: (12 * BASE, 6), k: Some(out(13, 2, 3)), v: Some(out(14, 2, 3)) };
        let (key, p, _) = plan_read(&read, ErrorSink::default()).unwrap().unwrap();
        assert_eq!((key.out, p.rows, p.seq_div.divisor), (DType::F32, 6, 3));
        // Outputs of one row count but other shapes, of two types, or too few rows: refused.
        let e = plan_read(&RawKvRead { v: Some(out(14, 1, 6)), ..read }, ErrorSink::default());
        assert!(matches!(e, Err(Error::Shape { what: "v out", axis: "batch", .. })), "{e:?}");
        let bf = RawTensor { dtype: DType::BF16, ..out(14, 2, 3) };
        let e = plan_read(&RawKvRead { v: Some(bf), ..read }, ErrorSink::default());
        assert!(matches!(e, Err(Error::DType { what: "v out", .. })), "{e:?}");
        let e = plan_read(&RawKvRead { slots: (12 * BASE, 5), ..read }, ErrorSink::default());
        assert!(matches!(e, Err(Error::Length { what: "slots", .. })), "{e:?}");
        let e = plan_read(&RawKvRead { cache: args().cache, ..read }, ErrorSink::default());
        assert!(matches!(e, Err(Error::DType { what: "k cache", .. })), "{e:?}");
        // Nothing to read: no launch.
        assert!(plan_read(&RawKvRead { k: None, v: None, ..read }, ErrorSink::default()).unwrap().is_none());
    }

    /// The GPU-free check of the append is the launch's own: it accepts what the launch
    /// plans and returns the same typed errors, the configuration's included.
    #[test]
    fn validate_append_runs_the_launch_checks() {
        let config = RopeConfig::new(128, 4096).dtype(DType::BF16);
        assert_eq!(validate_append(&config, &args()), Ok(()));
        let mut bad = args();
        bad.slots = Some((7 * BASE, 5));
        assert_eq!(validate_append(&config, &bad), plan_kv(&spec(), &bad).map(|_| ()));
        assert!(matches!(validate_append(&config, &bad), Err(Error::Length { what: "slots", .. })));
        let mut bad = args();
        bad.cache.v.ptr = bad.cache.k.ptr;
        assert!(matches!(validate_append(&config, &bad), Err(Error::Aliasing { a: "k cache", b: "v cache" })));
        assert!(matches!(validate_append(&config.clone().rotary_dim(3), &args()), Err(Error::RotaryDim { .. })));
    }
}
