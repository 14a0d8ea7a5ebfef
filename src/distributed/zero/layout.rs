//! The flat layout of a sharded optimizer (what a checkpoint's manifest records) and the
//! pieces of one rank's share.
//!
//! One flat buffer per parameter dtype, laid out bucket by bucket: the buckets are DDP's (the
//! parameters in reverse order, as backward produces their gradients, about `bucket_cap` bytes
//! each, a small first one), each padded to a multiple of the world size and split into
//! `world_size` equal chunks. Rank r's share is its chunk of every bucket, concatenated in
//! bucket order: so a bucket's reduce-scatter lands each rank's chunk where its optimizer
//! expects it, as soon as the bucket's gradients are ready. A layout of one bucket is the
//! plain contiguous split (what manifests without buckets describe).

use super::*;

/// One parameter in the flat layout.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlatParam {
    /// Position across the groups (the state dict's key).
    pub index: usize,
    pub shape: Vec<usize>,
    /// Offset of its first element in its flat buffer.
    pub offset: usize,
}

/// One bucket of a flat buffer: consecutive parameters, then padding up to a multiple of the
/// world size; rank r owns elements `offset + r·chunk .. offset + (r+1)·chunk`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlatBucket {
    /// Its first element in the flat buffer.
    pub offset: usize,
    /// The parameters' elements.
    pub len: usize,
    /// `len` rounded up to a multiple of the world size (at least the world size).
    pub padded: usize,
    /// Each rank's part: `padded / world_size`.
    pub chunk: usize,
    /// Where its chunk starts within a rank's share.
    pub share_offset: usize,
}

/// One flat buffer: the parameters of one dtype, in bucket order, each bucket padded.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlatBuffer {
    pub dtype: String,
    pub params: Vec<FlatParam>,
    /// The elements of the parameters.
    pub len: usize,
    /// The buffer's length: the buckets' padded lengths summed.
    pub padded: usize,
    /// Each rank's share: `padded / world_size`.
    pub share: usize,
    /// The buckets in buffer order (empty in manifests written before buckets: one bucket).
    #[serde(default)]
    pub buckets: Vec<FlatBucket>,
}

impl FlatBuffer {
    /// The buckets; a manifest without them describes one bucket over the whole buffer.
    pub fn bucket_list(&self) -> Vec<FlatBucket> {
        if !self.buckets.is_empty() {
            return self.buckets.clone();
        }
        vec![FlatBucket {
            offset: 0,
            len: self.len,
            padded: self.padded,
            chunk: self.share,
            share_offset: 0,
        }]
    }

    /// The buffer in flat order from the shares of every rank concatenated in rank order
    /// (`rank_major`, `[padded]`): bucket by bucket, each rank's chunk of it in rank order.
    pub fn flat_order(&self, rank_major: &Tensor, world_size: usize) -> Result<Tensor> {
        let buckets = self.bucket_list();
        if buckets.len() == 1 {
            return Ok(rank_major.clone());
        }
        let mut parts = Vec::with_capacity(buckets.len() * world_size);
        for b in &buckets {
            for r in 0..world_size {
                parts.push(rank_major.narrow(0, r * self.share + b.share_offset, b.chunk)?);
            }
        }
        let refs: Vec<&Tensor> = parts.iter().collect();
        Tensor::cat(&refs, 0)
    }
}

/// The flat layout of a sharded optimizer: what a checkpoint's manifest records, so that it
/// can be re-sharded at another world size.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ZeroLayout {
    pub world_size: usize,
    /// Per group: its parameters' positions.
    pub groups: Vec<Vec<usize>>,
    pub flats: Vec<FlatBuffer>,
}

/// Bucket sizes in bytes: the first bucket's and the others'.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct BucketCaps {
    pub(super) first: usize,
    pub(super) cap: usize,
}

impl ZeroLayout {
    /// The layout of `params` (per group) over `world_size` ranks, in DDP's buckets of `caps`,
    /// and the buckets' launch order (flat, bucket within it): the order backward fills them.
    pub(super) fn new(
        groups: &[Vec<Tensor>],
        world_size: usize,
        caps: BucketCaps,
    ) -> (ZeroLayout, Vec<(usize, usize)>) {
        let all: Vec<&Tensor> = groups.iter().flatten().collect();
        let mut positions = Vec::with_capacity(groups.len());
        let mut index = 0;
        for g in groups {
            positions.push((index..index + g.len()).collect());
            index += g.len();
        }
        let dtypes: Vec<DType> = all.iter().map(|p| p.dtype()).collect();
        let numels: Vec<usize> = all.iter().map(|p| p.elem_count()).collect();
        let order: Vec<usize> = (0..all.len()).rev().collect();
        let buckets = assign_buckets(&order, &dtypes, &numels, caps.first, caps.cap);
        let mut flats: Vec<FlatBuffer> = Vec::new();
        let mut launch = Vec::with_capacity(buckets.len());
        for b in &buckets {
            let dtype = b.dtype.as_str().to_string();
            let fi = match flats.iter().position(|f| f.dtype == dtype) {
                Some(i) => i,
                None => {
                    flats.push(FlatBuffer {
                        dtype,
                        params: Vec::new(),
                        len: 0,
                        padded: 0,
                        share: 0,
                        buckets: Vec::new(),
                    });
                    flats.len() - 1
                }
            };
            let f = &mut flats[fi];
            let offset = f.padded;
            let mut at = offset;
            for &i in &b.params {
                f.params.push(FlatParam {
                    index: i,
                    shape: all[i].dims().to_vec(),
                    offset: at,
                });
                at += numels[i];
            }
            let chunk = b.numel.div_ceil(world_size).max(1);
            launch.push((fi, f.buckets.len()));
            f.buckets.push(FlatBucket {
                offset,
                len: b.numel,
                padded: chunk * world_size,
                chunk,
                share_offset: f.share,
            });
            f.len += b.numel;
            f.padded += chunk * world_size;
            f.share += chunk;
        }
        let layout = ZeroLayout {
            world_size,
            groups: positions,
            flats,
        };
        (layout, launch)
    }

    /// The parameters' count across the groups.
    pub fn num_params(&self) -> usize {
        self.groups.iter().map(Vec::len).sum()
    }
}

/// A piece of this rank's share: the elements of one parameter that fall in its chunk of a
/// bucket, or the padding at the end of such a chunk.
#[derive(Debug)]
pub(super) struct Piece {
    pub(super) flat: usize,
    /// The bucket (its launch position) whose chunk holds the piece.
    pub(super) bucket: usize,
    /// The first element within that chunk.
    pub(super) at: usize,
    /// The first element within this rank's share of the flat buffer.
    pub(super) share_at: usize,
    /// Position of the parameter (None: padding).
    pub(super) param: Option<usize>,
    /// The first element within the parameter.
    pub(super) param_start: usize,
    pub(super) len: usize,
    /// The inner optimizer's parameter: the master (FP32 at O2) or a copy in the parameter's
    /// dtype, `[len]`.
    pub(super) value: Tensor,
    pub(super) group: usize,
}
