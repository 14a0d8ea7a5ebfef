//! The fused optimizers' `state_dict` and `load_state_dict` in PyTorch's layout: per-parameter
//! state by position, the step counters and masters, each group's hyperparameters with its
//! base learning rate; a load checked whole before anything changes.

use std::collections::BTreeMap;

use super::{in_range, state_zeros, Core, INITIAL_LR, MASTER, STEP};
use crate::error::{Error, Result};
use crate::optim::{
    match_layout, owned_copy, GroupConfig, GroupState, Hyperparams, OptimizerState,
};
use crate::tensor::{DType, Device, Shape, Tensor};

impl<C: GroupConfig> Core<C> {
    /// Host copies of the step counters (a sync: only for state_dict).
    fn host_steps(&self) -> Result<Vec<Vec<f32>>> {
        self.steps
            .iter()
            .map(|s| match s {
                Some(t) => t.to_vec::<f32>(),
                None => Ok(Vec::new()),
            })
            .collect()
    }

    /// PyTorch's layout: per-parameter state by position (`names[k]` for buffer k, plus `step`
    /// and the master when there are masters), for parameters that have taken a step.
    /// `extra(gi, idx)` adds optimizer-specific per-parameter entries.
    pub fn state_dict(
        &self,
        names: &[&str],
        hyper: impl Fn(&C) -> Hyperparams,
        extra: impl Fn(usize, usize, f32) -> Result<Vec<(String, Tensor)>>,
    ) -> Result<OptimizerState> {
        let steps = self.host_steps()?;
        let mut state = BTreeMap::new();
        let mut param_groups = Vec::with_capacity(self.groups.len());
        let mut pos = 0;
        for (gi, g) in self.groups.iter().enumerate() {
            let mut ids = Vec::with_capacity(g.params.len());
            for (idx, &step) in steps[gi].iter().enumerate() {
                let mut m = BTreeMap::new();
                if let (Some(st), true) = (&self.state[gi][idx], step > 0.0) {
                    for (k, t) in st.iter().enumerate() {
                        if let Some(name) = names.get(k) {
                            m.insert(name.to_string(), owned_copy(t, DType::F32)?);
                        }
                    }
                    m.insert(
                        STEP.to_string(),
                        Tensor::scalar(step as f64, DType::F32, Device::Cpu)?,
                    );
                    for (k, v) in extra(gi, idx, step)? {
                        m.insert(k, v);
                    }
                }
                if let Some(ms) = &self.masters {
                    m.insert(MASTER.to_string(), owned_copy(ms.at(gi, idx), DType::F32)?);
                }
                if !m.is_empty() {
                    state.insert(pos, m);
                }
                ids.push(pos);
                pos += 1;
            }
            let mut hyperparams = hyper(&g.config);
            hyperparams.insert(INITIAL_LR.to_string(), self.base_lrs[gi]);
            param_groups.push(GroupState {
                params: ids,
                hyperparams,
            });
        }
        Ok(OptimizerState {
            state,
            param_groups,
        })
    }

    /// The saved groups' configs (through `config`, without their `initial_lr`) and base
    /// learning rates, checked; nothing is changed yet.
    fn saved_configs(
        &self,
        saved: &OptimizerState,
        config: impl Fn(&Hyperparams) -> Result<C>,
    ) -> Result<(Vec<C>, Vec<f64>)> {
        let configs = saved
            .param_groups
            .iter()
            .map(|g| {
                let mut h = g.hyperparams.clone();
                h.remove(INITIAL_LR);
                config(&h)
            })
            .collect::<Result<Vec<_>>>()?;
        // States saved before base learning rates were kept have none: the current bases stay.
        let mut base_lrs = self.base_lrs.clone();
        for (gi, g) in saved.param_groups.iter().enumerate() {
            if let Some(&b) = g.hyperparams.get(INITIAL_LR) {
                in_range(self.op, INITIAL_LR, b, 0.0, f64::MAX, false)?;
                base_lrs[gi] = b;
            }
        }
        Ok((configs, base_lrs))
    }

