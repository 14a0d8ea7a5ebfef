//! DDP's gradient buckets: the trainable parameters in reverse registration order (the order
//! backward produces their gradients), cut into buckets of about `bucket_cap` bytes of one dtype
//! (a 1 MiB first bucket, to start communicating early), as PyTorch's reducer does.
//!
//! During backward a hook marks each parameter ready once its gradient is final; a bucket whose
//! parameters are all ready is launched at once, buckets strictly in index order (so that every
//! rank issues the same collectives in the same order): its gradients are packed into the
//! bucket's flat buffer and averaged by an asynchronous all-reduce, on NCCL's communication
//! stream, while the rest of backward runs. At the end of backward (an autograd callback) the
//! reducer launches what is left, orders the compute stream after every bucket's all-reduce, and
//! gives each parameter its averaged gradient. So anything that runs after backward (AMP's
//! overflow check, the optimizer) reads the reduced gradients, on every rank the same.
//!
//! Each bucket's flat buffer is made once (per parameter dtypes and layouts) and reused every
//! step; a parameter's part starts 16-element aligned so the copies run vectorised. Packing
//! and unpacking are one multi-tensor launch per bucket each, walking each gradient's memory in
//! its own order (a channels_last gradient travels in NHWC order; ranks agree on strides, which
//! `DistributedDataParallel::new` checks). The average goes back into each gradient's own
//! buffer when nothing else can see it (a persistent gradient, which so keeps its address across
//! steps as the optimizers' cached tensor tables need, or one no other handle holds); a gradient
//! handed out keeps its values, and the parameter gets a new buffer instead. PyTorch's
//! `gradient_as_bucket_view` (gradients that *are* bucket views) would save the two copies too,
//! but would make the optimizers' tables and `zero_grad` deal in views of one buffer; the copies
//! cost two launches per bucket.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use super::collective::ReduceOp;
use super::group::{ProcessGroup, Work};
use crate::autograd::queue_callback;
use crate::error::{Error, Result};
use crate::multi_tensor;
use crate::tensor::{DType, Tensor};

/// Where a parameter's part of its bucket starts: a multiple of this many elements (16 bytes or
/// more in every float dtype, so the multi-tensor copies load and store four at a time).
const PART_ALIGN: usize = 16;

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

#[derive(Clone)]
struct Layout {
    /// The parameters' dtypes and strides when the layout was made (a cast or a change of
    /// memory format after wrapping re-makes it).
    dtypes: Vec<(DType, Vec<usize>)>,
    buckets: Vec<Bucket>,
    /// Per parameter: its bucket.
    bucket_of: Vec<usize>,
    /// Per bucket: its flat buffer in the reduction's dtype, reused every step (the padding
    /// between parts stays zero).
    flats: Vec<Tensor>,
    /// Per parameter: its part of its bucket's flat buffer (a one-dimensional view).
    parts: Vec<Tensor>,
    /// F32 device scalars of the packing and unpacking copies: `1 / predivide` and
    /// `predivide / world` (both 1 without a predivide factor), and the Inf flag that the copy
    /// kernel sets and nothing reads.
    pack_scale: Tensor,
    unpack_scale: Tensor,
    unused_flag: Tensor,
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

