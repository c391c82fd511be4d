//! The versioned manifest: which shards make up a dataset version, and where they came from.
use std::collections::BTreeMap;

use hslake_schemas::{CapturePoint, DatasetSchema, FORMAT_VERSION, OLDEST_FORMAT_VERSION};
use serde::{Deserialize, Serialize};

use crate::{Result, StoreError};

/// Folder of the manifests, relative to the dataset root.
pub const VERSIONS_DIR: &str = "_hslake/versions";
/// Folder of the shard files, relative to the dataset root.
pub const DATA_DIR: &str = "data";

/// Relative path of version `n`'s manifest; zero-padded so a listing sorts by version.
pub fn manifest_path(n: u64) -> String {
    format!("{VERSIONS_DIR}/{n:020}.json")
}

/// The version number of a manifest file name, if it is one.
pub fn parse_manifest_name(name: &str) -> Option<u64> {
    let stem = name.strip_suffix(".json")?;
    (stem.len() == 20 && stem.bytes().all(|b| b.is_ascii_digit()))
        .then(|| stem.parse().ok())
        .flatten()
}

/// The canonical form of a shard path: `data/<name>[/...]`, parts joined by single slashes.
/// Empty parts (`data//x`, `/data/x`) are dropped, as every reader drops them; a path with a
/// `.` or `..` part, or one outside `data/`, is refused with the reason.
pub fn canonical_shard_path(raw: &str) -> std::result::Result<String, String> {
    let parts: Vec<&str> = raw.split('/').filter(|p| !p.is_empty()).collect();
    if parts.iter().any(|p| *p == "." || *p == "..") {
        return Err("has a '.' or '..' part; expected data/<name>".into());
    }
    if parts.len() < 2 || parts[0] != DATA_DIR {
        return Err(format!(
            "is not under {DATA_DIR}/; expected {DATA_DIR}/<name>"
        ));
    }
    Ok(parts.join("/"))
}

/// Most bytes a manifest may have, checked before it is read: a version of
/// [`MAX_MANIFEST_SHARDS`] shards of ~30 row groups each is about 1 KB of JSON a shard.
pub const MAX_MANIFEST_BYTES: u64 = 1 << 30;

/// Most shards a manifest may name, checked as it is parsed: 10x a large real dataset (10^5
/// shards of the writer's 256 MiB, 25 TiB). A version is read whole into memory (about 300 bytes
/// a shard parsed, on top of its JSON), so more would need a manifest split into parts.
pub const MAX_MANIFEST_SHARDS: usize = 1_000_000;

/// Fewest bytes of a file one row group takes: each of its column chunks (a shard has at
/// least 7 columns) has a page header in the data and an entry in the footer, tens of bytes
/// each. A manifest claiming more row groups than its file's bytes can hold is refused when it
/// is read, so no reader plans work (Ray's read tasks, the loader's units) for row groups that
/// cannot exist.
pub const MIN_ROW_GROUP_BYTES: u64 = 64;

/// An entry's counts must agree with each other and with what its file can hold: every
/// sizing from `rows` and `row_groups` (the loader's buffers, Ray's read tasks) is then
/// bounded by `bytes`.
fn check_counts(s: &ShardEntry) -> std::result::Result<(), String> {
    let most = s.bytes / MIN_ROW_GROUP_BYTES;
    if s.row_groups.len() as u64 > most {
        return Err(format!(
            "{} row groups cannot fit in a file of {} bytes (at most {most}: a row group takes \
             at least {MIN_ROW_GROUP_BYTES} bytes)",
            s.row_groups.len(),
            s.bytes
        ));
    }
    let in_groups = s
        .row_groups
        .iter()
        .try_fold(0u64, |a, &r| a.checked_add(r))
        .ok_or("row_groups add up to more than 2^64")?;
    if in_groups != s.rows {
        return Err(format!(
            "row_groups hold {in_groups} rows in all, rows says {}",
            s.rows
        ));
    }
    // Each row stores at least one byte of each of its columns.
    if s.rows > s.bytes {
        return Err(format!(
            "{} rows cannot fit in a file of {} bytes",
            s.rows, s.bytes
        ));
    }
    if s.rows > 0 && s.min_sample_id > s.max_sample_id {
        return Err(format!(
            "min_sample_id {} is above max_sample_id {}",
            s.min_sample_id, s.max_sample_id
        ));
    }
    Ok(())
}

