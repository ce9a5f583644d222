//! The two reference operations the project started from, exactly, as thin layers over
//! [`Rope`] and the fused append.
//!
//! - [`RotaryModel`]: the seed's `Model(dim, max_seq_len, base).forward(q, k)`, a PyTorch
//!   module holding `cos`/`sin` of `n * inv_freq[d % (dim / 2)]` for `n < max_seq_len`, whose
//!   `forward` rotated q and k of shape `[B, H, N, D]` at positions `0..N` in rotate-half
//!   style: `out = x * cos + rotate_half(x) * sin`.
//! - [`KvUpdate`]: `update_kv_cache(k_new, v_new, cos, sin, cache_k, cache_v, positions)`,
//!   interleaved RoPE on new keys with the caller's tables, scattered with the values into
//!   copies of both caches, returned stacked.

mod update;

pub use update::{KvShape, KvUpdate, UpdateBuffers};

use std::sync::Arc;

use cust::memory::{DeviceBuffer, DeviceSlice};
use cust::stream::Stream;

use crate::config::RopeConfig;
use crate::error::{Error, Result};
use crate::kernels::Kernels;
use crate::layout::Layout;
use crate::rope::{Rope, RopeArgs};
use crate::table::RopeTable;
use crate::tensor::{Positions, Tensor, TensorMut};

/// Rotate-half RoPE over contiguous f32 `[batch, heads, seq, head_dim]` tensors, positions
/// `0..seq`: the seed's `Model(dim, max_seq_len, base)`.
///
/// The cos/sin table is built once, in f64 and stored f32, when the model is created.
///
/// ```no_run
/// use cust::memory::DeviceBuffer;
/// use cust::stream::{Stream, StreamFlags};
/// use rope_cuda::Kernels;
/// use rope_cuda::seed::RotaryModel;
///
/// let _ctx = cust::quick_init()?;
/// let kernels = Kernels::load()?;
/// let stream = Stream::new(StreamFlags::NON_BLOCKING, None)?;
/// let model = RotaryModel::new(&kernels, 64, 256, 10_000.0)?;
/// let shape = [4, 8, 256, 64];
/// let q = DeviceBuffer::from_slice(&vec![0.5f32; shape.iter().product()])?;
/// let k = DeviceBuffer::from_slice(&vec![0.25f32; shape.iter().product()])?;
/// let (q_rot, k_rot) = model.forward(&q, &shape, &k, &shape, &stream)?;
/// stream.synchronize()?;
/// # let _ = (q_rot, k_rot);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct RotaryModel {
    rope: Rope,
}

/// A validated `[batch, heads, seq, head_dim]` shape.
#[derive(Debug, Clone, Copy)]
struct Bhnd {
    batch: usize,
    heads: usize,
    seq: usize,
    dim: usize,
}

impl Bhnd {
    fn elements(&self) -> usize {
        self.batch * self.heads * self.seq * self.dim
    }

    /// The contiguous layout of this shape.
    fn layout(&self) -> Layout {
        Layout::bhsd(self.batch, self.heads, self.seq, self.dim)
    }
}

