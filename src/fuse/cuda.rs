//! A traced graph on a CUDA device: its generated kernels (codegen.rs) compiled and loaded once
//! per device, and a call's launches: the compressed sizes and each buffer's strides and
//! address in one parameter block, the temporaries and outputs from the device's pool (graph
//! memory inside a capture, as every op's outputs), one launch per stage. No host read: a
//! call inside a captured step replays as its kernels.

use super::codegen::{self, compact_strides, Plan};
use super::ir::Graph;
use crate::backend::cuda::generated::{self, GeneratedModule};
use crate::backend::cuda::{CudaStorage, OpTimer};
use crate::base::error::{Error, Result};
use crate::base::DType;
use crate::tensor::storage::Storage;
use crate::tensor::{Shape, Tensor};

/// Threads per block of the outputs' kernel.
const MAP_THREADS: u32 = 256;

pub(crate) struct Program {
    plan: Plan,
    module: GeneratedModule,
}

impl Program {
    /// Generates `g`'s kernels and loads them on device `ordinal`.
    pub(crate) fn build(g: &Graph, ordinal: usize) -> Result<Program> {
        let plan = codegen::plan(g);
        let words = plan.rank()
            + (g.sig.inputs.len() + plan.temps.len() + g.outputs.len()) * (plan.rank() + 1);
        // The driver takes at most 4 KiB of kernel parameters on every architecture we run.
        if words * 8 > 4096 {
            return Err(Error::invalid_arg(
                "fuse",
                "function",
                format!(
                    "{}: {} inputs, {} reductions, {} outputs over {} dims",
                    g.name,
                    g.sig.inputs.len(),
                    plan.temps.len(),
                    g.outputs.len(),
                    plan.rank()
                ),
                "fewer buffers: a kernel's parameter block (8 bytes per size, stride and address) \
                 holds at most 4 KiB",
            ));
        }
        let kernels: Vec<String> = plan.stages.iter().map(|s| s.kernel.clone()).collect();
        let module = generated::load(ordinal, &plan.name, &plan.source, &kernels)?;
        Ok(Program { plan, module })
    }

    /// Runs the kernels on `xs` (on this program's device) over a domain of `sizes`.
    pub(crate) fn run(&self, g: &Graph, xs: &[&Tensor], sizes: &[usize]) -> Result<Vec<Tensor>> {
        let dev = self.module.device().clone();
        let _timer = OpTimer::start(&dev, "fuse", || g.name.to_string());
        let plan = &self.plan;
        let rank = plan.rank();
        let csizes: Vec<usize> = plan
            .groups
            .iter()
            .map(|&(lo, hi)| sizes[lo..hi].iter().product())
            .collect();
        // Dense inputs: a merged dim's stride is its innermost dim's.
        let dense: Vec<Tensor> = xs.iter().map(|x| x.contiguous()).collect::<Result<_>>()?;
        let mut buffers: Vec<(Vec<i64>, u64)> = Vec::new();
        let guards: Vec<_> = dense.iter().map(|x| x.storage()).collect();
        for (i, (x, s)) in dense.iter().zip(&guards).enumerate() {
            let Storage::Cuda(c) = &**s else {
                return Err(Error::DeviceMismatch {
                    op: "fuse",
                    lhs: xs[0].device(),
                    rhs: x.device(),
                });
            };
            let sig = &g.sig.inputs[i];
            let r = g.sig.rank;
            let mut st = vec![0i64; rank];
            let strides = x.layout().strides().to_vec();
            for (cd, &(_, hi)) in plan.groups.iter().enumerate() {
                let d = hi - 1;
                if sig.dims.has(d) {
                    st[cd] = strides[d - (r - x.rank())] as i64;
                }
            }
            buffers.push((st, c.ptr_at(&x.layout())?));
        }
        let mut temps = Vec::with_capacity(plan.temps.len());
        for t in &plan.temps {
            let n = t.dims.count(&csizes);
            let dt = if t.wide { DType::F64 } else { DType::F32 };
            let s = CudaStorage::alloc(&dev, dt, n)?;
            buffers.push((compact_strides(t.dims, &csizes, rank), s.ptr()));
            temps.push(s);
        }
        let mut outs = Vec::with_capacity(g.outputs.len());
        for (k, &o) in g.outputs.iter().enumerate() {
            let dims = plan.out_dims[k];
            let s = CudaStorage::alloc(&dev, g.items[o].dtype, dims.count(&csizes))?;
            buffers.push((compact_strides(dims, &csizes, rank), s.ptr()));
            outs.push(s);
        }
        let params = plan.params(&csizes, &buffers);
        for (k, stage) in plan.stages.iter().enumerate() {
            if stage.tasks.is_empty() {
                let most = plan
                    .out_dims
                    .iter()
                    .map(|d| d.count(&csizes))
                    .max()
                    .unwrap_or(0);
                let blocks = most
                    .div_ceil(MAP_THREADS as usize)
                    .clamp(1, dev.sm_count as usize * 16);
                self.module.launch(k, blocks as u32, MAP_THREADS, &params)?;
            } else {
                // A block per row; threads by the longest row.
                let mut rows = 0usize;
                let mut longest = 0usize;
                for &t in &stage.tasks {
                    let temp = &plan.temps[t];
                    rows += temp.dims.count(&csizes);
                    let a = match g.items[temp.item].node {
                        super::ir::Node::Reduce(_, a) => a,
                        _ => temp.item,
                    };
                    let red = Plan::compress(&plan.groups, g.items[a].dims).minus(temp.dims);
                    longest = longest.max(red.count(&csizes));
                }
                let threads = longest.next_power_of_two().clamp(32, 512) as u32;
                let blocks = rows.clamp(1, dev.sm_count as usize * 32);
                self.module.launch(k, blocks as u32, threads, &params)?;
            }
        }
        drop(guards);
        // The temporaries are freed in stream order, after the kernels that read them.
        drop(temps);
        Ok(outs
            .into_iter()
            .zip(&g.outputs)
            .map(|(s, &o)| Tensor::from_storage(Storage::Cuda(s), Shape::new(g.shape_of(o, sizes))))
            .collect())
    }
}

/// The CUDA source generated for `g` (what [`Program::build`] compiles).
pub(crate) fn source(g: &Graph) -> (String, String, usize) {
    let plan = codegen::plan(g);
    let n = plan.stages.len();
    (plan.name, plan.source, n)
}
