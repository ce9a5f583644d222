//! CUDA graphs: the launches of a step made once, replayed with one call.
//!
//! Two ways to make one. [`Graph::capture`] captures a stream: everything queued on it,
//! this library's work or not; while it lasts, no other thread of the context may make a
//! synchronising call (see there). [`Graph::record`] records this library's launches and
//! copies as graph nodes without capturing anything, so other threads are free meanwhile.
//!
//! `Rope::apply`, `Rope::append_kv`, their raw doors and `KvUpdate::update_kv_cache` of up to
//! [`crate::KV_SCAN_MAX_TOKENS`] tokens queue their work without allocating, synchronising or
//! looking anything up, so they may go into a graph; so does `Rope::shift_kv` at any size (one
//! launch, no claim: the deltas and slots are read when it replays). Not into a graph: a configuration with
//! `checked` set and `check_errors`, which synchronise and read what ran (while recording,
//! [`Error::NotCapturable`]; inside a capture they synchronise a capturing stream, which CUDA
//! does not allow), and KV calls of more tokens, which settle duplicate slots with an owner
//! array tagged by the host at each call, so a replay would reuse the tag
//! ([`Error::NotCapturable`] in both).
//!
//! A graph holds the addresses it was made with, not the values behind them: write new
//! positions, slots or inputs into the same buffers between replays.
//!
//! Replaying is `unsafe` ([`Graph::launch`]): nothing in the types ties a graph to the
//! buffers its nodes name, so the caller promises they are still alive. Borrowing them
//! instead would hold every buffer of a step borrowed for as long as the engine keeps the
//! graph (for its whole life, typically), which rules out the reuse of activation buffers
//! that graphs exist for; and the raw entry points hand the library addresses it cannot
//! borrow at all.

use std::cell::RefCell;
use std::ffi::c_void;

use cust::stream::Stream;
use cust::sys as cuda;

use crate::driver;
use crate::error::{Error, Result};

/// A graph being recorded on this thread ([`Graph::record`]).
struct Recording {
    graph: cuda::CUgraph,
    /// The last node added (null before the first): the next depends on it.
    last: cuda::CUgraphNode,
    context: cuda::CUcontext,
}

thread_local! {
    static RECORDING: RefCell<Option<Recording>> = const { RefCell::new(None) };
}

/// Whether this thread is recording a graph.
pub(crate) fn recording() -> bool {
    RECORDING.with_borrow(Option::is_some)
}

/// [`Error::NotCapturable`] naming `what` while this thread records a graph: for calls that
/// synchronise and read what ran, which in a recording has not run.
pub(crate) fn not_while_recording(what: &'static str) -> Result<()> {
    match recording() {
        true => Err(Error::NotCapturable(what)),
        false => Ok(()),
    }
}

/// Adds a node made by `add(graph, dependencies, context)` after the last one, if this
/// thread is recording: `None` when it is not.
fn add_node(
    add: impl FnOnce(cuda::CUgraph, &[cuda::CUgraphNode], cuda::CUcontext) -> Result<cuda::CUgraphNode>,
) -> Option<Result<()>> {
    RECORDING.with_borrow_mut(|r| {
        let r = r.as_mut()?;
        let deps = if r.last.is_null() { &[][..] } else { std::slice::from_ref(&r.last) };
        Some(add(r.graph, deps, r.context).map(|node| r.last = node))
    })
}

/// Records a launch of `function` (its parameters copied now) if this thread is recording.
pub(crate) fn record_kernel(
    function: cuda::CUfunction,
    grid: (u32, u32),
    block: (u32, u32),
    shared_bytes: u32,
    args: *mut *mut c_void,
) -> Option<Result<()>> {
    if !recording() {
        return None;
    }
    let params = cuda::CUDA_KERNEL_NODE_PARAMS {
        func: function,
        gridDimX: grid.0,
        gridDimY: grid.1,
        gridDimZ: 1,
        blockDimX: block.0,
        blockDimY: block.1,
        blockDimZ: 1,
        sharedMemBytes: shared_bytes,
        kernelParams: args,
        extra: std::ptr::null_mut(),
    };
    // SAFETY: `graph` and `deps` are the recording's; `params` names a loaded function and its
    // parameters, which the driver copies, and the launcher's caller vouches for their addresses.
    add_node(|graph, deps, _| unsafe { driver::graph_add_kernel_node(graph, deps, &params) })
}

