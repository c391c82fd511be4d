//! Checking a version end to end: the manifest's own consistency (canonical paths, each shard
//! named once, each sample id once), every shard's size, checksum, schema, the counts its entry
//! records (rows, row groups, tokens, raw bytes) and the shape of every tensor, naming the
//! file and row of each problem. A shard that is not in storage is named with every version
//! that names it, since each of those versions is broken by it.
use std::collections::BTreeMap;
use std::fmt;

use arrow_array::cast::AsArray;
use arrow_array::types::{UInt32Type, UInt64Type};
use arrow_array::RecordBatch;
use bytes::Bytes;
use futures::StreamExt;
use hslake_schemas::DatasetSchema;
use object_store::ObjectStoreExt;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

use crate::format::decode::{with_file_metadata, TensorColumn};
use crate::format::guard::{decoder_failure, guarded};
use crate::format::lengths::RowLengths;
use crate::format::shard::{check_footer, check_row_groups};
use crate::format::tokens::TokenRows;
use crate::table::manifest::{manifest_path, ShardEntry};
use crate::table::sample_ids::SHOWN_DUPLICATES;
use crate::table::versions;
use crate::{Dataset, Result, StoreError};

/// One thing wrong with a dataset.
#[derive(Debug, Clone, PartialEq)]
pub struct Problem {
    /// The file (URL of the shard).
    pub file: String,
    /// The row within the shard, where one row is at fault.
    pub row: Option<u64>,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.row {
            Some(r) => write!(f, "{}: row {r}: {}", self.file, self.message),
            None => write!(f, "{}: {}", self.file, self.message),
        }
    }
}

/// What `verify` checked and found.
#[derive(Debug, Clone, Default)]
pub struct VerifyReport {
    /// The version checked.
    pub version: u64,
    /// Shards checked.
    pub shards: usize,
    /// Samples checked.
    pub samples: u64,
    /// Bytes read.
    pub bytes: u64,
    /// Every problem found.
    pub problems: Vec<Problem>,
    /// Shards the version names that are not in storage, each with every version naming it.
    pub missing: Vec<MissingShard>,
}

/// A shard that a manifest names but storage does not hold.
#[derive(Debug, Clone, PartialEq)]
pub struct MissingShard {
    /// Its dataset-relative path.
    pub path: String,
    /// Every version whose manifest names it, ascending (manifests that cannot be read left out).
    pub versions: Vec<u64>,
}

impl VerifyReport {
    /// True when nothing is wrong.
    pub fn is_clean(&self) -> bool {
        self.problems.is_empty()
    }
}

