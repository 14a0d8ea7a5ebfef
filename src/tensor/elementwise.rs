//! Elementwise ops: unary, scalar, and binary with broadcasting and type promotion. Dense
//! inputs (contiguous, channels_last, any dense permutation) keep their strides; binary
//! operands are read through their (possibly broadcast) strides.

use super::autocast::{self, OpKind};
use super::{Layout, Tensor};
use crate::autograd::Op;
use crate::backend::{BinaryOp, UnaryOp};
use crate::base::error::Result;

impl Tensor {
    fn unary_op(&self, op: UnaryOp) -> Result<Tensor> {
        if let Some(x) = autocast::inputs1(op.into(), self)? {
            return x.unary_op(op);
        }
        self.float_only(op.name())?;
        let x = self.dense()?;
        let s = x.storage().unary(&x.layout(), op)?;
        Ok(Tensor::from_op_with_output(
            s,
            x.layout().dense_like(),
            &[self],
            |y| Op::Unary {
                saved: match op {
                    UnaryOp::Neg => None,
                    UnaryOp::Relu | UnaryOp::Exp | UnaryOp::Sqrt => Some(y),
                    UnaryOp::Log | UnaryOp::Sqr | UnaryOp::Abs => Some(self.detach()),
                },
                op,
            },
        ))
    }

    pub fn neg(&self) -> Result<Tensor> {
        self.unary_op(UnaryOp::Neg)
    }
    pub fn relu(&self) -> Result<Tensor> {
        self.unary_op(UnaryOp::Relu)
    }
    pub fn exp(&self) -> Result<Tensor> {
        self.unary_op(UnaryOp::Exp)
    }
    pub fn log(&self) -> Result<Tensor> {
        self.unary_op(UnaryOp::Log)
    }
    pub fn sqrt(&self) -> Result<Tensor> {
        self.unary_op(UnaryOp::Sqrt)
    }
    pub fn sqr(&self) -> Result<Tensor> {
        self.unary_op(UnaryOp::Sqr)
    }
    pub fn abs(&self) -> Result<Tensor> {
        self.unary_op(UnaryOp::Abs)
    }

    /// `self·mul + add`.
    pub fn affine(&self, mul: f64, add: f64) -> Result<Tensor> {
        self.float_only("affine")?;
        let x = self.dense()?;
        let s = x.storage().affine(&x.layout(), mul, add)?;
        Ok(Tensor::from_op(s, x.layout().dense_like(), &[self], || {
            Op::Affine { mul }
        }))
    }

    pub fn add_scalar(&self, v: f64) -> Result<Tensor> {
        self.affine(1.0, v)
    }
    pub fn mul_scalar(&self, v: f64) -> Result<Tensor> {
        self.affine(v, 0.0)
    }

    /// `self^e` elementwise.
    pub fn powf(&self, e: f64) -> Result<Tensor> {
        if let Some(x) = autocast::inputs1(OpKind::Powf, self)? {
            return x.powf(e);
        }
        self.float_only("powf")?;
        let x = self.dense()?;
        let s = x.storage().powf(&x.layout(), e)?;
        Ok(Tensor::from_op(s, x.layout().dense_like(), &[self], || {
            Op::Powf {
                x: self.detach(),
                e,
            }
        }))
    }

    fn binary_op(&self, rhs: &Tensor, op: BinaryOp) -> Result<Tensor> {
        if let Some((a, b)) = autocast::inputs2(op.into(), self, rhs)? {
            return a.binary_op(&b, op);
        }
        self.same_device(op.name(), rhs)?;
        self.float_only(op.name())?;
        rhs.float_only(op.name())?;
        let out = self.shape().broadcast_with(op.name(), rhs.shape())?;
        super::check_size(op.name(), &out, self.dtype())?;
        // Promotion as PyTorch's: the narrower operand is cast (and the cast is differentiable).
        let dt = super::DType::promote(self.dtype(), rhs.dtype());
        let (a, b) = (self.to_dtype(dt)?, rhs.to_dtype(dt)?);
        // Same shape and the same dense strides: the result keeps them (a channels_last sum
        // stays channels_last); otherwise it is row-major.
        let out_layout = if a.shape() == b.shape()
            && a.layout().is_dense()
            && a.layout().strides() == b.layout().strides()
        {
            a.layout().dense_like()
        } else {
            Layout::contiguous(out.clone())
        };
        let (la, lb) = (a.layout().expand(&out), b.layout().expand(&out));
        let s = a
            .storage()
            .binary(&la, &b.storage(), &lb, op, &out_layout)?;
        Ok(Tensor::from_op(s, out_layout, &[&a, &b], || Op::Binary {
            operands: match op {
                BinaryOp::Add | BinaryOp::Sub => None,
                _ => Some((a.detach(), b.detach())),
            },
            lhs_shape: a.shape().clone(),
            rhs_shape: b.shape().clone(),
            op,
        }))
    }

    pub fn add(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary_op(rhs, BinaryOp::Add)
    }
    pub fn sub(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary_op(rhs, BinaryOp::Sub)
    }
    pub fn mul(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary_op(rhs, BinaryOp::Mul)
    }
    pub fn div(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary_op(rhs, BinaryOp::Div)
    }
    pub fn maximum(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary_op(rhs, BinaryOp::Maximum)
    }
    pub fn minimum(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary_op(rhs, BinaryOp::Minimum)
    }

    /// `grad · (x > 0)`, the ReLU derivative (not recorded: used by backward passes). The
    /// result has `x`'s layout when `x` is dense.
    pub(crate) fn relu_backward(&self, x: &Tensor) -> Result<Tensor> {
        let x = x.dense()?;
        let g = self.laid_out_like(&x)?;
        let s = g
            .storage()
            .relu_backward(&g.layout(), &x.storage(), &x.layout())?;
        Ok(Tensor::from_storage(s, x.layout().dense_like()))
    }

    /// This tensor when its layout is dense (elementwise kernels run over its span), else a
    /// contiguous copy.
    pub(crate) fn dense(&self) -> Result<Tensor> {
        if self.layout().is_dense() {
            Ok(self.clone())
        } else {
            self.contiguous()
        }
    }
}
