//! What one thread of a KV append knows before anything waits on its token's position or
//! slot: its item, decoded by [`super::kv_append`] into an operand, a head group and a lane
//! ([`Lane`]); the first FP8 scale of its stores, its input rows and its first head's data.

use crate::fp8::Fp8;
use crate::gpu::{Bits, Io};
use crate::norm_lane::LaneAt;
use crate::params::KvParams;
use crate::rotate::{Quant, Rows, Style};

/// One item of a KV append: a lane of a group of up to `G` heads of q, k or v of one token.
#[derive(Clone, Copy)]
pub(super) struct Lane {
    /// The (token, item) pair, `None` for an idle slot (past the launch, past its group's
    /// lanes, or between the segments).
    pub item: Option<(u32, u32)>,
    /// The token and its batch and sequence index.
    pub t: u32,
    pub b: u64,
    pub s: u64,
    /// The item's index in its segment (q's, k's or v's).
    pub w: u32,
    pub is_q: bool,
    pub is_k: bool,
    /// q into an FP8 buffer (its dims past rotary_dim copied, as k's).
    pub q_fp8: bool,
    /// The operand's heads, its groups' lanes and the slots each group takes.
    pub heads: u32,
    pub lanes: u32,
    pub slots: u32,
    pub lane: usize,
    /// The group's first head and number of heads.
    pub h0: u64,
    pub count: usize,
    pub half: usize,
    /// The first head's input row and the step between heads.
    pub src: *const u8,
    pub src_step: usize,
    /// Whether the lane rotates (else it copies the elements at byte `copy_at` of the row).
    pub rotating: bool,
    pub copy_at: usize,
}

impl Lane {
    /// The FP8 quantizer of the item's stores: the format (one for both caches, checked by
    /// the host), and the item's first scale, loaded now, off the stores' path.
    #[rustc_force_inline]
    pub fn quant<W: Io>(self, p: &KvParams) -> Quant {
        let fmt = if W::FP8 { p.cache.types().0.fp8().unwrap_or(Fp8::E4M3) } else { Fp8::E4M3 };
        match self.item {
            Some(_) if W::FP8 && (!self.is_q || self.q_fp8) => {
                let (at, step) = if self.is_q { (p.scales.q(), 0) } else { p.scales.head(!self.is_k, self.h0) };
                // SAFETY: the host checked the scale buffers: one f32 (q's, or one for all kv
                // heads) or one per kv head, and `h0` is a head of the launch.
                unsafe { Quant::new::<W>(fmt, at as *const f32, step as usize) }
            }
            _ => Quant::NONE,
        }
    }

    /// The item's input rows (no outputs yet).
    #[rustc_force_inline]
    pub fn rows(self) -> Rows {
        Rows { src: self.src, dst: core::ptr::null_mut(), src_step: self.src_step, dst_step: 0, count: self.count }
    }

    /// Where the lane's elements lie, as the norm stage reads them.
    #[rustc_force_inline]
    pub fn at(self) -> LaneAt {
        LaneAt {
            rotating: self.rotating,
            lane: self.lane,
            half: self.half,
            copy_at: self.copy_at,
            head: self.h0 as usize,
        }
    }

    /// The first head's data: a rotating lane's pairs, or a copying lane's elements (the
    /// other zeros; both zeros for an idle item).
    ///
    /// # Safety
    /// The host checked the views against their buffers: the lane's elements lie in the row
    /// (past the rotary dims for a copying lane of q and k).
    #[rustc_force_inline]
    pub unsafe fn load<S: Style, R: Io, C: Io>(self, rows: &Rows) -> ([Bits; 2], Bits) {
        let first = if self.item.is_some() && self.rotating {
            // SAFETY: the caller's contract.
            unsafe { S::load::<R>(rows, 0, self.lane, self.half) }
        } else {
            [[0; 4]; 2]
        };
        // A copying lane's first head is loaded now too: its store then waits on the
        // position, slot and owner only, not on a load issued after them.
        let copy = if self.item.is_some() && !self.rotating {
            // SAFETY: as above.
            unsafe { C::load_raw(rows.src(0, self.copy_at)) }
        } else {
            [0; 4]
        };
        (first, copy)
    }
}