impl RotaryModel {
    /// Builds the table for `head_dim = dim`, positions `0..max_seq_len` and `base`.
    ///
    /// ```
    /// # let Ok(_ctx) = cust::quick_init() else { return Ok(()) }; // no GPU: nothing to run
    /// # let kernels = rope_cuda::Kernels::load()?;
    /// # let stream = cust::stream::Stream::new(cust::stream::StreamFlags::NON_BLOCKING, None)?;
    /// let model = rope_cuda::seed::RotaryModel::new(&kernels, 64, 4096, 10_000.0)?;
    /// assert_eq!((model.dim(), model.table().max_position()), (64, 4096));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn new(kernels: &Arc<Kernels>, dim: usize, max_seq_len: usize, base: f64) -> Result<Self> {
        Ok(RotaryModel { rope: Rope::new(kernels, RopeConfig::new(dim, max_seq_len).base(base))? })
    }

    /// The head dimension.
    pub fn dim(&self) -> usize {
        self.rope.config().head_dim
    }

    /// The table: positions `0..max_seq_len`.
    pub fn table(&self) -> &RopeTable {
        self.rope.table()
    }

    /// Returns `(q_rot, k_rot)`, newly allocated, as the seed's `forward(q, k)` did.
    ///
    /// `q` is `[B, Hq, N, D]` and `k` `[B, Hk, N, D]`, contiguous. The work is queued on
    /// `stream`; synchronise it before reading the results on the host.
    ///
    /// ```
    /// # let Ok(_ctx) = cust::quick_init() else { return Ok(()) }; // no GPU: nothing to run
    /// # let kernels = rope_cuda::Kernels::load()?;
    /// # let stream = cust::stream::Stream::new(cust::stream::StreamFlags::NON_BLOCKING, None)?;
    /// use cust::memory::{CopyDestination, DeviceBuffer};
    /// use rope_cuda::seed::RotaryModel;
    /// let model = RotaryModel::new(&kernels, 64, 256, 10_000.0)?;
    /// let shape = [2, 4, 16, 64];
    /// let x: Vec<f32> = (0..2 * 4 * 16 * 64).map(|i| (i % 11) as f32 * 0.25).collect();
    /// let (q, k) = (DeviceBuffer::from_slice(&x)?, DeviceBuffer::from_slice(&x)?);
    /// let (q_rot, k_rot) = model.forward(&q, &shape, &k, &shape, &stream)?;
    /// stream.synchronize()?;
    /// let (mut a, mut b) = (vec![0.0f32; x.len()], vec![0.0f32; x.len()]);
    /// q_rot.copy_to(&mut a[..])?;
    /// k_rot.copy_to(&mut b[..])?;
    /// assert_eq!(a, b); // the same inputs, the same outputs
    /// assert_eq!(a[..64], x[..64]); // position 0 of head 0 is not rotated
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn forward(
        &self,
        q: &DeviceSlice<f32>,
        q_shape: &[usize],
        k: &DeviceSlice<f32>,
        k_shape: &[usize],
        stream: &Stream,
    ) -> Result<(DeviceBuffer<f32>, DeviceBuffer<f32>)> {
        let (qs, ks) = self.check(q, q_shape, k, k_shape)?;
        // SAFETY: every element is written by the launch below before anyone can read it
        // (rotary_dim == head_dim, and the geometry covers every row).
        let (mut q_out, mut k_out) =
            unsafe { (DeviceBuffer::uninitialized(q.len())?, DeviceBuffer::uninitialized(k.len())?) };
        self.launch(qs, ks, q, &mut q_out, k, &mut k_out, stream)?;
        Ok((q_out, k_out))
    }

    /// [`forward`](Self::forward) into caller-owned outputs of the same shapes (no allocation).
    ///
    /// ```
    /// # let Ok(_ctx) = cust::quick_init() else { return Ok(()) }; // no GPU: nothing to run
    /// # let kernels = rope_cuda::Kernels::load()?;
    /// # let stream = cust::stream::Stream::new(cust::stream::StreamFlags::NON_BLOCKING, None)?;
    /// use cust::memory::DeviceBuffer;
    /// use rope_cuda::seed::RotaryModel;
    /// let model = RotaryModel::new(&kernels, 64, 256, 10_000.0)?;
    /// let (q_shape, k_shape) = ([1, 8, 16, 64], [1, 2, 16, 64]); // fewer k heads
    /// let q = DeviceBuffer::from_slice(&vec![0.5f32; 8 * 16 * 64])?;
    /// let k = DeviceBuffer::from_slice(&vec![0.5f32; 2 * 16 * 64])?;
    /// let mut q_out = DeviceBuffer::from_slice(&vec![0.0f32; q.len()])?;
    /// let mut k_out = DeviceBuffer::from_slice(&vec![0.0f32; k.len()])?;
    /// model.forward_into(&q, &q_shape, &k, &k_shape, &mut q_out, &mut k_out, &stream)?;
    /// stream.synchronize()?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[allow(clippy::too_many_arguments)]
    pub fn forward_into(
        &self,
        q: &DeviceSlice<f32>,
        q_shape: &[usize],
        k: &DeviceSlice<f32>,
        k_shape: &[usize],
        q_out: &mut DeviceSlice<f32>,
        k_out: &mut DeviceSlice<f32>,
        stream: &Stream,
    ) -> Result<()> {
        let (qs, ks) = self.check(q, q_shape, k, k_shape)?;
        check_len("q_out", q_shape, qs.elements(), q_out.len())?;
        check_len("k_out", k_shape, ks.elements(), k_out.len())?;
        self.launch(qs, ks, q, q_out, k, k_out, stream)
    }

    /// Rotates `q` and `k` in place.
    ///
    /// ```
    /// # let Ok(_ctx) = cust::quick_init() else { return Ok(()) }; // no GPU: nothing to run
    /// # let kernels = rope_cuda::Kernels::load()?;
    /// # let stream = cust::stream::Stream::new(cust::stream::StreamFlags::NON_BLOCKING, None)?;
    /// use cust::memory::DeviceBuffer;
    /// use rope_cuda::{seed::RotaryModel, Error};
    /// let model = RotaryModel::new(&kernels, 64, 16, 10_000.0)?;
    /// let mut q = DeviceBuffer::from_slice(&vec![0.5f32; 32 * 64])?;
    /// let mut k = DeviceBuffer::from_slice(&vec![0.5f32; 32 * 64])?;
    /// model.forward_in_place(&mut q, &[1, 2, 16, 64], &mut k, &[1, 2, 16, 64], &stream)?;
    /// // Longer than the table: refused before any launch.
    /// let e = model.forward_in_place(&mut q, &[1, 1, 32, 64], &mut k, &[1, 1, 32, 64], &stream);
    /// assert!(matches!(e, Err(Error::MaxPosition { needed: 32, max_position: 16 })));
    /// stream.synchronize()?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn forward_in_place(
        &self,
        q: &mut DeviceSlice<f32>,
        q_shape: &[usize],
        k: &mut DeviceSlice<f32>,
        k_shape: &[usize],
        stream: &Stream,
    ) -> Result<()> {
        let (qs, ks) = self.check(q, q_shape, k, k_shape)?;
        let mut q = TensorMut::new(q, qs.layout());
        let mut k = TensorMut::new(k, ks.layout());
        self.rope.apply(RopeArgs::in_place(&mut q, Positions::sequential()).k(&mut k), stream)
    }

    /// Validates both tensors against each other and the model.
    fn check(
        &self,
        q: &DeviceSlice<f32>,
        q_shape: &[usize],
        k: &DeviceSlice<f32>,
        k_shape: &[usize],
    ) -> Result<(Bhnd, Bhnd)> {
        check_shapes(self.dim(), self.table().max_position(), (q.len(), q_shape), (k.len(), k_shape))
    }

    #[allow(clippy::too_many_arguments)]
    fn launch(
        &self,
        qs: Bhnd,
        ks: Bhnd,
        q: &DeviceSlice<f32>,
        q_out: &mut DeviceSlice<f32>,
        k: &DeviceSlice<f32>,
        k_out: &mut DeviceSlice<f32>,
        stream: &Stream,
    ) -> Result<()> {
        let (q, k) = (Tensor::new(q, qs.layout()), Tensor::new(k, ks.layout()));
        let mut q_out = TensorMut::new(q_out, qs.layout());
        let mut k_out = TensorMut::new(k_out, ks.layout());
        self.rope.apply(RopeArgs::into(&q, &mut q_out, Positions::sequential()).k_into(&k, &mut k_out), stream)
    }
}

