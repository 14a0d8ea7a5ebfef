//! `Layout`: where the elements of a tensor sit in its storage. A logical shape, one stride per
//! dimension (in elements) and the offset of the first element: element `(i0, i1, …)` is at
//! `offset + Σ ik·strides[k]`. Views (permute, narrow, expand, reshape of a contiguous tensor)
//! change the layout and share the storage; the backend contract hands every op its operands'
//! layouts.
//!
//! Shapes stay logical (`[n, c, h, w]` for an image batch) whatever the memory order; a
//! [`MemoryFormat`] is a property of the strides, as in PyTorch.

use super::shape::Shape;

/// How a 4-D tensor's elements are ordered in memory, as PyTorch's `memory_format`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum MemoryFormat {
    /// Row-major over the logical dims (NCHW for images).
    #[default]
    Contiguous,
    /// Channels innermost (NHWC for images; KRSC for convolution weights).
    ChannelsLast,
}

impl MemoryFormat {
    pub fn name(self) -> &'static str {
        match self {
            MemoryFormat::Contiguous => "contiguous",
            MemoryFormat::ChannelsLast => "channels_last",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Layout {
    shape: Shape,
    strides: Vec<usize>,
    offset: usize,
}

/// Row-major strides of `dims`.
fn row_major(dims: &[usize]) -> Vec<usize> {
    let mut s = vec![1; dims.len()];
    for i in (0..dims.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * dims[i + 1].max(1);
    }
    s
}

impl Layout {
    /// Row-major at offset 0.
    pub fn contiguous(shape: Shape) -> Layout {
        let strides = row_major(shape.dims());
        Layout {
            shape,
            strides,
            offset: 0,
        }
    }

    /// `shape` in `format` at offset 0; channels_last needs a 4-D shape (other ranks are laid
    /// out contiguous, as PyTorch does for them).
    pub fn with_format(shape: Shape, format: MemoryFormat) -> Layout {
        match (format, shape.dims()) {
            (MemoryFormat::ChannelsLast, &[_, c, h, w]) => {
                let (c, h, w) = (c.max(1), h.max(1), w.max(1));
                Layout {
                    strides: vec![h * w * c, 1, w * c, c],
                    shape,
                    offset: 0,
                }
            }
            _ => Layout::contiguous(shape),
        }
    }

    pub fn new(shape: Shape, strides: Vec<usize>, offset: usize) -> Layout {
        debug_assert_eq!(shape.rank(), strides.len());
        Layout {
            shape,
            strides,
            offset,
        }
    }

    pub fn shape(&self) -> &Shape {
        &self.shape
    }
    pub fn dims(&self) -> &[usize] {
        self.shape.dims()
    }
    pub fn strides(&self) -> &[usize] {
        &self.strides
    }
    pub fn offset(&self) -> usize {
        self.offset
    }
    pub fn rank(&self) -> usize {
        self.shape.rank()
    }
    pub fn elem_count(&self) -> usize {
        self.shape.elem_count()
    }

    /// Whether the strides are those of `format` (dims of size 1 may have any stride, as in
    /// PyTorch: a `[n, c, 1, 1]` tensor is both contiguous and channels_last).
    pub fn is_format(&self, format: MemoryFormat) -> bool {
        let want = Layout::with_format(self.shape.clone(), format);
        self.dims()
            .iter()
            .zip(self.strides.iter().zip(&want.strides))
            .all(|(&d, (&s, &w))| d <= 1 || s == w)
    }

    /// Row-major (size-1 dims aside), at any offset.
    pub fn is_contiguous(&self) -> bool {
        self.is_format(MemoryFormat::Contiguous)
    }

    /// The format these strides are in (PyTorch's `suggest_memory_format`), `None` for other
    /// strided views. Where both fit because dims of size 1 leave it open (`[n, 1, h, w]`,
    /// `[n, c, 1, 1]`), the strides of the size-1 dims decide: channels_last when they are
    /// exactly channels_last's (as [`Layout::with_format`] lays them out) and not also exactly
    /// row-major's, else contiguous. So a one-channel image laid out channels_last stays
    /// channels_last through the ops that keep their input's format.
    pub fn memory_format(&self) -> Option<MemoryFormat> {
        let cl = MemoryFormat::ChannelsLast;
        match (self.is_contiguous(), self.is_format(cl)) {
            (false, false) => None,
            (false, true) => Some(cl),
            (true, false) => Some(MemoryFormat::Contiguous),
            (true, true) => {
                let exactly =
                    |f| Layout::with_format(self.shape.clone(), f).strides == self.strides;
                if exactly(cl) && !exactly(MemoryFormat::Contiguous) {
                    Some(cl)
                } else {
                    Some(MemoryFormat::Contiguous)
                }
            }
        }
    }

    /// Whether the elements fill `offset .. offset + elem_count` exactly once, in some order of
    /// the dims: elementwise ops then run over that span and keep the strides.
    pub fn is_dense(&self) -> bool {
        let mut dims: Vec<(usize, usize)> = self
            .dims()
            .iter()
            .zip(&self.strides)
            .filter(|(&d, _)| d != 1)
            .map(|(&d, &s)| (s, d))
            .collect();
        if dims.iter().any(|&(_, d)| d == 0) {
            return true;
        }
        dims.sort_unstable();
        let mut expect = 1;
        for (s, d) in dims {
            if s != expect {
                return false;
            }
            expect *= d;
        }
        true
    }

    /// The same strides at offset 0: where an elementwise op on a dense layout writes its result.
    pub fn dense_like(&self) -> Layout {
        Layout {
            shape: self.shape.clone(),
            strides: self.strides.clone(),
            offset: 0,
        }
    }

    /// The end (exclusive) of the storage range the elements touch: `offset + 1 + Σ (d-1)·s`.
    pub fn storage_end(&self) -> usize {
        if self.elem_count() == 0 {
            return self.offset;
        }
        self.offset
            + 1
            + self
                .dims()
                .iter()
                .zip(&self.strides)
                .map(|(&d, &s)| (d - 1) * s)
                .sum::<usize>()
    }

    // ---- views --------------------------------------------------------------------------------

    /// Output dim `i` is input dim `perm[i]` (`perm` is checked by the caller).
    pub fn permute(&self, perm: &[usize]) -> Layout {
        Layout {
            shape: Shape::new(perm.iter().map(|&p| self.dims()[p]).collect()),
            strides: perm.iter().map(|&p| self.strides[p]).collect(),
            offset: self.offset,
        }
    }

    /// Elements `start .. start + len` along `dim` (checked by the caller).
    pub fn narrow(&self, dim: usize, start: usize, len: usize) -> Layout {
        let mut dims = self.dims().to_vec();
        dims[dim] = len;
        Layout {
            shape: Shape::new(dims),
            strides: self.strides.clone(),
            offset: self.offset + start * self.strides[dim],
        }
    }

    /// Broadcast to `shape` (numpy rules, checked by the caller): new and size-1 dims get
    /// stride 0.
    pub fn expand(&self, shape: &Shape) -> Layout {
        let off = shape.rank() - self.rank();
        let strides = (0..shape.rank())
            .map(|i| {
                if i < off || (self.dims()[i - off] == 1 && shape.dims()[i] != 1) {
                    0
                } else {
                    self.strides[i - off]
                }
            })
            .collect();
        Layout {
            shape: shape.clone(),
            strides,
            offset: self.offset,
        }
    }

    /// The same elements as `shape`, sharing the storage, when the strides allow it without a
    /// copy (a contiguous layout always does); `None` otherwise.
    pub fn reshape(&self, shape: &Shape) -> Option<Layout> {
        if self.is_contiguous() {
            return Some(Layout {
                shape: shape.clone(),
                strides: row_major(shape.dims()),
                offset: self.offset,
            });
        }
        // Only size-1 dims added or removed: keep the other strides in order.
        let own: Vec<(usize, usize)> = self
            .dims()
            .iter()
            .zip(&self.strides)
            .filter(|(&d, _)| d != 1)
            .map(|(&d, &s)| (d, s))
            .collect();
        let theirs: Vec<usize> = shape.dims().iter().copied().filter(|&d| d != 1).collect();
        if own.len() != theirs.len() || own.iter().zip(&theirs).any(|(a, &b)| a.0 != b) {
            return None;
        }
        let mut it = own.iter();
        let strides = shape
            .dims()
            .iter()
            .map(|&d| {
                if d == 1 {
                    1
                } else {
                    it.next().map_or(1, |p| p.1)
                }
            })
            .collect();
        Some(Layout {
            shape: shape.clone(),
            strides,
            offset: self.offset,
        })
    }

    /// Storage positions of every element in row-major logical order (the reference walk the
    /// CPU backend's strided kernels use).
    pub fn positions(&self) -> StridedPositions<'_> {
        StridedPositions {
            layout: self,
            index: vec![0; self.rank()],
            next: self.offset,
            left: self.elem_count(),
        }
    }
}

impl From<Shape> for Layout {
    /// A contiguous layout of the shape.
    fn from(shape: Shape) -> Layout {
        Layout::contiguous(shape)
    }
}

/// Iterator of [`Layout::positions`].
pub struct StridedPositions<'a> {
    layout: &'a Layout,
    index: Vec<usize>,
    next: usize,
    left: usize,
}

