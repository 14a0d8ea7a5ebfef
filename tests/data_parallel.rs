//! `DataParallel` on the CPU backend (several CPU "devices" in one process): the whole path
//! (scatter, one worker thread per replica, DDP's bucketed averaging between the threads, the
//! differentiable gather, the fused optimizer step on every replica) as CI runs it.
//!
//! - equivalence with one model trained on the same global batch, O0 (within f32 rounding) and
//!   O2 (within the half gradients' rounding), replicas bitwise equal to each other;
//! - uneven chunks (7 samples over 2 and 3 replicas);
//! - an Inf in one replica's chunk makes every replica skip the step and lower its scale;
//! - checkpoints: one copy with the module's names, loaded into a plain model, a DataParallel;
//! - per-thread state: two threads training two models see only their own grad mode and
//!   autocast scope; a forward carries the caller's grad mode and autocast to the replicas.

use std::sync::{Arc, Barrier};

use mixprec::amp::{self, OptLevel, Policy};
use mixprec::distributed::data_parallel::chunk_sizes;
use mixprec::distributed::{DataParallel, DataParallelConfig, DdpConfig};
use mixprec::io::{Checkpoint, TrainProgress};
use mixprec::nn::{cross_entropy, BlockKind, Conv2d, Flatten, Linear, Module, ReLU, ResNet};
use mixprec::nn::{ResNetConfig, Sequential, Stem};
use mixprec::optim::{FusedSgd, SgdConfig};
use mixprec::{Conv2dConfig, DType, Device, Error, Result, Tensor};

const CPU: Device = Device::Cpu;
const STEPS: usize = 3;

fn sgd() -> SgdConfig {
    SgdConfig {
        lr: 0.1,
        momentum: 0.9,
        weight_decay: 1e-4,
        ..Default::default()
    }
}

