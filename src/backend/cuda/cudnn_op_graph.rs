//! cuDNN graph-API operation graphs of several nodes, built by index: tensors (in device
//! memory, virtual, or scalars passed by value), pointwise, matmul, reduction and reshape
//! operations, and the first execution plan cuDNN's heuristics propose that builds. What
//! `cudnn_attention.rs` writes its SDPA graphs with (`cudnn_graph.rs` holds the single-node
//! convolution graphs and the descriptor type they share).

use cudarc::cudnn::sys as dsys;
use dsys::cudnnBackendAttributeName_t as A;
use dsys::cudnnBackendAttributeType_t as T;
use dsys::cudnnBackendDescriptorType_t as D;
use dsys::cudnnDataType_t as Dt;
use dsys::cudnnPointwiseMode_t as Pw;

use super::cudnn_graph::{engine_configs, Desc};
use crate::base::error::Result;

/// Unique ids of virtual tensors count up from here (those of buffers and scalars are the
/// caller's, below it).
const FIRST_VIRTUAL: i64 = 100;

/// A built plan with every descriptor it refers to, or why there is none.
pub(super) struct Plan {
    _descs: Vec<Desc>,
    pub(super) plan: Desc,
    pub(super) workspace: usize,
}

/// An operation graph under construction: its tensors and operations, by index.
pub(super) struct OpGraph {
    tensors: Vec<Desc>,
    ops: Vec<Desc>,
    /// Descriptors the operations refer to (pointwise modes, matmul and reduction settings).
    keep: Vec<Desc>,
    next_virtual: i64,
}

#[derive(Clone, Copy)]
pub(super) struct Tn(usize);

pub(super) type Dims = [i64; 4];

/// Packed strides of `dims` (the last dimension contiguous).
pub(super) fn packed(d: Dims) -> Dims {
    [d[1] * d[2] * d[3], d[2] * d[3], d[3], 1]
}

impl OpGraph {
    pub(super) fn new() -> Self {
        OpGraph {
            tensors: Vec::new(),
            ops: Vec::new(),
            keep: Vec::new(),
            next_virtual: FIRST_VIRTUAL,
        }
    }

    fn tensor(&mut self, id: i64, dims: Dims, strides: Dims, dt: Dt, kind: Kind) -> Result<Tn> {
        let d = Desc::new(D::CUDNN_BACKEND_TENSOR_DESCRIPTOR)?;
        d.set(
            A::CUDNN_ATTR_TENSOR_DATA_TYPE,
            T::CUDNN_TYPE_DATA_TYPE,
            &[dt],
        )?;
        d.set_i64s(A::CUDNN_ATTR_TENSOR_DIMENSIONS, &dims)?;
        d.set_i64s(A::CUDNN_ATTR_TENSOR_STRIDES, &strides)?;
        d.set_i64s(A::CUDNN_ATTR_TENSOR_UNIQUE_ID, &[id])?;
        d.set_i64s(A::CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, &[16])?;
        match kind {
            Kind::Buffer => {}
            Kind::Virtual => d.set(
                A::CUDNN_ATTR_TENSOR_IS_VIRTUAL,
                T::CUDNN_TYPE_BOOLEAN,
                &[true],
            )?,
            Kind::ByValue => d.set(
                A::CUDNN_ATTR_TENSOR_IS_BY_VALUE,
                T::CUDNN_TYPE_BOOLEAN,
                &[true],
            )?,
        }
        self.tensors.push(d.finalize("a tensor descriptor")?);
        Ok(Tn(self.tensors.len() - 1))
    }

    /// A tensor in device memory, named by `id` in the variant pack.
    pub(super) fn buffer(&mut self, id: i64, dims: Dims, strides: Dims, dt: Dt) -> Result<Tn> {
        self.tensor(id, dims, strides, dt, Kind::Buffer)
    }

    /// An f32 scalar passed by value (a host pointer in the variant pack).
    pub(super) fn scalar(&mut self, id: i64) -> Result<Tn> {
        self.tensor(id, [1; 4], [1; 4], Dt::CUDNN_DATA_FLOAT, Kind::ByValue)
    }

