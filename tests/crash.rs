//! `kill -9` at random moments of a training run (checkpoint saves included): after every kill
//! the run directory holds a checkpoint that loads and verifies (or none yet), its lock is free
//! again, and `Resume::Auto` (`train_resnet --resume auto`) carries the run to its end with
//! exactly the numbers and weights of a run never interrupted.
//!
//! The run being killed is this test binary run again as a child process, executing the
//! ignored test `crash_child` with the run directory in an environment variable.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use mixprec::io;
use mixprec::train::{run, RunConfig};

#[path = "common/train_run.rs"]
mod train_run;
use train_run::{auto, options, small_cpu_run};

const CHILD_DIR: &str = "MIXPREC_CRASH_CHILD_DIR";

/// Short epochs (4 steps, a small test set), so that saves (two a epoch) are a good part of
/// the time and kills often land in one.
fn config(out: PathBuf) -> RunConfig {
    small_cpu_run(out, 8)
}

/// The process that gets killed (run by the test below; does nothing on its own).
#[test]
#[ignore = "the child process of kill_9_at_random_moments_then_resume_auto_is_exact"]
fn crash_child() {
    if let Some(dir) = std::env::var_os(CHILD_DIR) {
        run(&config(PathBuf::from(dir)), &auto()).unwrap();
    }
}

fn spawn_child(dir: &Path) -> std::process::Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["crash_child", "--exact", "--ignored", "--test-threads=1"])
        .env(CHILD_DIR, dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// A small deterministic generator for the kill times (the seed is printed on failure).
struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % n
    }
}

#[test]
fn kill_9_at_random_moments_then_resume_auto_is_exact() {
    let root = std::env::temp_dir().join(format!("mixprec-crash-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let t = Instant::now();
    let full = run(&config(root.join("full")), &options(None, None)).unwrap();
    // Each child starts where the last one was killed: kill it within about three epochs of
    // its start (a process start and the data load take a few hundred milliseconds), so that
    // the run takes several kills, some before the first checkpoint, some inside saves.
    let epoch_ms = t.elapsed().as_millis() as u64 / full.history.len() as u64;
    let mut span = 3 * epoch_ms + 600;
    let dir = root.join("killed");
    let seed = std::env::var("MIXPREC_CRASH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5eed);
    let mut rng = Lcg(seed);
    let (mut kills, mut epochs_seen) = (0, Vec::new());
    // A child may run its epochs faster than this process's first run did (which paid for the
    // first data load and warm-up): when a run ends after fewer than 3 kills, it starts over
    // with kills twice as early.
    for _attempt in 0..4 {
        let _ = std::fs::remove_dir_all(&dir);
        let mut finished = false;
        (kills, epochs_seen) = (0, Vec::new());
        while kills < 10 && !finished {
            let mut child = spawn_child(&dir);
            let delay = Duration::from_millis(100 + rng.below(span));
            let started = Instant::now();
            while started.elapsed() < delay {
                if child.try_wait().unwrap().is_some() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            match child.try_wait().unwrap() {
                Some(status) => {
                    assert!(status.success(), "seed {seed}: the child failed: {status}");
                    finished = true;
                }
                None => {
                    child.kill().unwrap(); // SIGKILL
                    child.wait().unwrap();
                    kills += 1;
                }
            }
            // Whatever moment it died at: the newest checkpoint loads and verifies (or there
            // is none yet), never an error.
            let latest = io::latest(&dir.join("checkpoints"))
                .unwrap_or_else(|e| panic!("seed {seed}, kill {kills}: no checkpoint loads: {e}"));
            epochs_seen.push(latest.map_or(0, |l| l.checkpoint.progress.epoch));
        }
        if kills >= 3 {
            break;
        }
        eprintln!("seed {seed}: {kills} kills within {span} ms: again, with kills sooner");
        span = (span / 2).max(50);
    }
    // The rest of the run in this process (the lock of the last killed child is free).
    let resumed = run(&config(dir.clone()), &auto()).unwrap();
    eprintln!("seed {seed}: {kills} kills, newest checkpoint after each: epochs {epochs_seen:?}");
    assert_eq!(resumed.history.len(), full.history.len(), "seed {seed}");
    for (a, b) in full.history.iter().zip(&resumed.history) {
        assert_eq!(
            a.train_loss.to_bits(),
            b.train_loss.to_bits(),
            "seed {seed}: epoch {}: {} vs {}",
            a.epoch,
            a.train_loss,
            b.train_loss
        );
        assert_eq!(a.test_loss.to_bits(), b.test_loss.to_bits(), "seed {seed}");
        assert_eq!(a.step, b.step);
    }
    // The final weights, whoever wrote them (a child that got to the end, or the resume).
    let weights = |d: &Path| std::fs::read(d.join("model.safetensors")).unwrap();
    assert!(
        weights(&root.join("full")) == weights(&dir),
        "seed {seed}: the final weights differ"
    );
    assert!(
        kills >= 3,
        "seed {seed}: only {kills} kills: the run is too short to test"
    );
    // No temporary file of an interrupted save is left once the run has been resumed, even
    // when the resume had nothing left to save (a kill inside the last epoch's saves).
    let leftovers: Vec<_> = std::fs::read_dir(dir.join("checkpoints"))
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains(".tmp-"))
        .map(|e| e.file_name())
        .collect();
    assert!(leftovers.is_empty(), "seed {seed}: {leftovers:?}");
    let _ = std::fs::remove_dir_all(&root);
}
