//! GPT-2 (Radford et al. 2019) as Hugging Face's `GPT2LMHeadModel` names it: token and position
//! embeddings (`transformer.wte`, `transformer.wpe`), `n_layer` pre-norm blocks
//! (`transformer.h.{i}`), a final norm (`transformer.ln_f`) and a head tied to the token
//! embedding (`lm_head.weight` is `transformer.wte.weight`, so it is neither visited nor trained
//! twice: PyTorch's `named_parameters` lists a shared tensor once too).
//!
//! Any size by [`GptConfig`]; GPT-2's init: N(0, 0.02) for weights and embeddings, the residual
//! projections (`attn.c_proj`, `mlp.c_proj`) scaled by 1/sqrt(2·n_layer), zero biases, unit norms.

use std::sync::Arc;

use super::checkpoint::checkpointed_forward;
use super::embedding::Embedding;
use super::layer_norm::LayerNorm;
use super::loss::{cross_entropy_with, CrossEntropyConfig};
use super::module::Module;
use super::transformer::{normal_tensor, BlockConfig, TransformerBlock, INIT_STD};
use crate::error::{Error, Result};
use crate::tensor::random::SeedStream;
use crate::tensor::{DType, Device, Tensor};

/// A GPT's sizes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GptConfig {
    pub n_layer: usize,
    pub n_head: usize,
    pub n_embd: usize,
    /// The longest context (rows of the position embedding).
    pub block_size: usize,
    /// Rows of the token embedding: the tokenizer's vocabulary padded up to a multiple of 64
    /// ([`GptConfig::padded_vocab`]) so the classifier's matrix products tile well. The padding
    /// rows are never a target; training drives their logits down.
    pub vocab_size: usize,
    /// Dropout on attention probabilities and residual branches (0 for GPT-2 pre-training).
    pub dropout: f64,
}

/// GPT-2's tokenizer vocabulary (`r50k_base`).
pub const GPT2_VOCAB: usize = 50257;

/// The named sizes `--model` accepts: name, layers, heads, width, context.
pub const GPT_SIZES: &[(&str, usize, usize, usize, usize)] = &[
    // A model that learns recognisable text in ~5 minutes on 2 CPU cores.
    ("tiny", 4, 4, 128, 128),
    // The default GPU recipe's model (nanoGPT's Shakespeare configuration, a minute or two).
    ("small", 6, 6, 384, 256),
    ("gpt2", 12, 12, 768, 1024),
    ("gpt2-medium", 24, 16, 1024, 1024),
    ("gpt2-large", 36, 20, 1280, 1024),
    ("gpt2-xl", 48, 25, 1600, 1024),
];

impl GptConfig {
    /// GPT-2 124M.
    pub fn gpt2() -> GptConfig {
        GptConfig::named("gpt2").expect("a built-in size")
    }

    /// A size from [`GPT_SIZES`] with GPT-2's padded vocabulary and no dropout.
    pub fn named(name: &str) -> Result<GptConfig> {
        let Some(&(_, n_layer, n_head, n_embd, block_size)) =
            GPT_SIZES.iter().find(|s| s.0 == name)
        else {
            let known: Vec<&str> = GPT_SIZES.iter().map(|s| s.0).collect();
            return Err(Error::invalid_arg(
                "GptConfig::named",
                "model",
                name,
                format!("one of {}", known.join(", ")),
            ));
        };
        Ok(GptConfig {
            n_layer,
            n_head,
            n_embd,
            block_size,
            vocab_size: Self::padded_vocab(GPT2_VOCAB),
            dropout: 0.0,
        })
    }

    /// `vocab` rounded up to a multiple of 64.
    pub fn padded_vocab(vocab: usize) -> usize {
        vocab.div_ceil(64) * 64
    }

    pub fn block(&self) -> BlockConfig {
        BlockConfig {
            n_embd: self.n_embd,
            n_head: self.n_head,
            n_inner: 4 * self.n_embd,
            dropout: self.dropout,
            residual_init_std: INIT_STD / (2.0 * self.n_layer.max(1) as f64).sqrt(),
        }
    }

    /// Every parameter element (the head is the token embedding).
    pub fn num_parameters(&self) -> usize {
        let (c, l) = (self.n_embd, self.n_layer);
        let block =
            2 * 2 * c + (c * 3 * c + 3 * c) + (c * c + c) + (c * 4 * c + 4 * c) + (4 * c * c + c);
        self.vocab_size * c + self.block_size * c + l * block + 2 * c
    }

    /// Model flops per token of a training step at context `t` (forward + backward): 6 per
    /// parameter plus attention's 12·n_layer·n_embd·t (PaLM's appendix B and llm.c count so).
    pub fn train_flops_per_token(&self, t: usize) -> f64 {
        6.0 * self.num_parameters() as f64 + 12.0 * (self.n_layer * self.n_embd * t) as f64
    }

    fn check(&self) -> Result<()> {
        let op = "Gpt::new";
        if self.n_layer == 0 || self.block_size == 0 || self.vocab_size == 0 {
            return Err(Error::invalid_arg(
                op,
                "n_layer/block_size/vocab_size",
                format!("{}/{}/{}", self.n_layer, self.block_size, self.vocab_size),
                "each at least 1",
            ));
        }
        self.block().check()
    }
}

