//! Elementwise ops: one operand (`unary`, `affine`, `powf`), two operands with broadcasting
//! (`binary`), and ReLU's backward mask.

use crate::backend::BackendStorage;
use crate::base::error::Result;
use crate::base::Layout;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnaryOp {
    Neg,
    Relu,
    Exp,
    Log,
    Sqrt,
    Sqr,
    Abs,
}

impl UnaryOp {
    pub fn name(self) -> &'static str {
        match self {
            UnaryOp::Neg => "neg",
            UnaryOp::Relu => "relu",
            UnaryOp::Exp => "exp",
            UnaryOp::Log => "log",
            UnaryOp::Sqrt => "sqrt",
            UnaryOp::Sqr => "sqr",
            UnaryOp::Abs => "abs",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BinaryOp {
    Add,
    Sub,
    Mul,
    Div,
    Maximum,
    Minimum,
}

impl BinaryOp {
    pub fn name(self) -> &'static str {
        match self {
            BinaryOp::Add => "add",
            BinaryOp::Sub => "sub",
            BinaryOp::Mul => "mul",
            BinaryOp::Div => "div",
            BinaryOp::Maximum => "maximum",
            BinaryOp::Minimum => "minimum",
        }
    }
}

/// Elementwise ops. `unary`, `affine`, `powf` and `relu_backward` take dense layouts
/// (`relu_backward`'s two operands with equal strides) and keep the input's strides in the
/// result; `binary` takes any strides and writes the dense layout `out`.
pub trait ElementwiseOps: BackendStorage {
    fn unary(&self, l: &Layout, op: UnaryOp) -> Result<Self>;
    /// `x·mul + add`.
    fn affine(&self, l: &Layout, mul: f64, add: f64) -> Result<Self>;
    /// `x^e`.
    fn powf(&self, l: &Layout, e: f64) -> Result<Self>;
    /// Elementwise op of two operands viewed with the shape of `out` (broadcast operands have
    /// stride-0 layouts), written in the dense layout `out`.
    fn binary(
        &self,
        l: &Layout,
        rhs: &Self,
        rl: &Layout,
        op: BinaryOp,
        out: &Layout,
    ) -> Result<Self>;
    /// `grad · (x > 0)`: the ReLU backward mask, called on `grad`.
    fn relu_backward(&self, l: &Layout, x: &Self, xl: &Layout) -> Result<Self>;
}
