//! The MLA append on the GPU ([`Rope::append_mla`]) against an f64 model: each token's latent
//! row `[kv_c | k_pe]` written at its slot, `kv_c` bit for bit (or, FP8, divided by the scale
//! and converted), `k_pe` rotated in interleaved pairs exactly (16-bit: within one ulp of the
//! correctly rounded value; f32 within 2e-6; FP8: the code of the rotation rounded to f32), the
//! last token of a repeated slot winning; `q_pe` rotated in place inside q's heads, whose
//! other dims stay as they were; every other byte of the cache and of q unchanged. Input types
//! × cache types (their own, E4M3, E5M2) × paged and contiguous caches (rows padded or not) ×
//! decode, claimed and wide calls × both sources of cos and sin × kv_c and k_pe as views of one
//! projection or buffers of their own × the typed and raw doors × kv_c copied or normalized in
//! the launch (`MlaAppend::kv_c_norm`: within one ulp of the f64 norm's correctly rounded
//! value, f32 within 2e-6; FP8: the code of a value within 1e-6 of it); then a recorded
//! graph, and misuse refused with nothing written.

mod common;

use common::{check_close, code, download_t, gpu, noise, row_at, test_seed, upload_t, Code, Draw, Gpu, TestElem};
use cust::memory::{CopyDestination, DeviceBuffer, DeviceCopy};
use half::{bf16, f16};
use rope_cuda::reference::rms_norm_row;
use rope_cuda::reference::{rope_row, uniform_vec};
use rope_cuda::{
    CosSin, DType, Direction, Error, Graph, Layout, MlaAppend, MlaCache, MlaGeometry, PositionKind, Positions,
    RawMlaArgs, RawMlaNorm, RawPositions, RawTensor, RawWeight, Rope, RopeConfig, RopeStyle, Tensor, TensorMut, F8E4M3,
    F8E5M2,
};

const MAX_POS: usize = 4096;
const BASE: f64 = 10_000.0;
/// kv_c's norm's `eps` (transformers' default for DeepSeek's `kv_a_layernorm`).
const EPS: f32 = 1e-6;

/// A latent cache's geometry of `kv_lora_rank` (the cache reads only the rank; DeepSeek-V3's
/// other sizes), with `kv_a_layernorm`'s eps, which the tests' `EPS` is.
fn geometry(kv_lora_rank: usize) -> MlaGeometry {
    let g = MlaGeometry::new(kv_lora_rank, 64, 128, 128, 128);
    assert_eq!(g.kv_norm_eps, EPS);
    g
}

/// kv_c's norm in a case: none, weights of the inputs' type, or f32 weights (the norm's
/// element-by-element weight loads).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Norm {
    None,
    Own,
    F32,
}

#[derive(Debug, Clone, Copy)]
struct Case {
    /// `kv_lora_rank`.
    rank: usize,
    /// `qk_rope_head_dim`: the Rope's head_dim.
    rope: usize,
    /// `qk_nope_head_dim`: the dims of each q head before its rotary part.
    nope: usize,
    /// Heads of q (0: no q_pe).
    heads: usize,
    batch: usize,
    seq: usize,
    /// Paged `(blocks, block_size)`, else contiguous with this many rows per sequence in `.1`.
    paged: bool,
    blocks: (usize, usize),
    /// Elements between the end of one cache row and the next.
    pad: usize,
    source: CosSin,
    /// kv_c and k_pe as the two parts of one `[tokens, rank + rope]` projection.
    fused: bool,
    /// Through `append_mla_raw`.
    raw: bool,
    /// The rotated pairs written de-interleaved (`MlaAppend::deinterleaved`).
    deint: bool,
    /// kv_c normalized in the launch (`MlaAppend::kv_c_norm`).
    norm: Norm,
}

/// One call's inputs, drawn from a seed.
struct Step<T> {
    /// q, `[tokens, heads, nope + rope]`.
    q: Vec<T>,
    /// kv_c and k_pe: one `[tokens, rank + rope]` buffer when fused, else `kv_c` then `k_pe`.
    kv_c: Vec<T>,
    k_pe: Vec<T>,
    /// kv_c's norm's weights (`rank`, in (-0.5, 1.5)), as their type holds them.
    weight: Vec<f64>,
    draw: Draw,
    cache: Layout,
}

impl Case {
    fn tokens(&self) -> usize {
        self.batch * self.seq
    }

    fn q_layout(&self) -> Layout {
        let (t, qd) = (self.seq, self.nope + self.rope);
        Layout::strided([self.batch, t, self.heads, self.rope], [t * self.heads * qd, self.heads * qd, qd], self.nope)
    }

    /// kv_c's and k_pe's layouts (views of one buffer when fused).
    fn input_layouts(&self) -> (Layout, Layout) {
        let (b, s, r, p) = (self.batch, self.seq, self.rank, self.rope);
        match self.fused {
            true => {
                let w = r + p;
                (Layout::strided([b, s, 1, r], [s * w, w, w], 0), Layout::strided([b, s, 1, p], [s * w, w, w], r))
            }
            false => (Layout::bshd(b, s, 1, r), Layout::bshd(b, s, 1, p)),
        }
    }

