//! Data-parallel training on the CPU backend (src/distributed): real multi-process runs with 2
//! and 3 ranks. The test binary launches itself as the ranks (`rank_entry` below, selected by
//! `MIXPREC_TEST_ROLE`) through `distributed::launch`, as `train_resnet --nproc-per-node` does;
//! each rank writes what it saw into a directory the test then checks.
//!
//! - collectives: every op and dtype, broadcast, all-gather, barrier, host gathers; ranks that
//!   disagree on a collective are named;
//! - DDP on a small ResNet with SyncBatchNorm: 2 and 3 ranks end bitwise equal to each other and
//!   equal (within f32 rounding of the reduction order) to one process on the global batch, with
//!   each rank's model initialised differently before the wrap (rank 0's wins); the same at O2;
//! - `no_sync` accumulation (O0 and O2): local gradients during `no_sync`, then the average of
//!   the totals;
//! - AMP: an Inf planted in one rank's batch makes every rank skip that step;
//! - faults: a killed rank and a hung rank make the others fail within a bounded time with an
//!   error naming the rank; mismatched models and dtypes are reported at wrap time.
//!
//! In-process tests cover the environment parsing, the rendezvous's refusals and the sampler.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use mixprec::amp::{self, OptLevel, Policy};
use mixprec::data::{DataLoader, DistributedSampler, SyntheticDataset};
use mixprec::distributed::launch::{launch, LaunchConfig, RankExit};
use mixprec::distributed::{
    convert_sync_batchnorm, Backend, DdpConfig, DistributedDataParallel, GroupOptions, LaunchEnv,
    Launcher, ProcessGroup, ReduceOp,
};
use mixprec::nn::{cross_entropy, BlockKind, Linear, Module, ReLU, ResNet, ResNetConfig};
use mixprec::nn::{Sequential, Stem};
use mixprec::optim::{Sgd, SgdConfig};
use mixprec::{DType, Device, Error, Result, Tensor};

const ROLE: &str = "MIXPREC_TEST_ROLE";
const OUT: &str = "MIXPREC_TEST_OUT";
const LEVEL: &str = "MIXPREC_TEST_LEVEL";
const CPU: Device = Device::Cpu;

// ---- the rank processes ------------------------------------------------------------------------

/// The entry point of the rank processes the tests launch; a no-op in a normal test run.
#[test]
fn rank_entry() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let out = PathBuf::from(std::env::var(OUT).expect("MIXPREC_TEST_OUT"));
    let env = LaunchEnv::from_env().expect("launcher variables");
    let r = match role.as_str() {
        "collectives" => worker_collectives(&env),
        "disagree" => worker_disagree(&env),
        "train" => worker_train(&env, &out),
        "accum" => worker_accum(&env, &out),
        "inf" => worker_inf(&env, &out),
        "die" => worker_die(&env),
        "hang" => worker_hang(&env),
        "early" => worker_early(&env),
        "mismatch-shape" | "mismatch-dtype" => worker_mismatch(&env, &role),
        #[cfg(feature = "train")]
        "trainer" => worker_trainer(&env, &out),
        "buffers" => worker_buffers(&env, &out, DType::F32),
        // F64 buffers take the broadcast's general path (no flat multi-tensor copy for F64).
        "buffers-f64" => worker_buffers(&env, &out, DType::F64),
        other => Err(Error::invalid_arg(
            "rank_entry",
            "role",
            other,
            "a known role",
        )),
    };
    match r {
        Ok(()) => std::process::exit(0),
        Err(e) => {
            let culprit = match &e {
                Error::Distributed { culprit, .. } => format!("{culprit:?}"),
                _ => "not a distributed error".into(),
            };
            let _ = std::fs::write(
                out.join(format!("rank{}.err", env.rank)),
                format!("culprit {culprit}\n{e}\n"),
            );
            eprintln!("rank {}: {e}", env.rank);
            std::process::exit(3);
        }
    }
}

fn group(env: &LaunchEnv) -> Result<ProcessGroup> {
    ProcessGroup::new(env, &GroupOptions::new(Backend::Cpu))
}

fn check(ok: bool, what: impl FnOnce() -> String) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(Error::Backward(format!("check failed: {}", what())))
    }
}

fn worker_collectives(env: &LaunchEnv) -> Result<()> {
    let g = group(env)?;
    let (r, n) = (env.rank as f64, env.world_size as f64);
    // Values that every dtype holds exactly: rank r contributes (r+1)·(i+1).
    for dtype in [DType::F32, DType::F16, DType::BF16, DType::F64] {
        let mk = || {
            let v: Vec<f64> = (0..5).map(|i| (r + 1.0) * (i as f64 + 1.0)).collect();
            Tensor::from_vec(v, [5], CPU)?.to_dtype(dtype)
        };
        let tri = n * (n + 1.0) / 2.0;
        for (op, want) in [
            (ReduceOp::Sum, tri),
            (ReduceOp::Avg, tri / n),
            (ReduceOp::Max, n),
            (ReduceOp::Min, 1.0),
        ] {
            let t = mk()?;
            g.all_reduce(&t, op)?;
            let got = t.to_vec_f64()?;
            let expect: Vec<f64> = (0..5).map(|i| want * (i as f64 + 1.0)).collect();
            check(t.dtype() == dtype && got == expect, || {
                format!("{dtype} {op:?}: got {got:?}, want {expect:?}")
            })?;
        }
        let t = mk()?;
        g.broadcast(&t, env.world_size - 1)?;
        let got = t.to_vec_f64()?;
        check(got == vec![n, 2.0 * n, 3.0 * n, 4.0 * n, 5.0 * n], || {
            format!("{dtype} broadcast: {got:?}")
        })?;
        let all = g.all_gather(&mk()?)?;
        check(all.dims() == [env.world_size, 5], || {
            format!("{:?}", all.dims())
        })?;
        let got = all.to_vec_f64()?;
        for q in 0..env.world_size {
            for i in 0..5 {
                let want = (q as f64 + 1.0) * (i as f64 + 1.0);
                check(got[q * 5 + i] == want, || {
                    format!("{dtype} all_gather {got:?}")
                })?;
            }
        }
    }
    // Integers, NaN in a max, an Avg of integers refused.
    let t = Tensor::from_vec(vec![env.rank as i64 * 10, 7], [2], CPU)?;
    g.all_reduce(&t, ReduceOp::Sum)?;
    let want = vec![
        (0..env.world_size as i64).sum::<i64>() * 10,
        7 * env.world_size as i64,
    ];
    check(t.to_vec::<i64>()? == want, || {
        format!("i64 sum {:?}", t.to_vec::<i64>())
    })?;
    check(g.all_reduce(&t, ReduceOp::Avg).is_err(), || {
        "i64 avg accepted".into()
    })?;
    let v = if env.rank == 1 { f32::NAN } else { 1.0 };
    let t = Tensor::from_vec(vec![v], [1], CPU)?;
    g.all_reduce(&t, ReduceOp::Max)?;
    check(t.to_vec::<f32>()?[0].is_nan(), || "NaN lost in max".into())?;
    // Half sums are computed in f32 and rounded once, in rank order: every rank the same bits.
    let t =
        Tensor::from_vec(vec![1.0f32 / 3.0 + r as f32 * 1e-3], [1], CPU)?.to_dtype(DType::F16)?;
    g.all_reduce(&t, ReduceOp::Sum)?;
    let bits = g.all_gather_bytes(&t.to_vec_f64()?[0].to_le_bytes())?;
    check(bits.iter().all(|b| *b == bits[0]), || {
        "ranks differ after a sum".into()
    })?;
    // A queued all-reduce, a barrier, host gathers, device checks.
    let t = Tensor::ones([1000], DType::F32, CPU)?;
    let w = g.all_reduce_async(&t, ReduceOp::Sum)?;
    w.wait()?;
    check(t.to_vec::<f32>()?.iter().all(|&x| x == n as f32), || {
        "async".into()
    })?;
    g.barrier()?;
    let names = g.all_gather_bytes(format!("rank {}", env.rank).as_bytes())?;
    for (q, b) in names.iter().enumerate() {
        check(*b == format!("rank {q}").into_bytes(), || {
            format!("{names:?}")
        })?;
    }
    let root = g.broadcast_bytes(b"from root", 0)?;
    check(root == b"from root", || format!("{root:?}"))?;
    check(g.broadcast(&t, env.world_size).is_err(), || {
        "root out of range".into()
    })?;
    Ok(())
}

