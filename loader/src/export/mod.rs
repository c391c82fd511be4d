//! A dataset version written in an EAGLE-3 trainer's own file layout, streamed: the loader
//! reads samples in storage order (no shuffle, one per batch) with the preset's capture
//! points, and a sink writes each sample's files under a temporary name, renamed when
//! complete. Used by `hslake export --format` and the Python module's `hslake.export`.
use std::path::{Path, PathBuf};

use hslake_store::tools::files;

use crate::{Batch, HostTensor, Loader, LoaderConfig, LoaderError, Preset};

mod hf_dataset;
mod specforge;
mod speculators;
mod torch_save;

/// How to export.
#[derive(Debug, Clone)]
pub struct ExportOptions {
    /// Dataset version (`None`: the latest).
    pub version: Option<u64>,
    /// Samples per `rows_*` folder (SpecForge layout).
    pub rows_per_dir: usize,
    /// Threads decoding samples ahead of the writer.
    pub decode_threads: usize,
}

impl Default for ExportOptions {
    fn default() -> Self {
        ExportOptions {
            version: None,
            rows_per_dir: 5000,
            decode_threads: 2,
        }
    }
}

/// What an export wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportSummary {
    /// The version exported.
    pub version: u64,
    /// Samples written.
    pub samples: u64,
    /// Tokens written.
    pub tokens: u64,
}

/// One sample as a trainer file needs it: tokens, mask and the preset's tensors.
pub(crate) struct TrainerSample<'a> {
    /// Position in the export, from 0.
    pub index: usize,
    /// The hslake sample id.
    pub sample_id: u64,
    /// Token ids.
    pub input_ids: Vec<i64>,
    /// Loss mask (0/1).
    pub loss_mask: Vec<i64>,
    /// Auxiliary states concatenated per token, `[T, k·H]`.
    pub aux: &'a HostTensor,
    /// Target states `[T, H]`.
    pub target: &'a HostTensor,
}

/// A trainer's file layout, fed one sample at a time.
pub(crate) trait TrainerSink {
    /// Write one sample's files.
    fn write(&mut self, s: &TrainerSample<'_>) -> Result<(), LoaderError>;
    /// Write what goes after the last sample (indexes); the export is complete after it.
    fn finish(self: Box<Self>) -> Result<(), LoaderError>;
}

/// An I/O failure on an export file, naming it.
pub(crate) fn io_err(path: &Path, e: impl std::fmt::Display) -> LoaderError {
    LoaderError::Export {
        path: path.display().to_string(),
        message: e.to_string(),
    }
}

/// An I/O failure creating an export file or folder, naming it; a name that exists already (a
/// link planted in the output directory included) is refused as such.
pub(crate) fn create_err(path: &Path, e: std::io::Error) -> LoaderError {
    match e.kind() {
        std::io::ErrorKind::AlreadyExists => io_err(
            path,
            "already exists; an export never overwrites a file or writes through a link \
             (export into an empty directory)",
        ),
        _ => io_err(path, e),
    }
}

/// Create the new file `path` (refused where anything is at that name, links never followed).
pub(crate) fn create_file(path: &Path) -> Result<std::fs::File, LoaderError> {
    files::create_new(path).map_err(|e| create_err(path, e))
}

/// Create the new folder `dir` (refused where anything is at that name).
pub(crate) fn create_dir(dir: &Path) -> Result<(), LoaderError> {
    std::fs::create_dir(dir).map_err(|e| create_err(dir, e))
}

/// Give the finished temporary file of `path` its name (refused where anything is there).
pub(crate) fn publish(path: &Path) -> Result<(), LoaderError> {
    files::publish(&tmp_name(path), path).map_err(|e| create_err(path, e))
}

/// Write `bytes` under a new temporary name, then give it its name: neither name may exist.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), LoaderError> {
    let t = tmp_name(path);
    let mut f = create_file(&t)?;
    std::io::Write::write_all(&mut f, bytes).map_err(|e| io_err(&t, e))?;
    publish(path)
}

/// `path` + `.tmp`.
pub(crate) fn tmp_name(path: &Path) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(".tmp");
    PathBuf::from(s)
}

fn empty_dir(dir: &Path) -> Result<(), LoaderError> {
    if dir.exists() {
        let mut entries = std::fs::read_dir(dir).map_err(|e| io_err(dir, e))?;
        if entries.next().is_some() {
            return Err(io_err(
                dir,
                "the directory is not empty; an export writes a trainer's whole layout and \
                 needs an empty or absent directory",
            ));
        }
    }
    std::fs::create_dir_all(dir).map_err(|e| io_err(dir, e))
}

