//! O1 autocast: a thread-local scope in which each op casts its inputs by its class, and the one
//! table that classifies every op of the crate.
//!
//! | class         | inputs become                                   | ops                          |
//! |---------------|-------------------------------------------------|------------------------------|
//! | `Half`        | the scope's half type                           | matmul, linear, conv2d       |
//! | `Fp32`        | F32 (F64 stays F64)                             | softmax, exp, log, pow, sums, means, norms, losses |
//! | `Promote`     | the widest input type (f16 with bf16: F32)      | binary elementwise, cat      |
//! | `Passthrough` | unchanged                                       | relu, pooling, batch_norm, shape ops |
//!
//! Each op calls one function at its entry (`inputs1`, `inputs2`, `inputs3`, `inputs_n`); when no
//! scope is active that is one thread-local read and the op goes on with its own inputs. When
//! the call returns casts, the op re-runs itself on them (the hook then sees inputs already of
//! the right types and returns `None`).
//!
//! Casts of FP32 *variables* (parameters) to half are cached for the iteration, keyed by the
//! variable, the target type and whether gradients are enabled — a cast made under `no_grad` (an
//! eval pass) carries no graph and is never handed to a training forward, apex's staleness bug.
//! The cache is cleared when a loss is scaled and when backward runs. Other inputs are cast fresh.
//!
//! Users classify their own ops with [`register_op`] and cast their inputs with [`cast_inputs`].

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::sync::RwLock;

use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor, TensorId};

/// How autocast treats an op's floating inputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OpClass {
    /// Cast to the half type (tensor-core ops).
    Half,
    /// Cast half inputs to F32 (ops that need the range or the precision).
    Fp32,
    /// Cast every input to the widest input type.
    Promote,
    /// Leave the inputs as they are.
    Passthrough,
}

/// The classification of every op of the crate, by the name each op passes to its hook. This is
/// the one place to look (and to change) which precision an op runs in under O1.
pub const OP_TABLE: &[(&str, OpClass)] = &[
    // ---- half: products that run on tensor cores --------------------------------------------
    ("matmul", OpClass::Half),
    ("linear", OpClass::Half),
    ("conv2d", OpClass::Half),
    // ---- fp32: range or precision matters -------------------------------------------------
    ("softmax", OpClass::Fp32),
    ("log_softmax", OpClass::Fp32),
    ("exp", OpClass::Fp32),
    ("log", OpClass::Fp32),
    ("powf", OpClass::Fp32),
    ("pow", OpClass::Fp32),
    ("sum", OpClass::Fp32),
    ("mean", OpClass::Fp32),
    ("norm", OpClass::Fp32),
    ("cross_entropy", OpClass::Fp32),
    ("mse_loss", OpClass::Fp32),
    // ---- promote: several inputs, the widest type wins -----------------------------------
    ("add", OpClass::Promote),
    ("sub", OpClass::Promote),
    ("mul", OpClass::Promote),
    ("div", OpClass::Promote),
    ("maximum", OpClass::Promote),
    ("minimum", OpClass::Promote),
    ("cat", OpClass::Promote),
    // ---- passthrough: exact in any type, or already computing statistics in FP32 ---------
    ("relu", OpClass::Passthrough),
    ("neg", OpClass::Passthrough),
    ("abs", OpClass::Passthrough),
    ("sqrt", OpClass::Passthrough),
    ("sqr", OpClass::Passthrough),
    ("affine", OpClass::Passthrough),
    ("max", OpClass::Passthrough),
    ("min", OpClass::Passthrough),
    ("argmax", OpClass::Passthrough),
    ("max_pool2d", OpClass::Passthrough),
    ("avg_pool2d", OpClass::Passthrough),
    ("adaptive_avg_pool2d", OpClass::Passthrough),
    ("batch_norm", OpClass::Passthrough),
    ("gather", OpClass::Passthrough),
    ("reshape", OpClass::Passthrough),
    ("permute", OpClass::Passthrough),
    ("narrow", OpClass::Passthrough),
    ("broadcast_as", OpClass::Passthrough),
    ("to_dtype", OpClass::Passthrough),
    ("to_device", OpClass::Passthrough),
];

