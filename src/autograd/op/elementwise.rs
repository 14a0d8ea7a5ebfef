//! Backward of the elementwise ops: unary, affine, powf, and binary with broadcasting (each
//! operand's gradient summed back to its shape).

use super::{Op, Wanted};
use crate::backend::{BinaryOp, UnaryOp};
use crate::base::error::{Error, Result};
use crate::tensor::{Shape, Tensor};

pub(super) fn backward(op: &Op, g: &Tensor, w: &mut Wanted<'_>) -> Result<Vec<Option<Tensor>>> {
    match op {
        Op::Unary { saved, op } => w.one(|| unary(g, saved.as_ref(), *op)),
        Op::Affine { mul } => w.one(|| g.affine(*mul, 0.0)),
        Op::Powf { x, e } => w.one(|| g.mul(&x.powf(e - 1.0)?.affine(*e, 0.0)?)),
        Op::Binary {
            operands,
            lhs_shape,
            rhs_shape,
            op,
        } => binary(g, operands.as_ref(), [lhs_shape, rhs_shape], *op, w),
        _ => Err(op.misrouted("elementwise")),
    }
}

fn unary(g: &Tensor, saved: Option<&Tensor>, op: UnaryOp) -> Result<Tensor> {
    let s = || saved.ok_or_else(|| Error::Backward(format!("{}: nothing saved", op.name())));
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
}

fn binary(
    g: &Tensor,
    operands: Option<&(Tensor, Tensor)>,
    shapes: [&Shape; 2],
    op: BinaryOp,
    w: &Wanted<'_>,
) -> Result<Vec<Option<Tensor>>> {
    let saved =
        || operands.ok_or_else(|| Error::Backward(format!("{}: operands not saved", op.name())));
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
        w.maybe(0, || grad_lhs()?.sum_to_shape(shapes[0]))?,
        w.maybe(1, || grad_rhs()?.sum_to_shape(shapes[1]))?,
    ])
}
