//! The loader's options, declared once: [`LoaderConfig`] holds each option's doc, type and
//! default, named as `hslake.Loader` takes its keyword arguments. Rust code fills it in
//! directly, serde reads it from the JSON of the keywords a Python user gave, and Python lists
//! it (`LoaderConfig::OPTIONS`); [`LoaderConfig::check`] refuses a value outside its option's
//! declared range or what cannot work together, and gives the values several options make
//! together ([`Resolved`]).
use std::fmt;
use std::time::Duration;

use hslake_schemas::CapturePoint;
use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::declare::{any_value, bytes, count, declare_options, millis, OptionRange, ANY};
use crate::{LoaderError, Preset};

/// Threads that assemble batches (`decode_threads`; the Python module's I/O runtime and
/// `hslake export --decode-threads` take as many): more than a machine has cores gains
/// nothing, and tens of thousands fail to spawn.
pub const DECODE_THREADS: OptionRange = count(1, 1024);

/// Seconds a single storage call may take (`timeout`; `hslake.Dataset`'s and Ray's
/// `read_hslake`'s `timeout` take the same range).
pub const IO_TIMEOUT: OptionRange = millis(1, 86_400_000);

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

any_value!(
    bool,
    ShuffleMode,
    CorruptPolicy,
    Preset,
    CapturePoint,
    Vec<CapturePoint>
);

declare_options! {
    /// Everything that shapes what a loader yields, named as `hslake.Loader` takes it. A JSON
    /// key left out takes the default; an unknown key is refused.
    pub struct LoaderConfig {
        /// Samples per batch (give this or `max_tokens`).
        pub batch_size: Option<usize> = None, in count(1, 1 << 20),
        /// Token budget per batch: `B × T` padded, `ΣT` packed (give this or `batch_size`);
        /// samples are also truncated to it.
        pub max_tokens: Option<usize> = None, in count(1, 1 << 24),
        /// One packed row with `cu_seqlens` instead of padded rows.
        pub packed: bool = false, in ANY,
        /// Truncate every sample to at most this many tokens.
        pub max_seq_len: Option<usize> = None, in count(1, 1 << 24),
        /// Round the padded length up to a multiple of this.
        pub pad_to_multiple_of: Option<usize> = None, in count(1, 1 << 16),
        /// Token id written into padding.
        pub pad_token_id: i64 = 0, in ANY,
        /// This process's rank.
        pub rank: usize = 0, in count(0, (1 << 20) - 1),
        /// Number of ranks.
        pub world_size: usize = 1, in count(1, 1 << 20),
        /// Sub-partition of this rank (a torch DataLoader worker).
        pub worker: usize = 0, in count(0, 4095),
        /// Sub-partitions per rank.
        pub num_workers: usize = 1, in count(1, 4096),
        /// Shuffle seed; with the epoch it fixes the order on every machine.
        pub seed: u64 = 0, in ANY,
        /// Shuffle at all.
        pub shuffle: bool = true, in ANY,
        /// Row groups whose samples are shuffled together (`shuffle_mode="window"`); memory
        /// holds about this many row groups.
        pub shuffle_window: usize = 16, in count(1, 1 << 16),
        /// `window` (row groups permuted, samples permuted within windows of `shuffle_window`
        /// row groups; the faster) or `sample` (a full per-sample permutation of the epoch).
        pub shuffle_mode: ShuffleMode = ShuffleMode::Window, in ANY,
        /// With `shuffle_mode="sample"`: raw tensor bytes (estimated from the manifest) of the
        /// samples read ahead together; memory holds about this much decoded, and a row group
        /// is read once per lookahead it has samples in.
        pub lookahead_bytes: u64 = 256 << 20, in bytes(1, 256 << 30),
        /// Leave out the samples that do not divide among ranks instead of repeating some.
        pub drop_last: bool = false, in ANY,
        /// Leave out a last batch smaller than the batch size or budget.
        pub drop_last_batch: bool = false, in ANY,
        /// Auxiliary points, concatenated in this order: layer indices or names (`30`,
        /// `"layer_30"`). None: every point but the target.
        #[serde(deserialize_with = "points")]
        pub aux_layers: Option<Vec<CapturePoint>> = None, in ANY,
        /// The target point. None: `final_norm` if captured, else the last point.
        #[serde(deserialize_with = "point")]
        pub target: Option<CapturePoint> = None, in ANY,
        /// A trainer's convention (`"speculators"`, `"specforge"`) choosing `aux_layers` and
        /// `target` from the dataset's layer count; give it or those two, not both.
        pub preset: Option<Preset> = None, in ANY,
        /// Dataset version to read. None: the newest at open.
        pub version: Option<u64> = None, in ANY,
        /// Row groups read ahead of use.
        pub prefetch_row_groups: usize = 4, in count(1, 4096),
        /// Assembled batches held ready.
        pub prefetch_batches: usize = 4, in count(1, 4096),
        /// Threads that assemble batches.
        pub decode_threads: usize = 2, in DECODE_THREADS,
        /// `error` (stop, naming the file) or `skip` (leave its samples out, count them) for an
        /// unreadable row group.
        pub on_corrupt: CorruptPolicy = CorruptPolicy::Error, in ANY,
        /// Keep reading the shards each newly committed version adds.
        pub follow: bool = false, in ANY,
        /// Seconds between looks for a new version when following.
        pub poll_interval: f64 = 1.0, in millis(1, 3_600_000),
        /// End a followed pass after this many seconds without a new version. None: never.
        pub follow_idle_timeout: Option<f64> = None, in millis(0, 365 * 86_400_000),
        /// Seconds any single storage call may take, retries included.
        pub timeout: f64 = 60.0, in IO_TIMEOUT,
    }
}