/// A small convolutional net without batch norm (whose batch statistics are per replica, as in
/// PyTorch's DataParallel, so a net with it is not the single-device model).
fn convnet(device: Device) -> Result<Sequential> {
    Ok(Sequential::new()
        .with(Conv2d::new(
            1,
            4,
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
        .with(Linear::new(4 * 6 * 6, 16, true, &device, 12)?)
        .with(ReLU::new())
        .with(Linear::new(16, 3, true, &device, 13)?))
}

fn tiny_resnet(device: Device) -> Result<ResNet> {
    ResNet::new(
        &ResNetConfig {
            block: BlockKind::Basic,
            blocks: vec![1, 1],
            widths: vec![8, 16],
            in_channels: 1,
            num_classes: 3,
            stem: Stem::Small,
            zero_init_residual: false,
            seed: 5,
        },
        &device,
    )
}

fn build_convnet(device: Device) -> Result<(Sequential, FusedSgd)> {
    let m = convnet(device)?;
    let o = FusedSgd::new(m.parameters(), sgd())?;
    Ok((m, o))
}

fn policy(level: OptLevel) -> Policy {
    Policy::opt_level(level).with_report_interval(0)
}

/// Several buckets, so that some start while the replicas' backward still runs.
fn config(level: OptLevel) -> DataParallelConfig {
    DataParallelConfig {
        policy: policy(level),
        ddp: DdpConfig {
            bucket_cap_mb: 0.004,
            first_bucket_mb: 0.001,
            ..Default::default()
        },
    }
}

fn batch(step: usize, n: usize) -> Result<(Tensor, Tensor)> {
    let x = Tensor::randn([n, 1, 6, 6], 0.0, 1.0, 300 + step as u64, DType::F32, CPU)?;
    let y: Vec<i64> = (0..n).map(|i| ((i * 7 + step) % 3) as i64).collect();
    Ok((x, Tensor::from_vec(y, [n], CPU)?))
}

/// The reference: one model on the global batches.
fn train_single(level: OptLevel, n: usize) -> Result<Vec<(String, Tensor)>> {
    let (m, o) = build_convnet(CPU)?;
    let (m, mut o) = amp::initialize(m, o, policy(level))?;
    for step in 0..STEPS {
        let (x, y) = batch(step, n)?;
        let loss = cross_entropy(&m.forward(&x)?, &y)?;
        o.zero_grad()?;
        o.backward(&loss)?;
        o.step()?;
    }
    m.state_dict()
}

fn train_dp(
    level: OptLevel,
    n: usize,
    replicas: usize,
) -> Result<(DataParallel<Sequential, FusedSgd>, Vec<f64>)> {
    let dp = DataParallel::new(build_convnet, &vec![CPU; replicas], CPU, config(level))?;
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let (x, y) = batch(step, n)?;
        let out = dp.forward(&x)?;
        assert_eq!(out.dims(), [n, 3]);
        let loss = cross_entropy(&out, &y)?;
        dp.zero_grad()?;
        dp.backward(&loss)?;
        dp.step()?;
        losses.push(loss.item()?);
    }
    Ok((dp, losses))
}

/// The largest absolute difference between two state dicts with the same names, and where.
fn max_diff(a: &[(String, Tensor)], b: &[(String, Tensor)]) -> (f64, String) {
    assert_eq!(
        a.iter().map(|e| &e.0).collect::<Vec<_>>(),
        b.iter().map(|e| &e.0).collect::<Vec<_>>()
    );
    let mut worst = (0.0, String::new());
    for ((n, x), (_, y)) in a.iter().zip(b) {
        let (x, y) = (x.to_vec_f64().unwrap(), y.to_vec_f64().unwrap());
        for (p, q) in x.iter().zip(&y) {
            let d = (p - q).abs();
            if d.is_nan() || d > worst.0 {
                worst = (d, n.clone());
            }
        }
    }
    worst
}

fn bits(sd: &[(String, Tensor)]) -> Vec<(String, Vec<u64>)> {
    sd.iter()
        .map(|(n, t)| {
            let v = t.to_vec_f64().unwrap();
            (n.clone(), v.iter().map(|x| x.to_bits()).collect())
        })
        .collect()
}

/// Every replica's parameters (their state-dict entries: the FP32 masters at O2), in replica
/// order. Buffers are left out: each replica's batch-norm statistics follow its own chunk
/// until the next forward copies replica 0's.
fn replica_states<M: Module + 'static, O: mixprec::optim::Optimizer + 'static>(
    dp: &DataParallel<M, O>,
) -> Vec<Vec<(String, Tensor)>> {
    dp.with_replicas(|r| {
        let params: Vec<String> = r
            .model()
            .named_parameters()
            .into_iter()
            .map(|e| e.0)
            .collect();
        let mut sd = r.model().state_dict()?;
        sd.retain(|(n, _)| params.contains(n));
        Ok(sd)
    })
    .unwrap()
}

fn assert_replicas_identical<M: Module + 'static, O: mixprec::optim::Optimizer + 'static>(
    dp: &DataParallel<M, O>,
) {
    let states = replica_states(dp);
    for (i, s) in states.iter().enumerate().skip(1) {
        assert!(
            bits(s) == bits(&states[0]),
            "replica {i} differs from replica 0 (max {:?})",
            max_diff(s, &states[0])
        );
    }
}

#[test]
fn chunks_follow_pytorch_and_every_device_gets_one() {
    assert_eq!(chunk_sizes(12, 2).unwrap(), vec![6, 6]);
    assert_eq!(chunk_sizes(5, 2).unwrap(), vec![3, 2]);
    assert_eq!(chunk_sizes(7, 3).unwrap(), vec![3, 3, 1]);
    // torch.chunk would give [2, 2] and leave a device idle.
    assert_eq!(chunk_sizes(4, 3).unwrap(), vec![2, 1, 1]);
    assert_eq!(chunk_sizes(3, 3).unwrap(), vec![1, 1, 1]);
    let e = chunk_sizes(2, 3).unwrap_err();
    assert!(e.to_string().contains("2 samples over 3"), "{e}");
}

#[test]
fn bad_devices_and_batches_are_errors() {
    let e = DataParallel::new(build_convnet, &[], CPU, config(OptLevel::O0)).unwrap_err();
    assert!(e.to_string().contains("one or more devices"), "{e}");
    let e = DataParallel::new(
        build_convnet,
        &[Device::Cuda(0), Device::Cuda(0)],
        CPU,
        config(OptLevel::O0),
    )
    .unwrap_err();
    assert!(e.to_string().contains("distinct GPUs"), "{e}");
    let e = DataParallel::new(
        build_convnet,
        &[CPU, Device::Cuda(0)],
        CPU,
        config(OptLevel::O0),
    )
    .unwrap_err();
    assert!(e.to_string().contains("one kind"), "{e}");
    let dp = DataParallel::new(build_convnet, &[CPU; 2], CPU, config(OptLevel::O0)).unwrap();
    let e = dp.forward(&batch(0, 1).unwrap().0).unwrap_err();
    assert!(e.to_string().contains("1 samples over 2"), "{e}");
    // A builder's error is the constructor's, on every replica, and nothing hangs.
    let e = DataParallel::new(
        |_d: Device| -> Result<(Sequential, FusedSgd)> {
            Err(Error::Backward("no model today".into()))
        },
        &[CPU; 2],
        CPU,
        config(OptLevel::O0),
    )
    .unwrap_err();
    assert!(e.to_string().contains("no model today"), "{e}");
}

fn check_equivalence(level: OptLevel, n: usize, replicas: usize, tol: f64) {
    let want = train_single(level, n).unwrap();
    let (dp, losses) = train_dp(level, n, replicas).unwrap();
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
    assert_replicas_identical(&dp);
    let got = dp.state_dict().unwrap();
    let (err, name) = max_diff(&got, &want);
    assert!(
        err <= tol,
        "{level:?}, batch {n} over {replicas} replicas: parameters after {STEPS} steps differ \
         from one model's by {err:e} (at {name}), more than {tol:e}"
    );
    eprintln!("{level:?} batch {n} over {replicas}: max error {err:e} at {name}");
    let stats = dp
        .with_replica(0, |r| Ok(r.model().last_reduction()))
        .unwrap();
    assert!(
        stats.launched_during_backward > 0 && stats.buckets >= 2,
        "buckets should start while backward runs: {stats:?}"
    );
}

#[test]
fn o0_equals_one_model_on_the_global_batch() {
    // f32 throughout: only the order of the sums differs (each replica's batch sums, then
    // their sum), a few ulps of the weights' scale.
    check_equivalence(OptLevel::O0, 12, 2, 2e-6);
}

#[test]
fn o2_equals_one_model_on_the_global_batch() {
    // f16 weights and gradients: each replica's gradient is rounded to f16 before the sum, one
    // model's once; lr 0.1 times an f16 rounding of gradients of order 0.1 is ~1e-4.
    check_equivalence(OptLevel::O2, 12, 2, 5e-4);
}

#[test]
fn uneven_chunks_equal_one_model() {
    check_equivalence(OptLevel::O0, 7, 2, 2e-6);
    check_equivalence(OptLevel::O0, 7, 3, 2e-6);
}

#[test]
fn an_inf_in_one_replica_skips_the_step_on_every_replica() {
    let dp = DataParallel::new(build_convnet, &[CPU; 2], CPU, config(OptLevel::O2)).unwrap();
    let stats = |dp: &DataParallel<Sequential, FusedSgd>| {
        dp.with_replicas(|r| Ok(r.optimizer().stats()?[0])).unwrap()
    };
    let mut before = Vec::new();
    for step in 0..3 {
        let (x, y) = batch(step, 8).unwrap();
        let x = if step == 1 {
            // Sample 6 is in replica 1's chunk (4..8): only its gradients overflow locally.
            let mut v = x.to_vec_f32().unwrap();
            v[6 * 36 + 3] = f32::INFINITY;
            Tensor::from_vec(v, [8, 1, 6, 6], CPU).unwrap()
        } else {
            x
        };
        if step == 1 {
            before = dp.state_dict().unwrap();
        }
        let loss = cross_entropy(&dp.forward(&x).unwrap(), &y).unwrap();
        dp.zero_grad().unwrap();
        // The unscaled path here (each replica scales at its output); the others use
        // dp.backward.
        loss.backward().unwrap();
        if step == 1 {
            // Replica 0's own chunk was finite: what it sees is the averaged gradient.
            let finite = dp
                .with_replicas(|r| {
                    let mut all = true;
                    for p in r.model().parameters() {
                        if let Some(g) = p.grad() {
                            all &= g.to_vec_f64()?.iter().all(|v| v.is_finite());
                        }
                    }
                    Ok(all)
                })
                .unwrap();
            assert_eq!(
                finite,
                vec![false, false],
                "every replica sees the overflow"
            );
        }
        dp.step().unwrap();
        assert_replicas_identical(&dp);
        if step == 1 {
            let after = dp.state_dict().unwrap();
            assert!(bits(&after) == bits(&before), "the step was not skipped");
        }
    }
    let s = stats(&dp);
    assert_eq!(s[0].skipped_total, 1, "{s:?}");
    assert_eq!(s[0], s[1], "the replicas' scalers agree");
    assert_eq!(s[0].scale, 65536.0 / 2.0, "{s:?}");
}

#[test]
fn checkpoints_hold_one_copy_and_load_into_a_plain_model() {
    let build = |d: Device| -> Result<(ResNet, FusedSgd)> {
        let m = tiny_resnet(d)?;
        let o = FusedSgd::new(m.parameters(), sgd())?;
        Ok((m, o))
    };
    let dp = DataParallel::new(build, &[CPU; 2], CPU, config(OptLevel::O2)).unwrap();
    for step in 0..2 {
        let (x, y) = batch(step, 6).unwrap();
        let loss = cross_entropy(&dp.forward(&x).unwrap(), &y).unwrap();
        dp.zero_grad().unwrap();
        dp.backward(&loss).unwrap();
        dp.step().unwrap();
    }
    // Replica 0's buffers are the model's; DDP copied them to the others at each forward, so
    // they differ only by the last forward's update.
    let sd = dp.state_dict().unwrap();
    let plain = tiny_resnet(CPU).unwrap();
    let names: Vec<String> = plain
        .state_dict()
        .unwrap()
        .into_iter()
        .map(|e| e.0)
        .collect();
    assert_eq!(sd.iter().map(|e| e.0.clone()).collect::<Vec<_>>(), names);
    assert!(sd.iter().all(|(n, _)| !n.starts_with("module.")));
    plain.load_state_dict(&sd).unwrap();
    // The same weights under the same policy, one model on the whole batch.
    let opt = FusedSgd::new(plain.parameters(), sgd()).unwrap();
    let (plain, _opt) = amp::initialize(plain, opt, policy(OptLevel::O2)).unwrap();
    plain.load_state_dict(&sd).unwrap();
    plain.eval();
    dp.set_training(false).unwrap();
    let (x, _) = batch(9, 4).unwrap();
    let want = plain.forward(&x).unwrap().to_vec_f64().unwrap();
    let got = dp.forward(&x).unwrap().to_vec_f64().unwrap();
    let err = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    // Per sample the same ops; the products' blocking may differ with the batch size.
    assert!(err < 1e-3, "eval outputs differ by {err}");

    // A checkpoint (model, optimizer, scaler) from replica 0, restored into every replica of
    // another DataParallel: the two then train on bit for bit alike.
    let dir = std::env::temp_dir().join(format!("mixprec-dp-ck-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("last.safetensors");
    let p = path.clone();
    dp.with_replica(0, move |r| {
        let progress = TrainProgress {
            epoch: 0,
            step: 2,
            seed: 0,
        };
        let ck = Checkpoint::capture(r.model().module(), r.optimizer(), progress, "{}".into())?;
        ck.save(&p)
    })
    .unwrap();
    let other = DataParallel::new(build, &[CPU; 2], CPU, config(OptLevel::O2)).unwrap();
    let ck = Arc::new(Checkpoint::load(&path).unwrap());
    other
        .with_replicas(move |r| {
            let (m, o) = r.parts_mut();
            ck.restore(m.module(), o)
        })
        .unwrap();
    dp.set_training(true).unwrap();
    for step in 2..4 {
        let (x, y) = batch(step, 6).unwrap();
        let loss = cross_entropy(&dp.forward(&x).unwrap(), &y).unwrap();
        dp.zero_grad().unwrap();
        dp.backward(&loss).unwrap();
        dp.step().unwrap();
        let loss = cross_entropy(&other.forward(&x).unwrap(), &y).unwrap();
        other.zero_grad().unwrap();
        other.backward(&loss).unwrap();
        other.step().unwrap();
    }
    assert_replicas_identical(&other);
    let (a, b) = (dp.state_dict().unwrap(), other.state_dict().unwrap());
    // Weights, momenta, scaler and (at the next forward) replica 0's buffers all came back.
    assert!(
        bits(&a) == bits(&b),
        "the restored run drifted: {:?}",
        max_diff(&a, &b)
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_forward_carries_the_callers_grad_mode_and_autocast() {
    let dp = DataParallel::new(build_convnet, &[CPU; 2], CPU, config(OptLevel::O0)).unwrap();
    let (x, _) = batch(0, 4).unwrap();
    {
        let _g = mixprec::no_grad();
        let out = dp.forward(&x).unwrap();
        assert!(!out.requires_grad());
        let kept = dp
            .with_replicas(|_| Ok(mixprec::autograd::is_grad_enabled()))
            .unwrap();
        // The workers' own mode is untouched (the call's mode applied only inside it).
        assert_eq!(kept, vec![true, true]);
    }
    let out = dp.forward(&x).unwrap();
    assert!(out.requires_grad() && out.dtype() == DType::F32);
    {
        let _a = amp::autocast(DType::BF16).unwrap();
        let out = dp.forward(&x).unwrap();
        // The last linear ran in bf16 on the replicas, as it would here.
        assert_eq!(out.dtype(), DType::BF16);
    }
    let active = dp
        .with_replicas(|_| Ok(mixprec::tensor::autocast::active()))
        .unwrap();
    assert_eq!(active, vec![None, None]);
    // A backward without a recorded forward is an error naming the cause, not a hang.
    let out = {
        let _g = mixprec::no_grad();
        dp.forward(&x).unwrap()
    };
    let e = out.sum_all().unwrap().backward().unwrap_err();
    assert!(e.to_string().contains("does not depend"), "{e}");
    // Each replica keeps the latest forward's graph: an older output's backward is refused,
    // the latest's still runs (the refusal failed nothing).
    let (x, y) = batch(1, 4).unwrap();
    let old = cross_entropy(&dp.forward(&x).unwrap(), &y).unwrap();
    let new = cross_entropy(&dp.forward(&x).unwrap(), &y).unwrap();
    let e = dp.backward(&old).unwrap_err();
    assert!(e.to_string().contains("latest forward only"), "{e}");
    dp.zero_grad().unwrap();
    dp.backward(&new).unwrap();
    dp.step().unwrap();
}

/// Thread A enters no_grad and an autocast scope and holds them while thread B trains a model
/// of its own; then the roles swap. Each thread's run equals the same run alone, bitwise.
#[test]
fn two_threads_training_two_models_see_only_their_own_state() {
    fn run(level: OptLevel, steps: usize, hold: Option<&Barrier>) -> Vec<(String, Tensor)> {
        let (m, o) = build_convnet(CPU).unwrap();
        let (m, mut o) = amp::initialize(m, o, policy(level)).unwrap();
        for step in 0..steps {
            if let Some(b) = hold {
                // The other thread is inside its scopes now.
                b.wait();
                assert!(mixprec::autograd::is_grad_enabled());
                assert_eq!(mixprec::tensor::autocast::active(), None);
            }
            let (x, y) = batch(step, 6).unwrap();
            let loss = cross_entropy(&m.forward(&x).unwrap(), &y).unwrap();
            o.zero_grad().unwrap();
            o.backward(&loss).unwrap();
            o.step().unwrap();
            if let Some(b) = hold {
                b.wait();
            }
        }
        m.state_dict().unwrap()
    }
    let alone_o0 = run(OptLevel::O0, STEPS, None);
    let alone_o1 = run(OptLevel::O1, STEPS, None);
    let barrier = Arc::new(Barrier::new(2));
    let scoped = |b: Arc<Barrier>| {
        move || {
            for _ in 0..STEPS {
                let _g = mixprec::no_grad();
                let _a = amp::autocast(DType::F16).unwrap();
                b.wait();
                b.wait();
            }
        }
    };
    for level in [OptLevel::O0, OptLevel::O1] {
        let b = barrier.clone();
        let holder = std::thread::spawn(scoped(b));
        let b = barrier.clone();
        let trainer = std::thread::spawn(move || run(level, STEPS, Some(&b)));
        holder.join().unwrap();
        let got = trainer.join().unwrap();
        let want = if level == OptLevel::O0 {
            &alone_o0
        } else {
            &alone_o1
        };
        assert!(
            bits(&got) == bits(want),
            "{level:?}: a run beside another thread's scopes differs from the run alone by {:?}",
            max_diff(&got, want)
        );
    }
}

/// Two DataParallels trained at once from two threads (four worker threads, two process
/// groups) end as each does alone.
#[test]
fn two_data_parallels_at_once_match_each_alone() {
    let alone = train_dp(OptLevel::O2, 8, 2)
        .unwrap()
        .0
        .state_dict()
        .unwrap();
    let a = std::thread::spawn(|| {
        train_dp(OptLevel::O2, 8, 2)
            .unwrap()
            .0
            .state_dict()
            .unwrap()
    });
    let b = std::thread::spawn(|| {
        let _g = mixprec::no_grad();
        let _a = amp::autocast(DType::F16).unwrap();
        // This thread's scopes are its own: the training inside enables what it needs.
        let _e = mixprec::autograd::enable_grad();
        drop(_a);
        train_dp(OptLevel::O2, 8, 2)
            .unwrap()
            .0
            .state_dict()
            .unwrap()
    });
    for got in [a.join().unwrap(), b.join().unwrap()] {
        assert!(bits(&got) == bits(&alone), "{:?}", max_diff(&got, &alone));
    }
}
