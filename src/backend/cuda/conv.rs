//! 2-D convolution through cuDNN (NCHW or NHWC, groups, dilation): forward, backward-data and
//! backward-filter. Each (geometry, memory format, dtype, direction, TF32 setting) gets a plan
//! chosen once, on the first call's own buffers, and kept with its workspace size.
//!
//! **One candidate list, one timer.** The candidates are the graph API's engine configurations
//! (`cudnn_graph.rs`: heuristic modes A and B, then the fallback list), the legacy API's algorithms
//! (`cudnn_legacy.rs`: `cudnnGet*Algorithm_v7`, each with its math type), every one that keeps the
//! dtype's numerical promise and needs at most the workspace limit, and our own kernel where it
//! applies (`conv_direct.rs`: the weight gradient of small channels_last filters, such as a
//! one-channel stem). All are timed the same way on the same buffers (`conv_tune.rs`: warm-up,
//! median of three, slow ones abandoned early, near-equals re-timed) and the fastest runs; among
//! candidates within 3% of it, the one with the least workspace. A candidate is not run at all
//! where a tenth of the best rate it reached in a long run on an earlier convolution of the same
//! direction, dtype and layout (`conv_tune::Rates`) would still make it slow: cuDNN's generic
//! engine 0, run on each of ResNet-50's convolutions and far slower than the best on every one, was
//! most of a new machine's first step.
//!
//! Why: inside a real ResNet-50 step (batch 256) the former choice lost by several times to the
//! legacy API's untimed heuristic choice (benches/RESULTS.md has the figures). The graph API's
//! candidates were capped at 256 MiB of workspace, and so was `cudnnFind*AlgorithmEx`'s scratch.
//! cuDNN's fast tensor-core kernels for NCHW operands run NHWC internally and transpose both
//! operands in the workspace: the sizes it asked for are x + y exactly (layer1's 1x1 64->256
//! forward: 102.8 + 411.0 MB = 513.8 MB; the 56x56 downsample's backward-data: dx 411.0 + dy
//! 205.5 MB = 616.6 MB; the stem, its 3 channels padded to 8: 205.5 + 411.0 MB). At batch 256 that
//! is over 256 MiB for every early-layer convolution, so the graph API was left with its generic
//! engine 0 on the strided 1x1 backward-data (hundreds of times slower than the best), cudnnFind
//! returned no candidate at all there (elsewhere one algorithm at most passed its filter: success,
//! the scratch size, and a math type equal to the descriptor's), and an untimed side lost by
//! default. channels_last operands need no such transposes. Now the limit is what PyTorch allows in
//! spirit (a generous cap: a quarter of the free device memory, at most 2 GiB;
//! `MIXPREC_CUDNN_WORKSPACE_MB` overrides), the legacy algorithms are timed by our own timer rather
//! than by cudnnFind (whose single run per candidate includes a first-launch warm-up, whose scratch
//! it cannot share with the graph API's timing, and whose results report no workspace-aware
//! tie-break), and nothing wins untimed while timing is on ([`conv_plans`] reports each plan's time
//! and how many candidates of each API were timed).
//!
//! Engines that compile kernels at run time (cuDNN's `RUNTIME_COMPILATION` note) stay out by
//! default: their compile happens when their plan is built, in every process and for every
//! shape, and the plan cache cannot carry it (it records the engine and its knobs; cuDNN
//! serialises compiled plans only experimentally). `MIXPREC_CUDNN_RUNTIME_COMPILED=1` admits
//! them, to measure whether they pay (see `benches/conv_choice.sh`).
//!
//! **The plan cache** (`conv_cache.rs`) keeps each choice on disk, so a second process rebuilds
//! its plans without timing anything.
//!
//! Environment: `MIXPREC_CUDNN_API=graph` or `=legacy` limits the candidates to one API (with
//! `graph`, the legacy API still covers what no graph engine supports); `MIXPREC_CONV_DIRECT=0`
//! leaves our own kernels out, `=only` runs them alone where they apply; `MIXPREC_CUDNN_FIND=0`
//! turns the timing (and the plan cache) off: the graph heuristics' first choice, else the
//! legacy one; `MIXPREC_CUDNN_PLAN_CACHE=DIR|0` and `MIXPREC_CUDNN_RETUNE=1` steer the cache;
//! `RUST_LOG=mixprec=debug` logs every candidate's time and the choice. The workspace is one
//! grow-only buffer per device.

