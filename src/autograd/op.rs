//! The graph node: which op made a tensor, from which inputs, and the gradient of each input.
//! Formulas are written with tensor ops (run under `no_grad`) or the backends' backward kernels.

use crate::backend::{
    AdaptivePoolParams, BatchNormParams, BinaryOp, Conv2dParams, MatmulDims, Pool2dParams, UnaryOp,
};
use crate::error::Result;
use crate::tensor::{Shape, Tensor};

pub(crate) enum Op {
    ToDType(Tensor),
    ToDevice(Tensor),
    /// `y` is the (detached) output, kept where the derivative is cheapest from it.
    Unary {
        x: Tensor,
        y: Tensor,
        op: UnaryOp,
    },
    Affine {
        x: Tensor,
        mul: f64,
    },
    Powf {
        x: Tensor,
        e: f64,
    },
    Binary {
        lhs: Tensor,
        rhs: Tensor,
        op: BinaryOp,
    },
    BroadcastTo(Tensor),
    Sum {
        x: Tensor,
        dim: usize,
    },
    /// Max or min along `dim`; `index` holds the position chosen in each lane.
    MaxMin {
        x: Tensor,
        dim: usize,
        index: Tensor,
    },
    Reshape(Tensor),
    Permute {
        x: Tensor,
        perm: Vec<usize>,
    },
    Narrow {
        x: Tensor,
        dim: usize,
        start: usize,
    },
    Cat {
        parts: Vec<Tensor>,
        dim: usize,
    },
    Gather {
        x: Tensor,
        dim: usize,
        index: Tensor,
    },
    Matmul {
        lhs: Tensor,
        rhs: Tensor,
        dims: MatmulDims,
    },
    Conv2d {
        x: Tensor,
        w: Tensor,
        p: Conv2dParams,
    },
    BatchNorm {
        x: Tensor,
        w: Tensor,
        b: Tensor,
        mean: Tensor,
        invstd: Tensor,
        p: BatchNormParams,
    },
    MaxPool2d {
        x: Tensor,
        argmax: Tensor,
        p: Pool2dParams,
    },
    AvgPool2d {
        x: Tensor,
        p: Pool2dParams,
    },
    AdaptiveAvgPool2d {
        x: Tensor,
        p: AdaptivePoolParams,
    },
    Softmax {
        x: Tensor,
        y: Tensor,
        dim: usize,
        log: bool,
    },
    /// A user-defined function (`autograd::custom_function`).
    Custom(Box<super::hooks::CustomOp>),
}

impl Op {
    pub(crate) fn inputs(&self) -> Vec<&Tensor> {
        match self {
            Op::ToDType(x)
            | Op::ToDevice(x)
            | Op::Unary { x, .. }
            | Op::Affine { x, .. }
            | Op::Powf { x, .. }
            | Op::BroadcastTo(x)
            | Op::Sum { x, .. }
            | Op::MaxMin { x, .. }
            | Op::Reshape(x)
            | Op::Permute { x, .. }
            | Op::Narrow { x, .. }
            | Op::Gather { x, .. }
            | Op::MaxPool2d { x, .. }
            | Op::AvgPool2d { x, .. }
            | Op::AdaptiveAvgPool2d { x, .. }
            | Op::Softmax { x, .. } => vec![x],
            Op::Binary { lhs, rhs, .. } | Op::Matmul { lhs, rhs, .. } => vec![lhs, rhs],
            Op::Cat { parts, .. } => parts.iter().collect(),
            Op::Conv2d { x, w, .. } => vec![x, w],
            Op::BatchNorm { x, w, b, .. } => vec![x, w, b],
            Op::Custom(f) => f.inputs.iter().collect(),
        }
    }

