//! Backward of layer norm and RMS norm: the input's and the parameters' gradients from one
//! backend call, keeping those that are needed.

use super::{Op, Wanted};
use crate::backend::{
    norm_stats_layout, NormBackwardOperands, NormBackwardParams, NormParamGrads, NormSaved,
};
use crate::base::error::Result;
use crate::tensor::Tensor;

pub(super) fn backward(op: &Op, g: &Tensor, w: &mut Wanted<'_>) -> Result<Vec<Option<Tensor>>> {
    let Op::Norm(n) = op else {
        return Err(op.misrouted("layer_norm"));
    };
    // Inputs in the order recorded: x, then the weight and the bias where the norm had them.
    let wi = n.weight.as_ref().map(|_| 1);
    let bi = n.has_bias.then(|| 1 + wi.unwrap_or(0));
    let want = NormParamGrads {
        weight: wi.is_some_and(|i| w.need(i)),
        bias: bi.is_some_and(|i| w.need(i)),
    };
    let g = g.contiguous()?;
    let bp = NormBackwardParams {
        norm: n.p,
        param_dtype: n.param_dtype,
        want,
    };
    let r = {
        let (gs, xs) = (g.storage(), n.x.storage());
        let (ms, rs) = (n.mean.storage(), n.rstd.storage());
        let ws = n.weight.as_ref().map(|t| t.storage());
        let wl = n.weight.as_ref().map(|t| t.layout());
        let (xl, sl) = (n.x.layout(), norm_stats_layout(n.p.rows));
        let o = NormBackwardOperands {
            x: (&*xs, &*xl),
            saved: NormSaved {
                mean: (&*ms, &sl),
                rstd: (&*rs, &sl),
            },
            weight: ws.as_deref().zip(wl.as_deref()),
        };
        gs.layer_norm_backward(&g.layout(), o, &bp)?
    };
    let mut out = vec![w
        .need(0)
        .then(|| Tensor::from_storage(r.input, n.x.shape().clone()))];
    if wi.is_some() {
        out.push(
            r.weight
                .map(|s| Tensor::from_storage(s, n.param_shape.clone())),
        );
    }
    if bi.is_some() {
        out.push(
            r.bias
                .map(|s| Tensor::from_storage(s, n.param_shape.clone())),
        );
    }
    Ok(out)
}
