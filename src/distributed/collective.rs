//! The vocabulary that a process group and its engines share: what a reduction does
//! ([`ReduceOp`]), which collective a call is ([`Coll`]), and which engine carries the data
//! ([`Backend`], with the codes the rendezvous compares between ranks).

use crate::tensor::Device;

/// How a reduction combines the ranks' values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    Sum = 0,
    /// The sum divided by the world size.
    Avg = 1,
    Max = 2,
    Min = 3,
}

/// A collective, as the backends see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Coll {
    AllReduce(ReduceOp),
    Broadcast(usize),
    AllGather,
    /// Reduces the input over the ranks; each rank keeps its equal share (rank order).
    ReduceScatter(ReduceOp),
    Barrier,
}

/// Which engine moves the data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// CPU tensors over TCP (processes on one machine or several): for tests and development.
    Cpu,
    /// CUDA tensors through NCCL, one GPU per process.
    Nccl,
}

impl Backend {
    /// The backend for tensors on `device`.
    pub fn for_device(device: Device) -> Backend {
        if device.is_cuda() {
            Backend::Nccl
        } else {
            Backend::Cpu
        }
    }

    /// The code a rank sends at the rendezvous (every rank must use one backend).
    pub(crate) fn code(self) -> u8 {
        self as u8
    }
}

/// The name of a backend's rendezvous code, for the error when ranks disagree.
pub(crate) fn backend_name(code: u8) -> &'static str {
    match code {
        0 => "cpu",
        1 => "nccl",
        _ => "unknown",
    }
}
