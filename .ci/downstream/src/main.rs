//! Uses rope-cuda's public API from a stable-Rust crate, as a newcomer would: the embedded PTX,
//! then (on a machine with a GPU) one decode step of three models built from their
//! `config.json` through the typed doors only: OLMo 2's whole-projection QK-norm into FP8
//! caches, Qwen3's per-head QK-norm, and DeepSeek-V3's MLA latent cache with its `kv_c` norm.
//! No raw struct, no `match` on `NormKind`.

use cust::memory::DeviceBuffer;
use cust::stream::{Stream, StreamFlags};
use rope_cuda::{
    HfConfig, HostTable, Kernels, KvAppend, KvCache, KvRead, KvScales, Layout, MlaAppend, MlaCache, Positions, Rope,
    Tensor, TensorMut, F8E4M3,
};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

const QWEN3: &str = r#"{"model_type": "qwen3", "hidden_size": 4096, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
    "max_position_embeddings": 40960}"#;
const OLMO2: &str = r#"{"model_type": "olmo2", "hidden_size": 4096, "num_attention_heads": 32,
    "num_key_value_heads": 32, "rms_norm_eps": 1e-6, "rope_theta": 500000, "max_position_embeddings": 4096}"#;
const DEEPSEEK_V3: &str = r#"{"model_type": "deepseek_v3", "num_attention_heads": 128, "kv_lora_rank": 512,
    "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "rms_norm_eps": 1e-6,
    "rope_theta": 10000, "max_position_embeddings": 163840,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
    "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}}"#;

/// Seeded values in [-1, 1).
fn noise(seed: u64, n: usize) -> Vec<f32> {
    (0..n as u64).map(|i| rope_cuda::reference::uniform(seed, 0, i)).collect()
}

/// One decode step (`t` sequences, one token each, at position 100) of a model with QK-norm:
/// q rotated in place, k and v into paged caches (FP8 with per-head scales when `fp8`), the
/// norm and the geometry from the config. Returns the keys read back from the cache.
fn qk_norm_step(
    kernels: &std::sync::Arc<Kernels>,
    stream: &Stream,
    json: &str,
    (hq, hk): (usize, usize),
    fp8: bool,
) -> Res<Vec<f32>> {
    let config = HfConfig::parse(json)?;
    let rope = Rope::new(kernels, config.rope()?)?; // f32 inputs: the configuration's default
    let spec = config.qk_norm(0)?.expect("this model normalizes q and k");
    let (q_len, k_len) = spec.weight_lens().expect("the config gives the sizes");
    let (d, t, blocks) = (128, 4, 64);
    let (mut q, k, v) = (DeviceBuffer::from_slice(&noise(1, t * hq * d))?, noise(2, t * hk * d), noise(3, t * hk * d));
    let (k, v) = (DeviceBuffer::from_slice(&k)?, DeviceBuffer::from_slice(&v)?);
    let (q_w, k_w) = (DeviceBuffer::from_slice(&noise(4, q_len))?, DeviceBuffer::from_slice(&noise(5, k_len))?);
    let norm = spec.weights(&q_w, &k_w)?; // the lengths checked against the config
    let pos = DeviceBuffer::from_slice(&vec![100i32; t])?;
    let slots = DeviceBuffer::from_slice(&(0..t as i64).map(|s| s * 16 + 4).collect::<Vec<_>>())?;
    let layout = Layout::bshd(blocks, 16, hk, d);
    let mut qv = TensorMut::new(&mut q, Layout::packed(t, hq, d));
    let (kv, vv) = (Tensor::new(&k, Layout::packed(t, hk, d)), Tensor::new(&v, Layout::packed(t, hk, d)));
    let mut out = DeviceBuffer::from_slice(&vec![f32::NAN; t * hk * d])?;
    if fp8 {
        let n = blocks * 16 * hk * d;
        let (mut k8, mut v8) =
            (DeviceBuffer::from_slice(&vec![F8E4M3(0); n])?, DeviceBuffer::from_slice(&vec![F8E4M3(0); n])?);
        let scales = DeviceBuffer::from_slice(&vec![0.05f32; hk])?;
        {
            let mut cache = KvCache::paged(&mut k8, &mut v8, layout).scales(KvScales::per_head(&scales, &scales));
            let step = KvAppend::new(&kv, &vv, &mut cache, Positions::ids_i32(&pos)).q(&mut qv).slots(&slots);
            rope.append_kv(step.norm(norm), stream)?;
        }
        // The keys back in f32, through shared borrows of the caches.
        let mut rows = TensorMut::new(&mut out, Layout::bshd(1, t, hk, d));
        let read = KvRead::shared(&k8, &v8, layout, KvScales::per_head(&scales, &scales), &slots);
        rope.read_kv(read.k(&mut rows), stream)?;
    } else {
        let n = blocks * 16 * hk * d;
        let (mut kc, mut vc) = (DeviceBuffer::from_slice(&vec![0f32; n])?, DeviceBuffer::from_slice(&vec![0f32; n])?);
        let mut cache = KvCache::paged(&mut kc, &mut vc, layout);
        let step = KvAppend::new(&kv, &vv, &mut cache, Positions::ids_i32(&pos)).q(&mut qv).slots(&slots);
        rope.append_kv(step.norm(norm), stream)?;
        drop(cache);
        stream.synchronize()?;
        let host = kc.as_host_vec()?;
        let rows: Vec<f32> = (0..t).flat_map(|s| host[(s * 16 + 4) * hk * d..][..hk * d].to_vec()).collect();
        out = DeviceBuffer::from_slice(&rows)?;
    }
    rope.check_errors(stream)?;
    stream.synchronize()?;
    Ok(out.as_host_vec()?)
}

