//! The KV shift on the GPU ([`Rope::shift_kv`], [`Rope::shift_kv_raw`]): cached keys turned in
//! place by a delta per sequence, against an f64 model: each named row's rotary dims turned by
//! `|Δ| inv_freq` reduced exactly (the reference's `sin_cos`), the sine negated for a negative
//! `Δ`, without the attention factor; bf16 and f16 within one ulp of the correctly rounded
//! turn, f32 within 2e-7 of the row's largest value, FP8 codes bit for bit (decoded with the
//! head's scale, turned, rounded to f32, divided by the scale and encoded once); every other
//! element (rows not named, padding slots, rows of `Δ = 0`, dims past the rotary ones, the
//! value cache) bit for bit. Styles × element types × both sources of cos and sin × paged
//! (both layouts), contiguous (both layouts) and window caches × vector and element-by-element
//! widths × plain, YaRN and MRoPE configurations × i32 and i64 deltas × the typed and raw
//! doors; then an engine's context shift against a cache filled at the new positions, `Δ`
//! and back, every source alike, a recorded graph replayed with new deltas, MLA latent
//! caches, out-of-range deltas and slots, the length-dependent scalings, and misuse refused
//! with nothing written.
//!
//! Where a shift follows another rounding (a shift of appended keys, `Δ` then `−Δ`, two
//! replays), an element's error is bounded by its pair's size, not its own: the first
//! rounding's error (half an ulp of each element of the pair) is turned with the pair and
//! lands on both elements, so an element much smaller than its pair's norm `r` may be many of
//! its own ulps off. Those checks take `ulp(r)`, the ulp of `T` at the pair's norm: two
//! roundings give at most about `(√2 / 2 + 1) ulp(r)`.

#![allow(clippy::needless_range_loop)]

mod common;

use std::ops::Range;

use common::{
    changed, distinct_slots, download_t, each_case, gpu, noise, random_bf16, row_at, test_seed, upload_t, Code, Gpu,
    TestElem,
};
use cust::memory::{CopyDestination, DeviceBuffer};
use half::{bf16, f16};
use rope_cuda::reference::{rope_row_freqs, sin_cos, splitmix64, uniform_vec};
use rope_cuda::{
    validate_shift, CosSin, CustElement, DType, Direction, Error, Fp8Scale, Graph, KvAppend, KvCache, KvScales,
    KvShift, Layout, MlaCache, MlaGeometry, Mrope, PositionKind, Positions, RawKvCache, RawMlaCache, RawPositions,
    RawScales, RawShiftArgs, RawTensor, Rope, RopeConfig, RopeScaling, RopeStyle, ShiftCache, Tensor, F8E4M3, F8E5M2,
    MAX_POSITION_LIMIT, SHIFT_MAX_DELTA,
};

const MAX_POS: usize = 4096;
const BASE: f64 = 10_000.0;

/// Scales that put FP8 codes across f32's range: large, small, around 1.
const SCALES: [f32; 7] = [3.7, 0.0019, 0.37, 41.0, 1.0, 1e-30, 3e20];

// The model.

/// Each pair's `(sin, cos)` for a turn by `delta` at the frequencies `freqs`: the angle
/// `|Δ| f` reduced exactly (the reference's `sin_cos`), the sine negated for a negative `Δ`,
/// and no attention factor.
fn turn(freqs: &[f64], delta: i64) -> Vec<(f64, f64)> {
    freqs
        .iter()
        .map(|&f| {
            let (s, c) = sin_cos(delta.unsigned_abs() as f64, f);
            (if delta < 0 { -s } else { s }, c)
        })
        .collect()
}

/// The two elements of pair `i` of `half` pairs.
fn pair(style: RopeStyle, half: usize, i: usize) -> (usize, usize) {
    match style {
        RopeStyle::NeoX => (i, i + half),
        RopeStyle::GptJ => (2 * i, 2 * i + 1),
    }
}

/// A row's rotary dims `x` turned by `turn` (one entry a pair), in f64.
fn rotate(x: &[f64], turn: &[(f64, f64)], style: RopeStyle) -> Vec<f64> {
    let mut y = x.to_vec();
    for (i, &(s, c)) in turn.iter().enumerate() {
        let (a, b) = pair(style, turn.len(), i);
        y[a] = x[a] * c - x[b] * s;
        y[b] = x[b] * c + x[a] * s;
    }
    y
}

/// One ulp of `T` at the magnitude `r`: the step above the value nearest `r`.
fn ulp_at<T: TestElem>(r: f64) -> f64 {
    let v = T::round(r.abs());
    T::from_bits(v.bits() + 1).to_f64() - v.to_f64()
}

/// A head's rotary dims `got` against `want` (exact values), each element within `ulps` ulps
/// of `T` at its pair's norm; returns the largest error in those units.
fn check_pairs<T: TestElem>(got: &[T], want: &[f64], style: RopeStyle, ulps: f64, what: &dyn Fn() -> String) -> f64 {
    let half = want.len() / 2;
    let mut worst = 0f64;
    for i in 0..half {
        let (a, b) = pair(style, half, i);
        let u = ulp_at::<T>(want[a].hypot(want[b]));
        for e in [a, b] {
            let err = (got[e].to_f64() - want[e]).abs() / u;
            assert!(err <= ulps, "{}: dim {e}: {:?} vs {} ({err:.2} ulps of the pair's norm)", what(), got[e], want[e]);
            worst = worst.max(err);
        }
    }
    worst
}

/// The deltas of a case, one a sequence: the (0, ±1, ±17, ±(max_position - 1),
/// max_position + 5, -2^24, ±(2^31 - 1)) and two seeded ones (any, and one within
/// ±max_position), in a seeded order.
fn deltas(seed: u64) -> Vec<i64> {
    let (m, max) = (MAX_POS as i64, SHIFT_MAX_DELTA);
    let r = |i: u64| splitmix64(seed ^ (i << 40) ^ 0xD1);
    let mut d = vec![
        0,
        1,
        -1,
        17,
        -17,
        m - 1,
        -(m - 1),
        m + 5,
        -(1 << 24),
        max,
        -max,
        (r(1) % (2 * max as u64 + 1)) as i64 - max,
        (r(2) % (2 * m as u64 + 1)) as i64 - m,
    ];
    for i in (1..d.len()).rev() {
        d.swap(i, (r(10 + i as u64) % (i as u64 + 1)) as usize);
    }
    d
}

/// YaRN at factor 4: frequencies of their own and an attention factor of 1.139, which the
/// shift must not apply.
fn yarn() -> RopeScaling {
    RopeScaling::Yarn {
        factor: 4.0,
        original_max_position_embeddings: 1024,
        beta_fast: 32.0,
        beta_slow: 1.0,
        mscale: None,
        mscale_all_dim: None,
        attention_factor: None,
        truncate: true,
    }
}

/// LongRoPE with per-pair factors for `half` pairs (long ones past 1024 positions) and an
/// attention factor above 1.
fn longrope(half: usize) -> RopeScaling {
    RopeScaling::LongRope {
        short_factor: (0..half).map(|i| 1.0 + 0.01 * i as f64).collect(),
        long_factor: (0..half).map(|i| 1.0 + 0.25 * i as f64).collect(),
        original_max_position_embeddings: 1024,
        factor: 16.0,
        attention_factor: None,
    }
}

// The caches and the rows a shift names.

/// A row a shift names: its sequence, its block and its row within the block.
type Row = (usize, usize, usize);

/// A cache's form and the rows a shift names in it.
#[derive(Debug, Clone, Copy)]
enum Form {
    /// Paged, `[pages, page, heads, d]` (`hnd`: `[pages, heads, page, d]`), `n` distinct slots
    /// a sequence, two of them padding (`-1`).
    Paged { hnd: bool, pages: usize, page: usize, n: usize },
    /// Contiguous, `[batch, rows, heads, d]` (`hnd`: `[batch, heads, rows, d]`), the rows
    /// `range` of each sequence (all where `None`).
    Contiguous { hnd: bool, rows: usize, range: Option<(usize, usize)> },
    /// A sliding window of `rows` rows after `sinks` sinks, `[batch, rows, heads, d]`.
    Window { rows: usize, sinks: usize, range: Option<(usize, usize)> },
}

/// A cache of a case and the rows its shift names.
#[derive(Debug)]
struct Target {
    form: Form,
    layout: Layout,
    /// Elements in each cache buffer.
    len: usize,
    /// A paged cache's slots, `[batch, n]`.
    slots: Option<Vec<i64>>,
    /// Each named row: its sequence, block and row within the block.
    named: Vec<Row>,
}

impl Form {
    /// The layout of `batch` sequences' cache of `heads` heads of `d`, `offset` elements into
    /// its buffer.
    fn layout(self, batch: usize, heads: usize, d: usize, offset: usize) -> Layout {
        let l = match self {
            Form::Paged { hnd: false, pages, page, .. } => Layout::bshd(pages, page, heads, d),
            Form::Paged { hnd: true, pages, page, .. } => Layout::bhsd(pages, heads, page, d),
            Form::Contiguous { hnd: false, rows, .. } | Form::Window { rows, .. } => {
                Layout::bshd(batch, rows, heads, d)
            }
            Form::Contiguous { hnd: true, rows, .. } => Layout::bhsd(batch, heads, rows, d),
        };
        Layout::strided(l.shape, l.strides, offset)
    }

    /// The slots (paged) and the named rows of `batch` sequences, drawn from `seed`.
    fn rows(self, seed: u64, batch: usize) -> (Option<Vec<i64>>, Vec<Row>) {
        match self {
            Form::Paged { pages, page, n, .. } => {
                let slots = distinct_slots(seed, pages * page, batch * n, &[1, n + 2]);
                (Some(slots.clone()), named_slots(&slots, n, page, pages * page))
            }
            Form::Contiguous { rows, range, .. } | Form::Window { rows, range, .. } => {
                let (a, b) = range.unwrap_or((0, rows));
                (None, (0..batch).flat_map(|s| (a..b).map(move |r| (s, s, r))).collect())
            }
        }
    }

