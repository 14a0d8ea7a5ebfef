//! GPU tests of data parallelism over NCCL (src/distributed), ignored without a GPU: on one GPU
//! the NCCL path runs for real at world size 1 — the rendezvous (rank 0 listening, the unique id
//! handed out), the non-blocking communicator, every collective on the communication stream,
//! DDP's buckets launched during backward, AMP's overflow check after the all-reduce — and a
//! step through the wrapper equals the unwrapped step bit for bit, with no host synchronisation;
//! the DDP step captured into a CUDA graph (its collectives as graph nodes) replays to the eager
//! step's bits, with SyncBatchNorm too, SyncBatchNorm's CUDA pieces equal the CPU's batch norm,
//! and a graph is not launched once its group has failed.
//! With several GPUs, one rank per GPU (every visible GPU; `MIXPREC_TEST_RANKS=N` takes the first
//! N): the ranks train, eagerly and captured, and must end bitwise equal; a rank that leaves
//! mid-replay is named at once, one that never reaches the first collective in time, and the
//! others leave in bounded time while one hangs (skipped on one GPU, saying so). The tests run one at a time (a capture owns the stream).
//!
//! Run on a GPU machine (see benches/gpu_ddp.sh): `bash .gpu/run.sh cuda_distributed`.
//! NCCL must be loadable (libnccl.so.2 on the library path; benches/gpu_ddp.sh adds PyTorch's).

use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use mixprec::amp::{self, CapturedStep, LossScale, OptLevel, Policy};
use mixprec::backend::cuda::host_sync_count;
use mixprec::distributed::launch::{launch, LaunchConfig};
use mixprec::distributed::{
    convert_sync_batchnorm, Backend, DdpConfig, DistributedDataParallel, GroupOptions, LaunchEnv,
    ProcessGroup, ReduceOp,
};
use mixprec::nn::{cross_entropy, BatchNorm2d, Module, ResNet};
use mixprec::optim::{Optimizer, Sgd, SgdConfig};
use mixprec::{DType, Device, Error, MemoryFormat, Result, Tensor};

const GPU: Device = Device::Cuda(0);

/// One test at a time: a capture takes the device's stream over (another thread's work on it
/// would be refused), and the bitwise comparisons need deterministic convolutions.
fn serial() -> MutexGuard<'static, ()> {
    static M: Mutex<()> = Mutex::new(());
    let g = M.lock().unwrap_or_else(|e| e.into_inner());
    Device::cuda(0).expect("these tests need a CUDA GPU");
    mixprec::backend::cuda::set_deterministic(true);
    g
}

fn nccl_group() -> ProcessGroup {
    Device::cuda(0).expect("these tests need a CUDA GPU");
    match ProcessGroup::new(&LaunchEnv::single(), &GroupOptions::new(Backend::Nccl)) {
        Ok(g) => g,
        Err(e) => panic!(
            "NCCL group at world size 1 failed: {e}\n(is libnccl.so.2 on LD_LIBRARY_PATH? \
             benches/gpu_ddp.sh adds PyTorch's)"
        ),
    }
}

fn bits(t: &Tensor) -> Vec<u64> {
    t.to_vec_f64()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

/// Rendezvous, unique id, communicator; every collective and dtype at world size 1 (where each
/// is the identity, bit for bit), queued without a host synchronisation.
#[test]
#[ignore = "needs a CUDA GPU"]
fn nccl_world_size_one_collectives() {
    let _serial = serial();
    let g = nccl_group();
    assert_eq!((g.rank(), g.world_size(), g.device()), (0, 1, GPU));
    for dtype in [DType::F32, DType::F16, DType::BF16, DType::F64] {
        let src = Tensor::randn([1000], 0.0, 1.0, 7, dtype, GPU).unwrap();
        let want = bits(&src);
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
            let t = mixprec::with_no_grad(|| src.affine(1.0, 0.0)).unwrap();
            let before = host_sync_count();
            let w = g.all_reduce_async(&t, op).unwrap();
            w.wait().unwrap();
            assert_eq!(
                host_sync_count(),
                before,
                "{dtype} {op:?}: the queue synchronised"
            );
            assert!(
                bits(&t) == want,
                "{dtype} {op:?}: not the identity at world size 1"
            );
        }
        let t = mixprec::with_no_grad(|| src.affine(1.0, 0.0)).unwrap();
        g.broadcast(&t, 0).unwrap();
        assert!(bits(&t) == want, "{dtype} broadcast");
        let all = g.all_gather(&src).unwrap();
        assert_eq!(all.dims(), [1, 1000]);
        assert!(
            bits(&all.flatten_all().unwrap()) == want,
            "{dtype} all_gather"
        );
    }
    let t = Tensor::from_vec(vec![3i64, -4], [2], GPU).unwrap();
    g.all_reduce(&t, ReduceOp::Sum).unwrap();
    assert_eq!(t.to_vec::<i64>().unwrap(), vec![3, -4]);
    g.barrier().unwrap();
    let cpu = Tensor::ones([2], DType::F32, Device::Cpu).unwrap();
    assert!(matches!(
        g.all_reduce(&cpu, ReduceOp::Sum),
        Err(Error::DeviceMismatch { .. })
    ));
    println!("nccl world size 1: every collective and dtype OK");
}

fn tiny_resnet() -> ResNet {
    ResNet::cifar_style(&[1, 1], 1, 10, &GPU).unwrap()
}

