//! `hslake export`: one sample's arrays as `.npy` files, for inspection with numpy.
use std::path::PathBuf;

use anyhow::{Context, Result};
use hslake_schemas::DType;
use hslake_store::{Dataset, DatasetReader};

use hslake_store::tools::npy::write_npy;

/// Arguments of `hslake export`.
#[derive(clap::Args)]
pub struct Args {
    /// Dataset URL.
    pub url: String,
    /// The sample id.
    #[arg(long)]
    pub sample: u64,
    /// Output directory (created).
    #[arg(long)]
    pub dir: PathBuf,
    /// Version (default: newest).
    #[arg(long)]
    pub version: Option<u64>,
}

/// Run `hslake export`.
pub async fn run(a: Args) -> Result<std::process::ExitCode> {
    let r = DatasetReader::open(&Dataset::open(&a.url).await?, a.version).await?;
    let s = r.get_sample(a.sample).await?;
    std::fs::create_dir_all(&a.dir).with_context(|| format!("create {}", a.dir.display()))?;
    let n = s.seq_len();
    let ids: Vec<u8> = s.input_ids.iter().flat_map(|v| v.to_le_bytes()).collect();
    write_npy(&a.dir.join("input_ids.npy"), "<i4", &[n], &ids)?;
    write_npy(&a.dir.join("loss_mask.npy"), "|u1", &[n], &s.loss_mask)?;
    for (p, t) in r.schema().points.iter().zip(&s.tensors) {
        // bf16 has no numpy dtype: exported as its raw 16 bits.
        let descr = match t.dtype {
            DType::Bf16 => "<u2",
            DType::F16 => "<f2",
            DType::F32 => "<f4",
            DType::Fp8E4m3 => "|u1",
        };
        write_npy(
            &a.dir.join(format!("{}.npy", p.column())),
            descr,
            &t.shape,
            &t.data,
        )?;
        if let Some(sc) = &t.scales {
            let b: Vec<u8> = sc.iter().flat_map(|v| v.to_le_bytes()).collect();
            write_npy(
                &a.dir.join(format!("{}_scale.npy", p.column())),
                "<f4",
                &[n],
                &b,
            )?;
        }
    }
    tracing::info!(sample = a.sample, dir = %a.dir.display(), "exported");
    Ok(std::process::ExitCode::SUCCESS)
}
