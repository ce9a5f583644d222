//! What the typed calls take: buffers as [`Operand`]s (cust's here, cudarc's in
//! [`crate::cudarc`]) and streams as a [`Queue`].
//!
//! An operand lends the call its buffer's address, its length and a [`Hold`]: whatever keeps
//! the buffer alive and its accesses ordered while the call queues its work. A cust buffer's
//! borrow is all it takes; a cudarc buffer comes with the stream the work goes on, and its
//! hold is cudarc's record of the access, made when the view holding it is dropped.

use std::marker::PhantomData;

use cust::memory::{DeviceBuffer, DeviceCopy, DeviceSlice};
use cust::stream::Stream;
use cust::sys as cuda;

use crate::config::DType;
use crate::error::{Error, Result};
use crate::kernels::Kernels;

pub(crate) mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
    impl Sealed for i32 {}
    impl Sealed for i64 {}
}

/// What an element is: a float the kernels rotate or copy, or an integer they index with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScalarKind {
    /// A float of the [`DType`] given.
    Float(DType),
    /// A 32-bit integer (positions).
    I32,
    /// A 64-bit integer (positions, slots).
    I64,
}

/// Element types the kernels take or index with: `f32`, `half::f16` and `half::bf16` (half
/// 1.8, cust's; with the feature `cudarc`, half 2's too), `i32` and `i64`.
pub trait Scalar: sealed::Sealed + Copy + 'static {
    /// What the element is.
    const KIND: ScalarKind;
}

/// The float element types, those of [`DType`]: `f32`, `half::f16` and `half::bf16` (and
/// with the feature `cudarc`, half 2's `f16` and `bf16`), and the FP8 codes of caches
/// ([`F8E4M3`](crate::F8E4M3), [`F8E5M2`](crate::F8E5M2)).
pub trait Element: Scalar {
    /// The matching [`DType`].
    const DTYPE: DType;
}

/// An [`Element`] that cust's buffers hold: every element type but the feature `cudarc`'s
/// half 2 `f16` and `bf16` (cust's `DeviceCopy` is for half 1.8's). The one bound generic code
/// over the crate's element types needs to upload, download and pass cust buffers.
///
/// ```
/// use cust::memory::{CopyDestination, DeviceBuffer};
/// use rope_cuda::{CustElement, DType};
///
/// /// A host slice to the device and back, for any element type the kernels take.
/// fn round_trip<T: CustElement + Default>(host: &[T]) -> cust::error::CudaResult<Vec<T>> {
///     let dev = DeviceBuffer::from_slice(host)?;
///     let mut back = vec![T::default(); host.len()];
///     dev.copy_to(&mut back[..])?;
///     Ok(back)
/// }
/// # let Ok(_ctx) = cust::quick_init() else { return Ok(()) }; // no GPU: nothing to run
/// let back = round_trip(&[half::bf16::ONE, half::bf16::ZERO])?;
/// assert_eq!((back[0], <half::bf16 as rope_cuda::Element>::DTYPE), (half::bf16::ONE, DType::BF16));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub trait CustElement: Element + DeviceCopy {}
impl<T: Element + DeviceCopy> CustElement for T {}

/// `Scalar` and `Element` for float types, each with its [`DType`] variant.
macro_rules! elements {
    ($($t:ty => $dtype:ident),* $(,)?) => {$(
        impl $crate::operand::Scalar for $t {
            const KIND: $crate::operand::ScalarKind = $crate::operand::ScalarKind::Float($crate::DType::$dtype);
        }
        impl $crate::operand::Element for $t {
            const DTYPE: $crate::DType = $crate::DType::$dtype;
        }
    )*};
}
pub(crate) use elements;

elements!(f32 => F32, half::f16 => F16, half::bf16 => BF16);
impl Scalar for i32 {
    const KIND: ScalarKind = ScalarKind::I32;
}
impl Scalar for i64 {
    const KIND: ScalarKind = ScalarKind::I64;
}

/// What keeps an operand's buffer ordered while calls use it ([`Operand::lend`]): nothing
/// beyond the borrow for cust's buffers; for cudarc's, the stream the work goes on and the
/// parts of cudarc's record of the access (its `SyncOnDrop`), which each call that uses the
/// buffer makes again after queueing its work. Allocates nothing, drops nothing.
#[derive(Debug, Clone, Copy)]
pub struct Hold<'a> {
    /// The stream the buffer was lent for (its raw handle as an address), if any: calls check
    /// that they queue their work there.
    stream: Option<usize>,
    /// cudarc's record of the access.
    #[cfg(rope_cudarc)]
    record: Record<'a>,
    _borrow: PhantomData<&'a ()>,
}

