//! `hslake vacuum`: delete files no manifest names.
use std::time::Duration;

use anyhow::Result;
use hslake_schemas::units::DurationRange;
use hslake_store::{Dataset, VacuumOptions};

/// `--grace`: none at all up to a year.
const GRACE: DurationRange = DurationRange::seconds("--grace", Duration::ZERO, super::YEAR);

/// Arguments of `hslake vacuum`.
#[derive(clap::Args)]
pub struct Args {
    /// Dataset URL.
    pub url: String,
    /// Leave unreferenced files younger than this alone (a writer may be about to commit
    /// them); at least 1h unless --no-writers.
    #[arg(long, default_value = "1h", value_parser = GRACE.parser())]
    pub grace: Duration,
    /// No writer is running on this dataset: allows a --grace below 1h (a writer that runs
    /// after all has its commit refused; no commit can name a deleted file).
    #[arg(long)]
    pub no_writers: bool,
    /// Only list what would be deleted.
    #[arg(long)]
    pub dry_run: bool,
}

/// Run `hslake vacuum`.
pub async fn run(a: Args) -> Result<std::process::ExitCode> {
    let ds = Dataset::open(&a.url).await?;
    let opts = VacuumOptions {
        grace: a.grace,
        no_writers: a.no_writers,
        dry_run: a.dry_run,
    };
    let r = hslake_store::vacuum(&ds, opts).await?;
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
    if let (Some(v), Some(cutoff)) = (r.version, r.cutoff) {
        println!("committed vacuum version {v} (cutoff {cutoff}) before deleting");
    }
    tracing::info!(
        deleted = r.deleted.len(),
        bytes = %super::human_bytes(r.bytes),
        kept_within_grace = r.too_recent.len(),
        left_alone = r.left_alone.len(),
        live = r.live,
        version = ?r.version,
        restarts = r.restarts,
        dry_run = a.dry_run,
        "vacuum done"
    );
    Ok(std::process::ExitCode::SUCCESS)
}
