//! Sliding-window caches on the GPU ([`KvCache::window`], [`MlaCache::window`]): the fused
//! append and the MLA append into sink rows and a ring, against an f64 model of the caches
//! (tokens in call order, the last writer of a row wins), across calls as an engine makes them.

#![allow(clippy::needless_range_loop)]

mod common;

use common::{check_close, download_t, gpu, row_at, test_seed, upload_t, Gpu, TestElem};
use half::{bf16, f16};
use rope_cuda::reference::{rope_row, splitmix64, uniform_vec};
use rope_cuda::{
    CosSin, DType, Direction, Error, KvAppend, KvCache, Layout, MlaAppend, MlaCache, MlaGeometry, PositionKind,
    Positions, RawKvArgs, RawPositions, Rope, RopeConfig, RopeStyle, Tensor, TensorMut,
};

const MAX_POS: usize = 1 << 15;
const BASE: f64 = 10_000.0;

/// The row of position `pos` in a window of `rows` rows after `sinks` sink rows.
fn ring(pos: usize, rows: usize, sinks: usize) -> usize {
    if pos < sinks {
        pos
    } else {
        sinks + (pos - sinks) % (rows - sinks)
    }
}

/// A window cache's shape and the model of what it holds.
#[derive(Debug, Clone, Copy)]
struct Window {
    style: RopeStyle,
    head_dim: usize,
    rotary_dim: usize,
    q_heads: usize,
    kv_heads: usize,
    batch: usize,
    /// Rows per sequence.
    rows: usize,
    sinks: usize,
    /// `[batch, heads, rows, head_dim]` (else `[batch, rows, heads, head_dim]`).
    bhsd: bool,
    source: CosSin,
}

/// The caches on the host, updated call by call as the kernels should update them.
struct Model<T: TestElem> {
    k: Vec<T>,
    v: Vec<T>,
    /// The exact value of each rotated element of the key cache (the rest are copies).
    exact: Vec<Option<f64>>,
}

impl Window {
    fn layout(&self) -> Layout {
        let (b, r, h, d) = (self.batch, self.rows, self.kv_heads, self.head_dim);
        if self.bhsd {
            Layout::bhsd(b, h, r, d)
        } else {
            Layout::bshd(b, r, h, d)
        }
    }

    fn config<T: TestElem>(&self) -> RopeConfig {
        RopeConfig::new(self.head_dim, MAX_POS)
            .rotary_dim(self.rotary_dim)
            .style(self.style)
            .dtype(T::DTYPE)
            .base(BASE)
            .cos_sin(self.source)
    }

    /// One call of `seq` tokens a sequence at `positions` (`[batch, seq]`): appends into the
    /// device caches `kc`, `vc`, checks q, and applies the call to `model`.
    fn step<T: TestElem>(
        &self,
        g: &Gpu,
        (rope, seed): (&Rope, u64),
        (kc, vc): (&mut cust::memory::DeviceBuffer<T>, &mut cust::memory::DeviceBuffer<T>),
        positions: &[i32],
        model: &mut Model<T>,
    ) {
        let (d, rot, hq, hk) = (self.head_dim, self.rotary_dim, self.q_heads, self.kv_heads);
        let seq = positions.len() / self.batch;
        let conv = |v: Vec<f32>| v.into_iter().map(T::from_f32).collect::<Vec<T>>();
        let tokens = positions.len();
        let (q0, k, v) = (
            conv(uniform_vec(seed, 1, tokens * hq * d)),
            conv(uniform_vec(seed, 2, tokens * hk * d)),
            conv(uniform_vec(seed, 3, tokens * hk * d)),
        );
        let (mut dq, dk, dv, dpos) = (upload_t(&q0), upload_t(&k), upload_t(&v), upload_t(positions));
        let (ql, kl) = (Layout::bshd(self.batch, seq, hq, d), Layout::bshd(self.batch, seq, hk, d));
        {
            let mut cache = KvCache::window(&mut *kc, &mut *vc, self.layout(), self.sinks);
            let (kt, vt) = (Tensor::new(&dk, kl), Tensor::new(&dv, kl));
            let mut q = TensorMut::new(&mut dq, ql);
            let mut a = KvAppend::new(&kt, &vt, &mut cache, Positions::ids_i32(&dpos));
            if hq > 0 {
                a = a.q(&mut q);
            }
            rope.append_kv(a, &g.stream).unwrap();
        }
        rope.check_errors(&g.stream).unwrap();
        let rotate = |x: &[T], pos: i32| {
            let x: Vec<f64> = x.iter().map(|v| v.to_f64()).collect();
            rope_row(&x, pos as f64, BASE, rot, self.style, Direction::Forward)
        };
        // q in place.
        let (mut want_q, mut exact_q) = (q0.clone(), vec![None; q0.len()]);
        for t in 0..tokens {
            for h in 0..hq {
                let at = (t * hq + h) * d;
                let y = rotate(&q0[at..at + d], positions[t]);
                for i in 0..rot {
                    (want_q[at + i], exact_q[at + i]) = (T::round(y[i]), Some(y[i]));
                }
            }
        }
        check_close::<T>(&download_t(&dq), &want_q, &exact_q, &format!("{} {self:?}: q", T::NAME));
        // The caches: tokens in call order, each at its ring row.
        let layout = self.layout();
        for t in 0..tokens {
            let row = ring(positions[t] as usize, self.rows, self.sinks);
            for h in 0..hk {
                let (src, dst) = ((t * hk + h) * d, row_at(&layout, t / seq, row, h));
                let y = rotate(&k[src..src + d], positions[t]);
                for i in 0..d {
                    model.exact[dst + i] = (i < rot).then_some(y[i]);
                    model.k[dst + i] = if i < rot { T::round(y[i]) } else { k[src + i] };
                }
                model.v[dst..dst + d].copy_from_slice(&v[src..src + d]);
            }
        }
    }

