//! What a convolution plan is: the settings a plan is chosen under (read from the environment,
//! with the workspace limit), the directions, a chosen plan and what runs it, and [`run`], which
//! runs one direction through its plan (choosing it on first use).

use std::ffi::c_void;

use cudarc::cudnn::result as dnn;
use cudarc::driver::DevicePtr;

use super::conv_cache::{CacheUse, Choice};
use super::conv_direct::DirectWgrad;
use super::cudnn::{dnn_err, dnn_state, lock_dnn};
use super::cudnn_graph::{EngineRules, GraphPlan};
use super::cudnn_legacy::{LegacyAlgo, LegacyConv};
use super::device::{allow_tf32, cuda_err, deterministic, env_on, CudaDevice};
use super::side_stream;
use super::storage::CudaStorage;
use crate::backend::{BackendStorage, Conv2dParams};
use crate::base::error::{Error, Result};
use crate::base::DType;

/// The most workspace one plan may need by default, and the least the limit goes down to when
/// free memory is short.
pub(super) const WORKSPACE_CAP: usize = 2 << 30;
pub(super) const WORKSPACE_FLOOR: usize = 64 << 20;

/// Which cuDNN API's candidates compete (`MIXPREC_CUDNN_API`): both (the default), or only one
/// (`graph`: the legacy API still covers what no graph engine supports; `legacy`: never the
/// graph API).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Api {
    Fastest,
    Graph,
    Legacy,
}

/// Whether our own kernels (`conv_direct.rs`) compete (`MIXPREC_CONV_DIRECT`): yes (the
/// default), no (`0`), or alone where one applies (`only`: for tests and comparisons).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Direct {
    On,
    Off,
    Only,
}

/// The settings a plan is chosen under, read from the environment at each choice.
pub(super) struct Settings {
    pub(super) api: Api,
    pub(super) direct: Direct,
    /// Candidates are timed (`MIXPREC_CUDNN_FIND` is not 0).
    pub(super) timed: bool,
    pub(super) rules: EngineRules,
    /// The most workspace a candidate may need.
    pub(super) limit: usize,
    pub(super) cache: CacheUse,
}

impl Settings {
    pub(super) fn now(dev: &CudaDevice, dtype: DType) -> Settings {
        let api = match std::env::var("MIXPREC_CUDNN_API").as_deref() {
            Ok("graph") => Api::Graph,
            Ok("legacy") => Api::Legacy,
            _ => Api::Fastest,
        };
        let timed = std::env::var("MIXPREC_CUDNN_FIND").map_or(true, |v| v != "0");
        let direct = match std::env::var("MIXPREC_CONV_DIRECT").as_deref() {
            Ok("0") | Ok("off") => Direct::Off,
            Ok("only") => Direct::Only,
            _ => Direct::On,
        };
        Settings {
            api,
            direct,
            timed,
            rules: EngineRules {
                dtype,
                tf32: allow_tf32(),
                deterministic: deterministic(),
                runtime_compiled: env_on("MIXPREC_CUDNN_RUNTIME_COMPILED"),
            },
            limit: workspace_limit(dev),
            cache: if timed {
                CacheUse::from_env()
            } else {
                CacheUse::Off
            },
        }
    }

    /// The rules part of a plan-cache key: what else decides a choice.
    pub(super) fn label(&self) -> String {
        format!(
            "api {:?} direct {:?} runtime-compiled {} deterministic {}",
            self.api, self.direct, self.rules.runtime_compiled, self.rules.deterministic
        )
    }
}

/// `MIXPREC_CUDNN_WORKSPACE_MB` if set, else a quarter of the free device memory within
/// [`WORKSPACE_FLOOR`, `WORKSPACE_CAP`].
pub(super) fn workspace_limit(dev: &CudaDevice) -> usize {
    if let Ok(v) = std::env::var("MIXPREC_CUDNN_WORKSPACE_MB") {
        match v.trim().parse::<usize>() {
            Ok(mb) => return mb.saturating_mul(1 << 20),
            Err(e) => log::warn!(
                "MIXPREC_CUDNN_WORKSPACE_MB={v:?} is not a number of MiB ({e}); using the default"
            ),
        }
    }
    let free = dev
        .ctx
        .bind_to_thread()
        .ok()
        .and_then(|_| cudarc::driver::result::mem_get_info().ok())
        .map_or(WORKSPACE_CAP, |(free, _)| free / 4);
    free.clamp(WORKSPACE_FLOOR, WORKSPACE_CAP)
}

