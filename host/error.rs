//! The crate's one error type.

use cust::error::CudaError;

/// What is wrong with a model's `config.json` ([`crate::RopeConfig::from_hf_config`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// Not JSON, or not a JSON object at the top.
    #[error("not a JSON object: {0}")]
    Json(String),
    /// A field the configuration needs is absent.
    #[error("missing field `{0}`")]
    Missing(String),
    /// A field has the wrong JSON type or an impossible value.
    #[error("field `{field}`: {problem}")]
    Invalid {
        /// The field's name (with its parent, for nested fields).
        field: String,
        /// What is wrong with it.
        problem: String,
    },
    /// `rope_type` (or `type`) names a scaling this crate does not implement.
    #[error("unknown rope_type `{0}`")]
    UnknownRopeType(String),
    /// The parameters differ per layer type; name one (`full_attention`, …).
    #[error("rope parameters differ per layer type ({available}); choose one with from_hf_config_layer")]
    LayerTypeNeeded {
        /// The layer types the config defines, comma-separated.
        available: String,
    },
    /// The layer type asked for is not in the config.
    #[error("no rope parameters for layer type `{asked}` (the config has: {available})")]
    NoSuchLayerType {
        /// The layer type asked for.
        asked: String,
        /// The layer types the config defines, comma-separated.
        available: String,
    },
}

