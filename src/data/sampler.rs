//! `DistributedSampler`: each rank's share of an epoch, as PyTorch's
//! `torch.utils.data.DistributedSampler` cuts it: the epoch's order (the loader's shuffle of
//! `(seed, epoch)`, the same on every rank) is padded by repeating its start until it divides
//! evenly (or, with `drop_last`, cut to a multiple of the world size), then rank `r` takes
//! positions `r, r + world, r + 2·world, ...`. So the shards are disjoint (up to the padding),
//! every rank gets the same number of samples, and a new epoch reshuffles them all.
//!
//! [`DistributedSampler::uneven`] cuts without padding or dropping (shards may differ by one
//! sample), for evaluation, where every sample must count once.

use crate::error::{Error, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DistributedSampler {
    pub rank: usize,
    pub world_size: usize,
    /// Cut the tail that does not divide evenly instead of padding it.
    pub drop_last: bool,
    /// No padding and no cut: shards may differ in length by one.
    pub even: bool,
}

impl DistributedSampler {
    /// Rank `rank`'s shard among `world_size`, padded as PyTorch's default.
    pub fn new(rank: usize, world_size: usize) -> Result<DistributedSampler> {
        if world_size == 0 || rank >= world_size {
            return Err(Error::invalid_arg(
                "DistributedSampler",
                "rank",
                format!("{rank} of {world_size}"),
                "a rank below a world size of at least 1",
            ));
        }
        Ok(DistributedSampler {
            rank,
            world_size,
            drop_last: false,
            even: true,
        })
    }

    /// Shards for evaluation: every sample exactly once over the ranks, lengths may differ.
    pub fn uneven(rank: usize, world_size: usize) -> Result<DistributedSampler> {
        let mut s = Self::new(rank, world_size)?;
        s.even = false;
        Ok(s)
    }

    pub fn drop_last(mut self, on: bool) -> Self {
        self.drop_last = on;
        self
    }

    /// The number of samples this rank gets from a dataset of `n`.
    pub fn num_samples(&self, n: usize) -> usize {
        let w = self.world_size;
        if !self.even {
            return n / w + usize::from(self.rank < n % w);
        }
        if self.drop_last && !n.is_multiple_of(w) {
            // ceil((n - w) / w), as torch computes it (0 when n < w).
            n.saturating_sub(w).div_ceil(w)
        } else {
            n.div_ceil(w)
        }
    }

    /// This rank's indices out of the epoch's `order`.
    pub fn shard(&self, order: &[usize]) -> Vec<usize> {
        let n = order.len();
        let w = self.world_size;
        if !self.even {
            return order.iter().skip(self.rank).step_by(w).copied().collect();
        }
        let total = self.num_samples(n) * w;
        let mut all: Vec<usize> = Vec::with_capacity(total);
        if n > 0 {
            while all.len() < total {
                let take = (total - all.len()).min(n);
                all.extend_from_slice(&order[..take]);
            }
        }
        all.truncate(total);
        all.into_iter().skip(self.rank).step_by(w).collect()
    }
}
