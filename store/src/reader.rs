//! Reading one pinned version: footers, row groups, single samples, scans.
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use arrow_array::cast::AsArray;
use arrow_array::types::UInt64Type;
use arrow_array::RecordBatch;
use futures::stream::{self, BoxStream};
use futures::{StreamExt, TryStreamExt};
use hslake_schemas::{DatasetSchema, Sample};
use parquet::arrow::arrow_reader::{ArrowReaderMetadata, ArrowReaderOptions, RowSelection};
use parquet::arrow::{ParquetRecordBatchStreamBuilder, ProjectionMask};
use parquet::file::metadata::{PageIndexPolicy, ParquetMetaData};
use parquet::file::statistics::Statistics;

use crate::format::codec::decode_samples_from;
use crate::format::decode::with_file_metadata;
use crate::format::guard::{decoder_failure, guarded_async};
use crate::format::lengths::RowLengths;
use crate::format::shard::{check_footer, check_row_groups};
use crate::format::tokens::{TokenRows, TOKEN_CHECKSUM_COLUMN};
use crate::io::counting::CountingStore;
use crate::io::ranged::ShardFile;
use crate::table::manifest::Manifest;
use crate::{Dataset, Result, StoreError};

/// Where one sample sits in a version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SampleSite {
    /// Index of its shard in the manifest.
    pub shard: usize,
    /// The shard's path, relative to the dataset.
    pub path: String,
    /// The row group in that shard.
    pub row_group: usize,
    /// The row in that row group.
    pub row: usize,
}

/// A reader pinned to one committed version; footers are cached after first use.
#[derive(Clone)]
pub struct DatasetReader {
    ds: Dataset,
    manifest: Arc<Manifest>,
    footers: Arc<Mutex<HashMap<usize, ArrowReaderMetadata>>>,
    io: Arc<CountingStore>,
}

impl DatasetReader {
    /// Pin a version (`None`: the newest).
    pub async fn open(ds: &Dataset, version: Option<u64>) -> Result<Self> {
        let manifest = Arc::new(ds.manifest(version).await?);
        Ok(DatasetReader {
            ds: ds.clone(),
            manifest,
            footers: Default::default(),
            io: Arc::new(CountingStore::new(ds.object_store())),
        })
    }

    /// The pinned manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// The dataset schema.
    pub fn schema(&self) -> &DatasetSchema {
        &self.manifest.schema
    }

    /// The dataset.
    pub fn dataset(&self) -> &Dataset {
        &self.ds
    }

    fn shown(&self, shard: usize) -> String {
        format!("{}/{}", self.ds.url(), self.manifest.shards[shard].path)
    }

    /// Bytes and requests fetched from storage by this reader and its clones.
    pub fn io(&self) -> (u64, u64) {
        (self.io.bytes_read(), self.io.requests())
    }

    fn object_reader(&self, shard: usize) -> Result<ShardFile> {
        let entry = self.manifest.shards.get(shard).ok_or_else(|| {
            StoreError::Usage(format!(
                "shard {shard} out of range: version has {}",
                self.manifest.shards.len()
            ))
        })?;
        Ok(ShardFile::new(
            self.io.clone(),
            self.ds.object_path(&entry.path),
            entry.bytes,
        ))
    }

    async fn arrow_metadata(&self, shard: usize) -> Result<ArrowReaderMetadata> {
        if let Some(m) = self
            .footers
            .lock()
            .ok()
            .and_then(|f| f.get(&shard).cloned())
        {
            return Ok(m);
        }
        let mut r = self.object_reader(shard)?;
        let m = ArrowReaderMetadata::load_async(
            &mut r,
            // The offset index locates each page, so that reading some rows of a row group
            // fetches only their pages; page statistics (the column index) are not used.
            ArrowReaderOptions::new()
                .with_column_index_policy(PageIndexPolicy::Skip)
                .with_offset_index_policy(PageIndexPolicy::Optional),
        )
        .await
        .map_err(|e| StoreError::pq(self.shown(shard), e))?;
        let entry = &self.manifest.shards[shard];
        check_footer(m.metadata(), entry.bytes).map_err(|reason| {
            StoreError::corrupt(self.shown(shard), format!("corrupt footer: {reason}"))
        })?;
        check_row_groups(m.metadata(), &entry.row_groups)
            .map_err(|reason| StoreError::corrupt(self.shown(shard), reason))?;
        if let Ok(mut f) = self.footers.lock() {
            f.insert(shard, m.clone());
        }
        Ok(m)
    }

    /// The Parquet footer of a shard (cached).
    pub async fn shard_metadata(&self, shard: usize) -> Result<Arc<ParquetMetaData>> {
        Ok(self.arrow_metadata(shard).await?.metadata().clone())
    }

    /// Read one row group, optionally only some columns, as one batch.
    pub async fn read_row_group(
        &self,
        shard: usize,
        row_group: usize,
        columns: Option<&[String]>,
    ) -> Result<RecordBatch> {
        self.read(shard, row_group, None, columns).await
    }

