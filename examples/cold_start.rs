//! What a fresh process pays before its first decode step: `Kernels::load`, then the first
//! fused RoPE + paged append (bf16, 32 sequences of one new token, 32 q and 8 kv heads of
//! 128), which loads the entry points it launches; then the same step again. With `--all` it
//! then loads every entry point of the PTX, the cost every process paid when the library
//! loaded the whole PTX at once.
//!
//! Run it with the driver's JIT cache off (`CUDA_CACHE_DISABLE=1`: the driver compiles each
//! module's PTX) and on (a second run reads the cache the first one filled):
//!
//! ```text
//! CUDA_CACHE_DISABLE=1 cargo run --release --example cold_start -- --all
//! cargo run --release --example cold_start; cargo run --release --example cold_start
//! ```

use std::time::Instant;

use cust::memory::DeviceBuffer;
use cust::stream::{Stream, StreamFlags};
use half::bf16;
use rope_cuda::reference::uniform;
use rope_cuda::{DType, Kernels, KvAppend, KvCache, Layout, Positions, Rope, RopeConfig, Tensor, TensorMut};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn main() -> Res<()> {
    let all = std::env::args().any(|a| a == "--all");
    let cache = if std::env::var_os("CUDA_CACHE_DISABLE").is_some_and(|v| v == "1") { "off" } else { "on" };
    let start = Instant::now();
    let _ctx = match cust::quick_init() {
        Ok(c) => c,
        Err(e) => {
            println!("cold_start: no CUDA device ({e}); nothing measured");
            return Ok(());
        }
    };
    let context = start.elapsed();
    let stream = Stream::new(StreamFlags::NON_BLOCKING, None)?;

    let t = Instant::now();
    let kernels = Kernels::load()?;
    let load = t.elapsed();

    let (seqs, hq, hk, d, bs, context_len) = (32, 32, 8, 128, 16, 2048);
    let blocks_per_seq = (context_len + 1usize).div_ceil(bs);
    let cache_layout = Layout::bshd(seqs * blocks_per_seq, bs, hk, d);
    let rope = Rope::new(&kernels, RopeConfig::new(d, 8192).base(500_000.0).dtype(DType::BF16))?;
    let seeded =
        |tensor: u64, n: usize| -> Vec<bf16> { (0..n).map(|i| bf16::from_f32(uniform(7, tensor, i as u64))).collect() };
    let positions: Vec<i32> = vec![context_len as i32; seqs];
    let slots: Vec<i64> = (0..seqs).map(|i| ((i * blocks_per_seq) * bs + context_len) as i64).collect();
    let mut dq = DeviceBuffer::from_slice(&seeded(1, seqs * hq * d))?;
    let dk = DeviceBuffer::from_slice(&seeded(2, seqs * hk * d))?;
    let dv = DeviceBuffer::from_slice(&seeded(3, seqs * hk * d))?;
    let cache_n = cache_layout.extent().expect("a cache layout");
    let mut kc = DeviceBuffer::from_slice(&seeded(4, cache_n))?;
    let mut vc = DeviceBuffer::from_slice(&seeded(5, cache_n))?;
    let (dpos, dslots) = (DeviceBuffer::from_slice(&positions)?, DeviceBuffer::from_slice(&slots)?);
    let (ql, kl) = (Layout::bshd(seqs, 1, hq, d), Layout::bshd(seqs, 1, hk, d));
    let mut step = || -> Res<f64> {
        let t = Instant::now();
        let mut cache = KvCache::paged(&mut kc, &mut vc, cache_layout);
        let mut q = TensorMut::new(&mut dq, ql);
        let (k, v) = (Tensor::new(&dk, kl), Tensor::new(&dv, kl));
        let append = KvAppend::new(&k, &v, &mut cache, Positions::ids_i32(&dpos)).q(&mut q).slots(&dslots);
        rope.append_kv(append, &stream)?;
        stream.synchronize()?;
        Ok(t.elapsed().as_secs_f64() * 1e3)
    };
    let first = step()?;
    let second = step()?;
    rope.check_errors(&stream)?;
    let stats = kernels.load_stats();

    println!("cold start (driver JIT cache {cache}, PTX for {})", kernels.arch());
    println!("| what | ms |");
    println!("|---|---:|");
    println!("| context (cust::quick_init) | {:.1} |", context.as_secs_f64() * 1e3);
    println!("| Kernels::load | {:.3} |", load.as_secs_f64() * 1e3);
    println!("| first decode step (loads its kernels) | {first:.1} |");
    println!("| second decode step | {second:.3} |");
    println!(
        "| driver loads so far: {} of {} entry points | {:.1} |",
        stats.loaded,
        stats.available,
        stats.load_time.as_secs_f64() * 1e3
    );
    println!("loaded: {:?}", kernels.loaded().map(|e| e.name()).collect::<Vec<_>>());
    if all {
        let t = Instant::now();
        kernels.preload_all()?;
        let every = t.elapsed();
        let stats = kernels.load_stats();
        println!("| every other entry point ({} in all) | {:.1} |", stats.loaded, every.as_secs_f64() * 1e3);
    }
    Ok(())
}
