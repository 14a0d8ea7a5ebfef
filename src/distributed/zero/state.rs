//! The sharded optimizer as an [`Optimizer`]: the step, its state as the unsharded optimizer
//! saves it (a collective gather) and its load at any world size.

use super::*;

impl<O: ShardableOptimizer> Optimizer for ShardedOptimizer<O> {
    fn step_scaled(&mut self, scaling: Option<GradScaling<'_>>) -> Result<()> {
        if let Some(sc) = &scaling {
            for (what, t) in [
                ("grad_multiplier", sc.grad_multiplier),
                ("found_inf", sc.found_inf),
            ] {
                if t.dtype() != DType::F32 || t.elem_count() != 1 || t.device() != self.device {
                    return Err(Error::invalid_arg(
                        O::NAME,
                        what,
                        format!(
                            "a {} tensor of shape {:?} on {}",
                            t.dtype(),
                            t.dims(),
                            t.device()
                        ),
                        format!("an F32 tensor of one element on {}", self.device),
                    ));
                }
            }
        }
        self.materialize()?;
        let _ng = crate::no_grad();
        self.buckets.finish()?;
        self.update(scaling)
    }

    fn use_master_weights(&mut self) -> Result<()> {
        if self.masters {
            return Ok(());
        }
        if self.sharded.is_some() {
            return Err(Error::Unsupported {
                op: O::NAME,
                detail: "master weights asked for after the first step or state load (amp \
                         asks before it casts the model)"
                    .into(),
            });
        }
        // The FP32 values now, before AMP casts the model: the share's masters are made from
        // them at the first step, when the cast dtypes fix the layout.
        let mut snap = Vec::new();
        for g in &self.groups {
            for p in &g.params {
                // One device-to-host copy per parameter (a route through f64 vectors cost a
                // 6.7B-parameter model a minute and a half of host time on each rank). On the
                // CPU a copy all the same: the cast to come replaces the buffer's contents.
                let v = p.detach().to_dtype(DType::F32)?;
                snap.push(match v.device() {
                    Device::Cpu => v.owned()?,
                    _ => v.to_device(Device::Cpu)?,
                });
            }
        }
        self.snapshot = Some(snap);
        self.masters = true;
        self.generation += 1;
        Ok(())
    }

    /// None: the masters are sharded; no rank has them all.
    fn master_weights(&self) -> Option<Arc<MasterWeights>> {
        None
    }

    /// This rank's pieces (the masters of its share at O2); before the first step at O2, the
    /// FP32 values the masters will be made from (host copies), else nothing.
    fn master_params(&self) -> Vec<Tensor> {
        match (&self.sharded, &self.snapshot) {
            (Some(s), _) => s.pieces.iter().map(|p| p.value.clone()).collect(),
            (None, Some(snap)) => snap.clone(),
            (None, None) => Vec::new(),
        }
    }

    fn generation(&self) -> u64 {
        self.generation
            + self
                .sharded
                .as_ref()
                .map_or(0, |s| s.inner.generation() << 32)
    }

    fn zero_grad(&mut self) {
        self.buckets.reset();
        for g in &self.groups {
            for p in &g.params {
                p.zero_grad();
            }
        }
        if let Some(s) = &self.sharded {
            for p in &s.pieces {
                p.value.zero_grad();
            }
        }
    }

