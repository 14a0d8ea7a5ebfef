//! Kernel fusion: a function of elementwise primitives and reductions, written once over
//! [`Var`]s, traced per input signature and run as generated kernels (CuPy's `fuse`).
//!
//! ```
//! use mixprec::{fuse, Device, Tensor};
//! // SwiGLU's gate: silu(a) · b, one kernel on a GPU, differentiable.
//! let swiglu = fuse("swiglu", |f, x| {
//!     let s = f.mul(x[0], f.sigmoid(x[0]));
//!     vec![f.mul(s, x[1])]
//! });
//! let a = Tensor::randn(vec![4, 8], 0.0, 1.0, 1, mixprec::DType::F32, Device::Cpu)?;
//! let b = Tensor::randn(vec![4, 8], 0.0, 1.0, 2, mixprec::DType::F32, Device::Cpu)?;
//! let y = swiglu.call1(&[&a, &b])?;
//! assert_eq!(y.dims(), &[4, 8]);
//! # Ok::<(), mixprec::Error>(())
//! ```
//!
//! - The body runs once per [`Signature`](ir::Signature) (inputs' dtypes and ranks, which dims
//!   are broadcast, the autocast state); sizes are symbolic, so a new batch size reuses it.
//! - Lower-rank inputs broadcast against the others (aligned to the last dims); reductions
//!   ([`Fuser::sum`], `mean`, `max`, `min`, `var`) keep their reduced dims as size 1, so a
//!   reduced value broadcasts back (`x - mean(x)`), and a function may hold several.
//! - Dtypes follow the unfused ops (binary ops promote, scalars take the other operand's
//!   dtype); half values compute in f32 and are rounded only where stored (outputs) or cast.
//!   Under autocast the policy's casts of the matching unfused ops are traced in.
//! - The CPU interprets the graph (`cpu.rs`, the reference); CUDA runs kernels generated from
//!   it (`codegen/`), compiled by NVRTC through the kernel registry's disk cache, one per
//!   reduction level plus one for the elementwise outputs (`cuda.rs`).
//! - A call is differentiable: each output's backward is a graph generated from the trace
//!   (`autograd.rs`), fused and run the same way.

mod autograd;
mod codegen;
mod cpu;
mod cuda;
pub mod ir;
mod trace;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

pub use trace::{Fuser, Var};

use crate::base::error::{Error, Result};
use crate::tensor::{Device, Tensor};

/// A fused function's body: the inputs in, the outputs out.
pub type FusedBody = dyn Fn(&Fuser, &[Var]) -> Vec<Var> + Send + Sync;

/// What a run of a graph gives: its outputs, and each reduction's value (the item, and the
/// value in f32, f64 for f64 values, shaped as the item: what a backward takes instead of
/// recomputing it).
pub(crate) struct Ran {
    pub outputs: Vec<Tensor>,
    pub reductions: Vec<(ir::Value, Tensor)>,
}

/// A graph ready to run: its trace and its compiled kernels per CUDA device.
pub(crate) struct Compiled {
    pub(crate) graph: ir::Graph,
    cuda: Mutex<HashMap<usize, Arc<cuda::Program>>>,
}

impl Compiled {
    fn new(graph: ir::Graph) -> Compiled {
        Compiled {
            graph,
            cuda: Mutex::new(HashMap::new()),
        }
    }

    /// Runs the graph on `xs` (one device).
    fn run(&self, xs: &[&Tensor]) -> Result<Ran> {
        let sizes = trace::domain(&self.graph.sig, xs)?;
        let _off = crate::autograd::no_grad();
        match xs.first().map(|x| x.device()).unwrap_or(Device::Cpu) {
            Device::Cpu => cpu::run(&self.graph, xs, &sizes),
            Device::Cuda(ordinal) => {
                let program = {
                    let mut progs = self.cuda.lock().unwrap_or_else(|e| e.into_inner());
                    match progs.get(&ordinal) {
                        Some(p) => p.clone(),
                        None => {
                            let p = Arc::new(cuda::Program::build(&self.graph, ordinal)?);
                            progs.insert(ordinal, p.clone());
                            p
                        }
                    }
                };
                program.run(&self.graph, xs, &sizes)
            }
        }
    }
}

/// An output's backward graph, for each of its outputs the input it is the gradient of, and the
/// forward reductions it takes after the gradient (`None`: no input's gradient depends on the
/// output).
type BackwardOf = Arc<Option<(Compiled, Vec<usize>, Vec<ir::Value>)>>;

/// One traced signature: the forward and, made at the first backward, each output's backward.
struct Traced {
    forward: Compiled,
    backward: Mutex<HashMap<usize, BackwardOf>>,
}

