//! `hslake bench`: benchmarks that print figures for docs/PERFORMANCE.md.
use anyhow::{Context, Result};
use hslake_schemas::{CapturePoint, DType, DatasetSchema, Sample};
use hslake_store::build_info;
use hslake_store::format::planes::ValueChecksum;
use hslake_store::tools::bench::{bench_layouts, bench_store, bench_value_decode, read_all};
use hslake_store::tools::synth::SynthModel;
use hslake_store::{Dataset, DatasetReader};

/// Benchmarks.
#[derive(clap::Subcommand)]
pub enum Bench {
    /// Shard format: write and read+decode MB/s per core, compression, bytes per sample, layouts.
    Store(StoreArgs),
    /// `hslake prepare`'s stages one by one on one thread: CPU µs per conversation.
    Prepare(PrepareArgs),
}

/// Arguments of `hslake bench prepare`.
#[derive(clap::Args)]
pub struct PrepareArgs {
    /// Hugging Face model directory (tokenizer.json and chat template).
    #[arg(long)]
    pub model: std::path::PathBuf,
    /// Conversations, JSONL or Parquet.
    #[arg(long)]
    pub input: std::path::PathBuf,
    /// Extra template variables as a JSON object.
    #[arg(long)]
    pub chat_template_kwargs: Option<String>,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

fn run_prepare(a: PrepareArgs) -> Result<std::process::ExitCode> {
    let kwargs: hslake_prepare::TemplateKwargs = match &a.chat_template_kwargs {
        Some(s) => {
            serde_json::from_str(s).context("--chat-template-kwargs: expected a JSON object")?
        }
        None => Default::default(),
    };
    let stages = hslake_prepare::bench::bench_stages(&a.model, &a.input, &kwargs)?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&stages)?);
    } else {
        println!("build: {}", build_info::describe());
        println!(
            "{:<64} {:>9} {:>9}",
            "stage (one thread)", "CPU µs", "wall µs"
        );
        for s in &stages {
            println!("{:<64} {:>9.1} {:>9.1}", s.name, s.cpu_us, s.wall_us);
        }
    }
    Ok(std::process::ExitCode::SUCCESS)
}

/// Arguments of `hslake bench store`.
#[derive(clap::Args)]
pub struct StoreArgs {
    /// Take samples from this dataset (e.g. real captured activations) instead of synthesising.
    #[arg(long)]
    pub from: Option<String>,
    /// Take samples from a directory of `layer_<i>.npy` (bf16 bits, [N, T, H]) and
    /// `input_ids.npy` ([N, T]), as benchmarks/cpu/real_activations.py writes them.
    #[arg(long, conflicts_with = "from")]
    pub from_npy: Option<std::path::PathBuf>,
    /// Samples to synthesise (or at most to take from --from / --from-npy).
    #[arg(long, default_value_t = 200)]
    pub samples: usize,
    /// Synthetic sequence lengths MIN:MAX.
    #[arg(long, default_value = "256:1024")]
    pub seq_len: String,
    /// Synthetic hidden size.
    #[arg(long, default_value_t = 1024)]
    pub hidden: usize,
    /// Synthetic captured layers.
    #[arg(long, value_delimiter = ',', default_value = "2,16,29,31")]
    pub layers: Vec<u32>,
    /// Synthetic dtype.
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
    /// zstd level.
    #[arg(long, default_value_t = 1)]
    pub zstd_level: i32,
    /// Scratch directory (default: a temporary one).
    #[arg(long)]
    pub dir: Option<std::path::PathBuf>,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
    /// Also write the samples once with each kind of value checksum and once without, read
    /// each this many times, alternating, and print best, median and worst of each (0: skip).
    #[arg(long, default_value_t = 0)]
    pub checksum_rounds: usize,
}

/// Figures of one variant over the rounds of `--checksum-rounds`: MB/s per CPU second.
#[derive(Debug)]
struct Rounds {
    checksum: Option<ValueChecksum>,
    file_bytes: u64,
    read_mb_s: Vec<f64>,
    write_mb_s: Vec<f64>,
    /// The decoder alone (`bench_value_decode`).
    decode_mb_s: Vec<f64>,
}

impl Rounds {
    fn to_json(&self) -> serde_json::Value {
        serde_json::json!({"checksum": self.label(), "file_bytes": self.file_bytes,
                           "read_mb_s": self.read_mb_s, "write_mb_s": self.write_mb_s,
                           "decode_mb_s": self.decode_mb_s})
    }