    fn target(self, seed: u64, batch: usize, heads: usize, d: usize, offset: usize) -> Target {
        let layout = self.layout(batch, heads, d, offset);
        let (slots, named) = self.rows(seed, batch);
        Target { form: self, layout, len: layout.extent().unwrap(), slots, named }
    }

    /// A contiguous cache's range of rows, as the shift is given it.
    fn range(self) -> Option<Range<usize>> {
        match self {
            Form::Paged { .. } => None,
            Form::Contiguous { range, .. } | Form::Window { range, .. } => range.map(|(a, b)| a..b),
        }
    }
}

/// The rows `slots` (`[batch, n]`) name in pages of `page`: those in `0..num_slots`.
fn named_slots(slots: &[i64], n: usize, page: usize, num_slots: usize) -> Vec<Row> {
    let inside = |s: i64| (0..num_slots as i64).contains(&s);
    slots
        .iter()
        .enumerate()
        .filter(|&(_, &s)| inside(s))
        .map(|(t, &s)| (t / n, s as usize / page, s as usize % page))
        .collect()
}

/// How a shift is called.
#[derive(Debug, Clone, Copy, Default)]
struct Door {
    /// i64 deltas (else i32).
    wide: bool,
    /// `shift_kv_raw` (else `shift_kv`).
    raw: bool,
    /// `KvShift::length_dependent`.
    length_dependent: bool,
}

/// An FP8 cache's scales: the keys', the values', per head or one each.
#[derive(Clone, Copy)]
struct Scales<'b> {
    k: &'b DeviceBuffer<f32>,
    v: &'b DeviceBuffer<f32>,
    per_head: bool,
}

/// Shifts `target`'s rows of the key cache `kc` (values `vc`) by `deltas` (one a sequence),
/// as `door` says; through the raw door, [`validate_shift`] must say what the launch says.
/// Returns the call's result (the records are not read).
fn run_shift<E: CustElement>(
    g: &Gpu,
    rope: &Rope,
    (kc, vc): (&mut DeviceBuffer<E>, &mut DeviceBuffer<E>),
    target: &Target,
    deltas: &[i64],
    door: Door,
    scales: Option<Scales<'_>>,
) -> rope_cuda::Result<()> {
    let d32 = upload_t(&deltas.iter().map(|&d| d as i32).collect::<Vec<_>>());
    let d64 = upload_t(deltas);
    let dslots = target.slots.as_ref().map(|s| upload_t(s));
    let mut cache = match target.form {
        Form::Paged { .. } => KvCache::paged(kc, vc, target.layout),
        Form::Contiguous { .. } => KvCache::contiguous(kc, vc, target.layout),
        Form::Window { sinks, .. } => KvCache::window(kc, vc, target.layout, sinks),
    };
    if let Some(s) = scales {
        cache = cache.scales(if s.per_head { KvScales::per_head(s.k, s.v) } else { KvScales::per_tensor(s.k, s.v) });
    }
    if door.raw {
        let (kind, ptr) = match door.wide {
            true => (PositionKind::IdsI64, d64.as_device_ptr().as_raw()),
            false => (PositionKind::IdsI32, d32.as_device_ptr().as_raw()),
        };
        let mut args = RawShiftArgs::new(ShiftCache::Kv(cache.raw()), RawPositions::new(kind, ptr, deltas.len()))
            .with_length_dependent(door.length_dependent);
        if let Some(s) = &dslots {
            args = args.with_slots((s.as_device_ptr().as_raw(), s.len()));
        }
        if let Some(r) = target.form.range() {
            args = args.with_rows(r);
        }
        // SAFETY: every address is a live buffer of this context, alive until the
        // synchronisation below.
        let got = unsafe { rope.shift_kv_raw(&args, g.stream.as_inner()) };
        assert_eq!(validate_shift(rope.config(), &args), got, "validate_shift and the launch disagree");
        g.stream.synchronize().unwrap();
        got
    } else {
        let positions = if door.wide { Positions::ids_i64(&d64) } else { Positions::ids_i32(&d32) };
        let mut shift = KvShift::new(&mut cache, positions);
        if let Some(s) = &dslots {
            shift = shift.slots(s);
        }
        if let Some(r) = target.form.range() {
            shift = shift.rows(r);
        }
        if door.length_dependent {
            shift = shift.length_dependent();
        }
        let got = rope.shift_kv(shift, &g.stream);
        g.stream.synchronize().unwrap();
        got
    }
}

/// The key cache `k` after a shift of `t`'s rows by `deltas` from `k0`, against the model of
/// `config`: each named row's rotary dims (for `Δ ≠ 0`) within one ulp of the correctly
/// rounded exact turn (f32: within 2e-7 of the row's largest value), every other element bit
/// for bit. Returns how many elements were turned.
fn check_shift<T: TestElem>(k: &[T], k0: &[T], t: &Target, deltas: &[i64], config: &RopeConfig, what: &str) -> usize {
    let (freqs, _) = config.frequencies().unwrap();
    let (rot, heads) = (config.rotary_dim, t.layout.shape[2]);
    let turns: Vec<_> = deltas.iter().map(|&d| turn(&freqs, d)).collect();
    let mut turned = vec![false; k.len()];
    let mut count = 0;
    for &(b, blk, within) in &t.named {
        if deltas[b] == 0 {
            continue; // bit for bit, below
        }
        for h in 0..heads {
            let at = row_at(&t.layout, blk, within, h);
            let x: Vec<f64> = k0[at..at + rot].iter().map(|v| v.to_f64()).collect();
            let y = rotate(&x, &turns[b], config.style);
            let largest = x.iter().chain(&y).fold(0f64, |m, v| m.max(v.abs()));
            for i in 0..rot {
                let got = k[at + i];
                let ok = match T::NAME {
                    "f32" => (got.to_f64() - y[i]).abs() <= 2e-7 * largest,
                    _ => got.ulps(T::round(y[i])) <= 1,
                };
                assert!(
                    ok,
                    "{what}: sequence {b} (Δ {}) block {blk} row {within} head {h} dim {i}: {got:?}, the model {} (was {:?})",
                    deltas[b], y[i], k0[at + i]
                );
                turned[at + i] = true;
            }
            count += rot;
        }
    }
    for i in 0..k.len() {
        if !turned[i] {
            assert_eq!(
                k[i].bits(),
                k0[i].bits(),
                "{what}: element {i}, not turned, changed: {:?} -> {:?}",
                k0[i],
                k[i]
            );
        }
    }
    count
}

/// The bits of `a` and `b` are the same.
fn same_bits<T: TestElem>(a: &[T], b: &[T]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.bits() == y.bits())
}

// The matrix.

#[derive(Debug, Clone, Copy, PartialEq)]
enum Scaling {
    Plain,
    Yarn,
    Mrope,
}

#[derive(Debug, Clone, Copy)]
struct Case {
    style: RopeStyle,
    head_dim: usize,
    rotary_dim: usize,
    kv_heads: usize,
    form: Form,
    source: CosSin,
    scaling: Scaling,
    /// Elements before the cache's view in its buffers (odd: no 16-byte accesses).
    offset: usize,
    /// How the shift is called.
    door: Door,
    /// FP8: one scale per kv head (else one for all).
    per_head: bool,
}

impl Case {
    fn config(&self, dtype: DType) -> RopeConfig {
        let c = RopeConfig::new(self.head_dim, MAX_POS)
            .rotary_dim(self.rotary_dim)
            .style(self.style)
            .dtype(dtype)
            .base(BASE)
            .cos_sin(self.source);
        match self.scaling {
            Scaling::Plain => c,
            Scaling::Yarn => c.scaling(yarn()),
            Scaling::Mrope => {
                let h = self.rotary_dim / 2;
                c.mrope(Some(Mrope::new([h - 2 * (h / 3), h / 3, h / 3], false)))
            }
        }
    }
}

/// Both sources × both styles × five cache forms; head and rotary dims that take 16-byte
/// accesses ((128, 128), (128, 96), (80, 32)) and one that does not (72, 36), as does a view
/// at an odd offset; plain, YaRN and MRoPE configurations; half through the raw door.
fn cases() -> Vec<Case> {
    let forms = [
        Form::Paged { hnd: false, pages: 24, page: 8, n: 5 },
        Form::Paged { hnd: true, pages: 9, page: 16, n: 7 },
        Form::Contiguous { hnd: false, rows: 16, range: Some((3, 14)) },
        Form::Contiguous { hnd: true, rows: 12, range: None },
        Form::Window { rows: 16, sinks: 4, range: Some((2, 16)) },
    ];
    let dims = [(128, 128), (128, 96), (80, 32), (72, 36)];
    let mut v = Vec::new();
    for source in [CosSin::Table, CosSin::Computed] {
        for style in [RopeStyle::NeoX, RopeStyle::GptJ] {
            for (i, form) in forms.into_iter().enumerate() {
                let n = v.len();
                let (head_dim, rotary_dim) = dims[(i + n) % dims.len()];
                v.push(Case {
                    style,
                    head_dim,
                    rotary_dim,
                    kv_heads: [2, 3, 1][n % 3],
                    form,
                    source,
                    scaling: [
                        Scaling::Plain,
                        Scaling::Plain,
                        Scaling::Yarn,
                        Scaling::Plain,
                        Scaling::Plain,
                        Scaling::Mrope,
                    ][n % 6],
                    offset: usize::from(n % 3 == 1),
                    door: Door { wide: n % 4 >= 2, raw: n % 2 == 1, length_dependent: false },
                    per_head: (n / 2) % 2 == 0,
                });
            }
        }
    }
    v
}

