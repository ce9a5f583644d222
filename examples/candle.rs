//! This crate on candle (feature `candle-examples`), on the GPU:
//!
//! 1. `--rope`: the drop-ins `rope_cuda::candle::{rope, rope_i, rope_thd}` beside candle_nn's
//!    functions of those names on the same tensors (bf16; a prefill of 16 x 4096 tokens and a
//!    decode step of 64 sequences; q of 32 heads and k of 8, head_dim 128), timed with CUDA
//!    events (median), a device copy of the same tensors as the yardstick.
//! 2. `--llama`: a Llama-architecture model of SmolLM2-135M's shapes with seeded random
//!    weights, decoding greedily through candle-transformers' `llama` and through this
//!    example's own decoder on the same weights, whose attention takes RoPE and the KV cache
//!    from this crate (each layer one fused step: k rotated into a paged cache, v copied, q
//!    rotated in place; attention itself by candle ops). Each model runs once untimed, then
//!    prefills a prompt and decodes 64 tokens greedily; then this decoder is fed
//!    candle-transformers' tokens, and the two logits compare at every step. Then the tokens
//!    per second of each, and one layer's RoPE + cache time in a decode step.
//!
//! ```text
//! cargo run --release --features candle-examples --example candle [-- --rope | --llama] [--dtype bf16|f32]
//! cargo run --release --features candle-examples --example candle -- --decode-kernels  # for ncu
//! ```
//!
//! Without an argument both parts run (the llama part in bf16 and in f32). Exits non-zero if
//! the logits disagree beyond the tolerance printed, if the argmax differs at a step that is
//! not a near-tie, or (f32) if the greedy tokens differ. In bf16 candle-transformers rotates
//! by bf16 tables with each product rounded to bf16 (this crate: one rounding from the exact
//! rotation), and random weights' near-ties can part the free-running sequences: it says at
//! which step.
//!
//! Both sides allocate their outputs from the device's default memory pool, whose release
//! threshold this example raises (see [`keep_freed_memory`]).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Device, IndexOp, Module, Tensor, D};
use candle_nn::{Embedding, Linear, VarBuilder};
use candle_transformers::models::llama;
use cudarc::driver::CudaStream;
use rope_cuda::candle::{append_kv, load, Axes, Cache, Ids};
use rope_cuda::{Rope, RopeConfig};

type R<T> = Result<T, Box<dyn std::error::Error>>;

fn main() -> R<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let has = |a: &str| args.iter().any(|x| x == a);
    let (rope, llama) = match (has("--rope"), has("--llama")) {
        (false, false) => (true, true),
        other => other,
    };
    let dtypes = match args.iter().position(|a| a == "--dtype").and_then(|i| args.get(i + 1)).map(String::as_str) {
        Some("bf16") => vec![DType::BF16],
        Some("f32") => vec![DType::F32],
        Some(other) => return Err(format!("--dtype {other}: bf16 or f32").into()),
        None => vec![DType::BF16, DType::F32],
    };
    let device = Device::new_cuda(0)?;
    keep_freed_memory()?;
    if has("--decode-kernels") {
        // For a profiler: the decode rows' calls of both sides, a few times, untimed.
        return decode_kernels(&device);
    }
    let mut ok = true;
    let mut runs = Vec::new();
    if rope {
        drop_ins(&device)?;
    }
    if llama {
        for dtype in dtypes {
            let (agree, tokens) = decode(&device, dtype)?;
            ok &= agree;
            runs.push((dtype, tokens));
        }
        // How long each bf16 model follows the f32 models' greedy tokens.
        if let (Some((_, bf16)), Some((_, f32s))) =
            (runs.iter().find(|r| r.0 == DType::BF16), runs.iter().find(|r| r.0 == DType::F32))
        {
            let follows = |a: &[u32]| a.iter().zip(&f32s.0).take_while(|(x, y)| x == y).count();
            println!(
                "bf16 models' greedy tokens equal to candle-transformers' f32 ones: candle-transformers {} steps, \
                 rope-cuda decoder {} steps (of {})\n",
                follows(&bf16.0),
                follows(&bf16.1),
                f32s.0.len()
            );
        }
    }
    match ok {
        true => Ok(()),
        false => Err("the two models disagree (see above)".into()),
    }
}

