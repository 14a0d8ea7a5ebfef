//! `DataLoader`: shuffles, batches and (optionally) augments a `Dataset`, assembling batches in a
//! background thread that stays `prefetch` batches ahead of the training loop.
//!
//! Reproducibility: epoch `e`'s order is a Fisher–Yates shuffle driven by a `SeedStream` whose
//! seed is derived from `(seed, e)` alone, and augmentation draws depend on `(seed, e, index)`;
//! so a run resumed at epoch `e` sees exactly the batches an uninterrupted run would.
//!
//! Threading: each `epoch()` call starts one producer thread that sends ready
//! `(images, labels)` tensors through a bounded channel. Dropping the iterator closes the
//! channel, which makes the producer's next `send` fail; the producer then exits and `Drop`
//! joins it, so an early `break` neither hangs nor leaks a thread.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::Arc;
use std::thread::JoinHandle;

use crate::data::dataset::Dataset;
use crate::data::sampler::DistributedSampler;
use crate::data::transforms::Augment;
use crate::error::{Error, Result};
use crate::tensor::random::{philox4x32, SeedStream};
use crate::tensor::{Device, Tensor};

/// Distinguishes shuffle seeds from other Philox uses of the same seed.
const SHUFFLE_TAG: u32 = 0x05f1_1e00;

/// A batch: images `[B, C, H, W]` F32 and labels `[B]` I64, both on `Device::Cpu`.
pub type Batch = (Tensor, Tensor);

/// Batches a dataset; see the module documentation. Cheap to clone (the dataset is shared).
#[derive(Clone)]
pub struct DataLoader {
    dataset: Arc<dyn Dataset>,
    batch_size: usize,
    shuffle_seed: Option<u64>,
    drop_last: bool,
    augment: Option<Augment>,
    prefetch: usize,
    /// Data-parallel runs: this rank's shard of every epoch.
    sampler: Option<DistributedSampler>,
}

impl std::fmt::Debug for DataLoader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataLoader")
            .field("len", &self.dataset.len())
            .field("item_shape", &self.dataset.item_shape())
            .field("batch_size", &self.batch_size)
            .field("shuffle_seed", &self.shuffle_seed)
            .field("drop_last", &self.drop_last)
            .field("augment", &self.augment)
            .field("prefetch", &self.prefetch)
            .field("sampler", &self.sampler)
            .finish()
    }
}

impl DataLoader {
    /// A loader in dataset order, no augmentation, keeping the last partial batch, prefetching
    /// 2 batches in a background thread. A `batch_size` of 0 is an error (as PyTorch's).
    pub fn new(dataset: impl Dataset + 'static, batch_size: usize) -> Result<Self> {
        Self::from_arc(Arc::new(dataset), batch_size)
    }

    /// Like `new`, for a dataset that is shared with other code.
    pub fn from_arc(dataset: Arc<dyn Dataset>, batch_size: usize) -> Result<Self> {
        if batch_size == 0 {
            return Err(Error::invalid_arg(
                "DataLoader",
                "batch_size",
                0,
                "at least 1",
            ));
        }
        Ok(DataLoader {
            dataset,
            batch_size,
            shuffle_seed: None,
            drop_last: false,
            augment: None,
            prefetch: 2,
            sampler: None,
        })
    }

    /// Serve only this rank's shard of each epoch (see [`DistributedSampler`]); batching and
    /// `drop_last` apply to the shard.
    pub fn sampler(mut self, sampler: DistributedSampler) -> Self {
        self.sampler = Some(sampler);
        self
    }

    /// Shuffle every epoch; epoch `e`'s order depends only on `(seed, e)`.
    pub fn shuffle(mut self, seed: u64) -> Self {
        self.shuffle_seed = Some(seed);
        self
    }

    /// Drop the last batch when it would be smaller than `batch_size`.
    pub fn drop_last(mut self, drop_last: bool) -> Self {
        self.drop_last = drop_last;
        self
    }

    /// Augment every image (use it for the training set only).
    pub fn augment(mut self, augment: Augment) -> Self {
        self.augment = (!augment.is_identity()).then_some(augment);
        self
    }

    /// How many batches the background thread may have ready ahead of the consumer; 0 assembles
    /// batches in the consumer's thread, on demand (no thread).
    pub fn prefetch(mut self, batches: usize) -> Self {
        self.prefetch = batches;
        self
    }

    pub fn dataset(&self) -> &Arc<dyn Dataset> {
        &self.dataset
    }

    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// Number of batches per epoch (of this rank's shard, with a sampler).
    pub fn num_batches(&self) -> usize {
        let n = match &self.sampler {
            Some(s) => s.num_samples(self.dataset.len()),
            None => self.dataset.len(),
        };
        let b = self.batch_size;
        if b == 0 {
            0
        } else if self.drop_last {
            n / b
        } else {
            n.div_ceil(b)
        }
    }

    /// The dataset indices of epoch `epoch`, in the order they are served (all of them, or this
    /// rank's shard with a sampler; before batching and `drop_last`).
    pub fn epoch_order(&self, epoch: usize) -> Vec<usize> {
        let n = self.dataset.len();
        let mut order: Vec<usize> = (0..n).collect();
        if let Some(seed) = self.shuffle_seed {
            let e = epoch as u64;
            let b = philox4x32(
                [e as u32, (e >> 32) as u32, SHUFFLE_TAG, 0],
                [seed as u32, (seed >> 32) as u32],
            );
            let mut rng = SeedStream::new(((b[0] as u64) << 32) | b[1] as u64);
            for i in (1..n).rev() {
                order.swap(i, rng.below(i + 1));
            }
        }
        match &self.sampler {
            Some(s) => s.shard(&order),
            None => order,
        }
    }

