//! Batches of token windows for a language model: `x` `[B, T]` and `y` `[B, T]` (I64; `y` is
//! `x` shifted by one token) drawn from mapped token shards without copying them.
//!
//! - **Windows**: shard by shard, a window is `T + 1` tokens starting at a multiple of `T`
//!   (consecutive windows share one token, so every token but a shard's first is a target
//!   once per epoch); windows never cross shards. The corpus's windows are numbered shard after
//!   shard.
//! - **Epoch order**: the window numbers in order, or (with a shuffle seed) a permutation that
//!   depends only on `(seed, epoch)`, the same on every rank.
//! - **Batches and ranks**: the epoch order is cut into batches of `B` windows and batch `k`
//!   goes to rank `k mod world_size`; the tail that does not give every rank a whole batch is
//!   dropped, so all ranks step together. Unshuffled, a rank's batch is `B·T + 1` consecutive
//!   tokens and rank `r` starts `r·B·T` tokens in, as llm.c's `DistributedDataLoader` reads.
//! - **Resume**: the position is [`TokenLoaderState`] `{ epoch, batch }`; a loader set to a
//!   saved state draws exactly the batches the saved run would have drawn next. After the last
//!   batch of an epoch the next epoch starts (reshuffled), so a training loop counts steps, not
//!   epochs.

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::token_corpus::{read_manifest, TokenSplit};
use super::token_shards::TokenShard;
use crate::tensor::random::{philox4x32, SeedStream};
use crate::{Device, Error, Result, Tensor};

/// Distinguishes the window shuffle from other Philox uses of the same seed.
const SHUFFLE_TAG: u32 = 0x7045_4e53;

/// What a [`TokenLoader`] draws.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenLoaderConfig {
    /// `B`: windows per batch (per rank).
    pub batch_size: usize,
    /// `T`: tokens per row of `x` and `y`.
    pub seq_len: usize,
    pub rank: usize,
    pub world_size: usize,
    /// Shuffle the windows each epoch with this seed; `None` reads them in order.
    pub shuffle_seed: Option<u64>,
    /// Every token must be below this (the model's vocabulary, GPT-2's 50257 by default):
    /// checked once per shard when the loader is made.
    pub vocab_size: usize,
}

impl TokenLoaderConfig {
    /// One rank, in order, GPT-2's vocabulary.
    pub fn new(batch_size: usize, seq_len: usize) -> Self {
        TokenLoaderConfig {
            batch_size,
            seq_len,
            rank: 0,
            world_size: 1,
            shuffle_seed: None,
            vocab_size: super::tokenizer::Gpt2Tokenizer::VOCAB_SIZE,
        }
    }

    /// Rank `rank` of `world_size`.
    pub fn ranks(mut self, rank: usize, world_size: usize) -> Self {
        self.rank = rank;
        self.world_size = world_size;
        self
    }

    pub fn shuffle(mut self, seed: u64) -> Self {
        self.shuffle_seed = Some(seed);
        self
    }

    pub fn vocab_size(mut self, vocab_size: usize) -> Self {
        self.vocab_size = vocab_size;
        self
    }

    fn check(&self) -> Result<()> {
        let arg = |name, value: usize, allowed: &str| {
            Err(Error::invalid_arg(
                "TokenLoader",
                name,
                value,
                allowed.to_string(),
            ))
        };
        if self.batch_size == 0 {
            return arg("batch_size", 0, "at least 1 window per batch");
        }
        if self.seq_len == 0 {
            return arg("seq_len", 0, "at least 1 token per row");
        }
        if self.world_size == 0 || self.rank >= self.world_size {
            return Err(Error::invalid_arg(
                "TokenLoader",
                "rank",
                format!("{} of {}", self.rank, self.world_size),
                "a rank below a world size of at least 1",
            ));
        }
        if self.vocab_size == 0 {
            return arg("vocab_size", 0, "at least 1 id");
        }
        Ok(())
    }
}

/// A loader's position: the next batch is this rank's `batch`-th of epoch `epoch`. Small and
/// serializable, for checkpoints.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenLoaderState {
    pub epoch: u64,
    pub batch: u64,
}