use std::collections::HashMap;
use std::ffi::c_void;

use cudarc::cudnn::{result as dnn, sys as dsys};
use cudarc::driver::CudaSlice;

use super::conv_cache::{self, CacheUse, Choice, Entry};
use super::conv_direct::DirectWgrad;
use super::conv_plan::*;
use super::conv_tune::{tune, EventTimer, Outcome, Rates, Scratch, Tuning};
use super::cudnn_graph::{GraphCandidate, GraphConv, GraphPlan};
use super::cudnn_legacy::{LegacyAlgo, LegacyConv};
use super::device::{cuda_err, CudaDevice};
use super::storage::CudaStorage;
use crate::backend::ConvOps;
use crate::backend::{BackendStorage, Conv2dParams};
use crate::base::error::{Error, Result};
use crate::base::{DType, Layout, MemoryFormat};

pub(crate) struct Dnn {
    pub(super) handle: dsys::cudnnHandle_t,
    pub(super) workspace: Option<CudaSlice<u8>>,
    /// The workspace of convolutions run beside (`side_stream.rs`), which may run while one on
    /// the main stream uses the other.
    pub(super) side_workspace: Option<CudaSlice<u8>>,
    pub(super) plans: HashMap<PlanKey, Plan>,
    /// The GPU, driver and cuDNN, as the plan cache's keys name them.
    pub(super) device_id: String,
    /// Candidate runs timed so far (warm-ups included).
    pub(super) timing_runs: u64,
    /// The best rate (flops per ms) each candidate reached on a convolution timed so far, for
    /// the floors of later ones.
    pub(super) rates: Rates<RateKey>,
    /// Batch norm's cuDNN descriptors and choices (`batch_norm.rs`).
    pub(super) batch_norm: super::batch_norm_choice::BnChoices,
    /// Attention's cuDNN plans (`cudnn_attention.rs`).
    pub(super) attention: super::cudnn_attention::AttentionPlans,
}

// SAFETY: the handle and descriptors are only used under the device's `dnn` mutex.
unsafe impl Send for Dnn {}

impl Dnn {
    pub(super) fn handle(&self) -> dsys::cudnnHandle_t {
        self.handle
    }
}

impl Drop for Dnn {
    fn drop(&mut self) {
        self.plans.clear();
        self.batch_norm = Default::default();
        self.attention.clear();
        // SAFETY: created by cudnnCreate, destroyed once.
        let _ = unsafe { dnn::destroy_handle(self.handle) };
    }
}

pub(super) fn dnn_err(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::Cuda(format!("cuDNN {what}: {e:?}"))
}

/// A candidate of the unified list: the k-th graph configuration or legacy algorithm, or our
/// own kernel.
#[derive(Clone, Copy, Debug)]
enum Cand {
    Graph(usize),
    Legacy(usize),
    Direct,
}

/// What a candidate is across convolutions: the graph engine with its knob choices, the legacy
/// algorithm with its math type, or our kernel.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(super) enum CandId {
    Graph(i64, Option<Vec<(u32, i64)>>),
    Legacy(i64, i64),
    Direct,
}

/// Whose rate: direction, dtype, memory format, TF32, candidate.
pub(super) type RateKey = (Dir, DType, MemoryFormat, bool, CandId);

/// Multiply-adds times two: the same for the three directions.
fn flops(p: &Conv2dParams) -> f64 {
    let per_out = (p.c_in / p.groups.max(1)) * p.kh * p.kw;
    2.0 * (p.n * p.c_out * p.out_h() * p.out_w()) as f64 * per_out as f64
}

/// The convolution a plan is chosen for: the device, the geometry, dtype and direction, and
/// the first call's buffers in cuDNN's argument order (the output is overwritten).
struct ConvRun<'a> {
    dev: &'a CudaDevice,
    p: &'a Conv2dParams,
    dtype: DType,
    dir: Dir,
    ptrs: [*mut c_void; 3],
}

