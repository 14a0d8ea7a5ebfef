//! The harness the GPU benchmarks share: the command line (`args`), the no-GPU skip, the
//! timing loop and the device-to-device copy bandwidth every row is compared with.

// Each bench uses part of the harness.
#![allow(dead_code)]

pub mod args;

use std::time::Instant;

use mixprec::backend::cuda::{device, CudaStorage};
use mixprec::backend::BackendStorage;
use mixprec::nn::{BlockKind, ResNet, ResNetConfig, Stem};
use mixprec::Device;

/// Runs `run` when there is a CUDA device (exits quietly without one; with status 1 on error).
pub fn main_with(run: impl FnOnce() -> mixprec::Result<()>) {
    // RUST_LOG=mixprec=debug shows, e.g., each convolution's timed candidates and the choice.
    let _ = env_logger::try_init();
    if let Err(e) = Device::cuda(0) {
        println!("no CUDA device, skipping the benchmark: {e}");
        return;
    }
    if let Err(e) = run() {
        eprintln!("benchmark failed: {e}");
        std::process::exit(1);
    }
}

/// The net of the Fashion-MNIST main job (`train_resnet` with no options): basic blocks
/// [1, 1, 1], widths [16, 32, 64], one input channel, the small stem, 10 classes.
pub fn main_job_net(dev: &Device) -> mixprec::Result<ResNet> {
    ResNet::new(
        &ResNetConfig {
            block: BlockKind::Basic,
            blocks: vec![1, 1, 1],
            widths: vec![16, 32, 64],
            in_channels: 1,
            num_classes: 10,
            stem: Stem::Small,
            zero_init_residual: false,
            seed: 0,
        },
        dev,
    )
}

/// Seconds per call: `warm` untimed calls, then 5 rounds of `iters` back-to-back calls (one
/// synchronisation per round, so launch latency overlaps with work as in a training loop); the
/// median round.
pub fn time(
    warm: usize,
    iters: usize,
    mut f: impl FnMut() -> mixprec::Result<()>,
) -> mixprec::Result<f64> {
    let dev = device(0)?;
    for _ in 0..warm {
        f()?;
    }
    dev.synchronize()?;
    let mut ts = Vec::with_capacity(5);
    for _ in 0..5 {
        let t = Instant::now();
        for _ in 0..iters {
            f()?;
        }
        dev.synchronize()?;
        ts.push(t.elapsed().as_secs_f64() / iters as f64);
    }
    ts.sort_by(|a, b| a.total_cmp(b));
    Ok(ts[ts.len() / 2])
}

/// The device-to-device copy of the F32 buffer `src`: seconds per copy and bytes per second
/// (each element read once and written once).
pub fn copy_bandwidth(src: &CudaStorage) -> mixprec::Result<(f64, f64)> {
    let t = time(3, 20, || src.try_clone().map(|_| ()))?;
    Ok((t, (2 * 4 * src.len()) as f64 / t))
}
