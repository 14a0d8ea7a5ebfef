//! AMP policies: apex's opt levels O0–O3 with their properties, the loss-scaler settings, and
//! loading from TOML with apex's rules on which overrides a level admits.
//!
//! | level | cast_model_type | autocast | keep_batchnorm_fp32 | master_weights | loss_scale |
//! |-------|-----------------|----------|---------------------|----------------|------------|
//! | O0    | f32             | no       | –                   | no             | 1.0        |
//! | O1    | –               | yes      | –                   | –              | dynamic    |
//! | O2    | half            | no       | yes                 | yes            | dynamic    |
//! | O3    | half            | no       | no                  | no             | 1.0        |
//!
//! "half" is the policy's `half_dtype` (f16 by default, or bf16). With bf16 the loss scale
//! defaults to a static 1.0 (bf16 has f32's exponent range); asking for a dynamic scale with bf16
//! is allowed and logs a warning.
//!
//! A policy file names `opt_level` and any overrides:
//!
//! ```toml
//! opt_level = "O2"
//! half_dtype = "bf16"        # f16 | bf16
//! loss_scale = "dynamic"     # "dynamic" or a number > 0
//! keep_batchnorm_fp32 = true
//! scale_window = 1000
//! ```
//!
//! At O1 the `[ops]` table moves the crate's ops between autocast classes (apex's
//! `register_half_function` / `register_float_function` / `register_promote_function`), by the
//! names of [`OpKind`] (an unknown name is an error listing the known ones; an op in two lists
//! is an error):
//!
//! ```toml
//! opt_level = "O1"
//! [ops]
//! half = ["softmax"]     # compute in the half type
//! float = ["matmul"]     # compute in F32
//! promote = []           # the widest input type
//! passthrough = []       # the inputs' own types
//! ```
//!
//! `amp::initialize` makes the lists active for the process and undoes them when it activates
//! another policy (see [`mod@crate::amp::autocast`]).
//!
//! Code builds the same with [`Policy::opt_level`] and the builder methods; every rule is checked
//! by [`Policy::validate`] (which `amp::initialize` calls), so a policy built in code is held to
//! the same rules as a file.
//!
//! Here: the levels, the policy and its builder, the resolved properties; the rules are in
//! `policy/rules.rs`, the files (and the built-in ones) in `policy/file.rs`.

use super::autocast::OpClass;
use crate::error::{fmt_number, Result};
use crate::tensor::autocast::OpKind;
use crate::tensor::DType;

mod file;
mod rules;

pub use file::BUILTIN_POLICIES;
pub use rules::POLICY_KEYS;

/// apex's optimisation levels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OptLevel {
    /// FP32 training: the reference.
    O0,
    /// Mixed precision by autocast: FP32 weights, half compute where it is safe.
    O1,
    /// "Almost FP16": a half model with FP32 BatchNorm, FP32 master weights, dynamic scaling.
    O2,
    /// Pure half: model and updates in half, no master weights, loss scale 1.
    O3,
}

impl OptLevel {
    pub fn as_str(self) -> &'static str {
        match self {
            OptLevel::O0 => "O0",
            OptLevel::O1 => "O1",
            OptLevel::O2 => "O2",
            OptLevel::O3 => "O3",
        }
    }

    pub fn parse(s: &str) -> Option<OptLevel> {
        Some(match s {
            "O0" => OptLevel::O0,
            "O1" => OptLevel::O1,
            "O2" => OptLevel::O2,
            "O3" => OptLevel::O3,
            _ => return None,
        })
    }
}

impl std::fmt::Display for OptLevel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How losses are scaled before backward.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LossScale {
    /// apex's dynamic scaler: start at `init_scale`, halve on overflow, double after
    /// `scale_window` clean steps.
    Dynamic,
    /// A fixed scale (1.0: no scaling).
    Static(f64),
}

impl std::fmt::Display for LossScale {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LossScale::Dynamic => f.write_str("\"dynamic\""),
            LossScale::Static(v) => write!(f, "{v}"),
        }
    }
}

