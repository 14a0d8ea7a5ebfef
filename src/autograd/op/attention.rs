//! Backward of the attention family: the masked softmax from its saved output, and the fused
//! attention's dq, dk, dv from one backend call, keeping those that are needed.

use super::{Op, Wanted};
use crate::base::error::Result;
use crate::tensor::Tensor;

pub(super) fn backward(op: &Op, g: &Tensor, w: &mut Wanted<'_>) -> Result<Vec<Option<Tensor>>> {
    match op {
        Op::MaskedSoftmax { y, p } => w.one(|| g.masked_softmax_backward(y, p)),
        Op::Sdpa(n) => {
            if !(w.need(0) || w.need(1) || w.need(2)) {
                return Ok(vec![None, None, None]);
            }
            let (dq, dk, dv) = g.sdpa_backward(n)?;
            Ok(vec![
                w.need(0).then_some(dq),
                w.need(1).then_some(dk),
                w.need(2).then_some(dv),
            ])
        }
        Op::SdpaPacked(n) => w.one(|| g.sdpa_backward_packed(n)),
        _ => Err(op.misrouted("attention")),
    }
}
