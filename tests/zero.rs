//! ZeRO-sharded optimizers (src/distributed/zero.rs) and their checkpoints
//! (src/io/zero_checkpoint.rs) on the CPU process group, the ranks as threads of this test:
//!
//! - the collectives: reduce-scatter (every op) and all-gather into a kept buffer, and their
//!   refusals;
//! - equivalence: after several steps the sharded AdamW and SGD leave the parameters bitwise
//!   those of the unsharded fused optimizer on all-reduced gradients (DDP's), at world sizes 1,
//!   2 and 3 (the CPU reduce-scatter sums in rank order exactly as the all-reduce does), with
//!   the parameters straddling share boundaries; the same under amp O2 (f16 model, FP32 masters
//!   and state of the share only);
//! - memory: each rank holds 1/world of the state;
//! - an Inf in one rank's batch skips the step on every rank (and every scaler backs off);
//! - LAMB: the global gradient norm and the per-tensor trust ratios over whole tensors, the
//!   weights straddling share boundaries, equal to the unsharded LAMB within f32 rounding;
//! - clipping by the global norm equals the unsharded clip within f32 rounding;
//! - the gradient buckets reduce-scattered from the gradient hooks during backward (a bucket
//!   per parameter), at world sizes 1, 2, 3, with and without gradient accumulation (told or
//!   not), bitwise those of the unsharded optimizer; bucket sizes and micro-batches checked and
//!   fixed by the first step;
//! - resume across world sizes (2 -> 1, 1 -> 2 bitwise; 3 -> 2 within f32 rounding) from the
//!   per-rank shards, also between bucket layouts, and the consolidated state loading into the plain optimizer.

use std::path::PathBuf;

use mixprec::amp::{self, OptLevel, Policy};
use mixprec::distributed::launch::free_port;
use mixprec::distributed::{
    Backend, GroupOptions, LaunchEnv, Launcher, ProcessGroup, ReduceOp, ZeroAdam, ZeroLamb, ZeroSgd,
};
use mixprec::io::zero_checkpoint;
use mixprec::nn::{cross_entropy, Linear, Module, ReLU, Sequential};
use mixprec::optim::{
    AdamConfig, FusedAdam, FusedLamb, FusedSgd, LambConfig, Optimizer, SgdConfig,
};
use mixprec::{DType, Device, Result, Tensor};

const CPU: Device = Device::Cpu;

/// Runs `f(rank, group)` on `world` ranks (threads) and returns their results in rank order.
fn on_ranks<T: Send + 'static>(
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
                let opts = GroupOptions::new(Backend::Cpu)
                    .with_timeout(std::time::Duration::from_secs(60));
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

/// 6 -> 5 -> 3: 53 parameter elements, so shares of 2 and 3 ranks cut through the weights.
fn mlp(seed: u64) -> Result<Sequential> {
    Ok(Sequential::new()
        .with(Linear::new(6, 5, true, &CPU, seed)?)
        .with(ReLU::new())
        .with(Linear::new(5, 3, true, &CPU, seed + 1)?))
}

/// Rank `rank`'s batch of step `step` (`same`: one batch for every rank).
fn batch(rank: usize, step: usize, same: bool) -> Result<(Tensor, Tensor)> {
    let r = if same { 0 } else { rank };
    let seed = 500 + 17 * r as u64 + step as u64;
    let x = Tensor::randn([4, 6], 0.0, 1.0, seed, DType::F32, CPU)?;
    let y: Vec<i64> = (0..4).map(|i| ((i + r + step) % 3) as i64).collect();
    Ok((x, Tensor::from_vec(y, [4], CPU)?))
}

fn values(m: &dyn Module) -> Result<Vec<Vec<f64>>> {
    m.parameters().iter().map(|p| p.to_vec_f64()).collect()
}

fn bits(v: &[Vec<f64>]) -> Vec<Vec<u64>> {
    v.iter()
        .map(|t| t.iter().map(|x| x.to_bits()).collect())
        .collect()
}

