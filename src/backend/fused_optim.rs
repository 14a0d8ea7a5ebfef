//! The fused optimizers' hyperparameter blocks, defined once: F32 words in device memory, in
//! field order, that the kernels of `kernels/fused_optim.cu` read as a struct of floats of the
//! same name and fields (flags are 0.0 / 1.0). Those CUDA structs are not written in the `.cu`
//! file: [`cuda_structs`] generates them from the definitions below, and the kernel registry
//! prepends them to the family's source, so the Rust and CUDA layouts cannot differ.
//!
//! A new fused optimizer adds its block to the one `hyper_blocks!` list below.

/// Declares every block, and [`cuda_structs`] over them all.
macro_rules! hyper_blocks {
    ($($(#[$m:meta])* $name:ident { $($(#[$fm:meta])* $f:ident),* $(,)? })*) => {
        $(
            $(#[$m])*
            #[derive(Clone, Copy, Debug, Default, PartialEq)]
            pub struct $name {
                $($(#[$fm])* pub $f: f32,)*
            }

            impl $name {
                /// The struct's name, in Rust and in the kernels.
                pub const NAME: &'static str = stringify!($name);
                /// The fields, in the order the kernels read them.
                pub const FIELDS: &'static [&'static str] = &[$(stringify!($f)),*];
                /// Words in the block.
                pub const WORDS: usize = Self::FIELDS.len();
                /// The block as the kernel reads it.
                pub fn words(&self) -> Vec<f32> {
                    vec![$(self.$f),*]
                }
                /// A block read back from its words (`w` holds [`Self::WORDS`] of them).
                pub fn from_words(w: &[f32]) -> Self {
                    let mut it = w.iter().copied();
                    $name { $($f: it.next().unwrap_or(0.0),)* }
                }
            }
        )*

        /// Every block as (name, fields).
        const BLOCKS: &[(&str, &[&str])] = &[$(($name::NAME, $name::FIELDS)),*];
    };
}

/// The CUDA definition of every block (`struct SgdHyper { float lr; ... };`, one a line), which
/// the registry prepends to `kernels/fused_optim.cu`.
pub(crate) fn cuda_structs() -> String {
    BLOCKS
        .iter()
        .map(|(name, fields)| {
            let body: String = fields.iter().map(|f| format!(" float {f};")).collect();
            format!("struct {name} {{{body} }};\n")
        })
        .collect()
}

hyper_blocks! {
    /// `torch.optim.SGD` (and apex FusedSGD) hyperparameters as the kernel reads them.
    SgdHyper {
        lr,
        momentum,
        dampening,
        weight_decay,
        /// 1: Nesterov momentum.
        nesterov,
        /// 1: weight decay added after the momentum (apex's `wd_after_momentum`).
        wd_after_momentum,
    }

    /// Adam/AdamW hyperparameters as the kernel reads them (amsgrad is the presence of the
    /// `max_exp_avg_sq` list).
    AdamHyper {
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        /// 1: decoupled weight decay (AdamW); 0: L2 (g += wd·p).
        adamw,
        bias_correction,
    }

    /// LAMB hyperparameters, read by both phases.
    LambHyper {
        lr,
        beta1,
        beta2,
        /// 1−β1 with grad averaging, else 1.
        beta3,
        eps,
        weight_decay,
        /// Clip the global gradient norm to this (≤ 0: off).
        max_grad_norm,
        bias_correction,
        /// 1: apply the trust ratio (use_nvlamb, or weight decay ≠ 0).
        use_ratio,
    }

    /// NovoGrad hyperparameters, read by the moment and the update kernels.
    NovoGradHyper {
        lr,
        beta1,
        beta2,
        beta3,
        eps,
        weight_decay,
        bias_correction,
        /// 1: weight decay inside the first moment (apex's moment_mode 0).
        reg_inside_moment,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SOURCE: &str = include_str!("../../kernels/fused_optim.cu");

    #[test]
    fn the_cuda_structs_are_the_rust_blocks() {
        assert_eq!(
            cuda_structs().lines().next(),
            Some(
                "struct SgdHyper { float lr; float momentum; float dampening; float weight_decay; \
                 float nesterov; float wd_after_momentum; };"
            )
        );
        assert_eq!(cuda_structs().lines().count(), BLOCKS.len());
        for (name, _) in BLOCKS {
            // Only the generated definition: a hand-written one would be a second definition.
            assert!(!SOURCE.contains(&format!("struct {name}")), "{name}");
            assert!(SOURCE.contains(&format!("const {name}*")), "{name} unused");
        }
    }

    #[test]
    fn words_round_trip_in_field_order() {
        let sgd = SgdHyper {
            lr: 0.1,
            momentum: 0.9,
            dampening: 0.5,
            weight_decay: 1e-4,
            nesterov: 1.0,
            wd_after_momentum: 0.0,
        };
        assert_eq!(sgd.words(), vec![0.1, 0.9, 0.5, 1e-4, 1.0, 0.0]);
        assert_eq!(SgdHyper::from_words(&sgd.words()), sgd);
        assert_eq!(SgdHyper::WORDS, 6);
        assert_eq!(AdamHyper::default().words().len(), AdamHyper::WORDS);
        assert_eq!(LambHyper::default().words().len(), LambHyper::WORDS);
        assert_eq!(NovoGradHyper::default().words().len(), NovoGradHyper::WORDS);
    }
}