/// See the module doc.
#[derive(Debug)]
pub struct TokenLoader {
    shards: Vec<TokenShard>,
    /// `first_window[i]`: the number of shard `i`'s first window; one entry past the end holds
    /// the total.
    first_window: Vec<usize>,
    cfg: TokenLoaderConfig,
    state: TokenLoaderState,
    /// The epoch whose order `order` holds (shuffled loaders only).
    order_epoch: Option<u64>,
    order: Vec<usize>,
}

impl TokenLoader {
    /// A loader over `shards` (in this order). Errors: a bad config, a token `>= vocab_size`
    /// (naming the shard and position), or too few windows for one batch per rank.
    pub fn new(shards: Vec<TokenShard>, cfg: TokenLoaderConfig) -> Result<TokenLoader> {
        cfg.check()?;
        let t = cfg.seq_len;
        let mut first_window = Vec::with_capacity(shards.len() + 1);
        let mut total = 0usize;
        for s in &shards {
            if let Some((at, id)) = s.first_out_of_vocab(cfg.vocab_size) {
                return Err(Error::DataFormat {
                    path: s.path().display().to_string(),
                    format: "token shard",
                    detail: format!(
                        "token {id} at position {at} is not below the vocabulary size {}",
                        cfg.vocab_size
                    ),
                });
            }
            first_window.push(total);
            total += if s.len() > t { (s.len() - 1) / t } else { 0 };
        }
        first_window.push(total);
        let loader = TokenLoader {
            shards,
            first_window,
            cfg,
            state: TokenLoaderState::default(),
            order_epoch: None,
            order: Vec::new(),
        };
        if loader.batches_per_epoch() == 0 {
            let tokens: usize = loader.shards.iter().map(|s| s.len()).sum();
            return Err(Error::invalid_arg(
                "TokenLoader",
                "batch_size",
                format!(
                    "{} windows of {} tokens x {} rank(s) (the data: {} token(s) in {} \
                     shard(s), {} window(s))",
                    cfg.batch_size,
                    t + 1,
                    cfg.world_size,
                    tokens,
                    loader.shards.len(),
                    total
                ),
                "at least one whole batch per rank: more data, a smaller batch or a shorter \
                 sequence",
            ));
        }
        Ok(loader)
    }

    /// The `split` shards of a folder made by
    /// [`tokenize_dir`](super::token_corpus::tokenize_dir): those its `corpus.json` lists, or,
    /// without one, every `{split}_*.bin` by name (llm.c's shard folders have no manifest and
    /// name shards `*_{split}_*.bin` or `*_{split}.bin`, which are matched too).
    pub fn open(dir: &Path, split: TokenSplit, cfg: TokenLoaderConfig) -> Result<TokenLoader> {
        let paths = match read_manifest(dir) {
            Some(m) => m.shard_paths(dir, split),
            None => {
                let entries = std::fs::read_dir(dir)
                    .map_err(|e| Error::io(format!("listing {}", dir.display()), e))?;
                let prefix = format!("{}_", split.name());
                let infix = format!("_{}_", split.name());
                let suffix = format!("_{}.bin", split.name());
                let mut paths: Vec<_> = entries
                    .flatten()
                    .map(|e| e.path())
                    .filter(|p| {
                        let n = p.file_name().unwrap_or_default().to_string_lossy();
                        n.ends_with(".bin")
                            && (n.starts_with(&prefix)
                                || n.contains(&infix)
                                || n.ends_with(&suffix))
                    })
                    .collect();
                paths.sort();
                paths
            }
        };
        if paths.is_empty() {
            return Err(Error::invalid_arg(
                "TokenLoader::open",
                "dir",
                dir.display(),
                format!("a folder with {split} token shards ({split}_000000.bin, ...)"),
            ));
        }
        let shards = paths
            .iter()
            .map(|p| TokenShard::open(p))
            .collect::<Result<Vec<_>>>()?;
        TokenLoader::new(shards, cfg)
    }

    pub fn config(&self) -> &TokenLoaderConfig {
        &self.cfg
    }

    pub fn shards(&self) -> &[TokenShard] {
        &self.shards
    }

    /// Windows of `T + 1` tokens in all shards.
    pub fn windows(&self) -> usize {
        *self.first_window.last().unwrap_or(&0)
    }

    /// This rank's batches per epoch (the same on every rank).
    pub fn batches_per_epoch(&self) -> usize {
        self.windows() / self.cfg.batch_size / self.cfg.world_size
    }

