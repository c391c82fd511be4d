//! DataFusion's built-in functions that can build large values, each made to check what it
//! would build before building it.
//!
//! A function "can grow" when its result can be larger than its arguments put together: a
//! count or length decides the size (`repeat`, `lpad`, `array_repeat`, `range`), one argument
//! is inserted per occurrence or element of another (`replace`, `regexp_replace`, `concat_ws`,
//! `array_to_string`, `to_char`), several values are joined into one (`concat`, `||`,
//! `make_array`, `array_concat`; nested, these double a value per level), or text expands by a
//! factor (`upper`, `translate`, `encode`). [`GROWING`] names each such function's rule
//! ([`growth::Growth`]); every other registered function is in [`BOUNDED`], with the reason
//! its result stays within its arguments. A test holds the two lists against the session's
//! registry, so a DataFusion upgrade that adds a function fails until it is classified.
//!
//! Each growing function is replaced in the session's registry by a [`CappedFn`] around it,
//! which works out the largest value and the total its call would build from the arguments
//! (before the function runs), refuses a value over the per-value cap, and reserves the total
//! in the query's memory pool ([`crate::budget::QueryBudget`]) while the function runs and,
//! shrunk to the result's size, for as long as the result lives ([`crate::budget::holding`]).
//! The SQL planner also makes built-in calls on its own (`OVERLAY(... PLACING ...)`, `[a, b]`,
//! `a || b`), and some functions simplify into others: [`CapRewrite`] and
//! [`CappedFn`]'s `simplify` wrap those too, and [`check_plan`] refuses a plan in which one
//! escaped. `CAST` is an expression, not a function: its result is at most a few times its
//! argument, fixed by the two types (a number as text), and does not compound.
//!
//! Aggregates (`string_agg`, `array_agg`) are not wrapped: their accumulators report their
//! size to the query's memory pool as they grow.
use std::sync::Arc;

use datafusion::common::Result;
use datafusion::execution::FunctionRegistry;
use datafusion::logical_expr::ScalarUDF;
use datafusion::prelude::SessionContext;

pub mod growth;
mod plan;
mod sizes;
mod wrapper;

use growth::Growth;
pub use plan::check_plan;
use wrapper::{capped, is_capped};
pub use wrapper::{CapRewrite, CappedFn};

/// Every built-in that can grow its result, with its rule (by name; aliases resolve to it).
pub const GROWING: &[(&str, Growth)] = &[
    ("concat", Growth::Sum),
    ("overlay", Growth::Sum),
    ("make_array", Growth::Sum),
    ("array_concat", Growth::Sum),
    ("array_append", Growth::Sum),
    ("array_prepend", Growth::Sum),
    ("array_union", Growth::Sum),
    ("struct", Growth::Sum),
    ("named_struct", Growth::Sum),
    ("map", Growth::Sum),
    (CONCAT_OPERATOR, Growth::Sum),
    ("concat_ws", Growth::Separated),
    ("repeat", Growth::Repeat),
    ("lpad", Growth::Pad),
    ("rpad", Growth::Pad),
    ("replace", Growth::Replace),
    ("regexp_replace", Growth::RegexpReplace),
    ("regexp_match", Growth::Captures),
    ("upper", Growth::Scale(3)),
    ("lower", Growth::Scale(3)),
    ("initcap", Growth::Scale(3)),
    ("translate", Growth::Scale(4)),
    ("encode", Growth::Scale(2)),
    ("to_char", Growth::Format),
    ("string_to_array", Growth::Split),
    ("array_repeat", Growth::ArrayRepeat),
    ("array_resize", Growth::ArrayResize),
    ("range", Growth::Series),
    ("generate_series", Growth::Series),
    ("array_replace", Growth::ArrayReplace),
    ("array_replace_n", Growth::ArrayReplace),
    ("array_replace_all", Growth::ArrayReplace),
    ("array_to_string", Growth::Join),
    ("arrays_zip", Growth::Zip),
];

/// The rule of the built-in called `name`, if it can grow its result.
pub fn growth_of(name: &str) -> Option<Growth> {
    GROWING.iter().find(|(n, _)| *n == name).map(|(_, g)| *g)
}

