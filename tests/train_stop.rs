//! Stopping runs as a scheduler or a user does, on the CPU backend: SIGTERM to a single run,
//! and to the launcher of 2 and 3 ranks; `kill -9` of the launcher; `kill -9` of one rank.
//! After each: no process of the run is left after a bounded time, the run directory's lock is
//! free, and `--resume auto` with the run's original settings continues it; at the end the
//! run's metrics and final checkpoint are bitwise those of a run never interrupted.
//!
//! The processes are this test binary run again: `stop_rank_child` trains (one process, or one
//! rank), `stop_launcher_child` is the launcher of `stop_rank_child` ranks.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use mixprec::distributed::launch::{supervise, LaunchConfig};
use mixprec::io::checkpoint::Checkpoint;
use mixprec::train::metrics::read_jsonl;
use mixprec::train::{run, RunConfig};

#[path = "common/train_run.rs"]
mod train_run;
use train_run::{auto, small_cpu_run};

const DIR: &str = "MIXPREC_STOP_DIR";
const NPROC: &str = "MIXPREC_STOP_NPROC";
const PIDS: &str = "MIXPREC_STOP_PIDS";

/// Long enough epochs (32 steps of one process) that a signal usually lands inside one.
fn config(out: PathBuf) -> RunConfig {
    let mut c = small_cpu_run(out, 5);
    c.data.batch_size = 16;
    c.data.train_limit = 512;
    c.data.test_limit = 64;
    c
}

/// One process, or one rank: trains with `--resume auto` and exits as the command line does
/// (128 + the signal when one stopped it). Writes its pid for the test to watch.
#[test]
#[ignore = "a child process of the tests below"]
fn stop_rank_child() {
    let Some(dir) = std::env::var_os(DIR) else {
        return;
    };
    let dir = PathBuf::from(dir);
    if let Some(pids) = std::env::var_os(PIDS) {
        let rank = std::env::var("RANK").unwrap_or_else(|_| "0".into());
        std::fs::create_dir_all(&pids).unwrap();
        std::fs::write(
            Path::new(&pids).join(format!("rank{rank}")),
            std::process::id().to_string(),
        )
        .unwrap();
    }
    let code = match run(&config(dir), &auto()) {
        Ok(s) => s.stopped.map_or(0, |sig| 128 + sig),
        Err(e) => {
            eprintln!("rank child: {e}");
            1
        }
    };
    std::process::exit(code);
}

/// The launcher of `MIXPREC_STOP_NPROC` ranks; exits with its status.
#[test]
#[ignore = "a child process of the tests below"]
fn stop_launcher_child() {
    let Some(n) = std::env::var(NPROC).ok().and_then(|n| n.parse().ok()) else {
        return;
    };
    let mut lc = LaunchConfig::new(
        n,
        std::env::current_exe().unwrap(),
        child_args("stop_rank_child"),
    );
    lc.stop_grace = Duration::from_secs(60);
    lc.env = vec![("MIXPREC_DIST_TIMEOUT".into(), "60".into())];
    let launched = supervise(&lc).unwrap();
    let code = launched.exit_code();
    if let Err(e) = launched.into_result() {
        eprintln!("{e}");
    }
    std::process::exit(code as i32);
}

fn child_args(name: &str) -> Vec<std::ffi::OsString> {
    [
        name,
        "--exact",
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ]
    .iter()
    .map(Into::into)
    .collect()
}

/// Starts `stop_rank_child` (nproc 1) or `stop_launcher_child` of `nproc` ranks on `dir`;
/// their output goes to `pids`/../`output` (read by [`wait_all_gone`]).
fn spawn(dir: &Path, nproc: usize, pids: &Path) -> Child {
    let name = if nproc == 1 {
        "stop_rank_child"
    } else {
        "stop_launcher_child"
    };
    let _ = std::fs::remove_dir_all(pids);
    let log = std::fs::File::create(output_of(pids)).unwrap();
    Command::new(std::env::current_exe().unwrap())
        .args(child_args(name))
        .env(DIR, dir)
        .env(NPROC, nproc.to_string())
        .env(PIDS, pids)
        .stdout(Stdio::from(log.try_clone().unwrap()))
        .stderr(Stdio::from(log))
        .spawn()
        .unwrap()
}

/// Where the children started with `pids` write their output.
fn output_of(pids: &Path) -> PathBuf {
    pids.with_extension("out")
}

fn signal(pid: u32, sig: i32) {
    // SAFETY: kill(2) on a pid this test started.
    unsafe {
        libc::kill(pid as libc::pid_t, sig);
    }
}

/// Whether `pid` runs: a zombie (left to a parent that does not reap it) does not, but a
/// process whose first thread is a zombie while others are still exiting (a multi-threaded
/// process being killed) does.
fn alive(pid: u32) -> bool {
    let running = |stat: &str| {
        !stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with(['Z', 'X']))
    };
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks
        .filter_map(|t| t.ok())
        .any(|t| std::fs::read_to_string(t.path().join("stat")).is_ok_and(|stat| running(&stat)))
}

