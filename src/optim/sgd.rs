//! Stochastic gradient descent with momentum, dampening, Nesterov and weight decay, matching
//! `torch.optim.SGD` step for step: the config, and [`sgd_update`], the rule in plain tensor ops
//! (the F64 path of [`super::FusedSgd`] and a readable reference for its kernel).

use super::{owned_copy, Hyperparams};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

const OP: &str = "SGD";

/// `torch.optim.SGD`'s hyperparameters (defaults as torch's: lr 1e-3, the rest 0/false).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdConfig {
    pub lr: f64,
    pub momentum: f64,
    pub dampening: f64,
    pub nesterov: bool,
    pub weight_decay: f64,
    /// Apply weight decay after the momentum (apex FusedSGD's `wd_after_momentum`).
    pub wd_after_momentum: bool,
}

impl Default for SgdConfig {
    fn default() -> Self {
        SgdConfig {
            lr: 1e-3,
            momentum: 0.0,
            dampening: 0.0,
            nesterov: false,
            weight_decay: 0.0,
            wd_after_momentum: false,
        }
    }
}

impl SgdConfig {
    /// Checks the values as torch does (plus finiteness); the error names the key, the value
    /// and what is allowed.
    pub fn validate(&self) -> Result<()> {
        let bad = |name: &'static str, value: String, allowed: &str| {
            Err(Error::invalid_arg(OP, name, value, allowed))
        };
        if !(self.lr >= 0.0 && self.lr.is_finite()) {
            return bad("lr", self.lr.to_string(), "a finite value >= 0");
        }
        if !(self.momentum >= 0.0 && self.momentum.is_finite()) {
            return bad("momentum", self.momentum.to_string(), "a finite value >= 0");
        }
        if !self.dampening.is_finite() {
            return bad("dampening", self.dampening.to_string(), "a finite value");
        }
        if !(self.weight_decay >= 0.0 && self.weight_decay.is_finite()) {
            return bad(
                "weight_decay",
                self.weight_decay.to_string(),
                "a finite value >= 0",
            );
        }
        if self.nesterov && (self.momentum <= 0.0 || self.dampening != 0.0) {
            return bad(
                "nesterov",
                format!(
                    "true (momentum = {}, dampening = {})",
                    self.momentum, self.dampening
                ),
                "nesterov needs momentum > 0 and dampening = 0",
            );
        }
        Ok(())
    }

    pub fn to_hyperparams(&self) -> Hyperparams {
        [
            ("lr", self.lr),
            ("momentum", self.momentum),
            ("dampening", self.dampening),
            ("nesterov", if self.nesterov { 1.0 } else { 0.0 }),
            ("weight_decay", self.weight_decay),
            (
                "wd_after_momentum",
                if self.wd_after_momentum { 1.0 } else { 0.0 },
            ),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }

    /// The config of saved hyperparameters: exactly the keys of [`SgdConfig::to_hyperparams`].
    pub fn from_hyperparams(h: &Hyperparams) -> Result<SgdConfig> {
        const KEYS: [&str; 6] = [
            "dampening",
            "lr",
            "momentum",
            "nesterov",
            "weight_decay",
            "wd_after_momentum",
        ];
        // The base learning rate is the optimizer's, not the config's (`initial_lr`).
        if let Some(k) = h
            .keys()
            .find(|k| !KEYS.contains(&k.as_str()) && k.as_str() != super::fused::INITIAL_LR)
        {
            return Err(Error::invalid_arg(
                OP,
                "param_groups",
                format!("unknown hyperparameter `{k}`"),
                format!("the keys {KEYS:?}"),
            ));
        }
        let get = |k: &str| {
            h.get(k).copied().ok_or_else(|| {
                Error::invalid_arg(
                    OP,
                    "param_groups",
                    format!("missing hyperparameter `{k}`"),
                    format!("the keys {KEYS:?}"),
                )
            })
        };
        let nesterov = get("nesterov")?;
        if nesterov != 0.0 && nesterov != 1.0 {
            return Err(Error::invalid_arg(
                OP,
                "nesterov",
                nesterov,
                "0 (false) or 1 (true)",
            ));
        }
        let cfg = SgdConfig {
            lr: get("lr")?,
            momentum: get("momentum")?,
            dampening: get("dampening")?,
            nesterov: nesterov == 1.0,
            weight_decay: get("weight_decay")?,
            // Absent in states saved before it existed.
            wd_after_momentum: h.get("wd_after_momentum").copied().unwrap_or(0.0) == 1.0,
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

/// torch's SGD rule for one parameter `w` with gradient `g` and momentum buffer `buf` (None
/// before the first step), all in the state dtype:
///
/// ```text
/// g += wd·w                       (before the momentum unless wd_after_momentum)
/// if momentum ≠ 0: buf = first ? g : μ·buf + (1−dampening)·g
///                  g = nesterov ? g + μ·buf : buf
/// g += wd·w                       (with wd_after_momentum)
/// w −= lr·g
/// ```
/// Returns the new weight and the new buffer (None without momentum). Not recorded.
pub fn sgd_update(
    w: &Tensor,
    g: &Tensor,
    buf: Option<&Tensor>,
    cfg: &SgdConfig,
) -> Result<(Tensor, Option<Tensor>)> {
    let _ng = crate::no_grad();
    let mut g = g.clone();
    if cfg.weight_decay != 0.0 && !cfg.wd_after_momentum {
        g = g.add(&w.mul_scalar(cfg.weight_decay)?)?;
    }
    let mut new_buf = None;
    if cfg.momentum != 0.0 {
        let b = match buf {
            // A copy: gradients may later be rewritten in place (AMP's unscale).
            None => owned_copy(&g, g.dtype())?,
            Some(b) => b
                .mul_scalar(cfg.momentum)?
                .add(&g.mul_scalar(1.0 - cfg.dampening)?)?,
        };
        g = if cfg.nesterov {
            g.add(&b.mul_scalar(cfg.momentum)?)?
        } else {
            b.clone()
        };
        new_buf = Some(b);
    }
    if cfg.weight_decay != 0.0 && cfg.wd_after_momentum {
        g = g.add(&w.mul_scalar(cfg.weight_decay)?)?;
    }
    let w = w.sub(&g.mul_scalar(cfg.lr)?)?;
    Ok((w, new_buf))
}

/// `torch.optim.SGD`: now the fused implementation ([`super::FusedSgd`]) under its old name;
/// the interface (`new`, `with_groups`, `groups`, `set_config`, `momentum_buffer`) is unchanged.
pub type Sgd = super::FusedSgd;
