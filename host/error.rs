//! The crate's one error type.

use cust::error::CudaError;

/// What is wrong with a model's `config.json` ([`crate::RopeConfig::from_hf_config`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The text given is not JSON, or not a JSON object at the top. Pass the contents of the
    /// model's `config.json` (the file's text, not its path).
    #[error("not a JSON object: {0}")]
    Json(String),
    /// A field the configuration needs is absent (named). Add it, or build the [`RopeConfig`](crate::RopeConfig)
    /// by hand for a model whose config does not carry it.
    #[error("missing field `{0}`")]
    Missing(String),
    /// A field has the wrong JSON type or an impossible value (named, with what is wrong):
    /// correct it in the config.
    #[error("field `{field}`: {problem}")]
    Invalid {
        /// The field's name (with its parent, for nested fields).
        field: String,
        /// What is wrong with it.
        problem: String,
    },
    /// `rope_type` (or `type`) names a scaling this crate does not implement. The known ones
    /// are those of [`RopeScaling`](crate::RopeScaling); build a configuration by hand (its
    /// frequencies, through [`HostTable::from_frequencies`](crate::HostTable::from_frequencies)) for others.
    #[error("unknown rope_type `{0}`")]
    UnknownRopeType(String),
    /// The config's RoPE parameters differ per layer type: call
    /// [`RopeConfig::from_hf_config_layer`](crate::RopeConfig::from_hf_config_layer) with one
    /// of the types listed, and build one `Rope` per type.
    #[error("rope parameters differ per layer type ({available}); choose one with from_hf_config_layer")]
    LayerTypeNeeded {
        /// The layer types the config defines, comma-separated.
        available: String,
    },
    /// The config's `model_type` is not one whose pairing style this crate has checked
    /// against the model's code (named; empty when the config has none), and strictness was
    /// asked for ([`RopeConfig::from_hf_config_strict`](crate::RopeConfig::from_hf_config_strict),
    /// [`HfConfig::strict`](crate::HfConfig::strict)). Read the model's attention code and
    /// set the style by hand, or use the lenient reading, which assumes rotate-half pairs.
    #[error("model_type `{0}`: its pairing style is not known (strict reading)")]
    UnknownModelType(String),
    /// The config's `model_type` (named) has no rotary embeddings: its positions are absolute
    /// embeddings or ALiBi ([`NO_ROPE_MODEL_TYPES`](crate::NO_ROPE_MODEL_TYPES)). Such a model
    /// needs no RoPE.
    #[error("model_type `{0}` does not use rotary position embeddings")]
    NoRope(String),
    /// The layer asked for is past the config's layers (`num_hidden_layers`, or the length of
    /// `layer_types` or `no_rope_layers`): ask for a layer below `layers`.
    #[error("layer {layer} asked for, the config has {layers}")]
    NoSuchLayer {
        /// The layer asked for.
        layer: usize,
        /// The layers the config describes.
        layers: usize,
    },
    /// The config has no multi-head latent attention (no `kv_lora_rank`; the model type is
    /// named): its cache is a key and a value cache ([`KvCache`](crate::KvCache)), not a
    /// latent one.
    #[error("model_type `{0}` has no multi-head latent attention (no kv_lora_rank)")]
    NoMla(String),
    /// The layer type asked for is not in the config: ask for one of those listed.
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
    /// A shape passed as a slice has the wrong number of dimensions (the seed operation takes
    /// `[B, H, N, D]`): pass a shape of the rank named.
    #[error("{what}: expected a rank-{expected} shape, got {got:?}")]
    Rank {
        /// Which tensor.
        what: &'static str,
        /// The rank the operation takes.
        expected: usize,
        /// The shape that was passed.
        got: Vec<usize>,
    },
    /// An axis of a tensor does not match the configuration or the other tensors of the call
    /// (q's batch and seq, k's head_dim, an output's shape, a cache's heads, …): make the
    /// named axis the expected extent, or build the `Rope` for this head_dim.
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
    /// A buffer's length is not the number of elements its shape describes (positions: one per
    /// token, or one per sequence for offsets; slots: one per token): pass a buffer of exactly
    /// that length, or a slice of one.
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
    /// The head dimension is zero, odd, or above [`RopeConfig::MAX_HEAD_DIM`](crate::RopeConfig::MAX_HEAD_DIM): RoPE pairs
    /// elements, so it must be even; check the model's `head_dim`.
    #[error("head_dim {head_dim} must be even and at least 2")]
    HeadDim {
        /// The rejected head dimension.
        head_dim: usize,
    },
    /// The rotary dimension is zero, odd, or larger than the head dimension: set an even
    /// `rotary_dim` of at most `head_dim` (partial rotary: `head_dim * partial_rotary_factor`).
    #[error("rotary_dim {rotary_dim} must be even, at least 2 and at most head_dim {head_dim}")]
    RotaryDim {
        /// The rejected rotary dimension.
        rotary_dim: usize,
        /// The head dimension.
        head_dim: usize,
    },
    /// A tensor's element type is not one this `Rope` takes: its inputs (q, k, v) must be of
    /// the configuration's type, its outputs and caches of a type a kernel writes from it (so
    /// far the same): build the `Rope` with [`RopeConfig::dtype`](crate::RopeConfig::dtype) of
    /// the buffers, or convert them.
    #[error("{what}: dtype {got:?} given, but this Rope takes {expected:?} there")]
    DType {
        /// Which tensor (`"q"`, `"k_out"`, `"v cache"`, …).
        what: &'static str,
        /// The type it takes: the configured one.
        expected: crate::DType,
        /// The type given.
        got: crate::DType,
    },
    /// A view's layout (shape, strides, offset) reaches past the end of its buffer: fix the
    /// layout, or pass the buffer the layout describes.
    #[error("{what}: the view reaches element {extent} but the buffer holds {len}")]
    OutOfBounds {
        /// Which tensor.
        what: &'static str,
        /// One past the last element the view reaches (`usize::MAX` on overflow).
        extent: usize,
        /// Elements in the buffer.
        len: usize,
    },
    /// A view that is written has elements sharing an address (a stride smaller than what it
    /// steps over, or a broadcast axis): written views need strides that keep every element
    /// apart.
    #[error("{what}: the view is written but its rows overlap (strides {strides:?} for shape {shape:?})")]
    Overlap {
        /// Which tensor.
        what: &'static str,
        /// Its shape.
        shape: [usize; 4],
        /// Its strides.
        strides: [usize; 3],
    },
    /// Two tensors of one launch share memory where one of them is written (an output over an
    /// input, q over k, a cache over the new keys): give them separate memory, or rotate in
    /// place with the same view as input and output.
    #[error("{a} and {b} share memory, and at least one of them is written")]
    Aliasing {
        /// One tensor.
        a: &'static str,
        /// The other.
        b: &'static str,
    },
    /// q is rotated in place and k out of place, or the reverse: give both outputs, or
    /// neither.
    #[error("q and k must both be rotated in place or both out of place")]
    InPlaceMismatch,
    /// A QK-norm's `eps` is not finite and positive ([`QkNorm`](crate::QkNorm)).
    #[error("qk norm: eps {eps} must be finite and greater than 0")]
    NormEps {
        /// The `eps` given.
        eps: f32,
    },
    /// A QK-norm (or MLA's kv_c norm, [`MlaAppend::kv_c_norm`](crate::MlaAppend::kv_c_norm))
    /// that does not fit its kind or the launch: weights missing for a weighted kind or given
    /// to [`NormKind::RmsUnit`](crate::NormKind::RmsUnit), views whose heads the normed
    /// kernels cannot take, or a whole projection past one block (see the message).
    #[error("qk norm: {0}")]
    Norm(&'static str),
    /// De-interleaved pairs ([`MlaAppend::deinterleaved`](crate::MlaAppend::deinterleaved))
    /// asked of a launch that cannot write them (see the message): GPT-J pairs only, no QK-norm
    /// (kv_c's norm is taken) or MRoPE, views that take 16-byte accesses, and in place a
    /// head of q at most 32 lanes.
    #[error("de-interleaved pairs: {0}")]
    Deinterleave(&'static str),
    /// A combination of features no kernel takes, by a rule of the support table
    /// ([`rope_cuda_kernels::support::supported`]; the README's support table says it in
    /// words): the rule names what to change. (A rule about the norm or de-interleaved pairs
    /// comes as [`Error::Norm`] or [`Error::Deinterleave`], with the rule's words.)
    #[error("no kernel takes this combination: {0}")]
    Unsupported(rope_cuda_kernels::support::Unsupported),
    /// A device address is not aligned to what is read there (its element size; 16 bytes for
    /// the benchmarks' copy): start the view on an element boundary.
    #[error("{what}: device address {address:#x} is not aligned to {align} bytes")]
    Alignment {
        /// Which buffer.
        what: &'static str,
        /// The address of its first element the kernel reads.
        address: u64,
        /// The alignment required.
        align: usize,
    },
    /// Tokens were given positions outside `0..max_position` (reported after the launch, by
    /// `check_errors` or a checked configuration); they were left untouched, and, for KV
    /// appends, not written to the cache. Fix the positions, or build the `Rope` with a
    /// larger `max_position` (and, for a contiguous cache, a longer cache).
    #[error(
        "{count} token(s) had positions outside 0..{max_position}; the first is token {token} at position {position}"
    )]
    PositionOutOfRange {
        /// The lowest offending token index (`b * seq + s`).
        token: usize,
        /// Its position (saturated to the i32 range).
        position: i64,
        /// The configuration's `max_position`: valid positions are below it.
        max_position: usize,
        /// Number of offending tokens since the record was last read.
        count: u64,
    },
    /// Tokens were given cache slots outside the cache (other than `-1`, padding; reported
    /// after the launch); their keys and values were not written. Fix the slot mapping, or
    /// pass the cache it was made for.
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
    /// The slot mapping does not fit the cache: a paged cache ([`KvCache::paged`](crate::KvCache::paged)) needs
    /// one, a contiguous cache takes its rows from the positions and must be given none.
    #[error("{0}")]
    SlotMapping(&'static str),
    /// The scales do not fit the call: FP8 caches need theirs ([`KvCache::scales`](crate::KvCache::scales)),
    /// other caches take none, and an FP8 output of q ([`KvAppend::q_fp8`](crate::KvAppend::q_fp8)) needs
    /// q and FP8 caches.
    #[error("{0}")]
    Scales(&'static str),
    /// Multimodal RoPE's sections do not give each stream its pairs: the three sections
    /// (`mrope_section`) must add up to half the rotary dimension, and, interleaved, each of
    /// the height and width sections must fit its every-third pairs. Take the sections from
    /// the model's config with its head and rotary dims.
    #[error("mrope sections {sections:?} (interleaved: {interleaved}) do not split {half} pairs")]
    MropeSections {
        /// The sections given.
        sections: [usize; 3],
        /// Whether the layout is interleaved.
        interleaved: bool,
        /// Pairs of the rotary dimension (`rotary_dim / 2`).
        half: usize,
    },
    /// The positions' kind does not fit the configuration: a multimodal (MRoPE) configuration
    /// takes three streams (`Positions::streams_i32`/`streams_i64`, `[3, batch * seq]`), any
    /// other configuration takes one position per token (ids, offsets or sequential).
    #[error("positions: expected {expected}, got {got:?}")]
    PositionKind {
        /// What the configuration takes.
        expected: &'static str,
        /// The kind given.
        got: rope_cuda_kernels::views::PositionKind,
    },
    /// A multimodal (MRoPE) append needs a paged cache with a slot mapping: its positions are
    /// not cache rows (image tokens share positions). Address a contiguous cache as a paged
    /// one (`block_size` = its sequence length, slot = `b * block_size + row`).
    #[error("a multimodal (MRoPE) append needs a paged cache and a slot mapping")]
    MropeCache,
    /// The rotary base (`rope_theta`) is not a finite number greater than zero: check the
    /// model's value.
    #[error("base {base} must be finite and greater than 0")]
    Base {
        /// The rejected base.
        base: f64,
    },
    /// A RoPE scaling parameter is out of its range (not finite, not positive, a band whose
    /// low bound exceeds its high one, …): correct the named parameter.
    #[error("rope scaling: {field} = {value} is out of range")]
    Scaling {
        /// The parameter's name in `config.json`.
        field: &'static str,
        /// The rejected value.
        value: f64,
    },
    /// A KV shift ([`Rope::shift_kv`](crate::Rope::shift_kv)) of a configuration whose
    /// frequencies change with the sequence's length (`dynamic` NTK, `longrope`): the keys in
    /// the cache may have been rotated at another length's frequencies, and a shift across the
    /// switch point would need the other set. Shift only at fixed frequencies, or opt in with
    /// [`KvShift::length_dependent`](crate::KvShift::length_dependent) where every key was
    /// appended by a `Rope` of this one's `seq_len`.
    #[error(
        "rope scaling {rope_type}: its frequencies change with the sequence length, so a shift is exact only \
         where the cached keys were rotated at this Rope's frequencies (KvShift::length_dependent says so)"
    )]
    ShiftScaling {
        /// The configuration's `rope_type`.
        rope_type: &'static str,
    },
    /// A per-pair list of a RoPE scaling (LongRoPE's factors) has the wrong length: it needs
    /// one entry per rotated pair, `rotary_dim / 2`.
    #[error("rope scaling: {field} has {got} entries, expected one per pair: {expected}")]
    ScalingLength {
        /// The parameter's name.
        field: &'static str,
        /// Pairs of the rotary dimension.
        expected: usize,
        /// Entries given.
        got: usize,
    },
    /// A model's `config.json` could not be read as a RoPE configuration: the inner error
    /// names the field.
    #[error("config.json: {0}")]
    Config(#[from] ConfigError),
    /// The call needs positions beyond the configuration's `max_position` (sequential
    /// positions of a sequence longer than it, or a zero `max_position`): build the `Rope`
    /// with a larger `max_position`, or pass explicit positions.
    #[error("positions up to {needed} are needed, but the configuration accepts only 0..{max_position}")]
    MaxPosition {
        /// One past the largest position the call needs.
        needed: usize,
        /// The configuration's `max_position`: valid positions are below it.
        max_position: usize,
    },
    /// A size exceeds what one launch can address (32-bit token, head and slot counts; grid
    /// limits): split the call into smaller ones.
    #[error("{what} = {value} exceeds the limit {limit}")]
    TooLarge {
        /// Which quantity.
        what: &'static str,
        /// Its value.
        value: u64,
        /// The largest accepted value.
        limit: u64,
    },
    /// The embedded PTX failed to load into the current context, or an entry point is missing
    /// from it: make a context current first (`cust::quick_init`, or binding cudarc's), and
    /// check that the driver supports the PTX's target ([`Kernels::arch`](crate::Kernels::arch)).
    #[error("loading kernel {name} failed: {source}")]
    KernelLoad {
        /// The kernel's entry-point name.
        name: &'static str,
        /// The driver's error.
        source: CudaError,
    },
    /// No embedded PTX is for this device: the architecture asked for (`ROPE_CUDA_PTX_ARCH`,
    /// [`Kernels::load_arch`](crate::Kernels::load_arch)) is not embedded or needs a newer
    /// device, or the device is older than every embedded architecture. Ask for one of
    /// `available` that the device's compute capability reaches (sm_80 needs 8.0).
    #[error("no PTX for this device: {requested} is not embedded or needs a newer device (compute capability {capability}; embedded: {available})")]
    Arch {
        /// The architecture asked for (or "the newest").
        requested: String,
        /// The device's compute capability, `major * 10 + minor`.
        capability: u32,
        /// The embedded architectures.
        available: String,
    },
    /// The kernel list has no entry point for what a launch needs (a bug of this library:
    /// every key its planners make is tested to exist).
    #[error("no kernel for {key}")]
    NoKernel {
        /// The kernel key asked for.
        key: String,
    },
    /// A buffer (or a cudarc stream) belongs to another device or context than the kernels
    /// the `Rope` or `KvUpdate` was made with: use one `Kernels` per device, and that device's
    /// buffers and streams with it.
    #[error("{what} is memory of device {got}; the kernels were loaded on device {expected}")]
    Device {
        /// The buffer.
        what: &'static str,
        /// The kernels' device ordinal.
        expected: i32,
        /// The buffer's device ordinal.
        got: i32,
    },
    /// A buffer was lent for work on another stream than the call's (a cudarc buffer paired
    /// with one `CudaStream`, given to a call on another): pair each buffer with the stream the
    /// call is given, so that cudarc orders the call after the buffer's earlier work.
    #[error("{what} was lent for work on another stream than the call's")]
    Stream {
        /// The buffer.
        what: &'static str,
    },
    /// A candle tensor this crate cannot take as it is (feature `candle`): not in a CUDA
    /// device's storage, of a dtype the call does not take, with a last axis that is not
    /// contiguous, positions or slots that are not contiguous, caches of two layouts: move it
    /// to the CUDA device, convert it, or make it contiguous.
    #[error("{what}: {why}")]
    Candle {
        /// Which tensor.
        what: &'static str,
        /// What is wrong with it.
        why: String,
    },
    /// A call that cannot go into a CUDA graph was made while capturing or recording one
    /// (`check_errors`, a checked configuration, a KV call of more than
    /// [`KV_SCAN_MAX_TOKENS`](crate::KV_SCAN_MAX_TOKENS) tokens): make it outside the graph.
    #[error("{0} cannot be captured or recorded into a CUDA graph")]
    NotCapturable(&'static str),
    /// The CUDA driver reported an error through cust (out of memory, an earlier fault on the
    /// stream, no device): the driver's error says which.
    #[error("CUDA driver error: {0}")]
    Cuda(#[from] CudaError),
    /// A driver call made directly (not through cust) failed with the `CUresult` given (see
    /// the CUDA driver API's list of error codes).
    #[error("{call} failed with CUresult {code}")]
    Driver {
        /// The driver function.
        call: &'static str,
        /// Its `CUresult`.
        code: u32,
    },
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl From<rope_cuda_kernels::support::Unsupported> for Error {
    /// A rule of the support table as the error of the feature it is about: the norm's rules
    /// as [`Error::Norm`], de-interleaved pairs' as [`Error::Deinterleave`], the others as
    /// [`Error::Unsupported`].
    fn from(rule: rope_cuda_kernels::support::Unsupported) -> Self {
        use rope_cuda_kernels::support::Unsupported as U;
        match rule {
            U::HeadNorm | U::WholeNorm => Error::Norm(rule.reason()),
            U::Deinterleaved => Error::Deinterleave(rule.reason()),
            _ => Error::Unsupported(rule),
        }
    }
}
