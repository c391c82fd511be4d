//! `hslake info`: what a dataset holds.
use anyhow::{Context, Result};
use arrow::compute::cast;
use arrow::datatypes::DataType;
use arrow_array::cast::AsArray;
use arrow_array::types::Float64Type;
use hslake_query::QuerySession;
use hslake_schemas::{stat_column, StatKind};
use hslake_store::{Dataset, Manifest};
use serde_json::json;

/// Arguments of `hslake info`.
#[derive(clap::Args)]
pub struct Args {
    /// Dataset URL.
    pub url: String,
    /// Version to describe (default: newest).
    #[arg(long)]
    pub version: Option<u64>,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
    /// Also count the samples and tokens of each part of a capture run as `--shard I/N` with
    /// this N (progress per shard while N processes fill the dataset).
    #[arg(long)]
    pub shards: Option<u64>,
}

/// The facts `info` prints, as JSON.
pub fn describe(url: &str, versions: &[u64], m: &Manifest) -> serde_json::Value {
    let s = &m.schema;
    json!({
        "url": url,
        "version": m.version,
        "versions": versions,
        "committed_at": m.committed_at,
        "format_version": m.format_version,
        "schema": {
            "model": s.model,
            "architecture": s.architecture,
            "hidden_size": s.hidden_size,
            "num_layers": s.num_layers,
            "vocab_size": s.vocab_size,
            "dtype": s.dtype.name(),
            "points": s.points.iter().map(|p| p.column()).collect::<Vec<_>>(),
            "layer_convention": s.layer_convention,
            "tokenizer_fingerprint": s.tokenizer_fingerprint,
        },
        "provenance": m.provenance,
        "samples": m.num_samples(),
        "tokens": m.num_tokens(),
        "shards": m.shards.len(),
        "bytes": m.bytes(),
        "raw_tensor_bytes": m.raw_bytes(),
        "compression_ratio": if m.bytes() > 0 { m.raw_bytes() as f64 / m.bytes() as f64 } else { 0.0 },
        "properties": m.properties,
        "vacuum": m.vacuum,
        "is_vacuum": m.is_vacuum(),
    })
}

/// Per capture point: mean token norm, max |x|, NaN and Inf counts over the version, computed
/// with SQL over the statistics columns (no tensor bytes are read).
async fn layer_stats(url: &str, m: &Manifest) -> Result<Vec<serde_json::Value>> {
    if m.num_samples() == 0 {
        return Ok(vec![]);
    }
    let session = QuerySession::open(url, Some(m.version)).await?;
    let mut out = vec![];
    for p in &m.schema.points {
        let sql = format!(
            "SELECT avg({}), max({}), sum({}), sum({}) FROM samples",
            stat_column(*p, StatKind::Norm),
            stat_column(*p, StatKind::MaxAbs),
            stat_column(*p, StatKind::NanCount),
            stat_column(*p, StatKind::InfCount)
        );
        let batches = session
            .query(&sql)
            .await
            .with_context(|| format!("statistics of {}", p.column()))?;
        let b = batches
            .first()
            .context("statistics query returned no batch")?;
        let v = |i: usize| -> Result<f64> {
            let c = cast(b.column(i), &DataType::Float64)?;
            Ok(c.as_primitive::<Float64Type>().value(0))
        };
        out.push(json!({
            "point": p.column(),
            "mean_token_norm": v(0)?,
            "max_abs": v(1)?,
            "nan_count": v(2)? as u64,
            "inf_count": v(3)? as u64,
        }));
    }
    Ok(out)
}