    fn param_groups(&self) -> Vec<GroupView<'_>> {
        self.groups
            .iter()
            .zip(self.group_hyperparams())
            .map(|(g, hyperparams)| GroupView {
                params: &g.params,
                hyperparams,
            })
            .collect()
    }

    fn lr(&self) -> f64 {
        self.groups.first().map_or(0.0, |g| g.config.lr())
    }

    fn base_lrs(&self) -> Vec<f64> {
        self.base_lrs.clone()
    }

    fn set_lr(&mut self, group: usize, lr: f64) -> Result<()> {
        let n = self.groups.len();
        let Some(g) = self.groups.get_mut(group) else {
            return Err(Error::invalid_arg(
                O::NAME,
                "group",
                group,
                format!("a group index in 0..{n}"),
            ));
        };
        let c = O::with_lr(&g.config, lr)?;
        if let Some(s) = &mut self.sharded {
            s.inner.set_lr(group, lr)?;
        }
        g.config = c;
        Ok(())
    }

    /// The consolidated state, in the unsharded optimizer's layout (a plain optimizer over the
    /// same parameters loads it): a collective, every rank must call it (each gathers every
    /// share).
    fn state_dict(&self) -> Result<OptimizerState> {
        // `shard_tensors` needs the layout; a state dict before any step is the empty one.
        let Some(s) = &self.sharded else {
            return Ok(OptimizerState {
                state: BTreeMap::new(),
                param_groups: self.empty_groups(),
            });
        };
        let _ng = crate::no_grad();
        let shards = self.shards_of(s)?;
        let mut fulls = BTreeMap::new();
        for (name, t) in shards {
            let (fi, key) = split_name(&name)?;
            let full = Tensor::zeros([s.layout.flats[fi].padded], DType::F32, self.device)?;
            // Every rank's share, in rank order (`consolidate` puts it in flat order).
            self.group.all_gather_into(&t, &full)?;
            fulls.insert((fi, key), full);
        }
        consolidate(&s.layout, &fulls, self.group_hyperparams())
    }

    /// Loads a consolidated state (from [`Optimizer::state_dict`] of a sharded optimizer at any
    /// world size, or of the unsharded optimizer) and keeps this rank's share. No collective.
    fn load_state_dict(&mut self, saved: &OptimizerState) -> Result<()> {
        if saved.param_groups.len() != self.groups.len() {
            return Err(Error::invalid_arg(
                O::NAME,
                "param_groups",
                format!("{} groups", saved.param_groups.len()),
                format!("{} groups, as the optimizer has", self.groups.len()),
            ));
        }
        let mut configs = Vec::with_capacity(self.groups.len());
        let mut bases = Vec::with_capacity(self.groups.len());
        for (gi, (sg, g)) in saved.param_groups.iter().zip(&self.groups).enumerate() {
            if sg.params.len() != g.params.len() {
                return Err(Error::invalid_arg(
                    O::NAME,
                    "param_groups",
                    format!("group {gi} with {} parameters", sg.params.len()),
                    format!(
                        "{} parameters, as the optimizer's group has",
                        g.params.len()
                    ),
                ));
            }
            let mut h = sg.hyperparams.clone();
            let base = h.remove(INITIAL_LR);
            let c = O::from_hyperparams(&h)?;
            bases.push(base.unwrap_or(c.lr()));
            configs.push(c);
        }
        // Positions must be the usual 0.. across the groups, with shapes that match.
        let params = self.params_flat();
        for (gi, sg) in saved.param_groups.iter().enumerate() {
            let first: usize = saved.param_groups[..gi]
                .iter()
                .map(|g| g.params.len())
                .sum();
            for (k, &pos) in sg.params.iter().enumerate() {
                if pos != first + k {
                    return Err(Error::invalid_arg(
                        O::NAME,
                        "param_groups",
                        format!("group {gi} lists position {pos} at {k}"),
                        format!("positions in order across the groups ({})", first + k),
                    ));
                }
            }
        }
        for (&pos, entries) in &saved.state {
            let Some(p) = params.get(pos) else {
                return Err(Error::invalid_arg(
                    O::NAME,
                    "state",
                    format!("state for parameter position {pos}"),
                    format!("positions below {}", params.len()),
                ));
            };
            for (name, t) in entries {
                if t.elem_count() != p.elem_count() && t.elem_count() != 1 {
                    return Err(Error::shape_mismatch(
                        O::NAME,
                        p.shape(),
                        t.shape(),
                        format!("state `{name}` of parameter {pos}"),
                    ));
                }
            }
        }
        self.materialize()?;
        self.load_pieces(saved, configs.clone())?;
        for (g, c) in self.groups.iter_mut().zip(configs) {
            g.config = c;
        }
        self.base_lrs = bases;
        self.generation += 1;
        Ok(())
    }

    fn params(&self) -> Vec<Tensor> {
        self.params_flat()
    }
}

impl<O: ShardableOptimizer> ShardedOptimizer<O> {
    fn empty_groups(&self) -> Vec<GroupState> {
        let mut pos = 0;
        self.groups
            .iter()
            .zip(self.group_hyperparams())
            .map(|(g, hyperparams)| {
                let params = (pos..pos + g.params.len()).collect();
                pos += g.params.len();
                GroupState {
                    params,
                    hyperparams,
                }
            })
            .collect()
    }