/// The resolved properties of a policy (apex's `Properties`), what `initialize` acts on.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Properties {
    pub opt_level: OptLevel,
    /// The dtype the model's parameters are cast to (None: left as they are, O1).
    pub cast_model_type: Option<DType>,
    /// Whether the wrapped forward runs under autocast (apex's `patch_torch_functions`).
    pub autocast: bool,
    /// Whether BatchNorm parameters and buffers stay FP32 when the model is cast.
    pub keep_batchnorm_fp32: bool,
    /// Whether the optimizer keeps FP32 master weights.
    pub master_weights: bool,
    pub loss_scale: LossScale,
    /// The half type of the level (what autocast and the model cast use).
    pub half_dtype: DType,
}

impl std::fmt::Display for Properties {
    /// What the level does, in one line: `f16 weights and activations, FP32 batch norm, FP32
    /// master weights, dynamic loss scale`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut parts = Vec::new();
        match self.cast_model_type {
            Some(t) if t.is_half() => parts.push(format!("{t} weights and activations")),
            _ => parts.push("FP32 weights".to_string()),
        }
        if self.autocast {
            parts.push(format!("autocast to {}", self.half_dtype));
        }
        if self.cast_model_type.is_some_and(|t| t.is_half()) && self.keep_batchnorm_fp32 {
            parts.push("FP32 batch norm".into());
        }
        if self.master_weights {
            parts.push("FP32 master weights".into());
        }
        parts.push(match self.loss_scale {
            LossScale::Dynamic => "dynamic loss scale".into(),
            LossScale::Static(1.0) => "no loss scaling".into(),
            LossScale::Static(s) => format!("static loss scale {}", fmt_number(s)),
        });
        f.write_str(&parts.join(", "))
    }
}

/// An AMP policy: an opt level, apex's overrides on top of it, and the scaler settings.
///
/// Override fields are `None` when not given (the level's default applies); see
/// [`Policy::properties`] for the resolved values.
#[derive(Clone, Debug, PartialEq)]
pub struct Policy {
    pub opt_level: OptLevel,
    /// `f16` (default) or `bf16`.
    pub half_dtype: DType,
    pub cast_model_type: Option<DType>,
    pub autocast: Option<bool>,
    pub keep_batchnorm_fp32: Option<bool>,
    pub master_weights: Option<bool>,
    pub loss_scale: Option<LossScale>,
    /// The dynamic scaler's first scale (2^16).
    pub init_scale: f64,
    /// Clean steps before the scale grows (2000).
    pub scale_window: u64,
    /// Growth factor after `scale_window` clean steps (2.0).
    pub growth_factor: f64,
    /// Backoff factor on overflow (0.5).
    pub backoff_factor: f64,
    /// The scale never goes below this (None: no floor, as apex's default).
    pub min_loss_scale: Option<f64>,
    /// The scale never grows above this (2^24).
    pub max_loss_scale: f64,
    /// The number of losses, each with its own scaler (1).
    pub num_losses: usize,
    /// 0: silent; 1: one info line per report interval with skipped steps (debug otherwise) and
    /// the policy at initialize at debug level; 2: the policy at info level too.
    pub verbosity: u8,
    /// Steps between scaler reports (0: never). A report reads the scaler state to the host.
    pub report_interval: u64,
    /// The `[ops]` lists: crate ops moved to another autocast class while this policy is
    /// active (O1 only), in the order given.
    pub op_classes: Vec<(OpKind, OpClass)>,
    /// Where the policy came from, for error messages (`<code>` or the file's path).
    pub source: String,
}

const CODE: &str = "<code>";

impl Policy {
    /// The level's defaults, f16, apex's scaler settings.
    pub fn opt_level(level: OptLevel) -> Policy {
        Policy {
            opt_level: level,
            half_dtype: DType::F16,
            cast_model_type: None,
            autocast: None,
            keep_batchnorm_fp32: None,
            master_weights: None,
            loss_scale: None,
            init_scale: 65536.0,
            scale_window: 2000,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            min_loss_scale: None,
            max_loss_scale: 16777216.0,
            num_losses: 1,
            verbosity: 1,
            report_interval: 100,
            op_classes: Vec::new(),
            source: CODE.to_string(),
        }
    }

    // ---- builder ----------------------------------------------------------------------------