/// Every candidate of one convolution: the graph API's configurations and the legacy API's
/// algorithms (each with the object that runs them), and our own kernel where it applies.
struct Candidates {
    graph: Option<(GraphConv, Vec<GraphCandidate>)>,
    legacy: Option<(LegacyConv, Vec<LegacyAlgo>)>,
    direct: Option<DirectWgrad>,
    /// Forced onto our kernel where it applies (`MIXPREC_CONV_DIRECT=only`).
    only_direct: bool,
    /// Whether the graph / legacy API was asked (before `only_direct` left them out).
    used_graph: bool,
    used_legacy: bool,
}

impl Candidates {
    /// The candidates of the APIs asked for (the legacy API's only when it competes: both APIs,
    /// or the graph API has none); an API that has none for this convolution is logged.
    fn gather(
        h: dsys::cudnnHandle_t,
        c: &ConvRun<'_>,
        s: &Settings,
        use_graph: bool,
        use_legacy: bool,
    ) -> Candidates {
        let (p, dtype, dir) = (c.p, c.dtype, c.dir);
        let direct = match s.direct {
            Direct::Off => None,
            Direct::On | Direct::Only => DirectWgrad::new(c.dev, p, dtype, dir),
        };
        // Forced onto our kernel where it applies: cuDNN's candidates stay out.
        let only_direct = s.direct == Direct::Only && direct.is_some();
        let graph = (use_graph && !only_direct)
            .then(|| {
                let g = super::probe::no_panic("cuDNN graph API", || {
                    let conv = GraphConv::new(h, p, dtype, dir)?;
                    let (cands, skipped) = conv.candidates(h, s.rules, s.limit, !s.timed)?;
                    Ok((conv, cands, skipped))
                });
                match g {
                    Ok((conv, cands, skipped)) => {
                        if !skipped.is_empty() {
                            log::debug!(
                                "{dir:?} {dtype} {p:?}, graph configurations not candidates: {}",
                                skipped.join("; ")
                            );
                        }
                        Some((conv, cands))
                    }
                    Err(e) => {
                        log::debug!("{dir:?} {dtype} {p:?}: no graph-API candidates: {e}");
                        None
                    }
                }
            })
            .flatten();
        let graph_empty = graph.as_ref().is_none_or(|(_, g)| g.is_empty());
        let legacy = (use_legacy && !only_direct && (s.api != Api::Graph || graph_empty))
            .then(|| {
                let l = LegacyConv::new(p, dtype, dir, s.rules.tf32).and_then(|conv| {
                    let (algos, skipped) = conv.candidates(h, s.rules, s.limit)?;
                    Ok((conv, algos, skipped))
                });
                match l {
                    Ok((conv, algos, skipped)) => {
                        if !skipped.is_empty() {
                            log::debug!(
                                "{dir:?} {dtype} {p:?}, legacy algorithms not candidates: {}",
                                skipped.join("; ")
                            );
                        }
                        Some((conv, algos))
                    }
                    Err(e) => {
                        log::debug!("{dir:?} {dtype} {p:?}: no legacy-API candidates: {e}");
                        None
                    }
                }
            })
            .flatten();
        Candidates {
            graph,
            legacy,
            direct,
            only_direct,
            used_graph: use_graph && !only_direct,
            used_legacy: use_legacy && !only_direct,
        }
    }

    /// The untimed choice: our kernel when forced onto it, else the heuristics' first (the
    /// graph API's, else the legacy API's).
    fn heuristic_plan(self, record: Record) -> Option<Plan> {
        if let (true, Some(d)) = (self.only_direct, self.direct) {
            return Some(Plan {
                runner: Runner::Direct(d),
                record,
            });
        }
        match (self.graph, self.legacy) {
            (Some((conv, mut cands)), _) if !cands.is_empty() => Some(Plan {
                runner: Runner::Graph(GraphPlan {
                    candidate: cands.swap_remove(0),
                    conv,
                }),
                record,
            }),
            (_, Some((conv, algos))) if !algos.is_empty() => Some(Plan {
                runner: Runner::Legacy {
                    conv,
                    algo: algos[0],
                },
                record,
            }),
            _ => None,
        }
    }

    /// The workspace candidate `c` needs.
    fn workspace(&self, c: &Cand) -> usize {
        match *c {
            Cand::Graph(k) => self.graph.as_ref().map_or(0, |(_, g)| g[k].workspace),
            Cand::Legacy(k) => self.legacy.as_ref().map_or(0, |(_, a)| a[k].workspace),
            Cand::Direct => self.direct.as_ref().map_or(0, DirectWgrad::workspace),
        }
    }

