//! One capture job's flags: what `hslake capture` captures and where, the body of `POST
//! /v1/jobs` of `hslake serve-capture`, and what `hslake jobs submit` sends. It lives in the
//! libtorch-free library since `hslake jobs` is a plain HTTP client in the light binary.
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use hslake_schemas::units::DurationRange;
use hslake_schemas::{CapturePoint, InputShard, Overlong};
use serde::{Deserialize, Serialize};

/// One capture job: the flags of `hslake capture` that say what to capture and where, and the
/// JSON body of `POST /v1/jobs` (the same names, in snake case) of `hslake serve-capture`.
#[derive(clap::Args, Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobArgs {
    /// Tokenized samples: JSONL or Parquet with input_ids, optional loss_mask and id; a local
    /// path or an object-store URL (s3://bucket/samples.jsonl).
    #[arg(long)]
    pub input: PathBuf,
    /// Dataset URL (file:///abs/path, s3://bucket/prefix, memory://name).
    #[arg(long)]
    pub output: String,
    /// Decoder layer outputs to capture, 0-based (layer i = HF hidden_states[i + 1]).
    #[arg(long, value_delimiter = ',')]
    #[serde(default)]
    pub layers: Vec<CapturePoint>,
    /// Also capture the last layer's output after the final RMS norm.
    #[arg(long)]
    #[serde(default)]
    pub final_norm: bool,
    /// Token budget of one padded batch (batch size x longest sample).
    #[arg(long, default_value_t = DEFAULT_MAX_TOKENS_PER_BATCH)]
    #[serde(default = "default_max_tokens_per_batch")]
    pub max_tokens_per_batch: usize,
    /// Longest sample kept whole; see --overlong for the rest.
    #[arg(long)]
    #[serde(default)]
    pub max_seq_len: Option<usize>,
    /// What to do with samples over --max-seq-len: truncate or skip.
    #[arg(long, default_value = "truncate")]
    #[serde(default, with = "overlong_name")]
    pub overlong: Overlong,
    /// Continue an interrupted capture: samples already committed are skipped.
    #[arg(long)]
    #[serde(default)]
    pub resume: bool,
    /// Each writer commits after this many samples...
    #[arg(long, default_value_t = DEFAULT_COMMIT_EVERY)]
    #[serde(default = "default_commit_every")]
    pub commit_every: u64,
    /// ...or after this long, whichever comes first, e.g. 30s or 5m (a bare number is seconds;
    /// in JSON a number of seconds or such a string).
    #[arg(long, default_value = "60s", value_parser = COMMIT_INTERVAL.parser())]
    #[serde(
        default = "default_commit_interval",
        deserialize_with = "commit_interval_json",
        serialize_with = "hslake_schemas::units::serialize_secs"
    )]
    pub commit_interval: Duration,
    /// zstd level of the shards, 1 to 22: at 1 the near-random mantissa planes are stored raw
    /// without trying to entropy code them (fastest); from 2 every plane is coded (smaller,
    /// more CPU).
    #[arg(long, default_value_t = DEFAULT_ZSTD_LEVEL, value_parser = parse_zstd_level)]
    #[serde(default = "default_zstd_level", deserialize_with = "zstd_level_json")]
    pub zstd_level: i32,
    /// Capture only part I of N of the input (the samples whose id is I modulo N), so that N
    /// processes, e.g. a Slurm array or a Kubernetes indexed Job, fill one dataset together.
    #[arg(long)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard: Option<InputShard>,
}

const DEFAULT_MAX_TOKENS_PER_BATCH: usize = 16384;
const DEFAULT_COMMIT_EVERY: u64 = 1000;
const DEFAULT_COMMIT_INTERVAL: Duration = Duration::from_secs(60);
const DEFAULT_ZSTD_LEVEL: i32 = 1;
/// `--commit-interval`: a millisecond up to a year.
const COMMIT_INTERVAL: DurationRange =
    DurationRange::seconds("--commit-interval", Duration::from_millis(1), super::YEAR);
/// `--zstd-level`: the levels Parquet's zstd codec takes.
const ZSTD_LEVELS: std::ops::RangeInclusive<i64> = 1..=22;

fn default_max_tokens_per_batch() -> usize {
    DEFAULT_MAX_TOKENS_PER_BATCH
}
fn default_commit_every() -> u64 {
    DEFAULT_COMMIT_EVERY
}
fn default_commit_interval() -> Duration {
    DEFAULT_COMMIT_INTERVAL
}
fn default_zstd_level() -> i32 {
    DEFAULT_ZSTD_LEVEL
}
fn commit_interval_json<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    COMMIT_INTERVAL.deserialize(d)
}

/// The one check of a zstd level, for the flag and the JSON field alike.
fn zstd_level(n: i64) -> Result<i32, String> {
    match i32::try_from(n) {
        Ok(level) if ZSTD_LEVELS.contains(&n) => Ok(level),
        _ => Err(format!(
            "--zstd-level {n}: out of range; expected a whole number from {} to {} \
             (the zstd levels Parquet takes)",
            ZSTD_LEVELS.start(),
            ZSTD_LEVELS.end()
        )),
    }
}
fn parse_zstd_level(s: &str) -> Result<i32, String> {
    let n = s.trim().parse::<i64>().map_err(|_| {
        format!(
            "--zstd-level {s:?}: not a whole number; expected one from {} to {}",
            ZSTD_LEVELS.start(),
            ZSTD_LEVELS.end()
        )
    })?;
    zstd_level(n)
}
fn zstd_level_json<'de, D: serde::Deserializer<'de>>(d: D) -> Result<i32, D::Error> {
    zstd_level(i64::deserialize(d)?).map_err(serde::de::Error::custom)
}

/// Refuses an output no dataset can live at: the root of a filesystem.
fn check_output(output: &str) -> anyhow::Result<()> {
    let loc =
        hslake_store::location::parse(output).with_context(|| format!("--output {output}"))?;
    // The root's URL comes back without its slash, so it is told by its empty object path.
    if loc.url.starts_with("file:") && loc.prefix.as_ref().is_empty() {
        bail!(
            "--output {output}: the filesystem root is not a dataset location; expected a \
             directory below it, e.g. file:///data/ds"
        );
    }
    Ok(())
}

/// The overlong policy in JSON as on the command line: "truncate" or "skip".
mod overlong_name {
    use hslake_schemas::Overlong;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(o: &Overlong, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(match o {
            Overlong::Truncate => "truncate",
            Overlong::Skip => "skip",
        })
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Overlong, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

impl JobArgs {
    /// The capture points in column order, after the checks the parsers make (so that a
    /// JobArgs built in code or sent as JSON gets them too), or an error naming the bad value.
    pub fn checked_points(&self) -> anyhow::Result<Vec<CapturePoint>> {
        let mut points = self.layers.clone();
        if self.final_norm {
            points.push(CapturePoint::FinalNorm);
        }
        if points.is_empty() {
            bail!(
                "nothing to capture: give --layers (e.g. --layers 2,30,58,60) and/or --final-norm"
            );
        }
        COMMIT_INTERVAL.check(self.commit_interval)?;
        zstd_level(self.zstd_level.into()).map_err(anyhow::Error::msg)?;
        check_output(&self.output)?;
        Ok(points)
    }
}
