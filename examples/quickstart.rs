//! The shortest complete AMP training loop (the README's): a CIFAR-style ResNet-18 on
//! Fashion-MNIST under policy O2, 30 steps, then 30 more with the step captured into a CUDA graph
//! (`amp::CapturedStep`; run eagerly on the CPU) under a one-cycle learning-rate schedule. About
//! two minutes of CPU time (measured at 3 minutes of wall time on a 2-core machine shared with
//! other builds); a second on a GPU. It prints the device and the data it uses.
//! `cargo run --release --example quickstart`

use mixprec::data::{DataLoader, FashionMnist, Split};
use mixprec::nn::{self, Module};
use mixprec::optim::{FusedSgd, LrSchedule, SgdConfig};
use mixprec::{amp, Device, Tensor};

fn main() -> mixprec::Result<()> {
    let dev = Device::cuda_if_available(0); // the CPU when there is no GPU or driver (logged)
    let (train, source) = FashionMnist::load(Split::Train)?;
    println!("device: {dev}; data: {source}");
    let loader = DataLoader::new(train, 64)?.shuffle(0).drop_last(true);

    let model = nn::resnet::ResNet::cifar_style(&[2, 2, 2, 2], 1, 10, &dev)?;
    let opt = FusedSgd::new(
        model.parameters(),
        SgdConfig {
            lr: 0.05,
            momentum: 0.9,
            ..Default::default()
        },
    )?;
    let policy = amp::Policy::builtin("O2")?; // configs/O2.toml, compiled in; or Policy::opt_level(OptLevel::O2)
    let (model, mut opt) = amp::initialize(model, opt, policy)?;

    for (step, batch) in loader.epoch(0).take(30).enumerate() {
        let (x, y) = batch?;
        let (x, y) = (x.to_device(dev)?, y.to_device(dev)?);
        let loss = nn::loss::cross_entropy(&model.forward(&x)?, &y)?;
        opt.zero_grad()?;
        opt.backward(&loss)?; // loss × scale, backward, overflow check (on the device)
        opt.step()?; // unscale inside the fused update; skipped on overflow; scale update
        if step % 10 == 0 {
            println!("step {step}: loss {:.4}", loss.item()?); // a host read: only now and then
        }
    }

    // The same step captured into a CUDA graph and replayed: one launch per step on a GPU
    // (after two eager warm-up steps); the same object runs eagerly on the CPU.
    let body = |x: &Tensor, y: &Tensor| nn::loss::cross_entropy(&model.forward(x)?, y);
    let mut step = if dev.is_cuda() {
        amp::CapturedStep::new(&model, &mut opt, body)?
    } else {
        amp::CapturedStep::eager(&model, &mut opt, body)?
    };
    let schedule = LrSchedule::one_cycle(0.05, 30);
    for (i, batch) in loader.epoch(1).take(30).enumerate() {
        let (x, y) = batch?;
        schedule.apply(step.optimizer().inner_mut(), i as u64)?; // lr lives on the device
        let loss = step.run(&x, &y)?; // copies the batch in, replays; no host synchronisation
        if i % 10 == 0 {
            println!("captured step {i}: loss {:.4}", loss.item()?);
        }
    }
    println!("{:?}", step.stats()); // eager warm-up steps, captures, replays
    println!("loss scale: {}", step.optimizer().stats()?[0].scale);
    Ok(())
}
