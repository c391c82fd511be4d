//! One module per subcommand, plus the small helpers they share.
pub mod bench;
#[cfg(feature = "capture")]
pub mod capture;
pub mod cp;
#[cfg(feature = "capture")]
pub mod debug;
pub mod export;
#[cfg(feature = "sql")]
pub mod info;
#[cfg(feature = "capture")]
pub mod jobs;
pub mod ls;
pub mod prepare;
pub mod repair;
#[cfg(feature = "capture")]
pub mod serve_capture;
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

/// Parse `90`, `30s`, `10m`, `2h`, `1d` into a duration.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: u64 = num
        .parse()
        .map_err(|_| format!("invalid duration {s:?}; expected e.g. 30s, 10m, 2h, 1d"))?;
    let secs = match unit {
        "" | "s" => n,
        "m" => n * 60,
        "h" => n * 3600,
        "d" => n * 86400,
        _ => {
            return Err(format!(
                "invalid duration unit in {s:?}; expected s, m, h or d"
            ))
        }
    };
    Ok(Duration::from_secs(secs))
}

/// Parse `1048576`, `512MiB`, `4GiB`, `2G`, `100M` (powers of 1024 either way) into bytes.
// Only `hslake sql`'s flags take sizes so far; a capture-only build has no caller.
#[cfg_attr(not(feature = "sql"), allow(dead_code))]
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (num, unit) = t.split_at(t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len()));
    let n: u64 = num
        .parse()
        .map_err(|_| format!("invalid size {s:?}; expected e.g. 512MiB, 4GiB"))?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => {
            return Err(format!(
                "invalid size unit in {s:?}; expected B, KiB, MiB, GiB or TiB"
            ))
        }
    };
    n.checked_mul(1 << shift)
        .ok_or_else(|| format!("size {s:?} is too large"))
}

/// Human-readable byte count.
pub fn human_bytes(b: u64) -> String {
    indicatif::HumanBytes(b).to_string()
}

/// The bearer token on the first line of `path`, trimmed; an empty one is refused.
#[cfg(any(feature = "capture", feature = "sql"))]
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_durations_with_units() {
        assert_eq!(parse_duration("0").unwrap(), Duration::ZERO);
        assert_eq!(parse_duration("10m").unwrap(), Duration::from_secs(600));
        assert!(parse_duration("5y").unwrap_err().contains("unit"));
    }

    #[test]
    fn parses_sizes_with_binary_units() {
        assert_eq!(parse_size("1048576").unwrap(), 1 << 20);
        assert_eq!(parse_size("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_size("4G").unwrap(), 4 << 30);
        assert!(parse_size("3 bananas").unwrap_err().contains("unit"));
        assert!(parse_size("GiB").unwrap_err().contains("invalid size"));
    }
}
