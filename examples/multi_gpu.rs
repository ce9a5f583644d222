//! Tensor parallelism: the attention heads of one step sharded across every visible GPU.
//!
//! GPU `r` of `n` owns q heads `r * 32/n ..`, kv heads `r * 8/n ..` and its part of a paged
//! cache (blocks of 16, `[blocks, 16, 8/n, 128]`). Each GPU, on a thread of its own with its
//! own context, module, stream and `Rope`, runs RoPE on its q heads and the fused RoPE + paged
//! append of its k and v heads in one launch per step, all GPUs at once. The results are
//! gathered and checked against the f64 CPU reference; then each GPU's step is timed with
//! events (all GPUs at once again) next to a device-to-device copy of the same bytes, and the
//! aggregate bandwidth is the bytes of all GPUs over the slowest GPU's median.
//!
//! ```text
//! cargo run --release --example multi_gpu [-- TOKENS_PER_SEQUENCE]
//! ```

use std::process::ExitCode;
use std::sync::{Arc, Barrier};

use cust::context::Context;
use cust::device::Device;
use cust::memory::{CopyDestination, DeviceBuffer};
use cust::stream::{Stream, StreamFlags};
use half::bf16;
use rope_cuda::bench::{copy_d2d, time_op, Timing};
use rope_cuda::reference::{rope_row, uniform, RefElem};
use rope_cuda::{
    DType, Direction, Kernels, KvCache, Layout, Positions, Rope, RopeConfig, RopeStyle, Tensor, TensorMut,
};

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const HQ: usize = 32;
const HK: usize = 8;
const D: usize = 128;
const BS: usize = 16;
const SEQS: usize = 16;
const CONTEXT: usize = 512;
const BASE: f64 = 500_000.0;
const MAX_POS: usize = 8192;

/// The whole step on the host: q `[T, 32, D]`, k and v `[T, 8, D]`, both caches
/// `[blocks, 16, 8, D]`, and each token's position and slot.
struct Step {
    tokens: usize,
    blocks: usize,
    q: Vec<bf16>,
    k: Vec<bf16>,
    v: Vec<bf16>,
    cache: Vec<bf16>,
    positions: Vec<i32>,
    slots: Vec<i64>,
}

impl Step {
    fn new(new: usize) -> Step {
        let tokens = SEQS * new;
        let per_seq = (CONTEXT + new).div_ceil(BS);
        let blocks = SEQS * per_seq;
        let r = |tensor, n: usize| (0..n as u64).map(|i| bf16::from_f32(uniform(21, tensor, i))).collect();
        // Sequence i owns blocks i * per_seq ..; its token j is at position CONTEXT + j.
        let positions = (0..tokens).map(|t| (CONTEXT + t % new) as i32).collect();
        let slots = (0..tokens).map(|t| ((t / new * per_seq) * BS + CONTEXT + t % new) as i64).collect();
        Step {
            tokens,
            blocks,
            q: r(0, tokens * HQ * D),
            k: r(1, tokens * HK * D),
            v: r(2, tokens * HK * D),
            cache: r(3, blocks * BS * HK * D),
            positions,
            slots,
        }
    }

    /// Heads `lo..hi` of every row of `x` (rows of `heads` heads of `D`).
    fn heads(x: &[bf16], heads: usize, lo: usize, hi: usize) -> Vec<bf16> {
        x.chunks(heads * D).flat_map(|row| row[lo * D..hi * D].iter().copied()).collect()
    }
}

/// What one GPU sends back: its rank, device name, q and both caches after one step, its
/// timings and the bytes a step moves.
struct Shard {
    rank: usize,
    name: String,
    q: Vec<bf16>,
    k_cache: Vec<bf16>,
    v_cache: Vec<bf16>,
    step: Timing,
    copy: Timing,
    bytes: u64,
}

/// The barriers every GPU's thread passes: the checked step, the timed steps, the copies.
const BARRIERS: usize = 3;

/// GPU `rank` of `n`: its shard of `step`, one checked step, then timed steps. A thread that
/// fails still passes the barriers it has not reached, so the other GPUs finish too.
fn run_shard(rank: usize, n: usize, step: &Step, barrier: &Barrier) -> Res<Shard> {
    let passed = std::cell::Cell::new(0);
    let wait = || {
        barrier.wait();
        passed.set(passed.get() + 1);
    };
    let shard = shard(rank, n, step, &wait);
    for _ in passed.get()..BARRIERS {
        barrier.wait();
    }
    shard
}