/// Raises the release threshold of device 0's default memory pool (which candle's stream-ordered
/// allocations draw from) to the largest value, so that freed memory stays in the pool for the
/// next allocation instead of going back to the driver at each synchronisation, as an engine's
/// caching allocator keeps it. Both sides of every comparison allocate their outputs from it.
fn keep_freed_memory() -> R<()> {
    use cust::sys::{cuDeviceGet, cuDeviceGetDefaultMemPool, cuMemPoolSetAttribute};
    use cust::sys::{cudaError_enum, CUmemPool_attribute, CUmemoryPool};
    let check = |r: cudaError_enum, what: &str| match r {
        cudaError_enum::CUDA_SUCCESS => Ok(()),
        e => Err(format!("{what}: {e:?}")),
    };
    let (mut dev, mut pool): (i32, CUmemoryPool) = (0, std::ptr::null_mut());
    let mut threshold = u64::MAX;
    // SAFETY: plain driver queries and one attribute set on the device's own pool; the value is
    // a u64, as the attribute asks.
    unsafe {
        check(cuDeviceGet(&mut dev, 0), "cuDeviceGet")?;
        check(cuDeviceGetDefaultMemPool(&mut pool, dev), "cuDeviceGetDefaultMemPool")?;
        let value = (&mut threshold as *mut u64).cast();
        check(
            cuMemPoolSetAttribute(pool, CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, value),
            "cuMemPoolSetAttribute",
        )?;
    }
    Ok(())
}

/// The decode row's calls of candle's functions and the drop-ins, three times each, untimed:
/// for `ncu --kernel-name regex:rope`, which times the kernels alone.
fn decode_kernels(device: &Device) -> R<()> {
    let (b, hq, hk, d) = (64, 32, 8, 128);
    let angles = random(1, 100, &[b, 1, d / 2], 1000.0, DType::F32, device)?.abs()?;
    let (cos, sin) = (angles.cos()?.to_dtype(DType::BF16)?, angles.sin()?.to_dtype(DType::BF16)?);
    for thd in [false, true] {
        let shape = |h: usize| if thd { vec![b, 1, h, d] } else { vec![b, h, 1, d] };
        let (q, k) =
            (random(1, 1, &shape(hq), 1.0, DType::BF16, device)?, random(1, 2, &shape(hk), 1.0, DType::BF16, device)?);
        let fns: [RopeFn; 4] = match thd {
            false => [
                candle_nn::rotary_emb::rope,
                rope_cuda::candle::rope,
                candle_nn::rotary_emb::rope_i,
                rope_cuda::candle::rope_i,
            ],
            true => [
                candle_nn::rotary_emb::rope_thd,
                rope_cuda::candle::rope_thd,
                candle_nn::rotary_emb::rope_thd,
                rope_cuda::candle::rope_thd,
            ],
        };
        for f in fns.iter().take(if thd { 2 } else { 4 }) {
            for _ in 0..3 {
                let _rotated = (f(&q, &cos, &sin)?, f(&k, &cos, &sin)?);
            }
        }
    }
    // The drop-in on a q whose rows start 2 bytes past a 16-byte boundary: the element-wise
    // kernel (`_s_t`) where the aligned one is `_p_t`.
    let shape = [b, hq, 1, d];
    let n = shape.iter().product::<usize>();
    let q = random(1, 1, &[n + 1], 1.0, DType::BF16, device)?.narrow(0, 1, n)?.reshape(&shape[..])?;
    for _ in 0..3 {
        let _rotated = rope_cuda::candle::rope(&q, &cos, &sin)?;
    }
    stream(device)?.synchronize()?;
    println!("decode-kernels: done");
    Ok(())
}

fn stream(device: &Device) -> R<Arc<CudaStream>> {
    match device {
        Device::Cuda(d) => Ok(d.cuda_stream()),
        _ => Err("not a CUDA device".into()),
    }
}