/// The parts of a cudarc `SyncOnDrop`, kept without its drop.
#[cfg(rope_cudarc)]
#[derive(Debug, Clone, Copy)]
enum Record<'a> {
    /// Nothing to record (cudarc does not track this buffer's accesses).
    Nothing,
    /// Record the stream's work in the buffer's event.
    Event(&'a cudarc::driver::CudaEvent, &'a cudarc::driver::CudaStream),
    /// Synchronise the stream.
    Sync(&'a cudarc::driver::CudaStream),
}

impl<'a> Hold<'a> {
    /// The hold of a buffer whose borrow for `'a` is all it takes: no stream, no record.
    pub const fn none() -> Self {
        Hold {
            stream: None,
            #[cfg(rope_cudarc)]
            record: Record::Nothing,
            _borrow: PhantomData,
        }
    }

    /// cudarc's record `sync` of an access for work on `stream`, taken apart: it is made again
    /// after each call that uses the buffer ([`Hold::queued`]).
    #[cfg(rope_cudarc)]
    pub(crate) fn record(mut sync: cudarc::driver::SyncOnDrop<'a>, stream: cuda::CUstream) -> Self {
        use cudarc::driver::SyncOnDrop;
        let record = match &mut sync {
            SyncOnDrop::Record(r) => r.take().map_or(Record::Nothing, |(event, s)| Record::Event(event, s)),
            SyncOnDrop::Sync(s) => s.take().map_or(Record::Nothing, Record::Sync),
        };
        // `sync` is empty now: dropping it records nothing.
        drop(sync);
        Hold { stream: Some(stream as usize), record, _borrow: PhantomData }
    }

    /// `Err(Error::Stream)` naming `what` if the buffer was lent for work on another stream
    /// than `stream`.
    pub(crate) fn check(&self, what: &'static str, stream: cuda::CUstream) -> Result<()> {
        match self.stream {
            Some(lent) if lent != stream as usize => Err(Error::Stream { what }),
            _ => Ok(()),
        }
    }

    /// After a call queued its work on the buffer's stream: makes cudarc's record of the access,
    /// so that later work on the buffer (and its free) waits for it.
    pub(crate) fn queued(&self) {
        #[cfg(rope_cudarc)]
        {
            use cudarc::driver::SyncOnDrop;
            match self.record {
                Record::Nothing => {}
                Record::Event(event, stream) => drop(SyncOnDrop::Record(Some((event, stream)))),
                Record::Sync(stream) => drop(SyncOnDrop::Sync(Some(stream))),
            }
        }
    }
}

/// Runs `launch` on `stream` for buffers lent with `holds` (each named; `None`: absent): checks
/// first that each was lent for work on `stream` ([`Error::Stream`] names the first that was
/// not), and makes their records after `launch` has queued its work.
pub(crate) fn on_stream<const N: usize>(
    holds: [(&'static str, Option<&Hold<'_>>); N],
    stream: cuda::CUstream,
    launch: impl FnOnce() -> Result<()>,
) -> Result<()> {
    for (what, hold) in holds {
        if let Some(hold) = hold {
            hold.check(what, stream)?;
        }
    }
    let launched = launch();
    for hold in holds.iter().filter_map(|(_, hold)| *hold) {
        hold.queued();
    }
    launched
}

/// A device buffer a call may read, borrowed for `'a`: cust's `&DeviceSlice<T>` and
/// `&DeviceBuffer<T>` (and their `&mut`), and with the feature `cudarc` cudarc's buffers paired
/// with the stream the work goes on: `(&CudaSlice<T>, &stream)`, `(&CudaView<T>, &stream)`
/// (and `(&mut CudaSlice<T>, &stream)`, `(&mut CudaViewMut<T>, &stream)`). [`OperandMut`]
/// marks those a call may write: the `&mut` ones.
///
/// # Safety
/// [`lend`](Operand::lend) returns the device address of element 0 of an allocation holding at
/// least `len` elements of [`Operand::Elem`], and a [`Hold`] such that, for work queued during
/// `'a` on the hold's stream (any stream, where it names none), followed by the hold's record
/// (made by the calls after queueing):
/// - the allocation stays allocated until that work completes, and
/// - no write by others runs concurrently with that work (for an [`OperandMut`], no read
///   either), whether by the borrow for `'a` or by the ordering the hold makes.
pub unsafe trait Operand<'a> {
    /// The buffer's element type.
    type Elem: Scalar;

    /// The buffer's device address and length in elements, and what keeps it alive and its
    /// accesses ordered while the call that takes it queues its work.
    fn lend(self) -> (u64, usize, Hold<'a>);
}

