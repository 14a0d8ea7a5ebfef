//! A policy's rules ([`Policy::validate`]): the keys and what each allows, apex's rules
//! between keys, the `[ops]` lists' rules; a policy built in code and one read from a file are
//! held to the same.

use super::{LossScale, OptLevel, Policy};
use crate::amp::autocast::OpClass;
use crate::error::{fmt_number, Error, Result};
use crate::tensor::autocast::OpKind;
use crate::tensor::DType;

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
pub(super) const OP_LISTS: [(&str, OpClass); 4] = [
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
pub(super) fn known_ops() -> String {
    let names: Vec<&str> = OpKind::ALL.iter().map(|k| k.name()).collect();
    format!("op names of the crate: {}", names.join(", "))
}

/// What a policy key allows (see [`POLICY_KEYS`]).
pub(super) fn allowed(key: &str) -> Option<&'static str> {
    POLICY_KEYS.iter().find(|(k, _)| *k == key).map(|(_, a)| *a)
}

impl Policy {
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
}
