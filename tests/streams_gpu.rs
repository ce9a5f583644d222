//! Streams and lifetimes (issue 7): two streams working at once on different buffers, several
//! handles in one context, and a handle dropped while its work is still queued.

mod common;

use common::{assert_rotated, gpu, test_seed, upload_t, TestElem};
use cust::memory::{CopyDestination, DeviceBuffer};
use cust::stream::{Stream, StreamFlags};
use half::bf16;
use rope_cuda::bench::spin;
use rope_cuda::reference::{splitmix64, uniform};
use rope_cuda::{DType, KvCache, Layout, Positions, Rope, RopeArgs, RopeConfig, RopeStyle, Tensor, TensorMut};

/// One out-of-place RoPE job: inputs, outputs, positions and its handle's settings.
struct Job {
    rope: Rope,
    q: DeviceBuffer<bf16>,
    q_out: DeviceBuffer<bf16>,
    qh: Vec<bf16>,
    pos: DeviceBuffer<i32>,
    ph: Vec<i32>,
    tokens: usize,
    heads: usize,
}

impl Job {
    fn new(
        kernels: &std::sync::Arc<rope_cuda::Kernels>,
        config: RopeConfig,
        tokens: usize,
        heads: usize,
        seed: u64,
    ) -> Job {
        let d = config.head_dim;
        let max = config.max_position;
        let qh: Vec<bf16> = (0..(tokens * heads * d) as u64).map(|i| bf16::from_f32(uniform(seed, 0, i))).collect();
        let ph: Vec<i32> = (0..tokens as u64).map(|t| (splitmix64(seed ^ t) % max as u64) as i32).collect();
        let poison = vec![bf16::from_bits(<bf16 as TestElem>::POISON_BITS as u16); qh.len()];
        Job {
            rope: Rope::new(kernels, config).unwrap(),
            q: upload_t(&qh),
            q_out: upload_t(&poison),
            qh,
            pos: upload_t(&ph),
            ph,
            tokens,
            heads,
        }
    }

    fn queue(&mut self, stream: &Stream) {
        let l = Layout::bshd(1, self.tokens, self.heads, self.rope.config().head_dim);
        let q = Tensor::new(&self.q, l);
        let mut out = TensorMut::new(&mut self.q_out, l);
        self.rope.apply(RopeArgs::into(&q, &mut out, Positions::ids_i32(&self.pos)), stream).unwrap();
    }

    fn check(&self, what: &str) {
        let mut got = vec![bf16::ZERO; self.qh.len()];
        self.q_out.copy_to(&mut got[..]).unwrap();
        let token = self.heads * self.rope.config().head_dim;
        for (t, (g, x)) in got.chunks(token).zip(self.qh.chunks(token)).enumerate() {
            assert_rotated(&format!("{what}: token {t}"), g, x, self.ph[t] as i64, self.rope.config());
        }
    }
}

/// Two streams, each with its own handle and buffers, both kept busy at once (each queue
/// starts behind a spin, so their launches interleave on the device): every result exact.
#[test]
fn two_streams_at_once() {
    let test = "two_streams_at_once";
    let Some(g) = gpu(test) else { return };
    let seed = test_seed(test);
    let kernels = &g.kernels;
    let streams =
        [Stream::new(StreamFlags::NON_BLOCKING, None).unwrap(), Stream::new(StreamFlags::NON_BLOCKING, None).unwrap()];
    let mut jobs = [
        Job::new(kernels, RopeConfig::new(128, 4096).dtype(DType::BF16), 3000, 8, seed),
        Job::new(
            kernels,
            RopeConfig::new(64, 8192).style(RopeStyle::GptJ).dtype(DType::BF16).base(1e6),
            5000,
            4,
            seed + 1,
        ),
    ];
    for (s, j) in streams.iter().zip(&mut jobs) {
        spin(kernels, s, 2_000_000).unwrap();
        for _ in 0..20 {
            j.queue(s);
        }
    }
    for s in &streams {
        s.synchronize().unwrap();
    }
    jobs[0].check("stream 0");
    jobs[1].check("stream 1");
}

