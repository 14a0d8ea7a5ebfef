//! Checkpoints of ZeRO-sharded optimizer states ([`ShardedOptimizer`]): each rank writes its
//! share (`zero-shard-{rank}-of-{world}.safetensors`: per flat buffer and state name an F32
//! tensor, with each tensor's CRC-32 in the header) and, once every share is written, rank 0
//! writes `zero-manifest.json` (the world size, the flat layout with each parameter's offset,
//! the groups' hyperparameters, the shard files), each file atomically. A directory without the
//! manifest is an unfinished save.
//!
//! Loading works at any world size: every rank reads all the shares (one directory every rank
//! sees), verifies the checksums, reassembles the consolidated state (the unsharded
//! optimizer's layout, [`consolidated_state`]) and keeps its own share of it. The consolidated
//! state is also what a plain optimizer over the same parameters loads (`load_state_dict`), the
//! single-file export ([`export_consolidated`] / [`read_consolidated`]) included.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::safetensors;
use crate::distributed::zero::{consolidate, split_name};
use crate::distributed::{ShardableOptimizer, ShardedOptimizer, ZeroLayout};
use crate::error::{Error, Result};
use crate::optim::{GroupState, Hyperparams, Optimizer, OptimizerState};
use crate::tensor::{DType, Device, Tensor};

const FORMAT: &str = "mixprec-zero-shards";
const EXPORT_FORMAT: &str = "mixprec-optimizer-state";
const VERSION: u32 = 1;
/// The manifest's file name in a checkpoint directory.
pub const MANIFEST: &str = "zero-manifest.json";
const META_CRCS: &str = "crc32";
const META_GROUPS: &str = "param_groups";

/// What `zero-manifest.json` holds.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ZeroManifest {
    pub format: String,
    pub version: u32,
    pub world_size: usize,
    pub layout: ZeroLayout,
    /// Per group: its hyperparameters (with `initial_lr`).
    pub hyperparams: Vec<Hyperparams>,
    /// The shard files, in rank order.
    pub shards: Vec<String>,
}

fn bad(path: &Path, detail: impl Into<String>) -> Error {
    Error::DataFormat {
        path: path.display().to_string(),
        format: FORMAT,
        detail: detail.into(),
    }
}

fn shard_name(rank: usize, world: usize) -> String {
    format!("zero-shard-{rank}-of-{world}.safetensors")
}

fn crc_map(tensors: &[(String, Tensor)]) -> Result<BTreeMap<String, u32>> {
    tensors
        .iter()
        .map(|(n, t)| Ok((n.clone(), safetensors::data_crc32(t)?)))
        .collect()
}

/// Writes this rank's share into `dir` (made if missing); rank 0 then writes the manifest. A
/// collective (a barrier between the shares and the manifest): every rank calls it.
pub fn save_sharded<O: ShardableOptimizer>(
    dir: &Path,
    opt: &mut ShardedOptimizer<O>,
) -> Result<()> {
    std::fs::create_dir_all(dir)
        .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
    let group = opt.process_group().clone();
    let (rank, world) = (group.rank(), group.world_size());
    let tensors = opt.shard_tensors()?;
    let crcs = crc_map(&tensors)?;
    let mut meta = BTreeMap::new();
    meta.insert("format".to_string(), FORMAT.to_string());
    meta.insert(
        META_CRCS.to_string(),
        serde_json::to_string(&crcs).map_err(|e| bad(dir, e.to_string()))?,
    );
    safetensors::write(&dir.join(shard_name(rank, world)), &tensors, &meta)?;
    group.barrier()?;
    if rank == 0 {
        let layout = opt.layout().expect("shard_tensors made the layout").clone();
        let manifest = ZeroManifest {
            format: FORMAT.to_string(),
            version: VERSION,
            world_size: world,
            layout,
            hyperparams: opt
                .param_groups()
                .into_iter()
                .map(|g| g.hyperparams)
                .collect(),
            shards: (0..world).map(|r| shard_name(r, world)).collect(),
        };
        let json = serde_json::to_vec_pretty(&manifest).map_err(|e| bad(dir, e.to_string()))?;
        crate::util::atomic::write_atomic(&dir.join(MANIFEST), |w| {
            w.write_all(&json)
                .map_err(|e| Error::io(format!("writing {MANIFEST}"), e))
        })?;
    }
    group.barrier()
}

/// The manifest of a sharded checkpoint directory.
pub fn read_manifest(dir: &Path) -> Result<ZeroManifest> {
    let path = dir.join(MANIFEST);
    let bytes =
        std::fs::read(&path).map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
    let m: ZeroManifest = serde_json::from_slice(&bytes).map_err(|e| bad(&path, e.to_string()))?;
    if m.format != FORMAT || m.version > VERSION {
        return Err(bad(
            &path,
            format!(
                "format {:?} version {} (this build reads {FORMAT:?} up to version {VERSION})",
                m.format, m.version
            ),
        ));
    }
    if m.shards.len() != m.world_size || m.layout.world_size != m.world_size {
        return Err(bad(
            &path,
            format!(
                "{} shard file(s) and a layout for {} rank(s) in a manifest of world size {}",
                m.shards.len(),
                m.layout.world_size,
                m.world_size
            ),
        ));
    }
    Ok(m)
}

