//! The GPT job (`train::gpt::run_gpt`) data-parallel on the CPU backend: real multi-process
//! runs of 2 and 3 ranks, launched as `train_gpt --nproc-per-node` launches them (this test
//! binary starts itself as the ranks: `rank_entry`, selected by `MIXPREC_TEST_ROLE`). Each rank
//! saves its trained model; the test checks that
//!
//! - every rank ends with the same parameters, bit for bit;
//! - they equal one process's trained on the same global batch (`batch_size` × ranks), within
//!   f32 rounding as AdamW carries it (the ranks' average sums in another order), with gradient
//!   accumulation too (where all micro-batches but the last skip the averaging: `no_sync`);
//! - the job's step body (`train::gpt::step_body`) through DDP leaves the first micro-batch's
//!   gradients local and averages only the step's totals;
//! - the loss falls, rank 0 alone writes the run's files, and the losses it reports are the
//!   single process's;
//! - a run stopped and resumed on as many ranks ends where the straight run did; a checkpoint of
//!   2 ranks is refused by 1, naming the world size to use.

use std::path::{Path, PathBuf};

use mixprec::distributed::launch::{launch, LaunchConfig};
use mixprec::distributed::LaunchEnv;
use mixprec::train::gpt::{run_gpt, GptRunConfig, GptRunOptions, GptRunSummary};
use mixprec::train::progress::ProgressMode;
use mixprec::{Device, Error, Result, Tensor};

const ROLE: &str = "MIXPREC_TEST_ROLE";
const OUT: &str = "MIXPREC_TEST_OUT";

/// The entry point of the rank processes; a no-op in a normal test run.
#[test]
fn rank_entry() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let out = PathBuf::from(std::env::var(OUT).expect("MIXPREC_TEST_OUT"));
    let rank = LaunchEnv::from_env().expect("launcher variables").rank;
    let r = match role.as_str() {
        "train_gpt" => worker(&out, rank),
        "no_sync" => worker_no_sync(&out, rank),
        other => Err(Error::invalid_arg(
            "rank_entry",
            "role",
            other,
            "train_gpt or no_sync",
        )),
    };
    match r {
        Ok(()) => std::process::exit(0),
        Err(e) => {
            let _ = std::fs::write(out.join(format!("rank{rank}.err")), format!("{e}\n"));
            std::process::exit(1);
        }
    }
}

/// One rank: the job with the config and options the test wrote, then its results.
fn worker(out: &Path, rank: usize) -> Result<()> {
    let text = std::fs::read_to_string(out.join("config.json"))
        .map_err(|e| Error::io("reading the test's config", e))?;
    let cfg: GptRunConfig = serde_json::from_str(&text)
        .map_err(|e| Error::invalid_arg("worker", "config.json", e, "a GptRunConfig"))?;
    let mut opts = options(&out.join("run"));
    opts.stop_after = std::env::var("MIXPREC_TEST_STOP")
        .ok()
        .and_then(|v| v.parse().ok());
    opts.resume = std::env::var("MIXPREC_TEST_RESUME").ok().map(PathBuf::from);
    let s = run_gpt(&cfg, &opts)?;
    std::fs::write(
        out.join(format!("rank{rank}.summary")),
        format!(
            "{} {} {} {} {}",
            s.world_size,
            s.rank,
            s.steps,
            s.train_loss.to_bits(),
            s.val_loss.to_bits()
        ),
    )
    .map_err(|e| Error::io("writing the summary", e))?;
    mixprec::io::safetensors::write(
        &out.join(format!("rank{rank}.safetensors")),
        &s.state,
        &Default::default(),
    )
}

