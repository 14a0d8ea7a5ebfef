//! What a graph node keeps for its backward formula, and the formula. A node keeps only the
//! tensors its formula reads (PyTorch's saved tensors) plus the shapes and dtypes of its inputs:
//! the graph's edges (`super::Edge`) are separate, so an activation nobody's backward reads is
//! freed as soon as the forward pass lets go of it.
//!
//! Saved tensors are detached handles (sharing the buffer, no graph node), so a node never keeps
//! another node alive through them. Formulas are written with tensor ops (run under `no_grad`)
//! or the backends' backward kernels.

use crate::backend::{
    AdaptivePoolParams, BatchNormParams, BatchNormSaved, BinaryOp, Conv2dParams, MatmulDims,
    Pool2dParams, UnaryOp,
};
use crate::error::Result;
use crate::tensor::{DType, Device, Layout, Shape, Tensor};

pub(crate) enum Op {
    ToDType {
        from: DType,
    },
    ToDevice {
        from: Device,
    },
    /// `saved` is the output for exp, sqrt and relu (whose derivatives read it), the input for
    /// log, sqr and abs, nothing for neg.
    Unary {
        saved: Option<Tensor>,
        op: UnaryOp,
    },
    Affine {
        mul: f64,
    },
    Powf {
        x: Tensor,
        e: f64,
    },
    /// Add and sub keep only the shapes; mul, div, maximum and minimum keep both operands.
    Binary {
        operands: Option<(Tensor, Tensor)>,
        lhs_shape: Shape,
        rhs_shape: Shape,
        op: BinaryOp,
    },
    BroadcastTo {
        from: Shape,
    },
    Sum {
        from: Shape,
        dim: usize,
    },
    /// Max or min along `dim`; `index` holds the position chosen in each lane.
    MaxMin {
        from: Shape,
        dim: usize,
        index: Tensor,
    },
    Reshape {
        from: Shape,
    },
    /// A copy into another layout (contiguous(), a memory-format change): the gradient passes
    /// through as it is.
    Relayout,
    Permute {
        perm: Vec<usize>,
    },
    Narrow {
        from: Shape,
        dim: usize,
        start: usize,
    },
    Cat {
        lens: Vec<usize>,
        dim: usize,
    },
    Gather {
        from: Shape,
        dim: usize,
        index: Tensor,
    },
    Matmul {
        lhs: Tensor,
        rhs: Tensor,
        dims: MatmulDims,
    },
    /// `x` is kept when the weight needs a gradient, `w` when the input does.
    Conv2d {
        x: Option<Tensor>,
        w: Option<Tensor>,
        x_shape: Shape,
        w_shape: Shape,
        p: Conv2dParams,
    },
    /// Inputs x, w, b (and the residual when `p.residual`); `y`, the output, is kept for the
    /// fused ReLU's mask.
    BatchNorm {
        x: Tensor,
        w: Tensor,
        b: Tensor,
        y: Option<Tensor>,
        mean: Tensor,
        invstd: Tensor,
        /// What the implementation that ran keeps besides (cuDNN's reserve space).
        reserve: Option<Tensor>,
        p: BatchNormParams,
    },
    MaxPool2d {
        from: Shape,
        argmax: Tensor,
        p: Pool2dParams,
    },
    AvgPool2d {
        from: Shape,
        p: Pool2dParams,
    },
    AdaptiveAvgPool2d {
        from: Shape,
        p: AdaptivePoolParams,
    },
    Softmax {
        y: Tensor,
        dim: usize,
        log: bool,
    },
    /// A user-defined function (`autograd::custom_function`).
    Custom(Box<super::hooks::CustomOp>),
}

