//! The `DataLoader`'s worker pool: N threads read (decode, augment) items straight into a ring
//! of batch buffers; the training thread takes finished batches in order.
//!
//! - Items are claimed one at a time from an atomic counter over the epoch's order, so every
//!   thread stays busy whatever each image costs, and one batch is filled by all threads at
//!   once (a batch is ready after `batch_size / workers` item times, not `batch_size`).
//! - Batch `k` is written into slot `k % S` (`S` = prefetch + 1), which a worker may claim only
//!   after batch `k - S` was handed over: at most `S` batches exist at a time (bounded memory),
//!   and a slow consumer stalls the workers rather than queueing without end.
//! - Each item's bytes are written by the one thread that claimed it, at the item's own offset;
//!   the slot's mutex orders those writes before the batch is handed over.
//! - Buffers are plain vectors for the CPU, or page-locked memory for a GPU: a finished batch is
//!   queued for an asynchronous upload (`backend::cuda::PinnedBuffer`) and its slot is reused
//!   only once the upload has read it.
//! - An item that fails (an error, or a panic in the dataset) ends the epoch at its batch: the
//!   batches before it are delivered, then the error. Dropping the iterator stops and joins the
//!   threads.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use crate::backend::cuda::PinnedBuffer;
use crate::data::dataset::{Dataset, ItemShape};
use crate::data::transforms::Augment;
use crate::error::{Error, Result};
use crate::tensor::{DType, Device, Shape, Storage, Tensor};

/// One epoch's work, shared by the pool and the single-threaded path.
pub(crate) struct EpochJob {
    pub dataset: Arc<dyn Dataset>,
    pub order: Vec<usize>,
    pub batch_size: usize,
    pub num_batches: usize,
    pub augment: Option<Augment>,
    pub epoch: usize,
    pub device: Device,
}

impl EpochJob {
    pub fn batch_len(&self, k: usize) -> usize {
        self.batch_size.min(self.order.len() - k * self.batch_size)
    }

    /// Items served this epoch (the last partial batch counts unless dropped).
    pub fn total_items(&self) -> usize {
        (self.num_batches * self.batch_size).min(self.order.len())
    }

    pub fn shape(&self) -> ItemShape {
        self.dataset.item_shape()
    }

    pub fn item_elems(&self) -> usize {
        self.shape().iter().product()
    }

    /// Reads item `p` of the epoch (a position in `order`) into `img`, augmented.
    pub fn read(
        &self,
        p: usize,
        img: &mut [f32],
        pads: &[f32],
        scratch: &mut Vec<f32>,
    ) -> Result<i64> {
        let idx = self.order[p];
        let label = self.dataset.read_item(self.epoch, idx, img)?;
        if let Some(a) = &self.augment {
            a.apply_padded(self.epoch, idx, img, self.shape(), pads, scratch)?;
        }
        Ok(label)
    }

    /// Batch tensors from host data.
    pub fn host_batch(&self, images: Vec<f32>, labels: Vec<i64>) -> Result<(Tensor, Tensor)> {
        let [c, h, w] = self.shape();
        let b = labels.len();
        let x = Tensor::from_vec(images, vec![b, c, h, w], Device::Cpu)?;
        let y = Tensor::from_vec(labels, vec![b], Device::Cpu)?;
        Ok((x.to_device(self.device)?, y.to_device(self.device)?))
    }
}