    fn cache_layout(&self) -> Layout {
        let (n, bs) = self.blocks;
        let row = self.rank + self.rope + self.pad;
        Layout::strided([n, bs, 1, self.rank + self.rope], [bs * row, row, row], 0)
    }

    fn config<T: TestElem>(&self) -> RopeConfig {
        RopeConfig::new(self.rope, MAX_POS).style(RopeStyle::GptJ).dtype(T::DTYPE).base(BASE).cos_sin(self.source)
    }

    fn draw<T: TestElem>(&self, seed: u64) -> Step<T> {
        let conv = |v: Vec<f32>| v.into_iter().map(T::from_f32).collect::<Vec<T>>();
        let tokens = self.tokens();
        let q = conv(uniform_vec(seed, 1, tokens * self.heads * (self.nope + self.rope)));
        let (kv_c, k_pe) = match self.fused {
            true => (conv(uniform_vec(seed, 2, tokens * (self.rank + self.rope))), Vec::new()),
            false => (conv(uniform_vec(seed, 2, tokens * self.rank)), conv(uniform_vec(seed, 3, tokens * self.rope))),
        };
        let draw = Draw::new(seed, (self.batch, self.seq), self.paged, self.blocks, MAX_POS);
        let weight = uniform_vec(seed, 4, self.rank).into_iter().map(|w| 0.5 + w);
        let weight = match self.norm {
            Norm::Own => weight.map(|w| T::from_f32(w).to_f64()).collect(),
            _ => weight.map(f64::from).collect(),
        };
        Step { q, kv_c, k_pe, weight, draw, cache: self.cache_layout() }
    }
}

impl<T: TestElem> Step<T> {
    /// Token `t`'s kv_c and k_pe.
    fn token(&self, c: &Case, t: usize) -> (&[T], &[T]) {
        let (r, p) = (c.rank, c.rope);
        match c.fused {
            true => (&self.kv_c[t * (r + p)..][..r], &self.kv_c[t * (r + p) + r..][..p]),
            false => (&self.kv_c[t * r..][..r], &self.k_pe[t * p..][..p]),
        }
    }

    /// A head (k_pe, or a head of q_pe) of token `t` rotated at its position, exactly, each
    /// value where the append writes it (de-interleaved: pair `i` at `i` and `rope / 2 + i`).
    fn rotated(&self, c: &Case, t: usize, x: &[T]) -> Vec<f64> {
        let x: Vec<f64> = x.iter().map(|v| v.to_f64()).collect();
        let y = rope_row(&x, self.draw.positions[t] as f64, BASE, c.rope, RopeStyle::GptJ, Direction::Forward);
        placed(c.deint, &y)
    }

    /// Token `t`'s latent as the append writes it, exactly: kv_c, or kv_c normalized (`None`
    /// where kv_c is copied bit for bit).
    fn latent(&self, c: &Case, t: usize) -> Option<Vec<f64>> {
        let x: Vec<f64> = self.token(c, t).0.iter().map(|v| v.to_f64()).collect();
        (c.norm != Norm::None).then(|| rms_norm_row(&x, Some(&self.weight), 0.0, EPS as f64))
    }

