//! The main job: train a small-image ResNet on Fashion-MNIST and report loss, test accuracy and
//! throughput per epoch.
//!
//!     cargo run --release --example train_resnet [-- OPTIONS]
//!
//! Options (all optional):
//!     --data bundled|DIR   the bundled 10k/2k subset, or a directory with the four IDX files
//!                          (default: $FASHION_MNIST_DIR, else the Debian package's full set, else
//!                          the bundled subset)
//!     --epochs N           (default 10)
//!     --batch-size N       (default 128)
//!     --lr X               peak learning rate of the one-cycle schedule (default 0.1)
//!     --widths A,B,C       channels per stage (default 16,32,64)
//!     --blocks A,B,C       basic blocks per stage (default 1,1,1)
//!     --seed N             (default 0)
//!     --augment on|off     random 2-pixel crop and horizontal flip (default off)
//!     --label-smoothing X  (default 0)
//!     --device cpu|cuda[:N] (default: the first GPU when one is usable, else the CPU, saying why)
//!     --amp FILE           an AMP policy (configs/O0.toml … O3.toml, *_bf16.toml; default: O0,
//!                          plain FP32)

use std::time::Instant;

use mixprec::data::{Augment, DataLoader, DataSource, FashionMnist, Split};
use mixprec::nn::loss::{cross_entropy_with, CrossEntropyConfig};
use mixprec::nn::resnet::{ResNet, ResNetConfig, Stem};
use mixprec::nn::{BlockKind, Module};
use mixprec::optim::{Optimizer, Sgd, SgdConfig};
use mixprec::{amp, Device, Error, Result, Tensor};

struct Args {
    data: Option<String>,
    epochs: usize,
    batch_size: usize,
    lr: f64,
    widths: Vec<usize>,
    blocks: Vec<usize>,
    seed: u64,
    device: Option<String>,
    amp: Option<String>,
    augment: bool,
    label_smoothing: f64,
}

fn parse_list(flag: &str, v: &str) -> Result<Vec<usize>> {
    v.split(',')
        .map(|s| s.trim().parse::<usize>())
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|_| {
            Error::invalid_arg(
                "train_resnet",
                "option",
                format!("{flag} {v}"),
                "comma-separated positive integers",
            )
        })
}

fn parse_args() -> Result<Args> {
    let mut a = Args {
        data: None,
        epochs: 10,
        batch_size: 128,
        lr: 0.1,
        widths: vec![16, 32, 64],
        blocks: vec![1, 1, 1],
        seed: 0,
        device: None,
        amp: None,
        augment: false,
        label_smoothing: 0.0,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let bad = |v: &str, allowed: &str| {
            Error::invalid_arg(
                "train_resnet",
                "option",
                format!("{flag} {v}"),
                allowed.to_string(),
            )
        };
        let value = it.next().ok_or_else(|| {
            bad(
                "(missing value)",
                "every option takes a value; see the file's header",
            )
        })?;
        match flag.as_str() {
            "--data" => a.data = Some(value),
            "--epochs" => {
                a.epochs = value
                    .parse()
                    .map_err(|_| bad(&value, "a positive integer"))?
            }
            "--batch-size" => {
                a.batch_size = value
                    .parse()
                    .map_err(|_| bad(&value, "a positive integer"))?
            }
            "--lr" => {
                a.lr = value
                    .parse()
                    .map_err(|_| bad(&value, "a positive number"))?
            }
            "--widths" => a.widths = parse_list(&flag, &value)?,
            "--blocks" => a.blocks = parse_list(&flag, &value)?,
            "--seed" => {
                a.seed = value
                    .parse()
                    .map_err(|_| bad(&value, "an unsigned integer"))?
            }
            "--device" => a.device = Some(value),
            "--amp" => a.amp = Some(value),
            "--augment" => {
                a.augment = match value.as_str() {
                    "on" => true,
                    "off" => false,
                    _ => return Err(bad(&value, "on or off")),
                }
            }
            "--label-smoothing" => {
                a.label_smoothing = value
                    .parse()
                    .ok()
                    .filter(|v| (0.0..=1.0).contains(v))
                    .ok_or_else(|| bad(&value, "a number in [0, 1]"))?
            }
            _ => {
                return Err(bad(
                    &value,
                    "--data, --epochs, --batch-size, --lr, --widths, --blocks, --seed, \
                     --device, --augment, --label-smoothing, --amp",
                ))
            }
        }
    }
    let lr_ok = a.lr > 0.0; // false for NaN too
    if a.epochs == 0 || a.batch_size == 0 || !lr_ok || a.widths.len() != a.blocks.len() {
        return Err(Error::invalid_arg(
            "train_resnet",
            "options",
            format!(
                "epochs {}, batch size {}, lr {}, {} widths for {} stages",
                a.epochs,
                a.batch_size,
                a.lr,
                a.widths.len(),
                a.blocks.len()
            ),
            "epochs, batch size and lr > 0, one width per stage",
        ));
    }
    Ok(a)
}

/// One-cycle schedule (linear warm-up over the first 15% of steps, then cosine to zero).
fn one_cycle(step: usize, total: usize, peak: f64) -> f64 {
    let warm = (total as f64 * 0.15).max(1.0);
    let s = step as f64;
    if s < warm {
        peak * (0.1 + 0.9 * s / warm)
    } else {
        let t = (s - warm) / (total as f64 - warm).max(1.0);
        peak * 0.5 * (1.0 + (std::f64::consts::PI * t.min(1.0)).cos())
    }
}

fn model_device(model: &impl Module) -> Device {
    model
        .parameters()
        .first()
        .map(|p| p.device())
        .unwrap_or(Device::Cpu)
}