fn max_rel(a: &[Vec<f64>], b: &[Vec<f64>]) -> f64 {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs() / y.abs().max(1e-3))
        .fold(0.0, f64::max)
}

/// DDP's gradients: every parameter's gradient averaged over the ranks in place.
fn all_reduce_grads(g: &ProcessGroup, m: &dyn Module) -> Result<()> {
    for p in m.parameters() {
        g.all_reduce(&p.grad().expect("a gradient"), ReduceOp::Avg)?;
    }
    Ok(())
}

fn adam() -> AdamConfig {
    AdamConfig {
        lr: 1e-2,
        weight_decay: 0.05,
        ..Default::default()
    }
}

fn sgd() -> SgdConfig {
    SgdConfig {
        lr: 0.1,
        momentum: 0.9,
        weight_decay: 1e-3,
        ..Default::default()
    }
}

#[test]
fn reduce_scatter_and_all_gather_into_on_two_and_three_ranks() {
    for world in [2, 3] {
        on_ranks(world, move |rank, g| {
            let n = 4 * world;
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
                let v: Vec<f32> = (0..n).map(|i| (i * (rank + 1)) as f32 - 3.0).collect();
                let input = Tensor::from_vec(v, [n], CPU)?;
                let out = Tensor::zeros([4], DType::F32, CPU)?;
                g.reduce_scatter(&input, &out, op)?;
                let got = out.to_vec_f32()?;
                for (k, &x) in got.iter().enumerate() {
                    let i = rank * 4 + k;
                    let each: Vec<f32> = (0..world).map(|r| (i * (r + 1)) as f32 - 3.0).collect();
                    let want = match op {
                        ReduceOp::Sum => each.iter().sum::<f32>(),
                        ReduceOp::Avg => each.iter().sum::<f32>() / world as f32,
                        ReduceOp::Max => each.iter().cloned().fold(f32::MIN, f32::max),
                        ReduceOp::Min => each.iter().cloned().fold(f32::MAX, f32::min),
                    };
                    assert_eq!(x, want, "{op:?} element {i} on rank {rank} of {world}");
                }
            }
            // All-gather into a buffer kept across calls (its address never changes).
            let mine = Tensor::from_vec(vec![rank as f32; 3], [3], CPU)?;
            let out = Tensor::zeros([3 * world], DType::F32, CPU)?;
            for _ in 0..2 {
                g.all_gather_into(&mine, &out)?;
            }
            let want: Vec<f32> = (0..world).flat_map(|r| vec![r as f32; 3]).collect();
            assert_eq!(out.to_vec_f32()?, want);
            // Refusals: sizes that do not divide, dtypes that differ.
            let e = g
                .reduce_scatter(&Tensor::zeros([5], DType::F32, CPU)?, &mine, ReduceOp::Sum)
                .unwrap_err();
            assert!(e.to_string().contains("reduce_scatter"), "{e}");
            let e = g
                .all_gather_into(&Tensor::zeros([3], DType::F16, CPU)?, &out)
                .unwrap_err();
            assert!(e.to_string().contains("all_gather_into"), "{e}");
            Ok(())
        });
    }
}

