//! Kernel parameter structs, shared bit-for-bit between host and device.
//!
//! Device pointers travel as `u64` (`CUdeviceptr`), so the structs are plain data on both
//! sides. Every struct is passed by value as a kernel's single parameter.

/// One tensor of rows to rotate, viewed as `[batch, seq, heads, head_dim]`.
///
/// Strides are in elements; `head_dim` is contiguous (stride 1). The output uses its own
/// strides, so out-of-place results may have a different layout from the input; in place
/// means `output == input` with equal strides.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HeadsView {
    /// Device address of element `[0, 0, 0, 0]` of the input.
    pub input: u64,
    /// Device address of element `[0, 0, 0, 0]` of the output.
    pub output: u64,
    /// Input strides, in elements, of the batch, seq and head axes.
    pub in_strides: [u64; 3],
    /// Output strides, in elements, of the batch, seq and head axes.
    pub out_strides: [u64; 3],
    /// Number of heads; 0 means the tensor is absent.
    pub heads: u32,
    /// Keeps the layout free of implicit padding.
    pub _pad: u32,
}

impl HeadsView {
    /// Element offset of row `(b, s, h)` in the input.
    #[inline(always)]
    pub fn in_offset(&self, b: u64, s: u64, h: u64) -> u64 {
        b * self.in_strides[0] + s * self.in_strides[1] + h * self.in_strides[2]
    }

    /// Element offset of row `(b, s, h)` in the output.
    #[inline(always)]
    pub fn out_offset(&self, b: u64, s: u64, h: u64) -> u64 {
        b * self.out_strides[0] + s * self.out_strides[1] + h * self.out_strides[2]
    }
}

/// Parameters of the RoPE kernels (`rope_neox_f32_v{1,4}`).
///
/// Thread mapping: a block is `(bx, by)` threads; `threadIdx.y` and `blockIdx.x` pick a token
/// `t = blockIdx.x * by + threadIdx.y` (token `t` is batch `t / seq`, sequence index
/// `t % seq`); `blockIdx.y * bx + threadIdx.x` picks a work item `w` in
/// `0 .. (q.heads + k.heads) * lanes`: head `w / lanes` (q's heads first, then k's) and
/// lane `w % lanes`. A lane rotates `V` consecutive pairs, `V` being the kernel's vector
/// width, so `lanes = rotary_dim / 2 / V`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RopeParams {
    /// The queries.
    pub q: HeadsView,
    /// The keys (`heads == 0`: none).
    pub k: HeadsView,
    /// Device address of the cosine table, f32 `[max_position, rotary_dim / 2]`.
    pub cos: u64,
    /// Device address of the sine table, f32 `[max_position, rotary_dim / 2]`.
    pub sin: u64,
    /// Number of tokens, `batch * seq`.
    pub tokens: u32,
    /// Sequence length: the token's position is its index within its sequence.
    pub seq: u32,
    /// Half the rotary dimension: the number of rotated pairs per row.
    pub half: u32,
    /// Work items per head: `half / V`.
    pub lanes: u32,
}
