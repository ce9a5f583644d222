//! The embedded PTX, one build per architecture, loaded one entry point at a time on first use
//! (one module each), and the one launch primitive every operation goes through.

use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use cust::module::Module;
use cust::sys as cuda;
use rope_cuda_kernels::entries::{EntryPoint, Key};

use crate::driver;
use crate::error::{Error, Result};

/// One architecture's embedded PTX, as build.rs packed it: the prologue (version, target,
/// shared declarations) and the entry points in groups of similar ones, each a brotli stream of
/// `blob`; a group of an architecture with a `base` is packed with the base's same group as
/// its dictionary.
pub(crate) struct ArchPtx {
    /// `sm_80`, …
    arch: &'static str,
    /// The compute capability it needs at least, `major * 10 + minor`.
    capability: u32,
    blob: &'static [u8],
    /// The prologue's stream: its byte range in `blob`, and its text's length.
    prologue: (usize, usize, usize),
    /// The architecture (an index of [`EMBEDDED`]) whose groups are this one's dictionaries.
    base: Option<usize>,
    /// Each group's stream: its byte range in `blob`, and its text's length.
    groups: &'static [(usize, usize, usize)],
    /// Each entry point, in the order of the kernel list: name, group, and the range of its
    /// text in the group's text (offset, length).
    entries: &'static [(&'static str, usize, usize, usize)],
}

// `EMBEDDED`: every architecture built, oldest first (build.rs writes it).
include!(concat!(env!("OUT_DIR"), "/ptx_index.rs"));

/// The architecture and sizes, not the bytes (a `Rope`'s `Debug` shows its `Kernels`).
impl std::fmt::Debug for ArchPtx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ArchPtx")
            .field("arch", &self.arch)
            .field("entries", &self.entries.len())
            .field("packed_bytes", &self.blob.len())
            .finish()
    }
}

/// A group's text, unpacked: its architecture, its index, the text.
struct Unpacked {
    arch: &'static str,
    group: usize,
    text: Arc<[u8]>,
}

/// The group unpacked last: the loads of one process mostly come from few groups (a model's
/// kernels), and [`Kernels::preload`] takes its list group by group.
static LAST_GROUP: Mutex<Option<Unpacked>> = Mutex::new(None);

impl ArchPtx {
    /// One stream's text, `dict` its dictionary (empty: none).
    fn unpack(&self, (start, end, len): (usize, usize, usize), dict: &[u8]) -> Vec<u8> {
        use std::io::Read;
        let bytes = &self.blob[start..end];
        let mut text = Vec::with_capacity(len);
        let read = match dict.is_empty() {
            true => brotli_decompressor::Decompressor::new(bytes, 1 << 16).read_to_end(&mut text),
            false => brotli_decompressor::Decompressor::new_with_custom_dict(bytes, 1 << 16, dict.to_vec().into())
                .read_to_end(&mut text),
        };
        assert!(read.is_ok() && text.len() == len, "build.rs packed this stream of the embedded PTX");
        text
    }

    /// The text of group `g`, unpacked (its base's same group first, as its dictionary).
    fn group(&self, g: usize) -> Arc<[u8]> {
        let mut last = LAST_GROUP.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(u) = last.as_ref().filter(|u| u.arch == self.arch && u.group == g) {
            return Arc::clone(&u.text);
        }
        let dict = self.base.map(|b| EMBEDDED[b].unpack(EMBEDDED[b].groups[g], &[])).unwrap_or_default();
        let text: Arc<[u8]> = self.unpack(self.groups[g], &dict).into();
        *last = Some(Unpacked { arch: self.arch, group: g, text: Arc::clone(&text) });
        text
    }

    fn prologue(&self) -> String {
        String::from_utf8(self.unpack(self.prologue, &[])).expect("PTX is ASCII")
    }

    /// Where entry point `name` lies: its group, and its offset and length in the group's
    /// text; `None` if this PTX lacks it.
    fn find(&self, name: &str) -> Option<(usize, usize, usize)> {
        self.entries.iter().find(|e| e.0 == name).map(|&(_, g, offset, len)| (g, offset, len))
    }

    /// The text of entry point `name`; `None` if this PTX lacks it.
    fn entry(&self, name: &str) -> Option<String> {
        let (g, offset, len) = self.find(name)?;
        let text = std::str::from_utf8(&self.group(g)[offset..offset + len]).expect("PTX is ASCII").to_string();
        Some(text)
    }

    /// The PTX of one entry point as a module of its own: the prologue and the entry's text;
    /// `None` if this PTX lacks it.
    fn module(&self, name: &str) -> Option<String> {
        let entry = self.entry(name)?;
        Some(self.prologue() + &entry)
    }

