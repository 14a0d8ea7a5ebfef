//! GPU benchmark (exits quietly without a GPU): the ResNet-50 O2 training step (batch 256 by
//! default, synthetic 224x224 images on the device, fused SGD with momentum, dynamic loss
//! scaling) unwrapped and wrapped in DistributedDataParallel over NCCL at world size 1 — the
//! rendezvous, the communicator, every gradient through the bucketed all-reduce on the
//! communication stream. The bound: DDP within 3% of the unwrapped step.
//!
//! The models are timed in rotating rounds (drift in clocks or temperature hits all of them),
//! one synchronisation per round; the medians are compared. Host synchronisations inside the
//! timed DDP steps are counted (the target is none). One JSON line with the figures, then a
//! PASS/FAIL line. PyTorch's side: `torchrun --standalone --nproc_per_node=1
//! benches/torch_ddp_resnet50.py` (see benches/gpu_ddp.sh, which runs both).
//!
//! Started by a launcher (RANK, WORLD_SIZE, ... set, as torchrun sets them) every rank runs the
//! same rounds on its own GPU and DDP averages over all of them; rank 0 reports, with an INFO
//! line instead of the world-size-1 bound.
//!
//! A third contender is the DDP step captured into a CUDA graph with its collectives
//! (`amp::CapturedStep` over the wrapper): its step time, issue time and speed against the eager
//! DDP step are reported beside (INFO).
//!
//! Environment: NET (resnet50, or main-job: the Fashion-MNIST example's small ResNet on 28x28
//! inputs), CHANNELS_LAST=1 (the model and the images in channels_last, as
//! benches/data_parallel_resnet50.rs runs them), BATCH (256; 128 for main-job), ROUNDS (7), STEPS per round (6), WARMUP steps (5);
//! SYNC_BN=1 makes the wrapped models' batch norms SyncBatchNorm (the unwrapped one keeps plain
//! batch norm); PROFILE=1 adds the device time per op of two unwrapped and two DDP steps, side
//! by side (a diagnostic: the timers add host work).

mod common;

use std::time::Instant;

use mixprec::amp::{self, AmpModel, AmpOptimizer, CapturedStep, OptLevel, Policy};
use mixprec::backend::cuda::{device, host_sync_count};
use mixprec::distributed::{
    convert_sync_batchnorm, Backend, DdpConfig, DistributedDataParallel, GroupOptions,
};
use mixprec::distributed::{LaunchEnv, ProcessGroup};
use mixprec::nn::{cross_entropy, Module, ResNet};
use mixprec::optim::{FusedSgd, SgdConfig};
use mixprec::{DType, Device, MemoryFormat, Tensor};

fn main() {
    common::main_with(run)
}

