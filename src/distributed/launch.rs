//! Spawns the rank processes of one machine and supervises them (what `torchrun
//! --nproc-per-node N` does, for `train_resnet --nproc-per-node N` and the tests): each child is
//! the same program with `RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`
//! and `MASTER_PORT` set. When one exits with a failure, the others get `grace` to notice through
//! the process group and exit with their own error; whoever is still running then is killed.
//! The launcher's error names the rank that failed first.
//!
//! A SIGINT or SIGTERM to the launcher (Ctrl-C, `kill`, a scheduler's stop, `timeout`) is
//! forwarded to every rank, which stops at a step boundary; the launcher waits for them (a
//! bounded grace, then SIGKILL) and reports the signal ([`Launched::exit_code`]: 128 + it). The
//! ranks die with the launcher: a `kill -9` of it takes them along (Linux).

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

use super::signals;
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
    /// After a SIGINT / SIGTERM forwarded to the ranks, how long they get to stop at a step
    /// boundary, save and exit before they are killed.
    pub stop_grace: Duration,
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
            stop_grace: Duration::from_secs(30),
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

/// How a launch ended (see [`supervise`]).
#[derive(Clone, Debug)]
pub struct Launched {
    /// Every rank's exit, in rank order.
    pub exits: Vec<RankExit>,
    /// The SIGINT / SIGTERM that stopped the launcher (forwarded to the ranks).
    pub stopped_by: Option<i32>,
    /// The rank that failed first (not counting exits after a forwarded signal).
    pub first_failure: Option<usize>,
}

impl Launched {
    /// The launcher's exit status, as a shell reports a process ended by a signal: 128 + the
    /// signal when it was stopped by one, 1 when a rank failed, 0 when every rank succeeded.
    pub fn exit_code(&self) -> u8 {
        match (self.stopped_by, self.first_failure) {
            (Some(sig), _) => 128u8.saturating_add(sig.clamp(0, 127) as u8),
            (None, Some(_)) => 1,
            (None, None) => 0,
        }
    }

    /// The exits when every rank succeeded; otherwise an error naming the signal that stopped
    /// the launch or the rank that failed first, with every rank's end.
    pub fn into_result(self) -> Result<Vec<RankExit>> {
        let n = self.exits.len();
        let ended = |first: Option<usize>| {
            let mut order: Vec<&RankExit> = self.exits.iter().filter(|e| !e.success()).collect();
            order.sort_by_key(|e| (Some(e.rank) != first, e.after));
            order
                .iter()
                .map(|e| e.describe())
                .collect::<Vec<_>>()
                .join("; ")
        };
        if let Some(sig) = self.stopped_by {
            let how = ended(None);
            return Err(Error::Distributed {
                rank: 0,
                world_size: n,
                culprit: None,
                detail: format!(
                    "launcher: stopped by {}, forwarded to the {n} ranks{}",
                    signals::name(sig),
                    if how.is_empty() {
                        ", which all exited cleanly".to_string()
                    } else {
                        format!(": {how}")
                    }
                ),
            });
        }
        match self.first_failure {
            None => Ok(self.exits),
            Some(first) => Err(Error::Distributed {
                rank: first,
                world_size: n,
                culprit: Some(first),
                detail: format!(
                    "launcher: rank {first} failed first; {}",
                    ended(Some(first))
                ),
            }),
        }
    }
}

/// Starts every rank and waits for all of them; Ok when every one exited successfully. The
/// exits are returned in the error's detail otherwise, the first failure first.
pub fn launch(cfg: &LaunchConfig) -> Result<Vec<RankExit>> {
    supervise(cfg)?.into_result()
}

/// The rank processes' command for `rank` of `port`'s rendezvous.
fn rank_command(cfg: &LaunchConfig, rank: usize, port: u16) -> Command {
    let n = cfg.nproc;
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
    die_with_launcher(&mut cmd);
    cmd
}