/// `steps` steps of the sharded optimizer and of the unsharded one on DDP's gradients, on every
/// rank: (sharded parameters, unsharded parameters, sharded state bytes) per rank.
fn sharded_vs_unsharded(world: usize, use_adam: bool, steps: usize) -> Vec<[Vec<Vec<f64>>; 2]> {
    on_ranks(world, move |rank, g| {
        let (a, b) = (mlp(7)?, mlp(7)?);
        let (mut za, mut zs, mut ra, mut rs) = (None, None, None, None);
        if use_adam {
            za = Some(ZeroAdam::single(&g, a.parameters(), adam())?);
            ra = Some(FusedAdam::new(b.parameters(), adam())?);
        } else {
            zs = Some(ZeroSgd::single(&g, a.parameters(), sgd())?);
            rs = Some(FusedSgd::new(b.parameters(), sgd())?);
        }
        for step in 0..steps {
            let (x, y) = batch(rank, step, false)?;
            cross_entropy(&a.forward(&x)?, &y)?.backward()?;
            cross_entropy(&b.forward(&x)?, &y)?.backward()?;
            all_reduce_grads(&g, &b)?;
            if let (Some(z), Some(r)) = (za.as_mut(), ra.as_mut()) {
                z.step()?;
                r.step()?;
                z.zero_grad();
                r.zero_grad();
            }
            if let (Some(z), Some(r)) = (zs.as_mut(), rs.as_mut()) {
                z.step()?;
                r.step()?;
                z.zero_grad();
                r.zero_grad();
            }
        }
        if let Some(z) = &za {
            // Two FP32 moments for this rank's share only (53 elements padded to a multiple
            // of the world size).
            let share = 53usize.div_ceil(world);
            assert_eq!(z.state_bytes()?, 2 * 4 * share, "rank {rank} of {world}");
        }
        Ok([values(&a)?, values(&b)?])
    })
}

#[test]
fn sharded_adamw_and_sgd_match_the_unsharded_fused_optimizers_bitwise() {
    for world in [1, 2, 3] {
        for use_adam in [true, false] {
            let ranks = sharded_vs_unsharded(world, use_adam, 4);
            for (r, [sharded, plain]) in ranks.iter().enumerate() {
                assert_eq!(
                    bits(sharded),
                    bits(plain),
                    "world {world}, adam {use_adam}, rank {r}: sharded vs unsharded"
                );
                assert_eq!(bits(sharded), bits(&ranks[0][0]), "rank {r} vs rank 0");
            }
        }
    }
}

/// Buckets launched from the gradient hooks during backward: one bucket per parameter, at world
/// sizes 1, 2, 3, with one backward per step (every bucket leaves during backward) and with two:
/// told (`set_micro_batches(2)`: the buckets leave during the second) or not (the buckets
/// launched in the first backward are stale, and the step reduces every bucket again); the
/// parameters bitwise those of the unsharded optimizer.
#[test]
fn buckets_reduce_scattered_during_backward_match_the_unsharded_optimizer_bitwise() {
    for world in [1, 2, 3] {
        for (accum, told) in [(1, true), (2, true), (2, false)] {
            let ranks = on_ranks(world, move |rank, g| {
                let (a, b) = (mlp(7)?, mlp(7)?);
                let mut z = ZeroAdam::single(&g, a.parameters(), adam())?;
                z.set_bucket_cap_mb(TINY_BUCKET_MB, TINY_BUCKET_MB)?;
                if told {
                    z.set_micro_batches(accum)?;
                }
                let mut r = FusedAdam::new(b.parameters(), adam())?;
                let mut stats = Vec::new();
                for step in 0..3 {
                    for micro in 0..accum {
                        let (x, y) = batch(rank, 10 * step + micro, false)?;
                        cross_entropy(&a.forward(&x)?, &y)?.backward()?;
                        cross_entropy(&b.forward(&x)?, &y)?.backward()?;
                    }
                    all_reduce_grads(&g, &b)?;
                    z.step()?;
                    r.step()?;
                    z.zero_grad();
                    r.zero_grad();
                    stats.push(z.last_reduction());
                }
                Ok(([values(&a)?, values(&b)?], stats))
            });
            for (r, ([sharded, plain], stats)) in ranks.iter().enumerate() {
                let what =
                    format!("world {world}, {accum} backward(s) a step (told {told}), rank {r}");
                // The first step fixes the layout: its backward had no buckets yet.
                for (i, s) in stats.iter().enumerate() {
                    assert_eq!(s.buckets, 4, "{what}");
                    let want = if told && i > 0 { 4 } else { 0 };
                    assert_eq!(s.launched_during_backward, want, "{what}");
                }
                assert_eq!(bits(sharded), bits(plain), "{what}: sharded vs unsharded");
                assert_eq!(bits(sharded), bits(&ranks[0].0[0]), "{what} vs rank 0");
            }
        }
    }
}