fn sgd() -> SgdConfig {
    SgdConfig {
        lr: 0.05,
        momentum: 0.9,
        ..Default::default()
    }
}

fn batch(step: usize) -> (Tensor, Tensor) {
    let x = Tensor::randn([16, 1, 28, 28], 0.0, 1.0, 30 + step as u64, DType::F32, GPU).unwrap();
    let y: Vec<i64> = (0..16).map(|i| ((i + step) % 10) as i64).collect();
    (x, Tensor::from_vec(y, [16], GPU).unwrap())
}

/// Every tensor of `got` holds the bits of the same-named one in `want`.
fn assert_same_bits(got: &[(String, Tensor)], want: &[(String, Tensor)], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: different state dicts");
    for ((n, a), (m, b)) in got.iter().zip(want) {
        assert_eq!(n, m);
        assert!(bits(a) == bits(b), "{n}: {what}");
    }
}

/// Largest |a − b| / max|b| over the state dicts' tensors.
fn worst(a: &[(String, Tensor)], b: &[(String, Tensor)]) -> (f64, String) {
    let mut w = (0.0f64, String::new());
    for ((n, ta), (_, tb)) in a.iter().zip(b) {
        let (x, y) = (ta.to_vec_f64().unwrap(), tb.to_vec_f64().unwrap());
        let scale = y.iter().fold(1e-30f64, |m, v| m.max(v.abs()));
        let d = x
            .iter()
            .zip(&y)
            .fold(0.0f64, |m, (p, q)| m.max((p - q).abs()))
            / scale;
        if d > w.0 || d.is_nan() {
            w = (d, n.clone());
        }
    }
    w
}

/// Four O2 steps of the small ResNet, unwrapped.
fn plain_run() -> (Vec<(String, Tensor)>, amp::ScalerStats) {
    let plain = tiny_resnet();
    let opt = Sgd::new(plain.parameters(), sgd()).unwrap();
    let policy = Policy::opt_level(OptLevel::O2).with_report_interval(0);
    let (plain, mut opt) = amp::initialize(plain, opt, policy).unwrap();
    for step in 0..4 {
        let (x, y) = batch(step);
        let loss = cross_entropy(&plain.forward(&x).unwrap(), &y).unwrap();
        opt.zero_grad().unwrap();
        opt.backward(&loss).unwrap();
        opt.step().unwrap();
    }
    (plain.state_dict().unwrap(), opt.stats().unwrap()[0])
}

/// O2 through DDP at world size 1 equals the unwrapped O2 step bit for bit (the all-reduce of
/// one rank is the identity) — or, should two unwrapped runs differ on this GPU (kernels that
/// are not deterministic), by no more than they do — the buckets start while backward runs,
/// and the steps make no host synchronisation.
#[test]
#[ignore = "needs a CUDA GPU"]
fn ddp_nccl_step_equals_the_unwrapped_step_with_no_host_sync() {
    let _serial = serial();
    let g = nccl_group();
    let policy = || Policy::opt_level(OptLevel::O2).with_report_interval(0);
    let (plain_a, stats_a) = plain_run();
    let (plain_b, _) = plain_run();
    let (noise, noise_at) = worst(&plain_b, &plain_a);
    println!("two unwrapped runs differ by {noise:e} ({noise_at})");
    let wrapped = tiny_resnet();
    let opt = Sgd::new(wrapped.parameters(), sgd()).unwrap();
    let (wrapped, mut opt) = amp::initialize(wrapped, opt, policy()).unwrap();
    let cfg = DdpConfig {
        bucket_cap_mb: 0.05,
        first_bucket_mb: 0.01,
        ..Default::default()
    };
    let ddp = DistributedDataParallel::new(wrapped, &g, cfg).unwrap();
    println!("buckets: {:?}", ddp.buckets());
    assert!(ddp.buckets().len() >= 3, "{:?}", ddp.buckets());
    let mut syncs = 0;
    for step in 0..4 {
        let (x, y) = batch(step);
        let before = host_sync_count();
        let loss = cross_entropy(&ddp.forward(&x).unwrap(), &y).unwrap();
        opt.zero_grad().unwrap();
        opt.backward(&loss).unwrap();
        opt.step().unwrap();
        if step > 0 {
            syncs += host_sync_count() - before;
        }
    }
    assert_eq!(syncs, 0, "{syncs} host synchronisations in 3 DDP steps");
    let stats = ddp.last_reduction();
    assert!(
        stats.launched_during_backward > 0,
        "no bucket started before the end of backward: {stats:?}"
    );
    let got = ddp.state_dict().unwrap();
    let (d, at) = worst(&got, &plain_a);
    if noise == 0.0 {
        assert_same_bits(
            &got,
            &plain_a,
            "DDP at world size 1 differs from the plain step",
        );
    } else {
        assert!(
            d <= 2.0 * noise,
            "DDP at world size 1 differs from the plain step by {d:e} ({at}); two plain runs \
             by {noise:e}"
        );
    }
    assert_eq!(stats_a, opt.stats().unwrap()[0]);
    println!(
        "DDP world size 1: {} the plain O2 step (difference {d:e}), 0 host syncs, {} of {} \
         buckets launched during backward",
        if d == 0.0 {
            "bitwise equal to"
        } else {
            "as close as two plain runs to"
        },
        stats.launched_during_backward,
        stats.buckets
    );
}