    /// Runs the append into a cache of `C` holding `cache0` (with `scale` for FP8) and returns
    /// the cache and q afterwards.
    fn run<C: rope_cuda::CustElement + Default + Clone>(
        &self,
        g: &Gpu,
        c: &Case,
        cache0: &[C],
        scale: Option<f32>,
    ) -> (Vec<C>, Vec<T>) {
        let rope = Rope::new(&g.kernels, c.config::<T>()).unwrap();
        let mut dq = upload_t(&self.q);
        let (dkv, dk) = (upload_t(&self.kv_c), upload_t(if c.fused { &self.kv_c[..1] } else { &self.k_pe }));
        let dpos = upload_t(&self.draw.positions);
        let dslots = self.draw.slots.as_ref().map(|s| upload_t(s));
        let mut dc = upload_t(cache0);
        let dscale = upload_t(&[scale.unwrap_or(1.0)]);
        // kv_c's norm's weights in their type: the inputs' or f32.
        let own: Vec<T> = self.weight.iter().map(|&w| T::from_f32(w as f32)).collect();
        let w32: Vec<f32> = self.weight.iter().map(|&w| w as f32).collect();
        let (dw, dw32) = (upload_t(&own), upload_t(&w32));
        let weight = match c.norm {
            Norm::None => None,
            Norm::Own => Some(RawWeight::new(dw.as_device_ptr().as_raw(), c.rank, T::DTYPE)),
            Norm::F32 => Some(RawWeight::new(dw32.as_device_ptr().as_raw(), c.rank, DType::F32)),
        };
        let (cl, kl) = c.input_layouts();
        let k_buf = if c.fused { &dkv } else { &dk };
        {
            let mut cache = match c.paged {
                true => MlaCache::paged(&mut dc, self.cache, &geometry(c.rank)),
                false => MlaCache::contiguous(&mut dc, self.cache, &geometry(c.rank)),
            };
            if scale.is_some() {
                cache = cache.scale(rope_cuda::Fp8Scale::new(&dscale));
            }
            if c.raw {
                let t = |b: &DeviceBuffer<T>, l| RawTensor::new(b.as_device_ptr().as_raw(), b.len(), T::DTYPE, l);
                let positions = RawPositions::new(PositionKind::IdsI32, dpos.as_device_ptr().as_raw(), c.tokens());
                let mut args =
                    RawMlaArgs::new(t(&dkv, cl), t(k_buf, kl), cache.raw(), positions).with_deinterleaved(c.deint);
                args.q_pe = (c.heads > 0).then(|| t(&dq, c.q_layout()));
                args.slots = dslots.as_ref().map(|s| (s.as_device_ptr().as_raw(), s.len()));
                args.kv_c_norm = weight.map(|weight| RawMlaNorm::new(weight, EPS));
                // SAFETY: every address is a live buffer of this context, alive until the sync.
                unsafe { rope.append_mla_raw(&args, g.stream.as_inner()) }.unwrap();
            } else {
                let (kv_c, k_pe) = (Tensor::new(&dkv, cl), Tensor::new(k_buf, kl));
                let mut q = TensorMut::new(&mut dq, c.q_layout());
                let mut a = MlaAppend::new(&kv_c, &k_pe, &mut cache, Positions::ids_i32(&dpos));
                if let Some(s) = &dslots {
                    a = a.slots(s);
                }
                if c.heads > 0 {
                    a = a.q_pe(&mut q);
                }
                if c.deint {
                    a = a.deinterleaved();
                }
                a = match c.norm {
                    Norm::None => a,
                    Norm::Own => a.kv_c_norm(&dw, EPS),
                    Norm::F32 => a.kv_c_norm(&dw32, EPS),
                };
                rope.append_mla(a, &g.stream).unwrap();
            }
        }
        rope.check_errors(&g.stream).unwrap();
        (download_t(&dc), download_t(&dq))
    }

    /// q_pe's check: each head's rotary part within tolerance of its rotation, the rest of q
    /// bit-identical.
    fn check_q(&self, c: &Case, q: &[T], what: &str) {
        let (mut want, mut exact) = (self.q.clone(), vec![None; self.q.len()]);
        let l = c.q_layout();
        for t in 0..c.tokens() {
            for h in 0..c.heads {
                let at = row_at(&l, t / c.seq, t % c.seq, h);
                let y = self.rotated(c, t, &self.q[at..at + c.rope]);
                for i in 0..c.rope {
                    (want[at + i], exact[at + i]) = (T::round(y[i]), Some(y[i]));
                }
            }
        }
        check_close::<T>(q, &want, &exact, &format!("{what}: q"));
    }
}

/// `y` (interleaved pairs) as the append writes it: as it is, or de-interleaved.
fn placed(deint: bool, y: &[f64]) -> Vec<f64> {
    let half = y.len() / 2;
    match deint {
        true => (0..y.len()).map(|i| if i < half { y[2 * i] } else { y[2 * (i - half) + 1] }).collect(),
        false => y.to_vec(),
    }
}

/// A cache of the inputs' type: kv_c bit for bit, k_pe rotated, everything else unchanged.
fn own_case<T: TestElem + DeviceCopy + Default>(g: &Gpu, c: Case, seed: u64) {
    let s = c.draw::<T>(seed);
    let n = s.cache.extent().unwrap();
    let cache0: Vec<T> = uniform_vec(seed, 9, n).into_iter().map(T::from_f32).collect();
    let (cache, q) = s.run(g, &c, &cache0, None);
    let what = format!("{} {c:?}", T::NAME);
    let (mut want, mut exact) = (cache0.clone(), vec![None; n]);
    for t in 0..c.tokens() {
        let Some(slot) = s.draw.target(t) else { continue };
        let at = row_at(&s.cache, slot / c.blocks.1, slot % c.blocks.1, 0);
        let (kv_c, k_pe) = s.token(&c, t);
        let y = s.rotated(&c, t, k_pe);
        let latent = s.latent(&c, t);
        for i in 0..c.rank {
            (want[at + i], exact[at + i]) = match &latent {
                None => (kv_c[i], None),
                Some(l) => (T::round(l[i]), Some(l[i])),
            };
        }
        for i in 0..c.rope {
            (want[at + c.rank + i], exact[at + c.rank + i]) = (T::round(y[i]), Some(y[i]));
        }
    }
    check_close::<T>(&cache, &want, &exact, &format!("{what}: latent cache"));
    s.check_q(&c, &q, &what);
}

