//! `DataParallel` on GPUs (needs a CUDA GPU and NCCL; `benches/gpu_data_parallel.sh` runs it):
//!
//! - one GPU: a DataParallel of one replica (an NCCL group of one thread) equals the plain
//!   model bit for bit at O0 and O2; `[cuda:0, cuda:0]` is refused with an error saying why;
//! - two or more GPUs (skipped, with a line saying so, on one): the parameters after a few steps
//!   equal one GPU's on the same global batch (O0 within f32 rounding, O2 within the half
//!   gradients' rounding), the replicas identical; an Inf in one replica's chunk skips the
//!   step on every replica with no host read in the step.

use std::sync::{Mutex, MutexGuard};

use mixprec::amp::{self, OptLevel, Policy};
use mixprec::backend::cuda::{device_count, host_sync_count};
use mixprec::distributed::{DataParallel, DataParallelConfig, DdpConfig};
use mixprec::nn::{cross_entropy, Conv2d, Flatten, Linear, Module, ReLU, Sequential};
use mixprec::optim::{FusedSgd, SgdConfig};
use mixprec::{Conv2dConfig, DType, Device, Result, Tensor};

const GPU: Device = Device::Cuda(0);
const STEPS: usize = 3;

fn serial() -> MutexGuard<'static, ()> {
    static M: Mutex<()> = Mutex::new(());
    let g = M.lock().unwrap_or_else(|e| e.into_inner());
    Device::cuda(0).expect("these tests need a CUDA GPU");
    mixprec::backend::cuda::set_deterministic(true);
    g
}

fn convnet(device: Device) -> Result<(Sequential, FusedSgd)> {
    let m = Sequential::new()
        .with(Conv2d::new(
            3,
            16,
            (3, 3),
            Conv2dConfig {
                padding: (1, 1),
                ..Default::default()
            },
            true,
            &device,
            11,
        )?)
        .with(ReLU::new())
        .with(Flatten::new(1, -1))
        .with(Linear::new(16 * 8 * 8, 32, true, &device, 12)?)
        .with(ReLU::new())
        .with(Linear::new(32, 10, true, &device, 13)?);
    let o = FusedSgd::new(
        m.parameters(),
        SgdConfig {
            lr: 0.1,
            momentum: 0.9,
            ..Default::default()
        },
    )?;
    Ok((m, o))
}

fn policy(level: OptLevel) -> Policy {
    Policy::opt_level(level).with_report_interval(0)
}

fn config(level: OptLevel) -> DataParallelConfig {
    DataParallelConfig {
        policy: policy(level),
        ddp: DdpConfig {
            bucket_cap_mb: 0.01,
            first_bucket_mb: 0.002,
            ..Default::default()
        },
    }
}

/// Step `step`'s global batch, on the CPU (scattered from there).
fn batch(step: usize, n: usize) -> Result<(Tensor, Tensor)> {
    let x = Tensor::randn(
        [n, 3, 8, 8],
        0.0,
        1.0,
        500 + step as u64,
        DType::F32,
        Device::Cpu,
    )?;
    let y: Vec<i64> = (0..n).map(|i| ((i * 7 + step) % 10) as i64).collect();
    Ok((x, Tensor::from_vec(y, [n], Device::Cpu)?))
}

fn train_one_gpu(level: OptLevel, n: usize) -> Vec<(String, Tensor)> {
    let (m, o) = convnet(GPU).unwrap();
    let (m, mut o) = amp::initialize(m, o, policy(level)).unwrap();
    for step in 0..STEPS {
        let (x, y) = batch(step, n).unwrap();
        let loss = cross_entropy(
            &m.forward(&x.to_device(GPU).unwrap()).unwrap(),
            &y.to_device(GPU).unwrap(),
        )
        .unwrap();
        o.zero_grad().unwrap();
        o.backward(&loss).unwrap();
        o.step().unwrap();
    }
    m.state_dict().unwrap()
}

fn train_dp(level: OptLevel, n: usize, devices: &[Device]) -> DataParallel<Sequential, FusedSgd> {
    let dp = DataParallel::new(convnet, devices, GPU, config(level)).unwrap();
    for step in 0..STEPS {
        let (x, y) = batch(step, n).unwrap();
        let loss = cross_entropy(&dp.forward(&x).unwrap(), &y.to_device(GPU).unwrap()).unwrap();
        dp.zero_grad().unwrap();
        dp.backward(&loss).unwrap();
        dp.step().unwrap();
    }
    dp
}

fn max_diff(a: &[(String, Tensor)], b: &[(String, Tensor)]) -> (f64, String) {
    let mut worst = (0.0, String::new());
    for ((n, x), (m, y)) in a.iter().zip(b) {
        assert_eq!(n, m);
        for (p, q) in x.to_vec_f64().unwrap().iter().zip(&y.to_vec_f64().unwrap()) {
            let d = (p - q).abs();
            if d.is_nan() || d > worst.0 {
                worst = (d, n.clone());
            }
        }
    }
    worst
}

fn replicas_identical(dp: &DataParallel<Sequential, FusedSgd>) {
    let states = dp.with_replicas(|r| r.model().state_dict()).unwrap();
    for (i, s) in states.iter().enumerate().skip(1) {
        let (d, at) = max_diff(s, &states[0]);
        assert!(
            d == 0.0,
            "replica {i} differs from replica 0 by {d:e} at {at}"
        );
    }
}

