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

use std::path::Path;

use serde::Deserialize;

use super::autocast::OpClass;
use crate::config_toml::ConfigText;
use crate::error::{fmt_number, Error, Result};
use crate::tensor::autocast::OpKind;
use crate::tensor::DType;

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

/// Every key a policy file may hold, with what it allows (the words of every error about it,
/// from a file or from [`Policy::validate`]). Rules between keys (apex's) have their own words.
pub const POLICY_KEYS: &[(&str, &str)] = &[
    ("opt_level", "\"O0\", \"O1\", \"O2\" or \"O3\" (required)"),
    ("half_dtype", "\"f16\" or \"bf16\""),
    ("cast_model_type", "\"f32\" or the policy's half_dtype"),
    ("autocast", "true or false"),
    ("patch_torch_functions", "true or false"),
    ("keep_batchnorm_fp32", "true or false"),
    ("master_weights", "true or false"),
    ("loss_scale", "\"dynamic\" or a finite number > 0"),
    ("init_scale", "a finite number > 0, at most max_loss_scale"),
    ("scale_window", "an integer >= 1"),
    ("growth_factor", "a finite number > 1"),
    ("backoff_factor", "a number in (0, 1)"),
    (
        "min_loss_scale",
        "a finite number > 0, at most max_loss_scale",
    ),
    ("max_loss_scale", "a finite number > 0"),
    ("num_losses", "an integer >= 1"),
    ("verbosity", "0, 1 or 2"),
    ("report_interval", "an integer >= 0 (steps; 0: never)"),
    (
        "ops",
        "a table of op-name lists `half`, `float`, `promote`, `passthrough` (at O1 only)",
    ),
    (
        "ops.half",
        "a list of op names (see the [ops] errors for the known ones)",
    ),
    (
        "ops.float",
        "a list of op names (see the [ops] errors for the known ones)",
    ),
    (
        "ops.promote",
        "a list of op names (see the [ops] errors for the known ones)",
    ),
    (
        "ops.passthrough",
        "a list of op names (see the [ops] errors for the known ones)",
    ),
];

/// The `[ops]` lists of a policy file and the class each moves its ops to.
const OP_LISTS: [(&str, OpClass); 4] = [
    ("half", OpClass::Half),
    ("float", OpClass::Fp32),
    ("promote", OpClass::Promote),
    ("passthrough", OpClass::Passthrough),
];

/// The `[ops]` list of `class`.
fn list_of(class: OpClass) -> &'static str {
    OP_LISTS
        .iter()
        .find(|(_, c)| *c == class)
        .map_or("?", |(l, _)| l)
}

/// What an op list admits: the known op names.
fn known_ops() -> String {
    let names: Vec<&str> = OpKind::ALL.iter().map(|k| k.name()).collect();
    format!("op names of the crate: {}", names.join(", "))
}

/// The policy files of `configs/` compiled into the library, by name (the file name without
/// `.toml`); [`Policy::builtin`] parses one.
pub const BUILTIN_POLICIES: &[(&str, &str)] = &[
    ("O0", include_str!("../../configs/O0.toml")),
    ("O1", include_str!("../../configs/O1.toml")),
    ("O1_bf16", include_str!("../../configs/O1_bf16.toml")),
    ("O2", include_str!("../../configs/O2.toml")),
    ("O2_bf16", include_str!("../../configs/O2_bf16.toml")),
    ("O3", include_str!("../../configs/O3.toml")),
    ("O3_bf16", include_str!("../../configs/O3_bf16.toml")),
];