    /// Candidate `c` in words, for the log.
    fn describe(&self, c: &Cand) -> String {
        match *c {
            Cand::Graph(k) => self
                .graph
                .as_ref()
                .map_or_else(String::new, |(_, g)| format!("{:?}", g[k])),
            Cand::Legacy(k) => self
                .legacy
                .as_ref()
                .map_or_else(String::new, |(_, a)| a[k].describe()),
            Cand::Direct => self
                .direct
                .as_ref()
                .map_or_else(String::new, DirectWgrad::describe),
        }
    }

    /// What candidate `c` is across convolutions (its rate's key).
    fn id(&self, c: &Cand) -> CandId {
        match (*c, &self.graph, &self.legacy) {
            (Cand::Graph(k), Some((_, g)), _) => CandId::Graph(g[k].engine, g[k].knobs.clone()),
            (Cand::Legacy(k), _, Some((_, a))) => {
                CandId::Legacy(a[k].algo.code(), a[k].math_code())
            }
            _ => CandId::Direct,
        }
    }

    /// What runs candidate `c`.
    fn into_runner(mut self, c: Cand) -> Result<Runner> {
        match (c, self.graph, self.legacy) {
            (Cand::Graph(k), Some((conv, mut cands)), _) => Ok(Runner::Graph(GraphPlan {
                candidate: cands.swap_remove(k),
                conv,
            })),
            (Cand::Legacy(k), _, Some((conv, algos))) => Ok(Runner::Legacy {
                conv,
                algo: algos[k],
            }),
            (Cand::Direct, _, _) => match self.direct.take() {
                Some(d) => Ok(Runner::Direct(d)),
                None => Err(Error::Cuda("cuDNN plan choice: candidate list".into())),
            },
            _ => Err(Error::Cuda("cuDNN plan choice: candidate list".into())),
        }
    }
}