/// An FP8 cache: every byte the model's code, or unchanged.
fn fp8_case<T: TestElem + DeviceCopy + Default, F: Code>(g: &Gpu, c: Case, seed: u64, scale: f32) {
    let s = c.draw::<T>(seed);
    let n = s.cache.extent().unwrap();
    let bytes0 = noise(seed, n);
    let cache0: Vec<F> = bytes0.iter().map(|&b| F::of(b)).collect();
    let (cache, q) = s.run(g, &c, &cache0, Some(scale));
    let what = format!("{} -> {:?} scale {scale} {c:?}", T::NAME, F::FMT);
    let mut want = bytes0.clone();
    let mut written = 0;
    for t in 0..c.tokens() {
        let Some(slot) = s.draw.target(t) else { continue };
        let at = row_at(&s.cache, slot / c.blocks.1, slot % c.blocks.1, 0);
        let (kv_c, k_pe) = s.token(&c, t);
        let y = s.rotated(&c, t, k_pe);
        match s.latent(&c, t) {
            None => (0..c.rank).for_each(|i| want[at + i] = code(F::FMT, kv_c[i].to_f64() as f32, scale)),
            // Normalized: the code of a value within 1e-6 of the exact one (the statistic's f32
            // arithmetic), the one of the exact value where the got byte is neither.
            Some(l) => {
                for i in 0..c.rank {
                    let near = [1.0 - 1e-6, 1.0 + 1e-6].map(|f| code(F::FMT, (l[i] * f) as f32, scale));
                    let got = cache[at + i].byte();
                    want[at + i] = if near.contains(&got) { got } else { code(F::FMT, l[i] as f32, scale) };
                }
            }
        }
        for i in 0..c.rope {
            // The rotation rounded to f32 once, then divided and converted.
            want[at + c.rank + i] = code(F::FMT, y[i] as f32, scale);
        }
        written += 1;
    }
    assert!(written > 0, "{what}: nothing written");
    for i in 0..n {
        let got = cache[i].byte();
        assert_eq!(
            got, want[i],
            "{what}: cache byte {i}: {got:#04x}, the model {:#04x} (was {:#04x})",
            want[i], bytes0[i]
        );
    }
    s.check_q(&c, &q, &what);
}

/// DeepSeek-V3's shapes (512 + 64, 128-dim nope) at a test's scale, paged, decode.
fn base() -> Case {
    Case {
        rank: 512,
        rope: 64,
        nope: 128,
        heads: 16,
        batch: 6,
        seq: 1,
        paged: true,
        blocks: (64, 16),
        pad: 0,
        source: CosSin::Table,
        fused: true,
        raw: false,
        deint: false,
        norm: Norm::None,
    }
}

fn cases() -> Vec<Case> {
    let b = base();
    vec![
        b,
        // Claimed: past the scan's tokens; computed cos and sin; the raw door.
        Case { batch: 2, seq: 150, source: CosSin::Computed, raw: true, ..b },
        // Past the one-head kernel's tokens: the wide kernel.
        Case { batch: 1, seq: 8200, heads: 4, blocks: (1024, 16), ..b },
        // Contiguous rows, inputs of their own, rows padded, no q.
        Case { paged: false, batch: 3, seq: 5, blocks: (3, 40), fused: false, pad: 8, heads: 0, ..b },
        // Smaller ranks and rotary parts; one that takes element-by-element lanes (36).
        Case { rank: 256, rope: 32, nope: 16, heads: 5, seq: 7, source: CosSin::Computed, ..b },
        Case { rank: 36, rope: 16, nope: 0, heads: 3, batch: 2, seq: 40, raw: true, ..b },
        // De-interleaved pairs (transformers' order): decode, claimed, wide, contiguous.
        Case { deint: true, ..b },
        Case { deint: true, batch: 2, seq: 150, source: CosSin::Computed, raw: true, ..b },
        Case { deint: true, batch: 1, seq: 8200, heads: 4, blocks: (1024, 16), ..b },
        Case { deint: true, rank: 256, rope: 32, nope: 16, heads: 5, seq: 7, paged: false, blocks: (6, 64), ..b },
        // kv_c normalized: decode, claimed, wide (f32 weights), contiguous with inputs of their
        // own, a smaller rank; de-interleaved decode and claimed.
        Case { norm: Norm::Own, ..b },
        Case { norm: Norm::Own, batch: 2, seq: 150, source: CosSin::Computed, raw: true, ..b },
        Case { norm: Norm::F32, batch: 1, seq: 8200, heads: 4, blocks: (1024, 16), ..b },
        Case { norm: Norm::F32, paged: false, batch: 3, seq: 5, blocks: (3, 40), fused: false, pad: 8, ..b },
        Case { norm: Norm::Own, rank: 256, rope: 32, nope: 16, heads: 5, seq: 7, source: CosSin::Computed, ..b },
        Case { norm: Norm::Own, deint: true, ..b },
        Case { norm: Norm::F32, deint: true, batch: 2, seq: 150, raw: true, ..b },
    ]
}

