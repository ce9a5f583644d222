//! The seed operation on the GPU against the f64 CPU reference.

mod common;

use common::{download, gather_rows, gpu, poisoned, reference_rows, test_seed, upload, POISON};
use cust::memory::DeviceSlice;
use rope_cuda::reference::{relative_error, uniform_vec};
use rope_cuda::seed::RotaryModel;
use rope_cuda::Error;

/// The kernels' accuracy bound: ‖out − ref‖ / ‖ref‖ in f32 against the f64 reference.
const REL_TOL: f64 = 2e-6;

/// Runs `forward` on fresh data of the given shapes and checks every element, then checks
/// `forward_into` (into poisoned windows of larger buffers) and `forward_in_place` give
/// bit-identical results and touch nothing else.
fn check_shapes(test: &str, q_shape: [usize; 4], k_shape: [usize; 4], max_seq_len: usize, base: f64) {
    let Some(g) = gpu(test) else { return };
    let seed = test_seed(test);
    let (nq, nk) = (q_shape.iter().product::<usize>(), k_shape.iter().product::<usize>());
    let (qh, kh) = (uniform_vec(seed, 0, nq), uniform_vec(seed, 1, nk));
    let (q, k) = (upload(&qh), upload(&kh));
    let model = RotaryModel::new(&g.kernels, q_shape[3], max_seq_len, base).unwrap();

    let (q_rot, k_rot) = model.forward(&q, &q_shape, &k, &k_shape, &g.stream).unwrap();
    g.stream.synchronize().unwrap();
    let (q_rot, k_rot) = (download(&q_rot), download(&k_rot));
    for (what, x, shape, out) in [("q", &qh, q_shape, &q_rot), ("k", &kh, k_shape, &k_rot)] {
        let rows = shape[..3].iter().product::<usize>();
        let want = reference_rows(x, shape, base, 0..rows);
        let err = relative_error(out, &want);
        assert!(err <= REL_TOL, "{test}: {what} relative error {err:e} > {REL_TOL:e} (seed {seed})");
    }

    // Out of place into windows of poisoned buffers: every element written, guards intact.
    let guard = 37;
    let (qo, ko) = (poisoned(nq + 2 * guard), poisoned(nk + 2 * guard));
    {
        let mut qw = qo.index(guard..guard + nq);
        let mut kw = ko.index(guard..guard + nk);
        model.forward_into(&q, &q_shape, &k, &k_shape, &mut qw, &mut kw, &g.stream).unwrap();
    }
    g.stream.synchronize().unwrap();
    for (what, buf, want, n) in [("q", &qo, &q_rot, nq), ("k", &ko, &k_rot, nk)] {
        let got = download(buf);
        let outside = got[..guard].iter().chain(&got[guard + n..]);
        assert!(outside.into_iter().all(|v| v.to_bits() == POISON), "{test}: {what} wrote outside its output");
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got[guard..guard + n]), bits(want), "{test}: {what} forward_into differs from forward");
    }

    // In place: the same bits as out of place.
    let (mut qi, mut ki) = (upload(&qh), upload(&kh));
    model.forward_in_place(&mut qi, &q_shape, &mut ki, &k_shape, &g.stream).unwrap();
    g.stream.synchronize().unwrap();
    assert_eq!(
        download(&qi).iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        q_rot.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    );
    assert_eq!(
        download(&ki).iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        k_rot.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    );
}

#[test]
fn seed_shape() {
    check_shapes("seed_shape", [4, 8, 256, 64], [4, 8, 256, 64], 256, 10_000.0);
}

#[test]
fn odd_shape_and_fewer_k_heads() {
    check_shapes("odd_shape_and_fewer_k_heads", [1, 3, 17, 80], [1, 2, 17, 80], 17, 10_000.0);
}

#[test]
fn scalar_path_head_dims() {
    // rotary halves 1, 3 and 10 are not multiples of 4: the one-pair-per-lane kernel.
    check_shapes("scalar_path_d2", [2, 3, 5, 2], [2, 1, 5, 2], 9, 10_000.0);
    check_shapes("scalar_path_d6", [1, 5, 33, 6], [1, 5, 33, 6], 40, 500_000.0);
    check_shapes("scalar_path_d20", [3, 2, 7, 20], [3, 4, 7, 20], 7, 10_000.0);
}

#[test]
fn wide_heads_and_many_heads() {
    check_shapes("head_dim_256", [2, 4, 33, 256], [2, 1, 33, 256], 64, 1_000_000.0);
    check_shapes("heads_32_8_d128", [1, 32, 65, 128], [1, 8, 65, 128], 65, 10_000.0);
}