/// Linux: the child gets SIGKILL when the launcher's thread that started it ends (the launcher
/// killed, or crashed), set between fork and exec; a launcher that was already gone before the
/// request took effect is caught by comparing the parent's pid with the launcher's.
#[cfg(target_os = "linux")]
fn die_with_launcher(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    let launcher = std::process::id() as libc::pid_t;
    // SAFETY: the closure runs in the child between fork and exec and calls only
    // async-signal-safe functions (prctl, getppid, _exit).
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(
                libc::PR_SET_PDEATHSIG,
                libc::SIGKILL as libc::c_ulong,
                0,
                0,
                0,
            ) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            if libc::getppid() != launcher {
                libc::_exit(128 + libc::SIGKILL);
            }
            Ok(())
        });
    }
}

#[cfg(not(target_os = "linux"))]
fn die_with_launcher(_cmd: &mut Command) {}

/// Sends `sig` to a running child.
fn send(c: &Child, sig: i32) {
    #[cfg(unix)]
    // SAFETY: kill(2) on the pid of a child not yet waited for (so not reused).
    unsafe {
        libc::kill(c.id() as libc::pid_t, sig);
    }
    #[cfg(not(unix))]
    let _ = (c, sig);
}

/// Starts every rank and supervises them until all have ended:
/// - a rank that fails gives the others [`LaunchConfig::grace`] to notice through the process
///   group and exit with their own error; whoever is still running then is killed;
/// - SIGINT or SIGTERM to the launcher is forwarded to every rank, which stops at a step
///   boundary (the trainer: rank 0 saves `last`); those still running after
///   [`LaunchConfig::stop_grace`], or at a second signal, are killed;
/// - the ranks die with the launcher (Linux: `PR_SET_PDEATHSIG`).
///
/// An error only when a rank could not be started (the others are killed then).
pub fn supervise(cfg: &LaunchConfig) -> Result<Launched> {
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
    signals::clear();
    let _signals = signals::StopSignals::install(false);
    let start = Instant::now();
    let mut children: Vec<Option<Child>> = Vec::with_capacity(n);
    for rank in 0..n {
        match rank_command(cfg, rank, port).spawn() {
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
    // The signal being forwarded, when, and how many the launcher had then.
    let mut stop: Option<(i32, Instant, usize)> = None;
    let mut kill_now = false;
    loop {
        if let Some(sig) = signals::pending() {
            match stop {
                None => {
                    eprintln!(
                        "launcher: {}: forwarded to the ranks; waiting up to {:.0} s for them to \
                         stop at a step boundary and exit (another signal kills them now)",
                        signals::name(sig),
                        cfg.stop_grace.as_secs_f64()
                    );
                    for c in children.iter().flatten() {
                        send(c, sig);
                    }
                    stop = Some((sig, Instant::now(), signals::received()));
                }
                Some((_, _, seen)) if signals::received() > seen => kill_now = true,
                Some(_) => {}
            }
        }
        // Failures seen in one pass: a rank killed by a signal (a crash) is more likely the
        // cause than one that exited with an error about it.
        let mut failed_now: Vec<(bool, usize)> = Vec::new();
        for (rank, slot) in children.iter_mut().enumerate() {
            let Some(c) = slot else { continue };
            let status = match c.try_wait() {
                Ok(None) => continue,
                Ok(Some(status)) => Some(status),
                Err(_) => None,
            };
            let e = RankExit {
                rank,
                status,
                killed: false,
                after: start.elapsed(),
            };
            if let Some(s) = status.filter(|_| !e.success()) {
                failed_now.push((s.code().is_some(), rank));
            }
            exits[rank] = Some(e);
            *slot = None;
        }
        if first_failure.is_none() && stop.is_none() {
            if let Some(&(_, rank)) = failed_now.iter().min() {
                first_failure = Some((rank, Instant::now()));
            }
        }
        if children.iter().all(|c| c.is_none()) {
            break;
        }
        let overdue = kill_now
            || match (stop, first_failure) {
                (Some((_, at, _)), _) => at.elapsed() > cfg.stop_grace,
                (None, Some((_, at))) => at.elapsed() > cfg.grace,
                (None, None) => false,
            };
        if overdue {
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
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(Launched {
        exits: exits.into_iter().flatten().collect(),
        stopped_by: stop.map(|(sig, _, _)| sig),
        first_failure: first_failure.map(|(r, _)| r),
    })
}