/// One case in `T`: fresh random caches, the shift, every element of both caches checked.
fn shift_case<T: TestElem>(g: &Gpu, c: Case, seed: u64) {
    let deltas = deltas(seed);
    let t = c.form.target(seed, deltas.len(), c.kv_heads, c.head_dim, c.offset);
    let config = c.config(T::DTYPE);
    let rope = Rope::new(&g.kernels, config.clone()).unwrap();
    let conv = |v: Vec<f32>| v.into_iter().map(T::from_f32).collect::<Vec<T>>();
    let (k0, v0) = (conv(uniform_vec(seed, 1, t.len)), conv(uniform_vec(seed, 2, t.len)));
    let (mut kc, mut vc) = (upload_t(&k0), upload_t(&v0));
    run_shift(g, &rope, (&mut kc, &mut vc), &t, &deltas, c.door, None).unwrap();
    rope.check_errors(&g.stream).unwrap();
    let (k, v): (Vec<T>, Vec<T>) = (download_t(&kc), download_t(&vc));
    let what = format!("{} {c:?}", T::NAME);
    let turned = check_shift(&k, &k0, &t, &deltas, &config, &what);
    assert!(turned > 0, "{what}: nothing turned");
    assert!(same_bits(&v, &v0), "{what}: the value cache changed");
}

#[test]
fn shift_matrix_bf16() {
    each_case("shift_matrix_bf16", cases(), shift_case::<bf16>);
}

#[test]
fn shift_matrix_f16() {
    each_case("shift_matrix_f16", cases(), shift_case::<f16>);
}

#[test]
fn shift_matrix_f32() {
    each_case("shift_matrix_f32", cases(), shift_case::<f32>);
}

/// The FP8 model of a named row's head: the codes `codes` (its rotary dims) decoded with
/// `scale` (an f32 product), turned exactly, rounded to f32, divided by the scale (an f32
/// quotient) and encoded. Where the exact turn leaves the sign or the value to a convention:
/// a pair with an infinite or NaN element turns into two NaNs (code `0x7F`; E5M2's infinities
/// have no finite turn, and the kernels' exact products make NaN of them), and a pair of zeros
/// into two `+0` (the exact turn of zero is zero, of no sign).
fn fp8_turned(fmt: rope_cuda::Fp8, codes: &[u8], scale: f32, turn: &[(f64, f64)], style: RopeStyle) -> Vec<u8> {
    let x: Vec<f64> = codes.iter().map(|&c| (fmt.to_f32(c) * scale) as f64).collect();
    let mut y = rotate(&x, turn, style);
    for i in 0..turn.len() {
        let (a, b) = pair(style, turn.len(), i);
        if !(x[a].is_finite() && x[b].is_finite()) {
            (y[a], y[b]) = (f64::NAN, f64::NAN);
        } else if x[a] == 0.0 && x[b] == 0.0 {
            (y[a], y[b]) = (0.0, 0.0);
        }
    }
    y.into_iter().map(|y| fmt.from_f32(y as f32 / scale)).collect()
}

/// One case into an FP8 cache of `F`: every code of the named rows' rotary dims (each byte
/// value among them) the model's, every other byte of both caches as it was.
fn fp8_case<F: Code>(g: &Gpu, c: Case, seed: u64) {
    let deltas = deltas(seed);
    let t = c.form.target(seed, deltas.len(), c.kv_heads, c.head_dim, c.offset);
    let config = c.config(DType::BF16);
    let (rot, hk) = (c.rotary_dim, c.kv_heads);
    let rope = Rope::new(&g.kernels, config.clone()).unwrap();
    let mut k0 = noise(seed ^ 1, t.len);
    // Every code among the turned elements: the first 256 of them take each byte once (NaN
    // codes, E5M2's infinities, zeros and subnormals included).
    let mut seeded = 0u64;
    for &(b, blk, within) in &t.named {
        for h in (0..hk).filter(|_| deltas[b] != 0) {
            let at = row_at(&t.layout, blk, within, h);
            for i in 0..rot {
                if seeded < 256 {
                    k0[at + i] = (seeded * 73).wrapping_add(seed) as u8;
                }
                seeded += 1;
            }
        }
    }
    assert!(seeded >= 256, "{c:?}: only {seeded} codes turned");
    let v0 = noise(seed ^ 2, t.len);
    let n_scales = if c.per_head { hk } else { 1 };
    let ks: Vec<f32> = (0..n_scales).map(|h| SCALES[(seed as usize).wrapping_add(h) % SCALES.len()]).collect();
    let vs: Vec<f32> = (0..n_scales).map(|h| SCALES[(seed as usize).wrapping_add(h + 2) % SCALES.len()]).collect();
    let codes = |b: &[u8]| b.iter().map(|&b| F::of(b)).collect::<Vec<F>>();
    let (mut kc, mut vc) = (upload_t(&codes(&k0)), upload_t(&codes(&v0)));
    let (dks, dvs) = (upload_t(&ks), upload_t(&vs));
    let scales = Scales { k: &dks, v: &dvs, per_head: c.per_head };
    run_shift(g, &rope, (&mut kc, &mut vc), &t, &deltas, c.door, Some(scales)).unwrap();
    rope.check_errors(&g.stream).unwrap();
    let bytes = |v: Vec<F>| v.into_iter().map(Code::byte).collect::<Vec<u8>>();
    let (k, v) = (bytes(download_t(&kc)), bytes(download_t(&vc)));
    let what = format!("{:?} {c:?} k scales {ks:?}", F::FMT);
    let (freqs, _) = config.frequencies().unwrap();
    let mut turned = vec![false; t.len];
    for &(b, blk, within) in &t.named {
        if deltas[b] == 0 {
            continue;
        }
        let turn = turn(&freqs, deltas[b]);
        for h in 0..hk {
            let at = row_at(&t.layout, blk, within, h);
            let scale = ks[if c.per_head { h } else { 0 }];
            let want = fp8_turned(F::FMT, &k0[at..at + rot], scale, &turn, c.style);
            for i in 0..rot {
                assert_eq!(
                    k[at + i],
                    want[i],
                    "{what}: sequence {b} (Δ {}) block {blk} row {within} head {h} dim {i}: code {:#04x}, the model {:#04x} (was {:#04x})",
                    deltas[b],
                    k[at + i],
                    want[i],
                    k0[at + i]
                );
                turned[at + i] = true;
            }
        }
    }
    for i in 0..t.len {
        if !turned[i] {
            assert_eq!(k[i], k0[i], "{what}: key byte {i}, not turned, changed");
        }
    }
    assert_eq!(v, v0, "{what}: the value cache changed");
}

#[test]
fn shift_fp8_matrix_e4m3() {
    each_case("shift_fp8_matrix_e4m3", cases(), fp8_case::<F8E4M3>);
}

#[test]
fn shift_fp8_matrix_e5m2() {
    each_case("shift_fp8_matrix_e5m2", cases(), fp8_case::<F8E5M2>);
}

// Compositions.

/// `Δ` then `−Δ` (the same deltas buffer, negated in place, the next call): every key back
/// where it was, within 2 ulps of its pair's norm (each turn rounds once); rows of `Δ = 0` and
/// every other element bit for bit.
#[test]
fn shift_there_and_back() {
    fn case<T: TestElem>(g: &Gpu, form: Form, style: RopeStyle, seed: u64) {
        let deltas = deltas(seed);
        let (d, hk) = (128, 2);
        let t = form.target(seed, deltas.len(), hk, d, 0);
        let config = RopeConfig::new(d, MAX_POS).style(style).dtype(T::DTYPE).base(BASE);
        let rope = Rope::new(&g.kernels, config).unwrap();
        let k0: Vec<T> = uniform_vec(seed, 1, t.len).into_iter().map(T::from_f32).collect();
        let (mut kc, mut vc) = (upload_t(&k0), upload_t(&k0));
        let back: Vec<i64> = deltas.iter().map(|d| -d).collect();
        for (i, d) in [&deltas, &back].into_iter().enumerate() {
            let door = Door { wide: i == 0, raw: i == 1, length_dependent: false };
            run_shift(g, &rope, (&mut kc, &mut vc), &t, d, door, None).unwrap();
            rope.check_errors(&g.stream).unwrap();
        }
        let k: Vec<T> = download_t(&kc);
        let what = format!("{} {form:?} {style:?}", T::NAME);
        let mut moved = vec![false; t.len];
        for &(b, blk, within) in &t.named {
            for h in (0..hk).filter(|_| deltas[b] != 0) {
                let at = row_at(&t.layout, blk, within, h);
                let x: Vec<f64> = k0[at..at + d].iter().map(|v| v.to_f64()).collect();
                let label = || format!("{what}: sequence {b} (Δ {}) block {blk} row {within} head {h}", deltas[b]);
                check_pairs(&k[at..at + d], &x, style, 2.0, &label);
                moved[at..at + d].iter_mut().for_each(|m| *m = true);
            }
        }
        for i in (0..t.len).filter(|&i| !moved[i]) {
            assert_eq!(k[i].bits(), k0[i].bits(), "{what}: element {i} changed");
        }
        assert!(same_bits(&download_t(&vc), &k0), "{what}: the value cache changed");
    }
    let test = "shift_there_and_back";
    let Some(g) = gpu(test) else { return };
    let seed = test_seed(test);
    let paged = Form::Paged { hnd: false, pages: 24, page: 8, n: 5 };
    let window = Form::Window { rows: 12, sinks: 2, range: None };
    case::<bf16>(&g, paged, RopeStyle::NeoX, seed);
    case::<bf16>(&g, window, RopeStyle::GptJ, seed ^ 1);
    case::<f16>(&g, paged, RopeStyle::GptJ, seed ^ 2);
}