/// Median time of `f` in microseconds on `device`'s stream: CUDA events around each of `runs`
/// runs after 5 warm-up runs. The events go through cust's driver bindings: cudarc's
/// `elapsed_ms` links `cuEventElapsedTime_v2`, which libcuda before CUDA 12.8 lacks at link time.
fn time_us(device: &Device, runs: usize, mut f: impl FnMut() -> candle_core::Result<()>) -> R<f64> {
    use cust::sys::{cuEventCreate, cuEventDestroy_v2, cuEventElapsedTime, cuEventRecord, cuEventSynchronize};
    use cust::sys::{cudaError_enum, CUevent, CUstream};
    let check = |r: cudaError_enum| {
        if r == cudaError_enum::CUDA_SUCCESS {
            Ok(())
        } else {
            Err(format!("CUDA event call: {r:?}"))
        }
    };
    let s = stream(device)?;
    let raw = s.cu_stream() as CUstream;
    let (mut a, mut b): (CUevent, CUevent) = (std::ptr::null_mut(), std::ptr::null_mut());
    // SAFETY: the events are created here, recorded on candle's live stream of the current
    // context, read after the later one completes, and destroyed once.
    unsafe {
        check(cuEventCreate(&mut a, 0))?;
        check(cuEventCreate(&mut b, 0))?;
    }
    for _ in 0..5 {
        f()?;
    }
    let mut t = Vec::with_capacity(runs);
    for _ in 0..runs {
        let mut ms = 0f32;
        // SAFETY: `a` was created above and `raw` is candle's live stream.
        unsafe { check(cuEventRecord(a, raw))? };
        f()?;
        // SAFETY: as above for `b`; both events were recorded before the elapsed time is read.
        unsafe {
            check(cuEventRecord(b, raw))?;
            check(cuEventSynchronize(b))?;
            check(cuEventElapsedTime(&mut ms, a, b))?;
        }
        t.push(ms as f64 * 1e3);
    }
    // SAFETY: the events were created above, their last use has completed (synchronised), and
    // each is destroyed once.
    unsafe {
        check(cuEventDestroy_v2(a))?;
        check(cuEventDestroy_v2(b))?;
    }
    t.sort_by(f64::total_cmp);
    Ok(t[runs / 2])
}

/// Seeded values in [-1, 1) of `shape`, as `dtype`, on `device`.
fn random(seed: u64, tensor: u64, shape: &[usize], scale: f32, dtype: DType, device: &Device) -> R<Tensor> {
    let n = shape.iter().product::<usize>() as u64;
    let v: Vec<f32> = (0..n).map(|i| scale * rope_cuda::reference::uniform(seed, tensor, i)).collect();
    Ok(Tensor::from_vec(v, shape, device)?.to_dtype(dtype)?)
}

type RopeFn = fn(&Tensor, &Tensor, &Tensor) -> candle_core::Result<Tensor>;

/// The drop-ins against candle_nn's functions on the same tensors.
fn drop_ins(device: &Device) -> R<()> {
    let (hq, hk, d) = (32, 8, 128);
    let seed = 0x5eed_ca4d1e;
    println!("candle drop-ins (bf16, q {hq} heads, k {hk}, head_dim {d}): median of CUDA-event times");
    println!(
        "{:<10} {:<28} {:>12} {:>12} {:>8} {:>10} {:>10} {:>14}",
        "function", "shape", "candle us", "rope-cuda us", "speedup", "% of copy", "max |diff|", "host us c / r"
    );
    let fns: [(&str, bool, RopeFn, RopeFn); 3] = [
        ("rope", false, candle_nn::rotary_emb::rope, rope_cuda::candle::rope),
        ("rope_i", false, candle_nn::rotary_emb::rope_i, rope_cuda::candle::rope_i),
        ("rope_thd", true, candle_nn::rotary_emb::rope_thd, rope_cuda::candle::rope_thd),
    ];
    // A prefill (tables shared by the sequences) and a decode step of 64 sequences, each at
    // its own position (tables per sequence, [b, 1, d / 2]).
    for (label, b, t, batched, runs) in
        [("16 x 4096 prefill", 16, 4096, false, 20), ("64-token decode", 64, 1, true, 200)]
    {
        let table_shape: Vec<usize> = if batched { vec![b, t, d / 2] } else { vec![t, d / 2] };
        let angles = random(seed, 100, &table_shape, 1000.0, DType::F32, device)?.abs()?;
        let (cos, sin) = (angles.cos()?.to_dtype(DType::BF16)?, angles.sin()?.to_dtype(DType::BF16)?);
        for (name, thd, theirs, ours) in fns {
            let shape = |h: usize| if thd { vec![b, t, h, d] } else { vec![b, h, t, d] };
            let q = random(seed, 1, &shape(hq), 1.0, DType::BF16, device)?;
            let k = random(seed, 2, &shape(hk), 1.0, DType::BF16, device)?;
            let both =
                |f: RopeFn| -> candle_core::Result<(Tensor, Tensor)> { Ok((f(&q, &cos, &sin)?, f(&k, &cos, &sin)?)) };
            let candle_us = time_us(device, runs, || both(theirs).map(drop))?;
            let ours_us = time_us(device, runs, || both(ours).map(drop))?;
            // The host's time per call pair, queueing `runs` pairs back to back.
            let host_us = |f: RopeFn| -> R<f64> {
                stream(device)?.synchronize()?;
                let start = Instant::now();
                for _ in 0..runs {
                    both(f)?;
                }
                let us = start.elapsed().as_secs_f64() * 1e6 / runs as f64;
                stream(device)?.synchronize()?;
                Ok(us)
            };
            let (candle_host, ours_host) = (host_us(theirs)?, host_us(ours)?);
            let copy_us = time_us(device, runs, || {
                let _copies = (q.copy()?, k.copy()?);
                Ok(())
            })?;
            let ((a, b2), (c, e)) = (both(theirs)?, both(ours)?);
            let diff = |x: &Tensor, y: &Tensor| -> candle_core::Result<f32> {
                (x.to_dtype(DType::F32)? - y.to_dtype(DType::F32)?)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()
            };
            let max_diff = diff(&a, &c)?.max(diff(&b2, &e)?);
            println!(
                "{:<10} {:<28} {:>12.1} {:>12.1} {:>7.2}x {:>9.1}% {:>10.4} {:>14}",
                name,
                format!("{label} {:?}", q.dims()),
                candle_us,
                ours_us,
                candle_us / ours_us,
                100.0 * copy_us / ours_us,
                max_diff,
                format!("{candle_host:.1} / {ours_host:.1}")
            );
        }
    }
    println!("(% of copy: a device copy of q and k, the same bytes read and written, over rope-cuda's time)");
    println!("(max |diff|: largest difference between the two outputs; candle's kernel rounds each product to bf16)");
    println!("(host us: the host's time per call pair, candle's / rope-cuda's, queueing the runs back to back)\n");
    Ok(())
}