#[test]
fn bucket_sizes_are_checked_and_fixed_by_the_first_step() {
    on_ranks(1, |rank, g| {
        let a = mlp(5)?;
        let mut z = ZeroAdam::single(&g, a.parameters(), adam())?;
        let e = z.set_bucket_cap_mb(0.0, 25.0).unwrap_err();
        assert!(e.to_string().contains("first_mb"), "{e}");
        let e = z.set_bucket_cap_mb(1.0, f64::NAN).unwrap_err();
        assert!(e.to_string().contains("cap_mb"), "{e}");
        let e = z.set_micro_batches(0).unwrap_err();
        assert!(e.to_string().contains("at least 1"), "{e}");
        let (x, y) = batch(rank, 0, false)?;
        cross_entropy(&a.forward(&x)?, &y)?.backward()?;
        z.step()?;
        // The first step has no layout while backward runs: it reduces every bucket itself.
        assert_eq!(z.last_reduction().launched_during_backward, 0);
        z.zero_grad();
        cross_entropy(&a.forward(&x)?, &y)?.backward()?;
        z.step()?;
        assert_eq!(z.last_reduction().launched_during_backward, 1);
        let e = z.set_bucket_cap_mb(1.0, 25.0).unwrap_err();
        assert!(e.to_string().contains("after the first step"), "{e}");
        let e = z.set_micro_batches(2).unwrap_err();
        assert!(e.to_string().contains("after the first step"), "{e}");
        Ok(())
    });
}

fn o2() -> Policy {
    Policy::opt_level(OptLevel::O2).with_report_interval(0)
}

#[test]
fn sharded_adam_under_amp_o2_matches_the_unsharded_one_bitwise() {
    let world = 2;
    let ranks = on_ranks(world, move |rank, g| {
        let a = mlp(3)?;
        let z = ZeroAdam::single(&g, a.parameters(), adam())?;
        let (a, mut z) = amp::initialize(a, z, o2())?;
        let b = mlp(3)?;
        let r = FusedAdam::new(b.parameters(), adam())?;
        let (b, mut r) = amp::initialize(b, r, o2())?;
        for step in 0..4 {
            let (x, y) = batch(rank, step, false)?;
            z.zero_grad()?;
            z.backward(&cross_entropy(&a.forward(&x)?, &y)?)?;
            z.step()?;
            r.zero_grad()?;
            r.backward(&cross_entropy(&b.forward(&x)?, &y)?)?;
            all_reduce_grads(&g, &b)?;
            r.step()?;
        }
        assert_eq!(a.parameters()[0].dtype(), DType::F16);
        // The hooks outlived the cast: the last step's bucket left during backward.
        assert_eq!(z.inner().last_reduction().launched_during_backward, 1);
        // The consolidated FP32 masters equal the unsharded optimizer's.
        let zs = z.inner().state_dict()?;
        let rs = r.inner().state_dict()?;
        for (pos, m) in &rs.state {
            for (name, t) in m {
                let got = zs.state[pos][name].to_vec_f64()?;
                assert_eq!(got, t.to_vec_f64()?, "state {pos}.{name} on rank {rank}");
            }
        }
        Ok([values(&a)?, values(&b)?])
    });
    for (r, [sharded, plain]) in ranks.iter().enumerate() {
        assert_eq!(
            bits(sharded),
            bits(plain),
            "rank {r}: O2 sharded vs unsharded"
        );
    }
}

