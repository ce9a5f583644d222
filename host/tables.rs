//! [`TableRope`]: RoPE by the caller's cos and sin tables, read where the caller keeps them
//! (candle's `rope`/`rope_i`/`rope_thd` drop-ins, and any engine with tables of its own).

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;

use cust::sys as cuda;
use rope_cuda_kernels::views::{CallerView, ErrorSink, PositionsView, SourceView};

use crate::config::{RopeConfig, RopeStyle};
use crate::error::{Error, Result};
use crate::kernels::Kernels;
use crate::launch::{check_axis, check_disjoint, check_view, Core};
use crate::operand::{on_stream, Queue};
use crate::rope::RawArgs;
use crate::rope::{plan, Plan, RopeArgs};
use crate::tensor::{PositionKind, RawTensor, Tensor};

/// RoPE with cos and sin from the caller's tables: entry `[row, i]` of each rotates pair `i`
/// of a token whose position is `row`, as given (the tables are taken as exact; the rotation
/// is computed in f32 from the entries and rounded once).
///
/// The tables are tensors of q's element type laid out `[batch, rows, 1, half]`, contiguous
/// (`half` = rotary_dim / 2, the pairs rotated): with `batch` 1, one table for every sequence,
/// read at the call's positions (ids, offsets or sequential); with q's batch, one table per
/// sequence, token `s` of sequence `b` rotated by row `s` of table `b` (positions sequential).
/// A position outside `0..rows` is skipped and recorded ([`TableRope::check_errors`]).
///
/// ```no_run
/// use cust::memory::DeviceBuffer;
/// use cust::stream::{Stream, StreamFlags};
/// use rope_cuda::{Kernels, Layout, Positions, RopeArgs, RopeStyle, TableRope, Tensor, TensorMut};
///
/// let _ctx = cust::quick_init()?;
/// let kernels = Kernels::load()?;
/// let stream = Stream::new(StreamFlags::NON_BLOCKING, None)?;
/// // Tables of 16 rows of 32 pairs (head_dim 64), one sequence of 4 tokens of 2 heads.
/// let cos = DeviceBuffer::from_slice(&vec![1.0f32; 16 * 32])?;
/// let sin = DeviceBuffer::from_slice(&vec![0.0f32; 16 * 32])?;
/// let mut q = DeviceBuffer::from_slice(&vec![0.5f32; 4 * 2 * 64])?;
/// let table = Layout::bshd(1, 16, 1, 32);
/// let mut qv = TensorMut::new(&mut q, Layout::bshd(1, 4, 2, 64));
/// let rope = TableRope::new(&kernels)?;
/// let args = RopeArgs::in_place(&mut qv, Positions::sequential());
/// rope.apply(RopeStyle::NeoX, args, &Tensor::new(&cos, table), &Tensor::new(&sin, table), &stream)?;
/// rope.check_errors(&stream)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct TableRope {
    core: Core,
    /// The rows of the last call's tables, for error reports.
    rows: AtomicUsize,
}

impl TableRope {
    /// Allocates the error records, in the current context.
    pub fn new(kernels: &Arc<Kernels>) -> Result<Self> {
        Ok(TableRope { core: Core::new(kernels)?, rows: AtomicUsize::new(0) })
    }

    /// The kernels this `TableRope` launches.
    pub fn kernels(&self) -> &Arc<Kernels> {
        &self.core.kernels
    }

    /// Rotates q (and k) of `args` in `style`'s pairs by the tables `cos` and `sin` (see
    /// [`TableRope`]), in place or into outputs, forward or as the args say, on `stream`.
    pub fn apply(
        &self,
        style: RopeStyle,
        args: RopeArgs<'_, '_>,
        cos: &Tensor<'_>,
        sin: &Tensor<'_>,
        stream: &impl Queue,
    ) -> Result<()> {
        let stream = stream.raw(self.kernels())?;
        let [q, q_out, k, k_out, positions, qw, kw] = args.holds();
        let holds = [q, q_out, k, k_out, positions, qw, kw, ("cos", Some(&cos.hold)), ("sin", Some(&sin.hold))];
        // SAFETY: each view lends a live buffer of its element type, ordered for work on
        // `stream` (checked) by its borrow and its record, made after the launch is queued; the
        // `Queue` vouches for the stream; `plan_tables` checks the rest.
        on_stream(holds, stream, || unsafe { self.apply_raw(style, &args.raw(), &cos.raw, &sin.raw, stream) })
    }