fn env_usize(key: &str, default: usize) -> usize {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

type Pair = (AmpModel<ResNet>, AmpOptimizer<FusedSgd>);

/// The benchmark's net: `NET` (resnet50 or main-job).
fn channels_last() -> bool {
    std::env::var("CHANNELS_LAST").is_ok_and(|v| v == "1")
}

fn net(dev: Device) -> mixprec::Result<ResNet> {
    let model = match std::env::var("NET").as_deref() {
        Ok("main-job") => common::main_job_net(&dev)?,
        _ => ResNet::resnet50(1000, &dev, 0)?,
    };
    if channels_last() {
        model.to_memory_format(MemoryFormat::ChannelsLast)?;
    }
    Ok(model)
}

fn build(dev: Device) -> mixprec::Result<Pair> {
    let model = net(dev)?;
    let opt = FusedSgd::new(
        model.parameters(),
        SgdConfig {
            lr: 0.01,
            momentum: 0.9,
            ..Default::default()
        },
    )?;
    amp::initialize(
        model,
        opt,
        Policy::opt_level(OptLevel::O2).with_report_interval(0),
    )
}

fn step(
    model: &dyn Module,
    opt: &mut AmpOptimizer<FusedSgd>,
    x: &Tensor,
    y: &Tensor,
) -> mixprec::Result<()> {
    let loss = cross_entropy(&model.forward(x)?, y)?;
    opt.zero_grad()?;
    opt.backward(&loss)?;
    opt.step()
}

/// Round times in ms, two decimals.
fn rounds_ms(t: &[f64]) -> Vec<f64> {
    t.iter().map(|t| (1e5 * t).round() / 100.0).collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn run() -> mixprec::Result<()> {
    let env = LaunchEnv::from_env()?;
    let group = ProcessGroup::new(&env, &GroupOptions::new(Backend::Nccl))?;
    let (world, rank) = (group.world_size(), group.rank());
    let dev = group.device();
    let Device::Cuda(ordinal) = dev else {
        return Err(mixprec::Error::Cuda(format!("the group's device is {dev}")));
    };
    let cuda = device(ordinal)?;
    let small = std::env::var("NET").is_ok_and(|v| v == "main-job");
    let batch = env_usize("BATCH", if small { 128 } else { 256 });
    let rounds = env_usize("ROUNDS", 7);
    let steps = env_usize("STEPS", 6);
    let warmup = env_usize("WARMUP", 5);
    let sync_bn = std::env::var("SYNC_BN").is_ok_and(|v| v == "1");
    let (ma, mi) = cuda.compute_capability();
    let name = if small {
        "main job's ResNet"
    } else {
        "ResNet-50"
    };
    if rank == 0 {
        println!(
            "device {dev} sm_{ma}{mi}; {name} O2{}, batch {batch} per rank, {world} rank(s), \
             {rounds} rounds of {steps} steps{}",
            if channels_last() {
                " channels_last"
            } else {
                ""
            },
            if sync_bn {
                "; the wrapped models with SyncBatchNorm"
            } else {
                ""
            }
        );
    }

    let (shape, classes) = if small {
        ([batch, 1, 28, 28], 10)
    } else {
        ([batch, 3, 224, 224], 1000)
    };
    let mut x = Tensor::randn(shape, 0.0, 1.0, 1 + rank as u64, DType::F32, dev)?;
    if channels_last() {
        x = x.to_memory_format(MemoryFormat::ChannelsLast)?;
    }
    let labels: Vec<i64> = (0..batch).map(|i| (i * 37 % classes) as i64).collect();
    let y = Tensor::from_vec(labels, [batch], dev)?;

    let wrap = |model: AmpModel<ResNet>| {
        if sync_bn {
            convert_sync_batchnorm(&model, &group)?;
        }
        DistributedDataParallel::new(model, &group, DdpConfig::default())
    };
    let (plain, mut plain_opt) = build(dev)?;
    let (wrapped, mut ddp_opt) = build(dev)?;
    let ddp = wrap(wrapped)?;
    if rank == 0 {
        println!(
            "ddp: {} buckets (dtype, elements, parameters): {:?}",
            ddp.buckets().len(),
            ddp.buckets()
        );
    }

    // The third contender: the DDP step captured into a CUDA graph with its collectives.
    let (wrapped_g, mut graph_opt) = build(dev)?;
    let ddp_g = wrap(wrapped_g)?;
    let mut captured = CapturedStep::new(&ddp_g, &mut graph_opt, |x: &Tensor, y: &Tensor| {
        cross_entropy(&ddp_g.forward(x)?, y)
    })?;

    for _ in 0..warmup.max(3) {
        step(&plain, &mut plain_opt, &x, &y)?;
        step(&ddp, &mut ddp_opt, &x, &y)?;
        captured.run(&x, &y)?;
    }
    cuda.synchronize()?;

    // Per contender (unwrapped, DDP, DDP captured): the step times of the rounds, and the host
    // time to issue a round's steps per step (near the step time, the host is the bound).
    let mut t: [Vec<f64>; 3] = Default::default();
    let mut q: [Vec<f64>; 3] = Default::default();
    let mut syncs = [0u64; 3];
    for round in 0..rounds {
        // Rotate which goes first, so that none always follows another's tail.
        for k in (0..3).map(|i| (i + round) % 3) {
            let t0 = Instant::now();
            let before = host_sync_count();
            for _ in 0..steps {
                match k {
                    0 => step(&plain, &mut plain_opt, &x, &y)?,
                    1 => step(&ddp, &mut ddp_opt, &x, &y)?,
                    _ => captured.run(&x, &y).map(|_| ())?,
                }
            }
            syncs[k] += host_sync_count() - before;
            q[k].push(t0.elapsed().as_secs_f64() / steps as f64);
            cuda.synchronize()?;
            t[k].push(t0.elapsed().as_secs_f64() / steps as f64);
        }
    }
    let [t_plain, t_ddp, t_graph] = t;
    let ddp_syncs = syncs[1];
    let (p, d, c) = (
        median(t_plain.clone()),
        median(t_ddp.clone()),
        median(t_graph.clone()),
    );
    let [qp, qd, qc] = q.map(median);
    let graph_stats = captured.stats();
    let graph_skipped = captured.optimizer().stats()?[0].skipped_total;
    drop(captured);
    let ratio = d / p;
    let stats = ddp.last_reduction();
    let (sp, sd) = (plain_opt.stats()?[0], ddp_opt.stats()?[0]);
    println!(
        "{{\"check\": \"mixprec-ddp\", \"net\": \"{name}\", \"world_size\": {world}, \
         \"rank\": {rank}, \"batch\": {batch}, \"sync_bn\": {sync_bn}, \"unwrapped_ms\": {:.3}, \
         \"ddp_ms\": {:.3}, \"ratio\": {ratio:.4}, \"unwrapped_issue_ms\": {:.3}, \
         \"ddp_issue_ms\": {:.3}, \"unwrapped_img_per_s\": {:.1}, \
         \"ddp_img_per_s\": {:.1}, \"ddp_captured_ms\": {:.3}, \
         \"ddp_captured_issue_ms\": {:.3}, \"ddp_captured_img_per_s\": {:.1}, \
         \"ddp_captured_replays\": {}, \"ddp_captured_host_syncs_in_timed_steps\": {}, \
         \"buckets\": {}, \"launched_during_backward\": {}, \
         \"ddp_host_syncs_in_timed_steps\": {ddp_syncs}, \"skipped_steps\": [{}, {}, {}], \
         \"rounds_ms\": {{\"unwrapped\": {:?}, \"ddp\": {:?}, \"ddp_captured\": {:?}}}}}",
        1e3 * p,
        1e3 * d,
        1e3 * qp,
        1e3 * qd,
        batch as f64 / p,
        batch as f64 / d,
        1e3 * c,
        1e3 * qc,
        batch as f64 / c,
        graph_stats.replays,
        syncs[2],
        stats.buckets,
        stats.launched_during_backward,
        sp.skipped_total,
        sd.skipped_total,
        graph_skipped,
        rounds_ms(&t_plain),
        rounds_ms(&t_ddp),
        rounds_ms(&t_graph),
    );
    if std::env::var("PROFILE").is_ok_and(|v| v == "1") {
        profile(&plain, &mut plain_opt, &ddp, &mut ddp_opt, &x, &y, rank)?;
    }
    if rank != 0 {
        return Ok(());
    }
    let ok = ratio <= 1.03 && ddp_syncs == 0 && stats.launched_during_backward > 0;
    // The bound compares like with like: not with SyncBatchNorm in the wrapped models only.
    let verdict = match (world, ok) {
        (1, _) if sync_bn => "INFO",
        (1, true) => "PASS",
        (1, false) => "FAIL",
        _ => "INFO",
    };
    println!(
        "{verdict}: DDP (NCCL, world size {world}) step {:.2} ms vs unwrapped {:.2} ms = {:.1}% \
         slower (bound 3% at world size 1), {ddp_syncs} host syncs, {} of {} buckets started \
         during backward",
        1e3 * d,
        1e3 * p,
        100.0 * (ratio - 1.0),
        stats.launched_during_backward,
        stats.buckets
    );
    println!(
        "INFO: DDP captured into a CUDA graph: {:.2} ms a step ({:.0} images/s per rank), {:.2}x \
         the eager DDP step's speed, {} host syncs in its timed replays",
        1e3 * c,
        batch as f64 / c,
        d / c,
        syncs[2]
    );
    Ok(())
}

/// Per op: calls and device ms per step, unwrapped against DDP, the ops that differ first.
fn profile(
    plain: &dyn Module,
    plain_opt: &mut AmpOptimizer<FusedSgd>,
    ddp: &dyn Module,
    ddp_opt: &mut AmpOptimizer<FusedSgd>,
    x: &Tensor,
    y: &Tensor,
    rank: usize,
) -> mixprec::Result<()> {
    use mixprec::backend::cuda::{op_profile, set_op_profiling};
    use std::collections::BTreeMap;
    let Device::Cuda(ordinal) = x.device() else {
        return Ok(());
    };
    let cuda = device(ordinal)?;
    let side = |m: &dyn Module, o: &mut AmpOptimizer<FusedSgd>| {
        cuda.synchronize()?;
        let _ = op_profile()?;
        set_op_profiling(true);
        let t = Instant::now();
        for _ in 0..2 {
            step(m, o, x, y)?;
        }
        cuda.synchronize()?;
        set_op_profiling(false);
        let wall = t.elapsed().as_secs_f64() * 1e3 / 2.0;
        let mut by_op: BTreeMap<String, (usize, f64)> = BTreeMap::new();
        for r in op_profile()? {
            let e = by_op.entry(r.op.to_string()).or_default();
            e.0 += r.calls;
            e.1 += r.total_ms / 2.0;
        }
        mixprec::Result::Ok((wall, by_op))
    };
    let (wall_p, p) = side(plain, plain_opt)?;
    let (wall_d, d) = side(ddp, ddp_opt)?;
    let busy = |m: &BTreeMap<String, (usize, f64)>| m.values().map(|v| v.1).sum::<f64>();
    if rank != 0 {
        return Ok(());
    }
    println!(
        "profile: unwrapped busy {:.2} ms wall {wall_p:.2} ms; ddp busy {:.2} ms wall {wall_d:.2} ms",
        busy(&p),
        busy(&d)
    );
    let mut ops: Vec<&String> = p.keys().chain(d.keys()).collect();
    ops.sort();
    ops.dedup();
    let get =
        |m: &BTreeMap<String, (usize, f64)>, k: &String| m.get(k).copied().unwrap_or_default();
    ops.sort_by(|a, b| {
        let da = (get(&d, a).1 - get(&p, a).1).abs();
        let db = (get(&d, b).1 - get(&p, b).1).abs();
        db.total_cmp(&da)
    });
    for op in ops.iter().take(25) {
        let (a, b) = (get(&p, op), get(&d, op));
        println!(
            "  op {op:<30} unwrapped {:>5} calls {:>8.3} ms | ddp {:>5} calls {:>8.3} ms",
            a.0 / 2,
            a.1,
            b.0 / 2,
            b.1
        );
    }
    Ok(())
}
