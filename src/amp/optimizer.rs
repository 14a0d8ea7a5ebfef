//! [`AmpOptimizer`]: the optimizer wrapped by [`initialize`](super::initialize()), with the
//! scaled backward ([`scale_loss`] and kin), the unscale + overflow check, the skip-or-step and
//! the update of the loss scalers ([`ScalerSet`]) that the optimizers of one `initialize` call
//! share.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::error::{Error, Result};
use crate::optim::{Optimizer, OptimizerState};
use crate::tensor::{DType, Device, Tensor, TensorId};

use super::autocast;
use super::fused;
use super::registry::unregister;
use super::scaler::{LossScaler, ScalerState, ScalerStats};

// ---- scalers shared by the optimizers of one initialize call -----------------------------------

/// The `num_losses` scalers of one `initialize` call, shared by its optimizers.
#[derive(Debug)]
pub struct ScalerSet {
    scalers: Vec<LossScaler>,
    /// Per scaler: the optimizers whose gradients it scaled since its last update; it updates
    /// when the last of them has stepped.
    waiting: Vec<BTreeSet<usize>>,
}

impl ScalerSet {
    pub(super) fn new(scalers: Vec<LossScaler>) -> Self {
        Self {
            waiting: vec![BTreeSet::new(); scalers.len()],
            scalers,
        }
    }
    pub fn len(&self) -> usize {
        self.scalers.len()
    }
    pub fn is_empty(&self) -> bool {
        self.scalers.is_empty()
    }
    pub fn get(&self, loss_id: usize) -> Option<&LossScaler> {
        self.scalers.get(loss_id)
    }
    pub fn iter(&self) -> impl Iterator<Item = &LossScaler> {
        self.scalers.iter()
    }
    fn scaler(&self, loss_id: usize) -> Result<&LossScaler> {
        let n = self.scalers.len();
        self.scalers.get(loss_id).ok_or_else(|| {
            Error::invalid_arg(
                "amp",
                "loss_id",
                loss_id,
                format!("a loss id in 0..{n} (the policy's num_losses)"),
            )
        })
    }
}

pub(super) type SharedScalers = Arc<Mutex<ScalerSet>>;

fn lock(s: &SharedScalers) -> MutexGuard<'_, ScalerSet> {
    s.lock().unwrap_or_else(|e| e.into_inner())
}

// ---- the wrapped optimizer ---------------------------------------------------------------------

/// An optimizer wrapped by [`initialize`](super::initialize()): scaled backward, unscale +
/// overflow check, the skip-or-step and the scale update.
pub struct AmpOptimizer<O: Optimizer> {
    inner: O,
    index: usize,
    scalers: SharedScalers,
    master_weights: bool,
    /// The scaler whose scale the current gradients carry.
    pending: Option<usize>,
    /// Scalers that scaled gradients of this optimizer since its last step.
    used: BTreeSet<usize>,
    /// Gradients set aside during a backward, so that its overflow check sees only the new
    /// ones (an overflow belongs to the loss that caused it, as in apex).
    stash: Vec<(Tensor, Tensor)>,
    /// Gradients in persistent buffers (see [`AmpOptimizer::set_persistent_grads`]).
    persistent: bool,
    /// Persistent mode: per parameter, the buffer that holds its gradient aside while a
    /// backward of another loss runs (made at first need, kept).
    stash_bufs: HashMap<TensorId, Tensor>,
    /// Persistent mode: parameters whose gradients are in `stash_bufs` now.
    stashed: Vec<Tensor>,
    clip: Option<f64>,
    device: Device,
    ids: Vec<TensorId>,
}

/// What `initialize` gives each [`AmpOptimizer`] it makes.
pub(super) struct OptimizerParts<O> {
    pub inner: O,
    /// Its place among the optimizers of its `initialize` call.
    pub index: usize,
    pub scalers: SharedScalers,
    pub master_weights: bool,
    pub device: Device,
    /// The optimizer's parameters (registered by `initialize`, unregistered on drop).
    pub ids: Vec<TensorId>,
}

/// The wrapped optimizer's state: the optimizer's own and the scalers' (apex's `amp.state_dict`).
#[derive(Clone, Debug)]
pub struct AmpOptimizerState {
    pub optimizer: OptimizerState,
    pub scalers: Vec<ScalerState>,
}

impl<O: Optimizer> Drop for AmpOptimizer<O> {
    fn drop(&mut self) {
        unregister(&self.ids);
    }
}

impl<O: Optimizer> AmpOptimizer<O> {
    pub(super) fn new(parts: OptimizerParts<O>) -> Self {
        Self {
            inner: parts.inner,
            index: parts.index,
            scalers: parts.scalers,
            master_weights: parts.master_weights,
            pending: None,
            used: BTreeSet::new(),
            stash: Vec::new(),
            persistent: false,
            stash_bufs: HashMap::new(),
            stashed: Vec::new(),
            clip: None,
            device: parts.device,
            ids: parts.ids,
        }
    }

