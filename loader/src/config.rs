use std::time::Duration;

use hslake_schemas::CapturePoint;
use serde::{Deserialize, Serialize};

use crate::{LoaderError, LoaderOptions, Preset};

/// How samples are grouped into batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Batching {
    /// A fixed number of samples per batch.
    Samples(usize),
    /// As many samples as fit a token budget: `B × T` padded, or `ΣT` packed.
    Tokens(usize),
}

/// How the samples of a batch are laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Layout {
    /// `[B, T]` right-padded to the longest sample, with an attention mask.
    #[default]
    Padded,
    /// One row `[1, ΣT]`, with `cu_seqlens` and document ids instead of padding.
    Packed,
}

/// How an epoch's order is shuffled (see `plan` for both orders).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ShuffleMode {
    /// Row groups permuted, then samples permuted within windows of `shuffle_window` row
    /// groups: each row group is read once per epoch; batches mix fewer row groups.
    #[default]
    Window,
    /// A full per-sample permutation of the epoch: each row group is read once per lookahead
    /// of `lookahead_bytes`, only its picked rows.
    Sample,
}

/// What to do with the samples left over when the dataset does not divide among the ranks
/// (the same choice as torch's `DistributedSampler`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Remainder {
    /// Every rank gets `ceil(N / world)` samples; the shortfall repeats samples from the start
    /// of the epoch's order.
    #[default]
    Pad,
    /// Every rank gets `floor(N / world)` samples; the last `N mod world` of the epoch's order
    /// are left out of this epoch.
    Drop,
}

/// What to do with a row group that cannot be read or decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CorruptPolicy {
    /// Stop with an error naming the shard file.
    #[default]
    Error,
    /// Leave its samples out, log a warning naming the file, and count them.
    Skip,
}

/// Keep reading versions committed after the pinned one.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Follow {
    /// How often to look for a new version.
    pub poll_interval: Duration,
    /// End the pass after this long without a new version (`None`: wait forever).
    pub idle_timeout: Option<Duration>,
}

/// Everything that shapes what a loader yields, resolved from [`LoaderOptions`] (or built
/// directly in Rust).
#[derive(Debug, Clone, PartialEq)]
pub struct LoaderConfig {
    /// Batch by samples or by tokens.
    pub batching: Batching,
    /// Padded or packed batches.
    pub layout: Layout,
    /// Truncate every sample to at most this many tokens.
    pub max_seq_len: Option<usize>,
    /// Round the padded length up to a multiple of this.
    pub pad_to_multiple_of: Option<usize>,
    /// Token id written into padding.
    pub pad_token_id: i64,
    /// This process's rank.
    pub rank: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// Sub-partition of this rank (e.g. a torch DataLoader worker).
    pub worker: usize,
    /// Number of sub-partitions per rank.
    pub num_workers: usize,
    /// Seed of the shuffle; with the epoch it fixes the order on every machine.
    pub seed: u64,
    /// Shuffle at all.
    pub shuffle: bool,
    /// Row groups whose samples are shuffled together; memory holds about this many row groups.
    pub shuffle_window: usize,
    /// Window shuffle (the default) or a full per-sample permutation.
    pub shuffle_mode: ShuffleMode,
    /// In sample mode: raw tensor bytes (estimated from the manifest) of the samples read
    /// together; memory holds about this much decoded, and a row group is read once per
    /// lookahead it has samples in.
    pub lookahead_bytes: u64,
    /// Policy for samples that do not divide among ranks.
    pub remainder: Remainder,
    /// Leave out a last batch smaller than the batch size or budget.
    pub drop_last_batch: bool,
    /// Auxiliary capture points, concatenated in this order (`None`: every point but the target).
    pub aux_layers: Option<Vec<CapturePoint>>,
    /// The target point (`None`: `final_norm` if captured, else the last point).
    pub target: Option<CapturePoint>,
    /// A trainer's named convention, resolved against the dataset's layer count in place of
    /// `aux_layers` and `target` (which must then be `None`).
    pub preset: Option<Preset>,
    /// Dataset version to read (`None`: the latest at open).
    pub version: Option<u64>,
    /// Row groups read ahead of use.
    pub prefetch_row_groups: usize,
    /// Assembled batches held ready ahead of use.
    pub prefetch_batches: usize,
    /// Threads that assemble batches at the same time.
    pub decode_threads: usize,
    /// Policy for unreadable row groups.
    pub on_corrupt: CorruptPolicy,
    /// Follow newly committed versions.
    pub follow: Option<Follow>,
    /// Upper bound on any single storage call, retries included.
    pub io_timeout: Duration,
}

