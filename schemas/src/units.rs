//! Durations, byte sizes and counts as flags, job fields, options and environment variables
//! spell them (`30s`, `1.5m`, `250ms`, `24GiB`, `500MB`, `16`), each checked against a named
//! range. Every such value goes through [`DurationRange::parse`] /
//! [`DurationRange::from_number`], [`SizeRange::parse`] or [`CountRange::check`], so an
//! extreme one (`1e308`, `-1`, `2^70` bytes, `10^6` threads) is refused with its range instead
//! of overflowing a conversion, an allocation or the thread limit further on.
//!
//! ```
//! use std::time::Duration;
//! use hslake_schemas::units::DurationRange;
//!
//! const GRACE: DurationRange = DurationRange::seconds("--grace", Duration::ZERO, Duration::from_secs(86_400));
//! assert_eq!(GRACE.parse("1.5m").unwrap(), Duration::from_secs(90));
//! assert!(GRACE.parse("1e308").unwrap_err().to_string().contains("from 0s to 1d"));
//! ```
use std::fmt;
use std::time::Duration;

use serde::de::{self, Deserializer, Visitor};
use serde::Serializer;

use crate::SchemaError;

/// Seconds per duration unit, longest spelling first within a letter so `ms` wins over `m`.
const TIME_UNITS: [(&str, f64); 9] = [
    ("ms", 1e-3),
    ("s", 1.0),
    ("sec", 1.0),
    ("min", 60.0),
    ("m", 60.0),
    ("h", 3600.0),
    ("hr", 3600.0),
    ("d", 86_400.0),
    ("day", 86_400.0),
];

/// The range a duration flag or field takes, with the name errors call it by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DurationRange {
    /// The flag or field, e.g. `--commit-interval`.
    pub name: &'static str,
    /// Smallest value taken.
    pub min: Duration,
    /// Largest value taken.
    pub max: Duration,
    /// What a number without a unit counts (seconds for most flags).
    pub bare: Duration,
}

impl DurationRange {
    /// A range whose bare numbers are seconds.
    pub const fn seconds(name: &'static str, min: Duration, max: Duration) -> Self {
        DurationRange {
            name,
            min,
            max,
            bare: Duration::from_secs(1),
        }
    }

    /// The same range with bare numbers counted in milliseconds (flags named `..._ms`).
    pub const fn bare_millis(self) -> Self {
        DurationRange {
            bare: Duration::from_millis(1),
            ..self
        }
    }

    /// Parses `90`, `1.5`, `30s`, `250ms`, `10m`, `2h`, `1d` (a bare number counts
    /// [`Self::bare`]) and checks the range.
    pub fn parse(&self, text: &str) -> Result<Duration, SchemaError> {
        let (number, unit) = split_number(text);
        let n: f64 = number
            .parse()
            .map_err(|_| self.error(text, "not a number"))?;
        let per_unit = if unit.is_empty() {
            self.bare.as_secs_f64()
        } else {
            TIME_UNITS
                .iter()
                .find(|(u, _)| u.eq_ignore_ascii_case(unit))
                .map(|(_, secs)| *secs)
                .ok_or_else(|| self.error(text, &format!("unknown unit {unit:?}")))?
        };
        self.in_range(text, n * per_unit)
    }

    /// Checks a number in [`Self::bare`] units, as JSON gives it.
    pub fn from_number(&self, n: f64) -> Result<Duration, SchemaError> {
        // Display writes 1e308 as 309 digits; the exponent form past ordinary magnitudes.
        let text = if n == 0.0 || (1e-4..1e15).contains(&n.abs()) {
            n.to_string()
        } else {
            format!("{n:e}")
        };
        self.in_range(&text, n * self.bare.as_secs_f64())
    }

    /// Checks a duration already in hand.
    pub fn check(&self, d: Duration) -> Result<Duration, SchemaError> {
        self.in_range(&show_duration(d), d.as_secs_f64())
    }

    /// A clap value parser for this range.
    pub fn parser(self) -> impl Fn(&str) -> Result<Duration, SchemaError> + Clone + Send + Sync {
        move |s| self.parse(s)
    }

