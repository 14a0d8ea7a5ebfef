//! GPT-2's whole training step against PyTorch's (`benches/torch_gpt_throughput.py` prints the
//! same fields). Exits quietly without a GPU. One configuration per process, so that its peak
//! memory is its own:
//!
//! ```text
//! bench-gpt_throughput [--model gpt2|gpt2-medium|...] [--mode o0|o1-bf16|o1-f16|o2-bf16|o2-f16]
//!                      [--captured] [--batch 16] [--seq 1024] [--steps 20] [--warmup 5] [--profile]
//!                      [--nproc-per-node N] [--bucket-cap-mb MB] [--checkpoint-activations]
//!                      [--zero] [--n-layer L --n-embd C --n-head H]
//! ```
//!
//! Several GPUs: `--nproc-per-node N` starts the bench N times, one rank per GPU (as
//! `train_gpt --nproc-per-node` does; torchrun's variables work too), each on its own batch of
//! `--batch` sequences, the model wrapped in `DistributedDataParallel` over NCCL (PyTorch's
//! twin: `torchrun ... torch_gpt_throughput.py --ddp`). Rank 0 alone prints, with `world`, and
//! `tokens_per_s` counting every rank's tokens (over the slowest rank's time).
//!
//! The step is the PyTorch twin's: forward, cross-entropy over the padded 50304-token vocabulary,
//! the scaled backward, clipping at norm 1.0, fused AdamW (lr 6e-4, betas 0.9/0.95, weight decay
//! 0.1 on every parameter, as the twin does), the loss-scale update; random tokens already on the
//! device. `--captured` replays the step as one CUDA graph (`amp::CapturedStep`). One JSON line:
//! tokens/s, step time, first-step time (process start to the end of the first step), peak pool
//! memory (bytes handed to tensors: PyTorch's `max_memory_allocated`), host syncs per step,
//! skipped steps, the final loss, the attention path taken. `--checkpoint-activations`
//! checkpoints every transformer block (recomputed in backward: less memory, more time).
//! `--zero` (with `--nproc-per-node`): the ZeRO-sharded AdamW (`distributed::ZeroAdam`,
//! gradients reduce-scattered in DDP's buckets during backward, `--bucket-cap-mb` sized, state
//! and FP32 masters 1/world per rank, clipping by the global norm inside it) instead of DDP +
//! FusedAdam; eager only. `opt_state_mib` is the FP32 masters
//! and moments one rank holds (12 bytes a parameter at O2, 8 without masters, /world sharded).
//!
//! `--n-layer`, `--n-embd`, `--n-head` override the `--model` preset's shape (GPT-2-shaped
//! models beyond the presets: 32 × 2560 is ~2.7B). Running out of device memory is not a
//! crash: the rank that ran out prints one JSON line with `"oom": true` (the model, its
//! parameters, the error) and exits with status 3, which ends every rank
//! (`benches/largest_gpt.sh` searches a ladder of models so). `peak_run_mib` is the pool's
//! high-water mark over the whole run (model, optimizer state, warm-up and timed steps), per
//! GPU.

mod common;

use std::time::Instant;

use mixprec::backend::cuda::{self, device};
use mixprec::distributed::{
    Backend, DdpConfig, DistributedDataParallel, GroupOptions, LaunchEnv, ProcessGroup, ZeroAdam,
};
use mixprec::nn::{Gpt, GptConfig, Module, GPT2_VOCAB};
use mixprec::optim::{AdamConfig, FusedAdam, Optimizer};
use mixprec::tensor::{AttentionPath, SdpaOptions};
use mixprec::train::distributed::{launched, spawn_ranks};
use mixprec::train::gpt::step_body;
use mixprec::{amp, DType, Device, Tensor};

