//! The image training pipeline's throughput, and whether it keeps a ResNet-50 O2 step busy.
//!
//!     bench-data_pipeline --data DIR [--batch 256] [--workers N] [--torch-json FILE]
//!
//! 1. Pipeline: an `ImageFolder` (DIR holds the class folders) through torchvision's training
//!    transform (RandomResizedCrop(224) + RandomHorizontalFlip + ToTensor + Normalize), batches
//!    of `--batch` on `--workers` threads, delivered on the GPU through pinned memory (on the CPU
//!    when there is no GPU). Images per second over `--batches` batches after 3 warm-up ones,
//!    the last upload included.
//! 2. With a GPU: torchvision's ResNet-50 under O2 (f16, FP32 masters, dynamic loss scale, fused
//!    SGD), `--steps` timed steps on one synthetic batch already on the GPU, then the same steps
//!    fed by the pipeline. The difference per step is time the GPU waited for data (its idle
//!    time); the host's wait for each batch is reported too. If batch `--batch` does not fit,
//!    it retries at half the batch and says so.
//! 3. One thread, per image: read + decode + transform (`ImageTransform::apply`) of the first
//!    200 files, with colour JPEGs resampled in YCbCr (the default) and in RGB.
//! 4. `--torch-json`: the result of `benches/torch_data_pipeline.py` on the same folder in the
//!    same call, for the ratio.
//!
//! `benches/gpu_data_pipeline.sh` runs all of it on the GPU machine.

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use mixprec::data::image_transforms::TransformScratch;
use mixprec::data::{DataLoader, Dataset, ImageFolder, ImageTransform};
use mixprec::nn::resnet::ResNet;
use mixprec::nn::Module;
use mixprec::optim::{FusedSgd, SgdConfig};
use mixprec::{amp, nn, Device, Tensor};

#[derive(Parser, Debug)]
struct Args {
    /// An ImageFolder root (one sub-directory per class), e.g. from benches/make_imagefolder.py.
    /// Without it (as under `cargo test --all-targets`) the benchmark says so and exits.
    #[arg(long)]
    data: Option<String>,
    #[arg(long, default_value_t = 256)]
    batch: usize,
    /// Decoding threads (0: one per core).
    #[arg(long, default_value_t = 0)]
    workers: usize,
    /// Timed batches of the pipeline measurement (after 3 warm-up batches).
    #[arg(long, default_value_t = 30)]
    batches: usize,
    /// Timed training steps, synthetic and real (after warm-up steps).
    #[arg(long, default_value_t = 25)]
    steps: usize,
    /// Skip the ResNet-50 steps.
    #[arg(long)]
    no_step: bool,
    /// benches/torch_data_pipeline.py's JSON output, for the comparison.
    #[arg(long)]
    torch_json: Option<String>,
}

fn main() {
    let _ = env_logger::try_init();
    // `cargo test --all-targets` runs this with its own flags and no --data: skip then.
    let args = match Args::try_parse() {
        Ok(a) => a,
        Err(e) if std::env::args().any(|a| a.starts_with("--data")) => e.exit(),
        Err(_) => {
            println!("data_pipeline: no --data folder given, nothing to measure (see --help)");
            return;
        }
    };
    let Some(data) = args.data.clone() else {
        println!("data_pipeline: no --data folder given, nothing to measure (see --help)");
        return;
    };
    if let Err(e) = run(&args, &data) {
        eprintln!("benchmark failed: {e}");
        std::process::exit(1);
    }
}

fn loader(
    ds: &Arc<dyn Dataset>,
    batch: usize,
    workers: usize,
    dev: Device,
) -> mixprec::Result<DataLoader> {
    Ok(DataLoader::from_arc(ds.clone(), batch)?
        .shuffle(0)
        .drop_last(true)
        .workers(workers)
        .device(dev)
        .prefetch(3))
}

fn sync(dev: Device) -> mixprec::Result<()> {
    if let Device::Cuda(i) = dev {
        mixprec::backend::cuda::device(i)?.synchronize()?;
    }
    Ok(())
}