/// `train::gpt::step_body` through DDP with 2 micro-batches a step, driven by hand: the
/// gradients after the first micro-batch's backward are this rank's own (`no_sync`), after the
/// second the mean over the ranks of the totals. Saves both.
fn worker_no_sync(out: &Path, rank: usize) -> Result<()> {
    use mixprec::amp::{self, OptLevel, Policy};
    use mixprec::distributed::{Backend, DdpConfig, DistributedDataParallel, GroupOptions};
    use mixprec::nn::{Gpt, GptConfig, Module};
    use mixprec::optim::{Sgd, SgdConfig};
    use mixprec::train::gpt::step_body;
    let env = LaunchEnv::from_env()?;
    let group = mixprec::distributed::ProcessGroup::new(&env, &GroupOptions::new(Backend::Cpu))?;
    let mut cfg = GptConfig::named("tiny")?;
    cfg.vocab_size = GptConfig::padded_vocab(100);
    cfg.n_layer = 1;
    cfg.block_size = 8;
    let model = Gpt::new(cfg, 3, &Device::Cpu)?;
    let opt = Sgd::new(model.parameters(), SgdConfig::default())?;
    let (model, _opt) = amp::initialize(model, opt, Policy::opt_level(OptLevel::O0))?;
    let model = std::sync::Arc::new(model);
    let ddp = DistributedDataParallel::new(model.clone(), &group, DdpConfig::default())?;
    let mut body = step_body(&model, Some(&ddp), 2);
    let ids = |seed: u64| -> Result<Tensor> {
        let v: Vec<i64> = (0..16)
            .map(|i| ((i as u64 * 7 + seed * 13) % 97) as i64)
            .collect();
        Tensor::from_vec(v, vec![2, 8], Device::Cpu)
    };
    let grads = |tag: &str| -> Vec<(String, Tensor)> {
        model
            .named_parameters()
            .into_iter()
            .filter_map(|(n, p)| p.grad().map(|g| (format!("{tag}.{n}"), g.detach())))
            .collect()
    };
    let mut saved = Vec::new();
    for micro in 0..2u64 {
        let seed = 10 * micro + rank as u64;
        body(&ids(seed)?, &ids(seed + 100)?)?.backward()?;
        saved.extend(grads(&format!("after{micro}")));
    }
    mixprec::io::safetensors::write(
        &out.join(format!("rank{rank}.safetensors")),
        &saved,
        &Default::default(),
    )
}

fn corpus(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    let text = "To be, or not to be, that is the question: whether 'tis nobler in the mind to \
                suffer the slings and arrows of outrageous fortune.\nOr to take arms against a \
                sea of troubles, and by opposing end them.\n";
    std::fs::write(dir.join("hamlet.txt"), text.repeat(80)).unwrap();
}

/// A tiny GPT, `batch` sequences per rank, `accum` micro-batches per step.
fn config(data: &Path, batch: usize, accum: usize, steps: u64) -> GptRunConfig {
    GptRunConfig {
        model: Some("tiny".into()),
        data: Some(data.to_path_buf()),
        context: Some(32),
        batch_size: Some(batch),
        grad_accum: Some(accum),
        steps: Some(steps),
        lr: Some(3e-3),
        warmup: Some(1),
        eval_every: Some(3),
        eval_batches: Some(1),
        sample_tokens: Some(4),
        prompt: Some("To be".into()),
        ..Default::default()
    }
}

fn options(out: &Path) -> GptRunOptions {
    GptRunOptions {
        out: out.to_path_buf(),
        device: Device::Cpu,
        resume: None,
        overwrite: false,
        progress: ProgressMode::Off,
        stop_after: None,
    }
}

/// What the ranks of one launched run left.
struct Ranks {
    dir: PathBuf,
    n: usize,
}

impl Ranks {
    fn state(&self, rank: usize) -> Vec<(String, Tensor)> {
        mixprec::io::safetensors::read(&self.dir.join(format!("rank{rank}.safetensors")))
            .unwrap_or_else(|e| panic!("rank {rank}'s model: {e}"))
            .0
    }

    /// world, rank, steps, train loss, val loss.
    fn summary(&self, rank: usize) -> (usize, usize, u64, f64, f64) {
        let s = std::fs::read_to_string(self.dir.join(format!("rank{rank}.summary"))).unwrap();
        let v: Vec<u64> = s.split(' ').map(|x| x.parse().unwrap()).collect();
        (
            v[0] as usize,
            v[1] as usize,
            v[2],
            f64::from_bits(v[3]),
            f64::from_bits(v[4]),
        )
    }

    fn run_dir(&self) -> PathBuf {
        self.dir.join("run")
    }
}

/// Launches `n` ranks of the job with `cfg` in `dir` (its `run/` is the job's --out).
fn launch_ranks(dir: &Path, n: usize, cfg: &GptRunConfig, env: &[(&str, String)]) -> Ranks {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), serde_json::to_string(cfg).unwrap()).unwrap();
    launch_role("train_gpt", dir, n, env)
}

/// Launches `n` ranks of `role` writing into `dir`.
fn launch_role(role: &str, dir: &Path, n: usize, env: &[(&str, String)]) -> Ranks {
    std::fs::create_dir_all(dir).unwrap();
    let exe = std::env::current_exe().unwrap();
    let mut lc = LaunchConfig::new(
        n,
        exe,
        ["rank_entry", "--exact", "--nocapture", "--test-threads=1"]
            .iter()
            .map(Into::into)
            .collect(),
    );
    lc.env = vec![
        (ROLE.into(), role.into()),
        (OUT.into(), dir.display().to_string()),
        ("MIXPREC_DIST_TIMEOUT".into(), "60".into()),
    ];
    for (k, v) in env {
        lc.env.push((k.to_string(), v.clone()));
    }
    if let Err(e) = launch(&lc) {
        let errs: Vec<String> = (0..n)
            .filter_map(|r| std::fs::read_to_string(dir.join(format!("rank{r}.err"))).ok())
            .collect();
        panic!("the ranks failed: {e}\n{}", errs.join("\n"));
    }
    Ranks {
        dir: dir.to_path_buf(),
        n,
    }
}

