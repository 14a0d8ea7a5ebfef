//! The blocks of a GPT-style decoder with Hugging Face `GPT2Model`'s parameter names:
//! [`CausalSelfAttention`] (`attn.c_attn`, `attn.c_proj`), [`Mlp`] (`mlp.c_fc`, `mlp.c_proj`)
//! and the pre-norm [`TransformerBlock`] (`ln_1`, `attn`, `ln_2`, `mlp`).
//!
//! Weights are `[out, in]` here as in every mixprec linear layer; `io::hf_gpt2` transposes
//! GPT-2's `Conv1D` weights on the way in and out.

use super::dropout::Dropout;
use super::layer_norm::LayerNorm;
use super::linear::Linear;
use super::module::{Module, TrainingFlag};
use crate::error::{Error, Result};
use crate::tensor::random::{normal_f32, SeedStream};
use crate::tensor::{DType, Device, DropoutGenerator, SdpaOptions, Tensor};

/// The sizes and regularisation one block needs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockConfig {
    /// Model width C.
    pub n_embd: usize,
    /// Attention heads; `n_embd` must be a multiple.
    pub n_head: usize,
    /// The MLP's hidden width (4·C in GPT-2).
    pub n_inner: usize,
    /// Dropout on the attention probabilities and after each residual branch (0: none).
    pub dropout: f64,
    /// The standard deviation of the residual projections' initial weights: GPT-2 scales 0.02
    /// by 1/sqrt(2·n_layer), so that the residual stream's variance does not grow with depth.
    pub residual_init_std: f64,
}

impl BlockConfig {
    pub(crate) fn check(&self) -> Result<()> {
        let op = "TransformerBlock";
        if self.n_embd == 0 || self.n_head == 0 || !self.n_embd.is_multiple_of(self.n_head) {
            return Err(Error::invalid_arg(
                op,
                "n_embd/n_head",
                format!("{}/{}", self.n_embd, self.n_head),
                "n_head >= 1 dividing n_embd >= 1",
            ));
        }
        if self.n_inner == 0 {
            return Err(Error::invalid_arg(op, "n_inner", 0, "at least 1"));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(Error::invalid_arg(
                op,
                "dropout",
                self.dropout,
                "a probability in [0, 1)",
            ));
        }
        if !(self.residual_init_std.is_finite() && self.residual_init_std > 0.0) {
            return Err(Error::invalid_arg(
                op,
                "residual_init_std",
                self.residual_init_std,
                "a finite value > 0",
            ));
        }
        Ok(())
    }
}

/// The standard deviation of GPT-2's other weights.
pub const INIT_STD: f64 = 0.02;

/// A `[out, in]` linear layer with weights from N(0, std²) and zero bias (GPT-2's init).
pub(crate) fn gpt_linear(
    inf: usize,
    outf: usize,
    std: f64,
    seed: u64,
    device: &Device,
) -> Result<Linear> {
    let w = normal_tensor(&[outf, inf], std, seed, device)?;
    let b = Tensor::zeros(vec![outf], DType::F32, *device)?;
    Linear::from_tensors(w, Some(b))
}

/// An F32 tensor of `shape` drawn from N(0, std²) with `seed`, on `device`.
pub(crate) fn normal_tensor(
    shape: &[usize],
    std: f64,
    seed: u64,
    device: &Device,
) -> Result<Tensor> {
    let n = shape.iter().product();
    Tensor::from_vec(normal_f32(seed, n, 0.0, std), shape.to_vec(), Device::Cpu)?.to_device(*device)
}

/// `[B, T, C]` of `x`, or an error naming `op`.
fn btc(op: &'static str, x: &Tensor, c: usize) -> Result<(usize, usize)> {
    if x.rank() != 3 || x.dims()[2] != c {
        return Err(Error::invalid_shape(
            op,
            x.shape(),
            format!("the input must be [batch, tokens, {c}]"),
        ));
    }
    Ok((x.dims()[0], x.dims()[1]))
}

/// Dropout that is no op at all when its probability is 0 (the GPT-2 benchmark's case).
struct MaybeDropout(Option<Dropout>);

impl MaybeDropout {
    fn new(p: f64, seed: u64, device: &Device) -> Result<Self> {
        Ok(MaybeDropout(if p > 0.0 {
            Some(Dropout::new(p, seed, device)?)
        } else {
            None
        }))
    }

    fn forward(&self, x: Tensor, training: bool) -> Result<Tensor> {
        match &self.0 {
            Some(d) if training => x.dropout(d.p, &d.generator),
            _ => Ok(x),
        }
    }
}

/// Multi-head causal self-attention with one fused QKV projection (`c_attn`, `[3C, C]`, rows
/// q, then k, then v, each head's `C/H` columns together, as GPT-2 lays them out) and the
/// output projection `c_proj`. q, k and v are views into the projection's output: no copies
/// before the attention op.
pub struct CausalSelfAttention {
    pub c_attn: Linear,
    pub c_proj: Linear,
    pub n_head: usize,
    attn_dropout: Option<(f64, DropoutGenerator)>,
    resid_dropout: MaybeDropout,
    training: TrainingFlag,
}

