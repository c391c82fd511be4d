//! `hslake verify`: exit 0 only when every shard is intact.
use anyhow::Result;
use hslake_store::Dataset;

/// Arguments of `hslake verify`.
#[derive(clap::Args)]
pub struct Args {
    /// Dataset URL.
    pub url: String,
    /// Version (default: newest).
    #[arg(long)]
    pub version: Option<u64>,
}

/// Run `hslake verify`.
pub async fn run(a: Args) -> Result<std::process::ExitCode> {
    let ds = Dataset::open(&a.url).await?;
    // As stored: a version naming a shard twice is reported, not refused.
    let m = ds.manifest_as_stored(a.version).await?;
    let pb = super::byte_progress(m.bytes());
    pb.set_message("verify");
    let report = hslake_store::verify(&ds, Some(m.version), |b| pb.inc(b)).await?;
    pb.finish_and_clear();
    for p in &report.problems {
        println!("{p}");
    }
    if !report.missing.is_empty() {
        eprintln!(
            "{} shard(s) missing: `hslake repair {} --drop-missing` commits a version without \
             them (their samples are lost; --dry-run lists them first)",
            report.missing.len(),
            ds.url()
        );
    }
    if report.is_clean() {
        tracing::info!(url = %ds.url(), version = report.version, shards = report.shards, samples = report.samples, "verify: clean");
        Ok(std::process::ExitCode::SUCCESS)
    } else {
        tracing::error!(url = %ds.url(), version = report.version, problems = report.problems.len(), "verify: problems found");
        Ok(std::process::ExitCode::FAILURE)
    }
}