/// The model's body: `transformer.*`.
pub struct GptBody {
    pub wte: Embedding,
    pub wpe: Embedding,
    /// Shared, so that a checkpointed block's recompute can hold it.
    pub h: Vec<Arc<TransformerBlock>>,
    pub ln_f: LayerNorm,
    /// Checkpoint every block (`nn::checkpoint`): keep only each block's input for backward.
    pub checkpoint_activations: bool,
}

impl Module for GptBody {
    /// Token ids `[B, T]` (I64) → final hidden states `[B, T, C]`.
    fn forward(&self, idx: &Tensor) -> Result<Tensor> {
        let mut x = idx.embedding(&self.wte.weight, None)?;
        let t = idx.dims()[1];
        // Position ids 0..T as a view of the table's rows: a narrow, no index tensor.
        let pos = self.wpe.weight.narrow(0, 0, t)?;
        x = x.add(&pos)?;
        for b in &self.h {
            x = if self.checkpoint_activations {
                checkpointed_forward(b, &x)?
            } else {
                b.forward(&x)?
            };
        }
        self.ln_f.forward(&x)
    }

    fn visit_children(&self, f: &mut dyn FnMut(&str, &dyn Module)) {
        f("wte", &self.wte);
        f("wpe", &self.wpe);
        for (i, b) in self.h.iter().enumerate() {
            f(&format!("h.{i}"), &**b);
        }
        f("ln_f", &self.ln_f);
    }
}

/// GPT-2's language model.
pub struct Gpt {
    pub config: GptConfig,
    pub transformer: GptBody,
}

impl Gpt {
    /// A freshly initialised model on `device`, its weights from `seed`.
    pub fn new(config: GptConfig, seed: u64, device: &Device) -> Result<Gpt> {
        config.check()?;
        let mut seeds = SeedStream::new(seed);
        let c = config.n_embd;
        let table = |rows: usize, seed: u64| -> Result<Embedding> {
            Ok(Embedding {
                weight: normal_tensor(&[rows, c], INIT_STD, seed, device)?.to_variable(),
                padding_idx: None,
            })
        };
        let wte = table(config.vocab_size, seeds.next_seed())?;
        let wpe = table(config.block_size, seeds.next_seed())?;
        let block = config.block();
        let h = (0..config.n_layer)
            .map(|_| TransformerBlock::new(&block, seeds.next_seed(), device).map(Arc::new))
            .collect::<Result<Vec<_>>>()?;
        Ok(Gpt {
            config,
            transformer: GptBody {
                wte,
                wpe,
                h,
                ln_f: LayerNorm::new(&[c], device)?,
                checkpoint_activations: false,
            },
        })
    }

    /// This model with every transformer block checkpointed (`on`) or not: activation memory
    /// for about one more forward pass of compute, gradients bitwise the same.
    pub fn with_activation_checkpointing(mut self, on: bool) -> Gpt {
        self.transformer.checkpoint_activations = on;
        self
    }

    fn check_ids(&self, op: &'static str, idx: &Tensor) -> Result<()> {
        if idx.rank() != 2 || idx.dims()[1] == 0 || idx.dims()[1] > self.config.block_size {
            return Err(Error::invalid_shape(
                op,
                idx.shape(),
                format!(
                    "token ids must be [batch, tokens] with 1..={} tokens (the context)",
                    self.config.block_size
                ),
            ));
        }
        if idx.dtype() != DType::I64 {
            return Err(Error::UnsupportedDType {
                op,
                got: idx.dtype(),
                expected: "i64 token ids",
            });
        }
        Ok(())
    }

    /// Mean cross-entropy of the next-token predictions for `idx` `[B, T]` against `targets`
    /// `[B, T]` (I64; `ignore_index` rows skipped when given), in f32 whatever the AMP level.
    pub fn loss(&self, idx: &Tensor, targets: &Tensor) -> Result<Tensor> {
        self.loss_with(idx, targets, CrossEntropyConfig::default())
    }

    /// [`Gpt::loss`] with the cross-entropy's options.
    pub fn loss_with(
        &self,
        idx: &Tensor,
        targets: &Tensor,
        cfg: CrossEntropyConfig,
    ) -> Result<Tensor> {
        let logits = self.forward(idx)?;
        if targets.dims() != idx.dims() {
            return Err(Error::shape_mismatch(
                "Gpt::loss",
                idx.shape(),
                targets.shape(),
                "targets must have the token ids' shape",
            ));
        }
        let n = idx.elem_count();
        let v = self.config.vocab_size;
        cross_entropy_with(
            &logits.reshape(vec![n, v])?,
            &targets.reshape(vec![n])?,
            cfg,
        )
    }
}

impl Module for Gpt {
    /// Token ids `[B, T]` (I64) → logits `[B, T, vocab_size]` (the head is `wteᵀ`).
    fn forward(&self, idx: &Tensor) -> Result<Tensor> {
        self.check_ids("Gpt::forward", idx)?;
        let x = self.transformer.forward(idx)?;
        x.linear(&self.transformer.wte.weight, None)
    }

    fn visit_children(&self, f: &mut dyn FnMut(&str, &dyn Module)) {
        f("transformer", &self.transformer);
    }
}
