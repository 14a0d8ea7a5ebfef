//! The learning check's mixprec half: after a `train_gpt` run, writes what PyTorch's twin
//! (`benches/torch_train_gpt_twin.py`) needs to train the same model on the same tokens from
//! the same weights: `RUN/twin/init.safetensors` (the run's initial weights, rebuilt from its
//! seed on the run's device), `RUN/twin/train.u16` (every training batch the run drew, in
//! order: steps x grad_accum x batch rows of context + 1 tokens, little-endian u16) and
//! `RUN/twin/val.u16` (the val batches each evaluation reads).
//!
//!     cargo run --release --example train_gpt -- --out RUN [flags]
//!     cargo run --release --example train_gpt_twin -- RUN [cpu|cuda]
//!     python3 benches/torch_train_gpt_twin.py RUN

use std::collections::BTreeMap;
use std::path::Path;

use mixprec::data::{TokenLoader, TokenLoaderConfig, TokenSplit};
use mixprec::nn::{Gpt, GptConfig, Module};
use mixprec::train::gpt::GptRecipe;
use mixprec::{Device, Error, Result};

fn write_u16(path: &Path, tokens: &[i64]) -> Result<()> {
    let bytes: Vec<u8> = tokens
        .iter()
        .flat_map(|&t| (t as u16).to_le_bytes())
        .collect();
    std::fs::write(path, bytes).map_err(|e| Error::io(format!("writing {}", path.display()), e))
}

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let run = std::path::PathBuf::from(args.next().ok_or_else(|| {
        Error::invalid_arg(
            "train_gpt_twin",
            "RUN",
            "nothing",
            "a train_gpt run directory",
        )
    })?);
    let dev = match args.next().as_deref() {
        Some("cuda") => Device::cuda(0)?,
        _ => Device::Cpu,
    };
    let text = std::fs::read_to_string(run.join("config.json"))
        .map_err(|e| Error::io(format!("reading {}/config.json", run.display()), e))?;
    let recipe: GptRecipe = serde_json::from_str(&text).map_err(|e| {
        Error::invalid_arg("train_gpt_twin", "config.json", e, "a train_gpt recipe")
    })?;
    let twin = run.join("twin");
    std::fs::create_dir_all(&twin).map_err(|e| Error::io("creating RUN/twin", e))?;

    // The batches in the order the run drew them: the loader's shuffled epochs, as train_gpt
    // opens it (one rank).
    let cfg = TokenLoaderConfig::new(recipe.batch_size, recipe.context);
    let shards = run.join("tokens");
    let mut train = TokenLoader::open(&shards, TokenSplit::Train, cfg.shuffle(recipe.seed))?;
    let per_epoch = train.batches_per_epoch() as u64;
    let draws = recipe.steps * recipe.grad_accum as u64;
    let mut tokens = Vec::new();
    for i in 0..draws {
        tokens.extend(train.batch_windows(i / per_epoch, i % per_epoch)?);
    }
    write_u16(&twin.join("train.u16"), &tokens)?;
    let mut val = TokenLoader::open(&shards, TokenSplit::Val, cfg)?;
    let n_val = recipe.eval_batches.min(val.batches_per_epoch().max(1)) as u64;
    let mut tokens = Vec::new();
    for i in 0..n_val {
        tokens.extend(val.batch_windows(0, i)?);
    }
    write_u16(&twin.join("val.u16"), &tokens)?;

    let gcfg: GptConfig = recipe.gpt.into();
    let model = Gpt::new(gcfg, recipe.seed, &dev)?;
    mixprec::io::safetensors::write(
        &twin.join("init.safetensors"),
        &model.state_dict()?,
        &BTreeMap::new(),
    )?;
    println!(
        "{}: {draws} train batches, {n_val} val batches of {} x {}, init weights ({:.1}M parameters)",
        twin.display(),
        recipe.batch_size,
        recipe.context + 1,
        model.num_parameters() as f64 / 1e6
    );
    Ok(())
}
