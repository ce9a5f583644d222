//! The append's planner, as a pipeline: the operand checks every append shares, then each
//! feature's stage (FP8 in [`super::scales`], the norm, MRoPE's rows, de-interleaved pairs),
//! then one choice of width from the constraints they give, the key checked against the
//! support table, and the geometry.

use cust::sys as cuda;
use rope_cuda_kernels::keys::{KvKey, KvTypes, KvWidth, TableSource};
use rope_cuda_kernels::norm::NormView;
use rope_cuda_kernels::params::{groups, kv_heads_per_thread, kv_segments, lane_slots, FastDiv, KvParams};
use rope_cuda_kernels::tuning::{BLOCK_THREADS, KV_PREFILL_MAX_TOKENS};
use rope_cuda_kernels::views::{CacheView, ErrorSink, OwnerView, Pairs, PositionsView, ScalesView, SourceView};

use crate::config::{DType, Mrope, RopeConfig, RopeStyle};
use crate::error::{Error, Result};
use crate::kernels::Geometry;
use crate::launch::{
    block_geometry, check_axis, check_disjoint, check_supported, check_u32, check_view, check_written, heads_view,
    lanes, pairs, positions, staged, vector_fits, Core,
};
use crate::layout::Layout;
use crate::norm::{
    check_head_lanes, norm_view, value_norm_view, whole_kv_layout, whole_v_layout, RawWeight, WHOLE_TOO_LARGE,
};

use super::call::{KvCall, KvOperand};
use super::scales::{fp8_stage, scale_tensor, Fp8Stage};
use super::{RawKvArgs, RawKvCache, KV_SCAN_MAX_TOKENS};