    /// Read only `rows` (ascending, distinct) of one row group, optionally only some columns,
    /// as one batch whose row `i` is row `rows[i]` of the row group. Unselected rows are
    /// skipped by Parquet before any of their values are decoded; errors name rows of the row
    /// group, not of the batch.
    pub async fn read_rows(
        &self,
        shard: usize,
        row_group: usize,
        rows: &[usize],
        columns: Option<&[String]>,
    ) -> Result<RecordBatch> {
        if rows.windows(2).any(|w| w[0] >= w[1]) {
            return Err(StoreError::Usage(format!(
                "{}: rows to read must be ascending and distinct",
                self.shown(shard)
            )));
        }
        self.read(shard, row_group, Some(rows), columns).await
    }

    async fn read(
        &self,
        shard: usize,
        row_group: usize,
        rows: Option<&[usize]>,
        columns: Option<&[String]>,
    ) -> Result<RecordBatch> {
        let meta = self.arrow_metadata(shard).await?;
        let shown = self.shown(shard);
        let rg_count = meta.metadata().num_row_groups();
        if row_group >= rg_count {
            return Err(StoreError::corrupt(
                &shown,
                format!("row group {row_group} out of range: file has {rg_count}"),
            ));
        }
        let rg_rows = meta.metadata().row_group(row_group).num_rows().max(0) as usize;
        let selection = match rows {
            None => None,
            Some(rows) => {
                if let Some(&last) = rows.last().filter(|&&r| r >= rg_rows) {
                    return Err(StoreError::Usage(format!(
                        "{shown}: row {last} of row group {row_group} is out of range: it has \
                         {rg_rows} rows"
                    )));
                }
                Some(RowSelection::from_consecutive_ranges(
                    rows.iter().map(|&r| r..r + 1),
                    rg_rows,
                ))
            }
        };
        let arrow = meta.schema().clone();
        let file_meta = arrow.metadata().clone();
        let mask =
            match columns {
                None => ProjectionMask::all(),
                Some(cols) => {
                    let mut cols: Vec<&str> = cols.iter().map(String::as_str).collect();
                    // A row's tokens are checked against their checksum and its seq_len
                    // wherever either token column is read, which takes both, the checksum,
                    // seq_len and the sample id (named in the error).
                    if cols.iter().any(|c| *c == "input_ids" || *c == "loss_mask") {
                        let present = arrow.index_of(TOKEN_CHECKSUM_COLUMN).is_ok();
                        let extra = ["sample_id", "seq_len", "input_ids", "loss_mask"]
                            .into_iter()
                            .chain(present.then_some(TOKEN_CHECKSUM_COLUMN));
                        for c in extra {
                            if !cols.contains(&c) {
                                cols.push(c);
                            }
                        }
                    }
                    let mut idx = Vec::with_capacity(cols.len());
                    for c in cols {
                        idx.push(arrow.index_of(c).map_err(|_| {
                            StoreError::corrupt(&shown, format!("no column {c:?}"))
                        })?);
                    }
                    ProjectionMask::roots(meta.parquet_schema(), idx)
                }
            };
        let mut builder =
            ParquetRecordBatchStreamBuilder::new_with_metadata(self.object_reader(shard)?, meta)
                .with_row_groups(vec![row_group])
                .with_projection(mask)
                .with_batch_size(rg_rows.max(1));
        if let Some(sel) = selection {
            builder = builder.with_row_selection(sel);
        }
        let batches: Vec<RecordBatch> =
            guarded_async(async { builder.build()?.try_collect().await })
                .await
                .map_err(|e| StoreError::corrupt(&shown, decoder_failure(&e)))?
                .map_err(|e| StoreError::pq(&shown, e))?;
        let batch = match batches.len() {
            1 => Ok(batches.into_iter().next().expect("one batch")),
            0 => Err(StoreError::corrupt(
                &shown,
                format!("row group {row_group} yielded no rows"),
            )),
            _ => {
                let schema = batches[0].schema();
                arrow_select_concat(&schema, &batches, &shown)
            }
        }?;
        // What the footer (checked against the manifest) promised is what was decoded.
        let want = rows.map_or(rg_rows, <[usize]>::len);
        if batch.num_rows() != want {
            return Err(StoreError::corrupt(
                &shown,
                format!(
                    "row group {row_group} yielded {} rows, {want} expected",
                    batch.num_rows()
                ),
            ));
        }
        let batch = with_file_metadata(batch, &file_meta);
        // Errors name rows of the row group, also where the batch holds only some of them.
        let each_row = |check: &dyn Fn(usize) -> Result<()>| match rows {
            None => (0..batch.num_rows()).try_for_each(check),
            Some(rows) => rows
                .iter()
                .enumerate()
                .try_for_each(|(i, &r)| check(i).map_err(|e| e.in_row(r))),
        };
        if let Some(tokens) = TokenRows::from_batch(&batch, &shown, Some(row_group))? {
            each_row(&|i| tokens.check_row(i))?;
        }
        if let Some(lengths) = RowLengths::from_batch(&batch, &shown, Some(row_group))? {
            each_row(&|i| lengths.check_row(i).map(|_| ()))?;
        }
        Ok(batch)
    }