/// The pids the ranks wrote (waiting until `n` have).
fn rank_pids(pids: &Path, n: usize, child: &mut Child) -> Vec<u32> {
    let t = Instant::now();
    loop {
        let found: Vec<u32> = (0..n)
            .filter_map(|r| std::fs::read_to_string(pids.join(format!("rank{r}"))).ok())
            .filter_map(|s| s.trim().parse().ok())
            .collect();
        if found.len() == n {
            return found;
        }
        assert!(
            child.try_wait().unwrap().is_none(),
            "the run ended before its ranks started"
        );
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "the ranks did not start"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Epochs recorded so far in `dir`'s metrics.
fn epochs_done(dir: &Path) -> usize {
    read_jsonl(&dir.join("metrics.jsonl")).map_or(0, |h| h.len())
}

/// Waits until `dir` has recorded `epochs` epochs (and `wait_more` after that).
fn wait_for_epochs(dir: &Path, epochs: usize, wait_more: Duration, child: &mut Child) {
    let t = Instant::now();
    while epochs_done(dir) < epochs {
        assert!(
            child.try_wait().unwrap().is_none(),
            "the run ended before epoch {epochs}"
        );
        assert!(t.elapsed() < Duration::from_secs(120), "no epoch {epochs}");
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(wait_more);
}

/// Waits (bounded) for the child and for every rank pid to be gone; the child's exit code
/// and the output of the processes started with `log`'s pids directory.
fn wait_all_gone(
    mut child: Child,
    pids: &[u32],
    log: &Path,
    within: Duration,
) -> (Option<i32>, String) {
    let t = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            t.elapsed() < within,
            "the run did not end within {within:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    while pids.iter().any(|&p| alive(p)) {
        let left: Vec<u32> = pids.iter().copied().filter(|&p| alive(p)).collect();
        if t.elapsed() > within {
            for &p in &left {
                signal(p, libc::SIGKILL);
            }
            panic!("processes {left:?} were still running {within:?} after the stop");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let text = std::fs::read_to_string(output_of(log)).unwrap_or_default();
    (status.code(), text)
}

/// The run directory's lock is free (no process of the run holds it; the kernel releases the
/// lock of a process as it ends, so it gets a moment).
fn assert_lock_free(dir: &Path) {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(dir.join(".lock"))
        .unwrap();
    let t = Instant::now();
    while f.try_lock().is_err() {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "{}: the lock is still held",
            dir.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    f.unlock().unwrap();
}

/// Whether `last` was saved inside an epoch.
fn last_is_mid_epoch(dir: &Path) -> bool {
    Checkpoint::load(&dir.join("checkpoints/last.safetensors"))
        .is_ok_and(|c| mixprec::train::resume::mid_epoch(&c).is_some())
}

/// The finished run in `dir` equals `reference` bit for bit: every epoch's losses and
/// accuracy, and every tensor of the final checkpoint.
fn assert_same_run(dir: &Path, reference: &Path) {
    let (a, b) = (
        read_jsonl(&dir.join("metrics.jsonl")).unwrap(),
        read_jsonl(&reference.join("metrics.jsonl")).unwrap(),
    );
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x.step, y.step, "epoch {}", x.epoch);
        assert_eq!(
            x.train_loss.to_bits(),
            y.train_loss.to_bits(),
            "epoch {} train loss",
            x.epoch
        );
        assert_eq!(
            x.test_loss.to_bits(),
            y.test_loss.to_bits(),
            "epoch {} test loss",
            x.epoch
        );
        assert_eq!(x.test_accuracy.to_bits(), y.test_accuracy.to_bits());
    }
    let load = |d: &Path| {
        mixprec::io::safetensors::read(&d.join("checkpoints/last.safetensors"))
            .unwrap()
            .0
    };
    let (x, y) = (load(dir), load(reference));
    assert_eq!(x.len(), y.len());
    for ((na, ta), (nb, tb)) in x.iter().zip(&y) {
        assert_eq!(na, nb);
        let bits = |t: &mixprec::Tensor| -> Vec<u64> {
            t.to_vec_f64()
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect()
        };
        assert!(
            bits(ta) == bits(tb),
            "{na} differs from the uninterrupted run's"
        );
    }
    assert!(
        std::fs::read(dir.join("model.safetensors")).unwrap()
            == std::fs::read(reference.join("model.safetensors")).unwrap(),
        "the final weights differ"
    );
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("mixprec-stop-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// An uninterrupted run of `nproc` processes (the reference), and the seconds an epoch took.
fn reference(root: &Path, nproc: usize) -> (PathBuf, Duration) {
    let dir = root.join("reference");
    let pids = root.join("pids-ref");
    let t = Instant::now();
    let child = spawn(&dir, nproc, &pids);
    let (code, out) = wait_all_gone(child, &[], &pids, Duration::from_secs(300));
    assert_eq!(code, Some(0), "{out}");
    (dir, t.elapsed() / config(PathBuf::new()).epochs as u32)
}

/// Ctrl-C / SIGTERM of one process: it stops at a step boundary, saves `last` (inside the
/// epoch), says how to continue, exits with 128 + 15 and frees its lock; `--resume auto`
/// continues to where an uninterrupted run ends, bit for bit.
#[test]
fn sigterm_stops_a_run_at_a_step_and_resume_auto_continues_it_exactly() {
    let root = scratch("single");
    let (reference, epoch) = reference(&root, 1);
    let dir = root.join("stopped");
    let pids = root.join("pids");
    let mut mid_epoch = 0;
    for attempt in 1..=3 {
        let mut child = spawn(&dir, 1, &pids);
        let pid = rank_pids(&pids, 1, &mut child);
        wait_for_epochs(&dir, attempt.min(2), epoch / 2, &mut child);
        signal(child.id(), libc::SIGTERM);
        let (code, out) = wait_all_gone(child, &pid, &pids, Duration::from_secs(60));
        assert_eq!(code, Some(128 + libc::SIGTERM), "{out}");
        assert!(
            out.contains("stopped by SIGTERM")
                && out.contains("to continue, run the same command with --resume auto"),
            "{out}"
        );
        assert_lock_free(&dir);
        if last_is_mid_epoch(&dir) {
            mid_epoch += 1;
            break;
        }
    }
    assert!(mid_epoch > 0, "no stop landed inside an epoch in 3 tries");
    // The rest of the run, as the same command with --resume auto.
    let s = run(&config(dir.clone()), &auto()).unwrap();
    assert_eq!(s.stopped, None);
    assert_same_run(&dir, &reference);
    let _ = std::fs::remove_dir_all(&root);
}

/// The three faults of a launched run, one after another on the same run, each continued by
/// `--resume auto` with the same settings: SIGTERM to the launcher (forwarded; rank 0 saves
/// `last`; the launcher exits 143 after the ranks), `kill -9` of the launcher (its ranks die
/// with it), `kill -9` of one rank (the others stop, the launcher exits 1). Then the run ends
/// where an uninterrupted one of as many ranks does, bit for bit.
fn launched_faults(nproc: usize) {
    let root = scratch(&format!("ranks{nproc}"));
    let (reference, epoch) = reference(&root, nproc);
    let dir = root.join("stopped");
    let pids = root.join("pids");
    let bound = Duration::from_secs(60);

    // SIGTERM to the launcher, inside epoch 2 (or at its end).
    let mut child = spawn(&dir, nproc, &pids);
    let ranks = rank_pids(&pids, nproc, &mut child);
    wait_for_epochs(&dir, 1, epoch / 2, &mut child);
    signal(child.id(), libc::SIGTERM);
    let (code, out) = wait_all_gone(child, &ranks, &pids, bound);
    assert_eq!(code, Some(128 + libc::SIGTERM), "{out}");
    assert!(
        out.contains("launcher: SIGTERM: forwarded to the ranks"),
        "{out}"
    );
    assert!(
        out.contains("to continue, run the same command with --resume auto"),
        "{out}"
    );
    assert_lock_free(&dir);
    let after_term = epochs_done(&dir);

    // kill -9 of the launcher: the ranks go with it.
    let mut child = spawn(&dir, nproc, &pids);
    let ranks = rank_pids(&pids, nproc, &mut child);
    wait_for_epochs(&dir, after_term + 1, Duration::ZERO, &mut child);
    signal(child.id(), libc::SIGKILL);
    let (code, _) = wait_all_gone(child, &ranks, &pids, Duration::from_secs(10));
    assert_eq!(code, None, "killed by a signal");
    assert_lock_free(&dir);

    // kill -9 of the last rank: the others fail naming it, the launcher exits 1.
    let mut child = spawn(&dir, nproc, &pids);
    let ranks = rank_pids(&pids, nproc, &mut child);
    wait_for_epochs(&dir, epochs_done(&dir) + 1, Duration::ZERO, &mut child);
    signal(ranks[nproc - 1], libc::SIGKILL);
    let (code, out) = wait_all_gone(child, &ranks, &pids, bound);
    if epochs_done(&dir) < config(PathBuf::new()).epochs {
        assert_eq!(code, Some(1), "{out}");
        assert!(out.contains(&format!("rank {}", nproc - 1)), "{out}");
    }
    assert_lock_free(&dir);

    // The same command once more: to the end.
    let child = spawn(&dir, nproc, &pids);
    let (code, out) = wait_all_gone(child, &[], &pids, Duration::from_secs(300));
    assert_eq!(code, Some(0), "{out}");
    assert_same_run(&dir, &reference);
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn two_ranks_stopped_killed_and_resumed_end_exactly() {
    launched_faults(2);
}

#[test]
fn three_ranks_stopped_killed_and_resumed_end_exactly() {
    launched_faults(3);
}