    pub fn inner(&self) -> &O {
        &self.inner
    }
    /// The optimizer (for learning-rate schedules and the like).
    pub fn inner_mut(&mut self) -> &mut O {
        &mut self.inner
    }

    /// Keeps every gradient in a buffer of its own from now on (PyTorch's
    /// `zero_grad(set_to_none=False)`): `zero_grad` zeroes it in place and each backward adds
    /// into it, so a gradient's address never changes (what a captured CUDA graph needs; it also
    /// saves the per-step gradient allocations). Every trained parameter then takes part in each
    /// step, with a zero gradient if the loss did not reach it. A backward of the same loss
    /// checks the accumulated gradients for overflow (which also catches a sum that overflows);
    /// a backward of another loss sets the previous gradients aside in persistent buffers, as
    /// the default mode does with new ones. Off by default; `amp::CapturedStep` turns it on.
    pub fn set_persistent_grads(&mut self, on: bool) -> Result<()> {
        if self.pending.is_some() || !self.stashed.is_empty() {
            return Err(Error::invalid_arg(
                "AmpOptimizer::set_persistent_grads",
                "on",
                on,
                "a change between steps (after step(), before the next backward)",
            ));
        }
        self.persistent = on;
        Ok(())
    }

    pub fn persistent_grads(&self) -> bool {
        self.persistent
    }

    /// The device of the model's parameters.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The gradient-clipping norm set by [`AmpOptimizer::clip_grad_norm`].
    pub fn clip_max_norm(&self) -> Option<f64> {
        self.clip
    }

    /// Forgets a step that was recorded but never ran (a failed capture): the host-side
    /// bookkeeping of its backward passes goes back to the state between steps.
    pub(crate) fn abandon_step(&mut self) {
        let mut set = lock(&self.scalers);
        for w in set.waiting.iter_mut() {
            w.remove(&self.index);
        }
        drop(set);
        self.pending = None;
        self.used.clear();
        self.stash.clear();
        self.stashed.clear();
    }

    /// Scaled backward of loss 0: gradients accumulate, still scaled, over several calls until
    /// `step` unscales them once (apex's `delay_unscale`).
    pub fn backward(&mut self, loss: &Tensor) -> Result<()> {
        self.backward_with(0, loss)
    }

    /// Scaled backward of loss `loss_id` with that loss's scaler.
    pub fn backward_with(&mut self, loss_id: usize, loss: &Tensor) -> Result<()> {
        scale_loss_many(loss, loss_id, &mut [self], |s| s.backward())
    }

    /// Clips the unscaled gradients' global L2 norm to `max_norm` at each step (None: off).
    pub fn clip_grad_norm(&mut self, max_norm: Option<f64>) -> Result<()> {
        if let Some(m) = max_norm {
            if !(m.is_finite() && m > 0.0) {
                return Err(Error::invalid_arg(
                    "AmpOptimizer::clip_grad_norm",
                    "max_norm",
                    m,
                    "a finite value > 0",
                ));
            }
        }
        self.clip = max_norm;
        Ok(())
    }

    /// One step: unscale (× the clip coefficient when set) into the update, skipped exactly on
    /// overflow, then the update of every scaler that this step closes.
    pub fn step(&mut self) -> Result<()> {
        let _s = autocast::suspend();
        let _g = crate::no_grad();
        let mut set = lock(&self.scalers);
        let dev = self.device;
        // The scalers' flags: the one flag itself in the usual case of one loss, their sum
        // (non-zero iff any is) with several.
        let mut found: Option<Tensor> = None;
        for &id in &self.used {
            let f = set.scaler(id)?.found_inf();
            found = Some(match found {
                None => f.clone(),
                Some(acc) => acc.add(f)?,
            });
        }
        let found = match found {
            Some(f) => f,
            None => Tensor::scalar(0.0, DType::F32, dev)?,
        };
        let mut mult = match self.pending {
            Some(id) => set.scaler(id)?.inv_scale()?,
            None => Tensor::scalar(1.0, DType::F32, dev)?,
        };
        if let Some(max_norm) = self.clip {
            let grads: Vec<Tensor> = self
                .inner
                .params()
                .iter()
                .filter_map(|p| p.grad())
                .collect();
            mult = fused::clip_into(&grads, max_norm, mult, &found)?;
        }
        fused::step_scaled(&mut self.inner, &mult, &found)?;
        for id in std::mem::take(&mut self.used) {
            set.waiting[id].remove(&self.index);
            if set.waiting[id].is_empty() {
                set.scalers[id].update()?;
            }
        }
        self.pending = None;
        Ok(())
    }