    /// An intermediate that never leaves the fused kernel.
    pub(super) fn virt(&mut self, dims: Dims, strides: Dims, dt: Dt) -> Result<Tn> {
        let id = self.next_virtual;
        self.next_virtual += 1;
        self.tensor(id, dims, strides, dt, Kind::Virtual)
    }

    fn t(&self, x: Tn) -> &Desc {
        &self.tensors[x.0]
    }

    /// `y = mode(x[, b[, t]])`, computed in `prec`; `axis` for GEN_INDEX.
    pub(super) fn pointwise(
        &mut self,
        mode: Pw,
        prec: Dt,
        inputs: &[Tn],
        y: Tn,
        axis: Option<i64>,
    ) -> Result<()> {
        let pw = Desc::new(D::CUDNN_BACKEND_POINTWISE_DESCRIPTOR)?;
        pw.set(
            A::CUDNN_ATTR_POINTWISE_MODE,
            T::CUDNN_TYPE_POINTWISE_MODE,
            &[mode],
        )?;
        pw.set(
            A::CUDNN_ATTR_POINTWISE_MATH_PREC,
            T::CUDNN_TYPE_DATA_TYPE,
            &[prec],
        )?;
        if let Some(axis) = axis {
            pw.set_i64s(A::CUDNN_ATTR_POINTWISE_AXIS, &[axis])?;
        }
        let pw = pw.finalize("a pointwise descriptor")?;
        let op = Desc::new(D::CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR)?;
        op.set_descs(A::CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, &[&pw])?;
        let names = [
            A::CUDNN_ATTR_OPERATION_POINTWISE_XDESC,
            A::CUDNN_ATTR_OPERATION_POINTWISE_BDESC,
            A::CUDNN_ATTR_OPERATION_POINTWISE_TDESC,
        ];
        for (name, x) in names.iter().zip(inputs) {
            op.set_descs(*name, &[self.t(*x)])?;
        }
        op.set_descs(A::CUDNN_ATTR_OPERATION_POINTWISE_YDESC, &[self.t(y)])?;
        op.set(
            A::CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1,
            T::CUDNN_TYPE_FLOAT,
            &[1f32],
        )?;
        op.set(
            A::CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2,
            T::CUDNN_TYPE_FLOAT,
            &[1f32],
        )?;
        self.ops
            .push(op.finalize(&format!("the pointwise {mode:?} operation"))?);
        self.keep.push(pw);
        Ok(())
    }

    /// `y = mode(inputs)` in f32.
    pub(super) fn pw(&mut self, mode: Pw, inputs: &[Tn], y: Tn) -> Result<()> {
        self.pointwise(mode, Dt::CUDNN_DATA_FLOAT, inputs, y, None)
    }

    /// `c = a · b` over the last two dimensions, batched over the first two, f32 accumulation.
    pub(super) fn matmul(&mut self, a: Tn, b: Tn, c: Tn) -> Result<()> {
        let mm = Desc::new(D::CUDNN_BACKEND_MATMUL_DESCRIPTOR)?;
        mm.set(
            A::CUDNN_ATTR_MATMUL_COMP_TYPE,
            T::CUDNN_TYPE_DATA_TYPE,
            &[Dt::CUDNN_DATA_FLOAT],
        )?;
        let mm = mm.finalize("a matmul descriptor")?;
        let op = Desc::new(D::CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR)?;
        op.set_descs(A::CUDNN_ATTR_OPERATION_MATMUL_ADESC, &[self.t(a)])?;
        op.set_descs(A::CUDNN_ATTR_OPERATION_MATMUL_BDESC, &[self.t(b)])?;
        op.set_descs(A::CUDNN_ATTR_OPERATION_MATMUL_CDESC, &[self.t(c)])?;
        op.set_descs(A::CUDNN_ATTR_OPERATION_MATMUL_DESC, &[&mm])?;
        self.ops.push(op.finalize("a matmul operation")?);
        self.keep.push(mm);
        Ok(())
    }

