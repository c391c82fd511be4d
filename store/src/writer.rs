//! Appending samples to a dataset: validation, encoding, shard rolling, atomic commits.
use std::collections::BTreeMap;
use std::sync::Arc;

use hslake_schemas::{tensor_stats, DatasetSchema, FinitePolicy, Sample, SchemaError, TensorStats};
use object_store::buffered::BufWriter;
use object_store::ObjectStoreExt;
use parquet::file::properties::WriterProperties;

use crate::format::codec::{build_batch, EncodedSample, TensorBytes};
use crate::format::planes::ValueChecksum;
use crate::format::shard::{shard_schema, writer_properties};
use crate::io::shard_upload::{ChunkPool, ShardUpload};
use crate::io::whole::{check, read_whole};
use crate::table::manifest::{ShardEntry, DATA_DIR};
use crate::table::sample_ids;
use crate::{Dataset, Result, StoreError};

/// How a writer lays out shards.
#[derive(Debug, Clone, Copy)]
pub struct WriterOptions {
    /// A shard is closed once its file reaches this many bytes.
    pub shard_target_bytes: u64,
    /// A row group is written once this many raw tensor bytes are buffered.
    pub row_group_target_bytes: u64,
    /// zstd level of every column.
    pub zstd_level: i32,
    /// What to do with NaN/Inf.
    pub finite_policy: FinitePolicy,
    /// The checksum every tensor and scale value carries (and the shard declares,
    /// docs/FORMAT.md): [`ValueChecksum::DEFAULT`] unless told otherwise; another kind or
    /// `None` only to write files as earlier writers did (benchmarks, compatibility tests).
    pub value_checksum: Option<ValueChecksum>,
}

impl Default for WriterOptions {
    fn default() -> Self {
        WriterOptions {
            shard_target_bytes: 256 << 20,
            row_group_target_bytes: 8 << 20,
            zstd_level: 1,
            finite_policy: FinitePolicy::Error,
            value_checksum: Some(ValueChecksum::DEFAULT),
        }
    }
}

/// What `append` did with a sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Appended {
    /// Buffered for the next commit.
    Written,
    /// Left out under [`FinitePolicy::Skip`].
    Skipped,
}

/// Counters of a writer since it was made.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct WriterStats {
    /// Samples appended (not skipped).
    pub samples: u64,
    /// Tokens appended.
    pub tokens: u64,
    /// Raw tensor bytes appended.
    pub raw_bytes: u64,
    /// Shard bytes written (closed shards).
    pub written_bytes: u64,
    /// Samples skipped for NaN/Inf.
    pub skipped: u64,
    /// Versions committed.
    pub commits: u64,
}

struct OpenShard {
    rel: String,
    upload: ShardUpload,
    rows: u64,
    tokens: u64,
    raw: u64,
    min_id: u64,
    max_id: u64,
    row_groups: Vec<u64>,
    ids: Vec<u64>,
}

/// Validate a sample against the schema, encode its tensors and compute their statistics;
/// `None` when the finiteness policy skips it. Pure CPU work: run it on as many threads as
/// the encoding needs, then hand the results to [`DatasetWriter::append_encoded`].
pub fn encode_sample<D: AsRef<[u8]>>(
    schema: &DatasetSchema,
    opts: &WriterOptions,
    sample: &Sample<D>,
) -> Result<Option<EncodedSample>> {
    schema.validate(sample).map_err(invalid(sample.sample_id))?;
    let stats: Vec<TensorStats> = sample.tensors.iter().map(tensor_stats).collect();
    encode_validated(schema, opts, sample, TensorBytes::Elements, stats)
}

