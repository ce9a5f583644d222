//! The PTX module and its entry points, loaded once per CUDA context.

use std::ffi::c_void;

use cust::module::Module;
use cust::sys as cuda;

use crate::error::{driver, Error, Result};

/// The PTX of every kernel, compiled from `kernels/` by `build.rs` for
/// [`ARCH`](crate::ARCH).
pub static PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/rope_cuda_kernels.ptx"));

/// The kernels' entry points, resolved once when the module is loaded.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Functions {
    /// `rope_{style}_{dtype}_{s,v,p}`, indexed `[style][dtype][width]` in the order of
    /// [`ENTRY_POINTS`]: NeoX, GPT-J; f32, f16, bf16; the widths of `rope::Width`.
    pub rope: [[[cuda::CUfunction; 3]; 3]; 2],
    /// `kv_{style}_{dtype}_{s,v,d,p}`, indexed `[style][dtype][width]` in the order of
    /// [`KV_ENTRY_POINTS`]: NeoX, GPT-J; f32, f16, bf16; the widths of `kv::Width`.
    pub kv: [[[cuda::CUfunction; 4]; 3]; 2],
    /// `kv_gptj_{f16,bf16}_{s,v,d}_t`: GPT-J with the caller's tables in the element type.
    pub kv_elem_table: [[cuda::CUfunction; 3]; 2],
    /// `kv_claim`.
    pub kv_claim: cuda::CUfunction,
    /// `bench_empty`, `bench_spin` and `bench_touch`, for [`crate::bench`].
    pub bench: [cuda::CUfunction; 3],
}

/// The loaded kernel module of one CUDA context.
///
/// Create one per context with [`Kernels::load`] (the context must be current) and reuse it:
/// launches look nothing up (where several GPUs are visible they ask the driver, once per
/// buffer, that it is memory of this module's device). Launches may come from any thread on
/// which that context is current.
#[derive(Debug)]
pub struct Kernels {
    pub(crate) functions: Functions,
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

impl Kernels {
    /// Loads the embedded PTX into the current context and resolves every entry point.
    pub fn load() -> Result<Self> {
        let module = Module::from_ptx(PTX, &[]).map_err(|source| Error::KernelLoad { name: "module", source })?;
        let function = |name: &'static str| -> Result<cuda::CUfunction> {
            module.get_function(name).map(|f| f.to_raw()).map_err(|source| Error::KernelLoad { name, source })
        };
        let mut rope = [[[std::ptr::null_mut(); 3]; 3]; 2];
        let slots = rope.iter_mut().flatten().flatten();
        for (slot, name) in slots.zip(ENTRY_POINTS) {
            *slot = function(name)?;
        }
        let mut kv = [[[std::ptr::null_mut(); 4]; 3]; 2];
        for (slot, name) in kv.iter_mut().flatten().flatten().zip(KV_ENTRY_POINTS) {
            *slot = function(name)?;
        }
        let mut kv_elem_table = [[std::ptr::null_mut(); 3]; 2];
        for (slot, name) in kv_elem_table.iter_mut().flatten().zip(KV_ELEM_TABLE_ENTRY_POINTS) {
            *slot = function(name)?;
        }
        let bench =
            [function(BENCH_ENTRY_POINTS[0])?, function(BENCH_ENTRY_POINTS[1])?, function(BENCH_ENTRY_POINTS[2])?];
        let functions = Functions { rope, kv, kv_elem_table, kv_claim: function("kv_claim")?, bench };
        let mut context = std::ptr::null_mut();
        // SAFETY: writes the current context handle into `context`.
        driver("cuCtxGetCurrent", unsafe { cuda::cuCtxGetCurrent(&mut context) })?;
        let (mut device, mut devices) = (0, 0);
        // SAFETY: each call writes one integer; a context is current (the module loaded).
        driver("cuCtxGetDevice", unsafe { cuda::cuCtxGetDevice(&mut device) })?;
        driver("cuDeviceGetCount", unsafe { cuda::cuDeviceGetCount(&mut devices) })?;
        Ok(Kernels { functions, context, device, devices, _module: module })
    }

