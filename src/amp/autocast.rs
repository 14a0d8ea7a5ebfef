//! O1 autocast: a thread-local scope in which each op casts its inputs by its class, and the one
//! table that classifies every op of the crate ([`class_of`]).
//!
//! | class         | inputs become                                   | ops                          |
//! |---------------|-------------------------------------------------|------------------------------|
//! | `Half`        | the scope's half type                           | matmul, linear, conv2d       |
//! | `Fp32`        | F32 (F64 stays F64)                             | softmax, exp, log, powf, sums, means, losses |
//! | `Fp32Math`    | unchanged; the op computes in F32 and returns F32 (F64 for F64) | cross_entropy (half logits are never copied to F32) |
//! | `Promote`     | the widest input type (f16 with bf16: F32)      | binary elementwise, cat      |
//! | `Passthrough` | unchanged                                       | relu, neg, abs, sqrt, sqr    |
//!
//! Ops that never call the hook (pooling, batch norm, views, casts) keep their input types too.
//!
//! Each op calls the tensor floor's hook at its entry with its [`OpKind`]
//! (`tensor::autocast`); when no scope is active that is one thread-local read and the op goes on
//! with its own inputs. Inside a scope the hook asks this module, which [`autocast`] installs,
//! for the casts; the op re-runs itself on them (the hook then sees inputs already of the right
//! types and returns `None`).
//!
//! Casts of FP32 *variables* (parameters) to half are cached for the iteration, keyed by the
//! variable, the target type and whether gradients are enabled — a cast made under `no_grad` (an
//! eval pass) carries no graph and is never handed to a training forward, apex's staleness bug.
//! The cache is cleared when a loss is scaled and when backward runs. Other inputs are cast fresh.
//!
//! Users classify their own ops with [`register_op`] and cast their inputs with [`cast_inputs`].
//! They move the crate's own ops (the [`OpKind`]s) to another class with apex's
//! [`register_half_function`] / [`register_float_function`] / [`register_promote_function`], or
//! with a policy's `[ops]` lists, which `amp::initialize` makes active (replacing the lists of
//! the policy activated before) and which win over the code's for the ops they name. Both are
//! process-wide, as apex's are; [`class_for`] is the class an op runs in now.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::RwLock;

use crate::error::{Error, Result};
use crate::tensor::autocast::{self as hook, AutocastHook};
pub use crate::tensor::autocast::{active, suspend, AutocastGuard, OpKind};
use crate::tensor::{DType, Tensor, TensorId};

/// How autocast treats an op's floating inputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OpClass {
    /// Cast to the half type (tensor-core ops).
    Half,
    /// Cast half inputs to F32 (ops that need the range or the precision).
    Fp32,
    /// Leave the inputs as they are: the op computes in F32 itself, whatever its inputs' type,
    /// and returns F32 (F64 for F64 inputs). For fused ops whose F32 copy of a half input
    /// would cost more than the op (cross-entropy over a large vocabulary).
    Fp32Math,
    /// Cast every input to the widest input type.
    Promote,
    /// Leave the inputs as they are.
    Passthrough,
}

/// The class of each op of the crate under O1: the one place to look (and to change) which
/// precision an op runs in. Exhaustive: an [`OpKind`] without a class does not compile.
pub const fn class_of(op: OpKind) -> OpClass {
    use OpKind as K;
    match op {
        // ---- half: products that run on tensor cores -----------------------------------------
        K::Matmul | K::Linear | K::Conv2d | K::Attention => OpClass::Half,
        // ---- fp32: range or precision matters ------------------------------------------------
        K::Softmax
        | K::LogSoftmax
        | K::Exp
        | K::Log
        | K::Powf
        | K::Sum
        | K::Mean
        | K::MseLoss
        | K::LayerNorm
        | K::RmsNorm => OpClass::Fp32,
        // ---- fp32 inside: half inputs read as they are, f32 math, an f32 output ------------
        K::CrossEntropy => OpClass::Fp32Math,
        // ---- promote: several inputs, the widest type wins -----------------------------------
        K::Add | K::Sub | K::Mul | K::Div | K::Maximum | K::Minimum | K::Cat => OpClass::Promote,
        // ---- passthrough: exact in any type ---------------------------------------------------
        K::Relu | K::Neg | K::Abs | K::Sqrt | K::Sqr => OpClass::Passthrough,
        // ---- passthrough: as torch's autocast, which lists neither ---------------------------
        K::Gelu | K::GeluTanh | K::Silu => OpClass::Passthrough,
    }
}