fn worker_disagree(env: &LaunchEnv) -> Result<()> {
    let g = group(env)?;
    let t = Tensor::ones([4], DType::F32, CPU)?;
    g.all_reduce(&t, ReduceOp::Sum)?;
    if env.rank == 1 {
        g.all_gather(&t)?;
    } else {
        g.all_reduce(&t, ReduceOp::Sum)?;
    }
    Err(Error::Backward(
        "a disagreeing collective went through".into(),
    ))
}

/// The small ResNet of the equality test (SyncBatchNorm makes its statistics global).
fn tiny_resnet(seed: u64) -> Result<ResNet> {
    ResNet::new(
        &ResNetConfig {
            block: BlockKind::Basic,
            blocks: vec![1, 1],
            widths: vec![8, 16],
            in_channels: 1,
            num_classes: 4,
            stem: Stem::Small,
            zero_init_residual: false,
            seed,
        },
        &CPU,
    )
}

const GLOBAL_BATCH: usize = 12;
const STEPS: usize = 3;

fn sgd() -> SgdConfig {
    SgdConfig {
        lr: 0.1,
        momentum: 0.9,
        weight_decay: 1e-4,
        ..Default::default()
    }
}

/// Step `step`'s global batch: images [12, 1, 8, 8] and labels.
fn global_batch(step: usize) -> Result<(Tensor, Tensor)> {
    let x = Tensor::randn(
        [GLOBAL_BATCH, 1, 8, 8],
        0.0,
        1.0,
        100 + step as u64,
        DType::F32,
        CPU,
    )?;
    let y: Vec<i64> = (0..GLOBAL_BATCH).map(|i| ((i + step) % 4) as i64).collect();
    Ok((x, Tensor::from_vec(y, [GLOBAL_BATCH], CPU)?))
}

fn shard(t: &Tensor, rank: usize, world: usize) -> Result<Tensor> {
    let per = t.dims()[0] / world;
    t.narrow(0, rank * per, per)
}

fn level_of(s: &str) -> OptLevel {
    match s {
        "O2" => OptLevel::O2,
        "O1" => OptLevel::O1,
        "O3" => OptLevel::O3,
        _ => OptLevel::O0,
    }
}

fn save(out: &Path, name: &str, tensors: Vec<(String, Tensor)>) -> Result<()> {
    mixprec::io::safetensors::write(&out.join(name), &tensors, &Default::default())
}

/// broadcast_buffers: each rank first gives its batch-norm statistics values of its own, then
/// runs one training forward through DDP on a batch all ranks share. The forward starts from
/// rank 0's statistics, so after it every rank holds the same; the rank saves them. The model
/// and the batch are in `dtype`.
fn worker_buffers(env: &LaunchEnv, out: &Path, dtype: DType) -> Result<()> {
    let g = group(env)?;
    let model = tiny_resnet(0)?;
    let mut floats = Vec::new();
    model.visit("", &mut |i| {
        if i.tensor.dtype().is_float() {
            floats.push(i.tensor.clone());
        }
    });
    for t in floats {
        t.cast_in_place(dtype)?;
    }
    let ddp = DistributedDataParallel::new(model, &g, DdpConfig::default())?;
    let r = env.rank as f64;
    let mut floats = 0;
    for (_, b) in ddp.named_buffers() {
        if b.dtype().is_float() {
            let _ng = mixprec::no_grad();
            b.copy_in_place(&b.affine(r + 1.0, r)?)?;
            floats += 1;
        }
    }
    check(floats > 0, || "the net has float buffers".into())?;
    for step in 0..2 {
        let x = Tensor::randn([4, 1, 8, 8], 0.0, 1.0, 7 + step, dtype, CPU)?;
        ddp.forward(&x)?;
    }
    save(
        out,
        &format!("rank{}.safetensors", env.rank),
        ddp.named_buffers(),
    )
}

fn worker_train(env: &LaunchEnv, out: &Path) -> Result<()> {
    let level = level_of(&std::env::var(LEVEL).unwrap_or_default());
    let g = group(env)?;
    // Each rank starts from other weights: the wrap copies rank 0's everywhere.
    let model = tiny_resnet(1 + env.rank as u64)?;
    convert_sync_batchnorm(&model, &g)?;
    let opt = Sgd::new(model.parameters(), sgd())?;
    let policy = Policy::opt_level(level).with_report_interval(0);
    let (model, mut opt) = amp::initialize(model, opt, policy)?;
    let cfg = DdpConfig {
        // Several buckets, so that some start while backward still runs.
        bucket_cap_mb: 0.004,
        first_bucket_mb: 0.001,
        ..Default::default()
    };
    let ddp = DistributedDataParallel::new(model, &g, cfg)?;
    check(ddp.buckets().len() > 2, || {
        format!("buckets {:?}", ddp.buckets())
    })?;
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let (x, y) = global_batch(step)?;
        let (x, y) = (
            shard(&x, env.rank, env.world_size)?,
            shard(&y, env.rank, env.world_size)?,
        );
        let loss = cross_entropy(&ddp.forward(&x)?, &y)?;
        opt.zero_grad()?;
        opt.backward(&loss)?;
        opt.step()?;
        losses.push(loss.item()? as f32);
    }
    let stats = ddp.last_reduction();
    check(
        stats.launched_during_backward > 0 && stats.buckets == ddp.buckets().len(),
        || format!("no bucket started during backward: {stats:?}"),
    )?;
    let mut sd = ddp.module().state_dict()?;
    sd.push(("losses".into(), Tensor::from_vec(losses, [STEPS], CPU)?));
    save(out, &format!("rank{}.safetensors", env.rank), sd)
}

