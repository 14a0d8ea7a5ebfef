//! Where this process stands in a distributed run, read from the variables that the launchers
//! set: `torchrun` (and `train_resnet --nproc-per-node`): `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//! `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`; Slurm's `srun`: `SLURM_PROCID`,
//! `SLURM_NTASKS`, `SLURM_LOCALID`, `SLURM_NTASKS_PER_NODE`, the node list. No variable at all
//! is a single process (rank 0 of 1).
//!
//! The rendezvous port: `MIXPREC_MASTER_PORT` when set; else under `torchrun`, whose agent serves
//! its own store on `MASTER_PORT` (`TORCHELASTIC_USE_AGENT_STORE=True`), `MASTER_PORT + 1`;
//! else `MASTER_PORT` (29500 under Slurm when unset, PyTorch's default).

use crate::error::{Error, Result};

/// Which launcher's variables described this process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Launcher {
    /// No launcher variables: one process.
    Single,
    /// `RANK`/`WORLD_SIZE` (torchrun, `train_resnet --nproc-per-node`, or set by hand).
    Torchrun,
    /// Slurm's `SLURM_PROCID`/`SLURM_NTASKS`.
    Slurm,
}

/// This process's place in the run and where the rendezvous is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchEnv {
    pub rank: usize,
    pub world_size: usize,
    /// The rank among the processes of this machine (it picks the GPU: `cuda:LOCAL_RANK`).
    pub local_rank: usize,
    pub local_world_size: usize,
    /// Rank 0's host: the others connect to it.
    pub master_addr: String,
    /// The port of mixprec's rendezvous on `master_addr` (0 for a single process: any free port).
    pub master_port: u16,
    pub launcher: Launcher,
}

/// PyTorch's default rendezvous port.
pub const DEFAULT_PORT: u16 = 29500;

fn env_err(key: &str, value: &str, allowed: impl Into<String>) -> Error {
    Error::config("environment", key, format!("{value:?}"), allowed)
}

fn parse_usize(key: &str, value: &str) -> Result<usize> {
    value
        .trim()
        .parse::<usize>()
        .map_err(|_| env_err(key, value, "a non-negative integer"))
}

fn parse_port(key: &str, value: &str) -> Result<u16> {
    value
        .trim()
        .parse::<u16>()
        .map_err(|_| env_err(key, value, "a TCP port number (0 to 65535)"))
}

fn check_rank(key: &str, rank: usize, world_size: usize) -> Result<()> {
    if world_size == 0 {
        return Err(env_err(
            key,
            &rank.to_string(),
            "a rank of a world of at least 1 process",
        ));
    }
    if rank >= world_size {
        return Err(env_err(
            key,
            &rank.to_string(),
            format!("a rank below the world size {world_size}"),
        ));
    }
    Ok(())
}

impl LaunchEnv {
    /// A single process: rank 0 of 1, the rendezvous on a free local port.
    pub fn single() -> LaunchEnv {
        LaunchEnv {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            local_world_size: 1,
            master_addr: "127.0.0.1".into(),
            master_port: 0,
            launcher: Launcher::Single,
        }
    }

