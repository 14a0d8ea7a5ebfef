//! [`AmpModel`]: the model wrapped by [`initialize`](super::initialize()): it casts inputs and
//! outputs or enters autocast per the level, and its `state_dict` is FP32 at every level (at O2
//! the parameters' entries are the optimizers' FP32 masters).

use std::collections::HashMap;
use std::sync::Arc;

use crate::error::Result;
use crate::nn::module::{Module, StateDict, TensorInfo, TensorKind, TrainingFlag};
use crate::nn::BatchNorm2d;
use crate::optim::MasterWeights;
use crate::tensor::{DType, Tensor, TensorId};

use super::autocast;
use super::policy::Properties;
use super::registry::unregister;

/// O2: the FP32 master of `param` in one of the optimizers' [`MasterWeights`] (each optimizer
/// owns its masters; the models read them).
fn master_of(masters: &[Arc<MasterWeights>], param: TensorId) -> Option<&Tensor> {
    masters.iter().find_map(|m| m.get(param))
}

/// A model wrapped by [`initialize`](super::initialize()): casts inputs/outputs or enters
/// autocast per the level.
pub struct AmpModel<M: Module> {
    inner: M,
    props: Properties,
    /// O2: the optimizers' masters (read-only here: the optimizers own and update them).
    masters: Vec<Arc<MasterWeights>>,
    ids: Vec<TensorId>,
}

impl<M: Module> AmpModel<M> {
    /// The wrapper (`initialize` registers `ids`, the model's tensors, which `drop` unregisters).
    pub(super) fn new(
        inner: M,
        props: Properties,
        masters: Vec<Arc<MasterWeights>>,
        ids: Vec<TensorId>,
    ) -> Self {
        Self {
            inner,
            props,
            masters,
            ids,
        }
    }
    pub fn inner(&self) -> &M {
        &self.inner
    }
    pub fn properties(&self) -> &Properties {
        &self.props
    }

    /// Runs `f` on the inner model under this level's rules, for work that is not `forward`:
    /// inside an autocast scope at O1; as it is at the other levels, with no cast of inputs or
    /// outputs. A language model computes its loss this way (`amp_model.scope(|m|
    /// m.loss(&x, &y))`), so that its half logits go straight into the cross-entropy instead of
    /// being copied to f32 as `forward`'s output cast at O2 would.
    pub fn scope<R>(&self, f: impl FnOnce(&M) -> Result<R>) -> Result<R> {
        if self.props.autocast {
            let _g = autocast::autocast(self.props.half_dtype)?;
            return f(&self.inner);
        }
        f(&self.inner)
    }
}

impl<M: Module> Drop for AmpModel<M> {
    fn drop(&mut self) {
        unregister(&self.ids);
    }
}

impl<M: Module> Module for AmpModel<M> {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if self.props.autocast {
            let _g = autocast::autocast(self.props.half_dtype)?;
            return self.inner.forward(x);
        }
        match self.props.cast_model_type {
            Some(t) if t.is_half() => {
                let x = if x.dtype().is_float() {
                    x.to_dtype(t)?
                } else {
                    x.clone()
                };
                let y = self.inner.forward(&x)?;
                if y.dtype().is_half() {
                    y.to_dtype(DType::F32)
                } else {
                    Ok(y)
                }
            }
            Some(DType::F32) if x.dtype().is_half() => self.inner.forward(&x.to_dtype(DType::F32)?),
            _ => self.inner.forward(x),
        }
    }
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&TensorInfo)) {
        self.inner.visit(prefix, f)
    }
    fn visit_own(&self, f: &mut dyn FnMut(&TensorInfo)) {
        self.inner.visit_own(f)
    }
    fn visit_children(&self, f: &mut dyn FnMut(&str, &dyn Module)) {
        self.inner.visit_children(f)
    }
    fn training_flag(&self) -> Option<&TrainingFlag> {
        self.inner.training_flag()
    }
    fn as_batch_norm(&self) -> Option<&BatchNorm2d> {
        self.inner.as_batch_norm()
    }
    fn set_training(&self, training: bool) {
        self.inner.set_training(training)
    }
    fn is_training(&self) -> bool {
        self.inner.is_training()
    }

    /// FP32 at every level; at O2 the parameters' entries are their FP32 masters.
    fn state_dict(&self) -> Result<StateDict> {
        let mut sd = self.inner.state_dict()?;
        if self.masters.is_empty() {
            return Ok(sd);
        }
        let mut ids = HashMap::new();
        self.inner.visit("", &mut |i| {
            ids.insert(i.name.to_string(), i.tensor.id());
        });
        for (name, t) in sd.iter_mut() {
            if let Some(m) = ids.get(name).and_then(|id| master_of(&self.masters, *id)) {
                *t = crate::optim::owned_copy(m, DType::F32)?;
            }
        }
        Ok(sd)
    }

    /// Loads into the model (values converted to each tensor's dtype) and, at O2, the FP32
    /// values into the masters too.
    fn load_state_dict(&self, entries: &[(String, Tensor)]) -> Result<()> {
        self.inner.load_state_dict(entries)?;
        if self.masters.is_empty() {
            return Ok(());
        }
        let mut params = Vec::new();
        self.inner.visit("", &mut |i| {
            if i.kind == TensorKind::Parameter {
                params.push((i.name.to_string(), i.tensor.id()));
            }
        });
        let given: HashMap<&str, &Tensor> = entries.iter().map(|(n, t)| (n.as_str(), t)).collect();
        let _g = crate::no_grad();
        for (name, id) in params {
            if let Some(src) = given.get(name.as_str()) {
                for m in &self.masters {
                    m.restore_param(id, src)?;
                }
            }
        }
        Ok(())
    }
}
