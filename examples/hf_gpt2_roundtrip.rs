//! The Hugging Face round trip, mixprec's half: loads a GPT-2 `model.safetensors` that
//! `benches/torch_hf_gpt2_export.py` wrote from a seeded `transformers.GPT2LMHeadModel`, runs the
//! same token ids, prints how far our f32 logits are from PyTorch's, and saves the weights back
//! with `save_hf_gpt2` for the script's `--check` (which loads them into `transformers`).
//!
//!     python3 benches/torch_hf_gpt2_export.py --out DIR [--layers 12 --heads 12 --d 768 --ctx 1024]
//!     cargo run --release --example hf_gpt2_roundtrip -- DIR HEADS [cpu|cuda]
//!     python3 benches/torch_hf_gpt2_export.py --out DIR [same sizes] --check DIR/ours.safetensors

use mixprec::io::hf_gpt2::{load_hf_gpt2, save_hf_gpt2, LM_HEAD};
use mixprec::io::safetensors;
use mixprec::nn::{Gpt, GptConfig, Module};
use mixprec::{DType, Device, Error, Result};

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let usage = || {
        Error::invalid_arg(
            "hf_gpt2_roundtrip",
            "arguments",
            std::env::args().skip(1).collect::<Vec<_>>().join(" "),
            "DIR HEADS [cpu|cuda]",
        )
    };
    let dir = std::path::PathBuf::from(args.next().ok_or_else(usage)?);
    let heads: usize = args.next().and_then(|h| h.parse().ok()).ok_or_else(usage)?;
    let dev = match args.next().as_deref() {
        Some("cuda") => Device::cuda(0)?,
        _ => Device::Cpu,
    };
    let file = dir.join("model.safetensors");
    // The file's vocabulary, padded to a multiple of 64 as our models are.
    let (raw, _) = safetensors::read(&file)?;
    let rows = raw
        .iter()
        .find(|(n, _)| n.ends_with("wte.weight"))
        .map_or(0, |(_, t)| t.dims()[0]);
    let (weights, dims) = load_hf_gpt2(&file, GptConfig::padded_vocab(rows))?;
    let cfg = GptConfig {
        n_layer: dims.n_layer,
        n_head: heads,
        n_embd: dims.n_embd,
        block_size: dims.n_positions,
        vocab_size: GptConfig::padded_vocab(dims.vocab_size),
        dropout: 0.0,
    };
    let model = Gpt::new(cfg, 0, &dev)?;
    let entries: Vec<_> = weights.into_iter().filter(|(n, _)| n != LM_HEAD).collect();
    model.load_state_dict(&entries)?;
    model.eval();
    let (refs, _) = safetensors::read(&dir.join("logits.safetensors"))?;
    let get = |name: &str| {
        refs.iter()
            .find(|(n, _)| n == name)
            .map(|(_, t)| t.clone())
            .ok_or_else(|| {
                Error::invalid_arg(
                    "hf_gpt2_roundtrip",
                    "logits.safetensors",
                    name,
                    "input_ids and logits",
                )
            })
    };
    let (ids, want) = (get("input_ids")?, get("logits")?);
    let got = mixprec::with_no_grad(|| model.forward(&ids.to_device(dev)?))?;
    let vocab = want.dims()[2];
    let got = got
        .narrow(2, 0, vocab)?
        .to_dtype(DType::F32)?
        .to_vec::<f32>()?;
    let want = want.to_vec::<f32>()?;
    let (mut max_abs, mut num, mut den) = (0f64, 0f64, 0f64);
    for (g, w) in got.iter().zip(&want) {
        let d = (*g as f64 - *w as f64).abs();
        max_abs = max_abs.max(d);
        num += d * d;
        den += (*w as f64) * (*w as f64);
    }
    let ours = dir.join("ours.safetensors");
    save_hf_gpt2(&ours, &model.state_dict()?, vocab)?;
    println!(
        "{{\"side\": \"mixprec\", \"device\": \"{dev}\", \"n_layer\": {}, \"n_embd\": {}, \
         \"logits\": {:?}, \"max_abs_diff\": {max_abs:.3e}, \"rel_l2\": {:.3e}, \"saved\": {:?}}}",
        cfg.n_layer,
        cfg.n_embd,
        ids.dims().iter().chain([&vocab]).collect::<Vec<_>>(),
        (num / den.max(f64::MIN_POSITIVE)).sqrt(),
        ours.display().to_string()
    );
    Ok(())
}