thread_local! {
    /// (variable, target dtype, grad enabled) → its cast.
    static CACHE: RefCell<HashMap<(TensorId, DType, bool), Tensor>> = RefCell::new(HashMap::new());
}

/// Classes users registered for their own ops.
static USER_OPS: RwLock<Option<HashMap<String, OpClass>>> = RwLock::new(None);

/// amp's side of the tensor ops' autocast hook: the table, and the cast cache.
struct AmpHook;

impl AutocastHook for AmpHook {
    fn cast_inputs(&self, op: OpKind, half: DType, xs: &[&Tensor]) -> Result<Option<Vec<Tensor>>> {
        cast_all(class_for(op), half, xs)
    }

    fn invalidate_casts(&self) {
        clear_cache();
    }
}

static HOOK: AmpHook = AmpHook;

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
    hook::install(&HOOK);
    Ok(hook::enter(half))
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

/// The class of the op named `op`: a user registration, else the crate's own as it is now
/// ([`class_for`]). Unknown names pass through.
pub fn op_class(op: &str) -> OpClass {
    if let Ok(g) = USER_OPS.read() {
        if let Some(c) = g.as_ref().and_then(|m| m.get(op)) {
            return *c;
        }
    }
    OpKind::from_name(op).map_or(OpClass::Passthrough, class_for)
}

/// Classes of the crate's own ops moved by users (apex's `register_*_function`): from code and
/// from the active policy's `[ops]` lists. Read by every op inside a scope, so a flag says
/// whether there are any before the lock is taken.
#[derive(Default)]
struct Overrides {
    /// From [`register_function`] and its apex-named forms; kept until
    /// [`clear_registered_functions`].
    code: HashMap<OpKind, OpClass>,
    /// The `[ops]` lists of the policy `amp::initialize` last activated (replaced by the next).
    policy: HashMap<OpKind, OpClass>,
}

static OVERRIDES: RwLock<Option<Overrides>> = RwLock::new(None);
static ANY_OVERRIDE: AtomicBool = AtomicBool::new(false);

fn with_overrides(f: impl FnOnce(&mut Overrides)) {
    let mut g = OVERRIDES.write().unwrap_or_else(|e| e.into_inner());
    let o = g.get_or_insert_with(Overrides::default);
    f(o);
    ANY_OVERRIDE.store(
        !(o.code.is_empty() && o.policy.is_empty()),
        Ordering::Release,
    );
}

/// The class `op` runs in now: the active policy's `[ops]` lists first, then the classes
/// registered in code, then the crate's table ([`class_of`]).
pub fn class_for(op: OpKind) -> OpClass {
    if ANY_OVERRIDE.load(Ordering::Acquire) {
        let g = OVERRIDES.read().unwrap_or_else(|e| e.into_inner());
        if let Some(o) = g.as_ref() {
            if let Some(&c) = o.policy.get(&op).or_else(|| o.code.get(&op)) {
                return c;
            }
        }
    }
    class_of(op)
}

/// Moves the crate's op `op` to `class` under O1 for this process, until
/// [`clear_registered_functions`] (a policy's `[ops]` lists take precedence while active).
pub fn register_function(op: OpKind, class: OpClass) {
    with_overrides(|o| {
        o.code.insert(op, class);
    });
}

/// apex's `amp.register_half_function`: `op` casts its floating inputs to the half type.
pub fn register_half_function(op: OpKind) {
    register_function(op, OpClass::Half)
}

/// apex's `amp.register_float_function`: `op` casts its half inputs to F32.
pub fn register_float_function(op: OpKind) {
    register_function(op, OpClass::Fp32)
}

/// apex's `amp.register_promote_function`: `op` casts its inputs to the widest input type.
pub fn register_promote_function(op: OpKind) {
    register_function(op, OpClass::Promote)
}

/// Drops every class registered in code (the policy's lists stay).
pub fn clear_registered_functions() {
    with_overrides(|o| o.code.clear());
}

/// Makes `lists` the active policy's op classes, replacing the previous policy's (what
/// `amp::initialize` does with [`Policy::op_classes`](super::Policy::op_classes)).
pub(crate) fn set_policy_classes(lists: &[(OpKind, OpClass)]) {
    with_overrides(|o| o.policy = lists.iter().copied().collect());
}

