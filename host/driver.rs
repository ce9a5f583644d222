//! The crate's raw CUDA driver calls, one function each: out-parameters become return values,
//! a failed `CUresult` becomes [`Error::Driver`] naming the call.
//!
//! Each function writes its driver symbol once, in [`call!`]. The name reported is the
//! driver API's documented one: the symbol less a `_v2` suffix (`cuCtxPushCurrent` for
//! `cuCtxPushCurrent_v2`), as the error strings were before this layer; other symbols are
//! reported as they are (`cuGraphInstantiateWithFlags`, formerly reported as
//! `cuGraphInstantiate`).
//!
//! Functions that take a handle, or an address the driver reads or writes through, are
//! `unsafe`: a stale handle or a bad address is undefined behaviour for the driver, not an
//! error. Those that take none, or only values the driver checks (a device ordinal, an
//! address it only looks up), are safe.

use std::ffi::c_void;

use cust::sys as cuda;

use crate::error::{Error, Result};

/// Calls the driver function `f` (a symbol of `cust::sys`) with `args`: `Ok` on
/// `CUDA_SUCCESS`, else [`Error::Driver`] with the function's [`reported`] name. The call is
/// an `unsafe` block: each use sits under a `// SAFETY:` line of its own.
macro_rules! call {
    ($f:ident($($arg:expr),* $(,)?)) => {
        check(
            const { reported(stringify!($f)) },
            // SAFETY: each use's own SAFETY line (clippy finds only this one) says why its call
            // is sound.
            unsafe { cuda::$f($($arg),*) },
        )
    };
}