/// [`run_shard`]'s work; `barrier` waits for every GPU's thread.
fn shard(rank: usize, n: usize, step: &Step, barrier: &dyn Fn()) -> Res<Shard> {
    let device = Device::get_device(rank as u32)?;
    let _ctx = Context::new(device)?;
    let kernels = Kernels::load()?;
    if kernels.device() != rank as i32 {
        return Err(format!("GPU {rank}: module loaded on device {}", kernels.device()).into());
    }
    let stream = Stream::new(StreamFlags::NON_BLOCKING, None)?;
    let rope = Rope::new(&kernels, RopeConfig::new(D, MAX_POS).base(BASE).dtype(DType::BF16))?;
    let (hq, hk) = (HQ / n, HK / n);
    let q_host = Step::heads(&step.q, HQ, rank * hq, (rank + 1) * hq);
    let (k_host, v_host) =
        (Step::heads(&step.k, HK, rank * hk, (rank + 1) * hk), Step::heads(&step.v, HK, rank * hk, (rank + 1) * hk));
    let cache_host = Step::heads(&step.cache, HK, rank * hk, (rank + 1) * hk);
    let mut q = DeviceBuffer::from_slice(&q_host)?;
    let (k, v) = (DeviceBuffer::from_slice(&k_host)?, DeviceBuffer::from_slice(&v_host)?);
    let (mut kc, mut vc) = (DeviceBuffer::from_slice(&cache_host)?, DeviceBuffer::from_slice(&cache_host)?);
    let (pos, slots) = (DeviceBuffer::from_slice(&step.positions)?, DeviceBuffer::from_slice(&step.slots)?);
    let t = step.tokens;
    let (ql, kl, cl) = (Layout::bshd(t, 1, hq, D), Layout::bshd(t, 1, hk, D), Layout::bshd(step.blocks, BS, hk, D));
    let launch = |q: &mut DeviceBuffer<bf16>, kc: &mut DeviceBuffer<bf16>, vc: &mut DeviceBuffer<bf16>| {
        let mut cache = KvCache::paged(kc, vc, cl);
        let mut tq = TensorMut::new(q, ql);
        let (k, v) = (Tensor::new(&k, kl), Tensor::new(&v, kl));
        let append = rope_cuda::KvAppend::new(&k, &v, &mut cache, Positions::ids_i32(&pos)).q(&mut tq).slots(&slots);
        rope.append_kv(append, &stream)
    };
    // One step on every GPU at once, then gathered.
    barrier();
    launch(&mut q, &mut kc, &mut vc)?;
    rope.check_errors(&stream)?;
    let download = |b: &DeviceBuffer<bf16>| -> Res<Vec<bf16>> {
        let mut h = vec![bf16::ZERO; b.len()];
        b.copy_to(&mut h[..])?;
        Ok(h)
    };
    let (q_out, k_cache, v_cache) = (download(&q)?, download(&kc)?, download(&vc)?);
    // Timed: every GPU at once again (q rotates further each run; the speed does not care).
    let bytes = (t * (2 * hq + 4 * hk) * D * 2) as u64;
    let src = DeviceBuffer::from_slice(&vec![bf16::ONE; bytes as usize / 4])?;
    let mut dst = DeviceBuffer::from_slice(&vec![bf16::ZERO; bytes as usize / 4])?;
    barrier();
    let step_t = time_op(&stream, 5, 30, || launch(&mut q, &mut kc, &mut vc))?;
    barrier();
    let copy = time_op(&stream, 5, 30, || copy_d2d(&src, &mut dst, &stream))?;
    Ok(Shard { rank, name: device.name()?, q: q_out, k_cache, v_cache, step: step_t, copy, bytes })
}