    /// Reads a JSON number (in [`Self::bare`] units) or string (`"30s"`), checked as a flag is.
    pub fn deserialize<'de, D: Deserializer<'de>>(&self, d: D) -> Result<Duration, D::Error> {
        struct Visit(DurationRange);
        impl<'de> Visitor<'de> for Visit {
            type Value = Duration;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a number of seconds or a duration such as \"30s\"")
            }
            fn visit_f64<E: de::Error>(self, n: f64) -> Result<Duration, E> {
                self.0.from_number(n).map_err(E::custom)
            }
            fn visit_u64<E: de::Error>(self, n: u64) -> Result<Duration, E> {
                self.visit_f64(n as f64)
            }
            fn visit_i64<E: de::Error>(self, n: i64) -> Result<Duration, E> {
                self.visit_f64(n as f64)
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Duration, E> {
                self.0.parse(s).map_err(E::custom)
            }
        }
        d.deserialize_any(Visit(*self))
    }

    fn in_range(&self, text: &str, secs: f64) -> Result<Duration, SchemaError> {
        if secs.is_nan() {
            return Err(self.error(text, "not a number"));
        }
        // Compared as f64 before any conversion: Duration::from_secs_f64 panics past u64 seconds.
        if secs < self.min.as_secs_f64() || secs > self.max.as_secs_f64() {
            return Err(self.error(text, "out of range"));
        }
        Ok(Duration::try_from_secs_f64(secs).unwrap_or(self.max))
    }

    fn error(&self, value: &str, problem: &str) -> SchemaError {
        let bare = if self.bare == Duration::from_millis(1) {
            "milliseconds"
        } else {
            "seconds"
        };
        SchemaError::Quantity {
            name: self.name.to_string(),
            value: value.trim().to_string(),
            problem: problem.to_string(),
            expected: format!(
                "a duration from {} to {} (e.g. 30s, 1.5m, 250ms, 2h, 1d; a bare number is {bare})",
                show_duration(self.min),
                show_duration(self.max)
            ),
        }
    }
}

/// Writes a duration as a number of seconds, which [`DurationRange::deserialize`] reads back
/// for a range of bare seconds (and which readers of the older all-seconds fields take too).
pub fn serialize_secs<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}

/// Bytes per size unit: powers of 1024 whether spelt `MB` or `MiB`, as the CLI always took them.
const SIZE_UNITS: [(&str, u64); 16] = [
    ("b", 1),
    ("k", 1 << 10),
    ("kb", 1 << 10),
    ("kib", 1 << 10),
    ("m", 1 << 20),
    ("mb", 1 << 20),
    ("mib", 1 << 20),
    ("g", 1 << 30),
    ("gb", 1 << 30),
    ("gib", 1 << 30),
    ("t", 1 << 40),
    ("tb", 1 << 40),
    ("tib", 1 << 40),
    ("p", 1 << 50),
    ("pb", 1 << 50),
    ("pib", 1 << 50),
];

/// The range a byte-size flag or field takes, with the name errors call it by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SizeRange {
    /// The flag or field, e.g. `--max-job-bytes`.
    pub name: &'static str,
    /// Smallest value taken, in bytes.
    pub min: u64,
    /// Largest value taken, in bytes.
    pub max: u64,
    /// Bytes a number without a unit counts (1, or 2^20 for flags named `..._mb`).
    pub bare: u64,
}

impl SizeRange {
    /// A range whose bare numbers are bytes.
    pub const fn bytes(name: &'static str, min: u64, max: u64) -> Self {
        SizeRange {
            name,
            min,
            max,
            bare: 1,
        }
    }

    /// The same range with bare numbers counted in MiB (flags named `..._mb`).
    pub const fn bare_mib(self) -> Self {
        SizeRange {
            bare: 1 << 20,
            ..self
        }
    }

    /// The same range with bare numbers counted in GiB (GPU memory, given as `24` or `0.5`).
    pub const fn bare_gib(self) -> Self {
        SizeRange {
            bare: 1 << 30,
            ..self
        }
    }

