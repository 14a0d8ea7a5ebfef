//! Shape ops: reshape (shares the buffer), permute/transpose, narrow, cat (copies).

use super::{Shape, Tensor};
use crate::autograd::Op;
use crate::error::{Error, Result};
use crate::tensor::storage::Storage;

impl Tensor {
    /// The same elements with another shape of the same element count; shares the buffer.
    pub fn reshape(&self, shape: impl Into<Shape>) -> Result<Tensor> {
        let shape = shape.into();
        if super::check_size("reshape", &shape, self.dtype())? != self.elem_count() {
            return Err(Error::shape_mismatch(
                "reshape",
                self.shape(),
                &shape,
                format!(
                    "{} elements cannot be viewed as {}",
                    self.elem_count(),
                    shape.elem_count()
                ),
            ));
        }
        if &shape == self.shape() {
            return Ok(self.clone());
        }
        Ok(self.view_with_op(shape, &[self], || Op::Reshape {
            from: self.shape().clone(),
        }))
    }

    /// Merges dims `start..=end` into one.
    pub fn flatten(&self, start: isize, end: isize) -> Result<Tensor> {
        if self.rank() == 0 {
            return self.reshape(vec![1]);
        }
        let (s, e) = (
            self.shape().dim("flatten", start)?,
            self.shape().dim("flatten", end)?,
        );
        if s > e {
            return Err(Error::invalid_arg(
                "flatten",
                "start",
                s,
                format!("at most end = {e}"),
            ));
        }
        let d = self.dims();
        let mut out = d[..s].to_vec();
        out.push(d[s..=e].iter().product());
        out.extend_from_slice(&d[e + 1..]);
        self.reshape(out)
    }

    /// All dims in one.
    pub fn flatten_all(&self) -> Result<Tensor> {
        self.reshape(vec![self.elem_count()])
    }

    /// Inserts a dim of size 1 at `dim`.
    pub fn unsqueeze(&self, dim: usize) -> Result<Tensor> {
        if dim > self.rank() {
            return Err(Error::DimOutOfRange {
                op: "unsqueeze",
                dim: dim as isize,
                rank: self.rank(),
            });
        }
        let mut d = self.dims().to_vec();
        d.insert(dim, 1);
        self.reshape(d)
    }

    /// Removes a dim of size 1.
    pub fn squeeze(&self, dim: isize) -> Result<Tensor> {
        let d = self.shape().dim("squeeze", dim)?;
        if self.dims()[d] != 1 {
            return Err(Error::invalid_shape(
                "squeeze",
                self.shape(),
                format!("dim {d} has size {}, not 1", self.dims()[d]),
            ));
        }
        let mut dims = self.dims().to_vec();
        dims.remove(d);
        self.reshape(dims)
    }

    /// Reorders the dims: output dim `i` is input dim `perm[i]`. Copies.
    pub fn permute(&self, perm: &[usize]) -> Result<Tensor> {
        let rank = self.rank();
        let mut seen = vec![false; rank];
        let valid = perm.len() == rank
            && perm
                .iter()
                .all(|&p| p < rank && !std::mem::replace(&mut seen[p], true));
        if !valid {
            return Err(Error::invalid_arg(
                "permute",
                "perm",
                format!("{perm:?}"),
                format!("a permutation of 0..{rank}"),
            ));
        }
        if perm.iter().enumerate().all(|(i, &p)| i == p) {
            return Ok(self.clone());
        }
        let s = self.storage().permute(self.shape(), perm)?;
        let shape = Shape::new(perm.iter().map(|&p| self.dims()[p]).collect());
        Ok(Tensor::from_op(s, shape, &[self], || Op::Permute {
            perm: perm.to_vec(),
        }))
    }

    /// Swaps two dims. Copies.
    pub fn transpose(&self, d0: isize, d1: isize) -> Result<Tensor> {
        let (a, b) = (
            self.shape().dim("transpose", d0)?,
            self.shape().dim("transpose", d1)?,
        );
        let mut perm: Vec<usize> = (0..self.rank()).collect();
        perm.swap(a, b);
        self.permute(&perm)
    }

    /// Elements `start..start+len` along `dim`. Copies.
    pub fn narrow(&self, dim: isize, start: usize, len: usize) -> Result<Tensor> {
        let d = self.shape().dim("narrow", dim)?;
        let n = self.dims()[d];
        if start.checked_add(len).is_none_or(|end| end > n) {
            return Err(Error::invalid_arg(
                "narrow",
                "start + len",
                format!("{start} + {len}"),
                format!("at most the size of dim {d}, {n}"),
            ));
        }
        if start == 0 && len == n {
            return Ok(self.clone());
        }
        let s = self
            .storage()
            .narrow(self.shape().split_at_dim(d), start, len)?;
        let mut shape = self.dims().to_vec();
        shape[d] = len;
        Ok(Tensor::from_op(s, Shape::new(shape), &[self], || {
            Op::Narrow {
                from: self.shape().clone(),
                dim: d,
                start,
            }
        }))
    }

    /// Concatenates along `dim`; all tensors share dtype, device and every other dim.
    pub fn cat(tensors: &[&Tensor], dim: isize) -> Result<Tensor> {
        if let Some(cast) = crate::amp::autocast::inputs_n("cat", tensors)? {
            return Tensor::cat(&cast.iter().collect::<Vec<_>>(), dim);
        }
        let first = tensors.first().ok_or_else(|| {
            Error::invalid_shape("cat", &Shape::scalar(), "no tensors to concatenate")
        })?;
        let d = first.shape().dim("cat", dim)?;
        for t in &tensors[1..] {
            first.same_device("cat", t)?;
            if t.dtype() != first.dtype() {
                return Err(Error::DTypeMismatch {
                    op: "cat",
                    lhs: first.dtype(),
                    rhs: t.dtype(),
                });
            }
            let ok = t.rank() == first.rank()
                && (0..t.rank()).all(|i| i == d || t.dims()[i] == first.dims()[i]);
            if !ok {
                return Err(Error::shape_mismatch(
                    "cat",
                    first.shape(),
                    t.shape(),
                    format!("every dim but {d} must match"),
                ));
            }
        }
        if tensors.len() == 1 {
            return Ok((*first).clone());
        }
        let (outer, _, inner) = first.shape().split_at_dim(d);
        let lens: Vec<usize> = tensors.iter().map(|t| t.dims()[d]).collect();
        let guards: Vec<_> = tensors.iter().map(|t| t.storage()).collect();
        let parts: Vec<&Storage> = guards.iter().map(|g| &**g).collect();
        let s = Storage::cat(&parts, outer, &lens, inner)?;
        drop(guards);
        let mut shape = first.dims().to_vec();
        shape[d] = lens
            .iter()
            .try_fold(0usize, |a, &l| a.checked_add(l))
            .unwrap_or(usize::MAX);
        let shape = Shape::new(shape);
        super::check_size("cat", &shape, first.dtype())?;
        Ok(Tensor::from_op(s, shape, tensors, || Op::Cat {
            lens: tensors.iter().map(|t| t.dims()[d]).collect(),
            dim: d,
        }))
    }
}