#[test]
fn mla_append_matches_the_model_in_the_inputs_type() {
    let test = "mla_append_matches_the_model_in_the_inputs_type";
    let Some(g) = gpu(test) else { return };
    let seed = test_seed(test);
    for (i, c) in cases().into_iter().enumerate() {
        let seed = seed.wrapping_add(i as u64);
        own_case::<bf16>(&g, c, seed);
        own_case::<f16>(&g, c, seed ^ 1);
        own_case::<f32>(&g, c, seed ^ 2);
    }
}

#[test]
fn mla_append_into_fp8_matches_the_model_byte_for_byte() {
    let test = "mla_append_into_fp8_matches_the_model_byte_for_byte";
    let Some(g) = gpu(test) else { return };
    let seed = test_seed(test);
    // Scales that take the inputs (in [-1, 1)) to saturation, across the normal range, and
    // into subnormals.
    let scales = [0.0019f32, 0.37, 41.0, 1.0];
    for (i, c) in cases().into_iter().enumerate() {
        let seed = seed.wrapping_add(i as u64);
        let scale = scales[i % scales.len()];
        fp8_case::<bf16, F8E4M3>(&g, c, seed, scale);
        fp8_case::<f32, F8E5M2>(&g, c, seed ^ 1, scale);
        fp8_case::<f16, F8E4M3>(&g, Case { source: CosSin::Computed, ..c }, seed ^ 2, scales[(i + 1) % 4]);
    }
}

/// One step recorded in a graph and replayed with new positions and slots written in place
/// between replays: each replay writes the rows the buffers name then.
#[test]
fn mla_append_replays_in_a_graph() {
    let test = "mla_append_replays_in_a_graph";
    let Some(g) = gpu(test) else { return };
    let seed = test_seed(test);
    let c = Case { heads: 8, batch: 4, ..base() };
    let s = c.draw::<bf16>(seed);
    let rope = Rope::new(&g.kernels, c.config::<bf16>()).unwrap();
    let (cl, kl) = c.input_layouts();
    let dkv = upload_t(&s.kv_c);
    let mut dq = upload_t(&s.q);
    let n = s.cache.extent().unwrap();
    let mut dc = upload_t(&vec![bf16::ZERO; n]);
    let mut dpos = upload_t(&s.draw.positions);
    let mut dslots = upload_t(&[0i64, 1, 2, 3]);
    let graph = Graph::record(|| {
        let (kv_c, k_pe) = (Tensor::new(&dkv, cl), Tensor::new(&dkv, kl));
        let mut cache = MlaCache::paged(&mut dc, s.cache, &geometry(c.rank));
        let mut q = TensorMut::new(&mut dq, c.q_layout());
        let a = MlaAppend::new(&kv_c, &k_pe, &mut cache, Positions::ids_i32(&dpos)).slots(&dslots).q_pe(&mut q);
        rope.append_mla(a, &g.stream)
    })
    .unwrap();
    for replay in 0..3u64 {
        let pos: Vec<i32> = (0..4).map(|t| (100 * replay as i32 + 17 * t) % MAX_POS as i32).collect();
        let slots: Vec<i64> = (0..4).map(|t| (8 * replay + t) as i64).collect();
        dpos.copy_from(&pos[..]).unwrap();
        dslots.copy_from(&slots[..]).unwrap();
        // SAFETY: every buffer the graph names lives until the synchronisation below.
        unsafe { graph.launch(&g.stream) }.unwrap();
        g.stream.synchronize().unwrap();
        let cache: Vec<bf16> = download_t(&dc);
        for t in 0..4 {
            let at = row_at(&s.cache, slots[t] as usize / 16, slots[t] as usize % 16, 0);
            let (kv_c, k_pe) = s.token(&c, t);
            let x: Vec<f64> = k_pe.iter().map(|v| v.to_f64()).collect();
            let y = rope_row(&x, pos[t] as f64, BASE, c.rope, RopeStyle::GptJ, Direction::Forward);
            for i in 0..c.rank {
                assert_eq!(cache[at + i].to_bits(), kv_c[i].to_bits(), "replay {replay} token {t} kv_c {i}");
            }
            for i in 0..c.rope {
                let got = cache[at + c.rank + i];
                assert!(got.ulps(bf16::round(y[i])) <= 1, "replay {replay} token {t} k_pe {i}: {got} vs {}", y[i]);
            }
        }
    }
}

