//! Test fault injection: an in-process rank whose N-th all-reduce fails, as a lost peer or as
//! an allocation libtorch refuses, for tests of what a lost rank or an out-of-memory error does
//! to the engine and to a long-running process. Unit tests build the failing rank themselves;
//! the end-to-end tests reach it through [`FAULT_ENV`], which only a build with the
//! `fault-injection` cargo feature reads, so a normal build never looks at it.
use std::cell::Cell;

use tch::Tensor;

use crate::error::{CaptureError, Result};
use crate::gpu::comm::{Communicator, LocalComm};

/// Environment variable that injects a failure into in-process (CPU) groups of a build with
/// the `fault-injection` feature: `RANK:N` makes rank RANK's N-th all-reduce fail as a lost
/// peer, `RANK:N:oom` as an allocation that libtorch refuses.
pub const FAULT_ENV: &str = "HSLAKE_TEST_FAIL_ALL_REDUCE";

/// How an injected all-reduce fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fault {
    /// The communicator reports a lost peer.
    Comm,
    /// libtorch refuses an allocation (8 PiB): the out-of-memory error a too large batch meets.
    OutOfMemory,
}

/// The (rank, call, fault) that [`FAULT_ENV`] names, if it is set.
#[cfg(feature = "fault-injection")]
pub(crate) fn from_env() -> Result<Option<(usize, usize, Fault)>> {
    match std::env::var(FAULT_ENV) {
        Ok(v) => {
            let (rank, call, fault) = parse_fault(&v)?;
            tracing::warn!(
                "{FAULT_ENV}: rank {rank}'s all-reduce {call} will fail ({fault:?}; a test build)"
            );
            Ok(Some((rank, call, fault)))
        }
        Err(_) => Ok(None),
    }
}

/// `RANK:N` or `RANK:N:oom` as (rank, call, fault), N >= 1.
fn parse_fault(v: &str) -> Result<(usize, usize, Fault)> {
    let mut parts = v.split(':').map(str::trim);
    let rank = parts.next().and_then(|r| r.parse().ok());
    let call = parts.next().and_then(|n| n.parse().ok());
    let fault = match parts.next() {
        None => Some(Fault::Comm),
        Some("oom") => Some(Fault::OutOfMemory),
        Some(_) => None,
    };
    match (rank, call, fault, parts.next()) {
        (Some(rank), Some(call), Some(fault), None) if call > 0 => Ok((rank, call, fault)),
        _ => Err(CaptureError::Option(format!(
            "{FAULT_ENV}={v:?}; expected RANK:N or RANK:N:oom with N >= 1 (rank RANK's N-th \
             all-reduce fails, as a lost peer or as a refused allocation)"
        ))),
    }
}

/// A rank of an in-process group whose `fail_at`-th all-reduce fails: an injected
/// communicator failure or out-of-memory error.
pub(crate) struct FailingComm {
    inner: LocalComm,
    fail_at: usize,
    fault: Fault,
    calls: Cell<usize>,
}

impl FailingComm {
    /// `inner`, failing at its `fail_at`-th all-reduce (counted from 1) as `fault` says.
    pub(crate) fn new(inner: LocalComm, fail_at: usize, fault: Fault) -> Self {
        FailingComm {
            inner,
            fail_at,
            fault,
            calls: Cell::new(0),
        }
    }
}

/// An allocation libtorch's allocator refuses on any device: an 8 PiB copy of a broadcast
/// view of one element of `t` (the view itself holds no memory).
fn refused_allocation(t: &Tensor) -> Result<()> {
    let huge = t
        .f_flatten(0, -1)?
        .f_narrow(0, 0, 1)?
        .f_expand([1i64 << 51], false)?;
    let _ = huge.f_add(&crate::scalar::float(1.0)?)?;
    Err(CaptureError::Pipeline(
        "an 8 PiB allocation meant to fail succeeded".into(),
    ))
}

impl Communicator for FailingComm {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn all_reduce_sum(&self, t: &mut Tensor) -> Result<()> {
        self.calls.set(self.calls.get() + 1);
        if self.calls.get() == self.fail_at {
            return match self.fault {
                Fault::Comm => Err(CaptureError::Comm {
                    rank: self.rank(),
                    message: "injected failure".into(),
                }),
                Fault::OutOfMemory => refused_allocation(t),
            };
        }
        self.inner.all_reduce_sum(t)
    }
    fn abort(&self) {
        self.inner.abort()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_injected_fault_names_a_rank_a_call_from_one_and_its_kind() {
        assert_eq!(parse_fault("1:12").unwrap(), (1, 12, Fault::Comm));
        assert_eq!(parse_fault("0:3:oom").unwrap(), (0, 3, Fault::OutOfMemory));
        for bad in ["1", "1:0", "x:3", "", "1:2:disk", "1:2:oom:3"] {
            let e = parse_fault(bad).unwrap_err().to_string();
            assert!(e.contains(FAULT_ENV) && e.contains("RANK:N"), "{e}");
        }
    }

    #[test]
    fn the_failing_rank_fails_at_its_call_and_its_peer_is_released() {
        let mut group = LocalComm::group(2);
        let peer = group.pop().unwrap();
        let failing = FailingComm::new(group.pop().unwrap(), 2, Fault::Comm);
        let other = std::thread::spawn(move || {
            let mut t = Tensor::from_slice(&[1.0f32]);
            let first = peer.all_reduce_sum(&mut t).map(|()| t.double_value(&[0]));
            let second = peer.all_reduce_sum(&mut t);
            (first, second)
        });
        let mut t = Tensor::from_slice(&[2.0f32]);
        failing.all_reduce_sum(&mut t).unwrap();
        assert_eq!(t.double_value(&[0]), 3.0);
        let e = failing.all_reduce_sum(&mut t).unwrap_err().to_string();
        assert_eq!(e, "communicator (rank 0): injected failure");
        failing.abort();
        let (first, second) = other.join().unwrap();
        assert_eq!(first.unwrap(), 3.0);
        assert!(second
            .unwrap_err()
            .to_string()
            .contains("another rank failed"));
    }
}