/// What a checked configuration runs by: the values that several options, or a conversion of
/// one, make.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Resolved {
    /// Batch by samples (`batch_size`) or by tokens (`max_tokens`).
    pub batching: Batching,
    /// Follow newly committed versions (`follow`, `poll_interval`, `follow_idle_timeout`).
    pub follow: Option<Follow>,
    /// Upper bound on any single storage call, retries included (`timeout`).
    pub io_timeout: Duration,
}

impl LoaderConfig {
    /// Options from a JSON object of the keys the user gave; an unknown key or a value of the
    /// wrong type is refused naming the key.
    pub fn from_json(json: &str) -> Result<Self, LoaderError> {
        let bad = |m: String| LoaderError::Config(m);
        let map: serde_json::Map<String, Value> = serde_json::from_str(json)
            .map_err(|e| bad(format!("loader options are not a JSON object: {e}")))?;
        serde_json::from_value(Value::Object(map.clone())).map_err(|e| {
            // serde names an unknown key but not the key of a mistyped value: find the key.
            let culprit = map.iter().find_map(|(k, v)| {
                let one = Value::Object([(k.clone(), v.clone())].into_iter().collect());
                serde_json::from_value::<LoaderConfig>(one)
                    .err()
                    .map(|e| format!("{k}={v}: {e}"))
            });
            bad(culprit.unwrap_or_else(|| e.to_string()))
        })
    }

    /// The default of every option, as JSON values by option name (what Python shows).
    pub fn defaults_json() -> serde_json::Map<String, Value> {
        match serde_json::to_value(LoaderConfig::default()) {
            Ok(Value::Object(map)) => map,
            _ => serde_json::Map::new(),
        }
    }

    /// Padded or packed batches (`packed`).
    pub fn layout(&self) -> Layout {
        match self.packed {
            true => Layout::Packed,
            false => Layout::Padded,
        }
    }

    /// What happens to the samples that do not divide among ranks (`drop_last`).
    pub fn remainder(&self) -> Remainder {
        match self.drop_last {
            true => Remainder::Drop,
            false => Remainder::Pad,
        }
    }

    fn batching(&self) -> Result<Batching, LoaderError> {
        match (self.batch_size, self.max_tokens) {
            (Some(b), None) => Ok(Batching::Samples(b)),
            (None, Some(t)) => Ok(Batching::Tokens(t)),
            _ => Err(LoaderError::Config(
                "give exactly one of batch_size or max_tokens".into(),
            )),
        }
    }

