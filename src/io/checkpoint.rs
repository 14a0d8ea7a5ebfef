//! Training checkpoints: everything needed to continue a run bit for bit, in two files with one
//! stem:
//!
//! - `NAME.safetensors`: the model's state dict under `model.` + torchvision's names (FP32; at O2
//!   the FP32 masters), and the optimizer's per-parameter state under
//!   `optimizer.state.{position}.{name}` (`momentum_buffer`, `exp_avg`, `step`, and at O2
//!   `master_param`; FP32), positions counted across the groups as PyTorch does;
//! - `NAME.json`: the format version, each group's parameter positions and hyperparameters, each
//!   loss scaler's state, the [`TrainProgress`] and a free-form `extra` value (the trainer's run
//!   config, its metrics history, ...).
//!
//! Both are written atomically, the JSON last, and carry the same checkpoint id: a JSON left
//! from an earlier save beside newer tensors (a save interrupted between the two renames) is
//! refused on load instead of being paired with the wrong tensors.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

use crate::amp::{AmpModel, AmpOptimizer, AmpOptimizerState, ScalerState};
use crate::error::{Error, Mismatch, Result};
use crate::nn::module::state_dict_mismatches;
use crate::nn::{Module, StateDict};
use crate::optim::{GroupState, Optimizer, OptimizerState};
use crate::tensor::{DType, Tensor};

use super::atomic::write_atomic;
use super::safetensors;

/// The version this build writes and the newest it reads.
pub const FORMAT_VERSION: u32 = 1;

const FORMAT: &str = "mixprec-checkpoint";
const MODEL_PREFIX: &str = "model.";
const STATE_PREFIX: &str = "optimizer.state.";
const MASTER: &str = "master_param";

/// Where a run stands.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrainProgress {
    /// Epochs completed.
    pub epoch: usize,
    /// Optimizer steps done (skipped AMP steps included).
    pub step: u64,
    /// The run's seed (data order, augmentation, initialisation).
    pub seed: u64,
}

/// A training checkpoint in memory: what [`Checkpoint::capture`] takes from a wrapped model and
/// optimizer, [`Checkpoint::save`] writes, [`Checkpoint::load`] reads and
/// [`Checkpoint::restore`] puts back.
#[derive(Clone, Debug)]
pub struct Checkpoint {
    /// The model's state dict (torchvision names, FP32 and I64). After [`Checkpoint::load`] the
    /// entries are sorted by name; [`Checkpoint::restore`] matches them by name.
    pub model: StateDict,
    /// The optimizer's state (per-parameter FP32 tensors, groups' hyperparameters) and the loss
    /// scalers'.
    pub optimizer: AmpOptimizerState,
    pub progress: TrainProgress,
    /// Free-form: the trainer's run config, metrics history, ... (`null` when unused).
    pub extra: serde_json::Value,
}

