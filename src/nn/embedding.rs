//! `Embedding`: PyTorch's `nn.Embedding(num_embeddings, embedding_dim, padding_idx)`, its table
//! `weight` drawn from N(0, 1) (the padding row zero), f32. Positional embeddings are the same
//! layer looked up by positions.

use super::module::{Module, TensorInfo, TensorKind};
use crate::error::{Error, Result};
use crate::tensor::{DType, Device, Tensor};

pub struct Embedding {
    /// `[num_embeddings, embedding_dim]`.
    pub weight: Tensor,
    pub padding_idx: Option<usize>,
}

impl Embedding {
    pub fn new(
        num_embeddings: usize,
        embedding_dim: usize,
        padding_idx: Option<usize>,
        seed: u64,
        device: &Device,
    ) -> Result<Embedding> {
        let op = "Embedding::new";
        if num_embeddings == 0 || embedding_dim == 0 {
            return Err(Error::invalid_arg(
                op,
                "num_embeddings/embedding_dim",
                format!("{num_embeddings}/{embedding_dim}"),
                "both at least 1",
            ));
        }
        if let Some(pi) = padding_idx.filter(|&pi| pi >= num_embeddings) {
            return Err(Error::invalid_arg(
                op,
                "padding_idx",
                pi,
                format!("a row of the table, 0..{num_embeddings}"),
            ));
        }
        let mut w = crate::tensor::random::normal(seed, num_embeddings * embedding_dim, 0.0, 1.0);
        if let Some(pi) = padding_idx {
            w[pi * embedding_dim..][..embedding_dim].fill(0.0);
        }
        let weight = Tensor::from_vec(w, [num_embeddings, embedding_dim], Device::Cpu)?
            .to_dtype(DType::F32)?
            .to_device(*device)?
            .to_variable();
        Ok(Embedding {
            weight,
            padding_idx,
        })
    }
}

impl Module for Embedding {
    /// `x` holds i64 indices of any shape.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.embedding(&self.weight, self.padding_idx)
    }

    fn visit_own(&self, f: &mut dyn FnMut(&TensorInfo)) {
        f(&TensorInfo {
            name: "weight",
            tensor: &self.weight,
            kind: TensorKind::Parameter,
            batch_norm: false,
        });
    }
}