/// Each misuse is refused before any launch, with the operand named as MLA names it, and
/// nothing is written: not the cache, not q.
#[test]
fn mla_misuse_is_refused_and_nothing_is_written() {
    let test = "mla_misuse_is_refused_and_nothing_is_written";
    let Some(g) = gpu(test) else { return };
    let seed = test_seed(test);
    let c = Case { heads: 2, batch: 2, ..base() };
    let s = c.draw::<bf16>(seed);
    let rope = Rope::new(&g.kernels, c.config::<bf16>()).unwrap();
    let (cl, kl) = c.input_layouts();
    let dkv = upload_t(&s.kv_c);
    let q0 = s.q.clone();
    let mut dq = upload_t(&q0);
    let n = s.cache.extent().unwrap();
    let cache0: Vec<bf16> = uniform_vec(seed, 9, n).into_iter().map(bf16::from_f32).collect();
    let mut dc = upload_t(&cache0);
    let mut d8 = upload_t(&vec![F8E4M3(0x11); n]);
    let dpos = upload_t(&s.draw.positions);
    let dslots = upload_t(&[3i64, 4]);
    let short = upload_t(&[3i64]);
    let scale = upload_t(&[1.0f32]);
    let kv_c = Tensor::new(&dkv, cl);
    let k_pe = Tensor::new(&dkv, kl);
    let wide_k = Tensor::new(&dkv, Layout::strided([2, 1, 1, 32], [576, 576, 576], 512));
    let mut call = |rank: usize, k: &Tensor, slots: &DeviceBuffer<i64>, fp8: bool| {
        let mut q = TensorMut::new(&mut dq, c.q_layout());
        let mut cache = match fp8 {
            false => MlaCache::paged(&mut dc, s.cache, &geometry(rank)),
            // No scale: refused.
            true => MlaCache::paged(&mut d8, s.cache, &geometry(rank)),
        };
        let a = MlaAppend::new(&kv_c, k, &mut cache, Positions::ids_i32(&dpos)).slots(slots).q_pe(&mut q);
        rope.append_mla(a, &g.stream)
    };
    assert!(matches!(call(448, &k_pe, &dslots, false), Err(Error::Shape { what: "kv_c", .. })));
    assert!(matches!(call(512, &wide_k, &dslots, false), Err(Error::Shape { what: "k_pe", axis: "head_dim", .. })));
    assert!(matches!(call(512, &k_pe, &short, false), Err(Error::Length { what: "slots", .. })));
    assert!(matches!(call(512, &k_pe, &dslots, true), Err(Error::Scales(m)) if m.contains("MlaCache::scale")));
    // kv_c's norm: weights of the wrong length, a bad eps, weights inside the cache (the raw
    // door), FP8 weights.
    let (w511, w512) = (upload_t(&vec![bf16::ONE; 511]), upload_t(&vec![bf16::ONE; 512]));
    let w8 = upload_t(&vec![F8E4M3(0x38); 512]);
    let cache_at = dc.as_device_ptr().as_raw();
    let mut normed = |w: RawWeight, eps: f32| {
        let mut q = TensorMut::new(&mut dq, c.q_layout());
        let mut cache = MlaCache::paged(&mut dc, s.cache, &geometry(512));
        let a = MlaAppend::new(&kv_c, &k_pe, &mut cache, Positions::ids_i32(&dpos)).slots(&dslots).q_pe(&mut q);
        let args = a.raw().with_kv_c_norm(RawMlaNorm::new(w, eps));
        // SAFETY: every address but the refused weights' is a live buffer of this context.
        unsafe { rope.append_mla_raw(&args, g.stream.as_inner()) }
    };
    let weight = |b: u64, len: usize, dtype: DType| RawWeight::new(b, len, dtype);
    let (at511, at512) = (w511.as_device_ptr().as_raw(), w512.as_device_ptr().as_raw());
    let e = normed(weight(at511, 511, DType::BF16), EPS);
    assert!(matches!(e, Err(Error::Length { what: "kv_c norm weight", expected: 512, got: 511, .. })), "{e:?}");
    for eps in [0.0, -1e-6, f32::NAN, f32::INFINITY] {
        assert!(matches!(normed(weight(at512, 512, DType::BF16), eps), Err(Error::NormEps { .. })), "{eps}");
    }
    let e = normed(weight(cache_at + 64, 512, DType::BF16), EPS);
    assert!(matches!(e, Err(Error::Aliasing { a, b }) if a == "kv_c norm weight" || b == "kv_c norm weight"), "{e:?}");
    let e = normed(weight(w8.as_device_ptr().as_raw(), 512, DType::E4M3), EPS);
    assert!(matches!(e, Err(Error::DType { what: "kv_c norm weight", .. })), "{e:?}");
    g.stream.synchronize().unwrap();
    let after: Vec<bf16> = download_t(&dc);
    assert!(after.iter().zip(&cache0).all(|(a, b)| a.to_bits() == b.to_bits()), "the cache changed");
    let codes: Vec<F8E4M3> = download_t(&d8);
    assert!(codes.iter().all(|c| c.0 == 0x11), "the FP8 cache changed");
    let q_after: Vec<bf16> = download_t(&dq);
    assert!(q_after.iter().zip(&q0).all(|(a, b)| a.to_bits() == b.to_bits()), "q changed");
    // The same call with its scale is accepted and writes.
    let mut q = TensorMut::new(&mut dq, c.q_layout());
    let mut cache = MlaCache::paged(&mut d8, s.cache, &geometry(512)).scale(rope_cuda::Fp8Scale::new(&scale));
    let a = MlaAppend::new(&kv_c, &k_pe, &mut cache, Positions::ids_i32(&dpos)).slots(&dslots).q_pe(&mut q);
    rope.append_mla(a, &g.stream).unwrap();
    rope.check_errors(&g.stream).unwrap();
    let codes: Vec<F8E4M3> = download_t(&d8);
    assert!(codes.iter().any(|c| c.0 != 0x11), "the accepted call wrote nothing");
}