/// Images per second of the pipeline alone.
fn pipeline(ds: &Arc<dyn Dataset>, a: &Args, workers: usize, dev: Device) -> mixprec::Result<f64> {
    let l = loader(ds, a.batch, workers, dev)?;
    let n = l.num_batches();
    if n < 4 {
        return Err(mixprec::Error::invalid_arg(
            "data_pipeline",
            "--data",
            a.data.as_deref().unwrap_or(""),
            format!("at least 4 batches of {} images", a.batch),
        ));
    }
    let timed = a.batches.min(n - 3);
    let mut it = l.epoch(0);
    for _ in 0..3 {
        it.next().unwrap()?;
    }
    sync(dev)?;
    let t = Instant::now();
    let mut images = 0;
    for _ in 0..timed {
        let (x, _) = it.next().unwrap()?;
        images += x.dims()[0];
    }
    sync(dev)?;
    Ok(images as f64 / t.elapsed().as_secs_f64())
}

/// Milliseconds per image on one thread, YCbCr-first and RGB-first.
fn per_image(folder: &ImageFolder, t: &ImageTransform) -> mixprec::Result<(f64, f64)> {
    let n = folder.len().min(200);
    let files: Vec<Vec<u8>> = (0..n)
        .map(|i| folder.read(i))
        .collect::<mixprec::Result<_>>()?;
    let [c, h, w] = t.output_shape()?;
    let mut out = vec![0f32; c * h * w];
    let mut ms = [0.0; 2];
    for (k, ycbcr) in [true, false].into_iter().enumerate() {
        let mut scratch = TransformScratch::default();
        scratch.ycbcr = ycbcr;
        let start = Instant::now();
        for (i, bytes) in files.iter().enumerate() {
            t.apply(
                bytes,
                &folder.samples()[i].path,
                0,
                i,
                &mut out,
                &mut scratch,
            )?;
        }
        ms[k] = 1e3 * start.elapsed().as_secs_f64() / n as f64;
    }
    Ok((ms[0], ms[1]))
}

struct StepTimes {
    batch: usize,
    synthetic: f64,
    real: f64,
    host_wait: f64,
}

fn steps(
    ds: &Arc<dyn Dataset>,
    a: &Args,
    batch: usize,
    workers: usize,
) -> mixprec::Result<StepTimes> {
    let dev = Device::Cuda(0);
    let model = ResNet::resnet50(ds.num_classes(), &dev, 0)?;
    let opt = FusedSgd::new(
        model.parameters(),
        SgdConfig {
            lr: 0.1,
            momentum: 0.9,
            ..Default::default()
        },
    )?;
    let (model, mut opt) = amp::initialize(model, opt, amp::Policy::opt_level(amp::OptLevel::O2))?;
    let mut step = |x: &Tensor, y: &Tensor| -> mixprec::Result<()> {
        let loss = nn::loss::cross_entropy(&model.forward(x)?, y)?;
        opt.zero_grad()?;
        opt.backward(&loss)?;
        opt.step()
    };
    // Synthetic: one batch, already on the GPU.
    let x = Tensor::randn([batch, 3, 224, 224], 0.0, 1.0, 1, mixprec::DType::F32, dev)?;
    let y = Tensor::from_vec(
        (0..batch)
            .map(|i| (i % ds.num_classes()) as i64)
            .collect::<Vec<_>>(),
        vec![batch],
        dev,
    )?;
    for _ in 0..5 {
        step(&x, &y)?;
    }
    sync(dev)?;
    let t = Instant::now();
    for _ in 0..a.steps {
        step(&x, &y)?;
    }
    sync(dev)?;
    let synthetic = t.elapsed().as_secs_f64() / a.steps as f64;
    drop((x, y));
    // Real: the pipeline feeds every step.
    let l = loader(ds, batch, workers, dev)?;
    let timed = a.steps.min(l.num_batches().saturating_sub(3));
    let mut it = l.epoch(1);
    for _ in 0..3 {
        let (x, y) = it.next().unwrap()?;
        step(&x, &y)?;
    }
    sync(dev)?;
    let mut waited = Duration::ZERO;
    let t = Instant::now();
    for _ in 0..timed {
        let w = Instant::now();
        let (x, y) = it.next().unwrap()?;
        waited += w.elapsed();
        step(&x, &y)?;
    }
    sync(dev)?;
    Ok(StepTimes {
        batch,
        synthetic,
        real: t.elapsed().as_secs_f64() / timed as f64,
        host_wait: waited.as_secs_f64() / timed as f64,
    })
}