/// What a policy key allows (see [`POLICY_KEYS`]).
fn allowed(key: &str) -> Option<&'static str> {
    POLICY_KEYS.iter().find(|(k, _)| *k == key).map(|(_, a)| *a)
}

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

    // ---- resolution and rules ---------------------------------------------------------------

    fn err(&self, key: &str, value: impl std::fmt::Display, allowed: impl Into<String>) -> Error {
        Error::config(self.source.clone(), key, value.to_string(), allowed)
    }

    /// A number key's error, the number as a person writes it and the key's words.
    fn num_err(&self, key: &str, v: f64) -> Error {
        self.err(key, fmt_number(v), allowed(key).unwrap_or(""))
    }

    /// Checks apex's rules and the value ranges; the error names the source, the key, the
    /// value and what is allowed.
    pub fn validate(&self) -> Result<()> {
        use OptLevel::*;
        let lvl = self.opt_level;
        if !self.half_dtype.is_half() {
            return Err(self.err("half_dtype", self.half_dtype, "\"f16\" or \"bf16\""));
        }
        // apex: "patch_torch_functions=True should only be set by selecting opt_level='O1'".
        if let Some(a) = self.autocast {
            if lvl != O1 && a {
                return Err(self.err(
                    "autocast",
                    a,
                    format!("autocast = true only at opt_level O1 (this policy is {lvl})"),
                ));
            }
        }
        if let Some(t) = self.cast_model_type {
            // apex: "with O1, the model weights themselves should remain FP32".
            if lvl == O1 && t != DType::F32 {
                return Err(self.err(
                    "cast_model_type",
                    t,
                    "at O1 the model stays FP32: leave cast_model_type out (or \"f32\"); use O2 or O3 to cast the model",
                ));
            }
            if t != DType::F32 && t != self.half_dtype {
                return Err(self.err(
                    "cast_model_type",
                    t,
                    format!("\"f32\" or the policy's half_dtype \"{}\"", self.half_dtype),
                ));
            }
        }
        if let Some(k) = self.keep_batchnorm_fp32 {
            // apex: "with opt_level O1, batchnorm functions are automatically patched to run
            // in FP32, so keep_batchnorm_fp32 should be None".
            if lvl == O1 {
                return Err(self.err(
                    "keep_batchnorm_fp32",
                    k,
                    "not set at O1 (autocast already runs batch norm statistics in FP32)",
                ));
            }
            if self.resolved_cast() == Some(DType::F32) {
                return Err(self.err(
                    "keep_batchnorm_fp32",
                    k,
                    "not set when the model is cast to f32 (O0, or cast_model_type = \"f32\"): there is no half model to keep batch norm out of",
                ));
            }
        }
        if let Some(m) = self.master_weights {
            // apex: "It doesn't make sense to use master_weights with O1".
            if lvl == O1 {
                return Err(self.err(
                    "master_weights",
                    m,
                    "not set at O1 (the model weights themselves are FP32)",
                ));
            }
        }
        if let Some(LossScale::Static(v)) = self.loss_scale {
            if !(v.is_finite() && v > 0.0) {
                return Err(self.num_err("loss_scale", v));
            }
        }
        let positive = |key: &str, v: f64| -> Result<()> {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(self.num_err(key, v))
            }
        };
        positive("max_loss_scale", self.max_loss_scale)?;
        positive("init_scale", self.init_scale)?;
        if self.init_scale > self.max_loss_scale {
            return Err(self.err(
                "init_scale",
                fmt_number(self.init_scale),
                format!(
                    "at most max_loss_scale = {}",
                    fmt_number(self.max_loss_scale)
                ),
            ));
        }
        if let Some(m) = self.min_loss_scale {
            positive("min_loss_scale", m)?;
            if m > self.max_loss_scale {
                return Err(self.err(
                    "min_loss_scale",
                    fmt_number(m),
                    format!(
                        "at most max_loss_scale = {}",
                        fmt_number(self.max_loss_scale)
                    ),
                ));
            }
        }
        if !(self.growth_factor.is_finite() && self.growth_factor > 1.0) {
            return Err(self.num_err("growth_factor", self.growth_factor));
        }
        if !(self.backoff_factor > 0.0 && self.backoff_factor < 1.0) {
            return Err(self.num_err("backoff_factor", self.backoff_factor));
        }
        if self.scale_window == 0 {
            return Err(self.err("scale_window", 0, allowed("scale_window").unwrap_or("")));
        }
        if self.num_losses == 0 {
            return Err(self.err("num_losses", 0, allowed("num_losses").unwrap_or("")));
        }
        if self.verbosity > 2 {
            return Err(self.err(
                "verbosity",
                self.verbosity,
                allowed("verbosity").unwrap_or(""),
            ));
        }
        self.validate_op_classes()
    }

    /// The `[ops]` rules: lists only where autocast runs, each op in one list.
    fn validate_op_classes(&self) -> Result<()> {
        let Some(&(first, class)) = self.op_classes.first() else {
            return Ok(());
        };
        if !self.autocast.unwrap_or(self.opt_level == OptLevel::O1) {
            return Err(self.err(
                &format!("ops.{}", list_of(class)),
                format!("[\"{first}\"]"),
                format!(
                    "op lists only with autocast, at opt_level O1 (this policy is {})",
                    self.opt_level
                ),
            ));
        }
        for (i, &(op, class)) in self.op_classes.iter().enumerate() {
            if !OP_LISTS.iter().any(|(_, c)| *c == class) {
                return Err(self.err(
                    "ops",
                    format!("{op} in {class:?}"),
                    "half, float, promote or passthrough (an op's own F32 math is its own)",
                ));
            }
            if let Some(&(_, before)) = self.op_classes[..i].iter().find(|(k, _)| *k == op) {
                return Err(self.err(
                    &format!("ops.{}", list_of(class)),
                    format!("\"{op}\""),
                    format!(
                        "each op in one list (`{op}` is also in ops.{})",
                        list_of(before)
                    ),
                ));
            }
        }
        Ok(())
    }

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

    // ---- built-in policies ------------------------------------------------------------------

    /// One of the policy files shipped in the crate's `configs/` (`"O0"` … `"O3"`, `"O1_bf16"`,
    /// `"O2_bf16"`, `"O3_bf16"`; see [`BUILTIN_POLICIES`]), compiled into the library so that a
    /// program outside this repository gets the same policy as `--policy configs/O2.toml`. Its
    /// `source` is the file's path in the repository (`configs/O2.toml`).
    ///
    /// ```
    /// use mixprec::amp::{OptLevel, Policy};
    ///
    /// let policy = Policy::builtin("O2_bf16")?;
    /// assert_eq!(policy.opt_level, OptLevel::O2);
    /// assert!(Policy::builtin("O4").is_err());
    /// # Ok::<(), mixprec::Error>(())
    /// ```
    pub fn builtin(name: &str) -> Result<Policy> {
        let (_, text) = BUILTIN_POLICIES
            .iter()
            .find(|(n, _)| *n == name)
            .ok_or_else(|| {
                let names: Vec<&str> = BUILTIN_POLICIES.iter().map(|(n, _)| *n).collect();
                Error::config(
                    "<built-in policies>",
                    "name",
                    format!("{name:?}"),
                    format!("one of {}", names.join(", ")),
                )
            })?;
        Self::parse_toml(text, &format!("configs/{name}.toml"))
    }

    // ---- TOML -------------------------------------------------------------------------------

    /// Reads a policy file (see the module docs for the format).
    pub fn from_toml_file(path: impl AsRef<Path>) -> Result<Policy> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::io(format!("reading the amp policy {}", path.display()), e))?;
        Self::parse_toml(&text, &path.display().to_string())
    }

    /// Parses a policy from TOML text (errors name the file as `<string>`).
    pub fn from_toml_str(text: &str) -> Result<Policy> {
        Self::parse_toml(text, "<string>")
    }

    fn parse_toml(text: &str, file: &str) -> Result<Policy> {
        let doc = ConfigText::parse(text, file)?;
        let f: PolicyFile = doc.deserialize(|k| allowed(k).map(String::from))?;
        let bad = |key: &str, value: String| {
            doc.locate(Error::config(file, key, value, allowed(key).unwrap_or("")))
        };
        let level = OptLevel::parse(&f.opt_level)
            .ok_or_else(|| bad("opt_level", format!("{:?}", f.opt_level)))?;
        let mut p = Policy::opt_level(level);
        p.source = file.to_string();
        let dtype = |key: &str, s: &str, ok: &[DType]| {
            DType::parse(s)
                .filter(|d| ok.contains(d))
                .ok_or_else(|| bad(key, format!("{s:?}")))
        };
        if let Some(h) = &f.half_dtype {
            p.half_dtype = dtype("half_dtype", h, &[DType::F16, DType::BF16])?;
        }
        if let Some(t) = &f.cast_model_type {
            p.cast_model_type = Some(dtype(
                "cast_model_type",
                t,
                &[DType::F32, DType::F16, DType::BF16],
            )?);
        }
        let autocast_key = match (f.autocast, f.patch_torch_functions) {
            (Some(_), Some(v)) => {
                return Err(doc.locate(Error::config(
                    file,
                    "patch_torch_functions",
                    v.to_string(),
                    "only one of `autocast` and `patch_torch_functions` (apex's name for it); `autocast` is given too",
                )))
            }
            (Some(_), None) => "autocast",
            (None, Some(_)) => "patch_torch_functions",
            (None, None) => "",
        };
        p.autocast = f.autocast.or(f.patch_torch_functions);
        p.keep_batchnorm_fp32 = f.keep_batchnorm_fp32;
        p.master_weights = f.master_weights;
        p.loss_scale = match f.loss_scale {
            None => None,
            Some(LossScaleToml::Number(v)) => Some(LossScale::Static(v)),
            Some(LossScaleToml::Name(s)) if s == "dynamic" => Some(LossScale::Dynamic),
            Some(LossScaleToml::Name(s)) => return Err(bad("loss_scale", format!("{s:?}"))),
        };
        macro_rules! set {
            ($($field:ident),*) => {$(
                if let Some(v) = f.$field {
                    p.$field = v;
                }
            )*};
        }
        set!(
            init_scale,
            scale_window,
            growth_factor,
            backoff_factor,
            max_loss_scale,
            num_losses,
            verbosity,
            report_interval
        );
        p.min_loss_scale = f.min_loss_scale;
        if let Some(ops) = &f.ops {
            for (list, class) in OP_LISTS {
                for name in ops.list(list) {
                    let op = OpKind::from_name(name).ok_or_else(|| {
                        doc.locate(Error::config(
                            file,
                            format!("ops.{list}"),
                            format!("{name:?}"),
                            format!("`{name}` is not an op; {}", known_ops()),
                        ))
                    })?;
                    p.op_classes.push((op, class));
                }
            }
        }
        p.validate().map_err(|e| match e {
            // Name the key as the file spells it.
            Error::Config {
                file,
                at,
                key,
                value,
                allowed,
            } if key == "autocast" => doc.locate(Error::Config {
                file,
                at,
                key: autocast_key.into(),
                value,
                allowed,
            }),
            e => doc.locate(e),
        })?;
        Ok(p)
    }
}