    /// (shard, row group) pairs that may hold `sample_id`, by the manifest's id ranges and the
    /// footers' (cached) `sample_id` statistics.
    async fn candidates(&self, sample_id: u64) -> Result<Vec<(usize, usize)>> {
        let mut out = Vec::new();
        for (i, s) in self.manifest.shards.iter().enumerate() {
            if sample_id < s.min_sample_id || sample_id > s.max_sample_id {
                continue;
            }
            let meta = self.shard_metadata(i).await?;
            for rg in 0..meta.num_row_groups() {
                let may_hold = match meta.row_group(rg).column(0).statistics() {
                    Some(Statistics::Int64(st)) => match (st.min_opt(), st.max_opt()) {
                        (Some(&lo), Some(&hi)) => {
                            (lo as u64) <= sample_id && sample_id <= (hi as u64)
                        }
                        _ => true,
                    },
                    _ => true,
                };
                if may_hold {
                    out.push((i, rg));
                }
            }
        }
        Ok(out)
    }

    /// Where `sample_id` sits in the pinned version (reading only `sample_id` columns), or
    /// `None` if the version does not hold it. Errors about a value seen apart from its file
    /// (SQL) use it to name the file and row group.
    pub async fn locate_sample(&self, sample_id: u64) -> Result<Option<SampleSite>> {
        let cols = ["sample_id".to_string()];
        for (i, rg) in self.candidates(sample_id).await? {
            let b = self.read_row_group(i, rg, Some(&cols)).await?;
            let ids = b.column(0).as_primitive::<UInt64Type>();
            if let Some(row) = ids.values().iter().position(|&x| x == sample_id) {
                return Ok(Some(SampleSite {
                    shard: i,
                    path: self.manifest.shards[i].path.clone(),
                    row_group: rg,
                    row,
                }));
            }
        }
        Ok(None)
    }

    /// Fetch one sample by id: the footer (cached) says which row group holds it, then one
    /// ranged read of that row group.
    pub async fn get_sample(&self, sample_id: u64) -> Result<Sample> {
        for (i, rg) in self.candidates(sample_id).await? {
            let batch = self.read_row_group(i, rg, None).await?;
            let ids = batch.column(0).as_primitive::<UInt64Type>();
            if let Some(row) = ids.values().iter().position(|&x| x == sample_id) {
                let one = batch.slice(row, 1);
                let mut v = decode_samples_from(self.schema(), &one, &self.shown(i), Some(rg))
                    .map_err(|e| e.in_row(row))?;
                return v
                    .pop()
                    .ok_or_else(|| StoreError::corrupt(self.shown(i), "empty row"));
            }
        }
        Err(StoreError::SampleNotFound {
            url: self.ds.url().to_string(),
            sample_id,
            version: self.manifest.version,
        })
    }

    /// Every sample id in the version, in shard order; reads only the `sample_id` columns.
    pub async fn sample_ids(&self) -> Result<Vec<u64>> {
        let mut out = Vec::with_capacity(self.manifest.num_samples() as usize);
        let cols = ["sample_id".to_string()];
        for (i, s) in self.manifest.shards.iter().enumerate() {
            for rg in 0..s.row_groups.len() {
                let b = self.read_row_group(i, rg, Some(&cols)).await?;
                out.extend_from_slice(b.column(0).as_primitive::<UInt64Type>().values());
            }
        }
        Ok(out)
    }

    /// Stream every row group of the version in order, optionally projected.
    pub fn scan(&self, columns: Option<Vec<String>>) -> BoxStream<'static, Result<RecordBatch>> {
        let me = self.clone();
        let units: Vec<(usize, usize)> = self
            .manifest
            .shards
            .iter()
            .enumerate()
            .flat_map(|(i, s)| (0..s.row_groups.len()).map(move |rg| (i, rg)))
            .collect();
        stream::iter(units)
            .then(move |(i, rg)| {
                let me = me.clone();
                let cols = columns.clone();
                async move { me.read_row_group(i, rg, cols.as_deref()).await }
            })
            .boxed()
    }
}

fn arrow_select_concat(
    schema: &arrow_schema::SchemaRef,
    batches: &[RecordBatch],
    shown: &str,
) -> Result<RecordBatch> {
    let mut cols = vec![];
    for c in 0..schema.fields().len() {
        let parts: Vec<&dyn arrow_array::Array> =
            batches.iter().map(|b| b.column(c).as_ref()).collect();
        cols.push(
            arrow_select::concat::concat(&parts).map_err(|source| StoreError::Arrow {
                context: shown.to_string(),
                source,
            })?,
        );
    }
    RecordBatch::try_new(schema.clone(), cols).map_err(|source| StoreError::Arrow {
        context: shown.to_string(),
        source,
    })
}