/// An [`Operand`] a call may write: an exclusive borrow.
///
/// # Safety
/// As [`Operand`], with nothing else reading or writing the buffer concurrently with that
/// work, whether by the exclusive borrow for `'a` or by the ordering the hold makes.
pub unsafe trait OperandMut<'a>: Operand<'a> {}

// SAFETY: cust's buffers are freed synchronously (`cuMemFree` waits for the work queued on
// them); the shared borrow for `'a` rules out writes through cust meanwhile.
unsafe impl<'a, T: Scalar + DeviceCopy> Operand<'a> for &'a DeviceSlice<T> {
    type Elem = T;
    fn lend(self) -> (u64, usize, Hold<'a>) {
        (self.as_device_ptr().as_raw(), self.len(), Hold::none())
    }
}

// SAFETY: as for `&DeviceSlice`, the borrow being exclusive.
unsafe impl<'a, T: Scalar + DeviceCopy> Operand<'a> for &'a mut DeviceSlice<T> {
    type Elem = T;
    fn lend(self) -> (u64, usize, Hold<'a>) {
        (self.as_device_ptr().as_raw(), self.len(), Hold::none())
    }
}

// SAFETY: the borrow for `'a` is exclusive.
unsafe impl<'a, T: Scalar + DeviceCopy> OperandMut<'a> for &'a mut DeviceSlice<T> {}

// SAFETY: as for `&DeviceSlice`.
unsafe impl<'a, T: Scalar + DeviceCopy> Operand<'a> for &'a DeviceBuffer<T> {
    type Elem = T;
    fn lend(self) -> (u64, usize, Hold<'a>) {
        (**self).lend()
    }
}

// SAFETY: as for `&mut DeviceSlice`.
unsafe impl<'a, T: Scalar + DeviceCopy> Operand<'a> for &'a mut DeviceBuffer<T> {
    type Elem = T;
    fn lend(self) -> (u64, usize, Hold<'a>) {
        (&mut **self).lend()
    }
}

// SAFETY: the borrow for `'a` is exclusive.
unsafe impl<'a, T: Scalar + DeviceCopy> OperandMut<'a> for &'a mut DeviceBuffer<T> {}

/// A stream the typed calls queue their work on: cust's [`Stream`], and with the feature
/// `cudarc` cudarc's `CudaStream` (or its `Arc`), checked to be of the kernels' context and
/// bound to the thread.
///
/// # Safety
/// An `Ok` from [`raw`](Queue::raw) is a valid stream of `kernels`' context, or null (the
/// legacy default stream) with that context current on the calling thread.
pub unsafe trait Queue {
    /// The raw stream to launch `kernels`' work on.
    fn raw(&self, kernels: &Kernels) -> Result<cuda::CUstream>;
}

// SAFETY: a cust stream is a stream of the context current at its creation, which for cust's
// users is the one their buffers and the kernels live in (the typed calls have always taken
// cust's streams so; the launches check the buffers' devices, not the stream's context).
unsafe impl Queue for Stream {
    fn raw(&self, _kernels: &Kernels) -> Result<cuda::CUstream> {
        Ok(self.as_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Direction, KvAppend, KvCache, Layout, PositionKind, Positions, RopeArgs, Tensor, TensorMut};

    /// A buffer at a made-up address: an operand without a GPU.
    struct Fake<T>(u64, usize, PhantomData<T>);

    fn fake<T>(i: u64, len: usize) -> Fake<T> {
        Fake(i << 28, len, PhantomData)
    }

    // SAFETY: never launched on; the tests only lower the views.
    unsafe impl<'a, T: Scalar> Operand<'a> for &'a Fake<T> {
        type Elem = T;
        fn lend(self) -> (u64, usize, Hold<'a>) {
            (self.0, self.1, Hold::none())
        }
    }