fn field<'b>(b: &'b Batch, name: &str) -> Result<&'b HostTensor, LoaderError> {
    b.field(name)
        .ok_or_else(|| LoaderError::Pipeline(format!("a batch without {name}")))
}

/// Export `url` into `dir` (created; must be empty) in `preset`'s trainer layout:
/// speculators: a `datasets` directory plus `hidden_states/hs_{i}.safetensors`;
/// SpecForge: `rows_*/data_{sample_id}.ckpt` (`torch.save` dicts). `progress(done, total)`
/// is called after every sample. Must run inside a tokio runtime.
pub async fn export_trainer_files(
    url: &str,
    preset: Preset,
    dir: &Path,
    opts: &ExportOptions,
    mut progress: impl FnMut(u64, u64),
) -> Result<ExportSummary, LoaderError> {
    if opts.rows_per_dir == 0 {
        return Err(LoaderError::Config(
            "rows_per_dir must be at least 1".into(),
        ));
    }
    let config = LoaderConfig {
        batch_size: Some(1),
        shuffle: false,
        preset: Some(preset),
        version: opts.version,
        decode_threads: opts.decode_threads.max(1),
        prefetch_batches: 8,
        ..Default::default()
    };
    let loader = Loader::open(url, config).await?;
    empty_dir(dir)?;
    let total = loader.samples_per_epoch();
    let mut sink: Box<dyn TrainerSink> = match preset {
        Preset::Speculators => Box::new(speculators::SpeculatorsSink::create(dir)?),
        Preset::Specforge => Box::new(specforge::SpecforgeSink::new(dir, opts.rows_per_dir)),
    };
    tracing::info!(
        "export {url} version {} ({total} samples) to the {preset} layout in {}: aux [{}], target {}",
        loader.version(),
        dir.display(),
        loader
            .aux_points()
            .iter()
            .map(|p| p.column())
            .collect::<Vec<_>>()
            .join(", "),
        loader.target_point()
    );
    let mut stream = loader.stream(&loader.initial_state())?;
    let (mut index, mut tokens) = (0usize, 0u64);
    while let Some(batch) = stream.next().await {
        let batch = batch?;
        let s = TrainerSample {
            index,
            sample_id: batch.sample_ids[0],
            input_ids: field(&batch, "input_ids")?.to_i64_vec(),
            loss_mask: field(&batch, "loss_mask")?.to_i64_vec(),
            aux: field(&batch, "aux_hidden_states")?,
            target: field(&batch, "target_hidden_states")?,
        };
        sink.write(&s)?;
        index += 1;
        tokens += batch.num_tokens() as u64;
        progress(index as u64, total);
    }
    sink.finish()?;
    Ok(ExportSummary {
        version: loader.version(),
        samples: index as u64,
        tokens,
    })
}

#[cfg(test)]
mod tests {
    use hslake_schemas::{CapturePoint, DType, DatasetSchema, Sample, TensorData};
    use hslake_store::{Dataset, DatasetWriter, Provenance, WriterOptions};

    use super::*;

    const H: usize = 4;

    /// An 8-layer model's dataset holding `points`; token t of point p has the value p·10 + t.
    async fn dataset(url: &str, points: Vec<CapturePoint>, samples: u64) {
        let np = points.len();
        let schema =
            DatasetSchema::new("m", "LlamaForCausalLM", H, 8, 100, DType::F32, points).unwrap();
        let ds = Dataset::create(url, schema, Provenance::default())
            .await
            .unwrap();
        let mut w = DatasetWriter::new(&ds, WriterOptions::default())
            .await
            .unwrap();
        for id in 0..samples {
            let n = 3 + id as usize;
            let tensors = (0..np)
                .map(|p| {
                    let v: Vec<f32> = (0..n * H).map(|i| (p * 10 + i / H) as f32).collect();
                    TensorData::from_f32(&v, vec![n, H])
                })
                .collect();
            let s = Sample {
                sample_id: 40 + id,
                input_ids: (0..n as i32).collect(),
                loss_mask: vec![1; n],
                tensors,
            };
            w.append(&s).await.unwrap();
        }
        w.commit().await.unwrap();
    }

    fn both_presets() -> Vec<CapturePoint> {
        let mut p: Vec<CapturePoint> = [1, 3, 4, 7].map(CapturePoint::LayerOutput).to_vec();
        p.push(CapturePoint::FinalNorm);
        p
    }

