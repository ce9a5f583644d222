//! Pure-Rust CUDA kernels for rotary position embeddings (RoPE).
//!
//! The kernels are Rust too: the `no_std` crate `rope-cuda-kernels` is compiled to PTX by
//! this crate's `build.rs` with rustc's NVPTX backend for sm_80, sm_90 and sm_100 ([`archs`],
//! [`ptx`]) and embedded here; [`Kernels::load`] picks the newest the device runs, and loads
//! each entry point on its first launch. Launches go through [`cust`] onto a stream the
//! caller gives, look nothing up, allocate only what a call returns and never synchronise
//! (unless asked to: [`RopeConfig::checked`]). Where several GPUs are visible, each launch
//! checks with the driver that its buffers are on the kernels' device.
//!
//! - [`Rope`], built from a [`RopeConfig`] (head_dim, rotary_dim, base, [`RopeStyle`],
//!   max_position, [`DType`]), holds the cos/sin table and rotates q and k: NeoX or GPT-J
//!   pairs; f32, f16 and bf16; any `[batch, seq, heads, head_dim]` strides ([`Layout`]),
//!   including q and k as views of one fused QKV buffer; different head counts for q and k,
//!   or no k; partial rotary; per-token i32/i64 ids or per-sequence offsets ([`Positions`]);
//!   in place or out of place; forward or inverse ([`Direction`]): [`Rope::apply`]
//!   ([`RopeArgs`]).
//! - [`Rope::append_kv`] ([`KvAppend`]) is one decode or prefill step in one launch: k rotated
//!   into a contiguous or paged cache ([`KvCache`]), v copied, q rotated in place.
//! - [`Rope::append_mla`] ([`MlaAppend`]) is the same step for multi-head latent attention
//!   (DeepSeek-V2/V3, Kimi K2): `k_pe` rotated and `kv_c` copied into one latent row a token
//!   ([`MlaCache`]), every head's `q_pe` rotated in place.
//! - Each operation has two doors. The typed one takes views ([`Tensor`], [`TensorMut`],
//!   [`Positions`], [`KvCache`]) of any [`Operand`]: cust's `DeviceSlice` / `DeviceBuffer`, and
//!   with the feature `cudarc` cudarc's buffers (`rope_cuda::cudarc`), each view with its own
//!   element type; and a stream as any [`Queue`]. The raw one ([`Rope::apply_raw`],
//!   [`Rope::append_kv_raw`]) takes device addresses and a raw `CUstream`, for buffers from
//!   candle or any allocator; [`validate`] and [`validate_append`] run its checks without a
//!   GPU.
//! - [`Graph`] records a step's launches once and replays them.
//! - [`seed`] holds the two reference operations the project started from.
//! - Every bad input is an [`Error`] before any launch. A position outside the table is
//!   never read past: its token is left untouched and reported by [`Rope::check_errors`].
//!
//! [`Kernels`] is loaded once per context and shared as an [`Arc`](std::sync::Arc); [`Rope`]
//! holds one, so it has no lifetime and is `Send + Sync`.
//!
//! Accuracy, against an f64 reference: f32 outputs within 2e-6 relative error; every f16
//! and bf16 output within one ulp of the correctly rounded exact result.
//!
//! ```
//! use cust::memory::{CopyDestination, DeviceBuffer};
//! use cust::stream::{Stream, StreamFlags};
//! use half::bf16;
//! use rope_cuda::reference::{rope_row, RefElem};
//! use rope_cuda::{DType, Direction, Kernels, Layout, Positions, Rope, RopeArgs, RopeConfig, RopeStyle, TensorMut};
//!
//! // A CUDA context, current on this thread (this example returns early without a GPU).
//! let Ok(_ctx) = cust::quick_init() else { return Ok(()) };
//! let kernels = Kernels::load()?; // once per context
//! let stream = Stream::new(StreamFlags::NON_BLOCKING, None)?;
//! let rope = Rope::new(&kernels, RopeConfig::new(64, 4096).base(500_000.0).dtype(DType::BF16))?;
//!
//! // Three tokens of a fused QKV buffer: 4 q heads, 2 k heads, 2 v heads of 64.
//! let (tokens, row) = (3, 8 * 64);
//! let x: Vec<bf16> = (0..tokens * row).map(|i| bf16::from_f32((i % 7) as f32 - 3.0)).collect();
//! let mut qkv = DeviceBuffer::from_slice(&x)?;
//! let ids = DeviceBuffer::from_slice(&[0i32, 17, 4095])?;
//! let q = Layout::strided([1, tokens, 4, 64], [tokens * row, row, 64], 0);
//! let k = Layout::strided([1, tokens, 2, 64], [tokens * row, row, 64], 4 * 64);
//! let (mut qv, mut kv) = TensorMut::pair(&mut qkv, q, k);
//! rope.apply(RopeArgs::in_place(&mut qv, Positions::ids_i32(&ids)).k(&mut kv), &stream)?;
//! rope.check_errors(&stream)?; // synchronises; Err would name the first bad position
//!
//! let mut out = vec![bf16::ZERO; x.len()];
//! qkv.copy_to(&mut out[..])?;
//! // Token 1, k head 0, against the f64 reference.
//! let start = row + 4 * 64;
//! let xs: Vec<f64> = x[start..start + 64].iter().map(|v| v.to_f64()).collect();
//! let want = rope_row(&xs, 17.0, 500_000.0, 64, RopeStyle::NeoX, Direction::Forward);
//! for (got, want) in out[start..start + 64].iter().zip(want) {
//!     assert!(got.ulps(<bf16 as RefElem>::round(want)) <= 1);
//! }
//! // v is untouched.
//! assert_eq!(out[6 * 64..row], x[6 * 64..row]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![deny(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks, clippy::missing_safety_doc)]