    /// The ordinal of the device this module was loaded on (its context's device).
    pub fn device(&self) -> i32 {
        self.device
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

    /// The CUDA context this module was loaded into.
    pub fn context(&self) -> cuda::CUcontext {
        self.context
    }
}

/// A launch's geometry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Geometry {
    pub grid: (u32, u32),
    pub block: (u32, u32),
}

/// Launches `function` with `params` as its one by-value parameter and `shared_bytes` of
/// dynamic shared memory; while this thread records a graph ([`crate::Graph::record`]), adds
/// the launch to the graph instead.
///
/// # Safety
/// `params` is the struct `function` expects, and every address in it is valid for what the
/// kernel does with the geometry given (the caller's checks say why).
pub(crate) unsafe fn launch<P>(
    function: cuda::CUfunction,
    geometry: Geometry,
    shared_bytes: u32,
    params: &P,
    stream: cuda::CUstream,
) -> Result<()> {
    let mut args = [params as *const P as *mut c_void];
    if let Some(recorded) = crate::graph::record_kernel(function, geometry, shared_bytes, args.as_mut_ptr()) {
        return recorded;
    }
    let (gx, gy) = geometry.grid;
    let (bx, by) = geometry.block;
    driver(
        "cuLaunchKernel",
        cuda::cuLaunchKernel(
            function,
            gx,
            gy,
            1,
            bx,
            by,
            1,
            shared_bytes,
            stream,
            args.as_mut_ptr(),
            std::ptr::null_mut(),
        ),
    )
}

const _: () = assert!(ENTRY_POINTS.len() == 2 * 3 * 3, "one entry point per style, dtype and width");

/// Every entry point of the PTX; [`Kernels::load`] resolves each one.
pub const ENTRY_POINTS: &[&str] = &[
    "rope_neox_f32_s",
    "rope_neox_f32_v",
    "rope_neox_f32_p",
    "rope_neox_f16_s",
    "rope_neox_f16_v",
    "rope_neox_f16_p",
    "rope_neox_bf16_s",
    "rope_neox_bf16_v",
    "rope_neox_bf16_p",
    "rope_gptj_f32_s",
    "rope_gptj_f32_v",
    "rope_gptj_f32_p",
    "rope_gptj_f16_s",
    "rope_gptj_f16_v",
    "rope_gptj_f16_p",
    "rope_gptj_bf16_s",
    "rope_gptj_bf16_v",
    "rope_gptj_bf16_p",
];

/// The KV-cache entry points; [`Kernels::load`] resolves each one.
pub const KV_ENTRY_POINTS: &[&str] = &[
    "kv_neox_f32_s",
    "kv_neox_f32_v",
    "kv_neox_f32_d",
    "kv_neox_f32_p",
    "kv_neox_f16_s",
    "kv_neox_f16_v",
    "kv_neox_f16_d",
    "kv_neox_f16_p",
    "kv_neox_bf16_s",
    "kv_neox_bf16_v",
    "kv_neox_bf16_d",
    "kv_neox_bf16_p",
    "kv_gptj_f32_s",
    "kv_gptj_f32_v",
    "kv_gptj_f32_d",
    "kv_gptj_f32_p",
    "kv_gptj_f16_s",
    "kv_gptj_f16_v",
    "kv_gptj_f16_d",
    "kv_gptj_f16_p",
    "kv_gptj_bf16_s",
    "kv_gptj_bf16_v",
    "kv_gptj_bf16_d",
    "kv_gptj_bf16_p",
];

/// The benchmarks' entry points: an empty kernel, a spin and a one-chunk-a-thread copy
/// ([`crate::bench`]).
pub const BENCH_ENTRY_POINTS: &[&str] = &["bench_empty", "bench_spin", "bench_touch"];

/// The KV-cache entry points reading the caller's tables (GPT-J, 16-bit).
pub const KV_ELEM_TABLE_ENTRY_POINTS: &[&str] = &[
    "kv_gptj_f16_s_t",
    "kv_gptj_f16_v_t",
    "kv_gptj_f16_d_t",
    "kv_gptj_bf16_s_t",
    "kv_gptj_bf16_v_t",
    "kv_gptj_bf16_d_t",
];