/// The MLA models' own rotary code in transformers (`tests/data/models/`, see
/// `make_golden_models.py`: each layer's call of the apply function on q's rotary parts and
/// on k_pe, recorded in a forward pass of a tiny random model): the configs read through
/// [`HfConfig`] (geometry and RoPE), the recorded inputs placed as an engine holds them (q_pe
/// inside q's heads after their `qk_nope_head_dim` dims, k_pe after kv_c in the kv_a
/// projection's rows), one append in f32 per layer; q_pe and the cache's k_pe match
/// transformers' outputs within 1e-5 of the row's largest input (its f32 angles), read
/// through the de-interleave permutation for the models whose apply function writes the pairs
/// back de-interleaved (DeepSeek-V3 and Kimi K2's `apply_rotary_pos_emb_interleave`; V2's
/// complex product writes them in place); kv_c and q's other dims are passed through.
#[test]
fn mla_append_matches_transformers_deepseek_and_kimi() {
    let test = "mla_append_matches_transformers_deepseek_and_kimi";
    let Some(g) = gpu(test) else { return };
    let seed = test_seed(test);
    for (name, deinterleaved) in [("deepseek_v2", false), ("deepseek_v3", true), ("kimi_k2", true)] {
        let json = String::from_utf8(common::data_file(&format!("models/{name}.json"))).unwrap();
        let model = rope_cuda::HfConfig::parse(&json).unwrap();
        let geo = model.mla().unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!((geo.kv_lora_rank, geo.qk_rope_head_dim, geo.qk_nope_head_dim), (32, 16, 16), "{name}");
        let config = model.rope().unwrap().dtype(rope_cuda::DType::F32);
        assert_eq!((config.head_dim, config.style), (geo.qk_rope_head_dim, RopeStyle::GptJ), "{name}");
        let rope = Rope::new(&g.kernels, config).unwrap();
        let golden = common::model_golden(name);
        let seq = golden.positions.len();
        let (pe, nope, rank) = (geo.qk_rope_head_dim, geo.qk_nope_head_dim, geo.kv_lora_rank);
        let (qd, w) = (geo.q_head_dim(), geo.latent_width());
        let positions: Vec<i32> = golden.positions.iter().map(|p| p[0] as i32).collect();
        // Where the append writes transformers' output element `j`: its pair `i` and which of
        // the two (`c`) as transformers wrote them (de-interleaved: at `i` and `pe / 2 + i`),
        // placed as the append was asked (`ask`: the same order, else at `2i + c`).
        let at = |j: usize, ask: bool| {
            let (i, c) = match deinterleaved {
                true => (j % (pe / 2), j / (pe / 2)),
                false => (j / 2, j % 2),
            };
            match ask {
                true => c * (pe / 2) + i,
                false => 2 * i + c,
            }
        };
        // Each layer's call: q's rotary parts, then k_pe.
        assert!(!golden.records.is_empty() && golden.records.len() % 2 == 0, "{name}: records");
        for (pair, ask) in golden.records.chunks(2).flat_map(|p| [(p, false), (p, true)]) {
            let (q_rec, k_rec) = (&pair[0], &pair[1]);
            let layer = q_rec.layer.unwrap_or_else(|| panic!("{name}: a call outside a layer"));
            assert_eq!(k_rec.layer, Some(layer), "{name}: q and k_pe of one call");
            let heads = q_rec.heads;
            assert_eq!((heads, q_rec.dim, k_rec.heads, k_rec.dim), (geo.num_heads, pe, 1, pe), "{name} layer {layer}");
            let what = format!("{name} layer {layer}, de-interleaved {ask}");
            // q: [seq, heads, nope + pe], seeded nope dims; kv_a: [seq, rank + pe], seeded kv_c.
            let mut q = uniform_vec(seed, layer as u64, seq * heads * qd);
            let mut kv_a = uniform_vec(seed, 100 + layer as u64, seq * w);
            for t in 0..seq {
                for h in 0..heads {
                    let row = &q_rec.input[(t * heads + h) * pe..][..pe];
                    q[(t * heads + h) * qd + nope..][..pe].copy_from_slice(row);
                }
                kv_a[t * w + rank..][..pe].copy_from_slice(&k_rec.input[t * pe..][..pe]);
            }
            let slots: Vec<i64> = (0..seq as i64).map(|t| 3 * t + 1).collect();
            let cache_layout = Layout::bshd(4, 16, 1, w);
            let cache0 = uniform_vec(seed, 200 + layer as u64, 4 * 16 * w);
            let (mut dq, dkv, mut dc) = (upload_t(&q), upload_t(&kv_a), upload_t(&cache0));
            let (dpos, dslots) = (upload_t(&positions), upload_t(&slots));
            {
                let q_pe = Layout::strided([1, seq, heads, pe], [seq * heads * qd, heads * qd, qd], nope);
                let mut qv = TensorMut::new(&mut dq, q_pe);
                let kv_c = Tensor::new(&dkv, Layout::strided([1, seq, 1, rank], [seq * w, w, w], 0));
                let k_pe = Tensor::new(&dkv, Layout::strided([1, seq, 1, pe], [seq * w, w, w], rank));
                let mut cache = MlaCache::paged(&mut dc, cache_layout, &geometry(rank));
                let a =
                    MlaAppend::new(&kv_c, &k_pe, &mut cache, Positions::ids_i32(&dpos)).slots(&dslots).q_pe(&mut qv);
                rope.append_mla(if ask { a.deinterleaved() } else { a }, &g.stream).unwrap();
            }
            rope.check_errors(&g.stream).unwrap();
            let (q_out, cache): (Vec<f32>, Vec<f32>) = (download_t(&dq), download_t(&dc));
            let close = |got: f32, want: f32, input: &[f32], where_: String| {
                let scale = input.iter().fold(0f64, |m, v| m.max(v.abs() as f64)).max(1e-30);
                let err = (got as f64 - want as f64).abs();
                assert!(err <= 1e-5 * scale, "{what}: {where_}: {got} vs transformers {want}");
            };
            for t in 0..seq {
                for h in 0..heads {
                    let r = (t * heads + h) * pe;
                    let base = (t * heads + h) * qd;
                    for j in 0..pe {
                        let got = q_out[base + nope + at(j, ask)];
                        close(
                            got,
                            q_rec.output[r + j],
                            &q_rec.input[r..r + pe],
                            format!("q token {t} head {h} dim {j}"),
                        );
                    }
                    assert_eq!(q_out[base..base + nope], q[base..base + nope], "{what}: q's nope dims of token {t}");
                }
                let row = slots[t] as usize * w;
                assert_eq!(cache[row..row + rank], kv_a[t * w..t * w + rank], "{what}: kv_c of token {t}");
                for j in 0..pe {
                    let got = cache[row + rank + at(j, ask)];
                    close(
                        got,
                        k_rec.output[t * pe + j],
                        &k_rec.input[t * pe..][..pe],
                        format!("k_pe token {t} dim {j}"),
                    );
                }
            }
            // Every other row as it was.
            for n in (0..64).filter(|n| !slots.contains(&(*n as i64))) {
                assert_eq!(cache[n * w..(n + 1) * w], cache0[n * w..(n + 1) * w], "{what}: row {n} changed");
            }
        }
    }
}

