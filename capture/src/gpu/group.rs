//! How the ranks of a tensor-parallel group join it, each on its own thread: alone, as threads
//! of this process, or through NCCL.
use std::rc::Rc;

use super::comm::{Communicator, LocalComm, SingleRank};
use super::nccl::{self, NcclComm};
use super::DeviceKind;
use crate::error::Result;

/// Joins a rank's group; runs on the rank's own thread (NCCL communicators stay there).
pub(crate) type CommInit = Box<dyn FnOnce() -> Result<Rc<dyn Communicator>> + Send>;

/// How each rank of `tp` on `device` joins its group: alone, as threads of this process, or
/// through NCCL over GPUs `0..tp`. A build with the `fault-injection` feature makes the
/// in-process rank that `HSLAKE_TEST_FAIL_ALL_REDUCE` names fail (see [`super::fault`]).
pub(crate) fn join_group(device: DeviceKind, tp: usize) -> Result<Vec<CommInit>> {
    fn joined(c: impl Communicator + Send + 'static) -> CommInit {
        Box::new(move || Ok(Rc::new(c) as Rc<dyn Communicator>))
    }
    Ok(match (device, tp) {
        (_, 1) => vec![joined(SingleRank)],
        (DeviceKind::Cpu, n) => {
            #[cfg(feature = "fault-injection")]
            let fault = super::fault::from_env()?;
            LocalComm::group(n)
                .into_iter()
                .map(|c| {
                    #[cfg(feature = "fault-injection")]
                    if let Some((_, at, kind)) = fault.filter(|(rank, ..)| *rank == c.rank()) {
                        return joined(super::fault::FailingComm::new(c, at, kind));
                    }
                    joined(c)
                })
                .collect()
        }
        (DeviceKind::Cuda, n) => {
            let id = nccl::unique_id()?;
            (0..n)
                .map(|r| {
                    Box::new(move || Ok(Rc::new(NcclComm::init(id, r, n)?) as Rc<dyn Communicator>))
                        as CommInit
                })
                .collect()
        }
    })
}
