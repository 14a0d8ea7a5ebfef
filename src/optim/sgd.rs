//! Stochastic gradient descent with momentum, dampening, Nesterov and weight decay, matching
//! `torch.optim.SGD` step for step. Plain (unfused) tensor ops; the update rule is
//! [`sgd_update`], the one place a fused kernel will replace.

use std::collections::{BTreeMap, HashMap};

use super::{
    check_groups, match_layout, owned_copy, state_dtype, GroupState, GroupView, Hyperparams,
    Optimizer, OptimizerState, ParamGroup,
};
use crate::error::{Error, Result};
use crate::tensor::{Tensor, TensorId};

const OP: &str = "SGD";
const MOMENTUM_BUFFER: &str = "momentum_buffer";

/// `torch.optim.SGD`'s hyperparameters (defaults as torch's: lr 1e-3, the rest 0/false).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdConfig {
    pub lr: f64,
    pub momentum: f64,
    pub dampening: f64,
    pub nesterov: bool,
    pub weight_decay: f64,
}

impl Default for SgdConfig {
    fn default() -> Self {
        SgdConfig {
            lr: 1e-3,
            momentum: 0.0,
            dampening: 0.0,
            nesterov: false,
            weight_decay: 0.0,
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
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }

    /// The config of saved hyperparameters: exactly the keys of [`SgdConfig::to_hyperparams`].
    pub fn from_hyperparams(h: &Hyperparams) -> Result<SgdConfig> {
        const KEYS: [&str; 5] = ["dampening", "lr", "momentum", "nesterov", "weight_decay"];
        if let Some(k) = h.keys().find(|k| !KEYS.contains(&k.as_str())) {
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
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

/// torch's SGD rule for one parameter `w` with gradient `g` and momentum buffer `buf` (None
/// before the first step), all in the state dtype:
///
/// ```text
/// g += wd·w
/// if momentum ≠ 0: buf = first ? g : μ·buf + (1−dampening)·g
///                  g = nesterov ? g + μ·buf : buf
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
    if cfg.weight_decay != 0.0 {
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
    let w = w.sub(&g.mul_scalar(cfg.lr)?)?;
    Ok((w, new_buf))
}

/// `torch.optim.SGD`.
#[derive(Debug)]
pub struct Sgd {
    groups: Vec<ParamGroup<SgdConfig>>,
    /// Momentum buffers (state dtype) by parameter.
    buffers: HashMap<TensorId, Tensor>,
}

impl Sgd {
    /// One group of `params` with `config`.
    pub fn new(params: Vec<Tensor>, config: SgdConfig) -> Result<Sgd> {
        Self::with_groups(vec![ParamGroup::new(params, config)])
    }

    /// Several groups, each with its own hyperparameters.
    pub fn with_groups(groups: Vec<ParamGroup<SgdConfig>>) -> Result<Sgd> {
        for g in &groups {
            g.config.validate()?;
        }
        check_groups(OP, &groups)?;
        Ok(Sgd {
            groups,
            buffers: HashMap::new(),
        })
    }

    pub fn groups(&self) -> &[ParamGroup<SgdConfig>] {
        &self.groups
    }

    /// Replaces the hyperparameters of `group` (validated).
    pub fn set_config(&mut self, group: usize, config: SgdConfig) -> Result<()> {
        config.validate()?;
        let n = self.groups.len();
        let g = self.groups.get_mut(group).ok_or_else(|| {
            Error::invalid_arg(OP, "group", group, format!("a group index in 0..{n}"))
        })?;
        g.config = config;
        Ok(())
    }

    /// The momentum buffer of `param`, once a step with momentum has made one.
    pub fn momentum_buffer(&self, param: &Tensor) -> Option<&Tensor> {
        self.buffers.get(&param.id())
    }
}

impl Optimizer for Sgd {
    fn step(&mut self) -> Result<()> {
        let _ng = crate::no_grad();
        for group in &self.groups {
            let cfg = &group.config;
            for p in &group.params {
                let Some(grad) = p.grad() else { continue };
                let dt = state_dtype(p.dtype());
                let w = p.detach().to_dtype(dt)?;
                let g = grad.detach().to_dtype(dt)?;
                let (new_w, new_buf) = sgd_update(&w, &g, self.buffers.get(&p.id()), cfg)?;
                p.set_data(&new_w.to_dtype(p.dtype())?)?;
                if let Some(b) = new_buf {
                    self.buffers.insert(p.id(), b);
                }
            }
        }
        Ok(())
    }

    fn zero_grad(&mut self) {
        for g in &self.groups {
            for p in &g.params {
                p.zero_grad();
            }
        }
    }

    fn param_groups(&self) -> Vec<GroupView<'_>> {
        self.groups
            .iter()
            .map(|g| GroupView {
                params: &g.params,
                hyperparams: g.config.to_hyperparams(),
            })
            .collect()
    }

    fn lr(&self) -> f64 {
        self.groups.first().map_or(0.0, |g| g.config.lr)
    }

    fn set_lr(&mut self, group: usize, lr: f64) -> Result<()> {
        let n = self.groups.len();
        let g = self.groups.get(group).ok_or_else(|| {
            Error::invalid_arg(OP, "group", group, format!("a group index in 0..{n}"))
        })?;
        let cfg = SgdConfig { lr, ..g.config };
        self.set_config(group, cfg)
    }

    fn state_dict(&self) -> Result<OptimizerState> {
        let mut state = BTreeMap::new();
        let mut param_groups = Vec::with_capacity(self.groups.len());
        let mut pos = 0;
        for g in &self.groups {
            let mut ids = Vec::with_capacity(g.params.len());
            for p in &g.params {
                if let Some(b) = self.buffers.get(&p.id()) {
                    let mut m = BTreeMap::new();
                    m.insert(MOMENTUM_BUFFER.to_string(), owned_copy(b, b.dtype())?);
                    state.insert(pos, m);
                }
                ids.push(pos);
                pos += 1;
            }
            param_groups.push(GroupState {
                params: ids,
                hyperparams: g.config.to_hyperparams(),
            });
        }
        Ok(OptimizerState {
            state,
            param_groups,
        })
    }

    fn load_state_dict(&mut self, saved: &OptimizerState) -> Result<()> {
        let op = "SGD::load_state_dict";
        let map = match_layout(op, &self.groups, saved)?;
        let configs = saved
            .param_groups
            .iter()
            .map(|g| SgdConfig::from_hyperparams(&g.hyperparams))
            .collect::<Result<Vec<_>>>()?;
        let mut buffers = HashMap::new();
        for (pos, entries) in &saved.state {
            let p = map[pos];
            for (name, t) in entries {
                if name != MOMENTUM_BUFFER {
                    return Err(Error::invalid_arg(
                        op,
                        "state",
                        format!("`{name}` for parameter {pos}"),
                        format!("only `{MOMENTUM_BUFFER}`"),
                    ));
                }
                buffers.insert(p.id(), owned_copy(t, state_dtype(p.dtype()))?);
            }
        }
        for (g, cfg) in self.groups.iter_mut().zip(configs) {
            g.config = cfg;
        }
        self.buffers = buffers;
        Ok(())
    }
}