/// [`encode_sample`] for a sample whose tensors arrive split into planes (see
/// [`TensorBytes::Planes`]), with their statistics computed where they were split: the bytes
/// are compressed as they are, never read as elements.
pub fn encode_split_sample<D: AsRef<[u8]>>(
    schema: &DatasetSchema,
    opts: &WriterOptions,
    sample: &Sample<D>,
    stats: Vec<TensorStats>,
) -> Result<Option<EncodedSample>> {
    schema.validate(sample).map_err(invalid(sample.sample_id))?;
    if stats.len() != sample.tensors.len() {
        return Err(StoreError::Usage(format!(
            "sample {}: {} statistics given for {} tensors split into planes",
            sample.sample_id,
            stats.len(),
            sample.tensors.len()
        )));
    }
    encode_validated(schema, opts, sample, TensorBytes::Planes, stats)
}

/// Sample `sample_id` refused by the schema.
fn invalid(sample_id: u64) -> impl FnOnce(SchemaError) -> StoreError {
    move |source| StoreError::InvalidSample { sample_id, source }
}

/// The finiteness policy on `stats`, then the encoding of a validated sample.
fn encode_validated<D: AsRef<[u8]>>(
    schema: &DatasetSchema,
    opts: &WriterOptions,
    sample: &Sample<D>,
    bytes: TensorBytes,
    stats: Vec<TensorStats>,
) -> Result<Option<EncodedSample>> {
    // The policy needs only the statistics: a sample it skips or refuses is never compressed.
    let keep = schema
        .apply_finite_policy(
            sample.sample_id,
            stats.iter().map(|s| (s.nan_count, s.inf_count)),
            opts.finite_policy,
        )
        .map_err(invalid(sample.sample_id))?;
    if !keep {
        return Ok(None);
    }
    EncodedSample::new(sample, bytes, stats, opts.zstd_level, opts.value_checksum).map(Some)
}

/// Appends samples to a dataset; `commit` makes them visible atomically as a new version.
pub struct DatasetWriter {
    ds: Dataset,
    schema: DatasetSchema,
    arrow: Arc<arrow_schema::Schema>,
    props: WriterProperties,
    opts: WriterOptions,
    buffer: Vec<EncodedSample>,
    buffer_raw: u64,
    open: Option<OpenShard>,
    pending: Vec<ShardEntry>,
    stats: WriterStats,
    /// Upload chunks, reused by one shard after another.
    chunks: ChunkPool,
}

impl DatasetWriter {
    /// A writer for the dataset's current schema.
    pub async fn new(ds: &Dataset, opts: WriterOptions) -> Result<Self> {
        let schema = ds.manifest(None).await?.schema;
        let arrow = Arc::new(shard_schema(&schema, opts.value_checksum));
        let props = writer_properties(&schema, opts.zstd_level, opts.value_checksum)?;
        Ok(DatasetWriter {
            ds: ds.clone(),
            schema,
            arrow,
            props,
            opts,
            buffer: vec![],
            buffer_raw: 0,
            open: None,
            pending: vec![],
            stats: WriterStats::default(),
            chunks: ChunkPool::default(),
        })
    }

    /// The options the writer was made with.
    pub fn options(&self) -> WriterOptions {
        self.opts
    }

    /// The dataset schema samples are checked against.
    pub fn schema(&self) -> &DatasetSchema {
        &self.schema
    }

    /// Validate, encode and buffer one sample. Nothing is visible to readers before `commit`.
    pub async fn append(&mut self, sample: &Sample) -> Result<Appended> {
        let enc = self.encode(sample)?;
        self.append_encoded(enc).await
    }

    /// Validate and encode a sample split into planes, with its statistics, without buffering
    /// it (see [`encode_split_sample`]).
    pub fn encode_split<D: AsRef<[u8]>>(
        &self,
        sample: &Sample<D>,
        stats: Vec<TensorStats>,
    ) -> Result<Option<EncodedSample>> {
        encode_split_sample(&self.schema, &self.opts, sample, stats)
    }

    /// Validate and encode a sample without buffering it (see [`encode_sample`]).
    pub fn encode<D: AsRef<[u8]>>(&self, sample: &Sample<D>) -> Result<Option<EncodedSample>> {
        encode_sample(&self.schema, &self.opts, sample)
    }