// The reference operation launches GPT-J kernels at the width `plan_kv` chose; its `_v_t`
// kernels serve both claimed widths, so they must take one head per thread like `_p`.
const _: () = assert!(kv_heads_per_thread(true, true, 2, false) == 1 && kv_heads_per_thread(true, true, 4, false) == 1);

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
pub(super) fn cache_layout(cache: &RawKvCache, v_head_dim: bool, n: fn(KvOperand) -> &'static str) -> Result<Layout> {
    let (cl, vl) = (cache.k.layout, cache.v.layout);
    let same = match v_head_dim {
        true => vl.shape[..3] == cl.shape[..3] && vl.strides == cl.strides,
        false => vl.shape == cl.shape && vl.strides == cl.strides,
    };
    if !same {
        return Err(Error::Shape {
            what: n(KvOperand::VCache),
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

/// Checks `args` against `spec` and works out the launch with cos and sin from `source` (of
/// `spec.tables`) and `errors`; `None` when there is no work.
pub(crate) fn plan_kv(
    spec: &KvSpec,
    call: &KvCall,
    args: &RawKvArgs,
    source: SourceView,
    errors: ErrorSink,
) -> Result<Option<KvPlan>> {
    debug_assert_eq!(source.source(), spec.tables);
    // The operands every append checks, then each feature's stage.
    let ops = operands(spec, call, args)?;
    let norm = norm_stage(spec, call, args, &ops)?;
    let cl = cache_stage(spec, call, &args.cache, &ops)?;
    let fp8 = fp8_stage(call, args, ops.kv_heads)?;
    check_apart(call, args, &fp8)?;
    let (positions, pairs) = rows_stage(spec, call, args, &ops, cl)?;
    if ops.tokens == 0 || ops.kv_heads == 0 {
        return Ok(None);
    }
    deinterleave_stage(spec, call, args)?;
    // One width from the features' constraints; the key it makes, against the support table.
    let (shape, width, claim) = choose_width(spec, call, args, &ops, &fp8, norm.as_ref());
    let (cache_k, cache_v) = (args.cache.k.dtype, args.cache.v.dtype);
    let key = KvKey {
        style: spec.style,
        types: KvTypes { q: spec.dtype, k: spec.dtype, v: spec.dtype, cache_k, cache_v },
        width,
        tables: spec.tables,
        mrope: spec.mrope.is_some(),
        norm: norm.is_some(),
        whole: norm.is_some_and(|n| n.whole()),
        deinterleave: call.deinterleave,
    };
    check_key(spec, call, &key)?;
    // The limits of the chosen width's geometry.
    let (rot_lanes, cw, k_lanes) = shape.lanes(width);
    if norm.is_some() && !shape.v_only {
        // Counted at 16 bytes a lane, as RoPE counts them: the decode kernels' 8-byte lanes are
        // chosen only where they fit too.
        check_head_lanes(shape.lanes(KvWidth::Prefill).2)?;
    }
    if call.deinterleave && args.q.is_some() && fp8.q_fp8.is_none() && lane_slots(rot_lanes as u64) > 32 {
        // In place, a head's lanes meet inside one warp between their loads and their stores.
        return Err(Error::Deinterleave("q in place with a head above 32 lanes"));
    }
    let g = match width {
        KvWidth::Vector => kv_heads_per_thread(true, spec.style == RopeStyle::GptJ, shape.size, key.norm && !key.whole),
        _ => 1,
    };
    let v_lanes = ops.v_hd / cw;
    // q into an FP8 buffer copies its dims past rotary_dim too: k's lanes; as does q
    // normalized in place.
    let q_lanes = if fp8.q_fp8.is_some() || norm.is_some() { k_lanes } else { rot_lanes };
    let lane_counts = [q_lanes, k_lanes, v_lanes].map(|l| l as u64);
    let (k_start, v_start, work, block) = match key.whole {
        false => {
            let (q, kv) = (groups(ops.q_heads as u32, g) as u64, groups(ops.kv_heads as u32, g) as u64);
            let (k, v, work) = kv_segments(q, kv, lane_counts);
            (k, v, work, BLOCK_THREADS)
        }
        true => shape.whole_layout(width).ok_or(Error::Norm(match shape.v_only {
            true => {
                "the values' norm takes a value head in one block of at most 512 threads, one per 16 bytes: \
                     up to 8 KiB (kv_lora_rank 4096 in f16/bf16)"
            }
            false => WHOLE_TOO_LARGE,
        }))?,
    };
    let Some((geometry, chunk)) = block_geometry(ops.tokens as u32, work, block)? else { return Ok(None) };

    let cache = &args.cache;
    let strides = cl.strides.map(|s| s as u64);
    let (kc, vc, nb, bs) = (cache.k.address(), cache.v.address(), cl.shape[0] as u32, cl.shape[1] as u32);
    let cache_view = match (args.slots, cache.window) {
        (Some((mapping, _)), _) => CacheView::paged(kc, vc, strides, mapping, nb, bs),
        // `sinks` below `bs`: the rows stage checked it.
        (None, Some(sinks)) => CacheView::window(kc, vc, strides, nb, bs, sinks as u32),
        (None, None) => CacheView::contiguous(kc, vc, strides, nb, bs),
    };
    let params = KvParams {
        q: args.q.as_ref().map(|q| heads_view(q, fp8.q_fp8.as_ref().map(|o| &o.out))).unwrap_or_default(),
        k: heads_view(&args.k, None),
        v: heads_view(&args.v, None),
        cache: cache_view.with_types(cache.k.dtype, cache.v.dtype),
        scales: match (fp8.scales, fp8.q_fp8) {
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
        tokens: ops.tokens as u32,
        seq: ops.seq as u32,
        rot_lanes: rot_lanes as u32,
        k_lanes: k_lanes as u32,
        v_lanes: v_lanes as u32,
        chunk,
        items_div: FastDiv::new(work as u32),
        seq_div: FastDiv::new(ops.seq as u32),
        lanes_div: lane_counts.map(|l| FastDiv::new(lane_slots(l) as u32)),
        // Below `work`, checked below 2^31 by `flat_geometry`.
        starts: [k_start as u32, v_start as u32],
    };
    debug_assert_eq!(params.types(), key.types);
    Ok(Some(KvPlan { key, params, geometry, claim }))
}

/// The operands' sizes, once checked ([`operands`]).
#[derive(Debug, Clone, Copy)]
struct Operands {
    batch: usize,
    seq: usize,
    tokens: usize,
    q_heads: usize,
    kv_heads: usize,
    /// The values' own head_dim (the value cache's).
    v_hd: usize,
}

/// The operand stage, shared by every append: q's, k's and v's types (the configuration's),
/// shapes and views.
fn operands(spec: &KvSpec, call: &KvCall, args: &RawKvArgs) -> Result<Operands> {
    let n = call.names;
    // The inputs are of the configuration's type; the caches of one a kernel writes from it
    // (checked with the key).
    for (what, t) in
        [(n(KvOperand::Q), args.q.as_ref()), (n(KvOperand::K), Some(&args.k)), (n(KvOperand::V), Some(&args.v))]
    {
        match t {
            Some(t) if t.dtype != spec.dtype => return Err(Error::DType { what, expected: spec.dtype, got: t.dtype }),
            _ => {}
        }
    }
    let hd = spec.head_dim;
    let ks = args.k.layout.shape;
    let (batch, seq, kv_heads) = (ks[0], ks[1], ks[2]);
    check_axis(n(KvOperand::K), "head_dim", hd, ks[3])?;
    for (axis, i) in [("batch", 0), ("seq", 1), ("heads", 2)] {
        check_axis(n(KvOperand::V), axis, ks[i], args.v.layout.shape[i])?;
    }
    // The values' own head_dim (copied, never rotated): the value cache's.
    let v_hd = args.v.layout.shape[3];
    if v_hd == 0 {
        return Err(Error::Shape { what: n(KvOperand::V), axis: "head_dim", expected: hd, got: 0 });
    }
    if let Some(q) = &args.q {
        for (axis, i, want) in [("batch", 0, batch), ("seq", 1, seq), ("head_dim", 3, hd)] {
            check_axis(n(KvOperand::Q), axis, want, q.layout.shape[i])?;
        }
        check_view(n(KvOperand::Q), q)?;
        check_written(n(KvOperand::Q), &q.layout)?;
    }
    check_view(n(KvOperand::K), &args.k)?;
    check_view(n(KvOperand::V), &args.v)?;
    let q_heads = args.q.map_or(0, |q| q.layout.shape[2]);
    Ok(Operands { batch, seq, tokens: batch.saturating_mul(seq), q_heads, kv_heads, v_hd })
}

/// The cache stage: the caches' one layout (the value cache's in its own head_dim), their
/// heads and head dims against the new rows', their views; returns the key cache's layout.
fn cache_stage(spec: &KvSpec, call: &KvCall, cache: &RawKvCache, ops: &Operands) -> Result<Layout> {
    let n = call.names;
    let cl = cache_layout(cache, true, n)?;
    check_axis(n(KvOperand::Cache), "heads", ops.kv_heads, cl.shape[2])?;
    check_axis(n(KvOperand::Cache), "head_dim", spec.head_dim, cl.shape[3])?;
    check_axis(n(KvOperand::VCache), "head_dim", ops.v_hd, cache.v.layout.shape[3])?;
    check_view(n(KvOperand::KCache), &cache.k)?;
    check_view(n(KvOperand::VCache), &cache.v)?;
    check_written(n(KvOperand::Cache), &cl)?;
    check_written(n(KvOperand::VCache), &cache.v.layout)?;
    Ok(cl)
}

/// What is written (q in place or its FP8 output, both caches) shares nothing with anything
/// else the launch touches, the scales and norm weights included.
fn check_apart(call: &KvCall, args: &RawKvArgs, fp8: &Fp8Stage) -> Result<()> {
    let (cache, q_fp8, n) = (&args.cache, fp8.q_fp8, call.names);
    let entries = [
        (n(KvOperand::Q), args.q, q_fp8.is_none()),
        (n(KvOperand::QOut), q_fp8.map(|o| o.out), true),
        (n(KvOperand::K), Some(args.k), false),
        (n(KvOperand::V), Some(args.v), false),
        (n(KvOperand::KCache), Some(cache.k), true),
        (n(KvOperand::VCache), Some(cache.v), true),
        (n(KvOperand::KScales), cache.scales.map(|s| scale_tensor(s.k)), false),
        (n(KvOperand::VScales), cache.scales.map(|s| scale_tensor(s.v)), false),
        (n(KvOperand::QScale), q_fp8.map(|o| scale_tensor(o.scale)), false),
        (n(KvOperand::QNormWeight), args.norm.and_then(|w| w.q_weight).map(RawWeight::tensor), false),
        (n(KvOperand::KNormWeight), args.norm.and_then(|w| w.k_weight).map(RawWeight::tensor), false),
        (n(KvOperand::VNormWeight), call.v_norm.map(|w| w.weight.tensor()), false),
    ];
    for (i, &(wn, w, written)) in entries.iter().enumerate() {
        for (j, &(on, o, o_written)) in entries.iter().enumerate() {
            let (Some(w), Some(o)) = (w, o) else { continue };
            if written && i != j && (!o_written || i < j) {
                check_disjoint((wn, &w), (on, &o))?;
            }
        }
    }
    Ok(())
}

/// The rows stage: which row each token writes (a paged cache's slot mapping; a contiguous
/// cache's positions, up to its length; a window's, in its ring), its positions view
/// (MRoPE's streams into paged caches only) and the pairs' frequencies; the counts the
/// kernels index in 32 bits.
fn rows_stage(
    spec: &KvSpec,
    call: &KvCall,
    args: &RawKvArgs,
    ops: &Operands,
    cl: Layout,
) -> Result<(PositionsView, Pairs)> {
    let (blocks, block_size) = (cl.shape[0], cl.shape[1]);
    let (batch, seq, tokens) = (ops.batch, ops.seq, ops.tokens);
    if spec.mrope.is_some() && !args.cache.paged {
        return Err(Error::MropeCache);
    }
    let limit = if args.cache.paged {
        if args.cache.window.is_some() {
            return Err(Error::SlotMapping("a window cache is contiguous: its rows come from the positions"));
        }
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
        check_axis((call.names)(KvOperand::Cache), "batch", batch, blocks)?;
        match args.cache.window {
            Some(sinks) if sinks >= block_size => {
                let limit = block_size.saturating_sub(1) as u64;
                return Err(Error::TooLarge {
                    what: "window sinks (rows of a sequence - 1)",
                    value: sinks as u64,
                    limit,
                });
            }
            Some(_) => spec.max_position,
            None => spec.max_position.min(block_size),
        }
    };
    let positions = positions(&args.positions, batch, seq, limit, spec.mrope.is_some())?;
    let pairs = pairs(spec.rotary_dim, spec.mrope.map(|m| m.bands()));
    check_u32(&[
        ("batch * seq", tokens),
        ("q heads", ops.q_heads),
        ("kv heads", ops.kv_heads),
        ("cache slots (blocks * block_size)", blocks.saturating_mul(block_size)),
    ])?;
    Ok((positions, pairs))
}

/// The de-interleaved pairs' stage (MLA's option): GPT-J pairs, and no QK-norm (kv_c's norm is
/// taken). The rest of their rules are the support table's; their lane limit, the geometry's.
fn deinterleave_stage(spec: &KvSpec, call: &KvCall, args: &RawKvArgs) -> Result<()> {
    match call.deinterleave {
        true if spec.style != RopeStyle::GptJ => Err(Error::Deinterleave("GPT-J (interleaved) pairs only")),
        true if args.norm.is_some() => Err(Error::Deinterleave("no QK-norm with them (kv_c's norm is taken)")),
        _ => Ok(()),
    }
}

/// The lanes and layouts of an append at each width.
#[derive(Debug, Clone, Copy)]
struct Shape {
    style: RopeStyle,
    size: usize,
    head_dim: usize,
    rotary_dim: usize,
    v_hd: usize,
    vector: bool,
    q_heads: usize,
    kv_heads: usize,
    /// Only the values normalized (MLA's kv_c): q's and k's lanes as without a norm.
    v_only: bool,
}

impl Shape {
    /// `(rot_lanes, copy width, k_lanes)` at `width`: the decode kernels move 8 bytes per
    /// access (half the work per thread: few tokens are bound by each thread's chain of
    /// latencies, not by bandwidth), the others 16.
    fn lanes(&self, width: KvWidth) -> (usize, usize, usize) {
        let e = if width == KvWidth::Decode { 8 / self.size } else { 16 / self.size };
        let (rot_lanes, cw) = lanes(self.vector, self.style, self.rotary_dim, e);
        (rot_lanes, cw, rot_lanes + (self.head_dim - self.rotary_dim) / cw)
    }

    /// A whole-projection norm's blocks at `width` (`whole_kv_layout`, or `whole_v_layout` for
    /// the values' norm alone); `None` where a token's projection outgrows a block.
    fn whole_layout(&self, width: KvWidth) -> Option<(u64, u64, u64, u32)> {
        let (_, cw, k_lanes) = self.lanes(width);
        let counts = [k_lanes, k_lanes, self.v_hd / cw].map(|l| l as u64);
        let g = match width {
            KvWidth::Vector => kv_heads_per_thread(true, self.style == RopeStyle::GptJ, self.size, false),
            _ => 1,
        };
        let (q, kv) = (groups(self.q_heads as u32, g) as u64, groups(self.kv_heads as u32, g) as u64);
        match self.v_only {
            true => whole_v_layout(q, kv, counts),
            false => whole_kv_layout(q, kv, counts),
        }
    }
}

/// The width, from the candidates the views and the number of tokens allow (best first) and
/// each feature's constraint on them, and whether duplicates are claimed.
fn choose_width(
    spec: &KvSpec,
    call: &KvCall,
    args: &RawKvArgs,
    ops: &Operands,
    fp8: &Fp8Stage,
    norm: Option<&NormView>,
) -> (Shape, KvWidth, bool) {
    let size = spec.dtype.size();
    let (hd, rot) = (spec.head_dim, spec.rotary_dim);
    let cache = &args.cache;
    let views = [args.q, fp8.q_fp8.map(|o| o.out), Some(args.k), Some(args.v), Some(cache.k), Some(cache.v)];
    let vector = vector_fits(spec.style, hd, rot, size, views.iter().flatten()) && ops.v_hd % (16 / size) == 0;
    let v_only = call.v_norm.is_some();
    let (q_heads, kv_heads) = (ops.q_heads, ops.kv_heads);
    let shape = Shape {
        style: spec.style,
        size,
        head_dim: hd,
        rotary_dim: rot,
        v_hd: ops.v_hd,
        vector,
        q_heads,
        kv_heads,
        v_only,
    };
    let few = ops.tokens <= KV_SCAN_MAX_TOKENS;
    let candidates: &[KvWidth] = match () {
        _ if !vector => &[KvWidth::Scalar],
        // Few tokens scan their duplicates in the 8-byte kernels; `_p` claims.
        _ if few => &[KvWidth::Decode, KvWidth::Prefill],
        // The caller's tables come in `_v_t` kernels only, one head per thread like `_p`.
        _ if ops.tokens <= KV_PREFILL_MAX_TOKENS && spec.tables != TableSource::Caller => &[KvWidth::Prefill],
        _ => &[KvWidth::Vector, KvWidth::Prefill],
    };
    let whole = norm.is_some_and(|n| n.whole());
    let fits = |width: KvWidth| match width {
        // A QK-norm: a head's lanes inside one warp (the decode kernel's 8-byte lanes can be too
        // many). (The values' norm alone sums a head of v over several warps.)
        KvWidth::Decode if norm.is_some() && !v_only && lane_slots(shape.lanes(width).2 as u64) > 32 => false,
        // A whole-projection norm: each token's q heads and its k heads inside one block
        // (`whole_kv_layout`); several heads a thread only of NeoX pairs (the support table)
        // and with weights that lie as the heads' elements do (each head's loaded as the head
        // is rotated).
        KvWidth::Decode if whole && shape.whole_layout(width).is_none() => false,
        KvWidth::Vector if whole => {
            spec.style == RopeStyle::NeoX
                && !call.deinterleave
                && norm.is_some_and(|n| n.vector != 0)
                && shape.whole_layout(width).is_some()
        }
        _ => true,
    };
    let width = candidates.iter().copied().find(|&w| fits(w)).unwrap_or(candidates[candidates.len() - 1]);
    let claim = match width {
        KvWidth::Scalar => !few,
        KvWidth::Decode => false,
        _ => true,
    };
    (shape, width, claim)
}

/// The key against the support table: its rule where no kernel takes it. Only the caches'
/// types can mix beyond the table: the inputs' are the configuration's.
fn check_key(spec: &KvSpec, call: &KvCall, key: &KvKey) -> Result<()> {
    check_supported(
        *key,
        || key.variant(),
        || {
            let (k, v) = ((call.names)(KvOperand::KCache), (call.names)(KvOperand::VCache));
            let caches = [(k, key.types.cache_k), (v, key.types.cache_v)];
            let (what, got) = caches.into_iter().find(|&(_, d)| d != spec.dtype).unwrap_or((k, spec.dtype));
            Error::DType { what, expected: spec.dtype, got }
        },
    )
}

/// The norm stage: a QK-norm's view, or the values' one head's (MLA's `kv_c`); neither with
/// the caller's tables, not both.
fn norm_stage(spec: &KvSpec, call: &KvCall, args: &RawKvArgs, ops: &Operands) -> Result<Option<NormView>> {
    match (&args.norm, &call.v_norm) {
        (Some(_), _) | (_, Some(_)) if spec.tables == TableSource::Caller => {
            Err(Error::Norm("the reference update (the caller's tables) takes no norm"))
        }
        (Some(_), Some(_)) => Err(Error::Norm("a QK-norm and the values' norm are not taken together")),
        (Some(n), None) => {
            let heads = [args.q.map(|q| q.layout.shape[2]), Some(ops.kv_heads)];
            Ok(Some(norm_view(n, spec.head_dim, heads, spec.dtype)?))
        }
        (None, Some(n)) => {
            check_axis((call.names)(KvOperand::V), "heads (one, normalized: MLA's kv_c)", 1, ops.kv_heads)?;
            Ok(Some(value_norm_view(n, ops.v_hd, spec.dtype)?))
        }
        (None, None) => Ok(None),
    }
}
