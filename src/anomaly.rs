//! Anomaly mode: finding the first non-finite value (PyTorch's `set_detect_anomaly`, and more).
//!
//! When on ([`detect`], [`detect_scope`], or `MIXPREC_DETECT_ANOMALY=1` in the environment,
//! read once), every op's output in the forward pass and every gradient a backward formula
//! returns is checked for NaN and ±inf. The first one found becomes an [`Error::NonFinite`]
//! whose text names the phase, the op (`log`, `matmul`, `batch_norm`, ...), the module path it
//! ran in (`layer1.0.conv2`, `2`), the tensor's dtype and shape, how many values were NaN and
//! inf, which inputs already held non-finite values (forward) or which input's gradient it is
//! (backward), and the loss scale of the step. [`last_report`] gives the same as an
//! [`AnomalyReport`].
//!
//! - **Backward**: the error is returned by `backward` itself, at the first formula whose
//!   output is non-finite, before anything downstream reads it.
//! - **Forward**: an op's result is not a `Result` at the point where it is checked, so the
//!   error is held for this thread and returned by the next tensor operation on it (the op
//!   that would read the bad value, or the loss's host read), or by [`check`]. Nothing computed
//!   from the bad value escapes without the error.
//!
//! **Module paths** are those of the parameter names (`layer1.0.conv1` for
//! `layer1.0.conv1.weight`): the containers of `nn` (`Sequential`, `ResNet`, its stages and
//! blocks) enter each child's scope ([`module_scope`], [`in_module`]) around its forward, which
//! costs one relaxed atomic load when the mode is off; a module of your own does the same for
//! its children. A backward error names the module its forward op ran in.
//!
//! **Where**: this module is the mode (its switch, the module scopes, the held error, the
//! reports) and imports only the base floor; the checks that read tensors are the tensor layer's
//! (`tensor::anomaly_check`), called as each op's output is made and by the backward engine.
//!
//! **Cost**: off, one relaxed atomic load per op (and one per recorded graph node). On, each op
//! reads its output on the host: on a GPU that is a device → host synchronisation per op (one
//! small reduction, then a 4-byte read), so anomaly mode is a debugging mode, many times slower
//! than a normal step. It cannot run inside a CUDA-graph capture (the capture fails with an
//! error saying so): capture with the mode off, or run the step eagerly (the trainers do).
//!
//! A non-finite gradient under dynamic loss scaling is often the scale's overflow, which the
//! scaler would handle by skipping the step; the report gives the scale so that the two can
//! be told apart, and anomaly mode stops at it anyway (as PyTorch's does).

use std::borrow::Cow;
use std::cell::{Cell, RefCell};
use std::fmt;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Mutex;

use crate::base::error::{Error, Result};
use crate::base::DType;

/// The environment variable that turns the mode on at start (`1`, `true`, `on`, `yes`).
pub const ENV: &str = "MIXPREC_DETECT_ANOMALY";

const UNREAD: u8 = 0;
const OFF: u8 = 1;
const ON: u8 = 2;

static STATE: AtomicU8 = AtomicU8::new(UNREAD);

/// Whether anomaly mode is on (process-wide). The environment is read at the first call.
#[inline]
pub fn is_enabled() -> bool {
    match STATE.load(Ordering::Relaxed) {
        ON => true,
        OFF => false,
        _ => read_env(),
    }
}

#[cold]
fn read_env() -> bool {
    let on = std::env::var(ENV).is_ok_and(|v| {
        matches!(
            v.trim().to_ascii_lowercase().as_str(),
            "1" | "true" | "on" | "yes"
        )
    });
    let _ = STATE.compare_exchange(
        UNREAD,
        if on { ON } else { OFF },
        Ordering::Relaxed,
        Ordering::Relaxed,
    );
    STATE.load(Ordering::Relaxed) == ON
}

/// Turns anomaly mode on or off for the whole process (`torch.autograd.set_detect_anomaly`).
pub fn detect(on: bool) {
    STATE.store(if on { ON } else { OFF }, Ordering::Relaxed);
}

/// Restores the mode as it was when dropped (`torch.autograd.detect_anomaly()` as a guard).
#[must_use = "the mode is restored when the guard drops"]
pub struct DetectGuard {
    prev: bool,
}

impl Drop for DetectGuard {
    fn drop(&mut self) {
        detect(self.prev);
    }
}

/// Sets the mode to `on` until the guard drops.
pub fn detect_scope(on: bool) -> DetectGuard {
    let prev = is_enabled();
    detect(on);
    DetectGuard { prev }
}

/// Where a non-finite value was found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// An op's output in a forward computation.
    Forward,
    /// A gradient returned by an op's backward formula.
    Backward,
}

/// What anomaly mode found: the first non-finite value of a forward or backward pass.
#[derive(Clone, Debug, PartialEq)]
pub struct AnomalyReport {
    pub phase: Phase,
    /// The op whose output (forward) or whose backward formula's output (backward) it was.
    pub op: &'static str,
    /// The module path the op ran in (`layer1.0.conv2`); empty at the top level.
    pub module: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub nan: usize,
    pub inf: usize,
    /// Forward: the inputs (by position) that already held non-finite values (none: the op
    /// made them). Backward: the input whose gradient it is.
    pub inputs: Vec<usize>,
    /// The loss scale of the step (the scaler last made or used), when there is one.
    pub loss_scale: Option<f64>,
}