    pub fn with_half_dtype(mut self, dtype: DType) -> Self {
        self.half_dtype = dtype;
        self
    }
    pub fn with_cast_model_type(mut self, dtype: DType) -> Self {
        self.cast_model_type = Some(dtype);
        self
    }
    pub fn with_autocast(mut self, on: bool) -> Self {
        self.autocast = Some(on);
        self
    }
    pub fn with_keep_batchnorm_fp32(mut self, on: bool) -> Self {
        self.keep_batchnorm_fp32 = Some(on);
        self
    }
    pub fn with_master_weights(mut self, on: bool) -> Self {
        self.master_weights = Some(on);
        self
    }
    pub fn with_loss_scale(mut self, scale: LossScale) -> Self {
        self.loss_scale = Some(scale);
        self
    }
    pub fn with_init_scale(mut self, v: f64) -> Self {
        self.init_scale = v;
        self
    }
    pub fn with_scale_window(mut self, steps: u64) -> Self {
        self.scale_window = steps;
        self
    }
    pub fn with_growth_factor(mut self, v: f64) -> Self {
        self.growth_factor = v;
        self
    }
    pub fn with_backoff_factor(mut self, v: f64) -> Self {
        self.backoff_factor = v;
        self
    }
    pub fn with_min_loss_scale(mut self, v: f64) -> Self {
        self.min_loss_scale = Some(v);
        self
    }
    pub fn with_max_loss_scale(mut self, v: f64) -> Self {
        self.max_loss_scale = v;
        self
    }
    pub fn with_num_losses(mut self, n: usize) -> Self {
        self.num_losses = n;
        self
    }
    pub fn with_verbosity(mut self, v: u8) -> Self {
        self.verbosity = v;
        self
    }
    pub fn with_report_interval(mut self, steps: u64) -> Self {
        self.report_interval = steps;
        self
    }

    /// Moves the crate's op `op` to `class` while this policy is active (O1; an `[ops]` list
    /// entry of a policy file).
    pub fn with_op_class(mut self, op: OpKind, class: OpClass) -> Self {
        self.op_classes.push((op, class));
        self
    }

    /// `op` computes in the half type (`[ops] half`).
    pub fn with_half_function(self, op: OpKind) -> Self {
        self.with_op_class(op, OpClass::Half)
    }

    /// `op` computes in F32 (`[ops] float`).
    pub fn with_float_function(self, op: OpKind) -> Self {
        self.with_op_class(op, OpClass::Fp32)
    }

    /// `op` computes in its widest input type (`[ops] promote`).
    pub fn with_promote_function(self, op: OpKind) -> Self {
        self.with_op_class(op, OpClass::Promote)
    }

    // ---- resolution -------------------------------------------------------------------------

    fn resolved_cast(&self) -> Option<DType> {
        self.cast_model_type.or(match self.opt_level {
            OptLevel::O0 => Some(DType::F32),
            OptLevel::O1 => None,
            OptLevel::O2 | OptLevel::O3 => Some(self.half_dtype),
        })
    }

    /// The resolved properties (validated). Logs a warning when a dynamic scale is asked for
    /// with bf16.
    pub fn properties(&self) -> Result<Properties> {
        self.validate()?;
        use OptLevel::*;
        let lvl = self.opt_level;
        let cast = self.resolved_cast();
        let half_model = cast.is_some_and(|t| t.is_half());
        let loss_scale = match self.loss_scale {
            Some(s) => {
                if s == LossScale::Dynamic && self.half_dtype == DType::BF16 {
                    log::warn!(
                        "amp ({}): a dynamic loss scale was asked for with bf16; bf16 has FP32's exponent range and needs no loss scaling",
                        self.source
                    );
                }
                s
            }
            None => match lvl {
                O0 | O3 => LossScale::Static(1.0),
                _ if self.half_dtype == DType::BF16 => LossScale::Static(1.0),
                O1 | O2 => LossScale::Dynamic,
            },
        };
        Ok(Properties {
            opt_level: lvl,
            cast_model_type: cast,
            autocast: self.autocast.unwrap_or(lvl == O1),
            keep_batchnorm_fp32: half_model && self.keep_batchnorm_fp32.unwrap_or(lvl == O2),
            master_weights: self.master_weights.unwrap_or(lvl == O2),
            loss_scale,
            half_dtype: self.half_dtype,
        })
    }
}
