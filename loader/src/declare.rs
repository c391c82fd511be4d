//! The macro that declares an options struct once, as DataFusion's `config_namespace!` does:
//! each option's doc, type, default and range stand together, and the struct, its `Default`,
//! its serde form (JSON keys = field names, a key left out takes the default, an unknown key is
//! refused), the check of every value against its range and the listing that Python shows
//! ([`OptionDoc`]) all come from that one place.
use std::fmt;
use std::time::Duration;

use hslake_schemas::units::{show_duration, show_size, CountRange, DurationRange, SizeRange};
use hslake_schemas::SchemaError;

/// One option as users name it, with its documentation (what `hslake.loader_options()` lists).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OptionDoc {
    /// The field name, which is also the JSON key and the Python keyword.
    pub name: &'static str,
    /// The doc comment, its lines joined by `\n`.
    pub doc: &'static str,
    /// The values it takes.
    pub range: OptionRange,
}

impl OptionDoc {
    /// The doc comment as one line of prose, ending with the range where it is not the type's.
    pub fn text(&self) -> String {
        let doc = self.doc.split_whitespace().collect::<Vec<_>>().join(" ");
        match self.range {
            OptionRange::Any => doc,
            r => format!("{doc} Range: {r}."),
        }
    }
}

/// The values an option takes, stated once in its declaration. A value outside is refused by
/// the house ranges of `hslake_schemas::units` ([`CountRange`], [`SizeRange`],
/// [`DurationRange`]), whose error names the option, the value and the range. Each bound is
/// one a real run never meets, and low enough that the option alone (threads spawned, padding
/// allocated, channel slots) cannot exhaust the machine.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum OptionRange {
    /// Whole numbers from `min` to `max`.
    Count {
        /// Smallest value taken.
        min: u64,
        /// Largest value taken.
        max: u64,
    },
    /// Bytes from `min` to `max`.
    Bytes {
        /// Smallest value taken.
        min: u64,
        /// Largest value taken.
        max: u64,
    },
    /// Seconds, given as a number, from `min` to `max`.
    Seconds {
        /// Smallest value taken.
        min: Duration,
        /// Largest value taken.
        max: Duration,
    },
    /// Every value of its type: a switch, one of named choices, capture points, a seed.
    Any,
}

/// Whole numbers from `min` to `max` (for declarations).
pub(crate) const fn count(min: u64, max: u64) -> OptionRange {
    OptionRange::Count { min, max }
}

/// Bytes from `min` to `max` (for declarations).
pub(crate) const fn bytes(min: u64, max: u64) -> OptionRange {
    OptionRange::Bytes { min, max }
}

/// Seconds from `min` to `max` milliseconds (for declarations).
pub(crate) const fn millis(min: u64, max: u64) -> OptionRange {
    OptionRange::Seconds {
        min: Duration::from_millis(min),
        max: Duration::from_millis(max),
    }
}

/// Every value of its type (for declarations).
pub(crate) const ANY: OptionRange = OptionRange::Any;

impl OptionRange {
    /// Check a whole number given to option `name`.
    pub fn check_whole(&self, name: &'static str, v: u64) -> Result<(), SchemaError> {
        match *self {
            OptionRange::Count { min, max } => CountRange::new(name, min, max).check(v).map(drop),
            OptionRange::Bytes { min, max } => SizeRange::bytes(name, min, max).check(v).map(drop),
            OptionRange::Seconds { .. } => self.check_seconds(name, v as f64),
            OptionRange::Any => Ok(()),
        }
    }

    /// Check a number of seconds given to option `name`.
    pub fn check_seconds(&self, name: &'static str, v: f64) -> Result<(), SchemaError> {
        match *self {
            OptionRange::Seconds { min, max } => DurationRange::seconds(name, min, max)
                .from_number(v)
                .map(drop),
            OptionRange::Any => Ok(()),
            // Its text is what a whole-number range refuses or takes.
            _ => self.check_text(name, &v.to_string()),
        }
    }

