//! `hslake synth`: a synthetic dataset whose values look like real activations.
use std::sync::mpsc;

use anyhow::{bail, Context, Result};
use hslake_schemas::{CapturePoint, DType, DatasetSchema};
use hslake_store::synth::SynthModel;
use hslake_store::{encode_sample, Dataset, DatasetWriter, Provenance, WriterOptions};

/// Arguments of `hslake synth`.
#[derive(clap::Args)]
pub struct Args {
    /// Dataset URL (file:///dir, s3://bucket/prefix, memory://name, or a plain path).
    pub url: String,
    /// Number of samples.
    #[arg(long)]
    pub samples: u64,
    /// Sequence lengths, uniform in MIN:MAX (or one number).
    #[arg(long, default_value = "128:512")]
    pub seq_len: String,
    /// Hidden size.
    #[arg(long, default_value_t = 256)]
    pub hidden: usize,
    /// Decoder layers whose outputs are "captured", 0-based.
    #[arg(long, value_delimiter = ',', default_value = "2,30,58,60")]
    pub layers: Vec<u32>,
    /// Also a final-norm column.
    #[arg(long)]
    pub final_norm: bool,
    /// Decoder layers of the pretend model (default: last captured layer + 1).
    #[arg(long)]
    pub num_layers: Option<usize>,
    /// Vocabulary size of the pretend model.
    #[arg(long, default_value_t = 32000)]
    pub vocab_size: usize,
    /// Element type: bf16, f16, f32 or fp8_e4m3.
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
    /// Random seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// First sample id.
    #[arg(long, default_value_t = 0)]
    pub first_id: u64,
    /// zstd level.
    #[arg(long, default_value_t = 1)]
    pub zstd_level: i32,
    /// Shard size target in MiB.
    #[arg(long, default_value_t = 256)]
    pub shard_mb: u64,
    /// Row-group size target in MiB of raw tensor bytes.
    #[arg(long, default_value_t = 8)]
    pub row_group_mb: u64,
    /// Commit every N samples (0: once at the end).
    #[arg(long, default_value_t = 0)]
    pub commit_every: u64,
}

/// Parse `MIN:MAX` or `N`.
pub fn parse_range(s: &str) -> Result<(usize, usize)> {
    let (a, b) = s.split_once(':').unwrap_or((s, s));
    let lo: usize = a
        .trim()
        .parse()
        .with_context(|| format!("--seq-len {s:?}: expected MIN:MAX"))?;
    let hi: usize = b
        .trim()
        .parse()
        .with_context(|| format!("--seq-len {s:?}: expected MIN:MAX"))?;
    if lo == 0 || hi < lo {
        bail!("--seq-len {s:?}: expected 1 <= MIN <= MAX");
    }
    Ok((lo, hi))
}

/// Run `hslake synth`.
pub async fn run(a: Args) -> Result<std::process::ExitCode> {
    let seq = parse_range(&a.seq_len)?;
    let dtype: DType = a.dtype.parse()?;
    let mut points: Vec<CapturePoint> = a
        .layers
        .iter()
        .map(|&l| CapturePoint::LayerOutput(l))
        .collect();
    if a.final_norm {
        points.push(CapturePoint::FinalNorm);
    }
    let num_layers = a
        .num_layers
        .unwrap_or_else(|| a.layers.iter().max().map_or(1, |m| *m as usize + 1));
    let schema = DatasetSchema::new(
        "synthetic",
        "Synthetic",
        a.hidden,
        num_layers,
        a.vocab_size,
        dtype,
        points,
    )?;
    let prov = Provenance {
        model: "synthetic".into(),
        architecture: "Synthetic".into(),
        dtype: dtype.to_string(),
        layers: schema.points.clone(),
        layer_convention: hslake_schemas::LAYER_CONVENTION.into(),
        software: format!("hslake {}", env!("CARGO_PKG_VERSION")),
        extra: [("synth_seed".to_string(), serde_json::json!(a.seed))]
            .into_iter()
            .collect(),
        ..Default::default()
    };
    let ds = Dataset::open_or_create(&a.url, schema.clone(), prov).await?;
    let opts = WriterOptions {
        zstd_level: a.zstd_level,
        shard_target_bytes: a.shard_mb << 20,
        row_group_target_bytes: a.row_group_mb << 20,
        ..Default::default()
    };
    let mut w = DatasetWriter::new(&ds, opts).await?;
    let gen = SynthModel::new(schema.clone(), seq, a.seed);

    // Generation and encoding are the CPU work: spread them over threads, each with its own
    // bounded channel, and take results round-robin so the order is deterministic.
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, 8);
    let pb = super::progress(a.samples, "samples");
    pb.set_message("synth");
    let mut rxs = vec![];
    let mut handles = vec![];
    for t in 0..threads as u64 {
        let (tx, rx) = mpsc::sync_channel(4);
        rxs.push(rx);
        let (gen, schema) = (gen.clone(), schema.clone());
        let (first, n) = (a.first_id, a.samples);
        handles.push(std::thread::spawn(move || {
            let mut i = t;
            while i < n {
                let s = gen.sample(first + i);
                let enc = encode_sample(&schema, &opts, &s);
                if tx.send(enc).is_err() {
                    return;
                }
                i += threads as u64;
            }
        }));
    }
    for i in 0..a.samples {
        let enc = rxs[(i % threads as u64) as usize]
            .recv()
            .context("encoder thread stopped")??;
        w.append_encoded(enc).await?;
        pb.inc(1);
        if a.commit_every > 0 && (i + 1) % a.commit_every == 0 {
            w.commit().await?;
        }
    }
    for h in handles {
        let _ = h.join();
    }
    let v = w.commit().await?;
    pb.finish_and_clear();
    let st = w.stats();
    tracing::info!(
        url = %ds.url(),
        version = ?v,
        samples = st.samples,
        tokens = st.tokens,
        raw = %super::human_bytes(st.raw_bytes),
        written = %super::human_bytes(st.written_bytes),
        ratio = format!("{:.3}", st.raw_bytes as f64 / st.written_bytes.max(1) as f64),
        "synthetic dataset written"
    );
    Ok(std::process::ExitCode::SUCCESS)
}