    /// Buffer a sample encoded by [`DatasetWriter::encode`] (`None`: it was skipped).
    pub async fn append_encoded(&mut self, enc: Option<EncodedSample>) -> Result<Appended> {
        let Some(enc) = enc else {
            self.stats.skipped += 1;
            return Ok(Appended::Skipped);
        };
        // The shard declares checksummed values, or none: a reader holds every frame of a
        // declaring file to it, so one sample encoded otherwise would read as corrupt.
        if enc.checksum() != self.opts.value_checksum {
            return Err(StoreError::Usage(format!(
                "sample {} was encoded with value_checksum = {:?}, but this writer writes {:?}",
                enc.sample_id,
                enc.checksum(),
                self.opts.value_checksum
            )));
        }
        self.stats.samples += 1;
        self.stats.tokens += enc.input_ids.len() as u64;
        self.stats.raw_bytes += enc.raw_bytes();
        self.buffer_raw += enc.raw_bytes();
        self.buffer.push(enc);
        if self.buffer_raw >= self.opts.row_group_target_bytes {
            self.flush_row_group().await?;
        }
        Ok(Appended::Written)
    }

    async fn flush_row_group(&mut self) -> Result<()> {
        if self.buffer.is_empty() {
            return Ok(());
        }
        let mut rows = std::mem::take(&mut self.buffer);
        self.buffer_raw = 0;
        let batch = build_batch(&self.schema, &self.arrow, &mut rows)?;
        if self.open.is_none() {
            self.open = Some(self.start_shard()?);
        }
        let shard = self.open.as_mut().expect("shard opened above");
        let shown = format!("{}/{}", self.ds.url(), shard.rel);
        shard
            .upload
            .write_row_group(&batch)
            .await
            .map_err(|e| StoreError::pq(&shown, e))?;
        shard.rows += rows.len() as u64;
        shard.tokens += rows.iter().map(|r| r.input_ids.len() as u64).sum::<u64>();
        shard.raw += rows.iter().map(EncodedSample::raw_bytes).sum::<u64>();
        for r in &rows {
            shard.min_id = shard.min_id.min(r.sample_id);
            shard.max_id = shard.max_id.max(r.sample_id);
            shard.ids.push(r.sample_id);
        }
        shard.row_groups.push(rows.len() as u64);
        if shard.upload.bytes_written() as u64 >= self.opts.shard_target_bytes {
            self.close_shard().await?;
        }
        Ok(())
    }

    fn start_shard(&self) -> Result<OpenShard> {
        let rel = format!("{DATA_DIR}/{}.parquet", uuid::Uuid::new_v4());
        let out = BufWriter::new(self.ds.object_store(), self.ds.object_path(&rel));
        let upload = ShardUpload::new(
            out,
            self.arrow.clone(),
            self.props.clone(),
            self.chunks.clone(),
        )
        .map_err(|e| StoreError::pq(format!("{}/{rel}", self.ds.url()), e))?;
        Ok(OpenShard {
            rel,
            upload,
            rows: 0,
            tokens: 0,
            raw: 0,
            min_id: u64::MAX,
            max_id: 0,
            row_groups: vec![],
            ids: vec![],
        })
    }

    async fn close_shard(&mut self) -> Result<()> {
        let Some(mut shard) = self.open.take() else {
            return Ok(());
        };
        let shown = format!("{}/{}", self.ds.url(), shard.rel);
        let closed = shard.upload.finish().await;
        let (crc, bytes) = shard.upload.digest();
        if let Err(e) = closed {
            // The upload may have landed although its response was lost: the file in storage,
            // read back, has the bytes written or the failure stands.
            let expected = ShardEntry {
                path: shard.rel.clone(),
                bytes,
                crc32c: crc,
                rows: 0,
                tokens: 0,
                raw_bytes: 0,
                min_sample_id: 0,
                max_sample_id: 0,
                row_groups: vec![],
            };
            let landed = read_whole(self.ds.location(), &shard.rel)
                .await
                .and_then(|b| check(&shown, &expected, &b));
            if landed.is_err() {
                return Err(StoreError::pq(&shown, e));
            }
            tracing::info!(shard = %shown, error = %e, "shard upload reported failure but the file is there and intact (response lost)");
        }
        self.stats.written_bytes += bytes;
        tracing::debug!(shard = %shown, rows = shard.rows, bytes, "closed shard");
        // The commit's duplicate check needs this shard's ids: no need to read them back.
        sample_ids::remember(self.ds.location(), &shard.rel, shard.ids);
        self.pending.push(ShardEntry {
            path: shard.rel,
            bytes,
            rows: shard.rows,
            tokens: shard.tokens,
            raw_bytes: shard.raw,
            min_sample_id: shard.min_id,
            max_sample_id: shard.max_id,
            crc32c: crc,
            row_groups: shard.row_groups,
        });
        Ok(())
    }

