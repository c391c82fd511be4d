//! How large the values of a growing built-in can be, worked out from its arguments before it
//! runs: each rule reads the byte sizes of the argument values (and the counts, lengths and
//! texts that control the result) row by row and gives an upper bound of each result value.
//!
//! Sizes include what a value costs besides its bytes: 8 bytes of offset per string, binary
//! or list value (16 for a view), so that many empty values are not free.
use datafusion::arrow::array::{Array, AsArray};
use datafusion::arrow::compute::cast;
use datafusion::arrow::datatypes::{
    DataType, Int64Type, IntervalMonthDayNano, IntervalMonthDayNanoType, IntervalUnit, TimeUnit,
};
use datafusion::common::{Result, ScalarValue};
use datafusion::logical_expr::ColumnarValue;

use super::sizes::{
    element_bytes, list_elements, overhead, row_bytes, scalar_array, scalar_bytes, OFFSET,
};
use crate::budget::OutputBound;

/// Bytes of `i64` / timestamp elements of a series.
const ELEMENT: u64 = 8;
/// Most characters a value takes as text, per byte it takes in memory (`false` from one
/// byte, `-128` from one, a float16 from two).
const TEXT_PER_BYTE: u64 = 6;
/// Most bytes a `to_char` format expands to, per byte of the format: `%+` (two bytes) gives
/// 32 characters (`2001-07-08T00:34:60.026490+09:30`).
const FORMAT_EXPANSION: u64 = 16;

/// How a growing built-in's result relates to its arguments; [`super::growth_of`] names the
/// rule of each function.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Growth {
    /// Joins its arguments into one value (`concat`, `||`, `make_array`, `array_concat`, ...):
    /// at most their sizes added up, a constant argument counted in every row.
    Sum,
    /// `concat_ws(sep, a, b, ...)`: the arguments and a separator between each pair.
    Separated,
    /// `repeat(s, n)`: `s` n times.
    Repeat,
    /// `lpad` / `rpad(s, n[, fill])`: `s` cut or padded to n characters (4 bytes at most each).
    Pad,
    /// `replace(s, from, to)`: each occurrence of `from` (an empty one between every two
    /// characters) becomes `to`.
    Replace,
    /// `regexp_replace(s, pattern, replacement[, flags])`: every match (at most one per byte and
    /// one more) replaced; each `$n` / `\n` reference adds at most all of `s`, since matches do
    /// not overlap.
    RegexpReplace,
    /// `regexp_match(s, pattern[, flags])`: one capture of at most `s` per group of the pattern.
    Captures,
    /// At most this many times the first argument: case mappings (3: `ΐ` becomes three
    /// characters), `translate` (4: one byte to a four-byte character), `encode` (2: hex).
    Scale(u64),
    /// `to_char(value, format)`: the format expanded, in every row.
    Format,
    /// `string_to_array(s, delimiter[, null])`: at most one element per byte of `s` and one
    /// more, each with its offset.
    Split,
    /// `array_repeat(x, n)`: `x` n times.
    ArrayRepeat,
    /// `array_resize(a, n[, value])`: `a` plus n elements of `value` (or empty ones).
    ArrayResize,
    /// `range` / `generate_series(start, stop[, step])`: one element per step.
    Series,
    /// `array_replace`, `_n`, `_all(a, from, to[, n])`: every element may become `to`.
    ArrayReplace,
    /// `array_to_string(a, delimiter[, null])`: every element as text, a delimiter after each
    /// and the null text for each null.
    Join,
    /// `arrays_zip(a, b, ...)`: as many structs as the longest list, each with a field of
    /// every list (empty where a list is shorter).
    Zip,
}

impl Growth {
    /// The bound of the values a call with `args` builds for a batch of `batch_rows` rows.
    /// When every argument is a constant the result is one constant, but whoever reads it
    /// copies it into each row of the batch, so it counts that many times in the total (a
    /// call made while constants are folded has a batch of one row).
    pub fn bound(self, args: &[ColumnarValue], batch_rows: usize) -> Result<OutputBound> {
        let constant = args.iter().all(|a| matches!(a, ColumnarValue::Scalar(_)));
        let mut bound = self.bound_rows(args, if constant { 1 } else { batch_rows })?;
        if constant {
            bound.total = bound.total.saturating_mul(batch_rows.max(1) as u64);
        }
        Ok(bound)
    }

