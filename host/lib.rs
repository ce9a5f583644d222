//! Pure-Rust CUDA kernels for rotary position embeddings (RoPE).
//!
//! The kernels are Rust too: the `no_std` crate `rope-cuda-kernels` is compiled to PTX by
//! this crate's `build.rs` with rustc's NVPTX backend, embedded here as [`PTX`], and loaded
//! once per CUDA context by [`Kernels::load`]. Launches go through [`cust`] onto a stream the
//! caller gives, look nothing up, allocate only what the call returns and never synchronise.
//!
//! The first operation is the seed's reference module, [`RotaryModel`]: rotate-half RoPE of
//! contiguous f32 `[B, H, N, D]` q and k at positions `0..N`.
//!
//! ```no_run
//! use cust::memory::{CopyDestination, DeviceBuffer};
//! use cust::stream::{Stream, StreamFlags};
//! use rope_cuda::{Kernels, RotaryModel};
//!
//! let _ctx = cust::quick_init()?; // a CUDA context, current on this thread
//! let kernels = Kernels::load()?; // once per context
//! let stream = Stream::new(StreamFlags::NON_BLOCKING, None)?;
//! let model = RotaryModel::new(&kernels, 128, 4096, 10_000.0)?;
//! let shape = [1, 32, 16, 128];
//! let n: usize = shape.iter().product();
//! let q = DeviceBuffer::from_slice(&vec![1.0f32; n])?;
//! let k = DeviceBuffer::from_slice(&vec![1.0f32; n])?;
//! let (q_rot, k_rot) = model.forward(&q, &shape, &k, &shape, &stream)?;
//! stream.synchronize()?;
//! let mut host = vec![0.0f32; n];
//! q_rot.copy_to(&mut host)?;
//! # let _ = k_rot;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![warn(missing_docs)]

pub mod bench;
mod error;
mod kernels;
pub mod reference;
mod rope;
mod seed;
mod table;

pub use error::{Error, Result};
pub use kernels::{Kernels, ENTRY_POINTS, PTX};
pub use seed::RotaryModel;
pub use table::{HostTable, RopeTable, MAX_POSITION_LIMIT};

/// The GPU architecture the embedded PTX was compiled for (`ROPE_CUDA_ARCH` at build time).
pub const ARCH: &str = env!("ROPE_CUDA_ARCH");