/// AMP's overflow check reads the all-reduced gradients: a pre-division so small that the f16
/// buckets overflow (while every local gradient is finite) skips the step, on the device.
#[test]
#[ignore = "needs a CUDA GPU"]
fn ddp_nccl_overflow_check_reads_the_reduced_gradients() {
    let _serial = serial();
    let g = nccl_group();
    let model = tiny_resnet();
    let opt = Sgd::new(model.parameters(), sgd()).unwrap();
    let policy = Policy::opt_level(OptLevel::O2)
        .with_loss_scale(LossScale::Dynamic)
        .with_report_interval(0);
    let (model, mut opt) = amp::initialize(model, opt, policy).unwrap();
    let cfg = DdpConfig {
        gradient_predivide_factor: Some(1e-30),
        ..Default::default()
    };
    let ddp = DistributedDataParallel::new(model, &g, cfg).unwrap();
    let before = ddp.state_dict().unwrap();
    let (x, y) = batch(0);
    let loss = cross_entropy(&ddp.forward(&x).unwrap(), &y).unwrap();
    assert!(loss.item().unwrap().is_finite());
    opt.zero_grad().unwrap();
    opt.backward(&loss).unwrap();
    opt.step().unwrap();
    let st = opt.stats().unwrap()[0];
    assert_eq!(
        st.skipped_total, 1,
        "the overflowed reduction did not skip the step: {st:?}"
    );
    assert_eq!(st.scale, 32768.0);
    for ((n, a), (_, b)) in before.iter().zip(&ddp.state_dict().unwrap()) {
        if !n.contains("running") && !n.contains("num_batches") {
            assert!(bits(a) == bits(b), "{n} changed in a skipped step");
        }
    }
    println!("DDP world size 1: an overflow in the reduced gradients skips the step");
}

/// The batch of `step` with an Inf planted when `inf` (the step's gradients overflow).
fn batch_with(step: usize, inf: bool) -> (Tensor, Tensor) {
    let (x, y) = batch(step);
    if !inf {
        return (x, y);
    }
    let mut v = x.to_vec::<f32>().unwrap();
    v[100] = f32::INFINITY;
    (Tensor::from_vec(v, x.dims().to_vec(), GPU).unwrap(), y)
}

/// Steps of the small ResNet through DDP at world size 1 over NCCL, as a `CapturedStep` that
/// captures (`capture`) or runs eagerly: O2 with a dynamic loss scale, a learning rate set every
/// step, an Inf planted in step 4's batch; with `sync_bn`, its batch norms are SyncBatchNorm
/// (an all-gather forward and an all-reduce backward each). Returns the state dict, the scaler's stats,
/// the step's stats and the host synchronisations of the last three steps.
fn ddp_steps(
    g: &ProcessGroup,
    capture: bool,
    sync_bn: bool,
) -> (Vec<(String, Tensor)>, amp::ScalerStats, amp::StepStats, u64) {
    let model = tiny_resnet();
    let opt = Sgd::new(model.parameters(), sgd()).unwrap();
    let policy = Policy::opt_level(OptLevel::O2)
        .with_loss_scale(LossScale::Dynamic)
        .with_report_interval(0);
    let (model, mut opt) = amp::initialize(model, opt, policy).unwrap();
    if sync_bn {
        assert!(convert_sync_batchnorm(&model, g).unwrap() > 0);
    }
    let cfg = DdpConfig {
        bucket_cap_mb: 0.05,
        first_bucket_mb: 0.01,
        ..Default::default()
    };
    let ddp = DistributedDataParallel::new(model, g, cfg).unwrap();
    let body = |x: &Tensor, y: &Tensor| cross_entropy(&ddp.forward(x)?, y);
    let mut step = if capture {
        CapturedStep::new(&ddp, &mut opt, body).unwrap()
    } else {
        CapturedStep::eager(&ddp, &mut opt, body).unwrap()
    };
    let mut syncs = 0;
    for i in 0..7 {
        let (x, y) = batch_with(i, i == 4);
        step.optimizer()
            .inner_mut()
            .set_lr_all(0.05 / (1.0 + i as f64))
            .unwrap();
        let before = host_sync_count();
        step.run(&x, &y).unwrap();
        if i >= 4 {
            syncs += host_sync_count() - before;
        }
    }
    let stats = step.stats();
    let scaler = step.optimizer().stats().unwrap()[0];
    drop(step);
    (ddp.state_dict().unwrap(), scaler, stats, syncs)
}

/// DDP's step captured into a CUDA graph — its bucket all-reduces and the buffer broadcast are
/// nodes of the graph — replays to the bits of the eager DDP step: parameters, batch-norm
/// buffers, the loss scale and the skipped step (an Inf in one batch), with no host
/// synchronisation per replay.
#[test]
#[ignore = "needs a CUDA GPU"]
fn ddp_nccl_captured_step_equals_the_eager_step() {
    let _serial = serial();
    let g = nccl_group();
    captured_equals_eager(&g, false);
}

/// The same with SyncBatchNorm: its statistics' all-gathers (forward) and their gradients'
/// (backward) are graph nodes too, and its running statistics are updated in their buffers.
#[test]
#[ignore = "needs a CUDA GPU"]
fn sync_batchnorm_captured_step_equals_the_eager_step() {
    let _serial = serial();
    let g = nccl_group();
    captured_equals_eager(&g, true);
}