    /// Drops every gradient (the model's and the masters'); with persistent gradients, zeroes
    /// them in place instead.
    pub fn zero_grad(&mut self) -> Result<()> {
        if self.persistent {
            let _g = crate::no_grad();
            crate::multi_tensor::zero_grads_in_place(&self.inner.params())?;
        } else {
            self.inner.zero_grad();
        }
        // Only real masters: without them `master_params` are the model's parameters, whose
        // persistent gradients were just zeroed and must keep their buffers.
        if self.master_weights {
            for m in fused::master_params(&self.inner) {
                m.zero_grad();
            }
        }
        Ok(())
    }

    /// The parameters the update runs on: the FP32 masters at O2, the model's otherwise.
    pub fn master_params(&self) -> Vec<Tensor> {
        if self.master_weights {
            fused::master_params(&self.inner)
        } else {
            self.inner.params()
        }
    }

    /// The scalers (shared with the other optimizers of the same `initialize` call).
    pub fn scalers(&self) -> MutexGuard<'_, ScalerSet> {
        lock(&self.scalers)
    }

    /// Every scaler's state read to the host (a synchronisation).
    pub fn stats(&self) -> Result<Vec<ScalerStats>> {
        lock(&self.scalers).iter().map(|s| s.stats()).collect()
    }

    pub fn state_dict(&self) -> Result<AmpOptimizerState> {
        Ok(AmpOptimizerState {
            optimizer: self.inner.state_dict()?,
            scalers: lock(&self.scalers)
                .iter()
                .map(|s| s.state())
                .collect::<Result<_>>()?,
        })
    }

    /// Restores the optimizer's state and the scalers'. Checked before anything changes.
    pub fn load_state_dict(&mut self, state: &AmpOptimizerState) -> Result<()> {
        let mut set = lock(&self.scalers);
        if state.scalers.len() != set.len() {
            return Err(Error::invalid_arg(
                "AmpOptimizer::load_state_dict",
                "scalers",
                format!("{} scaler states", state.scalers.len()),
                format!("{} (the policy's num_losses)", set.len()),
            ));
        }
        if let Some(bad) = state
            .scalers
            .iter()
            .find(|s| !(s.loss_scale.is_finite() && s.loss_scale > 0.0))
        {
            return Err(Error::invalid_arg(
                "AmpOptimizer::load_state_dict",
                "loss_scale",
                bad.loss_scale,
                "a finite scale > 0",
            ));
        }
        self.inner.load_state_dict(&state.optimizer)?;
        for (s, st) in set.scalers.iter_mut().zip(&state.scalers) {
            s.load_state(st)?;
        }
        drop(set);
        self.pending = None;
        self.used.clear();
        Ok(())
    }

    fn grads(&self) -> Vec<Tensor> {
        self.inner
            .params()
            .iter()
            .filter_map(|p| p.grad())
            .collect()
    }
}

/// What [`scale_loss_many`] needs of each optimizer it covers.
pub trait ScaledBackward {
    #[doc(hidden)]
    fn shared_scalers(&self) -> &Arc<Mutex<ScalerSet>>;
    /// Before a scaled backward of `loss_id`: gradients that carry another loss's scale are
    /// rescaled to this one's.
    #[doc(hidden)]
    fn before_backward(&mut self, set: &ScalerSet, loss_id: usize) -> Result<()>;
    /// After it: the overflow check into the loss's scaler.
    #[doc(hidden)]
    fn after_backward(&mut self, set: &mut ScalerSet, loss_id: usize) -> Result<()>;
    /// After a failed backward: the gradients set aside are put back.
    #[doc(hidden)]
    fn abort_backward(&mut self) -> Result<()>;
}

impl<O: Optimizer> ScaledBackward for AmpOptimizer<O> {
    fn shared_scalers(&self) -> &Arc<Mutex<ScalerSet>> {
        &self.scalers
    }

    fn before_backward(&mut self, set: &ScalerSet, loss_id: usize) -> Result<()> {
        let new = set.scaler(loss_id)?;
        let _g = crate::no_grad();
        let factor = match self.pending {
            Some(prev) if prev != loss_id => {
                Some(new.scale_tensor().div(set.scaler(prev)?.scale_tensor())?)
            }
            _ => None,
        };
        if self.persistent {
            self.pending = Some(loss_id);
            return self.stash_persistent(factor.as_ref());
        }
        self.stash.clear();
        // With one scaler and no rescale, gradients accumulate in place as in PyTorch: nothing
        // to attribute to another loss, and a data-parallel wrapper then averages the totals
        // (gradients set aside here would escape its averaging under `no_sync`).
        if set.len() == 1 && factor.is_none() {
            self.pending = Some(loss_id);
            return Ok(());
        }
        for p in self.inner.params() {
            if let Some(g) = p.grad() {
                let g = match &factor {
                    Some(f) => g.to_dtype(DType::F32)?.mul(f)?.to_dtype(g.dtype())?,
                    None => g,
                };
                p.set_grad(None);
                self.stash.push((p, g));
            }
        }
        self.pending = Some(loss_id);
        Ok(())
    }