    /// The caches against the model: every element (untouched ones bit-identical).
    fn check<T: TestElem>(&self, kc: &[T], vc: &[T], model: &Model<T>, what: &str) {
        let what = format!("{} {self:?} {what}", T::NAME);
        check_close::<T>(kc, &model.k, &model.exact, &format!("{what}: key cache"));
        for i in 0..vc.len() {
            assert_eq!(vc[i].bits(), model.v[i].bits(), "{what}: value cache element {i}");
        }
    }

    /// Fresh caches of seeded values (never zeros) on the device and in the model.
    fn caches<T: TestElem>(
        &self,
        seed: u64,
    ) -> (cust::memory::DeviceBuffer<T>, cust::memory::DeviceBuffer<T>, Model<T>) {
        let n = self.layout().extent().unwrap();
        let conv = |v: Vec<f32>| v.into_iter().map(T::from_f32).collect::<Vec<T>>();
        let (k, v) = (conv(uniform_vec(seed, 13, n)), conv(uniform_vec(seed, 14, n)));
        (upload_t(&k), upload_t(&v), Model { k, v, exact: vec![None; n] })
    }
}

/// Positions of one call: each sequence's `seq` tokens rising from a seeded start below
/// `3 * rows` (so calls cross the sinks, wrap the ring, and, longer than it, meet at rows), or
/// for `shuffled` the same positions in a seeded order (the call's last token at a row wins,
/// not the latest position).
fn positions(seed: u64, w: &Window, seq: usize, shuffled: bool) -> Vec<i32> {
    let mut rng = seed;
    let mut next = |n: usize| {
        rng = splitmix64(rng);
        (rng % n as u64) as usize
    };
    let mut all = Vec::new();
    for _ in 0..w.batch {
        let start = next(3 * w.rows);
        let mut p: Vec<i32> = (0..seq).map(|s| (start + s) as i32).collect();
        if shuffled {
            for i in (1..p.len()).rev() {
                p.swap(i, next(i + 1));
            }
        }
        all.extend(p);
    }
    all
}