    /// Check a value of option `name` as text (a negative number, a fraction).
    fn check_text(&self, name: &'static str, text: &str) -> Result<(), SchemaError> {
        match *self {
            OptionRange::Count { min, max } => {
                CountRange::new(name, min, max).parse(text).map(drop)
            }
            OptionRange::Bytes { min, max } => {
                SizeRange::bytes(name, min, max).parse(text).map(drop)
            }
            OptionRange::Seconds { min, max } => {
                DurationRange::seconds(name, min, max).parse(text).map(drop)
            }
            OptionRange::Any => Ok(()),
        }
    }
}

impl fmt::Display for OptionRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            OptionRange::Count { min, max } => write!(f, "{min} to {max}"),
            OptionRange::Bytes { min, max } => {
                write!(f, "{} to {}", show_size(min), show_size(max))
            }
            OptionRange::Seconds { min, max } => write!(
                f,
                "{} to {} (seconds)",
                show_duration(min),
                show_duration(max)
            ),
            OptionRange::Any => f.write_str("any value of its type"),
        }
    }
}

/// An option's value, checked against its declared [`OptionRange`].
pub trait InRange {
    /// `Ok` where this value of option `name` lies in `range`.
    fn check_in(&self, name: &'static str, range: &OptionRange) -> Result<(), SchemaError>;
}

impl InRange for u64 {
    fn check_in(&self, name: &'static str, range: &OptionRange) -> Result<(), SchemaError> {
        range.check_whole(name, *self)
    }
}

impl InRange for usize {
    fn check_in(&self, name: &'static str, range: &OptionRange) -> Result<(), SchemaError> {
        range.check_whole(name, *self as u64)
    }
}

impl InRange for i64 {
    fn check_in(&self, name: &'static str, range: &OptionRange) -> Result<(), SchemaError> {
        match u64::try_from(*self) {
            Ok(v) => range.check_whole(name, v),
            Err(_) => range.check_text(name, &self.to_string()),
        }
    }
}

impl InRange for f64 {
    fn check_in(&self, name: &'static str, range: &OptionRange) -> Result<(), SchemaError> {
        range.check_seconds(name, *self)
    }
}

impl<T: InRange> InRange for Option<T> {
    fn check_in(&self, name: &'static str, range: &OptionRange) -> Result<(), SchemaError> {
        self.as_ref().map_or(Ok(()), |v| v.check_in(name, range))
    }
}

/// Types whose every value is in range: their range is [`OptionRange::Any`]; a numeric range
/// declared for one is a mistake in the declaration, refused for every value.
macro_rules! any_value {
    ($($ty:ty),* $(,)?) => {
        $(impl $crate::declare::InRange for $ty {
            fn check_in(
                &self,
                name: &'static str,
                range: &$crate::declare::OptionRange,
            ) -> Result<(), hslake_schemas::SchemaError> {
                match range {
                    $crate::declare::OptionRange::Any => Ok(()),
                    r => Err(hslake_schemas::SchemaError::Quantity {
                        name: name.to_string(),
                        value: format!("{self:?}"),
                        problem: "is not a number".into(),
                        expected: format!("{r}"),
                    }),
                }
            }
        })*
    };
}

pub(crate) use any_value;

/// Declare an options struct: `pub name: Type = default, in range,` per field, each after its
/// doc comment and, where the JSON form needs it, `#[serde(...)]` attributes (after the doc
/// comment); the range is an [`OptionRange`] (`count(1, 1024)`, `bytes(..)`, `millis(..)`,
/// `ANY`). Generates the struct (serde, `Debug`, `Clone`, `PartialEq`), its `Default` from the
/// declared defaults (each field's rustdoc names its default and range), `OPTIONS`, the
/// [`OptionDoc`] of every field in declaration order, and `check_ranges`, which refuses the
/// first value outside its range.
macro_rules! declare_options {
    (
        $(#[doc = $struct_doc:literal])*
        pub struct $name:ident {
            $(
                $(#[doc = $doc:literal])+
                $(#[serde($($serde:tt)*)])*
                pub $field:ident: $ty:ty = $default:expr, in $range:expr,
            )*
        }
    ) => {
        $(#[doc = $struct_doc])*
        #[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
        #[serde(default, deny_unknown_fields)]
        pub struct $name {
            $(
                $(#[doc = $doc])+
                #[doc = ""]
                #[doc = concat!("Default: `", stringify!($default), "`. Range: `", stringify!($range), "`.")]
                $(#[serde($($serde)*)])*
                pub $field: $ty,
            )*
        }

        impl Default for $name {
            fn default() -> Self {
                $name {
                    $($field: $default,)*
                }
            }
        }

        impl $name {
            /// Every option, in declaration order, with its doc comment.
            pub const OPTIONS: &'static [$crate::declare::OptionDoc] = &[
                $($crate::declare::OptionDoc {
                    name: stringify!($field),
                    doc: concat!($($doc, "\n"),+),
                    range: $range,
                },)*
            ];

            /// Refuse the first value outside its option's declared range, naming the option,
            /// the value and the range.
            pub fn check_ranges(&self) -> Result<(), hslake_schemas::SchemaError> {
                $($crate::declare::InRange::check_in(&self.$field, stringify!($field), &$range)?;)*
                Ok(())
            }
        }
    };
}

pub(crate) use declare_options;

#[cfg(test)]
mod tests {
    use super::*;

    any_value!(String);

    declare_options! {
        /// Options of a test.
        pub struct Demo {
            /// How many.
            /// Two lines of doc.
            pub count: usize = 3, in count(1, 10),
            /// Which name.
            #[serde(rename = "label")]
            pub name: Option<String> = None, in ANY,
            /// How long.
            pub wait: f64 = 1.0, in millis(1, 60_000),
        }
    }

    #[test]
    fn defaults_docs_and_serde_come_from_the_one_declaration() {
        assert_eq!(
            Demo::default(),
            Demo {
                count: 3,
                name: None,
                wait: 1.0,
            }
        );
        let names: Vec<&str> = Demo::OPTIONS.iter().map(|o| o.name).collect();
        assert_eq!(names, ["count", "name", "wait"]);
        assert_eq!(
            Demo::OPTIONS[0].text(),
            "How many. Two lines of doc. Range: 1 to 10."
        );
        assert_eq!(Demo::OPTIONS[1].text(), "Which name.");
        assert_eq!(
            Demo::OPTIONS[2].text(),
            "How long. Range: 1ms to 1m (seconds)."
        );
        // Keys left out take the declared defaults; the serde attribute applies.
        let d: Demo = serde_json::from_str(r#"{"label": "x"}"#).unwrap();
        assert_eq!((d.count, d.name.as_deref()), (3, Some("x")));
        let err = serde_json::from_str::<Demo>(r#"{"cont": 1}"#).unwrap_err();
        assert!(err.to_string().contains("unknown field `cont`"), "{err}");
    }

    #[test]
    fn values_outside_their_declared_range_are_refused_naming_option_value_and_range() {
        assert!(Demo::default().check_ranges().is_ok());
        let refused = |d: Demo| d.check_ranges().unwrap_err().to_string();
        let e = refused(Demo {
            count: 11,
            ..Demo::default()
        });
        assert_eq!(
            e,
            "count \"11\": out of range; expected a whole number from 1 to 10"
        );
        let e = refused(Demo {
            wait: 1e308,
            ..Demo::default()
        });
        assert!(e.starts_with("wait \"1e308\": out of range"), "{e}");
        assert!(e.contains("from 1ms to 1m"), "{e}");
        for wait in [-1.0, f64::NAN, 0.0] {
            let e = refused(Demo {
                wait,
                ..Demo::default()
            });
            assert!(e.starts_with("wait"), "{wait}: {e}");
        }
        // A negative whole number against a count range.
        let e = (-5i64)
            .check_in("pad", &count(0, 9))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("not a whole number") && e.contains("from 0 to 9"),
            "{e}"
        );
        let e = "x"
            .to_string()
            .check_in("name", &count(1, 2))
            .unwrap_err()
            .to_string();
        assert!(e.contains("is not a number"), "{e}");
    }
}
