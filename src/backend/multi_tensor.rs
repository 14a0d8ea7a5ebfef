//! The multi-tensor protocol: one call runs a kernel over lists of tensors (apex's
//! `multi_tensor_apply`). The lists and arrays a kernel takes are named ([`MtList`], [`MtArray`])
//! and declared per kernel ([`MtKernel::lists`], [`MtKernel::arrays`]); [`MtKernel::check_call`]
//! checks a call against them before a backend runs it ([`MultiTensorOps`]).

use super::{AdamHyper, LambHyper, NovoGradHyper, SgdHyper};
use crate::base::error::Result;
use crate::base::DType;

/// One locked buffer of a multi-tensor op: its address (host address on the CPU, device address
/// on CUDA), dtype and element count. Built by `crate::multi_tensor` from tensors it holds locked
/// for the duration of the call; backends never see a dangling one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BufRef {
    pub addr: u64,
    pub dtype: DType,
    pub len: usize,
}

/// The tensor lists a multi-tensor kernel reads or writes, by name. Each name has one fixed
/// position ([`MtList::role`]) in [`MtEntry::bufs`] and in the CUDA tensor table (`TEnt::p` in
/// `kernels/mt_common.cuh`); [`MtKernel::lists`] says which names each kernel takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MtList {
    /// What `scale`, `check` and `norm` read.
    Input,
    /// Where `scale` writes.
    Output,
    /// axpby's operands and result: `out = a·x + b·y`.
    X,
    Y,
    Out,
    /// An optimizer's gradient (any float type, multiplied by the grad scale on load).
    Grad,
    /// The tensor an optimizer updates: the FP32 master when there is one, else the parameter.
    Param,
    /// SGD's momentum buffer (FP32; present exactly when momentum is on).
    MomentumBuffer,
    /// Adam/LAMB/NovoGrad first moment (FP32).
    ExpAvg,
    /// Adam/LAMB second moment (FP32).
    ExpAvgSq,
    /// Adam's amsgrad running maximum of the second moment (FP32; present exactly with amsgrad).
    MaxExpAvgSq,
    /// LAMB's raw update, written by phase 1 and applied by phase 2 (FP32 scratch).
    Update,
    /// The model's half weights written in the same pass as the FP32 master (amp O2).
    ModelCopy,
}

/// Buffers per tensor in [`MtEntry::bufs`] (and pointers per `TEnt`).
pub const MT_ROLES: usize = 6;

/// Elements per chunk of a multi-tensor call: one CUDA block each, and the unit of the per-chunk
/// partials that a norm sums in a fixed order (so the CPU backend walks the same chunks). apex
/// uses 65536; a block then loops 32 times over its chunk, and a small net (the main job's
/// ~80k parameters fill only 11 blocks) leaves most of the GPU idle during its SGD kernel. 8192
/// gives such a net enough blocks and keeps a large one's launch at memory speed.
pub const MT_CHUNK: usize = 8192;

impl MtList {
    /// The list's index in [`MtEntry::bufs`]. Names that never meet in one kernel share one.
    pub const fn role(self) -> usize {
        match self {
            MtList::Input | MtList::X | MtList::Grad => 0,
            MtList::Output | MtList::Y | MtList::Param => 1,
            MtList::Out | MtList::MomentumBuffer | MtList::ExpAvg => 2,
            MtList::ExpAvgSq => 3,
            MtList::MaxExpAvgSq | MtList::Update => 4,
            MtList::ModelCopy => 5,
        }
    }

    pub const fn name(self) -> &'static str {
        match self {
            MtList::Input => "input",
            MtList::Output => "output",
            MtList::X => "x",
            MtList::Y => "y",
            MtList::Out => "out",
            MtList::Grad => "grad",
            MtList::Param => "param",
            MtList::MomentumBuffer => "momentum_buffer",
            MtList::ExpAvg => "exp_avg",
            MtList::ExpAvgSq => "exp_avg_sq",
            MtList::MaxExpAvgSq => "max_exp_avg_sq",
            MtList::Update => "update",
            MtList::ModelCopy => "model_copy",
        }
    }
}

