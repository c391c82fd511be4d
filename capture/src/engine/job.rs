//! Preparing a job before any batch runs: every input record checked, the dataset opened or
//! created with this model's schema and provenance, what an earlier run committed left out,
//! and the rest planned into batches. Nothing is created before the inputs have been checked.
use std::collections::{BTreeMap, HashSet};
use std::path::Path;

use hslake_schemas::{DatasetSchema, LAYER_CONVENTION};
use hslake_store::{Dataset, DatasetReader, Provenance};

use super::options::{CaptureJob, EngineOptions};
use super::rank::WarmUp;
use super::summary::CaptureSummary;
use crate::batch::plan_batches;
use crate::error::{CaptureError, Result};
use crate::input::{scan_inputs, InputLimits, InputSample, Inputs, KeptSamples};
use crate::models::ModelInfo;

/// A job whose inputs and dataset are checked, ready for the engine it was prepared for.
pub struct PreparedJob {
    pub(super) engine: EngineOptions,
    pub(super) job: CaptureJob,
    pub(super) dataset: Dataset,
    /// Samples still to capture.
    pub(super) todo: Vec<InputSample>,
    /// Indices into `todo`, one list per batch.
    pub(super) batches: Vec<Vec<usize>>,
    /// The summary's fields known before the run.
    pub(super) summary: CaptureSummary,
}

impl PreparedJob {
    /// Samples the job will capture.
    pub fn samples(&self) -> u64 {
        self.todo.len() as u64
    }

    /// Tokens the job will capture.
    pub fn tokens(&self) -> u64 {
        self.todo.iter().map(|s| s.input_ids.len() as u64).sum()
    }

    /// The padded shape `[rows, cols]` of the batch with the most slots (rows × cols), or
    /// `[0, 0]` for a job with nothing to do.
    pub(super) fn largest_batch(&self) -> (usize, usize) {
        self.batches
            .iter()
            .map(|b| {
                let cols = b
                    .iter()
                    .map(|&i| self.todo[i].input_ids.len())
                    .max()
                    .unwrap_or(0);
                (b.len(), cols)
            })
            .max_by_key(|&(rows, cols)| rows * cols)
            .unwrap_or((0, 0))
    }

    /// The padded tokens of the batch with the most.
    pub(crate) fn largest_batch_tokens(&self) -> usize {
        let (rows, cols) = self.largest_batch();
        rows * cols
    }

    /// Each batch's padded tokens (rows × longest), in batch order.
    pub(super) fn padded_tokens(&self) -> Vec<u64> {
        self.batches
            .iter()
            .map(|b| {
                let cols = b.iter().map(|&i| self.todo[i].input_ids.len()).max();
                (b.len() * cols.unwrap_or(0)) as u64
            })
            .collect()
    }

    /// A warm-up pass like this job's largest batch (at least one token).
    pub(super) fn warm_up(&self) -> WarmUp {
        let (rows, cols) = self.largest_batch();
        WarmUp {
            rows: rows.max(1),
            cols: cols.max(1),
            points: self.job.points.clone(),
        }
    }
}

/// The runtime the store's async calls run on: the caller's.
pub(super) fn runtime() -> Result<tokio::runtime::Handle> {
    tokio::runtime::Handle::try_current().map_err(|_| {
        CaptureError::Option(
            "the capture engine needs a tokio runtime: call it from a blocking thread of one \
             (e.g. tokio::task::spawn_blocking)"
                .into(),
        )
    })
}