    // SAFETY: as above.
    unsafe impl<'a, T: Scalar> Operand<'a> for &'a mut Fake<T> {
        type Elem = T;
        fn lend(self) -> (u64, usize, Hold<'a>) {
            (self.0, self.1, Hold::none())
        }
    }

    // SAFETY: as above.
    unsafe impl<'a, T: Scalar> OperandMut<'a> for &'a mut Fake<T> {}

    /// The typed calls lower to the raw ones' arguments, each view with its own element type,
    /// and building and lowering them allocates nothing.
    #[test]
    fn typed_calls_lower_to_raw_args_without_allocating() {
        let (ql, kl) = (Layout::bshd(1, 2, 4, 64), Layout::bshd(1, 2, 1, 64));
        let (mut q, mut k) = (fake::<half::bf16>(1, 512), fake::<half::f16>(2, 128));
        let (mut q_out, mut k_out) = (fake::<f32>(3, 512), fake::<half::bf16>(4, 128));
        let (ids, slots) = (fake::<i64>(5, 2), fake::<i64>(6, 2));
        let (mut kc, mut vc, v) = (fake::<half::bf16>(7, 1024), fake::<f32>(8, 1024), fake::<f32>(9, 128));
        let ((), allocations) = crate::alloc_count::count(|| {
            let (mut qv, mut kv) = (TensorMut::new(&mut q, ql), TensorMut::new(&mut k, kl));
            let raw = RopeArgs::in_place(&mut qv, Positions::ids_i64(&ids)).k(&mut kv).raw();
            assert_eq!((raw.q.ptr, raw.q.dtype, raw.q.layout), (1 << 28, DType::BF16, ql));
            assert_eq!(raw.k.map(|k| (k.ptr, k.len, k.dtype)), Some((2 << 28, 128, DType::F16)));
            assert_eq!((raw.q_out, raw.k_out, raw.direction), (None, None, Direction::Forward));
            assert_eq!((raw.positions.kind, raw.positions.ptr, raw.positions.len), (PositionKind::IdsI64, 5 << 28, 2));

            let (qt, kt) = (qv.as_tensor(), kv.as_tensor());
            let (mut qo, mut ko) = (TensorMut::new(&mut q_out, ql), TensorMut::new(&mut k_out, kl));
            let args = RopeArgs::into(&qt, &mut qo, Positions::sequential()).k_into(&kt, &mut ko);
            let raw = args.direction(Direction::Inverse).raw();
            assert_eq!(raw.q_out.map(|t| (t.ptr, t.dtype)), Some((3 << 28, DType::F32)));
            assert_eq!(raw.k_out.map(|t| (t.ptr, t.dtype)), Some((4 << 28, DType::BF16)));
            assert_eq!((raw.positions.kind, raw.direction), (PositionKind::Sequential, Direction::Inverse));

            let mut cache = KvCache::paged(&mut kc, &mut vc, Layout::bshd(4, 4, 1, 64));
            let vt = Tensor::new(&v, kl);
            let raw = KvAppend::new(&kt, &vt, &mut cache, Positions::ids_i64(&ids)).q(&mut qv).slots(&slots).raw();
            assert_eq!((raw.q.map(|q| q.ptr), raw.v.ptr, raw.v.dtype), (Some(1 << 28), 9 << 28, DType::F32));
            assert_eq!((raw.cache.k.dtype, raw.cache.v.dtype, raw.cache.paged), (DType::BF16, DType::F32, true));
            assert_eq!(raw.slots, Some((6 << 28, 2)));
        });
        assert_eq!(allocations, 0);
    }

    /// A buffer lent for work on one stream is refused on another, before anything is queued.
    #[test]
    fn buffers_lent_for_another_stream_are_refused() {
        let on = |stream: usize| Hold { stream: Some(stream), ..Hold::none() };
        let (a, b, any) = (on(0x10), on(0x20), Hold::none());
        let stream = 0x10 as cuda::CUstream;
        let mut launched = false;
        let e = on_stream([("q", Some(&a)), ("q_out", None), ("k", Some(&b))], stream, || {
            launched = true;
            Ok(())
        });
        assert_eq!((e, launched), (Err(Error::Stream { what: "k" }), false));
        on_stream([("q", Some(&a)), ("positions", Some(&any))], stream, || Ok(())).unwrap();
    }
}