/// SyncBatchNorm's CUDA pieces (statistics, the all-gather, their combination, the normalised
/// output; the gradient sums, their all-reduce, the input's gradient) against a plain batch norm
/// on the CPU, which at world size 1 it must equal: every memory format, half type and fused
/// epilogue the layer runs, the output, all gradients and the running statistics.
#[test]
#[ignore = "needs a CUDA GPU"]
fn sync_batchnorm_pieces_match_the_cpu_batch_norm() {
    let _serial = serial();
    let g = nccl_group();
    let cpu = Device::Cpu;
    let (n, c, h, w) = (8, 24, 7, 9);
    let mut worst_of = Vec::new();
    for format in [MemoryFormat::Contiguous, MemoryFormat::ChannelsLast] {
        for (dtype, tol) in [(DType::F32, 2e-5), (DType::F16, 4e-3), (DType::BF16, 3e-2)] {
            for epilogue in ["plain", "relu", "add_relu"] {
                let what = format!("{} {dtype} {epilogue}", format.name());
                let make = |dev: &Device| {
                    let bn = BatchNorm2d::new(c, dev).unwrap();
                    let set = |t: &Tensor, seed| {
                        let v = Tensor::randn([c], 1.0, 0.5, seed, DType::F32, cpu).unwrap();
                        t.set_data(&v.to_device(*dev).unwrap()).unwrap();
                    };
                    set(&bn.weight, 3);
                    set(&bn.bias, 4);
                    bn
                };
                let (bn_cpu, bn_gpu) = (make(&cpu), make(&GPU));
                assert_eq!(convert_sync_batchnorm(&bn_gpu, &g).unwrap(), 1);
                let x = Tensor::randn([n, c, h, w], 0.7, 2.0, 5, dtype, cpu).unwrap();
                let r = Tensor::randn([n, c, h, w], 0.0, 1.0, 6, dtype, cpu).unwrap();
                let up = Tensor::randn([n, c, h, w], 0.0, 1.0, 7, dtype, cpu).unwrap();
                let run = |bn: &BatchNorm2d, dev: Device| {
                    let on = |t: &Tensor| {
                        t.to_device(dev)
                            .unwrap()
                            .to_memory_format(format)
                            .unwrap()
                            .to_variable()
                    };
                    let (x, r) = (on(&x), on(&r));
                    let y = match epilogue {
                        "plain" => bn.forward(&x),
                        "relu" => bn.forward_relu(&x),
                        _ => bn.forward_add_relu(&x, &r),
                    }
                    .unwrap();
                    let loss = y.mul(&on(&up)).unwrap().sum_all().unwrap();
                    loss.backward().unwrap();
                    let mut out = vec![
                        ("y", y.detach()),
                        ("dx", x.grad().unwrap()),
                        ("dweight", bn.weight.grad().unwrap()),
                        ("dbias", bn.bias.grad().unwrap()),
                        ("running_mean", bn.running_mean.clone()),
                        ("running_var", bn.running_var.clone()),
                    ];
                    if epilogue == "add_relu" {
                        out.push(("dresidual", r.grad().unwrap()));
                    }
                    out
                };
                let want = run(&bn_cpu, cpu);
                let got = run(&bn_gpu, GPU);
                for ((name, a), (_, b)) in got.iter().zip(&want) {
                    let (a, b) = (a.to_vec_f64().unwrap(), b.to_vec_f64().unwrap());
                    let scale = b.iter().fold(1.0f64, |m, v| m.max(v.abs()));
                    let e = a
                        .iter()
                        .zip(&b)
                        .fold(0.0f64, |m, (p, q)| m.max((p - q).abs()))
                        / scale;
                    assert!(e < tol, "{what}: {name} off by {e:e} (bound {tol:e})");
                    worst_of.push((e / tol, format!("{what} {name} {e:.1e}")));
                }
            }
        }
    }
    worst_of.sort_by(|a, b| a.0.total_cmp(&b.0));
    println!(
        "SyncBatchNorm on the GPU = batch norm on the CPU in {} comparisons; closest to its \
         bound: {}",
        worst_of.len(),
        worst_of.last().map_or("", |w| &w.1)
    );
}

fn captured_equals_eager(g: &ProcessGroup, sync_bn: bool) {
    let what = if sync_bn { "SyncBatchNorm" } else { "DDP" };
    let (eager, eager_scaler, eager_stats, _) = ddp_steps(g, false, sync_bn);
    let (graph, graph_scaler, graph_stats, syncs) = ddp_steps(g, true, sync_bn);
    assert_eq!(eager_stats.replays, 0);
    assert_eq!(
        (graph_stats.eager, graph_stats.captures, graph_stats.replays),
        (2, 1, 5),
        "{graph_stats:?}"
    );
    assert_eq!(
        eager_scaler.skipped_total, 1,
        "the planted Inf: {eager_scaler:?}"
    );
    assert_eq!(graph_scaler, eager_scaler);
    assert_eq!(
        syncs, 0,
        "{what}: {syncs} host synchronisations in three replayed steps"
    );
    assert_same_bits(
        &graph,
        &eager,
        &format!("{what}: the replayed step differs from the eager one"),
    );
    println!(
        "{what} world size 1: 5 replayed steps (one skipped) bitwise the eager steps, {} \
         tensors, 0 host syncs per replay",
        graph.len()
    );
}

