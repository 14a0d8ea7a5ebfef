//! The autocast hook of the tensor ops: each op that autocast may change calls `inputs1`,
//! `inputs2`, `inputs3` or `inputs_n` at its entry with its [`OpKind`]; when no scope is active
//! that is one thread-local read and the op goes on with its own inputs. Inside a scope the
//! installed [`AutocastHook`] (amp's O1 table and cast cache, `amp::autocast`) decides the
//! casts, and the op re-runs itself on them (the hook then sees inputs already of the right
//! types and returns `None`).
//!
//! The tensor floor knows only the op kinds and the scope; what each kind becomes is amp's.
//! Adding an op kind is one line in the `op_kinds!` list below, and amp's table then fails to
//! compile until the kind has a class.

use std::cell::Cell;
use std::sync::OnceLock;

use super::{DType, Tensor};
use crate::backend::{BinaryOp, UnaryOp};
use crate::base::error::Result;

/// Declares [`OpKind`]: each variant with the name policy files and errors know it by.
macro_rules! op_kinds {
    ($($(#[$m:meta])* $kind:ident => $name:literal,)*) => {
        /// Every op that calls the autocast hook, by kind. `amp::autocast::class_of` gives each
        /// its class with an exhaustive match: a kind added here without a class is a compile
        /// error, never a silent pass-through.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum OpKind {
            $($(#[$m])* $kind,)*
        }

        impl OpKind {
            /// Every kind, in declaration order.
            pub const ALL: &'static [OpKind] = &[$(OpKind::$kind,)*];

            /// The op's name (`"matmul"`, `"log_softmax"`, ...).
            pub const fn name(self) -> &'static str {
                match self {
                    $(OpKind::$kind => $name,)*
                }
            }
        }
    };
}

op_kinds! {
    Matmul => "matmul",
    Linear => "linear",
    Conv2d => "conv2d",
    Softmax => "softmax",
    LogSoftmax => "log_softmax",
    CrossEntropy => "cross_entropy",
    MseLoss => "mse_loss",
    Sum => "sum",
    Mean => "mean",
    Exp => "exp",
    Log => "log",
    Powf => "powf",
    Sqrt => "sqrt",
    Sqr => "sqr",
    Abs => "abs",
    Neg => "neg",
    Relu => "relu",
    Add => "add",
    Sub => "sub",
    Mul => "mul",
    Div => "div",
    Maximum => "maximum",
    Minimum => "minimum",
    Cat => "cat",
    LayerNorm => "layer_norm",
    RmsNorm => "rms_norm",
    Gelu => "gelu",
    GeluTanh => "gelu_tanh",
    Silu => "silu",
    Attention => "scaled_dot_product_attention",
}

impl OpKind {
    /// The kind named `name` (as [`OpKind::name`] spells it), if any.
    pub fn from_name(name: &str) -> Option<OpKind> {
        OpKind::ALL.iter().copied().find(|k| k.name() == name)
    }
}

impl std::fmt::Display for OpKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl From<UnaryOp> for OpKind {
    fn from(op: UnaryOp) -> OpKind {
        match op {
            UnaryOp::Neg => OpKind::Neg,
            UnaryOp::Relu => OpKind::Relu,
            UnaryOp::Exp => OpKind::Exp,
            UnaryOp::Log => OpKind::Log,
            UnaryOp::Sqrt => OpKind::Sqrt,
            UnaryOp::Sqr => OpKind::Sqr,
            UnaryOp::Abs => OpKind::Abs,
        }
    }
}

impl From<BinaryOp> for OpKind {
    fn from(op: BinaryOp) -> OpKind {
        match op {
            BinaryOp::Add => OpKind::Add,
            BinaryOp::Sub => OpKind::Sub,
            BinaryOp::Mul => OpKind::Mul,
            BinaryOp::Div => OpKind::Div,
            BinaryOp::Maximum => OpKind::Maximum,
            BinaryOp::Minimum => OpKind::Minimum,
        }
    }
}

/// What the tensor ops ask of autocast; `amp` installs the one implementation.
pub trait AutocastHook: Send + Sync {
    /// The inputs of `op` cast for a scope of `half`, or `None` when none changes.
    fn cast_inputs(&self, op: OpKind, half: DType, xs: &[&Tensor]) -> Result<Option<Vec<Tensor>>>;

    /// Casts made so far may not be used from here on: a backward pass begins (parameters
    /// change after it) or a CUDA graph capture begins (a cached cast would be baked into it).
    fn invalidate_casts(&self);
}

static HOOK: OnceLock<&'static dyn AutocastHook> = OnceLock::new();

/// Installs the hook (amp does, when a scope is first entered). The first one stays.
pub(crate) fn install(hook: &'static dyn AutocastHook) {
    let _ = HOOK.set(hook);
}

thread_local! {
    /// The half type of the innermost active scope, None outside any.
    static ACTIVE: Cell<Option<DType>> = const { Cell::new(None) };
}

/// Restores the previous autocast state when dropped.
#[must_use = "autocast ends when the guard is dropped"]
pub struct AutocastGuard {
    prev: Option<DType>,
}

impl Drop for AutocastGuard {
    fn drop(&mut self) {
        ACTIVE.with(|a| a.set(self.prev));
    }
}

/// Makes `half` the active scope's type on this thread (amp validates it and installs the hook
/// first) until the guard drops.
pub(crate) fn enter(half: DType) -> AutocastGuard {
    AutocastGuard {
        prev: ACTIVE.with(|a| a.replace(Some(half))),
    }
}

/// Suspends autocast on this thread until the guard drops (backward passes and optimizer steps
/// run their ops in the types they are given).
pub fn suspend() -> AutocastGuard {
    AutocastGuard {
        prev: ACTIVE.with(|a| a.replace(None)),
    }
}

/// The half type of the active scope on this thread, if any.
pub fn active() -> Option<DType> {
    ACTIVE.with(|a| a.get())
}

/// Tells the hook that cached casts are stale (see [`AutocastHook::invalidate_casts`]).
pub fn invalidate_casts() {
    if let Some(h) = HOOK.get() {
        h.invalidate_casts();
    }
}

/// The casts of `xs` for `op`, when a scope is active and the hook changes any.
fn cast(op: OpKind, xs: &[&Tensor]) -> Result<Option<Vec<Tensor>>> {
    let (Some(half), Some(hook)) = (active(), HOOK.get()) else {
        return Ok(None);
    };
    hook.cast_inputs(op, half, xs)
}

/// The hook of a one-input op: `Some(cast input)` when autocast changes it.
pub(crate) fn inputs1(op: OpKind, x: &Tensor) -> Result<Option<Tensor>> {
    if active().is_none() {
        return Ok(None);
    }
    Ok(cast(op, &[x])?.and_then(|v| v.into_iter().next()))
}

/// The hook of a two-input op.
pub(crate) fn inputs2(op: OpKind, a: &Tensor, b: &Tensor) -> Result<Option<(Tensor, Tensor)>> {
    if active().is_none() {
        return Ok(None);
    }
    Ok(cast(op, &[a, b])?.map(|v| {
        let mut it = v.into_iter();
        let (Some(x), Some(y)) = (it.next(), it.next()) else {
            return (a.clone(), b.clone());
        };
        (x, y)
    }))
}

/// The hook of an op with two inputs and an optional third (a bias).
pub(crate) fn inputs3(
    op: OpKind,
    a: &Tensor,
    b: &Tensor,
    c: Option<&Tensor>,
) -> Result<Option<(Tensor, Tensor, Option<Tensor>)>> {
    if active().is_none() {
        return Ok(None);
    }
    let cast = match c {
        Some(c) => cast(op, &[a, b, c])?,
        None => cast(op, &[a, b])?,
    };
    Ok(cast.map(|v| {
        let mut it = v.into_iter();
        let x = it.next().unwrap_or_else(|| a.clone());
        let y = it.next().unwrap_or_else(|| b.clone());
        (x, y, it.next())
    }))
}

/// The hook of an op over a list of inputs (cat).
pub(crate) fn inputs_n(op: OpKind, xs: &[&Tensor]) -> Result<Option<Vec<Tensor>>> {
    if active().is_none() {
        return Ok(None);
    }
    cast(op, xs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_round_trip() {
        for &k in OpKind::ALL {
            assert_eq!(OpKind::from_name(k.name()), Some(k), "{k:?}");
            assert_eq!(
                OpKind::ALL.iter().filter(|o| o.name() == k.name()).count(),
                1,
                "{k:?}"
            );
        }
        assert_eq!(OpKind::from_name("no_such_op"), None);
    }
}
