//! The block-stack twin against PyTorch (issue 42's second acceptance check), and the captured
//! step against the eager one. Runs first; `benches/torch_block_twin.py` runs after it and
//! prints the comparison:
//!
//! ```text
//! cargo run --release --example block_twin -- DIR [cuda|cpu] [--small] [--steps N]
//! python3 benches/torch_block_twin.py DIR [--device cuda|cpu]
//! ```
//!
//! 1. A GPT-2-style stack (`nn::Gpt`: 2 layers, 12 heads, d 768, context 1024, the padded
//!    50304-token vocabulary, no dropout; batch 2 x 1024) writes its initial weights under
//!    Hugging Face GPT-2 names and the batch to `DIR/init.safetensors` (as `gpt_twin` does).
//!    For each of O0, O1 bf16, O1 f16, O2 bf16 and O2 f16 a fresh copy (the same seed) runs one
//!    forward and the scaled backward of the mean cross-entropy; `DIR/ours_LEVEL.safetensors`
//!    gets the logits (f32), the loss, each token's loss (no reduction, from the same logits) and
//!    every parameter's gradient, unscaled, as f32, with the loss scale and the attention path in
//!    the metadata.
//! 2. The captured step bitwise equal to the eager one: per level, two models from the same seed
//!    take N optimizer steps (FusedAdam, clip 1.0) on the batch, one eagerly and one through
//!    `amp::CapturedStep` (1 eager warm-up step, then the capture and its replays), and every
//!    parameter (and every f32 master at O2) is compared bit for bit. A third model, eager
//!    again, is the control: it shows that two eager runs agree bitwise, without which the
//!    comparison would mean nothing. For that the step is made deterministic:
//!    `backend::cuda::set_deterministic(true)` (the embedding's backward takes its ordered
//!    scatter instead of atomics) and `MIXPREC_FLASH_ATTENTION=0` (the flash backward adds dQ
//!    with f32 atomics in an order that changes from run to run, and the determinism switch
//!    does not route around it, so attention takes the math path: batched products and the
//!    fused masked softmax, no atomics); this part runs in a child process of its own (the
//!    example runs itself with `--no-twin`), so that both switches hold from its first op. The
//!    cross-entropy's kept-row count is an atomic sum of
//!    ones, exact in any order. On the CPU the "captured" model runs `CapturedStep::eager`.
//!
//! `--keep-flash` runs the captured part with flash attention left on (a diagnostic).
//! `--seed N` draws the weights and the batch from seed N (default: weights 7, batch 3);
//! `benches/block_twin_seeds.sh` runs the twin over several seeds, for the scalar loss, whose
//! error from one draw says little.
//! `--small`: 2 layers, 2 heads, d 64, context 32, vocabulary 128, batch 2 x 32 (a CPU run).
//! `--no-capture` / `--no-twin` skip a part; `--levels O2-bf16,O1-bf16` runs only those levels.
//! `--seeds A-B`: the twin part for every seed from A to B in one process, into `DIR/seedS`
//! (`torch_block_twin.py DIR/seed*` reads them in one process too); with `--loss-only` each level
//! runs the forward only and writes the loss and each token's loss (no logits, no gradients):
//! the scalar loss over hundreds of seeds. Each seed's weights take 215 MB at full size:
//! `torch_block_twin.py --remove` deletes a seed's files once compared.
//! Exit status 1 when a level fails to run or a bitwise comparison fails.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use mixprec::amp::{self, OptLevel, Policy};
use mixprec::nn::{
    cross_entropy, cross_entropy_with, CrossEntropyConfig, Gpt, GptConfig, Module, Reduction,
};
use mixprec::optim::{AdamConfig, FusedAdam};
use mixprec::tensor::SdpaOptions;
use mixprec::{DType, Device, Error, Result, Tensor};

const LEVELS: [&str; 5] = ["O0", "O1-bf16", "O1-f16", "O2-bf16", "O2-f16"];
/// The weights' seed and the batch's without `--seed` (the figures in benches/RESULTS.md).
const SEEDS: (u64, u64) = (7, 3);

#[derive(Clone)]
struct Args {
    dir: PathBuf,
    device: Device,
    small: bool,
    /// The weights' seed and the batch's.
    seeds: (u64, u64),
    steps: usize,
    twin: bool,
    capture: bool,
    /// The captured part with flash attention left on (a diagnostic: does it stay bitwise?).
    keep_flash: bool,
    /// The levels to run (`--levels`; all by default).
    levels: Vec<&'static str>,
    /// `--seeds A-B`: the twin part for each seed in one process, into DIR/seedS.
    seed_range: Option<(u64, u64)>,
    /// The forward only: the loss and each token's loss.
    loss_only: bool,
}

