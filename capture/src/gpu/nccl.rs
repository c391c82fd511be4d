//! NCCL back end of [`Communicator`]: our own minimal FFI to `libnccl.so.2` from the
//! nvidia-nccl-cu13 wheel — the copy libtorch_cuda itself loads. (Loading NCCL dynamically
//! by name can pick up a second, system copy, and two NCCLs in one process corrupt every
//! communicator.) One rank per thread, one thread per GPU, collectives on libtorch's
//! default stream so they are ordered with the surrounding kernels.
use std::cell::Cell;
use std::ffi::{c_char, c_int, c_void, CStr};

use tch::{Device, Kind, Tensor};

use crate::error::{CaptureError, Result};
use crate::gpu::comm::Communicator;

/// NCCL's opaque 128-byte rendezvous token; plain bytes, so it can be handed to every rank thread.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId {
    internal: [c_char; 128],
}

type RawComm = *mut c_void;

const NCCL_SUM: c_int = 0;

extern "C" {
    fn ncclGetUniqueId(id: *mut UniqueId) -> c_int;
    fn ncclCommInitRank(comm: *mut RawComm, nranks: c_int, id: UniqueId, rank: c_int) -> c_int;
    fn ncclCommDestroy(comm: RawComm) -> c_int;
    fn ncclCommAbort(comm: RawComm) -> c_int;
    fn ncclAllReduce(
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        datatype: c_int,
        op: c_int,
        comm: RawComm,
        stream: *mut c_void,
    ) -> c_int;
    fn ncclGetErrorString(result: c_int) -> *const c_char;
    fn ncclGetVersion(version: *mut c_int) -> c_int;
}

fn check(code: c_int, rank: usize, what: &str) -> Result<()> {
    if code == 0 {
        return Ok(());
    }
    // SAFETY: ncclGetErrorString returns a static NUL-terminated string for any code.
    let msg = unsafe { CStr::from_ptr(ncclGetErrorString(code)) }
        .to_string_lossy()
        .into_owned();
    Err(CaptureError::Comm {
        rank,
        message: format!("{what}: {msg} (NCCL error {code})"),
    })
}

/// A fresh rendezvous token; create once and give a copy to every rank.
pub fn unique_id() -> Result<UniqueId> {
    let mut id = UniqueId { internal: [0; 128] };
    // SAFETY: `id` is a valid out-pointer of the declared layout.
    check(unsafe { ncclGetUniqueId(&mut id) }, 0, "ncclGetUniqueId")?;
    Ok(id)
}

/// The linked NCCL's version code (e.g. 22809 for 2.28.9).
pub fn version() -> Result<i32> {
    let mut v = 0;
    // SAFETY: `v` is a valid out-pointer.
    check(unsafe { ncclGetVersion(&mut v) }, 0, "ncclGetVersion")?;
    Ok(v)
}

fn nccl_type(kind: Kind) -> Option<c_int> {
    match kind {
        Kind::Half => Some(6),
        Kind::Float => Some(7),
        Kind::Double => Some(8),
        Kind::BFloat16 => Some(9),
        _ => None,
    }
}

/// One rank's NCCL communicator. Holds a raw pointer, so it stays on the thread that made it.
pub struct NcclComm {
    comm: RawComm,
    rank: usize,
    world: usize,
    aborted: Cell<bool>,
}

impl NcclComm {
    /// Joins the group (blocks until all `world` ranks have called this); uses GPU `rank`.
    pub fn init(id: UniqueId, rank: usize, world: usize) -> Result<Self> {
        crate::gpu::cuda::set_device(rank)?;
        let mut comm = std::ptr::null_mut();
        // SAFETY: `comm` is a valid out-pointer; `id` is passed by value as NCCL expects.
        check(
            unsafe { ncclCommInitRank(&mut comm, world as c_int, id, rank as c_int) },
            rank,
            "ncclCommInitRank",
        )?;
        Ok(NcclComm {
            comm,
            rank,
            world,
            aborted: Cell::new(false),
        })
    }
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn all_reduce_sum(&self, t: &mut Tensor) -> Result<()> {
        let err = |m: String| CaptureError::Comm {
            rank: self.rank,
            message: m,
        };
        if self.aborted.get() {
            return Err(err("communicator was aborted".into()));
        }
        if t.device() != Device::Cuda(self.rank) {
            return Err(err(format!(
                "all-reduce of a tensor on {:?}, expected cuda:{}",
                t.device(),
                self.rank
            )));
        }
        if !t.is_contiguous() {
            return Err(err("all-reduce needs a contiguous tensor".into()));
        }
        let dt =
            nccl_type(t.kind()).ok_or_else(|| err(format!("no NCCL type for {:?}", t.kind())))?;
        let ptr = t.data_ptr();
        // SAFETY: in-place all-reduce over `numel` elements of a live contiguous CUDA tensor on
        // this rank's device; null stream = the legacy default stream libtorch enqueues on.
        let code = unsafe {
            ncclAllReduce(
                ptr,
                ptr,
                t.numel(),
                dt,
                NCCL_SUM,
                self.comm,
                std::ptr::null_mut(),
            )
        };
        check(code, self.rank, "ncclAllReduce")
    }

    fn abort(&self) {
        if !self.aborted.replace(true) {
            // SAFETY: the communicator is live and, once aborted, never used or destroyed again.
            unsafe { ncclCommAbort(self.comm) };
        }
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        if !self.aborted.get() {
            // SAFETY: the communicator is live and destroyed exactly once.
            unsafe { ncclCommDestroy(self.comm) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn links_the_wheel_nccl_and_reports_its_version() {
        // The wheel torch 2.11 ships is NCCL 2.28.x; a CPU machine can still query the version.
        let v = version().unwrap();
        assert!(
            (22800..23000).contains(&v),
            "unexpected NCCL version code {v}"
        );
    }

    #[test]
    fn all_reduce_over_one_gpu_rank_is_the_identity() {
        if !tch::Cuda::is_available() {
            eprintln!("skipped: no CUDA device");
            return;
        }
        let comm = NcclComm::init(unique_id().unwrap(), 0, 1).unwrap();
        let mut t = Tensor::from_slice(&[1.5f32, -2.0, 3.25]).to_device(Device::Cuda(0));
        comm.all_reduce_sum(&mut t).unwrap();
        assert_eq!(
            Vec::<f32>::try_from(t.to_device(Device::Cpu)).unwrap(),
            vec![1.5, -2.0, 3.25]
        );
    }
}
