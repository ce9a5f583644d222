//! The RoPE launcher shared by every public RoPE entry point.

use cust::sys::CUstream;
use rope_cuda_kernels::params::RopeParams;

use crate::error::{Error, Result};
use crate::kernels::{launch, Geometry, Kernels};
use crate::table::RopeTable;

/// Threads per block the launcher aims for.
const BLOCK_THREADS: u32 = 256;

/// Launches rotate-half RoPE over `params.q` and `params.k` with positions `0..seq`.
///
/// The caller has validated the views: every row `(b, s, h)` with `b * seq + s < tokens`,
/// `h < heads` lies inside its buffers, `half == table.rotary_dim() / 2`, and
/// `seq <= table.max_position()`. This fills in the table, picks the vector width and the
/// geometry, and launches.
pub(crate) fn launch_neox_f32(
    kernels: &Kernels,
    table: &RopeTable,
    mut params: RopeParams,
    stream: CUstream,
) -> Result<()> {
    params.cos = table.cos.as_device_ptr().as_raw();
    params.sin = table.sin.as_device_ptr().as_raw();
    let vec4 = params.half % 4 == 0 && aligned16(&params);
    params.lanes = if vec4 { params.half / 4 } else { params.half };
    let Some(geometry) = geometry(&params)? else {
        return Ok(());
    };
    let function = kernels.functions.rope_neox_f32[vec4 as usize];
    // SAFETY: the caller's checks keep every row the geometry reaches inside its buffer and
    // every position inside the table; `aligned16` holds for the v4 kernel.
    unsafe { launch(function, geometry, &params, stream) }
}

/// Whether every row start of both views, and the tables, sit on 16-byte boundaries.
fn aligned16(p: &RopeParams) -> bool {
    let views = [&p.q, &p.k].into_iter().filter(|v| v.heads > 0);
    let mut ok = p.cos % 16 == 0 && p.sin % 16 == 0;
    for v in views {
        ok &= v.input % 16 == 0 && v.output % 16 == 0;
        ok &= v.in_strides.iter().chain(&v.out_strides).all(|s| s % 4 == 0);
    }
    ok
}

/// The launch geometry of [`RopeParams`]'s thread mapping; `None` when there is no work.
fn geometry(p: &RopeParams) -> Result<Option<Geometry>> {
    let work = (p.q.heads as u64 + p.k.heads as u64) * p.lanes as u64;
    if work == 0 || p.tokens == 0 {
        return Ok(None);
    }
    let work = u32::try_from(work).map_err(|_| Error::TooLarge {
        what: "heads * lanes",
        value: work,
        limit: u32::MAX as u64,
    })?;
    let bx = work.min(BLOCK_THREADS);
    let by = (BLOCK_THREADS / bx).max(1);
    let grid_y = work.div_ceil(bx);
    if grid_y > 65_535 {
        return Err(Error::TooLarge {
            what: "heads * lanes",
            value: work as u64,
            limit: 65_535 * BLOCK_THREADS as u64,
        });
    }
    Ok(Some(Geometry { grid: (p.tokens.div_ceil(by), grid_y), block: (bx, by) }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(qh: u32, kh: u32, lanes: u32, tokens: u32) -> RopeParams {
        let mut p = RopeParams { tokens, seq: 1, half: lanes, lanes, ..Default::default() };
        p.q.heads = qh;
        p.k.heads = kh;
        p
    }

    /// Every (token, work item) pair gets exactly one thread, and blocks stay within 1024.
    #[test]
    fn geometry_covers_all_work_once() {
        for (qh, kh, lanes, tokens) in [(32, 8, 16, 5), (1, 0, 1, 3), (17, 1, 10, 7), (3, 3, 8, 1), (64, 64, 32, 2)] {
            let p = params(qh, kh, lanes, tokens);
            let g = geometry(&p).unwrap().unwrap();
            assert!(g.block.0 * g.block.1 <= 1024);
            let work = (qh + kh) * lanes;
            let mut seen = vec![0u32; (work * tokens) as usize];
            for gx in 0..g.grid.0 {
                for gy in 0..g.grid.1 {
                    for ty in 0..g.block.1 {
                        for tx in 0..g.block.0 {
                            let (t, w) = (gx * g.block.1 + ty, gy * g.block.0 + tx);
                            if t < tokens && w < work {
                                seen[(t * work + w) as usize] += 1;
                            }
                        }
                    }
                }
            }
            assert!(seen.iter().all(|&c| c == 1), "{qh}/{kh} heads, {lanes} lanes, {tokens} tokens");
        }
        assert_eq!(geometry(&params(0, 0, 4, 9)).unwrap(), None);
        assert_eq!(geometry(&params(4, 0, 4, 0)).unwrap(), None);
    }
}
