//! Shared test helpers: the GPU (or a printed skip), golden files, host copies.
#![allow(dead_code)]

use std::io::Write;

use cust::context::Context;
use cust::memory::{CopyDestination, DeviceBuffer, DeviceSlice};
use cust::stream::{Stream, StreamFlags};
use rope_cuda::Kernels;

/// A context, the loaded kernels and a stream.
pub struct Gpu {
    pub kernels: std::sync::Arc<Kernels>,
    pub stream: Stream,
    // Dropped last.
    pub _ctx: Context,
}

/// Whether `ROPE_CUDA_REQUIRE_GPU` asks that GPU tests fail rather than skip.
fn gpu_required() -> bool {
    std::env::var("ROPE_CUDA_REQUIRE_GPU").is_ok_and(|v| !v.is_empty() && v != "0")
}

/// The GPU, or `None` after printing that `test` skipped. With `ROPE_CUDA_REQUIRE_GPU=1` a
/// missing GPU fails the test instead.
pub fn gpu(test: &str) -> Option<Gpu> {
    let ctx = or_skip(test, cust::quick_init())?;
    let kernels = Kernels::load().expect("loading the embedded PTX");
    let stream = Stream::new(StreamFlags::NON_BLOCKING, None).expect("creating a stream");
    Some(Gpu { kernels, stream, _ctx: ctx })
}

/// Runs `case` for each of `cases` on the GPU, case `i` with `test`'s seed plus `i` (or prints
/// that `test` skipped): the test matrices' loop.
pub fn each_case<C>(test: &str, cases: Vec<C>, mut case: impl FnMut(&Gpu, C, u64)) {
    let Some(g) = gpu(test) else { return };
    let seed = test_seed(test);
    for (i, c) in cases.into_iter().enumerate() {
        case(&g, c, seed.wrapping_add(i as u64));
    }
}

/// What finding the GPU gave (cust's, cudarc's or candle's context), or `None` after printing
/// that `test` skipped; with `ROPE_CUDA_REQUIRE_GPU=1` a missing GPU fails the test instead.
pub fn or_skip<T, E: std::fmt::Debug>(test: &str, found: Result<T, E>) -> Option<T> {
    match found {
        Ok(t) => Some(t),
        Err(e) if gpu_required() => panic!("{test}: ROPE_CUDA_REQUIRE_GPU is set but no GPU was found: {e:?}"),
        Err(e) => {
            // Written past libtest's capture, so the skip is visible in `cargo test` output.
            let _ = writeln!(std::io::stderr(), "{test}: skipped, no CUDA device ({e:?})");
            None
        }
    }
}

/// Device copy of `host`.
pub fn upload(host: &[f32]) -> DeviceBuffer<f32> {
    DeviceBuffer::from_slice(host).expect("upload")
}

/// Host copy of `dev` (the stream must be synchronised).
pub fn download(dev: &DeviceSlice<f32>) -> Vec<f32> {
    let mut host = vec![0.0f32; dev.len()];
    dev.copy_to(&mut host).expect("download");
    host
}

/// A device buffer of `n` signalling NaNs with a recognisable payload.
pub fn poisoned(n: usize) -> DeviceBuffer<f32> {
    upload(&vec![f32::from_bits(POISON); n])
}

/// The poison bit pattern (a NaN no arithmetic produces).
pub const POISON: u32 = <f32 as TestElem>::POISON_BITS;

/// A golden file produced by `tests/data/make_golden.py`.
pub struct Golden {
    pub dim: usize,
    pub max_seq_len: usize,
    pub base: f64,
    pub seed: u64,
    pub q_shape: [usize; 4],
    pub k_shape: [usize; 4],
    /// (tensor, b, h, n, values)
    pub rows: Vec<(usize, [usize; 3], Vec<f64>)>,
    /// For q then k: (sum, sum of squares, weighted sum).
    pub moments: Option<[[f64; 3]; 2]>,
}

/// A little-endian reader over a golden file.
pub struct Reader<'a>(pub &'a [u8]);

impl Reader<'_> {
    pub fn take<const N: usize>(&mut self) -> [u8; N] {
        let (head, rest) = self.0.split_at(N);
        self.0 = rest;
        head.try_into().unwrap()
    }
    pub fn u32(&mut self) -> usize {
        u32::from_le_bytes(self.take()) as usize
    }
    pub fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.take())
    }
    pub fn i64(&mut self) -> i64 {
        i64::from_le_bytes(self.take())
    }
    pub fn f64(&mut self) -> f64 {
        f64::from_le_bytes(self.take())
    }
}