    /// The buckets for the parameters' current dtypes and layouts (made again after a cast or a
    /// change of memory format), with their flat buffers.
    fn layout<'a>(&self, st: &'a mut State) -> Result<&'a Layout> {
        let dtypes: Vec<(DType, Vec<usize>)> = self
            .params
            .iter()
            .map(|p| (p.dtype(), p.layout().strides().to_vec()))
            .collect();
        if st.layout.as_ref().is_none_or(|l| l.dtypes != dtypes) {
            st.layout = None;
            let numels: Vec<usize> = self.params.iter().map(|p| p.elem_count()).collect();
            let buckets = self.buckets();
            let device = self.group.device();
            let _g = crate::no_grad();
            let mut bucket_of = vec![0; self.params.len()];
            let mut parts: Vec<Option<Tensor>> = vec![None; self.params.len()];
            let mut flats = Vec::with_capacity(buckets.len());
            for (b, bucket) in buckets.iter().enumerate() {
                let mut starts = Vec::with_capacity(bucket.params.len());
                let mut len = 0;
                for &i in &bucket.params {
                    bucket_of[i] = b;
                    starts.push(len);
                    len += numels[i].div_ceil(PART_ALIGN) * PART_ALIGN;
                }
                let dtype = self.cfg.reduce_dtype.unwrap_or(bucket.dtype);
                let flat = Tensor::zeros([len], dtype, device)?;
                for (&i, &at) in bucket.params.iter().zip(&starts) {
                    parts[i] = Some(flat.narrow(0, at, numels[i])?);
                }
                flats.push(flat);
            }
            let world = self.group.world_size() as f64;
            let (pack, unpack) = match self.cfg.predivide {
                Some(f) => (1.0 / f, f / world),
                None => (1.0, 1.0),
            };
            st.layout = Some(Layout {
                dtypes,
                buckets,
                bucket_of,
                flats,
                parts: parts
                    .into_iter()
                    .map(|p| {
                        p.ok_or_else(|| Error::Backward("DDP: a parameter without a bucket".into()))
                    })
                    .collect::<Result<_>>()?,
                pack_scale: multi_tensor::scalar_on(device, pack)?,
                unpack_scale: multi_tensor::scalar_on(device, unpack)?,
                unused_flag: multi_tensor::scalar_on(device, 0.0)?,
            });
        }
        st.layout
            .as_ref()
            .ok_or_else(|| Error::Backward("DDP: no bucket layout".into()))
    }

    /// The buckets for the parameters' current dtypes (what `layout` makes, without buffers).
    pub(crate) fn buckets(&self) -> Vec<Bucket> {
        let order: Vec<usize> = (0..self.params.len()).rev().collect();
        let dtypes: Vec<DType> = self.params.iter().map(|p| p.dtype()).collect();
        let numels: Vec<usize> = self.params.iter().map(|p| p.elem_count()).collect();
        assign_buckets(
            &order,
            &dtypes,
            &numels,
            self.cfg.first_bucket_bytes,
            self.cfg.bucket_cap_bytes,
        )
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
        let nb = self.layout(st)?.buckets.len();
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

    /// Packs bucket `k`'s gradients (zeros for parameters without one) into its flat buffer and
    /// starts its all-reduce there.
    fn launch(&self, st: &mut State, k: usize) -> Result<()> {
        let l = st
            .layout
            .as_ref()
            .ok_or_else(|| Error::Backward("DDP: no bucket layout".into()))?;
        let _g = crate::no_grad();
        let bucket = &l.buckets[k];
        let mut grads = Vec::with_capacity(bucket.params.len());
        let mut parts = Vec::with_capacity(bucket.params.len());
        for &i in &bucket.params {
            let p = &self.params[i];
            let g = match p.grad() {
                Some(g) => g,
                None => p.zeros_like()?,
            };
            grads.push(span_of(&g, p)?);
            parts.push(l.parts[i].clone());
        }
        let flat = l.flats[k].clone();
        multi_tensor::scale(&grads, &parts, &l.pack_scale, &l.unused_flag)?;
        let op = if self.cfg.predivide.is_some() {
            ReduceOp::Sum
        } else {
            ReduceOp::Avg
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
        let inflight = std::mem::take(&mut st.round.inflight);
        st.round.active = false;
        st.last = st.round.stats;
        // Handles only (the buffers are shared): the lock is not held while collectives finish.
        let l = st
            .layout
            .clone()
            .ok_or_else(|| Error::Backward("DDP: no bucket layout".into()))?;
        drop(st);
        let _g = crate::no_grad();
        for (bucket, slot) in l.buckets.iter().zip(inflight) {
            let Some((_, work)) = slot else { continue };
            work.wait()?;
            self.unpack(&l, bucket)?;
        }
        Ok(())
    }

    /// Gives each parameter of `bucket` its part of the reduced flat buffer: in place into its
    /// gradient when that is its persistent buffer or held by nothing else, else into a new
    /// buffer laid out as the parameter.
    fn unpack(&self, l: &Layout, bucket: &Bucket) -> Result<()> {
        let mut parts = Vec::with_capacity(bucket.params.len());
        let mut dst = Vec::with_capacity(bucket.params.len());
        let mut fresh = Vec::new();
        for &i in &bucket.params {
            let p = &self.params[i];
            let g = match p.grad_writable_in_place() {
                Some(g) if g.layout().strides() == p.layout().strides() => g,
                _ => {
                    let g = p.zeros_like()?;
                    fresh.push((i, g.clone()));
                    g
                }
            };
            dst.push(span_of(&g, p)?);
            parts.push(l.parts[i].clone());
        }
        multi_tensor::scale(&parts, &dst, &l.unpack_scale, &l.unused_flag)?;
        for (i, g) in fresh {
            self.params[i].set_grad(Some(g));
        }
        Ok(())
    }
}

/// The span of memory gradient `g` of `p` covers, in `p`'s memory order (see
/// [`Tensor::memory_span`]): packing and unpacking then agree element for element. A gradient
/// laid out otherwise (one a user set) is copied into `p`'s layout first.
fn span_of(g: &Tensor, p: &Tensor) -> Result<Tensor> {
    g.laid_out_like(p)?.memory_span().ok_or_else(|| {
        Error::invalid_arg(
            "DistributedDataParallel",
            "parameter",
            format!("strides {:?}", p.layout().strides()),
            "a dense parameter (its gradient is packed in its memory order)",
        )
    })
}
