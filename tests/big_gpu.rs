//! Tensors past 2^31 elements (int32 index overflow: vLLM #1486), on a GPU with the memory
//! for them (about 4.3 GB for the RoPE test, 8.6 GB for the cache test; the H200 has it).
//! The buffers are filled with a constant pattern on the device; sampled tokens get fresh
//! random data, and those and a few pattern rows are checked against the f64 reference,
//! including every row past element 2^31.

mod common;

use common::{assert_rotated, gpu, test_seed, upload_t};
use cust::memory::{CopyDestination, DeviceBuffer, DeviceSlice};
use cust::sys as cuda;
use half::bf16;
use rope_cuda::reference::{splitmix64, uniform};
use rope_cuda::{DType, KvCache, Layout, Positions, Rope, RopeArgs, RopeConfig, Tensor, TensorMut};

/// bf16 words of the fill pattern: 1.5 and -0.75.
const PATTERN: u32 = 0xBF40_3FC0;

/// `n` bf16 on the device, every pair of elements set to [`PATTERN`].
fn filled(n: usize) -> DeviceBuffer<bf16> {
    // SAFETY: every word is written by the memset before any read.
    let buf = unsafe { DeviceBuffer::<bf16>::uninitialized(n).expect("allocating") };
    // SAFETY: the buffer holds `n` bf16, `n` even.
    let r = unsafe { cuda::cuMemsetD32_v2(buf.as_device_ptr().as_raw(), PATTERN, n / 2) };
    assert_eq!(r, cuda::cudaError_enum::CUDA_SUCCESS);
    buf
}

fn pattern(i: usize) -> bf16 {
    bf16::from_bits((PATTERN >> (16 * (i % 2))) as u16)
}

fn read(buf: &DeviceSlice<bf16>, at: usize, n: usize) -> Vec<bf16> {
    let mut h = vec![bf16::ZERO; n];
    buf.index(at..at + n).copy_to(&mut h[..]).unwrap();
    h
}

fn write(buf: &DeviceSlice<bf16>, at: usize, host: &[bf16]) {
    let mut s = buf.index(at..at + host.len());
    s.copy_from(host).unwrap();
}

/// Whether `bytes` fit in the GPU's free memory with room to spare; prints a skip if not.
fn room(test: &str, bytes: usize) -> bool {
    let (free, _) = cust::memory::mem_get_info().unwrap();
    if free < bytes + (2 << 30) {
        eprintln!("{test}: skipped, needs {} GiB free, {} GiB are", bytes >> 30, free >> 30);
        return false;
    }
    true
}

/// RoPE in place on a bf16 q of 524289 x 32 x 128 = 2^31 + 4096 elements (4.3 GB) and its k:
/// the tokens on both sides of element 2^31 and the last one rotate correctly.
#[test]
fn rope_past_2_pow_31_elements() {
    let test = "rope_past_2_pow_31_elements";
    let Some(g) = gpu(test) else { return };
    let (tokens, hq, hk, d) = (524_289usize, 32, 1, 128);
    let (nq, nk) = (tokens * hq * d, tokens * hk * d);
    assert!(nq > 1 << 31);
    if !room(test, 2 * (nq + nk)) {
        return;
    }
    let seed = test_seed(test);
    let rope = Rope::new(&g.kernels, RopeConfig::new(d, 8192).dtype(DType::BF16)).unwrap();
    let (mut q, mut k) = (filled(nq), filled(nk));
    let positions: Vec<i32> = (0..tokens as u64).map(|t| (splitmix64(seed ^ t) % 8192) as i32).collect();
    let pos = upload_t(&positions);
    // Random tokens: the first, around the middle, on both sides of element 2^31, the last;
    // pattern tokens checked too.
    let boundary = (1usize << 31) / (hq * d);
    let random = [0, 1, tokens / 2, boundary - 1, boundary, tokens - 1];
    let sampled = [random.as_slice(), &[12_345, boundary - 7, tokens - 3]].concat();
    let mut orig = Vec::new();
    for &t in &sampled {
        let rnd = random.contains(&t);
        let make = |n: usize, tensor: u64| -> Vec<bf16> {
            (0..n)
                .map(|i| if rnd { bf16::from_f32(uniform(seed, tensor, (t * n + i) as u64)) } else { pattern(i) })
                .collect()
        };
        let (xq, xk) = (make(hq * d, 0), make(hk * d, 1));
        if rnd {
            write(&q, t * hq * d, &xq);
            write(&k, t * hk * d, &xk);
        }
        orig.push((t, xq, xk));
    }
    {
        let mut tq = TensorMut::new(&mut q, Layout::bshd(1, tokens, hq, d));
        let mut tk = TensorMut::new(&mut k, Layout::bshd(1, tokens, hk, d));
        rope.apply(RopeArgs::in_place(&mut tq, Positions::ids_i32(&pos)).k(&mut tk), &g.stream).unwrap();
    }
    rope.check_errors(&g.stream).unwrap();
    for (t, xq, xk) in orig {
        assert_rotated(&format!("q token {t}"), &read(&q, t * hq * d, hq * d), &xq, positions[t] as i64, rope.config());
        assert_rotated(&format!("k token {t}"), &read(&k, t * hk * d, hk * d), &xk, positions[t] as i64, rope.config());
    }
}

