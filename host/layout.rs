//! Strided `[batch, seq, heads, head_dim]` layouts, and the overlap rules that keep a launch
//! free of races.

/// Where the elements of a `[batch, seq, heads, head_dim]` view lie in a buffer.
///
/// Strides and the offset are in elements; `head_dim` is contiguous. Element
/// `[b, s, h, d]` is at `offset + b * strides[0] + s * strides[1] + h * strides[2] + d`.
///
/// ```
/// use rope_cuda::Layout;
/// // Packed QKV rows of 32 q heads, 8 k heads and 8 v heads of 128, 4096 tokens:
/// let row = (32 + 8 + 8) * 128;
/// let q = Layout::strided([1, 4096, 32, 128], [4096 * row, row, 128], 0);
/// let k = Layout::strided([1, 4096, 8, 128], [4096 * row, row, 128], 32 * 128);
/// assert_eq!(k.extent(), Some(4095 * row + 32 * 128 + 8 * 128));
/// assert!(q.is_non_overlapping() && k.is_non_overlapping());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Layout {
    /// `[batch, seq, heads, head_dim]`.
    pub shape: [usize; 4],
    /// Element strides of batch, seq and head.
    pub strides: [usize; 3],
    /// Element offset of `[0, 0, 0, 0]`.
    pub offset: usize,
}

impl Layout {
    /// A view with explicit strides and offset.
    pub fn strided(shape: [usize; 4], strides: [usize; 3], offset: usize) -> Self {
        Layout { shape, strides, offset }
    }

    /// Contiguous `[batch, seq, heads, head_dim]`.
    pub fn bshd(batch: usize, seq: usize, heads: usize, head_dim: usize) -> Self {
        Layout::strided([batch, seq, heads, head_dim], [seq * heads * head_dim, heads * head_dim, head_dim], 0)
    }

    /// Contiguous `[batch, heads, seq, head_dim]`, viewed as `[batch, seq, heads, head_dim]`.
    pub fn bhsd(batch: usize, heads: usize, seq: usize, head_dim: usize) -> Self {
        Layout::strided([batch, seq, heads, head_dim], [heads * seq * head_dim, head_dim, seq * head_dim], 0)
    }

    /// Packed tokens of several sequences, `[tokens, heads, head_dim]` (batch 1).
    pub fn packed(tokens: usize, heads: usize, head_dim: usize) -> Self {
        Layout::bshd(1, tokens, heads, head_dim)
    }

    /// Batch.
    pub fn batch(&self) -> usize {
        self.shape[0]
    }

    /// Sequence length.
    pub fn seq(&self) -> usize {
        self.shape[1]
    }

    /// Heads.
    pub fn heads(&self) -> usize {
        self.shape[2]
    }

    /// Elements per head.
    pub fn head_dim(&self) -> usize {
        self.shape[3]
    }

    /// Whether the view holds no element.
    pub fn is_empty(&self) -> bool {
        self.shape.contains(&0)
    }

    /// One past the largest element index the view reaches (0 when empty); `None` on overflow.
    pub fn extent(&self) -> Option<usize> {
        if self.is_empty() {
            return Some(0);
        }
        let mut last = self.offset.checked_add(self.shape[3] - 1)?;
        for (n, stride) in self.shape[..3].iter().zip(self.strides) {
            last = last.checked_add((n - 1).checked_mul(stride)?)?;
        }
        last.checked_add(1)
    }

    /// Whether no two elements of the view share an address (required of anything written).
    ///
    /// The axes of extent above 1, sorted by stride, must each step past everything the
    /// smaller axes span.
    pub fn is_non_overlapping(&self) -> bool {
        if self.is_empty() {
            return true;
        }
        let mut axes: Vec<(usize, usize)> =
            self.shape[..3].iter().zip(self.strides).filter(|(n, _)| **n > 1).map(|(&n, s)| (s, n)).collect();
        axes.sort_unstable();
        let mut span = self.shape[3];
        for (stride, n) in axes {
            if stride < span {
                return false;
            }
            span = match stride.checked_mul(n - 1).and_then(|x| x.checked_add(span)) {
                Some(s) => s,
                None => return false,
            };
        }
        true
    }

    /// The element intervals `[start, end)` of one token's heads, relative to the token's
    /// first element, sorted.
    fn token_footprint(&self) -> Vec<(usize, usize)> {
        let mut rows: Vec<(usize, usize)> =
            (0..self.heads()).map(|h| (h * self.strides[2], h * self.strides[2] + self.head_dim())).collect();
        rows.sort_unstable();
        rows
    }
}