/// SmolLM2-135M's config.json (the fields a Llama needs).
const SMOLLM2_135M: &str = r#"{
  "hidden_size": 576, "intermediate_size": 1536, "vocab_size": 49152, "num_hidden_layers": 30,
  "num_attention_heads": 9, "num_key_value_heads": 3, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
  "max_position_embeddings": 8192, "tie_word_embeddings": true, "bos_token_id": 0, "eos_token_id": 0
}"#;

/// The model's seeded random weights, named as in its safetensors.
fn weights(c: &llama::Config, dtype: DType, device: &Device) -> R<HashMap<String, Tensor>> {
    let seed = 0x5ead_11a3a;
    let (h, i, v) = (c.hidden_size, c.intermediate_size, c.vocab_size);
    let kv = h / c.num_attention_heads * c.num_key_value_heads;
    let mut shapes: Vec<(String, Vec<usize>, f32)> = vec![("model.embed_tokens.weight".into(), vec![v, h], 0.05)];
    for l in 0..c.num_hidden_layers {
        let p = format!("model.layers.{l}");
        for (name, shape) in [
            ("self_attn.q_proj", vec![h, h]),
            ("self_attn.k_proj", vec![kv, h]),
            ("self_attn.v_proj", vec![kv, h]),
            ("self_attn.o_proj", vec![h, h]),
            ("mlp.gate_proj", vec![i, h]),
            ("mlp.up_proj", vec![i, h]),
            ("mlp.down_proj", vec![h, i]),
        ] {
            shapes.push((format!("{p}.{name}.weight"), shape, 0.05));
        }
        for name in ["input_layernorm", "post_attention_layernorm"] {
            shapes.push((format!("{p}.{name}.weight"), vec![h], 0.0));
        }
    }
    shapes.push(("model.norm.weight".into(), vec![h], 0.0));
    let mut all = HashMap::new();
    for (n, (name, shape, scale)) in shapes.into_iter().enumerate() {
        let t = match scale {
            // Norm weights: 1 +- 0.1.
            0.0 => (random(seed, n as u64, &shape, 0.1, DType::F32, device)? + 1.0)?.to_dtype(dtype)?,
            s => random(seed, n as u64, &shape, s, dtype, device)?,
        };
        all.insert(name, t);
    }
    Ok(all)
}

/// One layer of this example's decoder.
struct Layer {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    gate: Linear,
    up: Linear,
    down: Linear,
    norm_1: Tensor,
    norm_2: Tensor,
    /// The paged caches, `[blocks, block_size, kv heads, head_dim]`.
    cache_k: Tensor,
    cache_v: Tensor,
}