struct Args {
    model: String,
    mode: String,
    captured: bool,
    batch: usize,
    seq: usize,
    steps: usize,
    warmup: usize,
    profile: bool,
    nproc: Option<usize>,
    /// DDP's gradient bucket size (PyTorch's `bucket_cap_mb`).
    bucket_cap_mb: f64,
    checkpoint_activations: bool,
    zero: bool,
    n_layer: Option<usize>,
    n_embd: Option<usize>,
    n_head: Option<usize>,
}

fn parse_args(flags: &mut common::args::Flags) -> Result<Args, String> {
    let mut a = Args {
        model: "gpt2".into(),
        mode: "o2-bf16".into(),
        captured: false,
        batch: 16,
        seq: 1024,
        steps: 20,
        warmup: 5,
        profile: false,
        nproc: None,
        bucket_cap_mb: DdpConfig::default().bucket_cap_mb,
        checkpoint_activations: false,
        zero: false,
        n_layer: None,
        n_embd: None,
        n_head: None,
    };
    while let Some(flag) = flags.next_flag() {
        match flag.as_str() {
            "--model" => a.model = flags.value(&flag)?,
            "--mode" => a.mode = flags.value(&flag)?,
            "--captured" => a.captured = true,
            "--batch" => a.batch = flags.number(&flag)?,
            "--seq" => a.seq = flags.number(&flag)?,
            "--steps" => a.steps = flags.number(&flag)?,
            "--warmup" => a.warmup = flags.number(&flag)?,
            "--profile" => a.profile = true,
            "--nproc-per-node" => a.nproc = Some(flags.number(&flag)?),
            "--checkpoint-activations" => a.checkpoint_activations = true,
            "--bucket-cap-mb" => {
                a.bucket_cap_mb = flags
                    .value(&flag)?
                    .parse()
                    .map_err(|_| "--bucket-cap-mb needs a number of MiB")?
            }
            "--zero" => a.zero = true,
            "--n-layer" => a.n_layer = Some(flags.number(&flag)?),
            "--n-embd" => a.n_embd = Some(flags.number(&flag)?),
            "--n-head" => a.n_head = Some(flags.number(&flag)?),
            other => return Err(common::args::unknown(other)),
        }
    }
    if a.batch == 0 || a.seq == 0 || a.steps == 0 || a.nproc == Some(0) {
        return Err("--batch, --seq, --steps and --nproc-per-node must be at least 1".into());
    }
    if [a.n_layer, a.n_embd, a.n_head].contains(&Some(0)) {
        return Err("--n-layer, --n-embd and --n-head must be at least 1".into());
    }
    Ok(a)
}

fn main() {
    let start = Instant::now();
    let args = common::args::parse_or_exit("gpt_throughput", parse_args);
    if let (Some(n), false) = (args.nproc, launched()) {
        // The ranks: this bench again, with the same arguments but that one.
        match spawn_ranks("gpt_throughput", n, None) {
            Ok(code) => std::process::exit(code.into()),
            Err(e) => {
                eprintln!("gpt_throughput: {e}");
                std::process::exit(1);
            }
        }
    }
    common::main_with(|| match run(&args, start) {
        Err(e) if is_oom(&e) => {
            report_oom(&args, &e);
            std::process::exit(3)
        }
        r => r,
    })
}

/// Whether `e` is the device running out of memory: the allocator's error, or a library's
/// (cuBLAS, cuDNN, NCCL) allocation failure passed on as its status.
fn is_oom(e: &mixprec::Error) -> bool {
    if matches!(e, mixprec::Error::OutOfMemory { .. }) {
        return true;
    }
    let m = e.to_string();
    ["OUT_OF_MEMORY", "out of memory", "ALLOC_FAILED"]
        .iter()
        .any(|k| m.contains(k))
}

