//! `hslake cp`: copy a dataset with its history to another store.
use anyhow::Result;
use hslake_store::Dataset;

/// Arguments of `hslake cp`.
#[derive(clap::Args)]
pub struct Args {
    /// Source dataset URL.
    pub src: String,
    /// Destination URL (must not hold a dataset).
    pub dst: String,
}

/// Run `hslake cp`.
pub async fn run(a: Args) -> Result<std::process::ExitCode> {
    let src = Dataset::open(&a.src).await?;
    let mut total = 0;
    for v in src.versions().await? {
        total = total.max(src.manifest_as_stored(Some(v)).await?.bytes());
    }
    let pb = super::byte_progress(total);
    pb.set_message("copy");
    let r = hslake_store::copy_dataset(&src, &a.dst, |b| pb.inc(b)).await?;
    pb.finish_and_clear();
    tracing::info!(src = %src.url(), dst = %a.dst, versions = r.versions, shards = r.shards, bytes = %super::human_bytes(r.bytes), "copied, checksums verified");
    Ok(std::process::ExitCode::SUCCESS)
}
