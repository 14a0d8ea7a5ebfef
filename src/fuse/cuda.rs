//! A traced graph on a CUDA device: its generated kernels (codegen/) compiled and loaded once
//! per device, and a call's launches: the compressed sizes, each buffer's strides and address
//! and how the reductions are cut in one parameter block; the temporaries, the reductions'
//! partials, their row counters (zeroed by a fill kernel) and the outputs from the device's pool
//! (graph memory inside a capture, as every op's outputs); one launch per stage. No host read:
//! a call inside a captured step replays as its kernels.

use std::sync::Arc;

use super::codegen::{self, compact_strides, Launch, Plan, MAX_THREADS, TILE, VEC};
use super::ir::Graph;
use super::Ran;
use crate::backend::cuda::generated::{self, GeneratedModule};
use crate::backend::cuda::{CudaDevice, CudaStorage, OpTimer};
use crate::base::error::{Error, Result};
use crate::base::DType;
use crate::tensor::storage::Storage;
use crate::tensor::{Shape, Tensor};

/// Threads per block of the outputs' kernel.
const MAP_THREADS: u32 = 256;

/// Waves of resident blocks a reduction level aims at: several, so that the last, partly
/// filled one is a small part of the time (the blocks of a level are about the same size).
const WAVES: usize = 4;

/// The fewest units (elements, or [`VEC`]-wide units) a reduction's thread takes per chunk:
/// below that, a row is not cut further (the partials' fold would cost more than it saves).
const MIN_UNITS_PER_THREAD: usize = 4;

pub(crate) struct Program {
    plan: Plan,
    module: GeneratedModule,
    /// Per stage: its blocks of [`MAP_THREADS`] resident on the whole device at once.
    resident: Vec<usize>,
}

impl Program {
    /// Generates `g`'s kernels and loads them on device `ordinal`.
    pub(crate) fn build(g: &Graph, ordinal: usize) -> Result<Program> {
        let plan = codegen::plan(g);
        let words = plan.words(g.sig.inputs.len() + plan.temps.len() + g.outputs.len());
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
        let sms = module.device().sm_count as usize;
        let resident = (0..kernels.len())
            .map(|k| Ok(module.blocks_per_sm(k, MAP_THREADS)? * sms))
            .collect::<Result<_>>()?;
        Ok(Program {
            plan,
            module,
            resident,
        })
    }

    /// Runs the kernels on `xs` (on this program's device) over a domain of `sizes`.
    pub(crate) fn run(&self, g: &Graph, xs: &[&Tensor], sizes: &[usize]) -> Result<Ran> {
        let dev = self.module.device().clone();
        let _timer = OpTimer::start(&dev, "fuse", || g.name.to_string());
        let plan = &self.plan;
        let csizes: Vec<usize> = plan
            .groups
            .iter()
            .map(|&(lo, hi)| sizes[lo..hi].iter().product())
            .collect();
        // Dense inputs: a merged dim's stride is its innermost dim's.
        let dense: Vec<Tensor> = xs.iter().map(|x| x.contiguous()).collect::<Result<_>>()?;
        let guards: Vec<_> = dense.iter().map(|x| x.storage()).collect();
        let mut buffers: Vec<(Vec<i64>, u64)> = Vec::new();
        for (i, (x, s)) in dense.iter().zip(&guards).enumerate() {
            let Storage::Cuda(c) = &**s else {
                return Err(Error::DeviceMismatch {
                    op: "fuse",
                    lhs: xs[0].device(),
                    rhs: x.device(),
                });
            };
            buffers.push((self.input_strides(g, i, x), c.ptr_at(&x.layout())?));
        }
        let (temps, outs) = self.alloc_results(&dev, g, &csizes, &mut buffers)?;
        let vec = self.vec_allowed(&csizes, &buffers);
        let mut cut = self.cut(&csizes, vec);
        let part = if cut.parts > 0 {
            Some(CudaStorage::alloc(&dev, DType::F64, cut.parts)?)
        } else {
            None
        };
        let count = if cut.counters > 0 {
            Some(CudaStorage::zeroed(&dev, DType::I64, cut.counters)?)
        } else {
            None
        };
        cut.launch.part = part.as_ref().map_or(0, |s| s.ptr());
        cut.launch.count = count.as_ref().map_or(0, |s| s.ptr());
        let params = plan.params(&csizes, &buffers, &cut.launch);
        for (k, &(blocks, threads)) in cut.shapes.iter().enumerate() {
            self.module.launch(k, blocks as u32, threads, &params)?;
        }
        drop(guards);
        // The partials and counters are freed in stream order, after the kernels that use them.
        drop((part, count));
        let tensor = |s: CudaStorage, v: usize| {
            Tensor::from_storage(Storage::Cuda(s), Shape::new(g.shape_of(v, sizes)))
        };
        Ok(Ran {
            outputs: outs
                .into_iter()
                .zip(&g.outputs)
                .map(|(s, &o)| tensor(s, o))
                .collect(),
            reductions: temps
                .into_iter()
                .zip(&plan.temps)
                .map(|(s, t)| (t.item, tensor(s, t.item)))
                .collect(),
        })
    }

