//! GPU benchmark (exits quietly without a GPU): one whole AMP training step — O2 (f16 model,
//! FP32 masters, dynamic loss scale), fused SGD with Nesterov momentum, a learning rate set
//! every step — run eagerly and replayed as a captured CUDA graph (`amp::CapturedStep`), on
//! synthetic data already on the device:
//!
//! - the main job's default net (ResNet 16-32-64, one block per stage, 1x28x28, batch 128),
//! - the CIFAR-style ResNet-18 (3x32x32, batch 128),
//! - torchvision's ResNet-50 (3x224x224, batch 256; 128 if 256 does not fit).
//!
//! Each net runs in both memory formats (`bench-capture_speed nchw` or `cl` for one): NCHW, and
//! channels_last, the format `train_resnet` trains in on a GPU.
//!
//! Per net: images/s of each mode (the median of 7 rounds of back-to-back steps, one
//! synchronisation per round; the two modes' steps are built side by side in one process and
//! their rounds alternate, see [`measure`]), the ratio against the target, and the host
//! synchronisations and allocations the timed replayed steps made (both must be 0). One JSON
//! line per measurement follows the table. PyTorch's eager, `torch.compile(mode=
//! "reduce-overhead")` and hand-captured steps on the same nets: `benches/torch_capture_speed.py`.

mod common;

use std::time::Instant;

use mixprec::amp::{self, CapturedStep, OptLevel, Policy};
use mixprec::backend::cuda::{allocation_count, device, external_profiler_range, host_sync_count};
use mixprec::nn::{self, Module, ResNet};
use mixprec::optim::{FusedSgd, LrSchedule, Optimizer, SgdConfig};
use mixprec::{DType, Device, MemoryFormat, Tensor};

fn main() {
    common::main_with(run)
}

struct Net {
    name: &'static str,
    build: fn(&Device) -> mixprec::Result<ResNet>,
    batches: &'static [usize],
    image: [usize; 3],
    /// The target: captured / eager images/s at least this.
    target: f64,
    /// Timed steps per round.
    steps: usize,
}

fn main_job(dev: &Device) -> mixprec::Result<ResNet> {
    common::main_job_net(dev)
}

fn resnet18(dev: &Device) -> mixprec::Result<ResNet> {
    ResNet::cifar_style(&[2, 2, 2, 2], 3, 10, dev)
}

fn resnet50(dev: &Device) -> mixprec::Result<ResNet> {
    ResNet::resnet50(1000, dev, 0)
}

struct Measured {
    images_per_s: f64,
    step_ms: f64,
    syncs: u64,
    allocs: u64,
    loss: f64,
    stats: amp::StepStats,
    nodes: Option<mixprec::backend::cuda::GraphNodes>,
}

/// One training setup (model, AMP optimizer) of `net`, as both modes build it.
fn setup(
    net: &Net,
    format: MemoryFormat,
) -> mixprec::Result<(amp::AmpModel<ResNet>, amp::AmpOptimizer<FusedSgd>)> {
    let model = (net.build)(&Device::Cuda(0))?;
    model.to_memory_format(format)?;
    let opt = FusedSgd::new(
        model.parameters(),
        SgdConfig {
            lr: 0.1,
            momentum: 0.9,
            nesterov: true,
            weight_decay: 5e-4,
            ..Default::default()
        },
    )?;
    let policy = Policy::opt_level(OptLevel::O2).with_report_interval(0);
    amp::initialize(model, opt, policy)
}

/// One mode's step and what its timed rounds measured.
struct Runner<'a> {
    step: CapturedStep<'a, FusedSgd>,
    schedule: LrSchedule,
    i: u64,
    times: Vec<f64>,
    syncs: u64,
    allocs: u64,
}

impl Runner<'_> {
    fn one(&mut self, x: &Tensor, y: &Tensor) -> mixprec::Result<()> {
        self.schedule.apply(
            self.step.optimizer().inner_mut() as &mut dyn Optimizer,
            self.i,
        )?;
        self.i += 1;
        self.step.run(x, y).map(|_| ())
    }

    /// `steps` back-to-back steps and one synchronisation: the round's time per step, and the
    /// host synchronisations (the round's own excepted) and allocations the steps made.
    fn round(&mut self, steps: usize, x: &Tensor, y: &Tensor) -> mixprec::Result<()> {
        let dev0 = device(0)?;
        let (s0, a0) = (host_sync_count(), allocation_count());
        let t = Instant::now();
        for _ in 0..steps {
            self.one(x, y)?;
        }
        dev0.synchronize()?;
        self.times.push(t.elapsed().as_secs_f64() / steps as f64);
        self.syncs += host_sync_count() - s0 - 1;
        self.allocs += allocation_count() - a0;
        Ok(())
    }

    fn measured(&self, batch: usize) -> mixprec::Result<Measured> {
        let mut times = self.times.clone();
        times.sort_by(|a, b| a.total_cmp(b));
        // No timed round (a profiled run): no figures.
        let t = times.get(times.len() / 2).copied().unwrap_or(f64::NAN);
        let loss = self.step.loss().map_or(Ok(f64::NAN), |l| l.item())?;
        Ok(Measured {
            images_per_s: batch as f64 / t,
            step_ms: t * 1e3,
            syncs: self.syncs,
            allocs: self.allocs,
            loss,
            stats: self.step.stats(),
            nodes: self.step.graph_nodes()?,
        })
    }
}

