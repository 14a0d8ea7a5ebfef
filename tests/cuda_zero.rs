//! ZeRO-sharded optimizers over NCCL (src/distributed/zero.rs) against the unsharded fused
//! optimizer on the same device: one rank (bitwise: a reduce over one rank is the identity),
//! and two ranks on two GPUs when there are two (within f32 rounding: NCCL's reduce-scatter and
//! all-reduce may sum in different orders), at O0 (FP32) and O2 (f16 model, FP32 masters).
//! Each also with a gradient bucket per parameter, every bucket reduce-scattered on NCCL's
//! stream from the gradient hooks while backward runs. The ranks are threads of this test, one
//! GPU each.

use mixprec::amp::{self, OptLevel, Policy};
use mixprec::distributed::launch::free_port;
use mixprec::distributed::{
    Backend, GroupOptions, LaunchEnv, Launcher, ProcessGroup, ReduceOp, ZeroAdam,
};
use mixprec::nn::{cross_entropy, Linear, Module, ReLU, Sequential};
use mixprec::optim::{AdamConfig, FusedAdam};
use mixprec::{DType, Device, Result, Tensor};

fn on_gpus<T: Send + 'static>(
    world: usize,
    f: impl Fn(usize, ProcessGroup) -> Result<T> + Send + Sync + Clone + 'static,
) -> Vec<T> {
    let port = free_port().unwrap();
    let threads: Vec<_> = (0..world)
        .map(|rank| {
            let f = f.clone();
            std::thread::spawn(move || -> Result<T> {
                let env = LaunchEnv {
                    rank,
                    world_size: world,
                    local_rank: rank,
                    local_world_size: world,
                    master_addr: "127.0.0.1".into(),
                    master_port: port,
                    launcher: Launcher::Torchrun,
                };
                let mut opts = GroupOptions::new(Backend::Nccl)
                    .with_timeout(std::time::Duration::from_secs(120));
                opts.device = Some(Device::Cuda(rank));
                let g = ProcessGroup::new(&env, &opts)?;
                f(rank, g)
            })
        })
        .collect();
    threads
        .into_iter()
        .enumerate()
        .map(|(r, t)| {
            t.join()
                .unwrap_or_else(|_| panic!("rank {r} panicked"))
                .unwrap_or_else(|e| panic!("rank {r}: {e}"))
        })
        .collect()
}

fn mlp(seed: u64, dev: Device) -> Result<Sequential> {
    // 64·37 + 37 + 37·5 + 5 elements: the shares of two ranks cut the first weight.
    Ok(Sequential::new()
        .with(Linear::new(64, 37, true, &dev, seed)?)
        .with(ReLU::new())
        .with(Linear::new(37, 5, true, &dev, seed + 1)?))
}

fn batch(rank: usize, step: usize, dev: Device) -> Result<(Tensor, Tensor)> {
    let x = Tensor::randn(
        [16, 64],
        0.0,
        1.0,
        70 + 13 * rank as u64 + step as u64,
        DType::F32,
        dev,
    )?;
    let y: Vec<i64> = (0..16).map(|i| ((i + rank + step) % 5) as i64).collect();
    Ok((x, Tensor::from_vec(y, [16], Device::Cpu)?.to_device(dev)?))
}

fn adam() -> AdamConfig {
    AdamConfig {
        lr: 1e-2,
        weight_decay: 0.05,
        ..Default::default()
    }
}

fn values(m: &dyn Module) -> Result<Vec<Vec<f64>>> {
    m.parameters().iter().map(|p| p.to_vec_f64()).collect()
}

/// Four steps of ZeroAdam and of DDP-averaged FusedAdam on each rank: (sharded, unsharded).
/// With `per_param`, a bucket per parameter, launched during backward.
fn compare(world: usize, level: OptLevel, per_param: bool) -> Vec<[Vec<Vec<f64>>; 2]> {
    on_gpus(world, move |rank, g| {
        let dev = g.device();
        let policy = Policy::opt_level(level).with_report_interval(0);
        let a = mlp(5, dev)?;
        let mut z = ZeroAdam::single(&g, a.parameters(), adam())?;
        if per_param {
            // One byte: every parameter fills a bucket of its own, in any dtype.
            let tiny = 1.0 / 1048576.0;
            z.set_bucket_cap_mb(tiny, tiny)?;
        }
        let (a, mut z) = amp::initialize(a, z, policy.clone())?;
        let b = mlp(5, dev)?;
        let r = FusedAdam::new(b.parameters(), adam())?;
        let (b, mut r) = amp::initialize(b, r, policy)?;
        for step in 0..4 {
            let (x, y) = batch(rank, step, dev)?;
            z.zero_grad()?;
            z.backward(&cross_entropy(&a.forward(&x)?, &y)?)?;
            z.step()?;
            r.zero_grad()?;
            r.backward(&cross_entropy(&b.forward(&x)?, &y)?)?;
            for p in b.parameters() {
                g.all_reduce(&p.grad().expect("a gradient"), ReduceOp::Avg)?;
            }
            r.step()?;
        }
        let want = if per_param { 4 } else { 1 };
        let stats = z.inner().last_reduction();
        assert_eq!(stats.buckets, want, "rank {rank}");
        assert_eq!(stats.launched_during_backward, want, "rank {rank}");
        Ok([values(&a)?, values(&b)?])
    })
}

fn max_rel(a: &[Vec<f64>], b: &[Vec<f64>]) -> f64 {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs() / y.abs().max(1e-3))
        .fold(0.0, f64::max)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn zero_adam_over_nccl_on_one_rank_matches_fused_adam_bitwise() {
    for level in [OptLevel::O0, OptLevel::O2] {
        for per_param in [false, true] {
            let ranks = compare(1, level, per_param);
            let [sharded, plain] = &ranks[0];
            assert_eq!(
                sharded, plain,
                "{level:?}, per-parameter buckets {per_param}: one rank, sharded vs unsharded"
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn zero_adam_over_nccl_on_two_gpus_matches_ddp_within_rounding() {
    let n = mixprec::backend::cuda::device_count().unwrap_or(0);
    if n < 2 {
        println!("skipped: {n} GPU(s), this test needs 2");
        return;
    }
    for (level, per_param) in [
        (OptLevel::O0, false),
        (OptLevel::O2, false),
        (OptLevel::O0, true),
        (OptLevel::O2, true),
    ] {
        let ranks = compare(2, level, per_param);
        for (r, [sharded, plain]) in ranks.iter().enumerate() {
            // The averaged gradients may differ in the last bit (summation order); Adam's
            // normalised update keeps that near f32 rounding, half parameters at one half ulp.
            let tol = if level == OptLevel::O0 { 1e-5 } else { 2e-3 };
            let e = max_rel(sharded, plain);
            assert!(e < tol, "{level:?} rank {r}: sharded vs DDP off by {e:e}");
            assert_eq!(sharded, &ranks[0][0], "{level:?}: rank {r} vs rank 0");
        }
    }
}