/// The reference of the equality test: one process, the global batch, plain BatchNorm.
fn train_single(level: OptLevel) -> Result<Vec<(String, Tensor)>> {
    let model = tiny_resnet(1)?;
    let opt = Sgd::new(model.parameters(), sgd())?;
    let policy = Policy::opt_level(level).with_report_interval(0);
    let (model, mut opt) = amp::initialize(model, opt, policy)?;
    for step in 0..STEPS {
        let (x, y) = global_batch(step)?;
        let loss = cross_entropy(&model.forward(&x)?, &y)?;
        opt.zero_grad()?;
        opt.backward(&loss)?;
        opt.step()?;
    }
    model.state_dict()
}

/// A small MLP (no batch norm) for the accumulation, overflow and fault tests.
fn mlp(hidden: usize, seed: u64) -> Result<Sequential> {
    Ok(Sequential::new()
        .with(Linear::new(6, hidden, true, &CPU, seed)?)
        .with(ReLU::new())
        .with(Linear::new(hidden, 3, true, &CPU, seed + 1)?))
}

/// Rank `rank`'s micro-batch `k` (4 rows).
fn micro_batch(rank: usize, k: usize) -> Result<(Tensor, Tensor)> {
    let seed = 1000 + 10 * rank as u64 + k as u64;
    let x = Tensor::randn([4, 6], 0.0, 1.0, seed, DType::F32, CPU)?;
    let y: Vec<i64> = (0..4).map(|i| ((i + rank + k) % 3) as i64).collect();
    Ok((x, Tensor::from_vec(y, [4], CPU)?))
}

fn grads_of(m: &dyn Module) -> Result<Vec<(String, Tensor)>> {
    m.named_parameters()
        .into_iter()
        .map(|(n, p)| {
            let g = p
                .grad()
                .ok_or_else(|| Error::Backward(format!("no grad for {n}")))?;
            Ok((format!("grad.{n}"), g.to_dtype(DType::F32)?))
        })
        .collect()
}

fn worker_accum(env: &LaunchEnv, out: &Path) -> Result<()> {
    let spec = std::env::var(LEVEL).unwrap_or_default();
    let level = level_of(&spec[..2.min(spec.len())]);
    // "-predivide": apex's gradient_predivide_factor; "-f32": f16 gradients reduced in f32.
    let cfg = DdpConfig {
        gradient_predivide_factor: spec.ends_with("-predivide").then_some(2.0),
        allreduce_dtype: spec.ends_with("-f32").then_some(DType::F32),
        ..Default::default()
    };
    let g = group(env)?;
    let model = mlp(16, 7)?;
    let opt = Sgd::new(model.parameters(), sgd())?;
    // A static scale of 1, so that the gradients read below are the true ones.
    let policy = Policy::opt_level(level)
        .with_loss_scale(amp::LossScale::Static(1.0))
        .with_report_interval(0);
    if spec.ends_with("-ddp-first") {
        // PyTorch's order: wrap first, then let AMP cast the wrapped model.
        let ddp = DistributedDataParallel::new(model, &g, DdpConfig::default())?;
        let (model, mut opt) = amp::initialize(ddp, opt, policy)?;
        return accumulate(env, out, &model, model.inner(), &mut opt);
    }
    let (model, mut opt) = amp::initialize(model, opt, policy)?;
    let ddp = DistributedDataParallel::new(model, &g, cfg)?;
    accumulate(env, out, &ddp, &ddp, &mut opt)
}

/// Two micro-batches through `model`, the first under `ddp`'s `no_sync`, then a step; saves
/// the gradients after each.
fn accumulate<M: Module>(
    env: &LaunchEnv,
    out: &Path,
    model: &dyn Module,
    ddp: &DistributedDataParallel<M>,
    opt: &mut amp::AmpOptimizer<Sgd>,
) -> Result<()> {
    opt.zero_grad()?;
    {
        let _local = ddp.no_sync();
        let (x, y) = micro_batch(env.rank, 0)?;
        opt.backward(&cross_entropy(&model.forward(&x)?, &y)?)?;
    }
    let after_first = grads_of(ddp)?;
    let (x, y) = micro_batch(env.rank, 1)?;
    opt.backward(&cross_entropy(&model.forward(&x)?, &y)?)?;
    let after_second = grads_of(ddp)?;
    opt.step()?;
    let mut all: Vec<(String, Tensor)> = after_first
        .into_iter()
        .map(|(n, t)| (format!("first.{n}"), t))
        .chain(
            after_second
                .into_iter()
                .map(|(n, t)| (format!("second.{n}"), t)),
        )
        .collect();
    all.extend(model.state_dict()?);
    save(out, &format!("rank{}.safetensors", env.rank), all)
}

fn worker_inf(env: &LaunchEnv, out: &Path) -> Result<()> {
    let g = group(env)?;
    let model = mlp(16, 3)?;
    let opt = Sgd::new(model.parameters(), sgd())?;
    let policy = Policy::opt_level(OptLevel::O2).with_report_interval(0);
    let (model, mut opt) = amp::initialize(model, opt, policy)?;
    let ddp = DistributedDataParallel::new(model, &g, DdpConfig::default())?;
    let mut saved = Vec::new();
    for step in 0..3 {
        let (mut x, y) = micro_batch(env.rank, step)?;
        if step == 1 && env.rank == 1 {
            // Only rank 1's batch overflows.
            let mut v = x.to_vec::<f32>()?;
            v[5] = f32::INFINITY;
            x = Tensor::from_vec(v, [4, 6], CPU)?;
        }
        let loss = cross_entropy(&ddp.forward(&x)?, &y)?;
        opt.zero_grad()?;
        opt.backward(&loss)?;
        opt.step()?;
        let st = opt.stats()?[0];
        saved.push((
            format!("step{step}.scaler"),
            Tensor::from_vec(
                vec![st.scale, st.skipped_total as f64, loss.item()?],
                [3],
                CPU,
            )?,
        ));
        for (n, t) in ddp.module().state_dict()? {
            saved.push((format!("step{step}.{n}"), t));
        }
    }
    save(out, &format!("rank{}.safetensors", env.rank), saved)
}

/// Trains the MLP; `stop(step)` runs before each step.
fn train_loop(env: &LaunchEnv, steps: usize, mut stop: impl FnMut(usize)) -> Result<()> {
    let g = group(env)?;
    let model = mlp(16, 5)?;
    let mut opt = Sgd::new(model.parameters(), sgd())?;
    let ddp = DistributedDataParallel::new(model, &g, DdpConfig::default())?;
    for step in 0..steps {
        stop(step);
        let (x, y) = micro_batch(env.rank, step)?;
        let loss = cross_entropy(&ddp.forward(&x)?, &y)?;
        mixprec::optim::Optimizer::zero_grad(&mut opt);
        loss.backward()?;
        mixprec::optim::Optimizer::step(&mut opt)?;
    }
    Ok(())
}

fn worker_die(env: &LaunchEnv) -> Result<()> {
    train_loop(env, 200, |step| {
        if step == 3 && env.rank == 2 {
            // A crash: no destructor runs, no goodbye is said.
            std::process::abort();
        }
    })
}

