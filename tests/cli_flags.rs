//! End-to-end: every duration and size flag of the `hslake` binary refuses an extreme value
//! (`1e308`, `-1`, a size past 2^64) with a usage error naming the flag and its range, never a
//! panic, and still takes its old spellings.
mod common;

use common::hslake;

/// Runs `args` and asserts a usage error (exit 2) whose message holds every one of `want`.
fn refused(args: &[&str], want: &[&str]) {
    let o = hslake(args);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
    assert!(!err.contains("panicked"), "{args:?}: {err}");
    for w in want {
        assert!(err.contains(w), "{args:?}: expected {w:?} in {err}");
    }
}

#[test]
fn extreme_durations_and_sizes_are_refused_with_the_flag_s_range() {
    refused(
        &["vacuum", "file:///nowhere", "--grace", "1e308"],
        &["--grace \"1e308\": out of range", "from 0s to 365d"],
    );
    refused(
        &[
            "synth",
            "x",
            "--samples",
            "1",
            "--shard-mb",
            "99999999999999999999",
        ],
        &["--shard-mb", "out of range", "from 0B to 1TiB"],
    );
    refused(
        &["prepare", "--request-timeout-secs", "1e308"],
        &["--request-timeout-secs", "from 1ms to 1d"],
    );
}

#[cfg(feature = "sql")]
#[test]
fn the_sql_commands_refuse_extreme_limits() {
    refused(
        &["sql", "file:///x", "SELECT 1", "--query-memory", "0"],
        &["--query-memory \"0\": out of range", "from 1MiB to 1PiB"],
    );
    refused(
        &["serve-sql", "--queue-timeout=-5s"],
        &["--queue-timeout \"-5s\": out of range"],
    );
}

#[cfg(feature = "capture")]
#[test]
fn capture_and_its_daemon_refuse_extreme_values() {
    refused(
        &["capture", "--commit-interval", "1e308"],
        &[
            "--commit-interval \"1e308\": out of range",
            "from 1ms to 365d",
        ],
    );
    refused(
        &["capture", "--zstd-level", "1000"],
        &["--zstd-level 1000: out of range", "from 1 to 22"],
    );
    refused(
        &["serve-capture", "--shutdown-timeout", "1e308"],
        &["--shutdown-timeout", "from 1ms to 1d"],
    );
    refused(
        &["serve-capture", "--max-job-bytes", "2PiB"],
        &["--max-job-bytes \"2PiB\": out of range"],
    );
    refused(
        &["jobs", "wait", "1", "--timeout", "1e308"],
        &["--timeout \"1e308\": out of range"],
    );
}

#[test]
fn old_spellings_still_parse() {
    // Bare numbers keep their old units; only the missing dataset stops these.
    let tmp = tempfile::tempdir().unwrap();
    let url = format!("file://{}", tmp.path().join("none").display());
    let o = hslake(&["vacuum", &url, "--grace", "3600"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("not an hslake dataset"), "{err}");
    let o = hslake(&[
        "synth",
        &url,
        "--samples",
        "2",
        "--shard-mb",
        "1",
        "--row-group-mb",
        "512KiB",
        "--hidden",
        "8",
        "--layers",
        "1",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}
