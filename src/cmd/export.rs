//! `hslake export`: one sample's arrays as `.npy` files, or a whole dataset version in an
//! EAGLE-3 trainer's own file layout (`--format speculators|specforge`), streamed.
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use hslake_loader::export::{export_trainer_files, ExportOptions};
use hslake_loader::Preset;
use hslake_schemas::DType;
use hslake_store::tools::npy::write_npy;
use hslake_store::{Dataset, DatasetReader};

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
            export_trainer(&a).await?;
        }
    }
    Ok(std::process::ExitCode::SUCCESS)
}

async fn export_trainer(a: &Args) -> Result<()> {
    let preset = match a.format {
        Format::Speculators => Preset::Speculators,
        _ => Preset::Specforge,
    };
    let opts = ExportOptions {
        version: a.version,
        rows_per_dir: a.rows_per_dir,
        decode_threads: a.decode_threads,
    };
    let pb = super::progress(0, "samples");
    if a.no_progress {
        pb.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    pb.set_message(format!("export {preset}"));
    let started = std::time::Instant::now();
    let mut last_log = started;
    let summary = export_trainer_files(&a.url, preset, &a.dir, &opts, |done, total| {
        pb.set_length(total);
        pb.set_position(done);
        if a.no_progress && last_log.elapsed().as_secs() >= 10 {
            last_log = std::time::Instant::now();
            tracing::info!("exported {done}/{total} samples");
        }
    })
    .await
    .with_context(|| format!("export {} as {preset}", a.url))?;
    pb.finish_and_clear();
    tracing::info!(
        version = summary.version,
        samples = summary.samples,
        tokens = summary.tokens,
        seconds = started.elapsed().as_secs_f64(),
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
                &dir.join(format!("{}.npy", p.scale_column())),
                "<f4",
                &[n],
                &b,
            )?;
        }
    }
    tracing::info!(sample = id, dir = %dir.display(), "exported");
    Ok(())
}
