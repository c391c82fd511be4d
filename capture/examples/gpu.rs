//! A small binary for GPU machines, built from this crate alone (the full CLI also links
//! DataFusion and Flight, and only the capture path needs to travel):
//!
//! ```text
//! gpu capture <hslake capture flags>     the CLI's capture subcommand, unchanged
//! gpu nccl-check                         NCCL with one rank on GPU 0: init, all-reduce, compare
//! gpu prefill --model DIR [--batch 8 --seq 2048 --iters 5 --layers 2,16,29,31]
//!                                        our forward alone (no copy, no write): tokens/s
//! gpu verify URL                         `hslake verify` of what a capture wrote
//! ```
use std::process::ExitCode;
use std::rc::Rc;
use std::time::Instant;

use anyhow::{bail, Context};
use clap::{Parser, Subcommand};
use hslake_capture::comm::{Communicator, SingleRank};
use hslake_capture::layers::NormKernel;
use hslake_capture::nccl::{self, NcclComm};
use hslake_capture::weights::Weights;
use hslake_capture::{models, ModelConfig};
use hslake_schemas::CapturePoint;
use tch::{Device, Kind, Tensor};
use tracing_subscriber::EnvFilter;

#[path = "../../src/cmd/capture.rs"]
mod capture;

#[derive(Parser)]
#[command(name = "gpu", about = "hslake capture and its GPU checks")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// The `hslake capture` subcommand.
    Capture(capture::Args),
    /// NCCL back end with one rank on GPU 0: init and all-reduce checks.
    NcclCheck,
    /// Prefill-only throughput of our forward on random token ids.
    Prefill {
        /// Checkpoint directory.
        #[arg(long)]
        model: std::path::PathBuf,
        /// Sequences per batch.
        #[arg(long, default_value_t = 8)]
        batch: i64,
        /// Tokens per sequence.
        #[arg(long, default_value_t = 2048)]
        seq: i64,
        /// Timed iterations (after two warm-up ones).
        #[arg(long, default_value_t = 5)]
        iters: usize,
        /// Layers whose outputs the forward returns (kept on the GPU).
        #[arg(long, value_delimiter = ',', default_value = "2,16,29,31")]
        layers: Vec<CapturePoint>,
        /// RMS norm kernel: fast or exact.
        #[arg(long, default_value = "fast")]
        norm: NormKernel,
    },
    /// Checksums, row counts and every tensor's decoding and shape, as `hslake verify` does.
    Verify {
        /// Dataset URL.
        url: String,
    },
}

/// Run an async subcommand on a multi-threaded runtime.
fn block_on(
    f: impl std::future::Future<Output = anyhow::Result<ExitCode>>,
) -> anyhow::Result<ExitCode> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?
        .block_on(f)
}

/// Verify the newest version; failure when any problem is found.
async fn verify(url: &str) -> anyhow::Result<ExitCode> {
    let ds = hslake_store::Dataset::open(url).await?;
    let report = hslake_store::verify(&ds, None, |_| {}).await?;
    for p in &report.problems {
        eprintln!("{p}");
    }
    println!(
        "verify {url}: version {}, {} shards, {} samples, {} problems",
        report.version,
        report.shards,
        report.samples,
        report.problems.len()
    );
    Ok(if report.is_clean() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn nccl_check() -> anyhow::Result<()> {
    if !tch::Cuda::is_available() {
        bail!("CUDA is not available");
    }
    println!("nccl version code {}", nccl::version()?);
    let comm = NcclComm::init(nccl::unique_id()?, 0, 1)?;
    for kind in [Kind::Float, Kind::BFloat16, Kind::Half] {
        let x = Tensor::f_randn([1 << 20], (Kind::Float, Device::Cuda(0)))?.f_to_kind(kind)?;
        let mut y = x.f_empty_like()?;
        y.f_copy_(&x)?;
        comm.all_reduce_sum(&mut y)?;
        let same = y.f_equal(&x)?;
        println!("nccl all-reduce {kind:?} world=1 on 2^20 elements: identical to input = {same}");
        if !same {
            bail!("all-reduce over one rank changed the values ({kind:?})");
        }
    }
    Ok(())
}

fn prefill(
    model: &std::path::Path,
    batch: i64,
    seq: i64,
    iters: usize,
    points: &[CapturePoint],
    norm: NormKernel,
) -> anyhow::Result<()> {
    let _g = tch::no_grad_guard();
    let cfg = ModelConfig::load(model)?;
    let weights = Weights::open(model)?;
    let comm: Rc<dyn Communicator> = Rc::new(SingleRank);
    let t = Instant::now();
    let m = models::load(&cfg, &weights, comm, Device::Cuda(0), Kind::BFloat16, norm)?;
    tch::Cuda::synchronize(0);
    println!("ours load secs {:.1}", t.elapsed().as_secs_f64());
    let ids = Tensor::f_randint(
        cfg.vocab_size as i64,
        [batch, seq],
        (Kind::Int64, Device::Cuda(0)),
    )?;
    for _ in 0..2 {
        m.forward(&ids, points)?;
    }
    tch::Cuda::synchronize(0);
    let t = Instant::now();
    for _ in 0..iters {
        m.forward(&ids, points)?;
    }
    tch::Cuda::synchronize(0);
    let secs = t.elapsed().as_secs_f64();
    println!(
        "ours prefill tokens/s {:.0}",
        (iters as i64 * batch * seq) as f64 / secs
    );
    Ok(())
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_env("HSLAKE_LOG").unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Capture(a) => block_on(capture::run(a)),
        Command::NcclCheck => nccl_check().map(|_| ExitCode::SUCCESS),
        Command::Prefill {
            model,
            batch,
            seq,
            iters,
            layers,
            norm,
        } => prefill(&model, batch, seq, iters, &layers, norm).map(|_| ExitCode::SUCCESS),
        Command::Verify { url } => block_on(verify(&url)),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