/// A `Rope` of each source of cos and sin, and ones whose `max_position` is far below the
/// deltas or at the limit, shift one cache to the same bits (the shift computes its angles
/// from the frequencies whatever the source), and those bits are the model's.
#[test]
fn every_source_shifts_alike() {
    let test = "every_source_shifts_alike";
    let Some(g) = gpu(test) else { return };
    let seed = test_seed(test);
    for (i, scaling) in [RopeScaling::Default, yarn()].into_iter().enumerate() {
        let s = seed.wrapping_add(i as u64);
        let base = RopeConfig::new(128, MAX_POS).rotary_dim(96).dtype(DType::BF16).base(BASE).scaling(scaling);
        let configs = [
            base.clone().cos_sin(CosSin::Table),
            base.clone().cos_sin(CosSin::Computed),
            base.clone().cos_sin(CosSin::Auto),
            base.clone().cos_sin(CosSin::Table).max_position(16),
            base.clone().cos_sin(CosSin::Computed).max_position(MAX_POSITION_LIMIT),
        ];
        let deltas = deltas(s);
        let t = Form::Paged { hnd: true, pages: 9, page: 16, n: 7 }.target(s, deltas.len(), 2, 128, 0);
        let k0 = random_bf16(s, 1, t.len);
        let mut first: Option<Vec<bf16>> = None;
        for (j, config) in configs.iter().enumerate() {
            let rope = Rope::new(&g.kernels, config.clone()).unwrap();
            let (mut kc, mut vc) = (upload_t(&k0), upload_t(&k0));
            let door = Door { wide: j % 2 == 0, raw: j % 2 == 1, length_dependent: false };
            run_shift(&g, &rope, (&mut kc, &mut vc), &t, &deltas, door, None).unwrap();
            rope.check_errors(&g.stream).unwrap();
            let k: Vec<bf16> = download_t(&kc);
            let what = format!("{:?} max_position {} {:?}", config.cos_sin, config.max_position, config.scaling);
            match &first {
                None => {
                    check_shift(&k, &k0, &t, &deltas, config, &what);
                    first = Some(k);
                }
                Some(f) => assert!(same_bits(&k, f), "{what}: not the bits of {:?}", configs[0].cos_sin),
            }
        }
    }
}

/// Appends `[batch, seq]` tokens (keys `k` and values `v` of `[batch, seq, heads, d]`) at
/// `positions` into a cache (paged with `slots`, else contiguous).
fn append(
    g: &Gpu,
    rope: &Rope,
    (kc, vc): (&mut DeviceBuffer<bf16>, &mut DeviceBuffer<bf16>),
    layout: Layout,
    (k, v): (&[bf16], &[bf16]),
    (positions, batch): (&[i32], usize),
    slots: Option<&[i64]>,
) {
    let [_, _, heads, d] = layout.shape;
    let (dk, dv, dpos) = (upload_t(k), upload_t(v), upload_t(positions));
    let dslots = slots.map(upload_t);
    let l = Layout::bshd(batch, positions.len() / batch, heads, d);
    let (kt, vt) = (Tensor::new(&dk, l), Tensor::new(&dv, l));
    let mut cache = match slots {
        Some(_) => KvCache::paged(kc, vc, layout),
        None => KvCache::contiguous(kc, vc, layout),
    };
    let mut a = KvAppend::new(&kt, &vt, &mut cache, Positions::ids_i32(&dpos));
    if let Some(s) = &dslots {
        a = a.slots(s);
    }
    rope.append_kv(a, &g.stream).unwrap();
    rope.check_errors(&g.stream).unwrap();
}

/// An engine's context shift: 300 tokens a sequence appended at positions 0..300 (the fused
/// append), the first K dropped and the rest shifted by −K (paged: the kept tokens' slots,
/// each sequence its own K, the shorter slot list padded; contiguous: rows K..300); against a
/// cache filled directly at positions 0..300−K from the same keys, and the exact rotation:
/// each shifted element within 2 ulps of its pair's norm of the exact value and within 3 of
/// the direct cache's (two roundings against one), the direct cache within one ulp of it;
/// the rows of the dropped tokens, the other slots and the value cache bit for bit. Both
/// sources of cos and sin.
#[test]
fn context_shift_matches_a_cache_filled_at_the_new_positions() {
    let test = "context_shift_matches_a_cache_filled_at_the_new_positions";
    let Some(g) = gpu(test) else { return };
    let seed = test_seed(test);
    let (batch, tokens, hk, d, page) = (2, 300, 4, 128, 16);
    let mut worst = 0f64;
    for (i, (source, paged)) in
        [(CosSin::Table, true), (CosSin::Computed, true), (CosSin::Table, false), (CosSin::Computed, false)]
            .into_iter()
            .enumerate()
    {
        let s = seed.wrapping_add(i as u64);
        let drop: [usize; 2] = if paged { [37, 100] } else { [37, 37] };
        let config = RopeConfig::new(d, MAX_POS).dtype(DType::BF16).base(BASE).cos_sin(source);
        let (freqs, _) = config.frequencies().unwrap();
        let rope = Rope::new(&g.kernels, config).unwrap();
        let row = hk * d;
        let (keys, values) = (random_bf16(s, 1, batch * tokens * row), random_bf16(s, 2, batch * tokens * row));
        // Where token p of sequence b lives: a seeded slot of 48 pages (paged), else row p of
        // block b; the direct cache holds it at the same slot, or at row p − K.
        let pages = 48;
        let layout = if paged { Layout::bshd(pages, page, hk, d) } else { Layout::bshd(batch, 320, hk, d) };
        let slot_of = distinct_slots(s, pages * page, batch * tokens, &[]);
        let shifted_at = |b: usize, p: usize| match paged {
            true => (slot_of[b * tokens + p] as usize / page, slot_of[b * tokens + p] as usize % page),
            false => (b, p),
        };
        let direct_at = |b: usize, p: usize| if paged { shifted_at(b, p) } else { (b, p - drop[b]) };
        let n = layout.extent().unwrap();
        let (mut kc, mut vc) = (upload_t(&random_bf16(s, 3, n)), upload_t(&random_bf16(s, 4, n)));
        let (mut kd, mut vd) = (upload_t(&random_bf16(s, 5, n)), upload_t(&random_bf16(s, 6, n)));
        // Every token at its position.
        let positions: Vec<i32> = (0..batch * tokens).map(|t| (t % tokens) as i32).collect();
        let slots = paged.then_some(&slot_of[..]);
        append(&g, &rope, (&mut kc, &mut vc), layout, (&keys, &values), (&positions, batch), slots);
        let (k1, v1): (Vec<bf16>, Vec<bf16>) = (download_t(&kc), download_t(&vc));
        // The kept tokens, `[batch, kept]`: token j of sequence b is its token drop[b] + j
        // (padding past its end).
        let kept = tokens - drop.iter().min().unwrap();
        let token = |b: usize, j: usize| (drop[b] + j < tokens).then_some(drop[b] + j);
        let mut direct_k = vec![bf16::ZERO; batch * kept * row];
        let mut direct_v = direct_k.clone();
        let (mut direct_pos, mut direct_slots, mut kept_slots) = (vec![0i32; batch * kept], vec![], vec![]);
        for b in 0..batch {
            for j in 0..kept {
                let at = (b * kept + j) * row;
                let Some(p) = token(b, j) else {
                    direct_slots.push(-1);
                    kept_slots.push(-1);
                    continue;
                };
                direct_k[at..at + row].copy_from_slice(&keys[(b * tokens + p) * row..][..row]);
                direct_v[at..at + row].copy_from_slice(&values[(b * tokens + p) * row..][..row]);
                direct_pos[b * kept + j] = j as i32;
                direct_slots.push(slot_of[b * tokens + p]);
                kept_slots.push(slot_of[b * tokens + p]);
            }
        }
        let slots = paged.then_some(&direct_slots[..]);
        append(&g, &rope, (&mut kd, &mut vd), layout, (&direct_k, &direct_v), (&direct_pos, batch), slots);
        // The shift.
        let deltas: Vec<i64> = drop.iter().map(|&k| -(k as i64)).collect();
        let form = match paged {
            true => Form::Paged { hnd: false, pages, page, n: kept },
            false => Form::Contiguous { hnd: false, rows: 320, range: Some((drop[0], tokens)) },
        };
        let t = Target {
            form,
            layout,
            len: n,
            slots: paged.then(|| kept_slots.clone()),
            named: vec![], // checked below
        };
        let door = Door { wide: i % 2 == 1, raw: i >= 2, length_dependent: false };
        run_shift(&g, &rope, (&mut kc, &mut vc), &t, &deltas, door, None).unwrap();
        rope.check_errors(&g.stream).unwrap();
        let (k, v, direct): (Vec<bf16>, Vec<bf16>, Vec<bf16>) = (download_t(&kc), download_t(&vc), download_t(&kd));
        let what = format!("{source:?} paged {paged}");
        let mut moved = vec![false; n];
        for b in 0..batch {
            for p in drop[b]..tokens {
                let turn = turn(&freqs, (p - drop[b]) as i64);
                let ((sb, sr), (db, dr)) = (shifted_at(b, p), direct_at(b, p));
                for h in 0..hk {
                    let x: Vec<f64> = keys[(b * tokens + p) * row + h * d..][..d].iter().map(|v| v.to_f64()).collect();
                    let exact = rotate(&x, &turn, RopeStyle::NeoX);
                    let (at, dat) = (row_at(&layout, sb, sr, h), row_at(&layout, db, dr, h));
                    let label = || format!("{what}: sequence {b} token {p} (now at {}) head {h}", p - drop[b]);
                    for e in 0..d {
                        let want = bf16::round(exact[e]);
                        assert!(direct[dat + e].ulps(want) <= 1, "{}: dim {e}: the direct cache", label());
                    }
                    worst = worst.max(check_pairs(&k[at..at + d], &exact, RopeStyle::NeoX, 2.0, &label));
                    let direct_row: Vec<f64> = direct[dat..dat + d].iter().map(|v| v.to_f64()).collect();
                    let against = || format!("{} against the direct cache", label());
                    check_pairs(&k[at..at + d], &direct_row, RopeStyle::NeoX, 3.0, &against);
                    moved[at..at + d].iter_mut().for_each(|m| *m = true);
                }
            }
        }
        for i in (0..n).filter(|&i| !moved[i]) {
            assert_eq!(k[i].bits(), k1[i].bits(), "{what}: key element {i}, not shifted, changed");
        }
        assert!(same_bits(&v, &v1), "{what}: the value cache changed");
    }
    eprintln!("{test}: the largest error, in ulps of the pair's norm: {worst:.3}");
}

