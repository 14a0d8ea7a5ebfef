//! The attention family on CUDA: the scaled, causal-masked softmax (`kernels/attention.cu`) on
//! contiguous rows, a warp or a block per row holding the row in registers, and the fused path
//! through the flash-attention kernels (`flash_attention.rs`), which the tensor layer chooses
//! only while [`flash_attention_available`] says so.

use super::common::{float_sfx, same_dtype};
use super::cudnn_attention::{cudnn_backward, cudnn_backward_packed, cudnn_forward};
use super::flash_attention::{
    flash_backward, flash_forward, FlashDims, FlashGrads, FlashInputs, FlashView,
};
use super::launch::{launch, Grid};
use super::registry::Family;
use super::storage::CudaStorage;
use crate::backend::BackendStorage;
use crate::backend::{AttentionOps, MaskedSoftmaxParams, SdpaKeyValue, SdpaParams, SdpaSaved};
use crate::base::error::{Error, Result};
use crate::base::Layout;

/// Whether `scaled_dot_product_attention` takes the fused (flash) kernels on device `ordinal`
/// where they apply: the one switch [`crate::tensor::fused_supported`] reads. The kernels need
/// tensor-core `mma.sync` (compute capability 8.0 or newer); `MIXPREC_FLASH_ATTENTION=0` turns
/// the fused path off (every call then takes the math path). A device that does not open gives
/// false. `scaled_dot_product_attention_fused` runs the kernels whatever this says. The variable
/// is read once, at the first call (every attention call asks), so set it before the first op.
pub fn flash_attention_available(ordinal: usize) -> bool {
    static TURNED_OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if *TURNED_OFF.get_or_init(|| std::env::var("MIXPREC_FLASH_ATTENTION").is_ok_and(|v| v == "0"))
    {
        return false;
    }
    super::device(ordinal).is_ok_and(|d| d.compute_capability().0 >= 8)
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

/// The fused kernels' problem of a call (they take one head size for q, k and v).
fn flash_dims(op: &'static str, p: &SdpaParams) -> Result<FlashDims> {
    if p.head_dim_v != p.head_dim {
        return Err(Error::Unsupported {
            op,
            detail: format!(
                "the fused kernels take v's head size equal to q's and k's ({} vs {})",
                p.head_dim_v, p.head_dim
            ),
        });
    }
    Ok(FlashDims {
        batch: p.batch,
        heads: p.heads,
        seq_q: p.seq_q,
        seq_k: p.seq_k,
        head_dim: p.head_dim,
        causal: p.causal,
        scale: p.scale as f32,
    })
}

/// An operand as the fused kernels read it: `None` where its layout fits them as it is, else a
/// contiguous copy (and its layout).
fn fitted(s: &CudaStorage, l: &Layout) -> Result<Option<(CudaStorage, Layout)>> {
    if FlashView::fits_bhtd(l) {
        return Ok(None);
    }
    let c = Layout::contiguous(l.shape().clone());
    Ok(Some((s.copy_strided(l, &c)?, c)))
}

/// The view of an operand, or of its fitted copy.
fn view<'a>(
    s: &'a CudaStorage,
    l: &'a Layout,
    copy: &'a Option<(CudaStorage, Layout)>,
) -> Result<FlashView<'a>> {
    match copy {
        Some((c, cl)) => FlashView::from_bhtd(c, cl),
        None => FlashView::from_bhtd(s, l),
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
        l: &Layout,
        kv: SdpaKeyValue<'_, Self>,
        p: &SdpaParams,
    ) -> Result<(Self, Self)> {
        let d = flash_dims("sdpa_forward", p)?;
        let ((k, kl), (v, vl)) = (kv.k, kv.v);
        let (qc, kc, vc) = (fitted(self, l)?, fitted(k, kl)?, fitted(v, vl)?);
        let inp = FlashInputs {
            q: view(self, l, &qc)?,
            k: view(k, kl, &kc)?,
            v: view(v, vl, &vc)?,
        };
        let out = match cudnn_forward(&inp, &d)? {
            Some(out) => out,
            None => flash_forward(&inp, &d)?,
        };
        Ok((out.o, out.lse))
    }

    fn sdpa_backward(
        &self,
        l: &Layout,
        saved: SdpaSaved<'_, Self>,
        p: &SdpaParams,
    ) -> Result<(Self, Self, Self)> {
        let d = flash_dims("sdpa_backward", p)?;
        with_grads(self, l, saved, |g| {
            let r = match cudnn_backward(g, &d)? {
                Some(r) => r,
                None => flash_backward(g, &d)?,
            };
            Ok((r.dq, r.dk, r.dv))
        })
    }

    fn sdpa_backward_packed(
        &self,
        l: &Layout,
        saved: SdpaSaved<'_, Self>,
        p: &SdpaParams,
    ) -> Result<Option<Self>> {
        let d = flash_dims("sdpa_backward_packed", p)?;
        if d.seq_q != d.seq_k {
            return Ok(None);
        }
        // Our kernels write three buffers: where cuDNN has no plan the caller packs them.
        with_grads(self, l, saved, |g| cudnn_backward_packed(g, &d))
    }
}

/// Runs `f` on the backward's operands as the fused kernels read them (dO is `grad_out`).
fn with_grads<R>(
    grad_out: &CudaStorage,
    l: &Layout,
    saved: SdpaSaved<'_, CudaStorage>,
    f: impl FnOnce(&FlashGrads<'_>) -> Result<R>,
) -> Result<R> {
    let ((q, ql), (k, kl), (v, vl), (o, ol)) = (saved.q, saved.k, saved.v, saved.o);
    let (qc, kc, vc) = (fitted(q, ql)?, fitted(k, kl)?, fitted(v, vl)?);
    let (oc, gc) = (fitted(o, ol)?, fitted(grad_out, l)?);
    f(&FlashGrads {
        q: view(q, ql, &qc)?,
        k: view(k, kl, &kc)?,
        v: view(v, vl, &vc)?,
        o: view(o, ol, &oc)?,
        lse: saved.lse.0,
        grad_out: view(grad_out, l, &gc)?,
    })
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
