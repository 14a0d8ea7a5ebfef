//! Training checkpoints: everything needed to continue a run bit for bit, in one safetensors
//! file:
//!
//! - the tensors: the model's state dict under `model.` + torchvision's names (FP32; at O2 the
//!   FP32 masters), and the optimizer's per-parameter state under
//!   `optimizer.state.{position}.{name}` (`momentum_buffer`, `exp_avg`, `step`, and at O2
//!   `master_param`; FP32), positions counted across the groups as PyTorch does;
//! - the header's `__metadata__`: `format`, `version` and a JSON `manifest` (each group's
//!   parameter positions and hyperparameters, each loss scaler's state, the [`TrainProgress`],
//!   a free-form `extra` value such as the trainer's run config and metrics history, and each
//!   tensor's dtype, shape and CRC-32), with the manifest's own CRC-32 beside it.
//!
//! A save is one atomic file replacement (temporary file, fsync, rename, fsync of the
//! directory: `io::write_atomic`), so a crash at any instant leaves the previous checkpoint or
//! the new one, never a mix; a load verifies every checksum, so a flipped byte is an error
//! naming the tensor (or the manifest) instead of a silently different run.
//! [`latest`] picks the newest checkpoint of a directory that loads and verifies.
//!
//! Version-1 checkpoints (two files: `NAME.safetensors` and `NAME.json`, no checksums) still
//! load; saving one again writes version 2.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::amp::{AmpModel, AmpOptimizer, AmpOptimizerState, ScalerState};
use crate::error::{Error, Mismatch, Result};
use crate::nn::module::state_dict_mismatches;
use crate::nn::{Module, StateDict};
use crate::optim::{GroupState, Optimizer, OptimizerState};
use crate::tensor::{DType, Tensor};

use super::safetensors;

/// The version this build writes and the newest it reads (1: two files, no checksums).
pub const FORMAT_VERSION: u32 = 2;

const FORMAT: &str = "mixprec-checkpoint";
const MODEL_PREFIX: &str = "model.";
const STATE_PREFIX: &str = "optimizer.state.";
const MASTER: &str = "master_param";
/// `__metadata__` keys of version 2.
const META_MANIFEST: &str = "manifest";
const META_MANIFEST_CRC: &str = "manifest_crc32";

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

/// Version 2's manifest (a JSON string in the safetensors metadata).
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Manifest {
    param_groups: Vec<GroupJson>,
    scalers: Vec<ScalerJson>,
    progress: TrainProgress,
    /// Every tensor of the file: what its header entry and its bytes must be.
    tensors: BTreeMap<String, TensorRecord>,
    #[serde(default)]
    extra: serde_json::Value,
}

#[derive(Serialize, Deserialize, PartialEq, Debug)]
#[serde(deny_unknown_fields)]
struct TensorRecord {
    dtype: String,
    shape: Vec<usize>,
    /// CRC-32 of the tensor's bytes in the file, 8 hex digits.
    crc32: String,
}

