//! CUDA graphs: a decode step captured or recorded once and replayed with new positions,
//! slots and inputs; recording while other threads use the context; the reference update
//! recorded; calls that cannot go into a graph refused. Its own test binary: a capture is a
//! state of the whole context, and this binary's tests capture while others would work in
//! the same (primary) context — on the H200 that crashed the process inside the driver's
//! `cuModuleUnload` or invalidated the capture (see `Graph::capture`).

mod common;

use common::{download_t, gpu, row_at, test_seed, upload_t, TestElem};
use cust::memory::CopyDestination;
use half::bf16;
use rope_cuda::reference::{rope_row, uniform};
use rope_cuda::{Direction, KvCache, Layout, Positions, Rope, RopeArgs, RopeConfig, RopeStyle, Tensor, TensorMut};

/// A decode step captured into a CUDA graph once, then replayed three times with new
/// positions, slots and inputs written into the captured buffers between replays: q and
/// every element of both caches checked after each replay (rotations within one ulp of the
/// f64 reference, values and untouched rows bit-exact).
/// Tests that capture run alone: a capture is a state of the whole (primary) context, which
/// the other tests of this binary share (see `Graph::capture`); the others run together.
static CONTEXT: std::sync::RwLock<()> = std::sync::RwLock::new(());

fn alone() -> std::sync::RwLockWriteGuard<'static, ()> {
    CONTEXT.write().unwrap_or_else(|e| e.into_inner())
}

fn together() -> std::sync::RwLockReadGuard<'static, ()> {
    CONTEXT.read().unwrap_or_else(|e| e.into_inner())
}

#[test]
fn decode_step_replays_from_a_captured_graph() {
    let _alone = alone();
    decode_step_replays("decode_step_replays_from_a_captured_graph", false);
}

/// The same with [`rope_cuda::Graph::record`].
#[test]
fn decode_step_replays_from_a_recorded_graph() {
    let _together = together();
    decode_step_replays("decode_step_replays_from_a_recorded_graph", true);
}