    fn label(&self) -> &'static str {
        self.checksum.map_or("off", ValueChecksum::name)
    }

    /// (best, median, worst) of `v`.
    fn spread(v: &[f64]) -> (f64, f64, f64) {
        let mut s = v.to_vec();
        s.sort_by(f64::total_cmp);
        (s[s.len() - 1], s[s.len() / 2], s[0])
    }
}

/// Write `samples` once without value checksums and once with each kind, then read each
/// `rounds` times, alternating so that a noisy machine slows all alike. (Writing costs several
/// times what reading does and is not what the checksum's cost target is about.)
async fn checksum_rounds(
    dir: &std::path::Path,
    schema: &DatasetSchema,
    samples: &[Sample],
    zstd_level: i32,
    rounds: usize,
) -> Result<Vec<Rounds>> {
    let kinds = std::iter::once(None).chain(ValueChecksum::ALL.map(Some));
    let mut out: Vec<Rounds> = kinds
        .map(|checksum| Rounds {
            checksum,
            file_bytes: 0,
            read_mb_s: vec![],
            write_mb_s: vec![],
            decode_mb_s: vec![],
        })
        .collect();
    let mut datasets = vec![];
    for r in out.iter_mut() {
        let url = format!(
            "file://{}",
            dir.join(format!("sums-{}", r.label())).display()
        );
        let opts = hslake_store::WriterOptions {
            zstd_level,
            value_checksum: r.checksum,
            ..Default::default()
        };
        let st = bench_store(&url, schema.clone(), samples, opts).await?;
        r.file_bytes = st.file_bytes;
        r.write_mb_s.push(st.write_mb_s);
        r.read_mb_s.push(st.read_mb_s);
        datasets.push((Dataset::open(&url).await?, st.raw_bytes as f64));
    }
    for _ in 1..rounds {
        for (r, (ds, raw)) in out.iter_mut().zip(&datasets) {
            let (_, cpu) = read_all(ds).await?;
            r.read_mb_s.push(raw / cpu / 1e6);
        }
    }
    // The decoder alone, on the first samples (up to 256 MB raw) held in memory.
    let mut raw = 0usize;
    let few: Vec<Sample> = samples
        .iter()
        .take_while(|s| {
            raw += s.tensors.iter().map(|t| t.data.len()).sum::<usize>();
            raw <= 256 << 20
        })
        .cloned()
        .collect();
    let kinds: Vec<Option<ValueChecksum>> = out.iter().map(|r| r.checksum).collect();
    let decode =
        tokio::task::block_in_place(|| bench_value_decode(&few, zstd_level, &kinds, 5 * rounds))?;
    for (r, d) in out.iter_mut().zip(decode) {
        r.decode_mb_s = d;
    }
    Ok(out)
}

async fn load_samples(a: &StoreArgs) -> Result<(DatasetSchema, Vec<Sample>)> {
    if let Some(url) = &a.from {
        let r = DatasetReader::open(&Dataset::open(url).await?, None).await?;
        let mut out = vec![];
        let mut scan = r.scan(None);
        use futures::TryStreamExt;
        while let Some(b) = scan.try_next().await? {
            out.extend(hslake_store::format::codec::decode_samples(r.schema(), &b)?);
            if out.len() >= a.samples {
                out.truncate(a.samples);
                break;
            }
        }
        return Ok((r.schema().clone(), out));
    }
    if let Some(dir) = &a.from_npy {
        return Ok(hslake_store::tools::bench::samples_from_npy(
            dir, a.samples,
        )?);
    }
    let seq = super::synth::parse_range(&a.seq_len)?;
    let dtype: DType = a.dtype.parse()?;
    let points = a
        .layers
        .iter()
        .map(|&l| CapturePoint::LayerOutput(l))
        .collect();
    let num_layers = a.layers.iter().max().map_or(1, |m| *m as usize + 1);
    let schema = DatasetSchema::new(
        "synthetic",
        "Synthetic",
        a.hidden,
        num_layers,
        32000,
        dtype,
        points,
    )?;
    let gen = SynthModel::new(schema.clone(), seq, 0);
    Ok((
        schema,
        (0..a.samples as u64).map(|i| gen.sample(i)).collect(),
    ))
}

