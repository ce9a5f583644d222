//! Entry points load on first use, one module each: `Kernels::load` compiles nothing, a launch
//! loads what it runs (once, however many threads ask), and `preload_all` loads the rest.

#![allow(clippy::needless_range_loop)]

mod common;

use common::{download_t, gpu, upload_t, TestElem};
use half::bf16;
use rope_cuda::reference::{rope_row, uniform_vec};
use rope_cuda::{DType, Direction, EntryPoint, Layout, Positions, Rope, RopeArgs, RopeConfig, RopeStyle, TensorMut};

#[test]
fn entry_points_load_on_first_use_once() {
    let Some(g) = gpu("entry_points_load_on_first_use_once") else { return };
    let fresh = g.kernels.load_stats();
    assert_eq!((fresh.loaded, fresh.available), (0, EntryPoint::ALL.len()), "Kernels::load compiled something");

    let (tokens, heads, d) = (5, 3, 64);
    let rope = Rope::new(&g.kernels, RopeConfig::new(d, 64).dtype(DType::BF16)).unwrap();
    assert_eq!(g.kernels.load_stats().loaded, 0, "Rope::new launches nothing");
    let x: Vec<bf16> = uniform_vec(31, 0, tokens * heads * d).into_iter().map(bf16::from_f32).collect();
    let ids: Vec<i32> = (0..tokens as i32).map(|t| 3 * t + 1).collect();
    let dids = upload_t(&ids);
    let layout = Layout::bshd(1, tokens, heads, d);
    let run = |threads: usize| {
        let mut buf = upload_t(&x);
        std::thread::scope(|s| {
            // `threads` launches of the same kernel at once, each on a buffer of its own.
            let bufs: Vec<_> = (1..threads).map(|_| upload_t(&x)).collect();
            for mut b in bufs {
                let (rope, dids) = (&rope, &dids);
                let ctx = &g._ctx;
                s.spawn(move || {
                    cust::context::CurrentContext::set_current(ctx).unwrap();
                    let stream = cust::stream::Stream::new(cust::stream::StreamFlags::NON_BLOCKING, None).unwrap();
                    let mut q = TensorMut::new(&mut b, layout);
                    rope.apply(RopeArgs::in_place(&mut q, Positions::ids_i32(dids)), &stream).unwrap();
                    stream.synchronize().unwrap();
                });
            }
            let mut q = TensorMut::new(&mut buf, layout);
            rope.apply(RopeArgs::in_place(&mut q, Positions::ids_i32(&dids)), &g.stream).unwrap();
        });
        g.stream.synchronize().unwrap();
        download_t(&buf)
    };
    let out: Vec<bf16> = run(8);
    let after = g.kernels.load_stats();
    assert_eq!(after.loaded, 1, "one launch of one kernel (from 8 threads) loads one entry point");
    assert!(after.load_time > fresh.load_time);
    // The loaded kernel computes RoPE: every output within 1 ulp of the f64 reference.
    for t in 0..tokens {
        for h in 0..heads {
            let r = (t * heads + h) * d;
            let xs: Vec<f64> = x[r..r + d].iter().map(|v| v.to_f64()).collect();
            let want = rope_row(&xs, ids[t] as f64, 10_000.0, d, RopeStyle::NeoX, Direction::Forward);
            for j in 0..d {
                assert!(
                    out[r + j].ulps(bf16::round(want[j])) <= 1,
                    "token {t} head {h} dim {j}: {} vs {}",
                    out[r + j],
                    want[j]
                );
            }
        }
    }
    // Launching it again loads nothing.
    let again = run(1);
    assert_eq!(again, out);
    assert_eq!(g.kernels.load_stats(), after);

    g.kernels.preload(&[EntryPoint::kv_claim, EntryPoint::kv_claim]).unwrap();
    assert_eq!(g.kernels.load_stats().loaded, 2);
    g.kernels.preload_all().unwrap();
    let all = g.kernels.load_stats();
    assert_eq!(all.loaded, all.available);
    // Every entry point's module loads on the H200's driver.
    assert!(all.load_time >= after.load_time);
}
