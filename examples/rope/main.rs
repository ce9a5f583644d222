//! The main job: the seed RoPE on the GPU, checked against the f64 CPU reference and timed
//! against a device-to-device copy of the same bytes in the same run.
//!
//! ```text
//! cargo run --release --example rope            # everything
//! cargo run --release --example rope -- --models # only the model-shaped rows
//! cargo run --release --example rope -- --kv     # only the KV-cache rows
//! cargo run --release --example rope -- --config path/to/config.json
//!                                                 # RoPE with that model's settings
//! ROPE_CUDA_COS_SIN=computed cargo run --release --example rope
//!                                                 # every `Rope` with that source of cos
//!                                                 # and sin (`table`, `computed`; unset:
//!                                                 # the library's choice, `CosSin::Auto`)
//! ```

use std::process::ExitCode;

use cust::memory::{CopyDestination, DeviceBuffer};
use cust::stream::{Stream, StreamFlags};
use rope_cuda::bench::{copy_d2d, time_device, time_op, Timing};
use rope_cuda::reference::{
    relative_error, rope_neox_row, rope_row_streams, splitmix64, uniform, uniform_vec, RefElem,
};
use rope_cuda::seed::RotaryModel;
use rope_cuda::{
    ConfigError, CosSin, DType, Direction, Error, Kernels, Layout, Positions, Rope, RopeArgs, RopeConfig, RopeStyle,
    Tensor, TensorMut,
};

const BASE: f64 = 10_000.0;
const REL_TOL: f64 = 2e-6;

struct Row {
    shape: String,
    mode: &'static str,
    rel_err: f64,
    rope: Timing,
    copy: Timing,
    bytes: u64,
}