impl Dnn {
    fn new(dev: &CudaDevice) -> Result<Dnn> {
        dev.ctx
            .bind_to_thread()
            .map_err(|e| cuda_err("binding the context", e))?;
        let handle = dnn::create_handle().map_err(|e| dnn_err("cudnnCreate", e))?;
        let mut driver = 0;
        // SAFETY: an out-pointer; the driver is initialised (a context exists).
        let _ = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut driver) };
        let device_id = format!(
            "{} sm{}{} {} SMs driver {driver} cudnn {}",
            dev.ctx.name().unwrap_or_else(|_| "unnamed GPU".into()),
            dev.arch.0,
            dev.arch.1,
            dev.sm_count,
            dnn::get_version()
        );
        let d = Dnn {
            handle,
            workspace: None,
            side_workspace: None,
            plans: HashMap::new(),
            device_id,
            timing_runs: 0,
            rates: Rates::new(),
            batch_norm: Default::default(),
            attention: Default::default(),
        };
        // SAFETY: live handle and stream.
        unsafe { dnn::set_stream(handle, dev.stream.cu_stream() as _) }
            .map_err(|e| dnn_err("cudnnSetStream", e))?;
        Ok(d)
    }

    /// The plan for one direction (see the module doc), chosen on the first call's buffers
    /// (`ptrs`, argument order; the output is overwritten): from the plan cache when it holds
    /// one, else timed (or heuristic) and then written to the cache.
    pub(super) fn make_plan(
        &mut self,
        dev: &CudaDevice,
        p: &Conv2dParams,
        dtype: DType,
        dir: Dir,
        ptrs: [*mut c_void; 3],
    ) -> Result<Plan> {
        dev.ctx
            .bind_to_thread()
            .map_err(|e| cuda_err("binding the context", e))?;
        let s = Settings::now(dev, dtype);
        let key = conv_cache::key(&self.device_id, &s.label(), p, dtype, dir, s.rules.tf32);
        if let CacheUse::ReadWrite(cache) = &s.cache {
            if let Some(entry) = conv_cache::load(cache, &key) {
                match self.restore(dev, &entry, p, dir, &s) {
                    Ok(plan) => return Ok(plan),
                    Err(e) => log::warn!(
                        "cuDNN plan cache: {} no longer builds ({e}); choosing the plan again",
                        conv_cache::path(cache, &key).display()
                    ),
                }
            }
        }
        let run = ConvRun {
            dev,
            p,
            dtype,
            dir,
            ptrs,
        };
        let plan = match self.choose(&run, &s, s.api != Api::Legacy, true)? {
            Some(plan) => plan,
            None => {
                return Err(Error::Cuda(format!(
                    "cuDNN: no {dir:?} convolution algorithm ran for {dtype} {p:?} within {} \
                     bytes of workspace (RUST_LOG=mixprec=debug lists the candidates)",
                    s.limit
                )))
            }
        };
        if let (Some(cache), PlanSource::Timed, Some(time_ms), Some(choice)) = (
            s.cache.dir(),
            plan.record.source,
            plan.record.time_ms,
            plan.choice(),
        ) {
            let r = plan.record;
            conv_cache::store(
                cache,
                &Entry {
                    format: conv_cache::FORMAT,
                    key,
                    choice,
                    workspace: plan.workspace(),
                    time_ms,
                    graph_candidates: r.graph_candidates,
                    legacy_candidates: r.legacy_candidates,
                    graph_timed: r.graph_timed,
                    legacy_timed: r.legacy_timed,
                    algorithm: plan.describe(),
                },
            );
        }
        Ok(plan)
    }

    /// Gathers the candidates of the APIs asked for and chooses among them: timed, or the
    /// heuristics' first. `None` when no candidate ran.
    fn choose(
        &mut self,
        c: &ConvRun<'_>,
        s: &Settings,
        use_graph: bool,
        use_legacy: bool,
    ) -> Result<Option<Plan>> {
        let cands = Candidates::gather(self.handle, c, s, use_graph, use_legacy);
        let record = Record {
            source: PlanSource::Heuristic,
            time_ms: None,
            choice_ms: 0.0,
            graph_candidates: cands.graph.as_ref().map_or(0, |(_, g)| g.len()),
            legacy_candidates: cands.legacy.as_ref().map_or(0, |(_, a)| a.len()),
            graph_timed: 0,
            legacy_timed: 0,
        };
        if !s.timed {
            return Ok(cands.heuristic_plan(record));
        }
        let (order, tuning) = self.time_candidates(c, s, &cands)?;
        let Some(chosen) = tuning.chosen else {
            // Every candidate failed to run. Forced onto the graph API, the legacy API may
            // still cover this convolution.
            if s.api == Api::Graph
                && cands.used_graph
                && cands.used_legacy
                && cands.legacy.is_none()
            {
                return self.choose(c, s, false, true);
            }
            return Ok(None);
        };
        let mut record = record;
        for (cand, o) in order.iter().zip(&tuning.outcomes) {
            if o.was_timed() {
                match cand {
                    Cand::Graph(_) => record.graph_timed += 1,
                    Cand::Legacy(_) => record.legacy_timed += 1,
                    Cand::Direct => {}
                }
            }
        }
        record.source = PlanSource::Timed;
        record.time_ms = tuning.outcomes[chosen].median_ms();
        let runner = cands.into_runner(order[chosen])?;
        Ok(Some(Plan { runner, record }))
    }

    /// Times `cands` in the unified order (the graph API's mode-A configurations, its best
    /// guesses; the legacy algorithms; the graph API's other configurations; our kernel) on the
    /// convolution's own buffers, within the scratch that could be allocated, and records each
    /// candidate's rate for the floors of later convolutions.
    fn time_candidates(
        &mut self,
        c: &ConvRun<'_>,
        s: &Settings,
        cands: &Candidates,
    ) -> Result<(Vec<Cand>, Tuning)> {
        let (dev, p, dtype, dir) = (c.dev, c.p, c.dtype, c.dir);
        let (h, tf32) = (self.handle, s.rules.tf32);
        let gc: &[GraphCandidate] = cands.graph.as_ref().map_or(&[], |(_, g)| g);
        let la: &[LegacyAlgo] = cands.legacy.as_ref().map_or(&[], |(_, a)| a);
        let is_a =
            |c: &GraphCandidate| c.mode == Some(dsys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_A);
        let mut order: Vec<Cand> = (0..gc.len())
            .filter(|&k| is_a(&gc[k]))
            .map(Cand::Graph)
            .chain((0..la.len()).map(Cand::Legacy))
            .chain((0..gc.len()).filter(|&k| !is_a(&gc[k])).map(Cand::Graph))
            .chain(cands.direct.as_ref().map(|_| Cand::Direct))
            .collect();
        let sizes: Vec<usize> = order.iter().map(|k| cands.workspace(k)).collect();
        let scratch = Scratch::alloc(dev, &sizes)?;
        let room = scratch.as_ref().map_or(0, |s| s.len);
        order.retain(|k| {
            let fits = cands.workspace(k) <= room;
            if !fits {
                log::debug!(
                    "{dir:?} {dtype} {p:?}: {} not timed: only {room} bytes of scratch could be \
                     allocated",
                    cands.describe(k)
                );
            }
            fits
        });
        let workspaces: Vec<usize> = order.iter().map(|k| cands.workspace(k)).collect();
        let rate_keys: Vec<RateKey> = order
            .iter()
            .map(|k| (dir, dtype, p.format, tf32, cands.id(k)))
            .collect();
        let work = flops(p);
        let floors: Vec<Option<f32>> = rate_keys
            .iter()
            .map(|k| self.rates.floor_ms(k, work))
            .collect();
        let ws_ptr = scratch.as_ref().map_or(std::ptr::null_mut(), |s| s.ptr());
        let ptrs = c.ptrs;
        let mut timer = EventTimer::new(dev);
        let tuning = tune(&workspaces, &floors, |i, runs, pre_run| match order[i] {
            Cand::Graph(k) => match cands.graph.as_ref() {
                Some((conv, _)) => {
                    timer.measure(|| conv.execute(h, &gc[k], ptrs, ws_ptr), runs, pre_run)
                }
                None => Ok(None),
            },
            Cand::Legacy(k) => match cands.legacy.as_ref() {
                Some((conv, _)) => timer.measure(
                    || conv.execute(h, &la[k], ptrs, ws_ptr, room),
                    runs,
                    pre_run,
                ),
                None => Ok(None),
            },
            Cand::Direct => match cands.direct.as_ref() {
                Some(d) => timer.measure(|| d.execute(dev, ptrs, ws_ptr), runs, pre_run),
                None => Ok(None),
            },
        });
        self.timing_runs += timer.runs;
        drop(scratch);
        let tuning = tuning?;
        for (key, o) in rate_keys.into_iter().zip(&tuning.outcomes) {
            self.rates.observe(key, work, o);
        }
        log::debug!(
            "{dir:?} {dtype} {p:?}: {} -> {}",
            order
                .iter()
                .zip(&tuning.outcomes)
                .map(|(k, o)| format!("{} {}", cands.describe(k), Outcome::describe(o)))
                .collect::<Vec<_>>()
                .join(", "),
            tuning
                .chosen
                .map_or_else(|| "none".into(), |i| cands.describe(&order[i]))
        );
        Ok((order, tuning))
    }

    /// Rebuilds a cached choice (no timing): an error when it no longer builds as recorded.
    fn restore(
        &self,
        dev: &CudaDevice,
        e: &Entry,
        p: &Conv2dParams,
        dir: Dir,
        s: &Settings,
    ) -> Result<Plan> {
        let h = self.handle;
        let dtype = s.rules.dtype;
        if e.workspace > s.limit {
            return Err(Error::Cuda(format!(
                "it needs {} bytes of workspace, the limit is now {}",
                e.workspace, s.limit
            )));
        }
        let record = Record {
            source: PlanSource::Cache,
            time_ms: Some(e.time_ms),
            choice_ms: 0.0,
            graph_candidates: e.graph_candidates,
            legacy_candidates: e.legacy_candidates,
            graph_timed: e.graph_timed,
            legacy_timed: e.legacy_timed,
        };
        let runner = match &e.choice {
            Choice::Graph { engine, knobs } => {
                let (conv, candidate) = super::probe::no_panic("cuDNN graph API", || {
                    let conv = GraphConv::new(h, p, dtype, dir)?;
                    let c = conv.rebuild(h, *engine, knobs, s.rules, s.limit)?;
                    Ok((conv, c))
                })?;
                if candidate.workspace != e.workspace {
                    return Err(Error::Cuda(format!(
                        "engine {engine} now needs {} bytes of workspace, not {}",
                        candidate.workspace, e.workspace
                    )));
                }
                Runner::Graph(GraphPlan { candidate, conv })
            }
            Choice::Legacy { algo, math } => {
                let conv = LegacyConv::new(p, dtype, dir, s.rules.tf32)?;
                let (algos, _) = conv.candidates(h, s.rules, s.limit)?;
                let found = algos
                    .into_iter()
                    .find(|a| a.algo.code() == *algo && a.math_code() == *math)
                    .ok_or_else(|| {
                        Error::Cuda(format!(
                            "cuDNN no longer lists legacy algorithm {algo} with math type {math}"
                        ))
                    })?;
                if found.workspace != e.workspace {
                    return Err(Error::Cuda(format!(
                        "legacy algorithm {algo} now needs {} bytes of workspace, not {}",
                        found.workspace, e.workspace
                    )));
                }
                Runner::Legacy { conv, algo: found }
            }
            Choice::Direct { kernel } => {
                let d = DirectWgrad::new(dev, p, dtype, dir)
                    .filter(|d| d.describe() == *kernel && d.workspace() == e.workspace)
                    .ok_or_else(|| {
                        Error::Cuda(format!("the direct kernel no longer launches as {kernel}"))
                    })?;
                Runner::Direct(d)
            }
        };
        Ok(Plan { runner, record })
    }
}