/// A graph holding NCCL collectives is not launched once its group has failed (the
/// communicator is aborted) or been dropped (released): the launch is refused with the
/// group's error, as an eager collective would be, rather than running NCCL's nodes on a
/// communicator that is gone.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_graph_is_not_replayed_on_a_failed_or_released_group() {
    let _serial = serial();
    for how in ["aborted", "dropped"] {
        let t = Tensor::ones([1024], DType::F32, GPU).unwrap();
        let g = nccl_group();
        // Warm-up: the kernel compiled and NCCL's connections made before the capture.
        let w = t.mul_scalar(2.0).unwrap();
        g.all_reduce(&w, ReduceOp::Sum).unwrap();
        let mut graph = mixprec::graph::capture(GPU, || {
            t.copy_in_place(&t.mul_scalar(2.0)?)?;
            g.all_reduce(&t, ReduceOp::Sum)
        })
        .unwrap();
        graph.launch().unwrap();
        assert_eq!(t.to_vec::<f32>().unwrap()[0], 2.0);
        if how == "aborted" {
            let _ = g.abort(None, "the test aborts the group");
        }
        drop(g);
        let err = graph.launch().expect_err("launched on a gone communicator");
        let msg = err.to_string();
        assert!(
            matches!(err, Error::Distributed { .. }),
            "{how}: not the group's error: {msg}"
        );
        if how == "aborted" {
            assert!(msg.contains("the test aborts the group"), "{msg}");
        } else {
            assert!(msg.contains("communicator was released"), "{msg}");
        }
        assert_eq!(
            t.to_vec::<f32>().unwrap()[0],
            2.0,
            "{how}: the refused launch ran"
        );
        println!("{how} group: the launch refused: {msg}");
    }
}

// ---- several GPUs: a rank on each (skipped on a machine with one) ------------------------------

/// The rank processes of the tests below (a no-op unless launched by one). `MIXPREC_TEST_MODE`:
/// - unset: three O2 steps through DDP in a plain loop;
/// - `eager` / `captured`: six steps as a `CapturedStep` that runs eagerly or captures (a
///   learning rate set every step); `sync-bn-eager` / `sync-bn-captured` the same with
///   SyncBatchNorm;
/// - `leave-early`: captured steps, rank 1 leaving after three while the others go on; rank 0
///   reads each step's loss, ranks 2.. only their last (`leave-early-quiet`: rank 0 too); each
///   rank exits by itself after 90 s whatever happens (status 4), so a hang fails the test
///   rather than holding the GPUs;
/// - `hang-first`: rank 1 sleeps while the others make the communicator's first all-reduce;
/// - `peer-hangs`: three O2 steps, then rank 1 issues an all-reduce no other rank issues, writes
///   its pid (`rank1.pid`) and stops itself (SIGSTOP: its host hung, its kernel waiting); the
///   others then leave the group cleanly and write how long leaving took (`rank{r}.left`).
#[test]
#[ignore = "needs a CUDA GPU"]
fn nccl_rank_entry() {
    let Ok(out) = std::env::var("MIXPREC_TEST_OUT") else {
        return;
    };
    let out = PathBuf::from(out);
    let mode = std::env::var("MIXPREC_TEST_MODE").unwrap_or_default();
    let rank = LaunchEnv::from_env().map_or(0, |e| e.rank);
    if mode.starts_with("leave-early") || mode == "peer-hangs" {
        let out = out.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(90));
            let _ = std::fs::write(out.join(format!("rank{rank}.err")), "still running at 90 s");
            std::process::exit(4);
        });
    }
    let r = (|| -> Result<()> {
        mixprec::backend::cuda::set_deterministic(true);
        let env = LaunchEnv::from_env()?;
        let g = ProcessGroup::new(&env, &GroupOptions::new(Backend::Nccl))?;
        let dev = g.device();
        if mode == "hang-first" {
            // Rank 1 is alive but never reaches the first collective; rank 0's all-reduce is
            // the communicator's first, whose call connects to the peers on the host.
            if env.rank == 1 {
                std::thread::sleep(Duration::from_secs(60));
                std::process::exit(5);
            }
            let t = Tensor::ones([4], DType::F32, dev)?;
            g.all_reduce(&t, ReduceOp::Sum)?;
            t.to_vec::<f32>()?;
            return g.check();
        }
        let model = ResNet::cifar_style(&[1, 1], 1, 10, &dev)?;
        let opt = Sgd::new(model.parameters(), sgd())?;
        let policy = Policy::opt_level(OptLevel::O2).with_report_interval(0);
        let (model, mut opt) = amp::initialize(model, opt, policy)?;
        let run = match mode.strip_prefix("sync-bn-") {
            Some(run) => {
                convert_sync_batchnorm(&model, &g)?;
                run
            }
            None => mode.as_str(),
        };
        let ddp = DistributedDataParallel::new(model, &g, DdpConfig::default())?;
        let batch = |step: u64| -> Result<(Tensor, Tensor)> {
            let x = Tensor::randn(
                [8, 1, 28, 28],
                0.0,
                1.0,
                50 + 10 * env.rank as u64 + step,
                DType::F32,
                dev,
            )?;
            let y = Tensor::from_vec(
                (0..8).map(|i| (i % 10) as i64).collect::<Vec<_>>(),
                [8],
                dev,
            )?;
            Ok((x, y))
        };
        if mode.is_empty() || mode == "peer-hangs" {
            for step in 0..3 {
                let (x, y) = batch(step)?;
                let loss = cross_entropy(&ddp.forward(&x)?, &y)?;
                opt.zero_grad()?;
                opt.backward(&loss)?;
                opt.step()?;
            }
            if mode == "peer-hangs" {
                drop((ddp, opt));
                return peer_hangs(g, &env, &out);
            }
        } else {
            let body = |x: &Tensor, y: &Tensor| cross_entropy(&ddp.forward(x)?, y);
            let mut step = match run {
                "eager" => CapturedStep::eager(&ddp, &mut opt, body)?,
                "captured" | "leave-early" | "leave-early-quiet" => {
                    CapturedStep::new(&ddp, &mut opt, body)?
                }
                other => panic!("unknown MIXPREC_TEST_MODE {other}"),
            };
            let leaving = mode.starts_with("leave-early");
            let reads_each = mode == "leave-early" && env.rank == 0;
            let steps = match (leaving, env.rank) {
                (true, 1) => 3,
                (true, _) => 8,
                _ => 6,
            };
            let mut last = None;
            for i in 0..steps {
                let (x, y) = batch(i)?;
                step.optimizer()
                    .inner_mut()
                    .set_lr_all(0.05 / (1.0 + i as f64))?;
                let loss = step.run(&x, &y)?;
                if reads_each {
                    loss.item()?;
                }
                last = Some(loss);
            }
            if leaving {
                // The others read only their last loss, as a program that reports at the end:
                // their replays after the departure are queued by then, and that read waits
                // for all-reduces the abort cuts short.
                if let Some(loss) = last.filter(|_| env.rank != 1) {
                    loss.item()?;
                }
                return Ok(());
            }
        }
        mixprec::io::safetensors::write(
            &out.join(format!("{mode}rank{}.safetensors", env.rank)),
            &ddp.state_dict()?,
            &Default::default(),
        )
    })();
    if let Err(e) = r {
        eprintln!("nccl rank {rank}: {e}");
        let _ = std::fs::write(out.join(format!("rank{rank}.err")), e.to_string());
        std::process::exit(3);
    }
    std::process::exit(0);
}