/// Whether two views, at byte addresses `a.0` and `b.0` with elements of `size` bytes, can
/// share no element. Exact for views on disjoint address ranges and for views that share a
/// token grid (q and k slices of one fused QKV buffer); any other pair counts as overlapping.
pub(crate) fn disjoint(a: (u64, &Layout), b: (u64, &Layout), size: usize) -> bool {
    let (pa, la) = a;
    let (pb, lb) = b;
    if la.is_empty() || lb.is_empty() {
        return true;
    }
    let start = |p: u64, l: &Layout| p as u128 + (l.offset * size) as u128;
    let end = |p: u64, l: &Layout| p as u128 + (l.extent().unwrap_or(usize::MAX) * size) as u128;
    if end(pa, la) <= start(pb, lb) || end(pb, lb) <= start(pa, la) {
        return true;
    }
    // A shared token grid: same batch and seq extents and strides, each token's heads inside
    // one seq stride, and batches that do not interleave.
    let grid = la.shape[..2] == lb.shape[..2] && la.strides[..2] == lb.strides[..2];
    if !grid {
        return false;
    }
    let base = start(pa, la).min(start(pb, lb));
    let rel = |p: u64, l: &Layout| -> Option<Vec<(u128, u128)>> {
        let off = start(p, l) - base;
        if off % size as u128 != 0 {
            return None;
        }
        let off = off / size as u128;
        Some(l.token_footprint().into_iter().map(|(s, e)| (off + s as u128, off + e as u128)).collect())
    };
    let (Some(fa), Some(fb)) = (rel(pa, la), rel(pb, lb)) else { return false };
    // Tokens cannot collide if the [batch, seq] grid, each token `reach` elements wide from
    // the common base, is itself free of overlap.
    let reach = fa.iter().chain(&fb).map(|r| r.1).max().unwrap_or(0);
    let Ok(reach) = usize::try_from(reach) else { return false };
    let tokens = Layout::strided([la.batch(), la.seq(), 1, reach], [la.strides[0], la.strides[1], 0], 0);
    if !tokens.is_non_overlapping() {
        return false;
    }
    fa.iter().all(|x| fb.iter().all(|y| x.1 <= y.0 || y.1 <= x.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extents() {
        assert_eq!(Layout::bshd(2, 3, 4, 8).extent(), Some(2 * 3 * 4 * 8));
        assert_eq!(Layout::bhsd(2, 3, 4, 8).extent(), Some(2 * 3 * 4 * 8));
        assert_eq!(Layout::bshd(0, 3, 4, 8).extent(), Some(0));
        assert_eq!(Layout::strided([1, 2, 1, 4], [0, 10, 0], 5).extent(), Some(19));
        assert_eq!(Layout::strided([2, 2, 2, 2], [usize::MAX, 1, 1], 0).extent(), None);
    }

    #[test]
    fn overlap_within_a_view() {
        assert!(Layout::bshd(2, 3, 4, 8).is_non_overlapping());
        assert!(Layout::bhsd(2, 3, 4, 8).is_non_overlapping());
        assert!(Layout::strided([1, 5, 2, 8], [0, 40, 16], 3).is_non_overlapping());
        assert!(!Layout::strided([1, 5, 2, 8], [0, 40, 4], 0).is_non_overlapping(), "heads overlap");
        assert!(!Layout::strided([2, 5, 2, 8], [16, 16, 8], 0).is_non_overlapping(), "tokens overlap");
        assert!(!Layout::strided([1, 5, 2, 8], [0, 0, 8], 0).is_non_overlapping(), "broadcast seq");
        assert!(Layout::strided([2, 16, 0, 64], [0, 64, 1024], 0).is_non_overlapping(), "empty");
    }

    #[test]
    fn fused_qkv_views_are_disjoint_but_shifted_ones_are_not() {
        let row = (4 + 2 + 2) * 16;
        let q = Layout::strided([1, 9, 4, 16], [9 * row, row, 16], 0);
        let k = Layout::strided([1, 9, 2, 16], [9 * row, row, 16], 4 * 16);
        assert!(disjoint((0, &q), (0, &k), 2));
        let k_bad = Layout::strided([1, 9, 2, 16], [9 * row, row, 16], 3 * 16);
        assert!(!disjoint((0, &q), (0, &k_bad), 2));
        // k reaching into the next token's q.
        let k_wrap = Layout::strided([1, 9, 2, 16], [9 * row, row, 16], row - 16);
        assert!(!disjoint((0, &q), (0, &k_wrap), 2));
        // Separate buffers.
        let b = Layout::bshd(1, 9, 4, 16);
        assert!(disjoint((0, &b), (1 << 20, &b), 4));
        assert!(!disjoint((0, &b), (64, &b), 4));
        assert!(!disjoint((0, &b), (0, &b), 4));
    }
}