/// The device's cuDNN state, locked, its handle made on first use (which a capture cannot
/// record: `op`'s warm-up step must have made it). Every cuDNN call runs under this lock.
pub(super) fn lock_dnn<'a>(
    dev: &'a std::sync::Arc<CudaDevice>,
    op: &'static str,
) -> Result<std::sync::MutexGuard<'a, Option<Dnn>>> {
    let mut guard = dev.dnn.lock().unwrap_or_else(|e| e.into_inner());
    if guard.is_none() {
        super::graph::refuse(
            dev.ordinal,
            op,
            "creating the cuDNN handle during capture: run a warm-up step of the same shapes first",
        )?;
        // A cuDNN missing a symbol would panic inside cudarc: an error instead.
        *guard = Some(super::probe::no_panic("creating the cuDNN handle", || {
            Dnn::new(dev)
        })?);
    }
    Ok(guard)
}

/// The state inside a guard from [`lock_dnn`].
pub(super) fn dnn_state(guard: &mut Option<Dnn>) -> Result<&mut Dnn> {
    guard
        .as_mut()
        .ok_or_else(|| Error::Cuda("cuDNN handle".into()))
}

pub(super) fn data_type(d: DType) -> Result<(dsys::cudnnDataType_t, dsys::cudnnDataType_t)> {
    use dsys::cudnnDataType_t::*;
    Ok(match d {
        DType::F16 => (CUDNN_DATA_HALF, CUDNN_DATA_FLOAT),
        DType::BF16 => (CUDNN_DATA_BFLOAT16, CUDNN_DATA_FLOAT),
        DType::F32 => (CUDNN_DATA_FLOAT, CUDNN_DATA_FLOAT),
        DType::F64 => (CUDNN_DATA_DOUBLE, CUDNN_DATA_DOUBLE),
        DType::I64 => {
            return Err(Error::UnsupportedDType {
                op: "conv2d",
                got: d,
                expected: "a float dtype",
            })
        }
    })
}

