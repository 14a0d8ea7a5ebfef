//! Elementwise ops: unary, scalar, and binary with broadcasting and type promotion.

use super::{Shape, Tensor};
use crate::amp::autocast;
use crate::autograd::Op;
use crate::backend::{BinaryOp, UnaryOp};
use crate::error::Result;

impl Tensor {
    fn unary_op(&self, op: UnaryOp) -> Result<Tensor> {
        if let Some(x) = autocast::inputs1(op.name(), self)? {
            return x.unary_op(op);
        }
        self.float_only(op.name())?;
        let s = self.storage().unary(op)?;
        Ok(Tensor::from_op_with_output(
            s,
            self.shape().clone(),
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
        let s = self.storage().affine(mul, add)?;
        Ok(Tensor::from_op(s, self.shape().clone(), &[self], || {
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
        if let Some(x) = autocast::inputs1("powf", self)? {
            return x.powf(e);
        }
        self.float_only("powf")?;
        let s = self.storage().powf(e)?;
        Ok(Tensor::from_op(s, self.shape().clone(), &[self], || {
            Op::Powf {
                x: self.detach(),
                e,
            }
        }))
    }

    fn binary_op(&self, rhs: &Tensor, op: BinaryOp) -> Result<Tensor> {
        if let Some((a, b)) = autocast::inputs2(op.name(), self, rhs)? {
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
        let s = a
            .storage()
            .binary(&b.storage(), op, a.shape(), b.shape(), &out)?;
        Ok(Tensor::from_op(s, out, &[&a, &b], || Op::Binary {
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

    /// `grad · (x > 0)`, the ReLU derivative (not recorded: used by backward passes).
    pub(crate) fn relu_backward(&self, x: &Tensor) -> Result<Tensor> {
        let s = self.storage().relu_backward(&x.storage())?;
        Ok(Tensor::from_storage(s, self.shape().clone()))
    }

    /// This tensor broadcast (numpy rules) to `shape`.
    pub fn broadcast_as(&self, shape: &Shape) -> Result<Tensor> {
        if self.shape() == shape {
            return Ok(self.clone());
        }
        super::check_size("broadcast_as", shape, self.dtype())?;
        let b = self.shape().broadcast_with("broadcast_as", shape)?;
        if &b != shape {
            return Err(crate::Error::shape_mismatch(
                "broadcast_as",
                self.shape(),
                shape,
                "cannot broadcast to the target",
            ));
        }
        let s = self.storage().broadcast_to(self.shape(), shape)?;
        Ok(Tensor::from_op(s, shape.clone(), &[self], || {
            Op::BroadcastTo {
                from: self.shape().clone(),
            }
        }))
    }
}