fn parse_args() -> std::result::Result<Args, String> {
    let mut it = std::env::args().skip(1);
    let mut dir = None;
    let mut device = None;
    let (mut small, mut steps, mut twin, mut capture) = (false, 3usize, true, true);
    let mut keep_flash = false;
    let mut seeds = SEEDS;
    let mut levels = LEVELS.to_vec();
    let (mut seed_range, mut loss_only) = (None, false);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--small" => small = true,
            "--no-twin" => twin = false,
            "--no-capture" => capture = false,
            "--keep-flash" => keep_flash = true,
            "--loss-only" => loss_only = true,
            "--seeds" => {
                let v = it.next().ok_or("--seeds needs a range, e.g. 1-64")?;
                let bad =
                    || format!("--seeds needs a range A-B of whole numbers, A <= B, not '{v}'");
                let (a, b) = v.split_once('-').ok_or_else(bad)?;
                let (a, b): (u64, u64) =
                    (a.parse().map_err(|_| bad())?, b.parse().map_err(|_| bad())?);
                if a > b {
                    return Err(bad());
                }
                seed_range = Some((a, b));
            }
            "--seed" => {
                let v = it.next().ok_or("--seed needs a value")?;
                let n: u64 = v
                    .parse()
                    .map_err(|_| format!("--seed needs a whole number, not '{v}'"))?;
                seeds = (n, n);
            }
            "--levels" => {
                let v = it
                    .next()
                    .ok_or("--levels needs a list, e.g. O2-bf16,O1-bf16")?;
                levels = v
                    .split(',')
                    .map(|l| {
                        LEVELS.iter().copied().find(|k| *k == l).ok_or(format!(
                            "--levels: unknown level '{l}' (known: {})",
                            LEVELS.join(", ")
                        ))
                    })
                    .collect::<std::result::Result<_, _>>()?;
            }
            "--steps" => {
                let v = it.next().ok_or("--steps needs a value")?;
                steps = v
                    .parse()
                    .map_err(|_| format!("--steps needs a whole number, not '{v}'"))?;
            }
            "cuda" => device = Some(Device::cuda(0).map_err(|e| format!("no CUDA device: {e}"))?),
            "cpu" => device = Some(Device::Cpu),
            other if other.starts_with("--") => return Err(format!("unknown flag {other}")),
            other if dir.is_none() => dir = Some(PathBuf::from(other)),
            other => return Err(format!("unexpected argument '{other}'")),
        }
    }
    let dir = dir.ok_or(
        "usage: block_twin DIR [cuda|cpu] [--small] [--steps N] [--seed N | --seeds A-B] \
         [--loss-only] [--levels L,..]",
    )?;
    let device = match device {
        Some(d) => d,
        None => Device::cuda(0).map_err(|e| format!("no CUDA device ({e}); pass `cpu`"))?,
    };
    Ok(Args {
        dir,
        device,
        small,
        seeds,
        steps,
        twin,
        capture,
        keep_flash,
        levels,
        seed_range,
        loss_only,
    })
}

/// The model and the batch size (batch, tokens).
fn config(small: bool) -> (GptConfig, usize, usize) {
    if small {
        let cfg = GptConfig {
            n_layer: 2,
            n_head: 2,
            n_embd: 64,
            block_size: 32,
            vocab_size: 128,
            dropout: 0.0,
        };
        (cfg, 2, 32)
    } else {
        let cfg = GptConfig {
            n_layer: 2,
            n_head: 12,
            n_embd: 768,
            block_size: 1024,
            vocab_size: 50304,
            dropout: 0.0,
        };
        (cfg, 2, 1024)
    }
}

fn policy(level: &str) -> Result<Policy> {
    let (lvl, half) = match level {
        "O0" => (OptLevel::O0, DType::F16),
        "O1-bf16" => (OptLevel::O1, DType::BF16),
        "O1-f16" => (OptLevel::O1, DType::F16),
        "O2-bf16" => (OptLevel::O2, DType::BF16),
        "O2-f16" => (OptLevel::O2, DType::F16),
        other => {
            return Err(Error::invalid_arg(
                "block_twin",
                "level",
                other,
                LEVELS.join(", "),
            ))
        }
    };
    Ok(Policy::opt_level(lvl).with_half_dtype(half))
}

fn half_of(level: &str) -> DType {
    match level {
        "O0" => DType::F32,
        l if l.ends_with("bf16") => DType::BF16,
        _ => DType::F16,
    }
}