    /// Reads this process's variables (see the module docs); a malformed or inconsistent value
    /// is an [`Error::Config`] naming the variable.
    pub fn from_env() -> Result<LaunchEnv> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// As [`LaunchEnv::from_env`], with the variables from `get` (for tests and launchers).
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<LaunchEnv> {
        let var = |k: &str| get(k).filter(|v| !v.trim().is_empty());
        let mut env = if let (Some(rank), Some(world)) = (var("RANK"), var("WORLD_SIZE")) {
            let rank = parse_usize("RANK", &rank)?;
            let world_size = parse_usize("WORLD_SIZE", &world)?;
            check_rank("RANK", rank, world_size)?;
            // Without LOCAL_RANK the process is taken to be on one machine with the others.
            let local_rank = match var("LOCAL_RANK") {
                Some(v) => parse_usize("LOCAL_RANK", &v)?,
                None => rank,
            };
            let local_world_size = match var("LOCAL_WORLD_SIZE") {
                Some(v) => parse_usize("LOCAL_WORLD_SIZE", &v)?,
                None => world_size,
            };
            let master_addr = var("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into());
            if world_size > 1 && var("MASTER_ADDR").is_none() {
                return Err(env_err(
                    "MASTER_ADDR",
                    "",
                    "rank 0's host name or address (torchrun sets it; set it when launching by hand)",
                ));
            }
            let master_port = match var("MASTER_PORT") {
                Some(p) => parse_port("MASTER_PORT", &p)?,
                None if world_size > 1 => {
                    return Err(env_err(
                        "MASTER_PORT",
                        "",
                        "a free TCP port on rank 0's host, the same on every rank",
                    ))
                }
                None => 0,
            };
            LaunchEnv {
                rank,
                world_size,
                local_rank,
                local_world_size,
                master_addr,
                master_port,
                launcher: Launcher::Torchrun,
            }
        } else if let (Some(rank), Some(world)) = (var("SLURM_PROCID"), var("SLURM_NTASKS")) {
            let rank = parse_usize("SLURM_PROCID", &rank)?;
            let world_size = parse_usize("SLURM_NTASKS", &world)?;
            check_rank("SLURM_PROCID", rank, world_size)?;
            let local_rank = match var("SLURM_LOCALID") {
                Some(v) => parse_usize("SLURM_LOCALID", &v)?,
                None => 0,
            };
            // "4" or "4(x2)" or "4,2": this node's count is the first when they differ.
            let local_world_size =
                match var("SLURM_NTASKS_PER_NODE").or_else(|| var("SLURM_STEP_TASKS_PER_NODE")) {
                    Some(v) => {
                        let digits: String = v.chars().take_while(|c| c.is_ascii_digit()).collect();
                        parse_usize("SLURM_NTASKS_PER_NODE", &digits)?
                    }
                    None => local_rank + 1,
                };
            let master_addr = match var("MASTER_ADDR") {
                Some(a) => a,
                None => {
                    let list = var("SLURM_STEP_NODELIST")
                        .or_else(|| var("SLURM_JOB_NODELIST"))
                        .or_else(|| var("SLURM_NODELIST"));
                    match list.as_deref().and_then(first_slurm_host) {
                        Some(h) => h,
                        None if world_size == 1 => "127.0.0.1".into(),
                        None => {
                            return Err(env_err(
                                "MASTER_ADDR",
                                "",
                                "rank 0's host (Slurm's node list was not readable either)",
                            ))
                        }
                    }
                }
            };
            let master_port = match var("MASTER_PORT") {
                Some(p) => parse_port("MASTER_PORT", &p)?,
                None => DEFAULT_PORT,
            };
            LaunchEnv {
                rank,
                world_size,
                local_rank,
                local_world_size,
                master_addr,
                master_port,
                launcher: Launcher::Slurm,
            }
        } else {
            LaunchEnv::single()
        };
        if let Some(p) = var("MIXPREC_MASTER_PORT") {
            env.master_port = parse_port("MIXPREC_MASTER_PORT", &p)?;
        } else if var("TORCHELASTIC_USE_AGENT_STORE").as_deref() == Some("True") {
            // torchrun's agent listens on MASTER_PORT itself (its TCPStore); ours is the next.
            env.master_port = env.master_port.checked_add(1).ok_or_else(|| {
                env_err(
                    "MASTER_PORT",
                    "65535",
                    "a port below 65535 under torchrun (mixprec's rendezvous uses MASTER_PORT + 1), or set MIXPREC_MASTER_PORT",
                )
            })?;
        }
        env.validate()?;
        Ok(env)
    }

    fn validate(&self) -> Result<()> {
        if self.world_size == 0 {
            return Err(env_err("WORLD_SIZE", "0", "at least 1"));
        }
        if self.rank >= self.world_size {
            return Err(env_err(
                "RANK",
                &self.rank.to_string(),
                format!("a rank below WORLD_SIZE = {}", self.world_size),
            ));
        }
        if self.local_world_size == 0 || self.local_rank >= self.local_world_size {
            return Err(env_err(
                "LOCAL_RANK",
                &self.local_rank.to_string(),
                format!(
                    "a local rank below LOCAL_WORLD_SIZE = {}",
                    self.local_world_size
                ),
            ));
        }
        if self.world_size > 1 && self.master_port == 0 {
            return Err(env_err(
                "MASTER_PORT",
                "0",
                "a fixed port (every rank must know it) when WORLD_SIZE > 1",
            ));
        }
        Ok(())
    }

    /// More than one process.
    pub fn is_distributed(&self) -> bool {
        self.world_size > 1
    }

    /// The CUDA device of this rank: `LOCAL_RANK`, or 0 when the launcher made exactly one GPU
    /// visible to each process (`CUDA_VISIBLE_DEVICES` with one entry, as Slurm's
    /// `--gpus-per-task 1` does).
    pub fn cuda_ordinal(&self) -> usize {
        let visible = std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_default();
        let one = !visible.trim().is_empty() && !visible.contains(',');
        if one {
            0
        } else {
            self.local_rank
        }
    }
}

/// The first host of a Slurm node list: `node[03-05,9],gpu1` → `node03`.
pub fn first_slurm_host(list: &str) -> Option<String> {
    let mut depth = 0usize;
    let mut end = list.len();
    for (i, c) in list.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                end = i;
                break;
            }
            _ => {}
        }
    }
    let first = list[..end].trim();
    if first.is_empty() {
        return None;
    }
    let Some(open) = first.find('[') else {
        return Some(first.to_string());
    };
    let close = first[open..].find(']')? + open;
    let inner = &first[open + 1..close];
    let range = inner.split(',').next()?;
    let start = range.split('-').next()?.trim();
    if start.is_empty() || !start.chars().all(|c| c.is_ascii_digit()) {
        return None;
    }
    Some(format!(
        "{}{}{}",
        &first[..open],
        start,
        &first[close + 1..]
    ))
}
