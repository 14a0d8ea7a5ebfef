//! GPU benchmark (exits quietly without a GPU): issue 47's speed check. The ResNet-50 O2
//! training step (channels_last, batch 256 per GPU by default, synthetic 224x224 images, fused
//! SGD with momentum, dynamic loss scaling) on one GPU, and in `DataParallel` over every
//! visible GPU (or `GPUS`) at `GPUS x BATCH` images per step, from one process. Each
//! replica's chunk is made on its own GPU (what a loader placing each part where it is used
//! gives; `forward_chunks`); `SCATTER=1` adds the plain `forward` of one batch on cuda:0,
//! which scatters it through the host.
//!
//! Timed in rotating rounds, one synchronisation per round, medians compared: one JSON line
//! with images/s and the speed-up over one GPU (the bound: >= 1.9x on 2 GPUs), then a
//! PASS/FAIL line. Our DDP on the same GPUs is benches/ddp_resnet50.rs under a launcher
//! (benches/gpu_data_parallel.sh runs it too: the bound is >= 0.95x of its images/s), and
//! PyTorch's `nn.DataParallel` is benches/torch_data_parallel_resnet50.py.
//!
//! Environment: GPUS (all visible), BATCH per GPU (256), ROUNDS (5), STEPS per round (5),
//! WARMUP steps (4), SCATTER (0), STEP0_BROADCAST (0: 1 also times replica 0 stepping alone and
//! its weights then copied to the others, the other way to keep the replicas equal).

mod common;

use std::time::Instant;

use mixprec::amp::{self, OptLevel, Policy};
use mixprec::backend::cuda::{device, device_count};
use mixprec::distributed::{DataParallel, DataParallelConfig};
use mixprec::nn::{cross_entropy, Module, ResNet};
use mixprec::optim::{FusedSgd, SgdConfig};
use mixprec::{DType, Device, MemoryFormat, Tensor};

fn main() {
    common::main_with(run)
}

