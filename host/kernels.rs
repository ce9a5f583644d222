//! The PTX module and its registry of entry points, loaded once per CUDA context, and the
//! one launch primitive every operation goes through.

use std::ffi::c_void;
use std::sync::Arc;

use cust::module::Module;
use cust::sys as cuda;
use rope_cuda_kernels::entries::{EntryPoint, Key};

use crate::error::{driver, Error, Result};

/// The PTX of every kernel, compiled from `kernels/` by `build.rs` for
/// [`ARCH`](crate::ARCH).
pub static PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/rope_cuda_kernels.ptx"));

/// The loaded kernel module of one CUDA context.
///
/// Create one per context with [`Kernels::load`] (the context must be current); the
/// [`Rope`](crate::Rope)s and reference updates made from it each hold an [`Arc`] of it, so it
/// lives as long as they do. Launches look nothing up: every entry point is resolved at load
/// (where several GPUs are visible they ask the driver, once per buffer, that it is memory of
/// this module's device). Launches may come from any thread on which that context is current.
#[derive(Debug)]
pub struct Kernels {
    /// Indexed by `EntryPoint as usize`.
    functions: [cuda::CUfunction; EntryPoint::ALL.len()],
    context: cuda::CUcontext,
    /// The ordinal of the context's device.
    device: i32,
    /// Devices visible to the process when the module was loaded.
    devices: i32,
    // Dropped last: the functions above belong to it.
    _module: Module,
}

// SAFETY: a CUmodule and its CUfunctions may be used from any thread of the process while
// their context lives; `Kernels` holds no thread-local state.
unsafe impl Send for Kernels {}
// SAFETY: launching through shared handles is thread-safe in the driver API.
unsafe impl Sync for Kernels {}

/// A launch's geometry: grid and block sizes (x, y).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Geometry {
    pub grid: (u32, u32),
    pub block: (u32, u32),
}

impl Kernels {
    /// Loads the embedded PTX into the current context and resolves every entry point of the
    /// kernel list.
    ///
    /// ```
    /// let Ok(_ctx) = cust::quick_init() else { return Ok(()) }; // a context, current on this thread
    /// let kernels = rope_cuda::Kernels::load()?; // every entry point resolved, once
    /// let rope = rope_cuda::Rope::new(&kernels, rope_cuda::RopeConfig::new(64, 128))?;
    /// assert!(std::sync::Arc::ptr_eq(rope.kernels(), &kernels));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn load() -> Result<Arc<Self>> {
        let module = Module::from_ptx(PTX, &[]).map_err(|source| Error::KernelLoad { name: "module", source })?;
        let mut functions = [std::ptr::null_mut(); EntryPoint::ALL.len()];
        for &ep in EntryPoint::ALL {
            let name = ep.name();
            let f = module.get_function(name).map_err(|source| Error::KernelLoad { name, source })?;
            functions[ep as usize] = f.to_raw();
        }
        let mut context = std::ptr::null_mut();
        // SAFETY: writes the current context handle into `context`.
        driver("cuCtxGetCurrent", unsafe { cuda::cuCtxGetCurrent(&mut context) })?;
        let (mut device, mut devices) = (0, 0);
        // SAFETY: each call writes one integer; a context is current (the module loaded).
        driver("cuCtxGetDevice", unsafe { cuda::cuCtxGetDevice(&mut device) })?;
        // SAFETY: as above.
        driver("cuDeviceGetCount", unsafe { cuda::cuDeviceGetCount(&mut devices) })?;
        Ok(Arc::new(Kernels { functions, context, device, devices, _module: module }))
    }

    /// The ordinal of the device this module was loaded on (its context's device).
    pub fn device(&self) -> i32 {
        self.device
    }

    /// The CUDA context this module was loaded into.
    pub fn context(&self) -> cuda::CUcontext {
        self.context
    }

    /// Checks that each named device address (0: absent) is memory of this module's device:
    /// [`Error::Device`] names the first that is not. Free where the process sees one
    /// device; otherwise one driver query per address. Addresses the driver does not know
    /// pass unchecked.
    pub(crate) fn check_devices(&self, addresses: &[(&'static str, u64)]) -> Result<()> {
        if self.devices <= 1 {
            return Ok(());
        }
        for &(what, ptr) in addresses.iter().filter(|a| a.1 != 0) {
            let mut ordinal: i32 = -1;
            // SAFETY: writes one int; the driver checks the address itself.
            let r = unsafe {
                cuda::cuPointerGetAttribute(
                    (&raw mut ordinal).cast(),
                    cuda::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                    ptr,
                )
            };
            // An address the driver does not know (CUDA_ERROR_INVALID_VALUE) has no device to
            // compare: it passes, as every address does where one device is visible (the raw
            // entry points' callers vouch for their addresses).
            if r == cuda::cudaError_enum::CUDA_ERROR_INVALID_VALUE {
                continue;
            }
            driver("cuPointerGetAttribute", r)?;
            if ordinal != self.device {
                return Err(Error::Device { what, expected: self.device, got: ordinal });
            }
        }
        Ok(())
    }

    /// Launches the entry point of `key` with `params` as its one by-value parameter and
    /// `shared_bytes` of dynamic shared memory; while this thread records a graph
    /// ([`crate::Graph::record`]), adds the launch to the graph instead. The key's type fixes
    /// the parameters' type, both taken from one line of the kernel list.
    ///
    /// # Safety
    /// Every address in `params` is valid for what the key's kernel does with `geometry`
    /// (the caller's checks say why), and `stream` is a stream of this module's context.
    pub(crate) unsafe fn launch<K: Key>(
        &self,
        key: K,
        geometry: Geometry,
        shared_bytes: u32,
        params: &K::Params,
        stream: cuda::CUstream,
    ) -> Result<()> {
        let ep = key.entry_point().ok_or_else(|| Error::NoKernel { key: format!("{key:?}") })?;
        let function = self.functions[ep as usize];
        let mut args = [params as *const K::Params as *mut c_void];
        let (grid, block) = (geometry.grid, geometry.block);
        if let Some(recorded) = crate::graph::record_kernel(function, grid, block, shared_bytes, args.as_mut_ptr()) {
            return recorded;
        }
        // SAFETY: `function` is a loaded entry point whose one parameter is `K::Params` (both
        // from the key's line of the kernel list); the caller vouches for its addresses.
        driver("cuLaunchKernel", unsafe {
            cuda::cuLaunchKernel(
                function,
                grid.0,
                grid.1,
                1,
                block.0,
                block.1,
                1,
                shared_bytes,
                stream,
                args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })
    }
}
