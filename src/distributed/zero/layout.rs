//! The flat layout of a sharded optimizer (what a checkpoint's manifest records) and the
//! pieces of one rank's share.

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

/// One flat buffer: the parameters of one dtype, in order, padded.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlatBuffer {
    pub dtype: String,
    pub params: Vec<FlatParam>,
    /// The elements of the parameters.
    pub len: usize,
    /// `len` rounded up to a multiple of the world size.
    pub padded: usize,
    /// Each rank's share: `padded / world_size`.
    pub share: usize,
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

impl ZeroLayout {
    /// The layout of `params` (per group) over `world_size` ranks.
    pub(super) fn new(groups: &[Vec<Tensor>], world_size: usize) -> ZeroLayout {
        let mut flats: Vec<FlatBuffer> = Vec::new();
        let mut positions = Vec::with_capacity(groups.len());
        let mut index = 0;
        for g in groups {
            let mut pos = Vec::with_capacity(g.len());
            for p in g {
                let dtype = p.dtype().as_str().to_string();
                let f = match flats.iter_mut().position(|f| f.dtype == dtype) {
                    Some(i) => &mut flats[i],
                    None => {
                        flats.push(FlatBuffer {
                            dtype,
                            params: Vec::new(),
                            len: 0,
                            padded: 0,
                            share: 0,
                        });
                        flats.last_mut().expect("just pushed")
                    }
                };
                f.params.push(FlatParam {
                    index,
                    shape: p.dims().to_vec(),
                    offset: f.len,
                });
                f.len += p.elem_count();
                pos.push(index);
                index += 1;
            }
            positions.push(pos);
        }
        for f in &mut flats {
            f.share = f.len.div_ceil(world_size).max(1);
            f.padded = f.share * world_size;
        }
        ZeroLayout {
            world_size,
            groups: positions,
            flats,
        }
    }

    /// The parameters' count across the groups.
    pub fn num_params(&self) -> usize {
        self.groups.iter().map(Vec::len).sum()
    }
}

/// A piece of this rank's share: the elements of one parameter that fall in it, or the padding
/// at the end of the last share.
#[derive(Debug)]
pub(super) struct Piece {
    pub(super) flat: usize,
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
