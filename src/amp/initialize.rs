//! `amp::initialize`: wraps models and optimizers per a policy, as apex's `amp.initialize`.
//!
//! - O0: nothing is cast; the scale is a static 1.
//! - O1: the wrapped forward runs under [`autocast`](mod@super::autocast); weights stay FP32.
//! - O2: the optimizer takes FP32 master copies of its parameters, then the model is cast to
//!   half (BatchNorm kept FP32 per the policy); the forward casts floating inputs to the half
//!   type and its output to FP32; each step updates the masters and rewrites the half weights.
//! - O3: the model is cast to half (BatchNorm too unless the policy keeps it FP32), no masters.
//!
//! Initializing activates the policy's `[ops]` lists (autocast classes of the crate's ops) for
//! the process, replacing those of the policy activated before.
//!
//! The wrapped model's `state_dict` is FP32 at every level (at O2 it holds the masters, so a
//! restore continues bitwise); the wrapped optimizer's state adds the scalers'.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};
use crate::nn::module::Module;
use crate::optim::{MasterWeights, Optimizer};
use crate::tensor::{DType, Device, Tensor, TensorId};

use super::fused;
use super::optimizer::{OptimizerParts, SharedScalers};
use super::policy::{Policy, Properties};
use super::registry::{any_registered, register};
use super::scaler::LossScaler;

// The wrappers live in their own files; these names stay reachable here as before.
pub use super::model::AmpModel;
pub use super::optimizer::{
    scale_loss, scale_loss_id, scale_loss_many, AmpOptimizer, AmpOptimizerState, ScaledBackward,
    ScalerSet,
};

/// Wraps one model and its optimizer per `policy` (see the module docs).
pub fn initialize<M: Module, O: Optimizer>(
    model: M,
    optimizer: O,
    policy: Policy,
) -> Result<(AmpModel<M>, AmpOptimizer<O>)> {
    let (mut ms, mut os) = initialize_many(vec![model], vec![optimizer], policy)?;
    match (ms.pop(), os.pop()) {
        (Some(m), Some(o)) => Ok((m, o)),
        _ => Err(Error::invalid_arg(
            "amp::initialize",
            "model",
            "nothing returned",
            "one model and one optimizer",
        )),
    }
}

/// What [`initialize_many`] returns: the wrapped models and optimizers, in the given order.
pub type Wrapped<M, O> = (Vec<AmpModel<M>>, Vec<AmpOptimizer<O>>);

/// Wraps several models and optimizers that share `num_losses` scalers (apex's
/// `amp.initialize([m0, m1], [opt0, opt1], num_losses=...)`). Every optimizer parameter must be
/// a parameter of one of the models.
pub fn initialize_many<M: Module, O: Optimizer>(
    models: Vec<M>,
    mut optimizers: Vec<O>,
    policy: Policy,
) -> Result<Wrapped<M, O>> {
    let props = policy.properties()?;
    // Every check before anything changes.
    let checked = validate(&models, &optimizers, &props)?;
    log_policy(&policy, &props);
    // The policy's `[ops]` lists replace the previous policy's (none: the crate's classes).
    super::autocast::set_policy_classes(&policy.op_classes);
    let masters = cast(&models, &mut optimizers, &props)?;
    let shared = shared_scalers(&policy, &props, checked.device)?;
    let models = models
        .into_iter()
        .zip(checked.model_ids)
        .map(|(inner, ids)| {
            register(&ids);
            AmpModel::new(inner, props, masters.clone(), ids)
        })
        .collect();
    let opts = optimizers
        .into_iter()
        .zip(checked.opt_ids)
        .enumerate()
        .map(|(index, (inner, ids))| {
            register(&ids);
            AmpOptimizer::new(OptimizerParts {
                inner,
                index,
                scalers: shared.clone(),
                master_weights: props.master_weights,
                device: checked.device,
                ids,
            })
        })
        .collect();
    Ok((models, opts))
}

/// What [`validate`] found out: each model's and optimizer's tensor ids (for the registry) and
/// the models' device.
struct Checked {
    model_ids: Vec<Vec<TensorId>>,
    opt_ids: Vec<Vec<TensorId>>,
    device: Device,
}

