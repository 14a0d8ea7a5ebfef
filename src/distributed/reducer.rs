//! DDP's gradient buckets: the trainable parameters in reverse registration order (the order
//! backward produces their gradients), cut into buckets of about `bucket_cap` bytes of one dtype
//! (a 1 MiB first bucket, to start communicating early), as PyTorch's reducer does.
//!
//! During backward a hook marks each parameter ready once its gradient is final; a bucket whose
//! parameters are all ready is launched at once, buckets strictly in index order (so that every
//! rank issues the same collectives in the same order): its gradients are copied into one flat
//! tensor and averaged by an asynchronous all-reduce, on NCCL's communication stream, while the
//! rest of backward runs. At the end of backward (an autograd callback) the reducer launches what
//! is left, orders the compute stream after every bucket's all-reduce, and gives each parameter
//! its averaged gradient. So anything that runs after backward (AMP's overflow check, the
//! optimizer) reads the reduced gradients, on every rank the same.
//!
//! The buckets are copies: gradients are packed with `cat`, and after the reduction each is cut
//! out of its bucket (a view) and copied into a buffer of its own, because the fused
//! optimizers' multi-tensor kernels take whole buffers. When they take views, `unflatten` keeps
//! the view (gradients as views of the bucket, PyTorch's `gradient_as_bucket_view`), and `launch`
//! is where persistent bucket storage would replace the `cat`: nothing else here changes.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use super::group::{ProcessGroup, ReduceOp, Work};
use crate::autograd::queue_callback;
use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};

/// What the reducer is told by `DdpConfig`.
#[derive(Clone, Debug)]
pub(crate) struct ReducerConfig {
    pub(crate) bucket_cap_bytes: usize,
    pub(crate) first_bucket_bytes: usize,
    pub(crate) predivide: Option<f64>,
    pub(crate) reduce_dtype: Option<DType>,
    pub(crate) find_unused: bool,
}

/// One bucket: parameter indices in the order they are packed.
#[derive(Clone, Debug)]
pub(crate) struct Bucket {
    pub(crate) params: Vec<usize>,
    pub(crate) dtype: DType,
    pub(crate) numel: usize,
}

struct Layout {
    /// The parameters' dtypes when the layout was made (a cast after wrapping re-makes it).
    dtypes: Vec<DType>,
    buckets: Vec<Bucket>,
    /// Per parameter: its bucket.
    bucket_of: Vec<usize>,
}

/// Statistics of the last reduction, for tests and logs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReductionStats {
    /// Buckets launched from the gradient hooks, while backward was still running.
    pub launched_during_backward: usize,
    pub buckets: usize,
}

#[derive(Default)]
struct Round {
    active: bool,
    sync: bool,
    ready: Vec<bool>,
    pending: Vec<usize>,
    next_launch: usize,
    inflight: Vec<Option<(Tensor, Work)>>,
    callback_queued: bool,
    stats: ReductionStats,
}

struct State {
    layout: Option<Layout>,
    round: Round,
    last: ReductionStats,
}

pub(crate) struct Reducer {
    group: ProcessGroup,
    params: Vec<Tensor>,
    cfg: ReducerConfig,
    /// False inside `no_sync()`.
    sync: Arc<AtomicBool>,
    state: Mutex<State>,
    me: Weak<Reducer>,
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// PyTorch's assignment: per dtype, fill a bucket up to the limit (the first one up to
/// `first`), in the given order; then order the buckets by their first parameter.
pub(crate) fn assign_buckets(
    order: &[usize],
    dtypes: &[DType],
    numels: &[usize],
    first: usize,
    cap: usize,
) -> Vec<Bucket> {
    let mut open: Vec<(DType, Bucket, usize)> = Vec::new();
    let mut closed: Vec<(usize, Bucket)> = Vec::new();
    let mut firsts_done: Vec<DType> = Vec::new();
    let mut position: Vec<usize> = vec![0; dtypes.len()];
    for (pos, &i) in order.iter().enumerate() {
        position[i] = pos;
        let d = dtypes[i];
        let k = match open.iter().position(|(od, _, _)| *od == d) {
            Some(k) => k,
            None => {
                open.push((
                    d,
                    Bucket {
                        params: Vec::new(),
                        dtype: d,
                        numel: 0,
                    },
                    0,
                ));
                open.len() - 1
            }
        };
        let (_, b, bytes) = &mut open[k];
        b.params.push(i);
        b.numel += numels[i];
        *bytes += numels[i] * d.size_in_bytes();
        let limit = if firsts_done.contains(&d) { cap } else { first };
        if *bytes >= limit {
            let (_, b, _) = open.swap_remove(k);
            firsts_done.push(d);
            closed.push((position[b.params[0]], b));
        }
    }
    for (_, b, _) in open {
        closed.push((position[b.params[0]], b));
    }
    closed.sort_by_key(|(p, _)| *p);
    closed.into_iter().map(|(_, b)| b).collect()
}

impl Reducer {
    pub(crate) fn new(
        group: ProcessGroup,
        params: Vec<Tensor>,
        cfg: ReducerConfig,
        sync: Arc<AtomicBool>,
    ) -> Arc<Reducer> {
        Arc::new_cyclic(|me| Reducer {
            group,
            params,
            cfg,
            sync,
            state: Mutex::new(State {
                layout: None,
                round: Round::default(),
                last: ReductionStats::default(),
            }),
            me: me.clone(),
        })
    }

