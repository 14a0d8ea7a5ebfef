//! The `Module` trait: a forward pass, plus a visitor over named parameters and buffers from
//! which everything else (parameter lists, state dicts, dtype casts, train/eval) is derived.
//!
//! Names follow PyTorch/torchvision (`layer1.0.conv1.weight`, `bn1.running_mean`), so that
//! checkpoints map one to one onto torch's. A module reports its *own* tensors with
//! [`Module::visit_own`] (names relative to it) and its direct children with
//! [`Module::visit_children`]; the provided [`Module::visit`] joins the two into full dotted
//! names. Every provided method works through `&self`: parameters are variables whose contents
//! are replaced in place (`set_data`, `cast_in_place`) and the train/eval mode is an atomic flag,
//! so a model can be shared (`Arc`) with the optimizer and AMP while it trains.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};

use super::batch_norm::BatchNorm2d;
use crate::error::{Error, Mismatch, Result};
use crate::tensor::{DType, MemoryFormat, Tensor};

/// Whether a tensor is trained (a parameter) or state that is saved but not trained (a buffer).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TensorKind {
    Parameter,
    Buffer,
}

/// One parameter or buffer, as the visitor sees it.
#[derive(Clone, Copy, Debug)]
pub struct TensorInfo<'a> {
    /// The full dotted name (`layer1.0.bn1.weight`), or the module-relative one in `visit_own`.
    pub name: &'a str,
    pub tensor: &'a Tensor,
    pub kind: TensorKind,
    /// Whether the tensor belongs to a batch-norm layer (AMP's O2 cast keeps these in FP32).
    pub batch_norm: bool,
}

/// A module's parameters and buffers by name, in registration order (PyTorch's `state_dict`).
pub type StateDict = Vec<(String, Tensor)>;

/// The train/eval flag of a module, settable through `&self`.
#[derive(Debug)]
pub struct TrainingFlag(AtomicBool);

impl TrainingFlag {
    pub fn new(training: bool) -> Self {
        TrainingFlag(AtomicBool::new(training))
    }
    pub fn get(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
    pub fn set(&self, training: bool) {
        self.0.store(training, Ordering::Relaxed)
    }
}

impl Default for TrainingFlag {
    /// Modules start in training mode, as in PyTorch.
    fn default() -> Self {
        TrainingFlag::new(true)
    }
}

fn join(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_string()
    } else {
        format!("{prefix}.{name}")
    }
}

pub trait Module: Send + Sync {
    fn forward(&self, x: &Tensor) -> Result<Tensor>;

    /// Calls `f` on this module's own parameters and buffers (not its children's), with names
    /// relative to the module (`weight`, `running_mean`), parameters before buffers.
    fn visit_own(&self, _f: &mut dyn FnMut(&TensorInfo)) {}

    /// Calls `f` on each direct child with its name (`conv1`, `0`, `downsample`), in order.
    fn visit_children(&self, _f: &mut dyn FnMut(&str, &dyn Module)) {}

    /// This module's train/eval flag, if it has one.
    fn training_flag(&self) -> Option<&TrainingFlag> {
        None
    }

    /// This module as a batch norm, if it is one (or wraps one as a whole: AMP's and DDP's
    /// wrappers, `SyncBatchNorm`); what [`Module::visit_batch_norms`] finds.
    fn as_batch_norm(&self) -> Option<&BatchNorm2d> {
        None
    }

    // ---- provided -----------------------------------------------------------------------------

