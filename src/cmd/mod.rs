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
pub mod ls;
pub mod prepare;
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

/// Human-readable byte count.
pub fn human_bytes(b: u64) -> String {
    indicatif::HumanBytes(b).to_string()
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
}