/// Checks the geometry before anything computes output sizes (which would underflow).
fn check(op: &'static str, p: &Conv2dParams) -> Result<()> {
    let bad = |name: &'static str, v: String, allowed: &str| {
        Err(Error::invalid_arg(op, name, v, allowed))
    };
    if p.groups == 0 || !p.c_in.is_multiple_of(p.groups) || !p.c_out.is_multiple_of(p.groups) {
        return bad(
            "groups",
            p.groups.to_string(),
            &format!(
                "a positive divisor of c_in {} and c_out {}",
                p.c_in, p.c_out
            ),
        );
    }
    if p.kh == 0
        || p.kw == 0
        || p.stride.0 == 0
        || p.stride.1 == 0
        || p.dilation.0 == 0
        || p.dilation.1 == 0
    {
        return bad("kernel/stride/dilation", format!("{p:?}"), "positive sizes");
    }
    if p.h + 2 * p.padding.0 < p.dilation.0 * (p.kh - 1) + 1
        || p.w + 2 * p.padding.1 < p.dilation.1 * (p.kw - 1) + 1
    {
        return bad(
            "kernel",
            format!("{}x{}", p.kh, p.kw),
            "must fit the padded input",
        );
    }
    Ok(())
}

fn sizes(p: &Conv2dParams) -> (usize, usize, usize) {
    (
        p.n * p.c_in * p.h * p.w,
        p.c_out * (p.c_in / p.groups) * p.kh * p.kw,
        p.n * p.c_out * p.out_h() * p.out_w(),
    )
}

