//! Device code of `rope-cuda`.
//!
//! Built twice: for `nvptx64-nvidia-cuda` by the host crate's `build.rs` (that build is
//! `no_std` and yields the PTX), and for the host as an ordinary dependency, so that the
//! host launches kernels with exactly the `#[repr(C)]` parameter structs the device reads
//! and shares the pure math with the CPU reference.
//!
//! Layout of this crate:
//! - [`params`]: one `#[repr(C)]` struct per kernel, passed by value at launch;
//! - [`math`]: `#[inline(always)]` arithmetic used by device and host alike;
//! - `gpu` (device only): the few intrinsics the kernels need, standing in for `cuda_std`;
//! - `entry` (device only): the RoPE `extern "ptx-kernel"` entry points, which only map
//!   threads to work and call into [`math`];
//! - `kv` (device only): the KV-cache entry points (fused RoPE + append, and its claims);
//! - `bench` (device only): an empty kernel and a spin, for the benchmarks' yardsticks.
#![cfg_attr(target_arch = "nvptx64", no_std)]
#![cfg_attr(
    target_arch = "nvptx64",
    feature(
        abi_ptx,
        stdarch_nvptx,
        asm_experimental_arch,
        f16,
        gpu_intrinsics,
        gpu_launch_sized_workgroup_mem,
        core_intrinsics
    )
)]
// `core_intrinsics` only for `core::intrinsics::gpu` (dynamic shared memory).
#![cfg_attr(target_arch = "nvptx64", allow(internal_features))]

pub mod math;
pub mod params;

#[cfg(target_arch = "nvptx64")]
mod bench;
#[cfg(target_arch = "nvptx64")]
mod entry;
#[cfg(target_arch = "nvptx64")]
mod gpu;
#[cfg(target_arch = "nvptx64")]
mod kv;