    /// The position of the next batch.
    pub fn state(&self) -> TokenLoaderState {
        self.state
    }

    /// Moves to `state` (from [`state`](Self::state) of a loader over the same shards and
    /// config). A batch index past the epoch's last is an error.
    pub fn set_state(&mut self, state: TokenLoaderState) -> Result<()> {
        if state.batch >= self.batches_per_epoch() as u64 {
            return Err(Error::invalid_arg(
                "TokenLoader::set_state",
                "batch",
                state.batch,
                format!(
                    "a batch index below this rank's {} batches per epoch (were the shards or \
                     the batch size, sequence length or world size changed?)",
                    self.batches_per_epoch()
                ),
            ));
        }
        self.state = state;
        Ok(())
    }

    /// Back to the first batch of epoch 0 (for evaluating on the same batches each time).
    pub fn reset(&mut self) {
        self.state = TokenLoaderState::default();
    }

    /// The window numbers of epoch `epoch`, in the order they are served (all ranks').
    pub fn epoch_order(&self, epoch: u64) -> Vec<usize> {
        let n = self.windows();
        let mut order: Vec<usize> = (0..n).collect();
        if let Some(seed) = self.cfg.shuffle_seed {
            let b = philox4x32(
                [epoch as u32, (epoch >> 32) as u32, SHUFFLE_TAG, 0],
                [seed as u32, (seed >> 32) as u32],
            );
            let mut rng = SeedStream::new(((b[0] as u64) << 32) | b[1] as u64);
            for i in (1..n).rev() {
                order.swap(i, rng.below(i + 1));
            }
        }
        order
    }

    /// Window `w`'s `T + 1` tokens into `out`.
    fn read_window(&self, w: usize, out: &mut [i64]) -> Result<()> {
        // The shard holding window w: the last whose first window is <= w.
        let s = self.first_window.partition_point(|&f| f <= w) - 1;
        let start = (w - self.first_window[s]) * self.cfg.seq_len;
        self.shards[s].read_into(start, out)
    }

    /// The rows of this rank's batch `batch` of epoch `epoch`: `B` windows of `T + 1` tokens,
    /// row-major. Does not move the loader.
    pub fn batch_windows(&mut self, epoch: u64, batch: u64) -> Result<Vec<i64>> {
        let per_epoch = self.batches_per_epoch() as u64;
        if batch >= per_epoch {
            return Err(Error::invalid_arg(
                "TokenLoader::batch_windows",
                "batch",
                batch,
                format!("a batch index below {per_epoch} (this rank's batches per epoch)"),
            ));
        }
        if self.cfg.shuffle_seed.is_some() && self.order_epoch != Some(epoch) {
            self.order = self.epoch_order(epoch);
            self.order_epoch = Some(epoch);
        }
        let (b, row) = (self.cfg.batch_size, self.cfg.seq_len + 1);
        let global = batch as usize * self.cfg.world_size + self.cfg.rank;
        let mut rows = vec![0i64; b * row];
        for (i, out) in rows.chunks_exact_mut(row).enumerate() {
            let pos = global * b + i;
            let w = if self.cfg.shuffle_seed.is_some() {
                self.order[pos]
            } else {
                pos
            };
            self.read_window(w, out)?;
        }
        Ok(rows)
    }

    /// The next batch, `x` and `y` `[B, T]` I64 on `device`, and the loader moved past it.
    pub fn next_batch(&mut self, device: Device) -> Result<(Tensor, Tensor)> {
        let TokenLoaderState { epoch, batch } = self.state;
        let rows = self.batch_windows(epoch, batch)?;
        let (b, t) = (self.cfg.batch_size, self.cfg.seq_len);
        let mut x = Vec::with_capacity(b * t);
        let mut y = Vec::with_capacity(b * t);
        for r in rows.chunks_exact(t + 1) {
            x.extend_from_slice(&r[..t]);
            y.extend_from_slice(&r[1..]);
        }
        let x = Tensor::from_vec(x, vec![b, t], device)?;
        let y = Tensor::from_vec(y, vec![b, t], device)?;
        self.state = if batch + 1 < self.batches_per_epoch() as u64 {
            TokenLoaderState {
                epoch,
                batch: batch + 1,
            }
        } else {
            TokenLoaderState {
                epoch: epoch + 1,
                batch: 0,
            }
        };
        Ok((x, y))
    }
}