    /// Check the values that do not need the dataset (each against its declared range, then
    /// those that must agree), and resolve those that combine.
    pub fn check(&self) -> Result<Resolved, LoaderError> {
        self.check_ranges().map_err(LoaderError::Option)?;
        let batching = self.batching()?;
        let bad = |m: String| Err(LoaderError::Config(m));
        if self.rank >= self.world_size {
            return bad(format!(
                "rank {} is out of range for world_size {}: ranks are 0..={}",
                self.rank,
                self.world_size,
                self.world_size - 1
            ));
        }
        if self.worker >= self.num_workers {
            return bad(format!(
                "worker {} is out of range for num_workers {}: workers are 0..={}",
                self.worker,
                self.num_workers,
                self.num_workers - 1
            ));
        }
        if let Some(p) = self.preset {
            if self.aux_layers.is_some() || self.target.is_some() {
                return bad(format!(
                    "preset {p} chooses aux_layers and target itself; give either the preset or \
                     aux_layers/target, not both"
                ));
            }
        }
        let follow = self.follow.then(|| Follow {
            poll_interval: seconds(self.poll_interval),
            idle_timeout: self.follow_idle_timeout.map(seconds),
        });
        Ok(Resolved {
            batching,
            follow,
            io_timeout: seconds(self.timeout),
        })
    }

