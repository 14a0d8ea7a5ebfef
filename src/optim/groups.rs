//! Parameter groups made from a model's parameter names: [`ParamGroups`] splits
//! `named_parameters()` by a rule (by default the GPT-2 / Hugging Face weight-decay convention,
//! [`decays_by_default`]) into labelled groups, and turns them into the optimizers'
//! [`ParamGroup`]s, the `no_decay` group without weight decay. [`GroupConfig`] is what the
//! optimizers' configs share for that.

use std::collections::{HashMap, HashSet};
use std::fmt;

use super::{AdamConfig, LambConfig, NovoGradConfig, ParamGroup, SgdConfig};
use crate::error::{Error, Result};
use crate::tensor::{Tensor, TensorId};

const OP: &str = "ParamGroups";

/// What every optimizer config has: a learning rate and a weight decay.
pub trait GroupConfig: Copy {
    fn lr(&self) -> f64;
    fn weight_decay(&self) -> f64;
    /// This config with another weight decay.
    fn with_weight_decay(&self, weight_decay: f64) -> Self;
}

macro_rules! group_config {
    ($($config:ty),*) => {$(
        impl GroupConfig for $config {
            fn lr(&self) -> f64 {
                self.lr
            }
            fn weight_decay(&self) -> f64 {
                self.weight_decay
            }
            fn with_weight_decay(&self, weight_decay: f64) -> Self {
                Self {
                    weight_decay,
                    ..*self
                }
            }
        }
    )*};
}
group_config!(AdamConfig, LambConfig, NovoGradConfig, SgdConfig);

/// One labelled group: its parameters and their names, in the model's order.
#[derive(Clone, Debug)]
pub struct NamedGroup {
    pub label: String,
    pub names: Vec<String>,
    pub params: Vec<Tensor>,
}

impl NamedGroup {
    /// The number of elements of its parameters.
    pub fn numel(&self) -> usize {
        self.params.iter().map(|p| p.elem_count()).sum()
    }
}

/// A model's parameters split into labelled groups, every parameter in exactly one (a tensor
/// listed under two names, as tied weights are, is taken once, under its first name).
#[derive(Clone, Debug)]
pub struct ParamGroups {
    groups: Vec<NamedGroup>,
}

/// The label of the parameters that get weight decay.
const DECAY: &str = "decay";
/// The label of the parameters that get none.
const NO_DECAY: &str = "no_decay";

impl ParamGroups {
    pub const DECAY: &'static str = DECAY;
    pub const NO_DECAY: &'static str = NO_DECAY;

    /// Two groups, [`ParamGroups::DECAY`] then [`ParamGroups::NO_DECAY`], by
    /// `decays(name, parameter)`. Either may be empty (the layout stays the same for every
    /// model, which checkpoints rely on).
    pub fn by_name(
        named: impl IntoIterator<Item = (String, Tensor)>,
        mut decays: impl FnMut(&str, &Tensor) -> bool,
    ) -> Result<ParamGroups> {
        Self::by_rule(named, &[DECAY, NO_DECAY], |name, t| {
            Some(if decays(name, t) { DECAY } else { NO_DECAY })
        })
    }

    /// [`ParamGroups::by_name`] with [`decays_by_default`]: no weight decay on biases, norm
    /// weights and embeddings, decay on every other weight of two or more dimensions.
    pub fn weight_decay_split(
        named: impl IntoIterator<Item = (String, Tensor)>,
    ) -> Result<ParamGroups> {
        Self::by_name(named, decays_by_default)
    }

