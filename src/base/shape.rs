//! Shapes and the index arithmetic shared by every backend. Tensors are always stored contiguous
//! (row-major), so a shape is all a backend needs; ops that would be views elsewhere (permute,
//! narrow) copy.

use super::error::{Error, Result};

#[derive(Clone, PartialEq, Eq, Hash, Default)]
pub struct Shape(Vec<usize>);

impl std::fmt::Debug for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

impl std::fmt::Display for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

impl Shape {
    pub fn new(dims: Vec<usize>) -> Self {
        Shape(dims)
    }

    pub fn scalar() -> Self {
        Shape(vec![])
    }

    pub fn dims(&self) -> &[usize] {
        &self.0
    }

    pub fn rank(&self) -> usize {
        self.0.len()
    }

    pub fn elem_count(&self) -> usize {
        self.0.iter().product()
    }

    /// The element count, or `None` when the product of the dims (zeros counted as 1) does not
    /// fit in `usize`. A shape that passes can be multiplied out in any grouping (`flatten`,
    /// `split_at_dim`) without overflow, even when a zero dim makes it empty.
    pub fn checked_elem_count(&self) -> Option<usize> {
        self.0
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d.max(1)))?;
        Some(self.elem_count())
    }

    /// Row-major strides, in elements.
    pub fn strides(&self) -> Vec<usize> {
        let mut s = vec![1; self.0.len()];
        for i in (0..self.0.len().saturating_sub(1)).rev() {
            s[i] = s[i + 1] * self.0[i + 1];
        }
        s
    }

    /// Resolves a possibly negative dim (`-1` is the last) against this rank.
    pub fn dim(&self, op: &'static str, dim: isize) -> Result<usize> {
        let rank = self.rank() as isize;
        let d = if dim < 0 { dim + rank } else { dim };
        if d < 0 || d >= rank {
            return Err(Error::DimOutOfRange {
                op,
                dim,
                rank: self.rank(),
            });
        }
        Ok(d as usize)
    }

    /// Splits the shape around `dim` into (outer, len, inner) element counts: the form every
    /// per-dimension kernel (reductions, softmax, gather, narrow, cat) works on.
    pub fn split_at_dim(&self, dim: usize) -> (usize, usize, usize) {
        let outer = self.0[..dim].iter().product();
        let inner = self.0[dim + 1..].iter().product();
        (outer, self.0[dim], inner)
    }

    /// The shape that broadcasting `self` with `other` gives (numpy rules).
    pub fn broadcast_with(&self, op: &'static str, other: &Shape) -> Result<Shape> {
        let (a, b) = (&self.0, &other.0);
        let rank = a.len().max(b.len());
        let mut out = vec![0; rank];
        for i in 0..rank {
            let da = if i + a.len() >= rank {
                a[i + a.len() - rank]
            } else {
                1
            };
            let db = if i + b.len() >= rank {
                b[i + b.len() - rank]
            } else {
                1
            };
            out[i] = if da == db || db == 1 {
                da
            } else if da == 1 {
                db
            } else {
                return Err(Error::shape_mismatch(
                    op,
                    self,
                    other,
                    format!("dimension {i} differs ({da} vs {db}) and neither is 1"),
                ));
            };
        }
        Ok(Shape(out))
    }

    /// Strides (in elements) to read `self` as if it had the broadcast shape `out`:
    /// 0 where a dimension is broadcast.
    pub fn broadcast_strides(&self, out: &Shape) -> Vec<usize> {
        let own = self.strides();
        let off = out.rank() - self.rank();
        (0..out.rank())
            .map(|i| {
                if i < off || self.0[i - off] == 1 {
                    0
                } else {
                    own[i - off]
                }
            })
            .collect()
    }
}

impl From<Vec<usize>> for Shape {
    fn from(v: Vec<usize>) -> Self {
        Shape(v)
    }
}
impl From<&[usize]> for Shape {
    fn from(v: &[usize]) -> Self {
        Shape(v.to_vec())
    }
}
impl<const N: usize> From<[usize; N]> for Shape {
    fn from(v: [usize; N]) -> Self {
        Shape(v.to_vec())
    }
}
impl From<&Shape> for Shape {
    fn from(v: &Shape) -> Self {
        v.clone()
    }
}
impl From<()> for Shape {
    fn from(_: ()) -> Self {
        Shape(vec![])
    }
}
impl From<usize> for Shape {
    fn from(v: usize) -> Self {
        Shape(vec![v])
    }
}