/// Validates `q` and `k`, each given as (buffer length, shape), for a model of head
/// dimension `dim` whose table holds `max_position` positions.
fn check_shapes(
    dim: usize,
    max_position: usize,
    (q_len, q_shape): (usize, &[usize]),
    (k_len, k_shape): (usize, &[usize]),
) -> Result<(Bhnd, Bhnd)> {
    let qs = bhnd("q", q_shape, q_len)?;
    let ks = bhnd("k", k_shape, k_len)?;
    if qs.dim != dim {
        return Err(Error::Shape { what: "q", axis: "head_dim", expected: dim, got: qs.dim });
    }
    for (axis, a, b) in [("batch", qs.batch, ks.batch), ("seq", qs.seq, ks.seq), ("head_dim", qs.dim, ks.dim)] {
        if a != b {
            return Err(Error::Shape { what: "k", axis, expected: a, got: b });
        }
    }
    if qs.seq > max_position {
        return Err(Error::MaxPosition { needed: qs.seq, max_position });
    }
    let tokens = qs.batch * qs.seq;
    for (what, value) in [("batch * seq", tokens), ("q heads", qs.heads), ("k heads", ks.heads)] {
        if value > u32::MAX as usize {
            return Err(Error::TooLarge { what, value: value as u64, limit: u32::MAX as u64 });
        }
    }
    Ok((qs, ks))
}