    fn check(&self) -> Result<()> {
        let [c, h, w] = self.dataset.item_shape();
        let item = c.checked_mul(h).and_then(|v| v.checked_mul(w));
        if item.is_none_or(|v| {
            v == 0
                || v.checked_mul(self.batch_size.min(self.dataset.len()))
                    .is_none()
        }) {
            return Err(Error::invalid_arg(
                "DataLoader",
                "item_shape",
                format!("{:?}", [c, h, w]),
                "every dimension at least 1, and a batch that fits in memory",
            ));
        }
        if let Some(a) = &self.augment {
            a.check([c, h, w])?;
        }
        Ok(())
    }

    /// The batches of epoch `epoch` (a counter from 0; it selects the shuffle and the
    /// augmentation draws).
    pub fn epoch(&self, epoch: usize) -> EpochIter {
        if let Err(e) = self.check() {
            return EpochIter {
                inner: Inner::Failed(Some(e)),
                remaining: 1,
            };
        }
        let producer = Producer {
            dataset: self.dataset.clone(),
            order: self.epoch_order(epoch),
            batch_size: self.batch_size,
            num_batches: self.num_batches(),
            augment: self.augment,
            epoch,
            next: 0,
            scratch: Vec::new(),
        };
        let remaining = producer.num_batches;
        if self.prefetch == 0 || remaining == 0 {
            return EpochIter {
                inner: Inner::Sync(producer),
                remaining,
            };
        }
        let (tx, rx) = sync_channel(self.prefetch);
        let stop = Arc::new(AtomicBool::new(false));
        let thread_stop = stop.clone();
        let spawned = std::thread::Builder::new()
            .name("mixprec-data".into())
            .spawn(move || {
                let mut producer = producer;
                while !thread_stop.load(Ordering::Relaxed) {
                    let Some(batch) = producer.next_batch() else {
                        break;
                    };
                    let failed = batch.is_err();
                    // A send fails only when the consumer is gone: stop.
                    if tx.send(batch).is_err() || failed {
                        break;
                    }
                }
            });
        match spawned {
            Ok(handle) => EpochIter {
                inner: Inner::Threaded {
                    rx: Some(rx),
                    handle: Some(handle),
                    stop,
                },
                remaining,
            },
            Err(e) => EpochIter {
                inner: Inner::Failed(Some(Error::io(
                    "DataLoader: starting the prefetch thread",
                    e,
                ))),
                remaining: 1,
            },
        }
    }
}

/// Assembles batches of one epoch.
struct Producer {
    dataset: Arc<dyn Dataset>,
    order: Vec<usize>,
    batch_size: usize,
    num_batches: usize,
    augment: Option<Augment>,
    epoch: usize,
    next: usize,
    scratch: Vec<f32>,
}

impl Producer {
    fn next_batch(&mut self) -> Option<Result<Batch>> {
        if self.next >= self.num_batches {
            return None;
        }
        let start = self.next * self.batch_size;
        let end = (start + self.batch_size).min(self.order.len());
        self.next += 1;
        Some(self.assemble(start, end))
    }

    fn assemble(&mut self, start: usize, end: usize) -> Result<Batch> {
        let shape = self.dataset.item_shape();
        let [c, h, w] = shape;
        let item = c * h * w;
        let b = end - start;
        let mut images = vec![0f32; b * item];
        let mut labels = Vec::with_capacity(b);
        let pad = self.dataset.pad_value();
        for (&idx, img) in self.order[start..end]
            .iter()
            .zip(images.chunks_exact_mut(item))
        {
            labels.push(self.dataset.read_into(idx, img)?);
            if let Some(a) = &self.augment {
                a.apply(self.epoch, idx, img, shape, pad, &mut self.scratch)?;
            }
        }
        let x = Tensor::from_vec(images, vec![b, c, h, w], Device::Cpu)?;
        let y = Tensor::from_vec(labels, vec![b], Device::Cpu)?;
        Ok((x, y))
    }
}

enum Inner {
    Sync(Producer),
    Threaded {
        rx: Option<Receiver<Result<Batch>>>,
        handle: Option<JoinHandle<()>>,
        stop: Arc<AtomicBool>,
    },
    Failed(Option<Error>),
}

/// The batches of one epoch: `Result<(images, labels)>`. After an error the iteration ends.
pub struct EpochIter {
    inner: Inner,
    remaining: usize,
}

impl Iterator for EpochIter {
    type Item = Result<Batch>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.remaining == 0 {
            return None;
        }
        let item = match &mut self.inner {
            Inner::Sync(p) => p.next_batch(),
            Inner::Failed(e) => e.take().map(Err),
            Inner::Threaded { rx, .. } => match rx.as_ref().map(|r| r.recv()) {
                Some(Ok(batch)) => Some(batch),
                // The producer ended before sending every batch: it panicked.
                Some(Err(_)) => Some(Err(Error::Unsupported {
                    op: "DataLoader",
                    detail: "the prefetch thread stopped unexpectedly (a dataset panicked?)".into(),
                })),
                None => None,
            },
        };
        self.remaining = match &item {
            Some(Ok(_)) => self.remaining - 1,
            _ => 0,
        };
        if self.remaining == 0 {
            self.shutdown();
        }
        item
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (0, Some(self.remaining))
    }
}

impl EpochIter {
    /// Stops and joins the producer thread, if any.
    fn shutdown(&mut self) {
        if let Inner::Threaded { rx, handle, stop } = &mut self.inner {
            stop.store(true, Ordering::Relaxed);
            // Closing the channel first unblocks a producer waiting in `send`.
            drop(rx.take());
            if let Some(h) = handle.take() {
                let _ = h.join();
            }
        }
    }
}

impl Drop for EpochIter {
    fn drop(&mut self) {
        self.shutdown();
    }
}