/// A policy file as written (every key but `opt_level` optional; [`Policy::parse_toml`] turns
/// it into a [`Policy`] and checks it).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PolicyFile {
    opt_level: String,
    half_dtype: Option<String>,
    cast_model_type: Option<String>,
    autocast: Option<bool>,
    patch_torch_functions: Option<bool>,
    keep_batchnorm_fp32: Option<bool>,
    master_weights: Option<bool>,
    loss_scale: Option<LossScaleToml>,
    init_scale: Option<f64>,
    scale_window: Option<u64>,
    growth_factor: Option<f64>,
    backoff_factor: Option<f64>,
    min_loss_scale: Option<f64>,
    max_loss_scale: Option<f64>,
    num_losses: Option<usize>,
    verbosity: Option<u8>,
    report_interval: Option<u64>,
    ops: Option<OpsFile>,
}
/// A policy file's `[ops]` table: op names by the class they move to.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct OpsFile {
    half: Option<Vec<String>>,
    float: Option<Vec<String>>,
    promote: Option<Vec<String>>,
    passthrough: Option<Vec<String>>,
}

impl OpsFile {
    /// The names of list `list` (one of [`OP_LISTS`]).
    fn list(&self, list: &str) -> &[String] {
        let l = match list {
            "half" => &self.half,
            "float" => &self.float,
            "promote" => &self.promote,
            _ => &self.passthrough,
        };
        l.as_deref().unwrap_or(&[])
    }
}