/// One tensor of a multi-tensor op: its buffers by role (see [`MtList`]), its element count
/// (every present buffer has it) and its slot (index into per-tensor arrays: step counters,
/// norms).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MtEntry {
    pub bufs: [Option<BufRef>; MT_ROLES],
    pub len: usize,
    pub slot: usize,
}

impl MtEntry {
    /// The buffer of list `l`, if the entry has one.
    pub fn get(&self, l: MtList) -> Option<BufRef> {
        self.bufs[l.role()]
    }
}

/// The device scalars and per-tensor arrays of a multi-tensor op, by name (all F32).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MtArray {
    /// `[1]`: set to 1 on a non-finite input; when non-zero, updates do nothing.
    FoundInf,
    /// `[1]`: every gradient (or input) is multiplied by it on load (1/loss scale · clip).
    GradScale,
    /// `[slots]`: per-tensor step counters (updates read `steps[slot]` before this step).
    Steps,
    /// The kernel's hyperparameters ([`SgdHyper`], [`AdamHyper`], ...), read on the device so
    /// that a captured step follows `set_lr` / `set_config`.
    Hyper,
    /// Norm: `[slots]` per-tensor norms written.
    Norms,
    /// Norm: `[1]` the norm of all tensors written.
    TotalNorm,
    /// LAMB phase 1: `[1]` the global norm of the unscaled gradients (for clipping).
    GradNorm,
    /// LAMB phase 2: `[slots]` ‖param‖ per tensor.
    ParamNorms,
    /// LAMB phase 2: `[slots]` ‖update‖ per tensor.
    UpdateNorms,
    /// NovoGrad: `[slots]` the gradient norm per tensor.
    GradNorms,
    /// NovoGrad: `[slots]` the per-tensor second moment.
    SecondMoments,
    /// The loss-scale update: `[1]` the scale, the clean steps since it changed, the skipped steps.
    LossScale,
    Unskipped,
    SkippedTotal,
}

/// Number of [`MtArray`] names.
pub const MT_ARRAYS: usize = 14;

impl MtArray {
    pub const fn name(self) -> &'static str {
        match self {
            MtArray::FoundInf => "found_inf",
            MtArray::GradScale => "grad_scale",
            MtArray::Steps => "steps",
            MtArray::Hyper => "hyperparameters",
            MtArray::Norms => "per-tensor norms",
            MtArray::TotalNorm => "total norm",
            MtArray::GradNorm => "global gradient norm",
            MtArray::ParamNorms => "parameter norms",
            MtArray::UpdateNorms => "update norms",
            MtArray::GradNorms => "gradient norms",
            MtArray::SecondMoments => "second moments",
            MtArray::LossScale => "loss scale",
            MtArray::Unskipped => "unskipped",
            MtArray::SkippedTotal => "skipped_total",
        }
    }
}

/// The arrays of one multi-tensor op, by name.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MtScalars {
    arrays: [Option<BufRef>; MT_ARRAYS],
}

impl MtScalars {
    pub fn get(&self, a: MtArray) -> Option<BufRef> {
        self.arrays[a as usize]
    }
    pub fn set(&mut self, a: MtArray, b: Option<BufRef>) {
        self.arrays[a as usize] = b;
    }
}

/// Whether a kernel needs a list or an array. `Ignored`: it may be present and is not read (so
/// one set of rows serves both LAMB phases, with one cached table).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Need {
    Required,
    Optional,
    Ignored,
}

/// How many elements an array has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Extent {
    One,
    /// At least one per slot of the call.
    PerSlot,
    /// Exactly this many (a hyperparameter block).
    Words(usize),
}

/// Loss-scale update (apex/PyTorch `_amp_update_scale_`): the scaler's fixed policy, a launch
/// argument.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ScaleUpdateParams {
    pub growth: f32,
    pub backoff: f32,
    pub window: f32,
    pub min: f32,
    pub max: f32,
    pub _pad: u32,
}