impl Op {
    /// The op's name, for errors.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Op::ToDType { .. } => "to_dtype",
            Op::ToDevice { .. } => "to_device",
            Op::Unary { op, .. } => op.name(),
            Op::Affine { .. } => "affine",
            Op::Powf { .. } => "powf",
            Op::Binary { op, .. } => op.name(),
            Op::BroadcastTo { .. } => "broadcast_as",
            Op::Sum { .. } => "sum",
            Op::MaxMin { .. } => "max/min",
            Op::Reshape { .. } => "reshape",
            Op::Relayout => "contiguous",
            Op::Permute { .. } => "permute",
            Op::Narrow { .. } => "narrow",
            Op::Cat { .. } => "cat",
            Op::Gather { .. } => "gather",
            Op::Matmul { .. } => "matmul",
            Op::Conv2d { .. } => "conv2d",
            Op::BatchNorm { p, .. } if p.residual => "batch_norm_add_relu",
            Op::BatchNorm { p, .. } if p.relu => "batch_norm_relu",
            Op::BatchNorm { .. } => "batch_norm",
            Op::MaxPool2d { .. } => "max_pool2d",
            Op::AvgPool2d { .. } => "avg_pool2d",
            Op::AdaptiveAvgPool2d { .. } => "adaptive_avg_pool2d",
            Op::Softmax { .. } => "softmax",
            Op::Custom(f) => f.name,
        }
    }

    /// The gradient of each input (in the order the op recorded them) whose `needs` entry is
    /// true, given `g`, the gradient of the output; `None` for the others. An input whose
    /// `may_beside` entry is true may get its gradient computed beside the main stream
    /// (`beside.rs`); those that did are added to `beside`.
    pub(crate) fn backward(
        &self,
        g: &Tensor,
        needs: &[bool],
        may_beside: &[bool],
        beside: &mut Vec<usize>,
    ) -> Result<Vec<Option<Tensor>>> {
        let need = |i: usize| needs.get(i).copied().unwrap_or(false);
        let one = |f: &dyn Fn() -> Result<Tensor>| -> Result<Vec<Option<Tensor>>> {
            Ok(vec![if need(0) { Some(f()?) } else { None }])
        };
        match self {
            Op::ToDType { from } => one(&|| g.to_dtype(*from)),
            Op::ToDevice { from } => one(&|| g.to_device(*from)),
            Op::Unary { saved, op } => one(&|| {
                let s = || {
                    saved.as_ref().ok_or_else(|| {
                        crate::Error::Backward(format!("{}: nothing saved", op.name()))
                    })
                };
                match op {
                    UnaryOp::Neg => g.neg(),
                    // y > 0 exactly where x > 0.
                    UnaryOp::Relu => g.relu_backward(s()?),
                    UnaryOp::Exp => g.mul(s()?),
                    UnaryOp::Log => g.div(s()?),
                    UnaryOp::Sqrt => g.div(&s()?.affine(2.0, 0.0)?),
                    UnaryOp::Sqr => g.mul(&s()?.affine(2.0, 0.0)?),
                    // sign(x)·g, with sign(0) = 0 as torch.
                    UnaryOp::Abs => {
                        let x = s()?;
                        g.relu_backward(x)?.sub(&g.relu_backward(&x.neg()?)?)
                    }
                }
            }),
            Op::Affine { mul } => one(&|| g.affine(*mul, 0.0)),
            Op::Powf { x, e } => one(&|| g.mul(&x.powf(e - 1.0)?.affine(*e, 0.0)?)),
            Op::Binary {
                operands,
                lhs_shape,
                rhs_shape,
                op,
            } => {
                let saved = || {
                    operands.as_ref().ok_or_else(|| {
                        crate::Error::Backward(format!("{}: operands not saved", op.name()))
                    })
                };
                // Ties of maximum/minimum send the whole gradient to lhs.
                let grad_lhs = || -> Result<Tensor> {
                    match op {
                        BinaryOp::Add | BinaryOp::Sub => Ok(g.clone()),
                        BinaryOp::Mul => g.mul(&saved()?.1),
                        BinaryOp::Div => g.div(&saved()?.1),
                        BinaryOp::Maximum => {
                            let (l, r) = saved()?;
                            g.sub(&g.relu_backward(&r.sub(l)?)?)
                        }
                        BinaryOp::Minimum => {
                            let (l, r) = saved()?;
                            g.sub(&g.relu_backward(&l.sub(r)?)?)
                        }
                    }
                };
                let grad_rhs = || -> Result<Tensor> {
                    match op {
                        BinaryOp::Add => Ok(g.clone()),
                        BinaryOp::Sub => g.neg(),
                        BinaryOp::Mul => g.mul(&saved()?.0),
                        BinaryOp::Div => {
                            let (l, r) = saved()?;
                            g.mul(l)?.div(&r.sqr()?)?.neg()
                        }
                        BinaryOp::Maximum => {
                            let (l, r) = saved()?;
                            g.relu_backward(&r.sub(l)?)
                        }
                        BinaryOp::Minimum => {
                            let (l, r) = saved()?;
                            g.relu_backward(&l.sub(r)?)
                        }
                    }
                };
                Ok(vec![
                    if need(0) {
                        Some(grad_lhs()?.sum_to_shape(lhs_shape)?)
                    } else {
                        None
                    },
                    if need(1) {
                        Some(grad_rhs()?.sum_to_shape(rhs_shape)?)
                    } else {
                        None
                    },
                ])
            }
            Op::BroadcastTo { from } => one(&|| g.sum_to_shape(from)),
            Op::Sum { from, dim } => one(&|| {
                let mut keep = from.dims().to_vec();
                keep[*dim] = 1;
                g.reshape(keep)?.broadcast_as(from)
            }),
            Op::MaxMin { from, dim, index } => one(&|| g.scatter_add_dim(index, *dim, from)),
            Op::Reshape { from } => one(&|| g.reshape(from.clone())),
            Op::Relayout => one(&|| Ok(g.clone())),
            Op::Permute { perm } => one(&|| {
                let mut inv = vec![0; perm.len()];
                for (i, &p) in perm.iter().enumerate() {
                    inv[p] = i;
                }
                g.permute(&inv)
            }),
            Op::Narrow { from, dim, start } => one(&|| {
                let len = from.dims()[*dim];
                let count = g.dims()[*dim];
                let mut parts = Vec::new();
                let zeros = |n: usize| {
                    let mut d = from.dims().to_vec();
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
            }),
            Op::Cat { lens, dim } => {
                let mut start = 0;
                let mut out = Vec::with_capacity(lens.len());
                for (i, &n) in lens.iter().enumerate() {
                    out.push(if need(i) {
                        Some(g.narrow(*dim as isize, start, n)?)
                    } else {
                        None
                    });
                    start += n;
                }
                Ok(out)
            }
            Op::Gather { from, dim, index } => one(&|| g.scatter_add_dim(index, *dim, from)),
            Op::Matmul { lhs, rhs, dims } => {
                // C = op(A)·op(B): see the four cases of d(op(A)·op(B)).
                let (ta, tb) = (dims.trans_a, dims.trans_b);
                let ga = || match (ta, tb) {
                    (false, false) => Tensor::matmul_raw(g, rhs, false, true, lhs.shape()),
                    (false, true) => Tensor::matmul_raw(g, rhs, false, false, lhs.shape()),
                    (true, false) => Tensor::matmul_raw(rhs, g, false, true, lhs.shape()),
                    (true, true) => Tensor::matmul_raw(rhs, g, true, true, lhs.shape()),
                };
                let gb = || match (ta, tb) {
                    (false, false) => Tensor::matmul_raw(lhs, g, true, false, rhs.shape()),
                    (false, true) => Tensor::matmul_raw(g, lhs, true, false, rhs.shape()),
                    (true, false) => Tensor::matmul_raw(lhs, g, false, false, rhs.shape()),
                    (true, true) => Tensor::matmul_raw(g, lhs, true, true, rhs.shape()),
                };
                Ok(vec![
                    if need(0) { Some(ga()?) } else { None },
                    if need(1) { Some(gb()?) } else { None },
                ])
            }
            Op::Conv2d {
                x,
                w,
                x_shape,
                w_shape,
                p,
            } => {
                let missing = |what: &str| {
                    crate::Error::Backward(format!("conv2d: the {what} was not saved"))
                };
                // The gradient in the format the forward ran in; both results come out in it.
                let g = g.packed_as(p.format)?;
                // The weight gradient first, beside where it can: the data gradient, which the
                // rest of backward waits for, then runs while it does.
                let dw = if need(1) {
                    let x = x.as_ref().ok_or_else(|| missing("input"))?;
                    let weight_grad = || {
                        let s = g.storage().conv2d_backward_weight(
                            &g.layout(),
                            &x.storage(),
                            &x.layout(),
                            p,
                        )?;
                        Ok(Tensor::from_storage(
                            s,
                            Layout::with_format(w_shape.clone(), p.format),
                        ))
                    };
                    // Beside only when the data gradient is computed too: what it overlaps.
                    let (dw, went) = if need(0) && may_beside.get(1) == Some(&true) {
                        super::beside::weight_grad(&g, x, p, weight_grad)?
                    } else {
                        (weight_grad()?, false)
                    };
                    if went {
                        beside.push(1);
                    }
                    Some(dw)
                } else {
                    None
                };
                let dx = if need(0) {
                    let w = w.as_ref().ok_or_else(|| missing("weight"))?;
                    let s = g.storage().conv2d_backward_input(
                        &g.layout(),
                        &w.storage(),
                        &w.layout(),
                        p,
                    )?;
                    Some(Tensor::from_storage(
                        s,
                        Layout::with_format(x_shape.clone(), p.format),
                    ))
                } else {
                    None
                };
                Ok(vec![dx, dw])
            }
            Op::BatchNorm {
                x,
                w,
                b,
                y,
                mean,
                invstd,
                reserve,
                p,
            } => {
                // Every gradient comes from one kernel; keep those that are needed.
                let g = g.packed_as(p.format)?;
                let y_storage = y.as_ref().map(|y| y.storage());
                let y_layout = y.as_ref().map(|y| y.layout());
                let y_arg = y_storage.as_deref().zip(y_layout.as_deref());
                let (mean_s, invstd_s) = (mean.storage(), invstd.storage());
                let reserve_s = reserve.as_ref().map(|r| r.storage());
                let saved = BatchNormSaved {
                    mean: &*mean_s,
                    invstd: &*invstd_s,
                    reserve: reserve_s.as_deref(),
                };
                let r = g.storage().batch_norm_backward(
                    &g.layout(),
                    &x.storage(),
                    &x.layout(),
                    y_arg,
                    &w.storage(),
                    &b.storage(),
                    saved,
                    p,
                )?;
                drop(y_storage);
                let c = Shape::new(vec![p.c]);
                let dense = x.layout().dense_like();
                Ok(vec![
                    need(0).then(|| Tensor::from_storage(r.input, dense.clone())),
                    need(1).then(|| Tensor::from_storage(r.weight, c.clone())),
                    need(2).then(|| Tensor::from_storage(r.bias, c)),
                    r.residual
                        .filter(|_| need(3))
                        .map(|s| Tensor::from_storage(s, dense)),
                ])
            }
            Op::MaxPool2d { from, argmax, p } => one(&|| {
                let g = g.packed_as(p.format)?;
                let s = g.storage().max_pool2d_backward(
                    &g.layout(),
                    &argmax.storage(),
                    &argmax.layout(),
                    p,
                )?;
                Ok(Tensor::from_storage(
                    s,
                    Layout::with_format(from.clone(), p.format),
                ))
            }),
            Op::AvgPool2d { from, p } => one(&|| {
                let g = g.packed_as(p.format)?;
                let s = g.storage().avg_pool2d_backward(&g.layout(), p)?;
                Ok(Tensor::from_storage(
                    s,
                    Layout::with_format(from.clone(), p.format),
                ))
            }),
            Op::AdaptiveAvgPool2d { from, p } => one(&|| {
                let g = g.packed_as(p.format)?;
                let s = g.storage().adaptive_avg_pool2d_backward(&g.layout(), p)?;
                Ok(Tensor::from_storage(
                    s,
                    Layout::with_format(from.clone(), p.format),
                ))
            }),
            Op::Softmax { y, dim, log } => one(&|| {
                let g = g.contiguous()?;
                let s = g.storage().softmax_backward(
                    &g.layout(),
                    &y.storage(),
                    &y.layout(),
                    *dim,
                    *log,
                )?;
                Ok(Tensor::from_storage(s, y.shape().clone()))
            }),
            Op::Custom(f) => f.backward(g, needs),
        }
    }
}
