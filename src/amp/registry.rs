//! The registry of parameters that a live `AmpModel`/`AmpOptimizer` wraps: `initialize` refuses
//! them a second time, and each wrapper's `Drop` takes its own out again.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};

use crate::tensor::TensorId;

/// Parameters that a live `AmpModel`/`AmpOptimizer` wraps: initializing them again is an error.
static REGISTRY: Mutex<Option<HashMap<TensorId, usize>>> = Mutex::new(None);

fn registry() -> MutexGuard<'static, Option<HashMap<TensorId, usize>>> {
    REGISTRY.lock().unwrap_or_else(|e| e.into_inner())
}

/// Registers `ids` (each wrapper registers its own; the count allows a model and its optimizer
/// to hold the same parameter).
pub(super) fn register(ids: &[TensorId]) {
    let mut g = registry();
    let m = g.get_or_insert_with(HashMap::new);
    for id in ids {
        *m.entry(*id).or_insert(0) += 1;
    }
}

pub(super) fn unregister(ids: &[TensorId]) {
    let mut g = registry();
    if let Some(m) = g.as_mut() {
        for id in ids {
            if let Some(n) = m.get_mut(id) {
                *n -= 1;
                if *n == 0 {
                    m.remove(id);
                }
            }
        }
    }
}

pub(super) fn any_registered(ids: &[TensorId]) -> bool {
    registry()
        .as_ref()
        .is_some_and(|m| ids.iter().any(|id| m.contains_key(id)))
}