impl Default for LoaderConfig {
    /// [`LoaderOptions`]' defaults, batching 8 samples (Python asks for `batch_size` or
    /// `max_tokens` instead of defaulting).
    fn default() -> Self {
        LoaderOptions {
            batch_size: Some(8),
            ..Default::default()
        }
        .resolve()
        .expect("the default loader options resolve")
    }
}

impl LoaderConfig {
    /// Check the values that do not need the dataset.
    pub fn check(&self) -> Result<(), LoaderError> {
        let bad = |m: String| Err(LoaderError::Config(m));
        if self.world_size == 0 {
            return bad("world_size must be at least 1".into());
        }
        if self.rank >= self.world_size {
            return bad(format!(
                "rank {} is out of range for world_size {}: ranks are 0..={}",
                self.rank,
                self.world_size,
                self.world_size - 1
            ));
        }
        if self.num_workers == 0 {
            return bad("num_workers must be at least 1".into());
        }
        if self.worker >= self.num_workers {
            return bad(format!(
                "worker {} is out of range for num_workers {}: workers are 0..={}",
                self.worker,
                self.num_workers,
                self.num_workers - 1
            ));
        }
        match self.batching {
            Batching::Samples(0) => return bad("batch_size must be at least 1".into()),
            Batching::Tokens(0) => return bad("max_tokens must be at least 1".into()),
            _ => {}
        }
        if self.max_seq_len == Some(0) {
            return bad("max_seq_len must be at least 1".into());
        }
        if self.pad_to_multiple_of == Some(0) {
            return bad("pad_to_multiple_of must be at least 1".into());
        }
        if self.shuffle_window == 0 {
            return bad("shuffle_window must be at least 1 row group".into());
        }
        if self.lookahead_bytes == 0 {
            return bad(
                "lookahead_bytes must be at least 1 (a lookahead always holds at least one \
                 sample)"
                    .into(),
            );
        }
        if self.prefetch_row_groups == 0 || self.prefetch_batches == 0 || self.decode_threads == 0 {
            return bad(
                "prefetch_row_groups, prefetch_batches and decode_threads must be at least 1"
                    .into(),
            );
        }
        if let Some(p) = self.preset {
            if self.aux_layers.is_some() || self.target.is_some() {
                return bad(format!(
                    "preset {p} chooses aux_layers and target itself; give either the preset or \
                     aux_layers/target, not both"
                ));
            }
        }
        if self.io_timeout.is_zero() {
            return bad("io_timeout must be positive".into());
        }
        if let Some(f) = self.follow {
            if f.poll_interval.is_zero() {
                return bad("follow poll_interval must be positive".into());
            }
        }
        Ok(())
    }

    /// The length every sample is cut to, if any: `max_seq_len`, and in token-budget mode also
    /// the budget, so that no batch exceeds it.
    pub fn truncate_to(&self) -> Option<usize> {
        let budget = match self.batching {
            Batching::Tokens(t) => Some(t),
            Batching::Samples(_) => None,
        };
        match (self.max_seq_len, budget) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_rank_not_below_world_size() {
        let c = LoaderConfig {
            rank: 2,
            world_size: 2,
            ..Default::default()
        };
        let err = c.check().unwrap_err().to_string();
        assert!(
            err.contains("rank 2 is out of range for world_size 2"),
            "{err}"
        );
    }

    #[test]
    fn rejects_zero_batch_size_and_budget() {
        for b in [Batching::Samples(0), Batching::Tokens(0)] {
            assert!(LoaderConfig {
                batching: b,
                ..Default::default()
            }
            .check()
            .is_err());
        }
    }

    #[test]
    fn rejects_preset_together_with_explicit_layers() {
        let c = LoaderConfig {
            preset: Some(Preset::Speculators),
            target: Some(CapturePoint::FinalNorm),
            ..Default::default()
        };
        let err = c.check().unwrap_err().to_string();
        assert!(err.contains("preset speculators chooses"), "{err}");
    }

    #[test]
    fn token_budget_also_truncates() {
        let c = LoaderConfig {
            batching: Batching::Tokens(100),
            max_seq_len: Some(300),
            ..Default::default()
        };
        assert_eq!(c.truncate_to(), Some(100));
        let c = LoaderConfig {
            batching: Batching::Samples(4),
            max_seq_len: Some(300),
            ..Default::default()
        };
        assert_eq!(c.truncate_to(), Some(300));
        assert_eq!(LoaderConfig::default().truncate_to(), None);
    }
}