    /// Input `i`'s strides over the compressed dims (0 where it is broadcast): a merged dim's
    /// is its innermost dim's (`x` is dense).
    fn input_strides(&self, g: &Graph, i: usize, x: &Tensor) -> Vec<i64> {
        let sig = &g.sig.inputs[i];
        let r = g.sig.rank;
        let mut st = vec![0i64; self.plan.rank()];
        let strides = x.layout().strides().to_vec();
        for (cd, &(_, hi)) in self.plan.groups.iter().enumerate() {
            let d = hi - 1;
            if sig.dims.has(d) {
                st[cd] = strides[d - (r - x.rank())] as i64;
            }
        }
        st
    }

    /// The temporaries and the outputs, compact, from the device's pool; their strides and
    /// addresses appended to `buffers` (after the inputs', in that order).
    fn alloc_results(
        &self,
        dev: &Arc<CudaDevice>,
        g: &Graph,
        csizes: &[usize],
        buffers: &mut Vec<(Vec<i64>, u64)>,
    ) -> Result<(Vec<CudaStorage>, Vec<CudaStorage>)> {
        let plan = &self.plan;
        let rank = plan.rank();
        let mut temps = Vec::with_capacity(plan.temps.len());
        for t in &plan.temps {
            let n = t.dims.count(csizes);
            let dt = if t.wide { DType::F64 } else { DType::F32 };
            let s = CudaStorage::alloc(dev, dt, n)?;
            buffers.push((compact_strides(t.dims, csizes, rank), s.ptr()));
            temps.push(s);
        }
        let mut outs = Vec::with_capacity(g.outputs.len());
        for (k, &o) in g.outputs.iter().enumerate() {
            let dims = plan.out_dims[k];
            let s = CudaStorage::alloc(dev, g.items[o].dtype, dims.count(csizes))?;
            buffers.push((compact_strides(dims, csizes, rank), s.ptr()));
            outs.push(s);
        }
        Ok((temps, outs))
    }

    /// Whether the VEC-wide paths may run: the innermost dim a multiple of VEC, every buffer
    /// that varies along it 16-byte aligned (dense, so each of its rows is too).
    fn vec_allowed(&self, csizes: &[usize], buffers: &[(Vec<i64>, u64)]) -> bool {
        self.plan.inner().is_some_and(|d| {
            csizes[d].is_multiple_of(VEC)
                && buffers
                    .iter()
                    .all(|(st, a)| st[d] == 0 || a.is_multiple_of(16))
        })
    }

    /// How a call over `csizes` is cut: each stage's blocks and threads, each set's chunks per
    /// row, and where each temporary's partials and each set's row counters lie.
    fn cut(&self, csizes: &[usize], vec: bool) -> Cut {
        let plan = &self.plan;
        let mut cut = Cut {
            launch: Launch {
                vec,
                part_at: vec![0; plan.temps.len()],
                ..Launch::default()
            },
            shapes: Vec::with_capacity(plan.stages.len()),
            parts: 0,
            counters: 0,
        };
        for (stage, &resident) in plan.stages.iter().zip(&self.resident) {
            let shape = if stage.sets.is_empty() {
                self.outputs_shape(csizes, vec, resident)
            } else {
                self.level_shape(&stage.sets, csizes, resident, &mut cut)
            };
            cut.shapes.push(shape);
        }
        cut
    }

