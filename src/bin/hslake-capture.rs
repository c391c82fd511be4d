//! `hslake-capture`: the capture subcommand alone, as a small binary for GPU machines
//! (the full CLI also links DataFusion and Flight; only this part needs to travel).
use clap::Parser;
use tracing_subscriber::EnvFilter;

#[path = "../cmd/capture.rs"]
mod capture;

/// Capture hidden states of a Hugging Face checkpoint into an hslake dataset.
#[derive(Parser)]
#[command(name = "hslake-capture", version, about)]
struct Cli {
    #[command(flatten)]
    args: capture::Args,
}

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_env("HSLAKE_LOG").unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
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
    match runtime.block_on(capture::run(cli.args)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