/// The JSON file.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Manifest {
    format: String,
    version: u32,
    /// Pairs the JSON with its tensors.
    id: String,
    /// The file name of the tensors (informative).
    tensors: String,
    param_groups: Vec<GroupJson>,
    scalers: Vec<ScalerJson>,
    progress: TrainProgress,
    #[serde(default)]
    extra: serde_json::Value,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct GroupJson {
    params: Vec<usize>,
    hyperparams: BTreeMap<String, f64>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct ScalerJson {
    loss_scale: f64,
    unskipped: u64,
    skipped_total: u64,
}

/// The JSON file beside the tensors `path` (same stem).
pub fn json_path(path: &Path) -> Result<PathBuf> {
    let json = path.with_extension("json");
    if json == path || path.file_name().is_none() {
        return Err(Error::invalid_arg(
            "Checkpoint",
            "path",
            path.display(),
            "the checkpoint's tensor file, e.g. `run/epoch3.safetensors` (its JSON goes beside it as `run/epoch3.json`)",
        ));
    }
    Ok(json)
}

fn new_id() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!(
        "{nanos:x}-{:x}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

fn bad(path: &Path, format: &'static str, detail: impl Into<String>) -> Error {
    Error::DataFormat {
        path: path.display().to_string(),
        format,
        detail: detail.into(),
    }
}

impl Checkpoint {
    /// Copies the state of a wrapped model and optimizer (a host read of the device state).
    pub fn capture<M: Module, O: Optimizer>(
        model: &AmpModel<M>,
        opt: &AmpOptimizer<O>,
        progress: TrainProgress,
        extra: serde_json::Value,
    ) -> Result<Self> {
        Ok(Checkpoint {
            model: model.state_dict()?,
            optimizer: opt.state_dict()?,
            progress,
            extra,
        })
    }

    /// Writes `path` (the tensors, a safetensors file) and the JSON beside it (`path` with the
    /// extension `json`), each atomically, the JSON last.
    pub fn save(&self, path: &Path) -> Result<()> {
        let json = json_path(path)?;
        let id = new_id();
        let opt = &self.optimizer.optimizer;
        let mut tensors: Vec<(String, Tensor)> =
            Vec::with_capacity(self.model.len() + opt.state.len());
        for (name, t) in &self.model {
            tensors.push((format!("{MODEL_PREFIX}{name}"), t.clone()));
        }
        for (pos, entries) in &opt.state {
            for (name, t) in entries {
                tensors.push((format!("{STATE_PREFIX}{pos}.{name}"), t.clone()));
            }
        }
        let meta: BTreeMap<String, String> = [
            ("format", FORMAT.to_string()),
            ("version", FORMAT_VERSION.to_string()),
            ("id", id.clone()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();

        let manifest = Manifest {
            format: FORMAT.into(),
            version: FORMAT_VERSION,
            id: id.clone(),
            tensors: path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
            param_groups: opt
                .param_groups
                .iter()
                .map(|g| GroupJson {
                    params: g.params.clone(),
                    hyperparams: g.hyperparams.clone(),
                })
                .collect(),
            scalers: self
                .optimizer
                .scalers
                .iter()
                .map(|s| ScalerJson {
                    loss_scale: s.loss_scale,
                    unskipped: s.unskipped,
                    skipped_total: s.skipped_total,
                })
                .collect(),
            progress: self.progress,
            extra: self.extra.clone(),
        };
        // JSON has no Inf/NaN (serde_json would write `null`, which would not load back).
        let numbers = manifest
            .param_groups
            .iter()
            .enumerate()
            .flat_map(|(gi, g)| {
                g.hyperparams
                    .iter()
                    .map(move |(k, v)| (format!("param_groups[{gi}].{k}"), *v))
            });
        let scales = manifest
            .scalers
            .iter()
            .enumerate()
            .map(|(i, s)| (format!("scalers[{i}].loss_scale"), s.loss_scale));
        if let Some((what, v)) = numbers.chain(scales).find(|(_, v)| !v.is_finite()) {
            return Err(Error::invalid_arg(
                "Checkpoint::save",
                "state",
                format!("{what} = {v} (saving {})", path.display()),
                "finite values (JSON has no Inf or NaN)",
            ));
        }
        let bytes = serde_json::to_vec_pretty(&manifest).map_err(|e| {
            Error::invalid_arg("Checkpoint::save", "json", e, "a serializable state")
        })?;
        // Whatever can fail without touching a file has failed by now: the tensors go first,
        // the JSON that names them last.
        safetensors::write(path, &tensors, &meta)?;
        write_atomic(&json, |w| {
            w.write_all(&bytes)
                .and_then(|_| w.write_all(b"\n"))
                .map_err(|e| Error::io(format!("writing {}", json.display()), e))
        })
    }

    /// Reads a checkpoint written by [`Checkpoint::save`] (`path` is the tensors' file). A
    /// missing or corrupt file, a JSON from another save, or a tensor name outside the layout is
    /// an error naming the file.
    pub fn load(path: &Path) -> Result<Self> {
        let json = json_path(path)?;
        let (tensors, meta) = safetensors::read(path)?;
        let bytes = std::fs::read(&json).map_err(|e| {
            Error::io(
                format!(
                    "reading {} (the JSON half of checkpoint {})",
                    json.display(),
                    path.display()
                ),
                e,
            )
        })?;
        let m: Manifest = serde_json::from_slice(&bytes)
            .map_err(|e| bad(&json, "checkpoint JSON", e.to_string()))?;
        if m.format != FORMAT {
            return Err(bad(
                &json,
                "checkpoint JSON",
                format!("format `{}`, expected `{FORMAT}`", m.format),
            ));
        }
        if m.version == 0 || m.version > FORMAT_VERSION {
            return Err(bad(
                &json,
                "checkpoint JSON",
                format!(
                    "format version {} (this build reads 1..={FORMAT_VERSION})",
                    m.version
                ),
            ));
        }
        if meta.get("format").map(String::as_str) != Some(FORMAT) {
            return Err(bad(
                path,
                "checkpoint",
                format!(
                    "no `format: {FORMAT}` in the safetensors metadata (found {:?}): a weights file, not a checkpoint?",
                    meta.get("format")
                ),
            ));
        }
        if meta.get("id") != Some(&m.id) {
            return Err(bad(
                &json,
                "checkpoint JSON",
                format!(
                    "checkpoint id {} but {} has id {}: the two files come from different saves (one interrupted?)",
                    m.id,
                    path.display(),
                    meta.get("id").map_or("(none)", String::as_str)
                ),
            ));
        }

        let mut model = Vec::new();
        let mut state: BTreeMap<usize, BTreeMap<String, Tensor>> = BTreeMap::new();
        for (name, t) in tensors {
            if let Some(n) = name.strip_prefix(MODEL_PREFIX) {
                model.push((n.to_string(), t));
                continue;
            }
            let parsed = name
                .strip_prefix(STATE_PREFIX)
                .and_then(|r| r.split_once('.'))
                .and_then(|(pos, key)| Some((pos.parse::<usize>().ok()?, key)))
                .filter(|(_, key)| !key.is_empty());
            let Some((pos, key)) = parsed else {
                return Err(bad(
                    path,
                    "checkpoint",
                    format!(
                        "tensor `{name}`: expected `{MODEL_PREFIX}NAME` or `{STATE_PREFIX}POSITION.NAME`"
                    ),
                ));
            };
            state.entry(pos).or_default().insert(key.to_string(), t);
        }
        Ok(Checkpoint {
            model,
            optimizer: AmpOptimizerState {
                optimizer: OptimizerState {
                    state,
                    param_groups: m
                        .param_groups
                        .into_iter()
                        .map(|g| GroupState {
                            params: g.params,
                            hyperparams: g.hyperparams,
                        })
                        .collect(),
                },
                scalers: m
                    .scalers
                    .into_iter()
                    .map(|s| ScalerState {
                        loss_scale: s.loss_scale,
                        unskipped: s.unskipped,
                        skipped_total: s.skipped_total,
                    })
                    .collect(),
            },
            progress: m.progress,
            extra: m.extra,
        })
    }

    /// Puts the checkpoint back into a model and optimizer wrapped at the same AMP level as the
    /// ones it was captured from, so that training continues bit for bit as if never stopped
    /// (at O2 the FP32 masters are the saved ones, not re-derived from half weights).
    ///
    /// Every tensor that does not fit (missing, unexpected, another shape, an integer where a
    /// float belongs) and every layout difference (number of groups, of parameters per group, of
    /// scalers; masters saved for an optimizer that keeps none) is reported at once in an
    /// [`Error::StateMismatch`] naming the checkpoint's tensors; nothing changes then.
    pub fn restore<M: Module, O: Optimizer>(
        &self,
        model: &AmpModel<M>,
        opt: &mut AmpOptimizer<O>,
    ) -> Result<()> {
        let mut problems: Vec<Mismatch> = state_dict_mismatches(model, &self.model)?
            .into_iter()
            .map(|p| prefixed(p, MODEL_PREFIX))
            .collect();
        problems.extend(self.optimizer_mismatches(opt));
        if !problems.is_empty() {
            return Err(Error::StateMismatch {
                context: "Checkpoint::restore".into(),
                problems,
            });
        }
        // The optimizer checks what remains (hyperparameter names and values, state keys) before
        // it changes anything; the model's load cannot fail on what was checked above, but
        // should it fail all the same, the optimizer goes back to where it was.
        let backup = opt.state_dict()?;
        opt.load_state_dict(&self.optimizer)?;
        if let Err(e) = model.load_state_dict(&self.model) {
            opt.load_state_dict(&backup)?;
            return Err(e);
        }
        Ok(())
    }

    /// The optimizer part of [`Checkpoint::restore`]'s check.
    fn optimizer_mismatches<O: Optimizer>(&self, opt: &AmpOptimizer<O>) -> Vec<Mismatch> {
        let mut problems = Vec::new();
        let saved = &self.optimizer.optimizer;
        let n_scalers = opt.scalers().len();
        if self.optimizer.scalers.len() != n_scalers {
            problems.push(Mismatch::Layout {
                name: "scalers".into(),
                detail: format!(
                    "{} loss scaler(s) in the checkpoint, {n_scalers} in the optimizer (the policy's num_losses)",
                    self.optimizer.scalers.len()
                ),
            });
        }
        let groups = opt.inner().param_groups();
        if saved.param_groups.len() != groups.len() {
            problems.push(Mismatch::Layout {
                name: "optimizer.param_groups".into(),
                detail: format!(
                    "{} group(s) in the checkpoint, {} in the optimizer",
                    saved.param_groups.len(),
                    groups.len()
                ),
            });
            return problems;
        }
        let mut params: BTreeMap<usize, &Tensor> = BTreeMap::new();
        for (gi, (s, g)) in saved.param_groups.iter().zip(&groups).enumerate() {
            if s.params.len() != g.params.len() {
                problems.push(Mismatch::Layout {
                    name: format!("optimizer.param_groups.{gi}"),
                    detail: format!(
                        "{} parameter(s) in the checkpoint's group, {} in the optimizer's",
                        s.params.len(),
                        g.params.len()
                    ),
                });
                continue;
            }
            for (&pos, p) in s.params.iter().zip(g.params) {
                params.insert(pos, p);
            }
        }
        let has_masters = {
            let ps = opt.inner().params();
            let ms = opt.master_params();
            ps.iter().zip(&ms).any(|(p, m)| p.id() != m.id())
        };
        for (pos, entries) in &saved.state {
            for (key, t) in entries {
                let name = format!("{STATE_PREFIX}{pos}.{key}");
                let Some(p) = params.get(pos) else {
                    problems.push(Mismatch::Unexpected {
                        name,
                        shape: t.shape().clone(),
                        dtype: t.dtype(),
                    });
                    continue;
                };
                if key == MASTER && !has_masters {
                    problems.push(Mismatch::Layout {
                        name,
                        detail: "an FP32 master weight, but the optimizer keeps none (a checkpoint of O2 restored at another level?)".into(),
                    });
                } else if !t.dtype().is_float() {
                    problems.push(Mismatch::DType {
                        name,
                        expected: DType::F32,
                        found: t.dtype(),
                    });
                } else if t.shape() != p.shape() && t.elem_count() != 1 {
                    // Per-parameter scalars (step counts, ...) are single elements.
                    problems.push(Mismatch::Shape {
                        name,
                        expected: p.shape().clone(),
                        found: t.shape().clone(),
                    });
                }
            }
        }
        problems
    }
}

fn prefixed(m: Mismatch, prefix: &str) -> Mismatch {
    let p = |n: String| format!("{prefix}{n}");
    match m {
        Mismatch::Missing { name, shape, dtype } => Mismatch::Missing {
            name: p(name),
            shape,
            dtype,
        },
        Mismatch::Unexpected { name, shape, dtype } => Mismatch::Unexpected {
            name: p(name),
            shape,
            dtype,
        },
        Mismatch::Shape {
            name,
            expected,
            found,
        } => Mismatch::Shape {
            name: p(name),
            expected,
            found,
        },
        Mismatch::DType {
            name,
            expected,
            found,
        } => Mismatch::DType {
            name: p(name),
            expected,
            found,
        },
        Mismatch::Layout { name, detail } => Mismatch::Layout {
            name: p(name),
            detail,
        },
    }
}
