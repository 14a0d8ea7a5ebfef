//! `CapturedStep`: a whole AMP training step (forward, scaled backward, unscale and overflow
//! check, optional gradient clipping, the fused optimizer step and the loss-scale update)
//! captured once into a CUDA graph and replayed with one launch per step.
//!
//! ```no_run
//! # use mixprec::{amp, nn::{self, Module}, optim::{self, Optimizer}, Device, Tensor};
//! # fn main() -> mixprec::Result<()> {
//! # let dev = Device::cuda(0)?;
//! # let batches: Vec<(Tensor, Tensor)> = Vec::new();
//! let model = nn::ResNet::cifar_style(&[1, 1], 1, 10, &dev)?;
//! let opt = optim::Sgd::new(model.parameters(), optim::SgdConfig { lr: 0.1, momentum: 0.9, ..Default::default() })?;
//! let (model, mut opt) = amp::initialize(model, opt, amp::Policy::opt_level(amp::OptLevel::O2))?;
//! let mut step = amp::CapturedStep::new(&model, &mut opt, |x, y| nn::cross_entropy(&model.forward(x)?, y))?;
//! for (i, (x, y)) in batches.iter().enumerate() {
//!     step.optimizer().inner_mut().set_lr_all(0.1 / (1.0 + i as f64))?; // read on the device
//!     let loss = step.run(x, y)?;            // one training step; no host synchronisation
//!     if i % 100 == 0 {
//!         println!("loss {}", loss.item()?); // a read only when asked
//!     }
//! }
//! # Ok(()) }
//! ```
//!
//! Each [`CapturedStep::run`] is exactly one training step. The first `warmup_steps` run
//! eagerly (they choose cuDNN plans, build the multi-tensor tables, make the optimizer state and
//! the persistent gradients), the next one captures the step and replays it, and every later one
//! only copies the batch into the static input buffers and replays. The eager and the replayed
//! steps run the same kernels on the same values, so a captured run is bitwise the eager run.
//!
//! What a replay cannot see is handled rather than baked in: the learning rate and every other
//! hyperparameter are read by the kernels from device memory (`set_lr` between steps is
//! followed); the loss scale, overflow flag, skip decision and step counters already live on
//! the device; a change of the optimizer's configuration or of a module's train/eval mode makes
//! the next run warm up and capture again; a tensor the graph uses that is replaced (a restored
//! state, `set_data`) does too. Anything the step does that cannot be captured is an
//! [`Error::Capture`] naming the op, at capture time.

use crate::error::{Error, Result};
use crate::graph::{self, Graph};
use crate::nn::Module;
use crate::optim::Optimizer;
use crate::tensor::{DType, Device, Tensor};

use super::autocast;
use super::optimizer::AmpOptimizer;

/// The body of a step: the loss of one batch (`x`, `y` are the step's static input buffers).
type Body<'a> = Box<dyn FnMut(&Tensor, &Tensor) -> Result<Tensor> + 'a>;

/// What a step was captured for: when it changes, the graph no longer describes the step.
#[derive(Clone, Debug, PartialEq)]
struct CaptureKey {
    /// Every module's train/eval flag, in visiting order.
    training: Vec<bool>,
    /// The optimizer's [`Optimizer::generation`].
    generation: u64,
    /// The clip setting's bits.
    clip: Option<u64>,
}

/// How the steps of a [`CapturedStep`] ran so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepStats {
    /// Steps run eagerly (warm-up, or all of them without capture).
    pub eager: u64,
    /// Graphs captured (1 unless something forced a new capture).
    pub captures: u64,
    /// Steps run by replaying the graph.
    pub replays: u64,
}

/// A training step captured into a CUDA graph (see the module docs).
pub struct CapturedStep<'a, O: Optimizer> {
    model: &'a dyn Module,
    opt: &'a mut AmpOptimizer<O>,
    body: Body<'a>,
    device: Device,
    capture: bool,
    warmup: usize,
    micro_batches: usize,
    /// Warm-up steps left before the next capture.
    eager_left: usize,
    /// The static input buffers, one `(x, y)` per micro-batch.
    inputs: Vec<(Tensor, Tensor)>,
    /// The static loss (F32): the step's loss (summed over micro-batches).
    loss: Option<Tensor>,
    graph: Option<Graph>,
    key: Option<CaptureKey>,
    stats: StepStats,
    persistent_before: bool,
}