    /// `y = reduce(x)` over the dimensions where `y` has extent 1, in f32.
    pub(super) fn reduction(
        &mut self,
        how: dsys::cudnnReduceTensorOp_t,
        x: Tn,
        y: Tn,
    ) -> Result<()> {
        let r = Desc::new(D::CUDNN_BACKEND_REDUCTION_DESCRIPTOR)?;
        r.set(
            A::CUDNN_ATTR_REDUCTION_COMP_TYPE,
            T::CUDNN_TYPE_DATA_TYPE,
            &[Dt::CUDNN_DATA_FLOAT],
        )?;
        r.set(
            A::CUDNN_ATTR_REDUCTION_OPERATOR,
            T::CUDNN_TYPE_REDUCTION_OPERATOR_TYPE,
            &[how],
        )?;
        let r = r.finalize("a reduction descriptor")?;
        let op = Desc::new(D::CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR)?;
        op.set_descs(A::CUDNN_ATTR_OPERATION_REDUCTION_XDESC, &[self.t(x)])?;
        op.set_descs(A::CUDNN_ATTR_OPERATION_REDUCTION_YDESC, &[self.t(y)])?;
        op.set_descs(A::CUDNN_ATTR_OPERATION_REDUCTION_DESC, &[&r])?;
        self.ops.push(op.finalize("a reduction operation")?);
        self.keep.push(r);
        Ok(())
    }

    /// `y` = `x` seen with `y`'s dimensions and strides (a transpose, here).
    pub(super) fn reshape(&mut self, x: Tn, y: Tn) -> Result<()> {
        let op = Desc::new(D::CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR)?;
        op.set_descs(A::CUDNN_ATTR_OPERATION_RESHAPE_XDESC, &[self.t(x)])?;
        op.set_descs(A::CUDNN_ATTR_OPERATION_RESHAPE_YDESC, &[self.t(y)])?;
        self.ops.push(op.finalize("a reshape operation")?);
        Ok(())
    }

    /// Finalizes the graph and builds the first plan cuDNN's heuristics propose that builds.
    pub(super) fn plan(
        self,
        handle: dsys::cudnnHandle_t,
    ) -> Result<std::result::Result<Plan, String>> {
        let graph = Desc::new(D::CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR)?;
        graph.set(
            A::CUDNN_ATTR_OPERATIONGRAPH_HANDLE,
            T::CUDNN_TYPE_HANDLE,
            &[handle],
        )?;
        let ops: Vec<&Desc> = self.ops.iter().collect();
        graph.set_descs(A::CUDNN_ATTR_OPERATIONGRAPH_OPS, &ops)?;
        let graph = match graph.finalize("the attention operation graph") {
            Ok(g) => g,
            Err(e) => return Ok(Err(e.to_string())),
        };
        let mut why = Vec::new();
        for mode in [
            dsys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_A,
            dsys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_FALLBACK,
        ] {
            let configs = match engine_configs(&graph, mode) {
                Ok(c) => c,
                Err(e) => {
                    why.push(format!("{mode:?}: {e}"));
                    continue;
                }
            };
            for config in configs {
                let plan = Desc::new(D::CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR)?;
                plan.set(
                    A::CUDNN_ATTR_EXECUTION_PLAN_HANDLE,
                    T::CUDNN_TYPE_HANDLE,
                    &[handle],
                )?;
                plan.set_descs(A::CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, &[&config])?;
                match plan.finalize("an attention execution plan") {
                    Ok(plan) => {
                        let mut ws = [0i64];
                        plan.get(
                            A::CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                            T::CUDNN_TYPE_INT64,
                            &mut ws,
                        )?;
                        let mut descs = self.tensors;
                        descs.extend(self.ops);
                        descs.extend(self.keep);
                        descs.push(graph);
                        descs.push(config);
                        return Ok(Ok(Plan {
                            _descs: descs,
                            plan,
                            workspace: ws[0].max(0) as usize,
                        }));
                    }
                    Err(e) => why.push(e.to_string()),
                }
            }
        }
        if why.is_empty() {
            why.push("the heuristics proposed no engine".into());
        }
        Ok(Err(why.join("; ")))
    }
}

#[derive(Clone, Copy)]
enum Kind {
    Buffer,
    Virtual,
    ByValue,
}
