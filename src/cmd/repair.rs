//! `hslake repair`: commit a version without the shards that are no longer in storage.
use anyhow::Result;
use hslake_store::{lost_samples, Dataset};

/// Arguments of `hslake repair`.
#[derive(clap::Args)]
pub struct Args {
    /// Dataset URL.
    pub url: String,
    /// Drop the newest version's shards that are not in storage (their samples are lost).
    #[arg(long, required = true)]
    pub drop_missing: bool,
    /// Only list what would be dropped.
    #[arg(long)]
    pub dry_run: bool,
}

/// Run `hslake repair`.
pub async fn run(a: Args) -> Result<std::process::ExitCode> {
    let ds = Dataset::open(&a.url).await?;
    let r = hslake_store::drop_missing(&ds, a.dry_run).await?;
    if r.dropped.is_empty() {
        println!(
            "no shard of version {} is missing; nothing to repair",
            r.checked
        );
        return Ok(std::process::ExitCode::SUCCESS);
    }
    let verb = if a.dry_run { "would drop" } else { "dropped" };
    for s in &r.dropped {
        println!("{verb} {}: {} lost", s.path, lost_samples(s));
    }
    if let Some(v) = r.version {
        println!(
            "committed version {v}: version {} without the {} missing shard(s)",
            r.checked,
            r.dropped.len()
        );
    }
    Ok(std::process::ExitCode::SUCCESS)
}
