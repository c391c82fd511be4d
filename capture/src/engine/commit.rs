//! When a writer commits: after so many samples or so much time since its last commit,
//! whichever comes first, so a crash loses at most that window.
use std::time::Duration;

/// A writer's commit policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CommitPolicy {
    /// Commit after this many samples...
    pub every: u64,
    /// ...or after this long, whichever comes first.
    pub interval: Duration,
}

impl Default for CommitPolicy {
    fn default() -> Self {
        CommitPolicy {
            every: 1000,
            interval: Duration::from_secs(60),
        }
    }
}

impl CommitPolicy {
    /// Whether a writer holding `pending` uncommitted samples, `elapsed` after its last
    /// commit, commits now. Nothing pending means nothing to commit.
    pub fn due(&self, pending: u64, elapsed: Duration) -> bool {
        pending > 0 && (pending >= self.every || elapsed >= self.interval)
    }

    /// How long a writer waiting for samples may sleep before its next commit check.
    pub fn wait(&self, elapsed: Duration) -> Duration {
        self.interval
            .saturating_sub(elapsed)
            .max(Duration::from_millis(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const POLICY: CommitPolicy = CommitPolicy {
        every: 3,
        interval: Duration::from_secs(10),
    };

    #[test]
    fn commits_on_count_or_time_but_never_with_nothing_pending() {
        let s = Duration::from_secs;
        assert!(!POLICY.due(2, s(9)));
        assert!(POLICY.due(3, s(0)));
        assert!(POLICY.due(1, s(10)));
        assert!(!POLICY.due(0, s(100)));
    }

    #[test]
    fn waits_until_the_interval_ends_and_never_zero() {
        assert_eq!(POLICY.wait(Duration::from_secs(4)), Duration::from_secs(6));
        assert_eq!(
            POLICY.wait(Duration::from_secs(40)),
            Duration::from_millis(1)
        );
    }
}