/// The multi-tensor kernels. Their lists and arrays are named ([`MtKernel::lists`],
/// [`MtKernel::arrays`]); "skips" means the kernel does nothing when `found_inf` is non-zero;
/// FP32 math, half outputs rounded once on store. Optimizer hyperparameters are read from the
/// `Hyper` array on the device, never passed by value, so a captured graph follows them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum MtKernel {
    /// `output = input·grad_scale`; sets found_inf on a non-finite input.
    Scale,
    /// Sets found_inf on a non-finite input.
    Check,
    /// `output = 0` (PyTorch's `_foreach_zero_`): persistent gradients zeroed by one launch,
    /// where a memset per tensor would cost a graph node each, about two small kernels' time.
    Zero,
    /// `out = a·x + b·y`; check 1: x, 2: y, 3: both for non-finite values.
    Axpby { a: f32, b: f32, check: u32 },
    /// Norms of input·(grad_scale or 1): `norms[slot]` per tensor and `total_norm` (each
    /// optional). `inf`: max-abs instead of L2. Sets found_inf (when given) on a non-finite input.
    Norm { inf: bool },
    /// Fused SGD; momentum when the `momentum_buffer` list is present (first step from
    /// `steps[slot]`); skips.
    Sgd,
    /// Fused Adam/AdamW; amsgrad when the `max_exp_avg_sq` list is present; skips.
    Adam,
    /// LAMB phase 1: moments and the raw update u = (m/bc1)/(√(v/bc2)+ε) + wd·p into `update`,
    /// the gradients clipped by `grad_norm`; skips.
    LambUpdate,
    /// LAMB phase 2: p −= lr·ratio·u, ratio = ‖p‖/‖u‖ from `param_norms`/`update_norms`
    /// (1 when use_ratio is off or either is 0); skips.
    LambApply,
    /// NovoGrad per-tensor moment: `second_moments[slot]` ← first ? n² : β2·v + (1−β2)·n², n =
    /// `grad_norms[slot]`; skips.
    NovoGradMoment,
    /// NovoGrad update with v from `second_moments[slot]`; skips.
    NovoGrad,
    /// `steps[slot] += 1` for each entry unless found_inf.
    StepIncrement,
    /// The loss-scale update on `loss_scale`, `unskipped`, `skipped_total` and `found_inf`
    /// (no lists): see `multi_tensor::amp_update_scale`.
    UpdateScale(ScaleUpdateParams),
}

use Extent::{One, PerSlot, Words};
use MtArray as A;
use MtList as L;
use Need::{Ignored, Optional, Required};

/// The arrays every optimizer update takes besides its own.
macro_rules! update_arrays {
    ($hyper:ty $(, $extra:expr)*) => {
        &[
            (A::Hyper, Required, Words(<$hyper>::WORDS)),
            (A::Steps, Required, PerSlot),
            $($extra,)*
            (A::FoundInf, Optional, One),
            (A::GradScale, Optional, One),
        ]
    };
}

