//! Text generation from a language model: autoregressive sampling with temperature and top-k
//! (GPT-2's and nanoGPT's recipe). The model is any [`Module`] mapping token ids `[1, T]` to
//! logits `[1, T, V]` (a [`super::Gpt`], or one wrapped by AMP), run without gradients and
//! without a cache: each new token re-reads the last `context` tokens. The draw itself runs
//! on the host from a seeded counter-based stream, so a seed gives the same text on any device
//! that gives the same logits.

use super::module::Module;
use crate::error::{Error, Result};
use crate::tensor::random::uniform;
use crate::tensor::{DType, Device, Tensor};

/// How to draw tokens.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SampleConfig {
    /// Tokens to add after the prompt.
    pub max_new_tokens: usize,
    /// Logits are divided by it; 0 picks the most likely token (greedy).
    pub temperature: f64,
    /// Only the `k` most likely tokens are drawn from (None: all).
    pub top_k: Option<usize>,
    /// The random stream's seed.
    pub seed: u64,
    /// Tokens the tokenizer knows (the model's vocabulary may be padded beyond them; padding
    /// ids are never drawn).
    pub vocab: usize,
    /// The longest context the model takes.
    pub context: usize,
}

/// The index to draw from `logits` (the real vocabulary's) given a uniform `u` in [0, 1).
fn pick(logits: &[f32], cfg: &SampleConfig, u: f64) -> usize {
    let argmax = || {
        (0..logits.len())
            .max_by(|&a, &b| logits[a].total_cmp(&logits[b]))
            .unwrap_or(0)
    };
    if cfg.temperature == 0.0 {
        return argmax();
    }
    let mut order: Vec<usize> = (0..logits.len()).collect();
    if let Some(k) = cfg.top_k.filter(|&k| k < logits.len()) {
        order.select_nth_unstable_by(k.max(1) - 1, |&a, &b| logits[b].total_cmp(&logits[a]));
        order.truncate(k.max(1));
    }
    let max = order
        .iter()
        .map(|&i| logits[i] as f64)
        .fold(f64::NEG_INFINITY, f64::max);
    if !max.is_finite() {
        return argmax();
    }
    let w: Vec<f64> = order
        .iter()
        .map(|&i| ((logits[i] as f64 - max) / cfg.temperature).exp())
        .collect();
    let total: f64 = w.iter().sum();
    let mut acc = 0.0;
    for (j, wj) in w.iter().enumerate() {
        acc += wj / total;
        if u < acc {
            return order[j];
        }
    }
    *order.last().expect("at least one candidate")
}

/// `prompt` followed by `cfg.max_new_tokens` drawn tokens. `device` is where the model lives.
pub fn generate(
    model: &dyn Module,
    device: Device,
    prompt: &[u32],
    cfg: &SampleConfig,
) -> Result<Vec<u32>> {
    let op = "generate";
    if prompt.is_empty() {
        return Err(Error::invalid_arg(op, "prompt", "[]", "at least one token"));
    }
    if !(cfg.temperature.is_finite() && cfg.temperature >= 0.0) {
        return Err(Error::invalid_arg(
            op,
            "temperature",
            cfg.temperature,
            "a finite value >= 0",
        ));
    }
    if cfg.top_k == Some(0) || cfg.vocab == 0 || cfg.context == 0 {
        return Err(Error::invalid_arg(
            op,
            "top_k/vocab/context",
            format!("{:?}/{}/{}", cfg.top_k, cfg.vocab, cfg.context),
            "each at least 1",
        ));
    }
    if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= cfg.vocab) {
        return Err(Error::invalid_arg(
            op,
            "prompt token",
            bad,
            format!("ids in 0..{}", cfg.vocab),
        ));
    }
    let was_training = model.is_training();
    model.set_training(false);
    let out = (|| {
        let _g = crate::no_grad();
        let draws = uniform(cfg.seed, cfg.max_new_tokens, 0.0, 1.0);
        let mut ids = prompt.to_vec();
        for u in draws {
            let ctx = &ids[ids.len().saturating_sub(cfg.context)..];
            let x: Vec<i64> = ctx.iter().map(|&t| t as i64).collect();
            let x = Tensor::from_vec(x, vec![1, ctx.len()], Device::Cpu)?.to_device(device)?;
            let logits = model.forward(&x)?;
            let v = logits.dims()[logits.rank() - 1];
            if v < cfg.vocab {
                return Err(Error::invalid_arg(
                    op,
                    "vocab",
                    cfg.vocab,
                    format!("at most the model's {v} logits"),
                ));
            }
            let last = logits
                .narrow(1, ctx.len() - 1, 1)?
                .narrow(2, 0, cfg.vocab)?
                .to_dtype(DType::F32)?
                .to_vec_f32()?;
            ids.push(pick(&last, cfg, u) as u32);
        }
        Ok(ids)
    })();
    model.set_training(was_training);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(temperature: f64, top_k: Option<usize>) -> SampleConfig {
        SampleConfig {
            max_new_tokens: 1,
            temperature,
            top_k,
            seed: 0,
            vocab: 4,
            context: 8,
        }
    }

    #[test]
    fn greedy_top_k_and_temperature() {
        let l = [0.0f32, 3.0, 1.0, 2.0];
        assert_eq!(pick(&l, &cfg(0.0, None), 0.99), 1);
        // top-1 is greedy whatever the draw.
        assert_eq!(pick(&l, &cfg(1.0, Some(1)), 0.99), 1);
        // top-2 draws only 1 or 3: weights e^3 : e^2.
        let p1 = 1.0 / (1.0 + (-1.0f64).exp());
        assert_eq!(pick(&l, &cfg(1.0, Some(2)), p1 - 1e-9), 1);
        assert_eq!(pick(&l, &cfg(1.0, Some(2)), p1 + 1e-9), 3);
        // Without top-k the candidates keep index order: the smallest draw picks index 0.
        assert_eq!(pick(&l, &cfg(1.0, None), 0.0), 0);
    }
}