/// The batch: random ids below the real vocabulary (as gpt_twin draws them), targets shifted.
fn batch(cfg: &GptConfig, b: usize, t: usize, seed: u64, dev: Device) -> Result<(Tensor, Tensor)> {
    let top = (cfg.vocab_size.min(50257) - 1) as f64;
    let ids: Vec<i64> = mixprec::tensor::random::uniform(seed, b * (t + 1), 0.0, top)
        .into_iter()
        .map(|u| u as i64)
        .collect();
    let rows: Vec<&[i64]> = ids.chunks(t + 1).collect();
    let x: Vec<i64> = rows.iter().flat_map(|r| r[..t].to_vec()).collect();
    let y: Vec<i64> = rows.iter().flat_map(|r| r[1..].to_vec()).collect();
    Ok((
        Tensor::from_vec(x, vec![b, t], dev)?,
        Tensor::from_vec(y, vec![b, t], dev)?,
    ))
}

type Amp = (amp::AmpModel<Gpt>, amp::AmpOptimizer<FusedAdam>);

/// A fresh model from the seed, its FusedAdam (GPT-2's settings), under `level`.
fn make(cfg: GptConfig, seed: u64, level: &str, clip: bool, dev: &Device) -> Result<Amp> {
    let model = Gpt::new(cfg, seed, dev)?;
    let opt = FusedAdam::new(
        model.parameters(),
        AdamConfig {
            lr: 6e-4,
            betas: (0.9, 0.95),
            weight_decay: 0.1,
            adam_w_mode: true,
            ..Default::default()
        },
    )?;
    let (model, mut opt) = amp::initialize(model, opt, policy(level)?)?;
    if clip {
        opt.clip_grad_norm(Some(1.0))?;
    }
    Ok((model, opt))
}

fn attention_path(cfg: &GptConfig, level: &str, b: usize, t: usize, dev: Device) -> String {
    let h = cfg.n_head;
    match Tensor::zeros(vec![b, h, t, cfg.n_embd / h], half_of(level), dev) {
        Ok(p) => format!(
            "{:?}",
            p.attention_path(
                &p,
                &p,
                &SdpaOptions {
                    causal: true,
                    ..Default::default()
                }
            )
        ),
        Err(e) => format!("unknown ({e})"),
    }
}

/// One forward and scaled backward at `level` (the forward only with `--loss-only`); writes
/// DIR/ours_LEVEL.safetensors.
fn twin_level(args: &Args, level: &str, x: &Tensor, y: &Tensor) -> Result<()> {
    let (cfg, b, t) = config(args.small);
    let dev = args.device;
    let (model, mut opt) = make(cfg, args.seeds.0, level, false, &dev)?;
    let n = b * t;
    let _no_grad = args.loss_only.then(mixprec::no_grad);
    let (logits, loss, token_loss) = model.scope(|m| {
        let logits = m.forward(x)?;
        let (rows, targets) = (
            logits.reshape(vec![n, cfg.vocab_size])?,
            y.reshape(vec![n])?,
        );
        let loss = cross_entropy(&rows, &targets)?;
        // Each token's loss (no reduction), from the same logits, outside the graph: the
        // scalar loss is their mean, whose error is a signed sum that one seed draws once.
        let token_loss = {
            let _g = mixprec::no_grad();
            let none = CrossEntropyConfig {
                reduction: Reduction::None,
                ..Default::default()
            };
            cross_entropy_with(&rows, &targets, none)?
        };
        Ok((logits, loss, token_loss))
    })?;
    let mut out = vec![
        ("loss".to_string(), loss.detach().to_dtype(DType::F32)?),
        ("token_loss".to_string(), token_loss.to_dtype(DType::F32)?),
    ];
    if !args.loss_only {
        opt.zero_grad()?;
        opt.backward(&loss)?;
        out.push(("logits".to_string(), logits.detach().to_dtype(DType::F32)?));
    }
    let scale = opt.stats()?.first().map_or(1.0, |s| s.scale);
    let mut param_dtypes = BTreeMap::new();
    for (name, p) in model.inner().named_parameters() {
        *param_dtypes
            .entry(format!("{:?}", p.dtype()))
            .or_insert(0usize) += 1;
        if args.loss_only {
            continue;
        }
        let g = p.grad().ok_or_else(|| {
            Error::invalid_arg("block_twin", "gradient", name.clone(), "one per parameter")
        })?;
        out.push((
            format!("grad.{name}"),
            g.to_dtype(DType::F32)?.mul_scalar(1.0 / scale)?,
        ));
    }
    let path = attention_path(&cfg, level, b, t, dev);
    let meta: BTreeMap<String, String> = [
        ("level".to_string(), level.to_string()),
        ("loss_scale".to_string(), format!("{scale}")),
        ("attention".to_string(), path.clone()),
        ("param_dtypes".to_string(), format!("{param_dtypes:?}")),
    ]
    .into_iter()
    .collect();
    let file = args.dir.join(format!("ours_{level}.safetensors"));
    mixprec::io::safetensors::write(&file, &out, &meta)?;
    let line = serde_json::json!({
        "part": "twin",
        "level": level,
        "loss": loss.item()?,
        "loss_scale": scale,
        "attention": path,
        "param_dtypes": format!("{param_dtypes:?}"),
        "file": file.display().to_string(),
    });
    println!("{line}");
    Ok(())
}