/// Samples and tokens of each input shard `I/n` (sample id modulo `n`, as `capture --shard`
/// splits), every shard listed, computed with SQL over the sample columns.
async fn shard_progress(url: &str, m: &Manifest, n: u64) -> Result<Vec<serde_json::Value>> {
    if n == 0 {
        anyhow::bail!("--shards 0: expected the N of --shard I/N, at least 1");
    }
    let mut counts = vec![(0u64, 0u64); n as usize];
    if m.num_samples() > 0 {
        let session = QuerySession::open(url, Some(m.version)).await?;
        let sql = format!(
            "SELECT CAST(sample_id % {n} AS BIGINT), CAST(count(*) AS BIGINT), \
             CAST(sum(seq_len) AS BIGINT) FROM samples GROUP BY 1"
        );
        let batches = session.query(&sql).await.context("samples per shard")?;
        for b in &batches {
            let col = |i: usize| -> Result<Vec<i64>> {
                let c = cast(b.column(i), &DataType::Int64)?;
                Ok(c.as_primitive::<arrow_array::types::Int64Type>()
                    .values()
                    .to_vec())
            };
            let (shard, samples, tokens) = (col(0)?, col(1)?, col(2)?);
            for ((s, k), t) in shard.into_iter().zip(samples).zip(tokens) {
                if let Some(slot) = counts.get_mut(s as usize) {
                    *slot = (k as u64, t as u64);
                }
            }
        }
    }
    Ok(counts
        .into_iter()
        .enumerate()
        .map(|(i, (samples, tokens))| {
            json!({ "shard": format!("{i}/{n}"), "samples": samples, "tokens": tokens })
        })
        .collect())
}

/// Run `hslake info`.
pub async fn run(a: Args) -> Result<std::process::ExitCode> {
    let ds = Dataset::open(&a.url).await?;
    let versions = ds.versions().await?;
    let m = ds.manifest(a.version).await?;
    let stats = layer_stats(ds.url(), &m).await?;
    let shards = match a.shards {
        Some(n) => Some(shard_progress(ds.url(), &m, n).await?),
        None => None,
    };
    if a.json {
        let mut d = describe(ds.url(), &versions, &m);
        d["layer_stats"] = json!(stats);
        if let Some(shards) = &shards {
            d["input_shards"] = json!(shards);
        }
        println!("{}", serde_json::to_string_pretty(&d)?);
        return Ok(std::process::ExitCode::SUCCESS);
    }
    let s = &m.schema;
    let hb = super::human_bytes;
    println!("dataset      {}", ds.url());
    println!(
        "version      {} of {} (committed {})",
        m.version,
        versions.len(),
        m.committed_at
    );
    println!("model        {} ({})", s.model, s.architecture);
    println!(
        "shape        [seq_len, {}] {}, {} layers, vocab {}",
        s.hidden_size, s.dtype, s.num_layers, s.vocab_size
    );
    println!(
        "captured     {}",
        s.points
            .iter()
            .map(|p| p.column())
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!("convention   {}", s.layer_convention);
    let p = &m.provenance;
    println!(
        "provenance   {} dtype={} tp={} software={}",
        p.model,
        p.dtype,
        p.tp_size.map_or("-".to_string(), |t| t.to_string()),
        p.software
    );
    println!("samples      {}", m.num_samples());
    println!("tokens       {}", m.num_tokens());
    println!("shards       {}", m.shards.len());
    println!(
        "bytes        {} on storage, {} raw tensors",
        hb(m.bytes()),
        hb(m.raw_bytes())
    );
    if m.bytes() > 0 {
        println!(
            "compression  {:.3}x",
            m.raw_bytes() as f64 / m.bytes() as f64
        );
    }
    for st in &stats {
        println!(
            "statistics   {}: mean token norm {:.3}, max |x| {}, NaN {}, Inf {}",
            st["point"].as_str().unwrap_or_default(),
            st["mean_token_norm"].as_f64().unwrap_or_default(),
            st["max_abs"].as_f64().unwrap_or_default(),
            st["nan_count"],
            st["inf_count"]
        );
    }
    if let Some(v) = m.vacuum {
        let this = if m.is_vacuum() {
            " (this version is that vacuum's: its parent's shards, before it deleted files)"
        } else {
            ""
        };
        println!(
            "vacuum       last at version {}, cutoff {}{this}",
            v.version, v.cutoff
        );
    }
    for (k, v) in &m.properties {
        println!("property     {k} = {v}");
    }
    for sh in shards.iter().flatten() {
        println!(
            "input shard  {}: {} samples, {} tokens",
            sh["shard"].as_str().unwrap_or_default(),
            sh["samples"],
            sh["tokens"]
        );
    }
    Ok(std::process::ExitCode::SUCCESS)
}