/// `nccl_rank_entry`'s `peer-hangs` after the steps: rank 1 hangs inside a collective of its
/// own, the others leave once it has (a clean leave: the group has not failed).
fn peer_hangs(g: ProcessGroup, env: &LaunchEnv, out: &std::path::Path) -> Result<()> {
    if env.rank == 1 {
        let t = Tensor::ones([4], DType::F32, g.device())?;
        // Waits until the issuing thread has made the NCCL call: the kernel is on the GPU.
        g.all_reduce_async(&t, ReduceOp::Sum)?.wait()?;
        std::fs::write(out.join("rank1.pid"), std::process::id().to_string()).unwrap();
        // SAFETY: raising a signal; the process stops here until the test kills it.
        unsafe { libc::raise(libc::SIGSTOP) };
        std::process::exit(6);
    }
    let t0 = std::time::Instant::now();
    while !out.join("rank1.pid").exists() {
        if t0.elapsed() > Duration::from_secs(60) {
            return Err(Error::Cuda("rank 1 never wrote its pid".into()));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_secs(1));
    g.check()?;
    let t = std::time::Instant::now();
    drop(g);
    std::fs::write(
        out.join(format!("rank{}.left", env.rank)),
        t.elapsed().as_secs_f64().to_string(),
    )
    .unwrap();
    Ok(())
}

/// The directory the ranks of `launch_ranks(n, mode)` write into.
fn ranks_out(n: usize, mode: &str) -> PathBuf {
    std::env::temp_dir().join(format!("mixprec-nccl{n}-{}-{mode}", std::process::id()))
}

/// Runs `n` ranks of `nccl_rank_entry` in `mode`, writing into a fresh directory.
fn launch_ranks(n: usize, mode: &str) -> (PathBuf, Result<()>) {
    let out = ranks_out(n, mode);
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out).unwrap();
    let mut cfg = LaunchConfig::new(
        n,
        std::env::current_exe().unwrap(),
        [
            "nccl_rank_entry",
            "--exact",
            "--include-ignored",
            "--nocapture",
        ]
        .iter()
        .map(Into::into)
        .collect(),
    );
    cfg.env = vec![
        ("MIXPREC_TEST_OUT".into(), out.display().to_string()),
        ("MIXPREC_TEST_MODE".into(), mode.into()),
        (
            "MIXPREC_DIST_TIMEOUT".into(),
            if mode == "hang-first" { "8" } else { "120" }.into(),
        ),
    ];
    cfg.grace = Duration::from_secs(20);
    let r = launch(&cfg).map(|_| ());
    (out, r)
}

/// The serial guard of a test with one rank per GPU and the number of ranks: every visible GPU,
/// or the first `MIXPREC_TEST_RANKS`; None (said) on a machine with one GPU.
fn several_gpus(test: &str) -> Option<(MutexGuard<'static, ()>, usize)> {
    let guard = serial();
    let gpus = mixprec::backend::cuda::device_count().expect("counting the GPUs");
    let n = match std::env::var("MIXPREC_TEST_RANKS") {
        Ok(v) => {
            let n: usize = v.parse().expect("MIXPREC_TEST_RANKS: a number of ranks");
            assert!(
                n <= gpus,
                "MIXPREC_TEST_RANKS={n}, but this machine has {gpus} GPU(s)"
            );
            n
        }
        Err(_) => gpus,
    };
    if n < 2 {
        println!("{test}: skipped, {n} rank(s) here (one GPU, or MIXPREC_TEST_RANKS)");
        return None;
    }
    Some((guard, n))
}