    /// The gradient of each input that requires one, given `g`, the gradient of `out`.
    pub(crate) fn backward(&self, out: &Tensor, g: &Tensor) -> Result<Vec<(Tensor, Tensor)>> {
        let mut res = Vec::new();
        // Computes an input's gradient only when that input needs it (the image fed to the first
        // convolution does not, and its gradient is the most expensive one).
        let mut push = |x: &Tensor, f: &mut dyn FnMut() -> Result<Tensor>| -> Result<()> {
            if x.requires_grad() {
                res.push((x.clone(), f()?));
            }
            Ok(())
        };
        match self {
            Op::ToDType(x) => push(x, &mut || g.to_dtype(x.dtype()))?,
            Op::ToDevice(x) => push(x, &mut || g.to_device(x.device()))?,
            Op::Unary { x, y, op } => push(x, &mut || match op {
                UnaryOp::Neg => g.neg(),
                UnaryOp::Relu => g.relu_backward(x),
                UnaryOp::Exp => g.mul(y),
                UnaryOp::Log => g.div(x),
                UnaryOp::Sqrt => g.div(&y.affine(2.0, 0.0)?),
                UnaryOp::Sqr => g.mul(&x.affine(2.0, 0.0)?),
                // sign(x)·g, with sign(0) = 0 as torch.
                UnaryOp::Abs => g.relu_backward(x)?.sub(&g.relu_backward(&x.neg()?)?),
            })?,
            Op::Affine { x, mul } => push(x, &mut || g.affine(*mul, 0.0))?,
            Op::Powf { x, e } => push(x, &mut || g.mul(&x.powf(e - 1.0)?.affine(*e, 0.0)?))?,
            Op::Binary { lhs, rhs, op } => {
                // Ties of maximum/minimum send the whole gradient to lhs.
                let grad_lhs = || match op {
                    BinaryOp::Add | BinaryOp::Sub => Ok(g.clone()),
                    BinaryOp::Mul => g.mul(rhs),
                    BinaryOp::Div => g.div(rhs),
                    BinaryOp::Maximum => g.sub(&g.relu_backward(&rhs.sub(lhs)?)?),
                    BinaryOp::Minimum => g.sub(&g.relu_backward(&lhs.sub(rhs)?)?),
                };
                let grad_rhs = || match op {
                    BinaryOp::Add => Ok(g.clone()),
                    BinaryOp::Sub => g.neg(),
                    BinaryOp::Mul => g.mul(lhs),
                    BinaryOp::Div => g.mul(lhs)?.div(&rhs.sqr()?)?.neg(),
                    BinaryOp::Maximum => g.relu_backward(&rhs.sub(lhs)?),
                    BinaryOp::Minimum => g.relu_backward(&lhs.sub(rhs)?),
                };
                push(lhs, &mut || grad_lhs()?.sum_to_shape(lhs.shape()))?;
                push(rhs, &mut || grad_rhs()?.sum_to_shape(rhs.shape()))?;
            }
            Op::BroadcastTo(x) => push(x, &mut || g.sum_to_shape(x.shape()))?,
            Op::Sum { x, dim } => push(x, &mut || {
                let mut keep = x.dims().to_vec();
                keep[*dim] = 1;
                g.reshape(keep)?.broadcast_as(x.shape())
            })?,
            Op::MaxMin { x, dim, index } => {
                push(x, &mut || g.scatter_add_dim(index, *dim, x.shape()))?
            }
            Op::Reshape(x) => push(x, &mut || g.reshape(x.shape().clone()))?,
            Op::Permute { x, perm } => push(x, &mut || {
                let mut inv = vec![0; perm.len()];
                for (i, &p) in perm.iter().enumerate() {
                    inv[p] = i;
                }
                g.permute(&inv)
            })?,
            Op::Narrow { x, dim, start } => push(x, &mut || {
                let len = x.dims()[*dim];
                let count = g.dims()[*dim];
                let mut parts = Vec::new();
                let zeros = |n: usize| {
                    let mut d = x.dims().to_vec();
                    d[*dim] = n;
                    Tensor::zeros(d, g.dtype(), g.device())
                };
                if *start > 0 {
                    parts.push(zeros(*start)?);
                }
                parts.push(g.clone());
                if start + count < len {
                    parts.push(zeros(len - start - count)?);
                }
                Tensor::cat(&parts.iter().collect::<Vec<_>>(), *dim as isize)
            })?,
            Op::Cat { parts, dim } => {
                let mut start = 0;
                for p in parts {
                    let n = p.dims()[*dim];
                    push(p, &mut || g.narrow(*dim as isize, start, n))?;
                    start += n;
                }
            }
            Op::Gather { x, dim, index } => {
                push(x, &mut || g.scatter_add_dim(index, *dim, x.shape()))?
            }
            Op::Matmul { lhs, rhs, dims } => {
                // C = op(A)·op(B): see the four cases of d(op(A)·op(B)).
                let d = *dims;
                let (ta, tb) = (d.trans_a, d.trans_b);
                push(lhs, &mut || match (ta, tb) {
                    (false, false) => Tensor::matmul_raw(g, rhs, false, true, lhs.shape()),
                    (false, true) => Tensor::matmul_raw(g, rhs, false, false, lhs.shape()),
                    (true, false) => Tensor::matmul_raw(rhs, g, false, true, lhs.shape()),
                    (true, true) => Tensor::matmul_raw(rhs, g, true, true, lhs.shape()),
                })?;
                push(rhs, &mut || match (ta, tb) {
                    (false, false) => Tensor::matmul_raw(lhs, g, true, false, rhs.shape()),
                    (false, true) => Tensor::matmul_raw(g, lhs, true, false, rhs.shape()),
                    (true, false) => Tensor::matmul_raw(lhs, g, false, false, rhs.shape()),
                    (true, true) => Tensor::matmul_raw(g, lhs, true, true, rhs.shape()),
                })?;
            }
            Op::Conv2d { x, w, p } => {
                push(x, &mut || {
                    let s = g.storage().conv2d_backward_input(&w.storage(), p)?;
                    Ok(Tensor::from_storage(s, x.shape().clone()))
                })?;
                push(w, &mut || {
                    let s = g.storage().conv2d_backward_weight(&x.storage(), p)?;
                    Ok(Tensor::from_storage(s, w.shape().clone()))
                })?;
            }
            Op::BatchNorm {
                x,
                w,
                b,
                mean,
                invstd,
                p,
            } => {
                let (dx, dw, db) = g.storage().batch_norm_backward(
                    &x.storage(),
                    &w.storage(),
                    &mean.storage(),
                    &invstd.storage(),
                    p,
                )?;
                let c = Shape::new(vec![p.c]);
                // All three come from one kernel; keep those that are needed.
                for (t, s, shape) in [(x, dx, x.shape().clone()), (w, dw, c.clone()), (b, db, c)] {
                    if t.requires_grad() {
                        res.push((t.clone(), Tensor::from_storage(s, shape)));
                    }
                }
            }
            Op::MaxPool2d { x, argmax, p } => push(x, &mut || {
                let s = g.storage().max_pool2d_backward(&argmax.storage(), p)?;
                Ok(Tensor::from_storage(s, x.shape().clone()))
            })?,
            Op::AvgPool2d { x, p } => push(x, &mut || {
                let s = g.storage().avg_pool2d_backward(p)?;
                Ok(Tensor::from_storage(s, x.shape().clone()))
            })?,
            Op::AdaptiveAvgPool2d { x, p } => push(x, &mut || {
                let s = g.storage().adaptive_avg_pool2d_backward(p)?;
                Ok(Tensor::from_storage(s, x.shape().clone()))
            })?,
            Op::Softmax { x, y, dim, log } => push(x, &mut || {
                let split = out.shape().split_at_dim(*dim);
                let s = g.storage().softmax_backward(&y.storage(), split, *log)?;
                Ok(Tensor::from_storage(s, x.shape().clone()))
            })?,
            Op::Custom(f) => res = f.backward(g)?,
        }
        Ok(res)
    }
}
