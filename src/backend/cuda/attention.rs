//! The attention family on CUDA: the scaled, causal-masked softmax (`kernels/attention.cu`) on
//! contiguous rows, a warp or a block per row holding the row in registers, and the slot of the
//! fused (flash) attention kernels, refused until they are built in
//! ([`flash_attention_available`]).

use super::common::{float_sfx, same_dtype};
use super::launch::{launch, Grid};
use super::registry::Family;
use super::storage::CudaStorage;
use crate::backend::BackendStorage;
use crate::backend::{AttentionOps, MaskedSoftmaxParams, SdpaKeyValue, SdpaParams, SdpaSaved};
use crate::base::error::{Error, Result};
use crate::base::Layout;

/// Whether the fused (flash) attention kernels are built into this process: the one switch
/// [`crate::tensor::fused_supported`] reads. Off until the kernels are wired in.
pub fn flash_attention_available() -> bool {
    false
}

/// Values a thread keeps in registers (`MS_VALS` in attention.cu).
const VALS_PER_THREAD: usize = 32;
/// Threads of a block of warp-per-row teams.
const WARP_TEAM_BLOCK: u32 = 128;
/// Most threads of a block-per-row team.
const MAX_BLOCK: usize = 1024;
/// Threads of the long-row kernels.
const LONG_BLOCK: u32 = 512;
/// Most blocks of a launch (the kernels stride over the rows beyond it).
const MAX_BLOCKS: usize = 1 << 20;

/// A launch of the masked softmax (forward or backward): the kernel name's ending, its grid and
/// the team argument (`None` for the long-row kernels, which take none).
struct Plan {
    name: String,
    grid: Grid,
    block_team: Option<i32>,
}

/// The kernel for rows of `seq_k` values of `dtype` whose buffers start at `ptrs`.
fn plan(
    kind: &str,
    sfx: &str,
    dtype: crate::base::DType,
    p: &MaskedSoftmaxParams,
    ptrs: &[u64],
) -> Plan {
    let rows = p.rows();
    let pack = 16 / dtype.size_in_bytes();
    let aligned = ptrs.iter().all(|a| a.is_multiple_of(16)) && p.seq_k.is_multiple_of(pack);
    let v = if aligned { pack } else { 1 };
    if p.seq_k <= 32 * VALS_PER_THREAD {
        let per_block = (WARP_TEAM_BLOCK / 32) as usize;
        Plan {
            name: format!("{kind}_{sfx}_v{v}"),
            grid: Grid {
                blocks: rows.div_ceil(per_block).clamp(1, MAX_BLOCKS) as u32,
                threads: WARP_TEAM_BLOCK,
            },
            block_team: Some(0),
        }
    } else if p.seq_k <= MAX_BLOCK * VALS_PER_THREAD {
        let threads = p.seq_k.div_ceil(VALS_PER_THREAD).next_multiple_of(32);
        Plan {
            name: format!("{kind}_{sfx}_v{v}"),
            grid: Grid {
                blocks: rows.clamp(1, MAX_BLOCKS) as u32,
                threads: threads as u32,
            },
            block_team: Some(1),
        }
    } else {
        Plan {
            name: format!("{kind}_long_{sfx}"),
            grid: Grid {
                blocks: rows.clamp(1, MAX_BLOCKS) as u32,
                threads: LONG_BLOCK,
            },
            block_team: None,
        }
    }
}

pub(crate) fn masked_softmax(
    x: &CudaStorage,
    l: &Layout,
    p: &MaskedSoftmaxParams,
) -> Result<CudaStorage> {
    let s = float_sfx("masked_softmax", x.dtype())?;
    let src = x.ptr_at(l)?;
    let n = p.rows() * p.seq_k;
    let out = CudaStorage::alloc(&x.dev, x.dtype(), n)?;
    if n == 0 {
        return Ok(out);
    }
    let pl = plan("masked_softmax", s, x.dtype(), p, &[src, out.ptr()]);
    let (rows, sq, sk) = (p.rows() as u64, p.seq_q as u64, p.seq_k as u64);
    let causal = p.causal as i32;
    match pl.block_team {
        Some(team) => launch!(x.dev, Family::Attention, pl.name, pl.grid;
            rows, sq, sk, p.scale, causal, team, src, out.ptr()),
        None => launch!(x.dev, Family::Attention, pl.name, pl.grid;
            rows, sq, sk, p.scale, causal, src, out.ptr()),
    }
    Ok(out)
}