/// Timed rounds per mode.
const ROUNDS: usize = 7;

/// The eager and the captured step of the same setup, built side by side in this process and
/// timed in alternating rounds (which mode goes first alternates too): the eager step is bound
/// by the host, and a host that is slower for a while then slows both modes' rounds alike
/// rather than whichever mode ran at that moment. With `profile_replays`, only the captured step
/// runs that many replays inside the external profiler's range.
fn measure(
    net: &Net,
    batch: usize,
    format: MemoryFormat,
    profile_replays: Option<usize>,
) -> mixprec::Result<(Measured, Measured)> {
    let dev = Device::Cuda(0);
    let classes = if net.name == "resnet50" { 1000 } else { 10 };
    let mut dims = vec![batch];
    dims.extend(net.image);
    let x = Tensor::randn(dims, 0.0, 1.0, 7, DType::F32, dev)?.to_memory_format(format)?;
    let labels: Vec<i64> = (0..batch).map(|i| (i * 7 % classes) as i64).collect();
    let y = Tensor::from_vec(labels, [batch], dev)?;
    let total = (5 + ROUNDS * net.steps) as u64;
    let (model_e, mut opt_e) = setup(net, format)?;
    let (model_g, mut opt_g) = setup(net, format)?;
    let body_e = |x: &Tensor, y: &Tensor| nn::cross_entropy(&model_e.forward(x)?, y);
    let body_g = |x: &Tensor, y: &Tensor| nn::cross_entropy(&model_g.forward(x)?, y);
    let runner = |step| Runner {
        step,
        schedule: LrSchedule::one_cycle(0.1, total),
        i: 0,
        times: Vec::new(),
        syncs: 0,
        allocs: 0,
    };
    let mut eager = runner(CapturedStep::eager(&model_e, &mut opt_e, body_e)?);
    let mut graph = runner(CapturedStep::new(&model_g, &mut opt_g, body_g)?);
    // Warm-up: plans, tables, state; the captured mode also captures here (2 eager + capture).
    for r in [&mut eager, &mut graph] {
        for _ in 0..5 {
            r.one(&x, &y)?;
        }
    }
    let dev0 = device(0)?;
    dev0.synchronize()?;
    if let Some(n) = profile_replays {
        external_profiler_range(0, true)?;
        for _ in 0..n {
            graph.one(&x, &y)?;
        }
        dev0.synchronize()?;
        external_profiler_range(0, false)?;
    } else {
        for r in 0..ROUNDS {
            if r % 2 == 0 {
                eager.round(net.steps, &x, &y)?;
                graph.round(net.steps, &x, &y)?;
            } else {
                graph.round(net.steps, &x, &y)?;
                eager.round(net.steps, &x, &y)?;
            }
        }
    }
    Ok((eager.measured(batch)?, graph.measured(batch)?))
}