fn gpus_or_skip(test: &str) -> Option<usize> {
    let n = device_count().expect("counting the GPUs");
    if n < 2 {
        println!("{test}: skipped, one GPU here (the one-GPU tests cover a single replica)");
        return None;
    }
    Some(n.min(4))
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn one_replica_on_one_gpu_equals_the_plain_model() {
    let _g = serial();
    for level in [OptLevel::O0, OptLevel::O2] {
        let want = train_one_gpu(level, 8);
        let dp = train_dp(level, 8, &[GPU]);
        let (d, at) = max_diff(&dp.state_dict().unwrap(), &want);
        assert!(
            d == 0.0,
            "{level:?}: one replica differs from the plain model by {d:e} at {at}"
        );
    }
    let e = DataParallel::new(convnet, &[GPU, GPU], GPU, config(OptLevel::O0)).unwrap_err();
    assert!(e.to_string().contains("distinct GPUs"), "{e}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn data_parallel_on_gpus_equals_one_gpu() {
    let _g = serial();
    let Some(n) = gpus_or_skip("data_parallel_on_gpus_equals_one_gpu") else {
        return;
    };
    let devices: Vec<Device> = (0..n).map(Device::Cuda).collect();
    for (level, tol) in [(OptLevel::O0, 2e-6), (OptLevel::O2, 1e-3)] {
        let want = train_one_gpu(level, 8 * n);
        let dp = train_dp(level, 8 * n, &devices);
        replicas_identical(&dp);
        let (d, at) = max_diff(&dp.state_dict().unwrap(), &want);
        println!("{level:?} over {n} GPUs: max error {d:e} at {at}");
        assert!(
            d <= tol,
            "{level:?} over {n} GPUs: max error {d:e} at {at}, above {tol:e}"
        );
        let stats = dp
            .with_replica(0, |r| Ok(r.model().last_reduction()))
            .unwrap();
        assert!(stats.launched_during_backward > 0, "{stats:?}");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn an_inf_in_one_replica_skips_the_step_on_every_gpu() {
    let _g = serial();
    let Some(n) = gpus_or_skip("an_inf_in_one_replica_skips_the_step_on_every_gpu") else {
        return;
    };
    let devices: Vec<Device> = (0..n).map(Device::Cuda).collect();
    let dp = DataParallel::new(convnet, &devices, GPU, config(OptLevel::O2)).unwrap();
    let rows = 4 * n;
    for step in 0..3 {
        let (x, y) = batch(step, rows).unwrap();
        let x = if step == 1 {
            // A sample of the last replica's chunk.
            let mut v = x.to_vec_f32().unwrap();
            v[(rows - 1) * 192 + 5] = f32::INFINITY;
            Tensor::from_vec(v, [rows, 3, 8, 8], Device::Cpu).unwrap()
        } else {
            x
        };
        let before = dp.state_dict().unwrap();
        let loss = cross_entropy(&dp.forward(&x).unwrap(), &y.to_device(GPU).unwrap()).unwrap();
        dp.zero_grad().unwrap();
        dp.backward(&loss).unwrap();
        let syncs = dp.with_replicas(|_| Ok(host_sync_count())).unwrap();
        dp.step().unwrap();
        let after = dp.with_replicas(|_| Ok(host_sync_count())).unwrap();
        assert_eq!(
            syncs, after,
            "the overflow decision read nothing on the host"
        );
        replicas_identical(&dp);
        if step == 1 {
            let (d, at) = max_diff(&dp.state_dict().unwrap(), &before);
            assert!(d == 0.0, "the overflowing step changed {at} by {d:e}");
        }
    }
    let stats = dp.with_replicas(|r| Ok(r.optimizer().stats()?[0])).unwrap();
    for s in &stats {
        assert_eq!(s.skipped_total, 1, "{stats:?}");
        assert_eq!(s.scale, stats[0].scale, "{stats:?}");
    }
}

/// A copy between GPUs (DataParallel's scatter, gather and the gradient it sends back) is
/// exact, queued without a host wait, ordered after the kernel that wrote its source, and
/// unharmed when the source is dropped and its memory reused at once.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_copy_between_gpus_is_exact_queued_and_ordered() -> Result<()> {
    let _g = serial();
    if device_count()? < 2 {
        eprintln!("one GPU: the copy between GPUs is checked on two or more");
        return Ok(());
    }
    let (a, b) = (Device::cuda(0)?, Device::cuda(1)?);
    for dtype in [DType::F32, DType::BF16] {
        // Large enough that the producing kernel is still running when the copy is queued.
        let x = Tensor::randn([4096, 4096], 0.0, 1.0, 7, DType::F32, a)?.to_dtype(dtype)?;
        let y = x.mul_scalar(3.0)?;
        let want = y
            .to_device(Device::Cpu)?
            .to_dtype(DType::F64)?
            .to_vec_f64()?;
        let syncs = host_sync_count();
        let z = y.exp()?.to_device(b)?;
        assert_eq!(host_sync_count(), syncs, "the copy waited on the host");
        drop(y);
        // Reuse the freed memory on the source device straight away.
        let _w = Tensor::zeros([4096, 4096], dtype, a)?.add_scalar(1.0)?;
        let got = z
            .log()?
            .to_device(Device::Cpu)?
            .to_dtype(DType::F64)?
            .to_vec_f64()?;
        let back = z.to_device(a)?.log()?.to_device(Device::Cpu)?;
        let back = back.to_dtype(DType::F64)?.to_vec_f64()?;
        let tol = if dtype == DType::F32 { 1e-5 } else { 2e-2 };
        for (i, ((w, g), r)) in want.iter().zip(&got).zip(&back).enumerate() {
            let bound = tol * w.abs().max(1.0);
            assert!(
                (w - g).abs() <= bound && (w - r).abs() <= bound,
                "{dtype} element {i}: want {w}, cuda:1 {g}, back on cuda:0 {r}"
            );
        }
    }
    Ok(())
}