fn decode_step_replays(test: &str, record: bool) {
    let Some(g) = gpu(test) else { return };
    let seed = test_seed(test);
    let (seqs, hq, hk, d, bs, per_seq) = (8, 4, 2, 64, 16, 4);
    let blocks = seqs * per_seq;
    let rope = Rope::new(&g.kernels, RopeConfig::new(d, 1024).dtype(rope_cuda::DType::BF16)).unwrap();
    let (ql, kl, cl) = (Layout::bshd(seqs, 1, hq, d), Layout::bshd(seqs, 1, hk, d), Layout::bshd(blocks, bs, hk, d));
    let cache_n = blocks * bs * hk * d;
    let seeded = |tensor: u64, n: usize| -> Vec<bf16> {
        (0..n as u64).map(|i| bf16::from_f32(uniform(seed, tensor, i))).collect()
    };
    let (mut k_cache, mut v_cache) = (seeded(1, cache_n), seeded(2, cache_n));
    let (mut dq, mut dk, mut dv) =
        (upload_t(&seeded(3, seqs * hq * d)), upload_t(&seeded(4, seqs * hk * d)), upload_t(&seeded(5, seqs * hk * d)));
    let (mut kc, mut vc) = (upload_t(&k_cache), upload_t(&v_cache));
    let (mut dpos, mut dslots) = (upload_t(&vec![0i32; seqs]), upload_t(&vec![-1i64; seqs]));
    let step = || {
        let mut q = TensorMut::new(&mut dq, ql);
        let mut cache = KvCache::paged(&mut kc, &mut vc, cl);
        let (k, v) = (Tensor::new(&dk, kl), Tensor::new(&dv, kl));
        rope.append_kv(
            rope_cuda::KvAppend::new(&k, &v, &mut cache, Positions::ids_i32(&dpos)).q(&mut q).slots(&dslots),
            &g.stream,
        )
    };
    let graph = if record { rope_cuda::Graph::record(step) } else { rope_cuda::Graph::capture(&g.stream, step) };
    let graph = graph.unwrap();
    // Nothing ran during capture.
    assert_eq!(download_t(&kc), k_cache);
    for step in 0..3u64 {
        // Sequence i owns blocks i * per_seq ..; this step's token is at 100 + 9 * step + i.
        let positions: Vec<i32> = (0..seqs).map(|i| 100 + 9 * step as i32 + i as i32).collect();
        let slots: Vec<i64> = positions
            .iter()
            .enumerate()
            .map(|(i, &p)| (i * per_seq * bs) as i64 + (p as i64 % (per_seq * bs) as i64))
            .collect();
        let (q, k, v) =
            (seeded(10 + step, seqs * hq * d), seeded(20 + step, seqs * hk * d), seeded(30 + step, seqs * hk * d));
        use cust::memory::CopyDestination;
        for (dst, src) in [(&mut dq, &q), (&mut dk, &k), (&mut dv, &v)] {
            dst.copy_from(&src[..]).unwrap();
        }
        dpos.copy_from(&positions[..]).unwrap();
        dslots.copy_from(&slots[..]).unwrap();
        // SAFETY: every buffer the graph names lives until the test synchronises the stream.
        unsafe { graph.launch(&g.stream) }.unwrap();
        g.stream.synchronize().unwrap();
        rope.check_errors(&g.stream).unwrap();
        let (q_out, kc_out, vc_out) = (download_t(&dq), download_t(&kc), download_t(&vc));
        for i in 0..seqs {
            let p = positions[i] as f64;
            let (block, within) = (slots[i] as usize / bs, slots[i] as usize % bs);
            for (src, heads, out, at) in [
                (&q, hq, &q_out, (0..hq).map(|h| i * hq * d + h * d).collect::<Vec<_>>()),
                (&k, hk, &kc_out, (0..hk).map(|h| row_at(&cl, block, within, h)).collect()),
            ] {
                for h in 0..heads {
                    let x: Vec<f64> = src[(i * heads + h) * d..][..d].iter().map(|v| v.to_f64()).collect();
                    let y = rope_row(&x, p, 10_000.0, d, RopeStyle::NeoX, Direction::Forward);
                    for (j, want) in y.into_iter().enumerate() {
                        let got = out[at[h] + j];
                        assert!(got.ulps(bf16::round(want)) <= 1, "step {step} seq {i} head {h} dim {j}");
                    }
                }
            }
            for h in 0..hk {
                let at = row_at(&cl, block, within, h);
                // The model of the caches: this step's rows written, everything else as before.
                k_cache[at..at + d].copy_from_slice(&kc_out[at..at + d]);
                v_cache[at..at + d].copy_from_slice(&v[(i * hk + h) * d..][..d]);
            }
        }
        assert!(
            kc_out.iter().zip(&k_cache).all(|(a, b)| a.bits() == b.bits()),
            "step {step}: a key row outside the step changed"
        );
        assert!(vc_out.iter().zip(&v_cache).all(|(a, b)| a.bits() == b.bits()), "step {step}: value cache differs");
    }
}