/// The checks and the run of one direction: `a`, `b` as [`run`] takes them.
fn conv(dir: Dir, a: &CudaStorage, b: &CudaStorage, p: &Conv2dParams) -> Result<CudaStorage> {
    let op = match dir {
        Dir::Forward => "conv2d",
        Dir::BackwardData => "conv2d_backward_input",
        Dir::BackwardFilter => "conv2d_backward_weight",
    };
    check(op, p)?;
    let (nx, nw, ny) = sizes(p);
    let (na, a_what, nb, b_what, n_out) = match dir {
        Dir::Forward => (nx, "the input", nw, "the weight", ny),
        Dir::BackwardData => (ny, "the output gradient", nw, "the weight", nx),
        Dir::BackwardFilter => (ny, "the output gradient", nx, "the input", nw),
    };
    for (s, n, what) in [(a, na, a_what), (b, nb, b_what)] {
        if s.len() != n {
            return Err(Error::invalid_arg(
                op,
                "len",
                s.len(),
                format!("{what} must have {n} elements"),
            ));
        }
    }
    run(&a.dev, dir, p, a.dtype(), a, b, n_out)
}

/// The operands of a convolution are packed in the params' format at offset 0 (the tensor
/// layer's `packed_as`), which is what cuDNN's descriptors describe.
fn packed(op: &'static str, s: &CudaStorage, l: &Layout) -> Result<()> {
    if l.offset() != 0 || l.elem_count() != s.len() {
        return Err(Error::invalid_arg(
            op,
            "layout",
            format!(
                "offset {} over {} of {} elements",
                l.offset(),
                l.elem_count(),
                s.len()
            ),
            "a packed operand (offset 0, the whole buffer)",
        ));
    }
    Ok(())
}

pub(crate) fn conv2d(
    x: &CudaStorage,
    lx: &Layout,
    w: &CudaStorage,
    lw: &Layout,
    p: &Conv2dParams,
) -> Result<CudaStorage> {
    packed("conv2d", x, lx)?;
    packed("conv2d", w, lw)?;
    conv(Dir::Forward, x, w, p)
}

/// `g` is the output gradient; returns the input gradient.
pub(crate) fn conv2d_backward_input(
    g: &CudaStorage,
    lg: &Layout,
    w: &CudaStorage,
    lw: &Layout,
    p: &Conv2dParams,
) -> Result<CudaStorage> {
    packed("conv2d_backward_input", g, lg)?;
    packed("conv2d_backward_input", w, lw)?;
    conv(Dir::BackwardData, g, w, p)
}

/// `g` is the output gradient; returns the weight gradient.
pub(crate) fn conv2d_backward_weight(
    g: &CudaStorage,
    lg: &Layout,
    x: &CudaStorage,
    lx: &Layout,
    p: &Conv2dParams,
) -> Result<CudaStorage> {
    packed("conv2d_backward_weight", g, lg)?;
    packed("conv2d_backward_weight", x, lx)?;
    conv(Dir::BackwardFilter, g, x, p)
}

impl ConvOps for CudaStorage {
    fn conv2d(&self, l: &Layout, w: &Self, wl: &Layout, p: &Conv2dParams) -> Result<Self> {
        conv2d(self, l, w, wl, p)
    }
    fn conv2d_backward_input(
        &self,
        l: &Layout,
        w: &Self,
        wl: &Layout,
        p: &Conv2dParams,
    ) -> Result<Self> {
        conv2d_backward_input(self, l, w, wl, p)
    }
    fn conv2d_backward_weight(
        &self,
        l: &Layout,
        x: &Self,
        xl: &Layout,
        p: &Conv2dParams,
    ) -> Result<Self> {
        conv2d_backward_weight(self, l, x, xl, p)
    }
}
