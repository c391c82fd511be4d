//! `hslake vacuum`: delete files no manifest names.
use std::time::Duration;

use anyhow::Result;
use hslake_schemas::units::DurationRange;
use hslake_store::Dataset;

/// `--grace`: none at all up to a year.
const GRACE: DurationRange = DurationRange::seconds("--grace", Duration::ZERO, super::YEAR);

/// Arguments of `hslake vacuum`.
#[derive(clap::Args)]
pub struct Args {
    /// Dataset URL.
    pub url: String,
    /// Leave unreferenced files younger than this alone (a writer may be about to commit them).
    #[arg(long, default_value = "1h", value_parser = GRACE.parser())]
    pub grace: Duration,
    /// Only list what would be deleted.
    #[arg(long)]
    pub dry_run: bool,
}

/// Run `hslake vacuum`.
pub async fn run(a: Args) -> Result<std::process::ExitCode> {
    let ds = Dataset::open(&a.url).await?;
    let r = hslake_store::vacuum(&ds, a.grace, a.dry_run).await?;
    for f in &r.deleted {
        println!(
            "{}{f}",
            if a.dry_run {
                "would delete "
            } else {
                "deleted "
            }
        );
    }
    tracing::info!(
        deleted = r.deleted.len(),
        bytes = %super::human_bytes(r.bytes),
        kept_within_grace = r.too_recent.len(),
        left_alone = r.left_alone.len(),
        live = r.live,
        dry_run = a.dry_run,
        "vacuum done"
    );
    Ok(std::process::ExitCode::SUCCESS)
}
