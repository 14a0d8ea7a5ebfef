//! The whole training step of a real network, the unit mixprec is measured in (exits quietly
//! without a GPU). One configuration per process, so that its peak memory is its own:
//!
//! ```text
//! bench-train_throughput --net resnet50|resnet18-cifar --mode o0|o2-f16|o2-bf16
//!                        [--layout nchw|cl] [--batch N] [--steps 20] [--warmup 5] [--lr 0.001]
//!                        [--profile]
//! ```
//!
//! A step is what a user's loop does: forward, cross-entropy, `opt.zero_grad()`, the scaled
//! backward (`opt.backward`: unscale and overflow check on the device), the fused SGD momentum
//! step (skipped on overflow) and the loss-scale update; synthetic data already on the device
//! (one fixed batch). After `warmup` steps, `steps` steps run back to back with one
//! synchronisation at the end. One JSON line comes out, the same fields as
//! `benches/torch_train_throughput.py` prints, and `benches/train_table.py` joins the two:
//! images/s; first-step time (process start to the end of the first step, plan choice and
//! kernel compiles included); the device memory in use at the end (`cuMemGetInfo`: the same
//! measure for both sides) and the pool's high-water marks; host synchronisations per step;
//! skipped steps and the final loss scale; how the first step's convolution plans were chosen
//! (how many came from the plan cache, the wall time spent choosing, the timing runs, the largest
//! workspace). `--profile` adds the device time per op over two
//! steps (stderr), and the stream's busy time against the wall time.

mod common;

use std::time::Instant;

use mixprec::backend::cuda::{self, device};
use mixprec::nn::{self, Module};
use mixprec::optim::{FusedSgd, SgdConfig};
use mixprec::{amp, DType, Device, MemoryFormat, Tensor};

struct Args {
    net: String,
    mode: String,
    layout: String,
    /// The net's own batch (256 for ResNet-50, 512 for the CIFAR ResNet-18) unless given.
    batch: Option<usize>,
    steps: usize,
    warmup: usize,
    lr: f64,
    profile: bool,
}

fn parse_args(flags: &mut common::args::Flags) -> Result<Args, String> {
    let mut a = Args {
        net: "resnet50".into(),
        mode: "o2-f16".into(),
        layout: "nchw".into(),
        batch: None,
        steps: 20,
        warmup: 5,
        lr: 0.001,
        profile: false,
    };
    while let Some(flag) = flags.next_flag() {
        match flag.as_str() {
            "--net" => a.net = flags.value(&flag)?,
            "--mode" => a.mode = flags.value(&flag)?,
            "--layout" => a.layout = flags.value(&flag)?,
            "--batch" => a.batch = Some(flags.number(&flag)?),
            "--steps" => a.steps = flags.number(&flag)?,
            "--warmup" => a.warmup = flags.number(&flag)?,
            "--lr" => a.lr = flags.number(&flag)?,
            "--profile" => a.profile = true,
            other => return Err(common::args::unknown(other)),
        }
    }
    Ok(a)
}

fn main() {
    let start = Instant::now();
    let args = common::args::parse_or_exit("train_throughput", parse_args);
    common::main_with(|| run(&args, start))
}

/// (batch, height/width, classes) of each network.
fn net_shape(net: &str) -> mixprec::Result<(usize, usize, usize)> {
    match net {
        "resnet50" => Ok((256, 224, 1000)),
        "resnet18-cifar" => Ok((512, 32, 10)),
        other => Err(mixprec::Error::invalid_arg(
            "train_throughput",
            "--net",
            other,
            "resnet50 or resnet18-cifar",
        )),
    }
}

fn policy(mode: &str) -> mixprec::Result<amp::Policy> {
    match mode {
        "o0" => Ok(amp::Policy::opt_level(amp::OptLevel::O0)),
        "o2-f16" => Ok(amp::Policy::opt_level(amp::OptLevel::O2)),
        "o2-bf16" => Ok(amp::Policy::opt_level(amp::OptLevel::O2).with_half_dtype(DType::BF16)),
        other => Err(mixprec::Error::invalid_arg(
            "train_throughput",
            "--mode",
            other,
            "o0, o2-f16 or o2-bf16",
        )),
    }
}

/// Device memory in use (all processes; the benchmark runs alone), in MiB.
/// A convolution's geometry as the op table shows it: `n×c×h×w -> c_out kh×kw/stride`.
fn geometry(p: &mixprec::backend::Conv2dParams) -> String {
    format!(
        "{}x{}x{}x{} -> {} {}x{}/{}",
        p.n, p.c_in, p.h, p.w, p.c_out, p.kh, p.kw, p.stride.0
    )
}