fn values(t: &Tensor) -> Vec<f64> {
    t.to_vec_f64().unwrap()
}

/// Every rank holds rank 0's parameters, bit for bit.
fn assert_ranks_equal(run: &Ranks) -> Vec<(String, Tensor)> {
    let base = run.state(0);
    for r in 1..run.n {
        let other = run.state(r);
        assert_eq!(base.len(), other.len());
        for ((na, a), (nb, b)) in base.iter().zip(&other) {
            assert_eq!(na, nb);
            let same = values(a)
                .iter()
                .zip(values(b))
                .all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same, "rank {r} differs from rank 0 in {na}");
        }
    }
    base
}

/// The largest |a − b| over every parameter, and where.
fn max_abs_diff(got: &[(String, Tensor)], want: &[(String, Tensor)]) -> (f64, String) {
    let mut worst = (0.0f64, String::new());
    assert_eq!(got.len(), want.len());
    // A saved file lists its tensors by name; a state dict in the module's order.
    let sorted = |v: &[(String, Tensor)]| {
        let mut v = v.to_vec();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    };
    let (got, want) = (sorted(got), sorted(want));
    for ((n, g), (m, w)) in got.iter().zip(&want) {
        assert_eq!(n, m);
        for (a, b) in values(g).iter().zip(values(w)) {
            let d = (a - b).abs();
            if d > worst.0 || d.is_nan() {
                worst = (d, n.clone());
            }
        }
    }
    worst
}

/// `n` ranks of `batch` sequences against one process on `n * batch`, `accum` micro-batches
/// per step each.
fn matches_one_process(name: &str, n: usize, batch: usize, accum: usize) {
    let tmp = scratch(name);
    let data = tmp.join("text");
    corpus(&data);
    let steps = 6;
    let ranks = launch_ranks(
        &tmp.join("ddp"),
        n,
        &config(&data, batch, accum, steps),
        &[],
    );
    let got = assert_ranks_equal(&ranks);
    for r in 0..n {
        let (world, rank, done, _, _) = ranks.summary(r);
        assert_eq!((world, rank, done), (n, r, steps));
    }
    let one: GptRunSummary = run_gpt(
        &config(&data, n * batch, accum, steps),
        &options(&tmp.join("one")),
    )
    .unwrap();
    assert_eq!(one.world_size, 1);
    let (err, at) = max_abs_diff(&got, &one.state);
    eprintln!(
        "{n} ranks x batch {batch} (accum {accum}) vs one process: max |Δparam| {err:.3e} ({at})"
    );
    // The gradients agree within f32 rounding (the ranks' mean sums in another order); AdamW's
    // m / sqrt(v) magnifies that for entries whose gradient is itself at rounding level (an
    // update of up to lr = 3e-3 a step, in either direction): measured 6e-6 (2 ranks), 4e-5
    // (2 ranks, accumulating) and 1.2e-4 (3 ranks) after 6 steps, against 1.8e-2 for a sign
    // flip in all of them.
    assert!(err < 5e-4, "{n} ranks vs one process: {err:e} in {at}");
    // The losses rank 0 reports are the means over the ranks: the single process's.
    let (_, _, _, train, val) = ranks.summary(0);
    assert!(
        (train - one.train_loss).abs() < 1e-4 && (val - one.val_loss).abs() < 1e-4,
        "train {train} vs {}, val {val} vs {}",
        one.train_loss,
        one.val_loss
    );
    // ln(50304) ≈ 10.8 at the start.
    assert!(train < 10.0 && val < 10.0, "train {train}, val {val}");
    // Rank 0 alone wrote the run's files; the others' losses are the same means.
    let run = ranks.run_dir();
    for f in [
        "metrics.csv",
        "model.safetensors",
        "checkpoints/last.safetensors",
    ] {
        assert!(run.join(f).is_file(), "{f}");
    }
    let csv = std::fs::read_to_string(run.join("metrics.csv")).unwrap();
    assert_eq!(
        csv.lines().count(),
        3,
        "a header and one row per round:\n{csv}"
    );
    let first: f64 = csv
        .lines()
        .nth(1)
        .unwrap()
        .split(',')
        .nth(2)
        .unwrap()
        .parse()
        .unwrap();
    assert!(train < first, "the train loss fell: {first} then {train}");
    for r in 1..n {
        let (_, _, _, t, v) = ranks.summary(r);
        assert_eq!((t.to_bits(), v.to_bits()), (train.to_bits(), val.to_bits()));
    }
}

#[test]
fn two_ranks_train_as_one_process_on_the_global_batch() {
    matches_one_process("gpt-ddp2", 2, 2, 1);
}

