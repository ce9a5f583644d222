//! The embedded PTX, loaded one entry point at a time on first use (one module each), and the
//! one launch primitive every operation goes through.

use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use cust::module::Module;
use cust::sys as cuda;
use rope_cuda_kernels::entries::{EntryPoint, Key};

use crate::error::{driver, Error, Result};

/// The PTX of every kernel, compiled from `kernels/` by `build.rs` for
/// [`ARCH`](crate::ARCH).
pub static PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/rope_cuda_kernels.ptx"));

// `PTX_PROLOGUE` and `PTX_ENTRIES`: where each entry point's text lies in `PTX` (build.rs).
include!(concat!(env!("OUT_DIR"), "/ptx_index.rs"));

/// The PTX of one entry point as a module of its own: the prologue (version, target, shared
/// declarations) and the entry's text; `None` if the embedded PTX lacks it.
fn entry_ptx(name: &str) -> Option<String> {
    let &(_, start, end) = PTX_ENTRIES.iter().find(|e| e.0 == name)?;
    Some(format!("{}{}", &PTX[..PTX_PROLOGUE], &PTX[start..end]))
}

/// An entry point loaded into the context: its module (unloaded when dropped) and function.
#[derive(Debug)]
struct Loaded {
    function: cuda::CUfunction,
    _module: Module,
}

/// The kernels of one CUDA context, loaded as they are first launched.
///
/// Create one per context with [`Kernels::load`] (the context must be current); the
/// [`Rope`](crate::Rope)s and reference updates made from it each hold an [`Arc`] of it, so it
/// lives as long as they do. [`Kernels::load`] itself compiles nothing: each entry point is
/// loaded (the driver compiles its PTX, or takes it from its cache) the first time a launch
/// needs it, so a process pays only for the kernels it uses; later launches look nothing up
/// but one atomic load. [`Kernels::preload`] loads a list ahead of time (before a latency-bound
/// first step, say), [`Kernels::preload_all`] every entry point, and [`Kernels::load_stats`]
/// reports what was loaded and how long the driver took. Where several GPUs are visible the
/// launches ask the driver, once per buffer, that it is memory of this module's device.
/// Launches may come from any thread on which that context is current.
#[derive(Debug)]
pub struct Kernels {
    /// Indexed by `EntryPoint as usize`; set once, on the entry's first launch.
    entries: [OnceLock<Loaded>; EntryPoint::ALL.len()],
    /// Held while an entry point loads: one load of each, however many threads launch it.
    loading: Mutex<Duration>,
    context: cuda::CUcontext,
    /// The ordinal of the context's device.
    device: i32,
    /// Devices visible to the process when the module was loaded.
    devices: i32,
}

// SAFETY: a CUmodule and its CUfunctions may be used from any thread of the process while
// their context lives; `Kernels` holds no thread-local state.
unsafe impl Send for Kernels {}
// SAFETY: launching through shared handles is thread-safe in the driver API; loads are
// serialized by `loading` and published through `OnceLock`.
unsafe impl Sync for Kernels {}

/// What a [`Kernels`] has loaded so far ([`Kernels::load_stats`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadStats {
    /// Entry points loaded (one module each).
    pub loaded: usize,
    /// Entry points the embedded PTX holds.
    pub available: usize,
    /// Time spent in the driver loading them (compiling the PTX, or reading its cache).
    pub load_time: Duration,
}

/// A launch's geometry: grid and block sizes (x, y).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Geometry {
    pub grid: (u32, u32),
    pub block: (u32, u32),
}

impl Kernels {
    /// Prepares the kernels of the current context. Nothing is compiled here: each entry
    /// point loads on its first launch (see [`Kernels`]).
    ///
    /// ```
    /// let Ok(_ctx) = cust::quick_init() else { return Ok(()) }; // a context, current on this thread
    /// let kernels = rope_cuda::Kernels::load()?; // cheap: nothing compiled yet
    /// let rope = rope_cuda::Rope::new(&kernels, rope_cuda::RopeConfig::new(64, 128))?;
    /// assert!(std::sync::Arc::ptr_eq(rope.kernels(), &kernels));
    /// assert_eq!(kernels.load_stats().loaded, 0); // Rope::new launches nothing
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn load() -> Result<Arc<Self>> {
        let mut context = std::ptr::null_mut();
        // SAFETY: writes the current context handle into `context`.
        driver("cuCtxGetCurrent", unsafe { cuda::cuCtxGetCurrent(&mut context) })?;
        if context.is_null() {
            return Err(Error::Driver {
                call: "cuCtxGetCurrent",
                code: cuda::CUresult::CUDA_ERROR_INVALID_CONTEXT as u32,
            });
        }
        let (mut device, mut devices) = (0, 0);
        // SAFETY: each call writes one integer; a context is current.
        driver("cuCtxGetDevice", unsafe { cuda::cuCtxGetDevice(&mut device) })?;
        // SAFETY: as above.
        driver("cuDeviceGetCount", unsafe { cuda::cuDeviceGetCount(&mut devices) })?;
        let entries = std::array::from_fn(|_| OnceLock::new());
        Ok(Arc::new(Kernels { entries, loading: Mutex::new(Duration::ZERO), context, device, devices }))
    }