/// Several handles of one context (different settings, RoPE and the fused append) used in
/// turn on one stream: each gets its own result.
#[test]
fn several_handles_in_one_context() {
    let test = "several_handles_in_one_context";
    let Some(g) = gpu(test) else { return };
    let seed = test_seed(test);
    let (kernels, stream) = (&g.kernels, &g.stream);
    let mut jobs: Vec<Job> = [(64, 1e4), (128, 5e5), (96, 1e6)]
        .into_iter()
        .enumerate()
        .map(|(i, (d, base))| {
            Job::new(kernels, RopeConfig::new(d, 2048).dtype(DType::BF16).base(base), 77, 3, seed + i as u64)
        })
        .collect();
    // A fused append with a fourth handle between the RoPE calls.
    let kv = Rope::new(kernels, RopeConfig::new(64, 2048).dtype(DType::BF16)).unwrap();
    let (tokens, hk, d) = (5, 2, 64);
    let kh: Vec<bf16> = (0..(tokens * hk * d) as u64).map(|i| bf16::from_f32(uniform(seed, 9, i))).collect();
    let (dk, dv) = (upload_t(&kh), upload_t(&kh));
    let cache_h: Vec<bf16> = (0..(2 * 16 * hk * d) as u64).map(|i| bf16::from_f32(uniform(seed, 10, i))).collect();
    let (mut kc, mut vc) = (upload_t(&cache_h), upload_t(&cache_h));
    let ph = [7i32, 100, 3, 2000, 0];
    let (pos, slots) = (upload_t(&ph), upload_t(&[4i64, 9, 17, 30, 31]));
    for (i, j) in jobs.iter_mut().enumerate() {
        j.queue(stream);
        if i == 1 {
            let mut cache = KvCache::paged(&mut kc, &mut vc, Layout::bshd(2, 16, hk, d));
            let l = Layout::bshd(tokens, 1, hk, d);
            kv.append_kv(
                rope_cuda::KvAppend::new(
                    &Tensor::new(&dk, l),
                    &Tensor::new(&dv, l),
                    &mut cache,
                    Positions::ids_i32(&pos),
                )
                .slots(&slots),
                stream,
            )
            .unwrap();
        }
    }
    stream.synchronize().unwrap();
    for (i, j) in jobs.iter().enumerate() {
        j.check(&format!("handle {i}"));
    }
    let got = common::download_t(&kc);
    let row = hk * d;
    for (t, s) in [4usize, 9, 17, 30, 31].into_iter().enumerate() {
        assert_rotated(
            &format!("append: token {t}"),
            &got[s * row..][..row],
            &kh[t * row..][..row],
            ph[t] as i64,
            kv.config(),
        );
    }
}

/// A handle dropped while its launch still waits in the stream (behind a 50 ms spin): no
/// crash, and the launch still reads the handle's table correctly (freeing device memory
/// waits for the work queued before it; compute-sanitizer's memcheck runs this too).
#[test]
fn handle_dropped_with_work_in_flight() {
    let test = "handle_dropped_with_work_in_flight";
    let Some(g) = gpu(test) else { return };
    let seed = test_seed(test);
    let (kernels, stream) = (&g.kernels, &g.stream);
    let mut job = Job::new(kernels, RopeConfig::new(128, 4096).dtype(DType::BF16), 4096, 8, seed);
    spin(kernels, stream, 50_000_000).unwrap();
    job.queue(stream);
    let Job { rope, q, q_out, qh, pos, ph, tokens, heads } = job;
    let config = rope.config().clone();
    drop(rope);
    stream.synchronize().unwrap();
    // Check with a fresh handle of the same settings (the output is already computed).
    let check = Job { rope: Rope::new(kernels, config).unwrap(), q, q_out, qh, pos, ph, tokens, heads };
    check.check("after drop");
}
