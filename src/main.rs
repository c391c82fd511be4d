//! `hslake`: capture, store, query and load EAGLE-3 hidden states. This binary has every
//! command that needs no GPU and does not link libtorch; `capture`, `serve-capture` and `debug`
//! run in `hslake-gpu`, which it replaces itself with (src/gpu_binary.rs). Cargo features
//! `capture` (builds hslake-gpu; libtorch) and `sql` (DataFusion, Flight) are on by default.
use clap::{Parser, Subcommand};
use hslake_cli::cmd;
use hslake_cli::gpu_binary::{self, Forwarded};

/// A data lake for the hidden states EAGLE-3 draft models train on.
#[derive(Parser)]
#[command(name = "hslake", version = hslake_cli::version_line(""), about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

// One variant per subcommand; each lives in its own file under src/cmd/, the GPU commands' in
// src/bin/hslake-gpu/ (here they only appear in the help).
#[derive(Subcommand)]
enum Command {
    #[command(about = gpu_binary::CAPTURE_ABOUT, long_about = None, disable_help_flag = true)]
    Capture(Forwarded),
    #[command(about = gpu_binary::SERVE_CAPTURE_ABOUT, long_about = None, disable_help_flag = true)]
    ServeCapture(Forwarded),
    /// Submit, list, show, cancel and wait for jobs of a capture daemon.
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
    /// Commit a version without the shards no longer in storage, or without repeated entries.
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
    #[command(about = gpu_binary::DEBUG_ABOUT, long_about = None, disable_help_flag = true, hide = true)]
    Debug(Forwarded),
}

fn main() -> std::process::ExitCode {
    let args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    // Before anything else, so that a GPU command pays nothing here but the exec.
    if gpu_binary::is_gpu_command(&args) {
        return forward(&args);
    }
    let cli = Cli::parse();
    hslake_cli::run(async {
        match cli.command {
            // Only reached when the check above misses a spelling clap still takes.
            Command::Capture(_) | Command::ServeCapture(_) | Command::Debug(_) => {
                Err(gpu_binary::exec(&args))
            }
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
        }
    })
}

/// Runs the GPU command in `args` in hslake-gpu; returns only when that cannot be done.
fn forward(args: &[std::ffi::OsString]) -> std::process::ExitCode {
    eprintln!("error: {:#}", gpu_binary::exec(args));
    std::process::ExitCode::FAILURE
}
