//! The trainer's side of data parallelism: under a launcher (`train_resnet --nproc-per-node N`,
//! `torchrun`, `srun`) each process is one rank: it trains on `cuda:LOCAL_RANK` (or the CPU),
//! joins the process group, and reads its shard of every epoch; rank 0 alone prints, writes
//! metrics, plots and checkpoints. Without a launcher nothing changes: one process, no group.

use crate::distributed::{Backend, GroupOptions, LaunchEnv, ProcessGroup};
use crate::error::{Error, Result};
use crate::tensor::Device;

use super::config::{parse_device, select_device};

/// This process's place in the run.
pub struct Ranks {
    pub env: LaunchEnv,
    pub group: Option<ProcessGroup>,
}

impl Ranks {
    /// Reads the launcher's variables (a single process when there are none).
    pub fn from_env() -> Result<Ranks> {
        Ok(Ranks {
            env: LaunchEnv::from_env()?,
            group: None,
        })
    }

    pub fn world_size(&self) -> usize {
        self.env.world_size
    }

    pub fn rank(&self) -> usize {
        self.env.rank
    }

    /// Rank 0: the one that prints and writes files.
    pub fn is_main(&self) -> bool {
        self.env.rank == 0
    }

    /// The device for `spec` (`auto`, `cpu`, `cuda`, `cuda:N`): with several ranks, `auto` and
    /// `cuda` mean `cuda:LOCAL_RANK` (`cuda:0` when each process sees one GPU), and naming one
    /// GPU for all of them is an error.
    /// Also a note saying why `auto` chose what it chose (empty with several ranks).
    pub fn device(&self, spec: &str) -> Result<(Device, String)> {
        if !self.env.is_distributed() {
            return select_device(spec);
        }
        let local = self.env.cuda_ordinal();
        let device = match parse_device(spec)? {
            None => Device::cuda_if_available(local),
            Some(None) => Device::Cpu,
            Some(Some(_)) if spec == "cuda" => Device::cuda(local)?,
            Some(Some(n)) => {
                return Err(Error::invalid_arg(
                    "train",
                    "device",
                    format!("cuda:{n} (with {} processes)", self.env.world_size),
                    "auto, cuda or cpu: each process trains on cuda:LOCAL_RANK",
                ))
            }
        };
        Ok((device, String::new()))
    }

    /// Joins the process group (NCCL on a GPU, the CPU backend on the CPU).
    pub fn join(&mut self, device: Device) -> Result<()> {
        if !self.env.is_distributed() {
            return Ok(());
        }
        let mut opts = GroupOptions::new(Backend::for_device(device));
        opts.device = Some(device);
        self.group = Some(ProcessGroup::new(&self.env, &opts)?);
        Ok(())
    }

    /// Every rank's `value`, in rank order (host values, through the control plane).
    pub fn gather(&self, value: f64) -> Result<Vec<f64>> {
        let Some(g) = &self.group else {
            return Ok(vec![value]);
        };
        g.all_gather_bytes(&value.to_le_bytes())?
            .iter()
            .map(|b| {
                b.as_slice()
                    .try_into()
                    .map(f64::from_le_bytes)
                    .map_err(|_| {
                        g.abort(None, format!("a rank sent {} bytes for one value", b.len()))
                    })
            })
            .collect()
    }

    /// The element-wise sum of every rank's `values` (host values, through the control plane).
    pub fn sum(&self, values: &[f64]) -> Result<Vec<f64>> {
        let Some(g) = &self.group else {
            return Ok(values.to_vec());
        };
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let all = g.all_gather_bytes(&bytes)?;
        let mut out = vec![0.0; values.len()];
        for b in &all {
            if b.len() != bytes.len() {
                return Err(g.abort(
                    None,
                    format!(
                        "the ranks report {} and {} metric values",
                        b.len() / 8,
                        values.len()
                    ),
                ));
            }
            for (o, c) in out.iter_mut().zip(b.chunks_exact(8)) {
                *o += f64::from_le_bytes(c.try_into().unwrap_or([0; 8]));
            }
        }
        Ok(out)
    }
}

/// Whether this process runs under a launcher (ours, torchrun, srun) as one rank of a run.
pub fn launched() -> bool {
    std::env::var_os("RANK").is_some() || std::env::var_os("SLURM_PROCID").is_some()
}

/// `--nproc-per-node`: a number of processes, or one per visible GPU (torchrun's `gpu`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Nproc {
    Count(usize),
    Gpu,
}

/// `--nproc-per-node`'s parser (for clap's `value_parser`).
pub fn parse_nproc(s: &str) -> std::result::Result<Nproc, String> {
    if s == "gpu" {
        return Ok(Nproc::Gpu);
    }
    match s.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(Nproc::Count(n)),
        _ => Err(format!(
            "`{s}`: a number of processes >= 1, or `gpu` (one per visible GPU)"
        )),
    }
}

impl Nproc {
    /// The number of processes `job` starts; `gpu` counts the GPUs this process sees.
    pub fn count(self, job: &'static str) -> Result<usize> {
        match self {
            Nproc::Count(n) => Ok(n),
            Nproc::Gpu => gpu_processes(job, crate::backend::cuda::device_count()),
        }
    }
}

/// `--nproc-per-node gpu` on a machine where CUDA sees `visible` GPUs (or why it sees none).
pub fn gpu_processes(job: &'static str, visible: Result<usize>) -> Result<usize> {
    let why = match visible {
        Ok(n) if n >= 1 => return Ok(n),
        Ok(_) => "CUDA sees no GPU".to_string(),
        Err(e) => e.to_string(),
    };
    Err(Error::invalid_arg(
        job,
        "--nproc-per-node",
        "gpu",
        format!(
            "a machine with a usable GPU ({why}); give a number to start that many CPU processes"
        ),
    ))
}

/// `--nproc-per-node N`: this program N times, with the same arguments but that one and
/// `--master-port`, as ranks 0..N of one run on this machine; the first failure ends the run,
/// and a SIGINT / SIGTERM is forwarded to every rank (see `distributed::launch`). Returns the
/// exit status: 0, or 128 + the signal that stopped it.
pub fn spawn_ranks(job: &'static str, n: usize, port: Option<u16>) -> Result<u8> {
    use crate::distributed::launch::{supervise, LaunchConfig};
    let mut args = Vec::new();
    let mut it = std::env::args_os().skip(1);
    while let Some(a) = it.next() {
        let s = a.to_string_lossy();
        if s == "--nproc-per-node" || s == "--master-port" {
            it.next();
        } else if !(s.starts_with("--nproc-per-node=") || s.starts_with("--master-port=")) {
            args.push(a);
        }
    }
    let exe = std::env::current_exe()
        .map_err(|e| Error::io("finding this program to start the ranks", e))?;
    let mut cfg = LaunchConfig::new(n, exe, args);
    cfg.master_port = port;
    let launched = supervise(&cfg)?;
    let code = launched.exit_code();
    match launched.into_result() {
        Ok(_) => Ok(code),
        Err(e) if code > 128 => {
            eprintln!("{job}: {e}");
            Ok(code)
        }
        Err(e) => Err(e),
    }
}