fn run() -> mixprec::Result<()> {
    let mut formats = Vec::new();
    let mut only_net: Option<String> = None;
    let mut profile_replays: Option<usize> = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = |flag: &'static str| {
            args.next().ok_or_else(|| {
                mixprec::Error::invalid_arg("capture_speed", flag, "nothing", "a value after it")
            })
        };
        formats.push(match a.as_str() {
            "--net" => {
                only_net = Some(value("--net")?);
                continue;
            }
            "--profile-replays" => {
                let v = value("--profile-replays")?;
                profile_replays = Some(v.parse().map_err(|_| {
                    mixprec::Error::invalid_arg(
                        "capture_speed",
                        "--profile-replays",
                        &v,
                        "a count of steps",
                    )
                })?);
                continue;
            }
            "nchw" => MemoryFormat::Contiguous,
            "cl" => MemoryFormat::ChannelsLast,
            other => {
                return Err(mixprec::Error::invalid_arg(
                    "capture_speed",
                    "layout",
                    other,
                    "nchw, cl, --net NAME or --profile-replays N",
                ))
            }
        });
    }
    if formats.is_empty() {
        formats = vec![MemoryFormat::Contiguous, MemoryFormat::ChannelsLast];
    }
    let dev = device(0)?;
    let (ma, mi) = dev.compute_capability();
    println!("device cuda:0 sm_{ma}{mi}; O2 f16, fused SGD (Nesterov), lr set every step, synthetic data on the device");
    let nets = [
        Net {
            name: "main-job-resnet-16-32-64",
            build: main_job,
            batches: &[128],
            image: [1, 28, 28],
            target: 2.0,
            steps: 100,
        },
        Net {
            name: "resnet18-cifar",
            build: resnet18,
            batches: &[128],
            image: [3, 32, 32],
            target: 1.3,
            steps: 50,
        },
        Net {
            name: "resnet50",
            build: resnet50,
            batches: &[256, 128],
            image: [3, 224, 224],
            target: 1.0,
            steps: 10,
        },
    ];
    println!(
        "{:<26} {:<6} {:>5} {:>12} {:>12} {:>9} {:>10} {:>9} {:>7}",
        "net",
        "layout",
        "batch",
        "eager img/s",
        "graph img/s",
        "ratio",
        "target",
        "syncs",
        "allocs"
    );
    let chosen: Vec<&Net> = nets
        .iter()
        .filter(|n| only_net.as_deref().is_none_or(|k| n.name.contains(k)))
        .collect();
    if chosen.is_empty() {
        let names: Vec<&str> = nets.iter().map(|n| n.name).collect();
        return Err(mixprec::Error::invalid_arg(
            "capture_speed",
            "--net",
            only_net.unwrap_or_default(),
            format!("part of a net's name: {}", names.join(", ")),
        ));
    }
    let mut json = Vec::new();
    for (net, format) in chosen
        .into_iter()
        .flat_map(|n| formats.iter().map(move |&f| (n, f)))
    {
        let layout = match format {
            MemoryFormat::Contiguous => "nchw",
            MemoryFormat::ChannelsLast => "cl",
        };
        if let Some(n) = profile_replays {
            let batch = net.batches[0];
            let (_, g) = measure(net, batch, format, Some(n))?;
            println!(
                "{:<26} {layout:<6} {batch:>5} profiled {n} replays; graph nodes {:?}",
                net.name, g.nodes
            );
            continue;
        }
        let mut done = false;
        for &batch in net.batches {
            match measure(net, batch, format, None) {
                Ok((e, g)) => {
                    let ratio = g.images_per_s / e.images_per_s;
                    let verdict = if ratio >= net.target && g.syncs == 0 && g.allocs == 0 {
                        "PASS"
                    } else {
                        "FAIL"
                    };
                    println!(
                        "{:<26} {layout:<6} {:>5} {:>12.0} {:>12.0} {:>8.2}x {:>9}x {:>9} {:>7}  {verdict}",
                        net.name,
                        batch,
                        e.images_per_s,
                        g.images_per_s,
                        ratio,
                        net.target,
                        g.syncs,
                        g.allocs
                    );
                    for (mode, m) in [("eager", &e), ("cuda-graph", &g)] {
                        json.push(format!(
                            "{{\"check\": \"mixprec-capture\", \"net\": \"{}\", \"layout\": \"{layout}\", \"batch\": {batch}, \"mode\": \"{mode}\", \"img_per_s\": {:.1}, \"step_ms\": {:.4}, \"host_syncs\": {}, \"allocations\": {}, \"loss\": {}, \"eager_steps\": {}, \"captures\": {}, \"replays\": {}, \"graph_nodes\": {}}}",
                            net.name, m.images_per_s, m.step_ms, m.syncs, m.allocs,
                            if m.loss.is_finite() { format!("{:.6}", m.loss) } else { "null".into() },
                            m.stats.eager, m.stats.captures, m.stats.replays,
                            m.nodes.map_or("null".into(), |n| format!(
                                "{{\"kernels\": {}, \"memsets\": {}, \"memcpys\": {}, \"other\": {}}}",
                                n.kernels, n.memsets, n.memcpys, n.other
                            ))
                        ));
                    }
                    done = true;
                    break;
                }
                Err(e) => {
                    println!("{:<26} {layout:<6} {:>5} failed: {e}", net.name, batch);
                }
            }
        }
        if !done {
            println!("{:<26} {layout:<6} no batch size ran", net.name);
        }
    }
    for j in json {
        println!("{j}");
    }
    Ok(())
}
