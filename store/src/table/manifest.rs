//! The versioned manifest: which shards make up a dataset version, and where they came from.
use std::collections::BTreeMap;

use hslake_schemas::{CapturePoint, DatasetSchema, FORMAT_VERSION};
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
    /// Every live shard.
    pub shards: Vec<ShardEntry>,
    /// Free-form properties (e.g. capture progress).
    #[serde(default)]
    pub properties: BTreeMap<String, String>,
}

impl Manifest {
    /// Samples in this version.
    pub fn num_samples(&self) -> u64 {
        self.shards.iter().map(|s| s.rows).sum()
    }
    /// Tokens in this version.
    pub fn num_tokens(&self) -> u64 {
        self.shards.iter().map(|s| s.tokens).sum()
    }
    /// Bytes of all shard files.
    pub fn bytes(&self) -> u64 {
        self.shards.iter().map(|s| s.bytes).sum()
    }
    /// Uncompressed tensor bytes.
    pub fn raw_bytes(&self) -> u64 {
        self.shards.iter().map(|s| s.raw_bytes).sum()
    }

    /// Parse a manifest, refusing newer formats before anything else.
    pub fn from_json(path: &str, bytes: &[u8]) -> Result<Self> {
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
        if head.format_version < FORMAT_VERSION {
            return Err(StoreError::OlderFormat {
                path: path.to_string(),
                found: head.format_version,
                supported: FORMAT_VERSION,
            });
        }
        let m: Manifest = serde_json::from_slice(bytes)
            .map_err(|e| StoreError::corrupt(path, format!("bad manifest: {e}")))?;
        m.schema.check()?;
        Ok(m)
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