impl<'a, O: Optimizer> CapturedStep<'a, O> {
    /// A step of `opt` over `model` whose loss `body` computes from a batch, captured into a
    /// CUDA graph after the warm-up steps. The optimizer keeps its gradients in persistent
    /// buffers from now on (see [`AmpOptimizer::set_persistent_grads`]). An error on a CPU
    /// model: CUDA graphs need a GPU (use [`CapturedStep::eager`] there, the same loop run
    /// eagerly).
    pub fn new(
        model: &'a dyn Module,
        opt: &'a mut AmpOptimizer<O>,
        body: impl FnMut(&Tensor, &Tensor) -> Result<Tensor> + 'a,
    ) -> Result<Self> {
        let device = opt.device();
        if !device.is_cuda() {
            return Err(Error::Capture {
                op: "CapturedStep::new",
                detail: format!(
                    "the model is on {device}: CUDA graphs need a CUDA device \
                     (CapturedStep::eager runs the same steps without a graph)"
                ),
            });
        }
        Self::build(model, opt, Box::new(body), true)
    }

    /// The same step object run eagerly on any device, every step (no graph): the switch that
    /// turns capture off while the training loop keeps its shape.
    pub fn eager(
        model: &'a dyn Module,
        opt: &'a mut AmpOptimizer<O>,
        body: impl FnMut(&Tensor, &Tensor) -> Result<Tensor> + 'a,
    ) -> Result<Self> {
        Self::build(model, opt, Box::new(body), false)
    }

    fn build(
        model: &'a dyn Module,
        opt: &'a mut AmpOptimizer<O>,
        body: Body<'a>,
        capture: bool,
    ) -> Result<Self> {
        let persistent_before = opt.persistent_grads();
        opt.set_persistent_grads(true)?;
        Ok(CapturedStep {
            model,
            device: opt.device(),
            opt,
            body,
            capture,
            warmup: 2,
            micro_batches: 1,
            eager_left: 2,
            inputs: Vec::new(),
            loss: None,
            graph: None,
            key: None,
            stats: StepStats::default(),
            persistent_before,
        })
    }

    /// Eager steps before the (first, or a new) capture; at least 1 (default 2: the first
    /// builds state and chooses plans, the second runs as every later step will).
    pub fn warmup_steps(mut self, n: usize) -> Result<Self> {
        if n == 0 {
            return Err(Error::invalid_arg(
                "CapturedStep::warmup_steps",
                "n",
                n,
                "at least 1 (a capture records work: it needs the state a real step makes)",
            ));
        }
        self.warmup = n;
        self.eager_left = n;
        Ok(self)
    }

    /// Gradient accumulation: each step runs `k` micro-batches (forward and scaled backward
    /// each, the gradients adding up) before one optimizer step; [`CapturedStep::run_accumulated`]
    /// takes the `k` batches. Set before the first run.
    pub fn micro_batches(mut self, k: usize) -> Result<Self> {
        if k == 0 {
            return Err(Error::invalid_arg(
                "CapturedStep::micro_batches",
                "k",
                k,
                "at least 1",
            ));
        }
        self.micro_batches = k;
        Ok(self)
    }

    /// The wrapped optimizer: set learning rates here between steps (the kernels read them on
    /// the device). A change of its configuration makes the next run capture again.
    pub fn optimizer(&mut self) -> &mut AmpOptimizer<O> {
        self.opt
    }

    /// Whether steps are captured (false for [`CapturedStep::eager`]).
    pub fn captures(&self) -> bool {
        self.capture
    }

    /// How many steps ran eagerly and by replay, and how many captures there were.
    pub fn stats(&self) -> StepStats {
        self.stats
    }

    /// The captured graph's nodes by kind, once a step was captured (`None` before, or when
    /// the step runs eagerly).
    pub fn graph_nodes(&self) -> Result<Option<crate::backend::cuda::GraphNodes>> {
        self.graph.as_ref().map(Graph::nodes).transpose()
    }

    /// The static loss buffer (after a run: that step's loss), if a step ran.
    pub fn loss(&self) -> Option<&Tensor> {
        self.loss.as_ref()
    }

    /// One training step on batch (`x`, `y`) (any device; copied into the static input buffers,
    /// which have the first batch's shape and dtype). Returns the static loss buffer: the
    /// step's loss, F32, on the device; read it (`item()`) when you need it, before the next run
    /// overwrites it.
    pub fn run(&mut self, x: &Tensor, y: &Tensor) -> Result<Tensor> {
        self.run_accumulated(&[(x.clone(), y.clone())])
    }