    fn bound_rows(self, args: &[ColumnarValue], rows: usize) -> Result<OutputBound> {
        let sizes: Vec<PerRow> = args.iter().map(PerRow::sizes).collect();
        let overheads: Vec<u64> = args.iter().map(|a| overhead(&a.data_type())).collect();
        let size = |arg: usize, row: usize| sizes.get(arg).map_or(0, |s| s.get(row));
        // Bytes of the text, bytes or elements alone, without the value's own offset: what is
        // copied when the value is put inside another.
        let content = |arg: usize, row: usize| {
            size(arg, row).saturating_sub(overheads.get(arg).copied().unwrap_or(0))
        };
        let mut bound = OutputBound::default();
        match self {
            Growth::Sum => {
                for row in 0..rows {
                    bound.add(row, (0..args.len()).map(|a| size(a, row)).sum());
                }
            }
            Growth::Separated => {
                let joins = args.len().saturating_sub(2) as u64;
                for row in 0..rows {
                    let parts: u64 = (1..args.len()).map(|a| size(a, row)).sum();
                    bound.add(row, parts + joins.saturating_mul(content(0, row)));
                }
            }
            Growth::Repeat => {
                let n = PerRow::ints(args.get(1))?;
                for row in 0..rows {
                    bound.add(row, OFFSET + content(0, row).saturating_mul(n.get(row)));
                }
            }
            Growth::ArrayRepeat => {
                let n = PerRow::ints(args.get(1))?;
                for row in 0..rows {
                    bound.add(row, OFFSET + size(0, row).saturating_mul(n.get(row)));
                }
            }
            Growth::Pad => {
                let n = PerRow::ints(args.get(1))?;
                for row in 0..rows {
                    bound.add(row, size(0, row) + 4 * n.get(row));
                }
            }
            Growth::Replace => {
                for row in 0..rows {
                    let (s, from) = (content(0, row), content(1, row));
                    let hits = s / from.max(1) + 1;
                    bound.add(row, OFFSET + s + hits.saturating_mul(content(2, row)));
                }
            }
            Growth::RegexpReplace => {
                let refs = PerRow::counts(args.get(2), &['$', '\\']);
                for row in 0..rows {
                    let s = content(0, row);
                    let replaced = (s + 1).saturating_mul(content(2, row));
                    let captured = refs.get(row).saturating_mul(s);
                    bound.add(row, OFFSET + s + replaced + captured);
                }
            }
            Growth::Captures => {
                let groups = PerRow::counts(args.get(1), &['(']);
                for row in 0..rows {
                    let captures = groups.get(row) + 1;
                    bound.add(row, OFFSET + captures.saturating_mul(size(0, row)));
                }
            }
            Growth::Scale(factor) => {
                for row in 0..rows {
                    bound.add(row, OFFSET + factor.saturating_mul(content(0, row)));
                }
            }
            Growth::Format => {
                for row in 0..rows {
                    let format = content(1, row);
                    bound.add(row, OFFSET + FORMAT_EXPANSION.saturating_mul(format));
                }
            }
            Growth::Split => {
                for row in 0..rows {
                    let s = content(0, row);
                    bound.add(row, OFFSET + s + (s + 1).saturating_mul(OFFSET));
                }
            }
            Growth::ArrayResize => {
                let n = PerRow::ints(args.get(1))?;
                let empty = args
                    .first()
                    .map_or(OFFSET, |a| element_bytes(&child_type(&a.data_type())));
                for row in 0..rows {
                    let each = if args.len() > 2 { size(2, row) } else { empty };
                    bound.add(row, size(0, row) + n.get(row).saturating_mul(each));
                }
            }
            Growth::Series => {
                let steps = series_steps(args)?;
                for row in 0..rows {
                    bound.add(row, OFFSET + steps.get(row).saturating_mul(ELEMENT));
                }
            }
            Growth::ArrayReplace => {
                let elements = PerRow::elements(args.first(), false);
                for row in 0..rows {
                    let each = size(2, row);
                    bound.add(row, size(0, row) + elements.get(row).saturating_mul(each));
                }
            }
            Growth::Join => {
                let leaves = PerRow::elements(args.first(), true);
                let factor = args.first().map_or(1, |a| text_factor(&a.data_type()));
                for row in 0..rows {
                    let per_element = content(1, row) + content(2, row);
                    let text = factor.saturating_mul(size(0, row));
                    bound.add(
                        row,
                        OFFSET + text + leaves.get(row).saturating_mul(per_element),
                    );
                }
            }
            Growth::Zip => {
                let lengths: Vec<PerRow> = args
                    .iter()
                    .map(|a| PerRow::elements(Some(a), false))
                    .collect();
                let empties: u64 = args
                    .iter()
                    .map(|a| element_bytes(&child_type(&a.data_type())))
                    .sum();
                for row in 0..rows {
                    let longest = lengths.iter().map(|l| l.get(row)).max().unwrap_or(0);
                    let lists: u64 = (0..args.len()).map(|a| size(a, row)).sum();
                    bound.add(row, lists + longest.saturating_mul(empties));
                }
            }
        }
        Ok(bound)
    }
}

