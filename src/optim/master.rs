//! `MasterWeights`: the FP32 master copies of an optimizer's parameters (amp O2), one object
//! with one owner. The optimizer makes it once (`use_master_weights`, from the parameters' FP32
//! values, before the model is cast to half) and is the only one that writes it: each step updates
//! the masters in place and writes the rounded values into the model's half parameters in the
//! same pass. The AMP model holds the same `Arc` read-only, for its FP32 `state_dict`.
//!
//! A master tensor keeps its buffer for its whole life: a restore copies into it
//! ([`MasterWeights::restore`]) instead of replacing it, so every holder, every cached
//! multi-tensor table and every captured CUDA graph keeps pointing at the current values, and
//! nothing has to be republished.

use std::collections::HashMap;

use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor, TensorId};

#[derive(Debug)]
pub struct MasterWeights {
    /// Per group, per parameter: the FP32 master.
    groups: Vec<Vec<Tensor>>,
    /// The model parameter each master belongs to → (group, index).
    index: HashMap<TensorId, (usize, usize)>,
}

impl MasterWeights {
    /// FP32 copies of `params` (per group), sharing nothing with them; `op` names the optimizer
    /// in errors (F64 parameters have no masters).
    pub(crate) fn new(op: &'static str, params: &[&[Tensor]]) -> Result<MasterWeights> {
        let mut groups = Vec::with_capacity(params.len());
        let mut index = HashMap::new();
        for (gi, g) in params.iter().enumerate() {
            let mut v = Vec::with_capacity(g.len());
            for (idx, p) in g.iter().enumerate() {
                if p.dtype() == DType::F64 {
                    return Err(Error::invalid_arg(
                        op,
                        "use_master_weights",
                        format!("group {gi} parameter {idx} of dtype f64"),
                        "F32/F16/BF16 parameters (masters are FP32)",
                    ));
                }
                v.push(super::owned_copy(p, DType::F32)?);
                index.insert(p.id(), (gi, idx));
            }
            groups.push(v);
        }
        Ok(MasterWeights { groups, index })
    }

    /// The master of model parameter `param`, if it has one here.
    pub fn get(&self, param: TensorId) -> Option<&Tensor> {
        self.index
            .get(&param)
            .map(|&(gi, idx)| &self.groups[gi][idx])
    }

    /// The master of parameter `idx` of group `gi`.
    pub(crate) fn at(&self, gi: usize, idx: usize) -> &Tensor {
        &self.groups[gi][idx]
    }

    /// Every master, in group order (the optimizer's `params()` order).
    pub fn tensors(&self) -> Vec<Tensor> {
        self.groups.iter().flatten().cloned().collect()
    }

    pub fn len(&self) -> usize {
        self.index.len()
    }

    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// Copies `value` (any float dtype, the master's shape, any device) into the master of
    /// parameter `idx` of group `gi`, in place.
    pub(crate) fn restore(&self, gi: usize, idx: usize, value: &Tensor) -> Result<()> {
        let m = &self.groups[gi][idx];
        let v = value.detach().to_device(m.device())?.to_dtype(DType::F32)?;
        m.copy_in_place(&v)
    }

    /// Copies `value` into the master of model parameter `param` (no-op when it has none).
    pub(crate) fn restore_param(&self, param: TensorId, value: &Tensor) -> Result<()> {
        match self.index.get(&param) {
            Some(&(gi, idx)) => self.restore(gi, idx, value),
            None => Ok(()),
        }
    }
}