/// `loss_scale = "dynamic"` or a number (an integer is a number too).
#[derive(Deserialize)]
#[serde(untagged)]
enum LossScaleToml {
    Number(f64),
    Name(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every policy file in `configs/` (those whose name starts with `O`) is built in, and the
    /// built-in policy is the one the file gives.
    #[test]
    fn every_shipped_policy_is_built_in_and_equals_its_file() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs");
        let mut files: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.starts_with('O') && n.ends_with(".toml"))
            .map(|n| n.trim_end_matches(".toml").to_string())
            .collect();
        files.sort();
        let mut names: Vec<String> = BUILTIN_POLICIES
            .iter()
            .map(|(n, _)| n.to_string())
            .collect();
        names.sort();
        assert_eq!(files, names, "configs/O*.toml and BUILTIN_POLICIES differ");
        for name in &names {
            let builtin = Policy::builtin(name).unwrap();
            let mut file = Policy::from_toml_file(dir.join(format!("{name}.toml"))).unwrap();
            assert_eq!(builtin.source, format!("configs/{name}.toml"));
            file.source = builtin.source.clone();
            assert_eq!(builtin, file, "{name}");
            assert_eq!(builtin.opt_level.as_str(), &name[..2]);
        }
    }

    #[test]
    fn an_unknown_builtin_name_is_an_error_listing_the_names() {
        let e = Policy::builtin("O4").unwrap_err().to_string();
        assert!(e.contains("\"O4\"") && e.contains("O2_bf16"), "{e}");
    }
}