    /// The whole PTX text: the prologue and every entry point, in the order of the kernel list.
    fn text(&self) -> String {
        let groups: Vec<Arc<[u8]>> = (0..self.groups.len()).map(|g| self.group(g)).collect();
        let mut text = self.prologue();
        for &(_, g, offset, len) in self.entries {
            text += std::str::from_utf8(&groups[g][offset..offset + len]).expect("PTX is ASCII");
            text.push('\n');
        }
        text
    }

    /// The group of entry point `name` (`usize::MAX` if this PTX lacks it).
    fn group_of(&self, name: &str) -> usize {
        self.find(name).map_or(usize::MAX, |e| e.0)
    }
}

/// The architectures whose PTX is embedded, oldest first (`sm_80`, `sm_90`, `sm_100`; a
/// build with `ROPE_CUDA_ARCH` set has only those it names).
pub fn archs() -> impl Iterator<Item = &'static str> {
    EMBEDDED.iter().map(|a| a.arch)
}

/// The embedded PTX for `arch` (`sm_80`, …) as one text, for offline checks (ptxas, the PTX
/// tests); `None` if it is not embedded. The kernels themselves load one entry point at a time.
///
/// ```
/// let ptx = rope_cuda::ptx("sm_90").expect("embedded");
/// assert!(ptx.contains(".target sm_90") && ptx.contains(".entry kv_claim("));
/// ```
pub fn ptx(arch: &str) -> Option<String> {
    EMBEDDED.iter().find(|a| a.arch == arch).map(ArchPtx::text)
}

/// The architecture to load on a device of compute capability `capability`: `requested`
/// (`ROPE_CUDA_PTX_ARCH`, or [`Kernels::load_arch`]'s argument) if the device runs it, else
/// the newest embedded one it runs.
fn pick(capability: u32, requested: Option<&str>) -> Result<&'static ArchPtx> {
    let available = || archs().collect::<Vec<_>>().join(", ");
    match requested {
        Some(name) => match EMBEDDED.iter().find(|a| a.arch == name) {
            Some(a) if a.capability <= capability => Ok(a),
            _ => Err(Error::Arch { requested: name.to_string(), capability, available: available() }),
        },
        None => EMBEDDED.iter().rev().find(|a| a.capability <= capability).ok_or_else(|| Error::Arch {
            requested: "the newest".to_string(),
            capability,
            available: available(),
        }),
    }
}

/// The PTX of entry point `name` from `$ROPE_CUDA_PTX_OVERRIDE_DIR/{name}.ptx` where that file
/// exists: a kernel variant timed against the embedded one in the same run, in this crate's
/// own examples and benches (built with `bench-kernels`; BENCHMARKS.md says how the variants
/// are built). A file that cannot be read is a panic, not a silent fallback.
#[cfg(feature = "bench-kernels")]
fn override_ptx(name: &str) -> Option<String> {
    let dir = std::env::var_os("ROPE_CUDA_PTX_OVERRIDE_DIR")?;
    let file = std::path::Path::new(&dir).join(format!("{name}.ptx"));
    file.exists().then(|| std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("reading {}: {e}", file.display())))
}

