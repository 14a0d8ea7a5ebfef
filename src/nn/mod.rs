//! Neural-network layers with PyTorch/torchvision names, ResNets, losses and initialisation.
//! The [`Module`] trait is the contract AMP builds on: named parameters and buffers (with a
//! batch-norm flag for O2's FP32 BatchNorm), an in-place dtype cast, train/eval through `&self`.

pub mod activation;
pub mod batch_norm;
pub mod blocks;
pub mod checkpoint;
pub mod conv;
pub mod dropout;
pub mod embedding;
pub mod flatten;
pub mod gpt;
pub mod init;
pub mod layer_norm;
pub mod linear;
pub mod loss;
pub mod module;
pub mod pool;
pub mod resnet;
pub mod sample;
pub mod sequential;
pub mod transformer;

pub use activation::{Gelu, ReLU, SiLU};
pub use batch_norm::{BatchNorm2d, BatchNormTraining, Epilogue};
pub use blocks::{BasicBlock, BlockKind, Bottleneck, Downsample};
pub use checkpoint::{checkpoint, checkpointed_forward, Checkpoint};
pub use conv::Conv2d;
pub use dropout::Dropout;
pub use embedding::Embedding;
pub use flatten::Flatten;
pub use gpt::{Gpt, GptBody, GptConfig, GPT2_VOCAB, GPT_SIZES};
pub use layer_norm::{LayerNorm, RMSNorm};
pub use linear::Linear;
pub use loss::{cross_entropy, cross_entropy_with, mse_loss, CrossEntropyConfig, Reduction};
pub use module::{state_dict_mismatches, Module, StateDict, TensorInfo, TensorKind, TrainingFlag};
pub use pool::{AdaptiveAvgPool2d, AvgPool2d, MaxPool2d};
pub use resnet::{ResNet, ResNetConfig, Stem};
pub use sample::{generate, SampleConfig};
pub use sequential::Sequential;
pub use transformer::{BlockConfig, CausalSelfAttention, Mlp, TransformerBlock};
