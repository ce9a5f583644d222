//! Device code of `rope-cuda`.
//!
//! Built twice: for `nvptx64-nvidia-cuda` by the host crate's `build.rs` (that build is
//! `no_std` and yields the PTX), and for the host as an ordinary dependency, so that the
//! host launches kernels with exactly the `#[repr(C)]` parameter structs the device reads,
//! decodes them with the same methods in its tests, and shares the pure math with the CPU
//! reference.
//!
//! Layout of this crate:
//! - [`views`]: the contract: views of tables, positions, caches, owner arrays and error
//!   records, embedded in the parameter structs, with the methods that decode them;
//! - [`params`]: one `#[repr(C)]` struct per kernel, passed by value at launch, and the
//!   thread mapping ([`params::work_item`]) both sides compute;
//! - [`support`]: the kernel axes and the one rule set saying which of their combinations
//!   exist; [`keys`] and [`entries`]: typed kernel keys and the list of entry points generated
//!   from that table, from which the device functions and the host's registry both come;
//! - [`math`]: `#[inline(always)]` arithmetic used by device and host alike; [`div`]: division
//!   by launch constants; [`fp8`]: the 8-bit float formats (an architecture-specific
//!   instruction behind one function, with its portable twin);
//! - [`mem`]: the loads and atomics of the views, for both sides; [`norm`]: the QK-norm's
//!   view and statistic (and, on the device, its reduction across a head's lanes);
//! - device only: `gpu` (the intrinsics and memory accesses the kernels need, standing in for
//!   `cuda_std`), `rotate` (the rotation engine: table entries, lanes, styles), `rope`,
//!   `kv` and `shift` (the bodies of the RoPE, KV-cache and KV-shift entry points), `bench` (benchmark yardsticks,
//!   only with the feature `bench`: they are not in the PTX a user's build ships).
//! - [`tuning`]: the measured constants (threads per block, heads per thread, …) both sides read.
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
        core_intrinsics,
        rustc_attrs
    )
)]
// `core_intrinsics` only for `core::intrinsics::gpu` (dynamic shared memory); `rustc_attrs` only
// for `#[rustc_force_inline]` on the KV body's stage functions (kernels/src/kv/mod.rs says why).
#![cfg_attr(target_arch = "nvptx64", allow(internal_features))]
#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks, clippy::missing_safety_doc)]
#![deny(missing_docs)]

pub mod div;
pub mod entries;
pub mod fp8;
pub mod keys;
pub mod math;
pub mod mem;
pub mod norm;
pub mod params;
pub mod support;
pub mod tuning;
pub mod views;

#[cfg(all(target_arch = "nvptx64", feature = "bench"))]
mod bench;
#[cfg(target_arch = "nvptx64")]
mod gpu;
#[cfg(target_arch = "nvptx64")]
mod kv;
#[cfg(target_arch = "nvptx64")]
mod norm_lane;
#[cfg(target_arch = "nvptx64")]
mod rope;
#[cfg(target_arch = "nvptx64")]
mod rotate;
#[cfg(target_arch = "nvptx64")]
mod shift;