fn read_state(out: &std::path::Path, mode: &str, rank: usize) -> Vec<(String, Tensor)> {
    mixprec::io::safetensors::read(&out.join(format!("{mode}rank{rank}.safetensors")))
        .unwrap()
        .0
}

/// Rank `r`'s state dicts agree bitwise with rank 0's but for the batch-norm statistics of each
/// rank's last batch; returns how many of those differ from rank 0's, over all ranks.
fn ranks_agree(states: &[Vec<(String, Tensor)>]) -> usize {
    let a = &states[0];
    let mut own = 0;
    for (r, b) in states.iter().enumerate().skip(1) {
        own += rank_agrees(a, b, r);
    }
    own
}

fn rank_agrees(a: &[(String, Tensor)], b: &[(String, Tensor)], rank: usize) -> usize {
    assert_eq!(a.len(), b.len());
    let mut own = 0;
    for ((n, ta), (nb, tb)) in a.iter().zip(b) {
        assert_eq!(n, nb);
        // Batch-norm statistics are rank 0's when each training forward starts (PyTorch's
        // broadcast_buffers), then that forward updates them from the rank's own batch: after
        // the last step each rank holds its own. Everything else must agree.
        if n.ends_with("running_mean") || n.ends_with("running_var") {
            own += usize::from(bits(ta) != bits(tb));
            continue;
        }
        assert!(bits(ta) == bits(tb), "{n}: rank {rank} differs from rank 0");
    }
    own
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn ddp_nccl_ranks_agree() {
    let Some((_serial, n)) = several_gpus("ddp_nccl_ranks_agree") else {
        return;
    };
    let (out, r) = launch_ranks(n, "");
    r.unwrap();
    let own = ranks_agree(&read_states(&out, "", n));
    println!(
        "{n} NCCL ranks on {n} GPUs: bitwise equal after 3 O2 steps ({own} running statistics \
         of the ranks' last batches differ from rank 0's, as in PyTorch)"
    );
}

fn read_states(out: &std::path::Path, mode: &str, n: usize) -> Vec<Vec<(String, Tensor)>> {
    (0..n).map(|r| read_state(out, mode, r)).collect()
}

/// Every rank replaying a captured DDP step (the collectives are nodes of each rank's graph):
/// they agree as eager ranks do, and each rank's state is bitwise its eager run's.
#[test]
#[ignore = "needs a CUDA GPU"]
fn ddp_nccl_ranks_captured_equal_eager() {
    let Some((_serial, n)) = several_gpus("ddp_nccl_ranks_captured_equal_eager") else {
        return;
    };
    let own = ranks_captured_equal_eager(n, "");
    println!(
        "{n} NCCL ranks, captured DDP step: 4 replays each, ranks agree ({own} running \
         statistics their own), each rank bitwise its eager run"
    );
}

/// The same with SyncBatchNorm, whose statistics are the global batch's: its forward and
/// backward all-reduces are graph nodes as well.
#[test]
#[ignore = "needs a CUDA GPU"]
fn sync_batchnorm_ranks_captured_equal_eager() {
    let Some((_serial, n)) = several_gpus("sync_batchnorm_ranks_captured_equal_eager") else {
        return;
    };
    let own = ranks_captured_equal_eager(n, "sync-bn-");
    println!(
        "{n} NCCL ranks, captured SyncBatchNorm step: ranks agree ({own} running statistics \
         differ), each rank bitwise its eager run"
    );
}

/// Runs `n` ranks eagerly and captured (modes `{prefix}eager`, `{prefix}captured`), checks that
/// the captured ranks agree and that each is bitwise its eager run; returns how many running
/// statistics differ from rank 0's.
fn ranks_captured_equal_eager(n: usize, prefix: &str) -> usize {
    let (eager, captured) = (format!("{prefix}eager"), format!("{prefix}captured"));
    let (out, r) = launch_ranks(n, &eager);
    r.unwrap();
    let (out_g, r) = launch_ranks(n, &captured);
    r.unwrap();
    let replayed = read_states(&out_g, &captured, n);
    let own = ranks_agree(&replayed);
    for (rank, state) in replayed.iter().enumerate() {
        assert_same_bits(
            state,
            &read_state(&out, &eager, rank),
            &format!("rank {rank}'s replayed {captured} step differs from its eager one"),
        );
    }
    own
}

/// A rank that leaves (cleanly, after three steps) while its peers replay a captured step whose
/// all-reduce it will never join: the peers fail at once, naming it, instead of waiting in the
/// all-reduce. The leaving rank says goodbye before it destroys its communicator (destroying it
/// can wait for the peers), and rank 0's control plane fails the group, for every rank, as soon
/// as the goodbye shows a collective the leaver never issued; the abort releases the all-reduce.
/// Ranks 2.. queue their remaining replays without reading, and their final read must fail
/// rather than return what was computed after the cut-short all-reduces; then again with rank
/// 0 reading only at the end too (`leave-early-quiet`: every survivor's read waits in the
/// driver while its group is aborted).
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_rank_that_leaves_mid_replay_is_named_at_once() {
    let Some((_serial, n)) = several_gpus("a_rank_that_leaves_mid_replay_is_named_at_once") else {
        return;
    };
    leaves_mid_replay(n, "leave-early");
    leaves_mid_replay(n, "leave-early-quiet");
}

fn leaves_mid_replay(n: usize, mode: &str) {
    let t = std::time::Instant::now();
    let (out, r) = launch_ranks(n, mode);
    let took = t.elapsed();
    let launcher = match r {
        Ok(()) => panic!("rank 0 should have failed"),
        Err(e) => e.to_string(),
    };
    println!("the launcher: {launcher}");
    assert!(
        !launcher.contains("was still running"),
        "a rank did not exit by itself: {launcher}"
    );
    let err = std::fs::read_to_string(out.join("rank0.err")).expect("rank 0's error");
    for rank in (0..n).filter(|&r| r != 1) {
        let e = std::fs::read_to_string(out.join(format!("rank{rank}.err")))
            .unwrap_or_else(|_| panic!("rank {rank} did not fail"));
        assert!(
            e.contains("rank 1 shut down its process group"),
            "rank {rank}'s error does not name rank 1: {e}"
        );
    }
    if let Ok(e1) = std::fs::read_to_string(out.join("rank1.err")) {
        panic!("rank 1 left cleanly, yet failed: {e1}");
    }
    assert!(took < Duration::from_secs(60), "took {took:?}");
    println!("{mode}: a rank leaving mid-replay: its peers failed in {took:?} naming it: {err}");
}

/// A rank that is alive but never issues the first collective: with a blocking communicator the
/// first call waits inside NCCL on the host for it to connect, and that wait must not hold the
/// other ranks past the collective timeout (8 s here): rank 0 fails naming rank 1 (and only
/// rank 1: the others issued it), and every rank but the sleeper exits by itself.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_rank_that_never_reaches_the_first_collective_is_named_in_time() {
    let Some((_serial, n)) =
        several_gpus("a_rank_that_never_reaches_the_first_collective_is_named_in_time")
    else {
        return;
    };
    let t = std::time::Instant::now();
    let (out, r) = launch_ranks(n, "hang-first");
    let took = t.elapsed();
    let launcher = match r {
        Ok(()) => panic!("rank 0 should have failed"),
        Err(e) => e.to_string(),
    };
    println!("the launcher: {launcher}");
    let err = std::fs::read_to_string(out.join("rank0.err")).expect("rank 0's error");
    assert!(
        err.contains("rank(s) [1] had not issued collective #1"),
        "rank 0's error does not name rank 1: {err}"
    );
    for rank in (0..n).filter(|&r| r != 1) {
        assert!(
            !launcher.contains(&format!("rank {rank} was still running")),
            "rank {rank} did not exit by itself: {launcher}"
        );
    }
    assert!(took < Duration::from_secs(50), "took {took:?}");
    println!("a rank that never reached the first collective: named in {took:?}: {err}");
}

