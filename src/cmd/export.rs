//! `hslake export`: one sample's arrays as `.npy` files, or a whole dataset version in an
//! EAGLE-3 trainer's own file layout (`--format speculators|specforge`), streamed.
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use hslake_loader::{Batch, Batching, HostTensor, Loader, LoaderConfig, Preset};
use hslake_schemas::DType;
use hslake_store::npy::write_npy;
use hslake_store::{Dataset, DatasetReader};

mod hf_dataset;
mod specforge;
mod speculators;
mod torch_save;

/// What `hslake export` writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// One sample (`--sample`) as `.npy` files.
    Npy,
    /// speculators 0.9: a `datasets` directory plus `hidden_states/hs_{i}.safetensors`.
    Speculators,
    /// SpecForge 0.2: one `torch.save` dict per sample under `rows_*/data_*.ckpt`.
    Specforge,
}

/// Arguments of `hslake export`.
#[derive(clap::Args)]
pub struct Args {
    /// Dataset URL.
    pub url: String,
    /// What to write.
    #[arg(long, value_enum, default_value = "npy")]
    pub format: Format,
    /// The sample id (`--format npy` only).
    #[arg(long)]
    pub sample: Option<u64>,
    /// Output directory (created; for the trainer formats it must be empty or absent).
    #[arg(long)]
    pub dir: PathBuf,
    /// Version (default: newest).
    #[arg(long)]
    pub version: Option<u64>,
    /// Samples per `rows_*` folder (`--format specforge`).
    #[arg(long, default_value_t = 5000)]
    pub rows_per_dir: usize,
    /// Threads decoding samples ahead of the writer.
    #[arg(long, default_value_t = 2)]
    pub decode_threads: usize,
    /// No progress bar (a log line every 10 s instead).
    #[arg(long)]
    pub no_progress: bool,
}

/// One sample as a trainer file needs it: tokens, mask and the preset's tensors.
pub struct TrainerSample<'a> {
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
pub trait TrainerSink {
    /// Write one sample's files.
    fn write(&mut self, s: &TrainerSample<'_>) -> Result<()>;
    /// Write what goes after the last sample (indexes); the export is complete after it.
    fn finish(self: Box<Self>) -> Result<()>;
}

/// Run `hslake export`.
pub async fn run(a: Args) -> Result<std::process::ExitCode> {
    match a.format {
        Format::Npy => {
            let Some(id) = a.sample else {
                bail!("--format npy exports one sample: give --sample ID");
            };
            export_npy(&a.url, id, &a.dir, a.version).await?;
        }
        Format::Speculators | Format::Specforge => {
            if a.sample.is_some() {
                bail!("--sample is for --format npy; the trainer formats export the whole version");
            }
            if a.rows_per_dir == 0 {
                bail!("--rows-per-dir must be at least 1");
            }
            export_trainer(&a).await?;
        }
    }
    Ok(std::process::ExitCode::SUCCESS)
}

fn empty_dir(dir: &Path) -> Result<()> {
    if dir.exists() {
        let mut entries = std::fs::read_dir(dir).with_context(|| format!("read {}", dir.display()))?;
        if entries.next().is_some() {
            bail!(
                "{} is not empty; the export writes a trainer's whole layout and needs an empty \
                 or absent directory",
                dir.display()
            );
        }
    }
    std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))
}

fn i64_row(t: &HostTensor) -> Vec<i64> {
    t.to_i64_vec()
}

fn field<'b>(b: &'b Batch, name: &str) -> Result<&'b HostTensor> {
    b.field(name)
        .with_context(|| format!("loader batch without {name} (a bug)"))
}