// Graphs.

/// A shift recorded once and replayed with new deltas written into its buffer in between:
/// after the first replay every key within one ulp of its turn by Δ1, after the second within
/// 2 ulps of its pair's norm of its turn by Δ1 + Δ2 (some sequences back to Δ = 0 in all);
/// nothing runs while recording. Then a 32,768-row shift records (no claim, no allocation),
/// and replays to the model.
#[test]
fn shift_replays_in_a_graph() {
    let test = "shift_replays_in_a_graph";
    let Some(g) = gpu(test) else { return };
    let seed = test_seed(test);
    let (hk, d) = (2, 128);
    let config = RopeConfig::new(d, MAX_POS).style(RopeStyle::GptJ).dtype(DType::BF16).base(BASE);
    let rope = Rope::new(&g.kernels, config.clone()).unwrap();
    let (freqs, _) = config.frequencies().unwrap();
    let first = deltas(seed);
    let batch = first.len();
    let max = SHIFT_MAX_DELTA as u64;
    let second: Vec<i64> = (0..batch)
        .map(|b| match b % 3 {
            0 => -first[b],
            1 => 0,
            _ => (splitmix64(seed ^ b as u64) % (2 * max + 1)) as i64 - max as i64,
        })
        .collect();
    let t = Form::Paged { hnd: false, pages: 12, page: 16, n: 9 }.target(seed, batch, hk, d, 0);
    let k0 = random_bf16(seed, 1, t.len);
    let (mut kc, mut vc) = (upload_t(&k0), upload_t(&k0));
    let (mut dd, ds) = (upload_t(&vec![0i64; batch]), upload_t(t.slots.as_ref().unwrap()));
    let graph = Graph::record(|| {
        let mut cache = KvCache::paged(&mut kc, &mut vc, t.layout);
        rope.shift_kv(KvShift::new(&mut cache, Positions::ids_i64(&dd)).slots(&ds), &g.stream)
    })
    .unwrap();
    g.stream.synchronize().unwrap();
    assert!(same_bits(&download_t(&kc), &k0), "the cache changed while recording");
    let replay = |dd: &mut DeviceBuffer<i64>, deltas: &[i64]| {
        dd.copy_from(deltas).unwrap();
        // SAFETY: every buffer the graph names (the caches, deltas, slots and the Rope's)
        // lives until the synchronisation below.
        unsafe { graph.launch(&g.stream) }.unwrap();
        g.stream.synchronize().unwrap();
        rope.check_errors(&g.stream).unwrap();
    };
    replay(&mut dd, &first);
    let k1: Vec<bf16> = download_t(&kc);
    check_shift(&k1, &k0, &t, &first, &config, "the first replay");
    replay(&mut dd, &second);
    let k2: Vec<bf16> = download_t(&kc);
    let mut moved = vec![false; t.len];
    for &(b, blk, within) in &t.named {
        let (d1, d2) = (first[b], second[b]);
        let turn = turn(&freqs, d1 + d2);
        for h in (0..hk).filter(|_| d1 != 0 || d2 != 0) {
            let at = row_at(&t.layout, blk, within, h);
            let x: Vec<f64> = k0[at..at + d].iter().map(|v| v.to_f64()).collect();
            let want = rotate(&x, &turn, RopeStyle::GptJ);
            let label = || format!("two replays: sequence {b} (Δ {d1} then {d2}) block {blk} row {within} head {h}");
            check_pairs(&k2[at..at + d], &want, RopeStyle::GptJ, 2.0, &label);
            moved[at..at + d].iter_mut().for_each(|m| *m = true);
        }
    }
    for i in (0..t.len).filter(|&i| !moved[i]) {
        assert_eq!(k2[i].bits(), k0[i].bits(), "two replays: element {i}, not named, changed");
    }
    assert!(same_bits(&download_t(&vc), &k0), "the value cache changed");

    // 32,768 rows: 4 sequences of 8,192 slots of 2,100 pages.
    let (hk, d, page, pages, n) = (2, 64, 16, 2100, 8192);
    let config = RopeConfig::new(d, MAX_POS).dtype(DType::BF16).base(BASE);
    let rope = Rope::new(&g.kernels, config.clone()).unwrap();
    let deltas = [5i64, -SHIFT_MAX_DELTA, 1 << 24, -3];
    let t = Form::Paged { hnd: false, pages, page, n }.target(seed, deltas.len(), hk, d, 0);
    let k0 = random_bf16(seed, 2, t.len);
    let (mut kc, mut vc) = (upload_t(&k0), upload_t(&k0));
    let (dd, ds) = (upload_t(&deltas), upload_t(t.slots.as_ref().unwrap()));
    assert_eq!(ds.len(), 32_768);
    let graph = Graph::record(|| {
        let mut cache = KvCache::paged(&mut kc, &mut vc, t.layout);
        rope.shift_kv(KvShift::new(&mut cache, Positions::ids_i64(&dd)).slots(&ds), &g.stream)
    })
    .unwrap();
    // SAFETY: as above.
    unsafe { graph.launch(&g.stream) }.unwrap();
    g.stream.synchronize().unwrap();
    rope.check_errors(&g.stream).unwrap();
    let turned = check_shift(&download_t(&kc), &k0, &t, &deltas, &config, "32,768 rows");
    assert_eq!(turned, (32_768 - 2) * hk * d);
}

// MLA.

#[derive(Debug, Clone, Copy)]
struct MlaCase {
    rank: usize,
    rope: usize,
    /// Elements after each latent row.
    pad: usize,
    paged: bool,
    /// Keys in NeoX order (`MlaAppend::deinterleaved`'s cache), else GPT-J.
    deint: bool,
    source: CosSin,
    door: Door,
}

impl MlaCase {
    fn config(&self, dtype: DType) -> RopeConfig {
        RopeConfig::new(self.rope, MAX_POS).style(RopeStyle::GptJ).dtype(dtype).base(BASE).cos_sin(self.source)
    }

    /// The latent rows of `batch` sequences, and the rows the shift names.
    fn target(&self, seed: u64, batch: usize) -> Target {
        let form = match self.paged {
            true => Form::Paged { hnd: false, pages: 16, page: 8, n: 4 },
            false => Form::Contiguous { hnd: false, rows: 10, range: Some((2, 9)) },
        };
        let (blocks, rows) = if self.paged { (16, 8) } else { (batch, 10) };
        let w = self.rank + self.rope;
        let row = w + self.pad;
        let layout = Layout::strided([blocks, rows, 1, w], [rows * row, row, row], 0);
        let (slots, named) = form.rows(seed, batch);
        Target { form, layout, len: layout.extent().unwrap() + self.pad, slots, named }
    }

    /// The style of the stored keys' pairs.
    fn style(&self) -> RopeStyle {
        if self.deint {
            RopeStyle::NeoX
        } else {
            RopeStyle::GptJ
        }
    }
}

/// Shifts the latent cache `dc` (with `scale`, FP8) as `c` says.
fn run_mla<E: CustElement>(
    g: &Gpu,
    rope: &Rope,
    dc: &mut DeviceBuffer<E>,
    (c, t): (&MlaCase, &Target),
    deltas: &[i64],
    scale: Option<&DeviceBuffer<f32>>,
) {
    let d32 = upload_t(&deltas.iter().map(|&d| d as i32).collect::<Vec<_>>());
    let d64 = upload_t(deltas);
    let dslots = t.slots.as_ref().map(|s| upload_t(s));
    let geometry = MlaGeometry::new(c.rank, c.rope, 128, 128, 16);
    let mut cache = match c.paged {
        true => MlaCache::paged(dc, t.layout, &geometry),
        false => MlaCache::contiguous(dc, t.layout, &geometry),
    };
    if let Some(s) = scale {
        cache = cache.scale(Fp8Scale::new(s));
    }
    if c.door.raw {
        let (kind, ptr) = match c.door.wide {
            true => (PositionKind::IdsI64, d64.as_device_ptr().as_raw()),
            false => (PositionKind::IdsI32, d32.as_device_ptr().as_raw()),
        };
        let mut args = RawShiftArgs::new(ShiftCache::Mla(cache.raw()), RawPositions::new(kind, ptr, deltas.len()))
            .with_deinterleaved(c.deint);
        if let Some(s) = &dslots {
            args = args.with_slots((s.as_device_ptr().as_raw(), s.len()));
        }
        if let Some(r) = t.form.range() {
            args = args.with_rows(r);
        }
        assert_eq!(validate_shift(rope.config(), &args), Ok(()));
        // SAFETY: every address is a live buffer of this context, alive until the sync.
        unsafe { rope.shift_kv_raw(&args, g.stream.as_inner()) }.unwrap();
    } else {
        let positions = if c.door.wide { Positions::ids_i64(&d64) } else { Positions::ids_i32(&d32) };
        let mut shift = KvShift::mla(&mut cache, positions);
        if let Some(s) = &dslots {
            shift = shift.slots(s);
        }
        if let Some(r) = t.form.range() {
            shift = shift.rows(r);
        }
        if c.deint {
            shift = shift.deinterleaved();
        }
        rope.shift_kv(shift, &g.stream).unwrap();
    }
    rope.check_errors(&g.stream).unwrap();
}