/// The element type of a list type (`t` itself for anything else).
fn child_type(t: &DataType) -> DataType {
    match t {
        DataType::List(f)
        | DataType::LargeList(f)
        | DataType::FixedSizeList(f, _)
        | DataType::ListView(f)
        | DataType::LargeListView(f) => f.data_type().clone(),
        other => other.clone(),
    }
}

/// One figure per row of an argument: the same for every row of a constant.
enum PerRow {
    Same(u64),
    Rows(Vec<u64>),
}

impl PerRow {
    fn get(&self, row: usize) -> u64 {
        match self {
            PerRow::Same(v) => *v,
            PerRow::Rows(v) => v.get(row).copied().unwrap_or(0),
        }
    }

    /// Bytes of each value of `arg`.
    fn sizes(arg: &ColumnarValue) -> PerRow {
        match arg {
            ColumnarValue::Scalar(s) => PerRow::Same(scalar_bytes(s)),
            ColumnarValue::Array(a) => PerRow::Rows(row_bytes(a.as_ref())),
        }
    }

    /// An integer argument (a count or a length), negative and NULL as 0. A value that is not
    /// an integer counts as 0: the function itself refuses it.
    fn ints(arg: Option<&ColumnarValue>) -> Result<PerRow> {
        let Some(arg) = arg else {
            return Ok(PerRow::Same(0));
        };
        let to_count = |v: Option<i64>| v.map_or(0, |v| v.max(0) as u64);
        Ok(match arg {
            ColumnarValue::Scalar(s) => {
                PerRow::Same(to_count(s.cast_to(&DataType::Int64).ok().and_then(int64)))
            }
            ColumnarValue::Array(a) => match cast(a, &DataType::Int64) {
                Ok(ints) => PerRow::Rows(
                    ints.as_primitive::<Int64Type>()
                        .iter()
                        .map(to_count)
                        .collect(),
                ),
                Err(_) => PerRow::Same(0),
            },
        })
    }

    /// How many of `chars` each text value of `arg` holds.
    fn counts(arg: Option<&ColumnarValue>, chars: &[char]) -> PerRow {
        let count = |s: Option<&str>| s.map_or(0, |s| s.matches(chars).count() as u64);
        match arg {
            None => PerRow::Same(0),
            Some(ColumnarValue::Scalar(s)) => PerRow::Same(match s {
                ScalarValue::Utf8(v) | ScalarValue::LargeUtf8(v) | ScalarValue::Utf8View(v) => {
                    count(v.as_deref())
                }
                _ => 0,
            }),
            Some(ColumnarValue::Array(a)) => match cast(a, &DataType::LargeUtf8) {
                Ok(text) => PerRow::Rows(text.as_string::<i64>().iter().map(count).collect()),
                Err(_) => PerRow::Same(0),
            },
        }
    }

    /// Elements in each list of `arg` (with `leaves`, of the innermost lists).
    fn elements(arg: Option<&ColumnarValue>, leaves: bool) -> PerRow {
        match arg {
            None => PerRow::Same(0),
            Some(ColumnarValue::Scalar(s)) => match scalar_array(s) {
                Some(a) => PerRow::Same(
                    list_elements(a.as_ref(), leaves)
                        .first()
                        .copied()
                        .unwrap_or(0),
                ),
                None => PerRow::Same(1),
            },
            Some(ColumnarValue::Array(a)) => PerRow::Rows(list_elements(a.as_ref(), leaves)),
        }
    }
}

fn int64(s: ScalarValue) -> Option<i64> {
    match s {
        ScalarValue::Int64(v) => v,
        _ => None,
    }
}

