//! The KV-cache rows of the example: the reference update, a decode step and a prefill chunk,
//! each checked on a sample, then timed (CUDA events, median of many runs) next to a
//! device-to-device copy measured in the same run.

use cust::memory::{CopyDestination, DeviceBuffer};
use cust::stream::Stream;
use half::bf16;
use rope_cuda::bench::{copy_d2d, empty, host_time, time_batched, time_device, time_op, touch, touch_rows, Timing};
use rope_cuda::reference::{rope_row, uniform, RefElem};
use rope_cuda::seed::{KvShape, KvUpdate};
use rope_cuda::{
    DType, Direction, Graph, Kernels, KvCache, KvScales, Layout, Positions, QkNorm, Rope, RopeArgs, RopeConfig,
    RopeStyle, Tensor, TensorMut, F8E4M3,
};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

struct KvRow {
    name: &'static str,
    what: String,
    op: Timing,
    /// The copy yardstick and the bytes both move, or a second operation to compare with.
    against: Against,
    /// The worst error of the sampled outputs in units of their last place (FP8: codes away
    /// from the model's, which must be 0).
    ulps: u64,
}

enum Against {
    Copy(Timing, u64),
    Baseline(&'static str, Timing),
}

fn upload(host: &[bf16]) -> Res<DeviceBuffer<bf16>> {
    Ok(DeviceBuffer::from_slice(host)?)
}

fn seeded(tensor: u64, n: usize) -> Vec<bf16> {
    (0..n as u64).map(|i| bf16::from_f32(uniform(21, tensor, i))).collect()
}

fn download(dev: &DeviceBuffer<bf16>) -> Res<Vec<bf16>> {
    let mut h = vec![bf16::ZERO; dev.len()];
    dev.copy_to(&mut h[..])?;
    Ok(h)
}

/// The reference operation, bf16, B=8, S=8192, H=8, D=128, T=16.
fn reference(kernels: &std::sync::Arc<Kernels>, stream: &Stream) -> Res<KvRow> {
    let (b, t, h, d, s) = (8, 16, 8, 128, 8192);
    let shape = KvShape { batch: b, new_tokens: t, heads: h, head_dim: d, cache_len: s };
    let (row, cache_n) = (h * d, b * s * h * d);
    let positions: Vec<i32> = (0..b * t).map(|i| ((i % t) * 311 + 100 * (i / t)) as i32 % s as i32).collect();
    let (k_new, v_new) = (seeded(0, b * t * row), seeded(1, b * t * row));
    let angle = |p: usize, i: usize| p as f64 / 10_000f64.powf(2.0 * i as f64 / d as f64);
    let cos: Vec<bf16> = (0..s * d / 2).map(|j| bf16::round(angle(j / (d / 2), j % (d / 2)).cos())).collect();
    let sin: Vec<bf16> = (0..s * d / 2).map(|j| bf16::round(angle(j / (d / 2), j % (d / 2)).sin())).collect();
    let cache_k = seeded(2, cache_n);
    let (dk, dv, dc, ds, dck) = (upload(&k_new)?, upload(&v_new)?, upload(&cos)?, upload(&sin)?, upload(&cache_k)?);
    let dcv = upload(&seeded(3, cache_n))?;
    let dp = DeviceBuffer::from_slice(&positions)?;
    let mut out = upload(&vec![bf16::from_bits(0x7FA5); 2 * cache_n])?;
    let update = KvUpdate::new(kernels)?;
    update.update_kv_cache(shape, &dk, &dv, &dc, &ds, &dck, &dcv, &dp, &mut out, stream)?;
    update.check_errors(stream)?;
    // Check: every targeted key row of sequence 3 within 1 ulp, one untouched row exact.
    let host = download(&out)?;
    let mut ulps = 0;
    for tok in 3 * t..4 * t {
        let p = positions[tok] as usize;
        for hh in 0..h {
            let at = ((3 * s + p) * h + hh) * d;
            for j in 0..d / 2 {
                let (c, sn) = (cos[p * d / 2 + j].to_f64(), sin[p * d / 2 + j].to_f64());
                let x = &k_new[tok * row + hh * d..];
                let (x0, x1) = (x[2 * j].to_f64(), x[2 * j + 1].to_f64());
                ulps = ulps.max(host[at + 2 * j].ulps(bf16::round(x0 * c - x1 * sn)));
                ulps = ulps.max(host[at + 2 * j + 1].ulps(bf16::round(x1 * c + x0 * sn)));
            }
        }
    }
    let untouched = (3 * s + 1) * row; // position 1 of sequence 3 is never named
    ulps = ulps.max(if host[untouched..untouched + row] == cache_k[untouched..untouched + row] { 0 } else { 99 });

    let bytes = (2 * 2 * cache_n * 2) as u64; // both caches read and written
    let (mut lo, mut hi) = (DeviceBuffer::from_slice(&cache_k)?, DeviceBuffer::from_slice(&cache_k)?);
    let runs = 50;
    let copy = time_op(stream, 5, runs, || {
        copy_d2d(&dck, &mut lo, stream)?;
        copy_d2d(&dcv, &mut hi, stream)
    })?;
    let op = time_op(stream, 5, runs, || {
        update.update_kv_cache(shape, &dk, &dv, &dc, &ds, &dck, &dcv, &dp, &mut out, stream)
    })?;
    Ok(KvRow {
        name: "reference update",
        what: "bf16 B8 S8192 H8 D128 T16".into(),
        op,
        against: Against::Copy(copy, bytes),
        ulps,
    })
}

/// The paged cache of [`step`] and [`fp8_step`] (blocks of 16, 8 kv heads of 128) and their
/// tokens' positions and slots: sequence i owns blocks `i * blocks_per_seq ..`, its token j is
/// at position 2048 + j.
fn paged_step(seqs: usize, new: usize) -> (Layout, Vec<i32>, Vec<i64>) {
    let (hk, d, bs, context) = (8, 128, 16, 2048);
    let blocks_per_seq = (context + new).div_ceil(bs);
    let positions = (0..seqs * new).map(|t| (context + t % new) as i32).collect();
    let slots = (0..seqs * new)
        .map(|t| {
            let (i, pos) = (t / new, context + t % new);
            ((i * blocks_per_seq + pos / bs) * bs + pos % bs) as i64
        })
        .collect();
    (Layout::bshd(seqs * blocks_per_seq, bs, hk, d), positions, slots)
}

/// A step over a paged cache (blocks of 16): `seqs` sequences of `new` tokens each, 32 q and
/// 8 kv heads of 128, bf16, NeoX, each sequence's tokens appended after `context` cached ones.
/// Returns the fused launch, and either RoPE followed by a separate append (`decode`) or a
/// copy of the bytes the step moves.
fn step(
    kernels: &std::sync::Arc<Kernels>,
    stream: &Stream,
    seqs: usize,
    new: usize,
    decode: bool,
    extra: &mut Vec<KvRow>,
) -> Res<KvRow> {
    let (hq, hk, d) = (32, 8, 128);
    let tokens = seqs * new;
    let (cache_layout, positions, slots) = paged_step(seqs, new);
    let blocks = cache_layout.shape[0];
    let bs = cache_layout.shape[1];
    let rope = Rope::new(kernels, crate::cos_sin(RopeConfig::new(d, 8192).base(500_000.0).dtype(DType::BF16))?)?;
    let (qh, kh, vh) = (seeded(10, tokens * hq * d), seeded(11, tokens * hk * d), seeded(12, tokens * hk * d));
    let (mut dq, dk, dv) = (upload(&qh)?, upload(&kh)?, upload(&vh)?);
    let cache_n = blocks * bs * hk * d;
    let (mut kc, mut vc) = (upload(&seeded(13, cache_n))?, upload(&seeded(14, cache_n))?);
    let (dpos, dslots) = (DeviceBuffer::from_slice(&positions)?, DeviceBuffer::from_slice(&slots)?);
    let (ql, kl) = (Layout::bshd(seqs, new, hq, d), Layout::bshd(seqs, new, hk, d));
    let pos = Positions::ids_i32(&dpos);

    let fused = |dq: &mut DeviceBuffer<bf16>, kc: &mut DeviceBuffer<bf16>, vc: &mut DeviceBuffer<bf16>| {
        let mut cache = KvCache::paged(kc, vc, cache_layout);
        let mut q = TensorMut::new(dq, ql);
        rope.append_kv(
            rope_cuda::KvAppend::new(&Tensor::new(&dk, kl), &Tensor::new(&dv, kl), &mut cache, pos)
                .q(&mut q)
                .slots(&dslots),
            stream,
        )
    };
    // Check once: q and the key rows of a sample of tokens within 1 ulp.
    fused(&mut dq, &mut kc, &mut vc)?;
    rope.check_errors(stream)?;
    let (q_out, k_cache) = (download(&dq)?, download(&kc)?);
    let mut ulps = 0;
    for t in (0..tokens).step_by(7) {
        let p = positions[t] as f64;
        for (src, heads, out, at) in [(&qh, hq, &q_out, t * hq * d), (&kh, hk, &k_cache, slots[t] as usize * hk * d)] {
            for hh in 0..heads {
                let x: Vec<f64> = src[(t * heads + hh) * d..][..d].iter().map(|v| v.to_f64()).collect();
                let y = rope_row(&x, p, 500_000.0, d, RopeStyle::NeoX, Direction::Forward);
                for (j, want) in y.into_iter().enumerate() {
                    ulps = ulps.max(out[at + hh * d + j].ulps(bf16::round(want)));
                }
            }
        }
    }
    // Timing rotates q again and again; the values do not matter for speed.
    let runs = 200;
    let op = time_op(stream, 20, runs, || fused(&mut dq, &mut kc, &mut vc))?;
    // The same step with a QK-norm in the launch (`whole`: OLMo 2's, else Qwen3's).
    let (qw, kw) = (upload(&seeded(19, d))?, upload(&seeded(20, d))?);
    // OLMo 2's weights, [heads x head_dim]: one statistic per token for the whole q
    // projection and one for k's, each token's heads in one block.
    let (qow, kow) = (upload(&seeded(21, hq * d))?, upload(&seeded(22, hk * d))?);
    let mut normed_with = |whole: bool| {
        let mut cache = KvCache::paged(&mut kc, &mut vc, cache_layout);
        let mut q = TensorMut::new(&mut dq, ql);
        let norm = if whole { QkNorm::olmo(&qow, &kow, 1e-6) } else { QkNorm::rms(&qw, &kw, 1e-6) };
        rope.append_kv(
            rope_cuda::KvAppend::new(&Tensor::new(&dk, kl), &Tensor::new(&dv, kl), &mut cache, pos)
                .q(&mut q)
                .slots(&dslots)
                .norm(norm),
            stream,
        )
    };
    let norm_op = time_op(stream, 20, runs, || normed_with(false))?;
    let norm_device = if decode { Some(time_device(kernels, stream, 20, runs, || normed_with(false))?) } else { None };
    let olmo_op = match decode {
        true => time_device(kernels, stream, 20, runs, || normed_with(true))?,
        false => time_op(stream, 20, runs, || normed_with(true))?,
    };
    let against = if decode {
        // RoPE on q and k in place, then the append as its own launch (which rotates k once
        // more: the same work as a plain append plus a few FMAs).
        let mut dk2 = upload(&kh)?;
        let mut baseline = || {
            let mut q = TensorMut::new(&mut dq, ql);
            let mut k = TensorMut::new(&mut dk2, kl);
            rope.apply(RopeArgs::in_place(&mut q, pos).k(&mut k), stream)?;
            let mut cache = KvCache::paged(&mut kc, &mut vc, cache_layout);
            rope.append_kv(
                rope_cuda::KvAppend::new(&Tensor::new(&dk2, kl), &Tensor::new(&dv, kl), &mut cache, pos).slots(&dslots),
                stream,
            )
        };
        let base = time_op(stream, 20, runs, &mut baseline)?;
        let base_device = time_device(kernels, stream, 20, runs, &mut baseline)?;
        // Back to back, 20 per timed run: the device's time per step when the host keeps up.
        let batched_base = time_batched(stream, 20, 50, 20, &mut baseline)?;
        // The normed step as two launches of this crate: QK-norm + RoPE on q and k in place
        // (no cache), then the append of the normed keys.
        let mut dk3 = upload(&kh)?;
        let two_normed = time_device(kernels, stream, 20, runs, || {
            let mut q = TensorMut::new(&mut dq, ql);
            let mut k = TensorMut::new(&mut dk3, kl);
            rope.apply(RopeArgs::in_place(&mut q, pos).k(&mut k).norm(QkNorm::rms(&qw, &kw, 1e-6)), stream)?;
            let mut cache = KvCache::paged(&mut kc, &mut vc, cache_layout);
            rope.append_kv(
                rope_cuda::KvAppend::new(&Tensor::new(&dk3, kl), &Tensor::new(&dv, kl), &mut cache, pos).slots(&dslots),
                stream,
            )
        })?;
        let mut dk2 = upload(&kh)?;
        let rope_alone = time_device(kernels, stream, 20, runs, || {
            let mut q = TensorMut::new(&mut dq, ql);
            let mut k = TensorMut::new(&mut dk2, kl);
            rope.apply(RopeArgs::in_place(&mut q, pos).k(&mut k), stream)
        })?;
        let device = time_device(kernels, stream, 20, runs, || fused(&mut dq, &mut kc, &mut vc))?;
        // The same step captured once into a CUDA graph and replayed.
        let graph = Graph::capture(stream, || fused(&mut dq, &mut kc, &mut vc))?;
        // SAFETY: `rope` and the buffers the graphs name (this one and those below) live to the
        // end of this function, and each timing synchronises the stream before returning.
        let replay = time_device(kernels, stream, 20, runs, || unsafe { graph.launch(stream) })?;
        // SAFETY: as the replay above: the graph's buffers outlive the timing, which synchronises.
        let replay_batched = time_batched(stream, 20, 50, 20, || unsafe { graph.launch(stream) })?;
        let batched = time_batched(stream, 20, 50, 20, || fused(&mut dq, &mut kc, &mut vc))?;
        let host = host_time(kernels, stream, 50, 20, || fused(&mut dq, &mut kc, &mut vc))?;
        let host_empty = host_time(kernels, stream, 50, 20, || empty(kernels, stream, 1))?;
        let blocks = (tokens * (hq + 3 * hk) * d / 16).div_ceil(128) as u32;
        let empty_eager = time_op(stream, 20, runs, || empty(kernels, stream, blocks))?;
        let empty_device = time_device(kernels, stream, 20, runs, || empty(kernels, stream, blocks))?;
        // The yardstick of the graph rows: an empty kernel captured and replayed the same way.
        let empty_graph = Graph::capture(stream, || empty(kernels, stream, blocks))?;
        // SAFETY: as the replay above: the graph's buffers outlive the timing, which synchronises.
        let empty_replay = time_device(kernels, stream, 20, runs, || unsafe { empty_graph.launch(stream) })?;
        // SAFETY: as the replay above: the graph's buffers outlive the timing, which synchronises.
        let empty_replay_batched = time_batched(stream, 20, 50, 20, || unsafe { empty_graph.launch(stream) })?;
        // The floor of any step that reads its inputs before writing: a copy of the step's
        // bytes (q, k and v read, as many written), one 16-byte load and store per thread.
        let step_elems = tokens * (hq + 2 * hk) * d;
        let (tsrc, mut tdst) = (upload(&seeded(17, step_elems))?, upload(&seeded(18, step_elems))?);
        let touch_device = time_device(kernels, stream, 20, runs, || touch(kernels, stream, &tsrc, &mut tdst))?;
        let touch_graph = Graph::capture(stream, || touch(kernels, stream, &tsrc, &mut tdst))?;
        // SAFETY: as the replay above: the graph's buffers outlive the timing, which synchronises.
        let touch_replay = time_device(kernels, stream, 20, runs, || unsafe { touch_graph.launch(stream) })?;
        // SAFETY: as the replay above: the graph's buffers outlive the timing, which synchronises.
        let touch_batched = time_batched(stream, 20, 50, 20, || unsafe { touch_graph.launch(stream) })?;
        let shape = format!("bf16 {seqs}x{new} tok 32/8 h d128 paged 16");
        extra.push(KvRow {
            name: "decode step, device",
            what: shape.clone(),
            op: device,
            against: Against::Baseline("RoPE, then append", base_device),
            ulps: 0,
        });
        if let Some(norm_device) = norm_device {
            extra.push(KvRow {
                name: "decode + QK-norm, device",
                what: format!("{shape}, Qwen3 norm"),
                op: norm_device,
                against: Against::Baseline("decode step, device", device),
                ulps: 0,
            });
            extra.push(KvRow {
                name: "decode + QK-norm, device",
                what: format!("{shape}, Qwen3 norm"),
                op: norm_device,
                against: Against::Baseline("norm+RoPE, then append", two_normed),
                ulps: 0,
            });
        }
        extra.push(KvRow {
            name: "decode + OLMo 2 norm, device",
            what: format!("{shape}, whole projections"),
            op: olmo_op,
            against: Against::Baseline("decode step, device", device),
            ulps: 0,
        });
        extra.push(KvRow {
            name: "decode, graph replay",
            what: format!("{shape}, device"),
            op: replay,
            against: Against::Baseline("eager launch", device),
            ulps: 0,
        });
        extra.push(KvRow {
            name: "decode, graph back to back",
            what: format!("bf16 {seqs}x{new} tok, 20 replays queued"),
            op: replay_batched,
            against: Against::Baseline("eager, back to back", batched),
            ulps: 0,
        });
        extra.push(KvRow {
            name: "decode, back to back",
            what: format!("bf16 {seqs}x{new} tok, 20 steps queued"),
            op: batched,
            against: Against::Baseline("RoPE, then append", batched_base),
            ulps: 0,
        });
        extra.push(KvRow {
            name: "decode, RoPE only",
            what: format!("{shape}, device"),
            op: rope_alone,
            against: Against::Baseline("fused step", device),
            ulps: 0,
        });
        extra.push(KvRow {
            name: "empty kernel",
            what: format!("{blocks} blocks of 128, eager"),
            op: empty_eager,
            against: Against::Baseline("device", empty_device),
            ulps: 0,
        });
        extra.push(KvRow {
            name: "empty, graph replay",
            what: format!("{blocks} blocks of 128, device"),
            op: empty_replay,
            against: Against::Baseline("decode, graph replay", replay),
            ulps: 0,
        });
        extra.push(KvRow {
            name: "empty, graph b2b",
            what: "20 replays queued".into(),
            op: empty_replay_batched,
            against: Against::Baseline("decode, graph b2b", replay_batched),
            ulps: 0,
        });
        extra.push(KvRow {
            name: "copy kernel, device",
            what: format!("{} KB each way, 16 B a thread", step_elems * 2 / 1024),
            op: touch_device,
            against: Against::Baseline("decode step, device", device),
            ulps: 0,
        });
        extra.push(KvRow {
            name: "copy kernel, graph",
            what: "replay, device".into(),
            op: touch_replay,
            against: Against::Baseline("decode, graph replay", replay),
            ulps: 0,
        });
        extra.push(KvRow {
            name: "copy kernel, graph b2b",
            what: "20 replays queued".into(),
            op: touch_batched,
            against: Against::Baseline("decode, graph b2b", replay_batched),
            ulps: 0,
        });
        extra.push(KvRow {
            name: "host, queue a step",
            what: "CPU time of one fused call".into(),
            op: host,
            against: Against::Baseline("empty kernel", host_empty),
            ulps: 0,
        });
        Against::Baseline("RoPE, then append", base)
    } else {
        // q read and written; k and v read; k and v written into the cache: a copy of half
        // that many elements moves the same bytes.
        let accesses = tokens * (2 * hq + 4 * hk) * d;
        let src = upload(&seeded(15, accesses / 2))?;
        let mut dst = upload(&seeded(16, accesses / 2))?;
        let copy = time_op(stream, 20, runs, || copy_d2d(&src, &mut dst, stream))?;
        extra.push(KvRow {
            name: "prefill + QK-norm",
            what: format!("bf16 {seqs}x{new} tok, Qwen3 norm"),
            op: norm_op,
            against: Against::Copy(copy, (2 * accesses) as u64),
            ulps: 0,
        });
        extra.push(KvRow {
            name: "prefill + OLMo 2 norm",
            what: format!("bf16 {seqs}x{new} tok, whole projections"),
            op: olmo_op,
            against: Against::Copy(copy, (2 * accesses) as u64),
            ulps: 0,
        });
        // QK-norm + RoPE alone, q and k in place (no cache): q and k read and written.
        let mut dk3 = upload(&kh)?;
        let rope_norm = time_op(stream, 20, runs, || {
            let mut q = TensorMut::new(&mut dq, ql);
            let mut k = TensorMut::new(&mut dk3, kl);
            rope.apply(RopeArgs::in_place(&mut q, pos).k(&mut k).norm(QkNorm::rms(&qw, &kw, 1e-6)), stream)
        })?;
        let qk = tokens * (hq + hk) * d;
        let (src, mut dst) = (upload(&seeded(15, qk))?, upload(&seeded(16, qk))?);
        let copy_qk = time_op(stream, 20, runs, || copy_d2d(&src, &mut dst, stream))?;
        extra.push(KvRow {
            name: "QK-norm + RoPE, no cache",
            what: format!("bf16 {seqs}x{new} tok, in place, Qwen3 norm"),
            op: rope_norm,
            against: Against::Copy(copy_qk, (4 * qk) as u64),
            ulps: 0,
        });
        Against::Copy(copy, (2 * accesses) as u64)
    };
    let name = if decode { "decode step, eager" } else { "prefill chunk, fused" };
    Ok(KvRow { name, what: format!("bf16 {seqs}x{new} tok 32/8 h d128 paged 16"), op, against, ulps })
}

/// A decode step as an engine's loop runs it: 64 sequences at scattered positions of a
/// 131072-position context, every sequence one position further at each step, so that no
/// step reads the positions of the one before (the fused launch of [`step`], device time).
fn spread_decode(kernels: &std::sync::Arc<Kernels>, stream: &Stream) -> Res<KvRow> {
    let (seqs, hq, hk, d, bs, max_pos) = (64, 32, 8, 128, 16, 131_072);
    let (warmup, runs) = (20usize, 200);
    let steps = warmup + runs;
    let bps = steps.div_ceil(bs);
    let cache_layout = Layout::bshd(seqs * bps, bs, hk, d);
    let rope = Rope::new(kernels, crate::cos_sin(RopeConfig::new(d, max_pos).base(500_000.0).dtype(DType::BF16))?)?;
    // Sequence i starts at a scattered position and owns blocks i * bps ..; step k writes
    // its slot k.
    let start: Vec<usize> =
        (0..seqs as u64).map(|i| (uniform(23, 0, i).abs() as f64 * (max_pos - steps) as f64) as usize).collect();
    let positions: Vec<i32> = (0..steps).flat_map(|k| start.iter().map(move |&p| (p + k) as i32)).collect();
    let slots: Vec<i64> =
        (0..steps).flat_map(|k| (0..seqs).map(move |i| ((i * bps + k / bs) * bs + k % bs) as i64)).collect();
    let (dpos, dslots) = (DeviceBuffer::from_slice(&positions)?, DeviceBuffer::from_slice(&slots)?);
    let qh = seeded(30, seqs * hq * d);
    let (mut dq, dk, dv) = (upload(&qh)?, upload(&seeded(31, seqs * hk * d))?, upload(&seeded(32, seqs * hk * d))?);
    let cache_n = seqs * bps * bs * hk * d;
    let (mut kc, mut vc) = (upload(&seeded(33, cache_n))?, upload(&seeded(34, cache_n))?);
    let (ql, kl) = (Layout::bshd(seqs, 1, hq, d), Layout::bshd(seqs, 1, hk, d));
    // Step `k` (its slots), at its own positions or, with `fixed`, every sequence at 2048.
    let same = DeviceBuffer::from_slice(&vec![2048i32; seqs])?;
    let mut run_step = |k: usize, fixed: bool, dq: &mut DeviceBuffer<bf16>| {
        let (pos, slot) = (dpos.index(k * seqs..(k + 1) * seqs), dslots.index(k * seqs..(k + 1) * seqs));
        let mut cache = KvCache::paged(&mut kc, &mut vc, cache_layout);
        let mut q = TensorMut::new(dq, ql);
        rope.append_kv(
            rope_cuda::KvAppend::new(
                &Tensor::new(&dk, kl),
                &Tensor::new(&dv, kl),
                &mut cache,
                Positions::ids_i32(if fixed { &same } else { &pos }),
            )
            .q(&mut q)
            .slots(&slot),
            stream,
        )
    };
    // Check once: step 0's q rows (every head of every fifth sequence) within 1 ulp.
    run_step(0, false, &mut dq)?;
    rope.check_errors(stream)?;
    let q_out = download(&dq)?;
    let mut ulps = 0;
    for t in (0..seqs).step_by(5) {
        for hh in 0..hq {
            let at = (t * hq + hh) * d;
            let x: Vec<f64> = qh[at..at + d].iter().map(|v| v.to_f64()).collect();
            let y = rope_row(&x, positions[t] as f64, 500_000.0, d, RopeStyle::NeoX, Direction::Forward);
            for (j, want) in y.into_iter().enumerate() {
                ulps = ulps.max(q_out[at + j].ulps(bf16::round(want)));
            }
        }
    }
    let mut timed = |fixed: bool| {
        let mut k = 0;
        time_device(kernels, stream, warmup, runs, || {
            k += 1;
            run_step(k - 1, fixed, &mut dq)
        })
    };
    let op = timed(false)?;
    rope.check_errors(stream)?;
    // The same steps with every sequence at position 2048, as `step` times them.
    let fixed = timed(true)?;
    Ok(KvRow {
        name: "decode, spread positions",
        what: format!("bf16 {seqs}x1 tok, 131072 ctx, device"),
        op,
        against: Against::Baseline("all at 2048", fixed),
        ulps,
    })
}

/// Decode as an engine replays it: 32 layers' fused steps (64 sequences x 1 token at position
/// 2048, 32/8 heads of 128, bf16, paged 16), each layer its own q, k, v and caches, recorded
/// into one graph with [`Graph::record`] and replayed back to back; device time per layer,
/// next to 32 copy kernels of each layer's bytes (q, k and v read, as many written) and 32
/// empty kernels recorded and replayed the same way. Checked once: every layer's q rows of a
/// sample of sequences within 1 ulp after one replay.
fn layered_decode(kernels: &std::sync::Arc<Kernels>, stream: &Stream) -> Res<Vec<KvRow>> {
    let (layers, seqs, hq, hk, d, bs) = (32usize, 64usize, 32, 8, 128, 16);
    let rope = Rope::new(kernels, crate::cos_sin(RopeConfig::new(d, 8192).base(500_000.0).dtype(DType::BF16))?)?;
    // Sequence i's token at position 2048, in block i (slot 2048 % 16 of it).
    let (positions, slots): (Vec<i32>, Vec<i64>) = (0..seqs).map(|i| (2048, (i * bs + 2048 % bs) as i64)).unzip();
    let (dpos, dslots) = (DeviceBuffer::from_slice(&positions)?, DeviceBuffer::from_slice(&slots)?);
    let cache_layout = Layout::bshd(seqs, bs, hk, d);
    let (ql, kl) = (Layout::bshd(seqs, 1, hq, d), Layout::bshd(seqs, 1, hk, d));
    let qh: Vec<Vec<bf16>> = (0..layers as u64).map(|l| seeded(40 + l, seqs * hq * d)).collect();
    let (kh, vh) = (seeded(38, seqs * hk * d), seeded(39, seqs * hk * d));
    let cache_n = seqs * bs * hk * d;
    let mut q = qh.iter().map(|h| upload(h)).collect::<Res<Vec<_>>>()?;
    let (k, v) = (
        (0..layers).map(|_| upload(&kh)).collect::<Res<Vec<_>>>()?,
        (0..layers).map(|_| upload(&vh)).collect::<Res<Vec<_>>>()?,
    );
    let cache = seeded(37, cache_n);
    let mut kc = (0..layers).map(|_| upload(&cache)).collect::<Res<Vec<_>>>()?;
    let mut vc = (0..layers).map(|_| upload(&cache)).collect::<Res<Vec<_>>>()?;
    let pos = Positions::ids_i32(&dpos);
    let graph = Graph::record(|| {
        for l in 0..layers {
            let mut cache = KvCache::paged(&mut kc[l], &mut vc[l], cache_layout);
            let mut qt = TensorMut::new(&mut q[l], ql);
            rope.append_kv(
                rope_cuda::KvAppend::new(&Tensor::new(&k[l], kl), &Tensor::new(&v[l], kl), &mut cache, pos)
                    .q(&mut qt)
                    .slots(&dslots),
                stream,
            )?;
        }
        Ok(())
    })?;
    // SAFETY: the buffers and `rope` the graphs name live to the end of
    // this function, and each timing synchronises the stream before returning.
    unsafe { graph.launch(stream)? };
    rope.check_errors(stream)?;
    let mut ulps = 0;
    for (l, host) in qh.iter().enumerate() {
        let out = download(&q[l])?;
        for t in (l % 5..seqs).step_by(5) {
            for hh in 0..hq {
                let at = (t * hq + hh) * d;
                let x: Vec<f64> = host[at..at + d].iter().map(|v| v.to_f64()).collect();
                let y = rope_row(&x, 2048.0, 500_000.0, d, RopeStyle::NeoX, Direction::Forward);
                for (j, want) in y.into_iter().enumerate() {
                    ulps = ulps.max(out[at + j].ulps(bf16::round(want)));
                }
            }
        }
    }
    let step_elems = seqs * (hq + 2 * hk) * d;
    let src = (0..layers).map(|l| upload(&seeded(80 + l as u64, step_elems))).collect::<Res<Vec<_>>>()?;
    let mut dst = (0..layers).map(|l| upload(&seeded(120 + l as u64, step_elems))).collect::<Res<Vec<_>>>()?;
    let copies = Graph::record(|| (0..layers).try_for_each(|l| touch(kernels, stream, &src[l], &mut dst[l])))?;
    let blocks = (step_elems / 8).div_ceil(128) as u32;
    let empties = Graph::record(|| (0..layers).try_for_each(|_| empty(kernels, stream, blocks)))?;
    let per_layer =
        |t: Timing| Timing { median_us: t.median_us / layers as f64, p90_us: t.p90_us / layers as f64, ..t };
    // SAFETY: the buffers and `rope` the graphs name live to the end of this function; each timing synchronises the stream.
    let replay = |g: &Graph| time_batched(stream, 5, 50, 10, || unsafe { g.launch(stream) }).map(per_layer);
    let (op, copy, none) = (replay(&graph)?, replay(&copies)?, replay(&empties)?);
    let shape = format!("bf16 {seqs}x1 tok, {layers} layers, graph");
    Ok(vec![
        KvRow {
            name: "decode, layers in graph",
            what: format!("{shape}, per layer"),
            op,
            against: Against::Baseline("copy kernel, same graph", copy),
            ulps,
        },
        KvRow {
            name: "empty, layers in graph",
            what: format!("{layers} x {blocks} blocks of 128, per layer"),
            op: none,
            against: Against::Baseline("decode, layers in graph", op),
            ulps: 0,
        },
    ])
}

/// [`step`] into an E4M3 paged cache (one scale for keys and one for values, as engines and
/// FlashInfer's fused kernel hold them; q rotated in place): the decode step's device time
/// against the bf16 cache's in the same run, or the prefill chunk against a copy of the bytes
/// it must move (q, k and v read in bf16, q written in bf16, k and v written in FP8). Checked
/// on a sample: every key and value code equal to the model's.
fn fp8_step(kernels: &std::sync::Arc<Kernels>, stream: &Stream, seqs: usize, new: usize) -> Res<KvRow> {
    let (hq, hk, d) = (32, 8, 128);
    let tokens = seqs * new;
    let (cache_layout, positions, slots) = paged_step(seqs, new);
    let (blocks, bs) = (cache_layout.shape[0], cache_layout.shape[1]);
    let rope = Rope::new(kernels, crate::cos_sin(RopeConfig::new(d, 8192).base(500_000.0).dtype(DType::BF16))?)?;
    let (kh, vh) = (seeded(11, tokens * hk * d), seeded(12, tokens * hk * d));
    let (mut dq, dk, dv) = (upload(&seeded(10, tokens * hq * d))?, upload(&kh)?, upload(&vh)?);
    let cache_n = blocks * bs * hk * d;
    let (mut kc, mut vc) =
        (DeviceBuffer::from_slice(&vec![F8E4M3(0); cache_n])?, DeviceBuffer::from_slice(&vec![F8E4M3(0); cache_n])?);
    // FlashInfer's row's scale: 1.5 amax / 224 (the inputs are uniform in [-1, 1)).
    let (k_scale, v_scale) = (1.5f32 / 224.0, 1.5f32 / 224.0 * 0.75);
    let (dks, dvs) = (DeviceBuffer::from_slice(&[k_scale])?, DeviceBuffer::from_slice(&[v_scale])?);
    let (dpos, dslots) = (DeviceBuffer::from_slice(&positions)?, DeviceBuffer::from_slice(&slots)?);
    let (ql, kl) = (Layout::bshd(seqs, new, hq, d), Layout::bshd(seqs, new, hk, d));
    let pos = Positions::ids_i32(&dpos);
    let mut fused = |dq: &mut DeviceBuffer<bf16>| {
        let mut cache = KvCache::paged(&mut kc, &mut vc, cache_layout).scales(KvScales::per_tensor(&dks, &dvs));
        let mut q = TensorMut::new(dq, ql);
        rope.append_kv(
            rope_cuda::KvAppend::new(&Tensor::new(&dk, kl), &Tensor::new(&dv, kl), &mut cache, pos)
                .q(&mut q)
                .slots(&dslots),
            stream,
        )
    };
    fused(&mut dq)?;
    rope.check_errors(stream)?;
    let runs = 200;
    let (op, against) = if new == 1 {
        let op = time_device(kernels, stream, 20, runs, || fused(&mut dq))?;
        // The same step into bf16 caches, timed the same way in the same run.
        let (mut kc16, mut vc16) = (upload(&seeded(13, cache_n))?, upload(&seeded(14, cache_n))?);
        let bf16_step = time_device(kernels, stream, 20, runs, || {
            let mut cache = KvCache::paged(&mut kc16, &mut vc16, cache_layout);
            let mut q = TensorMut::new(&mut dq, ql);
            rope.append_kv(
                rope_cuda::KvAppend::new(&Tensor::new(&dk, kl), &Tensor::new(&dv, kl), &mut cache, pos)
                    .q(&mut q)
                    .slots(&dslots),
                stream,
            )
        })?;
        (op, Against::Baseline("bf16 cache, device", bf16_step))
    } else {
        let op = time_op(stream, 20, runs, || fused(&mut dq))?;
        // q read and written, k and v read in bf16; k and v written in FP8.
        let bytes = tokens * d * (2 * 2 * hq + 2 * 2 * hk + 2 * hk);
        let src = upload(&seeded(15, bytes / 4))?;
        let mut dst = upload(&seeded(16, bytes / 4))?;
        let copy = time_op(stream, 20, runs, || copy_d2d(&src, &mut dst, stream))?;
        (op, Against::Copy(copy, bytes as u64))
    };
    // Every code of a sample of tokens' key and value rows against the model: the rotation
    // rounded to f32, divided by the scale, converted.
    let (mut k8, mut v8) = (vec![F8E4M3(0); cache_n], vec![F8E4M3(0); cache_n]);
    kc.copy_to(&mut k8[..])?;
    vc.copy_to(&mut v8[..])?;
    let mut ulps = 0;
    let order = |c: u8| if c & 0x80 != 0 { -i64::from(c & 0x7F) } else { i64::from(c) };
    for t in (0..tokens).step_by(7.max(tokens / 512)) {
        let at = slots[t] as usize * hk * d;
        for hh in 0..hk {
            let x: Vec<f64> = kh[(t * hk + hh) * d..][..d].iter().map(|v| v.to_f64()).collect();
            let y = rope_row(&x, positions[t] as f64, 500_000.0, d, RopeStyle::NeoX, Direction::Forward);
            for (j, &yj) in y.iter().enumerate() {
                let (i, src) = (at + hh * d + j, (t * hk + hh) * d + j);
                let (want_k, want_v) =
                    (F8E4M3::from_f32(yj as f32 / k_scale), F8E4M3::from_f32(vh[src].to_f32() / v_scale));
                ulps = ulps.max(order(k8[i].0).abs_diff(order(want_k.0)));
                ulps = ulps.max(order(v8[i].0).abs_diff(order(want_v.0)));
            }
        }
    }
    let name = if new == 1 { "fp8 decode, device" } else { "fp8 prefill, fused" };
    Ok(KvRow { name, what: format!("bf16->e4m3 {seqs}x{new} tok 32/8 h d128 pg16"), op, against, ulps })
}

/// DeepSeek-V3's MLA step ([`Rope::append_mla`]): `tokens` tokens of 128 heads whose q is
/// `[tokens, 128, 192]` (the rotary part the last 64 of each head, rotated in place), kv_c and
/// k_pe the two parts of the kv_a projection's `[tokens, 576]`, into a paged bf16 latent cache
/// `[4096, 64, 576]` (vLLM's layout), interleaved pairs. Decode (64 tokens): one request a
/// token at scattered slots and positions, device time, warm and with L2 flushed (peers' row
/// I-decode); prefill: 4 requests of `tokens / 4` from position 0 on pages drawn from the cache.
/// Against a copy of the bytes it moves: q_pe read and written, kv_c and k_pe read, the rows
/// written.
fn mla_step(kernels: &std::sync::Arc<Kernels>, stream: &Stream, tokens: usize) -> Res<Vec<KvRow>> {
    use rope_cuda::reference::splitmix64;
    use rope_cuda::{MlaAppend, MlaCache};
    let (heads, nope, pe, rank, blocks, bs) = (128, 128, 64, 512, 4096, 64);
    let (qd, w) = (nope + pe, rank + pe);
    let decode = tokens <= 64;
    let (positions, slots): (Vec<i32>, Vec<i64>) = match decode {
        true => {
            // Distinct slots: a seeded shuffle's first `tokens`.
            let mut all: Vec<i64> = (0..(blocks * bs) as i64).collect();
            for i in (1..all.len()).rev() {
                all.swap(i, (splitmix64(i as u64) % (i as u64 + 1)) as usize);
            }
            let pos = (0..tokens).map(|t| (splitmix64(t as u64 ^ 0xD5) % 8192) as i32).collect();
            (pos, all[..tokens].to_vec())
        }
        false => {
            let per = tokens / 4;
            let mut pages: Vec<i64> = (0..blocks as i64).collect();
            for i in (1..pages.len()).rev() {
                pages.swap(i, (splitmix64(i as u64 ^ 0xA11) % (i as u64 + 1)) as usize);
            }
            let slot = |t: usize| pages[(t / per) * (per / bs) + (t % per) / bs] * bs as i64 + (t % per % bs) as i64;
            ((0..tokens).map(|t| (t % per) as i32).collect(), (0..tokens).map(slot).collect())
        }
    };
    let rope =
        Rope::new(kernels, crate::cos_sin(RopeConfig::new(pe, 8192).style(RopeStyle::GptJ).dtype(DType::BF16))?)?;
    let (qh, kv_a) = (seeded(30, tokens * heads * qd), seeded(31, tokens * w));
    let mut dq = upload(&qh)?;
    let dkv = upload(&kv_a)?;
    let mut dc = upload(&seeded(32, blocks * bs * w))?;
    let (dpos, dslots) = (DeviceBuffer::from_slice(&positions)?, DeviceBuffer::from_slice(&slots)?);
    let q_pe = Layout::strided([1, tokens, heads, pe], [tokens * heads * qd, heads * qd, qd], nope);
    let (kv_c, k_pe) = (
        Layout::strided([1, tokens, 1, rank], [tokens * w, w, w], 0),
        Layout::strided([1, tokens, 1, pe], [tokens * w, w, w], rank),
    );
    let cache_layout = Layout::bshd(blocks, bs, 1, w);
    // kv_c's norm (`kv_a_layernorm`, eps 1e-6), for the rows that take it in the launch.
    let weight: Vec<bf16> = seeded(37, rank).iter().map(|w| bf16::from_f32(0.5 + w.to_f32())).collect();
    let dw = upload(&weight)?;
    let call = |dq: &mut DeviceBuffer<bf16>, dc: &mut DeviceBuffer<bf16>, norm: bool| {
        let mut cache = MlaCache::paged(dc, cache_layout, &rope_cuda::MlaGeometry::new(rank, 64, 128, 128, 128));
        let mut q = TensorMut::new(dq, q_pe);
        let (c, k) = (Tensor::new(&dkv, kv_c), Tensor::new(&dkv, k_pe));
        let a = MlaAppend::new(&c, &k, &mut cache, Positions::ids_i32(&dpos)).slots(&dslots).q_pe(&mut q);
        rope.append_mla(if norm { a.kv_c_norm(&dw, 1e-6) } else { a }, stream)
    };
    let op = |dq: &mut DeviceBuffer<bf16>, dc: &mut DeviceBuffer<bf16>| call(dq, dc, false);
    let normed = |dq: &mut DeviceBuffer<bf16>, dc: &mut DeviceBuffer<bf16>| call(dq, dc, true);
    // The check: one call on fresh q, then a sample of tokens' rows and q heads.
    op(&mut dq, &mut dc)?;
    rope.check_errors(stream)?;
    let (q_after, cache) = (download(&dq)?, download(&dc)?);
    let mut ulps = 0;
    for t in (0..tokens).step_by(7.max(tokens / 256)) {
        let y = |x: &[bf16]| {
            let x: Vec<f64> = x.iter().map(|v| v.to_f64()).collect();
            rope_row(&x, positions[t] as f64, 10_000.0, pe, RopeStyle::GptJ, Direction::Forward)
        };
        let at = slots[t] as usize * w;
        // kv_c bit for bit (an error of "ulps" past any rounding).
        if cache[at..at + rank] != kv_a[t * w..t * w + rank] {
            ulps = u64::MAX;
        }
        for (j, &yj) in y(&kv_a[t * w + rank..(t + 1) * w]).iter().enumerate() {
            ulps = ulps.max(cache[at + rank + j].ulps(bf16::round(yj)));
        }
        for h in (0..heads).step_by(9) {
            let at = (t * heads + h) * qd;
            for (j, &yj) in y(&qh[at + nope..at + qd]).iter().enumerate() {
                ulps = ulps.max(q_after[at + nope + j].ulps(bf16::round(yj)));
            }
            if q_after[at..at + nope] != qh[at..at + nope] {
                ulps = u64::MAX;
            }
        }
    }
    // The same step with kv_c normalized: the sampled rows' kv_c against the f64 norm.
    normed(&mut dq, &mut dc)?;
    rope.check_errors(stream)?;
    let cache = download(&dc)?;
    let w64: Vec<f64> = weight.iter().map(|v| v.to_f64()).collect();
    let mut norm_ulps = 0;
    for t in (0..tokens).step_by(7.max(tokens / 256)) {
        let x: Vec<f64> = kv_a[t * w..t * w + rank].iter().map(|v| v.to_f64()).collect();
        let y = rope_cuda::reference::rms_norm_row(&x, Some(&w64), 0.0, 1e-6f32 as f64);
        for (j, &yj) in y.iter().enumerate() {
            norm_ulps = norm_ulps.max(cache[slots[t] as usize * w + j].ulps(bf16::round(yj)));
        }
    }
    // q_pe read and written, kv_c and k_pe read, the rows written (bytes).
    let bytes = tokens * (2 * heads * pe + 2 * w) * 2;
    let src = upload(&seeded(33, bytes / 4))?;
    let mut dst = upload(&seeded(34, bytes / 4))?;
    let runs = 200;
    let what = format!("bf16 {tokens} tok 128 h, 512+64, pg64");
    let mut rows = Vec::new();
    if decode {
        let device = time_device(kernels, stream, 20, runs, || op(&mut dq, &mut dc))?;
        let device_norm = time_device(kernels, stream, 20, runs, || normed(&mut dq, &mut dc))?;
        let copy = time_device(kernels, stream, 20, runs, || copy_d2d(&src, &mut dst, stream))?;
        // With L2 flushed before each run (a 256 MiB memset outside the events), as peers time.
        let flush = DeviceBuffer::from_slice(&vec![0u32; 64 << 20])?;
        // The flush, then a spin kernel that keeps the stream busy while the timed launch queues.
        let cold = || {
            flush_l2(&flush, stream)?;
            rope_cuda::bench::spin(kernels, stream, 200_000)
        };
        let flushed = rope_cuda::bench::time_after(stream, 20, runs, &cold, || op(&mut dq, &mut dc))?;
        rows.push(KvRow {
            name: "mla decode, device",
            what: what.clone(),
            op: device,
            against: Against::Copy(copy, bytes as u64),
            ulps,
        });
        // As the peers time their rows: CUDA events around each call (the host's queueing
        // inside them), L2 flushed before.
        let events =
            rope_cuda::bench::time_after(stream, 20, runs, || flush_l2(&flush, stream), || op(&mut dq, &mut dc))?;
        // The least any kernel that reads these bytes and writes them costs, timed the same way.
        let touch_flushed =
            rope_cuda::bench::time_after(stream, 20, runs, &cold, || touch(kernels, stream, &src, &mut dst))?;
        rows.push(KvRow {
            name: "mla decode, L2 flushed",
            what: what.clone(),
            op: flushed,
            against: Against::Baseline("warm L2", device),
            ulps: 0,
        });
        rows.push(KvRow {
            name: "mla decode, as peers",
            what: "events around the call, L2 flushed".into(),
            op: events,
            against: Against::Baseline("device, L2 flushed", flushed),
            ulps: 0,
        });
        rows.push(KvRow {
            name: "copy kernel, L2 flushed",
            what: format!("the step's {} KB each way, device", bytes / 2048),
            op: touch_flushed,
            against: Against::Baseline("mla decode, L2 flushed", flushed),
            ulps: 0,
        });
        rows.push(KvRow {
            name: "mla decode + kv_c norm",
            what: "kv_a_layernorm in the launch, device".into(),
            op: device_norm,
            against: Against::Baseline("mla decode, device", device),
            ulps: norm_ulps,
        });
    } else {
        let fused = time_op(stream, 20, runs, || op(&mut dq, &mut dc))?;
        let fused_norm = time_op(stream, 20, runs, || normed(&mut dq, &mut dc))?;
        let copy = time_op(stream, 20, runs, || copy_d2d(&src, &mut dst, stream))?;
        // The access pattern's own yardstick: q_pe's 128 bytes of every 384 copied by a copy
        // kernel of strided rows (16 bytes a thread, read and written at q_pe's offsets), plus
        // a copy of the latent rows' bytes.
        let mut dq2 = upload(&qh)?;
        let q_bytes = |b: &DeviceBuffer<bf16>| b.as_device_ptr().as_raw() + (nope * 2) as u64;
        let (from, to) = (q_bytes(&dq), q_bytes(&dq2));
        let shape = ((pe * 2) as u64, (qd * 2) as u64, (tokens * heads) as u64);
        // SAFETY: both buffers hold q's `tokens * heads` rows of `qd` elements, alive until the
        // timing's synchronisation.
        let strided = time_op(stream, 20, runs, || unsafe { touch_rows(kernels, stream, (from, to), shape) })?;
        let row_bytes = tokens * w * 2;
        let (rs, mut rd) = (upload(&seeded(35, row_bytes / 2))?, upload(&seeded(36, row_bytes / 2))?);
        let rows_copy = time_op(stream, 20, runs, || copy_d2d(&rs, &mut rd, stream))?;
        let both = Timing {
            median_us: strided.median_us + rows_copy.median_us,
            p90_us: strided.p90_us + rows_copy.p90_us,
            runs,
        };
        // RoPE alone on q_pe, in place (the q part of the step).
        let rope_q = time_op(stream, 20, runs, || {
            let mut q = TensorMut::new(&mut dq2, q_pe);
            rope.apply(RopeArgs::in_place(&mut q, Positions::ids_i32(&dpos)), stream)
        })?;
        rows.push(KvRow {
            name: "mla prefill, fused",
            what: what.clone(),
            op: fused,
            against: Against::Copy(copy, bytes as u64),
            ulps,
        });
        rows.push(KvRow {
            name: "mla prefill, strided",
            what: "vs strided copy of q_pe + rows".into(),
            op: fused,
            against: Against::Baseline("strided + row copy", both),
            ulps: 0,
        });
        rows.push(KvRow {
            name: "mla prefill + kv_c norm",
            what: "kv_a_layernorm in the launch".into(),
            op: fused_norm,
            against: Against::Copy(copy, bytes as u64),
            ulps: norm_ulps,
        });
        rows.push(KvRow {
            name: "mla q_pe RoPE alone",
            what: "in place, 128 of every 384 bytes".into(),
            op: rope_q,
            against: Against::Baseline("strided copy of q_pe", strided),
            ulps: 0,
        });
    }
    Ok(rows)
}

/// The KV shift ([`Rope::shift_kv`](rope_cuda::Rope::shift_kv)) of a 32768-token paged cache
/// (2048 pages of 16 slots, 8 kv heads of 128): 4 sequences of 8192 rows on shuffled pages,
/// each sequence's keys turned in place by its delta (-4096, -1, 1000, -2^20), bf16 and E4M3
/// (one scale for the keys, one for the values). Each checked once on a sample of rows against
/// the f64 rotation of the stored key by its delta (bf16 within 1 ulp; FP8 every code equal to
/// the model's: the code's value times the scale in f32, rotated, rounded to f32, divided by
/// the scale, encoded), the value cache bit for bit; then timed against a copy of the key
/// cache's bytes (read and written) in the same run. The timed calls go on turning the same
/// cache (the speed does not depend on the values).
fn shift_paged(kernels: &std::sync::Arc<Kernels>, stream: &Stream) -> Res<Vec<KvRow>> {
    use rope_cuda::reference::splitmix64;
    use rope_cuda::KvShift;
    let (seqs, rows, pages, bs, hk, d) = (4, 8192, 2048, 16, 8, 128);
    let layout = Layout::bshd(pages, bs, hk, d);
    // Sequence i's rows on the pages `order[i * rows / bs ..]`, a seeded shuffle of them all.
    let mut order: Vec<usize> = (0..pages).collect();
    for i in (1..pages).rev() {
        order.swap(i, (splitmix64(i as u64 ^ 0x5F1) % (i as u64 + 1)) as usize);
    }
    let per = rows / bs;
    let slots: Vec<i64> =
        (0..seqs * rows).map(|r| (order[(r / rows) * per + (r % rows) / bs] * bs + r % bs) as i64).collect();
    let deltas: Vec<i32> = vec![-4096, -1, 1000, -(1 << 20)];
    let rope = Rope::new(kernels, crate::cos_sin(RopeConfig::new(d, 1 << 20).dtype(DType::BF16))?)?;
    let (ddeltas, dslots) = (DeviceBuffer::from_slice(&deltas)?, DeviceBuffer::from_slice(&slots)?);
    let n = pages * bs * hk * d;
    // The f64 rotation of row `r`'s key `x` by its sequence's delta (the sine negated for a
    // negative one).
    let turn = |x: &[f64], r: usize| {
        let delta = deltas[r / rows];
        let direction = if delta < 0 { Direction::Inverse } else { Direction::Forward };
        rope_row(x, delta.unsigned_abs() as f64, 10_000.0, d, RopeStyle::NeoX, direction)
    };
    // Every 61st row of the 32768 (each sequence's), and the last.
    let sample: Vec<usize> = (0..seqs * rows).step_by(61).chain([seqs * rows - 1]).collect();
    let runs = 200;
    let what = |ty: &str| format!("{ty} {seqs}x{rows} rows {hk} h d{d} pg{bs}");

    // bf16.
    let (keys, values) = (seeded(50, n), seeded(51, n));
    let (mut kc, mut vc) = (upload(&keys)?, upload(&values)?);
    let shift = |kc: &mut DeviceBuffer<bf16>, vc: &mut DeviceBuffer<bf16>| {
        let mut cache = KvCache::paged(kc, vc, layout);
        rope.shift_kv(KvShift::new(&mut cache, Positions::ids_i32(&ddeltas)).slots(&dslots), stream)
    };
    shift(&mut kc, &mut vc)?;
    rope.check_errors(stream)?;
    let got = download(&kc)?;
    let mut ulps = if download(&vc)? == values { 0 } else { 99 };
    for &r in &sample {
        let at = slots[r] as usize * hk * d;
        for h in 0..hk {
            let x: Vec<f64> = keys[at + h * d..][..d].iter().map(|v| v.to_f64()).collect();
            for (j, y) in turn(&x, r).into_iter().enumerate() {
                ulps = ulps.max(got[at + h * d + j].ulps(bf16::round(y)));
            }
        }
    }
    // The yardstick: a copy of the key cache's bytes (64 MiB), read and written.
    let (src, mut dst) = (upload(&vec![bf16::ZERO; n])?, upload(&vec![bf16::ZERO; n])?);
    let copy = time_op(stream, 20, runs, || copy_d2d(&src, &mut dst, stream))?;
    let op = time_op(stream, 20, runs, || shift(&mut kc, &mut vc))?;
    let bf16_row = KvRow {
        name: "kv shift, paged",
        what: what("bf16"),
        op,
        against: Against::Copy(copy, (2 * n * 2) as u64),
        ulps,
    };
    drop((kc, vc, src, dst));

    // E4M3: the same values' codes at FlashInfer's row's scales (as `fp8_step`).
    let (k_scale, v_scale) = (1.5f32 / 224.0, 1.5f32 / 224.0 * 0.75);
    let codes =
        |v: &[bf16], scale: f32| -> Vec<F8E4M3> { v.iter().map(|x| F8E4M3::from_f32(x.to_f32() / scale)).collect() };
    let (k8, v8) = (codes(&keys, k_scale), codes(&values, v_scale));
    drop((keys, values));
    let (mut kc, mut vc) = (DeviceBuffer::from_slice(&k8)?, DeviceBuffer::from_slice(&v8)?);
    let (dks, dvs) = (DeviceBuffer::from_slice(&[k_scale])?, DeviceBuffer::from_slice(&[v_scale])?);
    let shift = |kc: &mut DeviceBuffer<F8E4M3>, vc: &mut DeviceBuffer<F8E4M3>| {
        let mut cache = KvCache::paged(kc, vc, layout).scales(KvScales::per_tensor(&dks, &dvs));
        rope.shift_kv(KvShift::new(&mut cache, Positions::ids_i32(&ddeltas)).slots(&dslots), stream)
    };
    shift(&mut kc, &mut vc)?;
    rope.check_errors(stream)?;
    let (mut got, mut v_after) = (vec![F8E4M3(0); n], vec![F8E4M3(0); n]);
    kc.copy_to(&mut got[..])?;
    vc.copy_to(&mut v_after[..])?;
    let order = |c: u8| if c & 0x80 != 0 { -i64::from(c & 0x7F) } else { i64::from(c) };
    let mut ulps = if v_after == v8 { 0 } else { 99 };
    for &r in &sample {
        let at = slots[r] as usize * hk * d;
        for h in 0..hk {
            let x: Vec<f64> = k8[at + h * d..][..d].iter().map(|c| (c.to_f32() * k_scale) as f64).collect();
            for (j, y) in turn(&x, r).into_iter().enumerate() {
                let want = F8E4M3::from_f32(y as f32 / k_scale);
                ulps = ulps.max(order(got[at + h * d + j].0).abs_diff(order(want.0)));
            }
        }
    }
    // A copy of the key cache's bytes (32 MiB), read and written.
    let (src, mut dst) = (upload(&vec![bf16::ZERO; n / 2])?, upload(&vec![bf16::ZERO; n / 2])?);
    let copy = time_op(stream, 20, runs, || copy_d2d(&src, &mut dst, stream))?;
    let op = time_op(stream, 20, runs, || shift(&mut kc, &mut vc))?;
    let fp8_row =
        KvRow { name: "fp8 shift, paged", what: what("e4m3"), op, against: Against::Copy(copy, (2 * n) as u64), ulps };
    Ok(vec![bf16_row, fp8_row])
}

/// The fused step (q rotated in place, k and v appended; 32 q and 8 kv heads of 128, bf16,
/// NeoX) into a sliding-window cache ([`KvCache::window`]: blocks of 4096 rows, 4 sinks and a
/// ring of 4092) at positions past the window (sequence b's tokens from 10000 + 997 b on: the
/// ring has wrapped, and a prefill chunk may wrap within the call), next to its twin: the same
/// call into a contiguous cache of the same layout and buffers, at the positions of the rows
/// the window writes (the same rows, bytes and launch shape; a contiguous cache takes
/// positions below its block only). `seqs` sequences of `new` tokens each. Decode: device
/// time, the ring against its twin; prefill: both against a copy of the bytes the step moves
/// (q read and written, k and v read and written into the cache). Each checked once on fresh
/// q: q and the key rows of a sample of tokens within 1 ulp of the f64 rotation at their
/// positions, the value rows bit for bit, and (window) the sink rows untouched.
fn ring_append(kernels: &std::sync::Arc<Kernels>, stream: &Stream, seqs: usize, new: usize) -> Res<Vec<KvRow>> {
    let (hq, hk, d, block, sinks) = (32, 8, 128, 4096, 4);
    let tokens = seqs * new;
    let layout = Layout::bshd(seqs, block, hk, d);
    let ring = |p: usize| if p < sinks { p } else { sinks + (p - sinks) % (block - sinks) };
    let window_pos: Vec<i32> = (0..tokens).map(|t| (10_000 + 997 * (t / new) + t % new) as i32).collect();
    let contig_pos: Vec<i32> = window_pos.iter().map(|&p| ring(p as usize) as i32).collect();
    let rope = Rope::new(kernels, crate::cos_sin(RopeConfig::new(d, 1 << 15).base(500_000.0).dtype(DType::BF16))?)?;
    let (qh, kh, vh) = (seeded(60, tokens * hq * d), seeded(61, tokens * hk * d), seeded(62, tokens * hk * d));
    let (mut dq, dk, dv) = (upload(&qh)?, upload(&kh)?, upload(&vh)?);
    let cache_n = seqs * block * hk * d;
    let (mut kc, mut vc) = (upload(&vec![bf16::ZERO; cache_n])?, upload(&vec![bf16::ZERO; cache_n])?);
    let (dwin, dcon) = (DeviceBuffer::from_slice(&window_pos)?, DeviceBuffer::from_slice(&contig_pos)?);
    let (ql, kl) = (Layout::bshd(seqs, new, hq, d), Layout::bshd(seqs, new, hk, d));
    let append =
        |window: bool, dq: &mut DeviceBuffer<bf16>, kc: &mut DeviceBuffer<bf16>, vc: &mut DeviceBuffer<bf16>| {
            let mut cache = match window {
                true => KvCache::window(kc, vc, layout, sinks),
                false => KvCache::contiguous(kc, vc, layout),
            };
            let mut q = TensorMut::new(dq, ql);
            let pos = Positions::ids_i32(if window { &dwin } else { &dcon });
            rope.append_kv(
                rope_cuda::KvAppend::new(&Tensor::new(&dk, kl), &Tensor::new(&dv, kl), &mut cache, pos).q(&mut q),
                stream,
            )
        };
    // The check: the contiguous twin's call, then the window's, each on fresh q.
    let mut ulps = [0u64; 2];
    for (u, window) in ulps.iter_mut().zip([false, true]) {
        dq.copy_from(&qh[..])?;
        append(window, &mut dq, &mut kc, &mut vc)?;
        rope.check_errors(stream)?;
        let (q_out, k_out, v_out) = (download(&dq)?, download(&kc)?, download(&vc)?);
        let positions = if window { &window_pos } else { &contig_pos };
        for t in (0..tokens).step_by((tokens / 256).max(1)).chain([tokens - 1]) {
            // Both calls write token t to this row of its sequence's block.
            let at = ((t / new) * block + ring(window_pos[t] as usize)) * hk * d;
            for (src, heads, out, to) in [(&qh, hq, &q_out, t * hq * d), (&kh, hk, &k_out, at)] {
                for h in 0..heads {
                    let x: Vec<f64> = src[(t * heads + h) * d..][..d].iter().map(|v| v.to_f64()).collect();
                    let y = rope_row(&x, positions[t] as f64, 500_000.0, d, RopeStyle::NeoX, Direction::Forward);
                    for (j, want) in y.into_iter().enumerate() {
                        *u = (*u).max(out[to + h * d + j].ulps(bf16::round(want)));
                    }
                }
            }
            if v_out[at..at + hk * d] != vh[t * hk * d..(t + 1) * hk * d] {
                *u = 99;
            }
        }
        // No token of the window's call is at a sink position: its sink rows stay zero.
        if window && (0..seqs).any(|b| k_out[b * block * hk * d..][..sinks * hk * d].iter().any(|v| v.to_bits() != 0)) {
            *u = 99;
        }
    }
    // Timing rotates q again and again; the values do not matter for speed.
    let (runs, decode) = (200, new == 1);
    let mut timed = |window: bool| match decode {
        true => time_device(kernels, stream, 20, runs, || append(window, &mut dq, &mut kc, &mut vc)),
        false => time_op(stream, 20, runs, || append(window, &mut dq, &mut kc, &mut vc)),
    };
    // Three rounds, the twins in turn (so that a drift of the clocks falls on both alike); each
    // twin's round of the middle median.
    let mut rounds = [Vec::new(), Vec::new()];
    for _ in 0..3 {
        for (i, window) in [false, true].into_iter().enumerate() {
            rounds[i].push(timed(window)?);
        }
    }
    let [contig, windowed] = rounds.map(|mut r| {
        r.sort_by(|a, b| a.median_us.total_cmp(&b.median_us));
        r.swap_remove(1)
    });
    // q read and written; k and v read; k and v written into the cache: a copy of half that
    // many elements moves the same bytes.
    let accesses = tokens * (2 * hq + 4 * hk) * d;
    let (src, mut dst) = (upload(&seeded(63, accesses / 2))?, upload(&seeded(64, accesses / 2))?);
    let copy = match decode {
        true => time_device(kernels, stream, 20, runs, || copy_d2d(&src, &mut dst, stream))?,
        false => time_op(stream, 20, runs, || copy_d2d(&src, &mut dst, stream))?,
    };
    let bytes = (2 * accesses) as u64;
    let shape = format!("bf16 {seqs}x{new} tok 32/8 h d128{}", if decode { ", device" } else { "" });
    let ring_what = format!("{block} rows, {sinks} sinks, wrapped");
    Ok(match decode {
        true => vec![
            KvRow {
                name: "contig append, decode",
                what: shape,
                op: contig,
                against: Against::Copy(copy, bytes),
                ulps: ulps[0],
            },
            KvRow {
                name: "ring append, decode",
                what: ring_what,
                op: windowed,
                against: Against::Baseline("contiguous, device", contig),
                ulps: ulps[1],
            },
        ],
        false => vec![
            KvRow {
                name: "contig append, prefill",
                what: shape,
                op: contig,
                against: Against::Copy(copy, bytes),
                ulps: ulps[0],
            },
            KvRow {
                name: "ring append, prefill",
                what: ring_what,
                op: windowed,
                against: Against::Copy(copy, bytes),
                ulps: ulps[1],
            },
        ],
    })
}

/// Queues a memset of `flush` (larger than L2) on `stream`: the next launch finds L2 cold.
fn flush_l2(flush: &DeviceBuffer<u32>, stream: &Stream) -> rope_cuda::Result<()> {
    // SAFETY: `flush` holds `flush.len()` words and outlives the work queued on `stream` (the
    // timing synchronises before it returns).
    let r = unsafe { cust::sys::cuMemsetD32Async(flush.as_device_ptr().as_raw(), 0, flush.len(), stream.as_inner()) };
    match r {
        cust::sys::cudaError_enum::CUDA_SUCCESS => Ok(()),
        e => Err(rope_cuda::Error::Driver { call: "cuMemsetD32Async", code: e as u32 }),
    }
}

/// Runs, checks and prints the KV rows; `Ok(false)` if a check failed.
pub fn run(kernels: &std::sync::Arc<Kernels>, stream: &Stream) -> Res<bool> {
    // `ROPE_CUDA_DECODE_ONLY=1`: the decode step's rows alone (a short run for profilers).
    let decode_only = std::env::var_os("ROPE_CUDA_DECODE_ONLY").is_some();
    let mut rows = if decode_only { Vec::new() } else { vec![reference(kernels, stream)?] };
    let mut extra = Vec::new();
    rows.push(step(kernels, stream, 64, 1, true, &mut extra)?);
    extra.push(spread_decode(kernels, stream)?);
    extra.append(&mut layered_decode(kernels, stream)?);
    rows.push(fp8_step(kernels, stream, 64, 1)?);
    if !decode_only {
        rows.push(step(kernels, stream, 4, 512, false, &mut extra)?);
        rows.push(step(kernels, stream, 16, 4096, false, &mut extra)?);
        rows.push(fp8_step(kernels, stream, 16, 4096)?);
    }
    rows.append(&mut mla_step(kernels, stream, 64)?);
    if !decode_only {
        rows.append(&mut mla_step(kernels, stream, 16384)?);
    }
    rows.append(&mut ring_append(kernels, stream, 16, 1)?);
    if !decode_only {
        rows.append(&mut ring_append(kernels, stream, 4, 1024)?);
        rows.append(&mut shift_paged(kernels, stream)?);
    }
    rows.append(&mut extra);
    println!();
    println!(
        "{:<22} {:<34} {:>10} {:>9} {:>26} {:>8} {:>5}",
        "kv operation", "shape", "median us", "p90 us", "against", "ratio", "ulps"
    );
    let mut ok = true;
    for r in &rows {
        let (against, ratio) = match &r.against {
            Against::Copy(c, bytes) => (
                format!("copy {:.2} us {:.0} GB/s", c.median_us, c.gb_per_s(*bytes)),
                format!("{:.1}%", 100.0 * c.median_us / r.op.median_us),
            ),
            Against::Baseline(name, b) => {
                (format!("{name} {:.2} us", b.median_us), format!("{:.2}x", b.median_us / r.op.median_us))
            }
        };
        // FP8 codes are exact; the rest within 1 ulp.
        ok &= r.ulps <= u64::from(!r.name.starts_with("fp8"));
        println!(
            "{:<22} {:<34} {:>10.2} {:>9.2} {:>26} {:>8} {:>5}",
            r.name, r.what, r.op.median_us, r.op.p90_us, against, ratio, r.ulps
        );
    }
    println!(
        "kv accuracy: {} (worst ulps of the sampled outputs, <= 1; FP8 codes: 0)",
        if ok { "ok" } else { "FAILED" }
    );
    Ok(ok)
}
