//! `hslake prepare` on its own: the CLI's prepare subcommand (src/cmd/prepare.rs) compiled without
//! the rest of the CLI (no libtorch, no DataFusion), so its tests and benchmark can run from a
//! small build: `cargo build -p hslake-prepare --example hslake_prepare`, then
//! `HSLAKE_BIN=target/debug/examples/hslake_prepare pytest tests/python/test_prepare_*.py`.
use clap::{Parser, Subcommand};
use tracing_subscriber::EnvFilter;

#[path = "../../src/cmd/prepare.rs"]
mod prepare;

/// The prepare subcommand of hslake.
#[derive(Parser)]
#[command(name = "hslake", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Turn chat conversations into tokenized samples with assistant-only loss masks.
    Prepare(prepare::Args),
}

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_env("HSLAKE_LOG").unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let Command::Prepare(args) = Cli::parse().command;
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
    match runtime.block_on(prepare::run(args)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
