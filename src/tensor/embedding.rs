//! Embedding: rows of a `[num, dim]` table gathered by i64 indices of any shape (PyTorch's
//! `F.embedding`), the gradient a deterministic scatter-add into the table (positions summed in
//! order; `padding_idx`'s row gets none). The CPU refuses an index outside the table; the CUDA
//! backend cannot check without reading the device, so such a row comes out NaN there.

use super::{DType, Shape, Tensor};
use crate::autograd::Op;
use crate::backend::EmbeddingParams;
use crate::base::error::{Error, Result};

impl Tensor {
    /// `weight[self]`: `self` holds i64 indices, `weight` is the `[num, dim]` table; the result
    /// has shape `self.dims() + [dim]` and the table's dtype.
    pub fn embedding(&self, weight: &Tensor, padding_idx: Option<usize>) -> Result<Tensor> {
        let op = "embedding";
        if self.dtype() != DType::I64 {
            return Err(Error::UnsupportedDType {
                op,
                got: self.dtype(),
                expected: "i64 indices",
            });
        }
        weight.float_only(op)?;
        self.same_device(op, weight)?;
        let &[num, dim] = weight.dims() else {
            return Err(Error::invalid_arg(
                op,
                "weight",
                format!("shape {:?}", weight.dims()),
                "a 2-D [num, dim] table",
            ));
        };
        if let Some(pi) = padding_idx {
            if pi >= num {
                return Err(Error::invalid_arg(
                    op,
                    "padding_idx",
                    pi,
                    format!("a row of the table, 0..{num}"),
                ));
            }
        }
        let p = EmbeddingParams {
            num,
            dim,
            count: self.elem_count(),
            padding_idx,
        };
        let (idx, table) = (self.contiguous()?, weight.contiguous()?);
        let s = table
            .storage()
            .embedding(&table.layout(), &idx.storage(), &idx.layout(), &p)?;
        let mut dims = self.dims().to_vec();
        dims.push(dim);
        Ok(Tensor::from_op(s, Shape::new(dims), &[weight], || {
            Op::Embedding {
                idx: idx.detach(),
                p,
            }
        }))
    }

    /// The table's gradient from the output's (`self`).
    pub(crate) fn embedding_backward(&self, idx: &Tensor, p: &EmbeddingParams) -> Result<Tensor> {
        let g = self.contiguous()?;
        let s = g
            .storage()
            .embedding_backward(&g.layout(), &idx.storage(), &idx.layout(), p)?;
        Ok(Tensor::from_storage(s, Shape::new(vec![p.num, p.dim])))
    }
}
