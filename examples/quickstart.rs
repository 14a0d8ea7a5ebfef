//! The training loop of the README, compiled and runnable:
//! `cargo run --release --example quickstart` (ten steps of a CIFAR-style ResNet-18
//! on Fashion-MNIST).

use mixprec::data::{Augment, DataLoader, FashionMnist, Split};
use mixprec::nn::{self, Module};
use mixprec::optim::{Optimizer, Sgd, SgdConfig};
use mixprec::Device;

fn main() -> mixprec::Result<()> {
    let dev = Device::cuda_if_available(0); // Cpu when there is no GPU or driver (logged)
    let (train, source) = FashionMnist::load(Split::Train)?;
    println!("data: {source}");
    let loader = DataLoader::new(train, 64)
        .shuffle(0)
        .drop_last(true)
        .augment(Augment::crop_flip(2, 0));

    let model = nn::resnet::ResNet::cifar_style(&[2, 2, 2, 2], 1, 10, &dev)?;
    let mut opt = Sgd::new(
        model.parameters(),
        SgdConfig {
            lr: 0.01,
            momentum: 0.9,
            ..Default::default()
        },
    )?;
    for epoch in 0..1 {
        for (step, batch) in loader.epoch(epoch).take(10).enumerate() {
            let (x, y) = batch?;
            let (x, y) = (x.to_device(dev)?, y.to_device(dev)?);
            let loss = nn::loss::cross_entropy(&model.forward(&x)?, &y)?;
            opt.zero_grad();
            loss.backward()?;
            opt.step()?;
            println!("step {step}: loss {:.4}", loss.item()?);
        }
    }
    Ok(())
}