/// Most bytes of text per byte of a value of type `t` (the innermost elements of a list):
/// text is copied as it is, anything else is written out.
fn text_factor(t: &DataType) -> u64 {
    match t {
        DataType::List(f)
        | DataType::LargeList(f)
        | DataType::FixedSizeList(f, _)
        | DataType::ListView(f)
        | DataType::LargeListView(f) => text_factor(f.data_type()),
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View => 1,
        _ => TEXT_PER_BYTE,
    }
}

/// Steps of each row of `range` / `generate_series`: integers (1 to 3 arguments), or dates and
/// timestamps with an interval step, counted in nanoseconds (as `i128`: a date in the year
/// 9000 is past what an `i64` of nanoseconds holds).
fn series_steps(args: &[ColumnarValue]) -> Result<PerRow> {
    let rows = args
        .iter()
        .find_map(|a| match a {
            ColumnarValue::Array(a) => Some(a.len()),
            ColumnarValue::Scalar(_) => None,
        })
        .unwrap_or(1);
    let nothing = || vec![None; rows];
    // Argument `i` as integers, times `scale`.
    let ints = |i: usize| -> Vec<Option<i128>> {
        let Some(arg) = args.get(i) else {
            return nothing();
        };
        let scale = nanos_per_unit(&arg.data_type());
        match arg.to_array(rows).map(|a| cast(&a, &DataType::Int64)) {
            Ok(Ok(a)) => a
                .as_primitive::<Int64Type>()
                .iter()
                .map(|v| v.map(|v| i128::from(v) * scale))
                .collect(),
            _ => nothing(),
        }
    };
    let interval = |i: usize| -> Vec<Option<i128>> {
        let step = DataType::Interval(IntervalUnit::MonthDayNano);
        match args
            .get(i)
            .map(|a| a.to_array(rows).map(|a| cast(&a, &step)))
        {
            Some(Ok(Ok(a))) => a
                .as_primitive::<IntervalMonthDayNanoType>()
                .iter()
                .map(|v| v.map(shortest_step))
                .collect(),
            _ => nothing(),
        }
    };
    let is_time = args.first().is_some_and(|a| {
        matches!(
            a.data_type(),
            DataType::Date32 | DataType::Date64 | DataType::Timestamp(..)
        )
    });
    let (start, stop, step) = match (is_time, args.len()) {
        (true, _) => (ints(0), ints(1), interval(2)),
        (false, 1) => (vec![Some(0); rows], ints(0), vec![Some(1); rows]),
        (false, 2) => (ints(0), ints(1), vec![Some(1); rows]),
        (false, _) => (ints(0), ints(1), ints(2)),
    };
    Ok(PerRow::Rows(
        (0..rows)
            .map(|i| match (start[i], stop[i], step[i]) {
                (Some(a), Some(b), Some(s)) if s != 0 => {
                    u64::try_from(((b - a) / s).max(0) + 1).unwrap_or(u64::MAX)
                }
                // A zero step is an error of the function itself; NULLs give NULL.
                _ => 0,
            })
            .collect(),
    ))
}

/// Nanoseconds per unit of a date or timestamp type (1 for an integer).
fn nanos_per_unit(t: &DataType) -> i128 {
    match t {
        DataType::Date32 => 86_400 * 1_000_000_000,
        DataType::Date64 | DataType::Timestamp(TimeUnit::Millisecond, _) => 1_000_000,
        DataType::Timestamp(TimeUnit::Second, _) => 1_000_000_000,
        DataType::Timestamp(TimeUnit::Microsecond, _) => 1_000,
        _ => 1,
    }
}

