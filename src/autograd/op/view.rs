//! Backward of the views and layout changes, cat and gather: the gradient mapped back to the
//! input's shape.

use super::{Op, Wanted};
use crate::base::error::Result;
use crate::tensor::{Shape, Tensor};

pub(super) fn backward(op: &Op, g: &Tensor, w: &mut Wanted<'_>) -> Result<Vec<Option<Tensor>>> {
    match op {
        Op::BroadcastTo { from } => w.one(|| g.sum_to_shape(from)),
        Op::Reshape { from } => w.one(|| g.reshape(from.clone())),
        Op::Relayout => w.one(|| Ok(g.clone())),
        Op::Permute { perm } => w.one(|| {
            let mut inv = vec![0; perm.len()];
            for (i, &p) in perm.iter().enumerate() {
                inv[p] = i;
            }
            g.permute(&inv)
        }),
        Op::Narrow { from, dim, start } => w.one(|| narrow(g, from, *dim, *start)),
        Op::Cat { lens, dim } => {
            let mut start = 0;
            let mut out = Vec::with_capacity(lens.len());
            for (i, &n) in lens.iter().enumerate() {
                out.push(w.maybe(i, || g.narrow(*dim as isize, start, n))?);
                start += n;
            }
            Ok(out)
        }
        Op::Gather { from, dim, index } => w.one(|| g.scatter_add_dim(index, *dim, from)),
        _ => Err(op.misrouted("view")),
    }
}

/// The gradient of a narrow: `g` padded with zeros back to `from` along `dim`.
fn narrow(g: &Tensor, from: &Shape, dim: usize, start: usize) -> Result<Tensor> {
    let len = from.dims()[dim];
    let count = g.dims()[dim];
    let mut parts = Vec::new();
    let zeros = |n: usize| {
        let mut d = from.dims().to_vec();
        d[dim] = n;
        Tensor::zeros(d, g.dtype(), g.device())
    };
    if start > 0 {
        parts.push(zeros(start)?);
    }
    parts.push(g.clone());
    if start + count < len {
        parts.push(zeros(len - start - count)?);
    }
    Tensor::cat(&parts.iter().collect::<Vec<_>>(), dim as isize)
}
