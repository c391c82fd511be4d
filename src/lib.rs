//! The code of the `hslake` command line shared by its two binaries: `hslake` (src/main.rs),
//! every command that needs no GPU, and `hslake-gpu` (src/bin/hslake-gpu/, feature `capture`),
//! the commands that link libtorch, which `hslake` runs for them (see [`gpu_binary`]).
use std::future::Future;
use std::process::ExitCode;

use tracing_subscriber::EnvFilter;

pub mod cmd;
pub mod gpu_binary;

/// `--version`: the version and which build this is, since a dev-profile store is many times
/// slower than the one the documented figures come from; `note` is appended (a binary's
/// build variant, or empty); a second line gives the opt-level of each crate of the read and
/// write path. The first call's text stays for the process.
pub fn version_line(note: &str) -> &'static str {
    static LINE: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    LINE.get_or_init(|| {
        format!(
            "{} ({}){note}\nopt-level of the read and write path: {}",
            env!("CARGO_PKG_VERSION"),
            hslake_store::build_info::describe(),
            READ_WRITE_PATH
                .iter()
                .map(|c| format!("{} {}", c.name, c.opt_level))
                .collect::<Vec<_>>()
                .join(", ")
        )
    })
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

/// Runs a parsed command the way both binaries do: logs on stderr (HSLAKE_LOG, default info),
/// a multi-threaded runtime, and an error printed with its causes (exit 1).
pub fn run(command: impl Future<Output = anyhow::Result<ExitCode>>) -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_env("HSLAKE_LOG").unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        // Colour codes only for a person at a terminal, not in the daemon's log files.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    hslake_store::buffer::keep_freed_memory_for_reuse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(command) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
