//! `hslake repair`: commit a version without the shards that are no longer in storage, or
//! without the repeated entries of a shard.
use anyhow::Result;
use hslake_store::{lost_samples, Dataset, RepairOptions};

/// Arguments of `hslake repair`.
#[derive(clap::Args)]
#[command(group = clap::ArgGroup::new("what").required(true).multiple(true))]
pub struct Args {
    /// Dataset URL.
    pub url: String,
    /// Drop the newest version's shards that are not in storage (their samples are lost), and
    /// its repeated entries of a shard
    #[arg(long, group = "what")]
    pub drop_missing: bool,
    /// Drop only the newest version's repeated entries of a shard, keeping each shard once (no
    /// sample is lost; no shard is looked for in storage)
    #[arg(long, group = "what")]
    pub drop_repeats: bool,
    /// Only list what would be dropped.
    #[arg(long)]
    pub dry_run: bool,
}

/// Run `hslake repair`.
pub async fn run(a: Args) -> Result<std::process::ExitCode> {
    let ds = Dataset::open(&a.url).await?;
    let r = hslake_store::repair(
        &ds,
        RepairOptions {
            drop_missing: a.drop_missing,
            dry_run: a.dry_run,
        },
    )
    .await?;
    let verb = if a.dry_run { "would drop" } else { "dropped" };
    for s in &r.dropped {
        println!("{verb} {}: {} lost", s.path, lost_samples(s));
    }
    for x in &r.repeated {
        println!(
            "{verb} {} repeated entries of {} (named {} times; kept once, no sample lost)",
            x.times - 1,
            x.path,
            x.times
        );
    }
    if r.dropped.is_empty() && r.repeated.is_empty() {
        let looked = match a.drop_missing {
            true => "no shard is missing or named twice",
            false => "no shard is named twice",
        };
        println!("version {}: {looked}; nothing to repair", r.checked);
        return Ok(std::process::ExitCode::SUCCESS);
    }
    if let Some(v) = r.version {
        let mut without = vec![];
        if !r.dropped.is_empty() {
            without.push(format!("the {} missing shard(s)", r.dropped.len()));
        }
        if !r.repeated.is_empty() {
            let extra: u64 = r.repeated.iter().map(|x| x.times - 1).sum();
            without.push(format!("the {extra} repeated entries"));
        }
        println!(
            "committed version {v}: version {} without {}",
            r.checked,
            without.join(" and ")
        );
    }
    Ok(std::process::ExitCode::SUCCESS)
}