/// Records a device-to-device copy of `bytes` bytes if this thread is recording.
pub(crate) fn record_copy(dst: cuda::CUdeviceptr, src: cuda::CUdeviceptr, bytes: usize) -> Option<Result<()>> {
    if !recording() {
        return None;
    }
    let device = cuda::CUmemorytype::CU_MEMORYTYPE_DEVICE;
    let copy = cuda::CUDA_MEMCPY3D {
        srcXInBytes: 0,
        srcY: 0,
        srcZ: 0,
        srcLOD: 0,
        srcMemoryType: device,
        srcHost: std::ptr::null(),
        srcDevice: src,
        srcArray: std::ptr::null_mut(),
        reserved0: std::ptr::null_mut(),
        srcPitch: 0,
        srcHeight: 0,
        dstXInBytes: 0,
        dstY: 0,
        dstZ: 0,
        dstLOD: 0,
        dstMemoryType: device,
        dstHost: std::ptr::null_mut(),
        dstDevice: dst,
        dstArray: std::ptr::null_mut(),
        reserved1: std::ptr::null_mut(),
        dstPitch: 0,
        dstHeight: 0,
        WidthInBytes: bytes,
        Height: 1,
        Depth: 1,
    };
    // SAFETY: `graph`, `deps` and `context` are the recording's; both ranges are the caller's
    // live device memory of `bytes` bytes.
    add_node(|graph, deps, context| unsafe { driver::graph_add_memcpy_node(graph, deps, &copy, context) })
}

/// A captured, instantiated CUDA graph.
///
/// ```no_run
/// # use rope_cuda::{Graph, Kernels, Rope, RopeConfig};
/// # use cust::stream::{Stream, StreamFlags};
/// # fn step(rope: &Rope, stream: &Stream) -> rope_cuda::Result<()> { Ok(()) }
/// let _ctx = cust::quick_init()?;
/// let kernels = Kernels::load()?;
/// let stream = Stream::new(StreamFlags::NON_BLOCKING, None)?;
/// let rope = Rope::new(&kernels, RopeConfig::new(128, 8192))?;
/// let graph = Graph::capture(&stream, || step(&rope, &stream))?;
/// for _ in 0..3 {
///     // write this step's positions into the captured buffers, then:
///     // SAFETY: `rope` and every buffer `step` used are alive until the stream is synchronised.
///     unsafe { graph.launch(&stream)? };
/// }
/// stream.synchronize()?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct Graph {
    graph: cuda::CUgraph,
    exec: cuda::CUgraphExec,
}

// SAFETY: graph handles may be used from any thread while their context lives; launches
// through one exec from several threads are serialised by the driver.
unsafe impl Send for Graph {}
// SAFETY: as above.
unsafe impl Sync for Graph {}

