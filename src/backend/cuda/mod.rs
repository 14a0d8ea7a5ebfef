//! The CUDA backend: context and stream per device with a stream-ordered memory pool
//! (`device.rs`), library probing (`probe.rs`), the NVRTC kernel registry with its on-disk cache
//! (`registry.rs`), kernel launches (`launch.rs`), the buffer type (`storage.rs`) and its ops
//! (`ops.rs`), diagnostics (`profile.rs`: per-op device time, pool memory), cuBLAS matmul
//! (`matmul.rs`) and cuDNN convolution (`conv.rs`: the plan choice; the two cuDNN APIs in
//! `cudnn_graph.rs` and `cudnn_legacy.rs`, the timer in `conv_tune.rs`, the on-disk plan cache in
//! `conv_cache.rs`).
//! Kernels are in `kernels/*.cu` at the crate root.

mod conv;
mod conv_cache;
mod conv_tune;
mod cudnn_graph;
mod cudnn_legacy;
mod device;
mod launch;
mod matmul;
mod multi_tensor;
mod ops;
mod probe;
mod profile;
mod registry;
mod storage;

pub use conv::{
    clear_conv_plans, conv_plan_cache_dir, conv_plans, conv_timing_runs, ConvPlanInfo, PlanSource,
};
pub use device::{
    get as device, host_sync_count, set_allow_tf32, set_poison_allocations, CudaDevice,
};
pub use multi_tensor::{
    cached_lists, table_cache_clears, tables_built_on_this_thread, CudaMultiTensor,
};
pub use probe::probe;
pub(crate) use profile::OpTimer;
pub use profile::{
    mem_get_info, memory_stats, op_profile, reset_peak_memory, set_op_profiling, MemoryStats,
    OpProfileRow,
};
pub use storage::CudaStorage;

/// Whether f32 matmul/convolution may use TF32 (see [`set_allow_tf32`]).
pub fn allow_tf32() -> bool {
    device::allow_tf32()
}