/// The strided copy the example times MLA's q_pe against (`bench::touch_rows`) copies exactly
/// its rows' bytes and nothing between them.
#[test]
fn strided_copy_yardstick_copies_its_rows_only() {
    let test = "strided_copy_yardstick_copies_its_rows_only";
    let Some(g) = gpu(test) else { return };
    let seed = test_seed(test);
    let (rows, pitch, offset, width) = (37usize, 96usize, 32usize, 48usize);
    let src = noise(seed, rows * pitch);
    let dst0 = noise(seed ^ 1, rows * pitch);
    let (ds, dd) = (upload_t(&src), upload_t(&dst0));
    let at = |b: &DeviceBuffer<u8>| b.as_device_ptr().as_raw() + offset as u64;
    let shape = (width as u64, pitch as u64, (rows - 1) as u64);
    // SAFETY: both buffers hold `rows` rows of `pitch` bytes; the copy reaches row `rows - 2`'s
    // end at most.
    unsafe { rope_cuda::bench::touch_rows(&g.kernels, &g.stream, (at(&ds), at(&dd)), shape) }.unwrap();
    g.stream.synchronize().unwrap();
    let got: Vec<u8> = download_t(&dd);
    for i in 0..rows * pitch {
        let (r, c) = (i / pitch, i % pitch);
        let copied = r < rows - 1 && (offset..offset + width).contains(&c);
        assert_eq!(got[i], if copied { src[i] } else { dst0[i] }, "byte {i} (row {r}, column {c})");
    }
    // Misaligned: refused before any launch.
    // SAFETY: as above (nothing is launched).
    let e = unsafe { rope_cuda::bench::touch_rows(&g.kernels, &g.stream, (at(&ds) + 8, at(&dd)), shape) };
    assert!(matches!(e, Err(Error::Alignment { .. })), "{e:?}");
}