impl Traced {
    fn backward(&self, out: usize) -> Result<BackwardOf> {
        if out >= self.forward.graph.outputs.len() {
            return Err(Error::invalid_arg(
                "fuse",
                "output",
                out,
                format!(
                    "an output of {} (it has {})",
                    self.forward.graph.name,
                    self.forward.graph.outputs.len()
                ),
            ));
        }
        let mut bw = self.backward.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(b) = bw.get(&out) {
            return Ok(b.clone());
        }
        let b = Arc::new(
            autograd::backward_graph(&self.forward.graph, out)?
                .map(|b| (Compiled::new(b.graph), b.grads_of, b.saved)),
        );
        bw.insert(out, b.clone());
        Ok(b)
    }
}

/// A fused function (see the [module docs](self)): call it on tensors with [`Fused::call`].
pub struct Fused {
    name: &'static str,
    body: Arc<FusedBody>,
    traces: Mutex<HashMap<ir::Signature, Arc<Traced>>>,
}

/// A fused function named `name` (in errors and the generated kernels' names) whose body
/// records its computation on a [`Fuser`].
pub fn fuse(
    name: &'static str,
    body: impl Fn(&Fuser, &[Var]) -> Vec<Var> + Send + Sync + 'static,
) -> Fused {
    Fused {
        name,
        body: Arc::new(body),
        traces: Mutex::new(HashMap::new()),
    }
}

impl Fused {
    /// The trace for `xs`' signature, traced now if it is new.
    fn traced(&self, xs: &[&Tensor]) -> Result<Arc<Traced>> {
        let sig = trace::signature(self.name, xs)?;
        let mut traces = self.traces.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(t) = traces.get(&sig) {
            return Ok(t.clone());
        }
        let f = Fuser::new(self.name, sig.clone());
        let outs = (self.body)(&f, &f.inputs());
        let t = Arc::new(Traced {
            forward: Compiled::new(f.finish(&outs)?),
            backward: Mutex::new(HashMap::new()),
        });
        traces.insert(sig, t.clone());
        Ok(t)
    }

    /// The graph traced for `xs` (what a call on them runs).
    pub fn graph(&self, xs: &[&Tensor]) -> Result<ir::Graph> {
        Ok(self.traced(xs)?.forward.graph.clone())
    }

    /// The CUDA C source generated for `xs`' signature: the module's name, its source (after
    /// kernels/common.cuh) and how many kernels a call launches. Needs no GPU.
    pub fn cuda_source(&self, xs: &[&Tensor]) -> Result<(String, String, usize)> {
        Ok(cuda::source(&self.traced(xs)?.forward.graph))
    }

    /// [`Fused::cuda_source`] of the backward of output `out` (`None`: no input's gradient
    /// depends on it).
    pub fn cuda_backward_source(
        &self,
        xs: &[&Tensor],
        out: usize,
    ) -> Result<Option<(String, String, usize)>> {
        let t = self.traced(xs)?;
        Ok(t.backward(out)?
            .as_ref()
            .as_ref()
            .map(|(b, _, _)| cuda::source(&b.graph)))
    }

    /// How many signatures have been traced.
    pub fn traces(&self) -> usize {
        self.traces.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Runs the function on `xs`, returning its outputs; differentiable in every input.
    pub fn call(&self, xs: &[&Tensor]) -> Result<Vec<Tensor>> {
        let t = self.traced(xs)?;
        let ran = t.forward.run(xs)?;
        let outs = ran.outputs;
        if !crate::autograd::is_grad_enabled() || !xs.iter().any(|x| x.requires_grad()) {
            return Ok(outs);
        }
        let saved: Vec<Tensor> = xs.iter().map(|x| x.detach()).collect();
        let reductions = Arc::new(ran.reductions);
        let name = self.name;
        Ok(outs
            .iter()
            .enumerate()
            .map(|(k, y)| {
                let (t, saved, reductions) = (t.clone(), saved.clone(), reductions.clone());
                crate::autograd::custom_function(self.name, xs, y, move |g| {
                    let n = saved.len();
                    let mut grads = vec![None; n];
                    if let Some((bw, grads_of, taken)) = t.backward(k)?.as_ref() {
                        let mut ins: Vec<&Tensor> = saved.iter().collect();
                        ins.push(g);
                        for v in taken {
                            let r = reductions.iter().find(|(u, _)| u == v).ok_or_else(|| {
                                Error::invalid_arg(
                                    "fuse",
                                    "backward",
                                    name,
                                    "the forward call kept every reduction its backward takes",
                                )
                            })?;
                            ins.push(&r.1);
                        }
                        for (gx, &i) in bw.run(&ins)?.outputs.into_iter().zip(grads_of) {
                            grads[i] = Some(gx);
                        }
                    }
                    Ok(grads)
                })
            })
            .collect())
    }

    /// [`Fused::call`] for a function with one output.
    pub fn call1(&self, xs: &[&Tensor]) -> Result<Tensor> {
        let mut outs = self.call(xs)?;
        if outs.len() != 1 {
            return Err(Error::invalid_arg(
                "fuse",
                "outputs",
                format!("{}: {} outputs", self.name, outs.len()),
                "call1 is for functions with one output (use call)",
            ));
        }
        Ok(outs.remove(0))
    }
}