/// The fused append into paged caches of 2^21 + 1024 slots of 8 x 128 bf16 (2^31 + 2^20
/// elements each): slot x stride past 2^31, for a decode batch (block scan) and a prefill
/// chunk (claims), q rotated too; written slots hold the rotated keys and exact values, the
/// slots beside them keep the pattern.
#[test]
fn append_past_2_pow_31_elements() {
    let test = "append_past_2_pow_31_elements";
    let Some(g) = gpu(test) else { return };
    let (hq, hk, d, bs) = (4, 8, 128, 16);
    let num_slots = (1usize << 21) + 1024;
    let n = num_slots * hk * d;
    assert!(n > 1 << 31);
    if !room(test, 4 * n) {
        return;
    }
    let seed = test_seed(test);
    let rope = Rope::new(&g.kernels, RopeConfig::new(d, 8192).dtype(DType::BF16)).unwrap();
    let layout = Layout::bshd(num_slots / bs, bs, hk, d);
    let (mut kc, mut vc) = (filled(n), filled(n));
    for tokens in [8usize, 300] {
        let slots: Vec<i64> = (0..tokens)
            .map(|t| match t {
                0 => 0,
                1 => (1 << 21) - 1,
                2 => 1 << 21,
                3 => num_slots as i64 - 1,
                _ => ((1 << 21) + 2 * t + tokens) as i64,
            })
            .collect();
        let positions: Vec<i32> = (0..tokens as u64).map(|t| (splitmix64(seed ^ t) % 8192) as i32).collect();
        let r = |tensor, n: usize| {
            (0..n as u64).map(|i| bf16::from_f32(uniform(seed + tokens as u64, tensor, i))).collect::<Vec<_>>()
        };
        let (qh, kh, vh) = (r(0, tokens * hq * d), r(1, tokens * hk * d), r(2, tokens * hk * d));
        let (mut dq, dk, dv) = (upload_t(&qh), upload_t(&kh), upload_t(&vh));
        let (dpos, dslots) = (upload_t(&positions), upload_t(&slots));
        {
            let mut cache = KvCache::paged(&mut kc, &mut vc, layout);
            let mut q = TensorMut::new(&mut dq, Layout::bshd(tokens, 1, hq, d));
            let l = Layout::bshd(tokens, 1, hk, d);
            let (k, v) = (Tensor::new(&dk, l), Tensor::new(&dv, l));
            rope.append_kv(
                rope_cuda::KvAppend::new(&k, &v, &mut cache, Positions::ids_i32(&dpos)).q(&mut q).slots(&dslots),
                &g.stream,
            )
            .unwrap();
        }
        rope.check_errors(&g.stream).unwrap();
        let q_out = common::download_t(&dq);
        let row = hk * d;
        for t in 0..tokens {
            let s = slots[t] as usize;
            let p = positions[t];
            assert_rotated(
                &format!("{tokens} tokens: q {t}"),
                &q_out[t * hq * d..][..hq * d],
                &qh[t * hq * d..][..hq * d],
                p as i64,
                rope.config(),
            );
            assert_rotated(
                &format!("{tokens} tokens: k of {t} at slot {s}"),
                &read(&kc, s * row, row),
                &kh[t * row..][..row],
                p as i64,
                rope.config(),
            );
            let v = read(&vc, s * row, row);
            assert!(
                v.iter().zip(&vh[t * row..]).all(|(a, b)| a.to_bits() == b.to_bits()),
                "v of token {t} at slot {s}"
            );
            for nb in [s.wrapping_sub(1), s + 1] {
                if nb < num_slots && !slots.contains(&(nb as i64)) {
                    let (kr, vr) = (read(&kc, nb * row, row), read(&vc, nb * row, row));
                    let same = |r: &[bf16]| r.iter().enumerate().all(|(i, x)| x.to_bits() == pattern(i).to_bits());
                    assert!(same(&kr) && same(&vr), "{tokens} tokens: slot {nb} beside {s} changed");
                }
            }
        }
    }
}