/// The JSON line of a run that ran out of memory (printed by the rank that did).
fn report_oom(args: &Args, e: &mixprec::Error) {
    let env = LaunchEnv::from_env().ok();
    let (rank, world) = env.map_or((0, 1), |v| (v.rank, v.world_size));
    let (name, params) = match model_config(args) {
        Ok(cfg) => (model_name(args, &cfg), cfg.num_parameters()),
        Err(_) => (args.model.clone(), 0),
    };
    let detail = e.to_string().replace(['"', '\\', '\n'], " ");
    println!(
        "{{\"side\": \"mixprec\", \"model\": \"{name}\", \"mode\": \"{}\", \"checkpoint_activations\": {}, \
         \"zero\": {}, \"world\": {world}, \"rank\": {rank}, \"batch\": {}, \"seq\": {}, \"params\": {params}, \
         \"oom\": true, \"error\": \"{detail}\"}}",
        args.mode, args.checkpoint_activations, args.zero, args.batch, args.seq
    );
}

/// The `--model` preset with the shape flags applied, its context at least `--seq`.
fn model_config(args: &Args) -> mixprec::Result<GptConfig> {
    let mut cfg = GptConfig::named(&args.model)?;
    cfg.n_layer = args.n_layer.unwrap_or(cfg.n_layer);
    cfg.n_embd = args.n_embd.unwrap_or(cfg.n_embd);
    cfg.n_head = args.n_head.unwrap_or(cfg.n_head);
    if cfg.n_embd % cfg.n_head != 0 {
        return Err(mixprec::Error::invalid_arg(
            "gpt_throughput",
            "--n-embd",
            cfg.n_embd,
            format!("a multiple of the heads ({})", cfg.n_head),
        ));
    }
    cfg.block_size = cfg.block_size.max(args.seq);
    Ok(cfg)
}

/// The preset's name, or `{layers}x{width}h{heads}` when the shape flags changed it.
fn model_name(args: &Args, cfg: &GptConfig) -> String {
    if [args.n_layer, args.n_embd, args.n_head]
        .iter()
        .all(Option::is_none)
    {
        args.model.clone()
    } else {
        format!("{}x{}h{}", cfg.n_layer, cfg.n_embd, cfg.n_head)
    }
}

fn policy(mode: &str) -> mixprec::Result<amp::Policy> {
    use amp::{OptLevel, Policy};
    let half = |p: Policy, bf16: bool| {
        if bf16 {
            p.with_half_dtype(DType::BF16)
        } else {
            p
        }
    };
    match mode {
        "o0" => Ok(Policy::opt_level(OptLevel::O0)),
        "o1-f16" | "o1-bf16" => Ok(half(
            Policy::opt_level(OptLevel::O1),
            mode.ends_with("bf16"),
        )),
        "o2-f16" | "o2-bf16" => Ok(half(
            Policy::opt_level(OptLevel::O2),
            mode.ends_with("bf16"),
        )),
        other => Err(mixprec::Error::invalid_arg(
            "gpt_throughput",
            "--mode",
            other,
            "o0, o1-bf16, o1-f16, o2-bf16 or o2-f16",
        )),
    }
}

fn random_tokens(n: usize, seed: u64, dev: Device) -> mixprec::Result<Tensor> {
    let ids: Vec<i64> = mixprec::tensor::random::uniform(seed, n, 0.0, GPT2_VOCAB as f64)
        .into_iter()
        .map(|u| (u as i64).min(GPT2_VOCAB as i64 - 1))
        .collect();
    Tensor::from_vec(ids, vec![n], Device::Cpu)?.to_device(dev)
}