/// Registered functions whose result cannot outgrow their arguments, by why:
#[rustfmt::skip]
pub const BOUNDED: &[&str] = &[
    // A number, boolean, date, time or interval.
    "abs", "acos", "acosh", "array_any_match", "array_avg", "array_distance", "array_dims",
    "empty", "array_has", "array_has_all", "array_has_any", "array_length", "array_ndims",
    "array_position", "array_product", "array_sum", "ascii", "asin", "asinh", "atan", "atan2",
    "atanh", "bit_length", "cardinality", "cbrt", "ceil", "character_length", "contains", "cos",
    "cosh", "cosine_distance", "cot", "current_date", "current_time", "date_bin", "date_part",
    "date_trunc", "degrees", "ends_with", "exp", "factorial", "file_row_index", "find_in_set",
    "floor", "from_unixtime", "gcd", "inner_product", "isnan", "iszero", "lcm", "levenshtein",
    "ln", "log", "log10", "log2", "make_date", "make_time", "nanvl", "now", "octet_length",
    "pi", "power", "radians", "random", "regexp_count", "regexp_instr", "regexp_like", "round",
    "signum", "sin", "sinh", "sqrt", "starts_with", "strpos", "tan", "tanh", "to_date",
    "to_local_time", "to_time", "to_timestamp", "to_timestamp_micros", "to_timestamp_millis",
    "to_timestamp_nanos", "to_timestamp_seconds", "to_unixtime", "trunc",
    // Text of a size fixed by the function: a character, a number in hex, a UUID, the
    // engine's version.
    "chr", "to_hex", "uuid", "version",
    // Fixed by the schema, not by a value: a type, a field, metadata, a file name.
    "arrow_field", "arrow_metadata", "arrow_typeof", "input_file_name", "union_tag",
    "with_metadata",
    // A cast: at most a few times its argument, fixed by the two types (a number as text).
    "arrow_cast", "arrow_try_cast", "cast_to_type", "try_cast_to_type",
    // A part or a selection of one argument, or one of the arguments as it is.
    "array_any_value", "array_compact", "array_distinct", "array_element", "array_except",
    "array_filter", "array_first", "array_intersect", "array_max", "array_min",
    "array_pop_back", "array_pop_front", "array_remove", "array_remove_all", "array_remove_n",
    "array_reverse", "array_slice", "array_sort", "array_transform", "btrim", "coalesce",
    "decode", "flatten", "get_field", "greatest", "least", "left", "ltrim", "map_entries",
    "map_extract", "map_keys", "map_values", "nullif", "nvl", "nvl2", "reverse", "right",
    "rtrim", "split_part", "substr", "substr_index", "union_extract",
    // Element-wise arithmetic on lists of numbers: the longer list's length in numbers.
    "array_add", "array_normalize", "array_positions", "array_scale", "array_subtract",
];

