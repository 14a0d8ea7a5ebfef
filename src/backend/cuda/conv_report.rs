//! What the convolution plans of a device are, for tests and for a look at a network's
//! convolutions: [`conv_plans`], [`clear_conv_plans`], [`conv_timing_runs`],
//! [`conv_plan_cache_dir`].

use super::conv_cache::CacheUse;
use super::conv_plan::*;
use crate::backend::Conv2dParams;
use crate::base::error::Result;
use crate::base::DType;

/// One chosen convolution plan, as [`conv_plans`] reports it.
#[derive(Clone, Debug)]
pub struct ConvPlanInfo {
    /// The geometry, its memory format included.
    pub params: Conv2dParams,
    pub dtype: DType,
    /// "forward", "backward-data", "backward-filter" or "backward-data-add" (the data gradient
    /// added into the input's other gradients).
    pub direction: &'static str,
    /// Whether it runs through cuDNN's graph API (else the legacy API, or our own kernel).
    pub graph_api: bool,
    /// Whether it runs our own kernel (`conv_direct.rs`) rather than cuDNN.
    pub direct: bool,
    /// How it was chosen: timed here, from the plan cache, or cuDNN's untimed first choice.
    pub source: PlanSource,
    /// Its median time on the first call's buffers (ms), when it was timed (here or by the
    /// process that wrote the plan cache).
    pub time_ms: Option<f32>,
    /// Candidates of each API (configurations and algorithms that keep the dtype's promise and
    /// fit the workspace limit; 0 when that API was not asked).
    pub graph_candidates: usize,
    pub legacy_candidates: usize,
    /// How many of them were timed (abandoned as too slow counts; failing to run, or not run
    /// for a floor already slow, does not).
    pub graph_timed: usize,
    pub legacy_timed: usize,
    /// Wall time spent choosing it in this process (ms): building and timing candidates, or
    /// rebuilding it from the plan cache.
    pub choice_ms: f64,
    /// Bytes of workspace it needs.
    pub workspace: usize,
    /// What runs: "graph engine N [its notes] (...)" or "legacy `<cuDNN algorithm> <math>` (...)".
    pub algorithm: String,
    /// Chosen under [`super::set_deterministic`]: only bitwise-reproducible candidates.
    pub deterministic: bool,
}

/// The convolution plans device `ordinal` has chosen so far (one per geometry, memory format,
/// dtype, direction, TF32 and determinism setting): which API each runs through, how it was chosen, its
/// time. For tests and for a look at a network's convolutions.
pub fn conv_plans(ordinal: usize) -> Result<Vec<ConvPlanInfo>> {
    let dev = super::device::get(ordinal)?;
    let guard = dev.dnn.lock().unwrap_or_else(|e| e.into_inner());
    let Some(dnn) = guard.as_ref() else {
        return Ok(Vec::new());
    };
    Ok(dnn
        .plans
        .iter()
        .map(
            |((params, dtype, dir, _, deterministic), plan)| ConvPlanInfo {
                params: *params,
                dtype: *dtype,
                direction: dir.name(),
                graph_api: matches!(plan.runner, Runner::Graph(_)),
                direct: matches!(plan.runner, Runner::Direct(_)),
                source: plan.record.source,
                time_ms: plan.record.time_ms,
                graph_candidates: plan.record.graph_candidates,
                legacy_candidates: plan.record.legacy_candidates,
                graph_timed: plan.record.graph_timed,
                legacy_timed: plan.record.legacy_timed,
                choice_ms: plan.record.choice_ms,
                workspace: plan.workspace(),
                algorithm: plan.describe(),
                deterministic: *deterministic,
            },
        )
        .collect())
}

/// Forgets the convolution plans device `ordinal` has chosen: each is chosen again at its next
/// use (from the plan cache when it holds it). For tests, and after changing the environment
/// that steers the choice.
pub fn clear_conv_plans(ordinal: usize) -> Result<()> {
    let dev = super::device::get(ordinal)?;
    let mut guard = dev.dnn.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(dnn) = guard.as_mut() {
        dnn.plans.clear();
    }
    Ok(())
}

/// How many candidate runs device `ordinal` has timed to choose its convolution plans (0 for a
/// process whose plans all came from the plan cache).
pub fn conv_timing_runs(ordinal: usize) -> Result<u64> {
    let dev = super::device::get(ordinal)?;
    let guard = dev.dnn.lock().unwrap_or_else(|e| e.into_inner());
    Ok(guard.as_ref().map_or(0, |d| d.timing_runs))
}

/// Where the plan cache is for a choice made now (None: off), from the environment.
pub fn conv_plan_cache_dir() -> Option<std::path::PathBuf> {
    CacheUse::from_env().dir().map(|d| d.to_path_buf())
}
