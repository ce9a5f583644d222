//! Bandwidth sweep: each kernel family over 1 .. 131072 tokens, timed with CUDA events after
//! warm-up (median and p90), with and without an L2 flush before each run, next to a
//! device-to-device copy of the same bytes and an empty kernel launch measured in the same
//! run. Writes `sweep.csv` and `sweep.svg` (achieved share of copy bandwidth against tokens)
//! into the directory given (default `target/sweep`), and prints a table last.
//!
//! ```text
//! cargo bench --bench sweep [-- OUT_DIR]
//! ```
//!
//! `SWEEP_ONLY=a|b|..` keeps the kernels whose name contains one of the substrings, and `SWEEP_TOKENS=a,b,..`
//! replaces the token counts (for focused runs; the committed results are full sweeps).
//!
//! 32 q / 8 kv heads of 128 throughout; RoPE in place with i32 ids; the fused append as a
//! decode batch (one token per sequence) into a paged cache (blocks of 16, `[blocks, bs, H, D]`
//! and `[blocks, H, bs, D]`) or one sequence into a contiguous `[1, S, H, D]` cache; the
//! reference update with B=8, S=8192 and `tokens / 8` new tokens per sequence. Inputs are
//! filled on the device with a constant (the kernels' speed does not depend on the values).

use std::error::Error as StdError;
use std::fmt::Write as _;

use cust::memory::{DeviceBuffer, DeviceCopy};
use cust::stream::{Stream, StreamFlags};
use cust::sys as cuda;
use half::{bf16, f16};
use rope_cuda::bench::{copy_d2d, empty, time_after, time_device, time_op, Timing};
use rope_cuda::reference::splitmix64;
use rope_cuda::seed::{KvShape, KvUpdate};
use rope_cuda::{DType, Kernels, KvCache, Layout, Positions, Rope, RopeArgs, RopeConfig, RopeStyle, Tensor, TensorMut};

type Res<T> = Result<T, Box<dyn StdError>>;

const TOKENS: [usize; 10] = [1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 131072];
const HQ: usize = 32;
const HK: usize = 8;
const D: usize = 128;
const MAX_POS: usize = 8192;

struct Point {
    kernel: String,
    tokens: usize,
    flush: bool,
    op: Timing,
    copy: Timing,
    bytes: u64,
}

/// A device buffer of `n` elements, every 32-bit word set to `word`.
fn filled<T: DeviceCopy>(n: usize, word: u32, stream: &Stream) -> Res<DeviceBuffer<T>> {
    // SAFETY: every byte is written by the memset below before any read.
    let buf = unsafe { DeviceBuffer::<T>::uninitialized(n.max(1))? };
    let words = (n.max(1) * std::mem::size_of::<T>()).div_ceil(4);
    // SAFETY: the buffer holds at least `words` 32-bit words (allocations are 256-byte aligned).
    unsafe { cuda::cuMemsetD32Async(buf.as_device_ptr().as_raw(), word, words, stream.as_inner()) };
    Ok(buf)
}

/// Times `op` and a copy of `bytes / 2` bytes (a copy reads and writes each byte once), with
/// and without the flush.
fn measure(
    points: &mut Vec<Point>,
    stream: &Stream,
    flush: &DeviceBuffer<u32>,
    kernel: &str,
    tokens: usize,
    bytes: u64,
    mut op: impl FnMut() -> rope_cuda::Result<()>,
) -> Res<()> {
    let runs = if bytes > 1 << 28 { 10 } else { 30 };
    let words = (bytes / 8).max(1) as usize;
    let (src, mut dst) = (filled::<u32>(words, 1, stream)?, filled::<u32>(words, 2, stream)?);
    // With the flush, a 512 MiB memset before each timed run evicts L2 (outside the events).
    let evict = |on: bool| {
        move || {
            if on {
                let raw = flush.as_device_ptr().as_raw();
                // SAFETY: `flush` holds `flush.len()` words.
                unsafe { cuda::cuMemsetD32Async(raw, 0, flush.len(), stream.as_inner()) };
            }
            Ok(())
        }
    };
    for f in [false, true] {
        let op_t = time_after(stream, 3, runs, evict(f), &mut op)?;
        let copy = time_after(stream, 3, runs, evict(f), || copy_d2d(&src, &mut dst, stream))?;
        points.push(Point { kernel: kernel.into(), tokens, flush: f, op: op_t, copy, bytes });
    }
    Ok(())
}