/// Checks the gathered step against the f64 reference: every q head and written key row of
/// every 7th token within one ulp, the written values exact, every other cache row unchanged.
fn check(step: &Step, shards: &[Shard]) -> Result<(), String> {
    let n = shards.len();
    let (hq, hk) = (HQ / n, HK / n);
    let mut written = vec![false; step.blocks * BS];
    for &s in &step.slots {
        written[s as usize] = true;
    }
    for shard in shards {
        let r = shard.rank;
        for t in (0..step.tokens).step_by(7).chain([step.tokens - 1]) {
            let p = step.positions[t] as f64;
            let s = step.slots[t] as usize;
            for h in 0..hq {
                let x: Vec<f64> = step.q[(t * HQ + r * hq + h) * D..][..D].iter().map(|v| v.to_f64()).collect();
                let y = rope_row(&x, p, BASE, D, RopeStyle::NeoX, Direction::Forward);
                let got = &shard.q[(t * hq + h) * D..][..D];
                if let Some(i) = (0..D).find(|&i| got[i].ulps(bf16::round(y[i])) > 1) {
                    return Err(format!("GPU {r}: q token {t} head {} dim {i}", r * hq + h));
                }
            }
            for h in 0..hk {
                let at = (s * hk + h) * D;
                let x: Vec<f64> = step.k[(t * HK + r * hk + h) * D..][..D].iter().map(|v| v.to_f64()).collect();
                let y = rope_row(&x, p, BASE, D, RopeStyle::NeoX, Direction::Forward);
                if let Some(i) = (0..D).find(|&i| shard.k_cache[at + i].ulps(bf16::round(y[i])) > 1) {
                    return Err(format!("GPU {r}: key of token {t} head {} dim {i}", r * hk + h));
                }
                let want = &step.v[(t * HK + r * hk + h) * D..][..D];
                if shard.v_cache[at..at + D].iter().zip(want).any(|(a, b)| a.to_bits() != b.to_bits()) {
                    return Err(format!("GPU {r}: value of token {t} head {}", r * hk + h));
                }
            }
        }
        let orig = Step::heads(&step.cache, HK, r * hk, (r + 1) * hk);
        let row = hk * D;
        for (slot, _) in written.iter().enumerate().filter(|(_, w)| !**w) {
            let same = |c: &[bf16]| {
                c[slot * row..][..row].iter().zip(&orig[slot * row..]).all(|(a, b)| a.to_bits() == b.to_bits())
            };
            if !same(&shard.k_cache) || !same(&shard.v_cache) {
                return Err(format!("GPU {r}: slot {slot}, not written, changed"));
            }
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("multi_gpu: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Res<bool> {
    let new: usize = std::env::args().nth(1).map_or(Ok(1024), |a| a.parse())?;
    if let Err(e) = cust::init(cust::CudaFlags::empty()) {
        eprintln!("multi_gpu: no usable CUDA driver ({e}); this example needs NVIDIA GPUs.");
        return Ok(true);
    }
    let n = match Device::num_devices()? as usize {
        0 => {
            eprintln!("multi_gpu: no CUDA device; this example needs NVIDIA GPUs.");
            return Ok(true);
        }
        // The heads must split evenly: the largest power of two up to 8 that divides them.
        n => [8, 4, 2, 1].into_iter().find(|&k| k <= n).unwrap(),
    };
    let step = Arc::new(Step::new(new));
    let barrier = Arc::new(Barrier::new(n));
    let handles: Vec<_> = (0..n)
        .map(|rank| {
            let (step, barrier) = (Arc::clone(&step), Arc::clone(&barrier));
            std::thread::spawn(move || run_shard(rank, n, &step, &barrier))
        })
        .collect();
    let mut shards = Vec::new();
    for h in handles {
        shards.push(h.join().map_err(|_| "a GPU thread panicked")??);
    }
    shards.sort_by_key(|s| s.rank);
    let checked = check(&step, &shards);
    println!(
        "{n} GPU(s), heads sharded {}/{} q and {}/{} kv each; {} sequences x {new} tokens after {CONTEXT} cached, bf16, paged {BS}",
        HQ / n,
        HQ,
        HK / n,
        HK,
        SEQS
    );
    println!();
    println!(
        "{:<5} {:<22} {:>10} {:>10} {:>10} {:>10} {:>8}",
        "gpu", "device", "median us", "p90 us", "GB/s", "copy GB/s", "% copy"
    );
    for s in &shards {
        println!(
            "{:<5} {:<22} {:>10.2} {:>10.2} {:>10.0} {:>10.0} {:>7.1}%",
            s.rank,
            s.name,
            s.step.median_us,
            s.step.p90_us,
            s.step.gb_per_s(s.bytes),
            s.copy.gb_per_s(s.bytes),
            100.0 * s.copy.median_us / s.step.median_us
        );
    }
    let total: u64 = shards.iter().map(|s| s.bytes).sum();
    let slowest = shards.iter().map(|s| s.step.median_us).fold(0.0, f64::max);
    println!(
        "aggregate: {:.0} GB/s ({} bytes over the slowest GPU's {slowest:.2} us)",
        total as f64 / slowest / 1e3,
        total
    );
    match &checked {
        Ok(()) => println!(
            "check: ok (sampled q and key rows within 1 ulp of the f64 reference, values exact, other slots unchanged)"
        ),
        Err(e) => println!("check: FAILED: {e}"),
    }
    Ok(checked.is_ok())
}
