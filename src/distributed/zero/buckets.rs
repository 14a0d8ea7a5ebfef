//! The sharded optimizer's gradient buckets during backward, as DDP's reducer launches its
//! all-reduces: a hook on every parameter marks it ready once its gradient for this backward is
//! final; a bucket whose parameters are all ready is packed into its flat buffer and
//! reduce-scattered (averaged) into this rank's chunk at once, on the communication stream,
//! while backward goes on; buckets strictly in launch order, so every rank issues the same
//! collectives in the same order. The step launches what is left (parameters without a
//! gradient count as zeros) and waits for every bucket (stream-ordered under NCCL).
//!
//! With gradient accumulation over k backward passes a step
//! ([`ShardedOptimizer::set_micro_batches`](super::ShardedOptimizer::set_micro_batches)), a
//! gradient is final at its k-th hook of the round. A parameter whose gradient grows again
//! after its bucket was launched (more backward passes than k before the step) makes the
//! launched reduction stale: the round is then marked, nothing more launches from the hooks,
//! and the step reduces every bucket again from the final gradients. Correct whatever the
//! caller does, and the same on every rank (the hooks follow the same graph there); only the
//! overlap is lost.

use std::sync::{Arc, Mutex, MutexGuard};

use super::super::group::Work;
use super::*;
use crate::distributed::ReductionStats;

/// One bucket's buffers, made once.
pub(super) struct GradBucket {
    /// Parameter positions (across the groups), in their order in the bucket.
    pub(super) params: Vec<usize>,
    /// Per parameter: its part of `buffer`, `[elements]`.
    pub(super) parts: Vec<Tensor>,
    /// The bucket's gradients in flat order, `[padded]` (the padding stays zero).
    pub(super) buffer: Tensor,
    /// This rank's chunk of the averaged gradients, `[chunk]`.
    pub(super) out: Tensor,
}

/// What the hooks work with once the layout exists.
pub(super) struct BucketPlan {
    pub(super) group: ProcessGroup,
    /// Every parameter, by position across the groups.
    pub(super) params: Vec<Tensor>,
    /// In launch order.
    pub(super) buckets: Vec<GradBucket>,
    /// Per parameter: its bucket.
    pub(super) bucket_of: Vec<usize>,
    /// The packing copy's scale (1) and Inf flag (set by the copy, read by nothing: the step
    /// checks the averaged chunks).
    pub(super) one: Tensor,
    pub(super) unused_flag: Tensor,
    /// Backward passes a step (its gradients are final at the last).
    pub(super) micro_batches: usize,
}

#[derive(Default)]
struct Round {
    /// Per parameter: its hooks this round.
    seen: Vec<usize>,
    /// Per bucket: its parameters not ready yet.
    pending: Vec<usize>,
    next_launch: usize,
    inflight: Vec<Work>,
    /// A gradient grew after its bucket was launched: the step reduces everything again.
    stale: bool,
    stats: ReductionStats,
}

struct State {
    plan: Option<BucketPlan>,
    round: Round,
    last: ReductionStats,
}

/// Shared by the parameters' hooks and the optimizer.
pub(super) struct GradBuckets {
    state: Mutex<State>,
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl GradBuckets {
    pub(super) fn new() -> Arc<GradBuckets> {
        Arc::new(GradBuckets {
            state: Mutex::new(State {
                plan: None,
                round: Round::default(),
                last: ReductionStats::default(),
            }),
        })
    }

    /// The buckets, once the layout is fixed (before it, the hooks do nothing and the step
    /// reduces every bucket).
    pub(super) fn set_plan(&self, plan: BucketPlan) {
        let mut st = lock(&self.state);
        st.round = fresh_round(&plan);
        st.plan = Some(plan);
    }

    pub(super) fn last(&self) -> ReductionStats {
        lock(&self.state).last
    }

    /// The hook: parameter `i`'s gradient for this backward is final.
    pub(super) fn on_ready(&self, i: usize) -> Result<()> {
        let mut st = lock(&self.state);
        let st = &mut *st;
        let Some(plan) = &st.plan else {
            return Ok(());
        };
        let b = plan.bucket_of[i];
        st.round.seen[i] += 1;
        if st.round.seen[i] > plan.micro_batches {
            // Its gradient grew again: stale if its bucket already left.
            if b < st.round.next_launch {
                st.round.stale = true;
            }
            return Ok(());
        }
        if st.round.seen[i] < plan.micro_batches {
            return Ok(());
        }
        st.round.pending[b] -= 1;
        if st.round.stale {
            return Ok(());
        }
        while st.round.next_launch < st.round.pending.len()
            && st.round.pending[st.round.next_launch] == 0
        {
            let k = st.round.next_launch;
            st.round.inflight.push(launch(plan, k)?);
            st.round.next_launch = k + 1;
            st.round.stats.launched_during_backward += 1;
        }
        Ok(())
    }

    /// The step's reduction: launches the buckets left (all of them again after a stale
    /// round), waits for every one, and starts a new round. Each bucket's `out` then holds
    /// this rank's chunk of the averaged gradients.
    pub(super) fn finish(&self) -> Result<()> {
        let mut st = lock(&self.state);
        let st = &mut *st;
        let Some(plan) = &st.plan else {
            return Err(Error::Unsupported {
                op: "ZeRO reduce-scatter",
                detail: "the step's reduction before the layout exists".into(),
            });
        };
        let mut round = std::mem::replace(&mut st.round, fresh_round(plan));
        if round.stale {
            for w in round.inflight.drain(..) {
                w.wait()?;
            }
            round.next_launch = 0;
            round.stats.launched_during_backward = 0;
        }
        let _ng = crate::no_grad();
        for k in round.next_launch..plan.buckets.len() {
            round.inflight.push(launch(plan, k)?);
        }
        st.last = round.stats;
        for w in round.inflight {
            w.wait()?;
        }
        Ok(())
    }

    /// Drops the round in progress (its collectives complete first): `zero_grad`.
    pub(super) fn reset(&self) {
        let mut st = lock(&self.state);
        let st = &mut *st;
        let Some(plan) = &st.plan else {
            return;
        };
        let round = std::mem::replace(&mut st.round, fresh_round(plan));
        for w in round.inflight {
            let _ = w.wait();
        }
    }
}

fn fresh_round(plan: &BucketPlan) -> Round {
    Round {
        seen: vec![0; plan.params.len()],
        pending: plan.buckets.iter().map(|b| b.params.len()).collect(),
        next_launch: 0,
        inflight: Vec::new(),
        stale: false,
        stats: ReductionStats {
            launched_during_backward: 0,
            buckets: plan.buckets.len(),
        },
    }
}

/// Packs bucket `k`'s gradients (zeros for a parameter without one) into its buffer and
/// starts the reduce-scatter of its average into this rank's chunk.
fn launch(plan: &BucketPlan, k: usize) -> Result<Work> {
    let _ng = crate::no_grad();
    let b = &plan.buckets[k];
    let mut grads = Vec::with_capacity(b.params.len());
    for &i in &b.params {
        let p = &plan.params[i];
        let n = p.elem_count();
        grads.push(match p.grad() {
            Some(g) => g.detach().reshape([n])?,
            None => Tensor::zeros([n], p.dtype(), p.device())?,
        });
    }
    multi_tensor::scale(&grads, &b.parts, &plan.one, &plan.unused_flag)?;
    plan.group
        .reduce_scatter_async(&b.buffer, &b.out, ReduceOp::Avg)
}