/// The token counts to sweep: `SWEEP_TOKENS` or [`TOKENS`].
fn token_counts() -> Vec<usize> {
    match std::env::var("SWEEP_TOKENS") {
        Ok(v) => v.split(',').filter_map(|t| t.trim().parse().ok()).collect(),
        Err(_) => TOKENS.to_vec(),
    }
}

/// Whether kernel `name` is swept (`SWEEP_ONLY`).
fn wanted(name: &str) -> bool {
    std::env::var("SWEEP_ONLY").map_or(true, |only| only.split('|').any(|o| name.contains(o)))
}

fn ids(tokens: usize) -> Vec<i32> {
    (0..tokens).map(|t| (splitmix64(t as u64) % MAX_POS as u64) as i32).collect()
}

/// RoPE in place on q and k (or q only, `q_only`).
fn rope_points<T: rope_cuda::CustElement>(
    points: &mut Vec<Point>,
    kernels: &std::sync::Arc<Kernels>,
    stream: &Stream,
    flush: &DeviceBuffer<u32>,
    style: RopeStyle,
    one: u32,
    q_only: bool,
) -> Res<()> {
    let rope = Rope::new(kernels, RopeConfig::new(D, MAX_POS).base(500_000.0).style(style).dtype(T::DTYPE))?;
    let name = format!("rope {} {}", if style == RopeStyle::NeoX { "neox" } else { "gptj" }, T::DTYPE.name());
    let name = if q_only { format!("{name}, q only") } else { name };
    if !wanted(&name) {
        return Ok(());
    }
    for tokens in token_counts() {
        let (mut q, mut k) = (filled::<T>(tokens * HQ * D, one, stream)?, filled::<T>(tokens * HK * D, one, stream)?);
        let pos = DeviceBuffer::from_slice(&ids(tokens))?;
        let bytes = (2 * tokens * (HQ + HK * !q_only as usize) * D * T::DTYPE.size()) as u64;
        measure(points, stream, flush, &name, tokens, bytes, || {
            let mut tq = TensorMut::new(&mut q, Layout::bshd(1, tokens, HQ, D));
            let mut tk = TensorMut::new(&mut k, Layout::bshd(1, tokens, HK, D));
            let args = RopeArgs::in_place(&mut tq, Positions::ids_i32(&pos));
            rope.apply(if q_only { args } else { args.k(&mut tk) }, stream)
        })?;
    }
    Ok(())
}

#[derive(Clone, Copy, PartialEq)]
enum Cache {
    PagedBshd,
    PagedBhsd,
    Contiguous,
}

/// The fused append, bf16 NeoX: q rotated in place too (`with_q`), or keys and values only.
fn append_points(
    points: &mut Vec<Point>,
    kernels: &std::sync::Arc<Kernels>,
    stream: &Stream,
    flush: &DeviceBuffer<u32>,
    cache: Cache,
    with_q: bool,
) -> Res<()> {
    let one = 0x3F80_3F80; // bf16 1.0, twice
    let bs = 16;
    let name = match cache {
        Cache::PagedBshd => "append paged [blocks, bs, H, D]",
        Cache::PagedBhsd => "append paged [blocks, H, bs, D]",
        Cache::Contiguous => "append contiguous [B, S, H, D]",
    };
    let name = if with_q { name.to_string() } else { format!("{name}, k/v only") };
    if !wanted(&name) {
        return Ok(());
    }
    for tokens in token_counts() {
        let max_pos = if cache == Cache::Contiguous { tokens } else { MAX_POS };
        let rope = Rope::new(kernels, RopeConfig::new(D, max_pos).base(500_000.0).dtype(DType::BF16))?;
        let (seqs, seq) = if cache == Cache::Contiguous { (1, tokens) } else { (tokens, 1) };
        let slots_n = if cache == Cache::Contiguous { tokens } else { (2 * tokens).max(bs) };
        let blocks = slots_n.div_ceil(bs);
        let layout = match cache {
            Cache::PagedBshd => Layout::bshd(blocks, bs, HK, D),
            Cache::PagedBhsd => Layout::bhsd(blocks, HK, bs, D),
            Cache::Contiguous => Layout::bshd(1, tokens, HK, D),
        };
        let cache_n = blocks.max(1) * bs.min(slots_n) * HK * D;
        let cache_n = if cache == Cache::Contiguous { tokens * HK * D } else { cache_n };
        let (mut kc, mut vc) = (filled::<bf16>(cache_n, one, stream)?, filled::<bf16>(cache_n, one, stream)?);
        let mut q = filled::<bf16>(tokens * HQ * D, one, stream)?;
        let (k, v) = (filled::<bf16>(tokens * HK * D, one, stream)?, filled::<bf16>(tokens * HK * D, one, stream)?);
        // Unique slots spread over the cache; positions: the token's own (contiguous) or ids.
        let slots: Vec<i64> = (0..tokens).map(|t| ((t * 2 + (t % 3 == 0) as usize) % slots_n) as i64).collect();
        let positions: Vec<i32> = if cache == Cache::Contiguous { (0..tokens as i32).collect() } else { ids(tokens) };
        let (dpos, dslots) = (DeviceBuffer::from_slice(&positions)?, DeviceBuffer::from_slice(&slots)?);
        let paged = cache != Cache::Contiguous;
        let bytes = (tokens * (2 * HQ * with_q as usize + 4 * HK) * D * 2) as u64;
        measure(points, stream, flush, &name, tokens, bytes, || {
            let mut tq = TensorMut::new(&mut q, Layout::bshd(seqs, seq, HQ, D));
            let (tk, tv) =
                (Tensor::new(&k, Layout::bshd(seqs, seq, HK, D)), Tensor::new(&v, Layout::bshd(seqs, seq, HK, D)));
            let mut c = if paged {
                KvCache::paged(&mut kc, &mut vc, layout)
            } else {
                KvCache::contiguous(&mut kc, &mut vc, layout)
            };
            let mut args = rope_cuda::KvAppend::new(&tk, &tv, &mut c, Positions::ids_i32(&dpos));
            if paged {
                args = args.slots(&dslots);
            }
            if with_q {
                args = args.q(&mut tq);
            }
            rope.append_kv(args, stream)
        })?;
    }
    Ok(())
}