/// A Llama decoder whose RoPE and KV cache are this crate's fused step.
struct Decoder {
    embed: Embedding,
    lm_head: Linear,
    layers: Vec<Layer>,
    norm: Tensor,
    eps: f32,
    heads: (usize, usize, usize),
    rope: Rope,
    /// `0..max_len` as i64: each call's positions, and its slots (one sequence whose blocks
    /// are the cache's in order).
    ids: Tensor,
    max_len: usize,
}

impl Decoder {
    fn new(c: &llama::Config, w: &HashMap<String, Tensor>, max_len: usize, device: &Device) -> R<Self> {
        let get = |n: &str| w.get(n).cloned().ok_or_else(|| format!("no weight {n}"));
        let lin = |n: &str| -> R<Linear> { Ok(Linear::new(get(&format!("{n}.weight"))?, None)) };
        let (hq, hk) = (c.num_attention_heads, c.num_key_value_heads);
        let d = c.hidden_size / hq;
        let dtype = get("model.norm.weight")?.dtype();
        let block = 16;
        let blocks = max_len.div_ceil(block);
        let mut layers = Vec::new();
        for l in 0..c.num_hidden_layers {
            let p = format!("model.layers.{l}");
            let cache = || Tensor::zeros((blocks, block, hk, d), dtype, device);
            layers.push(Layer {
                q: lin(&format!("{p}.self_attn.q_proj"))?,
                k: lin(&format!("{p}.self_attn.k_proj"))?,
                v: lin(&format!("{p}.self_attn.v_proj"))?,
                o: lin(&format!("{p}.self_attn.o_proj"))?,
                gate: lin(&format!("{p}.mlp.gate_proj"))?,
                up: lin(&format!("{p}.mlp.up_proj"))?,
                down: lin(&format!("{p}.mlp.down_proj"))?,
                norm_1: get(&format!("{p}.input_layernorm.weight"))?,
                norm_2: get(&format!("{p}.post_attention_layernorm.weight"))?,
                cache_k: cache()?,
                cache_v: cache()?,
            });
        }
        let kernels = load(device)?;
        let ours = match dtype {
            DType::BF16 => rope_cuda::DType::BF16,
            DType::F16 => rope_cuda::DType::F16,
            _ => rope_cuda::DType::F32,
        };
        let config = RopeConfig::new(d, c.max_position_embeddings).base(c.rope_theta as f64).dtype(ours);
        let embed_w = get("model.embed_tokens.weight")?;
        Ok(Decoder {
            embed: Embedding::new(embed_w.clone(), c.hidden_size),
            lm_head: Linear::new(embed_w, None),
            layers,
            norm: get("model.norm.weight")?,
            eps: c.rms_norm_eps as f32,
            heads: (hq, hk, d),
            rope: Rope::new(&kernels, config)?,
            ids: Tensor::arange(0i64, max_len as i64, device)?,
            max_len,
        })
    }