impl MtKernel {
    pub fn name(&self) -> &'static str {
        match self {
            MtKernel::Scale => "scale",
            MtKernel::Check => "check",
            MtKernel::Zero => "zero",
            MtKernel::Axpby { .. } => "axpby",
            MtKernel::Norm { .. } => "norm",
            MtKernel::Sgd => "sgd",
            MtKernel::Adam => "adam",
            MtKernel::LambUpdate => "lamb_update",
            MtKernel::LambApply => "lamb_apply",
            MtKernel::NovoGradMoment => "novograd_moment",
            MtKernel::NovoGrad => "novograd",
            MtKernel::StepIncrement => "step_increment",
            MtKernel::UpdateScale(_) => "update_scale",
        }
    }

    /// The lists the kernel takes.
    pub fn lists(&self) -> &'static [(MtList, Need)] {
        match self {
            MtKernel::Scale => &[(L::Input, Required), (L::Output, Required)],
            MtKernel::Check | MtKernel::Norm { .. } => &[(L::Input, Required)],
            MtKernel::Zero => &[(L::Output, Required)],
            MtKernel::Axpby { .. } => &[(L::X, Required), (L::Y, Required), (L::Out, Required)],
            MtKernel::Sgd => &[
                (L::Grad, Required),
                (L::Param, Required),
                (L::MomentumBuffer, Optional),
                (L::ModelCopy, Optional),
            ],
            MtKernel::Adam => &[
                (L::Grad, Required),
                (L::Param, Required),
                (L::ExpAvg, Required),
                (L::ExpAvgSq, Required),
                (L::MaxExpAvgSq, Optional),
                (L::ModelCopy, Optional),
            ],
            MtKernel::LambUpdate => &[
                (L::Grad, Required),
                (L::Param, Required),
                (L::ExpAvg, Required),
                (L::ExpAvgSq, Required),
                (L::Update, Required),
                (L::ModelCopy, Ignored),
            ],
            MtKernel::LambApply => &[
                (L::Param, Required),
                (L::Update, Required),
                (L::ModelCopy, Optional),
                (L::Grad, Ignored),
                (L::ExpAvg, Ignored),
                (L::ExpAvgSq, Ignored),
            ],
            MtKernel::NovoGradMoment | MtKernel::StepIncrement => &[(L::Grad, Required)],
            MtKernel::NovoGrad => &[
                (L::Grad, Required),
                (L::Param, Required),
                (L::ExpAvg, Required),
                (L::ModelCopy, Optional),
            ],
            MtKernel::UpdateScale(_) => &[],
        }
    }

    /// The arrays the kernel takes, with their extents.
    pub fn arrays(&self) -> &'static [(MtArray, Need, Extent)] {
        match self {
            MtKernel::Scale => &[(A::GradScale, Required, One), (A::FoundInf, Required, One)],
            MtKernel::Check | MtKernel::Axpby { .. } => &[(A::FoundInf, Required, One)],
            MtKernel::Norm { .. } => &[
                (A::GradScale, Optional, One),
                (A::FoundInf, Optional, One),
                (A::Norms, Optional, PerSlot),
                (A::TotalNorm, Optional, One),
            ],
            MtKernel::Sgd => update_arrays!(SgdHyper),
            MtKernel::Adam => update_arrays!(AdamHyper),
            MtKernel::LambUpdate => update_arrays!(LambHyper, (A::GradNorm, Required, One)),
            MtKernel::LambApply => &[
                (A::Hyper, Required, Words(LambHyper::WORDS)),
                (A::ParamNorms, Required, PerSlot),
                (A::UpdateNorms, Required, PerSlot),
                (A::FoundInf, Optional, One),
            ],
            MtKernel::NovoGradMoment => &[
                (A::Hyper, Required, Words(NovoGradHyper::WORDS)),
                (A::Steps, Required, PerSlot),
                (A::GradNorms, Required, PerSlot),
                (A::SecondMoments, Required, PerSlot),
                (A::FoundInf, Optional, One),
            ],
            MtKernel::NovoGrad => {
                update_arrays!(NovoGradHyper, (A::SecondMoments, Required, PerSlot))
            }
            MtKernel::StepIncrement => {
                &[(A::Steps, Required, PerSlot), (A::FoundInf, Optional, One)]
            }
            MtKernel::Zero => &[],
            MtKernel::UpdateScale(_) => &[
                (A::LossScale, Required, One),
                (A::Unskipped, Required, One),
                (A::SkippedTotal, Required, One),
                (A::FoundInf, Required, One),
            ],
        }
    }

    /// Whether a set `found_inf` turns the kernel into a no-op.
    pub fn skips(&self) -> bool {
        matches!(
            self,
            MtKernel::Sgd
                | MtKernel::Adam
                | MtKernel::LambUpdate
                | MtKernel::LambApply
                | MtKernel::NovoGradMoment
                | MtKernel::NovoGrad
                | MtKernel::StepIncrement
        )
    }

    /// Checks a call against [`MtKernel::lists`] and [`MtKernel::arrays`]: every required list
    /// and array present, nothing the kernel does not take, each entry's buffers of its length,
    /// float lists and F32 arrays of their extent. `op` names the caller in errors.
    pub fn check_call(&self, op: &'static str, entries: &[MtEntry], sc: &MtScalars) -> Result<()> {
        use crate::base::error::Error;
        let lists = self.lists();
        for (i, e) in entries.iter().enumerate() {
            for role in 0..MT_ROLES {
                let Some(b) = e.bufs[role] else { continue };
                let Some(&(l, _)) = lists.iter().find(|(l, _)| l.role() == role) else {
                    return Err(Error::invalid_arg(
                        op,
                        "tensor lists",
                        format!("tensor {i}: a list in position {role}"),
                        format!(
                            "only the lists {} takes: {}",
                            self.name(),
                            list_names(lists)
                        ),
                    ));
                };
                if b.len != e.len {
                    return Err(Error::invalid_arg(
                        op,
                        "tensor lists",
                        format!(
                            "tensor {i}: `{}` has {} elements, the others {}",
                            l.name(),
                            b.len,
                            e.len
                        ),
                        "the lists' i-th tensors of equal element count",
                    ));
                }
                if !matches!(b.dtype, DType::F32 | DType::F16 | DType::BF16) {
                    return Err(Error::UnsupportedDType {
                        op,
                        got: b.dtype,
                        expected: "F32, F16 or BF16 tensors in the lists",
                    });
                }
            }
            for &(l, need) in lists {
                if need == Required && e.get(l).is_none() {
                    return Err(Error::invalid_arg(
                        op,
                        "tensor lists",
                        format!("tensor {i} without its `{}`", l.name()),
                        format!("every list {} reads: {}", self.name(), list_names(lists)),
                    ));
                }
            }
        }
        let arrays = self.arrays();
        let max_slot = entries.iter().map(|e| e.slot + 1).max().unwrap_or(0);
        for k in 0..MT_ARRAYS {
            let Some(b) = sc.arrays[k] else { continue };
            let Some(&(a, _, extent)) = arrays.iter().find(|(a, _, _)| *a as usize == k) else {
                return Err(Error::invalid_arg(
                    op,
                    "arrays",
                    format!("an array {} does not take", self.name()),
                    format!("only {}", array_names(arrays)),
                ));
            };
            if b.dtype != DType::F32 {
                return Err(Error::UnsupportedDType {
                    op,
                    got: b.dtype,
                    expected: "F32 device scalars and per-tensor arrays",
                });
            }
            let ok = match extent {
                One => b.len == 1,
                PerSlot => b.len >= max_slot,
                Words(n) => b.len == n,
            };
            if !ok {
                let want = match extent {
                    One => "one element".to_string(),
                    PerSlot => format!("one element per slot ({max_slot})"),
                    Words(n) => format!("{n} words"),
                };
                return Err(Error::invalid_arg(
                    op,
                    a.name(),
                    format!("{} elements", b.len),
                    want,
                ));
            }
        }
        for &(a, need, _) in arrays {
            if need == Required && sc.get(a).is_none() {
                return Err(Error::invalid_arg(
                    op,
                    a.name(),
                    "missing",
                    format!("the arrays {} reads: {}", self.name(), array_names(arrays)),
                ));
            }
        }
        Ok(())
    }
}

fn list_names(lists: &[(MtList, Need)]) -> String {
    let v: Vec<&str> = lists.iter().map(|(l, _)| l.name()).collect();
    v.join(", ")
}

fn array_names(arrays: &[(MtArray, Need, Extent)]) -> String {
    let v: Vec<&str> = arrays.iter().map(|(a, _, _)| a.name()).collect();
    v.join(", ")
}

/// Multi-tensor apply: one call runs `kernel` over every entry (one launch per dtype signature
/// on CUDA, with the chunk table cached on the device). Callers have run
/// [`MtKernel::check_call`].
pub trait MultiTensorOps {
    fn multi_tensor(
        &self,
        kernel: &MtKernel,
        entries: &[MtEntry],
        scalars: &MtScalars,
    ) -> Result<()>;
}