/// Everything that can go wrong in `rope-cuda`.
///
/// Input errors are detected on the host before any launch, and nothing is written when one
/// is returned.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A tensor has the wrong number of dimensions.
    #[error("{what}: expected a rank-{expected} shape, got {got:?}")]
    Rank {
        /// Which tensor.
        what: &'static str,
        /// The rank the operation takes.
        expected: usize,
        /// The shape that was passed.
        got: Vec<usize>,
    },
    /// Two tensors disagree on an axis that must match, or an axis has the wrong extent.
    #[error("{what}: axis {axis} is {got}, expected {expected}")]
    Shape {
        /// Which tensor.
        what: &'static str,
        /// Which axis.
        axis: &'static str,
        /// The extent it must have.
        expected: usize,
        /// The extent it has.
        got: usize,
    },
    /// A buffer's length is not the number of elements its shape describes.
    #[error("{what}: shape {shape:?} needs {expected} elements, but the buffer holds {got}")]
    Length {
        /// Which tensor.
        what: &'static str,
        /// The shape that was passed.
        shape: Vec<usize>,
        /// Product of the shape.
        expected: usize,
        /// Length of the buffer.
        got: usize,
    },
    /// The head dimension is zero or odd.
    #[error("head_dim {head_dim} must be even and at least 2")]
    HeadDim {
        /// The rejected head dimension.
        head_dim: usize,
    },
    /// The rotary dimension is zero, odd, or larger than the head dimension.
    #[error("rotary_dim {rotary_dim} must be even, at least 2 and at most head_dim {head_dim}")]
    RotaryDim {
        /// The rejected rotary dimension.
        rotary_dim: usize,
        /// The head dimension.
        head_dim: usize,
    },
    /// A tensor's element type is not the configuration's.
    #[error("dtype {got:?} given, but this Rope was configured for {expected:?}")]
    DType {
        /// The configured type.
        expected: crate::DType,
        /// The type given.
        got: crate::DType,
    },
    /// A view reaches past the end of its buffer.
    #[error("{what}: the view reaches element {extent} but the buffer holds {len}")]
    OutOfBounds {
        /// Which tensor.
        what: &'static str,
        /// One past the last element the view reaches (`usize::MAX` on overflow).
        extent: usize,
        /// Elements in the buffer.
        len: usize,
    },
    /// A view that is written has elements sharing an address.
    #[error("{what}: the view is written but its rows overlap (strides {strides:?} for shape {shape:?})")]
    Overlap {
        /// Which tensor.
        what: &'static str,
        /// Its shape.
        shape: [usize; 4],
        /// Its strides.
        strides: [usize; 3],
    },
    /// Two tensors of one launch share memory where one of them is written.
    #[error("{a} and {b} share memory, and at least one of them is written")]
    Aliasing {
        /// One tensor.
        a: &'static str,
        /// The other.
        b: &'static str,
    },
    /// q is rotated in place and k out of place, or the reverse.
    #[error("q and k must both be rotated in place or both out of place")]
    InPlaceMismatch,
    /// A device address is not aligned to its element size.
    #[error("{what}: device address {address:#x} is not aligned to {align} bytes")]
    Alignment {
        /// Which buffer.
        what: &'static str,
        /// The address of its first element the kernel reads.
        address: u64,
        /// The alignment required.
        align: usize,
    },
    /// Tokens were given positions outside the table; they were left untouched.
    #[error(
        "{count} token(s) had positions outside 0..{max_position}; the first is token {token} at position {position}"
    )]
    PositionOutOfRange {
        /// The lowest offending token index (`b * seq + s`).
        token: usize,
        /// Its position (saturated to the i32 range).
        position: i64,
        /// Number of positions the table holds.
        max_position: usize,
        /// Number of offending tokens since the record was last read.
        count: u64,
    },
    /// Tokens were given cache slots outside the cache (other than `-1`, padding); their
    /// keys and values were not written.
    #[error("{count} token(s) had cache slots outside 0..{num_slots}; the first is token {token} at slot {slot}")]
    SlotOutOfRange {
        /// The lowest offending token index.
        token: usize,
        /// Its slot (saturated to the i32 range).
        slot: i64,
        /// Number of slots in the cache of the last call (0 if unknown).
        num_slots: u64,
        /// Number of offending tokens since the record was last read.
        count: u64,
    },
    /// The slot mapping does not fit the cache: a paged cache needs one, a contiguous cache
    /// takes positions instead.
    #[error("{0}")]
    SlotMapping(&'static str),
    /// The rotary base is not a finite number greater than zero.
    #[error("base {base} must be finite and greater than 0")]
    Base {
        /// The rejected base.
        base: f64,
    },
    /// A RoPE scaling parameter is out of its range (not finite, not positive, …).
    #[error("rope scaling: {field} = {value} is out of range")]
    Scaling {
        /// The parameter's name in `config.json`.
        field: &'static str,
        /// The rejected value.
        value: f64,
    },
    /// A per-pair list of a RoPE scaling (LongRoPE's factors) has the wrong length.
    #[error("rope scaling: {field} has {got} entries, expected one per pair: {expected}")]
    ScalingLength {
        /// The parameter's name.
        field: &'static str,
        /// Pairs of the rotary dimension.
        expected: usize,
        /// Entries given.
        got: usize,
    },
    /// A model's `config.json` could not be read as a RoPE configuration.
    #[error("config.json: {0}")]
    Config(#[from] ConfigError),
    /// The call needs positions beyond the cos/sin table.
    #[error("positions up to {needed} are needed, but the table covers only 0..{max_position}")]
    MaxPosition {
        /// One past the largest position the call needs.
        needed: usize,
        /// Number of positions the table holds.
        max_position: usize,
    },
    /// A size exceeds what one launch can address.
    #[error("{what} = {value} exceeds the limit {limit}")]
    TooLarge {
        /// Which quantity.
        what: &'static str,
        /// Its value.
        value: u64,
        /// The largest accepted value.
        limit: u64,
    },
    /// A kernel is missing from the embedded PTX, or the module failed to load.
    #[error("loading kernel {name} failed: {source}")]
    KernelLoad {
        /// The kernel's entry-point name.
        name: &'static str,
        /// The driver's error.
        source: CudaError,
    },
    /// The kernel list has no entry point for what a launch needs (a bug of this library:
    /// every key its planners make is tested to exist).
    #[error("no kernel for {key}")]
    NoKernel {
        /// The kernel key asked for.
        key: String,
    },
    /// A buffer lives on another device than the kernels (and the `Rope` or `KvUpdate`)
    /// that would use it.
    #[error("{what} is memory of device {got}; the kernels were loaded on device {expected}")]
    Device {
        /// The buffer.
        what: &'static str,
        /// The kernels' device ordinal.
        expected: i32,
        /// The buffer's device ordinal.
        got: i32,
    },
    /// A call that cannot go into a CUDA graph was made while capturing or recording one.
    #[error("{0} cannot be captured or recorded into a CUDA graph")]
    NotCapturable(&'static str),
    /// The CUDA driver reported an error through cust.
    #[error("CUDA driver error: {0}")]
    Cuda(#[from] CudaError),
    /// A driver call made directly (not through cust) failed.
    #[error("{call} failed with CUresult {code}")]
    Driver {
        /// The driver function.
        call: &'static str,
        /// Its `CUresult`.
        code: u32,
    },
}

/// Maps a raw `CUresult` of driver function `call` to `Ok` or [`Error::Driver`].
pub(crate) fn driver(call: &'static str, result: cust::sys::CUresult) -> Result<()> {
    match result {
        cust::sys::CUresult::CUDA_SUCCESS => Ok(()),
        other => Err(Error::Driver { call, code: other as u32 }),
    }
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