impl CaptureJob {
    /// Checks the job against `model` run under `engine`: options, every input record, and
    /// the dataset (opened, or created with this model's schema). Blocks; needs a tokio
    /// runtime (call it from `spawn_blocking`).
    pub fn prepare(&self, model: &ModelInfo, engine: &EngineOptions) -> Result<PreparedJob> {
        let (inputs, dataset, committed) = self.checked(model, engine, true)?;
        if let Some(shard) = self.shard {
            tracing::info!(
                "input shard {shard}: {} of {} samples",
                inputs.kept.samples,
                inputs.records
            );
        }
        let todo: Vec<InputSample> = inputs
            .samples
            .into_iter()
            .filter(|s| !committed.contains(&s.sample_id))
            .collect();
        let skipped_committed = committed.len() as u64;
        if skipped_committed > 0 {
            tracing::info!(
                "resuming: {skipped_committed} samples already committed, {} to go",
                todo.len()
            );
        }
        let batches = plan_batches(&todo, self.max_tokens_per_batch);
        tracing::info!(
            "capturing {} samples in {} batches: {} {} on {:?} x{} ({})",
            todo.len(),
            batches.len(),
            model.architecture,
            engine.dtype.name(),
            engine.device,
            engine.tp,
            self.points
                .iter()
                .map(|p| p.column())
                .collect::<Vec<_>>()
                .join(", ")
        );
        Ok(PreparedJob {
            engine: engine.clone(),
            job: self.clone(),
            dataset,
            todo,
            batches,
            summary: CaptureSummary {
                dataset: self.output.clone(),
                skipped_committed,
                truncated: inputs.truncated,
                skipped_overlong: inputs.skipped_overlong,
                ..Default::default()
            },
        })
    }

    /// Checks the job as [`CaptureJob::prepare`] does (options, every input record, the
    /// dataset) but keeps none of its samples: the check holds one record at a time, and says
    /// what the samples would take. What a server runs on submission. Blocks; needs a tokio
    /// runtime.
    pub fn validate(&self, model: &ModelInfo, engine: &EngineOptions) -> Result<KeptSamples> {
        Ok(self.checked(model, engine, false)?.0.kept)
    }

    // The checks of `prepare` and `validate`: the inputs read (their samples kept if `keep`),
    // the dataset, and the ids it already holds.
    fn checked(
        &self,
        model: &ModelInfo,
        engine: &EngineOptions,
        keep: bool,
    ) -> Result<(Inputs, Dataset, HashSet<u64>)> {
        self.check()?;
        let io = runtime()?;
        let schema = DatasetSchema::new(
            model_name(&engine.model_dir),
            model.architecture,
            model.hidden_size,
            model.num_layers,
            model.vocab_size,
            engine.dtype,
            self.points.clone(),
        )?;
        let limits = InputLimits {
            shard: self.shard,
            max_memory: self.max_input_bytes,
            ..InputLimits::new(model.vocab_size, self.max_seq_len, self.overlong)
        };
        let mut samples = vec![];
        let mut sink = |s: InputSample, _| {
            if keep {
                samples.push(s);
            }
            Ok(())
        };
        let mut inputs = read_job_inputs(
            &self.input,
            limits,
            self.max_input_bytes,
            &io,
            keep,
            &mut sink,
        )?;
        inputs.samples = samples;
        let provenance = provenance(model, engine, self, inputs.ids_from_input, &schema);
        let dataset = io.block_on(Dataset::open_or_create(&self.output, schema, provenance))?;
        let committed = io.block_on(committed_ids(&dataset, self))?;
        Ok((inputs, dataset, committed))
    }
}

/// The input's object-store URL, if it is not a local path.
fn input_url(input: &Path) -> Option<&str> {
    input.to_str().filter(|s| s.contains("://"))
}

/// The size in bytes of a job's input: a local regular file's length, or the object's. Anything
/// else local (a directory, a FIFO, a device) is refused: it has no size to check, and reading
/// it might never end.
pub async fn input_size(input: &Path) -> Result<u64> {
    use object_store::ObjectStoreExt;
    if let Some(url) = input_url(input) {
        let loc = hslake_store::location::parse(url)?;
        let meta = loc
            .store
            .head(&loc.prefix)
            .await
            .map_err(|e| CaptureError::Input {
                path: input.to_path_buf(),
                location: "download".into(),
                message: e.to_string(),
            })?;
        return Ok(meta.size);
    }
    let meta = tokio::fs::metadata(input)
        .await
        .map_err(|source| CaptureError::Io {
            path: input.to_path_buf(),
            source,
        })?;
    if !meta.is_file() {
        return Err(CaptureError::Input {
            path: input.to_path_buf(),
            location: "file".into(),
            message: "not a regular file; expected a JSONL or Parquet file".into(),
        });
    }
    Ok(meta.len())
}

