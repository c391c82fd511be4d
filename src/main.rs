//! `hslake`: capture, store, query and load EAGLE-3 hidden states. Cargo features `capture`
//! (libtorch) and `sql` (DataFusion, Flight) are on by default; the GPU machines' binary is
//! built with `--no-default-features --features capture`.
use clap::{Parser, Subcommand};
use tracing_subscriber::EnvFilter;

mod cmd;

/// A data lake for the hidden states EAGLE-3 draft models train on.
#[derive(Parser)]
#[command(name = "hslake", version = version_line(), about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

// One variant per subcommand; each lives in its own file under src/cmd/.
#[derive(Subcommand)]
enum Command {
    /// Run a Hugging Face checkpoint over tokenized samples and write chosen layers' hidden states.
    #[cfg(feature = "capture")]
    Capture(cmd::capture::Args),
    /// Keep a model loaded and run capture jobs submitted over HTTP (the capture daemon).
    #[cfg(feature = "capture")]
    ServeCapture(cmd::serve_capture::Args),
    /// Submit, list, show, cancel and wait for jobs of a capture daemon.
    #[cfg(feature = "capture")]
    Jobs(cmd::jobs::Args),
    /// Turn chat conversations into tokenized samples with assistant-only loss masks.
    Prepare(cmd::prepare::Args),
    /// Write a synthetic dataset whose values look like real activations.
    Synth(cmd::synth::Args),
    /// Describe a dataset: schema, capture points, versions, samples, tokens, bytes.
    #[cfg(feature = "sql")]
    Info(cmd::info::Args),
    /// List a dataset's versions, shards or samples.
    Ls(cmd::ls::Args),
    /// Check every shard's checksum, row counts, schema and tensor shapes.
    Verify(cmd::verify::Args),
    /// Delete files that no manifest names (after a grace period).
    Vacuum(cmd::vacuum::Args),
    /// Commit a version without the shards that are no longer in storage.
    Repair(cmd::repair::Args),
    /// Copy a dataset version to another store, checking checksums.
    Cp(cmd::cp::Args),
    /// Write one sample's arrays as .npy files.
    Export(cmd::export::Args),
    /// Run SQL over a dataset version (interactive prompt when no query is given).
    #[cfg(feature = "sql")]
    Sql(cmd::sql::Args),
    /// Serve datasets read-only over Arrow Flight SQL, with bearer-token authentication.
    #[cfg(feature = "sql")]
    ServeSql(cmd::serve_sql::Args),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(cmd::bench::Bench),
    /// GPU checks and measurements of the capture forward.
    #[cfg(feature = "capture")]
    #[command(subcommand, hide = true)]
    Debug(cmd::debug::Debug),
}

/// The crates the read and write path runs in, which Cargo.toml raises to opt-level 3 in the dev
/// profile that setup builds; `--version` lists how each was compiled, and tests/cli_store.rs
/// fails when one is not at opt-level 3.
const READ_WRITE_PATH: [hslake_schemas::CrateBuild; 4] = [
    hslake_schemas::BUILD,
    hslake_store::build_info::BUILD,
    hslake_loader::BUILD,
    hslake_prepare::BUILD,
];

/// `hslake --version`: the version and which build this is, since a dev-profile store is many
/// times slower than the one the documented figures come from; the second line gives the
/// opt-level of each crate of the read and write path.
fn version_line() -> &'static str {
    static LINE: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    LINE.get_or_init(|| {
        format!(
            "{} ({}){}\nopt-level of the read and write path: {}",
            env!("CARGO_PKG_VERSION"),
            hslake_store::build_info::describe(),
            if cfg!(feature = "fault-injection") {
                ", with test fault injection"
            } else {
                ""
            },
            READ_WRITE_PATH
                .iter()
                .map(|c| format!("{} {}", c.name, c.opt_level))
                .collect::<Vec<_>>()
                .join(", ")
        )
    })
}

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_env("HSLAKE_LOG").unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        // Colour codes only for a person at a terminal, not in the daemon's log files.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    hslake_store::buffer::keep_freed_memory_for_reuse();
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            #[cfg(feature = "capture")]
            Command::Capture(a) => cmd::capture::run(a).await,
            #[cfg(feature = "capture")]
            Command::ServeCapture(a) => cmd::serve_capture::run(a).await,
            #[cfg(feature = "capture")]
            Command::Jobs(a) => cmd::jobs::run(a).await,
            Command::Prepare(a) => cmd::prepare::run(a).await,
            Command::Synth(a) => cmd::synth::run(a).await,
            #[cfg(feature = "sql")]
            Command::Info(a) => cmd::info::run(a).await,
            Command::Ls(a) => cmd::ls::run(a).await,
            Command::Verify(a) => cmd::verify::run(a).await,
            Command::Vacuum(a) => cmd::vacuum::run(a).await,
            Command::Repair(a) => cmd::repair::run(a).await,
            Command::Cp(a) => cmd::cp::run(a).await,
            Command::Export(a) => cmd::export::run(a).await,
            #[cfg(feature = "sql")]
            Command::Sql(a) => cmd::sql::run(a).await,
            #[cfg(feature = "sql")]
            Command::ServeSql(a) => cmd::serve_sql::run(a).await,
            Command::Bench(b) => cmd::bench::run(b).await,
            #[cfg(feature = "capture")]
            Command::Debug(d) => cmd::debug::run(d),
        }
    });
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