/// A slot's memory.
enum Buffer {
    Host(Vec<f32>),
    /// Images (f32) then labels (i64, at `labels_at` bytes).
    Pinned {
        buf: PinnedBuffer,
        labels_at: usize,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SlotState {
    /// Reusable by batch `k` once batch `k - S` was delivered.
    Free,
    /// A worker is getting the buffer ready (allocating, or waiting for its last upload).
    Preparing,
    Filling,
    Ready,
    /// The consumer is turning it into tensors.
    Taken,
}

struct Slot {
    batch: usize,
    state: SlotState,
    buffer: Option<Buffer>,
    /// Host address of the images, valid while `Filling`.
    images: usize,
    filled: usize,
    labels: Vec<i64>,
}

struct State {
    slots: Vec<Slot>,
    /// Batches handed to the consumer so far.
    delivered: usize,
    /// The first failing item (its position in the order) and its error.
    failed: Option<(usize, Error)>,
    stop: bool,
    live_workers: usize,
}

struct Shared {
    job: EpochJob,
    pads: Vec<f32>,
    next_item: AtomicUsize,
    state: Mutex<State>,
    /// Workers wait here for a slot.
    slot_freed: Condvar,
    /// The consumer waits here for a batch.
    batch_ready: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn fail(&self, st: &mut State, p: usize, e: Error) {
        if st.failed.as_ref().is_none_or(|(q, _)| p < *q) {
            st.failed = Some((p, e));
        }
        self.batch_ready.notify_all();
        self.slot_freed.notify_all();
    }

    /// A new or recycled buffer for one batch, ready to be written.
    fn prepare(&self, old: Option<Buffer>) -> Result<Buffer> {
        let n = self.job.batch_size * self.job.item_elems();
        match (old, self.job.device) {
            (Some(Buffer::Pinned { buf, labels_at }), _) => {
                buf.wait_uploads()?;
                Ok(Buffer::Pinned { buf, labels_at })
            }
            (Some(Buffer::Host(v)), _) => Ok(Buffer::Host(v)),
            (None, Device::Cpu) => Ok(Buffer::Host(vec![0f32; n])),
            (None, Device::Cuda(ordinal)) => {
                let labels_at = (n * 4).next_multiple_of(8);
                let buf = PinnedBuffer::new(ordinal, labels_at + self.job.batch_size * 8)?;
                Ok(Buffer::Pinned { buf, labels_at })
            }
        }
    }
}

/// Decrements the live-worker count however the worker ends (a panic included).
struct LiveGuard(Arc<Shared>);

impl Drop for LiveGuard {
    fn drop(&mut self) {
        let mut st = self.0.lock();
        st.live_workers -= 1;
        self.0.batch_ready.notify_all();
    }
}

fn worker(shared: Arc<Shared>) {
    let _live = LiveGuard(shared.clone());
    let job = &shared.job;
    let (bs, total, elems) = (job.batch_size, job.total_items(), job.item_elems());
    let slots = shared.lock().slots.len();
    let mut scratch = Vec::new();
    loop {
        let p = shared.next_item.fetch_add(1, Ordering::Relaxed);
        if p >= total {
            return;
        }
        let (k, j) = (p / bs, p % bs);
        let s = k % slots;
        // Get slot `s` filling batch `k`.
        let mut st = shared.lock();
        let images = loop {
            if st.stop || st.failed.as_ref().is_some_and(|(q, _)| *q < p) {
                return;
            }
            let delivered = st.delivered;
            let slot = &mut st.slots[s];
            if slot.state == SlotState::Filling && slot.batch == k {
                break slot.images;
            }
            if slot.state == SlotState::Free && k < delivered + slots {
                slot.state = SlotState::Preparing;
                slot.batch = k;
                let old = slot.buffer.take();
                drop(st);
                let prepared = shared.prepare(old);
                st = shared.lock();
                match prepared {
                    Ok(mut buf) => {
                        let slot = &mut st.slots[s];
                        slot.images = match &mut buf {
                            Buffer::Host(v) => v.as_mut_ptr() as usize,
                            // SAFETY: the buffer's last upload has finished (prepare waited).
                            Buffer::Pinned { buf, .. } => (unsafe { buf.as_mut_ptr() }) as usize,
                        };
                        slot.buffer = Some(buf);
                        slot.filled = 0;
                        slot.labels.clear();
                        slot.labels.resize(job.batch_len(k), 0);
                        slot.state = SlotState::Filling;
                        shared.slot_freed.notify_all();
                        continue;
                    }
                    Err(e) => {
                        st.slots[s].state = SlotState::Free;
                        shared.fail(&mut st, k * bs, e);
                        return;
                    }
                }
            }
            st = shared
                .slot_freed
                .wait(st)
                .unwrap_or_else(|e| e.into_inner());
        };
        drop(st);
        // SAFETY: the slot is `Filling` batch `k`, so its buffer stays where it is until every
        // item of the batch is counted; item `j`'s range is written by this thread only.
        let img =
            unsafe { std::slice::from_raw_parts_mut((images as *mut f32).add(j * elems), elems) };
        let result = catch_unwind(AssertUnwindSafe(|| {
            job.read(p, img, &shared.pads, &mut scratch)
        }))
        .unwrap_or_else(|panic| {
            let msg = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            Err(Error::Unsupported {
                op: "DataLoader",
                detail: format!(
                    "reading item {} (dataset index {}) panicked: {msg}",
                    p, job.order[p]
                ),
            })
        });
        let mut st = shared.lock();
        match result {
            Ok(label) => {
                let slot = &mut st.slots[s];
                slot.labels[j] = label;
                slot.filled += 1;
                if slot.filled == slot.labels.len() {
                    slot.state = SlotState::Ready;
                    shared.batch_ready.notify_all();
                }
            }
            Err(e) => {
                shared.fail(&mut st, p, e);
                return;
            }
        }
    }
}

/// The running pool of one epoch.
pub(crate) struct Pool {
    shared: Arc<Shared>,
    handles: Vec<JoinHandle<()>>,
    slots: usize,
}

impl Pool {
    /// Starts `workers` threads (at most one per item) with `prefetch + 1` batch slots.
    pub fn start(job: EpochJob, workers: usize, prefetch: usize) -> Result<Pool> {
        let pads = job.dataset.pad_values();
        let slots = prefetch.max(1) + 1;
        let n = workers.clamp(1, job.total_items().max(1));
        let shared = Arc::new(Shared {
            job,
            pads,
            next_item: AtomicUsize::new(0),
            state: Mutex::new(State {
                slots: (0..slots)
                    .map(|_| Slot {
                        batch: 0,
                        state: SlotState::Free,
                        buffer: None,
                        images: 0,
                        filled: 0,
                        labels: Vec::new(),
                    })
                    .collect(),
                delivered: 0,
                failed: None,
                stop: false,
                live_workers: n,
            }),
            slot_freed: Condvar::new(),
            batch_ready: Condvar::new(),
        });
        let mut pool = Pool {
            shared: shared.clone(),
            handles: Vec::with_capacity(n),
            slots,
        };
        for i in 0..n {
            let sh = shared.clone();
            match std::thread::Builder::new()
                .name(format!("mixprec-data-{i}"))
                .spawn(move || worker(sh))
            {
                Ok(h) => pool.handles.push(h),
                Err(e) => {
                    // Threads that never started are not live; with none at all, fail.
                    shared.lock().live_workers -= n - i;
                    if i == 0 {
                        return Err(Error::io("DataLoader: starting a worker thread", e));
                    }
                    log::warn!("DataLoader: started {i} of {n} worker threads: {e}");
                    break;
                }
            }
        }
        Ok(pool)
    }

    /// The next batch, in order; `None` after the last.
    pub fn next_batch(&mut self) -> Option<Result<(Tensor, Tensor)>> {
        let sh = &self.shared;
        let job = &sh.job;
        let slots = self.slots;
        let mut st = sh.lock();
        let k = st.delivered;
        if k >= job.num_batches {
            return None;
        }
        let s = k % slots;
        loop {
            if st.slots[s].state == SlotState::Ready && st.slots[s].batch == k {
                break;
            }
            if let Some((q, _)) = &st.failed {
                if *q / job.batch_size <= k {
                    let (_, e) = st.failed.take()?;
                    st.stop = true;
                    sh.slot_freed.notify_all();
                    return Some(Err(e));
                }
            }
            if st.live_workers == 0 {
                st.stop = true;
                return Some(Err(Error::Unsupported {
                    op: "DataLoader",
                    detail: "the worker threads stopped before the epoch's end".into(),
                }));
            }
            st = sh.batch_ready.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        let slot = &mut st.slots[s];
        slot.state = SlotState::Taken;
        let labels = std::mem::take(&mut slot.labels);
        let buffer = slot.buffer.take();
        drop(st);
        let (made, keep) = match buffer {
            Some(Buffer::Host(mut v)) => {
                v.truncate(labels.len() * job.item_elems());
                (job.host_batch(v, labels.clone()), None)
            }
            Some(Buffer::Pinned { buf, labels_at }) => {
                let made = upload(&buf, labels_at, &labels, job);
                (made, Some(Buffer::Pinned { buf, labels_at }))
            }
            None => (
                Err(Error::Unsupported {
                    op: "DataLoader",
                    detail: "a ready batch had no buffer".into(),
                }),
                None,
            ),
        };
        let mut st = sh.lock();
        let slot = &mut st.slots[s];
        slot.buffer = keep;
        slot.labels = labels;
        slot.state = SlotState::Free;
        st.delivered += 1;
        if made.is_err() {
            st.stop = true;
        }
        sh.slot_freed.notify_all();
        Some(made)
    }

    /// Stops the workers and joins them.
    pub fn shutdown(&mut self) {
        {
            let mut st = self.shared.lock();
            st.stop = true;
            // Claims past the end make idle workers return at their next item.
            self.shared
                .next_item
                .store(usize::MAX / 2, Ordering::Relaxed);
        }
        self.shared.slot_freed.notify_all();
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Queues the uploads of a filled pinned batch; returns device tensors at once.
fn upload(
    buf: &PinnedBuffer,
    labels_at: usize,
    labels: &[i64],
    job: &EpochJob,
) -> Result<(Tensor, Tensor)> {
    let [c, h, w] = job.shape();
    let b = labels.len();
    // SAFETY: the batch is complete and no upload from this buffer is in flight (its slot
    // was prepared after the previous one finished); the labels' range is inside the buffer.
    unsafe {
        let dst = buf.as_mut_ptr().add(labels_at) as *mut i64;
        std::ptr::copy_nonoverlapping(labels.as_ptr(), dst, b);
    }
    let images = buf.upload(0, DType::F32, b * c * h * w)?;
    let labels = buf.upload(labels_at, DType::I64, b)?;
    Ok((
        Tensor::from_storage(Storage::Cuda(images), Shape::from(vec![b, c, h, w])),
        Tensor::from_storage(Storage::Cuda(labels), Shape::from(vec![b])),
    ))
}