fn mla_cases() -> Vec<MlaCase> {
    let b = MlaCase {
        rank: 512,
        rope: 64,
        pad: 0,
        paged: true,
        deint: false,
        source: CosSin::Table,
        door: Door::default(),
    };
    let raw = Door { raw: true, ..Door::default() };
    let wide = Door { wide: true, ..Door::default() };
    vec![
        b,
        MlaCase { deint: true, door: raw, ..b },
        MlaCase { paged: false, pad: 8, source: CosSin::Computed, door: wide, ..b },
        MlaCase { paged: false, deint: true, source: CosSin::Computed, door: Door { wide: true, ..raw }, ..b },
        // Rows that take no 16-byte accesses (odd widths): element by element.
        MlaCase { rank: 36, rope: 16, pad: 1, door: raw, ..b },
        MlaCase { rank: 256, rope: 32, pad: 1, deint: true, paged: false, ..b },
    ]
}

/// MLA latent caches (paged and contiguous, GPT-J and de-interleaved, vector and
/// element-by-element rows), in bf16, f16 and both FP8 formats with the cache's one scale:
/// each named row's k_pe turned (FP8: every code the model's), its kv_c, the padding, the rows
/// not named and those of `Δ = 0` bit for bit.
#[test]
fn mla_shift_turns_only_k_pe() {
    fn own<T: TestElem>(g: &Gpu, c: MlaCase, seed: u64) {
        let deltas = deltas(seed);
        let t = c.target(seed, deltas.len());
        let config = c.config(T::DTYPE);
        let rope = Rope::new(&g.kernels, config.clone()).unwrap();
        let c0: Vec<T> = uniform_vec(seed, 1, t.len).into_iter().map(T::from_f32).collect();
        let mut dc = upload_t(&c0);
        run_mla(g, &rope, &mut dc, (&c, &t), &deltas, None);
        let got: Vec<T> = download_t(&dc);
        // k_pe is a cache of one head of `rope` elements, `rank` into each row.
        let k_pe = Target {
            form: t.form,
            layout: Layout::strided([t.layout.shape[0], t.layout.shape[1], 1, c.rope], t.layout.strides, c.rank),
            len: t.len,
            slots: None,
            named: t.named.clone(),
        };
        let config = config.style(c.style());
        let turned = check_shift(&got, &c0, &k_pe, &deltas, &config, &format!("{} {c:?}", T::NAME));
        assert!(turned > 0);
    }
    fn fp8<F: Code>(g: &Gpu, c: MlaCase, seed: u64, scale: f32) {
        let deltas = deltas(seed);
        let t = c.target(seed, deltas.len());
        let config = c.config(DType::BF16);
        let rope = Rope::new(&g.kernels, config.clone()).unwrap();
        let c0 = noise(seed, t.len);
        let mut dc = upload_t(&c0.iter().map(|&b| F::of(b)).collect::<Vec<F>>());
        let ds = upload_t(&[scale]);
        run_mla(g, &rope, &mut dc, (&c, &t), &deltas, Some(&ds));
        let got: Vec<u8> = download_t(&dc).into_iter().map(|c: F| c.byte()).collect();
        let (freqs, _) = config.frequencies().unwrap();
        let mut want = c0.clone();
        for &(b, blk, within) in t.named.iter().filter(|r| deltas[r.0] != 0) {
            let at = row_at(&t.layout, blk, within, 0) + c.rank;
            let turned = fp8_turned(F::FMT, &c0[at..at + c.rope], scale, &turn(&freqs, deltas[b]), c.style());
            want[at..at + c.rope].copy_from_slice(&turned);
        }
        for i in 0..t.len {
            assert_eq!(got[i], want[i], "{:?} scale {scale} {c:?}: byte {i}: was {:#04x}", F::FMT, c0[i]);
        }
    }
    let test = "mla_shift_turns_only_k_pe";
    let Some(g) = gpu(test) else { return };
    let seed = test_seed(test);
    for (i, c) in mla_cases().into_iter().enumerate() {
        let s = seed.wrapping_add(i as u64);
        own::<bf16>(&g, c, s);
        own::<f16>(&g, c, s ^ 1);
        fp8::<F8E4M3>(&g, c, s ^ 2, SCALES[i % SCALES.len()]);
        fp8::<F8E5M2>(&g, c, s ^ 3, SCALES[(i + 2) % SCALES.len()]);
    }
}

// Errors.

/// A delta outside ±(2^31 − 1) (i32::MIN through i32 deltas; 2^31, −2^40 and i64::MIN
/// through i64 ones) leaves its sequence's rows as they were and is reported once, by
/// sequence; a slot outside the cache skips its row and is reported; every other row is
/// shifted.
#[test]
fn out_of_range_deltas_and_slots_are_skipped_and_reported() {
    let test = "out_of_range_deltas_and_slots_are_skipped_and_reported";
    let Some(g) = gpu(test) else { return };
    let seed = test_seed(test);
    let config = RopeConfig::new(64, MAX_POS).dtype(DType::BF16).base(BASE);
    let rope = Rope::new(&g.kernels, config.clone()).unwrap();
    let paged = Form::Paged { hnd: false, pages: 6, page: 8, n: 5 };
    let min32 = i32::MIN as i64;
    for (i, (form, deltas, wide, first, position, count)) in [
        (Form::Contiguous { hnd: false, rows: 8, range: None }, vec![5, min32, -3, min32, 0], false, 1, min32, 2),
        (paged, vec![1 << 31, 7, -(1 << 40), -SHIFT_MAX_DELTA, i64::MIN], true, 0, i32::MAX as i64, 3),
    ]
    .into_iter()
    .enumerate()
    {
        for raw in [false, true] {
            let s = seed.wrapping_add(2 * i as u64 + u64::from(raw));
            let t = form.target(s, deltas.len(), 2, 64, 0);
            let k0 = random_bf16(s, 1, t.len);
            let (mut kc, mut vc) = (upload_t(&k0), upload_t(&k0));
            let door = Door { wide, raw, length_dependent: false };
            run_shift(&g, &rope, (&mut kc, &mut vc), &t, &deltas, door, None).unwrap();
            let e = rope.check_errors(&g.stream);
            assert!(
                matches!(e, Err(Error::PositionOutOfRange { token, position: p, count: n, .. })
                    if token == first && p == position && n == count),
                "deltas {deltas:?}: {e:?}"
            );
            rope.check_errors(&g.stream).unwrap(); // reported once
                                                   // The model: those sequences untouched.
            let kept: Vec<i64> =
                deltas.iter().map(|&d| if d.unsigned_abs() > SHIFT_MAX_DELTA as u64 { 0 } else { d }).collect();
            let turned = check_shift(&download_t(&kc), &k0, &t, &kept, &config, &format!("deltas {deltas:?}"));
            assert!(turned > 0);
            assert!(same_bits(&download_t(&vc), &k0), "the value cache changed");
        }
    }
    // Slots: row 3 at the cache's end, row 8 far past it.
    let deltas = [9i64, -9, 100, 1, -4];
    let mut t = paged.target(seed, deltas.len(), 2, 64, 0);
    let num_slots = 6 * 8;
    let slots = t.slots.as_mut().unwrap();
    (slots[3], slots[8]) = (num_slots, 1 << 40);
    t.named = named_slots(slots, 5, 8, num_slots as usize);
    assert_eq!(t.named.len(), 25 - 4);
    for raw in [false, true] {
        let k0 = random_bf16(seed, 2 + u64::from(raw), t.len);
        let (mut kc, mut vc) = (upload_t(&k0), upload_t(&k0));
        run_shift(&g, &rope, (&mut kc, &mut vc), &t, &deltas, Door { raw, ..Door::default() }, None).unwrap();
        let e = rope.check_errors(&g.stream);
        let want = Error::SlotOutOfRange { token: 3, slot: num_slots, num_slots: num_slots as u64, count: 2 };
        assert_eq!(e, Err(want));
        rope.check_errors(&g.stream).unwrap();
        check_shift(&download_t(&kc), &k0, &t, &deltas, &config, "slots outside the cache");
    }
}

