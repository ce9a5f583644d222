//! Several GPUs (issue 8): one module per device, launches on the device that owns the
//! buffers, and buffers of another device refused with a typed error. Runs on every visible
//! GPU and passes with one (the cross-device checks then print that they need two).

mod common;

use std::io::Write;

use common::assert_rotated;
use cust::context::{Context, CurrentContext};
use cust::device::Device;
use cust::memory::{CopyDestination, DeviceBuffer};
use cust::stream::{Stream, StreamFlags};
use half::bf16;
use rope_cuda::reference::{splitmix64, uniform};
use rope_cuda::{DType, Error, Kernels, KvCache, Layout, Positions, Rope, RopeArgs, RopeConfig, Tensor, TensorMut};

/// The visible devices, or `None` after printing a skip (a failure with
/// `ROPE_CUDA_REQUIRE_GPU=1`).
fn devices(test: &str) -> Option<Vec<Device>> {
    let found = cust::init(cust::CudaFlags::empty()).and_then(|_| Device::num_devices());
    match found {
        Ok(n) if n > 0 => Some((0..n).map(|i| Device::get_device(i).unwrap()).collect()),
        other => {
            let required = std::env::var("ROPE_CUDA_REQUIRE_GPU").is_ok_and(|v| !v.is_empty() && v != "0");
            assert!(!required, "{test}: ROPE_CUDA_REQUIRE_GPU is set but CUDA found no GPU: {other:?}");
            let _ = writeln!(std::io::stderr(), "{test}: skipped, no CUDA device ({other:?})");
            None
        }
    }
}

/// A decode step of 9 sequences with 4 q and 2 kv heads of 64 on the current device:
/// checks q and the written key and value rows against the f64 reference.
fn step_on_current_device(kernels: &std::sync::Arc<Kernels>, seed: u64) {
    let stream = Stream::new(StreamFlags::NON_BLOCKING, None).unwrap();
    let rope = Rope::new(kernels, RopeConfig::new(64, 1024).dtype(DType::BF16)).unwrap();
    let (t, hq, hk, d) = (9, 4, 2, 64);
    let r = |tensor, n: usize| (0..n as u64).map(|i| bf16::from_f32(uniform(seed, tensor, i))).collect::<Vec<_>>();
    let (qh, kh, vh, ch) = (r(0, t * hq * d), r(1, t * hk * d), r(2, t * hk * d), r(3, 4 * 16 * hk * d));
    let ph: Vec<i32> = (0..t as u64).map(|i| (splitmix64(seed ^ i) % 1024) as i32).collect();
    let sh: Vec<i64> = (0..t as i64).map(|i| 3 + 7 * i).collect();
    let mut q = DeviceBuffer::from_slice(&qh).unwrap();
    let (k, v) = (DeviceBuffer::from_slice(&kh).unwrap(), DeviceBuffer::from_slice(&vh).unwrap());
    let (mut kc, mut vc) = (DeviceBuffer::from_slice(&ch).unwrap(), DeviceBuffer::from_slice(&ch).unwrap());
    let (pos, slots) = (DeviceBuffer::from_slice(&ph).unwrap(), DeviceBuffer::from_slice(&sh).unwrap());
    {
        let mut cache = KvCache::paged(&mut kc, &mut vc, Layout::bshd(4, 16, hk, d));
        let mut tq = TensorMut::new(&mut q, Layout::bshd(t, 1, hq, d));
        let l = Layout::bshd(t, 1, hk, d);
        let (k, v) = (Tensor::new(&k, l), Tensor::new(&v, l));
        let append = rope_cuda::KvAppend::new(&k, &v, &mut cache, Positions::ids_i32(&pos)).q(&mut tq).slots(&slots);
        rope.append_kv(append, &stream).unwrap();
    }
    rope.check_errors(&stream).unwrap();
    let get = |b: &DeviceBuffer<bf16>| {
        let mut h = vec![bf16::ZERO; b.len()];
        b.copy_to(&mut h[..]).unwrap();
        h
    };
    let (q_out, k_cache, v_cache) = (get(&q), get(&kc), get(&vc));
    let (qr, kr) = (hq * d, hk * d);
    for i in 0..t {
        let p = ph[i] as i64;
        assert_rotated(&format!("q token {i}"), &q_out[i * qr..][..qr], &qh[i * qr..][..qr], p, rope.config());
        let at = sh[i] as usize * kr;
        assert_rotated(&format!("key of token {i}"), &k_cache[at..][..kr], &kh[i * kr..][..kr], p, rope.config());
        let same = v_cache[at..][..kr].iter().zip(&vh[i * kr..]).all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "value of token {i}");
    }
}