/// Which convolution runs, with its buffers in cuDNN's argument order: forward (x, w) -> y,
/// backward-data (dy, w) -> dx, backward-filter (dy, x) -> dw; backward-data-add (dy, w) ->
/// dx += the data gradient (cuDNN's beta = 1: a residual network's input gradient arrives in
/// two parts, and the second is added as it is written instead of by an add over both).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum Dir {
    Forward,
    BackwardData,
    BackwardFilter,
    BackwardDataAdd,
}

impl Dir {
    pub(super) fn name(self) -> &'static str {
        match self {
            Dir::Forward => "forward",
            Dir::BackwardData => "backward-data",
            Dir::BackwardFilter => "backward-filter",
            Dir::BackwardDataAdd => "backward-data-add",
        }
    }

    /// cuDNN's beta: what the output's prior values are scaled by before the result is added.
    pub(super) fn beta(self) -> f64 {
        match self {
            Dir::BackwardDataAdd => 1.0,
            _ => 0.0,
        }
    }
}

/// How a plan was chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PlanSource {
    /// Its candidates were timed in this process.
    Timed,
    /// Rebuilt from the plan cache on disk (timed by an earlier process), no timing runs.
    Cache,
    /// cuDNN's heuristic first choice, untimed (`MIXPREC_CUDNN_FIND=0`).
    Heuristic,
}

/// What is known of how a plan was chosen.
#[derive(Clone, Copy, Debug)]
pub(super) struct Record {
    pub(super) source: PlanSource,
    pub(super) time_ms: Option<f32>,
    /// Wall time spent choosing it (building candidates, timing them, or rebuilding it from the
    /// plan cache), ms.
    pub(super) choice_ms: f64,
    pub(super) graph_candidates: usize,
    pub(super) legacy_candidates: usize,
    pub(super) graph_timed: usize,
    pub(super) legacy_timed: usize,
}

/// What runs for one (geometry, dtype, direction).
pub(super) enum Runner {
    Graph(GraphPlan),
    Legacy { conv: LegacyConv, algo: LegacyAlgo },
    Direct(DirectWgrad),
}

/// A chosen plan.
pub(super) struct Plan {
    pub(super) runner: Runner,
    pub(super) record: Record,
}

impl Plan {
    pub(super) fn workspace(&self) -> usize {
        match &self.runner {
            Runner::Graph(g) => g.candidate.workspace,
            Runner::Legacy { algo, .. } => algo.workspace,
            Runner::Direct(d) => d.workspace(),
        }
    }

    /// What runs: the graph engine with its notes, or the legacy algorithm.
    pub(super) fn describe(&self) -> String {
        match &self.runner {
            Runner::Graph(g) => format!("{:?}", g.candidate),
            Runner::Legacy { algo, .. } => algo.describe(),
            Runner::Direct(d) => d.describe(),
        }
    }

    /// What the plan cache records of it (None: it cannot be rebuilt from a record).
    pub(super) fn choice(&self) -> Option<Choice> {
        match &self.runner {
            Runner::Graph(g) => Some(Choice::Graph {
                engine: g.candidate.engine,
                knobs: g.candidate.knobs.clone()?,
            }),
            Runner::Legacy { algo, .. } => Some(Choice::Legacy {
                algo: algo.algo.code(),
                math: algo.math_code(),
            }),
            Runner::Direct(d) => Some(Choice::Direct {
                kernel: d.describe(),
            }),
        }
    }
}

/// The key of a plan in memory: geometry (with its memory format), dtype, direction, TF32,
/// determinism.
pub(super) type PlanKey = (Conv2dParams, DType, Dir, bool, bool);

/// Runs one convolution direction: `a`, `b` are the two inputs in cuDNN's argument order and the
/// output has `out_len` elements.
pub(super) fn run(
    dev: &std::sync::Arc<CudaDevice>,
    dir: Dir,
    p: &Conv2dParams,
    dtype: DType,
    a: &CudaStorage,
    b: &CudaStorage,
    out_len: usize,
) -> Result<CudaStorage> {
    let out = CudaStorage::alloc(dev, dtype, out_len)?;
    if out_len > 0 && (a.is_empty() || b.is_empty()) {
        super::cast::fill(&out, 0.0)?;
        return Ok(out);
    }
    run_into(dev, dir, p, dtype, a, b, &out)?;
    Ok(out)
}