thread_local! {
    /// The half type of the innermost active scope, None outside any.
    static ACTIVE: Cell<Option<DType>> = const { Cell::new(None) };
    /// (variable, target dtype, grad enabled) → its cast.
    static CACHE: RefCell<HashMap<(TensorId, DType, bool), Tensor>> = RefCell::new(HashMap::new());
}

/// Classes users registered for their own ops.
static USER_OPS: RwLock<Option<HashMap<String, OpClass>>> = RwLock::new(None);

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

/// Enters an autocast scope on this thread in which `Half` ops compute in `half`
/// (F16 or BF16; any other dtype is an error), until the guard drops. Scopes nest.
pub fn autocast(half: DType) -> Result<AutocastGuard> {
    if !half.is_half() {
        return Err(Error::UnsupportedDType {
            op: "amp::autocast",
            got: half,
            expected: "f16 or bf16",
        });
    }
    Ok(AutocastGuard {
        prev: ACTIVE.with(|a| a.replace(Some(half))),
    })
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

/// Drops every cached cast of this thread (done when a loss is scaled and when backward runs).
pub fn clear_cache() {
    CACHE.with(|c| {
        if let Ok(mut c) = c.try_borrow_mut() {
            c.clear()
        }
    });
}

/// The number of cached casts on this thread (for tests and debugging).
pub fn cache_len() -> usize {
    CACHE.with(|c| c.borrow().len())
}

/// The class of `op`: a user registration, else the table. Unknown ops pass through.
pub fn op_class(op: &str) -> OpClass {
    if let Ok(g) = USER_OPS.read() {
        if let Some(c) = g.as_ref().and_then(|m| m.get(op)) {
            return *c;
        }
    }
    OP_TABLE
        .iter()
        .find(|(n, _)| *n == op)
        .map_or(OpClass::Passthrough, |(_, c)| *c)
}

/// Registers the class of a user op `name` (re-registering replaces the class). The crate's own
/// ops keep theirs: naming one of [`OP_TABLE`] is an error.
pub fn register_op(name: &str, class: OpClass) -> Result<()> {
    if name.is_empty() || OP_TABLE.iter().any(|(n, _)| *n == name) {
        return Err(Error::invalid_arg(
            "amp::autocast::register_op",
            "name",
            format!("`{name}`"),
            "a non-empty name that is not one of the crate's ops (OP_TABLE)",
        ));
    }
    let mut g = USER_OPS.write().unwrap_or_else(|e| e.into_inner());
    g.get_or_insert_with(HashMap::new)
        .insert(name.to_string(), class);
    Ok(())
}

/// The dtype each floating input of `op` should have under a scope of `half`, or None when
/// none changes.
fn targets(op: &str, half: DType, dtypes: &[DType]) -> Option<Vec<DType>> {
    let floats = || dtypes.iter().filter(|d| d.is_float());
    let out: Vec<DType> = match op_class(op) {
        OpClass::Passthrough => return None,
        OpClass::Half => dtypes
            .iter()
            .map(|&d| if d.is_float() { half } else { d })
            .collect(),
        OpClass::Fp32 => dtypes
            .iter()
            .map(|&d| if d.is_half() { DType::F32 } else { d })
            .collect(),
        OpClass::Promote => {
            let mut it = floats().copied();
            let first = it.next()?;
            let wide = it.fold(first, DType::promote);
            dtypes
                .iter()
                .map(|&d| if d.is_float() { wide } else { d })
                .collect()
        }
    };
    (out.as_slice() != dtypes).then_some(out)
}

/// `x` in `dtype`: cached for FP32 variables cast to half, fresh otherwise.
fn cast(x: &Tensor, dtype: DType) -> Result<Tensor> {
    if x.dtype() == dtype {
        return Ok(x.clone());
    }
    if !(x.is_variable() && x.dtype() == DType::F32 && dtype.is_half()) {
        return x.to_dtype(dtype);
    }
    let key = (x.id(), dtype, crate::autograd::is_grad_enabled());
    if let Some(t) = CACHE.with(|c| c.borrow().get(&key).cloned()) {
        return Ok(t);
    }
    let t = x.to_dtype(dtype)?;
    CACHE.with(|c| c.borrow_mut().insert(key, t.clone()));
    Ok(t)
}

fn cast_all(op: &str, xs: &[&Tensor]) -> Result<Option<Vec<Tensor>>> {
    let Some(half) = active() else {
        return Ok(None);
    };
    let dtypes: Vec<DType> = xs.iter().map(|t| t.dtype()).collect();
    let Some(to) = targets(op, half, &dtypes) else {
        return Ok(None);
    };
    xs.iter()
        .zip(to)
        .map(|(x, d)| cast(x, d))
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

/// The hook of a one-input op: `Some(cast input)` when autocast changes it.
pub(crate) fn inputs1(op: &'static str, x: &Tensor) -> Result<Option<Tensor>> {
    if ACTIVE.with(|a| a.get()).is_none() {
        return Ok(None);
    }
    Ok(cast_all(op, &[x])?.map(|mut v| v.swap_remove(0)))
}

/// The hook of a two-input op.
pub(crate) fn inputs2(
    op: &'static str,
    a: &Tensor,
    b: &Tensor,
) -> Result<Option<(Tensor, Tensor)>> {
    if ACTIVE.with(|a| a.get()).is_none() {
        return Ok(None);
    }
    Ok(cast_all(op, &[a, b])?.map(|v| {
        let mut it = v.into_iter();
        let (Some(x), Some(y)) = (it.next(), it.next()) else {
            return (a.clone(), b.clone());
        };
        (x, y)
    }))
}

/// The hook of an op with two inputs and an optional third (a bias).
pub(crate) fn inputs3(
    op: &'static str,
    a: &Tensor,
    b: &Tensor,
    c: Option<&Tensor>,
) -> Result<Option<(Tensor, Tensor, Option<Tensor>)>> {
    if ACTIVE.with(|a| a.get()).is_none() {
        return Ok(None);
    }
    let mut xs = vec![a, b];
    xs.extend(c);
    Ok(cast_all(op, &xs)?.map(|v| {
        let mut it = v.into_iter();
        let x = it.next().unwrap_or_else(|| a.clone());
        let y = it.next().unwrap_or_else(|| b.clone());
        (x, y, it.next())
    }))
}

/// The hook of an op over a list of inputs (cat).
pub(crate) fn inputs_n(op: &'static str, xs: &[&Tensor]) -> Result<Option<Vec<Tensor>>> {
    if ACTIVE.with(|a| a.get()).is_none() {
        return Ok(None);
    }
    cast_all(op, xs)
}

/// The inputs of a user op `op` cast by its class under the active scope (unchanged outside a
/// scope): call it at the top of your own op after [`register_op`].
pub fn cast_inputs(op: &str, xs: &[&Tensor]) -> Result<Vec<Tensor>> {
    Ok(match cast_all(op, xs)? {
        Some(v) => v,
        None => xs.iter().map(|t| (*t).clone()).collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_names_are_unique() {
        let mut names: Vec<&str> = OP_TABLE.iter().map(|(n, _)| *n).collect();
        names.sort_unstable();
        let n = names.len();
        names.dedup();
        assert_eq!(n, names.len());
    }

    #[test]
    fn targets_by_class() {
        use DType::*;
        assert_eq!(targets("matmul", F16, &[F32, F32]), Some(vec![F16, F16]));
        assert_eq!(targets("matmul", F16, &[F16, F16]), None);
        assert_eq!(targets("softmax", BF16, &[BF16]), Some(vec![F32]));
        assert_eq!(targets("softmax", BF16, &[F64]), None);
        assert_eq!(targets("add", F16, &[F16, F32]), Some(vec![F32, F32]));
        assert_eq!(targets("cat", F16, &[F16, BF16]), Some(vec![F32, F32]));
        assert_eq!(targets("relu", F16, &[F32]), None);
        assert_eq!(
            targets("cross_entropy", F16, &[F16, I64]),
            Some(vec![F32, I64])
        );
    }
}