/// Verify a version (`None`: the newest). `on_shard` is called after each shard with its bytes.
pub async fn verify(
    ds: &Dataset,
    version: Option<u64>,
    mut on_shard: impl FnMut(u64),
) -> Result<VerifyReport> {
    // As stored: a shard named twice is a problem to report, not a reason to stop.
    let m = ds.manifest_as_stored(version).await?;
    let mut report = VerifyReport {
        version: m.version,
        shards: m.shards.len(),
        ..Default::default()
    };
    let manifest_file = format!("{}/{}", ds.url(), manifest_path(m.version));
    for raw in &m.noncanonical_paths {
        report.problems.push(Problem {
            file: manifest_file.clone(),
            row: None,
            message: format!("shard path {raw:?} is not canonical (data/<name>); readers and vacuum read it as its canonical form"),
        });
    }
    for r in &m.repeated {
        report.problems.push(Problem {
            file: manifest_file.clone(),
            row: None,
            message: format!(
                "shard {} is named {} times; readers refuse the version (`hslake repair {} \
                 --drop-repeats` commits one without the repeats)",
                r.path,
                r.times,
                ds.url()
            ),
        });
    }
    // (sample id, shard index, row) of every row read, to find ids held twice.
    let mut ids: Vec<(u64, usize, u64)> = Vec::new();
    let mut missing: Vec<&str> = vec![];
    let store = ds.object_store();
    for (index, entry) in m.shards.iter().enumerate() {
        let file = format!("{}/{}", ds.url(), entry.path);
        let mut problem = |row: Option<u64>, message: String| {
            report.problems.push(Problem {
                file: file.clone(),
                row,
                message,
            })
        };
        let bytes = match store.get(&ds.object_path(&entry.path)).await {
            Ok(r) => match r.bytes().await {
                Ok(b) => b,
                Err(e) => {
                    problem(None, format!("cannot be read: {e}"));
                    continue;
                }
            },
            Err(object_store::Error::NotFound { .. }) => {
                missing.push(&entry.path);
                continue;
            }
            Err(e) => {
                problem(None, format!("cannot be read: {e}"));
                continue;
            }
        };
        report.bytes += bytes.len() as u64;
        on_shard(bytes.len() as u64);
        if bytes.len() as u64 != entry.bytes {
            problem(
                None,
                format!(
                    "file is {} bytes, the manifest says {} (truncated or replaced)",
                    bytes.len(),
                    entry.bytes
                ),
            );
        }
        let crc = crc32c::crc32c(&bytes);
        if crc != entry.crc32c {
            problem(
                None,
                format!(
                    "checksum mismatch: crc32c {crc:08x}, the manifest says {:08x}",
                    entry.crc32c
                ),
            );
        }
        let mut seen = Seen::default();
        check_shard_contents(&m.schema, entry, bytes, &mut seen, &mut problem);
        // Counts of a shard that could not be read to its end would only repeat that problem.
        let counts = [
            ("tokens", seen.tokens, entry.tokens),
            ("raw_bytes", seen.raw_bytes, entry.raw_bytes),
        ];
        for (name, found, recorded) in counts.into_iter().filter(|_| seen.complete) {
            if found != u128::from(recorded) {
                problem(
                    None,
                    format!("rows hold {found} {name}, the manifest says {recorded}"),
                );
            }
        }
        report.samples += seen.ids.len() as u64;
        ids.extend(seen.ids.into_iter().map(|(id, row)| (id, index, row)));
    }
    if !missing.is_empty() {
        let naming = versions_naming(ds, &missing).await?;
        for path in missing {
            let versions = naming.get(path).cloned().unwrap_or_default();
            report.problems.push(Problem {
                file: format!("{}/{path}", ds.url()),
                row: None,
                message: format!("missing: not in storage; {}", name_versions(&versions)),
            });
            report.missing.push(MissingShard {
                path: path.to_string(),
                versions,
            });
        }
    }
    ids.sort_unstable();
    let twice: Vec<&[(u64, usize, u64)]> = ids
        .chunk_by(|a, b| a.0 == b.0)
        .filter(|g| g.len() > 1)
        .collect();
    for g in twice.iter().take(SHOWN_DUPLICATES) {
        let (id, first, first_row) = g[0];
        let others: Vec<String> = g[1..]
            .iter()
            .map(|&(_, s, r)| format!("{} row {r}", m.shards[s].path))
            .collect();
        report.problems.push(Problem {
            file: format!("{}/{}", ds.url(), m.shards[first].path),
            row: Some(first_row),
            message: format!("sample {id} is held again by {}", others.join(", ")),
        });
    }
    if twice.len() > SHOWN_DUPLICATES {
        report.problems.push(Problem {
            file: manifest_file,
            row: None,
            message: format!(
                "{} sample ids are held more than once in all ({SHOWN_DUPLICATES} shown above)",
                twice.len()
            ),
        });
    }
    Ok(report)
}

/// For each of `paths`, every version whose manifest names it. A manifest that cannot be read
/// is left out (verifying that version reports why).
async fn versions_naming(ds: &Dataset, paths: &[&str]) -> Result<BTreeMap<String, Vec<u64>>> {
    let all = ds.versions().await?;
    let mut manifests = std::pin::pin!(versions::read_each(ds.location(), &all));
    let mut naming: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    while let Some(m) = manifests.next().await {
        let Ok(m) = m else { continue };
        for s in m.shards.iter().filter(|s| paths.contains(&s.path.as_str())) {
            naming.entry(s.path.clone()).or_default().push(m.version);
        }
    }
    Ok(naming)
}

/// `versions 3..=7, 9 name it`: runs of consecutive versions as ranges.
fn name_versions(versions: &[u64]) -> String {
    let mut runs: Vec<(u64, u64)> = vec![];
    for &v in versions {
        match runs.last_mut() {
            Some((_, end)) if v == *end + 1 => *end = v,
            _ => runs.push((v, v)),
        }
    }
    let text: Vec<String> = runs
        .iter()
        .map(|&(a, b)| {
            if a == b {
                a.to_string()
            } else {
                format!("{a}..={b}")
            }
        })
        .collect();
    match versions {
        [] => "no readable manifest names it".into(),
        [_] => format!("version {} names it", text[0]),
        _ => format!("versions {} name it", text.join(", ")),
    }
}

/// What the rows of one shard hold, summed as `verify` reads them.
#[derive(Default)]
struct Seen {
    /// (sample id, row) of each row.
    ids: Vec<(u64, u64)>,
    /// Sum of `seq_len`.
    tokens: u128,
    /// Sum of `seq_len × hidden × element size × points`, the writer's raw tensor bytes.
    raw_bytes: u128,
    /// Whether every row was read.
    complete: bool,
}