fn run(args: &Args, start: Instant) -> mixprec::Result<()> {
    // Under a launcher: one rank on cuda:LOCAL_RANK, in a group over NCCL.
    let env = LaunchEnv::from_env()?;
    let group = match env.is_distributed() {
        true => Some(ProcessGroup::new(&env, &GroupOptions::new(Backend::Nccl))?),
        false => None,
    };
    let (world, rank) = (env.world_size, env.rank);
    let dev = match &group {
        Some(g) => g.device(),
        None => Device::cuda(0)?,
    };
    let Device::Cuda(ordinal) = dev else {
        return Err(mixprec::Error::Cuda(format!("the group's device is {dev}")));
    };
    let cfg = model_config(args)?;
    let name = model_name(args, &cfg);
    let model = Gpt::new(cfg, 0, &dev)?.with_activation_checkpointing(args.checkpoint_activations);
    let params = model.num_parameters();
    let adam = AdamConfig {
        lr: 6e-4,
        betas: (0.9, 0.95),
        weight_decay: 0.1,
        adam_w_mode: true,
        ..Default::default()
    };
    let zero = match (&group, args.zero) {
        (Some(g), true) => Some(g),
        (None, true) => {
            return Err(mixprec::Error::invalid_arg(
                "gpt_throughput",
                "--zero",
                "without --nproc-per-node",
                "--nproc-per-node N (ZeRO shards over the ranks)",
            ))
        }
        _ => None,
    };
    if zero.is_some() && args.captured {
        return Err(mixprec::Error::invalid_arg(
            "gpt_throughput",
            "--captured",
            "with --zero",
            "no --captured: the sharded step runs eagerly",
        ));
    }
    let opt: Box<dyn Optimizer> = match zero {
        Some(g) => {
            let mut z = ZeroAdam::single(g, model.parameters(), adam)?;
            z.clip_grad_norm(Some(1.0))?;
            // DDP's bucket sizes: the reduce-scatters leave during backward as its all-reduces.
            z.set_bucket_cap_mb(DdpConfig::default().first_bucket_mb, args.bucket_cap_mb)?;
            Box::new(z)
        }
        None => Box::new(FusedAdam::new(model.parameters(), adam)?),
    };
    let masters = args.mode.starts_with("o2");
    let (model, mut opt) = amp::initialize(model, opt, policy(&args.mode)?)?;
    if zero.is_none() {
        opt.clip_grad_norm(Some(1.0))?;
    }
    // FP32 masters (O2) and two moments per parameter, for this rank's share under --zero.
    let state_bytes =
        (if masters { 12 } else { 8 }) * params.div_ceil(if zero.is_some() { world } else { 1 });
    let (b, t) = (args.batch, args.seq);
    // Each rank its own batch.
    let seed = 2 * rank as u64;
    let x = random_tokens(b * t, seed + 1, dev)?.reshape(vec![b, t])?;
    let y = random_tokens(b * t, seed + 2, dev)?.reshape(vec![b, t])?;

    // Which attention path the blocks take at this shape and dtype.
    let half = match args.mode.as_str() {
        "o0" => DType::F32,
        m if m.ends_with("bf16") => DType::BF16,
        _ => DType::F16,
    };
    let h = cfg.n_head;
    let probe = Tensor::zeros(vec![b, h, t, cfg.n_embd / h], half, dev)?;
    let path: AttentionPath = probe.attention_path(
        &probe,
        &probe,
        &SdpaOptions {
            causal: true,
            ..Default::default()
        },
    );
    drop(probe);

    let model = std::sync::Arc::new(model);
    let ddp = match group.as_ref().filter(|_| zero.is_none()) {
        Some(g) => Some(DistributedDataParallel::new(
            model.clone(),
            g,
            DdpConfig {
                bucket_cap_mb: args.bucket_cap_mb,
                ..DdpConfig::default()
            },
        )?),
        None => None,
    };
    // train_gpt's step body (through DDP under a launcher).
    let body = step_body(&model, ddp.as_ref(), 1);
    // Eager or captured, the same step object (eager: every step runs as written).
    let mut stepper = if args.captured {
        amp::CapturedStep::new(&*model, &mut opt, body)?
    } else {
        amp::CapturedStep::eager(&*model, &mut opt, body)?
    };
    let mut step = || stepper.run(&x, &y);
    let gpu = device(ordinal)?;
    let first_loss = step()?.item()?;
    let first_step_s = start.elapsed().as_secs_f64();
    // A captured step runs two eager warm-up steps, then captures: past them before timing.
    for _ in 1..args.warmup.max(4) {
        step()?;
    }
    gpu.synchronize()?;
    // The high-water mark of the model, the state and the warm-up steps.
    let warm_peak = cuda::memory_stats(ordinal)?.used_high;
    cuda::reset_peak_memory(ordinal)?;

    if args.profile && !args.captured {
        cuda::set_op_profiling(true);
        for _ in 0..2 {
            step()?;
        }
        gpu.synchronize()?;
        cuda::set_op_profiling(false);
        let rows = cuda::op_profile()?;
        let busy: f64 = rows.iter().map(|r| r.total_ms).sum::<f64>() / 2.0;
        eprintln!(
            "profile {} {}: device busy {busy:.2} ms per step",
            args.model, args.mode
        );
        for r in rows.iter().take(40) {
            eprintln!(
                "  {:<28} {:<48} {:>4}x {:>8.3} ms/step",
                r.op,
                r.detail,
                r.calls / 2,
                r.total_ms / 2.0
            );
        }
    }

    // The ranks start the timed steps together.
    if let Some(g) = &group {
        g.barrier()?;
    }
    let syncs_before = cuda::host_sync_count();
    let t0 = Instant::now();
    let mut loss = None;
    for _ in 0..args.steps {
        loss = Some(step()?);
    }
    gpu.synchronize()?;
    let mut wall_s = t0.elapsed().as_secs_f64();
    let syncs = cuda::host_sync_count() - syncs_before - 1;
    if let Some(g) = &group {
        // The run's time is its slowest rank's.
        for bytes in g.all_gather_bytes(&wall_s.to_le_bytes())? {
            let w = bytes.try_into().map(f64::from_le_bytes).unwrap_or(f64::NAN);
            wall_s = wall_s.max(w);
        }
    }
    let mem = cuda::memory_stats(ordinal)?;
    let run_peak = mem.used_high.max(warm_peak);
    let stats = stepper.optimizer().stats()?;
    let skipped: u64 = stats.iter().map(|s| s.skipped_total).sum();
    let scale = stats.first().map_or(1.0, |s| s.scale);
    let final_loss = match loss {
        Some(l) => l.item()?,
        None => f64::NAN,
    };
    if rank != 0 {
        return Ok(());
    }
    let step_s = wall_s / args.steps as f64;
    let tokens_per_s = (world * b * t) as f64 / step_s;
    // Per GPU, as PyTorch's side reports it.
    let flops = cfg.train_flops_per_token(t) * (b * t) as f64;
    let mib = |v: u64| v as f64 / (1 << 20) as f64;
    println!(
        "{{\"side\": \"mixprec\", \"model\": \"{}\", \"mode\": \"{}\", \"captured\": {}, \"checkpoint_activations\": {}, \"zero\": {}, \"opt_state_mib\": {:.0}, \"attention\": \"{:?}\", \
         \"world\": {world}, \"batch\": {b}, \"seq\": {t}, \"params\": {params}, \"steps\": {}, \"tokens_per_s\": {tokens_per_s:.0}, \
         \"step_ms\": {:.2}, \"tflops\": {:.1}, \"first_step_s\": {first_step_s:.2}, \
         \"peak_alloc_mib\": {:.0}, \"peak_reserved_mib\": {:.0}, \"peak_run_mib\": {:.0}, \"host_syncs_per_step\": {:.2}, \
         \"skipped\": {skipped}, \"loss_scale\": {scale}, \"loss_first\": {first_loss:.4}, \"loss_last\": {final_loss:.4}, \"oom\": false}}",
        name,
        args.mode,
        args.captured,
        args.checkpoint_activations,
        args.zero,
        mib(state_bytes as u64),
        path,
        args.steps,
        step_s * 1e3,
        flops / step_s / 1e12,
        mib(mem.used_high),
        mib(mem.reserved_high),
        mib(run_peak),
        syncs as f64 / args.steps as f64,
    );
    Ok(())
}