impl CausalSelfAttention {
    pub fn new(cfg: &BlockConfig, seed: u64, device: &Device) -> Result<Self> {
        cfg.check()?;
        let c = cfg.n_embd;
        let mut seeds = SeedStream::new(seed);
        let c_attn = gpt_linear(c, 3 * c, INIT_STD, seeds.next_seed(), device)?;
        let c_proj = gpt_linear(c, c, cfg.residual_init_std, seeds.next_seed(), device)?;
        let attn_dropout = if cfg.dropout > 0.0 {
            Some((
                cfg.dropout,
                DropoutGenerator::new(seeds.next_seed(), *device)?,
            ))
        } else {
            None
        };
        Ok(CausalSelfAttention {
            c_attn,
            c_proj,
            n_head: cfg.n_head,
            attn_dropout,
            resid_dropout: MaybeDropout::new(cfg.dropout, seeds.next_seed(), device)?,
            training: TrainingFlag::default(),
        })
    }
}

impl Module for CausalSelfAttention {
    /// `x` `[B, T, C]` → `[B, T, C]`.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let c = self.c_proj.in_features();
        let (b, t) = btc("CausalSelfAttention", x, c)?;
        let (h, d) = (self.n_head, c / self.n_head);
        let qkv = self.c_attn.forward(x)?.reshape(vec![b, t, 3, h, d])?;
        let training = self.training.get();
        let (dropout_p, generator) = match &self.attn_dropout {
            Some((p, g)) if training => (*p, Some(g)),
            _ => (0.0, None),
        };
        let opts = SdpaOptions {
            causal: true,
            dropout_p,
            generator,
            ..Default::default()
        };
        // q, k, v are read where they lie in the projection; on the fused path their
        // gradients come back as one [B, T, 3, H, D] tensor.
        let y = qkv.scaled_dot_product_attention_packed(&opts)?;
        // Heads merged back: [B, H, T, D] → [B, T, H·D].
        let y = y.permute(&[0, 2, 1, 3])?.reshape(vec![b, t, c])?;
        self.resid_dropout
            .forward(self.c_proj.forward(&y)?, training)
    }

    fn visit_children(&self, f: &mut dyn FnMut(&str, &dyn Module)) {
        f("c_attn", &self.c_attn);
        f("c_proj", &self.c_proj);
    }

    fn training_flag(&self) -> Option<&TrainingFlag> {
        Some(&self.training)
    }
}

/// GPT-2's feed-forward: `c_proj(gelu_tanh(c_fc(x)))`.
pub struct Mlp {
    pub c_fc: Linear,
    pub c_proj: Linear,
    dropout: MaybeDropout,
    training: TrainingFlag,
}

impl Mlp {
    pub fn new(cfg: &BlockConfig, seed: u64, device: &Device) -> Result<Self> {
        cfg.check()?;
        let mut seeds = SeedStream::new(seed);
        let (c, i) = (cfg.n_embd, cfg.n_inner);
        Ok(Mlp {
            c_fc: gpt_linear(c, i, INIT_STD, seeds.next_seed(), device)?,
            c_proj: gpt_linear(i, c, cfg.residual_init_std, seeds.next_seed(), device)?,
            dropout: MaybeDropout::new(cfg.dropout, seeds.next_seed(), device)?,
            training: TrainingFlag::default(),
        })
    }
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        btc("Mlp", x, self.c_fc.in_features())?;
        // With a bias, the activation joins the product's epilogue (one op).
        let h = match &self.c_fc.bias {
            Some(b) => x.linear_gelu_tanh(&self.c_fc.weight, b)?,
            None => self.c_fc.forward(x)?.gelu_tanh()?,
        };
        self.dropout
            .forward(self.c_proj.forward(&h)?, self.training.get())
    }

    fn visit_children(&self, f: &mut dyn FnMut(&str, &dyn Module)) {
        f("c_fc", &self.c_fc);
        f("c_proj", &self.c_proj);
    }

    fn training_flag(&self) -> Option<&TrainingFlag> {
        Some(&self.training)
    }
}

/// A pre-norm block: `x + attn(ln_1(x))`, then `+ mlp(ln_2(·))`.
pub struct TransformerBlock {
    pub ln_1: LayerNorm,
    pub attn: CausalSelfAttention,
    pub ln_2: LayerNorm,
    pub mlp: Mlp,
}

impl TransformerBlock {
    pub fn new(cfg: &BlockConfig, seed: u64, device: &Device) -> Result<Self> {
        cfg.check()?;
        let mut seeds = SeedStream::new(seed);
        Ok(TransformerBlock {
            ln_1: LayerNorm::new(&[cfg.n_embd], device)?,
            attn: CausalSelfAttention::new(cfg, seeds.next_seed(), device)?,
            ln_2: LayerNorm::new(&[cfg.n_embd], device)?,
            mlp: Mlp::new(cfg, seeds.next_seed(), device)?,
        })
    }
}

impl Module for TransformerBlock {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = x.add(&self.attn.forward(&self.ln_1.forward(x)?)?)?;
        x.add(&self.mlp.forward(&self.ln_2.forward(&x)?)?)
    }

    fn visit_children(&self, f: &mut dyn FnMut(&str, &dyn Module)) {
        f("ln_1", &self.ln_1);
        f("attn", &self.attn);
        f("ln_2", &self.ln_2);
        f("mlp", &self.mlp);
    }
}
