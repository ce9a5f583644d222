//! Property tests, on the CPU, of the checks every launch makes ([`rope_cuda::validate`], what
//! `Rope::apply_raw` runs before launching) against a plain model of the rules: each view's
//! elements enumerated one by one, overlaps found by set intersection.
//!
//! The library may refuse more than the model (its overlap test between q and k is exact only
//! for views sharing a token grid, and conservative otherwise), never less: every accepted
//! call is valid. For tensors in separate allocations, where nothing can overlap, acceptance
//! must match the model exactly.

use std::collections::HashSet;

use proptest::prelude::*;
use rope_cuda::{validate, DType, Layout, PositionKind, RawArgs, RawPositions, RawTensor, RopeConfig};

const SIZE: u64 = 2; // bf16
const MAX_POS: usize = 4;

/// Element addresses (in elements from address 0) of every element of a view.
fn elements(t: &RawTensor) -> Vec<u64> {
    let l = &t.layout;
    let mut v = Vec::new();
    for b in 0..l.shape[0] {
        for s in 0..l.shape[1] {
            for h in 0..l.shape[2] {
                for i in 0..l.shape[3] {
                    let at = l.offset + b * l.strides[0] + s * l.strides[1] + h * l.strides[2] + i;
                    v.push(t.ptr / SIZE + at as u64);
                }
            }
        }
    }
    v
}

fn set(t: &RawTensor) -> HashSet<u64> {
    elements(t).into_iter().collect()
}

/// The rules, plainly.
fn model(config: &RopeConfig, a: &RawArgs) -> bool {
    let d = config.head_dim;
    if a.k.is_some() && a.q_out.is_some() != a.k_out.is_some() || a.k.is_none() && a.k_out.is_some() {
        return false;
    }
    let q = (a.q, a.q_out.unwrap_or(a.q));
    let k = a.k.map(|k| (k, a.k_out.unwrap_or(k)));
    let qs = a.q.layout.shape;
    for (input, output) in [Some(q), k].into_iter().flatten() {
        let sh = input.layout.shape;
        if sh[3] != d || sh[0] != qs[0] || sh[1] != qs[1] || output.layout.shape != sh {
            return false;
        }
        for t in [input, output] {
            let e = elements(&t);
            let extent = e.iter().map(|&x| x - t.ptr / SIZE + 1).max().unwrap_or(0);
            if t.ptr % SIZE != 0 || extent > t.len as u64 {
                return false;
            }
        }
        // What is written: no element twice, and out of place nothing shared with the input.
        let written = elements(&output);
        if written.len() != set(&output).len() {
            return false;
        }
        let same = output.ptr == input.ptr && output.layout == input.layout;
        if !same && !set(&input).is_disjoint(&set(&output)) {
            return false;
        }
    }
    if let Some((ki, ko)) = k {
        let (qi, qo) = q;
        if !set(&qo).is_disjoint(&set(&ko)) || !set(&qo).is_disjoint(&set(&ki)) || !set(&ko).is_disjoint(&set(&qi)) {
            return false;
        }
    }
    let tokens = qs[0] * qs[1];
    match a.positions.kind {
        PositionKind::Sequential => qs[1] <= MAX_POS,
        PositionKind::IdsI32 => a.positions.len == tokens && a.positions.ptr % 4 == 0,
        PositionKind::IdsI64 => a.positions.len == tokens && a.positions.ptr % 8 == 0,
        PositionKind::OffsetsI32 => a.positions.len == qs[0] && a.positions.ptr % 4 == 0,
        PositionKind::OffsetsI64 => a.positions.len == qs[0] && a.positions.ptr % 8 == 0,
        // Three streams are for MRoPE configurations only; sequence rows for the caller's
        // tables (`TableRope`) only.
        PositionKind::StreamsI32 | PositionKind::StreamsI64 | PositionKind::SequenceRows => false,
    }
}

/// A view of `shape` (its head_dim sometimes wrong) in the allocation at `base`: mostly
/// row-major strides with some padding, sometimes arbitrary small strides (0 allowed:
/// overlapping rows); its length mostly at least its extent; its address rarely misaligned.
fn tensor(base: u64, shape: [usize; 4]) -> impl Strategy<Value = RawTensor> {
    (
        prop_oneof![19 => Just(shape[3]), 1 => Just(shape[3] + 2)],
        prop_oneof![
            4 => (0usize..3, 0usize..3, 0usize..3).prop_map(|p| (true, [p.0, p.1, p.2])),
            1 => (0usize..=24, 0usize..=12, 0usize..=10).prop_map(|s| (false, [s.0, s.1, s.2])),
        ],
        0usize..4,
        prop_oneof![9 => 0i64..=3, 1 => Just(-1i64)],
        prop_oneof![19 => Just(0u64), 1 => Just(1u64)],
        0u64..64,
    )
        .prop_map(move |(d, (padded, st), offset, slack, misalign, shift)| {
            let sh = [shape[0], shape[1], shape[2], d];
            let strides = if padded {
                let s2 = d + st[2];
                let s1 = sh[2] * s2 + st[1];
                [sh[1] * s1 + st[0], s1, s2]
            } else {
                st
            };
            let layout = Layout::strided(sh, strides, offset);
            let extent = layout.extent().unwrap_or(0) as i64;
            RawTensor::new(base + shift * 8 * SIZE + misalign, (extent + slack).max(0) as usize, DType::BF16, layout)
        })
}

