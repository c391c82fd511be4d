//! One module per subcommand of the light binary, plus what both binaries share: the
//! helpers below, a capture job's flags and the listeners. The GPU commands' modules are the
//! GPU binary's own (src/bin/hslake-gpu/).
pub mod bench;
pub mod capture_job;
pub mod cp;
pub mod export;
#[cfg(feature = "sql")]
pub mod info;
pub mod jobs;
#[cfg(any(feature = "capture", feature = "sql"))]
pub mod listen;
pub mod ls;
pub mod prepare;
pub mod repair;
#[cfg(feature = "sql")]
pub mod serve_sql;
#[cfg(feature = "sql")]
pub mod sql;
pub mod synth;
pub mod vacuum;
pub mod verify;

use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};

/// A progress bar on stderr with a message, position, rate and ETA.
pub fn progress(len: u64, unit: &str) -> ProgressBar {
    let pb = ProgressBar::new(len);
    let tmpl = format!("{{msg}} [{{elapsed_precise}}] {{wide_bar}} {{human_pos}}/{{human_len}} {unit} ({{per_sec}}, ETA {{eta}})");
    pb.set_style(
        ProgressStyle::with_template(&tmpl).unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    pb
}

/// A progress bar counting bytes.
pub fn byte_progress(len: u64) -> ProgressBar {
    let pb = ProgressBar::new(len);
    let tmpl =
        "{msg} [{elapsed_precise}] {wide_bar} {bytes}/{total_bytes} ({bytes_per_sec}, ETA {eta})";
    pb.set_style(
        ProgressStyle::with_template(tmpl).unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    pb
}

/// The longest duration any flag takes: beyond it a timeout or interval means "never", and
/// `Instant + Duration` arithmetic stays far from overflow.
pub const YEAR: Duration = Duration::from_secs(365 * 86_400);

/// Human-readable byte count.
pub fn human_bytes(b: u64) -> String {
    indicatif::HumanBytes(b).to_string()
}

/// The bearer token on the first line of `path`, trimmed; an empty one is refused.
pub fn read_token_file(path: &std::path::Path) -> anyhow::Result<String> {
    use anyhow::{bail, Context};
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading token file {}", path.display()))?;
    let token = text.lines().next().unwrap_or("").trim().to_string();
    if token.is_empty() {
        bail!(
            "token file {} is empty; expected a bearer token on its first line",
            path.display()
        );
    }
    Ok(token)
}