async fn export_trainer(a: &Args) -> Result<()> {
    let preset = match a.format {
        Format::Speculators => Preset::Speculators,
        _ => Preset::Specforge,
    };
    let config = LoaderConfig {
        batching: Batching::Samples(1),
        shuffle: false,
        preset: Some(preset),
        version: a.version,
        decode_threads: a.decode_threads.max(1),
        prefetch_batches: 8,
        ..Default::default()
    };
    let loader = Loader::open(&a.url, config)
        .await
        .with_context(|| format!("export {} as {}", a.url, preset))?;
    empty_dir(&a.dir)?;
    let schema = loader.schema().clone();
    let total = loader.samples_per_epoch();
    let mut sink: Box<dyn TrainerSink> = match preset {
        Preset::Speculators => Box::new(speculators::SpeculatorsSink::create(&a.dir)?),
        Preset::Specforge => Box::new(specforge::SpecforgeSink::new(&a.dir, a.rows_per_dir)),
    };
    tracing::info!(
        url = a.url,
        version = loader.version(),
        samples = total,
        aux = ?loader.aux_points().iter().map(|p| p.column()).collect::<Vec<_>>(),
        target = %loader.target_point(),
        dtype = %schema.dtype,
        "export to {} layout in {}",
        preset,
        a.dir.display()
    );
    if schema.dtype == DType::Fp8E4m3 {
        tracing::info!("fp8 states are written as bf16 (value × token scale)");
    }
    let pb = super::progress(total, "samples");
    if a.no_progress {
        pb.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    pb.set_message(format!("export {preset}"));
    let mut stream = loader.stream(&loader.initial_state())?;
    let started = std::time::Instant::now();
    let mut last_log = started;
    let (mut index, mut tokens) = (0usize, 0usize);
    while let Some(batch) = stream.next().await {
        let batch = batch?;
        let s = TrainerSample {
            index,
            sample_id: batch.sample_ids[0],
            input_ids: i64_row(field(&batch, "input_ids")?),
            loss_mask: i64_row(field(&batch, "loss_mask")?),
            aux: field(&batch, "aux_hidden_states")?,
            target: field(&batch, "target_hidden_states")?,
        };
        sink.write(&s)
            .with_context(|| format!("sample {} (export index {index})", s.sample_id))?;
        index += 1;
        tokens += batch.num_tokens();
        pb.inc(1);
        if a.no_progress && last_log.elapsed().as_secs() >= 10 {
            last_log = std::time::Instant::now();
            tracing::info!("exported {index}/{total} samples, {tokens} tokens");
        }
    }
    sink.finish()?;
    pb.finish_and_clear();
    tracing::info!(
        samples = index,
        tokens,
        seconds = format!("{:.1}", started.elapsed().as_secs_f64()),
        "exported {} to {}",
        preset,
        a.dir.display()
    );
    Ok(())
}

async fn export_npy(url: &str, id: u64, dir: &Path, version: Option<u64>) -> Result<()> {
    let r = DatasetReader::open(&Dataset::open(url).await?, version).await?;
    let s = r.get_sample(id).await?;
    std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    let n = s.seq_len();
    let ids: Vec<u8> = s.input_ids.iter().flat_map(|v| v.to_le_bytes()).collect();
    write_npy(&dir.join("input_ids.npy"), "<i4", &[n], &ids)?;
    write_npy(&dir.join("loss_mask.npy"), "|u1", &[n], &s.loss_mask)?;
    for (p, t) in r.schema().points.iter().zip(&s.tensors) {
        // bf16 has no numpy dtype: exported as its raw 16 bits.
        let descr = match t.dtype {
            DType::Bf16 => "<u2",
            DType::F16 => "<f2",
            DType::F32 => "<f4",
            DType::Fp8E4m3 => "|u1",
        };
        write_npy(
            &dir.join(format!("{}.npy", p.column())),
            descr,
            &t.shape,
            &t.data,
        )?;
        if let Some(sc) = &t.scales {
            let b: Vec<u8> = sc.iter().flat_map(|v| v.to_le_bytes()).collect();
            write_npy(
                &dir.join(format!("{}_scale.npy", p.column())),
                "<f4",
                &[n],
                &b,
            )?;
        }
    }
    tracing::info!(sample = id, dir = %dir.display(), "exported");
    Ok(())
}
