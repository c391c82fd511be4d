//! `hslake-gpu`: the commands of `hslake` that link libtorch (capture, the capture daemon and
//! the hidden GPU checks). `hslake` runs it for them (src/gpu_binary.rs), so its help and
//! errors speak as `hslake`. Built with the `capture` feature.
// A libtorch or CUDA failure (out of memory, say) is an error to report, never a panic; tests
// may unwrap (clippy.toml). capture's tch calls are checked in that crate (clippy.toml).
#![warn(clippy::unwrap_used, clippy::expect_used)]
use clap::{Parser, Subcommand};
use hslake_cli::gpu_binary;

mod capture;
mod debug;
mod serve_capture;

/// The commands of hslake that link libtorch; `hslake` runs them through this binary, so its
/// help and errors name `hslake`.
#[derive(Parser)]
#[command(
    name = "hslake",
    bin_name = "hslake",
    version = version_line(),
    about = "The GPU commands of hslake (they link libtorch), which `hslake` runs through this binary"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    #[command(about = gpu_binary::CAPTURE_ABOUT, long_about = None)]
    Capture(capture::Args),
    #[command(about = gpu_binary::SERVE_CAPTURE_ABOUT, long_about = None)]
    ServeCapture(serve_capture::Args),
    #[command(about = gpu_binary::DEBUG_ABOUT, long_about = None, subcommand, hide = true)]
    Debug(debug::Debug),
}

/// `--version`, saying whether this build reads HSLAKE_TEST_FAIL_ALL_REDUCE.
fn version_line() -> &'static str {
    hslake_cli::version_line(if hslake_capture::FAULT_INJECTION {
        ", with test fault injection"
    } else {
        ""
    })
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    hslake_cli::run(async {
        match cli.command {
            Command::Capture(a) => capture::run(a).await,
            Command::ServeCapture(a) => serve_capture::run(a).await,
            Command::Debug(d) => debug::run(d),
        }
    })
}