    /// Parses `1048576`, `512MiB`, `1.5GiB`, `500MB`, `4G` (powers of 1024 either way; a bare
    /// number counts [`Self::bare`]) and checks the range.
    pub fn parse(&self, text: &str) -> Result<u64, SchemaError> {
        let (number, unit) = split_number(text);
        let per_unit = if unit.is_empty() {
            self.bare
        } else {
            SIZE_UNITS
                .iter()
                .find(|(u, _)| u.eq_ignore_ascii_case(unit))
                .map(|(_, bytes)| *bytes)
                .ok_or_else(|| self.error(text, &format!("unknown unit {unit:?}")))?
        };
        // Whole numbers exactly (u128 holds any u64 times any unit); fractions through f64.
        let bytes: f64 = match number.parse::<u64>() {
            Ok(n) => {
                let b = u128::from(n) * u128::from(per_unit);
                return match u64::try_from(b) {
                    Ok(b) => self.check_text(text, b),
                    Err(_) => Err(self.error(text, "out of range")),
                };
            }
            Err(_) => {
                number
                    .parse::<f64>()
                    .map_err(|_| self.error(text, "not a number"))?
                    * per_unit as f64
            }
        };
        if bytes.is_nan() || bytes < self.min as f64 || bytes > self.max as f64 {
            return Err(self.error(text, "out of range"));
        }
        self.check_text(text, bytes as u64)
    }

    /// Checks a byte count already in hand.
    pub fn check(&self, bytes: u64) -> Result<u64, SchemaError> {
        self.check_text(&bytes.to_string(), bytes)
    }

    /// A clap value parser for this range.
    pub fn parser(self) -> impl Fn(&str) -> Result<u64, SchemaError> + Clone + Send + Sync {
        move |s| self.parse(s)
    }

    fn check_text(&self, text: &str, bytes: u64) -> Result<u64, SchemaError> {
        if bytes < self.min || bytes > self.max {
            return Err(self.error(text, "out of range"));
        }
        Ok(bytes)
    }

    fn error(&self, value: &str, problem: &str) -> SchemaError {
        let bare = match self.bare {
            1 => "bytes".to_string(),
            b => show_size(b),
        };
        SchemaError::Quantity {
            name: self.name.to_string(),
            value: value.trim().to_string(),
            problem: problem.to_string(),
            expected: format!(
                "a size from {} to {} (e.g. 512MiB, 24GiB, 500MB; powers of 1024 either way; a bare number is {bare})",
                show_size(self.min),
                show_size(self.max)
            ),
        }
    }
}

/// The range a count flag or field takes (threads, row groups, samples), with the name errors
/// call it by: the same checks and error as [`SizeRange`], for numbers without a unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CountRange {
    /// The flag or field, e.g. `decode_threads`.
    pub name: &'static str,
    /// Smallest value taken.
    pub min: u64,
    /// Largest value taken.
    pub max: u64,
}

impl CountRange {
    /// Counts from `min` to `max`.
    pub const fn new(name: &'static str, min: u64, max: u64) -> Self {
        CountRange { name, min, max }
    }

    /// Parses a whole number and checks the range.
    pub fn parse(&self, text: &str) -> Result<u64, SchemaError> {
        let t = text.trim();
        match t.parse::<u64>() {
            Ok(n) => self.check_text(text, n),
            // Digits alone that do not fit a u64 are a count past any range.
            Err(_) if !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit()) => {
                Err(self.error(text, "out of range"))
            }
            Err(_) => Err(self.error(text, "not a whole number")),
        }
    }

    /// Checks a count already in hand.
    pub fn check(&self, n: u64) -> Result<u64, SchemaError> {
        self.check_text(&n.to_string(), n)
    }

    /// A clap value parser for this range.
    pub fn parser(self) -> impl Fn(&str) -> Result<u64, SchemaError> + Clone + Send + Sync {
        move |s| self.parse(s)
    }

    fn check_text(&self, text: &str, n: u64) -> Result<u64, SchemaError> {
        if n < self.min || n > self.max {
            return Err(self.error(text, "out of range"));
        }
        Ok(n)
    }

    fn error(&self, value: &str, problem: &str) -> SchemaError {
        SchemaError::Quantity {
            name: self.name.to_string(),
            value: value.trim().to_string(),
            problem: problem.to_string(),
            expected: format!("a whole number from {} to {}", self.min, self.max),
        }
    }
}