/// Checks that `shape` is `[B, H, N, D]` and that the buffer holds exactly its elements.
fn bhnd(what: &'static str, shape: &[usize], len: usize) -> Result<Bhnd> {
    let &[batch, heads, seq, dim] = shape else {
        return Err(Error::Rank { what, expected: 4, got: shape.to_vec() });
    };
    let elements = shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d)).ok_or(Error::TooLarge {
        what: "elements",
        value: u64::MAX,
        limit: usize::MAX as u64,
    })?;
    check_len(what, shape, elements, len)?;
    Ok(Bhnd { batch, heads, seq, dim })
}

fn check_len(what: &'static str, shape: &[usize], expected: usize, got: usize) -> Result<()> {
    if expected != got {
        return Err(Error::Length { what, shape: shape.to_vec(), expected, got });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(q: &[usize], k: &[usize]) -> Result<(Bhnd, Bhnd)> {
        let len = |s: &[usize]| s.iter().product::<usize>();
        check_shapes(64, 16, (len(q), q), (len(k), k))
    }

    #[test]
    fn accepts_matching_shapes_and_fewer_k_heads() {
        let (q, k) = check(&[2, 8, 16, 64], &[2, 2, 16, 64]).unwrap();
        assert_eq!((q.heads, k.heads, q.seq, q.elements()), (8, 2, 16, 2 * 8 * 16 * 64));
        // Contiguous [B, H, N, D] strides: batch, seq, head.
        assert_eq!(q.layout().strides, [8 * 16 * 64, 64, 16 * 64]);
        check(&[0, 8, 16, 64], &[0, 8, 16, 64]).unwrap();
    }

    #[test]
    fn each_bad_input_has_its_error() {
        let e = check(&[8, 16, 64], &[2, 8, 16, 64]).unwrap_err();
        assert!(matches!(e, Error::Rank { what: "q", expected: 4, .. }), "{e:?}");
        let e = check(&[2, 8, 16, 64], &[1, 2, 8, 16, 64]).unwrap_err();
        assert!(matches!(e, Error::Rank { what: "k", .. }), "{e:?}");
        let e = check(&[2, 8, 16, 32], &[2, 8, 16, 32]).unwrap_err();
        assert!(matches!(e, Error::Shape { what: "q", axis: "head_dim", expected: 64, got: 32 }), "{e:?}");
        let e = check(&[2, 8, 16, 64], &[3, 8, 16, 64]).unwrap_err();
        assert!(matches!(e, Error::Shape { what: "k", axis: "batch", expected: 2, got: 3 }), "{e:?}");
        let e = check(&[2, 8, 16, 64], &[2, 8, 8, 64]).unwrap_err();
        assert!(matches!(e, Error::Shape { what: "k", axis: "seq", expected: 16, got: 8 }), "{e:?}");
        let e = check(&[2, 8, 16, 64], &[2, 8, 16, 32]).unwrap_err();
        assert!(matches!(e, Error::Shape { what: "k", axis: "head_dim", expected: 64, got: 32 }), "{e:?}");
        let e = check(&[1, 8, 17, 64], &[1, 8, 17, 64]).unwrap_err();
        assert!(matches!(e, Error::MaxPosition { needed: 17, max_position: 16 }), "{e:?}");
        let e = check_shapes(64, 16, (100, &[2, 8, 16, 64]), (2 * 8 * 16 * 64, &[2, 8, 16, 64])).unwrap_err();
        assert!(matches!(e, Error::Length { what: "q", expected: 16384, got: 100, .. }), "{e:?}");
        let huge = [usize::MAX / 2, 4, 1, 64];
        let e = check_shapes(64, 16, (0, &huge), (0, &huge)).unwrap_err();
        assert!(matches!(e, Error::TooLarge { .. }), "{e:?}");
    }

    #[test]
    fn tables_refuse_bad_arguments() {
        assert!(matches!(crate::HostTable::new(7, 1e4, 4), Err(Error::HeadDim { head_dim: 7 })));
        assert!(matches!(crate::HostTable::new(0, 1e4, 4), Err(Error::HeadDim { head_dim: 0 })));
        assert!(matches!(crate::HostTable::new(8, -1.0, 4), Err(Error::Base { .. })));
        assert!(matches!(crate::HostTable::new(8, f64::INFINITY, 4), Err(Error::Base { .. })));
    }
}
