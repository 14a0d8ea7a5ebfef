//! The twin check against PyTorch: writes a GPT's initial weights and one fixed batch to
//! `DIR/init.safetensors`, then trains N steps on that batch (AdamW, clip 1.0, under the AMP
//! level given) and prints each step's loss; `benches/torch_gpt_twin.py` repeats the same steps
//! in PyTorch from the same file. `gpt2` takes GPT-2 124M on the GPU (batch 4 x 256), else a
//! 2-layer GPT on the CPU (batch 4 x 32).
//!
//!     cargo run --release --example gpt_twin -- DIR [STEPS] [O0|O1|O2] [gpt2]
//!     python3 benches/torch_gpt_twin.py DIR STEPS [cpu|cuda] [bf16]

use std::collections::BTreeMap;

use mixprec::nn::{Gpt, GptConfig, Module};
use mixprec::optim::{AdamConfig, FusedAdam};
use mixprec::{amp, Device, Tensor};

fn main() -> mixprec::Result<()> {
    let mut args = std::env::args().skip(1);
    let dir = std::path::PathBuf::from(args.next().expect("an output directory"));
    let steps: usize = args.next().map_or(20, |s| s.parse().expect("a step count"));
    let level = args.next().unwrap_or_else(|| "O0".into());
    let big = args.next().is_some_and(|a| a == "gpt2");
    std::fs::create_dir_all(&dir).map_err(|e| mixprec::Error::io("creating the directory", e))?;
    let cfg = if big {
        GptConfig::gpt2()
    } else {
        GptConfig {
            n_layer: 2,
            n_head: 2,
            n_embd: 64,
            block_size: 32,
            vocab_size: 128,
            dropout: 0.0,
        }
    };
    let dev = if big { Device::cuda(0)? } else { Device::Cpu };
    let model = Gpt::new(cfg, 7, &dev)?;
    let (b, t) = if big {
        (4usize, 256usize)
    } else {
        (4usize, 32usize)
    };
    let top = if big { 50257.0 } else { 120.0 };
    let ids: Vec<i64> = mixprec::tensor::random::uniform(3, b * (t + 1), 0.0, top)
        .into_iter()
        .map(|u| u as i64)
        .collect();
    let rows: Vec<&[i64]> = ids.chunks(t + 1).collect();
    let x: Vec<i64> = rows.iter().flat_map(|r| r[..t].to_vec()).collect();
    let y: Vec<i64> = rows.iter().flat_map(|r| r[1..].to_vec()).collect();
    let x = Tensor::from_vec(x, vec![b, t], dev)?;
    let y = Tensor::from_vec(y, vec![b, t], dev)?;
    let mut state = model.state_dict()?;
    state.push(("x".into(), x.clone()));
    state.push(("y".into(), y.clone()));
    mixprec::io::safetensors::write(&dir.join("init.safetensors"), &state, &BTreeMap::new())?;
    let opt = FusedAdam::new(
        model.parameters(),
        AdamConfig {
            lr: if big { 6e-4 } else { 1e-2 },
            betas: (0.9, 0.95),
            weight_decay: 0.1,
            ..Default::default()
        },
    )?;
    let (model, mut opt) = amp::initialize(
        model,
        opt,
        amp::Policy::builtin(&level)?.with_half_dtype(mixprec::DType::BF16),
    )?;
    opt.clip_grad_norm(Some(1.0))?;
    for s in 0..steps {
        let loss = model.scope(|m| m.loss(&x, &y))?;
        opt.zero_grad()?;
        opt.backward(&loss)?;
        opt.step()?;
        println!("step {s} loss {:.6}", loss.item()?);
    }
    Ok(())
}