/// Positions up to 2^20: f32 output within 2e-6 of the f64 reference.
#[test]
fn positions_up_to_2_pow_20() {
    let test = "positions_up_to_2_pow_20";
    let Some(g) = gpu(test) else { return };
    let seed = test_seed(test);
    let n = (1 << 20) + 2;
    let (q_shape, k_shape) = ([1, 2, n, 64], [1, 1, n, 64]);
    let (qh, kh) = (uniform_vec(seed, 0, 2 * n * 64), uniform_vec(seed, 1, n * 64));
    let model = RotaryModel::new(&g.kernels, 64, n, 10_000.0).unwrap();
    let (q_rot, k_rot) = model.forward(&upload(&qh), &q_shape, &upload(&kh), &k_shape, &g.stream).unwrap();
    g.stream.synchronize().unwrap();
    for (what, x, shape, out) in [("q", &qh, q_shape, download(&q_rot)), ("k", &kh, k_shape, download(&k_rot))] {
        let rows = shape[1] * n;
        // Every 101st row, and every row of the last 4096 positions of each head.
        let picked: Vec<usize> = (0..rows).filter(|r| r % 101 == 0 || r % n >= n - 4096).collect();
        let want = reference_rows(x, shape, 10_000.0, picked.iter().copied());
        let got = gather_rows(&out, 64, picked.iter().copied());
        let err = relative_error(&got, &want);
        assert!(err <= REL_TOL, "{test}: {what} relative error {err:e} (seed {seed})");
        // The last position on its own, too.
        let last = [n - 1];
        let err = relative_error(&gather_rows(&out, 64, last), &reference_rows(x, shape, 10_000.0, last));
        assert!(err <= REL_TOL, "{test}: {what} at position {}: relative error {err:e}", n - 1);
    }
}

/// Every bad input returns its error before any launch and leaves the outputs untouched.
#[test]
fn bad_inputs_write_nothing() {
    let test = "bad_inputs_write_nothing";
    let Some(g) = gpu(test) else { return };
    let seed = test_seed(test);
    let shape = [2, 3, 16, 64];
    let n: usize = shape.iter().product();
    let (q, k) = (upload(&uniform_vec(seed, 0, n)), upload(&uniform_vec(seed, 1, n)));
    let model = RotaryModel::new(&g.kernels, 64, 16, 10_000.0).unwrap();
    let (mut qo, mut ko) = (poisoned(n), poisoned(n));
    let short = upload(&uniform_vec(seed, 2, n - 64));
    // (name, q, q shape, k, k shape, the error expected)
    type Case<'a> = (&'a str, &'a DeviceSlice<f32>, Vec<usize>, &'a DeviceSlice<f32>, Vec<usize>, fn(&Error) -> bool);
    let cases: Vec<Case> = vec![
        ("rank", &q, vec![6, 16, 64], &k, shape.to_vec(), |e| matches!(e, Error::Rank { what: "q", expected: 4, .. })),
        ("k batch", &q, shape.to_vec(), &k, vec![3, 2, 16, 64], |e| {
            matches!(e, Error::Shape { what: "k", axis: "batch", .. })
        }),
        ("k seq", &q, shape.to_vec(), &k, vec![2, 6, 8, 64], |e| {
            matches!(e, Error::Shape { what: "k", axis: "seq", .. })
        }),
        ("k dim", &q, shape.to_vec(), &k, vec![2, 6, 16, 32], |e| {
            matches!(e, Error::Shape { what: "k", axis: "head_dim", .. })
        }),
        ("q dim", &q, vec![2, 3, 32, 32], &k, vec![2, 3, 32, 32], |e| {
            matches!(e, Error::Shape { what: "q", axis: "head_dim", .. })
        }),
        ("length", &short, shape.to_vec(), &k, shape.to_vec(), |e| matches!(e, Error::Length { what: "q", .. })),
        ("max position", &q, vec![1, 3, 32, 64], &k, vec![1, 3, 32, 64], |e| {
            matches!(e, Error::MaxPosition { needed: 32, max_position: 16 })
        }),
    ];
    for (name, q, qs, k, ks, is_expected) in cases {
        let err = model.forward_into(q, &qs, k, &ks, &mut qo, &mut ko, &g.stream).unwrap_err();
        assert!(is_expected(&err), "{test}: case {name}: unexpected error {err:?}");
        let err = model.forward(q, &qs, k, &ks, &g.stream).unwrap_err();
        assert!(is_expected(&err), "{test}: case {name} (forward): unexpected error {err:?}");
    }
    // Output lengths that do not match.
    let mut small = poisoned(n - 1);
    let err = model.forward_into(&q, &shape, &k, &shape, &mut small, &mut ko, &g.stream).unwrap_err();
    assert!(matches!(err, Error::Length { what: "q_out", .. }), "{err:?}");
    g.stream.synchronize().unwrap();
    for buf in [&qo, &ko, &small] {
        assert!(download(buf).iter().all(|v| v.to_bits() == POISON), "{test}: an output was written");
    }
    // Odd head_dim is refused when the model is made.
    assert!(matches!(RotaryModel::new(&g.kernels, 63, 16, 10_000.0), Err(Error::HeadDim { head_dim: 63 })));
    assert!(matches!(RotaryModel::new(&g.kernels, 64, 16, f64::NAN), Err(Error::Base { .. })));
}

/// An empty batch returns at once with empty results.
#[test]
fn empty_batch_returns_at_once() {
    let Some(g) = gpu("empty_batch_returns_at_once") else { return };
    let model = RotaryModel::new(&g.kernels, 64, 16, 10_000.0).unwrap();
    let empty = upload(&[]);
    for shape in [[0, 3, 16, 64], [2, 0, 16, 64], [2, 3, 0, 64]] {
        let (q, k) = model.forward(&empty, &shape, &empty, &shape, &g.stream).unwrap();
        assert_eq!((q.len(), k.len()), (0, 0));
    }
    g.stream.synchronize().unwrap();
}