/// The shortest an interval step can be, in nanoseconds, with its sign: a month is at least
/// 28 days and a day at least 23 hours (a daylight-saving change). Mixed signs may cancel
/// out, so they count as the smallest step of their direction.
fn shortest_step(i: IntervalMonthDayNano) -> i128 {
    const DAY: i128 = 23 * 3600 * 1_000_000_000;
    let parts = [
        i128::from(i.months) * 28 * 24 * 3600 * 1_000_000_000,
        i128::from(i.days) * DAY,
        i128::from(i.nanoseconds),
    ];
    let all_same_sign = parts.iter().all(|&p| p >= 0) || parts.iter().all(|&p| p <= 0);
    let sum: i128 = parts.iter().sum();
    if all_same_sign || sum == 0 {
        sum
    } else {
        sum.signum()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use datafusion::arrow::array::{Int64Array, ListArray, StringArray};
    use datafusion::arrow::datatypes::Int32Type;

    use super::*;

    fn constant(v: ScalarValue) -> ColumnarValue {
        ColumnarValue::Scalar(v)
    }

    fn text(s: &str) -> ColumnarValue {
        constant(ScalarValue::Utf8(Some(s.into())))
    }

    fn int(n: i64) -> ColumnarValue {
        constant(ScalarValue::Int64(Some(n)))
    }

    #[test]
    fn repeat_is_the_text_times_its_count_in_each_row() {
        let texts = StringArray::from(vec!["ab", "abcd", "x"]);
        let counts = Int64Array::from(vec![Some(10), Some(-3), None]);
        let args = [
            ColumnarValue::Array(Arc::new(texts)),
            ColumnarValue::Array(Arc::new(counts)),
        ];
        let b = Growth::Repeat.bound(&args, 3).unwrap();
        // 20 bytes and an offset; a negative or NULL count builds an empty value.
        assert_eq!(
            b,
            OutputBound {
                largest: 28,
                row: 0,
                total: 28 + 8 + 8
            }
        );
    }

    #[test]
    fn a_constant_result_counts_once_per_row_of_its_batch() {
        let b = Growth::Repeat.bound(&[text("abc"), int(4)], 100).unwrap();
        assert_eq!((b.largest, b.total), (20, 2000));
    }

    #[test]
    fn replace_inserts_the_replacement_wherever_the_pattern_can_match() {
        let b = Growth::Replace
            .bound(&[text("aaaa"), text("a"), text("xyz")], 1)
            .unwrap();
        assert!((8 + 12..=8 + 4 + 5 * 3).contains(&b.largest), "{b:?}");
        // An empty pattern matches before every character and at the end.
        let b = Growth::Replace
            .bound(&[text("aaaa"), text(""), text("xyz")], 1)
            .unwrap();
        assert!(b.largest >= 8 + 4 + 5 * 3, "{b:?}");
    }

    #[test]
    fn a_list_is_its_elements_with_their_offsets() {
        let lists = ListArray::from_iter_primitive::<Int32Type, _, _>(vec![
            Some(vec![Some(1), Some(2), Some(3)]),
            None,
            Some(vec![]),
        ]);
        assert_eq!(row_bytes(&lists), vec![8 + 12, 8, 8]);
        assert_eq!(row_bytes(&StringArray::from(vec!["", "abc"])), vec![8, 11]);
    }

    #[test]
    fn an_integer_series_counts_its_steps() {
        let steps = |args: &[ColumnarValue]| Growth::Series.bound(args, 1).unwrap().largest;
        assert_eq!(steps(&[int(1), int(1_000_000)]), 8 + 8 * 1_000_000);
        assert_eq!(steps(&[int(10)]), 8 + 8 * 11);
        assert_eq!(steps(&[int(0), int(100), int(-1)]), 8 + 8);
        // A zero step is the function's own error.
        assert_eq!(steps(&[int(0), int(100), int(0)]), 8);
    }

    #[test]
    fn a_series_of_dates_counts_days_also_past_what_nanoseconds_hold() {
        let day = IntervalMonthDayNano::new(0, 1, 0);
        let args = [
            constant(ScalarValue::Date32(Some(10_957))),
            constant(ScalarValue::Date32(Some(2_557_000))),
            constant(ScalarValue::IntervalMonthDayNano(Some(day))),
        ];
        let days = (2_557_000 - 10_957) as u64;
        let b = Growth::Series.bound(&args, 1).unwrap();
        // A day counts as 23 hours at least (a daylight-saving change).
        assert!(
            (8 + 8 * days..=8 + 8 * (days * 24 / 23 + 1)).contains(&b.largest),
            "{b:?}"
        );
    }

    #[test]
    fn intervals_of_mixed_signs_count_as_the_smallest_step() {
        assert_eq!(shortest_step(IntervalMonthDayNano::new(1, -27, 0)), 1);
        assert_eq!(
            shortest_step(IntervalMonthDayNano::new(0, -1, 0)),
            -23 * 3600 * 1_000_000_000
        );
    }

    #[test]
    fn text_of_numbers_is_counted_wider_than_their_bytes() {
        let list = ListArray::from_iter_primitive::<Int32Type, _, _>(vec![Some(vec![Some(1); 4])]);
        let args = [ColumnarValue::Array(Arc::new(list)), text(", ")];
        let b = Growth::Join.bound(&args, 1).unwrap();
        // Four numbers of up to 6 characters per byte, and a delimiter after each.
        assert_eq!(b.largest, 8 + 6 * (8 + 16) + 4 * 2);
    }
}
