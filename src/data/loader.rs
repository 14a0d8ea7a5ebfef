//! `DataLoader`: shuffles, batches and (optionally) augments a `Dataset`, reading items on a
//! pool of worker threads that stays `prefetch` batches ahead of the training loop, and
//! delivering batches on the training device (through pinned memory and an asynchronous copy
//! when that is a GPU).
//!
//! Reproducibility: epoch `e`'s order is a Fisher–Yates shuffle driven by a `SeedStream` whose
//! seed is derived from `(seed, e)` alone, and augmentation draws (and a dataset's own random
//! draws, `Dataset::read_item`) depend on `(seed, e, index)`; so a run resumed at epoch `e`
//! sees exactly the batches an uninterrupted run would, whatever the number of workers.
//!
//! Threading: each `epoch()` call starts `workers` threads (see `data::workers`); dropping the
//! iterator stops and joins them, so an early `break` neither hangs nor leaks a thread.
//! `prefetch(0)` reads every batch in the consumer's thread instead, on demand.

use std::sync::Arc;

use crate::data::dataset::Dataset;
use crate::data::sampler::DistributedSampler;
use crate::data::transforms::Augment;
use crate::data::workers::{EpochJob, Pool};
use crate::error::{Error, Result};
use crate::tensor::random::{philox4x32, SeedStream};
use crate::tensor::{Device, Tensor};

/// Distinguishes shuffle seeds from other Philox uses of the same seed.
const SHUFFLE_TAG: u32 = 0x05f1_1e00;

/// A batch: images `[B, C, H, W]` F32 and labels `[B]` I64, both on the loader's device
/// (`Device::Cpu` unless [`DataLoader::device`] says otherwise).
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
    workers: usize,
    device: Device,
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
            .field("workers", &self.workers)
            .field("device", &self.device)
            .field("sampler", &self.sampler)
            .finish()
    }
}

impl DataLoader {
    /// A loader in dataset order, no augmentation, keeping the last partial batch, prefetching
    /// 2 batches with one worker thread, delivering on the CPU. A `batch_size` of 0 is an
    /// error (as PyTorch's).
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
            workers: 1,
            device: Device::Cpu,
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

    /// How many batches the workers may have ready ahead of the consumer; 0 assembles batches
    /// in the consumer's thread, on demand (no thread).
    pub fn prefetch(mut self, batches: usize) -> Self {
        self.prefetch = batches;
        self
    }

    /// Threads that read items (decode, augment) in parallel, all filling the same batch; 0
    /// means one per available core. Results do not depend on it.
    pub fn workers(mut self, workers: usize) -> Self {
        self.workers = if workers == 0 {
            default_workers()
        } else {
            workers
        };
        self
    }

    /// Deliver batches on `device`. For a GPU, workers write into page-locked host buffers and
    /// each batch is copied with an asynchronous upload that overlaps the previous step's
    /// kernels (torch's `pin_memory=True` plus `.to(device, non_blocking=True)`).
    pub fn device(mut self, device: Device) -> Self {
        self.device = device;
        self
    }

    pub fn num_workers(&self) -> usize {
        self.workers
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
        self.epoch_from(epoch, 0)
    }

    /// The batches of epoch `epoch` after its first `skip` (none read): the rest of an epoch a
    /// run was stopped in, exactly as the whole epoch would have served them.
    pub fn epoch_from(&self, epoch: usize, skip: usize) -> EpochIter {
        if let Err(e) = self.check() {
            return EpochIter {
                inner: Inner::Failed(Some(e)),
                remaining: 1,
            };
        }
        let mut order = self.epoch_order(epoch);
        let skip = skip.min(self.num_batches());
        order.drain(..(skip * self.batch_size).min(order.len()));
        let job = EpochJob {
            dataset: self.dataset.clone(),
            order,
            batch_size: self.batch_size,
            num_batches: self.num_batches() - skip,
            augment: self.augment,
            epoch,
            device: self.device,
        };
        let remaining = job.num_batches;
        if self.prefetch == 0 || remaining == 0 {
            return EpochIter {
                inner: Inner::Sync(Producer::new(job)),
                remaining,
            };
        }
        match Pool::start(job, self.workers, self.prefetch) {
            Ok(pool) => EpochIter {
                inner: Inner::Pool(pool),
                remaining,
            },
            Err(e) => EpochIter {
                inner: Inner::Failed(Some(e)),
                remaining: 1,
            },
        }
    }
}

/// One worker per available core (at least 1).
pub fn default_workers() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Assembles the batches of one epoch in the consumer's thread (`prefetch(0)`).
struct Producer {
    job: EpochJob,
    pads: Vec<f32>,
    next: usize,
    scratch: Vec<f32>,
}

impl Producer {
    fn new(job: EpochJob) -> Self {
        let pads = job.dataset.pad_values();
        Producer {
            job,
            pads,
            next: 0,
            scratch: Vec::new(),
        }
    }

    fn next_batch(&mut self) -> Option<Result<Batch>> {
        if self.next >= self.job.num_batches {
            return None;
        }
        let k = self.next;
        self.next += 1;
        Some(self.assemble(k))
    }

    fn assemble(&mut self, k: usize) -> Result<Batch> {
        let item = self.job.item_elems();
        let b = self.job.batch_len(k);
        let start = k * self.job.batch_size;
        let mut images = vec![0f32; b * item];
        let mut labels = Vec::with_capacity(b);
        for (j, img) in images.chunks_exact_mut(item).enumerate() {
            labels.push(
                self.job
                    .read(start + j, img, &self.pads, &mut self.scratch)?,
            );
        }
        self.job.host_batch(images, labels)
    }
}

enum Inner {
    Sync(Producer),
    Pool(Pool),
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
            Inner::Pool(pool) => pool.next_batch(),
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
    /// Stops and joins the worker threads, if any.
    fn shutdown(&mut self) {
        if let Inner::Pool(pool) = &mut self.inner {
            pool.shutdown();
        }
    }
}

impl Drop for EpochIter {
    fn drop(&mut self) {
        self.shutdown();
    }
}