    /// Calls `f` on every parameter and buffer of this module and its descendants with full
    /// dotted names under `prefix` (`""` for the root), each module's own tensors before its
    /// children's (PyTorch's order).
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&TensorInfo)) {
        self.visit_own(&mut |info| {
            let name = join(prefix, info.name);
            f(&TensorInfo {
                name: &name,
                ..*info
            })
        });
        self.visit_children(&mut |name, child| child.visit(&join(prefix, name), f));
    }

    /// Calls `f` on every batch norm of this module and its descendants with its full dotted
    /// name under `prefix` (`layer1.0.bn1`; `""` for the root), in the order of [`Module::visit`].
    fn visit_batch_norms(&self, prefix: &str, f: &mut dyn FnMut(&str, &BatchNorm2d)) {
        if let Some(bn) = self.as_batch_norm() {
            f(prefix, bn);
        }
        self.visit_children(&mut |name, child| child.visit_batch_norms(&join(prefix, name), f));
    }

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        self.visit("", &mut |i| {
            if i.kind == TensorKind::Parameter {
                out.push((i.name.to_string(), i.tensor.clone()));
            }
        });
        out
    }

    /// The parameters (handles to them: an optimizer updates them in place).
    fn parameters(&self) -> Vec<Tensor> {
        self.named_parameters()
            .into_iter()
            .map(|(_, t)| t)
            .collect()
    }

    fn named_buffers(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        self.visit("", &mut |i| {
            if i.kind == TensorKind::Buffer {
                out.push((i.name.to_string(), i.tensor.clone()));
            }
        });
        out
    }

    /// The number of parameter elements (PyTorch's `sum(p.numel() for p in m.parameters())`).
    fn num_parameters(&self) -> usize {
        let mut n = 0;
        self.visit("", &mut |i| {
            if i.kind == TensorKind::Parameter {
                n += i.tensor.elem_count();
            }
        });
        n
    }

    /// Copies of every parameter and buffer by name: half tensors as F32 (a checkpoint never
    /// holds half values whatever the AMP level), F32/F64 as they are, I64 buffers as they are.
    /// The copies share nothing with the model.
    fn state_dict(&self) -> Result<StateDict> {
        let mut out = Vec::new();
        let mut err = None;
        self.visit("", &mut |i| {
            if err.is_some() {
                return;
            }
            match state_copy(i.tensor) {
                Ok(t) => out.push((i.name.to_string(), t)),
                Err(e) => err = Some(e),
            }
        });
        match err {
            Some(e) => Err(e),
            None => Ok(out),
        }
    }

    /// Copies `entries` into this module's parameters and buffers, strictly (PyTorch's
    /// `load_state_dict(strict=True)`): every name must be present exactly once, no other names,
    /// equal shapes; every problem is reported at once ([`Error::StateMismatch`], see
    /// [`state_dict_mismatches`]). Values are converted to each tensor's current dtype; tensors
    /// keep their identity. Everything is checked before anything is written, so an error leaves
    /// the module unchanged.
    fn load_state_dict(&self, entries: &[(String, Tensor)]) -> Result<()> {
        let problems = state_dict_mismatches(self, entries)?;
        if !problems.is_empty() {
            return Err(Error::StateMismatch {
                context: "load_state_dict".into(),
                problems,
            });
        }
        let given: HashMap<&str, &Tensor> = entries.iter().map(|(n, t)| (n.as_str(), t)).collect();
        let mut targets: Vec<(String, Tensor)> = Vec::new();
        self.visit("", &mut |i| {
            targets.push((i.name.to_string(), i.tensor.clone()))
        });
        let _g = crate::no_grad();
        for (name, dst) in &targets {
            // Copied across devices as PyTorch's load_state_dict does (a checkpoint is read on
            // the CPU; a BatchNorm's step counter lives there whatever the model's device).
            let src = given[name.as_str()]
                .detach()
                .to_device(dst.device())?
                .to_dtype(dst.dtype())?;
            dst.set_data(&src)?;
        }
        Ok(())
    }

    /// Casts every float parameter and buffer to `dtype` in place (and their gradients, if
    /// any); with `keep_batchnorm_fp32`, batch-norm tensors are cast to F32 instead (apex's O2).
    /// I64 buffers are left alone.
    fn cast(&self, dtype: DType, keep_batchnorm_fp32: bool) -> Result<()> {
        if !dtype.is_float() {
            return Err(Error::UnsupportedDType {
                op: "Module::cast",
                got: dtype,
                expected: "a float dtype",
            });
        }
        let mut result = Ok(());
        self.visit("", &mut |i| {
            if result.is_err() || !i.tensor.dtype().is_float() {
                return;
            }
            let to = if keep_batchnorm_fp32 && i.batch_norm {
                DType::F32
            } else {
                dtype
            };
            result = cast_with_grad(i.tensor, to);
        });
        result
    }

    /// Lays every 4-D parameter and buffer (convolution weights) out in `format`, in place, with
    /// its gradient (PyTorch's `model.to(memory_format=...)`). With channels_last weights and
    /// inputs, convolutions, batch norm and pooling run NHWC end to end on the GPU. Call it
    /// before creating the optimizer or `amp::initialize`: their state takes each parameter's
    /// layout when it is made. State dicts and checkpoints hold logical tensors whatever the
    /// format.
    fn to_memory_format(&self, format: MemoryFormat) -> Result<()> {
        let mut result = Ok(());
        self.visit("", &mut |i| {
            if result.is_ok() && i.tensor.rank() == 4 {
                result = i.tensor.to_memory_format_(format);
            }
        });
        result
    }

    /// Switches this module and its descendants to training (`true`) or eval (`false`) mode.
    fn set_training(&self, training: bool) {
        if let Some(f) = self.training_flag() {
            f.set(training);
        }
        self.visit_children(&mut |_, c| c.set_training(training));
    }

    /// Eval mode, PyTorch's `model.eval()`.
    fn eval(&self) {
        self.set_training(false)
    }

    /// The mode of this module: its own flag, else its first descendant's, else `true`.
    fn is_training(&self) -> bool {
        if let Some(f) = self.training_flag() {
            return f.get();
        }
        let mut found = None;
        self.visit_children(&mut |_, c| {
            if found.is_none() {
                found = Some(c.is_training());
            }
        });
        found.unwrap_or(true)
    }

    /// Drops every parameter's gradient.
    fn zero_grad(&self) {
        self.visit("", &mut |i| {
            if i.kind == TensorKind::Parameter {
                i.tensor.zero_grad();
            }
        });
    }
}