/// The consolidated state of a sharded checkpoint directory (saved at any world size), in the
/// unsharded optimizer's layout, on the host: every share read and its checksums verified.
pub fn consolidated_state(dir: &Path) -> Result<OptimizerState> {
    let m = read_manifest(dir)?;
    let mut parts: BTreeMap<(usize, String), Vec<Tensor>> = BTreeMap::new();
    for (rank, file) in m.shards.iter().enumerate() {
        let path: PathBuf = dir.join(file);
        let (tensors, meta) = safetensors::read(&path)?;
        let crcs: BTreeMap<String, u32> = meta
            .get(META_CRCS)
            .map(|s| serde_json::from_str(s))
            .transpose()
            .map_err(|e| bad(&path, format!("its checksums: {e}")))?
            .ok_or_else(|| bad(&path, "no checksums in the header"))?;
        if crcs.len() != tensors.len() {
            return Err(bad(
                &path,
                format!("{} tensor(s), {} checksum(s)", tensors.len(), crcs.len()),
            ));
        }
        for (name, t) in tensors {
            let want = crcs.get(&name).copied();
            let got = safetensors::data_crc32(&t)?;
            if want != Some(got) {
                return Err(bad(
                    &path,
                    format!("tensor {name}: checksum {got:08x}, the header says {want:08x?}"),
                ));
            }
            let (fi, key) = split_name(&name)?;
            let share = m.layout.flats.get(fi).map(|f| f.share);
            if share != Some(t.elem_count()) {
                return Err(bad(
                    &path,
                    format!(
                        "tensor {name} of {} element(s); the layout's share is {share:?}",
                        t.elem_count()
                    ),
                ));
            }
            let v = parts.entry((fi, key)).or_default();
            if v.len() != rank {
                return Err(bad(
                    &path,
                    format!("tensor {name} missing from a lower rank's shard"),
                ));
            }
            v.push(t);
        }
    }
    let mut fulls = BTreeMap::new();
    for (k, v) in parts {
        if v.len() != m.world_size {
            return Err(bad(
                dir,
                format!(
                    "state {}.{} in {} of {} shards",
                    k.0,
                    k.1,
                    v.len(),
                    m.world_size
                ),
            ));
        }
        let refs: Vec<&Tensor> = v.iter().collect();
        fulls.insert(k, Tensor::cat(&refs, 0)?);
    }
    consolidate(&m.layout, &fulls, m.hyperparams)
}

/// Loads a sharded checkpoint directory (saved at any world size) into `opt`: this rank keeps
/// its share. No collective.
pub fn load_sharded<O: ShardableOptimizer>(
    dir: &Path,
    opt: &mut ShardedOptimizer<O>,
) -> Result<()> {
    let st = consolidated_state(dir)?;
    opt.load_state_dict(&st)
}

/// Writes a consolidated state as one safetensors file (`optimizer.state.{pos}.{name}`, the
/// groups in the header), atomically: the single-file export of a sharded run's optimizer.
pub fn export_consolidated(state: &OptimizerState, path: &Path) -> Result<()> {
    let mut tensors = Vec::new();
    for (pos, m) in &state.state {
        for (name, t) in m {
            tensors.push((format!("optimizer.state.{pos}.{name}"), t.clone()));
        }
    }
    let groups: Vec<(Vec<usize>, Hyperparams)> = state
        .param_groups
        .iter()
        .map(|g| (g.params.clone(), g.hyperparams.clone()))
        .collect();
    let mut meta = BTreeMap::new();
    meta.insert("format".to_string(), EXPORT_FORMAT.to_string());
    meta.insert(
        META_GROUPS.to_string(),
        serde_json::to_string(&groups).map_err(|e| bad(path, e.to_string()))?,
    );
    meta.insert(
        META_CRCS.to_string(),
        serde_json::to_string(&crc_map(&tensors)?).map_err(|e| bad(path, e.to_string()))?,
    );
    safetensors::write(path, &tensors, &meta)
}

/// Reads a file of [`export_consolidated`] (checksums verified), for a plain optimizer's
/// `load_state_dict`.
pub fn read_consolidated(path: &Path) -> Result<OptimizerState> {
    let (tensors, meta) = safetensors::read(path)?;
    if meta.get("format").map(String::as_str) != Some(EXPORT_FORMAT) {
        return Err(bad(path, format!("not a {EXPORT_FORMAT} file")));
    }
    let groups: Vec<(Vec<usize>, Hyperparams)> = meta
        .get(META_GROUPS)
        .map(|s| serde_json::from_str(s))
        .transpose()
        .map_err(|e| bad(path, format!("its groups: {e}")))?
        .ok_or_else(|| bad(path, "no groups in the header"))?;
    let crcs: BTreeMap<String, u32> = meta
        .get(META_CRCS)
        .map(|s| serde_json::from_str(s))
        .transpose()
        .map_err(|e| bad(path, format!("its checksums: {e}")))?
        .ok_or_else(|| bad(path, "no checksums in the header"))?;
    let mut state: BTreeMap<usize, BTreeMap<String, Tensor>> = BTreeMap::new();
    for (name, t) in tensors {
        let got = safetensors::data_crc32(&t)?;
        if crcs.get(&name) != Some(&got) {
            return Err(bad(path, format!("tensor {name}: checksum mismatch")));
        }
        let rest = name
            .strip_prefix("optimizer.state.")
            .and_then(|r| r.split_once('.'))
            .and_then(|(p, n)| Some((p.parse::<usize>().ok()?, n.to_string())));
        let Some((pos, key)) = rest else {
            return Err(bad(
                path,
                format!("tensor {name}: not optimizer.state.POS.NAME"),
            ));
        };
        // Step counts are 0-d F32 on the host, as the optimizers save them.
        let t = if t.elem_count() == 1 && t.dims().is_empty() {
            Tensor::scalar(t.to_vec_f64()?[0], DType::F32, Device::Cpu)?
        } else {
            t
        };
        state.entry(pos).or_default().insert(key, t);
    }
    Ok(OptimizerState {
        state,
        param_groups: groups
            .into_iter()
            .map(|(params, hyperparams)| GroupState {
                params,
                hyperparams,
            })
            .collect(),
    })
}