impl Graph {
    /// Captures what `queue` queues on `stream` (thread-local capture mode) and instantiates
    /// it. Nothing runs during capture. If `queue` fails, the capture is ended and discarded
    /// and its error returned.
    ///
    /// Stream capture is a state of the whole context: while it lasts, another thread of the
    /// same context must not make a call that synchronises it — a synchronous copy, freeing
    /// memory, loading or unloading a module (creating or dropping a [`Kernels`](crate::Kernels),
    /// [`Rope`](crate::Rope) or [`KvUpdate`](crate::seed::KvUpdate)). On the H200 such calls made
    /// the other thread's call fail, ended the capture with `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`,
    /// or crashed the process inside the driver's `cuModuleUnload`. Where other threads work
    /// in the context, use [`Graph::record`].
    ///
    /// ```
    /// # let Ok(_ctx) = cust::quick_init() else { return Ok(()) }; // no GPU: nothing to run
    /// # let kernels = rope_cuda::Kernels::load()?;
    /// # let stream = cust::stream::Stream::new(cust::stream::StreamFlags::NON_BLOCKING, None)?;
    /// use cust::memory::DeviceBuffer;
    /// use rope_cuda::{Graph, Layout, Positions, Rope, RopeArgs, RopeConfig, TensorMut};
    /// let rope = Rope::new(&kernels, RopeConfig::new(64, 4096))?;
    /// let mut q = DeviceBuffer::from_slice(&vec![1.0f32; 4 * 64])?;
    /// let ids = DeviceBuffer::from_slice(&[0i32, 1, 2, 3])?;
    /// let graph = Graph::capture(&stream, || {
    ///     let mut qv = TensorMut::new(&mut q, Layout::bshd(1, 4, 1, 64));
    ///     rope.apply(RopeArgs::in_place(&mut qv, Positions::ids_i32(&ids)), &stream)
    /// })?;
    /// for _ in 0..3 {
    ///     // SAFETY: `rope`, `q` and `ids` outlive the replays, which the synchronisation below
    ///     // waits for.
    ///     unsafe { graph.launch(&stream)? };
    /// }
    /// stream.synchronize()?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn capture(stream: &Stream, queue: impl FnOnce() -> Result<()>) -> Result<Graph> {
        let raw = stream.as_inner();
        let mode = cuda::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        // SAFETY: `raw` is a live stream; capture ends below on every path.
        unsafe { driver::stream_begin_capture(raw, mode) }?;
        let queued = queue();
        // SAFETY: ends the capture begun above, on this thread.
        let (graph, ended) = unsafe { driver::stream_end_capture(raw) };
        Graph::instantiate(graph, queued.and(ended))
    }

    /// Records the launches this library's calls in `queue` make into a new graph, node after
    /// node in the order they are made, instead of queueing them (the calls' `stream`
    /// arguments are not used), and instantiates it. No stream is captured, so other threads
    /// may use the context meanwhile as they like. Only this library's operations are
    /// recorded: anything else `queue` does runs as it would. If `queue` fails, the graph is
    /// discarded and its error returned.
    ///
    /// ```
    /// # let Ok(_ctx) = cust::quick_init() else { return Ok(()) }; // no GPU: nothing to run
    /// # let kernels = rope_cuda::Kernels::load()?;
    /// # let stream = cust::stream::Stream::new(cust::stream::StreamFlags::NON_BLOCKING, None)?;
    /// use cust::memory::DeviceBuffer;
    /// use rope_cuda::{Graph, Layout, Positions, Rope, RopeArgs, RopeConfig, TensorMut};
    /// let rope = Rope::new(&kernels, RopeConfig::new(64, 4096))?;
    /// let mut q = DeviceBuffer::from_slice(&vec![1.0f32; 4 * 64])?;
    /// let offsets = DeviceBuffer::from_slice(&[100i64])?;
    /// // The calls' stream is not used while recording: the launches become nodes of the graph.
    /// let graph = Graph::record(|| {
    ///     let mut qv = TensorMut::new(&mut q, Layout::bshd(1, 4, 1, 64));
    ///     rope.apply(RopeArgs::in_place(&mut qv, Positions::offsets_i64(&offsets)), &stream)
    /// })?;
    /// // SAFETY: `rope`, `q` and `offsets` outlive the replay, which the synchronisation waits for.
    /// unsafe { graph.launch(&stream)? };
    /// stream.synchronize()?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn record(queue: impl FnOnce() -> Result<()>) -> Result<Graph> {
        if RECORDING.with_borrow(Option::is_some) {
            return Err(Error::NotCapturable("Graph::record inside Graph::record"));
        }
        let graph = driver::graph_create()?;
        let context = match driver::ctx_get_current() {
            Ok(context) => context,
            Err(e) => return Graph::instantiate(graph, Err(e)),
        };
        /// Ends the recording however `queue` returns (a panic included).
        struct Stop;
        impl Drop for Stop {
            fn drop(&mut self) {
                RECORDING.set(None);
            }
        }
        RECORDING.set(Some(Recording { graph, last: std::ptr::null_mut(), context }));
        let stop = Stop;
        let queued = queue();
        drop(stop);
        Graph::instantiate(graph, queued)
    }

    /// Instantiates `graph` after `made` (what making it returned), or destroys it (when not
    /// null) and returns the error.
    fn instantiate(graph: cuda::CUgraph, made: Result<()>) -> Result<Graph> {
        let destroy = |graph: cuda::CUgraph| {
            if !graph.is_null() {
                // SAFETY: `graph` came from the capture or recording and is not used again.
                let _ = unsafe { driver::graph_destroy(graph) };
            }
        };
        if let Err(e) = made {
            destroy(graph);
            return Err(e);
        }
        // SAFETY: `graph` is a valid graph.
        match unsafe { driver::graph_instantiate_with_flags(graph, 0) } {
            Ok(exec) => Ok(Graph { graph, exec }),
            Err(e) => {
                destroy(graph);
                Err(e)
            }
        }
    }

    /// Queues one replay on `stream`.
    ///
    /// Replaying without `unsafe` does not compile:
    ///
    /// ```compile_fail,E0133
    /// # fn replay(graph: &rope_cuda::Graph, stream: &cust::stream::Stream) -> rope_cuda::Result<()> {
    /// graph.launch(stream)
    /// # }
    /// ```
    ///
    /// # Safety
    /// Every device buffer the recorded or captured calls named is still allocated, and stays
    /// so until the replay completes on `stream`: the caller's inputs, outputs, positions, slot
    /// mappings and caches, and the library objects whose tables and error records the calls
    /// used (the [`Rope`](crate::Rope)s and reference updates, and through them their
    /// [`Kernels`](crate::Kernels)). A graph replays addresses: a freed buffer would be read or
    /// written all the same, and so would whatever now occupies its memory.
    pub unsafe fn launch(&self, stream: &Stream) -> Result<()> {
        // SAFETY: `exec` lives as long as `self`; the caller keeps the buffers it names alive.
        unsafe { driver::graph_launch(self.exec, stream.as_inner()) }
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        // SAFETY: both handles came from `capture` and are destroyed once. Replays already
        // queued complete first (the driver defers the release).
        unsafe {
            let _ = driver::graph_exec_destroy(self.exec);
            let _ = driver::graph_destroy(self.graph);
        }
    }
}