pub(crate) fn masked_softmax_backward(
    g: &CudaStorage,
    lg: &Layout,
    y: &CudaStorage,
    ly: &Layout,
    p: &MaskedSoftmaxParams,
) -> Result<CudaStorage> {
    let op = "masked_softmax_backward";
    let s = float_sfx(op, g.dtype())?;
    same_dtype(op, g, y)?;
    let (pg, py) = (g.ptr_at(lg)?, y.ptr_at(ly)?);
    let n = p.rows() * p.seq_k;
    let out = CudaStorage::alloc(&g.dev, g.dtype(), n)?;
    if n == 0 {
        return Ok(out);
    }
    let pl = plan(
        "masked_softmax_backward",
        s,
        g.dtype(),
        p,
        &[pg, py, out.ptr()],
    );
    let (rows, sq, sk) = (p.rows() as u64, p.seq_q as u64, p.seq_k as u64);
    let causal = p.causal as i32;
    match pl.block_team {
        Some(team) => launch!(g.dev, Family::Attention, pl.name, pl.grid;
            rows, sq, sk, p.scale, causal, team, pg, py, out.ptr()),
        None => launch!(g.dev, Family::Attention, pl.name, pl.grid;
            rows, sq, sk, p.scale, causal, pg, py, out.ptr()),
    }
    Ok(out)
}

/// The refusal of the fused kernels' slot while they are not built in.
fn not_built(op: &'static str) -> Error {
    Error::Unsupported {
        op,
        detail: "fused attention is not built yet".into(),
    }
}

impl AttentionOps for CudaStorage {
    fn masked_softmax(&self, l: &Layout, p: &MaskedSoftmaxParams) -> Result<Self> {
        masked_softmax(self, l, p)
    }

    fn masked_softmax_backward(
        &self,
        l: &Layout,
        y: &Self,
        yl: &Layout,
        p: &MaskedSoftmaxParams,
    ) -> Result<Self> {
        masked_softmax_backward(self, l, y, yl, p)
    }

    fn sdpa_forward(
        &self,
        _l: &Layout,
        _kv: SdpaKeyValue<'_, Self>,
        _p: &SdpaParams,
    ) -> Result<(Self, Self)> {
        Err(not_built("sdpa_forward"))
    }

    fn sdpa_backward(
        &self,
        _l: &Layout,
        _saved: SdpaSaved<'_, Self>,
        _p: &SdpaParams,
    ) -> Result<(Self, Self, Self)> {
        Err(not_built("sdpa_backward"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::base::DType;

    fn p(batch: usize, seq_q: usize, seq_k: usize) -> MaskedSoftmaxParams {
        MaskedSoftmaxParams {
            batch,
            seq_q,
            seq_k,
            scale: 0.125,
            causal: true,
        }
    }

    #[test]
    fn the_plan_keeps_each_row_in_one_teams_registers() {
        // GPT-2's rows: a warp each, 16-byte packs, four warps a block.
        let pl = plan(
            "masked_softmax",
            "f16",
            DType::F16,
            &p(24, 1024, 1024),
            &[0, 4096],
        );
        assert_eq!(pl.name, "masked_softmax_f16_v8");
        assert_eq!(pl.block_team, Some(0));
        assert_eq!((pl.grid.blocks, pl.grid.threads), (24 * 1024 / 4, 128));
        // Unaligned rows (a view at an odd offset, or a row length off the pack) read singly.
        let pl = plan(
            "masked_softmax",
            "f16",
            DType::F16,
            &p(1, 4, 1024),
            &[2, 4096],
        );
        assert_eq!(pl.name, "masked_softmax_f16_v1");
        let pl = plan("masked_softmax", "f32", DType::F32, &p(1, 4, 130), &[0, 0]);
        assert_eq!(pl.name, "masked_softmax_f32_v1");
        // Longer rows: a block each, enough threads for 32 values apiece.
        let pl = plan(
            "masked_softmax",
            "bf16",
            DType::BF16,
            &p(2, 8, 4096),
            &[0, 0],
        );
        assert_eq!(pl.block_team, Some(1));
        assert_eq!((pl.grid.blocks, pl.grid.threads), (16, 128));
        let pl = plan(
            "masked_softmax",
            "f32",
            DType::F32,
            &p(1, 1, 32 * 1024),
            &[0, 0],
        );
        assert_eq!((pl.block_team, pl.grid.threads), (Some(1), 1024));
        // Past a block's registers: the long-row kernels.
        let pl = plan(
            "masked_softmax",
            "f32",
            DType::F32,
            &p(1, 3, 32 * 1024 + 1),
            &[0, 0],
        );
        assert_eq!(pl.name, "masked_softmax_long_f32");
        assert_eq!(pl.block_team, None);
    }
}