/// One plain eager step: what a user's training loop does.
fn eager_step(
    m: &amp::AmpModel<Gpt>,
    opt: &mut amp::AmpOptimizer<FusedAdam>,
    x: &Tensor,
    y: &Tensor,
) -> Result<f64> {
    opt.zero_grad()?;
    let loss = m.scope(|g| g.loss(x, y))?;
    opt.backward(&loss)?;
    opt.step()?;
    loss.item()
}

/// Every parameter and master of `a` against `b`: (tensors compared, tensors differing, the
/// largest absolute difference, the first differing name).
fn bitwise(a: &Amp, b: &Amp) -> Result<(usize, usize, f64, String)> {
    let mut pairs: Vec<(String, Tensor, Tensor)> = Vec::new();
    let (pa, pb) = (
        a.0.inner().named_parameters(),
        b.0.inner().named_parameters(),
    );
    for ((name, ta), (_, tb)) in pa.into_iter().zip(pb) {
        pairs.push((name, ta, tb));
    }
    for (i, (ta, tb)) in
        a.1.master_params()
            .into_iter()
            .zip(b.1.master_params())
            .enumerate()
    {
        pairs.push((format!("master[{i}]"), ta, tb));
    }
    let (mut differ, mut worst, mut first) = (0usize, 0.0f64, String::new());
    for (name, ta, tb) in &pairs {
        let (va, vb) = (ta.to_vec_f64()?, tb.to_vec_f64()?);
        let mut same = va.len() == vb.len();
        for (u, v) in va.iter().zip(&vb) {
            if u.to_bits() != v.to_bits() {
                same = false;
                worst = worst.max((u - v).abs());
            }
        }
        if !same {
            differ += 1;
            if first.is_empty() {
                first = name.clone();
            }
        }
    }
    Ok((pairs.len(), differ, worst, first))
}

/// The captured step against the eager one (and the eager control) at `level`.
fn captured_level(args: &Args, level: &str, x: &Tensor, y: &Tensor) -> Result<bool> {
    let (cfg, b, t) = config(args.small);
    let dev = args.device;
    let path = attention_path(&cfg, level, b, t, dev);
    let mut eager = make(cfg, args.seeds.0, level, true, &dev)?;
    let mut control = make(cfg, args.seeds.0, level, true, &dev)?;
    let mut cap = make(cfg, args.seeds.0, level, true, &dev)?;
    let mut losses = Vec::new();
    for _ in 0..args.steps {
        losses.push(eager_step(&eager.0, &mut eager.1, x, y)?);
        eager_step(&control.0, &mut control.1, x, y)?;
    }
    let stats = {
        let model = &cap.0;
        let body = |x: &Tensor, y: &Tensor| model.scope(|g| g.loss(x, y));
        let mut step = if dev.is_cuda() {
            amp::CapturedStep::new(model, &mut cap.1, body)?
        } else {
            amp::CapturedStep::eager(model, &mut cap.1, body)?
        }
        .warmup_steps(1)?;
        for _ in 0..args.steps {
            step.run(x, y)?;
        }
        step.stats()
    };
    let (n, ctrl_differ, ctrl_worst, ctrl_first) = bitwise(&eager, &control)?;
    let (_, differ, worst, first) = bitwise(&eager, &cap)?;
    let pass = differ == 0 && ctrl_differ == 0;
    let line = serde_json::json!({
        "part": "captured",
        "level": level,
        "steps": args.steps,
        "attention": path,
        "deterministic": mixprec::backend::cuda::deterministic(),
        "eager_losses": losses,
        "captured_stats": format!("{stats:?}"),
        "tensors": n,
        "captured_vs_eager_differing": differ,
        "max_abs_diff": worst,
        "first_differing": first,
        "control_eager_vs_eager_differing": ctrl_differ,
        "control_max_abs_diff": ctrl_worst,
        "control_first_differing": ctrl_first,
        "pass": pass,
    });
    println!("{line}");
    Ok(pass)
}

