//! `hslake synth`: a synthetic dataset whose values look like real activations.
use anyhow::{bail, Context, Result};
use hslake_schemas::units::SizeRange;
use hslake_store::tools::synth::{write_dataset, SynthSpec};
use hslake_store::WriterOptions;

/// `--shard-mb`: up to a TiB; 0 closes a shard after every row group.
const SHARD_SIZE: SizeRange = SizeRange::bytes("--shard-mb", 0, 1 << 40).bare_mib();
/// `--row-group-mb`: up to a TiB; 0 writes every sample as a row group of its own.
const ROW_GROUP_SIZE: SizeRange = SizeRange::bytes("--row-group-mb", 0, 1 << 40).bare_mib();

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
    /// Shard size target, e.g. 1GiB; a bare number is MiB.
    #[arg(long = "shard-mb", default_value = "256", value_parser = SHARD_SIZE.parser())]
    pub shard_bytes: u64,
    /// Row-group size target in raw tensor bytes, e.g. 512KiB; a bare number is MiB.
    #[arg(long = "row-group-mb", default_value = "8", value_parser = ROW_GROUP_SIZE.parser())]
    pub row_group_bytes: u64,
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
    let spec = SynthSpec {
        samples: a.samples,
        seq_len: parse_range(&a.seq_len)?,
        hidden: a.hidden,
        layers: a.layers,
        final_norm: a.final_norm,
        num_layers: a.num_layers,
        vocab_size: a.vocab_size,
        dtype: a.dtype.parse()?,
        seed: a.seed,
        first_id: a.first_id,
        writer: WriterOptions {
            zstd_level: a.zstd_level,
            shard_target_bytes: a.shard_bytes,
            row_group_target_bytes: a.row_group_bytes,
            ..Default::default()
        },
        commit_every: a.commit_every,
    };
    let pb = super::progress(a.samples, "samples");
    pb.set_message("synth");
    let r = write_dataset(&a.url, &spec, || pb.inc(1)).await?;
    pb.finish_and_clear();
    let st = r.stats;
    tracing::info!(
        url = %r.dataset.url(),
        version = ?r.version,
        samples = st.samples,
        tokens = st.tokens,
        raw = %super::human_bytes(st.raw_bytes),
        written = %super::human_bytes(st.written_bytes),
        ratio = format!("{:.3}", st.raw_bytes as f64 / st.written_bytes.max(1) as f64),
        "synthetic dataset written"
    );
    Ok(std::process::ExitCode::SUCCESS)
}