    fn after_backward(&mut self, set: &mut ScalerSet, loss_id: usize) -> Result<()> {
        set.scaler(loss_id)?.check(&self.grads())?;
        self.used.insert(loss_id);
        set.waiting[loss_id].insert(self.index);
        self.abort_backward()
    }

    fn abort_backward(&mut self) -> Result<()> {
        let _g = crate::no_grad();
        if self.persistent {
            // The gradients set aside are added back in place.
            for p in std::mem::take(&mut self.stashed) {
                if let (Some(g), Some(b)) = (p.grad(), self.stash_bufs.get(&p.id())) {
                    g.add_in_place(b)?;
                }
            }
            return Ok(());
        }
        for (p, old) in std::mem::take(&mut self.stash) {
            let total = match p.grad() {
                Some(new) => old.add(&new)?,
                None => old,
            };
            p.set_grad(Some(total));
        }
        Ok(())
    }
}

impl<O: Optimizer> AmpOptimizer<O> {
    /// Persistent mode, before a backward: when the gradients carry another loss's scale
    /// (`factor` = new scale / old scale), they move, rescaled, into their stash buffers and the
    /// gradient buffers are zeroed, so the backward's overflow check sees only its own
    /// gradients; `abort_backward` adds them back. Every buffer keeps its address.
    fn stash_persistent(&mut self, factor: Option<&Tensor>) -> Result<()> {
        self.stashed.clear();
        let Some(f) = factor else { return Ok(()) };
        for p in self.inner.params() {
            let Some(g) = p.grad() else { continue };
            let buf = match self.stash_bufs.get(&p.id()) {
                Some(b) => b.clone(),
                None => {
                    let b = Tensor::zeros(g.shape().clone(), g.dtype(), g.device())?;
                    self.stash_bufs.insert(p.id(), b.clone());
                    b
                }
            };
            let rescaled = g.to_dtype(DType::F32)?.mul(f)?.to_dtype(g.dtype())?;
            buf.copy_in_place(&rescaled)?;
            g.zero_in_place()?;
            self.stashed.push(p);
        }
        Ok(())
    }
}

/// apex's `with amp.scale_loss(loss, opt) as s: s.backward()`: `f` receives the scaled loss of
/// loss 0 (and normally calls `backward` on it).
pub fn scale_loss<O: Optimizer>(
    loss: &Tensor,
    opt: &mut AmpOptimizer<O>,
    f: impl FnOnce(&Tensor) -> Result<()>,
) -> Result<()> {
    scale_loss_many(loss, 0, &mut [opt], f)
}

/// [`scale_loss`] with the scaler of loss `loss_id`.
pub fn scale_loss_id<O: Optimizer>(
    loss: &Tensor,
    loss_id: usize,
    opt: &mut AmpOptimizer<O>,
    f: impl FnOnce(&Tensor) -> Result<()>,
) -> Result<()> {
    scale_loss_many(loss, loss_id, &mut [opt], f)
}

/// [`scale_loss`] over several optimizers (of one `initialize` call) whose parameters the loss
/// reaches, apex's `amp.scale_loss(loss, [opt0, opt1], loss_id=...)`.
pub fn scale_loss_many(
    loss: &Tensor,
    loss_id: usize,
    opts: &mut [&mut dyn ScaledBackward],
    f: impl FnOnce(&Tensor) -> Result<()>,
) -> Result<()> {
    let Some(first) = opts.first() else {
        return Err(Error::invalid_arg(
            "amp::scale_loss",
            "optimizers",
            "none",
            "at least one optimizer",
        ));
    };
    let shared = first.shared_scalers().clone();
    if opts
        .iter()
        .any(|o| !Arc::ptr_eq(o.shared_scalers(), &shared))
    {
        return Err(Error::invalid_arg(
            "amp::scale_loss",
            "optimizers",
            "optimizers from different amp::initialize calls",
            "optimizers returned by one initialize call (they share the loss scalers)",
        ));
    }
    let scaled = {
        let set = lock(&shared);
        for o in opts.iter_mut() {
            o.before_backward(&set, loss_id)?;
        }
        set.scaler(loss_id)?.scale_loss(loss)?
    };
    let r = f(&scaled);
    autocast::clear_cache();
    let mut set = lock(&shared);
    for o in opts.iter_mut() {
        match &r {
            Ok(()) => o.after_backward(&mut set, loss_id)?,
            // The gradients set aside go back; those of the failed backward count as seen.
            Err(_) => o.abort_backward()?,
        }
    }
    r
}