/// [`check_contents`], with a failure of the Parquet decoder itself named as a problem.
fn check_shard_contents(
    schema: &DatasetSchema,
    entry: &ShardEntry,
    bytes: Bytes,
    seen: &mut Seen,
    problem: &mut impl FnMut(Option<u64>, String),
) {
    if let Err(e) = guarded(|| check_contents(schema, entry, bytes, seen, problem)) {
        seen.complete = false;
        problem(None, decoder_failure(&e));
    }
}

/// Decode a shard and check schema, counts and every tensor's size; what it holds goes to `seen`.
fn check_contents(
    schema: &DatasetSchema,
    entry: &ShardEntry,
    bytes: Bytes,
    seen: &mut Seen,
    problem: &mut impl FnMut(Option<u64>, String),
) {
    let len = bytes.len() as u64;
    let builder = match ParquetRecordBatchReaderBuilder::try_new(bytes) {
        Ok(b) => b,
        Err(e) => {
            problem(None, format!("not a readable Parquet file: {e}"));
            return;
        }
    };
    if let Err(reason) = check_footer(builder.metadata(), len) {
        problem(None, format!("corrupt footer: {reason}"));
        return;
    }
    match DatasetSchema::from_arrow(builder.schema()) {
        Ok(s) if &s == schema => {}
        Ok(_) => problem(
            None,
            "file schema differs from the manifest's dataset schema".into(),
        ),
        Err(e) => problem(None, e.to_string()),
    }
    if let Err(reason) = check_row_groups(builder.metadata(), &entry.row_groups) {
        problem(None, reason);
    }
    let file_meta = builder.schema().metadata().clone();
    let reader = match builder.with_batch_size(1024).build() {
        Ok(r) => r,
        Err(e) => {
            problem(None, format!("cannot be decoded: {e}"));
            return;
        }
    };
    let mut row0 = 0u64;
    for batch in reader {
        match batch {
            Ok(b) => {
                let b = with_file_metadata(b, &file_meta);
                check_batch(schema, entry, &b, row0, seen, problem);
                row0 += b.num_rows() as u64;
            }
            Err(e) => {
                problem(Some(row0), format!("cannot be decoded: {e}"));
                return;
            }
        }
    }
    if row0 != entry.rows {
        problem(
            None,
            format!("holds {row0} rows, the manifest says {}", entry.rows),
        );
    }
    seen.complete = true;
}