    /// [`TableRope::apply`] on device addresses and a raw stream. An `Err` means nothing was
    /// launched.
    ///
    /// # Safety
    /// As [`Rope::apply_raw`](crate::Rope::apply_raw), for the tables too (read only).
    pub unsafe fn apply_raw(
        &self,
        style: RopeStyle,
        args: &RawArgs,
        cos: &RawTensor,
        sin: &RawTensor,
        stream: cuda::CUstream,
    ) -> Result<()> {
        let Some((plan, rows)) = plan_tables(style, args, cos, sin, self.core.records.sink())? else { return Ok(()) };
        self.core.prepare(&crate::rope::buffers(args, plan.params.positions.address()), false)?;
        self.core.prepare(&[("cos", cos.ptr), ("sin", sin.ptr)], false)?;
        self.rows.store(rows, Relaxed);
        // SAFETY: `plan_tables` checked every view against its buffer, outputs against
        // overlap with each other, their inputs and the tables, the tables' shape against
        // the positions' limit, alignment for the chosen width and the positions buffer's
        // length; the caller vouches for the addresses.
        unsafe { self.core.launch(plan.key, plan.geometry, plan.shared, &plan.params, stream, None) }
    }

    /// Synchronises `stream`, then reports (and clears) the out-of-range positions recorded
    /// since the last check (against the rows of the last call's tables).
    pub fn check_errors(&self, stream: &impl Queue) -> Result<()> {
        self.core.check_errors_raw(stream.raw(self.kernels())?, self.rows.load(Relaxed))
    }
}

