//! The append's planner and the read's, without a GPU.

use super::read::plan_read;
use super::*;
use crate::config::{DType, RopeConfig, RopeStyle};
use crate::error::Error;
use crate::launch::detached_source;
use crate::tensor::PositionKind;
use rope_cuda_kernels::entries::Key;
use rope_cuda_kernels::keys::KvTypes;
use rope_cuda_kernels::keys::{KvKey, KvWidth, TableSource};
use rope_cuda_kernels::params::{kv_segments, lane_slots};
use rope_cuda_kernels::tuning::{BLOCK_THREADS, KV_PREFILL_MAX_TOKENS};
use rope_cuda_kernels::views::CacheKind;

/// [`super::plan_kv`] without tables or records, as [`validate_append`] plans.
fn plan_kv(spec: &KvSpec, args: &RawKvArgs) -> Result<Option<KvPlan>> {
    super::plan_kv(spec, &KvCall::APPEND, args, detached_source(spec.rotary_dim, spec.tables), ErrorSink::default())
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
        cache: RawKvCache::paged(tensor(4, Layout::bshd(10, 16, 2, 128)), tensor(5, Layout::bshd(10, 16, 2, 128))),
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
    // Past the one-head limit, NeoX pairs: two heads a thread (bf16), a token's 32 q heads in
    // 16 groups of 8 lanes (128 items), k's 4 groups from 128, v's 4 groups of 16 lanes from
    // 160: blocks of 224 threads, one token each. GPT-J pairs, or weights that do not lie as
    // the heads' elements do (f32 weights of bf16 heads), keep one head a thread.
    let tokens = rope_cuda_kernels::tuning::KV_PREFILL_MAX_TOKENS + 8;
    let long = |i, h| tensor(i, Layout::bshd(1, tokens, h, 128));
    let mut a = RawKvArgs { norm: Some(weights(32, 8)), ..args() };
    (a.q, a.k, a.v) = (Some(long(1, 32)), long(2, 8), long(3, 8));
    (a.cache.k, a.cache.v) = (long(4, 8), long(5, 8));
    a.cache.paged = false;
    (a.positions.len, a.slots) = (tokens, None);
    let p = plan_kv(&spec(), &a).unwrap().unwrap();
    assert_eq!((p.key.width, p.key.whole), (KvWidth::Vector, true));
    assert_eq!((p.params.starts, p.params.items_div.divisor, p.geometry.block.0), ([128, 160], 224, 224));
    assert!(p.key.entry_point().is_some());
    let gptj = KvSpec { style: RopeStyle::GptJ, ..spec() };
    assert_eq!(plan_kv(&gptj, &a).unwrap().unwrap().key.width, KvWidth::Prefill);
    let mut f32_weights = weights(32, 8);
    for w in [&mut f32_weights.q_weight, &mut f32_weights.k_weight] {
        w.as_mut().unwrap().dtype = DType::F32;
    }
    a.norm = Some(f32_weights);
    assert_eq!(plan_kv(&spec(), &a).unwrap().unwrap().key.width, KvWidth::Prefill);
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
        assert!(matches!(e, Error::DType { what, expected: DType::BF16, got: DType::F16 } if what == name), "{e:?}");
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
                        // A whole-projection norm: one head a thread (8 or 16 bytes), or
                        // several of NeoX pairs.
                        let whole = KvKey { whole: true, ..normed };
                        let has = matches!(width, KvWidth::Decode | KvWidth::Prefill)
                            || (width == KvWidth::Vector && style == RopeStyle::NeoX);
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
                cache: RawKvCache { scales: scales((8 * BASE + 2, 2), (9 * BASE, 2), true), ..fp8_args(false).cache },
                ..fp8_args(false)
            },
            |e| matches!(e, Error::Alignment { what: "k scales", .. }),
        ),
        (
            "scales inside the cache",
            RawKvArgs {
                cache: RawKvCache { scales: scales((4 * BASE + 64, 2), (9 * BASE, 2), true), ..fp8_args(false).cache },
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