/// The reference update: B=8, S=8192, H=8, D=128, bf16, `tokens / 8` new tokens a sequence.
fn reference_points(
    points: &mut Vec<Point>,
    kernels: &std::sync::Arc<Kernels>,
    stream: &Stream,
    flush: &DeviceBuffer<u32>,
) -> Res<()> {
    let (b, h, s) = (8, 8, 8192);
    let update = KvUpdate::new(kernels)?;
    let cache_n = b * s * h * D;
    let one = 0x3F80_3F80;
    let (ck, cv) = (filled::<bf16>(cache_n, one, stream)?, filled::<bf16>(cache_n, one, stream)?);
    let (cos, sin) = (filled::<bf16>(s * D / 2, one, stream)?, filled::<bf16>(s * D / 2, 0, stream)?);
    let mut out = filled::<bf16>(2 * cache_n, 0, stream)?;
    if !wanted("reference update") {
        return Ok(());
    }
    for tokens in token_counts().into_iter().filter(|&t| t >= b && t / b <= s) {
        let t = tokens / b;
        let shape = KvShape { batch: b, new_tokens: t, heads: h, head_dim: D, cache_len: s };
        let (kn, vn) = (filled::<bf16>(b * t * h * D, one, stream)?, filled::<bf16>(b * t * h * D, one, stream)?);
        let pos: Vec<i32> = (0..b * t).map(|i| ((i % t) * 7 % s) as i32).collect();
        let dpos = DeviceBuffer::from_slice(&pos)?;
        let bytes = (4 * cache_n * 2) as u64;
        measure(points, stream, flush, "reference update (B8 S8192)", tokens, bytes, || {
            update.update_kv_cache(shape, &kn, &vn, &cos, &sin, &ck, &cv, &dpos, &mut out, stream)
        })?;
    }
    Ok(())
}

fn pct(p: &Point) -> f64 {
    100.0 * p.copy.median_us / p.op.median_us
}

fn plot(points: &[Point], path: &std::path::Path) -> Res<()> {
    use plotters::prelude::*;
    let root = SVGBackend::new(path, (1100, 650)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption("rope-cuda on the H200: share of copy bandwidth (no L2 flush)", ("sans-serif", 22))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(55)
        .build_cartesian_2d((1f64..131072f64).log_scale(), 0f64..110f64)?;
    chart.configure_mesh().x_desc("tokens").y_desc("% of device-to-device copy").draw()?;
    let mut kernels: Vec<&str> = points.iter().map(|p| p.kernel.as_str()).collect();
    kernels.dedup();
    for (i, k) in kernels.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let series: Vec<(f64, f64)> =
            points.iter().filter(|p| p.kernel == *k && !p.flush).map(|p| (p.tokens as f64, pct(p))).collect();
        chart
            .draw_series(LineSeries::new(series, color.stroke_width(2)))?
            .label(*k)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
    }
    chart.configure_series_labels().border_style(BLACK).background_style(WHITE.mix(0.9)).draw()?;
    root.present()?;
    Ok(())
}