/// [`run`] into `out`: written, or added to for [`Dir::BackwardDataAdd`]. The caller has checked
/// the sizes; empty operands leave `out` as it is.
pub(super) fn run_into(
    dev: &std::sync::Arc<CudaDevice>,
    dir: Dir,
    p: &Conv2dParams,
    dtype: DType,
    a: &CudaStorage,
    b: &CudaStorage,
    out: &CudaStorage,
) -> Result<()> {
    if out.is_empty() || a.is_empty() || b.is_empty() {
        return Ok(());
    }
    let mut guard = lock_dnn(dev, "conv2d")?;
    let dnn_state = dnn_state(&mut guard)?;
    // What a capture cannot record (the timed plan search, workspace growth) must have
    // happened in a warm-up step.
    let first_use = |what: String| {
        super::graph::refuse(
            dev.ordinal,
            "conv2d",
            &format!("{what} during capture: run a warm-up step of the same shapes first"),
        )
    };
    let ptrs = [a.ptr(), b.ptr(), out.ptr()].map(|p| p as *mut c_void);
    let key = (*p, dtype, dir, allow_tf32(), deterministic());
    let beside = side_stream::is_beside(dev.ordinal);
    if !dnn_state.plans.contains_key(&key) {
        first_use(format!("choosing the {dir:?} {dtype} plan for {p:?}"))?;
        // Plans are timed on the main stream on these buffers, with scratch of the main
        // stream: beside, both streams are waited for first (the output was allocated on the
        // side stream) and after.
        if beside {
            side_stream::synchronize_both(dev)?;
        }
        let started = std::time::Instant::now();
        // The timer runs every candidate several times: an output that is added to is timed
        // in a scratch buffer of its size (zeros), so that the real one is added to once.
        let scratch = if dir == Dir::BackwardDataAdd {
            let s = CudaStorage::alloc(dev, dtype, out.len())?;
            super::cast::fill(&s, 0.0)?;
            Some(s)
        } else {
            None
        };
        let timed_ptrs = match &scratch {
            Some(s) => [ptrs[0], ptrs[1], s.ptr() as *mut c_void],
            None => ptrs,
        };
        let mut plan =
            side_stream::on_main(|| dnn_state.make_plan(dev, p, dtype, dir, timed_ptrs))?;
        drop(scratch);
        if beside {
            side_stream::synchronize_both(dev)?;
        }
        plan.record.choice_ms = started.elapsed().as_secs_f64() * 1e3;
        log::debug!(
            "{dir:?} {dtype} {p:?}: {} ({:?}, {:.1} ms to choose)",
            plan.describe(),
            plan.record.source,
            plan.record.choice_ms
        );
        dnn_state.plans.insert(key, plan);
    }
    let ws_needed = dnn_state.plans.get(&key).map_or(0, Plan::workspace);
    let workspace = if beside {
        &mut dnn_state.side_workspace
    } else {
        &mut dnn_state.workspace
    };
    let have = workspace.as_ref().map_or(0, |w| w.len());
    if ws_needed > have {
        first_use(format!("growing the workspace to {ws_needed} bytes"))?;
        // Let go of first (the old buffer is too small for anything from now on), unless a
        // captured graph still uses it: the graph then keeps it while it lives.
        if let Some(old) = workspace.take() {
            // Freed on the stream that used it last: beside, that is the side stream, whose
            // earlier work the main stream may not have waited for yet.
            if let Some(old) = super::graph::retire(dev.ordinal, old) {
                side_stream::free(dev.ordinal, old);
            }
        }
        // cuDNN owns the workspace contents.
        let ws = side_stream::alloc(dev, ws_needed).map_err(|e| {
            cuda_err(
                &format!("allocating {ws_needed} bytes of cuDNN workspace"),
                e,
            )
        })?;
        *workspace = Some(ws);
    }
    let (ws_ptr, ws_len) = match workspace {
        Some(w) => (w.device_ptr(&dev.stream).0 as *mut c_void, w.len()),
        None => (std::ptr::null_mut(), 0),
    };
    let h = dnn_state.handle;
    dev.ctx
        .bind_to_thread()
        .map_err(|e| cuda_err("binding the context", e))?;
    // The handle runs on the main stream; beside, on the side stream for this call only.
    let set_stream = |s: cudarc::driver::sys::CUstream| {
        // SAFETY: a live handle and a stream of its device.
        unsafe { dnn::set_stream(h, s as _) }.map_err(|e| dnn_err("cudnnSetStream", e))
    };
    if beside {
        set_stream(side_stream::current(dev))?;
    }
    let ran = match dnn_state.plans.get(&key).map(|plan| &plan.runner) {
        Some(Runner::Graph(g)) => g.execute(h, ptrs, ws_ptr),
        Some(Runner::Legacy { conv, algo }) => conv.execute(h, algo, ptrs, ws_ptr, ws_len),
        Some(Runner::Direct(d)) => d.execute(dev, ptrs, ws_ptr),
        None => Err(Error::Cuda("cuDNN plan cache".into())),
    };
    if beside {
        set_stream(dev.stream.cu_stream())?;
    }
    ran.map_err(|e| Error::Cuda(format!("{dir:?} convolution ({dtype}, {p:?}): {e}")))
}