    /// Loads each of `entries` not loaded yet (the driver compiles them now rather than at
    /// their first launch): before a latency-bound first step, or before capturing a stream
    /// into a graph with another library.
    pub fn preload(&self, entries: &[EntryPoint]) -> Result<()> {
        entries.iter().try_for_each(|&ep| self.function(ep).map(|_| ()))
    }

    /// Loads every entry point of the embedded PTX (what the library did before loading
    /// lazily: on a fresh driver cache, seconds).
    pub fn preload_all(&self) -> Result<()> {
        self.preload(EntryPoint::ALL)
    }

    /// What has been loaded so far, and the driver's time for it.
    pub fn load_stats(&self) -> LoadStats {
        let load_time = *self.loading.lock().unwrap_or_else(|e| e.into_inner());
        let loaded = self.entries.iter().filter(|e| e.get().is_some()).count();
        LoadStats { loaded, available: EntryPoint::ALL.len(), load_time }
    }

    /// The entry points loaded so far, in the order of the kernel list.
    pub fn loaded(&self) -> impl Iterator<Item = EntryPoint> + '_ {
        EntryPoint::ALL.iter().copied().filter(|&ep| self.entries[ep as usize].get().is_some())
    }

    /// The entry point's function, loading its module into this context on first use.
    fn function(&self, ep: EntryPoint) -> Result<cuda::CUfunction> {
        let cell = &self.entries[ep as usize];
        if let Some(loaded) = cell.get() {
            return Ok(loaded.function);
        }
        let mut spent = self.loading.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(loaded) = cell.get() {
            return Ok(loaded.function);
        }
        let name = ep.name();
        let ptx = entry_ptx(name).ok_or(Error::KernelLoad { name, source: cust::error::CudaError::NotFound })?;
        let start = Instant::now();
        // SAFETY: makes this module's context current on this thread for the load; popped below.
        driver("cuCtxPushCurrent", unsafe { cuda::cuCtxPushCurrent_v2(self.context) })?;
        let module = Module::from_ptx(&ptx, &[]).map_err(|source| Error::KernelLoad { name, source });
        let function = module.as_ref().ok().map(|m| m.get_function(name).map(|f| f.to_raw()));
        let mut popped = std::ptr::null_mut();
        // SAFETY: pops the context pushed above.
        driver("cuCtxPopCurrent", unsafe { cuda::cuCtxPopCurrent_v2(&mut popped) })?;
        *spent += start.elapsed();
        let module = module?;
        let function = function.expect("loaded").map_err(|source| Error::KernelLoad { name, source })?;
        let _ = cell.set(Loaded { function, _module: module });
        Ok(function)
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
        let function = self.function(ep)?;
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Each entry point's module is the PTX's prologue and exactly that entry's text: one
    /// `.entry`, its own name, closed, and nothing of another entry.
    #[test]
    fn every_entry_point_has_a_module_of_its_own() {
        assert_eq!(PTX_ENTRIES.len(), EntryPoint::ALL.len(), "the index and the kernel list disagree");
        let prologue = &PTX[..PTX_PROLOGUE];
        assert!(prologue.contains(".version") && prologue.contains(".target") && !prologue.contains(".entry"));
        let mut covered = PTX_PROLOGUE;
        for &ep in EntryPoint::ALL {
            let name = ep.name();
            let text = entry_ptx(name).unwrap_or_else(|| panic!("{name} is not in the index"));
            assert!(text.starts_with(prologue), "{name}");
            let body = &text[prologue.len()..];
            assert!(body.starts_with(&format!(".visible .entry {name}(")), "{name}");
            assert!(body.ends_with("}\n"), "{name}: not closed");
            assert_eq!(body.matches(".entry ").count(), 1, "{name}");
            covered += body.len();
        }
        assert!(entry_ptx("no_such_kernel").is_none());
        // Between the entries lie only comments and blank lines.
        let rest: usize = {
            let mut spans: Vec<_> = PTX_ENTRIES.iter().map(|e| (e.1, e.2)).collect();
            spans.sort_unstable();
            let mut at = PTX_PROLOGUE;
            let mut gaps = 0;
            for (s, e) in spans {
                let gap = &PTX[at..s];
                assert!(gap.lines().all(|l| l.trim().is_empty() || l.trim_start().starts_with("//")), "{gap:?}");
                gaps += gap.len();
                at = e;
            }
            gaps + PTX[at..].len()
        };
        assert_eq!(covered + rest, PTX.len());
    }
}