    /// Checks and restores a saved state completely before changing anything: configs via
    /// `config`, buffers named `names` (missing ones zero), `step`, masters, and optimizer
    /// specific per-parameter scalars (`scalar_names`, returned per group as `[n]` host vectors).
    #[allow(clippy::type_complexity)]
    pub fn load_state_dict(
        &mut self,
        saved: &OptimizerState,
        names: &[&str],
        scalar_names: &[&str],
        config: impl Fn(&Hyperparams) -> Result<C>,
    ) -> Result<Vec<BTreeMap<String, Vec<f32>>>> {
        let op = self.op;
        let map = match_layout(op, &self.groups, saved)?;
        let (configs, base_lrs) = self.saved_configs(saved, config)?;
        // (group, idx) of each position.
        let mut where_ = BTreeMap::new();
        for (gi, g) in saved.param_groups.iter().enumerate() {
            for (idx, &pos) in g.params.iter().enumerate() {
                where_.insert(pos, (gi, idx));
            }
        }
        let mut state: Vec<Vec<Option<Vec<Tensor>>>> = self
            .groups
            .iter()
            .map(|g| vec![None; g.params.len()])
            .collect();
        let mut steps: Vec<Vec<f32>> = self
            .groups
            .iter()
            .map(|g| vec![0.0; g.params.len()])
            .collect();
        let mut scalars: Vec<BTreeMap<String, Vec<f32>>> = self
            .groups
            .iter()
            .map(|g| {
                scalar_names
                    .iter()
                    .map(|n| (n.to_string(), vec![0.0; g.params.len()]))
                    .collect()
            })
            .collect();
        // Masters are restored in place once everything is checked: (group, index, value).
        let mut masters: Vec<(usize, usize, Tensor)> = Vec::new();
        for (pos, entries) in &saved.state {
            let p = map[pos];
            let (gi, idx) = where_[pos];
            let mut bufs: Vec<Option<Tensor>> = vec![None; names.len()];
            for (name, t) in entries {
                let full = |t: &Tensor| -> Result<Tensor> {
                    if t.shape() != p.shape() {
                        return Err(Error::shape_mismatch(
                            op,
                            p.shape(),
                            t.shape(),
                            format!("state `{name}` of parameter {pos}"),
                        ));
                    }
                    // Laid out as the parameter (a channels_last weight's state is too).
                    owned_copy(&t.to_device(self.device)?, DType::F32)?
                        .laid_out_like(p)
                        .map(|t| t.detach())
                };
                if let Some(k) = names.iter().position(|n| n == name) {
                    bufs[k] = Some(full(t)?);
                } else if name == STEP {
                    let v = t.item()?;
                    if !(v >= 0.0 && v.fract() == 0.0 && v < 16_777_216.0) {
                        return Err(Error::invalid_arg(
                            op,
                            "step",
                            v,
                            "a whole number of steps in 0..2^24",
                        ));
                    }
                    steps[gi][idx] = v as f32;
                } else if name == MASTER {
                    if self.masters.is_none() {
                        return Err(Error::invalid_arg(
                            op,
                            "state",
                            format!("`{MASTER}` for parameter {pos}"),
                            "master weights only after use_master_weights()",
                        ));
                    }
                    masters.push((gi, idx, full(t)?));
                } else if scalar_names.contains(&name.as_str()) {
                    scalars[gi].get_mut(name.as_str()).expect("listed")[idx] = t.item()? as f32;
                } else {
                    let mut known: Vec<&str> = names.to_vec();
                    known.extend([STEP, MASTER]);
                    known.extend(scalar_names);
                    return Err(Error::invalid_arg(
                        op,
                        "state",
                        format!("`{name}` for parameter {pos}"),
                        format!("the keys {known:?}"),
                    ));
                }
            }
            if bufs.iter().any(|b| b.is_some()) || steps[gi][idx] > 0.0 {
                // Buffers the state does not have after its last one (amsgrad's max when it was
                // off) are not made: a step makes them when it needs them, and the state then
                // saves as it was loaded.
                while bufs.last().is_some_and(|b| b.is_none()) {
                    bufs.pop();
                }
                let bufs = bufs
                    .into_iter()
                    .map(|b| match b {
                        Some(b) => Ok(b),
                        None => state_zeros(p),
                    })
                    .collect::<Result<Vec<_>>>()?;
                state[gi][idx] = Some(bufs);
            }
        }
        let new_steps = steps
            .iter()
            .map(|s| {
                if s.is_empty() {
                    Ok(None)
                } else {
                    Tensor::from_vec(s.clone(), Shape::new(vec![s.len()]), self.device).map(Some)
                }
            })
            .collect::<Result<Vec<_>>>()?;
        if let Some(ms) = &self.masters {
            for (gi, idx, v) in &masters {
                ms.restore(*gi, *idx, v)?;
            }
        }
        for (g, c) in self.groups.iter_mut().zip(configs) {
            g.config = c;
        }
        for gi in 0..self.groups.len() {
            self.sync_hyper(gi)?;
        }
        self.state = state;
        self.steps = new_steps;
        self.base_lrs = base_lrs;
        self.generation += 1;
        Ok(scalars)
    }
}