    /// The outputs' kernel's blocks and threads.
    fn outputs_shape(&self, csizes: &[usize], vec: bool, resident: usize) -> (usize, u32) {
        let plan = &self.plan;
        let most = plan
            .out_dims
            .iter()
            .map(|d| {
                let n = d.count(csizes);
                let wide = vec && plan.inner().is_some_and(|i| d.has(i));
                if wide {
                    n / VEC
                } else {
                    n
                }
            })
            .max()
            .unwrap_or(0);
        // At most one wave: each thread's share of a grid-stride loop differs from
        // another's by one element at most, and no wave runs partly filled.
        let blocks = most.div_ceil(MAP_THREADS as usize).clamp(1, resident);
        (blocks, MAP_THREADS)
    }

    /// A reduction level's blocks and threads, its `sets` cut into `cut`.
    fn level_shape(
        &self,
        sets: &[usize],
        csizes: &[usize],
        resident: usize,
        cut: &mut Cut,
    ) -> (usize, u32) {
        let plan = &self.plan;
        let vec = cut.launch.vec;
        let sms = self.module.device().sm_count as usize;
        let units = |s: usize| {
            let set = &plan.sets[s];
            let n = set.red.count(csizes);
            if vec && set.inner {
                n / VEC
            } else {
                n
            }
        };
        // Threads by the longest row (a warp per unit of a row for a tile of rows side by
        // side); then each set's rows cut so that the level has about WAVES waves of
        // resident blocks, each thread (warp) taking at least MIN_UNITS_PER_THREAD units (a
        // batch norm of (32, 256, 56, 56) f16: 12 chunks of about 1,000 8-wide units per
        // channel where 6 or more blocks fit an SM).
        let threads = sets
            .iter()
            .map(|&s| {
                let u = units(s).max(1);
                if plan.sets[s].across {
                    u.saturating_mul(32)
                } else {
                    u
                }
            })
            .max()
            .unwrap_or(1)
            .next_power_of_two()
            .clamp(32, MAX_THREADS);
        let launch = &mut cut.launch;
        let mut jobs = 0usize;
        for &s in sets {
            let set = &plan.sets[s];
            let rows = set.kept.count(csizes).max(1);
            // Rows, or tiles of TILE rows, each cut into `per` chunks.
            let (lines, workers) = if set.across {
                (rows.div_ceil(TILE), threads / 32)
            } else {
                (rows, threads)
            };
            let most = (units(s) / (workers * MIN_UNITS_PER_THREAD)).max(1);
            let per = (resident * WAVES).div_ceil(lines).clamp(1, most);
            if launch.per.len() <= s {
                launch.per.resize(s + 1, 1);
                launch.count_at.resize(s + 1, 0);
            }
            launch.per[s] = per;
            if per > 1 {
                for &k in &set.tasks {
                    launch.part_at[k] = cut.parts;
                    cut.parts += rows * per;
                }
                launch.count_at[s] = cut.counters;
                cut.counters += lines;
            }
            jobs += lines * per;
        }
        (jobs.clamp(1, sms * 64), threads as u32)
    }
}

/// How a call is cut ([`Program::cut`]).
struct Cut {
    /// The call's words after the buffers (`part` and `count` filled in once allocated).
    launch: Launch,
    /// Per stage: blocks and threads per block.
    shapes: Vec<(usize, u32)>,
    /// 8-byte slots of partials, and row counters, the call needs.
    parts: usize,
    counters: usize,
}

/// The CUDA source generated for `g` (what [`Program::build`] compiles).
pub(crate) fn source(g: &Graph) -> (String, String, usize) {
    let plan = codegen::plan(g);
    let n = plan.stages.len();
    (plan.name, plan.source, n)
}