/// Fraction of `test` classified correctly, in eval mode, recording no graph.
fn evaluate(model: &impl Module, test: &DataLoader) -> Result<f64> {
    let _no_grad = mixprec::no_grad();
    model.eval();
    let (mut correct, mut total) = (0usize, 0usize);
    for batch in test.epoch(0) {
        let (x, y) = batch?;
        let x = x.to_device(model_device(model))?;
        let pred = model.forward(&x)?.argmax(1, false)?.to_vec::<i64>()?;
        let labels = y.to_vec::<i64>()?;
        correct += pred.iter().zip(&labels).filter(|(p, l)| p == l).count();
        total += labels.len();
    }
    model.set_training(true);
    Ok(correct as f64 / total.max(1) as f64)
}

fn main() -> Result<()> {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    let args = parse_args()?;
    let device = match args.device.as_deref() {
        None => Device::cuda_if_available(0),
        Some("cpu") => Device::Cpu,
        Some(d) => {
            let ordinal = d
                .strip_prefix("cuda")
                .map(|r| r.trim_start_matches(':'))
                .map(|r| if r.is_empty() { Ok(0) } else { r.parse() });
            match ordinal {
                Some(Ok(i)) => Device::cuda(i)?,
                _ => {
                    return Err(Error::invalid_arg(
                        "train_resnet",
                        "--device",
                        d,
                        "cpu, cuda or cuda:N",
                    ))
                }
            }
        }
    };

    let source = match args.data.as_deref() {
        None => DataSource::locate()?,
        Some("bundled") => DataSource::Bundled(mixprec::data::fashion_mnist::bundled_dir()),
        Some(dir) => DataSource::Env(dir.into()),
    };
    let train = FashionMnist::load_from(&source, Split::Train)?;
    let test = FashionMnist::load_from(&source, Split::Test)?;
    println!("data: {source}");

    let config = ResNetConfig {
        block: BlockKind::Basic,
        blocks: args.blocks.clone(),
        widths: args.widths.clone(),
        in_channels: 1,
        num_classes: 10,
        stem: Stem::Small,
        zero_init_residual: false,
        seed: args.seed,
    };
    let model = ResNet::new(&config, &device)?;
    println!(
        "model: ResNet, basic blocks {:?}, widths {:?}, {} parameters; device {device}; batch {}, {} epochs, SGD one-cycle peak lr {}",
        args.blocks,
        args.widths,
        model.num_parameters(),
        args.batch_size,
        args.epochs,
        args.lr
    );

    let opt = Sgd::new(
        model.parameters(),
        SgdConfig {
            lr: args.lr,
            momentum: 0.9,
            nesterov: true,
            weight_decay: 5e-4,
            ..Default::default()
        },
    )?;
    let policy = match &args.amp {
        Some(file) => amp::Policy::from_toml_file(file)?,
        None => amp::Policy::opt_level(amp::OptLevel::O0),
    };
    println!(
        "amp: {} from {} ({:?})",
        policy.opt_level,
        policy.source,
        policy.properties()?
    );
    let (model, mut opt) = amp::initialize(model, opt, policy)?;
    let mut train_loader = DataLoader::new(train, args.batch_size)
        .shuffle(args.seed)
        .drop_last(true)
        .prefetch(2);
    if args.augment {
        train_loader = train_loader.augment(Augment::crop_flip(2, args.seed));
    }
    let test_loader = DataLoader::new(test, 500).prefetch(2);
    let loss_cfg = CrossEntropyConfig {
        label_smoothing: args.label_smoothing,
        ..Default::default()
    };

    let total_steps = args.epochs * train_loader.num_batches();
    let mut step = 0;
    let run_start = Instant::now();
    let mut accuracy = 0.0;
    for epoch in 0..args.epochs {
        let start = Instant::now();
        let (mut loss_sum, mut images) = (0.0, 0usize);
        // The running loss stays on the device until the epoch ends: no per-step read-back.
        let mut epoch_loss: Option<Tensor> = None;
        for batch in train_loader.epoch(epoch) {
            let (x, y) = batch?;
            let (x, y) = (x.to_device(device)?, y.to_device(device)?);
            opt.inner_mut()
                .set_lr_all(one_cycle(step, total_steps, args.lr))?;
            let loss = cross_entropy_with(&model.forward(&x)?, &y, loss_cfg)?;
            opt.zero_grad()?;
            opt.backward(&loss)?;
            opt.step()?;
            let l = loss.detach();
            epoch_loss = Some(match epoch_loss {
                None => l,
                Some(acc) => acc.add(&l)?,
            });
            images += x.dims()[0];
            step += 1;
        }
        let steps = train_loader.num_batches().max(1);
        if let Some(l) = epoch_loss {
            loss_sum = l.item()?;
        }
        let train_time = start.elapsed().as_secs_f64();
        accuracy = evaluate(&model, &test_loader)?;
        println!(
            "epoch {}/{}  train loss {:.4}  test accuracy {:.2}%  {:.0} images/s  ({:.1} s)",
            epoch + 1,
            args.epochs,
            loss_sum / steps as f64,
            100.0 * accuracy,
            images as f64 / train_time,
            start.elapsed().as_secs_f64()
        );
    }
    let scaler = opt.stats()?[0];
    println!(
        "done: test accuracy {:.2}% after {} epochs in {:.1} s (loss scale {}, {} steps skipped)",
        100.0 * accuracy,
        args.epochs,
        run_start.elapsed().as_secs_f64(),
        scaler.scale,
        scaler.skipped_total
    );
    Ok(())
}