    /// The length every sample is cut to, if any: `max_seq_len`, and in token-budget mode also
    /// the budget, so that no batch exceeds it.
    pub fn truncate_to(&self) -> Option<usize> {
        let budget = match self.batching() {
            Ok(Batching::Tokens(t)) => Some(t),
            _ => None,
        };
        match (self.max_seq_len, budget) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}

/// `v` seconds, already checked against its option's range, as a duration.
fn seconds(v: f64) -> Duration {
    Duration::try_from_secs_f64(v).unwrap_or(Duration::MAX)
}

/// A capture point as users name it: a layer index (`30`) or a name (`"layer_30"`,
/// `"final_norm"`).
struct PointArg(CapturePoint);

impl<'de> Deserialize<'de> for PointArg {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = PointArg;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(
                    "a layer index or a capture point name such as \"layer_30\" or \"final_norm\"",
                )
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<PointArg, E> {
                u32::try_from(v)
                    .map(|l| PointArg(CapturePoint::LayerOutput(l)))
                    .map_err(|_| E::custom(format!("layer {v} is out of range")))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<PointArg, E> {
                match u64::try_from(v) {
                    Ok(v) => self.visit_u64(v),
                    Err(_) => Err(E::custom(format!(
                        "layer {v}: layer indices are 0-based and non-negative"
                    ))),
                }
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<PointArg, E> {
                v.parse().map(PointArg).map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

fn point<'de, D: Deserializer<'de>>(d: D) -> Result<Option<CapturePoint>, D::Error> {
    Ok(Option::<PointArg>::deserialize(d)?.map(|p| p.0))
}

fn points<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<CapturePoint>>, D::Error> {
    Ok(Option::<Vec<PointArg>>::deserialize(d)?.map(|v| v.into_iter().map(|p| p.0).collect()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The options a JSON object gives, checked.
    fn resolve(json: &str) -> Result<(LoaderConfig, Resolved), String> {
        LoaderConfig::from_json(json)
            .and_then(|c| c.check().map(|r| (c, r)))
            .map_err(|e| e.to_string())
    }

    fn batched(size: usize) -> LoaderConfig {
        LoaderConfig {
            batch_size: Some(size),
            ..Default::default()
        }
    }

    #[test]
    fn keys_left_out_take_the_defaults() {
        let (c, r) = resolve(r#"{"batch_size": 4}"#).unwrap();
        assert_eq!(c, batched(4));
        assert_eq!(
            r,
            Resolved {
                batching: Batching::Samples(4),
                follow: None,
                io_timeout: Duration::from_secs(60),
            }
        );
        assert_eq!(
            (c.layout(), c.remainder()),
            (Layout::Padded, Remainder::Pad)
        );
    }

    #[test]
    fn python_style_values_become_the_config() {
        let (c, r) = resolve(
            r#"{"max_tokens": 60, "packed": true, "drop_last": true, "aux_layers": [3, "layer_1"],
                "target": "final_norm", "on_corrupt": "skip", "follow": true, "poll_interval": 0.5,
                "follow_idle_timeout": 4, "timeout": 30}"#,
        )
        .unwrap();
        assert_eq!(r.batching, Batching::Tokens(60));
        assert_eq!(
            (c.layout(), c.remainder()),
            (Layout::Packed, Remainder::Drop)
        );
        assert_eq!(
            c.aux_layers,
            Some(vec![
                CapturePoint::LayerOutput(3),
                CapturePoint::LayerOutput(1)
            ])
        );
        assert_eq!(c.target, Some(CapturePoint::FinalNorm));
        assert_eq!(c.on_corrupt, CorruptPolicy::Skip);
        assert_eq!(
            r.follow,
            Some(Follow {
                poll_interval: Duration::from_millis(500),
                idle_timeout: Some(Duration::from_secs(4)),
            })
        );
        assert_eq!(r.io_timeout, Duration::from_secs(30));
    }

    #[test]
    fn refuses_unknown_keys_and_mistyped_values_naming_the_key() {
        let err = resolve(r#"{"batch_size": 4, "sead": 1}"#).unwrap_err();
        assert!(err.contains("unknown field `sead`"), "{err}");
        let err = resolve(r#"{"batch_size": 4, "rank": -1}"#).unwrap_err();
        assert!(err.contains("rank=-1"), "{err}");
        let err = resolve(r#"{"batch_size": 4, "aux_layers": [2, -1]}"#).unwrap_err();
        assert!(err.contains("layer -1: layer indices are 0-based"), "{err}");
        let err = resolve(r#"{"batch_size": 4, "target": true}"#).unwrap_err();
        assert!(err.contains("target=true"), "{err}");
        let err = resolve(r#"{"batch_size": 4, "preset": "eagle"}"#).unwrap_err();
        assert!(err.contains("preset=\"eagle\""), "{err}");
        assert!(err.contains("unknown preset"), "{err}");
        let err = resolve(r#"{"batch_size": 4, "on_corrupt": "ignore"}"#).unwrap_err();
        assert!(err.contains("on_corrupt=\"ignore\""), "{err}");
    }

    #[test]
    fn shuffle_mode_is_named_as_in_python_and_bad_values_are_refused_naming_the_key() {
        let (c, _) =
            resolve(r#"{"batch_size": 2, "shuffle_mode": "sample", "lookahead_bytes": 4096}"#)
                .unwrap();
        assert_eq!(
            (c.shuffle_mode, c.lookahead_bytes),
            (ShuffleMode::Sample, 4096)
        );
        assert_eq!(
            resolve(r#"{"batch_size": 2}"#).unwrap().0.shuffle_mode,
            ShuffleMode::Window
        );
        let err = resolve(r#"{"batch_size": 2, "shuffle_mode": "global"}"#).unwrap_err();
        assert!(err.contains("shuffle_mode=\"global\""), "{err}");
        assert!(err.contains("expected `window` or `sample`"), "{err}");
        let err = resolve(r#"{"batch_size": 2, "lookahead_bytes": -1}"#).unwrap_err();
        assert!(err.contains("lookahead_bytes=-1"), "{err}");
        let err = resolve(r#"{"batch_size": 2, "lookahead_bytes": 0}"#).unwrap_err();
        assert!(err.contains("lookahead_bytes \"0\": out of range"), "{err}");
    }

    #[test]
    fn a_preset_is_named_as_in_python() {
        let (c, _) = resolve(r#"{"batch_size": 2, "preset": "specforge"}"#).unwrap();
        assert_eq!(c.preset, Some(Preset::Specforge));
    }

    #[test]
    fn refuses_neither_or_both_batch_sizes_and_negative_seconds() {
        for json in [r#"{}"#, r#"{"batch_size": 2, "max_tokens": 9}"#] {
            assert_eq!(
                resolve(json).unwrap_err(),
                "invalid loader configuration: give exactly one of batch_size or max_tokens"
            );
        }
        let err = resolve(r#"{"batch_size": 2, "timeout": -1}"#).unwrap_err();
        assert!(
            err.contains("timeout \"-1\": out of range; expected a duration from 1ms to 1d"),
            "{err}"
        );
    }

    /// A value just past an option's range, or `None` for a range every value is in.
    fn past(range: OptionRange) -> Option<Vec<Value>> {
        Some(match range {
            OptionRange::Count { min, max } | OptionRange::Bytes { min, max } => {
                let mut v = vec![Value::from(max + 1)];
                if min > 0 {
                    v.push(Value::from(min - 1));
                }
                v
            }
            OptionRange::Seconds { min, max } => {
                let mut v = vec![Value::from(max.as_secs_f64() * 2.0), Value::from(-1.0)];
                if !min.is_zero() {
                    v.push(Value::from(0.0));
                }
                v
            }
            OptionRange::Any => return None,
        })
    }

    #[test]
    fn every_option_past_its_range_is_refused_naming_the_option_value_and_range() {
        let mut ranged = 0;
        for o in LoaderConfig::OPTIONS {
            let Some(values) = past(o.range) else {
                continue;
            };
            ranged += 1;
            for v in values {
                let mut json = serde_json::json!({ "batch_size": 1, "follow": true });
                json[o.name] = v.clone();
                if o.name == "max_tokens" {
                    json["batch_size"] = Value::Null;
                }
                let err = resolve(&json.to_string()).unwrap_err();
                assert!(
                    err.starts_with(&format!("invalid loader option: {} ", o.name))
                        && err.contains("out of range"),
                    "{}={v}: {err}",
                    o.name
                );
                let shown = o.range.to_string();
                let bounds = shown.trim_end_matches(" (seconds)");
                assert!(err.contains(bounds), "{}={v}: {err} lacks {bounds}", o.name);
            }
        }
        assert!(ranged >= 15, "the numeric options each have a range");
        // The attacks: padding of 2^40 tokens, 10^5 and 10^6 threads.
        for (name, v) in [
            ("pad_to_multiple_of", 1u64 << 40),
            ("decode_threads", 100_000),
            ("decode_threads", 1_000_000),
        ] {
            let err = resolve(&format!(r#"{{"batch_size": 1, "{name}": {v}}}"#)).unwrap_err();
            assert!(
                err.contains(&format!("{name} \"{v}\": out of range")),
                "{err}"
            );
        }
        // Each default lies in its range, and the listing states it.
        assert!(LoaderConfig::default().check_ranges().is_ok());
        let threads = LoaderConfig::OPTIONS
            .iter()
            .find(|o| o.name == "decode_threads")
            .unwrap();
        assert!(
            threads.text().ends_with("Range: 1 to 1024."),
            "{}",
            threads.text()
        );
    }

    #[test]
    fn every_option_is_listed_with_its_doc_and_default_under_its_json_key() {
        let defaults = LoaderConfig::defaults_json();
        let names: Vec<&str> = LoaderConfig::OPTIONS.iter().map(|o| o.name).collect();
        let keys: Vec<&str> = defaults.keys().map(String::as_str).collect();
        let (mut sorted_names, mut sorted_keys) = (names.clone(), keys.clone());
        sorted_names.sort_unstable();
        sorted_keys.sort_unstable();
        assert_eq!(
            sorted_names, sorted_keys,
            "the listing and serde name the same keys"
        );
        for o in LoaderConfig::OPTIONS {
            assert!(!o.text().is_empty(), "{} has a doc", o.name);
            // Each listed key alone is accepted: the name is the one serde reads.
            let one = format!(r#"{{"{}": {}}}"#, o.name, defaults[o.name]);
            assert_eq!(
                LoaderConfig::from_json(&one).unwrap(),
                LoaderConfig::default(),
                "{}",
                o.name
            );
        }
        assert_eq!(defaults["lookahead_bytes"], 256 << 20);
        assert_eq!(defaults["shuffle_mode"], "window");
        assert_eq!(defaults["batch_size"], Value::Null);
    }

    #[test]
    fn rejects_rank_not_below_world_size() {
        let c = LoaderConfig {
            rank: 2,
            world_size: 2,
            ..batched(8)
        };
        let err = c.check().unwrap_err().to_string();
        assert!(
            err.contains("rank 2 is out of range for world_size 2"),
            "{err}"
        );
    }

    #[test]
    fn rejects_zero_batch_size_and_budget() {
        let budget = LoaderConfig {
            max_tokens: Some(0),
            ..Default::default()
        };
        for c in [batched(0), budget] {
            assert!(c.check().is_err());
        }
    }

    #[test]
    fn rejects_preset_together_with_explicit_layers() {
        let c = LoaderConfig {
            preset: Some(Preset::Speculators),
            target: Some(CapturePoint::FinalNorm),
            ..batched(8)
        };
        let err = c.check().unwrap_err().to_string();
        assert!(err.contains("preset speculators chooses"), "{err}");
    }

    #[test]
    fn token_budget_also_truncates() {
        let c = LoaderConfig {
            max_tokens: Some(100),
            max_seq_len: Some(300),
            ..Default::default()
        };
        assert_eq!(c.truncate_to(), Some(100));
        let c = LoaderConfig {
            max_seq_len: Some(300),
            ..batched(4)
        };
        assert_eq!(c.truncate_to(), Some(300));
        assert_eq!(batched(8).truncate_to(), None);
    }
}