/// The checks of [`initialize_many`]: models and optimizers given, none wrapped before, each
/// parameter in one optimizer and in a model, FP32 parameters where the policy casts or keeps
/// masters.
fn validate<M: Module, O: Optimizer>(
    models: &[M],
    optimizers: &[O],
    props: &Properties,
) -> Result<Checked> {
    let op = "amp::initialize";
    if models.is_empty() || optimizers.is_empty() {
        return Err(Error::invalid_arg(
            op,
            "models/optimizers",
            format!("{} models, {} optimizers", models.len(), optimizers.len()),
            "at least one model and one optimizer",
        ));
    }
    let model_params: Vec<Vec<Tensor>> = models.iter().map(|m| m.parameters()).collect();
    let model_ids: Vec<Vec<TensorId>> = models
        .iter()
        .map(|m| {
            let mut ids = Vec::new();
            m.visit("", &mut |i| ids.push(i.tensor.id()));
            ids
        })
        .collect();
    let opt_ids: Vec<Vec<TensorId>> = optimizers
        .iter()
        .map(|o| o.params().iter().map(|p| p.id()).collect())
        .collect();
    let all: Vec<TensorId> = model_ids
        .iter()
        .chain(&opt_ids)
        .flatten()
        .copied()
        .collect();
    if any_registered(&all) {
        return Err(Error::invalid_arg(
            op,
            "model/optimizer",
            "parameters that amp::initialize has already wrapped",
            "a model and optimizer initialized once (call initialize once, with every model and optimizer)",
        ));
    }
    check_owners(&model_params, &opt_ids)?;
    let device = model_params
        .iter()
        .flatten()
        .next()
        .map(|p| p.device())
        .ok_or_else(|| {
            Error::invalid_arg(op, "model", "no parameters", "a model with parameters")
        })?;
    if props.cast_model_type.is_some_and(|t| t.is_half()) || props.master_weights {
        check_fp32(&model_params)?;
    }
    Ok(Checked {
        model_ids,
        opt_ids,
        device,
    })
}

/// Each optimizer parameter is in exactly one optimizer and is a parameter of the models.
fn check_owners(model_params: &[Vec<Tensor>], opt_ids: &[Vec<TensorId>]) -> Result<()> {
    let op = "amp::initialize";
    let mut owner: HashMap<TensorId, usize> = HashMap::new();
    for (k, ids) in opt_ids.iter().enumerate() {
        for id in ids {
            if let Some(j) = owner.insert(*id, k) {
                return Err(Error::invalid_arg(
                    op,
                    "optimizers",
                    format!("a parameter in optimizers {j} and {k}"),
                    "each parameter in one optimizer",
                ));
            }
        }
    }
    let known: HashSet<TensorId> = model_params.iter().flatten().map(|p| p.id()).collect();
    for (k, ids) in opt_ids.iter().enumerate() {
        if let Some(pos) = ids.iter().position(|id| !known.contains(id)) {
            return Err(Error::invalid_arg(
                op,
                "optimizer",
                format!("optimizer {k}, parameter {pos}: not a parameter of the models"),
                "optimizers over the models' parameters",
            ));
        }
    }
    Ok(())
}

/// apex's check_params_fp32: casting and masters start from FP32 models.
fn check_fp32(model_params: &[Vec<Tensor>]) -> Result<()> {
    for (k, ps) in model_params.iter().enumerate() {
        if let Some(p) = ps.iter().find(|p| p.dtype() != DType::F32) {
            return Err(Error::UnsupportedDType {
                op: if k == 0 {
                    "amp::initialize (model 0)"
                } else {
                    "amp::initialize (a model)"
                },
                got: p.dtype(),
                expected: "FP32 parameters before initialize (it casts them per the policy)",
            });
        }
    }
    Ok(())
}

/// A program prints its own summary; the library's line is for those who ask (verbosity 2 or
/// RUST_LOG=debug).
fn log_policy(policy: &Policy, props: &Properties) {
    let level = if policy.verbosity > 1 {
        log::Level::Info
    } else {
        log::Level::Debug
    };
    if policy.verbosity > 0 {
        let moved: Vec<String> = policy
            .op_classes
            .iter()
            .map(|(op, class)| format!("{op} {class:?}"))
            .collect();
        let moved = if moved.is_empty() {
            String::new()
        } else {
            format!("; ops moved: {}", moved.join(", "))
        };
        log::log!(
            level,
            "amp: {} from {}: {props}{moved}",
            policy.opt_level,
            policy.source
        );
    }
}

/// The masters, then the model cast (masters are copied from the FP32 weights); returns the
/// optimizers' masters, which the wrapped models read.
fn cast<M: Module, O: Optimizer>(
    models: &[M],
    optimizers: &mut [O],
    props: &Properties,
) -> Result<Vec<Arc<MasterWeights>>> {
    if props.master_weights {
        for o in optimizers.iter_mut() {
            fused::use_master_weights(o)?;
        }
    }
    if let Some(t) = props.cast_model_type {
        for m in models {
            m.cast(t, props.keep_batchnorm_fp32)?;
        }
    }
    Ok(optimizers
        .iter()
        .filter_map(|o| o.master_weights())
        .collect())
}

/// The policy's `num_losses` scalers, shared by the optimizers of this call.
fn shared_scalers(policy: &Policy, props: &Properties, device: Device) -> Result<SharedScalers> {
    let scalers = (0..policy.num_losses)
        .map(|i| LossScaler::new(i, policy, props, device))
        .collect::<Result<Vec<_>>>()?;
    Ok(Arc::new(Mutex::new(ScalerSet::new(scalers))))
}
