//! Loader options as users give them (Python keyword arguments, JSON), with every default in
//! one place, converted once into a checked [`LoaderConfig`].
use std::fmt;
use std::time::Duration;

use hslake_schemas::CapturePoint;
use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::{
    Batching, CorruptPolicy, Follow, Layout, LoaderConfig, LoaderError, Preset, Remainder,
    ShuffleMode,
};

/// Everything that shapes what a loader yields, named as `hslake.Loader` takes it. A key left
/// out takes the default below; an unknown key is refused.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LoaderOptions {
    /// Samples per batch (give this or `max_tokens`).
    pub batch_size: Option<usize>,
    /// Token budget per batch: `B × T` padded, `ΣT` packed (give this or `batch_size`).
    pub max_tokens: Option<usize>,
    /// One packed row with `cu_seqlens` instead of padded rows. Default: false.
    pub packed: bool,
    /// Truncate every sample to at most this many tokens.
    pub max_seq_len: Option<usize>,
    /// Round the padded length up to a multiple of this.
    pub pad_to_multiple_of: Option<usize>,
    /// Token id written into padding. Default: 0.
    pub pad_token_id: i64,
    /// This process's rank. Default: 0.
    pub rank: usize,
    /// Number of ranks. Default: 1.
    pub world_size: usize,
    /// Sub-partition of this rank (a torch DataLoader worker). Default: 0.
    pub worker: usize,
    /// Sub-partitions per rank. Default: 1.
    pub num_workers: usize,
    /// Shuffle seed; with the epoch it fixes the order on every machine. Default: 0.
    pub seed: u64,
    /// Shuffle at all. Default: true.
    pub shuffle: bool,
    /// Row groups whose samples are shuffled together (`shuffle_mode="window"`). Default: 16.
    pub shuffle_window: usize,
    /// `window` (row groups permuted, samples permuted within windows of `shuffle_window` row
    /// groups; the faster) or `sample` (a full per-sample permutation of the epoch).
    /// Default: window.
    pub shuffle_mode: ShuffleMode,
    /// With `shuffle_mode="sample"`: raw tensor bytes of the samples read ahead together;
    /// memory holds about this much. Default: 256 MiB.
    pub lookahead_bytes: u64,
    /// Leave out the samples that do not divide among ranks instead of repeating some.
    /// Default: false.
    pub drop_last: bool,
    /// Leave out a last batch smaller than the batch size or budget. Default: false.
    pub drop_last_batch: bool,
    /// Auxiliary points, concatenated in this order: layer indices or names (`30`,
    /// `"layer_30"`). Default: every point but the target.
    #[serde(deserialize_with = "points")]
    pub aux_layers: Option<Vec<CapturePoint>>,
    /// The target point. Default: `final_norm` if captured, else the last point.
    #[serde(deserialize_with = "point")]
    pub target: Option<CapturePoint>,
    /// A trainer's convention (`"speculators"`, `"specforge"`) choosing `aux_layers` and
    /// `target` from the dataset's layer count; give it or those two, not both.
    pub preset: Option<Preset>,
    /// Dataset version to read. Default: the newest at open.
    pub version: Option<u64>,
    /// Row groups read ahead of use. Default: 4.
    pub prefetch_row_groups: usize,
    /// Assembled batches held ready. Default: 4.
    pub prefetch_batches: usize,
    /// Threads that assemble batches. Default: 2.
    pub decode_threads: usize,
    /// `error` (stop, naming the file) or `skip` (leave its samples out, count them) for an
    /// unreadable row group. Default: error.
    pub on_corrupt: CorruptPolicy,
    /// Keep reading the shards each newly committed version adds. Default: false.
    pub follow: bool,
    /// Seconds between looks for a new version when following. Default: 1.
    pub poll_interval: f64,
    /// End a followed pass after this many seconds without a new version. Default: never.
    pub follow_idle_timeout: Option<f64>,
    /// Seconds any single storage call may take, retries included. Default: 60.
    pub timeout: f64,
}

impl Default for LoaderOptions {
    fn default() -> Self {
        LoaderOptions {
            batch_size: None,
            max_tokens: None,
            packed: false,
            max_seq_len: None,
            pad_to_multiple_of: None,
            pad_token_id: 0,
            rank: 0,
            world_size: 1,
            worker: 0,
            num_workers: 1,
            seed: 0,
            shuffle: true,
            shuffle_window: 16,
            shuffle_mode: ShuffleMode::Window,
            lookahead_bytes: 256 << 20,
            drop_last: false,
            drop_last_batch: false,
            aux_layers: None,
            target: None,
            preset: None,
            version: None,
            prefetch_row_groups: 4,
            prefetch_batches: 4,
            decode_threads: 2,
            on_corrupt: CorruptPolicy::Error,
            follow: false,
            poll_interval: 1.0,
            follow_idle_timeout: None,
            timeout: 60.0,
        }
    }
}