/// Refuse a manifest of more than [`MAX_MANIFEST_BYTES`] before it is read or parsed.
pub fn check_manifest_size(path: &str, bytes: u64) -> Result<()> {
    if bytes > MAX_MANIFEST_BYTES {
        return Err(StoreError::ManifestTooLarge {
            path: path.to_string(),
            bytes,
            limit: MAX_MANIFEST_BYTES,
        });
    }
    Ok(())
}

/// How the data was captured.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Provenance {
    /// Model name or path.
    pub model: String,
    /// Hugging Face architecture.
    pub architecture: String,
    /// Compute dtype of the forward pass.
    pub dtype: String,
    /// Tensor-parallel size of the capture.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tp_size: Option<usize>,
    /// Captured points, resolved.
    #[serde(default)]
    pub layers: Vec<CapturePoint>,
    /// Meaning of the layer indices.
    #[serde(default)]
    pub layer_convention: String,
    /// Software that wrote the data, e.g. `hslake 0.1.0`.
    #[serde(default)]
    pub software: String,
    /// Anything else worth keeping.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub extra: BTreeMap<String, serde_json::Value>,
}

/// One immutable shard file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardEntry {
    /// Path relative to the dataset root (`data/<uuid>.parquet`).
    pub path: String,
    /// File size.
    pub bytes: u64,
    /// Samples.
    pub rows: u64,
    /// Tokens over all samples.
    pub tokens: u64,
    /// Uncompressed tensor bytes.
    pub raw_bytes: u64,
    /// Smallest sample id.
    pub min_sample_id: u64,
    /// Largest sample id.
    pub max_sample_id: u64,
    /// CRC-32C of the whole file.
    pub crc32c: u32,
    /// Rows in each row group, in file order.
    pub row_groups: Vec<u64>,
}

/// A vacuum's mark on the version chain (docs/FORMAT.md, `vacuum`): the newest vacuum at or
/// before a version, and the latest cutoff of it and every vacuum before it. Every file a vacuum
/// deletes was last modified (by the store's clock) at or before its cutoff, so a commit on a
/// head with this mark refuses new shards that old: one of those vacuums may be deleting them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct VacuumMark {
    /// The version the newest vacuum committed.
    pub version: u64,
    /// The latest cutoff of that vacuum and every earlier one.
    pub cutoff: chrono::DateTime<chrono::Utc>,
}

impl VacuumMark {
    /// The cutoff a vacuum records for the newest modification time among the files it deletes,
    /// as its listing reported it. A listing may give times cut to the second (S3) or the
    /// millisecond while a commit's HEAD of the same file gives more, so a time that is whole
    /// in one of those units stands for all of it: the cutoff is the end of that unit.
    pub fn cutoff_for(newest: chrono::DateTime<chrono::Utc>) -> chrono::DateTime<chrono::Utc> {
        use chrono::Timelike;
        let nanos = newest.nanosecond();
        let unit = [1_000_000_000, 1_000_000, 1_000]
            .into_iter()
            .find(|u| nanos.is_multiple_of(*u))
            .unwrap_or(1);
        newest + chrono::Duration::nanoseconds(i64::from(unit - 1))
    }

    /// Whether a file last modified at `modified` may be one that a vacuum up to this mark
    /// deletes.
    pub fn may_have_deleted(&self, modified: chrono::DateTime<chrono::Utc>) -> bool {
        modified <= self.cutoff
    }
}

