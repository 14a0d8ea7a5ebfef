//! Dropout draws recorded and replayed, for activation checkpointing (`autograd::checkpoint`):
//! a checkpointed forward records the generator state each dropout drew its mask at, and the
//! recompute in backward draws each mask again from that state, in order, instead of from the
//! generator. The generator itself is neither read nor advanced by a replayed draw, so the ops
//! after the checkpointed block draw exactly what they would have drawn without it.
//!
//! Both are thread-local scopes around a closure; a state is a device tensor (a copy made by the
//! draw itself), so recording and replaying read nothing on the host and are capturable.

use std::cell::RefCell;

use super::{Device, Tensor};
use crate::backend::DropoutParams;
use crate::base::error::{Error, Result};

/// One dropout draw: the generator state it drew at (`[seed, offset]`, a copy of its own) and
/// what it drew over.
#[derive(Clone, Debug)]
pub(crate) struct Draw {
    state: Tensor,
    n: usize,
    p: f64,
}

struct Replay {
    draws: Vec<Draw>,
    next: usize,
}

thread_local! {
    static RECORDING: RefCell<Option<Vec<Draw>>> = const { RefCell::new(None) };
    static REPLAYING: RefCell<Option<Replay>> = const { RefCell::new(None) };
}

/// Runs `f`, returning with its result every dropout draw made on this thread meanwhile, in
/// order. An enclosing recording sees them too.
pub(crate) fn record<R>(f: impl FnOnce() -> R) -> (R, Vec<Draw>) {
    let prev = RECORDING.with(|r| r.borrow_mut().replace(Vec::new()));
    let out = f();
    let draws = RECORDING.with(|r| {
        let mut r = r.borrow_mut();
        let draws = r.take().unwrap_or_default();
        *r = prev.map(|mut p| {
            p.extend(draws.iter().cloned());
            p
        });
        draws
    });
    (out, draws)
}

/// Runs `f` with the dropout draws on this thread taken from `draws`, in order: each must draw
/// over as many values at the same probability as the recorded one, and every recorded draw
/// must be used, else an error naming `op`.
pub(crate) fn replay<R>(op: &str, draws: &[Draw], f: impl FnOnce() -> Result<R>) -> Result<R> {
    let fresh = Replay {
        draws: draws.to_vec(),
        next: 0,
    };
    let prev = REPLAYING.with(|r| r.borrow_mut().replace(fresh));
    let out = f();
    let used = REPLAYING.with(|r| {
        let mut r = r.borrow_mut();
        let used = r.as_ref().map_or(0, |s| s.next);
        *r = prev;
        used
    });
    let out = out?;
    if used != draws.len() {
        return Err(Error::Backward(format!(
            "{op}: the recompute made {used} dropout draws where the forward made {} (a \
             checkpointed function must repeat its forward: the same shapes and the same \
             train/eval mode)",
            draws.len()
        )));
    }
    Ok(out)
}

/// The state a dropout over `p.n` values on `device` draws at now, when a replay is running: a
/// copy of the recorded state (the draw advances what it is given). `None` outside a replay.
pub(crate) fn next_state(p: &DropoutParams, device: Device) -> Result<Option<Tensor>> {
    let draw = REPLAYING.with(|r| {
        let mut r = r.borrow_mut();
        let Some(s) = r.as_mut() else {
            return Ok(None);
        };
        let i = s.next;
        let Some(d) = s.draws.get(i) else {
            return Err(Error::Backward(format!(
                "checkpoint: the recompute makes dropout draw {} (over {} values at p {}) where \
                 the forward made {} draws (a checkpointed function must repeat its forward)",
                i + 1,
                p.n,
                p.p,
                s.draws.len()
            )));
        };
        if d.n != p.n || d.p != p.p || d.state.device() != device {
            return Err(Error::Backward(format!(
                "checkpoint: the recompute's dropout draw {} is over {} values at p {} on {}; the \
                 forward's was over {} values at p {} on {} (a checkpointed function must \
                 repeat its forward)",
                i + 1,
                p.n,
                p.p,
                device,
                d.n,
                d.p,
                d.state.device()
            )));
        }
        s.next += 1;
        Ok(Some(d.state.clone()))
    })?;
    draw.map(|s| s.owned()).transpose()
}

/// Notes a draw made at `state` (the draw's own copy) for the recording running, if any.
pub(crate) fn note(state: &Tensor, p: &DropoutParams) {
    RECORDING.with(|r| {
        if let Some(v) = r.borrow_mut().as_mut() {
            v.push(Draw {
                state: state.clone(),
                n: p.n,
                p: p.p,
            });
        }
    });
}