    /// The logits (f32) of the last of `tokens` (`[1, t]`), the first at position `pos`.
    fn forward(&self, tokens: &Tensor, pos: usize) -> R<Tensor> {
        let (b, t) = tokens.dims2()?;
        let (hq, hk, d) = self.heads;
        let len = pos + t;
        if len > self.max_len {
            return Err(format!("{len} tokens: the cache holds {}", self.max_len).into());
        }
        let mut x = self.embed.forward(tokens)?;
        for layer in &self.layers {
            let h = candle_nn::ops::rms_norm(&x, &layer.norm_1, self.eps)?;
            let q = layer.q.forward(&h)?.reshape((b, t, hq, d))?;
            let k = layer.k.forward(&h)?.reshape((b, t, hk, d))?;
            let v = layer.v.forward(&h)?.reshape((b, t, hk, d))?;
            // This crate's step: k rotated into the paged cache, v copied, q rotated in place.
            let ids = self.ids.narrow(0, pos, t)?;
            let cache = Cache { k: &layer.cache_k, v: &layer.cache_v, axes: Axes::Bshd, paged: true };
            append_kv(&self.rope, Some(&q), &k, &v, cache, Ids::Ids(&ids), Some(&ids), Axes::Bshd)?;
            // Attention over the cache's first `len` rows, by candle ops (in f32).
            let rows = |c: &Tensor| -> candle_core::Result<Tensor> {
                let all = c.reshape((c.dim(0)? * c.dim(1)?, hk, d))?;
                all.narrow(0, 0, len)?.unsqueeze(0)?.transpose(1, 2)?.contiguous()
            };
            let (kc, vc) =
                (repeat_heads(rows(&layer.cache_k)?, hq / hk)?, repeat_heads(rows(&layer.cache_v)?, hq / hk)?);
            let q = q.transpose(1, 2)?.to_dtype(DType::F32)?.contiguous()?;
            let (kc, vc) = (kc.to_dtype(DType::F32)?, vc.to_dtype(DType::F32)?);
            let mut att = (q.matmul(&kc.t()?)? / (d as f64).sqrt())?;
            if t > 1 {
                let mask: Vec<u8> = (0..t).flat_map(|i| (0..len).map(move |j| u8::from(j > pos + i))).collect();
                let mask = Tensor::from_slice(&mask, (t, len), x.device())?.broadcast_as(att.shape())?;
                let minus_inf = Tensor::new(f32::NEG_INFINITY, x.device())?.broadcast_as(att.shape())?;
                att = mask.where_cond(&minus_inf, &att)?;
            }
            let att = candle_nn::ops::softmax_last_dim(&att)?;
            let y = att.matmul(&vc.contiguous()?)?.to_dtype(x.dtype())?;
            let y = y.transpose(1, 2)?.reshape((b, t, hq * d))?;
            x = (layer.o.forward(&y)? + &x)?;
            let h = candle_nn::ops::rms_norm(&x, &layer.norm_2, self.eps)?;
            let mlp = (candle_nn::ops::silu(&layer.gate.forward(&h)?)? * layer.up.forward(&h)?)?;
            x = (layer.down.forward(&mlp)? + &x)?;
        }
        let x = candle_nn::ops::rms_norm(&x, &self.norm, self.eps)?;
        let x = x.i((.., t - 1, ..))?.contiguous()?;
        Ok(self.lm_head.forward(&x)?.to_dtype(DType::F32)?)
    }
}

/// `[b, kv, s, d]` with each kv head repeated `n` times, `[b, kv * n, s, d]`.
fn repeat_heads(x: Tensor, n: usize) -> candle_core::Result<Tensor> {
    if n == 1 {
        return Ok(x);
    }
    let (b, kv, s, d) = x.dims4()?;
    Tensor::cat(&vec![&x; n], 2)?.reshape((b, kv * n, s, d))
}

fn argmax(logits: &Tensor) -> R<u32> {
    Ok(logits.argmax(D::Minus1)?.flatten_all()?.to_vec1::<u32>()?[0])
}

/// A greedy run: each step's token and logits, and the prefill's and the decode steps' times.
struct Run {
    tokens: Vec<u32>,
    logits: Vec<Tensor>,
    prefill_s: f64,
    decode_s: f64,
}

/// Prefills `prompt` through `forward` (tokens `[1, t]`, first position), then takes `steps`
/// tokens greedily; with `forced`, feeds `forced[step]` instead of the argmax (as many steps as
/// it has tokens), still recording the argmax.
fn greedy(
    device: &Device,
    prompt: &[u32],
    steps: usize,
    forced: Option<&[u32]>,
    mut forward: impl FnMut(&Tensor, usize) -> R<Tensor>,
) -> R<Run> {
    let steps = forced.map_or(steps, |f| f.len().min(steps));
    let s = stream(device)?;
    let mut run = Run { tokens: Vec::new(), logits: Vec::new(), prefill_s: 0.0, decode_s: 0.0 };
    let start = Instant::now();
    let mut logits = forward(&Tensor::new(prompt, device)?.unsqueeze(0)?, 0)?;
    let mut next = argmax(&logits)?;
    run.prefill_s = start.elapsed().as_secs_f64();
    let start = Instant::now();
    for step in 0..steps {
        run.tokens.push(next);
        run.logits.push(logits.clone());
        if step + 1 == steps {
            break;
        }
        let fed = forced.map_or(next, |f| f[step]);
        logits = forward(&Tensor::new(&[fed], device)?.unsqueeze(0)?, prompt.len() + step)?;
        next = argmax(&logits)?;
    }
    s.synchronize()?;
    run.decode_s = start.elapsed().as_secs_f64();
    Ok(run)
}

/// Tokens of candle-transformers' model and of this example's decoder.
type Tokens = (Vec<u32>, Vec<u32>);

