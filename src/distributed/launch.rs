//! Spawns the rank processes of one machine and supervises them (what `torchrun
//! --nproc-per-node N` does, for `train_resnet --nproc-per-node N` and the tests): each child is
//! the same program with `RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`
//! and `MASTER_PORT` set. When one exits with a failure, the others get `grace` to notice through
//! the process group and exit with their own error; whoever is still running then is killed.
//! The launcher's error names the rank that failed first.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// What to launch.
#[derive(Clone, Debug)]
pub struct LaunchConfig {
    pub nproc: usize,
    pub program: PathBuf,
    pub args: Vec<OsString>,
    /// Rank 0's address for the rendezvous (this machine).
    pub master_addr: String,
    /// None: a free port, chosen now.
    pub master_port: Option<u16>,
    /// Extra variables for every child.
    pub env: Vec<(String, String)>,
    /// After the first failure, how long the other ranks get to exit by themselves.
    pub grace: Duration,
}

impl LaunchConfig {
    /// `nproc` copies of `program args` on this machine.
    pub fn new(nproc: usize, program: impl Into<PathBuf>, args: Vec<OsString>) -> LaunchConfig {
        LaunchConfig {
            nproc,
            program: program.into(),
            args,
            master_addr: "127.0.0.1".into(),
            master_port: None,
            env: Vec::new(),
            grace: Duration::from_secs(30),
        }
    }
}

/// How one rank ended.
#[derive(Clone, Debug)]
pub struct RankExit {
    pub rank: usize,
    pub status: Option<ExitStatus>,
    /// Killed by the launcher after the grace period.
    pub killed: bool,
    pub after: Duration,
}

impl RankExit {
    pub fn success(&self) -> bool {
        self.status.is_some_and(|s| s.success()) && !self.killed
    }

    fn describe(&self) -> String {
        if self.killed {
            return format!("rank {} was still running and was killed", self.rank);
        }
        match self.status {
            Some(s) => format!("rank {} exited with {}", self.rank, status_text(s)),
            None => format!("rank {} ended in an unknown way", self.rank),
        }
    }
}

fn status_text(s: ExitStatus) -> String {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(sig) = s.signal() {
            let name = match sig {
                6 => " (SIGABRT)",
                9 => " (SIGKILL)",
                11 => " (SIGSEGV)",
                15 => " (SIGTERM)",
                2 => " (SIGINT)",
                _ => "",
            };
            return format!("signal {sig}{name}");
        }
    }
    match s.code() {
        Some(c) => format!("status {c}"),
        None => "no status".into(),
    }
}

/// A free TCP port on this machine (the OS picks; a race with another program is possible but
/// the rendezvous then says the port is taken).
pub fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind(("127.0.0.1", 0))
        .map_err(|e| Error::io("finding a free port for the rendezvous", e))?;
    l.local_addr()
        .map(|a| a.port())
        .map_err(|e| Error::io("finding a free port for the rendezvous", e))
}

/// Starts every rank and waits for all of them; Ok when every one exited successfully. The
/// exits are returned in the error's detail otherwise, the first failure first.
pub fn launch(cfg: &LaunchConfig) -> Result<Vec<RankExit>> {
    if cfg.nproc == 0 {
        return Err(Error::invalid_arg(
            "launch",
            "nproc",
            0,
            "at least one process",
        ));
    }
    let port = match cfg.master_port {
        Some(p) => p,
        None => free_port()?,
    };
    let n = cfg.nproc;
    let start = Instant::now();
    let mut children: Vec<Option<Child>> = Vec::with_capacity(n);
    for rank in 0..n {
        let mut cmd = Command::new(&cfg.program);
        cmd.args(&cfg.args)
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("GROUP_RANK", "0")
            .env("WORLD_SIZE", n.to_string())
            .env("LOCAL_WORLD_SIZE", n.to_string())
            .env("MASTER_ADDR", &cfg.master_addr)
            .env("MASTER_PORT", port.to_string())
            // Not torchrun's agent: the port above is free for rank 0 to listen on.
            .env_remove("TORCHELASTIC_USE_AGENT_STORE");
        for (k, v) in &cfg.env {
            cmd.env(k, v);
        }
        match cmd.spawn() {
            Ok(c) => children.push(Some(c)),
            Err(e) => {
                for c in children.iter_mut().flatten() {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                return Err(Error::io(
                    format!("starting rank {rank} ({})", cfg.program.display()),
                    e,
                ));
            }
        }
    }
    let mut exits: Vec<Option<RankExit>> = vec![None; n];
    let mut first_failure: Option<(usize, Instant)> = None;
    loop {
        // Failures seen in one pass: a rank killed by a signal (a crash) is more likely the
        // cause than one that exited with an error about it.
        let mut failed_now: Vec<(bool, usize)> = Vec::new();
        for (rank, slot) in children.iter_mut().enumerate() {
            let Some(c) = slot else { continue };
            match c.try_wait() {
                Ok(Some(status)) => {
                    let e = RankExit {
                        rank,
                        status: Some(status),
                        killed: false,
                        after: start.elapsed(),
                    };
                    if !e.success() {
                        failed_now.push((status.code().is_some(), rank));
                    }
                    exits[rank] = Some(e);
                    *slot = None;
                }
                Ok(None) => {}
                Err(_) => {
                    exits[rank] = Some(RankExit {
                        rank,
                        status: None,
                        killed: false,
                        after: start.elapsed(),
                    });
                    *slot = None;
                }
            }
        }
        if first_failure.is_none() {
            if let Some(&(_, rank)) = failed_now.iter().min() {
                first_failure = Some((rank, Instant::now()));
            }
        }
        if children.iter().all(|c| c.is_none()) {
            break;
        }
        if let Some((_, at)) = first_failure {
            if at.elapsed() > cfg.grace {
                for (rank, slot) in children.iter_mut().enumerate() {
                    if let Some(c) = slot.as_mut() {
                        let _ = c.kill();
                        let status = c.wait().ok();
                        exits[rank] = Some(RankExit {
                            rank,
                            status,
                            killed: true,
                            after: start.elapsed(),
                        });
                        *slot = None;
                    }
                }
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let exits: Vec<RankExit> = exits.into_iter().flatten().collect();
    match first_failure {
        None => Ok(exits),
        Some((first, _)) => {
            let mut order: Vec<&RankExit> = exits.iter().filter(|e| !e.success()).collect();
            order.sort_by_key(|e| (e.rank != first, e.after));
            let lines: Vec<String> = order.iter().map(|e| e.describe()).collect();
            Err(Error::Distributed {
                rank: first,
                world_size: n,
                culprit: Some(first),
                detail: format!("launcher: rank {first} failed first; {}", lines.join("; ")),
            })
        }
    }
}
