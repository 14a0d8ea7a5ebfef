//! The last kernel of a plan: every output computed from the inputs and the reductions'
//! temporaries, grid-strided, [`VEC`] elements a thread where the host allows.

use std::fmt::Write;

use super::emit::{count, small_flag, split, storage_type, Emitter, Section};
use super::{Plan, VEC};
use crate::fuse::ir::Dims;

/// The outputs' kernel: each output's elements in turn, grid-strided; returns the outputs'
/// compressed dims.
pub(super) fn outputs_kernel(
    em: &Emitter,
    kernel: &str,
    rank: usize,
    src: &mut String,
) -> Vec<Dims> {
    let g = em.g;
    let n_in = em.n_in;
    let _ = writeln!(
        src,
        "extern \"C\" __global__ void {kernel}(const FuseParams p) {{"
    );
    *src += &small_flag(rank);
    let mut out_dims = Vec::new();
    for (k, &o) in g.outputs.iter().enumerate() {
        let it = &g.items[o];
        let dims = Plan::compress(em.groups, it.dims);
        out_dims.push(dims);
        let st = storage_type(it.dtype);
        let b = n_in + em.temps.len() + k;
        let acc = if it.wide() { "double" } else { "float" };
        let need = em.needed(&[o]);
        if em.varies(o) {
            let mut w = String::new();
            let _ = writeln!(
                w,
                "  if (p.vec != 0) {{\n  for (u64 u = global_tid(); u < (u64){} / {VEC}; u += global_stride()) {{\n        \
                 i64 idx[{rank}] = {{0}};",
                count(dims, rank)
            );
            split(&mut w, &format!("u * {VEC}"), dims, rank);
            em.emit(&need, Section::Invariant, &mut w);
            let _ = writeln!(
                w,
                "        FuseVec<{st}> yv;\n        #pragma unroll\n        for (int e = 0; e < {VEC}; ++e) {{"
            );
            em.emit(&need, Section::Lane, &mut w);
            let _ = writeln!(
                w,
                "          yv.v[e] = Num<{st}>::from(({acc})v{o});\n        }}\n        \
                 *(FuseVec<{st}>*)&((({st}*)p.ptr[{b}])[u * {VEC}]) = yv;\n  }}\n  }} else"
            );
            *src += &w;
        }
        let _ = writeln!(
            src,
            "  for (u64 i = global_tid(); i < (u64){}; i += global_stride()) {{\n        i64 idx[{rank}] = {{0}};",
            count(dims, rank)
        );
        let mut body = String::new();
        split(&mut body, "i", dims, rank);
        em.emit(&need, Section::All, &mut body);
        *src += &body;
        let _ = writeln!(
            src,
            "        (({st}*)p.ptr[{b}])[i] = Num<{st}>::from(({acc})v{o});\n  }}"
        );
    }
    let _ = writeln!(src, "}}");
    out_dims
}