/// Both models on the same weights: prefill, 64 greedy steps; whether they agree, and the
/// tokens of each.
fn decode(device: &Device, dtype: DType) -> R<(bool, Tokens)> {
    let (prompt_len, steps) = (32, 64);
    let c = serde_json::from_str::<llama::LlamaConfig>(SMOLLM2_135M)?.into_config(false);
    println!(
        "Llama of SmolLM2-135M's shapes ({} layers, hidden {}, {}/{} heads of {}, vocab {}), seeded random weights, {dtype:?}",
        c.num_hidden_layers,
        c.hidden_size,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.hidden_size / c.num_attention_heads,
        c.vocab_size
    );
    let w = weights(&c, dtype, device)?;
    let vb = VarBuilder::from_tensors(w.clone(), dtype, device);
    let model = llama::Llama::load(vb, &c)?;
    let ours = Decoder::new(&c, &w, prompt_len + steps, device)?;
    let prompt: Vec<u32> = (0..prompt_len as u64)
        .map(|i| (rope_cuda::reference::splitmix64(0x9e37 ^ i) % c.vocab_size as u64) as u32)
        .collect();

    // Each model once untimed (its first calls load kernels and set up cuBLAS), then timed.
    let theirs_run = |forced: Option<&[u32]>| {
        let mut cache = llama::Cache::new(true, dtype, &c, device)?;
        greedy(device, &prompt, steps, forced, |x, pos| Ok(model.forward(x, pos, &mut cache)?))
    };
    let ours_run = |forced: Option<&[u32]>| greedy(device, &prompt, steps, forced, |x, pos| ours.forward(x, pos));
    let warm: Vec<u32> = vec![0; 2];
    theirs_run(Some(&warm))?;
    ours_run(Some(&warm))?;
    let theirs = theirs_run(None)?;
    let mine = ours_run(None)?;
    // Our decoder fed candle-transformers' tokens (teacher forcing): every step's logits
    // compare, also after a near-tie has sent the free-running sequences apart.
    let forced = ours_run(Some(&theirs.tokens))?;

    // The comparison: the tokens, and every step's logits within the tolerance (relative to
    // the step's largest logit: 2^-5 for bf16, about 8 of its ulps; 1e-4 for f32). A step
    // whose argmax differs must be a near-tie: candle-transformers' two best logits closer
    // than twice the tolerance.
    let rel = if dtype == DType::F32 { 1e-4 } else { 1.0 / 32.0 };
    let host =
        |l: &[Tensor]| -> candle_core::Result<Vec<Vec<f32>>> { l.iter().map(|t| t.flatten_all()?.to_vec1()).collect() };
    let (theirs_logits, forced_logits) = (host(&theirs.logits)?, host(&forced.logits)?);
    let first_diff = theirs.tokens.iter().zip(&mine.tokens).position(|(a, b)| a != b);
    let (mut worst, mut within, mut flips) = ((0.0f32, 0usize), true, Vec::new());
    for (step, (a, b)) in theirs_logits.iter().zip(&forced_logits).enumerate() {
        let scale = a.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let diff = a.iter().zip(b).fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
        if diff / scale > worst.0 {
            worst = (diff / scale, step);
        }
        within &= diff <= rel * scale;
        if theirs.tokens[step] != forced.tokens[step] {
            let mut top = a.clone();
            top.sort_by(|x, y| y.total_cmp(x));
            flips.push((step, (top[0] - top[1]) / scale));
        }
    }
    let near_ties = flips.iter().all(|&(_, margin)| margin <= 2.0 * rel);
    println!("  tokens (candle-transformers): {:?}", theirs.tokens);
    println!("  tokens (rope-cuda decoder)  : {:?}", mine.tokens);
    match first_diff {
        None => println!("  identical greedy tokens over {steps} steps"),
        Some(s) => println!("  tokens differ from step {s}"),
    }
    println!(
        "  logits, rope-cuda fed candle-transformers' tokens: largest difference {:.2e} of the step's largest \
         logit (step {}); tolerance {rel:.1e}: {}",
        worst.0,
        worst.1,
        if within { "within" } else { "EXCEEDED" }
    );
    for (step, margin) in &flips {
        println!(
            "  step {step}: argmax differs; candle-transformers' two best logits {:.2e} of the largest apart ({})",
            margin,
            if *margin <= 2.0 * rel { "a near-tie" } else { "NOT a near-tie" }
        );
    }
    let (prefill_theirs, decode_theirs, prefill_ours, decode_ours) =
        (theirs.prefill_s, theirs.decode_s, mine.prefill_s, mine.decode_s);
    // f32: the tokens must be identical; bf16, where candle's kernel rounds each product to
    // bf16 and its tables are bf16 while this crate rounds once from exact cos and sin, random
    // weights' near-ties may part the sequences: the logits must agree and any flip be a tie.
    let agree = within && near_ties && (first_diff.is_none() || dtype != DType::F32);

    // One layer's RoPE + cache work in a decode step at position prompt + 32, each model's way.
    let (hq, hk, d) = (c.num_attention_heads, c.num_key_value_heads, c.hidden_size / c.num_attention_heads);
    let pos = prompt_len + 32;
    let q = random(7, 1, &[1, 1, hq * d], 1.0, dtype, device)?;
    let k = random(7, 2, &[1, 1, hk * d], 1.0, dtype, device)?;
    let v = random(7, 3, &[1, 1, hk * d], 1.0, dtype, device)?;
    // candle-transformers' way: q and k to [b, h, 1, d], rope by its tables, the cache grown by
    // concatenation.
    let (cos, sin) = {
        let half = d / 2;
        let inv: Vec<f32> = (0..half).map(|i| 1.0 / c.rope_theta.powf(2.0 * i as f32 / d as f32)).collect();
        let p = Tensor::arange(0u32, (pos + 1) as u32, device)?.to_dtype(DType::F32)?.reshape((pos + 1, 1))?;
        let ang = p.matmul(&Tensor::new(inv, device)?.reshape((1, half))?)?;
        (ang.cos()?.to_dtype(dtype)?, ang.sin()?.to_dtype(dtype)?)
    };
    let past_k = random(7, 4, &[1, hk, pos, d], 1.0, dtype, device)?;
    let past_v = random(7, 5, &[1, hk, pos, d], 1.0, dtype, device)?;
    let step_theirs = time_us(device, 200, || {
        let qh = q.reshape((1, 1, hq, d))?.transpose(1, 2)?.contiguous()?;
        let kh = k.reshape((1, 1, hk, d))?.transpose(1, 2)?.contiguous()?;
        let vh = v.reshape((1, 1, hk, d))?.transpose(1, 2)?;
        let (cs, sn) = (cos.narrow(0, pos, 1)?, sin.narrow(0, pos, 1)?);
        let _q = candle_nn::rotary_emb::rope(&qh, &cs, &sn)?;
        let kh = candle_nn::rotary_emb::rope(&kh, &cs, &sn)?;
        let _k = Tensor::cat(&[&past_k, &kh], 2)?.contiguous()?;
        let _v = Tensor::cat(&[&past_v, &vh], 2)?.contiguous()?;
        Ok(())
    })?;
    let layer = &ours.layers[0];
    let ids = ours.ids.narrow(0, pos, 1)?;
    let (q4, k4, v4) = (q.reshape((1, 1, hq, d))?, k.reshape((1, 1, hk, d))?, v.reshape((1, 1, hk, d))?);
    let step_ours = time_us(device, 200, || {
        let cache = Cache { k: &layer.cache_k, v: &layer.cache_v, axes: Axes::Bshd, paged: true };
        append_kv(&ours.rope, Some(&q4), &k4, &v4, cache, Ids::Ids(&ids), Some(&ids), Axes::Bshd)
    })?;

    println!("  {:<34} {:>14} {:>14}", "", "candle-transf.", "rope-cuda");
    println!(
        "  {:<34} {:>14.2} {:>14.2}",
        format!("prefill of {prompt_len} tokens, ms"),
        prefill_theirs * 1e3,
        prefill_ours * 1e3
    );
    println!(
        "  {:<34} {:>14.1} {:>14.1}",
        format!("decode, tokens/s ({} steps)", steps - 1),
        (steps - 1) as f64 / decode_theirs,
        (steps - 1) as f64 / decode_ours
    );
    println!("  {:<34} {:>14.2} {:>14.2}", format!("one layer's RoPE + cache, us (pos {pos})"), step_theirs, step_ours);
    println!(
        "  (candle-transformers: rope on q and k by its {dtype:?} tables, k and v concatenated onto the cache; \
         rope-cuda: one fused append into the paged cache, q in place)\n"
    );
    Ok((agree, (theirs.tokens, mine.tokens)))
}
