//! The rotation engine, shared by the RoPE and KV-cache kernels: table entries, lanes of
//! pairs (fast, and exact where a narrow output needs it), the rows a thread moves, and the
//! two pairing styles. The entry points' bodies ([`crate::rope`], [`crate::kv`]) only map
//! threads to work and call in here.
//!
//! Its parts: [`source`] (table rows, sources of cos and sin, the block's prologue, a lane's
//! entries), [`lanes`] (a lane's pairs rotated), [`quant`] (FP8 outputs' scales), [`rows`] (the
//! rows a thread moves) and [`style`] (the pairing styles).

mod lanes;
mod quant;
mod rows;
mod source;
mod style;

pub(crate) use quant::*;
pub(crate) use rows::*;
pub(crate) use source::*;
pub(crate) use style::*;