fn run(args: &Args) -> Result<bool> {
    if args.capture && !args.twin {
        // The switches that make the step repeatable bit for bit (see the module docs), set
        // before the first op.
        if !args.keep_flash {
            std::env::set_var("MIXPREC_FLASH_ATTENTION", "0");
        }
        mixprec::backend::cuda::set_deterministic(true);
    }
    std::fs::create_dir_all(&args.dir)
        .map_err(|e| Error::io(format!("creating {}", args.dir.display()), e))?;
    let (cfg, b, t) = config(args.small);
    let dev = args.device;
    let (x, y) = batch(&cfg, b, t, args.seeds.1, dev)?;
    let mut ok = true;
    if args.twin {
        let model = Gpt::new(cfg, args.seeds.0, &dev)?;
        let mut state = model.state_dict()?;
        state.push(("x".into(), x.clone()));
        state.push(("y".into(), y.clone()));
        let meta: BTreeMap<String, String> = [
            ("n_layer", cfg.n_layer),
            ("n_head", cfg.n_head),
            ("n_embd", cfg.n_embd),
            ("block_size", cfg.block_size),
            ("vocab_size", cfg.vocab_size),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        write(&args.dir.join("init.safetensors"), &state, &meta)?;
        drop(model);
        for &level in &args.levels {
            if let Err(e) = twin_level(args, level, &x, &y) {
                eprintln!("block_twin: {level} failed: {e}");
                ok = false;
            }
        }
    }
    if args.capture && args.twin {
        // The bitwise part in a process of its own, its switches set before its first op (a
        // cached flash-availability answer from the twin part cannot leak into it).
        let exe = std::env::current_exe()
            .map_err(|e| Error::io("finding this executable to run the captured part", e))?;
        let mut cmd = std::process::Command::new(exe);
        cmd.arg(&args.dir)
            .arg(if dev.is_cuda() { "cuda" } else { "cpu" })
            .args(["--no-twin", "--steps", &args.steps.to_string()]);
        if args.seeds != SEEDS {
            cmd.args(["--seed", &args.seeds.0.to_string()]);
        }
        if args.small {
            cmd.arg("--small");
        }
        if args.keep_flash {
            cmd.arg("--keep-flash");
        }
        if args.levels.len() < LEVELS.len() {
            cmd.args(["--levels", &args.levels.join(",")]);
        }
        let status = cmd
            .status()
            .map_err(|e| Error::io("running the captured part", e))?;
        ok &= status.success();
    } else if args.capture {
        let attention = if args.keep_flash {
            "flash attention LEFT ON (--keep-flash, a diagnostic: its dQ backward adds with f32 \
             atomics, so even the eager control may differ)"
        } else {
            "flash attention off (MIXPREC_FLASH_ATTENTION=0: its dQ backward adds with f32 \
             atomics), attention on the math path"
        };
        println!(
            "captured vs eager: deterministic mode on (embedding backward: ordered scatter, no \
             atomics); {attention}; {} steps, 1 eager warm-up then capture{}",
            args.steps,
            if dev.is_cuda() {
                ""
            } else {
                " (CPU: CapturedStep::eager, no graph)"
            }
        );
        for &level in &args.levels {
            match captured_level(args, level, &x, &y) {
                Ok(pass) => ok &= pass,
                Err(e) => {
                    eprintln!("block_twin: captured {level} failed: {e}");
                    ok = false;
                }
            }
        }
    }
    Ok(ok)
}

fn write(path: &Path, state: &[(String, Tensor)], meta: &BTreeMap<String, String>) -> Result<()> {
    mixprec::io::safetensors::write(path, state, meta)
}

fn main() {
    let _ = env_logger::try_init();
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("block_twin: {e}");
            std::process::exit(2);
        }
    };
    let runs: Vec<Args> = match args.seed_range {
        None => vec![args],
        // One process for every seed: each into DIR/seedS, its twin part only.
        Some((a, b)) => (a..=b)
            .map(|s| Args {
                dir: args.dir.join(format!("seed{s}")),
                seeds: (s, s),
                capture: false,
                ..args.clone()
            })
            .collect(),
    };
    let mut ok = true;
    for a in &runs {
        match run(a) {
            Ok(pass) => ok &= pass,
            Err(e) => {
                eprintln!("block_twin: {}: {e}", a.dir.display());
                ok = false;
            }
        }
    }
    if !ok {
        std::process::exit(1);
    }
}