impl fmt::Display for AnomalyReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let module = if self.module.is_empty() {
            "at the top level (no module scope)".to_string()
        } else {
            format!("in module `{}`", self.module)
        };
        let what = match self.phase {
            Phase::Forward => format!("forward: the output of `{}` {module}", self.op),
            Phase::Backward => format!(
                "backward: the gradient that `{}`'s backward returned for its input {} ({module} \
                 in the forward)",
                self.op,
                self.inputs.first().copied().unwrap_or(0)
            ),
        };
        write!(
            f,
            "{what}: {} {:?} holds {} NaN and {} inf value(s)",
            self.dtype, self.shape, self.nan, self.inf
        )?;
        if self.phase == Phase::Forward {
            if self.inputs.is_empty() {
                write!(f, "; its inputs were finite (this op made them)")?;
            } else {
                write!(
                    f,
                    "; its input(s) {:?} already held non-finite values (a tensor set outside \
                     the checked ops, e.g. a parameter)",
                    self.inputs
                )?;
            }
        }
        match self.loss_scale {
            Some(s) => write!(f, "; loss scale {s}")?,
            None => write!(f, "; no loss scaler")?,
        }
        if self.phase == Phase::Backward
            && self.nan == 0
            && self.loss_scale.is_some_and(|s| s > 1.0)
            && self.dtype.is_half()
        {
            write!(
                f,
                " (only inf in a half gradient under a loss scale above 1: likely the scale's \
                 overflow, which the dynamic scaler handles by skipping the step)"
            )?;
        }
        Ok(())
    }
}

thread_local! {
    /// True while this thread runs a backward pass or a check (their ops are not forward ops).
    static QUIET: Cell<bool> = const { Cell::new(false) };
    static SCOPES: RefCell<Vec<Cow<'static, str>>> = const { RefCell::new(Vec::new()) };
    static PENDING: RefCell<Option<Error>> = const { RefCell::new(None) };
}

static LAST: Mutex<Option<AnomalyReport>> = Mutex::new(None);

/// The last anomaly found in this process, if any.
pub fn last_report() -> Option<AnomalyReport> {
    LAST.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// Forgets [`last_report`] and this thread's held forward error.
pub fn clear() {
    *LAST.lock().unwrap_or_else(|e| e.into_inner()) = None;
    PENDING.with(|p| p.borrow_mut().take());
}

/// The error of a forward anomaly found on this thread and not yet returned, if any (and
/// clears it). Tensor operations return it by themselves; call this where none follows (the
/// end of a step).
pub fn check() -> Result<()> {
    match PENDING.with(|p| p.borrow_mut().take()) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Called by each backend op before it runs (only when the mode is on).
#[inline]
pub(crate) fn before_op() -> Result<()> {
    if QUIET.with(|q| q.get()) {
        return Ok(());
    }
    check()
}

/// The scope of one module's forward: pushed when made (mode on), popped when dropped.
#[must_use = "the module scope ends when the guard drops"]
pub struct ModuleScope {
    pushed: bool,
}

impl Drop for ModuleScope {
    fn drop(&mut self) {
        if self.pushed {
            SCOPES.with(|s| s.borrow_mut().pop());
        }
    }
}

fn push(name: impl FnOnce() -> Cow<'static, str>) -> ModuleScope {
    if !is_enabled() {
        return ModuleScope { pushed: false };
    }
    SCOPES.with(|s| s.borrow_mut().push(name()));
    ModuleScope { pushed: true }
}

/// Enters the child module `name` (its name in the parent: `conv1`, `layer2`) until the guard
/// drops.
pub fn module_scope(name: &'static str) -> ModuleScope {
    push(|| Cow::Borrowed(name))
}

/// Enters the child module at index `i` of a list (`Sequential`'s `0`, `1`, ...).
pub fn module_index(i: usize) -> ModuleScope {
    push(|| Cow::Owned(i.to_string()))
}

/// Enters a child module whose name is made (only when the mode is on) by `name`.
pub fn module_scope_with(name: impl FnOnce() -> String) -> ModuleScope {
    push(|| Cow::Owned(name()))
}

/// Runs `f` inside the child module `name`'s scope.
pub fn in_module<R>(name: &'static str, f: impl FnOnce() -> R) -> R {
    let _s = module_scope(name);
    f()
}

/// The current module path on this thread (`layer1.0.conv2`; empty outside any scope or when
/// the mode is off).
pub fn module_path() -> String {
    SCOPES.with(|s| s.borrow().join("."))
}

/// The module path a recorded graph node keeps for a backward report (mode on only).
pub(crate) fn node_module() -> Option<Box<str>> {
    if !is_enabled() {
        return None;
    }
    Some(module_path().into_boxed_str())
}

/// Marks this thread's ops as not forward ops until dropped (a backward pass, a check).
pub(crate) struct Quiet {
    prev: bool,
}

impl Drop for Quiet {
    fn drop(&mut self) {
        QUIET.with(|q| q.set(self.prev));
    }
}

pub(crate) fn quiet() -> Quiet {
    Quiet {
        prev: QUIET.with(|q| q.replace(true)),
    }
}

/// The error a finding becomes; [`last_report`] keeps the report.
pub(crate) fn found(report: AnomalyReport) -> Error {
    let e = Error::NonFinite {
        op: "anomaly mode",
        detail: report.to_string(),
    };
    *LAST.lock().unwrap_or_else(|e| e.into_inner()) = Some(report);
    e
}

/// Whether this thread's ops are not forward ops now (inside a backward pass or a check).
pub(crate) fn is_quiet() -> bool {
    QUIET.with(|q| q.get())
}

/// Whether a forward finding is held for this thread, not yet returned.
pub(crate) fn is_pending() -> bool {
    PENDING.with(|p| p.borrow().is_some())
}

/// Holds `err` for this thread's next tensor operation (a forward finding: see the module's
/// doc).
pub(crate) fn hold(err: Error) {
    PENDING.with(|p| *p.borrow_mut() = Some(err));
}