/// Reads the job's input: a local file, or an object-store URL (`s3://bucket/key.jsonl`),
/// which is streamed to a temporary file first (the readers need a file), handing each sample
/// to `sink` (without its lists unless `keep`). With `max_bytes`, a larger input is refused
/// before it is read. Errors name the input as given, not the temporary copy.
fn read_job_inputs(
    input: &Path,
    limits: InputLimits,
    max_bytes: Option<u64>,
    io: &tokio::runtime::Handle,
    keep: bool,
    sink: &mut dyn FnMut(InputSample, usize) -> Result<()>,
) -> Result<Inputs> {
    if let Some(limit) = max_bytes {
        let size = io.block_on(input_size(input))?;
        if size > limit {
            return Err(CaptureError::InputTooLarge {
                path: input.to_path_buf(),
                size,
                limit,
            });
        }
    }
    let Some(url) = input_url(input) else {
        return scan_inputs(input, limits, keep, sink);
    };
    let copy = io.block_on(download(url, max_bytes))?;
    scan_inputs(copy.path(), limits, keep, sink).map_err(|e| match e {
        CaptureError::Input {
            location, message, ..
        } => CaptureError::Input {
            path: input.to_path_buf(),
            location,
            message,
        },
        CaptureError::Io { source, .. } => CaptureError::Io {
            path: input.to_path_buf(),
            source,
        },
        CaptureError::SamplesTooLarge {
            samples,
            tokens,
            limit,
            ..
        } => CaptureError::SamplesTooLarge {
            path: input.to_path_buf(),
            samples,
            tokens,
            limit,
        },
        e => e,
    })
}

/// A local copy of the object at `url`, named with the object's extension (which says its
/// format), written as it arrives so that memory holds one chunk at a time; stopped once it
/// passes `max_bytes` (the object may have grown since its size was checked).
async fn download(url: &str, max_bytes: Option<u64>) -> Result<tempfile::NamedTempFile> {
    use futures::TryStreamExt;
    use object_store::ObjectStoreExt;
    let fail = |message: String| CaptureError::Input {
        path: url.into(),
        location: "download".into(),
        message,
    };
    let loc = hslake_store::location::parse(url)?;
    let mut chunks = loc
        .store
        .get(&loc.prefix)
        .await
        .map_err(|e| fail(e.to_string()))?
        .into_stream();
    let ext = Path::new(url)
        .extension()
        .map(|e| format!(".{}", e.to_string_lossy()))
        .unwrap_or_default();
    let mut file = tempfile::Builder::new()
        .prefix("hslake-input-")
        .suffix(&ext)
        .tempfile()
        .map_err(|e| fail(format!("cannot create a temporary copy: {e}")))?;
    let mut written = 0u64;
    while let Some(chunk) = chunks.try_next().await.map_err(|e| fail(e.to_string()))? {
        written += chunk.len() as u64;
        if let Some(limit) = max_bytes.filter(|&l| written > l) {
            return Err(CaptureError::InputTooLarge {
                path: url.into(),
                size: written,
                limit,
            });
        }
        std::io::Write::write_all(&mut file, &chunk)
            .map_err(|e| fail(format!("cannot write the temporary copy: {e}")))?;
    }
    Ok(file)
}

/// The sample ids of the job's part of the input (all of it without a shard) that the dataset
/// already holds; any is refused without `resume`. Other shards' samples are no concern of
/// this job: their processes commit into the same dataset at the same time.
async fn committed_ids(dataset: &Dataset, job: &CaptureJob) -> Result<HashSet<u64>> {
    let reader = DatasetReader::open(dataset, None).await?;
    if reader.manifest().num_samples() == 0 {
        return Ok(HashSet::new());
    }
    let mine: HashSet<u64> = reader
        .sample_ids()
        .await?
        .into_iter()
        .filter(|id| job.shard.is_none_or(|s| s.contains(*id)))
        .collect();
    if !mine.is_empty() && !job.resume {
        let of_shard = job
            .shard
            .map(|s| format!(" of shard {s}"))
            .unwrap_or_default();
        return Err(CaptureError::Option(format!(
            "{} already holds {} samples{of_shard}; pass --resume to continue it (committed samples are skipped)",
            job.output,
            mine.len()
        )));
    }
    Ok(mine)
}