#[test]
fn an_inf_on_one_rank_skips_the_step_on_every_rank() {
    let ranks = on_ranks(2, move |rank, g| {
        let a = mlp(4)?;
        let z = ZeroAdam::single(&g, a.parameters(), adam())?;
        let (a, mut z) = amp::initialize(a, z, o2())?;
        let mut seen = Vec::new();
        for step in 0..3 {
            let (mut x, y) = batch(rank, step, false)?;
            if step == 1 && rank == 1 {
                let mut v = x.to_vec::<f32>()?;
                v[5] = f32::INFINITY;
                x = Tensor::from_vec(v, [4, 6], CPU)?;
            }
            z.zero_grad()?;
            z.backward(&cross_entropy(&a.forward(&x)?, &y)?)?;
            z.step()?;
            let st = z.stats()?[0];
            seen.push((values(&a)?, st.scale, st.skipped_total));
        }
        Ok(seen)
    });
    for (r, seen) in ranks.iter().enumerate() {
        assert_eq!(seen[1].2, 1, "rank {r} skipped step 1");
        assert_eq!(seen[2].2, 1, "rank {r}: one skip in all");
        assert_eq!(seen[1].1, seen[0].1 / 2.0, "rank {r}'s scale backed off");
        assert_eq!(
            bits(&seen[1].0),
            bits(&seen[0].0),
            "rank {r}: the skipped step changed nothing"
        );
        assert_ne!(bits(&seen[2].0), bits(&seen[1].0), "rank {r} stepped after");
        assert_eq!(bits(&seen[2].0), bits(&ranks[0][2].0), "rank {r} vs rank 0");
    }
}

#[test]
fn clipping_by_the_global_norm_matches_the_unsharded_clip() {
    // One bucket, and a bucket per parameter (the padding of every chunk in the norm).
    for (world, per_param) in [(2, false), (3, false), (3, true)] {
        let ranks = on_ranks(world, move |rank, g| {
            let (a, b) = (mlp(9)?, mlp(9)?);
            let mut z = ZeroAdam::single(&g, a.parameters(), adam())?;
            z.clip_grad_norm(Some(0.05))?;
            if per_param {
                z.set_bucket_cap_mb(TINY_BUCKET_MB, TINY_BUCKET_MB)?;
            }
            let mut r = FusedAdam::new(b.parameters(), adam())?;
            for step in 0..3 {
                let (x, y) = batch(rank, step, false)?;
                cross_entropy(&a.forward(&x)?, &y)?.backward()?;
                cross_entropy(&b.forward(&x)?, &y)?.backward()?;
                all_reduce_grads(&g, &b)?;
                let norm = mixprec::optim::clip_grad_norm(&b.parameters(), 0.05)?;
                assert!(norm.to_vec_f64()?[0] > 0.05, "the clip is active");
                z.step()?;
                r.step()?;
                z.zero_grad();
                r.zero_grad();
            }
            Ok([values(&a)?, values(&b)?])
        });
        for (r, [sharded, plain]) in ranks.iter().enumerate() {
            // The norms differ only in summation order (f32): a relative 1e-5 covers it
            // (Adam's normalised update amplifies a relative change of the gradient little).
            let e = max_rel(sharded, plain);
            assert!(
                e < 1e-5,
                "world {world} rank {r}: clipped sharded vs unsharded off by {e:e}"
            );
        }
    }
}