#[cfg(feature = "bench-kernels")]
#[doc(hidden)]
pub mod bench;
#[cfg(feature = "candle")]
pub mod candle;
// The `candle-examples` feature's crates serve `examples/candle.rs` only (Cargo has no optional
// dev-dependencies); naming them here keeps Cargo's unused-dependency lint quiet.
#[cfg(feature = "candle-examples")]
use {candle_nn as _, candle_transformers as _};
#[cfg(rope_cudarc)]
pub mod cudarc;
pub mod reference;
pub mod seed;

mod alloc;
mod config;
mod driver;
mod error;
mod fp8;
mod graph;
mod hf_config;
mod kernels;
mod kv;
mod launch;
mod layout;
mod mla;
mod norm;
mod operand;
mod records;
mod rope;
mod scaling;
mod table;
mod tables;
mod tensor;

/// The README's examples, compiled with the doctests (not run: they need a GPU) so that they
/// cannot drift from the API; the cudarc and candle ones need their features and are marked
/// `ignore` there.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeExamples;

pub use config::{
    CosSin, DType, Direction, HeadGrouping, Mrope, MropeBands, RopeConfig, RopeStyle, AUTO_TABLE_BYTES,
    MAX_POSITION_LIMIT,
};
pub use error::{ConfigError, Error, Result};
pub use fp8::{F8E4M3, F8E5M2};
pub use graph::Graph;
pub use hf_config::{
    HfConfig, MlaGeometry, StyleSource, INTERLEAVED_MODEL_TYPES, NEOX_MODEL_TYPES, NO_ROPE_MODEL_TYPES,
};
pub use kernels::{archs, ptx, Kernels, LoadStats};
pub use kv::{
    validate_append, validate_shift, Fp8Scale, KvAppend, KvCache, KvRead, KvScales, KvShift, RawKvArgs, RawKvCache,
    RawKvRead, RawQFp8, RawScales, RawShiftArgs, ShiftCache, KV_SCAN_MAX_TOKENS, SHIFT_MAX_DELTA,
};
pub use layout::Layout;
pub use mla::{validate_mla, MlaAppend, MlaCache, RawMlaArgs, RawMlaCache};
pub use norm::{NormKind, QkNorm, QkNormSpec, RawMlaNorm, RawNorm, RawWeight};
pub use operand::{CustElement, Element, Hold, Operand, OperandMut, Queue, Scalar, ScalarKind};
pub use rope::{validate, RawArgs, Rope, RopeArgs};
pub use rope_cuda_kernels::entries::EntryPoint;
pub use rope_cuda_kernels::fp8::Fp8;
pub use scaling::RopeScaling;
pub use table::{row as table_row, HostTable, RopeTable};
pub use tables::TableRope;
pub use tensor::{PositionKind, Positions, RawPositions, RawTensor, Tensor, TensorMut};

pub use rope_cuda_kernels::keys::TableSource;

/// Moved to [`seed::KvShape`]; this alias keeps code written against the old path building.
#[deprecated(note = "moved: use rope_cuda::seed::KvShape")]
pub type KvShape = seed::KvShape;
/// Moved to [`seed::KvUpdate`]; this alias keeps code written against the old path building.
#[deprecated(note = "moved: use rope_cuda::seed::KvUpdate")]
pub type KvUpdate = seed::KvUpdate;
/// Moved to [`seed::RotaryModel`]; this alias keeps code written against the old path
/// building.
#[deprecated(note = "moved: use rope_cuda::seed::RotaryModel")]
pub type RotaryModel = seed::RotaryModel;

/// A [`Rope`] and a reference update are `Send + Sync + 'static`: an engine holds them in
/// long-lived structs and shares them between threads.
const _: () = {
    const fn held<T: Send + Sync + 'static>() {}
    held::<Rope>();
    held::<TableRope>();
    held::<seed::KvUpdate>();
    held::<seed::RotaryModel>();
    held::<Kernels>();
    held::<Graph>();
};

/// Counts heap allocations made by the current thread while counting is on, so unit tests
/// can show the launch path allocates nothing.
#[cfg(test)]
pub(crate) mod alloc_count {
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::cell::Cell;

    thread_local! {
        static ON: Cell<bool> = const { Cell::new(false) };
        static COUNT: Cell<usize> = const { Cell::new(0) };
    }

    struct Counting;

    // SAFETY: forwards to the system allocator; the bookkeeping allocates nothing.
    unsafe impl GlobalAlloc for Counting {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            if ON.with(Cell::get) {
                COUNT.with(|c| c.set(c.get() + 1));
            }
            // SAFETY: the caller's contract, forwarded.
            unsafe { System.alloc(layout) }
        }
        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            // SAFETY: the caller's contract, forwarded.
            unsafe { System.dealloc(ptr, layout) }
        }
    }

    #[global_allocator]
    static ALLOCATOR: Counting = Counting;

    /// Runs `f` and returns its result and the allocations it made on this thread.
    pub fn count<R>(f: impl FnOnce() -> R) -> (R, usize) {
        COUNT.with(|c| c.set(0));
        ON.with(|o| o.set(true));
        let r = f();
        ON.with(|o| o.set(false));
        (r, COUNT.with(Cell::get))
    }
}