/// What the manifest records of how the states were made.
fn provenance(
    model: &ModelInfo,
    engine: &EngineOptions,
    job: &CaptureJob,
    ids_from_input: bool,
    schema: &DatasetSchema,
) -> Provenance {
    let mut extra = BTreeMap::new();
    extra.insert(
        "model_dir".to_string(),
        serde_json::json!(engine.model_dir.display().to_string()),
    );
    extra.insert(
        "input".to_string(),
        serde_json::json!(job.input.display().to_string()),
    );
    extra.insert(
        "sample_id".to_string(),
        serde_json::json!(if ids_from_input {
            "the input's integer id"
        } else {
            "0-based record index of the input"
        }),
    );
    // The states were computed from these weights: dequantized ones differ from the bf16
    // originals, so a dataset says which it came from.
    extra.insert(
        "quantization".to_string(),
        serde_json::json!(model.quantization.as_deref().unwrap_or("none")),
    );
    if engine.tp > 1 {
        extra.insert(
            "tp_reduce".to_string(),
            serde_json::json!(engine.kernels.tp_reduce.name()),
        );
    }
    Provenance {
        model: schema.model.clone(),
        architecture: model.architecture.to_string(),
        dtype: engine.dtype.name().to_string(),
        tp_size: Some(engine.tp),
        layers: job.points.clone(),
        layer_convention: LAYER_CONVENTION.to_string(),
        software: format!(
            "hslake-capture {} (tch 0.24, libtorch 2.11)",
            env!("CARGO_PKG_VERSION")
        ),
        extra,
    }
}

/// The model's name for the manifest: the checkpoint directory's name.
fn model_name(dir: &Path) -> String {
    std::fs::canonicalize(dir)
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| dir.display().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> InputLimits {
        InputLimits::new(100, None, hslake_schemas::Overlong::Truncate)
    }

    const TWO_SAMPLES: &[u8] = b"{\"input_ids\": [1, 2, 3]}\n{\"input_ids\": [4, 5]}\n";

    // Every sample of the input, read as a run reads it.
    fn read_all(
        path: &Path,
        max: Option<u64>,
        io: &tokio::runtime::Handle,
    ) -> Result<Vec<InputSample>> {
        let mut samples = vec![];
        let mut sink = |s, _| {
            samples.push(s);
            Ok(())
        };
        read_job_inputs(path, limits(), max, io, true, &mut sink)?;
        Ok(samples)
    }

    #[test]
    fn an_input_over_the_limit_is_refused_before_it_is_read() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("in.jsonl");
        std::fs::write(&path, TWO_SAMPLES).unwrap();
        let size = TWO_SAMPLES.len() as u64;
        let read = |max| read_all(&path, max, rt.handle());
        assert_eq!(read(Some(size)).unwrap().len(), 2);
        match read(Some(size - 1)).unwrap_err() {
            CaptureError::InputTooLarge { size: s, limit, .. } => {
                assert_eq!((s, limit), (size, size - 1))
            }
            e => panic!("{e}"),
        }
        // A directory has no size to check: refused by name, not read.
        let e = read_all(dir.path(), Some(1 << 20), rt.handle()).unwrap_err();
        assert!(e.to_string().contains("not a regular file"), "{e}");
    }

    #[test]
    fn a_download_streams_and_stops_past_the_limit() {
        use object_store::ObjectStoreExt;
        let rt = tokio::runtime::Runtime::new().unwrap();
        let url = "memory://capture-download-limit/in.jsonl";
        let loc = hslake_store::location::parse(url).unwrap();
        let body: Vec<u8> = TWO_SAMPLES.repeat(1000);
        rt.block_on(loc.store.put(&loc.prefix, body.clone().into()))
            .unwrap();
        let copy = rt.block_on(download(url, Some(body.len() as u64))).unwrap();
        assert_eq!(std::fs::read(copy.path()).unwrap(), body);
        assert!(copy.path().to_string_lossy().ends_with(".jsonl"));
        // Checked while the bytes arrive, whatever a size check before found.
        match rt.block_on(download(url, Some(100))).unwrap_err() {
            CaptureError::InputTooLarge { size, limit, .. } => {
                assert!(size > 100 && limit == 100, "{size}")
            }
            e => panic!("{e}"),
        }
        let path = std::path::Path::new(url);
        let got = read_all(path, Some(body.len() as u64), rt.handle()).unwrap();
        assert_eq!(got.len(), 2000);
    }
}