    /// One training step over `micro_batches` batches (see [`CapturedStep::micro_batches`]);
    /// the returned loss is the sum of the body's losses.
    pub fn run_accumulated(&mut self, batches: &[(Tensor, Tensor)]) -> Result<Tensor> {
        let op = "CapturedStep::run";
        if batches.len() != self.micro_batches {
            return Err(Error::invalid_arg(
                op,
                "batches",
                format!("{} batches", batches.len()),
                format!(
                    "{} (the step's micro_batches; run takes one batch, run_accumulated k)",
                    self.micro_batches
                ),
            ));
        }
        self.load_inputs(batches)?;
        // Casts cached by eager work since the last step would be of old weights.
        autocast::clear_cache();
        if !self.capture {
            self.step_body()?;
            self.stats.eager += 1;
            return self.static_loss();
        }
        let key = self.key_now();
        if let Some(g) = &self.graph {
            let changed = self.key.as_ref() != Some(&key);
            if g.is_stale() || changed {
                log::info!(
                    "CapturedStep: {}; warming up and capturing again",
                    if changed {
                        "the optimizer's config or a module's train/eval mode changed"
                    } else {
                        "tensors the graph used were replaced"
                    }
                );
                self.graph = None;
                self.eager_left = self.warmup;
            }
        }
        if self.graph.is_none() {
            if self.eager_left > 0 {
                self.step_body()?;
                self.eager_left -= 1;
                self.stats.eager += 1;
                return self.static_loss();
            }
            let captured = graph::capture(self.device, || self.step_body());
            let g = match captured {
                Ok(g) => g,
                Err(e) => {
                    // Nothing ran; the host-side state of the half-recorded step is dropped.
                    self.opt.abandon_step();
                    return Err(e);
                }
            };
            self.graph = Some(g);
            self.key = Some(key);
            self.stats.captures += 1;
        }
        let g = self.graph.as_mut().ok_or_else(|| Error::Capture {
            op,
            detail: "no graph after capture".into(),
        })?;
        g.launch()?;
        self.stats.replays += 1;
        self.static_loss()
    }

    fn static_loss(&self) -> Result<Tensor> {
        self.loss
            .as_ref()
            .map(Tensor::detach)
            .ok_or_else(|| Error::Capture {
                op: "CapturedStep::run",
                detail: "no loss buffer after a step".into(),
            })
    }

    /// Copies the batches into the static input buffers (made from the first batches).
    fn load_inputs(&mut self, batches: &[(Tensor, Tensor)]) -> Result<()> {
        let op = "CapturedStep::run";
        let _g = crate::no_grad();
        let dev = self.device;
        let on_dev = |t: &Tensor| -> Result<Tensor> {
            let t = t.detach();
            if t.device() == dev {
                Ok(t)
            } else {
                t.to_device(dev)
            }
        };
        if self.inputs.is_empty() {
            for (x, y) in batches {
                let (x, y) = (on_dev(x)?, on_dev(y)?);
                // Buffers of their own, in the batch's layout.
                self.inputs.push((x.owned()?, y.owned()?));
            }
            return Ok(());
        }
        for (i, ((x, y), (sx, sy))) in batches.iter().zip(&self.inputs).enumerate() {
            for (name, t, s) in [("x", x, sx), ("y", y, sy)] {
                if t.shape() != s.shape() || t.dtype() != s.dtype() {
                    return Err(Error::invalid_arg(
                        op,
                        name,
                        format!("batch {i}: {} {:?}", t.dtype(), t.dims()),
                        format!(
                            "{} {:?}, the static input's (a captured step has fixed shapes: \
                             drop the last partial batch, or run it with another step object)",
                            s.dtype(),
                            s.dims()
                        ),
                    ));
                }
                s.copy_in_place(&on_dev(t)?)?;
            }
        }
        Ok(())
    }

    /// The step itself, eager or under capture: zero the gradients, forward and scaled backward
    /// per micro-batch (the loss into the static buffer), the optimizer step.
    fn step_body(&mut self) -> Result<()> {
        let op = "CapturedStep::run";
        self.opt.zero_grad()?;
        for i in 0..self.micro_batches {
            let (x, y) = self.inputs[i].clone();
            let loss = (self.body)(&x, &y)?;
            if loss.elem_count() != 1 || !loss.dtype().is_float() {
                return Err(Error::invalid_arg(
                    op,
                    "loss",
                    format!("a {} tensor of shape {:?}", loss.dtype(), loss.dims()),
                    "a single float value (the step's body returns the loss)",
                ));
            }
            self.opt.backward(&loss)?;
            let _g = crate::no_grad();
            let l = loss
                .detach()
                .reshape(Vec::<usize>::new())?
                .to_dtype(DType::F32)?;
            drop(loss);
            match &self.loss {
                Some(s) if i == 0 => s.copy_in_place(&l)?,
                Some(s) => s.add_in_place(&l)?,
                None => self.loss = Some(l.owned()?),
            }
        }
        self.opt.step()
    }

    fn key_now(&self) -> CaptureKey {
        let mut training = Vec::new();
        collect_training(self.model, &mut training);
        CaptureKey {
            training,
            generation: self.opt.inner().generation(),
            clip: self.opt.clip_max_norm().map(f64::to_bits),
        }
    }
}

impl<O: Optimizer> Drop for CapturedStep<'_, O> {
    fn drop(&mut self) {
        // The graph goes first (it pins the buffers); the optimizer keeps its gradients.
        self.graph = None;
        let _ = self.opt.set_persistent_grads(self.persistent_before);
    }
}

fn collect_training(m: &dyn Module, out: &mut Vec<bool>) {
    out.push(m.is_training());
    m.visit_children(&mut |_, c| collect_training(c, out));
}