/// Version 1's JSON file (beside the tensors).
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct ManifestV1 {
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

/// The JSON file beside a version-1 checkpoint's tensors `path` (same stem).
pub fn json_path(path: &Path) -> Result<PathBuf> {
    let json = path.with_extension("json");
    if json == path || path.file_name().is_none() {
        return Err(Error::invalid_arg(
            "Checkpoint",
            "path",
            path.display(),
            "a checkpoint file, e.g. `run/epoch3.safetensors`",
        ));
    }
    Ok(json)
}

fn crc_hex(crc: u32) -> String {
    format!("{crc:08x}")
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

    /// Writes the checkpoint to `path`, one safetensors file, atomically (a temporary file,
    /// fsync, one rename over `path`, fsync of the directory): until the new file is durable
    /// the previous one stays in place, and temporary files of earlier crashed saves to the
    /// same name are removed. Anything that can fail without touching a file (a non-finite
    /// hyperparameter, which JSON cannot hold) fails first.
    pub fn save(&self, path: &Path) -> Result<()> {
        if path.extension().is_some_and(|e| e == "json") || path.file_name().is_none() {
            return Err(Error::invalid_arg(
                "Checkpoint::save",
                "path",
                path.display(),
                "a checkpoint file, e.g. `run/epoch3.safetensors`",
            ));
        }
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
        let groups: Vec<GroupJson> = opt
            .param_groups
            .iter()
            .map(|g| GroupJson {
                params: g.params.clone(),
                hyperparams: g.hyperparams.clone(),
            })
            .collect();
        let scalers: Vec<ScalerJson> = self
            .optimizer
            .scalers
            .iter()
            .map(|s| ScalerJson {
                loss_scale: s.loss_scale,
                unskipped: s.unskipped,
                skipped_total: s.skipped_total,
            })
            .collect();
        // JSON has no Inf/NaN (serde_json would write `null`, which would not load back).
        let numbers = groups.iter().enumerate().flat_map(|(gi, g)| {
            g.hyperparams
                .iter()
                .map(move |(k, v)| (format!("param_groups[{gi}].{k}"), *v))
        });
        let scales = scalers
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
        let mut records = BTreeMap::new();
        for (name, t) in &tensors {
            let record = TensorRecord {
                dtype: safetensors::dtype_name(t.dtype()).to_string(),
                shape: t.dims().to_vec(),
                crc32: crc_hex(safetensors::data_crc32(t)?),
            };
            if records.insert(name.clone(), record).is_some() {
                return Err(Error::invalid_arg(
                    "Checkpoint::save",
                    "tensors",
                    format!("`{name}` twice (saving {})", path.display()),
                    "each name once",
                ));
            }
        }
        let manifest = Manifest {
            param_groups: groups,
            scalers,
            progress: self.progress,
            tensors: records,
            extra: self.extra.clone(),
        };
        let json = serde_json::to_string(&manifest).map_err(|e| {
            Error::invalid_arg("Checkpoint::save", "manifest", e, "a serializable state")
        })?;
        let meta: BTreeMap<String, String> = [
            ("format", FORMAT.to_string()),
            ("version", FORMAT_VERSION.to_string()),
            (META_MANIFEST_CRC, crc_hex(crc32fast::hash(json.as_bytes()))),
            (META_MANIFEST, json),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        safetensors::write(path, &tensors, &meta)?;
        // A version-1 JSON left beside the file would describe other tensors: drop it.
        if let Ok(j) = json_path(path) {
            if j.is_file() {
                let _ = std::fs::remove_file(j);
            }
        }
        Ok(())
    }

    /// Reads and verifies a checkpoint written by [`Checkpoint::save`]: a missing, truncated
    /// or corrupt file, a flipped byte (a tensor whose CRC-32, dtype or shape is not the one
    /// recorded; a manifest whose CRC-32 is not), or a tensor name outside the layout is an
    /// error naming the file and the tensor. Version-1 checkpoints (two files) load too.
    pub fn load(path: &Path) -> Result<Self> {
        let bytes =
            std::fs::read(path).map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
        let (tensors, meta) = safetensors::parse(path, &bytes)?;
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
        let version = meta.get("version").and_then(|v| v.parse::<u32>().ok());
        let m = match version {
            Some(2) => verified_manifest(path, &meta, &tensors)?,
            Some(1) => {
                log::warn!(
                    "{}: a version-1 checkpoint (two files, no checksums); it loads, and saving \
                     it again (Checkpoint::load then save) writes the one-file version 2",
                    path.display()
                );
                load_v1_manifest(path, &meta)?
            }
            _ => {
                return Err(bad(
                    path,
                    "checkpoint",
                    format!(
                        "format version {:?} (this build reads 1..={FORMAT_VERSION})",
                        meta.get("version")
                    ),
                ))
            }
        };

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

    /// Where the checkpoint at `path` stands, reading only the file's header (a version-1
    /// checkpoint: its JSON). Verifies the manifest's checksum, not the tensors'.
    pub fn peek(path: &Path) -> Result<TrainProgress> {
        let meta = safetensors::read_metadata(path)?;
        if meta.get("format").map(String::as_str) != Some(FORMAT) {
            return Err(bad(path, "checkpoint", "not a mixprec checkpoint"));
        }
        match meta.get("version").map(String::as_str) {
            Some("1") => Ok(load_v1_manifest(path, &meta)?.progress),
            _ => Ok(manifest_of(path, &meta)?.progress),
        }
    }

    /// Puts the checkpoint back into a model and optimizer wrapped at the same AMP level as the
    /// ones it was captured from, so that training continues bit for bit as if never stopped
    /// (at O2 the FP32 masters are the saved ones, not re-derived from half weights).
    ///
    /// Every tensor that does not fit (missing, unexpected, another shape, an integer where a
    /// float belongs) and every layout difference (number of groups, of parameters per group, of
    /// scalers; masters saved for an optimizer that keeps none) is reported at once in an
    /// [`Error::StateMismatch`] naming the checkpoint's tensors; nothing changes then. A
    /// checkpoint holding Inf or NaN values (a diverged run's state) is an [`Error::NonFinite`]
    /// naming the tensors: training cannot continue from it.
    pub fn restore<M: Module, O: Optimizer>(
        &self,
        model: &AmpModel<M>,
        opt: &mut AmpOptimizer<O>,
    ) -> Result<()> {
        let bad = self.non_finite_tensors()?;
        if !bad.is_empty() {
            return Err(non_finite_error(&bad));
        }
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

    /// The names (as in the file) of the floating tensors that hold an Inf or a NaN.
    pub fn non_finite_tensors(&self) -> Result<Vec<String>> {
        let model = self
            .model
            .iter()
            .map(|(n, t)| (format!("{MODEL_PREFIX}{n}"), t));
        let state = self.optimizer.optimizer.state.iter().flat_map(|(pos, e)| {
            e.iter()
                .map(move |(n, t)| (format!("{STATE_PREFIX}{pos}.{n}"), t))
        });
        let mut bad = Vec::new();
        for (name, t) in model.chain(state) {
            if t.dtype().is_float() && t.to_vec_f64()?.iter().any(|x| !x.is_finite()) {
                bad.push(name);
            }
        }
        Ok(bad)
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

fn non_finite_error(bad: &[String]) -> Error {
    let shown: Vec<String> = bad.iter().take(5).map(|n| format!("`{n}`")).collect();
    Error::NonFinite {
        op: "Checkpoint::restore",
        detail: format!(
            "the checkpoint holds Inf or NaN values in {}{} (the state of a diverged run): \
             continue from an earlier checkpoint",
            shown.join(", "),
            if bad.len() > 5 {
                format!(" and {} more tensors", bad.len() - 5)
            } else {
                String::new()
            }
        ),
    }
}

/// What both versions' manifests give a checkpoint.
struct Parts {
    param_groups: Vec<GroupJson>,
    scalers: Vec<ScalerJson>,
    progress: TrainProgress,
    extra: serde_json::Value,
}

/// The version-2 manifest of `meta`, its own checksum verified.
fn manifest_of(path: &Path, meta: &BTreeMap<String, String>) -> Result<Manifest> {
    let (Some(json), Some(crc)) = (meta.get(META_MANIFEST), meta.get(META_MANIFEST_CRC)) else {
        return Err(bad(
            path,
            "checkpoint",
            format!("no `{META_MANIFEST}` and `{META_MANIFEST_CRC}` in the metadata"),
        ));
    };
    let actual = crc_hex(crc32fast::hash(json.as_bytes()));
    if *crc != actual {
        return Err(bad(
            path,
            "checkpoint",
            format!(
                "the manifest (hyperparameters, loss scalers, progress, tensor list) has CRC-32 \
                 {actual}, the file recorded {crc}: the file is corrupt"
            ),
        ));
    }
    serde_json::from_str(json).map_err(|e| bad(path, "checkpoint manifest", e.to_string()))
}

/// Checks every tensor of a version-2 file against its manifest record.
fn verified_manifest(
    path: &Path,
    meta: &BTreeMap<String, String>,
    tensors: &[(String, Tensor)],
) -> Result<Parts> {
    let m = manifest_of(path, meta)?;
    for (name, t) in tensors {
        let Some(rec) = m.tensors.get(name) else {
            return Err(bad(
                path,
                "checkpoint",
                format!("tensor `{name}` is not in the manifest: the file is corrupt"),
            ));
        };
        let dtype = safetensors::dtype_name(t.dtype());
        if rec.dtype != dtype || rec.shape != t.dims() {
            return Err(bad(
                path,
                "checkpoint",
                format!(
                    "tensor `{name}`: {dtype} {:?} in the file, {} {:?} recorded: the file is corrupt",
                    t.dims(),
                    rec.dtype,
                    rec.shape
                ),
            ));
        }
        let crc = crc_hex(safetensors::data_crc32(t)?);
        if crc != rec.crc32 {
            return Err(bad(
                path,
                "checkpoint",
                format!(
                    "tensor `{name}`: its data has CRC-32 {crc}, the file recorded {}: the \
                     file is corrupt",
                    rec.crc32
                ),
            ));
        }
    }
    if let Some(missing) = m
        .tensors
        .keys()
        .find(|n| !tensors.iter().any(|(t, _)| t == *n))
    {
        return Err(bad(
            path,
            "checkpoint",
            format!("tensor `{missing}` is recorded but not in the file: the file is corrupt"),
        ));
    }
    Ok(Parts {
        param_groups: m.param_groups,
        scalers: m.scalers,
        progress: m.progress,
        extra: m.extra,
    })
}

/// A version-1 checkpoint's JSON (beside `path`), paired with the tensors by id.
fn load_v1_manifest(path: &Path, meta: &BTreeMap<String, String>) -> Result<Parts> {
    let json = json_path(path)?;
    let bytes = std::fs::read(&json).map_err(|e| {
        Error::io(
            format!(
                "reading {} (the JSON half of the version-1 checkpoint {})",
                json.display(),
                path.display()
            ),
            e,
        )
    })?;
    let m: ManifestV1 =
        serde_json::from_slice(&bytes).map_err(|e| bad(&json, "checkpoint JSON", e.to_string()))?;
    if m.format != FORMAT || m.version != 1 {
        return Err(bad(
            &json,
            "checkpoint JSON",
            format!(
                "format `{}` version {}, expected `{FORMAT}` version 1",
                m.format, m.version
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
    Ok(Parts {
        param_groups: m.param_groups,
        scalers: m.scalers,
        progress: m.progress,
        extra: m.extra,
    })
}

/// The newest checkpoint of a directory that loads and verifies, and those skipped on the way.
#[derive(Debug)]
pub struct Latest {
    pub path: PathBuf,
    pub checkpoint: Checkpoint,
    /// Newer checkpoints that did not load, and files whose header does not read (their
    /// progress unknown), each with the reason.
    pub skipped: Vec<(PathBuf, Error)>,
}

/// The newest checkpoint in `dir` (`*.safetensors`, ordered by their progress: step, then
/// epoch) that loads, verifies and holds only finite values; `Ok(None)` when `dir` holds no
/// checkpoint file at all, an error listing every file and its reason when none qualifies.
pub fn latest(dir: &Path) -> Result<Option<Latest>> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io(format!("listing {}", dir.display()), e)),
    };
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.extension().is_some_and(|x| x == "safetensors")
                && p.file_name()
                    .is_some_and(|n| !n.to_string_lossy().starts_with('.'))
        })
        .collect();
    if files.is_empty() {
        return Ok(None);
    }
    files.sort();
    // Newest first (`last` before an epoch file of the same progress); an unreadable header
    // (a file cut short, empty, or not a checkpoint) sorts last: it is tried after the others
    // and, when an older one loads first, still reported as skipped.
    let rank = |p: &Path| {
        let progress = Checkpoint::peek(p).ok().map(|g| (g.step, g.epoch));
        (progress, p.file_stem().is_some_and(|s| s == "last"))
    };
    let mut ranked: Vec<_> = files.into_iter().map(|p| (rank(&p), p)).collect();
    ranked.sort_by_key(|(r, _)| std::cmp::Reverse(*r));
    let mut skipped = Vec::new();
    let mut ranked = ranked.into_iter();
    for (_, path) in ranked.by_ref() {
        // A checkpoint that verifies but holds Inf/NaN (a diverged run saved it) cannot be
        // continued from either.
        let loaded = Checkpoint::load(&path).and_then(|c| match c.non_finite_tensors()? {
            bad if bad.is_empty() => Ok(c),
            bad => Err(non_finite_error(&bad)),
        });
        match loaded {
            Ok(checkpoint) => {
                for (r, p) in ranked {
                    if r.0.is_none() {
                        if let Err(e) = Checkpoint::peek(&p) {
                            skipped.push((p, e));
                        }
                    }
                }
                return Ok(Some(Latest {
                    path,
                    checkpoint,
                    skipped,
                }));
            }
            Err(e) => skipped.push((path, e)),
        }
    }
    let reasons: Vec<String> = skipped
        .iter()
        .map(|(p, e)| format!("{}: {e}", p.display()))
        .collect();
    Err(Error::DataFormat {
        path: dir.display().to_string(),
        format: "checkpoint",
        detail: format!("no checkpoint loads: {}", reasons.join("; ")),
    })
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
