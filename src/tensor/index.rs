//! gather and its inverse, scatter_add.

use super::{DType, Shape, Tensor};
use crate::autograd::Op;
use crate::base::error::{Error, Result};

impl Tensor {
    /// `out[.., j, ..] = self[.., index[.., j, ..], ..]` along `dim`; `index` (I64) has this
    /// tensor's shape except along `dim`.
    pub fn gather(&self, dim: isize, index: &Tensor) -> Result<Tensor> {
        let d = self.shape().dim("gather", dim)?;
        self.same_device("gather", index)?;
        if index.dtype() != DType::I64 {
            return Err(Error::UnsupportedDType {
                op: "gather",
                got: index.dtype(),
                expected: "i64 indices",
            });
        }
        let ok = index.rank() == self.rank()
            && (0..self.rank()).all(|i| i == d || index.dims()[i] == self.dims()[i]);
        if !ok {
            return Err(Error::shape_mismatch(
                "gather",
                self.shape(),
                index.shape(),
                format!("index must match the input in every dim but {d}"),
            ));
        }
        let (x, index) = (self.contiguous()?, index.contiguous()?);
        let s = x
            .storage()
            .gather(&x.layout(), &index.storage(), &index.layout(), d)?;
        Ok(Tensor::from_op(s, index.shape().clone(), &[self], || {
            Op::Gather {
                from: self.shape().clone(),
                dim: d,
                index: index.detach(),
            }
        }))
    }

    /// Zeros of `shape` with this tensor's values added at `index` along `dim` (the backward of
    /// gather and of max/min; not recorded).
    pub(crate) fn scatter_add_dim(
        &self,
        index: &Tensor,
        dim: usize,
        shape: &Shape,
    ) -> Result<Tensor> {
        let g = self.reshape(index.shape().clone())?.contiguous()?;
        let index = index.contiguous()?;
        let s =
            g.storage()
                .scatter_add(&g.layout(), &index.storage(), &index.layout(), dim, shape)?;
        Ok(Tensor::from_storage(s, shape.clone()))
    }
}