/// On every visible GPU: its own context and module (which knows its device), and a fused
/// step checked against the reference.
#[test]
fn a_step_on_every_visible_gpu() {
    let test = "a_step_on_every_visible_gpu";
    let Some(devices) = devices(test) else { return };
    for (i, device) in devices.iter().enumerate() {
        let _ctx = Context::new(*device).unwrap();
        let kernels = Kernels::load().unwrap();
        assert_eq!(kernels.device(), i as i32);
        step_on_current_device(&kernels, 40 + i as u64);
    }
    let _ = writeln!(std::io::stderr(), "{test}: ran on {} GPU(s)", devices.len());
}

/// With two or more GPUs: a buffer of device 1 handed to device 0's `Rope` (RoPE and the
/// fused append) is a typed `Error::Device` before any launch, and the buffer keeps its bits.
#[test]
fn buffers_of_another_device_are_refused() {
    let test = "buffers_of_another_device_are_refused";
    let Some(devices) = devices(test) else { return };
    if devices.len() < 2 {
        let _ = writeln!(std::io::stderr(), "{test}: skipped, needs two GPUs ({} visible)", devices.len());
        return;
    }
    let ctx1 = Context::new(devices[1]).unwrap();
    let host: Vec<bf16> = (0..4 * 4 * 64).map(|i| bf16::from_f32(uniform(7, 0, i))).collect();
    let mut on_1 = DeviceBuffer::from_slice(&host).unwrap();
    let ctx0 = Context::new(devices[0]).unwrap();
    CurrentContext::set_current(&ctx0).unwrap();
    let kernels = Kernels::load().unwrap();
    let stream = Stream::new(StreamFlags::NON_BLOCKING, None).unwrap();
    let rope = Rope::new(&kernels, RopeConfig::new(64, 64).dtype(DType::BF16)).unwrap();
    let ids = DeviceBuffer::from_slice(&[1i32, 2, 3, 4]).unwrap();
    let mut tq = TensorMut::new(&mut on_1, Layout::bshd(1, 4, 4, 64));
    let e = rope.apply(RopeArgs::in_place(&mut tq, Positions::ids_i32(&ids)), &stream);
    assert!(matches!(e, Err(Error::Device { what: "q", expected: 0, got: 1 })), "{e:?}");
    // The fused append with a cache on device 0 and keys on device 1.
    let (k0, mut kc, mut vc) = (
        DeviceBuffer::from_slice(&host).unwrap(),
        DeviceBuffer::from_slice(&host).unwrap(),
        DeviceBuffer::from_slice(&host).unwrap(),
    );
    let slots = DeviceBuffer::from_slice(&[0i64, 1, 2, 3]).unwrap();
    let l = Layout::bshd(4, 1, 4, 64);
    let mut cache = KvCache::paged(&mut kc, &mut vc, Layout::bshd(1, 4, 4, 64));
    let (on_1_keys, on_0_values) = (Tensor::new(&on_1, l), Tensor::new(&k0, l));
    let e = rope.append_kv(
        rope_cuda::KvAppend::new(&on_1_keys, &on_0_values, &mut cache, Positions::ids_i32(&ids)).slots(&slots),
        &stream,
    );
    assert!(matches!(e, Err(Error::Device { what: "k", expected: 0, got: 1 })), "{e:?}");
    // The same call with both on device 0 is accepted: the refusal was the device's.
    let on_0_keys = Tensor::new(&k0, l);
    rope.append_kv(
        rope_cuda::KvAppend::new(&on_0_keys, &on_0_values, &mut cache, Positions::ids_i32(&ids)).slots(&slots),
        &stream,
    )
    .unwrap();
    stream.synchronize().unwrap();
    CurrentContext::set_current(&ctx1).unwrap();
    let mut back = vec![bf16::ZERO; host.len()];
    on_1.copy_to(&mut back[..]).unwrap();
    assert!(back.iter().zip(&host).all(|(a, b)| a.to_bits() == b.to_bits()), "a refused call wrote");
    // Each device's objects go with its context current.
    drop(on_1);
    CurrentContext::set_current(&ctx0).unwrap();
}