fn matrix<T: TestElem>(test: &str) {
    let Some(g) = gpu(test) else { return };
    let seed = test_seed(test);
    let mut n = 0;
    for source in [CosSin::Table, CosSin::Computed] {
        for (i, style) in [RopeStyle::NeoX, RopeStyle::GptJ].into_iter().enumerate() {
            for (j, (rows, sinks, bhsd)) in [(16, 4, false), (40, 0, true), (24, 23, false)].into_iter().enumerate() {
                let (head_dim, rotary_dim) = [(64, 64), (128, 96), (80, 32)][(i + j) % 3];
                let (q_heads, kv_heads) = [(8, 2), (4, 4), (0, 1)][j];
                let w = Window { style, head_dim, rotary_dim, q_heads, kv_heads, batch: 3, rows, sinks, bhsd, source };
                let rope = Rope::new(&g.kernels, w.config::<T>()).unwrap();
                let s = seed ^ (n << 8);
                let (mut kc, mut vc, mut model) = w.caches::<T>(s);
                // Decode steps, a chunk shorter than the ring, one longer (rows meet), one
                // shuffled, and one past the scan (the claim path).
                for (c, (seq, shuffled)) in
                    [(1, false), (5, false), (2 * rows + 3, false), (rows + 7, true), (300, false)]
                        .into_iter()
                        .enumerate()
                {
                    let cs = s ^ (c as u64 + 1);
                    w.step(&g, (&rope, cs), (&mut kc, &mut vc), &positions(cs, &w, seq, shuffled), &mut model);
                    w.check::<T>(&download_t(&kc), &download_t(&vc), &model, &format!("call {c} ({seq} tokens)"));
                }
                n += 1;
            }
        }
    }
}

#[test]
fn window_rows_f32() {
    matrix::<f32>("window_rows_f32");
}

#[test]
fn window_rows_f16() {
    matrix::<f16>("window_rows_f16");
}

#[test]
fn window_rows_bf16() {
    matrix::<bf16>("window_rows_bf16");
}

/// An engine's sequence: a prompt chunk, then decode steps one token at a time past several
/// turns of the ring; at the end the cache holds the sinks' rows and the latest positions',
/// each where a cache filled directly with those tokens holds it.
#[test]
fn window_keeps_the_sinks_and_the_latest_positions() {
    let test = "window_keeps_the_sinks_and_the_latest_positions";
    let Some(g) = gpu(test) else { return };
    let seed = test_seed(test);
    for source in [CosSin::Table, CosSin::Computed] {
        let w = Window {
            style: RopeStyle::NeoX,
            head_dim: 128,
            rotary_dim: 128,
            q_heads: 4,
            kv_heads: 2,
            batch: 2,
            rows: 32,
            sinks: 4,
            bhsd: false,
            source,
        };
        let rope = Rope::new(&g.kernels, w.config::<bf16>()).unwrap();
        let (mut kc, mut vc, mut model) = w.caches::<bf16>(seed);
        let prompt: Vec<i32> = (0..w.batch).flat_map(|_| 0..50).collect();
        w.step(&g, (&rope, seed ^ 1), (&mut kc, &mut vc), &prompt, &mut model);
        for p in 50..130 {
            w.step(&g, (&rope, seed ^ (p as u64) << 4), (&mut kc, &mut vc), &vec![p; w.batch], &mut model);
        }
        let (k, v): (Vec<bf16>, Vec<bf16>) = (download_t(&kc), download_t(&vc));
        w.check(&k, &v, &model, "after 80 decode steps");
        // The model's rows are positions 0..4 and 102..130, every row written: the cache
        // holds nothing of its initial values and nothing of an overwritten position.
        for row in 0..w.rows {
            assert!(model.exact[row_at(&w.layout(), 1, row, 1)].is_some(), "row {row} written");
        }
    }
}