/// One committed version of a dataset.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Format version of this manifest and the shards it names.
    pub format_version: u32,
    /// This version's number.
    pub version: u64,
    /// The version it was built on.
    pub parent: Option<u64>,
    /// RFC 3339 time of the commit.
    pub committed_at: String,
    /// The dataset schema.
    pub schema: DatasetSchema,
    /// Capture provenance.
    pub provenance: Provenance,
    /// Every live shard, each once (at most [`MAX_MANIFEST_SHARDS`]).
    #[serde(deserialize_with = "bounded_shards")]
    pub shards: Vec<ShardEntry>,
    /// Free-form properties (e.g. capture progress).
    #[serde(default)]
    pub properties: BTreeMap<String, String>,
    /// Random id of the commit that wrote this manifest, so that a writer whose put's response
    /// was lost can recognise its own manifest (absent in manifests of older writers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub commit_id: Option<String>,
    /// The vacuums up to this version (absent: none yet), carried forward by every commit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vacuum: Option<VacuumMark>,
    /// Shard paths as the stored manifest spelled them, where that was not canonical; `shards`
    /// holds them canonical. Never stored; `verify` reports them.
    #[serde(skip)]
    pub noncanonical_paths: Vec<String>,
    /// Shards the stored manifest named more than once (by canonical path), with how many times
    /// each, in the order first named; `shards` holds each once. Never stored: readers and
    /// commits refuse such a manifest ([`Manifest::refuse_repeats`]), `verify` reports it and
    /// `repair` commits a version without the repeats.
    #[serde(skip)]
    pub repeated: Vec<RepeatedShard>,
}

/// A shard a manifest names more than once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepeatedShard {
    /// Its canonical path.
    pub path: String,
    /// How many times the manifest names it (at least 2).
    pub times: u64,
}

/// A list of at most `.0` shard entries, refused as soon as one more is parsed.
struct Bounded(usize);

impl<'de> serde::de::Visitor<'de> for Bounded {
    type Value = Vec<ShardEntry>;
    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "a list of at most {} shard entries", self.0)
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(
        self,
        mut seq: A,
    ) -> std::result::Result<Self::Value, A::Error> {
        let mut out = Vec::new();
        while let Some(s) = seq.next_element()? {
            if out.len() == self.0 {
                return Err(serde::de::Error::custom(format!(
                    "names more than {} shards, the most a manifest may name",
                    self.0
                )));
            }
            out.push(s);
        }
        Ok(out)
    }
}

/// The `shards` of a manifest, refused past [`MAX_MANIFEST_SHARDS`] before more are parsed.
fn bounded_shards<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> std::result::Result<Vec<ShardEntry>, D::Error> {
    d.deserialize_seq(Bounded(MAX_MANIFEST_SHARDS))
}

impl Manifest {
    /// Samples in this version (saturating: `verify` reports sums that overflow).
    pub fn num_samples(&self) -> u64 {
        self.sum(|s| s.rows).unwrap_or(u64::MAX)
    }
    /// Tokens in this version (saturating).
    pub fn num_tokens(&self) -> u64 {
        self.sum(|s| s.tokens).unwrap_or(u64::MAX)
    }
    /// Bytes of all shard files (saturating).
    pub fn bytes(&self) -> u64 {
        self.sum(|s| s.bytes).unwrap_or(u64::MAX)
    }
    /// Uncompressed tensor bytes (saturating).
    pub fn raw_bytes(&self) -> u64 {
        self.sum(|s| s.raw_bytes).unwrap_or(u64::MAX)
    }

    /// The sum of one field over the shards; `None` where it does not fit in a u64.
    pub fn sum(&self, field: impl Fn(&ShardEntry) -> u64) -> Option<u64> {
        self.shards
            .iter()
            .try_fold(0u64, |acc, s| acc.checked_add(field(s)))
    }