/// Every op whose class differs from the crate's table now, with its class, in [`OpKind::ALL`]
/// order.
pub fn moved_ops() -> Vec<(OpKind, OpClass)> {
    OpKind::ALL
        .iter()
        .map(|&k| (k, class_for(k)))
        .filter(|&(k, c)| c != class_of(k))
        .collect()
}

/// Registers the class of a user op `name` (re-registering replaces the class). Naming one of
/// the crate's ops ([`OpKind::ALL`]) is an error: move those with [`register_function`].
pub fn register_op(name: &str, class: OpClass) -> Result<()> {
    if name.is_empty() || OpKind::from_name(name).is_some() {
        return Err(Error::invalid_arg(
            "amp::autocast::register_op",
            "name",
            format!("`{name}`"),
            "a non-empty name that is not one of the crate's ops (OpKind::ALL)",
        ));
    }
    let mut g = USER_OPS.write().unwrap_or_else(|e| e.into_inner());
    g.get_or_insert_with(HashMap::new)
        .insert(name.to_string(), class);
    Ok(())
}

/// The dtype each floating input of an op of `class` should have under a scope of `half`, or
/// None when none changes.
fn targets(class: OpClass, half: DType, dtypes: &[DType]) -> Option<Vec<DType>> {
    let floats = || dtypes.iter().filter(|d| d.is_float());
    let out: Vec<DType> = match class {
        OpClass::Passthrough | OpClass::Fp32Math => return None,
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

fn cast_all(class: OpClass, half: DType, xs: &[&Tensor]) -> Result<Option<Vec<Tensor>>> {
    let dtypes: Vec<DType> = xs.iter().map(|t| t.dtype()).collect();
    let Some(to) = targets(class, half, &dtypes) else {
        return Ok(None);
    };
    xs.iter()
        .zip(to)
        .map(|(x, d)| cast(x, d))
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

/// The inputs of a user op `op` cast by its class under the active scope (unchanged outside a
/// scope): call it at the top of your own op after [`register_op`].
pub fn cast_inputs(op: &str, xs: &[&Tensor]) -> Result<Vec<Tensor>> {
    let cast = match active() {
        Some(half) => cast_all(op_class(op), half, xs)?,
        None => None,
    };
    Ok(cast.unwrap_or_else(|| xs.iter().map(|t| (*t).clone()).collect()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_op_kind_has_a_class_and_a_name_that_round_trips() {
        for &k in OpKind::ALL {
            assert_eq!(OpKind::from_name(k.name()), Some(k), "{k:?}");
            assert_eq!(op_class(k.name()), class_of(k), "{k:?}");
            assert!(register_op(k.name(), OpClass::Half).is_err(), "{k:?}");
        }
        assert_eq!(op_class("no_such_op"), OpClass::Passthrough);
    }

    #[test]
    fn targets_by_class() {
        use DType::*;
        let t = |op: OpKind, half, dtypes: &[DType]| targets(class_of(op), half, dtypes);
        assert_eq!(t(OpKind::Matmul, F16, &[F32, F32]), Some(vec![F16, F16]));
        assert_eq!(t(OpKind::Matmul, F16, &[F16, F16]), None);
        assert_eq!(t(OpKind::Softmax, BF16, &[BF16]), Some(vec![F32]));
        assert_eq!(t(OpKind::Softmax, BF16, &[F64]), None);
        assert_eq!(t(OpKind::Add, F16, &[F16, F32]), Some(vec![F32, F32]));
        assert_eq!(t(OpKind::Cat, F16, &[F16, BF16]), Some(vec![F32, F32]));
        assert_eq!(t(OpKind::Relu, F16, &[F32]), None);
        // Cross-entropy reads half logits as they are (f32 math inside, an f32 output).
        assert_eq!(class_of(OpKind::CrossEntropy), OpClass::Fp32Math);
        assert_eq!(t(OpKind::CrossEntropy, F16, &[F16, I64]), None);
        assert_eq!(t(OpKind::CrossEntropy, BF16, &[BF16, I64]), None);
        assert_eq!(t(OpKind::MseLoss, F16, &[F16, F16]), Some(vec![F32, F32]));
    }
}