fn env_usize(key: &str, default: usize) -> usize {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn policy() -> Policy {
    Policy::opt_level(OptLevel::O2).with_report_interval(0)
}

/// ResNet-50 in channels_last with its fused SGD (before AMP).
fn build(dev: Device) -> mixprec::Result<(ResNet, FusedSgd)> {
    let model = ResNet::resnet50(1000, &dev, 0)?;
    model.to_memory_format(MemoryFormat::ChannelsLast)?;
    let opt = FusedSgd::new(
        model.parameters(),
        SgdConfig {
            lr: 0.01,
            momentum: 0.9,
            ..Default::default()
        },
    )?;
    Ok((model, opt))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn images(batch: usize, dev: Device, seed: u64) -> mixprec::Result<(Tensor, Tensor)> {
    let x = Tensor::randn([batch, 3, 224, 224], 0.0, 1.0, seed, DType::F32, dev)?
        .to_memory_format(MemoryFormat::ChannelsLast)?;
    let labels: Vec<i64> = (0..batch).map(|i| (i * 37 % 1000) as i64).collect();
    Ok((x, Tensor::from_vec(labels, [batch], dev)?))
}

fn run() -> mixprec::Result<()> {
    let gpus = env_usize("GPUS", device_count()?).max(1);
    let batch = env_usize("BATCH", 256);
    let rounds = env_usize("ROUNDS", 5);
    let steps = env_usize("STEPS", 5);
    let warmup = env_usize("WARMUP", 4);
    let scatter = std::env::var("SCATTER").is_ok_and(|v| v == "1");
    let step0 = std::env::var("STEP0_BROADCAST").is_ok_and(|v| v == "1");
    let devices: Vec<Device> = (0..gpus).map(Device::Cuda).collect();
    println!(
        "ResNet-50 O2 channels_last, batch {batch} per GPU; one GPU vs DataParallel over {gpus} \
         GPU(s); {rounds} rounds of {steps} steps"
    );

    // One GPU.
    let (m, o) = build(Device::Cuda(0))?;
    let (single, mut single_opt) = amp::initialize(m, o, policy())?;
    let (x0, y0) = images(batch, Device::Cuda(0), 1)?;
    let mut single_step = || -> mixprec::Result<()> {
        let loss = cross_entropy(&single.forward(&x0)?, &y0)?;
        single_opt.zero_grad()?;
        single_opt.backward(&loss)?;
        single_opt.step()
    };

    // DataParallel: chunk i made on GPU i, the labels of the whole batch on the output device.
    let dp = DataParallel::new(
        build,
        &devices,
        Device::Cuda(0),
        DataParallelConfig::new(policy()),
    )?;
    let chunks: Vec<Tensor> = devices
        .iter()
        .enumerate()
        .map(|(i, &d)| images(batch, d, 10 + i as u64).map(|c| c.0))
        .collect::<mixprec::Result<_>>()?;
    let (_, y_all) = images(batch * gpus, Device::Cuda(0), 3)?;
    let dp_step = |whole: Option<&Tensor>| -> mixprec::Result<()> {
        let out = match whole {
            Some(x) => dp.forward(x)?,
            None => dp.forward_chunks(chunks.clone())?,
        };
        let loss = cross_entropy(&out, &y_all)?;
        dp.zero_grad()?;
        loss.backward()?;
        dp.step()
    };
    // The alternative PyTorch's DataParallel implies: replica 0 alone steps, then its weights
    // go to the others (timed only: the other replicas' optimizer states are left behind).
    let dp_step0_broadcast = || -> mixprec::Result<()> {
        let loss = cross_entropy(&dp.forward_chunks(chunks.clone())?, &y_all)?;
        dp.zero_grad()?;
        loss.backward()?;
        dp.with_replica(0, |r| r.optimizer_mut().step())?;
        dp.broadcast_from_replica0()
    };
    let whole = if scatter {
        Some(images(batch * gpus, Device::Cuda(0), 4)?.0)
    } else {
        None
    };

    let sync_all = || -> mixprec::Result<()> {
        for i in 0..gpus {
            device(i)?.synchronize()?;
        }
        Ok(())
    };
    let mut names = vec!["one_gpu", "data_parallel"];
    if scatter {
        names.push("scatter");
    }
    if step0 && gpus >= 2 {
        names.push("step0_broadcast");
    }
    let mut run = |name: &str| -> mixprec::Result<()> {
        match name {
            "one_gpu" => single_step(),
            "data_parallel" => dp_step(None),
            "scatter" => dp_step(whole.as_ref()),
            _ => dp_step0_broadcast(),
        }
    };
    for _ in 0..warmup {
        for name in &names {
            run(name)?;
        }
    }
    sync_all()?;
    let contenders = names.len();
    let mut t: Vec<Vec<f64>> = vec![Vec::new(); contenders];
    for round in 0..rounds {
        for k in (0..contenders).map(|i| (i + round) % contenders) {
            let t0 = Instant::now();
            for _ in 0..steps {
                run(names[k])?;
            }
            sync_all()?;
            t[k].push(t0.elapsed().as_secs_f64() / steps as f64);
        }
    }
    let ips_of = |name: &str| -> Option<f64> {
        let k = names.iter().position(|n| *n == name)?;
        Some(if k == 0 { batch } else { batch * gpus } as f64 / median(t[k].clone()))
    };
    let single_ips = batch as f64 / median(t[0].clone());
    let dp_ips = (batch * gpus) as f64 / median(t[1].clone());
    let speedup = dp_ips / single_ips;
    let scatter_ips = ips_of("scatter");
    let step0_ips = ips_of("step0_broadcast");
    let ms = |v: &[f64]| -> Vec<f64> { v.iter().map(|s| (s * 1e5).round() / 100.0).collect() };
    println!(
        "{{\"check\":\"data-parallel\",\"gpus\":{gpus},\"batch_per_gpu\":{batch},\
         \"one_gpu_img_per_s\":{single_ips:.1},\"data_parallel_img_per_s\":{dp_ips:.1},\
         \"speedup\":{speedup:.3},\"scatter_img_per_s\":{},\"step0_broadcast_img_per_s\":{},\
         \"rounds_ms\":{{\"one_gpu\":{:?},\"data_parallel\":{:?}}}}}",
        scatter_ips.map_or("null".into(), |v| format!("{v:.1}")),
        step0_ips.map_or("null".into(), |v| format!("{v:.1}")),
        ms(&t[0]),
        ms(&t[1]),
    );
    if gpus >= 2 {
        let bound = 0.95 * gpus as f64;
        println!(
            "{}: DataParallel over {gpus} GPUs at {speedup:.2}x one GPU (bound {bound:.2}x)",
            if speedup >= bound { "PASS" } else { "FAIL" }
        );
    } else {
        println!("INFO: one GPU visible: DataParallel over one replica at {speedup:.2}x");
    }
    Ok(())
}
