//! Backward of the views and layout changes, cat and gather: the gradient mapped back to the
//! input's shape.

use super::{Op, Wanted};
use crate::base::error::Result;
use crate::tensor::{Shape, Tensor};

pub(super) fn backward(op: &Op, g: &Tensor, w: &mut Wanted<'_>) -> Result<Vec<Option<Tensor>>> {
    match op {
        Op::BroadcastTo { from } => w.one(|| g.sum_to_shape(from)),
        Op::Reshape { from } => w.one(|| reshape_grad(g, from)),
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

/// The gradient of a reshape, mapped back to the input's shape. The gradient a sum sends back
/// is one value broadcast everywhere (every stride 0), which a reshape would copy out to the
/// full size (`sum_all` flattens first: 12.6M elements at op_speed's attention shapes); it goes
/// back as a broadcast of that value instead, a view. Only here: a forward reshape of a
/// broadcast stays a copy, as callers of `reshape` expect a tensor of their own.
fn reshape_grad(g: &Tensor, from: &Shape) -> Result<Tensor> {
    if g.elem_count() > 1 && g.layout().strides().iter().all(|&s| s == 0) {
        let mut one = g.clone();
        for d in 0..g.rank() {
            one = one.narrow(d as isize, 0, 1)?;
        }
        return one.reshape(Shape::scalar())?.broadcast_as(from);
    }
    g.reshape(from.clone())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::{DType, Device};

    #[test]
    fn a_broadcast_gradient_reshapes_as_a_view() {
        let one = Tensor::from_vec(vec![2.5f32], Shape::scalar(), Device::Cpu).unwrap();
        let g = one.broadcast_as(&Shape::new(vec![24])).unwrap();
        let r = reshape_grad(&g, &Shape::new(vec![2, 3, 4])).unwrap();
        assert_eq!(r.dims(), &[2, 3, 4]);
        assert_eq!(r.layout().strides(), &[0, 0, 0]);
        assert_eq!(r.to_vec::<f32>().unwrap(), vec![2.5; 24]);
        // Anything else reshapes as before.
        let dense = Tensor::zeros([24], DType::F32, Device::Cpu).unwrap();
        let r = reshape_grad(&dense, &Shape::new(vec![4, 6])).unwrap();
        assert_eq!(r.layout().strides(), &[6, 1]);
    }
}