/// Rows and an MLA latent cache's window: kv_c copied and k_pe rotated (GPT-J pairs) into the
/// ring rows; every other element bit-identical.
#[test]
fn mla_window_rows() {
    let test = "mla_window_rows";
    let Some(g) = gpu(test) else { return };
    let seed = test_seed(test);
    let (rank, rope_dim, batch, rows, sinks) = (512, 64, 2, 20, 2);
    for (c, seq) in [1usize, 7, 45, 300].into_iter().enumerate() {
        let s = seed ^ c as u64;
        let config = RopeConfig::new(rope_dim, MAX_POS).style(RopeStyle::GptJ).dtype(DType::BF16).base(BASE);
        let rope = Rope::new(&g.kernels, config).unwrap();
        let w = Window {
            style: RopeStyle::GptJ,
            head_dim: rope_dim,
            rotary_dim: rope_dim,
            q_heads: 0,
            kv_heads: 1,
            batch,
            rows,
            sinks,
            bhsd: false,
            source: CosSin::Table,
        };
        let pos = positions(s, &w, seq, c == 2);
        let conv = |v: Vec<f32>| v.into_iter().map(bf16::from_f32).collect::<Vec<bf16>>();
        let (kv_c, k_pe) =
            (conv(uniform_vec(s, 1, batch * seq * rank)), conv(uniform_vec(s, 2, batch * seq * rope_dim)));
        let layout = Layout::bshd(batch, rows, 1, rank + rope_dim);
        let cache0 = conv(uniform_vec(s, 3, layout.extent().unwrap()));
        let (dkv, dk, dpos, mut dc) = (upload_t(&kv_c), upload_t(&k_pe), upload_t(&pos), upload_t(&cache0));
        {
            let mut cache = MlaCache::window(&mut dc, layout, &MlaGeometry::new(rank, 64, 128, 128, 128), sinks);
            let (kt, kp) = (
                Tensor::new(&dkv, Layout::bshd(batch, seq, 1, rank)),
                Tensor::new(&dk, Layout::bshd(batch, seq, 1, rope_dim)),
            );
            rope.append_mla(MlaAppend::new(&kt, &kp, &mut cache, Positions::ids_i32(&dpos)), &g.stream).unwrap();
        }
        rope.check_errors(&g.stream).unwrap();
        let (mut want, mut exact) = (cache0.clone(), vec![None; cache0.len()]);
        for t in 0..batch * seq {
            let dst = row_at(&layout, t / seq, ring(pos[t] as usize, rows, sinks), 0);
            want[dst..dst + rank].copy_from_slice(&kv_c[t * rank..(t + 1) * rank]);
            let x: Vec<f64> = k_pe[t * rope_dim..(t + 1) * rope_dim].iter().map(|v| v.to_f64()).collect();
            let y = rope_row(&x, pos[t] as f64, BASE, rope_dim, RopeStyle::GptJ, Direction::Forward);
            for i in 0..rank {
                exact[dst + i] = None;
            }
            for i in 0..rope_dim {
                (want[dst + rank + i], exact[dst + rank + i]) = (bf16::round(y[i]), Some(y[i]));
            }
        }
        check_close::<bf16>(&download_t(&dc), &want, &exact, &format!("mla window, {seq} tokens"));
    }
}

/// Sinks that fill the window, and a window given slots or marked paged, are refused before
/// any launch; the caches stay bit-identical.
#[test]
fn window_refusals_write_nothing() {
    let test = "window_refusals_write_nothing";
    let Some(g) = gpu(test) else { return };
    let seed = test_seed(test);
    let config = RopeConfig::new(64, MAX_POS).dtype(DType::BF16);
    let rope = Rope::new(&g.kernels, config).unwrap();
    let conv = |v: Vec<f32>| v.into_iter().map(bf16::from_f32).collect::<Vec<bf16>>();
    let layout = Layout::bshd(2, 8, 1, 64);
    let n = layout.extent().unwrap();
    let (k0, v0) = (conv(uniform_vec(seed, 1, n)), conv(uniform_vec(seed, 2, n)));
    let (mut kc, mut vc) = (upload_t(&k0), upload_t(&v0));
    let new = conv(uniform_vec(seed, 3, 2 * 64));
    let (dk, dv, dpos, dslots) = (upload_t(&new), upload_t(&new), upload_t(&[3i32, 9]), upload_t(&[1i64, 2]));
    let nl = Layout::bshd(2, 1, 1, 64);
    let (kt, vt) = (Tensor::new(&dk, nl), Tensor::new(&dv, nl));
    {
        let mut full = KvCache::window(&mut kc, &mut vc, layout, 8);
        let got = rope.append_kv(KvAppend::new(&kt, &vt, &mut full, Positions::ids_i32(&dpos)), &g.stream);
        assert!(matches!(got, Err(Error::TooLarge { value: 8, limit: 7, .. })), "{got:?}");
    }
    {
        let mut cache = KvCache::window(&mut kc, &mut vc, layout, 2);
        let got =
            rope.append_kv(KvAppend::new(&kt, &vt, &mut cache, Positions::ids_i32(&dpos)).slots(&dslots), &g.stream);
        assert!(matches!(got, Err(Error::SlotMapping(_))), "{got:?}");
        // A raw window marked paged, given slots.
        let mut raw = cache.raw();
        raw.paged = true;
        let t = |b: &cust::memory::DeviceBuffer<bf16>| {
            rope_cuda::RawTensor::new(b.as_device_ptr().as_raw(), b.len(), DType::BF16, nl)
        };
        let positions = RawPositions::new(PositionKind::IdsI32, dpos.as_device_ptr().as_raw(), 2);
        let args = RawKvArgs::new(t(&dk), t(&dv), raw, positions).with_slots((dslots.as_device_ptr().as_raw(), 2));
        // SAFETY: every address is a live buffer of this context; the call is refused.
        let got = unsafe { rope.append_kv_raw(&args, g.stream.as_inner()) };
        assert!(matches!(got, Err(Error::SlotMapping(_))), "{got:?}");
    }
    // An MLA window whose sinks fill it: latent rows of 64 + 64.
    let ml = Layout::bshd(2, 8, 1, 128);
    let r0 = conv(uniform_vec(seed, 4, ml.extent().unwrap()));
    let mut rows = upload_t(&r0);
    {
        let mut cache = MlaCache::window(&mut rows, ml, &MlaGeometry::new(64, 64, 128, 128, 128), 8);
        let got = rope.append_mla(MlaAppend::new(&kt, &vt, &mut cache, Positions::ids_i32(&dpos)), &g.stream);
        assert!(matches!(got, Err(Error::TooLarge { value: 8, limit: 7, .. })), "{got:?}");
    }
    let r: Vec<bf16> = download_t(&rows);
    assert!(r.iter().zip(&r0).all(|(a, b)| a.to_bits() == b.to_bits()), "nothing written to the latent rows");
    g.stream.synchronize().unwrap();
    let (k, v): (Vec<bf16>, Vec<bf16>) = (download_t(&kc), download_t(&vc));
    assert!(k.iter().zip(&k0).chain(v.iter().zip(&v0)).all(|(a, b)| a.to_bits() == b.to_bits()), "nothing written");
}