    /// The buckets for the parameters' current dtypes (made again after a cast).
    fn layout<'a>(&self, st: &'a mut State) -> &'a Layout {
        let dtypes: Vec<DType> = self.params.iter().map(|p| p.dtype()).collect();
        if st.layout.as_ref().is_none_or(|l| l.dtypes != dtypes) {
            let order: Vec<usize> = (0..self.params.len()).rev().collect();
            let numels: Vec<usize> = self.params.iter().map(|p| p.elem_count()).collect();
            let buckets = assign_buckets(
                &order,
                &dtypes,
                &numels,
                self.cfg.first_bucket_bytes,
                self.cfg.bucket_cap_bytes,
            );
            let mut bucket_of = vec![0; self.params.len()];
            for (b, bucket) in buckets.iter().enumerate() {
                for &i in &bucket.params {
                    bucket_of[i] = b;
                }
            }
            st.layout = Some(Layout {
                dtypes,
                buckets,
                bucket_of,
            });
        }
        st.layout.as_ref().expect("layout was just made")
    }

    pub(crate) fn buckets(&self) -> Vec<Bucket> {
        let mut st = lock(&self.state);
        self.layout(&mut st).buckets.clone()
    }

    pub(crate) fn last_stats(&self) -> ReductionStats {
        lock(&self.state).last
    }

    /// A forward is about to run: the next backward reduces (unless `no_sync`).
    pub(crate) fn prepare(&self) -> Result<()> {
        let mut st = lock(&self.state);
        self.begin(&mut st)
    }

    fn begin(&self, st: &mut State) -> Result<()> {
        // A round that never finished (its backward failed): let its collectives complete.
        let stale = std::mem::take(&mut st.round);
        for (_, w) in stale.inflight.into_iter().flatten() {
            let _ = w.wait();
        }
        let n = self.params.len();
        let nb = self.layout(st).buckets.len();
        let pending = st
            .layout
            .as_ref()
            .map(|l| l.buckets.iter().map(|b| b.params.len()).collect())
            .unwrap_or_default();
        st.round = Round {
            active: true,
            sync: self.sync.load(Ordering::Acquire),
            ready: vec![false; n],
            pending,
            next_launch: 0,
            inflight: (0..nb).map(|_| None).collect(),
            callback_queued: false,
            stats: ReductionStats {
                launched_during_backward: 0,
                buckets: nb,
            },
        };
        Ok(())
    }

    /// The gradient hook: parameter `i`'s gradient for this backward is final.
    pub(crate) fn on_ready(&self, i: usize) -> Result<()> {
        let mut st = lock(&self.state);
        if !st.round.active {
            // A backward without a forward through the wrapper since the last reduction (a
            // second backward of one graph): it reduces too.
            self.begin(&mut st)?;
        }
        if !st.round.sync {
            return Ok(());
        }
        if !st.round.callback_queued {
            let me = self.me.clone();
            queue_callback(move || match me.upgrade() {
                Some(r) => r.finalize(),
                None => Ok(()),
            })?;
            st.round.callback_queued = true;
        }
        if st.round.ready[i] {
            return Ok(());
        }
        st.round.ready[i] = true;
        let b = st.layout.as_ref().map_or(0, |l| l.bucket_of[i]);
        st.round.pending[b] -= 1;
        while st.round.next_launch < st.round.pending.len()
            && st.round.pending[st.round.next_launch] == 0
        {
            let k = st.round.next_launch;
            self.launch(&mut st, k)?;
            st.round.stats.launched_during_backward += 1;
        }
        Ok(())
    }

    /// Packs bucket `k`'s gradients (zeros for parameters without one) and starts its all-reduce.
    fn launch(&self, st: &mut State, k: usize) -> Result<()> {
        let bucket = st
            .layout
            .as_ref()
            .map(|l| l.buckets[k].clone())
            .ok_or_else(|| Error::Backward("DDP: no bucket layout".into()))?;
        let _g = crate::no_grad();
        let mut parts = Vec::with_capacity(bucket.params.len());
        for &i in &bucket.params {
            let p = &self.params[i];
            let g = match p.grad() {
                Some(g) => g,
                None => Tensor::zeros(p.shape().clone(), p.dtype(), p.device())?,
            };
            parts.push(g.flatten_all()?);
        }
        let refs: Vec<&Tensor> = parts.iter().collect();
        let mut flat = Tensor::cat(&refs, 0)?;
        if let Some(d) = self.cfg.reduce_dtype.filter(|d| *d != bucket.dtype) {
            flat = flat.to_dtype(d)?;
        }
        let op = match self.cfg.predivide {
            Some(f) => {
                flat = flat.affine(1.0 / f, 0.0)?;
                ReduceOp::Sum
            }
            None => ReduceOp::Avg,
        };
        let work = self.group.all_reduce_async(&flat, op)?;
        st.round.inflight[k] = Some((flat, work));
        st.round.next_launch = k + 1;
        Ok(())
    }

    /// The end of backward: launch what is left, wait (stream-ordered) for every bucket and
    /// hand each parameter its averaged gradient.
    pub(crate) fn finalize(&self) -> Result<()> {
        let mut st = lock(&self.state);
        if !st.round.active || !st.round.sync {
            return Ok(());
        }
        let unused: Vec<usize> = (0..self.params.len())
            .filter(|&i| !st.round.ready[i])
            .collect();
        if !unused.is_empty() && !self.cfg.find_unused {
            st.round.active = false;
            let inflight = std::mem::take(&mut st.round.inflight);
            drop(st);
            for (_, w) in inflight.into_iter().flatten() {
                let _ = w.wait();
            }
            let names: Vec<String> = unused.iter().take(5).map(|i| format!("#{i}")).collect();
            return Err(self.group.abort(
                Some(self.group.rank()),
                format!(
                    "DistributedDataParallel: {} parameter(s) (registration index {}{}) got no \
                     gradient in this backward on rank {}; when some parameters do not take part \
                     in every forward, set DdpConfig::find_unused_parameters",
                    unused.len(),
                    names.join(", "),
                    if unused.len() > 5 { ", ..." } else { "" },
                    self.group.rank()
                ),
            ));
        }
        while st.round.next_launch < st.round.pending.len() {
            let k = st.round.next_launch;
            self.launch(&mut st, k)?;
        }
        let buckets = st
            .layout
            .as_ref()
            .map(|l| l.buckets.clone())
            .unwrap_or_default();
        let inflight = std::mem::take(&mut st.round.inflight);
        st.round.active = false;
        st.last = st.round.stats;
        drop(st);
        let world = self.group.world_size() as f64;
        let _g = crate::no_grad();
        for (bucket, slot) in buckets.iter().zip(inflight) {
            let Some((flat, work)) = slot else { continue };
            work.wait()?;
            self.unflatten(bucket, &flat, world)?;
        }
        Ok(())
    }

    /// Gives each parameter of `bucket` its part of the reduced `flat`.
    fn unflatten(&self, bucket: &Bucket, flat: &Tensor, world: f64) -> Result<()> {
        let mut flat = flat.clone();
        if let Some(f) = self.cfg.predivide {
            flat = flat.affine(f / world, 0.0)?;
        }
        if flat.dtype() != bucket.dtype {
            flat = flat.to_dtype(bucket.dtype)?;
        }
        let mut at = 0;
        for &i in &bucket.params {
            let p = &self.params[i];
            let n = p.elem_count();
            // A view of the bucket, then a buffer of the gradient's own laid out as its
            // parameter (channels_last included): the fused optimizers take whole buffers, not
            // views. When they take views, `owned` goes and the gradient stays in the bucket.
            let g = flat
                .narrow(0, at, n)?
                .reshape(p.shape().clone())?
                .laid_out_like(p)?;
            let g = if g.same_storage(&flat) { g.owned()? } else { g };
            p.set_grad(Some(g));
            at += n;
        }
        Ok(())
    }
}