/// `dynamic` and `longrope` configurations: refused without `length_dependent` (the cache
/// bit for bit), shifted with it at the configuration's frequencies (at its `seq_len`), the
/// attention factor (LongRoPE's above 1) not applied.
#[test]
fn length_dependent_scalings_shift_when_asked() {
    let test = "length_dependent_scalings_shift_when_asked";
    let Some(g) = gpu(test) else { return };
    let seed = test_seed(test);
    let dynamic = RopeScaling::Dynamic { factor: 4.0, max_position_embeddings: 1024 };
    for (i, (name, scaling, seq_len)) in
        [("dynamic", dynamic, 3000), ("longrope", longrope(64), 2000)].into_iter().enumerate()
    {
        let s = seed.wrapping_add(i as u64);
        let config =
            RopeConfig::new(128, MAX_POS).dtype(DType::BF16).base(BASE).scaling(scaling).seq_len(Some(seq_len));
        let plain = RopeConfig::new(128, MAX_POS).base(BASE).frequencies().unwrap().0;
        let (freqs, attention) = config.frequencies().unwrap();
        assert_ne!(freqs, plain, "{name}: the frequencies at seq_len {seq_len} are the plain ones");
        assert!(name == "dynamic" || attention > 1.0, "{name}: attention factor {attention}");
        let rope = Rope::new(&g.kernels, config.clone()).unwrap();
        let deltas = deltas(s);
        let t = Form::Contiguous { hnd: true, rows: 8, range: Some((1, 7)) }.target(s, deltas.len(), 2, 128, 0);
        let k0 = random_bf16(s, 1, t.len);
        let (mut kc, mut vc) = (upload_t(&k0), upload_t(&k0));
        for raw in [false, true] {
            let door = Door { raw, wide: raw, length_dependent: false };
            let e = run_shift(&g, &rope, (&mut kc, &mut vc), &t, &deltas, door, None);
            assert_eq!(e, Err(Error::ShiftScaling { rope_type: name }));
        }
        assert!(same_bits(&download_t(&kc), &k0), "{name}: a refused shift wrote");
        let door = Door { raw: i == 1, wide: false, length_dependent: true };
        run_shift(&g, &rope, (&mut kc, &mut vc), &t, &deltas, door, None).unwrap();
        rope.check_errors(&g.stream).unwrap();
        check_shift(&download_t(&kc), &k0, &t, &deltas, &config, name);
        assert!(same_bits(&download_t(&vc), &k0), "{name}: the value cache changed");
    }
}

/// Each misuse is refused before any launch, and nothing is written: a paged cache without
/// slots, a contiguous one with slots, rows past the block, deltas not one a sequence, deltas
/// of another kind, a cache of another type or head_dim, an FP8 cache without scales (or a
/// 16-bit one with them), slots not `[batch, n]`, an MLA FP8 cache without its scale.
#[test]
fn shift_misuse_is_refused_and_nothing_is_written() {
    let test = "shift_misuse_is_refused_and_nothing_is_written";
    let Some(g) = gpu(test) else { return };
    let seed = test_seed(test);
    let rope = Rope::new(&g.kernels, RopeConfig::new(64, MAX_POS).dtype(DType::BF16)).unwrap();
    let layout = Layout::bshd(3, 8, 2, 64);
    let n = layout.extent().unwrap();
    let (k0, v0) = (random_bf16(seed, 1, n), random_bf16(seed, 2, n));
    let (mut kc, mut vc) = (upload_t(&k0), upload_t(&v0));
    let h0: Vec<f16> = uniform_vec(seed, 3, n).into_iter().map(f16::from_f32).collect();
    let (mut hc, mut hv) = (upload_t(&h0), upload_t(&h0));
    let b0 = noise(seed, n);
    let (mut fc, mut fv) =
        (upload_t(&b0.iter().map(|&b| F8E4M3(b)).collect::<Vec<_>>()), upload_t(&vec![F8E4M3(1); n]));
    let (d3, d2, d64) = (upload_t(&[3i32, -2, 7]), upload_t(&[3i32, -2]), upload_t(&[3i64, -2, 7]));
    let (slots, odd) = (upload_t(&[0i64, 5, 9, 17, 23, 2]), upload_t(&[0i64, 5, 9, 17]));
    let (one, wide) = (upload_t(&[1.0f32]), Layout::bshd(3, 4, 2, 128));
    let expect = |what: &str, e: rope_cuda::Result<()>, ok: &dyn Fn(&Error) -> bool| match e {
        Err(ref err) if ok(err) => {}
        other => panic!("{what}: {other:?}"),
    };
    {
        let mut c = KvCache::paged(&mut kc, &mut vc, layout);
        let e = rope.shift_kv(KvShift::new(&mut c, Positions::ids_i32(&d3)), &g.stream);
        expect("paged without slots", e, &|e| matches!(e, Error::SlotMapping(_)));
        let e = rope.shift_kv(KvShift::new(&mut c, Positions::ids_i32(&d3)).slots(&odd), &g.stream);
        expect("4 slots for 3 sequences", e, &|e| matches!(e, Error::Length { what: "slots", .. }));
        let e = rope.shift_kv(KvShift::new(&mut c, Positions::ids_i32(&d3)).slots(&slots).rows(0..2), &g.stream);
        expect("paged with rows", e, &|e| matches!(e, Error::SlotMapping(_)));
    }
    {
        let mut c = KvCache::contiguous(&mut kc, &mut vc, layout);
        let e = rope.shift_kv(KvShift::new(&mut c, Positions::ids_i32(&d3)).slots(&slots), &g.stream);
        expect("contiguous with slots", e, &|e| matches!(e, Error::SlotMapping(_)));
        let e = rope.shift_kv(KvShift::new(&mut c, Positions::ids_i64(&d64)).rows(2..9), &g.stream);
        let past = |e: &Error| matches!(e, Error::TooLarge { what: "rows (end)", value: 9, limit: 8 });
        expect("rows past the block", e, &past);
        let e = rope.shift_kv(KvShift::new(&mut c, Positions::ids_i32(&d2)), &g.stream);
        let one_each = |e: &Error| matches!(e, Error::Shape { what: "deltas", expected: 3, got: 2, .. });
        expect("two deltas for three sequences", e, &one_each);
        for (what, positions) in [("offsets", Positions::offsets_i32(&d3)), ("sequential", Positions::sequential())] {
            let e = rope.shift_kv(KvShift::new(&mut c, positions), &g.stream);
            expect(what, e, &|e| matches!(e, Error::PositionKind { .. }));
        }
        // Rows end before they start: through the raw door's field.
        let args = changed(KvShift::new(&mut c, Positions::ids_i32(&d3)).raw(), |a| a.rows = Some((5, 3)));
        // SAFETY: every address is a live buffer of this context; the call is refused.
        let e = unsafe { rope.shift_kv_raw(&args, g.stream.as_inner()) };
        expect("rows 5..3", e, &|e| matches!(e, Error::TooLarge { what: "rows (start)", .. }));
        // Deltas inside the key cache.
        let inside = RawPositions::new(PositionKind::IdsI32, c.raw().k.ptr + 64, 3);
        let args = changed(args, |a| (a.rows, a.deltas) = (None, inside));
        // SAFETY: as above.
        let e = unsafe { rope.shift_kv_raw(&args, g.stream.as_inner()) };
        expect("deltas inside the cache", e, &|e| matches!(e, Error::Aliasing { .. }));
    }
    {
        let mut c = KvCache::contiguous(&mut kc, &mut vc, wide);
        let e = rope.shift_kv(KvShift::new(&mut c, Positions::ids_i32(&d3)), &g.stream);
        expect("head_dim 128", e, &|e| matches!(e, Error::Shape { axis: "head_dim", .. }));
    }
    {
        let mut c = KvCache::contiguous(&mut hc, &mut hv, layout);
        let e = rope.shift_kv(KvShift::new(&mut c, Positions::ids_i32(&d3)), &g.stream);
        let f16 = |e: &Error| matches!(e, Error::DType { what: "k cache", expected: DType::BF16, got: DType::F16 });
        expect("an f16 cache", e, &f16);
    }
    {
        let mut c = KvCache::contiguous(&mut fc, &mut fv, layout);
        let e = rope.shift_kv(KvShift::new(&mut c, Positions::ids_i32(&d3)), &g.stream);
        expect("FP8 without scales", e, &|e| matches!(e, Error::Scales(_)));
        let mut c = KvCache::contiguous(&mut kc, &mut vc, layout).scales(KvScales::per_tensor(&one, &one));
        let e = rope.shift_kv(KvShift::new(&mut c, Positions::ids_i32(&d3)), &g.stream);
        expect("bf16 with scales", e, &|e| matches!(e, Error::Scales(_)));
    }
    {
        // An MLA latent cache of FP8 rows (32 + 64) without its scale.
        let geometry = MlaGeometry::new(32, 64, 128, 128, 16);
        let mut c = MlaCache::paged(&mut fc, Layout::bshd(3, 8, 2, 48), &geometry);
        let e = rope.shift_kv(KvShift::mla(&mut c, Positions::ids_i32(&d3)).slots(&slots), &g.stream);
        expect("MLA rows of two heads", e, &|e| matches!(e, Error::Shape { what: "latent cache", .. }));
        let mut c = MlaCache::paged(&mut fc, Layout::bshd(3, 8, 1, 96), &geometry);
        let e = rope.shift_kv(KvShift::mla(&mut c, Positions::ids_i32(&d3)).slots(&slots), &g.stream);
        expect("MLA FP8 without its scale", e, &|e| matches!(e, Error::Scales(m) if m.contains("MlaCache::scale")));
    }
    g.stream.synchronize().unwrap();
    assert!(same_bits(&download_t(&kc), &k0) && same_bits(&download_t(&vc), &v0), "a refused shift wrote");
    assert!(same_bits(&download_t(&hc), &h0), "a refused shift wrote the f16 cache");
    let codes: Vec<F8E4M3> = download_t(&fc);
    assert!(codes.iter().zip(&b0).all(|(c, &b)| c.0 == b), "a refused shift wrote the FP8 cache");
    // The same calls, mended, are accepted and write.
    let mut c = KvCache::paged(&mut kc, &mut vc, layout);
    rope.shift_kv(KvShift::new(&mut c, Positions::ids_i32(&d3)).slots(&slots), &g.stream).unwrap();
    rope.check_errors(&g.stream).unwrap();
    assert!(!same_bits(&download_t(&kc), &k0), "the mended shift wrote nothing");
}

// Without a GPU.