fn positions(batch: usize, seq: usize) -> impl Strategy<Value = (PositionKind, usize, u64)> {
    prop_oneof![
        Just((PositionKind::Sequential, 0, 0)),
        Just((PositionKind::IdsI32, batch * seq, 0)),
        Just((PositionKind::IdsI64, batch * seq, 0)),
        Just((PositionKind::OffsetsI32, batch, 0)),
        Just((PositionKind::OffsetsI64, batch, 0)),
        (0usize..8, Just(0u64)).prop_map(|(n, a)| (PositionKind::IdsI32, n, a)),
        Just((PositionKind::IdsI64, batch * seq, 4)),
        Just((PositionKind::SequenceRows, 0, 0)),
    ]
}

/// Arguments for a random `[batch, seq]` with every tensor in the allocation at `bases[i]`
/// (equal bases: one allocation, overlaps possible).
fn args(d: usize, bases: [u64; 4]) -> impl Strategy<Value = RawArgs> {
    (1usize..=2, 1usize..=5, 1usize..=3, 1usize..=2, prop_oneof![9 => Just(0usize), 1 => Just(1usize)]).prop_flat_map(
        move |(b, s, hq, hk, seq_off)| {
            (
                tensor(bases[0], [b, s, hq, d]),
                proptest::option::weighted(0.8, tensor(bases[1], [b, s + seq_off, hk, d])),
                any::<bool>(),
                tensor(bases[2], [b, s, hq, d]),
                tensor(bases[3], [b, s + seq_off, hk, d]),
                positions(b, s),
                prop_oneof![19 => Just(false), 1 => Just(true)],
            )
                .prop_map(|(q, k, in_place, q_out, k_out, (kind, len, misalign), odd)| {
                    let mut args = RawArgs::new(q, RawPositions::new(kind, (1 << 40) + misalign, len));
                    // Rarely, an output given for only one of q and k.
                    args.q_out = (!in_place).then_some(q_out);
                    args.k = k;
                    args.k_out = (!in_place && k.is_some() != odd).then_some(k_out);
                    args
                })
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 4000, ..ProptestConfig::default() })]

    /// One allocation for everything: overlaps of every kind. Whatever the library accepts
    /// is valid by the model.
    #[test]
    fn accepted_calls_are_valid(a in args(4, [1 << 20; 4])) {
        let config = RopeConfig::new(4, MAX_POS).dtype(DType::BF16);
        if validate(&config, &a).is_ok() {
            prop_assert!(model(&config, &a), "accepted but invalid: {a:?}");
        }
    }

    /// Separate allocations (q, k, q_out, k_out far apart): acceptance matches the model
    /// exactly, and a rejection is a typed error, never a panic.
    #[test]
    fn separate_allocations_match_the_model(a in args(8, [1 << 20, 2 << 20, 3 << 20, 4 << 20])) {
        let config = RopeConfig::new(8, MAX_POS).dtype(DType::BF16);
        let got = validate(&config, &a);
        prop_assert_eq!(got.is_ok(), model(&config, &a), "{:?} for {:?}", got, a);
    }
}

/// Neither property is vacuous: both strategies produce accepted and refused calls in good
/// numbers, and the shared allocation produces calls the model finds overlapping.
#[test]
fn strategies_cover_both_outcomes() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let mut runner = TestRunner::deterministic();
    for (d, bases) in [(4, [1 << 20; 4]), (8, [1 << 20, 2 << 20, 3 << 20, 4 << 20])] {
        let config = RopeConfig::new(d, MAX_POS).dtype(DType::BF16);
        let strategy = args(d, bases);
        let (mut ok, mut valid, n) = (0, 0, 4000);
        for _ in 0..n {
            let a = strategy.new_tree(&mut runner).unwrap().current();
            ok += validate(&config, &a).is_ok() as usize;
            valid += model(&config, &a) as usize;
        }
        eprintln!("d {d}: {ok} of {n} accepted, {valid} valid");
        assert!(ok > n / 10 && ok < n - n / 10, "d {d}: {ok} of {n} accepted");
        assert!(valid >= ok, "d {d}: {valid} valid, {ok} accepted");
    }
}

/// The model itself catches what it is meant to: a tensor past its buffer, a misaligned
/// address, overlapping output rows, q and k sharing elements.
#[test]
fn model_rejects_known_bad_arguments() {
    let config = RopeConfig::new(8, MAX_POS).dtype(DType::BF16);
    let t = |ptr, len, layout| RawTensor::new(ptr, len, DType::BF16, layout);
    let pos = RawPositions::new(PositionKind::Sequential, 0, 0);
    let good =
        RawArgs::new(t(1 << 20, 32, Layout::bshd(1, 2, 2, 8)), pos).with_k(t(2 << 20, 16, Layout::bshd(1, 2, 1, 8)));
    assert!(model(&config, &good) && validate(&config, &good).is_ok());
    let with_q = |q| {
        let mut args = good;
        args.q = q;
        args
    };
    let short = with_q(t(1 << 20, 31, Layout::bshd(1, 2, 2, 8)));
    let misaligned = with_q(t((1 << 20) + 1, 32, Layout::bshd(1, 2, 2, 8)));
    let overlapping = with_q(t(1 << 20, 32, Layout::strided([1, 2, 2, 8], [32, 8, 4], 0)));
    let shared = good.with_k(t(1 << 20, 32, Layout::bshd(1, 2, 1, 8)));
    for bad in [short, misaligned, overlapping, shared] {
        assert!(!model(&config, &bad), "{bad:?}");
        assert!(validate(&config, &bad).is_err(), "{bad:?}");
    }
}