/// The bytes of `tests/data/<name>`: found from the manifest directory, or relative to the
/// repository root (where the GPU bundle runs).
pub fn data_file(name: &str) -> Vec<u8> {
    let path = data_path(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// The path of `tests/data/<name>`: under the manifest directory if it is there, else relative
/// to the repository root (where the GPU bundle runs).
pub fn data_path(name: &str) -> std::path::PathBuf {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data").join(name);
    if path.exists() {
        path
    } else {
        std::path::Path::new("tests/data").join(name)
    }
}

/// Reads golden file `name` of `tests/data/make_golden.py`.
pub fn golden(name: &str) -> Golden {
    let bytes = data_file(name);
    let mut r = Reader(&bytes);
    assert_eq!(&r.take::<8>(), b"RPGOLD1\0", "{name}: bad magic");
    let (dim, max_seq_len, base, seed) = (r.u32(), r.u32(), r.f64(), r.u64());
    let q_shape = [r.u32(), r.u32(), r.u32(), r.u32()];
    let k_shape = [r.u32(), r.u32(), r.u32(), r.u32()];
    let rows = (0..r.u32())
        .map(|_| {
            let (t, b, h, n) = (r.u32(), r.u32(), r.u32(), r.u32());
            (t, [b, h, n], (0..dim).map(|_| r.f64()).collect())
        })
        .collect();
    let moments = (r.u32() == 1).then(|| {
        let mut m = [[0.0; 3]; 2];
        for t in &mut m {
            *t = [r.f64(), r.f64(), r.f64()];
        }
        m
    });
    assert!(r.0.is_empty(), "{name}: trailing bytes");
    Golden { dim, max_seq_len, base, seed, q_shape, k_shape, rows, moments }
}

/// Flat index of row `(b, h, n)` of a contiguous `[B, H, N, D]` tensor.
pub fn row_start(shape: [usize; 4], b: usize, h: usize, n: usize) -> usize {
    ((b * shape[1] + h) * shape[2] + n) * shape[3]
}

/// Seed for a test's random data: `ROPE_CUDA_TEST_SEED` if set, else fresh from the clock.
/// Printed (past the capture) so a failure can be replayed.
pub fn test_seed(test: &str) -> u64 {
    let seed = std::env::var("ROPE_CUDA_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64 & 0xFFFF_FFFF
    });
    let _ = writeln!(std::io::stderr(), "{test}: ROPE_CUDA_TEST_SEED={seed}");
    seed
}

/// The f64 reference of the seed operation on a contiguous `[B, H, N, D]` tensor, for the
/// rows `rows` (flat row indices `(b * H + h) * N + n`); returns their outputs concatenated.
pub fn reference_rows(x: &[f32], shape: [usize; 4], base: f64, rows: impl IntoIterator<Item = usize>) -> Vec<f64> {
    let d = shape[3];
    let mut out = Vec::new();
    for row in rows {
        let xs: Vec<f64> = x[row * d..(row + 1) * d].iter().map(|&v| v as f64).collect();
        out.extend(rope_cuda::reference::rope_neox_row(&xs, (row % shape[2]) as f64, base));
    }
    out
}

/// The elements of rows `rows` of a `[.., D]` tensor, concatenated.
pub fn gather_rows(x: &[f32], d: usize, rows: impl IntoIterator<Item = usize>) -> Vec<f32> {
    rows.into_iter().flat_map(|r| x[r * d..(r + 1) * d].iter().copied()).collect()
}

pub use rope_cuda::reference::RefElem as TestElem;

/// Device copy of `host`, any element type.
pub fn upload_t<T: cust::memory::DeviceCopy>(host: &[T]) -> DeviceBuffer<T> {
    DeviceBuffer::from_slice(host).expect("upload")
}

/// Host copy of `dev`, any element type (the stream must be synchronised).
pub fn download_t<T: cust::memory::DeviceCopy + Default + Clone>(dev: &DeviceSlice<T>) -> Vec<T> {
    let mut host = vec![T::default(); dev.len()];
    dev.copy_to(&mut host).expect("download");
    host
}

/// Element offset of row `(block, within, h)` of a cache laid out as `l`.
pub fn row_at(l: &rope_cuda::Layout, block: usize, within: usize, h: usize) -> usize {
    l.offset + block * l.strides[0] + within * l.strides[1] + h * l.strides[2]
}

/// Asserts that every `config.head_dim`-element row of `got` (one token's heads) is within one
/// ulp of the same row of `x` rotated at `pos` by the f64 reference of `config`'s frequencies.
pub fn assert_rotated<T: TestElem>(what: &str, got: &[T], x: &[T], pos: i64, config: &rope_cuda::RopeConfig) {
    let (freqs, attention) = config.frequencies().expect("frequencies");
    let d = config.head_dim;
    assert_eq!(got.len(), x.len(), "{what}: lengths");
    for (h, (g, x)) in got.chunks(d).zip(x.chunks(d)).enumerate() {
        let xs: Vec<f64> = x.iter().map(|v| v.to_f64()).collect();
        let y = rope_cuda::reference::rope_row_freqs(
            &xs,
            pos as f64,
            &freqs,
            attention,
            config.style,
            rope_cuda::Direction::Forward,
        );
        for i in 0..d {
            assert!(g[i].ulps(T::round(y[i])) <= 1, "{what}: head {h} dim {i}: {:?} vs {}", g[i], y[i]);
        }
    }
}

/// Elements with an exact value: f32 within 2e-6 of it relative to the row scale (1), 16-bit
/// within 1 ulp of its correctly rounded value; the rest bit-identical.
pub fn check_close<T: TestElem>(got: &[T], want: &[T], exact: &[Option<f64>], what: &str) {
    for i in 0..got.len() {
        match exact[i] {
            Some(e) if T::NAME == "f32" => {
                let err = (got[i].to_f64() - e).abs();
                assert!(err <= 2e-6, "{what}: element {i}: {:?} vs {e} (error {err:e})", got[i]);
            }
            Some(_) => assert!(got[i].ulps(want[i]) <= 1, "{what}: element {i}: {:?} vs {:?}", got[i], want[i]),
            None => assert_eq!(got[i].bits(), want[i].bits(), "{what}: element {i} changed"),
        }
    }
}

// The model families' golden data (tests/data/make_golden_models.py).

/// One call of the model's apply function: the layer, and a `[seq, heads, dim]` input and output.
pub struct ModelRecord {
    pub layer: Option<usize>,
    pub heads: usize,
    pub dim: usize,
    pub input: Vec<f32>,
    pub output: Vec<f32>,
}

/// A model family's golden file: the tokens' positions and every recorded call.
pub struct ModelGolden {
    /// `[seq][3]`: each token's positions (three equal ones for plain RoPE).
    pub positions: Vec<[i64; 3]>,
    pub streams: usize,
    pub records: Vec<ModelRecord>,
}

/// `tests/data/models/{name}.bin`, read.
pub fn model_golden(name: &str) -> ModelGolden {
    let bytes = data_file(&format!("models/{name}.bin"));
    let mut r = Reader(&bytes);
    assert_eq!(&r.take::<8>(), b"RPMD1\0\0\0", "{name}");
    let (streams, seq) = (r.u32(), r.u32());
    assert!(streams == 1 || streams == 3, "{name}: {streams} streams");
    let flat: Vec<i64> = (0..streams * seq).map(|_| r.i64()).collect();
    let positions = (0..seq).map(|t| [0, 1, 2].map(|k| flat[(k % streams) * seq + t])).collect();
    let n = r.u32();
    let mut records = Vec::new();
    for _ in 0..n {
        let (layer, heads, dim) = (r.u32(), r.u32(), r.u32());
        let len = seq * heads * dim;
        let input = (0..len).map(|_| f32::from_le_bytes(r.take())).collect();
        let output = (0..len).map(|_| f32::from_le_bytes(r.take())).collect();
        records.push(ModelRecord { layer: (layer != u32::MAX as usize).then_some(layer), heads, dim, input, output });
    }
    assert!(r.0.is_empty(), "{name}: trailing bytes");
    ModelGolden { positions, streams, records }
}

// FP8 caches' tests.

/// An FP8 cache element type.
pub trait Code: rope_cuda::CustElement + Copy + Default + std::fmt::Debug {
    const FMT: rope_cuda::Fp8;
    fn of(b: u8) -> Self;
    fn byte(self) -> u8;
}

impl Code for rope_cuda::F8E4M3 {
    const FMT: rope_cuda::Fp8 = rope_cuda::Fp8::E4M3;
    fn of(b: u8) -> Self {
        rope_cuda::F8E4M3(b)
    }
    fn byte(self) -> u8 {
        self.0
    }
}

impl Code for rope_cuda::F8E5M2 {
    const FMT: rope_cuda::Fp8 = rope_cuda::Fp8::E5M2;
    fn of(b: u8) -> Self {
        rope_cuda::F8E5M2(b)
    }
    fn byte(self) -> u8 {
        self.0
    }
}

/// The code the model stores for `x` (the f32 nearest the exact value) at `scale`.
pub fn code(fmt: rope_cuda::Fp8, x: f32, scale: f32) -> u8 {
    fmt.from_f32(x / scale)
}

/// Random bytes (never all one value): the caches' and q output's contents before the call.
pub fn noise(seed: u64, n: usize) -> Vec<u8> {
    (0..n as u64).map(|i| rope_cuda::reference::splitmix64(seed ^ (i << 20) ^ 0x5EED) as u8).collect()
}

/// FP8 conversion inputs (tests/fp8.rs, tests/fp8_gpu.rs): every value of both formats and the
/// midpoints between neighbours (with the f32 on either
/// side), the saturation points, specials, and seeded random bits and values.
pub fn fp8_inputs(seed: u64) -> Vec<f32> {
    use rope_cuda_kernels::fp8::Fp8;
    let mut xs = vec![0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, -f32::NAN, f32::MAX, f32::MIN_POSITIVE];
    xs.push(f32::from_bits(0x7F80_0001));
    xs.push(f32::from_bits(1));
    for f in [Fp8::E4M3, Fp8::E5M2] {
        let mut vals: Vec<f32> = (0u8..0x80).map(|c| f.to_f32(c)).filter(|v| v.is_finite()).collect();
        vals.sort_by(f32::total_cmp);
        vals.push(2.0 * f.max());
        for w in vals.windows(2) {
            let mid = (w[0] + w[1]) / 2.0;
            for x in [w[0], mid, f32::from_bits(mid.to_bits() - 1), f32::from_bits(mid.to_bits() + 1)] {
                xs.extend([x, -x]);
            }
        }
    }
    xs.extend(fp8_random(seed, 300_000));
    if xs.len() % 2 == 1 {
        xs.push(1.0);
    }
    xs
}

/// `2 * pairs` seeded FP8 conversion inputs (tests/data/make_golden_fp8.py makes the same):
/// for each `i`, `r = splitmix64(seed ^ i)` gives a uniform f32 bit pattern (NaNs included),
/// then a value of random sign and mantissa with exponent in 2^-22 .. 2^17.
pub fn fp8_random(seed: u64, pairs: u64) -> impl Iterator<Item = f32> {
    use rope_cuda::reference::splitmix64;
    (0..pairs).flat_map(move |i| {
        let r = splitmix64(seed ^ i);
        let e = (r >> 40) as i32 % 40 - 22; // 2^-22 .. 2^17: both formats' ranges and past them
        let spread = (((e + 127) as u32) << 23) | (r >> 32) as u32 & 0x7F_FFFF | ((r >> 63) as u32) << 31;
        [f32::from_bits(r as u32), f32::from_bits(spread)]
    })
}

/// Where a fused append writes (the KV tests' cache layouts).
#[derive(Debug, Clone, Copy)]
pub enum CacheKind {
    /// `[batch, seq, heads, head_dim]`, `seq` rows per sequence.
    Bshd(usize),
    /// `[batch, heads, seq, head_dim]`.
    Bhsd(usize),
    /// Paged `[blocks, block_size, heads, head_dim]`.
    PagedNhd(usize, usize),
    /// Paged `[blocks, heads, block_size, head_dim]`.
    PagedHnd(usize, usize),
}

impl CacheKind {
    /// The cache's layout for `batch` sequences of `heads` heads of `d`, and whether it is paged.
    pub fn layout(self, batch: usize, heads: usize, d: usize) -> (rope_cuda::Layout, bool) {
        use rope_cuda::Layout;
        match self {
            CacheKind::Bshd(s) => (Layout::bshd(batch, s, heads, d), false),
            CacheKind::Bhsd(s) => (Layout::bhsd(batch, heads, s, d), false),
            CacheKind::PagedNhd(n, bs) => (Layout::bshd(n, bs, heads, d), true),
            CacheKind::PagedHnd(n, bs) => (Layout::bhsd(n, heads, bs, d), true),
        }
    }
}

/// The tokens of one fused append in the KV tests, drawn from `seed`: each one's position and,
/// for a paged cache, the slot mapping, with duplicate targets (and, paged, padding slots).
pub struct Draw {
    pub positions: Vec<i32>,
    pub slots: Option<Vec<i64>>,
    seq: usize,
    block_size: usize,
}

impl Draw {
    /// `batch * seq` tokens into a cache of `blocks` blocks (or sequences) of `block_size`
    /// rows; paged: positions below `max_pos`, slots anywhere, one in 8 padding (-1) and one in
    /// 8 an earlier token's; contiguous: rows of the token's sequence, one in 6 an earlier
    /// token's of the same sequence.
    pub fn new(
        seed: u64,
        (batch, seq): (usize, usize),
        paged: bool,
        (blocks, block_size): (usize, usize),
        max_pos: usize,
    ) -> Draw {
        use rope_cuda::reference::splitmix64;
        let tokens = batch * seq;
        let mut rng = seed;
        let mut next = |n: usize| {
            rng = splitmix64(rng);
            (rng % n as u64) as usize
        };
        let (positions, slots) = if paged {
            let pos = (0..tokens).map(|_| next(max_pos) as i32).collect();
            let mut slots: Vec<i64> = (0..tokens).map(|_| next(blocks * block_size) as i64).collect();
            for t in 0..tokens {
                match next(8) {
                    0 => slots[t] = -1,
                    1 if t > 0 => slots[t] = slots[next(t)],
                    _ => {}
                }
            }
            (pos, Some(slots))
        } else {
            let mut pos: Vec<i32> = (0..tokens).map(|_| next(block_size) as i32).collect();
            for t in 0..tokens {
                if t % seq > 0 && next(6) == 0 {
                    pos[t] = pos[t - 1 - next(t % seq)]; // a duplicate within the sequence
                }
            }
            (pos, None)
        };
        Draw { positions, slots, seq, block_size }
    }

    /// Token `t`'s cache row (slot, or the sequence's row at its position); `None`: padding.
    pub fn target(&self, t: usize) -> Option<usize> {
        match &self.slots {
            Some(s) => (s[t] >= 0).then_some(s[t] as usize),
            None => Some((t / self.seq) * self.block_size + self.positions[t] as usize),
        }
    }
}

/// `tokens` distinct slots of `slots` drawn from `seed` (a seeded shuffle), with the tokens of
/// `padding` given `-1` (padding, not written).
pub fn distinct_slots(seed: u64, slots: usize, tokens: usize, padding: &[usize]) -> Vec<i64> {
    use rope_cuda::reference::splitmix64;
    let mut all: Vec<i64> = (0..slots as i64).collect();
    for i in (1..all.len()).rev() {
        all.swap(i, (splitmix64(seed.wrapping_add(i as u64)) % (i as u64 + 1)) as usize);
    }
    all.truncate(tokens);
    for &t in padding {
        all[t] = -1;
    }
    all
}

/// Seeded values in [-1, 1) as bf16 (half 1.8's, the reference's), tensor `tensor` of `seed`.
pub fn random_bf16(seed: u64, tensor: u64, n: usize) -> Vec<half::bf16> {
    (0..n as u64).map(|i| half::bf16::from_f32(rope_cuda::reference::uniform(seed, tensor, i))).collect()
}

/// A paged append's host data (bf16): `tokens` new q (`hq` heads), k and v (`hk` heads) of
/// `d`, the caches' first contents (`blocks` of `block_size`), positions below `max_pos` and
/// distinct slots, token 4 padding.
pub struct PagedStep {
    pub q: Vec<half::bf16>,
    pub k: Vec<half::bf16>,
    pub v: Vec<half::bf16>,
    pub kc0: Vec<half::bf16>,
    pub vc0: Vec<half::bf16>,
    pub ids: Vec<i32>,
    pub slots: Vec<i64>,
}

impl PagedStep {
    pub fn draw(
        seed: u64,
        (tokens, hq, hk, d): (usize, usize, usize, usize),
        (blocks, block_size): (usize, usize),
        max_pos: usize,
    ) -> Self {
        use rope_cuda::reference::splitmix64;
        let cache_n = blocks * block_size * hk * d;
        PagedStep {
            q: random_bf16(seed, 2, tokens * hq * d),
            k: random_bf16(seed, 3, tokens * hk * d),
            v: random_bf16(seed, 4, tokens * hk * d),
            kc0: random_bf16(seed, 5, cache_n),
            vc0: random_bf16(seed, 6, cache_n),
            ids: (0..tokens as u64).map(|t| (splitmix64(seed ^ t) % max_pos as u64) as i32).collect(),
            slots: distinct_slots(seed, blocks * block_size, tokens, &[4]),
        }
    }
}

// QK-norm tests' inputs and checks.

/// Seeded inputs of `n` elements for heads of `d`: uniform in [-1, 1), with every third
/// head scaled by 2^-10 (a mean square near `eps`: eps matters there).
pub fn norm_heads(seed: u64, tensor: u64, n: usize, d: usize) -> Vec<f32> {
    let mut x = rope_cuda::reference::uniform_vec(seed, tensor, n);
    for (h, row) in x.chunks_mut(d).enumerate() {
        if h % 3 == 0 {
            row.iter_mut().for_each(|v| *v *= 1.0 / 1024.0);
        }
    }
    x
}

/// The weights of a kind (`n` of them): around 1 for `Rms` and `RmsProjection`, around 0 for
/// `RmsOnePlus`, none for `RmsUnit`.
pub fn norm_weights(kind: rope_cuda::NormKind, seed: u64, tensor: u64, n: usize) -> Option<Vec<f32>> {
    let w = rope_cuda::reference::uniform_vec(seed, tensor, n);
    match kind {
        rope_cuda::NormKind::Rms | rope_cuda::NormKind::RmsProjection => {
            Some(w.iter().map(|v| 1.0 + 0.5 * v).collect())
        }
        rope_cuda::NormKind::RmsOnePlus => Some(w.iter().map(|v| 0.5 * v).collect()),
        _ => None,
    }
}

/// Elements with a value: f32 within 1e-5 of it relative to its head's largest, 16-bit within
/// one ulp of its correct rounding (f16: or within 2^-21 of the head's largest); the rest
/// bit-identical to `before`.
pub fn check_normed<T: TestElem>(got: &[T], want: &[Option<f64>], before: &[T], d: usize, what: &str) {
    for (r, row) in want.chunks(d).enumerate() {
        let scale = row.iter().flatten().fold(0f64, |m, v| m.max(v.abs()));
        for (j, w) in row.iter().enumerate() {
            let i = r * d + j;
            match w {
                Some(e) if T::NAME == "f32" => {
                    let err = (got[i].to_f64() - e).abs();
                    assert!(err <= 1e-5 * scale, "{what}: element {i}: {:?} vs {e} (error {err:e})", got[i]);
                }
                Some(e) => {
                    // f16's ulp falls below f32's arithmetic at the head's scale for elements
                    // under about 2^-11 of it (the normalized head is an f32 intermediate):
                    // those within 2^-21 of the head's largest value (8 f32 ulps). bf16 has
                    // f32's exponent range: 1 ulp everywhere.
                    let err = (got[i].to_f64() - e).abs();
                    let fine = T::NAME == "f16" && err <= scale * (-21f64).exp2();
                    assert!(fine || got[i].ulps(T::round(*e)) <= 1, "{what}: element {i}: {:?} vs {e}", got[i]);
                }
                None => assert_eq!(got[i].bits(), before[i].bits(), "{what}: element {i} changed"),
            }
        }
    }
}

/// A norm of a test: its kind, the weights of q's and k's norm (around 1 for `Rms`, around 0
/// for `RmsOnePlus`, none for `RmsUnit`; rounded to `T` unless held in f32) on the host and on
/// the device, and the f64 model of a head normalized, then rotated.
pub struct TestNorm<T: TestElem> {
    pub kind: rope_cuda::NormKind,
    f32_weights: bool,
    host: [Option<Vec<f64>>; 2],
    f32_dev: [DeviceBuffer<f32>; 2],
    typed_dev: [DeviceBuffer<T>; 2],
}

impl<T: TestElem> TestNorm<T> {
    /// Seeded weights for heads of `d` elements: `d` of them, or for `RmsProjection` those of
    /// `heads[0]` q heads and `heads[1]` k heads.
    pub fn new(kind: rope_cuda::NormKind, seed: u64, (d, heads): (usize, [usize; 2]), f32_weights: bool) -> Self {
        let whole = kind == rope_cuda::NormKind::RmsProjection;
        let len = |i: usize| if whole { heads[i].max(1) * d } else { d };
        let round = |w: Vec<f32>| -> Vec<f32> {
            match f32_weights {
                true => w,
                false => w.into_iter().map(|v| T::from_f32(v).to_f64() as f32).collect(),
            }
        };
        let w = [norm_weights(kind, seed, 20, len(0)).map(round), norm_weights(kind, seed, 21, len(1)).map(round)];
        let f32_dev = [0, 1].map(|i| upload_t(w[i].as_deref().unwrap_or(&[0.0])));
        let typed =
            |w: &Option<Vec<f32>>| w.as_deref().unwrap_or(&[0.0]).iter().map(|&v| T::from_f32(v)).collect::<Vec<T>>();
        let typed_dev = [0, 1].map(|i| upload_t(&typed(&w[i])));
        let host = w.map(|w| w.map(|w| w.iter().map(|&v| v as f64).collect()));
        TestNorm { kind, f32_weights, host, f32_dev, typed_dev }
    }

    /// The norm for a call, with `eps`.
    pub fn qk_norm(&self, eps: f32) -> rope_cuda::QkNorm<'_> {
        use rope_cuda::{NormKind, QkNorm};
        let ([q32, k32], [qt, kt]) = (&self.f32_dev, &self.typed_dev);
        match (self.kind, self.f32_weights) {
            (NormKind::RmsUnit, _) => QkNorm::unit(eps),
            (NormKind::Rms, true) => QkNorm::rms(q32, k32, eps),
            (NormKind::Rms, false) => QkNorm::rms(qt, kt, eps),
            (NormKind::RmsProjection, true) => QkNorm::olmo(q32, k32, eps),
            (NormKind::RmsProjection, false) => QkNorm::olmo(qt, kt, eps),
            (_, true) => QkNorm::gemma(q32, k32, eps),
            (_, false) => QkNorm::gemma(qt, kt, eps),
        }
    }

    /// A token's heads `x` (`[heads, d]`) of q (`which == 0`) or k (1) normalized with `eps` in
    /// f64 (each head, or for `RmsProjection` all of them at once), then each rotated forward
    /// at `pos` (NeoX or GPT-J pairs over `rot` dims, `base`).
    pub fn model_token(
        &self,
        which: usize,
        (x, d): (&[T], usize),
        pos: f64,
        (base, rot, style): (f64, usize, rope_cuda::RopeStyle),
        eps: f32,
    ) -> Vec<f64> {
        if self.kind != rope_cuda::NormKind::RmsProjection {
            return x.chunks(d).flat_map(|h| self.model(which, h, pos, (base, rot, style), eps)).collect();
        }
        let x: Vec<f64> = x.iter().map(|v| v.to_f64()).collect();
        let y = rope_cuda::reference::rms_norm_row(&x, self.host[which].as_deref(), 0.0, eps as f64);
        let rotate =
            |h: &[f64]| rope_cuda::reference::rope_row(h, pos, base, rot, style, rope_cuda::Direction::Forward);
        y.chunks(d).flat_map(rotate).collect()
    }

    /// Head `x` of q (`which == 0`) or k (1) normalized with `eps` in f64, then rotated forward
    /// at `pos` (NeoX or GPT-J pairs over `rot` dims, `base`).
    pub fn model(
        &self,
        which: usize,
        x: &[T],
        pos: f64,
        (base, rot, style): (f64, usize, rope_cuda::RopeStyle),
        eps: f32,
    ) -> Vec<f64> {
        let offset = if self.kind == rope_cuda::NormKind::RmsOnePlus { 1.0 } else { 0.0 };
        let x: Vec<f64> = x.iter().map(|v| v.to_f64()).collect();
        let y = rope_cuda::reference::rms_norm_row(&x, self.host[which].as_deref(), offset, eps as f64);
        rope_cuda::reference::rope_row(&y, pos, base, rot, style, rope_cuda::Direction::Forward)
    }
}

/// `x` changed by `f`: the struct update (`RawNorm { eps, ..good }`) of the raw doors'
/// `#[non_exhaustive]` structs, whose fields stay public to assign.
pub fn changed<T>(mut x: T, f: impl FnOnce(&mut T)) -> T {
    f(&mut x);
    x
}