fn device_used_mib() -> mixprec::Result<f64> {
    let (free, total) = cuda::mem_get_info(0)?;
    Ok((total - free) as f64 / (1 << 20) as f64)
}

fn run(args: &Args, start: Instant) -> mixprec::Result<()> {
    let dev = Device::cuda(0)?;
    let (net_batch, hw, classes) = net_shape(&args.net)?;
    let batch = args.batch.unwrap_or(net_batch);
    if batch == 0 {
        return Err(mixprec::Error::invalid_arg(
            "train_throughput",
            "--batch",
            0,
            "at least 1",
        ));
    }
    let format = match args.layout.as_str() {
        "nchw" => MemoryFormat::Contiguous,
        "cl" => MemoryFormat::ChannelsLast,
        other => {
            return Err(mixprec::Error::invalid_arg(
                "train_throughput",
                "--layout",
                other,
                "nchw or cl",
            ))
        }
    };
    let model = match args.net.as_str() {
        "resnet50" => nn::resnet::ResNet::resnet50(classes, &dev, 0)?,
        _ => nn::resnet::ResNet::cifar_style(&[2, 2, 2, 2], 3, classes, &dev)?,
    };
    // As PyTorch's `model.to(memory_format=...)`: before the optimizer makes its state.
    model.to_memory_format(format)?;
    let opt = FusedSgd::new(
        model.parameters(),
        SgdConfig {
            lr: args.lr,
            momentum: 0.9,
            ..Default::default()
        },
    )?;
    let (model, mut opt) = amp::initialize(model, opt, policy(&args.mode)?)?;
    let x = Tensor::randn([batch, 3, hw, hw], 0.0, 1.0, 1, DType::F32, dev)?
        .to_memory_format(format)?;
    let labels: Vec<i64> = (0..batch as i64)
        .map(|i| (i * 7919) % classes as i64)
        .collect();
    let y = Tensor::from_vec(labels, [batch], dev)?;

    let mut step = || -> mixprec::Result<Tensor> {
        let loss = nn::loss::cross_entropy(&model.forward(&x)?, &y)?;
        opt.zero_grad()?;
        opt.backward(&loss)?;
        opt.step()?;
        Ok(loss)
    };
    let gpu = device(0)?;
    step()?;
    gpu.synchronize()?;
    let first_step_s = start.elapsed().as_secs_f64();
    // How the convolution plans of the first step were chosen (timed here or from the plan
    // cache) and what that cost.
    let plans = cuda::conv_plans(0)?;
    let conv = format!(
        "\"cudnn_api\": \"{}\", \"conv_plans\": {}, \"conv_plans_from_cache\": {}, \
         \"conv_choice_s\": {:.2}, \"conv_timing_runs\": {}, \"conv_workspace_max_mib\": {:.0}",
        std::env::var("MIXPREC_CUDNN_API").unwrap_or_else(|_| "both".into()),
        plans.len(),
        plans
            .iter()
            .filter(|p| p.source == cuda::PlanSource::Cache)
            .count(),
        plans.iter().map(|p| p.choice_ms).sum::<f64>() / 1e3,
        cuda::conv_timing_runs(0)?,
        plans.iter().map(|p| p.workspace).max().unwrap_or(0) as f64 / (1 << 20) as f64,
    );
    // Which channels_last batch norms run on cuDNN (timed against ours on the first step).
    let bn = cuda::batch_norm_choices(0)?;
    let conv = format!(
        "{conv}, \"batch_norm_impl\": \"{:?}\", \"batch_norm_shapes\": {}, \"batch_norm_on_cudnn\": {}",
        cuda::batch_norm_impl(),
        bn.len(),
        bn.iter().filter(|c| c.implementation == "cudnn").count()
    );
    for _ in 1..args.warmup {
        step()?;
    }
    gpu.synchronize()?;
    cuda::reset_peak_memory(0)?;

    if args.profile {
        cuda::set_op_profiling(true);
        let t = Instant::now();
        for _ in 0..2 {
            step()?;
        }
        gpu.synchronize()?;
        let wall_ms = t.elapsed().as_secs_f64() * 1e3 / 2.0;
        cuda::set_op_profiling(false);
        let rows = cuda::op_profile()?;
        let busy: f64 = rows.iter().map(|r| r.total_ms).sum::<f64>() / 2.0;
        eprintln!(
            "profile {} {} {}: device busy {busy:.2} ms per step, wall {wall_ms:.2} ms (timers add host work)",
            args.net, args.mode, args.layout
        );
        let mut by_op: std::collections::BTreeMap<&str, (usize, f64)> = Default::default();
        for r in &rows {
            let e = by_op.entry(r.op).or_default();
            e.0 += r.calls;
            e.1 += r.total_ms / 2.0;
        }
        let mut ops: Vec<_> = by_op.into_iter().collect();
        ops.sort_by(|a, b| b.1 .1.total_cmp(&a.1 .1));
        for (op, (calls, ms)) in ops {
            eprintln!(
                "  op {op:<28} {:>5} calls/step {ms:>8.2} ms/step",
                calls / 2
            );
        }
        for r in rows.iter().take(40) {
            eprintln!(
                "  {:<24} {:<48} {:>4}x {:>8.3} ms/step",
                r.op,
                r.detail,
                r.calls / 2,
                r.total_ms / 2.0
            );
        }
        // Each convolution plan's time when it was chosen (alone, on its first call's buffers),
        // under the op and detail names above: set beside the in-network rows, a plan that is
        // fast alone and slow in the step shows up.
        let mut plans = cuda::conv_plans(0)?;
        plans.sort_by(|a, b| {
            b.time_ms
                .unwrap_or(0.0)
                .total_cmp(&a.time_ms.unwrap_or(0.0))
        });
        for c in &plans {
            let p = &c.params;
            let op = match c.direction {
                "forward" => "conv2d",
                "backward-data" => "conv2d_backward_input",
                "backward-data-add" => "conv2d_backward_input_add",
                _ => "conv2d_backward_weight",
            };
            eprintln!(
                "  plan {op:<24} {:<48} {:>8.3} ms alone ({:?}) {} {}",
                geometry(p),
                c.time_ms.unwrap_or(f32::NAN),
                c.source,
                c.dtype,
                c.algorithm
            );
        }
    }

    if args.profile {
        for c in cuda::conv_space_to_depth_choices(0) {
            eprintln!(
                "  space-to-depth {} {:<16} {}: as given {:.3} ms, rewritten {:.3} ms: {}",
                c.dtype,
                c.direction,
                geometry(&c.params),
                c.direct_ms.unwrap_or(f32::NAN),
                c.rewritten_ms.unwrap_or(f32::NAN),
                if c.chosen { "rewritten" } else { "as given" }
            );
        }
        for c in cuda::batch_norm_choices(0)? {
            eprintln!(
                "  batch norm {} {}x{}x{} res={} relu={}: {} (forward + backward: {}){}",
                c.dtype,
                c.n,
                c.c,
                c.spatial,
                c.residual,
                c.relu,
                c.implementation,
                c.timing.as_deref().unwrap_or("not timed"),
                c.cudnn_refused
                    .map(|e| format!(", cuDNN refused: {e}"))
                    .unwrap_or_default()
            );
        }
    }

    let syncs_before = cuda::host_sync_count();
    let t = Instant::now();
    let mut loss = None;
    for _ in 0..args.steps {
        loss = Some(step()?);
    }
    let enqueue_s = t.elapsed().as_secs_f64();
    gpu.synchronize()?;
    let wall_s = t.elapsed().as_secs_f64();
    let syncs = cuda::host_sync_count() - syncs_before - 1;
    let mem = cuda::memory_stats(0)?;
    let used_mib = device_used_mib()?;
    let stats = opt.stats()?;
    let final_loss = match loss {
        Some(l) => l.item()?,
        None => f64::NAN,
    };
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    println!(
        "{{\"side\": \"mixprec\", \"net\": \"{}\", \"mode\": \"{}\", \"layout\": \"{}\", \"batch\": {batch}, \
         \"steps\": {}, \"total_steps\": {}, \"img_per_s\": {:.1}, \"step_ms\": {:.3}, \"enqueue_ms\": {:.3}, \
         \"first_step_s\": {first_step_s:.2}, \"device_used_mib\": {used_mib:.0}, \
         \"pool_used_high_mib\": {:.0}, \"pool_reserved_high_mib\": {:.0}, \
         \"host_syncs_per_step\": {:.2}, \"skipped\": {}, \"loss_scale\": {}, \"final_loss\": {final_loss:.4}, \
         {conv}}}",
        args.net,
        args.mode,
        args.layout,
        args.steps,
        args.warmup.max(1) + args.steps + if args.profile { 2 } else { 0 },
        (batch * args.steps) as f64 / wall_s,
        wall_s * 1e3 / args.steps as f64,
        enqueue_s * 1e3 / args.steps as f64,
        mib(mem.used_high),
        mib(mem.reserved_high),
        syncs as f64 / args.steps as f64,
        stats.iter().map(|s| s.skipped_total).sum::<u64>(),
        stats.first().map_or(1.0, |s| s.scale),
    );
    Ok(())
}
