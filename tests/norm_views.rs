//! One rule for the QK-norm's views, whichever door takes it: RoPE's (`RopeArgs::norm`) and
//! the fused append's (`KvAppend::norm`) accept the same q and k views and refuse the others
//! with the same error, over element types, head and rotary dims, pairings, norm kinds,
//! misaligned addresses and strides, and decode and prefill token counts. No GPU: both are
//! checked as their launches check them (`validate`, `validate_append`).

use rope_cuda::{
    validate, validate_append, DType, Error, Layout, NormKind, PositionKind, RawArgs, RawKvArgs, RawKvCache, RawNorm,
    RawPositions, RawTensor, RawWeight, RopeConfig, RopeStyle,
};

const GIB: u64 = 1 << 30;

/// q and k of `tokens` tokens (`q_heads`, `kv_heads` of `head_dim`), starting `shift` bytes
/// past an aligned address and with heads `pad` elements apart beyond `head_dim`.
fn views(
    dtype: DType,
    tokens: usize,
    heads: (usize, usize),
    head_dim: usize,
    shift: u64,
    pad: usize,
) -> [RawTensor; 2] {
    let view = |at: u64, h: usize| {
        let row = head_dim + pad;
        let layout = Layout::strided([tokens, 1, h, head_dim], [h * row, h * row, row], 0);
        RawTensor::new(at * GIB + shift, layout.extent().unwrap(), dtype, layout)
    };
    [view(1, heads.0), view(2, heads.1)]
}

fn norm(kind: NormKind, dtype: DType, heads: (usize, usize), head_dim: usize) -> RawNorm {
    let n = RawNorm::new(kind, 1e-6);
    match kind {
        NormKind::RmsUnit => n,
        NormKind::RmsProjection => n.with_weights(
            RawWeight::new(8 * GIB, heads.0 * head_dim, dtype),
            RawWeight::new(9 * GIB, heads.1 * head_dim, dtype),
        ),
        _ => n.with_weights(RawWeight::new(8 * GIB, head_dim, dtype), RawWeight::new(9 * GIB, head_dim, dtype)),
    }
}

#[test]
fn rope_and_the_append_take_a_qk_norm_on_the_same_views() {
    let (mut agreed, mut accepted) = (0, 0);
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let size = dtype.size() as u64;
        for head_dim in [32, 64, 96, 128, 192, 256, 320, 512] {
            for rotary_dim in [head_dim, head_dim / 2] {
                for style in [RopeStyle::NeoX, RopeStyle::GptJ] {
                    let config = RopeConfig::new(head_dim, 4096).rotary_dim(rotary_dim).style(style).dtype(dtype);
                    for kind in [NormKind::Rms, NormKind::RmsProjection, NormKind::RmsUnit] {
                        // Aligned; 8 bytes off (the 8-byte accesses' alignment); one element
                        // off; heads 8 bytes apart past head_dim.
                        for (shift, pad) in [(0, 0), (8, 0), (size, 0), (0, (8 / size) as usize)] {
                            for tokens in [1, 600] {
                                let heads = (8, 2);
                                let [q, k] = views(dtype, tokens, heads, head_dim, shift, pad);
                                let n = norm(kind, dtype, heads, head_dim);
                                let positions = RawPositions::new(PositionKind::IdsI32, 10 * GIB, tokens);
                                let rope = RawArgs::new(q, positions).with_k(k).with_norm(n);
                                // The values and the caches aligned: only q's and k's views vary.
                                let cache = Layout::bshd(tokens, 1, 2, head_dim);
                                let extent = cache.extent().unwrap();
                                let v = RawTensor::new(3 * GIB, extent, dtype, cache);
                                let caches = RawKvCache::contiguous(
                                    RawTensor::new(4 * GIB, extent, dtype, cache),
                                    RawTensor::new(5 * GIB, extent, dtype, cache),
                                );
                                let positions = RawPositions::new(PositionKind::IdsI32, 10 * GIB, tokens);
                                let append = RawKvArgs::new(k, v, caches, positions).with_q(q).with_norm(n);
                                let (r, a) = (validate(&config, &rope), validate_append(&config, &append));
                                let case = format!(
                                    "{dtype:?} head_dim {head_dim} rotary {rotary_dim} {style:?} {kind:?} shift {shift} pad {pad} tokens {tokens}"
                                );
                                assert_eq!(r, a, "{case}: RoPE {r:?}, the append {a:?}");
                                if let Err(e) = &r {
                                    assert!(matches!(e, Error::Norm(_)), "{case}: {e}");
                                }
                                agreed += 1;
                                accepted += r.is_ok() as usize;
                            }
                        }
                    }
                }
            }
        }
    }
    // Both kinds of answer were met.
    println!("{agreed} cases, {accepted} accepted by both doors, the rest refused by both alike");
    assert!(accepted > 100 && agreed - accepted > 100, "{accepted} of {agreed} accepted");
}
