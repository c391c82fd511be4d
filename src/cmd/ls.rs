//! `hslake ls`: versions, shards or samples of a dataset.
use anyhow::Result;
use arrow_array::cast::AsArray;
use arrow_array::types::{Float32Type, UInt32Type, UInt64Type};
use futures::TryStreamExt;
use hslake_schemas::{stat_column, StatKind};
use hslake_store::{Dataset, DatasetReader};

/// What to list.
#[derive(clap::ValueEnum, Clone, Copy, Default)]
pub enum What {
    /// Committed versions.
    Versions,
    /// Shards of a version.
    #[default]
    Shards,
    /// Samples of a version (reads no tensor bytes).
    Samples,
}

/// Arguments of `hslake ls`.
#[derive(clap::Args)]
pub struct Args {
    /// Dataset URL.
    pub url: String,
    /// What to list.
    #[arg(value_enum, default_value_t = What::Shards)]
    pub what: What,
    /// Version (default: newest).
    #[arg(long)]
    pub version: Option<u64>,
    /// At most this many lines.
    #[arg(long)]
    pub limit: Option<usize>,
}

/// What set a version apart: a vacuum's version, or one that dropped shards of its parent
/// (`hslake repair`); `-` for an ordinary commit.
fn note(m: &hslake_store::Manifest, previous: Option<&hslake_store::Manifest>) -> String {
    if let Some(v) = m.vacuum.filter(|_| m.is_vacuum()) {
        return format!("vacuum (cutoff {})", v.cutoff);
    }
    if !m.repeated.is_empty() {
        return format!(
            "names {} shard(s) more than once (readers refuse it)",
            m.repeated.len()
        );
    }
    let dropped = previous
        .filter(|p| m.parent == Some(p.version))
        .map_or(0, |p| {
            let kept: std::collections::HashSet<&str> =
                m.shards.iter().map(|t| t.path.as_str()).collect();
            p.shards
                .iter()
                .filter(|s| !kept.contains(s.path.as_str()))
                .count()
        });
    if dropped > 0 {
        format!(
            "dropped {dropped} shard(s) of version {}",
            m.parent.unwrap_or_default()
        )
    } else {
        "-".into()
    }
}

/// Run `hslake ls`.
pub async fn run(a: Args) -> Result<std::process::ExitCode> {
    let ds = Dataset::open(&a.url).await?;
    let limit = a.limit.unwrap_or(usize::MAX);
    match a.what {
        What::Versions => {
            println!("version\tcommitted_at\tshards\tsamples\tbytes\tnote");
            let mut parent: Option<hslake_store::Manifest> = None;
            for v in ds.versions().await?.into_iter().take(limit) {
                // The history as stored: a version that named a shard twice (read with the
                // shard once) is listed like any other, `repaired` after it.
                let m = ds.manifest_as_stored(Some(v)).await?;
                println!(
                    "{}\t{}\t{}\t{}\t{}\t{}",
                    v,
                    m.committed_at,
                    m.shards.len(),
                    m.num_samples(),
                    m.bytes(),
                    note(&m, parent.as_ref())
                );
                parent = Some(m);
            }
        }
        What::Shards => {
            let m = ds.manifest(a.version).await?;
            println!("path\tbytes\trows\ttokens\tsample_ids\trow_groups\tcrc32c");
            for s in m.shards.iter().take(limit) {
                println!(
                    "{}\t{}\t{}\t{}\t{}..={}\t{}\t{:08x}",
                    s.path,
                    s.bytes,
                    s.rows,
                    s.tokens,
                    s.min_sample_id,
                    s.max_sample_id,
                    s.row_groups.len(),
                    s.crc32c
                );
            }
        }
        What::Samples => {
            let r = DatasetReader::open(&ds, a.version).await?;
            let first = r.schema().points[0];
            let norm = stat_column(first, StatKind::Norm);
            let cols = vec![
                "sample_id".to_string(),
                "seq_len".into(),
                "num_loss_tokens".into(),
                norm.clone(),
            ];
            println!("sample_id\tseq_len\tloss_tokens\t{norm}");
            let mut n = 0usize;
            let mut scan = r.scan(Some(cols));
            'outer: while let Some(b) = scan.try_next().await? {
                let ids = b.column(0).as_primitive::<UInt64Type>();
                let len = b.column(1).as_primitive::<UInt32Type>();
                let loss = b.column(2).as_primitive::<UInt32Type>();
                let nm = b.column(3).as_primitive::<Float32Type>();
                for i in 0..b.num_rows() {
                    if n >= limit {
                        break 'outer;
                    }
                    println!(
                        "{}\t{}\t{}\t{:.4}",
                        ids.value(i),
                        len.value(i),
                        loss.value(i),
                        nm.value(i)
                    );
                    n += 1;
                }
            }
        }
    }
    Ok(std::process::ExitCode::SUCCESS)
}
