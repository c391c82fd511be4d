//! `hslake info`: what a dataset holds.
use anyhow::Result;
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
    })
}

/// Run `hslake info`.
pub async fn run(a: Args) -> Result<std::process::ExitCode> {
    let ds = Dataset::open(&a.url).await?;
    let versions = ds.versions().await?;
    let m = ds.manifest(a.version).await?;
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&describe(ds.url(), &versions, &m))?
        );
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
    for (k, v) in &m.properties {
        println!("property     {k} = {v}");
    }
    Ok(std::process::ExitCode::SUCCESS)
}