fn scratch(name: &str) -> PathBuf {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let d = std::env::temp_dir().join(format!(
        "mixprec-zero-{}-{name}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Trains at `world` ranks (every rank the same batch, so the average is the same at any world
/// size) from `start` parameters (None: the seed's), steps `from..to`; with `resume`, loads the
/// sharded state from it first; with `save`, saves the shards into it after. Rank 0's
/// parameters afterwards.
fn train(
    world: usize,
    start: Option<Vec<Vec<f64>>>,
    steps: (usize, usize),
    resume: Option<PathBuf>,
    save: Option<PathBuf>,
) -> Vec<Vec<f64>> {
    train_in_buckets(false, world, start, steps, resume, save)
}

/// A bucket per parameter (the MLP's smallest is 12 bytes).
const TINY_BUCKET_MB: f64 = 10.0 / 1048576.0;

/// [`train`], with a bucket per parameter when `per_param`.
fn train_in_buckets(
    per_param: bool,
    world: usize,
    start: Option<Vec<Vec<f64>>>,
    steps: (usize, usize),
    resume: Option<PathBuf>,
    save: Option<PathBuf>,
) -> Vec<Vec<f64>> {
    let ranks = on_ranks(world, move |rank, g| {
        let a = mlp(11)?;
        if let Some(v) = &start {
            for (p, v) in a.parameters().iter().zip(v) {
                let t = Tensor::from_vec(
                    v.iter().map(|&x| x as f32).collect(),
                    p.shape().clone(),
                    CPU,
                )?;
                let _ng = mixprec::no_grad();
                p.copy_in_place(&t)?;
            }
        }
        let mut z = ZeroAdam::single(&g, a.parameters(), adam())?;
        if per_param {
            z.set_bucket_cap_mb(TINY_BUCKET_MB, TINY_BUCKET_MB)?;
        }
        if let Some(d) = &resume {
            zero_checkpoint::load_sharded(d, &mut z)?;
        }
        for step in steps.0..steps.1 {
            let (x, y) = batch(rank, step, true)?;
            cross_entropy(&a.forward(&x)?, &y)?.backward()?;
            z.step()?;
            z.zero_grad();
        }
        if let Some(d) = &save {
            zero_checkpoint::save_sharded(d, &mut z)?;
        }
        values(&a)
    });
    ranks.into_iter().next().unwrap()
}

#[test]
fn a_sharded_checkpoint_resumes_at_another_world_size_as_an_uninterrupted_run() {
    let straight = train(1, None, (0, 6), None, None);
    assert_eq!(bits(&train(2, None, (0, 6), None, None)), bits(&straight));
    for (from, to) in [(2, 1), (1, 2)] {
        let dir = scratch(&format!("{from}to{to}"));
        let mid = train(from, None, (0, 3), None, Some(dir.clone()));
        let m = zero_checkpoint::read_manifest(&dir).unwrap();
        assert_eq!(m.world_size, from);
        let end = train(to, Some(mid), (3, 6), Some(dir.clone()), None);
        assert_eq!(bits(&end), bits(&straight), "resumed {from} -> {to}");
        let _ = std::fs::remove_dir_all(&dir);
    }
    // 3 ranks average three equal gradients: (g+g+g)/3 may round, so within f32 rounding.
    let dir = scratch("3to2");
    let mid = train(3, None, (0, 3), None, Some(dir.clone()));
    let end = train(2, Some(mid), (3, 6), Some(dir.clone()), None);
    let e = max_rel(&end, &straight);
    assert!(e < 1e-5, "resumed 3 -> 2 off by {e:e}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_checkpoint_in_buckets_resumes_at_another_world_size_and_bucket_size() {
    let straight = train(1, None, (0, 6), None, None);
    // Saved in a bucket per parameter at 2 ranks, resumed in one bucket at 1: bitwise.
    let dir = scratch("buckets2to1");
    let mid = train_in_buckets(true, 2, None, (0, 3), None, Some(dir.clone()));
    let m = zero_checkpoint::read_manifest(&dir).unwrap();
    assert_eq!(m.layout.flats[0].buckets.len(), 4, "{m:?}");
    let end = train(1, Some(mid), (3, 6), Some(dir.clone()), None);
    assert_eq!(bits(&end), bits(&straight), "resumed 2 (buckets) -> 1");
    let _ = std::fs::remove_dir_all(&dir);
    // One bucket at 1 rank, resumed in a bucket per parameter at 3: f32 rounding of (3g)/3.
    let dir = scratch("1to3buckets");
    let mid = train(1, None, (0, 3), None, Some(dir.clone()));
    let end = train_in_buckets(true, 3, Some(mid), (3, 6), Some(dir.clone()), None);
    let e = max_rel(&end, &straight);
    assert!(e < 1e-5, "resumed 1 -> 3 (buckets) off by {e:e}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_consolidated_state_loads_into_the_plain_optimizer() {
    let straight = train(1, None, (0, 6), None, None);
    let dir = scratch("consolidated");
    let mid = train(2, None, (0, 3), None, Some(dir.clone()));
    let state = zero_checkpoint::consolidated_state(&dir).unwrap();
    // Through the single-file export and back.
    let file = dir.join("optimizer.safetensors");
    zero_checkpoint::export_consolidated(&state, &file).unwrap();
    let state = zero_checkpoint::read_consolidated(&file).unwrap();
    let a = mlp(11).unwrap();
    for (p, v) in a.parameters().iter().zip(&mid) {
        let t = Tensor::from_vec(
            v.iter().map(|&x| x as f32).collect(),
            p.shape().clone(),
            CPU,
        )
        .unwrap();
        let _ng = mixprec::no_grad();
        p.copy_in_place(&t).unwrap();
    }
    let mut r = FusedAdam::new(a.parameters(), adam()).unwrap();
    r.load_state_dict(&state).unwrap();
    for step in 3..6 {
        let (x, y) = batch(0, step, true).unwrap();
        cross_entropy(&a.forward(&x).unwrap(), &y)
            .unwrap()
            .backward()
            .unwrap();
        r.step().unwrap();
        r.zero_grad();
    }
    assert_eq!(bits(&values(&a).unwrap()), bits(&straight));
    // A flipped byte in a shard is named at load.
    let shard = dir.join("zero-shard-1-of-2.safetensors");
    let mut bytes = std::fs::read(&shard).unwrap();
    let n = bytes.len();
    bytes[n - 3] ^= 0x40;
    std::fs::write(&shard, bytes).unwrap();
    let e = zero_checkpoint::consolidated_state(&dir).unwrap_err();
    assert!(e.to_string().contains("checksum"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn sharded_lamb_takes_its_trust_ratios_over_whole_tensors_across_share_boundaries() {
    let lamb = LambConfig {
        lr: 0.02,
        weight_decay: 0.01,
        max_grad_norm: 0.5,
        ..Default::default()
    };
    // One bucket, and a bucket per parameter (tensors cut into the chunks of their bucket).
    for (world, per_param) in [(1, false), (2, false), (3, false), (2, true), (3, true)] {
        let ranks = on_ranks(world, move |rank, g| {
            let (a, b) = (mlp(13)?, mlp(13)?);
            let start = values(&a)?;
            let mut z = ZeroLamb::single(&g, a.parameters(), lamb)?;
            if per_param {
                z.set_bucket_cap_mb(TINY_BUCKET_MB, TINY_BUCKET_MB)?;
            }
            let mut r = FusedLamb::new(b.parameters(), lamb)?;
            for step in 0..4 {
                let (x, y) = batch(rank, step, false)?;
                cross_entropy(&a.forward(&x)?, &y)?.backward()?;
                cross_entropy(&b.forward(&x)?, &y)?.backward()?;
                all_reduce_grads(&g, &b)?;
                z.step()?;
                r.step()?;
                z.zero_grad();
                r.zero_grad();
            }
            Ok([values(&a)?, values(&b)?, start])
        });
        for (r, [sharded, plain, start]) in ranks.iter().enumerate() {
            // The norms sum the pieces' squares in another order than the whole tensor's: a
            // relative 1e-5 covers it; a trust ratio taken per piece instead misses by far more.
            let e = max_rel(sharded, plain);
            assert!(
                e < 1e-5,
                "world {world} rank {r}: ZeroLamb vs FusedLamb off by {e:e}"
            );
            assert!(max_rel(plain, start) > 1e-3, "the steps moved the weights");
            assert_eq!(bits(sharded), bits(&ranks[0][0]), "rank {r} vs rank 0");
        }
    }
}
