//! Test fault injection: an in-process rank whose N-th all-reduce fails, for tests of what a
//! lost rank does to the engine and to a long-running process. Unit tests build the failing
//! rank themselves; the capture daemon's end-to-end test reaches it through
//! [`FAULT_ENV`], which only a build with the `fault-injection` cargo feature reads, so a
//! normal build never looks at it.
use std::cell::Cell;

use tch::Tensor;

use crate::error::{CaptureError, Result};
use crate::gpu::comm::{Communicator, LocalComm};

/// Environment variable that injects a communicator failure into in-process (CPU) groups of a
/// build with the `fault-injection` feature: `RANK:N` makes rank RANK's N-th all-reduce fail.
pub const FAULT_ENV: &str = "HSLAKE_TEST_FAIL_ALL_REDUCE";

/// The (rank, call) that [`FAULT_ENV`] names, if it is set.
#[cfg(feature = "fault-injection")]
pub(crate) fn from_env() -> Result<Option<(usize, usize)>> {
    match std::env::var(FAULT_ENV) {
        Ok(v) => {
            let (rank, call) = parse_fault(&v)?;
            tracing::warn!("{FAULT_ENV}: rank {rank}'s all-reduce {call} will fail (a test build)");
            Ok(Some((rank, call)))
        }
        Err(_) => Ok(None),
    }
}

/// `RANK:N` as (rank, call), N >= 1.
fn parse_fault(v: &str) -> Result<(usize, usize)> {
    let parsed = v
        .split_once(':')
        .and_then(|(r, n)| Some((r.trim().parse().ok()?, n.trim().parse().ok()?)));
    match parsed {
        Some((rank, call)) if call > 0 => Ok((rank, call)),
        _ => Err(CaptureError::Option(format!(
            "{FAULT_ENV}={v:?}; expected RANK:N with N >= 1 (rank RANK's N-th all-reduce fails)"
        ))),
    }
}

/// A rank of an in-process group whose `fail_at`-th all-reduce fails: an injected
/// communicator failure.
pub(crate) struct FailingComm {
    inner: LocalComm,
    fail_at: usize,
    calls: Cell<usize>,
}

impl FailingComm {
    /// `inner`, failing at its `fail_at`-th all-reduce (counted from 1).
    pub(crate) fn new(inner: LocalComm, fail_at: usize) -> Self {
        FailingComm {
            inner,
            fail_at,
            calls: Cell::new(0),
        }
    }
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
            return Err(CaptureError::Comm {
                rank: self.rank(),
                message: "injected failure".into(),
            });
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
    fn an_injected_fault_names_a_rank_and_a_call_from_one() {
        assert_eq!(parse_fault("1:12").unwrap(), (1, 12));
        for bad in ["1", "1:0", "x:3", ""] {
            let e = parse_fault(bad).unwrap_err().to_string();
            assert!(e.contains(FAULT_ENV) && e.contains("RANK:N"), "{e}");
        }
    }

    #[test]
    fn the_failing_rank_fails_at_its_call_and_its_peer_is_released() {
        let mut group = LocalComm::group(2);
        let peer = group.pop().unwrap();
        let failing = FailingComm::new(group.pop().unwrap(), 2);
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