fn run(a: &Args, data: &str) -> mixprec::Result<()> {
    let dev = Device::cuda_if_available(0);
    let workers = if a.workers == 0 {
        mixprec::data::loader::default_workers()
    } else {
        a.workers
    };
    let folder = ImageFolder::new(data)?;
    println!(
        "data: {} ({} images, {} classes); batch {}, {workers} workers, delivered on {dev}",
        data,
        folder.len(),
        folder.classes().len(),
        a.batch
    );
    let t = ImageTransform::imagenet_train(224, 0);
    let (ms_ycc, ms_rgb) = per_image(&folder, &t)?;
    println!("one thread: {ms_ycc:.2} ms per image (resampling in YCbCr), {ms_rgb:.2} ms (in RGB)");
    let ds: Arc<dyn Dataset> = Arc::new(folder.with_transform(t)?);
    let ours = pipeline(&ds, a, workers, dev)?;
    println!(
        "pipeline: {ours:.0} images/s ({:.2} ms per image per worker)",
        1e3 * workers as f64 / ours
    );

    let torch = match &a.torch_json {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| mixprec::Error::io(format!("reading {path}"), e))?;
            let v: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| mixprec::Error::DataFormat {
                    path: path.clone(),
                    format: "JSON",
                    detail: e.to_string(),
                })?;
            v["images_per_s"].as_f64()
        }
        None => None,
    };

    let mut st = None;
    if !a.no_step && dev != Device::Cpu {
        let mut batch = a.batch;
        while batch >= 32 {
            match steps(&ds, a, batch, workers) {
                Ok(s) => {
                    st = Some(s);
                    break;
                }
                Err(e) => {
                    println!(
                        "ResNet-50 O2 at batch {batch} failed ({e}); retrying at {}",
                        batch / 2
                    );
                    batch /= 2;
                }
            }
        }
    }

    println!();
    println!("| measurement | value |");
    println!("|---|---|");
    println!(
        "| mixprec pipeline ({workers} workers, batch {}, to {dev}) | {ours:.0} images/s |",
        a.batch
    );
    if let Some(t) = torch {
        println!("| torchvision ImageFolder + DataLoader (same folder) | {t:.0} images/s |");
        println!(
            "| ratio mixprec / torchvision | {:.2}x {} |",
            ours / t,
            if ours >= t {
                "(>= 1.0: pass)"
            } else {
                "(< 1.0: FAIL)"
            }
        );
    }
    if let Some(s) = st {
        let need = s.batch as f64 / s.synthetic;
        println!(
            "| ResNet-50 O2 step, synthetic batch {} on the GPU | {:.1} ms ({need:.0} images/s) |",
            s.batch,
            1e3 * s.synthetic
        );
        println!(
            "| ResNet-50 O2 step fed by the pipeline | {:.1} ms ({:.0} images/s) |",
            1e3 * s.real,
            s.batch as f64 / s.real
        );
        let idle = (s.real - s.synthetic).max(0.0);
        println!(
            "| GPU idle per step, real vs synthetic data | {:.1} ms ({:.1}% of the step) |",
            1e3 * idle,
            100.0 * idle / s.real
        );
        println!(
            "| host wait for the next batch, per step | {:.1} ms |",
            1e3 * s.host_wait
        );
        println!(
            "| pipeline / step demand | {:.2}x {} |",
            ours / need,
            if ours >= need {
                "(keeps up)"
            } else {
                "(falls short)"
            }
        );
    }
    Ok(())
}