/// One MLA decode step of DeepSeek-V3 from its config: q_pe rotated in place, kv_c normalized
/// (kv_a_layernorm, its eps from the geometry) and k_pe rotated into the latent cache.
fn mla_step(kernels: &std::sync::Arc<Kernels>, stream: &Stream) -> Res<Vec<f32>> {
    let config = HfConfig::parse(DEEPSEEK_V3)?;
    let geo = config.mla()?;
    let rope = Rope::new(kernels, config.rope()?)?;
    let (t, h, qd, w) = (4, geo.num_heads, geo.q_head_dim(), geo.latent_width());
    let (rank, pe) = (geo.kv_lora_rank, geo.qk_rope_head_dim);
    let mut q = DeviceBuffer::from_slice(&noise(6, t * h * qd))?;
    let kv_a = DeviceBuffer::from_slice(&noise(7, t * w))?;
    let weight = DeviceBuffer::from_slice(&noise(8, rank))?;
    let mut latent = DeviceBuffer::from_slice(&vec![0f32; 8 * 64 * w])?;
    let pos = DeviceBuffer::from_slice(&vec![100i32; t])?;
    let slots = DeviceBuffer::from_slice(&(0..t as i64).map(|s| s * 64 + 100).collect::<Vec<_>>())?;
    let nope = geo.qk_nope_head_dim;
    let mut q_pe = TensorMut::new(&mut q, Layout::strided([1, t, h, pe], [t * h * qd, h * qd, qd], nope));
    let kv_c = Tensor::new(&kv_a, Layout::strided([1, t, 1, rank], [t * w, w, w], 0));
    let k_pe = Tensor::new(&kv_a, Layout::strided([1, t, 1, pe], [t * w, w, w], rank));
    {
        let mut cache = MlaCache::paged(&mut latent, Layout::bshd(8, 64, 1, w), &geo);
        let step = MlaAppend::new(&kv_c, &k_pe, &mut cache, Positions::ids_i32(&pos)).q_pe(&mut q_pe).slots(&slots);
        rope.append_mla(step.kv_c_norm(&weight, geo.kv_norm_eps), stream)?;
    }
    rope.check_errors(stream)?;
    stream.synchronize()?;
    let host = latent.as_host_vec()?;
    Ok((0..t).flat_map(|s| host[(s * 64 + 100) * w..][..w].to_vec()).collect())
}

fn main() -> Res<()> {
    let table = HostTable::new(128, 10_000.0, 16)?;
    let archs: Vec<&str> = rope_cuda::archs().collect();
    assert_eq!(archs, ["sm_80", "sm_90", "sm_100"], "the PTX of every architecture is embedded");
    for arch in &archs {
        let ptx = rope_cuda::ptx(arch).expect("embedded");
        // A user's build ships only the library's kernels: no benchmark yardsticks.
        assert!(!ptx.contains(".entry bench_"), "the benchmark kernels are in a user's PTX");
        assert!(ptx.contains(".entry kv_") && ptx.contains(&format!(".target {arch}")), "{arch}");
        println!("rope-cuda: {} bytes of PTX for {arch}", ptx.len());
    }
    println!("table {}x{}", table.max_position, table.half);
    // The models' settings, read as a newcomer reads them (no GPU needed).
    let olmo2 = HfConfig::parse(OLMO2)?.qk_norm(0)?.expect("OLMo 2 normalizes q and k");
    assert_eq!(olmo2.weight_lens(), Some((4096, 4096)));
    assert_eq!(HfConfig::parse(DEEPSEEK_V3)?.mla()?.latent_width(), 576);
    let _ctx = match cust::quick_init() {
        Ok(ctx) => ctx,
        Err(e) => {
            println!("no CUDA device ({e}): the models' steps skipped");
            return Ok(());
        }
    };
    let kernels = Kernels::load()?;
    let stream = Stream::new(StreamFlags::NON_BLOCKING, None)?;
    for (name, json, heads, fp8) in [("OLMo 2, FP8 caches", OLMO2, (32, 32), true), ("Qwen3", QWEN3, (32, 8), false)] {
        let keys = qk_norm_step(&kernels, &stream, json, heads, fp8)?;
        assert!(keys.iter().all(|x| x.is_finite()) && keys.iter().any(|&x| x != 0.0), "{name}: keys");
        println!("{name}: {} keys appended and read back", keys.len());
    }
    let rows = mla_step(&kernels, &stream)?;
    assert!(rows.iter().all(|x| x.is_finite()) && rows.iter().any(|&x| x != 0.0), "MLA rows");
    println!("DeepSeek-V3 MLA: {} latent rows written", rows.len() / 576);
    Ok(())
}