fn worker_hang(env: &LaunchEnv) -> Result<()> {
    train_loop(env, 200, |step| {
        if step == 3 && env.rank == 1 {
            std::thread::sleep(Duration::from_secs(60));
        }
    })
}

fn worker_early(env: &LaunchEnv) -> Result<()> {
    // Rank 1 runs 2 steps and leaves cleanly; the others want 6.
    let steps = if env.rank == 1 { 2 } else { 6 };
    train_loop(env, steps, |_| {})
}

fn worker_mismatch(env: &LaunchEnv, role: &str) -> Result<()> {
    let g = group(env)?;
    let hidden = if role == "mismatch-shape" && env.rank == 1 {
        17
    } else {
        16
    };
    let model = mlp(hidden, 5)?;
    let opt = Sgd::new(model.parameters(), sgd())?;
    let level = if role == "mismatch-dtype" && env.rank == 1 {
        OptLevel::O3
    } else {
        OptLevel::O0
    };
    let (model, _opt) = amp::initialize(model, opt, Policy::opt_level(level))?;
    DistributedDataParallel::new(model, &g, DdpConfig::default())?;
    Err(Error::Backward("mismatched models were accepted".into()))
}

#[cfg(feature = "train")]
/// The main job's loop (`train_resnet`'s) as one rank: the config and options from the test.
fn worker_trainer(env: &LaunchEnv, out: &Path) -> Result<()> {
    use mixprec::train::progress::ProgressMode;
    use mixprec::train::{run, Resume, RunConfig, RunOptions};
    let cfg = RunConfig::from_toml_file(out.join("run.toml"))?;
    let resume = std::env::var("MIXPREC_TEST_RESUME")
        .ok()
        .map(|p| Resume::From(PathBuf::from(p)));
    let stop_after = std::env::var("MIXPREC_TEST_STOP")
        .ok()
        .and_then(|v| v.parse().ok());
    let summary = run(
        &cfg,
        &RunOptions {
            resume,
            progress: Some(ProgressMode::Off),
            stop_after,
            sync_batch_norm: true,
            ..Default::default()
        },
    )?;
    std::fs::write(
        out.join(format!("rank{}.summary", env.rank)),
        format!(
            "{} {} {}",
            summary.world_size,
            summary.rank,
            summary.history.len()
        ),
    )
    .map_err(|e| Error::io("writing the summary", e))
}

// ---- the launching side ------------------------------------------------------------------------

struct Run {
    result: Result<Vec<RankExit>>,
    out: PathBuf,
    seconds: f64,
}

impl Run {
    fn expect_ok(&self) {
        if let Err(e) = &self.result {
            let errs: Vec<String> = (0..4)
                .filter_map(|r| std::fs::read_to_string(self.out.join(format!("rank{r}.err"))).ok())
                .collect();
            panic!("the ranks failed: {e}\n{}", errs.join("\n"));
        }
    }

    fn err_of(&self, rank: usize) -> String {
        std::fs::read_to_string(self.out.join(format!("rank{rank}.err")))
            .unwrap_or_else(|_| format!("(rank {rank} wrote no error)"))
    }

    fn tensors(&self, rank: usize) -> Vec<(String, Tensor)> {
        mixprec::io::safetensors::read(&self.out.join(format!("rank{rank}.safetensors")))
            .unwrap_or_else(|e| panic!("rank {rank}'s results: {e}"))
            .0
    }
}

