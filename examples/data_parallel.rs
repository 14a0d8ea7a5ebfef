//! The README's data-parallel loop as a program: DDP over every process a launcher started (or
//! rank 0 of 1 without one), AMP O2, a CIFAR-style ResNet-18 on each rank's shard of
//! Fashion-MNIST, 20 steps; then rank 0 saves a checkpoint and the weights under
//! `runs/ddp/` and loads the checkpoint back.
//!
//! `cargo run --release --example data_parallel` (one process), or under a launcher:
//! `torchrun --standalone --nproc-per-node 2 --no-python target/release/examples/data_parallel`.
//! The main job does the same with `train_resnet --nproc-per-node N`.

use mixprec::amp;
use mixprec::data::{DataLoader, DistributedSampler, FashionMnist, Split};
use mixprec::distributed::{Backend, DdpConfig, DistributedDataParallel, LaunchEnv, ProcessGroup};
use mixprec::io::{save_weights, serde_json::json, Checkpoint, TrainProgress};
use mixprec::nn::{self, Module, ResNet};
use mixprec::optim::{FusedSgd, SgdConfig};
use mixprec::Device;

fn main() -> mixprec::Result<()> {
    let (seed, epochs, steps) = (0, 1, 20);
    let (train, _) = FashionMnist::load(Split::Train)?;
    let sgd = SgdConfig {
        lr: 0.05,
        momentum: 0.9,
        ..Default::default()
    };

    let env = LaunchEnv::from_env()?; // rank 0 of 1 without a launcher
    let dev = Device::cuda_if_available(env.cuda_ordinal());
    let group = ProcessGroup::from_env(Backend::for_device(dev))?; // NCCL on a GPU, else CPU/TCP
    let model = ResNet::cifar_style(&[2, 2, 2, 2], 1, 10, &dev)?;
    let opt = FusedSgd::new(model.parameters(), sgd)?;
    let (model, mut opt) = amp::initialize(model, opt, amp::Policy::builtin("O2")?)?;
    let model = DistributedDataParallel::new(model, &group, DdpConfig::default())?;
    let shard = DistributedSampler::new(env.rank, env.world_size)?;
    let loader = DataLoader::new(train, 64)?.shuffle(seed).sampler(shard);
    for epoch in 0..epochs {
        for batch in loader.epoch(epoch).take(steps) {
            let (x, y) = batch?;
            let (x, y) = (x.to_device(dev)?, y.to_device(dev)?);
            let loss = nn::loss::cross_entropy(&model.forward(&x)?, &y)?;
            opt.zero_grad()?;
            opt.backward(&loss)?; // gradients averaged over the ranks before the overflow check
            opt.step()?; // every rank skips the same steps
        }
    }

    if env.rank == 0 {
        let dir = "runs/ddp";
        std::fs::create_dir_all(dir)
            .map_err(|e| mixprec::Error::io(format!("creating {dir}"), e))?;
        let progress = TrainProgress {
            epoch: epochs,
            step: (epochs * steps) as u64,
            seed,
        };
        let ck = Checkpoint::capture(model.module(), &opt, progress, json!({ "lr": 0.05 }))?;
        ck.save("runs/ddp/last.safetensors".as_ref())?;
        save_weights(model.module(), "runs/ddp/model.safetensors".as_ref())?;
        // later, with a model and optimizer wrapped at the same AMP level:
        let ck = Checkpoint::load("runs/ddp/last.safetensors".as_ref())?;
        ck.restore(model.module(), &mut opt)?; // training continues bit for bit (O0–O3)
        println!(
            "rank 0 of {}: saved and restored runs/ddp/last.safetensors",
            env.world_size
        );
    }
    Ok(())
}
