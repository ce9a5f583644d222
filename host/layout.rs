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
        // (stride, extent) of batch, seq and head; axes of extent 1 never step.
        let mut axes = [0, 1, 2].map(|i| (self.strides[i], self.shape[i]));
        axes.sort_unstable();
        let mut span = self.shape[3];
        for (stride, n) in axes.into_iter().filter(|&(_, n)| n > 1) {
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
    let offset = |p: u64, l: &Layout| {
        let off = start(p, l) - base;
        (off % size as u128 == 0).then_some(off / size as u128)
    };
    let (Some(oa), Some(ob)) = (offset(pa, la), offset(pb, lb)) else { return false };
    let last = |o: u128, l: &Layout| o + (l.heads() as u128 - 1) * l.strides[2] as u128 + l.head_dim() as u128;
    // Tokens cannot collide if the [batch, seq] grid, each token `reach` elements wide from
    // the common base, is itself free of overlap.
    let Ok(reach) = usize::try_from(last(oa, la).max(last(ob, lb))) else { return false };
    let tokens = Layout::strided([la.batch(), la.seq(), 1, reach], [la.strides[0], la.strides[1], 0], 0);
    if !tokens.is_non_overlapping() {
        return false;
    }
    heads_disjoint(
        (oa as i128, la.strides[2] as i128, la.heads(), la.head_dim() as i128),
        (ob as i128, lb.strides[2] as i128, lb.heads(), lb.head_dim() as i128),
    )
}

/// Whether the intervals `[o + h * s, o + h * s + d)`, `h < n`, of two views (each given as
/// `(o, s, n, d)`: MLA's latent cache holds a 512-wide and a 64-wide view in one row) share
/// no element. O(1) for equal strides and head dims (q and k of a fused buffer); otherwise
/// pairwise.
fn heads_disjoint((oa, sa, na, da): (i128, i128, usize, i128), (ob, sb, nb, db): (i128, i128, usize, i128)) -> bool {
    // `[x, x + dx)` and `[y, y + dy)` share nothing iff one ends before the other starts.
    let apart = |x: i128, y: i128| y >= x + da || x >= y + db;
    if sa == sb && da == db && na > 1 && nb > 1 {
        // Intervals overlap iff |ob - oa + k s| < d for some k = g - h in -(na-1) ..= nb-1.
        let (diff, s, lo, hi) = (ob - oa, sa, -(na as i128 - 1), nb as i128 - 1);
        let near = if s == 0 { lo } else { (-diff).div_euclid(s).clamp(lo, hi) };
        return [near, (near + 1).min(hi)].iter().all(|&k| (diff + k * s).abs() >= da);
    }
    (0..na as i128).all(|h| (0..nb as i128).all(|g| apart(oa + h * sa, ob + g * sb)))
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

    /// The element indices of a view (brute force).
    fn elements(l: &Layout) -> Vec<usize> {
        let mut v = Vec::new();
        for b in 0..l.batch() {
            for s in 0..l.seq() {
                for h in 0..l.heads() {
                    let row = l.offset + b * l.strides[0] + s * l.strides[1] + h * l.strides[2];
                    v.extend(row..row + l.head_dim());
                }
            }
        }
        v
    }

    /// Over many small random layouts: `is_non_overlapping` and `disjoint` never claim what
    /// the brute-force element sets contradict, and `disjoint` is exact for views on one
    /// token grid with equal head strides (fused QKV and its near misses).
    #[test]
    fn overlap_checks_agree_with_brute_force() {
        let mut state = 0x1234_5678_u64;
        let mut rnd = |n: u64| {
            state = rope_cuda_kernels_rand(state);
            (state % n) as usize
        };
        let (mut exact_cases, mut disjoint_cases) = (0, 0);
        for _ in 0..20_000 {
            let d = 1 + rnd(4);
            let shape_a = [1 + rnd(2), 1 + rnd(3), 1 + rnd(3), d];
            let same_grid = rnd(2) == 0;
            let strides_a = [rnd(40), rnd(20), rnd(8)];
            let a = Layout::strided(shape_a, strides_a, rnd(10));
            let b = if same_grid {
                let shape_b = [shape_a[0], shape_a[1], 1 + rnd(3), d];
                Layout::strided(shape_b, [strides_a[0], strides_a[1], strides_a[2]], rnd(16))
            } else {
                Layout::strided([1 + rnd(2), 1 + rnd(3), 1 + rnd(3), d], [rnd(40), rnd(20), rnd(8)], rnd(16))
            };
            let ea = elements(&a);
            let mut sorted = ea.clone();
            sorted.sort_unstable();
            sorted.dedup();
            if a.is_non_overlapping() {
                assert_eq!(sorted.len(), ea.len(), "{a:?} claimed free of overlap");
            }
            let eb = elements(&b);
            let truly = !eb.iter().any(|e| sorted.binary_search(e).is_ok());
            let claimed = disjoint((0, &a), (0, &b), 2);
            assert!(!claimed || truly, "{a:?} and {b:?} claimed disjoint");
            let on_grid = same_grid && a.is_non_overlapping() && b.is_non_overlapping();
            if on_grid && truly {
                exact_cases += 1;
                disjoint_cases += claimed as usize;
            }
        }
        assert!(exact_cases > 100, "too few grid cases ({exact_cases})");
        // Views on one grid that are disjoint are mostly recognised (the rest interleave
        // tokens in ways the grid rule does not model).
        assert!(disjoint_cases * 2 > exact_cases, "{disjoint_cases} of {exact_cases}");
    }

    fn rope_cuda_kernels_rand(s: u64) -> u64 {
        crate::reference::splitmix64(s)
    }

    #[test]
    fn heads_disjoint_matches_pairwise() {
        for oa in 0..6i128 {
            for ob in 0..40i128 {
                for s in [0i128, 2, 3, 8] {
                    for (na, nb) in [(1, 1), (2, 3), (4, 2), (5, 5)] {
                        for (da, db) in [(3, 3), (1, 4), (5, 2)] {
                            let fast = heads_disjoint((oa, s, na, da), (ob, s, nb, db));
                            // Element by element.
                            let elems = |o: i128, n: usize, d: i128| {
                                (0..n as i128).flat_map(move |h| (0..d).map(move |e| o + h * s + e))
                            };
                            let slow = elems(oa, na, da).all(|x| elems(ob, nb, db).all(|y| x != y));
                            assert_eq!(fast, slow, "oa {oa} ob {ob} s {s} n {na}/{nb} d {da}/{db}");
                        }
                    }
                }
            }
        }
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

    /// MLA's latent cache: kv_c (512) and k_pe (64) of each row, two views of one buffer of
    /// different head dims, are disjoint; k_pe reaching back into kv_c, or past the row into
    /// the next one's kv_c, is not.
    #[test]
    fn latent_cache_views_are_disjoint() {
        let row = 576;
        let kv_c = Layout::strided([10, 64, 1, 512], [64 * row, row, row], 0);
        let k_pe = Layout::strided([10, 64, 1, 64], [64 * row, row, row], 512);
        assert!(disjoint((0, &kv_c), (0, &k_pe), 2));
        assert!(disjoint((0, &k_pe), (0, &kv_c), 2));
        let back = Layout::strided([10, 64, 1, 64], [64 * row, row, row], 511);
        assert!(!disjoint((0, &kv_c), (0, &back), 2));
        let past = Layout::strided([10, 64, 1, 65], [64 * row, row, row], 512);
        assert!(!disjoint((0, &kv_c), (0, &past), 2));
    }
}