    /// One group per label of `labels` (in that order; each may end up empty), each parameter in
    /// the group `rule(name, parameter)` names. A parameter the rule puts in no group (`None`),
    /// a label not in `labels`, a tensor put in two groups under two names, a name given twice
    /// and an empty or repeated label list are errors.
    pub fn by_rule<S: AsRef<str>>(
        named: impl IntoIterator<Item = (String, Tensor)>,
        labels: &[&str],
        mut rule: impl FnMut(&str, &Tensor) -> Option<S>,
    ) -> Result<ParamGroups> {
        if labels.is_empty() {
            return Err(Error::invalid_arg(
                OP,
                "labels",
                "an empty label list",
                "at least one group label",
            ));
        }
        let mut groups: Vec<NamedGroup> = Vec::with_capacity(labels.len());
        for (i, l) in labels.iter().enumerate() {
            if labels[..i].contains(l) {
                return Err(Error::invalid_arg(
                    OP,
                    "labels",
                    format!("`{l}` twice in {labels:?}"),
                    "each label once",
                ));
            }
            groups.push(NamedGroup {
                label: l.to_string(),
                names: Vec::new(),
                params: Vec::new(),
            });
        }
        // Each tensor's group and first name; each name once.
        let mut placed: HashMap<TensorId, (usize, String)> = HashMap::new();
        let mut names: HashSet<String> = HashSet::new();
        let mut total = 0;
        for (name, t) in named {
            total += 1;
            if !names.insert(name.clone()) {
                return Err(Error::invalid_arg(
                    OP,
                    "named parameters",
                    format!("`{name}` twice"),
                    "each name once",
                ));
            }
            let label = rule(&name, &t).ok_or_else(|| {
                Error::invalid_arg(
                    OP,
                    "rule",
                    format!("parameter `{name}` (shape {:?}) in no group", t.dims()),
                    format!("every parameter in one of the groups {labels:?}"),
                )
            })?;
            let label = label.as_ref();
            let gi = labels.iter().position(|l| *l == label).ok_or_else(|| {
                Error::invalid_arg(
                    OP,
                    "rule",
                    format!("group `{label}` for parameter `{name}`"),
                    format!("one of the groups {labels:?}"),
                )
            })?;
            if let Some((first_gi, first)) = placed.get(&t.id()) {
                if *first_gi != gi {
                    return Err(Error::invalid_arg(
                        OP,
                        "rule",
                        format!(
                            "parameter `{name}` in group `{label}`, but it is the same tensor as `{first}`, in group `{}`",
                            labels[*first_gi]
                        ),
                        "each parameter in exactly one group (a tied weight's names in the same group)",
                    ));
                }
                continue;
            }
            placed.insert(t.id(), (gi, name.clone()));
            groups[gi].names.push(name);
            groups[gi].params.push(t);
        }
        if total == 0 {
            return Err(Error::invalid_arg(
                OP,
                "named parameters",
                "an empty parameter list",
                "at least one parameter",
            ));
        }
        Ok(ParamGroups { groups })
    }

    pub fn groups(&self) -> &[NamedGroup] {
        &self.groups
    }

    /// The group labelled `label`, if any.
    pub fn group(&self, label: &str) -> Option<&NamedGroup> {
        self.groups.iter().find(|g| g.label == label)
    }

    /// The optimizer groups, each with `config`, except that the group labelled
    /// [`ParamGroups::NO_DECAY`] gets weight decay 0.
    pub fn with_config<C: GroupConfig>(&self, config: C) -> Vec<ParamGroup<C>> {
        self.with_configs(|g| {
            if g.label == NO_DECAY {
                config.with_weight_decay(0.0)
            } else {
                config
            }
        })
    }

    /// The optimizer groups, each with the config `config_of(group)` gives.
    pub fn with_configs<C>(
        &self,
        mut config_of: impl FnMut(&NamedGroup) -> C,
    ) -> Vec<ParamGroup<C>> {
        self.groups
            .iter()
            .map(|g| ParamGroup::new(g.params.clone(), config_of(g)))
            .collect()
    }
}

/// One line: each group's label, number of tensors and of elements.
impl fmt::Display for ParamGroups {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, g) in self.groups.iter().enumerate() {
            if i > 0 {
                write!(f, ", ")?;
            }
            write!(
                f,
                "{}: {} tensors, {} elements",
                g.label,
                g.params.len(),
                g.numel()
            )?;
        }
        Ok(())
    }
}

/// The default weight-decay rule (GPT-2 / nanoGPT / Hugging Face convention): `false` for a
/// bias (last name segment `bias`), for a parameter of fewer than two dimensions (norm scales:
/// LayerNorm, RMSNorm, BatchNorm), and for a parameter of a module whose path names an
/// embedding (a segment `wte`, `wpe` or containing `emb`: `embedding`, `embed_tokens`,
/// `word_embeddings`, `tok_emb`) or a norm (a segment containing `norm`, or `ln`, `ln_*`,
/// `bn`, `bn<digits>`); `true` for every other weight.
pub fn decays_by_default(name: &str, param: &Tensor) -> bool {
    let mut segments: Vec<&str> = name.split('.').collect();
    let last = segments.pop().unwrap_or("");
    if last == "bias" || param.rank() < 2 {
        return false;
    }
    !segments.iter().any(|s| {
        let s = s.to_ascii_lowercase();
        let embedding = s == "wte" || s == "wpe" || s.contains("emb");
        let norm = s.contains("norm")
            || s == "ln"
            || s.starts_with("ln_")
            || s.strip_prefix("bn")
                .is_some_and(|d| d.chars().all(|c| c.is_ascii_digit()));
        embedding || norm
    })
}