    /// [`ShardedOptimizer::shard_tensors`] through a shared reference (state_dict's).
    pub(super) fn shards_of(&self, s: &Sharded<O>) -> Result<Vec<(String, Tensor)>> {
        let st = s.inner.state_dict()?;
        let mut out = Vec::new();
        for fi in 0..s.layout.flats.len() {
            let mut idx: Vec<usize> = (0..s.pieces.len())
                .filter(|&k| s.pieces[k].flat == fi)
                .collect();
            idx.sort_by_key(|&k| s.pieces[k].share_at);
            let mut names: Vec<String> = st
                .state
                .get(&idx[0])
                .map(|m| m.keys().cloned().collect())
                .unwrap_or_default();
            if self.masters {
                names.push(MASTER.to_string());
            }
            for name in names {
                let mut parts = Vec::with_capacity(idx.len());
                for &k in &idx {
                    let piece = &s.pieces[k];
                    let t = if name == MASTER {
                        piece.value.detach().to_dtype(DType::F32)?
                    } else {
                        let Some(e) = st.state.get(&k).and_then(|m| m.get(&name)) else {
                            return Err(Error::Unsupported {
                                op: O::NAME,
                                detail: format!(
                                    "state `{name}` exists for some pieces of the share and not \
                                     others (a parameter that never stepped?)"
                                ),
                            });
                        };
                        if name == STEP {
                            let v = e.to_vec_f32()?[0];
                            Tensor::from_vec(vec![v; piece.len], [piece.len], self.device)?
                        } else {
                            e.to_dtype(DType::F32)?
                                .reshape([piece.len])?
                                .to_device(self.device)?
                        }
                    };
                    parts.push(t);
                }
                let refs: Vec<&Tensor> = parts.iter().collect();
                out.push((format!("flat{fi}.{name}"), Tensor::cat(&refs, 0)?.owned()?));
            }
        }
        Ok(out)
    }
}

/// `flat{f}.{name}` → (f, name).
pub fn split_name(name: &str) -> Result<(usize, String)> {
    let bad = || {
        Error::invalid_arg(
            "zero checkpoint",
            "tensor name",
            name.to_string(),
            "flat{index}.{state name}",
        )
    };
    let rest = name.strip_prefix("flat").ok_or_else(bad)?;
    let (f, key) = rest.split_once('.').ok_or_else(bad)?;
    Ok((f.parse().map_err(|_| bad())?, key.to_string()))
}

/// The consolidated state (the unsharded layout) from whole flat buffers of state
/// (`fulls[(flat, name)]`, F32 `[padded]`, any device: every rank's share concatenated in rank
/// order) under `layout`, with the groups' hyperparameters.
pub fn consolidate(
    layout: &ZeroLayout,
    fulls: &BTreeMap<(usize, String), Tensor>,
    hyperparams: Vec<Hyperparams>,
) -> Result<OptimizerState> {
    let mut state: BTreeMap<usize, BTreeMap<String, Tensor>> = BTreeMap::new();
    for ((fi, name), full) in fulls {
        let f = layout.flats.get(*fi).ok_or_else(|| {
            Error::invalid_arg(
                "zero consolidate",
                "flat",
                fi,
                format!("a flat index below {}", layout.flats.len()),
            )
        })?;
        if full.elem_count() != f.padded {
            return Err(Error::invalid_arg(
                "zero consolidate",
                "state",
                format!("`{name}` of {} elements", full.elem_count()),
                format!("{} (flat {fi}'s padded length)", f.padded),
            ));
        }
        let full = f.flat_order(full, layout.world_size)?;
        let steps = if name == STEP {
            Some(full.to_vec_f32()?)
        } else {
            None
        };
        for fp in &f.params {
            let n: usize = fp.shape.iter().product();
            let t = match &steps {
                Some(v) => Tensor::scalar(f64::from(v[fp.offset]), DType::F32, Device::Cpu)?,
                None => full
                    .narrow(0, fp.offset, n)?
                    .reshape(fp.shape.clone())?
                    .owned()?,
            };
            state.entry(fp.index).or_default().insert(name.clone(), t);
        }
    }
    let param_groups = layout
        .groups
        .iter()
        .zip(hyperparams)
        .map(|(ids, hyperparams)| GroupState {
            params: ids.clone(),
            hyperparams,
        })
        .collect();
    Ok(OptimizerState {
        state,
        param_groups,
    })
}