/// The same refusals and the accepted forms without a GPU ([`validate_append`],
/// [`validate_mla`]): a window's positions run to `max_position`, past its rows.
#[test]
fn window_plans_without_a_gpu() {
    use rope_cuda::{validate_append, validate_mla, RawKvCache, RawMlaArgs, RawMlaCache, RawTensor};
    let t = |i: u64, layout: Layout| RawTensor::new(i << 30, layout.extent().unwrap(), DType::BF16, layout);
    let config = RopeConfig::new(128, MAX_POS).dtype(DType::BF16);
    let (new, cache) = (Layout::bshd(2, 3, 2, 128), Layout::bshd(2, 16, 2, 128));
    let args = |cache: RawKvCache, slots| {
        let mut args = RawKvArgs::new(t(1, new), t(2, new), cache, RawPositions::new(PositionKind::IdsI32, 5 << 30, 6));
        args.slots = slots;
        args
    };
    let window = |sinks| RawKvCache::window(t(3, cache), t(4, cache), sinks);
    for sinks in [0, 4, 15] {
        assert_eq!(validate_append(&config, &args(window(sinks), None)), Ok(()), "sinks {sinks}");
    }
    let full = validate_append(&config, &args(window(16), None));
    assert!(matches!(full, Err(Error::TooLarge { value: 16, limit: 15, .. })), "{full:?}");
    let slots = validate_append(&config, &args(window(4), Some((6 << 30, 6))));
    assert!(matches!(slots, Err(Error::SlotMapping(_))), "{slots:?}");
    let mut paged = window(4);
    paged.paged = true;
    let paged = validate_append(&config, &args(paged, Some((6 << 30, 6))));
    assert!(matches!(paged, Err(Error::SlotMapping(_))), "{paged:?}");
    // MLA: latent rows of 512 + 64 in a window of 16 after 2 sinks.
    let mla = RopeConfig::new(64, MAX_POS).dtype(DType::BF16).style(RopeStyle::GptJ);
    let rows = Layout::bshd(2, 16, 1, 576);
    let mla_args = |sinks| {
        RawMlaArgs::new(
            t(1, Layout::bshd(2, 3, 1, 512)),
            t(2, Layout::bshd(2, 3, 1, 64)),
            RawMlaCache::window(t(3, rows), 512, sinks),
            RawPositions::new(PositionKind::IdsI32, 5 << 30, 6),
        )
    };
    assert_eq!(validate_mla(&mla, &mla_args(2)), Ok(()));
    assert!(matches!(validate_mla(&mla, &mla_args(16)), Err(Error::TooLarge { value: 16, .. })));
}