/// `zero = true`: the ZeRO-sharded AdamW in place of DDP's all-reduce ends where DDP + the
/// fused AdamW do (within f32 rounding: the clip's global norm sums the shares' squares in
/// another order), and rank 0's checkpoint (the consolidated state, gathered from every rank)
/// is written.
#[test]
fn two_ranks_with_the_sharded_optimizer_train_as_ddp_does() {
    let tmp = scratch("gpt-zero2");
    let data = tmp.join("text");
    corpus(&data);
    let cfg = config(&data, 2, 1, 6);
    let ddp = launch_ranks(&tmp.join("ddp"), 2, &cfg, &[]);
    let zero_cfg = GptRunConfig {
        zero: Some(true),
        ..cfg.clone()
    };
    let zero = launch_ranks(&tmp.join("zero"), 2, &zero_cfg, &[]);
    let want = assert_ranks_equal(&ddp);
    let got = assert_ranks_equal(&zero);
    let (err, at) = max_abs_diff(&got, &want);
    eprintln!("2 ranks, ZeRO vs DDP: max |dparam| {err:.3e} ({at})");
    assert!(err < 5e-4, "ZeRO vs DDP: {err:e} in {at}");
    assert!(zero
        .run_dir()
        .join("checkpoints/last.safetensors")
        .is_file());
}

#[test]
fn two_ranks_accumulating_gradients_train_as_one_process() {
    matches_one_process("gpt-ddp2-accum", 2, 2, 2);
}

#[test]
fn three_ranks_train_as_one_process_on_the_global_batch() {
    matches_one_process("gpt-ddp3", 3, 1, 1);
}

/// With gradient accumulation through DDP, the step body averages only the step's totals: after
/// the first micro-batch each rank holds its own gradients, after the last every rank holds the
/// same, the mean of the ranks' sums.
#[test]
fn accumulating_through_ddp_averages_only_the_totals() {
    let tmp = scratch("gpt-ddp-no-sync");
    let run = launch_role("no_sync", &tmp, 2, &[]);
    let (a, b) = (run.state(0), run.state(1));
    let get = |v: &[(String, Tensor)], name: &str| -> Vec<f64> {
        values(&v.iter().find(|(n, _)| n == name).unwrap().1)
    };
    let mut checked = 0;
    for (name, _) in a.iter().filter(|(n, _)| n.starts_with("after0.")) {
        let last = name.replacen("after0.", "after1.", 1);
        let (a0, b0) = (get(&a, name), get(&b, name));
        let (a1, b1) = (get(&a, &last), get(&b, &last));
        assert_ne!(
            a0, b0,
            "{name}: the first micro-batch's gradients stayed local"
        );
        let same = a1.iter().zip(&b1).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same, "{last}: the ranks hold the same averaged totals");
        checked += 1;
    }
    assert!(checked > 5, "{checked} gradients compared");
}

/// Stopped after 3 steps and resumed on 2 ranks, the run ends bit for bit where the straight
/// 2-rank run did; one process refuses the 2-rank checkpoint.
#[test]
fn a_two_rank_run_resumes_on_two_ranks_only() {
    let tmp = scratch("gpt-ddp-resume");
    let data = tmp.join("text");
    corpus(&data);
    let cfg = config(&data, 2, 1, 6);
    let straight = launch_ranks(&tmp.join("straight"), 2, &cfg, &[]);
    let split = tmp.join("split");
    launch_ranks(&split, 2, &cfg, &[("MIXPREC_TEST_STOP", "3".into())]);
    let last = split.join("run/checkpoints/last.safetensors");
    let resumed = launch_ranks(
        &split,
        2,
        &cfg,
        &[("MIXPREC_TEST_RESUME", last.display().to_string())],
    );
    let (a, b) = (assert_ranks_equal(&straight), assert_ranks_equal(&resumed));
    assert_eq!(max_abs_diff(&a, &b).0, 0.0);
    assert_eq!(
        straight.summary(0).3.to_bits(),
        resumed.summary(0).3.to_bits()
    );

    let mut o = options(&split.join("run"));
    o.resume = Some(last);
    let e = run_gpt(&cfg, &o).unwrap_err().to_string();
    assert!(
        e.contains("written by 2 process(es)") && e.contains("--nproc-per-node 2"),
        "{e}"
    );
}

/// A fresh scratch directory for one test (removed first if a crashed run left it).
/// A fresh directory under the system's temp dir, removed with everything in it when dropped
/// (the ranks' checkpoints run to hundreds of MB per test).
struct Scratch(PathBuf);

impl std::ops::Deref for Scratch {
    type Target = std::path::Path;
    fn deref(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn scratch(name: &str) -> Scratch {
    let d = std::env::temp_dir().join(format!("mixprec-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    Scratch(d)
}