fn check_batch(
    schema: &DatasetSchema,
    entry: &ShardEntry,
    b: &RecordBatch,
    row0: u64,
    seen: &mut Seen,
    problem: &mut impl FnMut(Option<u64>, String),
) {
    let (Some(ids), Some(seq), Some(_), Some(_)) = (
        b.column_by_name("sample_id")
            .and_then(|c| c.as_primitive_opt::<UInt64Type>()),
        b.column_by_name("seq_len")
            .and_then(|c| c.as_primitive_opt::<UInt32Type>()),
        b.column_by_name("input_ids")
            .and_then(|c| c.as_list_opt::<i32>()),
        b.column_by_name("loss_mask")
            .and_then(|c| c.as_list_opt::<i32>()),
    ) else {
        problem(
            None,
            "missing or mistyped sample_id/seq_len/input_ids/loss_mask columns".into(),
        );
        return;
    };
    // A batch whose columns cannot be read is one problem, reported by its reason.
    let unreadable = |e: StoreError| match e {
        StoreError::Corrupt { reason, .. } => reason,
        e => e.to_string(),
    };
    let cols = match schema
        .points
        .iter()
        .map(|&p| TensorColumn::from_batch(b, schema.dtype, schema.hidden_size, p, "", None))
        .collect::<Result<Vec<_>>>()
    {
        Ok(c) => c,
        Err(e) => {
            problem(None, unreadable(e));
            return;
        }
    };
    let tokens = match TokenRows::from_batch(b, "", None) {
        Ok(t) => t,
        Err(e) => {
            problem(None, unreadable(e));
            return;
        }
    };
    let lengths = match RowLengths::from_batch(b, "", None) {
        Ok(l) => l,
        Err(e) => {
            problem(None, unreadable(e));
            return;
        }
    };
    let (mut values, mut scales) = (Vec::new(), Vec::new());
    for r in 0..b.num_rows() {
        let row = Some(row0 + r as u64);
        let id = ids.value(r);
        if id < entry.min_sample_id || id > entry.max_sample_id {
            problem(
                row,
                format!(
                    "sample {id} outside the manifest's range {}..={}",
                    entry.min_sample_id, entry.max_sample_id
                ),
            );
        }
        seen.ids.push((id, row0 + r as u64));
        let n = seq.value(r) as usize;
        seen.tokens += n as u128;
        seen.raw_bytes += n as u128
            * schema.hidden_size as u128
            * schema.dtype.size() as u128
            * cols.len() as u128;
        if let Some(Err(StoreError::BadValue { column, reason, .. })) =
            lengths.as_ref().map(|l| l.check_row(r))
        {
            problem(row, format!("sample {id} {column}: {reason}"));
        }
        if let Some(Err(StoreError::BadValue { column, reason, .. })) =
            tokens.as_ref().map(|t| t.check_row(r))
        {
            problem(row, format!("sample {id} {column}: {reason}"));
        }
        for col in &cols {
            if col.is_null(r) {
                problem(row, format!("sample {id} {}: null tensor", col.name()));
                continue;
            }
            // Decoding every value checks its frames as well as its shape.
            match col.decode_row(r, n, &mut values, &mut scales) {
                Ok(()) => {}
                Err(StoreError::BadValue { column, reason, .. }) => {
                    problem(row, format!("sample {id} {column}: {reason}"))
                }
                Err(e) => problem(row, format!("sample {id}: {e}")),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tools::synth::SynthModel;
    use crate::{DatasetReader, DatasetWriter, Provenance, WriterOptions};
    use hslake_schemas::{CapturePoint, DType};

    /// A one-shard dataset of a few small samples in `dir`: its schema, shard entry and bytes.
    async fn one_shard(dir: &std::path::Path) -> (Dataset, DatasetSchema, ShardEntry, Vec<u8>) {
        let schema = DatasetSchema::new(
            "m",
            "LlamaForCausalLM",
            32,
            4,
            1000,
            DType::Bf16,
            vec![CapturePoint::LayerOutput(1), CapturePoint::LayerOutput(3)],
        )
        .unwrap();
        let url = format!("file://{}", dir.display());
        let ds = Dataset::create(&url, schema.clone(), Provenance::default())
            .await
            .unwrap();
        let opts = WriterOptions {
            row_group_target_bytes: 1 << 10,
            ..Default::default()
        };
        let mut w = DatasetWriter::new(&ds, opts).await.unwrap();
        let synth = SynthModel::new(schema.clone(), (3, 9), 5);
        for id in 0..4 {
            w.append(&synth.sample(id)).await.unwrap();
        }
        w.commit().await.unwrap();
        let entry = ds.manifest(None).await.unwrap().shards[0].clone();
        let bytes = std::fs::read(dir.join(&entry.path)).unwrap();
        (ds, schema, entry, bytes)
    }

    #[test]
    fn names_the_versions_of_a_missing_shard_as_ranges() {
        assert_eq!(name_versions(&[12]), "version 12 names it");
        assert_eq!(name_versions(&[12, 13, 14]), "versions 12..=14 name it");
        assert_eq!(
            name_versions(&[3, 5, 6, 7, 9]),
            "versions 3, 5..=7, 9 name it"
        );
        assert_eq!(name_versions(&[]), "no readable manifest names it");
    }

    #[tokio::test]
    async fn no_flipped_bit_anywhere_in_a_shard_makes_verify_or_the_reader_panic() {
        let tmp = tempfile::tempdir().unwrap();
        let (ds, schema, entry, clean) = one_shard(tmp.path()).await;
        let mut refused_footers = 0;
        for at in 0..clean.len() {
            for bit in [0x01u8, 0x10, 0x80] {
                let mut b = clean.clone();
                b[at] ^= bit;
                let mut problems = vec![];
                check_shard_contents(
                    &schema,
                    &entry,
                    Bytes::from(b),
                    &mut Seen::default(),
                    &mut |_, p| problems.push(p),
                );
                refused_footers += problems.iter().any(|p| p.contains("corrupt footer")) as u32;
            }
        }
        // Flips in the footer's offsets and sizes are among them, and are named as such.
        assert!(refused_footers > 0);
        // The reader (SQL, loader) returns an error for every flip it notices, never a panic,
        // and names a footer it cannot trust as such.
        let mut refused = 0;
        for at in 0..clean.len() {
            let mut b = clean.clone();
            b[at] ^= 0x80;
            std::fs::write(tmp.path().join(&entry.path), &b).unwrap();
            let r = DatasetReader::open(&ds, None).await.unwrap();
            if let Err(e) = r.read_row_group(0, 0, None).await {
                refused += e.to_string().contains("corrupt footer") as u32;
            }
        }
        assert!(refused > 0);
    }
}