/// An entry point loaded into the context: its module (unloaded when dropped) and function.
#[derive(Debug)]
struct Loaded {
    function: cuda::CUfunction,
    /// The most threads a block of it may have (its registers decide).
    max_threads: u32,
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
    /// The architecture's PTX the entry points load from.
    ptx: &'static ArchPtx,
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
        Self::load_with(std::env::var("ROPE_CUDA_PTX_ARCH").ok().filter(|v| !v.is_empty()).as_deref())
    }

    /// [`Kernels::load`] with the PTX of `arch` (`sm_80`, `sm_90`, …; see [`archs`]) rather
    /// than the newest the device runs: to compare architectures' kernels, or to test the
    /// portable code on a newer device. [`Error::Arch`] if it is not embedded or the device
    /// cannot run it.
    pub fn load_arch(arch: &str) -> Result<Arc<Self>> {
        Self::load_with(Some(arch))
    }

    fn load_with(requested: Option<&str>) -> Result<Arc<Self>> {
        let context = driver::ctx_get_current()?;
        if context.is_null() {
            return Err(Error::Driver {
                call: "cuCtxGetCurrent",
                code: cuda::CUresult::CUDA_ERROR_INVALID_CONTEXT as u32,
            });
        }
        let device = driver::ctx_get_device()?;
        let devices = driver::device_get_count()?;
        let attribute = |which| driver::device_get_attribute(which, device);
        let major = attribute(cuda::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = attribute(cuda::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        let ptx = pick((major * 10 + minor) as u32, requested)?;
        let entries = std::array::from_fn(|_| OnceLock::new());
        Ok(Arc::new(Kernels { entries, loading: Mutex::new(Duration::ZERO), ptx, context, device, devices }))
    }

    /// Loads each of `entries` not loaded yet (the driver compiles them now rather than at
    /// their first launch): before a latency-bound first step, or before capturing a stream
    /// into a graph with another library.
    pub fn preload(&self, entries: &[EntryPoint]) -> Result<()> {
        // Group by group: each group of the embedded PTX is unpacked once.
        let mut entries = entries.to_vec();
        entries.sort_by_cached_key(|ep| self.ptx.group_of(ep.name()));
        entries.iter().try_for_each(|&ep| self.function(ep).map(|_| ()))
    }

    /// Loads every entry point of the embedded PTX (what the library did before loading
    /// lazily: on a fresh driver cache, seconds).
    pub fn preload_all(&self) -> Result<()> {
        self.preload(EntryPoint::ALL)
    }

    /// The architecture whose PTX this context loads (`sm_90` on an H200, unless
    /// `ROPE_CUDA_PTX_ARCH` or [`Kernels::load_arch`] chose another).
    pub fn arch(&self) -> &'static str {
        self.ptx.arch
    }

    /// What has been loaded so far, and the driver's time for it.
    pub fn load_stats(&self) -> LoadStats {
        let load_time = *self.loading.lock().unwrap_or_else(|e| e.into_inner());
        let loaded = self.loaded().count();
        LoadStats { loaded, available: EntryPoint::ALL.len(), load_time }
    }

    /// The entry points loaded so far, in the order of the kernel list.
    pub fn loaded(&self) -> impl Iterator<Item = EntryPoint> + '_ {
        EntryPoint::ALL.iter().copied().filter(|&ep| self.entries[ep as usize].get().is_some())
    }

    /// The entry point's function, loading its module into this context on first use.
    fn function(&self, ep: EntryPoint) -> Result<cuda::CUfunction> {
        self.entry(ep).map(|l| l.function)
    }

    /// The entry point as loaded, its module loaded into this context on first use.
    fn entry(&self, ep: EntryPoint) -> Result<&Loaded> {
        let cell = &self.entries[ep as usize];
        if let Some(loaded) = cell.get() {
            return Ok(loaded);
        }
        let mut spent = self.loading.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(loaded) = cell.get() {
            return Ok(loaded);
        }
        let name = ep.name();
        let ptx = self.ptx.module(name).ok_or(Error::KernelLoad { name, source: cust::error::CudaError::NotFound })?;
        #[cfg(feature = "bench-kernels")]
        let ptx = override_ptx(name).unwrap_or(ptx);
        let start = Instant::now();
        // SAFETY: makes this module's context current on this thread for the load; popped below.
        unsafe { driver::ctx_push_current(self.context) }?;
        let load = || -> Result<Loaded> {
            let module = Module::from_ptx(&ptx, &[]).map_err(|source| Error::KernelLoad { name, source })?;
            let function = module.get_function(name).map_err(|source| Error::KernelLoad { name, source })?.to_raw();
            let max_threads = driver::func_max_threads(function)? as u32;
            Ok(Loaded { function, max_threads, _module: module })
        };
        let loaded = load();
        driver::ctx_pop_current()?;
        *spent += start.elapsed();
        let loaded = loaded?;
        // No other thread sets it while the lock is held.
        Ok(cell.get_or_init(move || loaded))
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
            // An address the driver does not know has no device to compare: it passes, as every
            // address does where one device is visible (the raw entry points' callers vouch for
            // their addresses).
            let Some(ordinal) = driver::pointer_get_device_ordinal(ptr)? else { continue };
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
    /// Checks that the kernel of `key` takes blocks of `geometry`'s size: the library's blocks
    /// of [`BLOCK_THREADS`](rope_cuda_kernels::tuning::BLOCK_THREADS) always fit; the larger blocks of a
    /// whole-projection norm (up to 512 threads, one token's q or k heads each) need a kernel
    /// of at most 128 registers a thread (each is: ptxas's counts in CI), which the driver's
    /// compilation decides. [`Error::TooLarge`] otherwise, before any launch.
    pub(crate) fn check_block<K: Key>(&self, key: K, geometry: Geometry) -> Result<()> {
        let threads = geometry.block.0 * geometry.block.1;
        if threads <= rope_cuda_kernels::tuning::BLOCK_THREADS {
            return Ok(());
        }
        let ep = key.entry_point().ok_or_else(|| Error::NoKernel { key: format!("{key:?}") })?;
        let limit = self.entry(ep)?.max_threads;
        match threads <= limit {
            true => Ok(()),
            false => Err(Error::TooLarge {
                what: "threads a block (a whole-projection norm: one token's q or k heads in a block)",
                value: threads as u64,
                limit: limit as u64,
            }),
        }
    }

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
        self.check_block(key, geometry)?;
        let mut args = [params as *const K::Params as *mut c_void];
        let (grid, block) = (geometry.grid, geometry.block);
        if let Some(recorded) = crate::graph::record_kernel(function, grid, block, shared_bytes, args.as_mut_ptr()) {
            return recorded;
        }
        // SAFETY: `function` is a loaded entry point whose one parameter is `K::Params` (both
        // from the key's line of the kernel list); the caller vouches for its addresses.
        unsafe { driver::launch_kernel(function, grid, block, shared_bytes, stream, args.as_mut_ptr()) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every architecture of the build embeds every entry point of the kernel list; each
    /// entry point's module is that architecture's prologue and exactly that entry's text: one
    /// `.entry`, its own name, closed.
    #[test]
    fn every_entry_point_has_a_module_of_its_own_per_architecture() {
        assert!(!EMBEDDED.is_empty(), "no PTX embedded");
        for a in EMBEDDED {
            assert_eq!(a.entries.len(), EntryPoint::ALL.len(), "{}: the index and the kernel list disagree", a.arch);
            let prologue = a.prologue();
            assert!(prologue.contains(&format!(".target {}\n", a.arch)), "{}", a.arch);
            assert!(prologue.contains(".version") && !prologue.contains(".entry"));
            for &ep in EntryPoint::ALL {
                let name = ep.name();
                let text = a.module(name).unwrap_or_else(|| panic!("{}: {name} is not in the index", a.arch));
                let body = text.strip_prefix(prologue.as_str()).expect("the module starts with the prologue");
                assert!(body.starts_with(&format!(".visible .entry {name}(")), "{name}");
                assert!(body.ends_with("}\n"), "{name}: not closed");
                assert_eq!(body.matches(".entry ").count(), 1, "{name}");
            }
            assert!(a.module("no_such_kernel").is_none());
            let whole = a.text();
            assert_eq!(whole.matches(".entry ").count(), EntryPoint::ALL.len());
        }
        // Oldest first, each needing a newer device than the one before.
        assert!(EMBEDDED.windows(2).all(|w| w[0].capability < w[1].capability));
        // Debug shows the architecture, not the megabytes of PTX.
        let shown = format!("{:?}", EMBEDDED[0]);
        assert!(shown.contains(EMBEDDED[0].arch) && shown.len() < 200, "{shown}");
    }

    /// The packed PTX of every architecture (the benchmark kernels included: this test's
    /// build has them) is at most 12 MB a binary, the packing's target; an entry point of an
    /// architecture packed against another's dictionary unpacks to the same kernel.
    #[test]
    fn the_packed_ptx_of_every_architecture_fits_12_mb() {
        let packed: usize = EMBEDDED.iter().map(|a| a.blob.len()).sum();
        let text: usize = EMBEDDED.iter().map(|a| a.prologue.2 + a.groups.iter().map(|g| g.2).sum::<usize>()).sum();
        println!("embedded PTX: {} architectures, {text} bytes of text packed into {packed}", EMBEDDED.len());
        if EMBEDDED.len() == 3 {
            assert!(packed <= 12_000_000, "{packed} bytes");
        }
        for a in EMBEDDED.iter().filter(|a| a.base.is_some()) {
            let base = &EMBEDDED[a.base.unwrap()];
            assert_ne!(base.arch, a.arch);
            assert!(base.base.is_none(), "a base is packed alone");
            let name = a.entries[a.entries.len() / 2].0;
            let (mine, theirs) = (a.module(name).unwrap(), base.module(name).unwrap());
            assert!(mine.contains(&format!(".target {}\n", a.arch)) && mine.contains(&format!(".entry {name}(")));
            assert_ne!(mine, theirs, "{name}: {} and {} unpack alike", a.arch, base.arch);
        }
    }

    /// The newest architecture a device runs is loaded, or the one asked for if it runs it.
    #[test]
    fn the_newest_architecture_the_device_runs_is_picked() {
        let newest_for = |cc| pick(cc, None).map(|a| a.arch);
        let oldest = &EMBEDDED[0];
        assert!(newest_for(oldest.capability - 1).is_err(), "a device older than every PTX");
        for a in EMBEDDED {
            assert_eq!(newest_for(a.capability).unwrap(), a.arch);
            assert_eq!(newest_for(a.capability + 9).unwrap(), a.arch, "a later minor version");
            assert_eq!(pick(200, Some(a.arch)).unwrap().arch, a.arch);
            assert!(matches!(pick(a.capability - 1, Some(a.arch)), Err(Error::Arch { .. })));
        }
        assert!(matches!(pick(200, Some("sm_75")), Err(Error::Arch { .. })));
        if archs().any(|a| a == "sm_90") {
            assert_eq!(newest_for(90).unwrap(), "sm_90", "an H200 (compute capability 9.0)");
        }
    }
}