/// Records, replays and drops a graph 200 times while three other threads load modules,
/// allocate, launch, copy, synchronise and free in the same (primary) context, as the other
/// tests of a binary do: each replay's output must equal the eager result bit for bit. (With
/// `Graph::capture` in its place this crashed or failed in 12 of 12 runs on the H200.)
#[test]
fn record_while_other_threads_work() {
    let _together = together();
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::Arc;
    let test = "record_while_other_threads_work";
    let Some(g) = gpu(test) else { return };
    let seed = test_seed(test);
    let (t, h, d) = (64, 8, 128);
    let rope = Rope::new(&g.kernels, RopeConfig::new(d, 4096).dtype(rope_cuda::DType::BF16)).unwrap();
    let l = Layout::bshd(t, 1, h, d);
    let x: Vec<bf16> = (0..(t * h * d) as u64).map(|i| bf16::from_f32(uniform(seed, 0, i))).collect();
    let pos: Vec<i32> = (0..t as i32).map(|i| 37 * i + 5).collect();
    let (dx, dpos) = (upload_t(&x), upload_t(&pos));
    let mut out = upload_t(&vec![bf16::ZERO; x.len()]);
    let run = |out: &mut cust::memory::DeviceBuffer<bf16>| {
        let mut o = TensorMut::new(out, l);
        rope.apply(RopeArgs::into(&Tensor::new(&dx, l), &mut o, Positions::ids_i32(&dpos)), &g.stream)
    };
    run(&mut out).unwrap();
    g.stream.synchronize().unwrap();
    let eager = download_t(&out);
    let stop = Arc::new(AtomicBool::new(false));
    let rounds = Arc::new(AtomicUsize::new(0));
    let workers: Vec<_> = (0..3u64)
        .map(|w| {
            let (stop, rounds) = (Arc::clone(&stop), Arc::clone(&rounds));
            std::thread::spawn(move || {
                let g = gpu("record_while_other_threads_work (worker)").unwrap();
                let rope = Rope::new(&g.kernels, RopeConfig::new(64, 1024)).unwrap();
                let l = Layout::bshd(4, 33, 3, 64);
                while !stop.load(Ordering::Relaxed) {
                    let host: Vec<f32> = (0..4 * 33 * 3 * 64).map(|i| uniform(w, 1, i)).collect();
                    let mut buf = upload_t(&host);
                    let mut q = TensorMut::new(&mut buf, l);
                    let offsets = upload_t(&[0i32, 100, 200, 300]);
                    rope.apply(RopeArgs::in_place(&mut q, Positions::offsets_i32(&offsets)), &g.stream).unwrap();
                    g.stream.synchronize().unwrap();
                    assert_ne!(download_t(&buf), host);
                    rounds.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    for i in 0..200 {
        let graph = rope_cuda::Graph::record(|| run(&mut out)).unwrap();
        upload_t(&[bf16::ZERO; 8]); // an allocation and a copy of this thread's own between
        out.copy_from(&vec![bf16::ZERO; x.len()][..]).unwrap();
        // SAFETY: every buffer the graph names lives until the test synchronises the stream.
        unsafe { graph.launch(&g.stream) }.unwrap();
        g.stream.synchronize().unwrap();
        assert!(download_t(&out).iter().zip(&eager).all(|(a, b)| a.bits() == b.bits()), "replay {i} differs");
    }
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.join().expect("a worker failed");
    }
    assert!(rounds.load(Ordering::Relaxed) > 0, "the other threads never ran");
}

/// The reference update (two cache copies and the append) recorded and replayed: the stacked
/// caches equal the eager call's bit for bit.
#[test]
fn reference_update_replays_from_a_recorded_graph() {
    let _together = together();
    let test = "reference_update_replays_from_a_recorded_graph";
    let Some(g) = gpu(test) else { return };
    let seed = test_seed(test);
    let shape = rope_cuda::seed::KvShape { batch: 2, new_tokens: 16, heads: 4, head_dim: 32, cache_len: 128 };
    let (cache_n, new_n) = (2 * 128 * 4 * 32, 2 * 16 * 4 * 32);
    let r = |tensor: u64, n: usize| -> Vec<bf16> {
        (0..n as u64).map(|i| bf16::from_f32(uniform(seed, tensor, i))).collect()
    };
    let (k, v, ck, cv) =
        (upload_t(&r(0, new_n)), upload_t(&r(1, new_n)), upload_t(&r(2, cache_n)), upload_t(&r(3, cache_n)));
    let (cos, sin) = (upload_t(&r(4, 128 * 16)), upload_t(&r(5, 128 * 16)));
    let pos = upload_t(&(0..32).map(|i| (i * 7 + 3) % 128).collect::<Vec<i32>>());
    let update = rope_cuda::seed::KvUpdate::new(&g.kernels).unwrap();
    let mut eager = upload_t(&vec![bf16::ZERO; 2 * cache_n]);
    update.update_kv_cache(shape, &k, &v, &cos, &sin, &ck, &cv, &pos, &mut eager, &g.stream).unwrap();
    let mut out = upload_t(&vec![bf16::from_f32(-7.0); 2 * cache_n]);
    let graph = rope_cuda::Graph::record(|| {
        update.update_kv_cache(shape, &k, &v, &cos, &sin, &ck, &cv, &pos, &mut out, &g.stream)
    })
    .unwrap();
    g.stream.synchronize().unwrap();
    assert!(download_t(&out).iter().all(|x| x.to_f32() == -7.0), "recording ran something");
    // SAFETY: every buffer the graph names lives until the test synchronises the stream.
    unsafe { graph.launch(&g.stream) }.unwrap();
    g.stream.synchronize().unwrap();
    update.check_errors(&g.stream).unwrap();
    let (want, got) = (download_t(&eager), download_t(&out));
    assert!(want.iter().zip(&got).all(|(a, b)| a.bits() == b.bits()), "replay differs from the eager call");
}

/// KV calls above `KV_SCAN_MAX_TOKENS` tokens are refused inside a recording and a capture
/// (a replay would reuse their claims' tag), before anything is queued or recorded.
#[test]
fn claiming_appends_are_not_capturable() {
    let _alone = alone();
    let test = "claiming_appends_are_not_capturable";
    let Some(g) = gpu(test) else { return };
    let seed = test_seed(test);
    let tokens = rope_cuda::KV_SCAN_MAX_TOKENS + 1;
    let rope = Rope::new(&g.kernels, RopeConfig::new(64, 4096).dtype(rope_cuda::DType::BF16)).unwrap();
    let l = Layout::bshd(tokens, 1, 2, 64);
    let r = |tensor: u64, n: usize| -> Vec<bf16> {
        (0..n as u64).map(|i| bf16::from_f32(uniform(seed, tensor, i))).collect()
    };
    let (k, v) = (upload_t(&r(0, tokens * 128)), upload_t(&r(1, tokens * 128)));
    let cache = r(2, 2 * tokens * 128);
    let (mut kc, mut vc) = (upload_t(&cache), upload_t(&cache));
    let pos = upload_t(&(0..tokens as i32).collect::<Vec<_>>());
    let slots = upload_t(&(0..tokens as i64).map(|t| 2 * t).collect::<Vec<_>>());
    let step = |kc: &mut cust::memory::DeviceBuffer<bf16>, vc: &mut cust::memory::DeviceBuffer<bf16>| {
        let mut c = KvCache::paged(kc, vc, Layout::bshd(2 * tokens, 1, 2, 64));
        let (k, v) = (Tensor::new(&k, l), Tensor::new(&v, l));
        rope.append_kv(rope_cuda::KvAppend::new(&k, &v, &mut c, Positions::ids_i32(&pos)).slots(&slots), &g.stream)
    };
    let e = rope_cuda::Graph::record(|| step(&mut kc, &mut vc));
    assert!(matches!(e, Err(rope_cuda::Error::NotCapturable(_))), "{e:?}");
    let e = rope_cuda::Graph::capture(&g.stream, || step(&mut kc, &mut vc));
    assert!(matches!(e, Err(rope_cuda::Error::NotCapturable(_))), "{e:?}");
    g.stream.synchronize().unwrap();
    assert!(download_t(&kc).iter().zip(&cache).all(|(a, b)| a.bits() == b.bits()), "a refused call wrote");
    // Eagerly the same call runs.
    step(&mut kc, &mut vc).unwrap();
    g.stream.synchronize().unwrap();
    assert!(download_t(&kc).iter().zip(&cache).any(|(a, b)| a.bits() != b.bits()), "the eager call wrote nothing");
}

/// A checked configuration's calls and `check_errors` are refused while recording (nothing
/// has run then, so they would report nothing), before anything is recorded.
#[test]
fn checked_calls_are_not_recordable() {
    let _together = together();
    let test = "checked_calls_are_not_recordable";
    let Some(g) = gpu(test) else { return };
    let checked = Rope::new(&g.kernels, RopeConfig::new(64, 64).checked(true)).unwrap();
    let unchecked = Rope::new(&g.kernels, RopeConfig::new(64, 64)).unwrap();
    let host: Vec<f32> = (0..4 * 64).map(|i| uniform(1, 0, i)).collect();
    let mut q = upload_t(&host);
    let pos = upload_t(&[1i32, 2, 3, 4]);
    let e = rope_cuda::Graph::record(|| {
        let mut t = TensorMut::new(&mut q, Layout::bshd(1, 4, 1, 64));
        checked.apply(RopeArgs::in_place(&mut t, Positions::ids_i32(&pos)), &g.stream)
    });
    assert!(matches!(e, Err(rope_cuda::Error::NotCapturable(_))), "{e:?}");
    let e = rope_cuda::Graph::record(|| unchecked.check_errors(&g.stream));
    assert!(matches!(e, Err(rope_cuda::Error::NotCapturable(_))), "{e:?}");
    g.stream.synchronize().unwrap();
    assert_eq!(download_t(&q), host, "a refused call wrote");
}