/// Run a benchmark.
pub async fn run(b: Bench) -> Result<std::process::ExitCode> {
    let a = match b {
        Bench::Store(a) => a,
        Bench::Prepare(a) => return tokio::task::block_in_place(|| run_prepare(a)),
    };
    let warning = build_info::benchmark_warning();
    if let Some(w) = &warning {
        tracing::warn!("{w}");
    }
    let (schema, samples) = load_samples(&a).await?;
    anyhow::ensure!(!samples.is_empty(), "no samples to benchmark");
    let tmp = tempfile::tempdir().context("temporary directory")?;
    let dir = a
        .dir
        .clone()
        .unwrap_or_else(|| tmp.path().to_path_buf())
        .join(format!("bench-{}", std::process::id()));
    let url = format!("file://{}", dir.display());
    tracing::info!(samples = samples.len(), hidden = schema.hidden_size, dtype = %schema.dtype, "benchmarking the shard format");
    let opts = hslake_store::WriterOptions {
        zstd_level: a.zstd_level,
        ..Default::default()
    };
    let st = bench_store(&url, schema.clone(), &samples, opts).await?;
    let layouts = tokio::task::block_in_place(|| bench_layouts(&schema, &samples, a.zstd_level))?;
    let rounds = if a.checksum_rounds > 0 {
        Some(checksum_rounds(&dir, &schema, &samples, a.zstd_level, a.checksum_rounds).await?)
    } else {
        None
    };
    let _ = std::fs::remove_dir_all(&dir);
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "build": build_info::describe(), "optimized": build_info::optimized(),
                "store": st, "layouts": layouts, "checksum_rounds": rounds.as_ref().map(|r| r.iter().map(Rounds::to_json).collect::<Vec<_>>())
            }))?
        );
    } else {
        // Repeated on stdout too: these lines get pasted into documents, the log does not.
        if let Some(w) = &warning {
            println!("WARNING: {w}");
        }
        println!("build: {}", build_info::describe());
        println!(
            "samples {}  raw {}  file {}  ratio {:.3}x",
            st.samples,
            super::human_bytes(st.raw_bytes),
            super::human_bytes(st.file_bytes),
            st.ratio
        );
        println!(
            "write (validate+stats+split+zstd+write), one core: {:.0} MB/s raw",
            st.write_mb_s
        );
        println!(
            "read+decode (fetch+zstd+unsplit), one core:        {:.0} MB/s raw",
            st.read_mb_s
        );
        println!(
            "one random sample: {} fetched in {} request(s) for {} raw",
            super::human_bytes(st.one_sample_bytes),
            st.one_sample_requests,
            super::human_bytes(st.one_sample_raw)
        );
        println!("layout\tratio\twrite MB/s per CPU s\tread MB/s per CPU s");
        for l in &layouts {
            println!(
                "{}\t{:.3}\t{:.0}\t{:.0}",
                l.layout, l.ratio, l.write_mb_s, l.read_mb_s
            );
        }
        if let Some(rounds) = &rounds {
            println!(
                "value checksums, {} alternating reads each (one write): MB/s raw per CPU s, best / median / worst",
                a.checksum_rounds
            );
            for r in rounds {
                let (rb, rm, rw) = Rounds::spread(&r.read_mb_s);
                let (wb, wm, ww) = Rounds::spread(&r.write_mb_s);
                let (db, dm, dw) = Rounds::spread(&r.decode_mb_s);
                println!(
                    "checksum {:<10}  file {}  read {rb:.0} / {rm:.0} / {rw:.0}  write {wb:.0} / {wm:.0} / {ww:.0}  \
                     decoder alone ({} rounds) {db:.0} / {dm:.0} / {dw:.0}",
                    r.label(),
                    super::human_bytes(r.file_bytes),
                    r.decode_mb_s.len(),
                );
            }
            let cost = |on: &[f64], off: &[f64]| {
                let (b_on, m_on, _) = Rounds::spread(on);
                let (b_off, m_off, _) = Rounds::spread(off);
                (100.0 * (1.0 - b_on / b_off), 100.0 * (1.0 - m_on / m_off))
            };
            let off = &rounds[0];
            for r in &rounds[1..] {
                let (rb, rm) = cost(&r.read_mb_s, &off.read_mb_s);
                let (wb, wm) = cost(&r.write_mb_s, &off.write_mb_s);
                let (db, dm) = cost(&r.decode_mb_s, &off.decode_mb_s);
                println!(
                    "cost of {} (vs off, best / median): read {rb:+.1} % / {rm:+.1} %, write {wb:+.1} % / {wm:+.1} %, \
                     decoder alone {db:+.1} % / {dm:+.1} %",
                    r.label()
                );
            }
        }
    }
    Ok(std::process::ExitCode::SUCCESS)
}