/// `text` cut where its number ends: `("1.5", "GiB")`; the unit trimmed, the number as given.
fn split_number(text: &str) -> (&str, &str) {
    let t = text.trim();
    // A unit never starts with `e`, so an exponent (`1e308`) stays in the number.
    let end = t
        .find(|c: char| !(c.is_ascii_digit() || matches!(c, '.' | 'e' | 'E' | '+' | '-')))
        .unwrap_or(t.len());
    (&t[..end], t[end..].trim())
}

/// A duration in its largest whole unit: `1d`, `90s`, `250ms`.
pub fn show_duration(d: Duration) -> String {
    if d.subsec_nanos() != 0 {
        return format!("{}ms", d.as_millis());
    }
    let secs = d.as_secs();
    for (unit, per) in [("d", 86_400), ("h", 3600), ("m", 60)] {
        if secs >= per && secs.is_multiple_of(per) {
            return format!("{}{unit}", secs / per);
        }
    }
    format!("{secs}s")
}

/// A size in its largest whole binary unit: `24GiB`, `1536KiB`, `7B`.
pub fn show_size(bytes: u64) -> String {
    for (unit, per) in [
        ("PiB", 1u64 << 50),
        ("TiB", 1 << 40),
        ("GiB", 1 << 30),
        ("MiB", 1 << 20),
        ("KiB", 1 << 10),
    ] {
        if bytes >= per && bytes.is_multiple_of(per) {
            return format!("{}{unit}", bytes / per);
        }
    }
    format!("{bytes}B")
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: Duration = Duration::from_secs(86_400);
    const INTERVAL: DurationRange =
        DurationRange::seconds("--commit-interval", Duration::from_millis(1), DAY);
    const BYTES: SizeRange = SizeRange::bytes("--max-job-bytes", 1, 1 << 40);

    #[test]
    fn durations_take_units_fractions_and_bare_seconds() {
        let s = Duration::from_secs;
        for (text, want) in [
            ("90", s(90)),
            ("1.5", Duration::from_millis(1500)),
            ("30s", s(30)),
            ("250ms", Duration::from_millis(250)),
            ("10m", s(600)),
            ("10 min", s(600)),
            ("2h", s(7200)),
            ("1d", DAY),
            ("1e3", s(1000)),
            (" 2H ", s(7200)),
        ] {
            assert_eq!(INTERVAL.parse(text).unwrap(), want, "{text}");
        }
        assert_eq!(
            INTERVAL.bare_millis().parse("1000").unwrap(),
            Duration::from_secs(1)
        );
    }

    #[test]
    fn extreme_durations_are_refused_with_their_named_range() {
        for text in [
            "1e308",
            "-1",
            "0",
            "2d",
            "inf",
            "NaN",
            "1e-9",
            "18446744073709551616",
        ] {
            let e = INTERVAL.parse(text).unwrap_err().to_string();
            assert!(
                e.starts_with("--commit-interval")
                    && e.contains("from 1ms to 1d")
                    && e.contains(text.trim()),
                "{text}: {e}"
            );
        }
        for n in [1e308, f64::INFINITY, f64::NAN, -0.5, 0.0] {
            let e = INTERVAL.from_number(n).unwrap_err().to_string();
            assert!(e.contains("from 1ms to 1d"), "{n}: {e}");
        }
        assert!(INTERVAL
            .parse("5y")
            .unwrap_err()
            .to_string()
            .contains("unknown unit \"y\""));
        assert!(INTERVAL
            .parse("s")
            .unwrap_err()
            .to_string()
            .contains("not a number"));
        assert_eq!(
            INTERVAL.from_number(0.25).unwrap(),
            Duration::from_millis(250)
        );
    }

    #[test]
    fn json_takes_numbers_and_strings_through_the_same_checks() {
        let read = |v: serde_json::Value| INTERVAL.deserialize(v).map_err(|e| e.to_string());
        assert_eq!(
            read(serde_json::json!(0.2)).unwrap(),
            Duration::from_millis(200)
        );
        assert_eq!(
            read(serde_json::json!(60)).unwrap(),
            Duration::from_secs(60)
        );
        assert_eq!(
            read(serde_json::json!("2h")).unwrap(),
            Duration::from_secs(7200)
        );
        for (bad, shown) in [
            (serde_json::json!(1e308), "\"1e308\""),
            (serde_json::json!(-3), "\"-3\""),
            (serde_json::json!("1e308"), "\"1e308\""),
        ] {
            let e = read(bad.clone()).unwrap_err();
            assert!(
                e.contains("from 1ms to 1d") && e.contains(shown),
                "{bad}: {e}"
            );
        }
        assert!(read(serde_json::json!([1]))
            .unwrap_err()
            .contains("a number of seconds"));
        let mut out = serde_json::Serializer::new(Vec::new());
        serialize_secs(&Duration::from_millis(1500), &mut out).unwrap();
        assert_eq!(out.into_inner(), b"1.5");
    }

    #[test]
    fn sizes_take_binary_units_either_spelling() {
        for (text, want) in [
            ("1048576", 1u64 << 20),
            ("512MiB", 512 << 20),
            ("500MB", 500 << 20),
            ("4G", 4 << 30),
            ("1.5GiB", 3 << 29),
            ("24gib", 24 << 30),
            ("7 b", 7),
        ] {
            assert_eq!(BYTES.parse(text).unwrap(), want, "{text}");
        }
        assert_eq!(BYTES.bare_mib().parse("256").unwrap(), 256 << 20);
    }

    #[test]
    fn extreme_sizes_are_refused_with_their_named_range() {
        for text in [
            "0",
            "2TiB",
            "18446744073709551615PiB",
            "1e308",
            "-1",
            "nan",
            "3 bananas",
            "GiB",
        ] {
            let e = BYTES.parse(text).unwrap_err().to_string();
            assert!(
                e.starts_with("--max-job-bytes") && e.contains("from 1B to 1TiB"),
                "{text}: {e}"
            );
        }
        assert!(BYTES.check(2 << 40).is_err());
        assert_eq!(BYTES.check(5).unwrap(), 5);
    }

    #[test]
    fn shows_values_in_their_largest_whole_unit() {
        assert_eq!(show_duration(DAY), "1d");
        assert_eq!(show_duration(Duration::from_secs(90)), "90s");
        assert_eq!(show_duration(Duration::from_millis(1500)), "1500ms");
        assert_eq!(show_duration(Duration::ZERO), "0s");
        assert_eq!(show_size(24 << 30), "24GiB");
        assert_eq!(show_size(1536 << 10), "1536KiB");
        assert_eq!(show_size(7), "7B");
    }

    #[test]
    fn counts_past_their_range_are_refused_naming_it() {
        const THREADS: CountRange = CountRange::new("decode_threads", 1, 1024);
        assert_eq!(THREADS.parse(" 16 ").unwrap(), 16);
        assert_eq!(THREADS.check(1024).unwrap(), 1024);
        for text in [
            "0",
            "1025",
            "100000",
            "18446744073709551616",
            "-1",
            "2.5",
            "",
            "x",
        ] {
            let e = THREADS.parse(text).unwrap_err().to_string();
            assert!(
                e.starts_with("decode_threads") && e.contains("a whole number from 1 to 1024"),
                "{text}: {e}"
            );
        }
        let e = THREADS.check(1 << 40).unwrap_err().to_string();
        assert_eq!(
            e,
            "decode_threads \"1099511627776\": out of range; expected a whole number from 1 to 1024"
        );
    }
}