/// The documented name of driver symbol `symbol`: the symbol less a `_v2` suffix.
const fn reported(symbol: &'static str) -> &'static str {
    match symbol.as_bytes() {
        [head @ .., b'_', b'v', b'2'] => match std::str::from_utf8(head) {
            Ok(name) => name,
            Err(_) => symbol,
        },
        _ => symbol,
    }
}

/// Maps `result`, returned by driver function `call`, to `Ok` or [`Error::Driver`].
fn check(call: &'static str, result: cuda::CUresult) -> Result<()> {
    match result {
        cuda::CUresult::CUDA_SUCCESS => Ok(()),
        other => Err(Error::Driver { call, code: other as u32 }),
    }
}

/// The calling thread's current context (null when none).
pub(crate) fn ctx_get_current() -> Result<cuda::CUcontext> {
    let mut context = std::ptr::null_mut();
    // SAFETY: writes one handle into `context`.
    call!(cuCtxGetCurrent(&mut context)).map(|()| context)
}

/// The device of the current context.
pub(crate) fn ctx_get_device() -> Result<cuda::CUdevice> {
    let mut device = 0;
    // SAFETY: writes one integer; without a context the driver returns an error.
    call!(cuCtxGetDevice(&mut device)).map(|()| device)
}

/// Makes `context` current on the calling thread, above the one that was.
///
/// # Safety
/// `context` is a live context; the caller pops it ([`ctx_pop_current`]) when done.
pub(crate) unsafe fn ctx_push_current(context: cuda::CUcontext) -> Result<()> {
    // SAFETY: the caller's contract (`# Safety`).
    call!(cuCtxPushCurrent_v2(context))
}

/// Pops the calling thread's current context, returning it.
pub(crate) fn ctx_pop_current() -> Result<cuda::CUcontext> {
    let mut popped = std::ptr::null_mut();
    // SAFETY: writes one handle into `popped`; with no context current the driver returns an
    // error.
    call!(cuCtxPopCurrent_v2(&mut popped)).map(|()| popped)
}

/// The number of devices the process sees.
pub(crate) fn device_get_count() -> Result<i32> {
    let mut count = 0;
    // SAFETY: writes one integer.
    call!(cuDeviceGetCount(&mut count)).map(|()| count)
}

/// Attribute `attribute` of device `device` (an ordinal the driver checks).
pub(crate) fn device_get_attribute(attribute: cuda::CUdevice_attribute, device: cuda::CUdevice) -> Result<i32> {
    let mut value = 0;
    // SAFETY: writes one integer; an unknown device is an error.
    call!(cuDeviceGetAttribute(&mut value, attribute, device)).map(|()| value)
}

/// The most threads a block of `function` (a loaded entry point) may have: 1024, or fewer
/// where its registers allow fewer.
pub(crate) fn func_max_threads(function: cuda::CUfunction) -> Result<i32> {
    let mut value = 0;
    let which = cuda::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK;
    // SAFETY: writes one integer; `function` is a loaded entry point.
    call!(cuFuncGetAttribute(&mut value, which, function)).map(|()| value)
}

/// The ordinal of the device whose memory `address` is; `None` where the driver does not know
/// the address (`CUDA_ERROR_INVALID_VALUE`).
pub(crate) fn pointer_get_device_ordinal(address: cuda::CUdeviceptr) -> Result<Option<i32>> {
    let mut ordinal: i32 = -1;
    let attribute = cuda::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL;
    // SAFETY: the attribute is one int, written into `ordinal`; the driver checks `address`.
    let found = call!(cuPointerGetAttribute((&raw mut ordinal).cast(), attribute, address));
    match found {
        Ok(()) => Ok(Some(ordinal)),
        Err(Error::Driver { code, .. }) if code == cuda::CUresult::CUDA_ERROR_INVALID_VALUE as u32 => Ok(None),
        Err(e) => Err(e),
    }
}

/// Blocks until everything queued on `stream` has completed.
///
/// # Safety
/// `stream` is a live stream (or null, the legacy default stream) of the current context.
pub(crate) unsafe fn stream_synchronize(stream: cuda::CUstream) -> Result<()> {
    // SAFETY: the caller's contract (`# Safety`).
    call!(cuStreamSynchronize(stream))
}

/// Whether `stream` is being captured.
///
/// # Safety
/// As [`stream_synchronize`].
pub(crate) unsafe fn stream_is_capturing(stream: cuda::CUstream) -> Result<cuda::CUstreamCaptureStatus> {
    let mut status = cuda::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: the caller's contract; writes one status into `status`.
    call!(cuStreamIsCapturing(stream, &mut status)).map(|()| status)
}

/// Begins capturing `stream` in capture mode `mode`.
///
/// # Safety
/// `stream` is a live stream of the current context; the caller ends the capture
/// ([`stream_end_capture`]) on every path.
pub(crate) unsafe fn stream_begin_capture(stream: cuda::CUstream, mode: cuda::CUstreamCaptureMode) -> Result<()> {
    // SAFETY: the caller's contract (`# Safety`).
    call!(cuStreamBeginCapture_v2(stream, mode))
}

/// Ends the capture of `stream`: the graph the driver wrote (null when none, as after an
/// invalidated capture) and the call's result, so that the caller can destroy a graph
/// whatever the result.
///
/// # Safety
/// `stream` is a live stream being captured by this thread.
pub(crate) unsafe fn stream_end_capture(stream: cuda::CUstream) -> (cuda::CUgraph, Result<()>) {
    let mut graph = std::ptr::null_mut();
    // SAFETY: the caller's contract; writes one handle into `graph`.
    let ended = call!(cuStreamEndCapture(stream, &mut graph));
    (graph, ended)
}

/// Launches `function` on `stream` with a `grid` of `block`s (z = 1 for both),
/// `shared_bytes` of dynamic shared memory and its parameters at `args`.
///
/// # Safety
/// `function` is a loaded function of `stream`'s context; `args` points to one pointer per
/// parameter of `function`, each to a value of that parameter's type; every address those
/// values hold is valid for what the kernel does with this geometry.
pub(crate) unsafe fn launch_kernel(
    function: cuda::CUfunction,
    grid: (u32, u32),
    block: (u32, u32),
    shared_bytes: u32,
    stream: cuda::CUstream,
    args: *mut *mut c_void,
) -> Result<()> {
    // SAFETY: the caller's contract (`# Safety`).
    call!(cuLaunchKernel(
        function,
        grid.0,
        grid.1,
        1,
        block.0,
        block.1,
        1,
        shared_bytes,
        stream,
        args,
        std::ptr::null_mut(),
    ))
}

/// Queues a copy of `bytes` bytes from device address `src` to `dst` on `stream`.
///
/// # Safety
/// `src` and `dst` are each `bytes` bytes of live device memory that stay so until the copy
/// completes, and `dst` is not read or written meanwhile by anything not ordered with it;
/// `stream` is a live stream of their context.
pub(crate) unsafe fn memcpy_dtod_async(
    dst: cuda::CUdeviceptr,
    src: cuda::CUdeviceptr,
    bytes: usize,
    stream: cuda::CUstream,
) -> Result<()> {
    // SAFETY: the caller's contract (`# Safety`).
    call!(cuMemcpyDtoDAsync_v2(dst, src, bytes, stream))
}

/// Copies `src` to device address `dst`, synchronously.
///
/// # Safety
/// `dst` is `size_of_val(src)` bytes of live device memory of the current context, which no
/// queued work uses.
pub(crate) unsafe fn memcpy_htod<T: Copy>(dst: cuda::CUdeviceptr, src: &[T]) -> Result<()> {
    // SAFETY: `src` is `size_of_val(src)` bytes of host memory; the caller's contract covers
    // `dst`.
    call!(cuMemcpyHtoD_v2(dst, src.as_ptr().cast(), std::mem::size_of_val(src)))
}

/// A new, empty graph.
pub(crate) fn graph_create() -> Result<cuda::CUgraph> {
    let mut graph = std::ptr::null_mut();
    // SAFETY: writes one handle into `graph`.
    call!(cuGraphCreate(&mut graph, 0)).map(|()| graph)
}

/// `(pointer, count)` of `nodes`, the pointer null when there are none.
fn dependencies(nodes: &[cuda::CUgraphNode]) -> (*const cuda::CUgraphNode, usize) {
    match nodes {
        [] => (std::ptr::null(), 0),
        _ => (nodes.as_ptr(), nodes.len()),
    }
}

/// Adds a kernel launch described by `params` to `graph`, after `dependencies`; returns the
/// new node. The driver copies `params` and the parameter values it points to.
///
/// # Safety
/// `graph` is a live graph and `dependencies` are nodes of it; `params` satisfies
/// [`launch_kernel`]'s contract for its function, parameters and geometry whenever the graph
/// is launched.
pub(crate) unsafe fn graph_add_kernel_node(
    graph: cuda::CUgraph,
    dependencies: &[cuda::CUgraphNode],
    params: &cuda::CUDA_KERNEL_NODE_PARAMS,
) -> Result<cuda::CUgraphNode> {
    let (deps, count) = self::dependencies(dependencies);
    let mut node = std::ptr::null_mut();
    // SAFETY: the caller's contract; `deps` and `count` describe `dependencies`; writes one
    // handle into `node`.
    call!(cuGraphAddKernelNode(&mut node, graph, deps, count, params)).map(|()| node)
}

/// Adds the copy `copy` to `graph` in `context`, after `dependencies`; returns the new node.
///
/// # Safety
/// `graph` is a live graph and `dependencies` are nodes of it; `context` is a live context;
/// `copy` names memory that satisfies [`memcpy_dtod_async`]'s contract whenever the graph is
/// launched.
pub(crate) unsafe fn graph_add_memcpy_node(
    graph: cuda::CUgraph,
    dependencies: &[cuda::CUgraphNode],
    copy: &cuda::CUDA_MEMCPY3D,
    context: cuda::CUcontext,
) -> Result<cuda::CUgraphNode> {
    let (deps, count) = self::dependencies(dependencies);
    let mut node = std::ptr::null_mut();
    // SAFETY: as in `graph_add_kernel_node`.
    call!(cuGraphAddMemcpyNode(&mut node, graph, deps, count, copy, context)).map(|()| node)
}

/// Instantiates `graph` with `flags`; returns the executable graph.
///
/// # Safety
/// `graph` is a live graph.
pub(crate) unsafe fn graph_instantiate_with_flags(graph: cuda::CUgraph, flags: u64) -> Result<cuda::CUgraphExec> {
    let mut exec = std::ptr::null_mut();
    // SAFETY: the caller's contract; writes one handle into `exec`.
    call!(cuGraphInstantiateWithFlags(&mut exec, graph, flags)).map(|()| exec)
}

/// Queues one launch of `exec` on `stream`.
///
/// # Safety
/// `exec` is a live executable graph and `stream` a live stream of its context; every
/// address the graph's nodes name is valid for them until the launch completes.
pub(crate) unsafe fn graph_launch(exec: cuda::CUgraphExec, stream: cuda::CUstream) -> Result<()> {
    // SAFETY: the caller's contract (`# Safety`).
    call!(cuGraphLaunch(exec, stream))
}

/// Destroys executable graph `exec` (launches already queued complete first).
///
/// # Safety
/// `exec` is a live executable graph, not used again.
pub(crate) unsafe fn graph_exec_destroy(exec: cuda::CUgraphExec) -> Result<()> {
    // SAFETY: the caller's contract (`# Safety`).
    call!(cuGraphExecDestroy(exec))
}

/// Destroys `graph`.
///
/// # Safety
/// `graph` is a live graph, not used again.
pub(crate) unsafe fn graph_destroy(graph: cuda::CUgraph) -> Result<()> {
    // SAFETY: the caller's contract (`# Safety`).
    call!(cuGraphDestroy(graph))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reported_names_drop_only_a_v2_suffix() {
        assert_eq!(reported("cuCtxPushCurrent_v2"), "cuCtxPushCurrent");
        assert_eq!(reported("cuMemcpyDtoDAsync_v2"), "cuMemcpyDtoDAsync");
        assert_eq!(reported("cuStreamSynchronize"), "cuStreamSynchronize");
        assert_eq!(reported("cuGraphInstantiateWithFlags"), "cuGraphInstantiateWithFlags");
        assert_eq!(reported("_v2"), "");
    }

    #[test]
    fn a_failed_call_names_the_function() {
        let e = check(reported("cuCtxPopCurrent_v2"), cuda::CUresult::CUDA_ERROR_INVALID_CONTEXT);
        assert_eq!(
            e,
            Err(Error::Driver { call: "cuCtxPopCurrent", code: cuda::CUresult::CUDA_ERROR_INVALID_CONTEXT as u32 })
        );
        assert_eq!(check("cuStreamSynchronize", cuda::CUresult::CUDA_SUCCESS), Ok(()));
    }
}