    #[tokio::test]
    async fn speculators_layout_stacks_three_aux_layers_and_the_pre_norm_target() {
        dataset("memory://export-spec", both_presets(), 3).await;
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("spec");
        let s = export_trainer_files(
            "memory://export-spec",
            Preset::Speculators,
            &out,
            &ExportOptions::default(),
            |_, _| {},
        )
        .await
        .unwrap();
        assert_eq!((s.samples, s.tokens), (3, 3 + 4 + 5));
        for f in [
            "data-00000-of-00001.arrow",
            "dataset_info.json",
            "state.json",
        ] {
            assert!(out.join(f).exists(), "{f}");
        }
        let bytes = std::fs::read(out.join("hidden_states/hs_2.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let hs = st.tensor("hidden_states").unwrap();
        assert_eq!(hs.shape(), &[5, 4, H]);
        // Token 1: layers 1, 3, 4 (points 0..2) then layer_7 (point 3), each row of value p·10 + 1.
        let row: Vec<f32> = hs.data()[4 * H * 4..8 * H * 4]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let want: Vec<f32> = [1.0, 11.0, 21.0, 31.0]
            .iter()
            .flat_map(|&v| [v; H])
            .collect();
        assert_eq!(row, want);
        assert_eq!(st.tensor("token_ids").unwrap().shape(), &[5]);
        assert!(!out.read_dir().unwrap().any(|e| e
            .unwrap()
            .file_name()
            .to_string_lossy()
            .ends_with(".tmp")));
    }

    #[tokio::test]
    async fn specforge_layout_names_files_by_sample_id_in_row_folders() {
        dataset("memory://export-sf", both_presets(), 3).await;
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("sf");
        let opts = ExportOptions {
            rows_per_dir: 2,
            ..Default::default()
        };
        export_trainer_files(
            "memory://export-sf",
            Preset::Specforge,
            &out,
            &opts,
            |_, _| {},
        )
        .await
        .unwrap();
        for f in [
            "rows_0-2/data_40.ckpt",
            "rows_0-2/data_41.ckpt",
            "rows_2-4/data_42.ckpt",
        ] {
            let b = std::fs::read(out.join(f)).unwrap();
            assert_eq!(&b[..4], b"PK\x03\x04", "{f}");
        }
    }

    #[tokio::test]
    async fn refuses_a_dataset_without_the_pre_norm_last_layer_and_writes_nothing() {
        let mut p: Vec<CapturePoint> = [1, 3, 4].map(CapturePoint::LayerOutput).to_vec();
        p.push(CapturePoint::FinalNorm);
        dataset("memory://export-missing", p, 1).await;
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("never");
        let err = export_trainer_files(
            "memory://export-missing",
            Preset::Speculators,
            &out,
            &ExportOptions::default(),
            |_, _| {},
        )
        .await
        .unwrap_err()
        .to_string();
        assert!(err.contains("missing layer_7"), "{err}");
        assert!(!out.exists());
    }

    #[tokio::test]
    async fn refuses_a_directory_that_is_not_empty() {
        dataset("memory://export-full", both_presets(), 1).await;
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("x"), b"x").unwrap();
        let err = export_trainer_files(
            "memory://export-full",
            Preset::Specforge,
            dir.path(),
            &ExportOptions::default(),
            |_, _| {},
        )
        .await
        .unwrap_err()
        .to_string();
        assert!(err.contains("not empty"), "{err}");
    }

    #[test]
    fn never_writes_through_a_link_planted_at_a_file_or_folder_name() {
        let dir = tempfile::tempdir().unwrap();
        let outside = dir.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        std::fs::write(outside.join("victim"), b"precious").unwrap();
        let out = dir.path().join("out");
        std::fs::create_dir(&out).unwrap();
        let link = |name: &str, to: &Path| std::os::unix::fs::symlink(to, out.join(name)).unwrap();
        // At the final name, at the temporary name, and as a row folder.
        link("hs_0.safetensors", &outside.join("victim"));
        link("hs_1.safetensors.tmp", &outside.join("victim"));
        link("rows_0-2", &outside);
        for name in ["hs_0.safetensors", "hs_1.safetensors"] {
            let err = write_atomic(&out.join(name), b"new")
                .unwrap_err()
                .to_string();
            assert!(
                err.contains(name) && err.contains("already exists"),
                "{err}"
            );
        }
        let err = create_dir(&out.join("rows_0-2")).unwrap_err().to_string();
        assert!(err.contains("rows_0-2: already exists"), "{err}");
        assert_eq!(std::fs::read(outside.join("victim")).unwrap(), b"precious");
        assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 1);
        // The refused write left no temporary file of its own behind.
        assert!(!out.join("hs_0.safetensors.tmp").exists());
    }
}