/// The name of the function `a || b` becomes, so that it is capped like `concat`.
pub const CONCAT_OPERATOR: &str = "||";
/// Replace every growing built-in in `ctx`'s registry by its capped form, and add the rewrite
/// that caps the calls the SQL planner makes itself.
pub fn register(ctx: &SessionContext) -> Result<()> {
    let state = ctx.state();
    let mut builtins: Vec<Arc<ScalarUDF>> = state
        .scalar_functions()
        .values()
        .filter(|f| growth_of(f.name()).is_some() && !is_capped(f))
        .cloned()
        .collect();
    builtins.sort_by(|a, b| a.name().cmp(b.name()));
    builtins.dedup_by(|a, b| a.name() == b.name());
    for f in builtins {
        if let Some(capped) = capped(&f) {
            ctx.register_udf(capped);
        }
    }
    ctx.state_ref()
        .write()
        .register_function_rewrite(Arc::new(CapRewrite))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;
    use crate::{testdata, QueryLimits, QuerySession};

    #[test]
    fn every_registered_function_that_can_grow_is_capped_and_every_other_is_known_bounded() {
        let session = QuerySession::new().unwrap();
        let state = session.context().state();
        let ours = crate::udf::FUNCTION_NAMES;
        let (mut registered, mut unclassified, mut uncapped) =
            (BTreeSet::new(), BTreeSet::new(), BTreeSet::new());
        for f in state.scalar_functions().values() {
            let name = f.name();
            registered.insert(name.to_string());
            match growth_of(name) {
                Some(_) if !is_capped(f) => {
                    uncapped.insert(name.to_string());
                }
                Some(_) => {}
                None if BOUNDED.contains(&name) || ours.contains(&name) => {}
                None => {
                    unclassified.insert(name.to_string());
                }
            }
        }
        // Functions taking a lambda: their results are the lambda's values (capped by the
        // functions inside it) or a selection of their list.
        for f in state.higher_order_functions().values() {
            registered.insert(f.name().to_string());
            if !BOUNDED.contains(&f.name()) {
                unclassified.insert(f.name().to_string());
            }
        }
        assert!(
            unclassified.is_empty(),
            "registered functions in neither GROWING nor BOUNDED (query/src/capped/mod.rs): \
             {unclassified:?}; decide whether each can build a value larger than its arguments"
        );
        assert!(
            uncapped.is_empty(),
            "growing functions left uncapped: {uncapped:?}"
        );
        let stale: Vec<&str> = GROWING
            .iter()
            .map(|(n, _)| *n)
            .chain(BOUNDED.iter().copied())
            .filter(|n| *n != CONCAT_OPERATOR && !registered.contains(*n))
            .collect();
        assert!(stale.is_empty(), "classified but not registered: {stale:?}");
    }

    async fn four_rows(name: &str, limits: QueryLimits) -> QuerySession {
        let url = format!("memory://{name}");
        testdata::write(&url, hslake_schemas::DType::Bf16, 4, 1).await;
        let mut session = QuerySession::open(&url, None).await.unwrap();
        session.set_limits(limits);
        session
    }

    fn memory(bytes: usize) -> QueryLimits {
        QueryLimits {
            memory_per_query: Some(bytes),
            ..QueryLimits::default()
        }
    }

    #[tokio::test]
    async fn a_large_constant_is_refused_before_it_is_copied_into_every_row() {
        let session = four_rows("caps-constant", memory(64 << 20)).await;
        let text = "x".repeat(100_000);
        let e = session
            .query(&format!("SELECT '{text}' AS s FROM samples"))
            .await
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "query refused: it holds a constant of 97.7 KB, which DataFusion copies into each \
             row of a batch (up to 8192 rows); at most 64.0 KB is allowed (limit: 64.0 MB per \
             query, set by --query-memory)"
        );
    }

    #[tokio::test]
    async fn a_call_on_constants_is_folded_only_into_a_constant_any_batch_may_copy() {
        let session = four_rows("caps-fold", memory(64 << 20)).await;
        let optimized = |sql: &'static str| {
            let session = &session;
            async move {
                let plans = session.query(&format!("EXPLAIN {sql}")).await.unwrap();
                datafusion::arrow::util::pretty::pretty_format_batches(&plans)
                    .unwrap()
                    .to_string()
            }
        };
        // Up to 64 KiB (the query's memory over 8192 rows is less) it is folded ...
        let small = optimized("SELECT length(repeat('x', 60000)) AS n FROM samples").await;
        assert!(small.contains("Int32(60000) AS n"), "{small}");
        // ... past it, left to run with the query, where it builds one value per batch.
        let large = optimized("SELECT length(repeat('x', 100000)) AS n FROM samples").await;
        assert!(
            large.contains("repeat(Utf8(\"x\"), Int64(100000))"),
            "{large}"
        );
        let b = session
            .query("SELECT length(repeat('x', 100000)) AS n FROM samples")
            .await
            .unwrap();
        assert_eq!(b.iter().map(|b| b.num_rows()).sum::<usize>(), 4);
        // Copied into the table's 4 rows, 100 KB is well within the query's memory.
        let b = session
            .query("SELECT repeat('x', 100000) AS s FROM samples")
            .await
            .unwrap();
        assert_eq!(b.iter().map(|b| b.num_rows()).sum::<usize>(), 4);
    }

    #[tokio::test]
    async fn a_growing_constant_is_refused_by_name_before_it_is_built() {
        // Before: both `repeat`s were folded while the plan was made, into two constants
        // outside the memory pool that every later pass copied, and the query ran for a
        // minute against no limit before a check refused the plan.
        let limits = QueryLimits {
            max_value: Some(64 << 20),
            ..memory(64 << 20)
        };
        let session = four_rows("caps-bomb", limits).await;
        let e = session
            .query(
                "SELECT cardinality(make_array(repeat('x', 20000000), repeat('x', 20000000))) \
                 FROM samples",
            )
            .await
            .unwrap_err();
        // Left to run with the query, under its memory limit, whichever call reaches it first.
        assert!(matches!(e, crate::QueryError::Limit { .. }), "{e}");
        let e = e.to_string();
        assert!(e.starts_with("query stopped: "), "{e}");
        assert!(
            e.contains("(limit: 64.0 MB per query, set by --query-memory)"),
            "{e}"
        );
    }
}