/// The model's turn is the library's f64 reference (`rope_row_freqs` at `|Δ|`, inverse for a
/// negative `Δ`, attention factor 1) bit for bit, and the configurations the tests shift have
/// an attention factor that would show if it were applied.
#[test]
fn shift_model_is_the_reference() {
    let seed = 0x5117;
    for config in [
        RopeConfig::new(128, MAX_POS).base(BASE),
        RopeConfig::new(128, MAX_POS).rotary_dim(96).style(RopeStyle::GptJ).scaling(yarn()),
        RopeConfig::new(128, MAX_POS).scaling(longrope(64)).seq_len(Some(2000)),
    ] {
        let (freqs, attention) = config.frequencies().unwrap();
        assert!(config.scaling == RopeScaling::Default || attention > 1.05, "{:?}: {attention}", config.scaling);
        let x: Vec<f64> = uniform_vec(seed, 1, config.rotary_dim).into_iter().map(f64::from).collect();
        for delta in deltas(seed).into_iter().chain([SHIFT_MAX_DELTA, -SHIFT_MAX_DELTA, 1 << 31]) {
            let direction = if delta < 0 { Direction::Inverse } else { Direction::Forward };
            let want = rope_row_freqs(&x, delta.unsigned_abs() as f64, &freqs, 1.0, config.style, direction);
            assert_eq!(rotate(&x, &turn(&freqs, delta), config.style), want, "Δ {delta}");
        }
    }
    // Two turns make their sum's (the graph test's cumulative model), to f64's rounding.
    let freqs = RopeConfig::new(64, MAX_POS).frequencies().unwrap().0;
    let x: Vec<f64> = uniform_vec(seed, 2, 64).into_iter().map(f64::from).collect();
    let (a, b) = (SHIFT_MAX_DELTA, -(1 << 24) - 3);
    let two = rotate(&rotate(&x, &turn(&freqs, a), RopeStyle::NeoX), &turn(&freqs, b), RopeStyle::NeoX);
    let one = rotate(&x, &turn(&freqs, a + b), RopeStyle::NeoX);
    assert!(two.iter().zip(&one).all(|(p, q)| (p - q).abs() < 1e-12), "{two:?} vs {one:?}");
}

/// [`validate_shift`]'s checks on device addresses, without a GPU: the accepted forms and
/// each refusal, by its error.
#[test]
fn shift_plans_without_a_gpu() {
    let t = |i: u64, layout: Layout, dtype: DType| RawTensor::new(i << 30, layout.extent().unwrap(), dtype, layout);
    let config = RopeConfig::new(128, MAX_POS).dtype(DType::BF16);
    let deltas = |n: usize| RawPositions::new(PositionKind::IdsI32, 5 << 30, n);
    let pl = Layout::bshd(64, 16, 2, 128);
    let paged = RawKvCache::paged(t(1, pl, DType::BF16), t(2, pl, DType::BF16));
    let ok = RawShiftArgs::new(ShiftCache::Kv(paged), deltas(4)).with_slots((6 << 30, 4 * 100));
    let check = |args: &RawShiftArgs| validate_shift(&config, args);
    assert_eq!(check(&ok), Ok(()));
    assert_eq!(check(&changed(ok, |a| a.deltas = RawPositions::new(PositionKind::IdsI64, 5 << 30, 4))), Ok(()));
    assert!(matches!(check(&changed(ok, |a| a.slots = None)), Err(Error::SlotMapping(_))));
    assert!(matches!(check(&ok.with_rows(0..4)), Err(Error::SlotMapping(_))));
    assert!(matches!(check(&ok.with_slots((6 << 30, 401))), Err(Error::Length { what: "slots", .. })));
    assert!(matches!(check(&ok.with_slots(((6 << 30) + 4, 400))), Err(Error::Alignment { what: "slots", .. })));
    let misaligned = RawPositions::new(PositionKind::IdsI32, (5 << 30) + 2, 4);
    assert!(matches!(check(&changed(ok, |a| a.deltas = misaligned)), Err(Error::Alignment { what: "deltas", .. })));
    for kind in [PositionKind::OffsetsI32, PositionKind::OffsetsI64, PositionKind::Sequential] {
        let args = changed(ok, |a| a.deltas = RawPositions::new(kind, 5 << 30, 4));
        assert!(matches!(check(&args), Err(Error::PositionKind { .. })), "{kind:?}");
    }
    let inside = changed(ok, |a| a.deltas = RawPositions::new(PositionKind::IdsI32, (1 << 30) + 256, 4));
    assert!(matches!(check(&inside), Err(Error::Aliasing { .. })));
    // Contiguous and window caches: a range of each block, one delta a block.
    let cl = Layout::bhsd(4, 2, 1024, 128);
    for cache in [
        RawKvCache::contiguous(t(1, cl, DType::BF16), t(2, cl, DType::BF16)),
        RawKvCache::window(t(1, cl, DType::BF16), t(2, cl, DType::BF16), 4),
    ] {
        let ok = RawShiftArgs::new(ShiftCache::Kv(cache), deltas(4));
        assert_eq!(check(&ok), Ok(()));
        assert_eq!(check(&ok.with_rows(100..1024)), Ok(()));
        assert_eq!(check(&ok.with_rows(7..7)), Ok(()), "no rows: no work");
        let past = check(&ok.with_rows(0..1025));
        assert!(matches!(past, Err(Error::TooLarge { what: "rows (end)", value: 1025, limit: 1024 })), "{past:?}");
        let reversed = check(&changed(ok, |a| a.rows = Some((10, 5))));
        assert!(matches!(reversed, Err(Error::TooLarge { what: "rows (start)", .. })), "{reversed:?}");
        let three = check(&changed(ok, |a| a.deltas = deltas(3)));
        assert!(matches!(three, Err(Error::Shape { what: "deltas", expected: 4, got: 3, .. })), "{three:?}");
        assert!(matches!(check(&ok.with_slots((6 << 30, 8))), Err(Error::SlotMapping(_))));
    }
    // Types, head_dim, scales.
    let f16 = RawKvCache::paged(t(1, pl, DType::F16), t(2, pl, DType::F16));
    let e = check(&changed(ok, |a| a.cache = ShiftCache::Kv(f16)));
    assert!(matches!(e, Err(Error::DType { what: "k cache", .. })), "{e:?}");
    let small = Layout::bshd(64, 16, 2, 64);
    let narrow = RawKvCache::paged(t(1, small, DType::BF16), t(2, small, DType::BF16));
    let e = check(&changed(ok, |a| a.cache = ShiftCache::Kv(narrow)));
    assert!(matches!(e, Err(Error::Shape { axis: "head_dim", .. })), "{e:?}");
    let fp8 = RawKvCache::paged(t(1, pl, DType::E4M3), t(2, pl, DType::E4M3));
    let e = check(&changed(ok, |a| a.cache = ShiftCache::Kv(fp8)));
    assert!(matches!(e, Err(Error::Scales(_))), "{e:?}");
    let scaled = |s: RawScales| changed(fp8, |c| c.scales = Some(s));
    let per_tensor = RawScales::per_tensor((7 << 30, 1), (8 << 30, 1));
    assert_eq!(check(&changed(ok, |a| a.cache = ShiftCache::Kv(scaled(per_tensor)))), Ok(()));
    let per_head = RawScales::per_head((7 << 30, 2), (8 << 30, 2));
    assert_eq!(check(&changed(ok, |a| a.cache = ShiftCache::Kv(scaled(per_head)))), Ok(()));
    let short = RawScales::per_head((7 << 30, 1), (8 << 30, 2));
    let e = check(&changed(ok, |a| a.cache = ShiftCache::Kv(scaled(short))));
    assert!(matches!(e, Err(Error::Length { what: "k scales", .. })), "{e:?}");
    let e = check(&changed(ok, |a| a.cache = ShiftCache::Kv(changed(paged, |c| c.scales = Some(per_tensor)))));
    assert!(matches!(e, Err(Error::Scales(_))), "{e:?}");
    // Length-dependent scalings: refused unless asked; others need nothing.
    let dynamic = config.clone().scaling(RopeScaling::Dynamic { factor: 2.0, max_position_embeddings: 1024 });
    for (name, c) in [("dynamic", dynamic), ("longrope", config.clone().scaling(longrope(64)))] {
        assert_eq!(validate_shift(&c, &ok), Err(Error::ShiftScaling { rope_type: name }));
        assert_eq!(validate_shift(&c, &ok.with_length_dependent(true)), Ok(()));
    }
    assert_eq!(validate_shift(&config.clone().scaling(yarn()), &ok), Ok(()));
    // MLA: k_pe, the last 64 of rows of 512 + 64, for a Rope of head_dim 64.
    let mla = RopeConfig::new(64, MAX_POS).dtype(DType::BF16).style(RopeStyle::GptJ);
    let rows = Layout::bshd(64, 16, 1, 576);
    let latent = |rank| ShiftCache::Mla(RawMlaCache::paged(t(1, rows, DType::BF16), rank));
    let args = changed(ok, |a| a.cache = latent(512));
    assert_eq!(validate_shift(&mla, &args), Ok(()));
    assert_eq!(validate_shift(&mla, &args.with_deinterleaved(true)), Ok(()));
    let e = validate_shift(&mla, &changed(ok, |a| a.cache = latent(448)));
    assert!(matches!(e, Err(Error::Shape { axis: "head_dim", .. })), "{e:?}");
    let e = validate_shift(&mla, &changed(ok, |a| a.cache = latent(576)));
    assert!(matches!(e, Err(Error::Shape { what: "latent cache", .. })), "{e:?}");
    let fp8_rows = ShiftCache::Mla(RawMlaCache::paged(t(1, rows, DType::E5M2), 512));
    let e = validate_shift(&mla, &changed(ok, |a| a.cache = fp8_rows));
    assert!(matches!(e, Err(Error::Scales(_))), "{e:?}");
    let scaled = ShiftCache::Mla(RawMlaCache::paged(t(1, rows, DType::E5M2), 512).scale((7 << 30, 1)));
    assert_eq!(validate_shift(&mla, &changed(ok, |a| a.cache = scaled)), Ok(()));
}