    /// Parse a manifest (at most [`MAX_MANIFEST_BYTES`], checked first), refusing newer formats
    /// before anything else. Non-canonical shard paths are read canonical
    /// (`noncanonical_paths`), and a shard named more than once is kept once (`repeated`):
    /// whoever reads a version for its data refuses the latter ([`Manifest::refuse_repeats`]).
    pub fn from_json(path: &str, bytes: &[u8]) -> Result<Self> {
        check_manifest_size(path, bytes.len() as u64)?;
        #[derive(Deserialize)]
        struct Head {
            format_version: u32,
        }
        let head: Head = serde_json::from_slice(bytes)
            .map_err(|e| StoreError::corrupt(path, format!("not a manifest: {e}")))?;
        if head.format_version > FORMAT_VERSION {
            return Err(StoreError::NewerFormat {
                path: path.to_string(),
                found: head.format_version,
                supported: FORMAT_VERSION,
            });
        }
        if head.format_version < OLDEST_FORMAT_VERSION {
            return Err(StoreError::OlderFormat {
                path: path.to_string(),
                found: head.format_version,
                supported: OLDEST_FORMAT_VERSION,
            });
        }
        let mut m: Manifest = serde_json::from_slice(bytes)
            .map_err(|e| StoreError::corrupt(path, format!("bad manifest: {e}")))?;
        m.schema.check()?;
        if let Some(v) = m.vacuum.filter(|v| v.version > m.version) {
            return Err(StoreError::corrupt(
                path,
                format!(
                    "vacuum.version {} is after the manifest's own version {}",
                    v.version, m.version
                ),
            ));
        }
        for (i, s) in m.shards.iter_mut().enumerate() {
            let bad =
                |why: String| StoreError::corrupt(path, format!("shard {i} ({}): {why}", s.path));
            let canon = canonical_shard_path(&s.path).map_err(|why| bad(format!("path {why}")))?;
            check_counts(s).map_err(bad)?;
            if canon != s.path {
                m.noncanonical_paths
                    .push(std::mem::replace(&mut s.path, canon));
            }
        }
        m.drop_repeats();
        for (name, field) in [
            ("rows", (|s: &ShardEntry| s.rows) as fn(&ShardEntry) -> u64),
            ("tokens", |s| s.tokens),
            ("bytes", |s| s.bytes),
            ("raw_bytes", |s| s.raw_bytes),
        ] {
            if m.sum(field).is_none() {
                return Err(StoreError::corrupt(
                    path,
                    format!("the shards' {name} add up to more than 2^64"),
                ));
            }
        }
        Ok(m)
    }

    /// Keep the first entry of each shard path, recording the others in `repeated`.
    fn drop_repeats(&mut self) {
        let mut times: std::collections::HashMap<&str, u64> =
            std::collections::HashMap::with_capacity(self.shards.len());
        for s in &self.shards {
            *times.entry(s.path.as_str()).or_default() += 1;
        }
        if times.len() == self.shards.len() {
            return;
        }
        let mut repeated = Vec::new();
        let mut first = vec![false; self.shards.len()];
        for (i, s) in self.shards.iter().enumerate() {
            if let Some(t) = times.remove(s.path.as_str()) {
                first[i] = true;
                if t > 1 {
                    repeated.push(RepeatedShard {
                        path: s.path.clone(),
                        times: t,
                    });
                }
            }
        }
        let mut keep = first.into_iter();
        self.shards.retain(|_| keep.next().unwrap_or(false));
        self.repeated = repeated;
    }

    /// Refuse a version that named a shard more than once (`repeated`): its rows would be read
    /// and counted that many times. `url` is the dataset's, `manifest` the manifest file shown.
    pub fn refuse_repeats(&self, url: &str, manifest: &str) -> Result<()> {
        match self.repeated.first() {
            None => Ok(()),
            Some(r) => Err(StoreError::RepeatedShard {
                url: url.to_string(),
                manifest: manifest.to_string(),
                path: r.path.clone(),
                times: r.times,
                others: self.repeated.len() - 1,
            }),
        }
    }

