//! One AMP training step of a GPT (the README's `train_gpt` section): a tiny GPT under O2 bf16
//! with AdamW in two parameter groups, the loss computed inside the model.
//! `cargo run --release --example gpt_step`

use mixprec::nn::{Gpt, GptConfig, Module};
use mixprec::optim::{AdamConfig, FusedAdam, ParamGroups};
use mixprec::{amp, DType, Device};

fn main() -> mixprec::Result<()> {
    let dev = Device::cuda_if_available(0);
    let model = Gpt::new(GptConfig::named("tiny")?, 0, &dev)?;
    let groups = ParamGroups::weight_decay_split(model.named_parameters())?;
    let opt = FusedAdam::with_param_groups(
        &groups,
        AdamConfig {
            lr: 6e-4,
            weight_decay: 0.1,
            ..Default::default()
        },
    )?;
    let policy = amp::Policy::builtin("O2")?.with_half_dtype(DType::BF16);
    let (model, mut opt) = amp::initialize(model, opt, policy)?;
    let ids: Vec<i64> = (0..2 * 64).map(|i| i % 50257).collect();
    let x = mixprec::Tensor::from_vec(ids, vec![2, 64], dev)?;
    // The loss inside the model: half logits go straight into the fused cross-entropy.
    let loss = model.scope(|m| m.loss(&x, &x))?;
    opt.zero_grad()?;
    opt.backward(&loss)?;
    opt.step()?;
    println!("loss {:.3}", loss.item()?);
    Ok(())
}
