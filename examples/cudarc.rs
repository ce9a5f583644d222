//! RoPE and the fused KV append on cudarc's buffers and stream (feature `cudarc`): one decode
//! step of a Llama-3-shaped layer (bf16, 32 q / 8 kv heads of 128) on 64 sequences, into a
//! paged cache, every written element checked against the f64 reference.
//!
//! ```text
//! cargo run --release --features cudarc --example cudarc
//! ```

use std::process::ExitCode;
use std::time::Instant;

use cudarc::driver::CudaContext;
use half::bf16;
use rope_cuda::cudarc::load;
use rope_cuda::reference::{rope_row_freqs, splitmix64, uniform, RefElem};
use rope_cuda::{DType, Direction, KvAppend, KvCache, Layout, Positions, Rope, RopeConfig, Tensor, TensorMut};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn main() -> ExitCode {
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("cudarc: a check FAILED");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("cudarc: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Res<bool> {
    let ctx = match CudaContext::new(0) {
        Ok(ctx) => ctx,
        Err(e) => return Err(format!("no usable CUDA device ({e:?}); this example needs an NVIDIA GPU").into()),
    };
    let stream = ctx.default_stream();
    let kernels = load(&ctx)?;
    println!("device: {}  (cudarc context, kernels loaded into it)", ctx.name()?);
    let (seqs, hq, hk, d, blocks, bs) = (64, 32, 8, 128, 1024, 16);
    let config = RopeConfig::new(d, 8192).base(500_000.0).dtype(DType::BF16);
    let rope = Rope::new(&kernels, config.clone())?;
    let seeded = |tensor: u64, n: usize| -> Vec<bf16> {
        (0..n as u64).map(|i| bf16::from_f32(uniform(2026, tensor, i))).collect()
    };
    let to2 = |x: &[bf16]| x.iter().map(|v| half2::bf16::from_bits(v.to_bits())).collect::<Vec<_>>();
    let from2 = |x: Vec<half2::bf16>| x.iter().map(|v| bf16::from_bits(v.to_bits())).collect::<Vec<_>>();
    let (q, k, v) = (seeded(0, seqs * hq * d), seeded(1, seqs * hk * d), seeded(2, seqs * hk * d));
    let cache_n = blocks * bs * hk * d;
    let (kc0, vc0) = (seeded(3, cache_n), seeded(4, cache_n));
    // Each sequence at its own length, appending into its own page.
    let positions: Vec<i64> = (0..seqs as u64).map(|s| (splitmix64(s) % 8000) as i64).collect();
    let slots: Vec<i64> = (0..seqs as i64).map(|s| s * 16 * bs as i64 + positions[s as usize] % bs as i64).collect();
    let (mut dq, dk, dv) = (stream.clone_htod(&to2(&q))?, stream.clone_htod(&to2(&k))?, stream.clone_htod(&to2(&v))?);
    let (mut dkc, mut dvc) = (stream.clone_htod(&to2(&kc0))?, stream.clone_htod(&to2(&vc0))?);
    let (dpos, dslots) = (stream.clone_htod(&positions)?, stream.clone_htod(&slots)?);
    let start = Instant::now();
    {
        // Each cudarc buffer is lent with the stream the work goes on.
        let mut qv = TensorMut::new((&mut dq, &stream), Layout::packed(seqs, hq, d));
        let (kv, vv) = (
            Tensor::new((&dk, &stream), Layout::packed(seqs, hk, d)),
            Tensor::new((&dv, &stream), Layout::packed(seqs, hk, d)),
        );
        let mut cache = KvCache::paged((&mut dkc, &stream), (&mut dvc, &stream), Layout::bshd(blocks, bs, hk, d));
        let pos = Positions::ids_i64((&dpos, &stream));
        let args = KvAppend::new(&kv, &vv, &mut cache, pos).q(&mut qv).slots((&dslots, &stream));
        rope.append_kv(args, &stream)?;
    }
    rope.check_errors(&stream)?;
    let elapsed = start.elapsed();
    let (gq, gkc, gvc) =
        (from2(stream.clone_dtoh(&dq)?), from2(stream.clone_dtoh(&dkc)?), from2(stream.clone_dtoh(&dvc)?));

    // Every element of q and of the written cache rows against the f64 reference; every
    // other cache row unchanged.
    let (freqs, attention) = config.frequencies()?;
    let (mut worst, mut checked, mut ok) = (0u64, 0usize, true);
    let mut rotated = |got: &[bf16], x: &[bf16], p: i64| {
        for (g, x) in got.chunks(d).zip(x.chunks(d)) {
            let xs: Vec<f64> = x.iter().map(|v| v.to_f64()).collect();
            let want = rope_row_freqs(&xs, p as f64, &freqs, attention, config.style, Direction::Forward);
            for (g, w) in g.iter().zip(want) {
                worst = worst.max(g.ulps(<bf16 as RefElem>::round(w)));
                checked += 1;
            }
        }
    };
    let mut written = vec![false; blocks * bs];
    for s in 0..seqs {
        let p = positions[s];
        rotated(&gq[s * hq * d..(s + 1) * hq * d], &q[s * hq * d..(s + 1) * hq * d], p);
        let n = slots[s] as usize;
        written[n] = true;
        let (row, src) = (n * hk * d..(n + 1) * hk * d, s * hk * d..(s + 1) * hk * d);
        rotated(&gkc[row.clone()], &k[src.clone()], p);
        ok &= gvc[row] == v[src];
    }
    let untouched = (0..blocks * bs).filter(|&n| !written[n]).all(|n| {
        let r = n * hk * d..(n + 1) * hk * d;
        gkc[r.clone()] == kc0[r.clone()] && gvc[r.clone()] == vc0[r]
    });
    ok &= untouched && worst <= 1;
    println!();
    println!("{:<44} {:>10} {:>12}", "cudarc: fused RoPE + paged append", "checked", "worst ulps");
    println!("{:<44} {:>10} {:>12}", format!("bf16 {seqs}x1 tok {hq}/{hk} h d{d}, q + k"), checked, worst);
    println!("{:<44} {:>10} {:>12}", "v copied bit for bit", if ok { "yes" } else { "NO" }, "");
    println!("{:<44} {:>10} {:>12}", "other cache rows unchanged", if untouched { "yes" } else { "NO" }, "");
    println!("first call, host wall time incl. sync: {:.1} us", elapsed.as_secs_f64() * 1e6);
    println!("check: {}", if ok { "ok" } else { "FAILED" });
    Ok(ok)
}