/// What [`Module::load_state_dict`] checks, without loading anything: every name of the module
/// that `entries` lacks, every entry the module has no tensor for, every shape that differs and
/// every float/integer disagreement (values are otherwise converted to the module's dtype), in
/// the module's order and then the entries'. An empty list means the load will succeed. A name
/// given twice in `entries` is an error of its own.
pub fn state_dict_mismatches<M: Module + ?Sized>(
    module: &M,
    entries: &[(String, Tensor)],
) -> Result<Vec<Mismatch>> {
    let mut given: HashMap<&str, &Tensor> = HashMap::with_capacity(entries.len());
    for (name, t) in entries {
        if given.insert(name.as_str(), t).is_some() {
            return Err(Error::invalid_arg(
                "load_state_dict",
                "state_dict",
                format!("`{name}` given twice"),
                "each name at most once",
            ));
        }
    }
    let mut problems = Vec::new();
    let mut known = HashSet::new();
    module.visit("", &mut |i| {
        known.insert(i.name.to_string());
        let dst = i.tensor;
        let Some(src) = given.get(i.name) else {
            problems.push(Mismatch::Missing {
                name: i.name.to_string(),
                shape: dst.shape().clone(),
                dtype: dst.dtype(),
            });
            return;
        };
        if src.shape() != dst.shape() {
            problems.push(Mismatch::Shape {
                name: i.name.to_string(),
                expected: dst.shape().clone(),
                found: src.shape().clone(),
            });
        } else if src.dtype().is_float() != dst.dtype().is_float() {
            problems.push(Mismatch::DType {
                name: i.name.to_string(),
                expected: dst.dtype(),
                found: src.dtype(),
            });
        }
    });
    for (name, t) in entries {
        if !known.contains(name) {
            problems.push(Mismatch::Unexpected {
                name: name.clone(),
                shape: t.shape().clone(),
                dtype: t.dtype(),
            });
        }
    }
    Ok(problems)
}

/// A copy of `t` sharing nothing with it: half as F32, other dtypes kept.
fn state_copy(t: &Tensor) -> Result<Tensor> {
    let t = t.detach();
    if t.dtype().is_half() {
        return t.to_dtype(DType::F32);
    }
    t.owned()
}

fn cast_with_grad(t: &Tensor, dtype: DType) -> Result<()> {
    if t.dtype() == dtype {
        return Ok(());
    }
    t.cast_in_place(dtype)?;
    if let Some(g) = t.grad() {
        t.set_grad(Some(g.detach().to_dtype(dtype)?));
    }
    Ok(())
}

/// `Module` for smart pointers to modules, forwarding every method (the provided ones too, so
/// that a wrapper's own state dict, AMP's O2 masters, survives boxing or sharing).
macro_rules! forward_module {
    ($($ptr:ident)::+) => {
        impl<M: Module + ?Sized> Module for $($ptr)::+<M> {
            fn forward(&self, x: &Tensor) -> Result<Tensor> {
                (**self).forward(x)
            }
            fn visit(&self, prefix: &str, f: &mut dyn FnMut(&TensorInfo)) {
                (**self).visit(prefix, f)
            }
            fn set_training(&self, training: bool) {
                (**self).set_training(training)
            }
            fn is_training(&self) -> bool {
                (**self).is_training()
            }
            fn visit_own(&self, f: &mut dyn FnMut(&TensorInfo)) {
                (**self).visit_own(f)
            }
            fn visit_children(&self, f: &mut dyn FnMut(&str, &dyn Module)) {
                (**self).visit_children(f)
            }
            fn training_flag(&self) -> Option<&TrainingFlag> {
                (**self).training_flag()
            }
            fn as_batch_norm(&self) -> Option<&BatchNorm2d> {
                (**self).as_batch_norm()
            }
            fn visit_batch_norms(&self, prefix: &str, f: &mut dyn FnMut(&str, &BatchNorm2d)) {
                (**self).visit_batch_norms(prefix, f)
            }
            fn state_dict(&self) -> Result<StateDict> {
                (**self).state_dict()
            }
            fn load_state_dict(&self, entries: &[(String, Tensor)]) -> Result<()> {
                (**self).load_state_dict(entries)
            }
        }
    };
}
forward_module!(Box);
forward_module!(std::sync::Arc);