    /// Close the open shard and commit every pending shard as a new version.
    pub async fn commit(&mut self) -> Result<Option<u64>> {
        self.commit_inner(&BTreeMap::new()).await
    }

    /// Like [`DatasetWriter::commit`], also setting manifest properties (commits even with no new data).
    pub async fn commit_with_properties(
        &mut self,
        props: BTreeMap<String, String>,
    ) -> Result<Option<u64>> {
        self.commit_inner(&props).await
    }

    async fn commit_inner(&mut self, props: &BTreeMap<String, String>) -> Result<Option<u64>> {
        self.flush_row_group().await?;
        self.close_shard().await?;
        if self.pending.is_empty() && props.is_empty() {
            return Ok(None);
        }
        let v = self.ds.commit(&self.schema, &self.pending, props).await?;
        self.pending.clear();
        self.stats.commits += 1;
        Ok(Some(v))
    }

    /// Counters since the writer was made.
    pub fn stats(&self) -> WriterStats {
        self.stats
    }

    /// Samples appended since the last commit.
    pub fn uncommitted_samples(&self) -> u64 {
        self.buffer.len() as u64
            + self.open.as_ref().map_or(0, |s| s.rows)
            + self.pending.iter().map(|s| s.rows).sum::<u64>()
    }

    /// Drop everything not yet committed and delete its shard files.
    pub async fn abort(mut self) -> Result<()> {
        if let Some(mut s) = self.open.take() {
            // Closing completes the upload so the file can be deleted like any other.
            let _ = s.upload.finish().await;
            self.pending.push(ShardEntry {
                path: s.rel,
                bytes: 0,
                rows: 0,
                tokens: 0,
                raw_bytes: 0,
                min_sample_id: 0,
                max_sample_id: 0,
                crc32c: 0,
                row_groups: vec![],
            });
        }
        let store = self.ds.object_store();
        for s in self.pending.drain(..) {
            match store.delete(&self.ds.object_path(&s.path)).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => return Err(StoreError::os(format!("{}/{}", self.ds.url(), s.path), e)),
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hslake_schemas::{CapturePoint, DType, TensorData};

    fn nan_sample() -> (DatasetSchema, Sample) {
        let schema = DatasetSchema::new(
            "m",
            "LlamaForCausalLM",
            2,
            4,
            100,
            DType::Bf16,
            vec![CapturePoint::LayerOutput(1)],
        )
        .unwrap();
        let s = Sample {
            sample_id: 9,
            input_ids: vec![1, 2],
            loss_mask: vec![1, 1],
            tensors: vec![TensorData::from_bf16_bits(
                &[0x3f80, 0x7fc0, 0x4000, 0x4040],
                vec![2, 2],
            )],
        };
        (schema, s)
    }

    fn with_policy(finite_policy: FinitePolicy) -> WriterOptions {
        WriterOptions {
            finite_policy,
            ..WriterOptions::default()
        }
    }

    #[test]
    fn finite_policy_decides_what_a_sample_with_nan_becomes() {
        let (schema, s) = nan_sample();
        let err = encode_sample(&schema, &with_policy(FinitePolicy::Error), &s).unwrap_err();
        assert!(
            matches!(err, StoreError::InvalidSample { sample_id: 9, .. }),
            "{err}"
        );
        assert!(encode_sample(&schema, &with_policy(FinitePolicy::Skip), &s)
            .unwrap()
            .is_none());
        let kept = encode_sample(&schema, &with_policy(FinitePolicy::Record), &s)
            .unwrap()
            .expect("kept");
        assert_eq!(kept.stats[0].nan_count, 1);
        assert_eq!(kept.raw_bytes(), 8);
    }

    /// Each shard's file metadata as `read_row_group` attaches it to the batches it returns.
    async fn file_metadata(ds: &Dataset) -> Vec<std::collections::HashMap<String, String>> {
        let r = crate::DatasetReader::open(ds, None).await.unwrap();
        let mut out = vec![];
        for i in 0..r.manifest().shards.len() {
            let b = r.read_row_group(i, 0, None).await.unwrap();
            out.push(b.schema().metadata().clone());
        }
        out
    }

    #[tokio::test]
    async fn shards_declare_the_value_checksum_they_are_written_with() {
        let (schema, s) = nan_sample();
        for on in [
            Some(ValueChecksum::Crc32),
            Some(ValueChecksum::ZstdXxh64),
            None,
        ] {
            let url = format!("memory://writer-checksums-{on:?}");
            let ds = Dataset::create(&url, schema.clone(), crate::Provenance::default())
                .await
                .unwrap();
            let opts = WriterOptions {
                finite_policy: FinitePolicy::Record,
                value_checksum: on,
                ..WriterOptions::default()
            };
            let mut w = DatasetWriter::new(&ds, opts).await.unwrap();
            // A sample encoded the other way would make the file's declaration false.
            let other = WriterOptions {
                value_checksum: match on {
                    Some(_) => None,
                    None => Some(ValueChecksum::DEFAULT),
                },
                ..opts
            };
            let wrong = encode_sample(&schema, &other, &s).unwrap();
            let err = w.append_encoded(wrong).await.unwrap_err().to_string();
            assert!(err.contains("value_checksum"), "{err}");
            w.append(&s).await.unwrap();
            w.commit().await.unwrap();
            let metas = file_metadata(&ds).await;
            assert_eq!(metas.len(), 1);
            assert_eq!(
                metas[0].get(crate::format::planes::CHECKSUM_META_KEY),
                on.map(|k| k.name().to_string()).as_ref(),
                "{metas:?}"
            );
            let back = crate::DatasetReader::open(&ds, None)
                .await
                .unwrap()
                .get_sample(9)
                .await
                .unwrap();
            assert_eq!(back.tensors[0].data, s.tensors[0].data);
        }
    }
    #[test]
    fn a_sample_split_into_planes_encodes_to_the_bytes_of_its_elements() {
        let (schema, s) = nan_sample();
        let opts = with_policy(FinitePolicy::Record);
        let whole = encode_sample(&schema, &opts, &s).unwrap().expect("kept");
        let mut planes = vec![];
        crate::format::planes::to_planes(&s.tensors[0].data, 2, &mut planes);
        let split = Sample {
            tensors: vec![TensorData {
                data: planes,
                ..s.tensors[0].clone()
            }],
            ..s.clone()
        };
        let stats = vec![tensor_stats(&s.tensors[0])];
        let from_planes = encode_split_sample(&schema, &opts, &split, stats.clone())
            .unwrap()
            .expect("kept");
        assert_eq!(from_planes.tensors, whole.tensors);
        assert_eq!(from_planes.stats, whole.stats);
        // The policy reads the statistics it is given: they are all it knows of the values.
        let refused =
            encode_split_sample(&schema, &with_policy(FinitePolicy::Error), &split, stats);
        assert!(refused.is_err());
        let err = encode_split_sample(&schema, &opts, &split, vec![]).unwrap_err();
        assert!(
            err.to_string().contains("0 statistics given for 1 tensors"),
            "{err}"
        );
    }
}
