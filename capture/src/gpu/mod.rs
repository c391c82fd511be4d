//! GPU plumbing, and its CPU stand-ins: which device the ranks run on, the CUDA runtime calls
//! libtorch does not expose ([`cuda`]), NVRTC ([`nvrtc`]), the collectives between ranks
//! ([`comm`], over NCCL in [`nccl`], joined as [`group`] says), and the plane split kernel
//! ([`plane_split`]); our fused kernels of the forward ([`fused`]), attention's kernel choice
//! ([`sdpa`]), and the per-part profile of a forward ([`sections`]).
pub(crate) mod comm;
pub(crate) mod cuda;
#[cfg(any(test, feature = "fault-injection"))]
pub(crate) mod fault;
pub(crate) mod fused;
pub(crate) mod group;
pub(crate) mod nccl;
pub(crate) mod nvrtc;
pub(crate) mod plane_split;
pub(crate) mod sdpa;
pub(crate) mod sections;

/// Where the forward runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceKind {
    /// CPU; tensor parallelism through the in-process back end.
    Cpu,
    /// CUDA GPUs `0..tp`; tensor parallelism through NCCL.
    Cuda,
}

impl DeviceKind {
    /// The device rank `rank` runs on: the CPU, or GPU `rank`.
    pub fn device(self, rank: usize) -> tch::Device {
        match self {
            DeviceKind::Cpu => tch::Device::Cpu,
            DeviceKind::Cuda => tch::Device::Cuda(rank),
        }
    }
}

impl std::str::FromStr for DeviceKind {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "cpu" => Ok(DeviceKind::Cpu),
            "cuda" | "gpu" => Ok(DeviceKind::Cuda),
            _ => Err(format!("unknown device {s:?}; expected cpu or cuda")),
        }
    }
}
