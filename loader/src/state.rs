//! The loader's resume point: a few numbers, serialisable as JSON.
use serde::{Deserialize, Serialize};

use crate::{LoaderConfig, LoaderError, Remainder, ShuffleMode};

/// Where a loader is in its stream, plus the settings that fix the order, so that resuming
/// under different settings is refused instead of silently repeating or skipping samples.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoaderState {
    /// Format of this state.
    pub format: u32,
    /// The dataset version the loader was pinned to.
    pub dataset_version: u64,
    /// The version whose samples are being read: equal to `dataset_version`, or in follow mode
    /// a later version whose newly added shards are being read.
    pub segment_version: u64,
    /// The epoch.
    pub epoch: u64,
    /// Samples of this reader's part of the epoch (or segment) already delivered.
    pub position: u64,
    /// Shuffle seed.
    pub seed: u64,
    /// Whether the order was shuffled.
    pub shuffle: bool,
    /// Row groups per shuffle window.
    pub shuffle_window: usize,
    /// Window or per-sample shuffle (states saved before the mode existed are window).
    #[serde(default)]
    pub shuffle_mode: ShuffleMode,
    /// Rank.
    pub rank: usize,
    /// World size.
    pub world_size: usize,
    /// Worker within the rank.
    pub worker: usize,
    /// Workers per rank.
    pub num_workers: usize,
    /// Remainder policy.
    pub remainder: Remainder,
}

/// Current format of [`LoaderState`].
pub const STATE_FORMAT: u32 = 1;

impl LoaderState {
    /// The state at the start of `epoch` of a version, for a configuration.
    pub fn start(config: &LoaderConfig, version: u64, epoch: u64) -> Self {
        LoaderState {
            format: STATE_FORMAT,
            dataset_version: version,
            segment_version: version,
            epoch,
            position: 0,
            seed: config.seed,
            shuffle: config.shuffle,
            shuffle_window: config.shuffle_window,
            shuffle_mode: config.shuffle_mode,
            rank: config.rank,
            world_size: config.world_size,
            worker: config.worker,
            num_workers: config.num_workers,
            remainder: config.remainder(),
        }
    }

    /// As JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// From JSON.
    pub fn from_json(s: &str) -> Result<Self, LoaderError> {
        let st: LoaderState =
            serde_json::from_str(s).map_err(|e| LoaderError::BadState(e.to_string()))?;
        if st.format != STATE_FORMAT {
            return Err(LoaderError::BadState(format!(
                "state format {} is not the supported {STATE_FORMAT}",
                st.format
            )));
        }
        Ok(st)
    }

    /// Refuse a state saved under settings that give another order.
    pub fn check_matches(&self, config: &LoaderConfig, version: u64) -> Result<(), LoaderError> {
        fn differ<T: PartialEq + std::fmt::Debug>(
            field: &'static str,
            saved: T,
            current: T,
        ) -> Result<(), LoaderError> {
            if saved == current {
                Ok(())
            } else {
                Err(LoaderError::StateMismatch {
                    field,
                    saved: format!("{saved:?}"),
                    current: format!("{current:?}"),
                })
            }
        }
        differ("dataset_version", self.dataset_version, version)?;
        differ("seed", self.seed, config.seed)?;
        differ("shuffle", self.shuffle, config.shuffle)?;
        differ("shuffle_mode", self.shuffle_mode, config.shuffle_mode)?;
        // The window shapes only the window shuffle's order.
        if self.shuffle && self.shuffle_mode == ShuffleMode::Window {
            differ("shuffle_window", self.shuffle_window, config.shuffle_window)?;
        }
        differ("rank", self.rank, config.rank)?;
        differ("world_size", self.world_size, config.world_size)?;
        differ("worker", self.worker, config.worker)?;
        differ("num_workers", self.num_workers, config.num_workers)?;
        differ("remainder", self.remainder, config.remainder())?;
        if self.segment_version < self.dataset_version {
            return Err(LoaderError::BadState(format!(
                "segment_version {} is before dataset_version {}",
                self.segment_version, self.dataset_version
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_through_json() {
        let mut s = LoaderState::start(&LoaderConfig::default(), 3, 2);
        s.position = 17;
        assert_eq!(LoaderState::from_json(&s.to_json()).unwrap(), s);
    }

    #[test]
    fn refuses_a_state_from_another_rank_or_seed() {
        let c = LoaderConfig {
            rank: 1,
            world_size: 2,
            seed: 5,
            ..Default::default()
        };
        let s = LoaderState::start(&c, 1, 0);
        let other = LoaderConfig {
            rank: 0,
            ..c.clone()
        };
        let err = s.check_matches(&other, 1).unwrap_err().to_string();
        assert_eq!(
            err,
            "cannot resume: the saved state has rank = 1, but this loader has 0"
        );
        let other = LoaderConfig {
            seed: 6,
            ..c.clone()
        };
        assert!(s.check_matches(&other, 1).is_err());
        assert!(s.check_matches(&c, 2).is_err(), "another pinned version");
        assert!(s.check_matches(&c, 1).is_ok());
    }

    #[test]
    fn a_state_of_the_other_shuffle_mode_is_refused_and_the_window_matters_only_to_its_mode() {
        let sample = LoaderConfig {
            shuffle_mode: ShuffleMode::Sample,
            ..Default::default()
        };
        let s = LoaderState::start(&sample, 1, 0);
        let err = s
            .check_matches(&LoaderConfig::default(), 1)
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "cannot resume: the saved state has shuffle_mode = Sample, but this loader has Window"
        );
        let other_window = LoaderConfig {
            shuffle_window: 3,
            ..sample.clone()
        };
        assert!(s.check_matches(&other_window, 1).is_ok());
        let w = LoaderState::start(&LoaderConfig::default(), 1, 0);
        let other_window = LoaderConfig {
            shuffle_window: 3,
            ..Default::default()
        };
        assert!(w.check_matches(&other_window, 1).is_err());
    }

    #[test]
    fn a_state_saved_before_shuffle_modes_reads_as_window() {
        let mut json: serde_json::Value =
            serde_json::from_str(&LoaderState::start(&LoaderConfig::default(), 1, 0).to_json())
                .unwrap();
        json.as_object_mut().unwrap().remove("shuffle_mode");
        let s = LoaderState::from_json(&json.to_string()).unwrap();
        assert_eq!(s.shuffle_mode, ShuffleMode::Window);
    }

    #[test]
    fn rejects_garbage() {
        assert!(LoaderState::from_json("{\"format\": 1}").is_err());
        assert!(LoaderState::from_json("not json").is_err());
    }
}
