//! The fused optimizers a [`ShardedOptimizer`](super::ShardedOptimizer) runs on its pieces:
//! their configs, hyperparameters, and LAMB's norms completed over the ranks.

use super::*;

impl ShardableOptimizer for FusedLamb {
    type Config = LambConfig;
    const NAME: &'static str = "ZeroLamb";
    fn build(groups: Vec<ParamGroup<LambConfig>>) -> Result<Self> {
        FusedLamb::with_groups(groups)
    }
    fn hyperparams(c: &LambConfig) -> Hyperparams {
        c.to_hyperparams()
    }
    fn from_hyperparams(h: &Hyperparams) -> Result<LambConfig> {
        LambConfig::from_hyperparams(h)
    }
    fn with_lr(c: &LambConfig, lr: f64) -> Result<LambConfig> {
        let c = LambConfig { lr, ..*c };
        c.validate()?;
        Ok(c)
    }
    fn attach(&mut self, ctx: ShardContext) -> Result<()> {
        self.set_norm_reducer(Box::new(LambNorms::new(ctx)?));
        Ok(())
    }
}

/// LAMB's norms over the ranks: the global gradient norm from the shares' squared norms
/// (summed over the ranks), and each tensor's norm from its pieces' squared norms, summed per
/// tensor by a 0/1 matrix product (pieces × tensors, made once) and over the ranks: on the
/// device, the same calls every step.
struct LambNorms {
    group: ProcessGroup,
    /// Per group: the [pieces, tensors] 0/1 matrix (None for a group without pieces here).
    maps: Vec<Option<Tensor>>,
    group_sizes: Vec<usize>,
    device: Device,
}

impl LambNorms {
    fn new(ctx: ShardContext) -> Result<LambNorms> {
        let mut maps = Vec::with_capacity(ctx.pieces.len());
        for (pieces, &n) in ctx.pieces.iter().zip(&ctx.group_sizes) {
            if pieces.is_empty() {
                maps.push(None);
                continue;
            }
            let mut m = vec![0f32; pieces.len() * n];
            for (k, p) in pieces.iter().enumerate() {
                if let Some(i) = p {
                    m[k * n + i] = 1.0;
                }
            }
            maps.push(Some(
                Tensor::from_vec(m, [pieces.len(), n], Device::Cpu)?.to_device(ctx.device)?,
            ));
        }
        Ok(LambNorms {
            group: ctx.group,
            maps,
            group_sizes: ctx.group_sizes,
            device: ctx.device,
        })
    }
}

impl LambNormReducer for LambNorms {
    fn global_norm(&self, norm: &Tensor) -> Result<()> {
        let sq = norm.sqr()?.owned()?;
        self.group.all_reduce(&sq, ReduceOp::Sum)?;
        norm.copy_in_place(&sq.sqrt()?)
    }

    fn tensor_norms(&self, norms: &[Option<&Tensor>]) -> Result<()> {
        // Per group, each tensor's sum of its pieces' squared norms here; one all-reduce of
        // all groups' sums.
        let mut sums = Vec::with_capacity(self.maps.len());
        for ((m, t), &n) in self.maps.iter().zip(norms).zip(&self.group_sizes) {
            sums.push(match (m, t) {
                (Some(m), Some(t)) => {
                    let k = t.elem_count();
                    t.sqr()?.reshape([1, k])?.matmul(m)?.reshape([n])?
                }
                _ => Tensor::zeros([n], DType::F32, self.device)?,
            });
        }
        let refs: Vec<&Tensor> = sums.iter().collect();
        let all = Tensor::cat(&refs, 0)?.owned()?;
        self.group.all_reduce(&all, ReduceOp::Sum)?;
        let mut at = 0;
        for ((m, t), &n) in self.maps.iter().zip(norms).zip(&self.group_sizes) {
            if let (Some(m), Some(t)) = (m, t) {
                let total = all.narrow(0, at, n)?.reshape([1, n])?;
                let back = total.matmul(&m.transpose(0, 1)?)?.sqrt()?;
                t.copy_in_place(&back.reshape([t.elem_count()])?)?;
            }
            at += n;
        }
        Ok(())
    }
}

impl ShardableOptimizer for FusedAdam {
    type Config = AdamConfig;
    const NAME: &'static str = "ZeroAdam";
    fn build(groups: Vec<ParamGroup<AdamConfig>>) -> Result<Self> {
        FusedAdam::with_groups(groups)
    }
    fn hyperparams(c: &AdamConfig) -> Hyperparams {
        c.to_hyperparams()
    }
    fn from_hyperparams(h: &Hyperparams) -> Result<AdamConfig> {
        AdamConfig::from_hyperparams(h)
    }
    fn with_lr(c: &AdamConfig, lr: f64) -> Result<AdamConfig> {
        let c = AdamConfig { lr, ..*c };
        c.validate()?;
        Ok(c)
    }
}

impl ShardableOptimizer for FusedSgd {
    type Config = SgdConfig;
    const NAME: &'static str = "ZeroSgd";
    fn build(groups: Vec<ParamGroup<SgdConfig>>) -> Result<Self> {
        FusedSgd::with_groups(groups)
    }
    fn hyperparams(c: &SgdConfig) -> Hyperparams {
        c.to_hyperparams()
    }
    fn from_hyperparams(h: &Hyperparams) -> Result<SgdConfig> {
        SgdConfig::from_hyperparams(h)
    }
    fn with_lr(c: &SgdConfig, lr: f64) -> Result<SgdConfig> {
        let c = SgdConfig { lr, ..*c };
        c.validate()?;
        Ok(c)
    }
}