fn main() -> Res<()> {
    let out_dir = std::env::args().skip(1).find(|a| !a.starts_with('-')).unwrap_or_else(|| "target/sweep".into());
    let _ctx = match cust::quick_init() {
        Ok(ctx) => ctx,
        Err(e) => {
            eprintln!("sweep: no usable CUDA device ({e}); the sweep needs an NVIDIA GPU.");
            return Ok(());
        }
    };
    let device = cust::device::Device::get_device(0)?;
    let kernels = Kernels::load()?;
    let stream = Stream::new(StreamFlags::NON_BLOCKING, None)?;
    let flush = filled::<u32>(128 << 20, 0, &stream)?; // 512 MiB, ten times the L2
    let empty_device = time_device(&kernels, &stream, 20, 200, || empty(&kernels, &stream, 1))?;
    let empty_eager = time_op(&stream, 20, 200, || empty(&kernels, &stream, 1))?;
    let mut points = Vec::new();
    for style in [RopeStyle::NeoX, RopeStyle::GptJ] {
        rope_points::<f32>(&mut points, &kernels, &stream, &flush, style, 0x3F80_0000, false)?;
        rope_points::<f16>(&mut points, &kernels, &stream, &flush, style, 0x3C00_3C00, false)?;
        rope_points::<bf16>(&mut points, &kernels, &stream, &flush, style, 0x3F80_3F80, false)?;
    }
    rope_points::<bf16>(&mut points, &kernels, &stream, &flush, RopeStyle::NeoX, 0x3F80_3F80, true)?;
    for cache in [Cache::PagedBshd, Cache::PagedBhsd, Cache::Contiguous] {
        append_points(&mut points, &kernels, &stream, &flush, cache, true)?;
    }
    append_points(&mut points, &kernels, &stream, &flush, Cache::PagedBshd, false)?;
    reference_points(&mut points, &kernels, &stream, &flush)?;

    std::fs::create_dir_all(&out_dir)?;
    let mut csv = String::from(
        "kernel,tokens,l2_flush,median_us,p90_us,bytes,gb_per_s,copy_median_us,copy_gb_per_s,percent_of_copy\n",
    );
    for p in &points {
        writeln!(
            csv,
            "\"{}\",{},{},{:.3},{:.3},{},{:.1},{:.3},{:.1},{:.1}",
            p.kernel,
            p.tokens,
            p.flush,
            p.op.median_us,
            p.op.p90_us,
            p.bytes,
            p.op.gb_per_s(p.bytes),
            p.copy.median_us,
            p.copy.gb_per_s(p.bytes),
            pct(p)
        )?;
    }
    let dir = std::path::Path::new(&out_dir);
    std::fs::write(dir.join("sweep.csv"), csv)?;
    plot(&points, &dir.join("sweep.svg"))?;

    println!("device: {}  (PTX for {})", device.name()?, kernels.arch());
    println!(
        "empty kernel (1 block): {:.2} us device, {:.2} us eager; wrote {}/sweep.csv and sweep.svg",
        empty_device.median_us, empty_eager.median_us, out_dir
    );
    println!();
    let shown = match std::env::var("SWEEP_TOKENS") {
        Ok(_) => token_counts().into_iter().take(4).collect(),
        Err(_) => vec![1, 64, 4096, 131072],
    };
    print!("{:<40}", "median us (% of copy), no flush");
    for &t in &shown {
        print!(" {:>20}", format!("{t} tokens"));
    }
    println!();
    let mut kernels_seen: Vec<&str> = points.iter().map(|p| p.kernel.as_str()).collect();
    kernels_seen.dedup();
    for k in kernels_seen {
        print!("{k:<40}");
        for &t in &shown {
            match points.iter().find(|p| p.kernel == k && p.tokens == t && !p.flush) {
                Some(p) => print!(" {:>20}", format!("{:.2} ({:.1}%)", p.op.median_us, pct(p))),
                None => print!(" {:>20}", "-"),
            }
        }
        println!();
    }
    Ok(())
}

trait Name {
    fn name(self) -> &'static str;
}

impl Name for DType {
    fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::E4M3 => "e4m3",
            DType::E5M2 => "e5m2",
        }
    }
}
