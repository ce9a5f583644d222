//! CUDA graphs: capture the launches of a step once, replay them with one call.
//!
//! `Rope::apply*`, `Rope::append_kv*` (up to [`crate::KV_SCAN_MAX_TOKENS`] tokens) and
//! `KvUpdate::update_kv_cache` queue their work without allocating, synchronising or looking
//! anything up, so they may be captured. Not capturable: a configuration with `checked` set
//! (it synchronises), `check_errors` (it synchronises), and `append_kv` calls above
//! `KV_SCAN_MAX_TOKENS` tokens whose owner array must first grow (the first such call
//! allocates; make one before capturing).
//!
//! A graph holds the addresses it was captured with, not the values behind them: write new
//! positions, slots or inputs into the same buffers between replays.

use cust::stream::Stream;
use cust::sys as cuda;

use crate::error::{driver, Result};

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
///     graph.launch(&stream)?;
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
    /// Captures what `queue` queues on `stream` (thread-local capture mode: other threads'
    /// CUDA calls are not affected) and instantiates it. Nothing runs during capture. If
    /// `queue` fails, the capture is ended and discarded and its error returned.
    pub fn capture(stream: &Stream, queue: impl FnOnce() -> Result<()>) -> Result<Graph> {
        let raw = stream.as_inner();
        let mode = cuda::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        // SAFETY: `raw` is a live stream; capture ends below on every path.
        driver("cuStreamBeginCapture", unsafe { cuda::cuStreamBeginCapture_v2(raw, mode) })?;
        let queued = queue();
        let mut graph = std::ptr::null_mut();
        // SAFETY: ends the capture begun above, writing the graph (null if it was invalidated).
        let ended = driver("cuStreamEndCapture", unsafe { cuda::cuStreamEndCapture(raw, &mut graph) });
        let destroy = |graph: cuda::CUgraph| {
            if !graph.is_null() {
                // SAFETY: `graph` came from the capture and is not used again.
                unsafe { cuda::cuGraphDestroy(graph) };
            }
        };
        if let Err(e) = queued.and(ended) {
            destroy(graph);
            return Err(e);
        }
        let mut exec = std::ptr::null_mut();
        // SAFETY: `graph` is a valid graph; `exec` receives the instance.
        if let Err(e) = driver("cuGraphInstantiate", unsafe { cuda::cuGraphInstantiateWithFlags(&mut exec, graph, 0) })
        {
            destroy(graph);
            return Err(e);
        }
        Ok(Graph { graph, exec })
    }

    /// Queues one replay on `stream`.
    pub fn launch(&self, stream: &Stream) -> Result<()> {
        // SAFETY: `exec` lives as long as `self`; the buffers it names are the caller's to
        // keep alive (as for the calls it was captured from).
        driver("cuGraphLaunch", unsafe { cuda::cuGraphLaunch(self.exec, stream.as_inner()) })
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        // SAFETY: both handles came from `capture` and are destroyed once. Replays already
        // queued complete first (the driver defers the release).
        unsafe {
            cuda::cuGraphExecDestroy(self.exec);
            cuda::cuGraphDestroy(self.graph);
        }
    }
}