fn main() -> ExitCode {
    let _ctx = match cust::quick_init() {
        Ok(ctx) => ctx,
        Err(e) => {
            eprintln!("rope: no usable CUDA device ({e}); this example needs an NVIDIA GPU and its driver.");
            return ExitCode::FAILURE;
        }
    };
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("rope: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `config` with the source of cos and sin that `ROPE_CUDA_COS_SIN` names (`table` or
/// `computed`), for comparing the two in one build; unchanged when it is unset.
fn cos_sin(config: RopeConfig) -> Result<RopeConfig, Box<dyn std::error::Error>> {
    Ok(match std::env::var("ROPE_CUDA_COS_SIN").as_deref() {
        Err(std::env::VarError::NotPresent) => config,
        Ok("table") => config.cos_sin(CosSin::Table),
        Ok("computed") => config.cos_sin(CosSin::Computed),
        _ => return Err("ROPE_CUDA_COS_SIN must be `table` or `computed`".into()),
    })
}

fn run() -> Result<bool, Box<dyn std::error::Error>> {
    let device = cust::device::Device::get_device(0)?;
    let source = cos_sin(RopeConfig::new(2, 1))?.cos_sin;
    let kernels = Kernels::load()?;
    println!("device: {}  (PTX for {}; ROPE_CUDA_PTX_ARCH picks another)", device.name()?, kernels.arch());
    println!("cos and sin: {source:?} (ROPE_CUDA_COS_SIN)");
    let stream = Stream::new(StreamFlags::NON_BLOCKING, None)?;
    let mut rows = Vec::new();
    let flag = |f: &str| std::env::args().any(|a| a == f);
    if flag("--kv") {
        return kv::run(&kernels, &stream);
    }
    let args: Vec<String> = std::env::args().collect();
    let config_path = args.iter().position(|a| a == "--config").map(|i| args.get(i + 1).cloned());
    let model = match &config_path {
        Some(None) => return Err("--config needs a path to a config.json".into()),
        Some(Some(path)) => Model::from_file(path)?,
        None => Model::default_model(),
    };
    if config_path.is_some() {
        let c = &model.config;
        let (_, attention) = c.frequencies()?;
        println!(
            "{}: rope_type {}, base {}, head_dim {}, rotary_dim {}, {:?} style, {} positions, attention factor {attention}, \
             {}/{} heads",
            model.name,
            c.scaling.rope_type(),
            c.base,
            c.head_dim,
            c.rotary_dim,
            c.style,
            c.max_position,
            model.hq,
            model.hk
        );
    }
    // What a `Rope` with computed cos and sin costs to build, and holds on the device: no
    // table, whatever the positions.
    if config_path.is_none() {
        println!("\nRope::new, computed cos and sin, head_dim 128 (llama3 scaling), bf16:");
        println!("{:>12} {:>10} {:>14}", "positions", "ms", "device bytes");
        for positions in [131_072usize, 1 << 20, 10_485_760] {
            let config = RopeConfig::from_hf_config(&format!(
                r#"{{"model_type": "llama", "head_dim": 128, "num_attention_heads": 40, "torch_dtype": "bfloat16",
                    "max_position_embeddings": {positions}, "rope_theta": 500000.0,
                    "rope_scaling": {{"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 1.0, "original_max_position_embeddings": 8192}}}}"#
            ))?
            .cos_sin(CosSin::Computed);
            let start = std::time::Instant::now();
            let rope = Rope::new(&kernels, config)?;
            let ms = start.elapsed().as_secs_f64() * 1e3;
            println!("{positions:>12} {ms:>10.3} {:>14}", rope.table().device_bytes());
        }
    }
    // `--models`: only the model-shaped rows (for comparing builds).
    let only_models = flag("--models") || config_path.is_some();
    if !only_models {
        for (shape, runs) in [([4, 8, 256, 64], 500), ([16, 32, 4096, 128], 50)] {
            rows.extend(case(&kernels, &stream, shape, runs)?);
        }
    }
    // RoPE for models: 16 sequences of 4096 tokens, 32 q heads, 8 k heads, head_dim 128,
    // per-token i32 positions (or the heads and settings of `--config`).
    use Mode::*;
    let m = &model;
    if config_path.is_some() {
        let style = m.config.style;
        for mode in [InPlace, OutOfPlace] {
            rows.push(model_case::<half::bf16>(&kernels, &stream, m, style, mode)?);
            rows.push(model_case::<half::f16>(&kernels, &stream, m, style, mode)?);
            rows.push(model_case::<f32>(&kernels, &stream, m, style, mode)?);
        }
    } else {
        for (style, mode) in [(RopeStyle::NeoX, InPlace), (RopeStyle::NeoX, OutOfPlace), (RopeStyle::NeoX, PackedQkv)] {
            rows.push(model_case::<half::bf16>(&kernels, &stream, m, style, mode)?);
            rows.push(model_case::<f32>(&kernels, &stream, m, style, mode)?);
        }
        rows.push(model_case::<half::f16>(&kernels, &stream, m, RopeStyle::NeoX, InPlace)?);
        rows.push(model_case::<half::bf16>(&kernels, &stream, m, RopeStyle::GptJ, InPlace)?);
        rows.push(model_case::<half::bf16>(&kernels, &stream, m, RopeStyle::NeoX, Mrope)?);
        rows.push(model_case::<f32>(&kernels, &stream, m, RopeStyle::NeoX, Mrope)?);
    }

    println!();
    println!(
        "{:<34} {:<13} {:>10} {:>10} {:>9} {:>9} {:>8} {:>9}",
        "shape", "mode", "median us", "p90 us", "GB/s", "copy GB/s", "% copy", "error"
    );
    let mut ok = true;
    for r in &rows {
        let (gbs, copy) = (r.rope.gb_per_s(r.bytes), r.copy.gb_per_s(r.bytes));
        ok &= r.rel_err <= if r.shape.contains("f32") { REL_TOL } else { 1.0 };
        println!(
            "{:<34} {:<13} {:>10.2} {:>10.2} {:>9.0} {:>9.0} {:>7.1}% {:>9.1e}",
            r.shape,
            r.mode,
            r.rope.median_us,
            r.rope.p90_us,
            gbs,
            copy,
            100.0 * gbs / copy,
            r.rel_err
        );
    }
    println!(
        "accuracy: {} (f32: relative error <= {REL_TOL:e}; f16/bf16: the error column is the worst ulps, <= 1)",
        if ok { "ok" } else { "FAILED" }
    );
    if !only_models {
        ok &= kv::run(&kernels, &stream)?;
    }
    Ok(ok)
}

mod kv;

/// Checks and times one shape, out of place and in place.
fn case(
    kernels: &std::sync::Arc<Kernels>,
    stream: &Stream,
    shape: [usize; 4],
    runs: usize,
) -> Result<Vec<Row>, Box<dyn std::error::Error>> {
    let n: usize = shape.iter().product();
    let (qh, kh) = (uniform_vec(11, 0, n), uniform_vec(11, 1, n));
    let (q, k) = (DeviceBuffer::from_slice(&qh)?, DeviceBuffer::from_slice(&kh)?);
    // SAFETY: written by the first launch before any read.
    let (mut q_out, mut k_out) = unsafe { (DeviceBuffer::uninitialized(n)?, DeviceBuffer::uninitialized(n)?) };
    let model = RotaryModel::new(kernels, shape[3], shape[2], BASE)?;
    model.forward_into(&q, &shape, &k, &shape, &mut q_out, &mut k_out, stream)?;
    stream.synchronize()?;

    // Check against the f64 reference: every row of small shapes, a sample of large ones.
    let (d, rows) = (shape[3], n / shape[3]);
    let step = if rows > 100_000 { 997 } else { 1 };
    let picked: Vec<usize> = (0..rows).filter(|r| r % step == 0 || *r >= rows - 64).collect();
    let mut got = Vec::new();
    let mut want = Vec::new();
    for (x, out) in [(&qh, &q_out), (&kh, &k_out)] {
        let mut host = vec![0.0f32; n];
        out.copy_to(&mut host[..])?;
        for &r in &picked {
            let xs: Vec<f64> = x[r * d..(r + 1) * d].iter().map(|&v| v as f64).collect();
            want.extend(rope_neox_row(&xs, (r % shape[2]) as f64, BASE));
            got.extend_from_slice(&host[r * d..(r + 1) * d]);
        }
    }
    let rel_err = relative_error(&got, &want);

    // Each run reads q and k and writes them (out of place) or back (in place).
    let bytes = (4 * n * 4) as u64;
    let warmup = 10;
    let copy = time_op(stream, warmup, runs, || {
        copy_d2d(&q, &mut q_out, stream)?;
        copy_d2d(&k, &mut k_out, stream)
    })?;
    let out_of_place =
        time_op(stream, warmup, runs, || model.forward_into(&q, &shape, &k, &shape, &mut q_out, &mut k_out, stream))?;
    let (mut qi, mut ki) = (DeviceBuffer::from_slice(&qh)?, DeviceBuffer::from_slice(&kh)?);
    let in_place = time_op(stream, warmup, runs, || model.forward_in_place(&mut qi, &shape, &mut ki, &shape, stream))?;
    let mut rows = vec![
        Row { shape: format!("seed f32 {shape:?}"), mode: "out of place", rel_err, rope: out_of_place, copy, bytes },
        Row { shape: format!("seed f32 {shape:?}"), mode: "in place", rel_err, rope: in_place, copy, bytes },
    ];
    if n <= 1 << 20 {
        // Small shapes: the device's time alone (the stream kept busy while the host queues
        // the launch), for the copy too.
        let copy = time_device(kernels, stream, warmup, runs, || {
            copy_d2d(&q, &mut q_out, stream)?;
            copy_d2d(&k, &mut k_out, stream)
        })?;
        let rope = time_device(kernels, stream, warmup, runs, || {
            model.forward_into(&q, &shape, &k, &shape, &mut q_out, &mut k_out, stream)
        })?;
        rows.push(Row { shape: format!("seed f32 {shape:?}"), mode: "out, device", rel_err, rope, copy, bytes });
    }
    Ok(rows)
}

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    InPlace,
    OutOfPlace,
    /// q and k as views of one `[tokens, (32 + 8 + 8) * 128]` QKV buffer, in place.
    PackedQkv,
    /// In place with multimodal RoPE: Qwen2-VL's sections (`[16, 24, 24]` at head_dim 128),
    /// three i32 position streams per token.
    Mrope,
}

/// The RoPE settings and head counts of the model rows.
struct Model {
    name: String,
    config: RopeConfig,
    hq: usize,
    hk: usize,
}

impl Model {
    /// 32 q and 8 k heads of 128, base 500000, 8192 positions.
    fn default_model() -> Self {
        Model { name: "default".into(), config: RopeConfig::new(128, 8192).base(500_000.0), hq: 32, hk: 8 }
    }

    /// A model's `config.json`: its RoPE settings (the full-attention layers' where they
    /// differ per layer type) and head counts; the table is capped at 2^20 positions.
    fn from_file(path: &str) -> Result<Self, Box<dyn std::error::Error>> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{path}: {e}"))?;
        let mut config = match RopeConfig::from_hf_config(&text) {
            Err(Error::Config(ConfigError::LayerTypeNeeded { .. })) => {
                RopeConfig::from_hf_config_layer(&text, "full_attention")?
            }
            other => other?,
        };
        config.max_position = config.max_position.min(1 << 20);
        let json: serde_json::Value = serde_json::from_str(&text)?;
        let json = if json.get("num_attention_heads").is_some() { &json } else { &json["text_config"] };
        let heads = |keys: &[&str]| keys.iter().find_map(|k| json.get(*k).and_then(|v| v.as_u64()));
        let hq = heads(&["num_attention_heads", "n_head"]).unwrap_or(32) as usize;
        let hk = heads(&["num_key_value_heads"]).map_or(hq, |h| h as usize);
        Ok(Model { name: path.to_string(), config, hq, hk })
    }
}

/// One model-shaped row: 16 x 4096 tokens, the model's heads, i32 ids; checked on sampled
/// tokens against the f64 reference of the model's frequencies, then timed against a copy of
/// the bytes it must move (q and k read and written).
fn model_case<T: RefElem>(
    kernels: &std::sync::Arc<Kernels>,
    stream: &Stream,
    model: &Model,
    style: RopeStyle,
    mode: Mode,
) -> Result<Row, Box<dyn std::error::Error>> {
    let (batch, seq, hq, hk, d) = (16, 4096, model.hq, model.hk, model.config.head_dim);
    let tokens = batch * seq;
    let mut config = model.config.clone().style(style).dtype(T::DTYPE);
    if mode == Mode::Mrope {
        let half = config.rotary_dim / 2;
        let (h, w) = (3 * half / 8, 3 * half / 8);
        config = config.mrope(Some(rope_cuda::Mrope::new([half - h - w, h, w], false)));
    }
    let mrope = config.mrope;
    let max_pos = config.max_position;
    let (freqs, attention) = config.frequencies()?;
    let rope = Rope::new(kernels, cos_sin(config)?)?;
    let ids: Vec<i32> = (0..tokens).map(|t| (splitmix64(t as u64) % max_pos as u64) as i32).collect();
    // MRoPE: the streams differ by small grid offsets (an image's rows and columns).
    let streams: Vec<i32> = (0..3)
        .flat_map(|k| ids.iter().enumerate().map(move |(t, &p)| (p + k * (t % 16) as i32).min(max_pos as i32 - 1)))
        .collect();
    let stream_of = |t: usize| [0, 1, 2].map(|k| streams[k * tokens + t] as f64);
    let ids_dev = DeviceBuffer::from_slice(if mode == Mode::Mrope { &streams } else { &ids })?;
    let (q_layout, k_layout, lens) = if mode == Mode::PackedQkv {
        let row = (hq + 2 * hk) * d;
        let strides = [seq * row, row, d];
        let q = Layout::strided([batch, seq, hq, d], strides, 0);
        (q, Layout::strided([batch, seq, hk, d], strides, hq * d), vec![tokens * row])
    } else {
        let (q, k) = (Layout::bshd(batch, seq, hq, d), Layout::bshd(batch, seq, hk, d));
        (q, k, vec![tokens * hq * d, tokens * hk * d])
    };
    let host: Vec<Vec<T>> = lens
        .iter()
        .enumerate()
        .map(|(i, &n)| (0..n as u64).map(|j| T::from_f32(uniform(5, i as u64, j))).collect())
        .collect();
    let mut bufs: Vec<DeviceBuffer<T>> = host.iter().map(|h| DeviceBuffer::from_slice(h)).collect::<Result<_, _>>()?;
    // SAFETY: uninitialized device memory of plain floats: the out-of-place launch below writes
    // every output element before anything reads it (in place, the outputs are never read).
    let mut outs: Vec<DeviceBuffer<T>> =
        lens.iter().map(|&n| unsafe { DeviceBuffer::uninitialized(n) }).collect::<Result<_, _>>()?;
    let (qb, kb) = (0, lens.len() - 1);
    let positions = if mode == Mode::Mrope { Positions::streams_i32(&ids_dev) } else { Positions::ids_i32(&ids_dev) };
    let launch = |bufs: &mut Vec<DeviceBuffer<T>>, outs: &mut Vec<DeviceBuffer<T>>| -> rope_cuda::Result<()> {
        let fwd = Direction::Forward;
        match mode {
            Mode::PackedQkv => {
                let (mut q, mut k) = TensorMut::pair(&mut bufs[0], q_layout, k_layout);
                rope.apply(RopeArgs::in_place(&mut q, positions).k(&mut k).direction(fwd), stream)
            }
            Mode::InPlace | Mode::Mrope => {
                let (a, b) = bufs.split_at_mut(1);
                let (mut q, mut k) = (TensorMut::new(&mut a[0], q_layout), TensorMut::new(&mut b[0], k_layout));
                rope.apply(RopeArgs::in_place(&mut q, positions).k(&mut k).direction(fwd), stream)
            }
            Mode::OutOfPlace => {
                let (q, k) = (Tensor::new(&bufs[qb], q_layout), Tensor::new(&bufs[kb], k_layout));
                let (a, b) = outs.split_at_mut(1);
                let (mut qo, mut ko) = (TensorMut::new(&mut a[0], q_layout), TensorMut::new(&mut b[0], k_layout));
                rope.apply(RopeArgs::into(&q, &mut qo, positions).k_into(&k, &mut ko).direction(fwd), stream)
            }
        }
    };

    // Check once, on every head of a sample of tokens.
    launch(&mut bufs, &mut outs)?;
    rope.check_errors(stream)?;
    let result = if mode == Mode::OutOfPlace { &outs } else { &bufs };
    let got: Vec<Vec<T>> = result
        .iter()
        .map(|b| {
            let mut h = vec![T::default(); b.len()];
            b.copy_to(&mut h[..]).map(|_| h)
        })
        .collect::<Result<_, _>>()?;
    let (mut worst_ulps, mut out32, mut ref64) = (0u64, Vec::new(), Vec::new());
    for t in (0..tokens).step_by(509).chain([tokens - 1]) {
        for (buf, layout) in [(qb, q_layout), (kb, k_layout)] {
            for h in 0..layout.heads() {
                let start = layout.offset + (t / seq) * layout.strides[0] + (t % seq) * layout.strides[1] + h * d;
                let x: Vec<f64> = host[buf][start..start + d].iter().map(|v| v.to_f64()).collect();
                let y = rope_row_streams(&x, stream_of(t), &freqs, attention, style, mrope, Direction::Forward);
                for (j, want) in y.into_iter().enumerate() {
                    let g = got[buf][start + j];
                    worst_ulps = worst_ulps.max(g.ulps(T::round(want)));
                    out32.push(g.to_f64() as f32);
                    ref64.push(want);
                }
            }
        }
    }
    let error = if T::DTYPE == DType::F32 { relative_error(&out32, &ref64) } else { worst_ulps as f64 };

    // Time it against one copy of the same number of bytes.
    // In place, only the rotary dims are read and written.
    let moved = if mode == Mode::OutOfPlace { d } else { model.config.rotary_dim };
    let elems = tokens * (hq + hk) * moved;
    let bytes = (2 * elems * std::mem::size_of::<T>()) as u64;
    let src = DeviceBuffer::from_slice(&host.concat()[..elems])?;
    // SAFETY: `dst` is only written (the copy below fills it) before it is read.
    let mut dst = unsafe { DeviceBuffer::<T>::uninitialized(elems)? };
    let runs = 30;
    let copy = time_op(stream, 5, runs, || copy_d2d(&src, &mut dst, stream))?;
    // In place, each run rotates the previous run's output: the speed does not depend on
    // the values (rerunning from restored inputs measured the same on the H200).
    let rope_t = time_op(stream, 5, runs, || launch(&mut bufs, &mut outs))?;
    let mode_name = match mode {
        Mode::InPlace => "in place",
        Mode::OutOfPlace => "out of place",
        Mode::PackedQkv => "packed QKV",
        Mode::Mrope => "MRoPE, in pl.",
    };
    let style_name = if style == RopeStyle::NeoX { "neox" } else { "gptj" };
    Ok(Row {
        shape: format!("{style_name} {} 16x4096 tok {hq}/{hk} h d{d}", T::NAME),
        mode: mode_name,
        rel_err: error,
        rope: rope_t,
        copy,
        bytes,
    })
}