impl Iterator for StridedPositions<'_> {
    type Item = usize;

    fn next(&mut self) -> Option<usize> {
        if self.left == 0 {
            return None;
        }
        self.left -= 1;
        let here = self.next;
        let dims = self.layout.dims();
        let strides = self.layout.strides();
        for d in (0..dims.len()).rev() {
            self.index[d] += 1;
            if self.index[d] < dims[d] {
                self.next += strides[d];
                break;
            }
            self.next -= (dims[d] - 1) * strides[d];
            self.index[d] = 0;
        }
        Some(here)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.left, Some(self.left))
    }
}

impl ExactSizeIterator for StridedPositions<'_> {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_and_density() {
        let s = Shape::new(vec![2, 3, 4, 5]);
        let c = Layout::contiguous(s.clone());
        let cl = Layout::with_format(s.clone(), MemoryFormat::ChannelsLast);
        assert_eq!(c.strides(), &[60, 20, 5, 1]);
        assert_eq!(cl.strides(), &[60, 1, 15, 3]);
        assert!(c.is_contiguous() && !cl.is_contiguous());
        assert_eq!(cl.memory_format(), Some(MemoryFormat::ChannelsLast));
        assert!(c.is_dense() && cl.is_dense());
        assert!(!c.narrow(3, 1, 2).is_dense());
        assert!(c.narrow(0, 1, 1).is_dense());
        assert!(!c.expand(&Shape::new(vec![3, 2, 3, 4, 5])).is_dense());
        // Size-1 dims: both formats fit; the strides of the size-1 dims say which was meant.
        let v = Layout::contiguous(Shape::new(vec![2, 3, 1, 1]));
        assert!(v.is_format(MemoryFormat::ChannelsLast) && v.is_contiguous());
        assert_eq!(v.memory_format(), Some(MemoryFormat::Contiguous));
        for dims in [vec![2, 3, 1, 1], vec![2, 1, 4, 5]] {
            let s = Shape::new(dims);
            let cl = Layout::with_format(s.clone(), MemoryFormat::ChannelsLast);
            assert_eq!(
                cl.memory_format(),
                Some(MemoryFormat::ChannelsLast),
                "{s:?}"
            );
            let c = Layout::contiguous(s.clone());
            assert_eq!(c.memory_format(), Some(MemoryFormat::Contiguous), "{s:?}");
        }
        // Every stride equal both ways: row-major, as PyTorch defaults.
        let one = Layout::with_format(Shape::new(vec![2, 1, 1, 1]), MemoryFormat::ChannelsLast);
        assert_eq!(one.memory_format(), Some(MemoryFormat::Contiguous));
    }

    #[test]
    fn positions_walk_row_major() {
        let l = Layout::contiguous(Shape::new(vec![2, 3])).permute(&[1, 0]);
        assert_eq!(l.positions().collect::<Vec<_>>(), vec![0, 3, 1, 4, 2, 5]);
        let n = Layout::contiguous(Shape::new(vec![3, 4])).narrow(1, 1, 2);
        assert_eq!(n.positions().collect::<Vec<_>>(), vec![1, 2, 5, 6, 9, 10]);
        assert_eq!(n.storage_end(), 11);
        let e = Layout::contiguous(Shape::new(vec![3])).expand(&Shape::new(vec![2, 3]));
        assert_eq!(e.positions().collect::<Vec<_>>(), vec![0, 1, 2, 0, 1, 2]);
    }

    #[test]
    fn reshape_views_only_when_strides_allow() {
        let c = Layout::contiguous(Shape::new(vec![2, 3, 4]));
        assert!(c.reshape(&Shape::new(vec![6, 4])).is_some());
        let t = c.permute(&[0, 2, 1]);
        assert!(t.reshape(&Shape::new(vec![2, 12])).is_none());
        let cl = Layout::with_format(Shape::new(vec![2, 8, 1, 1]), MemoryFormat::ChannelsLast);
        let flat = cl
            .reshape(&Shape::new(vec![2, 8]))
            .expect("size-1 dims only");
        assert_eq!(flat.strides(), &[8, 1]);
    }
}