    /// Whether this version is a vacuum's: the same shards and properties as its parent,
    /// committed before the vacuum deleted anything.
    pub fn is_vacuum(&self) -> bool {
        self.vacuum.is_some_and(|v| v.version == self.version)
    }

    /// Serialise for storage.
    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec_pretty(self).expect("manifest serialises")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manifest_names_sort_by_version_and_parse_back() {
        assert!(manifest_path(9) < manifest_path(10));
        assert_eq!(
            parse_manifest_name(manifest_path(42).rsplit('/').next().unwrap()),
            Some(42)
        );
        assert_eq!(parse_manifest_name("42.json"), None);
    }

    #[test]
    fn canonical_shard_paths_drop_empty_parts_and_refuse_escapes() {
        for raw in [
            "data/a.parquet",
            "data//a.parquet",
            "/data/a.parquet",
            "data/a.parquet/",
        ] {
            assert_eq!(
                canonical_shard_path(raw).unwrap(),
                "data/a.parquet",
                "{raw}"
            );
        }
        for raw in [
            "data/../x",
            "./data/a",
            "a.parquet",
            "other/a.parquet",
            "data",
            "",
        ] {
            assert!(canonical_shard_path(raw).is_err(), "{raw}");
        }
    }

    fn manifest_with(shards: &str) -> Vec<u8> {
        format!(
            r#"{{"format_version": 2, "version": 1, "parent": 0, "committed_at": "t",
            "schema": {{"model": "m", "architecture": "a", "hidden_size": 4, "num_layers": 2,
              "vocab_size": 10, "dtype": "bf16", "points": ["layer_1"]}},
            "provenance": {{"model": "", "architecture": "", "dtype": ""}},
            "shards": [{shards}]}}"#
        )
        .into_bytes()
    }

    fn shard_json(path: &str, bytes: u64, rows: u64, row_groups: &str) -> String {
        format!(
            r#"{{"path": "{path}", "bytes": {bytes}, "rows": {rows}, "tokens": 1, "raw_bytes": 1,
               "min_sample_id": 0, "max_sample_id": 0, "crc32c": 0, "row_groups": {row_groups}}}"#
        )
    }

    #[test]
    fn reads_non_canonical_paths_as_canonical_and_remembers_them() {
        let a = shard_json("data//a.parquet", 1000, 2, "[1, 1]");
        let b = shard_json("data/b.parquet", 1000, 2, "[2]");
        let m = Manifest::from_json("v.json", &manifest_with(&format!("{a}, {b}"))).unwrap();
        assert_eq!(m.shards[0].path, "data/a.parquet");
        assert_eq!(m.noncanonical_paths, ["data//a.parquet"]);
        assert_eq!((m.num_samples(), m.num_tokens()), (4, 2));
        assert_eq!(
            m.commit_id, None,
            "manifests of older writers have no commit id"
        );
    }

    #[test]
    fn refuses_counts_that_overflow_or_that_the_file_cannot_hold() {
        let cases = [
            (
                format!(
                    "{}, {}",
                    shard_json("data/a", u64::MAX, 1 << 63, "[9223372036854775808]"),
                    shard_json("data/b", u64::MAX, 1 << 63, "[9223372036854775808]")
                ),
                "rows add up to more than 2^64",
            ),
            (
                shard_json("data/a", 5000, 1_000_000_000_000, "[1000000000000]"),
                "1000000000000 rows cannot fit in a file of 5000 bytes",
            ),
            (
                shard_json("data/a", 5000, 3, "[1, 1]"),
                "row_groups hold 2 rows in all, rows says 3",
            ),
            (
                shard_json("data/../../etc/passwd", 5000, 1, "[1]"),
                "has a '.' or '..' part",
            ),
        ];
        for (shards, want) in cases {
            let err = Manifest::from_json("v.json", &manifest_with(&shards))
                .unwrap_err()
                .to_string();
            assert!(err.contains(want), "{err}");
        }
    }

    #[test]
    fn a_shard_named_twice_is_kept_once_recorded_and_refused_by_readers() {
        let entries = [
            shard_json("data/a", 1000, 2, "[2]"),
            shard_json("data/b", 1000, 3, "[3]"),
            shard_json("data//a", 1000, 2, "[2]"),
            shard_json("data/a", 1000, 2, "[2]"),
            shard_json("data/b", 1000, 3, "[3]"),
        ];
        let m = Manifest::from_json("v.json", &manifest_with(&entries.join(", "))).unwrap();
        let paths: Vec<&str> = m.shards.iter().map(|s| s.path.as_str()).collect();
        assert_eq!(paths, ["data/a", "data/b"]);
        assert_eq!(m.num_samples(), 5, "each shard counted once");
        let r = |path: &str, times| RepeatedShard {
            path: path.into(),
            times,
        };
        assert_eq!(m.repeated, [r("data/a", 3), r("data/b", 2)]);
        let err = m
            .refuse_repeats("memory://d", "v.json")
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "v.json: shard data/a is named 3 times (1 more shards are named more than once); a \
             manifest names each shard once (`hslake repair memory://d --drop-repeats` commits a \
             version without the repeats)"
        );
        let once = Manifest::from_json("v.json", &manifest_with(&entries[..2].join(", "))).unwrap();
        assert!(once.repeated.is_empty() && once.refuse_repeats("u", "v").is_ok());
        // A commit writes what was kept, each shard once.
        let back = Manifest::from_json("v.json", &m.to_json()).unwrap();
        assert_eq!((back.shards.len(), back.repeated.len()), (2, 0));
    }

    #[test]
    fn refuses_more_row_groups_than_the_file_can_hold_and_oversized_manifests() {
        let groups = format!("[{}]", vec!["1"; 200].join(", "));
        let err = Manifest::from_json(
            "v.json",
            &manifest_with(&shard_json("data/a", 200 * 64 - 1, 200, &groups)),
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("200 row groups cannot fit in a file of 12799 bytes (at most 199"),
            "{err}"
        );
        assert!(Manifest::from_json(
            "v.json",
            &manifest_with(&shard_json("data/a", 200 * 64, 200, &groups))
        )
        .is_ok());
        let err = check_manifest_size("v.json", MAX_MANIFEST_BYTES + 1)
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "v.json: the manifest is 1073741825 bytes, more than the 1073741824 bytes a manifest \
             may have"
        );
        assert!(check_manifest_size("v.json", MAX_MANIFEST_BYTES).is_ok());
    }

    #[test]
    fn a_list_of_shards_past_its_bound_is_refused_before_more_are_parsed() {
        let three = [0, 1, 2].map(|i| shard_json(&format!("data/{i}"), 1000, 1, "[1]"));
        let parse = |n: usize, bound: usize| {
            let json = format!("[{}]", three[..n].join(", "));
            serde::Deserializer::deserialize_seq(
                &mut serde_json::Deserializer::from_str(&json),
                Bounded(bound),
            )
            .map(|v| v.len())
            .map_err(|e| e.to_string())
        };
        assert_eq!(parse(2, 2), Ok(2));
        let err = parse(3, 2).unwrap_err();
        assert!(
            err.contains("names more than 2 shards, the most a manifest may name"),
            "{err}"
        );
    }

    #[test]
    fn refuses_manifest_of_newer_format() {
        let err = Manifest::from_json("v.json", br#"{"format_version": 7}"#)
            .unwrap_err()
            .to_string();
        assert!(err.contains("format version 7 is newer"), "{err}");
    }

    #[test]
    fn refuses_manifest_of_the_byte_split_format() {
        let err = Manifest::from_json("v.json", br#"{"format_version": 1}"#)
            .unwrap_err()
            .to_string();
        assert!(err.contains("format version 1 predates"), "{err}");
    }
}