fn run_ranks(role: &str, n: usize, env: &[(&str, &str)], grace: Duration) -> Run {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let out = std::env::temp_dir().join(format!(
        "mixprec-dist-{}-{role}-{n}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out).unwrap();
    let exe = std::env::current_exe().unwrap();
    let mut cfg = LaunchConfig::new(
        n,
        exe,
        ["rank_entry", "--exact", "--nocapture", "--test-threads=1"]
            .iter()
            .map(Into::into)
            .collect(),
    );
    cfg.grace = grace;
    cfg.env = vec![
        (ROLE.into(), role.into()),
        (OUT.into(), out.display().to_string()),
        ("MIXPREC_DIST_TIMEOUT".into(), "60".into()),
    ];
    for (k, v) in env {
        cfg.env.push((k.to_string(), v.to_string()));
    }
    let t = Instant::now();
    let result = launch(&cfg);
    Run {
        result,
        out,
        seconds: t.elapsed().as_secs_f64(),
    }
}

fn bits(t: &Tensor) -> Vec<u64> {
    t.to_vec_f64()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

fn assert_ranks_bitwise_equal(run: &Run, n: usize) -> Vec<(String, Tensor)> {
    let base = run.tensors(0);
    for r in 1..n {
        let other = run.tensors(r);
        assert_eq!(base.len(), other.len());
        for ((na, a), (nb, b)) in base.iter().zip(&other) {
            assert_eq!(na, nb);
            if na.contains("losses") || na.contains("first.") || na.ends_with(".scaler") {
                continue; // each rank's own losses and local gradients differ
            }
            assert!(bits(a) == bits(b), "rank {r} differs from rank 0 in {na}");
        }
    }
    base
}

/// Largest |a - b| / (|b| + atol) over all entries named in `want`.
fn worst_rel(got: &[(String, Tensor)], want: &[(String, Tensor)], atol: f64) -> (f64, String) {
    let mut worst = (0.0f64, String::new());
    for (name, w) in want {
        let Some((_, g)) = got.iter().find(|(n, _)| n == name) else {
            panic!("{name} missing from the ranks' results")
        };
        let (g, w) = (g.to_vec_f64().unwrap(), w.to_vec_f64().unwrap());
        assert_eq!(g.len(), w.len(), "{name}");
        for (a, b) in g.iter().zip(&w) {
            let e = (a - b).abs() / (b.abs() + atol);
            if e > worst.0 || e.is_nan() {
                worst = (e, name.clone());
            }
        }
    }
    worst
}

/// Largest ‖a − b‖∞ / ‖b‖∞ over the tensors named in `want` (for half-precision results,
/// whose small elements carry large relative errors).
fn worst_normwise(got: &[(String, Tensor)], want: &[(String, Tensor)]) -> (f64, String) {
    let mut worst = (0.0f64, String::new());
    for (name, w) in want {
        let Some((_, g)) = got.iter().find(|(n, _)| n == name) else {
            panic!("{name} missing from the ranks' results")
        };
        let (g, w) = (g.to_vec_f64().unwrap(), w.to_vec_f64().unwrap());
        let scale = w.iter().fold(0.0f64, |m, v| m.max(v.abs())).max(1e-12);
        let diff = g
            .iter()
            .zip(&w)
            .fold(0.0f64, |m, (a, b)| m.max((a - b).abs()));
        if diff / scale > worst.0 || diff.is_nan() {
            worst = (diff / scale, name.clone());
        }
    }
    worst
}

#[test]
fn collectives_on_two_and_three_ranks() {
    for n in [2, 3] {
        run_ranks("collectives", n, &[], Duration::from_secs(10)).expect_ok();
    }
}

#[test]
fn each_training_forward_starts_from_rank_zeros_buffers() {
    for role in ["buffers", "buffers-f64"] {
        let run = run_ranks(role, 3, &[], Duration::from_secs(10));
        run.expect_ok();
        let base = run.tensors(0);
        for r in 1..3 {
            for ((n, a), (_, b)) in base.iter().zip(&run.tensors(r)) {
                assert!(
                    bits(a) == bits(b),
                    "{role}, rank {r}: {n} differs from rank 0's"
                );
            }
        }
    }
}

#[test]
fn ranks_that_issue_different_collectives_are_named() {
    let run = run_ranks("disagree", 3, &[], Duration::from_secs(10));
    let e = run.result.as_ref().unwrap_err().to_string();
    assert!(e.contains("rank"), "{e}");
    for r in 0..3 {
        let err = run.err_of(r);
        assert!(err.contains("culprit Some(1)"), "rank {r}: {err}");
        assert!(err.contains("all_gather"), "rank {r}: {err}");
    }
}

#[test]
fn ddp_with_sync_batchnorm_matches_one_process_on_the_global_batch() {
    let reference = train_single(OptLevel::O0).unwrap();
    for n in [2, 3] {
        let run = run_ranks("train", n, &[(LEVEL, "O0")], Duration::from_secs(10));
        run.expect_ok();
        let got = assert_ranks_bitwise_equal(&run, n);
        // Parameters and running statistics: f32 rounding of another summation order only.
        let (e, name) = worst_rel(&got, &reference, 1e-3);
        println!("{n} ranks, O0: worst relative difference from one process {e:.2e} ({name})");
        assert!(
            e < 5e-5,
            "{n} ranks: {name} differs from one process by {e:e}"
        );
    }
}

#[test]
fn ddp_composes_with_amp_o2() {
    let reference = train_single(OptLevel::O2).unwrap();
    let run = run_ranks("train", 2, &[(LEVEL, "O2")], Duration::from_secs(10));
    run.expect_ok();
    let got = assert_ranks_bitwise_equal(&run, 2);
    // f16 activations and gradients: another order of the sums moves the half roundings, and
    // three steps at lr 0.1 amplify them. The bound is what f16 alone does to this run: the
    // gap between one process at O2 and at O0 (a broken average would be off by far more).
    let (noise, _) = worst_normwise(&reference, &train_single(OptLevel::O0).unwrap());
    let (e, name) = worst_normwise(&got, &reference);
    println!(
        "2 ranks, O2: {e:.2e} from one process ({name}); O2 vs O0 in one process: {noise:.2e}"
    );
    assert!(
        e < 2.0 * noise,
        "O2: {name} differs from one process by {e:e}"
    );
}

/// What `worker_accum` must produce: rank r's local gradient of micro-batch 0, and the average
/// over the ranks of both micro-batches' gradients.
type Named = Vec<(String, Tensor)>;

fn accum_reference(n: usize) -> (Vec<Named>, Named) {
    let mut first = Vec::new();
    let mut total: Vec<(String, Vec<f64>)> = Vec::new();
    for r in 0..n {
        let model = mlp(16, 7).unwrap();
        for k in 0..2 {
            let (x, y) = micro_batch(r, k).unwrap();
            cross_entropy(&model.forward(&x).unwrap(), &y)
                .unwrap()
                .backward()
                .unwrap();
            if k == 0 {
                first.push(grads_of(&model).unwrap());
            }
        }
        for (i, (name, g)) in grads_of(&model).unwrap().into_iter().enumerate() {
            let v = g.to_vec_f64().unwrap();
            if r == 0 {
                total.push((name, v));
            } else {
                for (a, b) in total[i].1.iter_mut().zip(v) {
                    *a += b;
                }
            }
        }
    }
    let avg = total
        .into_iter()
        .map(|(name, v)| {
            let len = v.len();
            let v: Vec<f64> = v.into_iter().map(|x| x / n as f64).collect();
            (name, Tensor::from_vec(v, [len], CPU).unwrap())
        })
        .collect();
    (first, avg)
}

#[test]
fn no_sync_accumulates_locally_then_averages_the_totals() {
    let n = 2;
    let (first, avg) = accum_reference(n);
    for (level, tol) in [
        ("O0", 1e-5),
        ("O1", 2e-2),
        ("O2", 2e-2),
        ("O3", 2e-2),
        ("O2-ddp-first", 2e-2),
        ("O2-predivide", 2e-2),
        ("O2-f32", 2e-2),
    ] {
        let run = run_ranks("accum", n, &[(LEVEL, level)], Duration::from_secs(10));
        run.expect_ok();
        let got0 = assert_ranks_bitwise_equal(&run, n);
        for (r, want_first) in first.iter().enumerate() {
            let got = run.tensors(r);
            let mine: Vec<(String, Tensor)> = got
                .iter()
                .filter_map(|(k, t)| k.strip_prefix("first.").map(|k| (k.to_string(), t.clone())))
                .collect();
            let (e, name) = if level == "O0" {
                worst_rel(&mine, want_first, 1e-3)
            } else {
                worst_normwise(&mine, want_first)
            };
            assert!(
                e < tol,
                "{level}: rank {r}'s gradient under no_sync is not its own: {name} {e:e}"
            );
        }
        let second: Vec<(String, Tensor)> = got0
            .iter()
            .filter_map(|(k, t)| {
                k.strip_prefix("second.")
                    .map(|k| (k.to_string(), t.flatten_all().unwrap()))
            })
            .collect();
        let (e, name) = if level == "O0" {
            worst_rel(&second, &avg, 1e-3)
        } else {
            worst_normwise(&second, &avg)
        };
        println!("no_sync {level}: worst relative difference from the average {e:.2e} ({name})");
        assert!(
            e < tol,
            "{level}: {name} is not the average of the totals ({e:e})"
        );
    }
}

#[test]
fn an_inf_on_one_rank_skips_the_step_on_every_rank() {
    let run = run_ranks("inf", 2, &[], Duration::from_secs(10));
    run.expect_ok();
    let base = assert_ranks_bitwise_equal(&run, 2);
    let get = |rank: usize, name: &str| {
        run.tensors(rank)
            .into_iter()
            .find(|(n, _)| n == name)
            .map(|(_, t)| t.to_vec_f64().unwrap())
            .unwrap_or_else(|| panic!("{name}"))
    };
    for r in 0..2 {
        let s0 = get(r, "step0.scaler");
        let s1 = get(r, "step1.scaler");
        let s2 = get(r, "step2.scaler");
        assert_eq!(s0[1], 0.0, "rank {r}: step 0 skipped");
        assert_eq!(
            s1[1], 1.0,
            "rank {r}: step 1 (Inf on rank 1) was not skipped"
        );
        assert_eq!(s1[0], s0[0] / 2.0, "rank {r}: the scale did not back off");
        assert_eq!(s2[1], 1.0, "rank {r}: step 2 skipped");
    }
    // Rank 0's own loss was finite: it skipped because of rank 1's gradients.
    assert!(get(0, "step1.scaler")[2].is_finite());
    assert!(!get(1, "step1.scaler")[2].is_finite());
    for (name, t) in &base {
        if let Some(p) = name
            .strip_prefix("step1.")
            .filter(|p| !p.ends_with("scaler"))
        {
            let before = base
                .iter()
                .find(|(n, _)| *n == format!("step0.{p}"))
                .unwrap();
            assert!(
                bits(&before.1) == bits(t),
                "{p} changed in the skipped step"
            );
        }
    }
}

#[test]
fn a_killed_rank_makes_the_others_fail_naming_it() {
    let run = run_ranks("die", 3, &[], Duration::from_secs(20));
    let e = run.result.as_ref().unwrap_err();
    assert!(
        matches!(
            e,
            Error::Distributed {
                culprit: Some(2),
                ..
            }
        ),
        "launcher: {e}"
    );
    for r in [0, 1] {
        let err = run.err_of(r);
        assert!(err.contains("culprit Some(2)"), "rank {r}: {err}");
        assert!(err.contains("rank 2"), "rank {r}: {err}");
    }
    // The collective timeout is 60 s: the failure came from the closed connection, at once.
    assert!(run.seconds < 20.0, "took {:.1} s", run.seconds);
}

#[test]
fn a_hung_rank_is_named_within_the_timeout() {
    let run = run_ranks(
        "hang",
        3,
        &[("MIXPREC_DIST_TIMEOUT", "5")],
        Duration::from_secs(2),
    );
    assert!(run.result.is_err());
    for r in [0, 2] {
        let err = run.err_of(r);
        assert!(err.contains("culprit Some(1)"), "rank {r}: {err}");
    }
    assert!(run.err_of(0).contains("within 5 s"), "{}", run.err_of(0));
    // 5 s timeout, then 2 s for the launcher to kill the hung rank.
    assert!(run.seconds < 25.0, "took {:.1} s", run.seconds);
}

#[test]
fn a_rank_that_stops_early_is_named_at_once() {
    let run = run_ranks("early", 3, &[], Duration::from_secs(10));
    assert!(run.result.is_err());
    for r in [0, 2] {
        let err = run.err_of(r);
        assert!(err.contains("culprit Some(1)"), "rank {r}: {err}");
        assert!(
            err.contains("shut down its process group"),
            "rank {r}: {err}"
        );
    }
    assert!(
        !run.out.join("rank1.err").exists(),
        "rank 1 itself finished cleanly"
    );
    assert!(run.seconds < 20.0, "took {:.1} s", run.seconds);
}

#[test]
fn mismatched_models_and_dtypes_are_reported_at_wrap_time() {
    for (role, needle) in [("mismatch-shape", "[17, 6]"), ("mismatch-dtype", "f16")] {
        let run = run_ranks(role, 2, &[], Duration::from_secs(10));
        assert!(run.result.is_err(), "{role}");
        for r in 0..2 {
            let err = run.err_of(r);
            assert!(err.contains("culprit Some(1)"), "{role}, rank {r}: {err}");
            assert!(err.contains("0.weight"), "{role}, rank {r}: {err}");
            assert!(err.contains(needle), "{role}, rank {r}: {err}");
        }
    }
}

// ---- in-process tests --------------------------------------------------------------------------

fn vars(list: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let owned: Vec<(String, String)> = list
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    move |k| owned.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
}

#[test]
fn launch_env_from_torchrun_slurm_and_nothing() {
    let e = LaunchEnv::from_vars(vars(&[])).unwrap();
    assert_eq!((e.rank, e.world_size, e.launcher), (0, 1, Launcher::Single));
    let e = LaunchEnv::from_vars(vars(&[
        ("RANK", "3"),
        ("WORLD_SIZE", "8"),
        ("LOCAL_RANK", "1"),
        ("LOCAL_WORLD_SIZE", "2"),
        ("MASTER_ADDR", "node7"),
        ("MASTER_PORT", "29501"),
    ]))
    .unwrap();
    assert_eq!(
        (e.rank, e.world_size, e.local_rank, e.local_world_size),
        (3, 8, 1, 2)
    );
    assert_eq!((e.master_addr.as_str(), e.master_port), ("node7", 29501));
    // torchrun's agent holds MASTER_PORT itself.
    let e = LaunchEnv::from_vars(vars(&[
        ("RANK", "0"),
        ("WORLD_SIZE", "2"),
        ("MASTER_ADDR", "h"),
        ("MASTER_PORT", "29500"),
        ("TORCHELASTIC_USE_AGENT_STORE", "True"),
    ]))
    .unwrap();
    assert_eq!(e.master_port, 29501);
    let e = LaunchEnv::from_vars(vars(&[
        ("SLURM_PROCID", "5"),
        ("SLURM_NTASKS", "8"),
        ("SLURM_LOCALID", "1"),
        ("SLURM_NTASKS_PER_NODE", "4(x2)"),
        ("SLURM_JOB_NODELIST", "gpu[03-04,09],login1"),
    ]))
    .unwrap();
    assert_eq!(
        (
            e.rank,
            e.world_size,
            e.local_rank,
            e.local_world_size,
            e.launcher
        ),
        (5, 8, 1, 4, Launcher::Slurm)
    );
    assert_eq!((e.master_addr.as_str(), e.master_port), ("gpu03", 29500));
    let e = LaunchEnv::from_vars(vars(&[
        ("RANK", "0"),
        ("WORLD_SIZE", "2"),
        ("MASTER_ADDR", "h"),
        ("MASTER_PORT", "1"),
        ("MIXPREC_MASTER_PORT", "4000"),
    ]))
    .unwrap();
    assert_eq!(e.master_port, 4000);
    for (bad, key) in [
        (vec![("RANK", "2"), ("WORLD_SIZE", "2")], "RANK"),
        (vec![("RANK", "x"), ("WORLD_SIZE", "2")], "RANK"),
        (
            vec![("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "1")],
            "MASTER_ADDR",
        ),
        (
            vec![("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h")],
            "MASTER_PORT",
        ),
        (
            vec![
                ("RANK", "0"),
                ("WORLD_SIZE", "2"),
                ("MASTER_ADDR", "h"),
                ("MASTER_PORT", "70000"),
            ],
            "MASTER_PORT",
        ),
    ] {
        match LaunchEnv::from_vars(vars(&bad)) {
            Err(Error::Config { key: k, .. }) => assert_eq!(k, key, "{bad:?}"),
            other => panic!("{bad:?}: {other:?}"),
        }
    }
}

fn env_for(rank: usize, world: usize, port: u16) -> LaunchEnv {
    LaunchEnv {
        rank,
        world_size: world,
        local_rank: rank,
        local_world_size: world,
        master_addr: "127.0.0.1".into(),
        master_port: port,
        launcher: Launcher::Torchrun,
    }
}

fn opts(secs: f64) -> GroupOptions {
    GroupOptions::new(Backend::Cpu).with_timeout(Duration::from_secs_f64(secs))
}

#[test]
fn rendezvous_names_missing_and_inconsistent_ranks() {
    use mixprec::distributed::launch::free_port;
    // Rank 1 never comes.
    let port = free_port().unwrap();
    let t = Instant::now();
    let e = ProcessGroup::new(&env_for(0, 2, port), &opts(1.0)).unwrap_err();
    assert!(
        matches!(
            e,
            Error::Distributed {
                culprit: Some(1),
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("did not join"), "{e}");
    assert!(t.elapsed() < Duration::from_secs(10));
    // Rank 1 thinks the world has 3 processes.
    let port = free_port().unwrap();
    let h = std::thread::spawn(move || {
        ProcessGroup::new(&env_for(0, 2, port), &opts(10.0)).map(|_| ())
    });
    let mut other = env_for(1, 3, port);
    other.world_size = 3;
    let e1 = ProcessGroup::new(&other, &opts(10.0)).unwrap_err();
    let e0 = h.join().unwrap().unwrap_err();
    for e in [&e0, &e1] {
        assert!(e.to_string().contains("WORLD_SIZE = 3"), "{e}");
    }
    // Rank 0 is not there: rank 1 gives up at the deadline, naming rank 0.
    let port = free_port().unwrap();
    let e = ProcessGroup::new(&env_for(1, 2, port), &opts(1.0)).unwrap_err();
    assert!(
        matches!(
            e,
            Error::Distributed {
                culprit: Some(0),
                ..
            }
        ),
        "{e}"
    );
    // Two processes claim rank 1.
    let port = free_port().unwrap();
    let h0 = std::thread::spawn(move || {
        ProcessGroup::new(&env_for(0, 3, port), &opts(10.0)).map(|_| ())
    });
    let h1 = std::thread::spawn(move || {
        ProcessGroup::new(&env_for(1, 3, port), &opts(10.0)).map(|_| ())
    });
    let h2 = std::thread::spawn(move || {
        ProcessGroup::new(&env_for(1, 3, port), &opts(10.0)).map(|_| ())
    });
    let e0 = h0.join().unwrap().unwrap_err();
    assert!(
        e0.to_string().contains("two processes claim rank 1"),
        "{e0}"
    );
    assert!(h1.join().unwrap().is_err() || h2.join().unwrap().is_err());
}

#[test]
fn a_group_of_one_works_without_peers() {
    let g = ProcessGroup::new(&LaunchEnv::single(), &GroupOptions::new(Backend::Cpu)).unwrap();
    assert_eq!((g.rank(), g.world_size()), (0, 1));
    let t = Tensor::from_vec(vec![1.5f32, -2.0], [2], CPU).unwrap();
    for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
        g.all_reduce(&t, op).unwrap();
        assert_eq!(t.to_vec::<f32>().unwrap(), vec![1.5, -2.0]);
    }
    assert_eq!(g.all_gather(&t).unwrap().dims(), [1, 2]);
    g.barrier().unwrap();
    // The wrong device is an error naming both.
    let e = DistributedDataParallel::new(mlp(4, 1).unwrap(), &g, DdpConfig::default());
    assert!(e.is_ok());
    let bad = DdpConfig {
        bucket_cap_mb: 0.0,
        ..Default::default()
    };
    assert!(DistributedDataParallel::new(mlp(4, 1).unwrap(), &g, bad).is_err());
}

#[test]
fn buckets_follow_reverse_registration_order_and_the_cap() {
    let g = ProcessGroup::new(&LaunchEnv::single(), &GroupOptions::new(Backend::Cpu)).unwrap();
    // Linear 6→16 (96 + 16 floats), Linear 16→3 (48 + 3): with a 200-byte cap (50 floats) and a
    // 100-byte first bucket, the last layer's parameters come first.
    let cfg = DdpConfig {
        bucket_cap_mb: 200.0 / 1048576.0,
        first_bucket_mb: 100.0 / 1048576.0,
        ..Default::default()
    };
    let ddp = DistributedDataParallel::new(mlp(16, 1).unwrap(), &g, cfg).unwrap();
    let b = ddp.buckets();
    assert_eq!(
        b.iter().map(|(_, n, p)| (*n, *p)).collect::<Vec<_>>(),
        vec![(3 + 48, 2), (16 + 96, 2)],
        "{b:?}"
    );
    // At world size 1 a training step through the wrapper equals one without it, bit for bit.
    let plain = mlp(16, 1).unwrap();
    let (x, y) = micro_batch(0, 0).unwrap();
    for m in [&ddp as &dyn Module, &plain] {
        cross_entropy(&m.forward(&x).unwrap(), &y)
            .unwrap()
            .backward()
            .unwrap();
    }
    let (a, b) = (grads_of(&ddp).unwrap(), grads_of(&plain).unwrap());
    for ((n, ga), (_, gb)) in a.iter().zip(&b) {
        assert!(bits(ga) == bits(gb), "{n}");
    }
    assert_eq!(ddp.last_reduction().buckets, 2);
}

/// At world size 1 a channels_last ResNet under O2 trains through the wrapper exactly as without
/// it (the buckets carry each gradient in its memory order and give it back in the same order),
/// and the averaged gradients land in the persistent gradient buffers: each keeps its buffer
/// from step to step, as the optimizers' cached tensor tables need.
#[test]
fn ddp_returns_gradients_in_place_and_in_their_memory_order() {
    use mixprec::MemoryFormat;
    let g = ProcessGroup::new(&LaunchEnv::single(), &GroupOptions::new(Backend::Cpu)).unwrap();
    let make = || {
        let m = tiny_resnet(3).unwrap();
        m.to_memory_format(MemoryFormat::ChannelsLast).unwrap();
        let opt = Sgd::new(m.parameters(), sgd()).unwrap();
        let (m, mut opt) = amp::initialize(
            m,
            opt,
            Policy::opt_level(OptLevel::O2).with_report_interval(0),
        )
        .unwrap();
        // zero_grad keeps the gradients' buffers (what a captured step does).
        opt.set_persistent_grads(true).unwrap();
        (m, opt)
    };
    let (plain, mut plain_opt) = make();
    let (wrapped, mut ddp_opt) = make();
    let cfg = DdpConfig {
        bucket_cap_mb: 0.004,
        first_bucket_mb: 0.001,
        ..Default::default()
    };
    let ddp = DistributedDataParallel::new(wrapped, &g, cfg).unwrap();
    assert!(ddp.buckets().len() > 2, "{:?}", ddp.buckets());
    let mut first_grads: Option<Vec<Tensor>> = None;
    for step in 0..STEPS {
        let (x, y) = global_batch(step).unwrap();
        let x = x.to_memory_format(MemoryFormat::ChannelsLast).unwrap();
        for (m, o) in [
            (&ddp as &dyn Module, &mut ddp_opt),
            (&plain as &dyn Module, &mut plain_opt),
        ] {
            let loss = cross_entropy(&m.forward(&x).unwrap(), &y).unwrap();
            o.zero_grad().unwrap();
            o.backward(&loss).unwrap();
            o.step().unwrap();
        }
        let grads: Vec<Tensor> = ddp
            .parameters()
            .iter()
            .map(|p| p.grad().expect("every parameter has a gradient"))
            .collect();
        for ((p, g), q) in ddp.parameters().iter().zip(&grads).zip(plain.parameters()) {
            assert_eq!(g.layout().strides(), p.layout().strides());
            let want = q.grad().unwrap();
            assert!(bits(g) == bits(&want), "step {step}: a gradient differs");
        }
        match &first_grads {
            None => first_grads = Some(grads),
            Some(first) => {
                for (a, b) in first.iter().zip(&grads) {
                    assert!(
                        a.same_storage(b),
                        "step {step}: a gradient got a new buffer"
                    );
                }
            }
        }
    }
    for (a, b) in ddp.parameters().iter().zip(plain.parameters()) {
        assert!(bits(a) == bits(&b), "the trained weights differ");
    }
    assert!(ddp.last_reduction().launched_during_backward > 0);
}

#[test]
fn distributed_sampler_cuts_epochs_as_pytorch() {
    // 10 samples on 3 ranks: padded to 12 (the first two repeat), or cut to 9 with drop_last.
    let order: Vec<usize> = (0..10).collect();
    let s = |r| DistributedSampler::new(r, 3).unwrap();
    assert_eq!(s(0).shard(&order), vec![0, 3, 6, 9]);
    assert_eq!(s(1).shard(&order), vec![1, 4, 7, 0]);
    assert_eq!(s(2).shard(&order), vec![2, 5, 8, 1]);
    assert_eq!(s(0).num_samples(10), 4);
    let d = |r| DistributedSampler::new(r, 3).unwrap().drop_last(true);
    assert_eq!(d(0).shard(&order), vec![0, 3, 6]);
    assert_eq!(d(2).shard(&order), vec![2, 5, 8]);
    assert_eq!(d(1).num_samples(10), 3);
    // Fewer samples than ranks: padding repeats them, drop_last leaves nothing.
    assert_eq!(s(2).shard(&[7, 8]), vec![7]);
    assert_eq!(d(2).shard(&[7, 8]), Vec::<usize>::new());
    // Evaluation: every sample once.
    let u = |r| DistributedSampler::uneven(r, 3).unwrap();
    let mut all: Vec<usize> = (0..3).flat_map(|r| u(r).shard(&order)).collect();
    all.sort();
    assert_eq!(all, order);
    assert_eq!((u(0).num_samples(10), u(2).num_samples(10)), (4, 3));
    assert!(DistributedSampler::new(3, 3).is_err());
    // In the loader: disjoint shards of the same shuffle, reshuffled each epoch.
    let ds = SyntheticDataset::new(22, [1, 2, 2], 3, 0).unwrap();
    let loaders: Vec<DataLoader> = (0..2)
        .map(|r| {
            DataLoader::new(ds.clone(), 4)
                .unwrap()
                .shuffle(5)
                .sampler(DistributedSampler::new(r, 2).unwrap())
        })
        .collect();
    for epoch in 0..2 {
        let (a, b) = (loaders[0].epoch_order(epoch), loaders[1].epoch_order(epoch));
        assert_eq!((a.len(), b.len()), (11, 11));
        let mut all: Vec<usize> = a.iter().chain(&b).copied().collect();
        all.sort();
        all.dedup();
        assert_eq!(all.len(), 22, "shards overlap in epoch {epoch}");
        assert_eq!(loaders[0].num_batches(), 3);
        assert_eq!(loaders[0].epoch(epoch).count(), 3);
    }
    assert_ne!(loaders[0].epoch_order(0), loaders[0].epoch_order(1));
}

#[cfg(feature = "train")]
#[test]
fn the_training_job_runs_on_ranks_and_resumes_with_another_count() {
    use mixprec::train::RunConfig;
    let dir = std::env::temp_dir().join(format!("mixprec-dist-job-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut cfg = RunConfig {
        epochs: 2,
        device: "cpu".into(),
        out: dir.join("run"),
        ..Default::default()
    };
    cfg.model.blocks = vec![1, 1];
    cfg.model.widths = vec![4, 8];
    cfg.data.dir = "bundled".into();
    cfg.data.batch_size = 32;
    cfg.data.train_limit = 384;
    cfg.data.test_limit = 100;
    cfg.amp.opt_level = "O0".into();
    // The ranks read the config from their output directory.
    let launch_job = |n: usize, env: &[(&str, &str)]| {
        use mixprec::distributed::launch::{launch, LaunchConfig};
        let out = dir.join(format!("ranks-{n}-{}", env.len()));
        std::fs::create_dir_all(&out).unwrap();
        std::fs::write(out.join("run.toml"), cfg.to_toml()).unwrap();
        let mut lc = LaunchConfig::new(
            n,
            std::env::current_exe().unwrap(),
            ["rank_entry", "--exact", "--nocapture", "--test-threads=1"]
                .iter()
                .map(Into::into)
                .collect(),
        );
        lc.env = vec![
            (ROLE.into(), "trainer".into()),
            (OUT.into(), out.display().to_string()),
            ("MIXPREC_DIST_TIMEOUT".into(), "60".into()),
        ];
        for (k, v) in env {
            lc.env.push((k.to_string(), v.to_string()));
        }
        if let Err(e) = launch(&lc) {
            let errs: Vec<String> = (0..n)
                .filter_map(|r| std::fs::read_to_string(out.join(format!("rank{r}.err"))).ok())
                .collect();
            panic!("{n} ranks: {e}\n{}", errs.join("\n"));
        }
        (0..n)
            .map(|r| std::fs::read_to_string(out.join(format!("rank{r}.summary"))).unwrap())
            .collect::<Vec<_>>()
    };
    // Two ranks, stopped after the first epoch: rank 0 alone keeps the history and the files.
    let s = launch_job(2, &[("MIXPREC_TEST_STOP", "1")]);
    assert_eq!(s, vec!["2 0 1".to_string(), "2 1 0".to_string()]);
    let run_dir = cfg.out.clone();
    let ckpt = run_dir.join("checkpoints/epoch-001.safetensors");
    assert!(ckpt.is_file());
    // The manifest is in the checkpoint's header (format 2).
    let saved = mixprec::io::Checkpoint::load(&ckpt).unwrap();
    assert_eq!(saved.extra["world_size"], 2);
    // Resumed on three ranks, then on one process: each continues from epoch 1.
    let resume = ckpt.display().to_string();
    let s = launch_job(3, &[("MIXPREC_TEST_RESUME", resume.as_str())]);
    assert_eq!(s[0], "3 0 2");
    let lines = std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap();
    assert_eq!(lines.lines().count(), 2, "{lines}");
    let single = mixprec::train::run(
        &cfg,
        &mixprec::train::RunOptions {
            resume: Some(mixprec::train::Resume::From(ckpt)),
            progress: Some(mixprec::train::progress::ProgressMode::Off),
            // The three ranks' epoch 2 is newer than epoch 1: replaced, not mixed in.
            overwrite: true,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!((single.world_size, single.history.len()), (1, 2));
    assert!(single.history[1].test_accuracy > 0.0);
}
