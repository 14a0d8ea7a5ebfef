//! Data-parallel training over several processes, one per device (PyTorch's
//! `torch.distributed` + `DistributedDataParallel`, apex's DDP): a process group from the
//! launcher's environment, collectives on tensors through NCCL (GPUs) or a CPU backend (tests
//! and development), and the model wrapper that averages gradients in buckets while backward
//! runs.
//!
//! - `env.rs`: the launcher's variables (torchrun, Slurm, `train_resnet --nproc-per-node`);
//! - `rendezvous.rs`, `wire.rs`: rank 0's TCP rendezvous and the frames on mixprec's links;
//! - `control.rs`: the control plane: dead and hung ranks, fault relay, host-side gathers;
//! - `group.rs`: `ProcessGroup` and its collectives; `cpu.rs` and `nccl.rs`: the backends;
//!   `collective.rs`: what they share (the reduction ops, the collectives, the backend codes);
//! - `ddp.rs`, `reducer.rs`: `DistributedDataParallel` and its gradient buckets;
//! - `data_parallel.rs`, `data_parallel_worker.rs`: `DataParallel`, several devices from one
//!   process (a worker thread per device, DDP's buckets between them);
//! - `sync_batch_norm.rs`: `SyncBatchNorm`, batch statistics over every rank;
//! - `zero.rs`: ZeRO-sharded optimizers (state and masters split over the ranks);
//! - `launch.rs`: spawning and supervising the rank processes of one machine.
//!
//! A dead or hung rank is an [`Error::Distributed`](crate::Error::Distributed) on every other
//! rank within a bounded time, naming the rank; docs/distributed.md ("Faults") shows each fault.

mod collective;
mod control;
mod cpu;
pub mod data_parallel;
mod data_parallel_worker;
pub mod ddp;
pub mod env;
mod group;
mod handoff;
pub mod launch;
mod nccl;
mod nccl_comm;
mod reducer;
mod rendezvous;
pub mod signals;
pub mod sync_batch_norm;
mod wire;
pub mod zero;

pub use collective::{Backend, ReduceOp};
pub use data_parallel::{DataParallel, DataParallelConfig};
pub use data_parallel_worker::Replica;
pub use ddp::{DdpConfig, DistributedDataParallel, NoSyncGuard};
pub use env::{LaunchEnv, Launcher};
pub use group::{default_timeout, GroupOptions, ProcessGroup, Work};
pub use reducer::ReductionStats;
pub use sync_batch_norm::{convert_sync_batchnorm, SyncBatchNorm};
pub use zero::{
    ShardContext, ShardableOptimizer, ShardedOptimizer, ZeroAdam, ZeroLamb, ZeroLayout, ZeroSgd,
};