/// Checks a call of [`TableRope`] and plans its launch: the plan, and the tables' rows;
/// `None` when there is no work.
pub(crate) fn plan_tables(
    style: RopeStyle,
    args: &RawArgs,
    cos: &RawTensor,
    sin: &RawTensor,
    errors: ErrorSink,
) -> Result<Option<(Plan, usize)>> {
    if args.norm.is_some() {
        return Err(Error::Norm("the caller's tables (TableRope) take no norm"));
    }
    let [batch, seq, _, head_dim] = args.q.layout.shape;
    let [tb, rows, _, half] = cos.layout.shape;
    for (what, t) in [("cos", cos), ("sin", sin)] {
        if t.dtype != args.q.dtype {
            return Err(Error::DType { what, expected: args.q.dtype, got: t.dtype });
        }
        let s = t.layout.shape;
        check_axis(what, "heads", 1, s[2])?;
        for (axis, i, n) in [("batch", 0, tb), ("rows", 1, rows), ("pairs", 3, half)] {
            check_axis(what, axis, n, s[i])?;
        }
        if tb != 1 {
            check_axis(what, "batch", batch, tb)?;
        }
        // Row `r` of table `b` at `(b * rows + r) * half`: contiguous (the heads axis is 1).
        for (axis, i, n) in [("batch stride", 0, rows * half), ("row stride", 1, half)] {
            if s[i] > 1 {
                check_axis(what, axis, n, t.layout.strides[i])?;
            }
        }
        check_view(what, t)?;
    }
    let per_sequence = tb > 1;
    if tb * rows == 0 {
        // No row to read: nothing to do without tokens, else every position is out of range.
        return match batch * seq {
            0 => Ok(None),
            _ => Err(Error::MaxPosition { needed: 1, max_position: 0 }),
        };
    }
    let config = RopeConfig::new(head_dim, tb * rows).style(style).dtype(args.q.dtype).rotary_dim(2 * half);
    // The rotary dims past the tables' pairs must be head dims (a typed error, not a panic);
    // the frequencies, unused, are not computed.
    config.validate_dims()?;
    if per_sequence {
        if args.positions.kind != PositionKind::Sequential {
            let expected = "sequential positions: tables of one block of rows per sequence are read in order";
            return Err(Error::PositionKind { expected, got: args.positions.kind });
        }
        if seq > rows {
            return Err(Error::MaxPosition { needed: seq, max_position: rows });
        }
    }
    // Nothing written may be a table.
    let written = [(Some(args.q_out.as_ref().unwrap_or(&args.q)), "q"), (args.k_out.as_ref().or(args.k.as_ref()), "k")];
    for (t, what) in written.iter().filter_map(|(t, w)| t.map(|t| (t, *w))) {
        for (table, name) in [(cos, "cos"), (sin, "sin")] {
            check_disjoint((what, t), (name, table))?;
        }
    }
    let source = SourceView::Caller(CallerView::new(cos.address(), sin.address()));
    let Some(mut plan) = plan(&config, args, source, errors)? else { return Ok(None) };
    if per_sequence {
        plan.params.positions = PositionsView::sequence_rows(rows as u32, (tb * rows) as u32);
    }
    Ok(Some((plan, rows)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::DType;
    use crate::layout::Layout;
    use crate::tensor::RawPositions;
    use crate::Direction;
    use rope_cuda_kernels::entries::Key;
    use rope_cuda_kernels::keys::TableSource;

    const BASE: u64 = 1 << 20;

    fn tensor(ptr: u64, layout: Layout, dtype: DType) -> RawTensor {
        RawTensor::new(ptr, layout.extent().unwrap(), dtype, layout)
    }

    /// bf16 q `[2, 3, 4, 64]` in place, sequential, and tables of `tb` x 8 rows.
    fn call(tb: usize) -> (RawArgs, RawTensor, RawTensor) {
        let q = tensor(BASE, Layout::bshd(2, 3, 4, 64), DType::BF16);
        let args = RawArgs {
            q,
            q_out: None,
            k: None,
            k_out: None,
            positions: RawPositions::SEQUENTIAL,
            direction: Direction::Forward,
            norm: None,
        };
        let table = Layout::bshd(tb, 8, 1, 32);
        (args, tensor(2 * BASE, table, DType::BF16), tensor(3 * BASE, table, DType::BF16))
    }

    fn planned(args: &RawArgs, cos: &RawTensor, sin: &RawTensor) -> Result<Option<(Plan, usize)>> {
        plan_tables(RopeStyle::NeoX, args, cos, sin, ErrorSink::default())
    }

    #[test]
    fn plans_caller_table_kernels_with_rows_per_sequence_where_tables_are_batched() {
        let (args, cos, sin) = call(1);
        let (p, rows) = planned(&args, &cos, &sin).unwrap().unwrap();
        assert_eq!((p.key.source, rows, p.params.positions.kind()), (TableSource::Caller, 8, PositionKind::Sequential));
        assert!(p.key.entry_point().is_some(), "{:?}", p.key);
        assert_eq!(p.params.source, SourceView::Caller(CallerView::new(2 * BASE, 3 * BASE)));
        let (args, cos, sin) = call(2);
        let (p, _) = planned(&args, &cos, &sin).unwrap().unwrap();
        assert_eq!((p.params.positions.kind(), p.params.positions.limit()), (PositionKind::SequenceRows, 16));
        for style in [RopeStyle::NeoX, RopeStyle::GptJ] {
            for dtype in [DType::F32, DType::F16, DType::BF16] {
                let l = Layout::bshd(2, 3, 4, 64);
                let a = RawArgs { q: tensor(BASE, l, dtype), ..args };
                let t = |p| tensor(p, Layout::bshd(1, 8, 1, 32), dtype);
                let p = plan_tables(style, &a, &t(2 * BASE), &t(3 * BASE), ErrorSink::default());
                assert!(p.unwrap().unwrap().0.key.entry_point().is_some(), "{style:?} {dtype:?}");
            }
        }
    }

    #[test]
    fn refuses_tables_that_do_not_fit_the_call() {
        let (args, cos, sin) = call(1);
        let err = |args: &RawArgs, cos: &RawTensor, sin: &RawTensor| planned(args, cos, sin).unwrap_err();
        let f32_table = tensor(2 * BASE, Layout::bshd(1, 8, 1, 32), DType::F32);
        assert!(matches!(err(&args, &f32_table, &sin), Error::DType { what: "cos", .. }));
        let short = RawTensor { len: 8 * 32 - 1, ..cos };
        assert!(matches!(err(&args, &short, &sin), Error::OutOfBounds { what: "cos", .. }));
        let other_rows = tensor(3 * BASE, Layout::bshd(1, 9, 1, 32), DType::BF16);
        assert!(matches!(err(&args, &cos, &other_rows), Error::Shape { what: "sin", axis: "rows", .. }));
        let three = tensor(2 * BASE, Layout::bshd(3, 8, 1, 32), DType::BF16);
        let three_sin = RawTensor { ptr: 3 * BASE, ..three };
        assert!(matches!(err(&args, &three, &three_sin), Error::Shape { what: "cos", axis: "batch", .. }));
        let strided = RawTensor { layout: Layout::strided([1, 8, 1, 32], [512, 64, 32], 0), len: 512, ..cos };
        let strided_sin = RawTensor { ptr: 3 * BASE, ..strided };
        assert!(matches!(err(&args, &strided, &strided_sin), Error::Shape { axis: "row stride", .. }));
        let wide = tensor(2 * BASE, Layout::bshd(1, 8, 1, 40), DType::BF16);
        let wide_sin = RawTensor { ptr: 3 * BASE, ..wide };
        assert!(matches!(err(&args, &wide, &wide_sin), Error::RotaryDim { rotary_dim: 80, head_dim: 64 }));
        // In place over a table.
        let over = RawTensor { ptr: BASE + 64, ..cos };
        assert!(matches!(err(&args, &over, &sin), Error::Aliasing { a: "q", b: "cos" }));
        // Batched tables: sequential positions, at most `rows` tokens a sequence.
        let (args2, cos2, sin2) = call(2);
        let ids = RawArgs { positions: RawPositions { kind: PositionKind::IdsI32, ptr: 5 * BASE, len: 6 }, ..args2 };
        assert!(matches!(err(&ids, &cos2, &sin2), Error::PositionKind { .. }));
        let few = |t: RawTensor| RawTensor { layout: Layout::bshd(2, 2, 1, 32), len: 2 * 2 * 32, ..t };
        assert!(matches!(err(&args2, &few(cos2), &few(sin2)), Error::MaxPosition { needed: 3, max_position: 2 }));
        // A shared table's sequential positions: at most its rows.
        let long = RawArgs { q: tensor(BASE, Layout::bshd(1, 9, 4, 64), DType::BF16), ..args };
        assert!(matches!(err(&long, &cos, &sin), Error::MaxPosition { needed: 9, max_position: 8 }));
    }
}
