//! `hslake export`: one sample's arrays as `.npy` files, or a whole dataset version in an
//! EAGLE-3 trainer's own file layout (`--format speculators|specforge`), streamed.
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use hslake_loader::export::{export_trainer_files, ExportOptions};
use hslake_loader::Preset;
use hslake_schemas::DType;
use hslake_store::tools::files;
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

/// One sample's arrays, each a new `.npy` file in `dir`. Every name is checked first and none
/// may exist (a symbolic link included: exports never write through links), so a refusal
/// leaves the directory as it was; files of a write that fails midway are removed.
async fn export_npy(url: &str, id: u64, dir: &Path, version: Option<u64>) -> Result<()> {
    let r = DatasetReader::open(&Dataset::open(url).await?, version).await?;
    let s = r.get_sample(id).await?;
    let n = s.seq_len();
    // (file name, numpy dtype, shape, little-endian bytes)
    let mut arrays: Vec<(String, &str, Vec<usize>, Vec<u8>)> = vec![
        (
            "input_ids.npy".into(),
            "<i4",
            vec![n],
            s.input_ids.iter().flat_map(|v| v.to_le_bytes()).collect(),
        ),
        ("loss_mask.npy".into(), "|u1", vec![n], s.loss_mask.clone()),
    ];
    for (p, t) in r.schema().points.iter().zip(&s.tensors) {
        // bf16 has no numpy dtype: exported as its raw 16 bits.
        let descr = match t.dtype {
            DType::Bf16 => "<u2",
            DType::F16 => "<f2",
            DType::F32 => "<f4",
            DType::Fp8E4m3 => "|u1",
        };
        arrays.push((
            format!("{}.npy", p.column()),
            descr,
            t.shape.clone(),
            t.data.clone(),
        ));
        if let Some(sc) = &t.scales {
            let b: Vec<u8> = sc.iter().flat_map(|v| v.to_le_bytes()).collect();
            arrays.push((format!("{}.npy", p.scale_column()), "<f4", vec![n], b));
        }
    }
    std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    let taken: Vec<String> = arrays
        .iter()
        .map(|a| dir.join(&a.0))
        .filter(|p| files::exists(p))
        .map(|p| p.display().to_string())
        .collect();
    if !taken.is_empty() {
        bail!(
            "{} already exist(s): export never overwrites a file or writes through a link; \
             choose an empty directory",
            taken.join(", ")
        );
    }
    let mut written: Vec<PathBuf> = vec![];
    for (name, descr, shape, data) in &arrays {
        let path = dir.join(name);
        if let Err(e) = write_npy(&path, descr, shape, data) {
            for w in &written {
                let _ = std::fs::remove_file(w);
            }
            return Err(e.into());
        }
        written.push(path);
    }
    tracing::info!(sample = id, dir = %dir.display(), "exported");
    Ok(())
}