/// A peer whose host hangs inside a collective that the others never issue (rank 1 stops itself
/// with its all-reduce's kernel on the GPU): NCCL's destroy of a finalized communicator waits for
/// such a peer, and leaving the group must not wait with it. Every other rank leaves cleanly in
/// bounded time and exits 0; the test then kills rank 1.
#[test]
#[ignore = "needs a CUDA GPU"]
fn leaving_does_not_wait_for_a_hung_peer() {
    let Some((_serial, n)) = several_gpus("leaving_does_not_wait_for_a_hung_peer") else {
        return;
    };
    let out = ranks_out(n, "peer-hangs");
    let _ = std::fs::remove_dir_all(&out);
    let others: Vec<usize> = (0..n).filter(|&r| r != 1).collect();
    let watcher = {
        let (out, others) = (out.clone(), others.clone());
        std::thread::spawn(move || {
            // Until every other rank has left or failed (each exits by itself within 90 s).
            let t0 = std::time::Instant::now();
            let ended = |r: usize| {
                out.join(format!("rank{r}.left")).exists()
                    || out.join(format!("rank{r}.err")).exists()
            };
            while !others.iter().all(|&r| ended(r)) && t0.elapsed() < Duration::from_secs(100) {
                std::thread::sleep(Duration::from_millis(100));
            }
            std::thread::sleep(Duration::from_secs(2));
            if let Ok(pid) = std::fs::read_to_string(out.join("rank1.pid")) {
                let pid: i32 = pid.trim().parse().unwrap();
                // SAFETY: a signal to the stopped rank process this test launched.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        })
    };
    let (_, r) = launch_ranks(n, "peer-hangs");
    watcher.join().unwrap();
    let launcher = match r {
        Ok(()) => panic!("rank 1 should have been killed"),
        Err(e) => e.to_string(),
    };
    println!("the launcher: {launcher}");
    assert!(
        launcher.contains("rank 1 exited with signal 9"),
        "rank 1 was not the one killed: {launcher}"
    );
    for &rank in &others {
        if let Ok(e) = std::fs::read_to_string(out.join(format!("rank{rank}.err"))) {
            panic!("rank {rank} failed: {e}");
        }
        assert!(
            !launcher.contains(&format!("rank {rank} ")),
            "rank {rank} did not exit cleanly: {launcher}"
        );
        let left: f64 = std::fs::read_to_string(out.join(format!("rank{rank}.left")))
            .expect("how long leaving took")
            .parse()
            .unwrap();
        println!("rank {rank} left its group in {left:.2} s while rank 1 hung");
        assert!(left < 30.0, "rank {rank} took {left} s to leave");
    }
}
