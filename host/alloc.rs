//! Device allocations the library owns (tables, error records, owner arrays), shareable
//! between threads.

use cust::memory::{DeviceBuffer, DeviceCopy};

use crate::error::Result;

/// A cust device buffer that may be shared between threads: through `&self` only its address
/// and length are read, and the memory behind it is accessed only by stream-ordered driver
/// calls and kernels.
#[derive(Debug)]
pub(crate) struct DeviceAlloc<T: DeviceCopy>(DeviceBuffer<T>);

// SAFETY: `DeviceBuffer<T>` is `Send` for `T: Send`; `&DeviceAlloc` gives out no reference
// into the allocation, only its address and length (plain integers), so sharing it between
// threads is as safe as sending it.
unsafe impl<T: DeviceCopy + Send> Sync for DeviceAlloc<T> {}

impl<T: DeviceCopy> DeviceAlloc<T> {
    /// An allocation holding a copy of `host`, in the current context.
    pub fn from_slice(host: &[T]) -> Result<Self> {
        Ok(DeviceAlloc(DeviceBuffer::from_slice(host)?))
    }

    /// The device address of element 0.
    pub fn address(&self) -> u64 {
        self.0.as_device_ptr().as_raw()
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// The buffer, for copies.
    pub fn buffer(&self) -> &DeviceBuffer<T> {
        &self.0
    }
}

impl<T: DeviceCopy + Default + Clone> DeviceAlloc<T> {
    /// `n` elements of `T::default()` (zeroes for the integer types used here).
    pub fn filled(n: usize) -> Result<Self> {
        Self::from_slice(&vec![T::default(); n])
    }
}