impl LoaderOptions {
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
                serde_json::from_value::<LoaderOptions>(one)
                    .err()
                    .map(|e| format!("{k}={v}: {e}"))
            });
            bad(culprit.unwrap_or_else(|| e.to_string()))
        })
    }

    /// The loader configuration these options give, with what cannot work refused.
    pub fn resolve(&self) -> Result<LoaderConfig, LoaderError> {
        let bad = |m: String| LoaderError::Config(m);
        let batching = match (self.batch_size, self.max_tokens) {
            (Some(b), None) => Batching::Samples(b),
            (None, Some(t)) => Batching::Tokens(t),
            _ => return Err(bad("give exactly one of batch_size or max_tokens".into())),
        };
        let secs = |name: &str, v: f64| {
            Duration::try_from_secs_f64(v).map_err(|_| {
                bad(format!(
                    "{name} must be a non-negative number of seconds, got {v}"
                ))
            })
        };
        let follow = match self.follow {
            true => Some(Follow {
                poll_interval: secs("poll_interval", self.poll_interval)?,
                idle_timeout: self
                    .follow_idle_timeout
                    .map(|t| secs("follow_idle_timeout", t))
                    .transpose()?,
            }),
            false => None,
        };
        Ok(LoaderConfig {
            batching,
            layout: match self.packed {
                true => Layout::Packed,
                false => Layout::Padded,
            },
            max_seq_len: self.max_seq_len,
            pad_to_multiple_of: self.pad_to_multiple_of,
            pad_token_id: self.pad_token_id,
            rank: self.rank,
            world_size: self.world_size,
            worker: self.worker,
            num_workers: self.num_workers,
            seed: self.seed,
            shuffle: self.shuffle,
            shuffle_window: self.shuffle_window,
            shuffle_mode: self.shuffle_mode,
            lookahead_bytes: self.lookahead_bytes,
            remainder: match self.drop_last {
                true => Remainder::Drop,
                false => Remainder::Pad,
            },
            drop_last_batch: self.drop_last_batch,
            aux_layers: self.aux_layers.clone(),
            target: self.target,
            preset: self.preset,
            version: self.version,
            prefetch_row_groups: self.prefetch_row_groups,
            prefetch_batches: self.prefetch_batches,
            decode_threads: self.decode_threads,
            on_corrupt: self.on_corrupt,
            follow,
            io_timeout: secs("timeout", self.timeout)?,
        })
    }
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

    fn resolve(json: &str) -> Result<LoaderConfig, String> {
        LoaderOptions::from_json(json)
            .and_then(|o| o.resolve())
            .map_err(|e| e.to_string())
    }

    #[test]
    fn keys_left_out_take_the_defaults() {
        let c = resolve(r#"{"batch_size": 4}"#).unwrap();
        assert_eq!(
            c,
            LoaderConfig {
                batching: Batching::Samples(4),
                ..LoaderConfig::default()
            }
        );
    }

    #[test]
    fn python_style_values_become_the_config() {
        let c = resolve(
            r#"{"max_tokens": 60, "packed": true, "drop_last": true, "aux_layers": [3, "layer_1"],
                "target": "final_norm", "on_corrupt": "skip", "follow": true, "poll_interval": 0.5,
                "follow_idle_timeout": 4, "timeout": 30}"#,
        )
        .unwrap();
        assert_eq!(c.batching, Batching::Tokens(60));
        assert_eq!((c.layout, c.remainder), (Layout::Packed, Remainder::Drop));
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
            c.follow,
            Some(Follow {
                poll_interval: Duration::from_millis(500),
                idle_timeout: Some(Duration::from_secs(4)),
            })
        );
        assert_eq!(c.io_timeout, Duration::from_secs(30));
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
        let c = resolve(r#"{"batch_size": 2, "shuffle_mode": "sample", "lookahead_bytes": 4096}"#)
            .unwrap();
        assert_eq!(
            (c.shuffle_mode, c.lookahead_bytes),
            (ShuffleMode::Sample, 4096)
        );
        assert_eq!(
            resolve(r#"{"batch_size": 2}"#).unwrap().shuffle_mode,
            ShuffleMode::Window
        );
        let err = resolve(r#"{"batch_size": 2, "shuffle_mode": "global"}"#).unwrap_err();
        assert!(err.contains("shuffle_mode=\"global\""), "{err}");
        assert!(err.contains("expected `window` or `sample`"), "{err}");
        let err = resolve(r#"{"batch_size": 2, "lookahead_bytes": -1}"#).unwrap_err();
        assert!(err.contains("lookahead_bytes=-1"), "{err}");
        let c = resolve(r#"{"batch_size": 2, "lookahead_bytes": 0}"#).unwrap();
        let err = c.check().unwrap_err().to_string();
        assert!(err.contains("lookahead_bytes must be at least 1"), "{err}");
    }

    #[test]
    fn a_preset_is_named_as_in_python() {
        let c = resolve(r#"{"batch_size": 2, "preset": "specforge"}"#).unwrap();
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
            err.contains("timeout must be a non-negative number of seconds"),
            "{err}"
        );
    }
}
