//! A bound on the memory one rendering of a chat template can take, beyond what minijinja's
//! fuel already pays for.
//!
//! minijinja charges fuel for the strings and lists it builds, before it builds them where it
//! knows their size. Two things escape that:
//! - **Lazy and shared values.** `a + b` of two lists, `[x] * n`, `x | chain(y)`, slices and the
//!   sequence filters build views that cost almost nothing until they are printed, copied or
//!   unpacked, and a list may hold one value many times (`[x, x]`), so doubling a value in a
//!   loop doubles its printed form while its memory stays small. Printing it (`~`, `| string`,
//!   a `{% set %}` block, any argument converted to a string) then allocates all of it at once,
//!   before anything is charged; `l + l` forty times made minijinja copy 2^33 items by itself.
//!   A namespace assigned into itself printed without end (a stack overflow).
//! - **Python's string methods** (minijinja-contrib), which charge nothing:
//!   `('x' * 10**8).split('')` built 10^8 strings.
//!
//! So the template is rendered from a guarded copy ([`rewrite`]): every expression that may
//! build a container — `+` and `*` unless a string is involved, list, tuple and map literals,
//! calls, filters other than those returning text, numbers or a value they were given, and
//! slices — is wrapped in [`SETTLE`], and every value assigned to a namespace's attribute in
//! [`ASSIGN`]. Settling ([`settle`]) replaces every lazy container in the value by a plain
//! copy, pays half a unit of fuel for each item it walks (minijinja's price of visiting an
//! item), and refuses the value, as out of fuel, if its printed form (strings counted six
//! bytes a byte, as they may print escaped) would take more bytes than the fuel left buys
//! (64 a unit). [`ASSIGN`] also refuses a value holding the namespace it is assigned to.
//!
//! Every value a template can name is therefore plain and prints within the fuel it had when
//! it was made, so no printing, copying or unpacking allocates more than that; Python's
//! methods that build strings or lists are checked the same way before they run, `sum` of
//! lists is done by copying, and the fuel pays for the walks, so doubling a value runs out of
//! fuel after about 23 doublings. The copy differs from the template only by these calls: the
//! same text and lines, the same output.
mod rewrite;
mod settle;

use minijinja::value::{Kwargs, Value, ValueKind, ValueOrKwargs};
use minijinja::{Environment, Error, ErrorKind, State};

pub(crate) use rewrite::guarded_copy;
pub(crate) use settle::MAX_DEPTH;
use settle::{ensure, Namespaces, Settler, ITEM_UNITS};

/// The prefix of the guard's names; a template or a template variable using it is refused.
pub(crate) const RESERVED: &str = "__hslake";
/// The function that settles a value.
const SETTLE: &str = "__hslake_settle";
/// The function that settles a value assigned to a namespace's attribute.
const ASSIGN: &str = "__hslake_assign";

/// Gives `env` the guard's functions, and the checked versions of `namespace`, `sum` and
/// Python's string methods.
pub(crate) fn install(env: &mut Environment<'_>) {
    env.add_function(SETTLE, |state: &State, v: Value| settle(state, v, None));
    env.add_function(ASSIGN, |state: &State, ns: Value, v: Value| {
        settle(state, v, Some(ns))
    });
    env.add_function("namespace", namespace);
    env.add_filter("sum", sum);
    env.set_unknown_method_callback(methods);
}

fn settle(state: &State, v: Value, forbidden: Option<Value>) -> Result<Value, Error> {
    if v.as_object().is_none() {
        return Ok(v);
    }
    Settler::new(state, forbidden).settle(&v)
}

// minijinja's `namespace()`, registered so that settling keeps it as it is.
fn namespace(state: &mut State, defaults: Option<ValueOrKwargs>) -> Result<Value, Error> {
    let ns = minijinja::functions::namespace(defaults)?;
    state
        .get_or_insert_extension(Namespaces::default())
        .0
        .push(ns.clone());
    Ok(ns)
}

// minijinja's `sum`, except that lists (a list `start`) are joined into one copy: minijinja adds
// them lazily one by one, and from 32 on copies the whole sum at every item.
fn sum(
    state: &State,
    values: Value,
    attribute: Option<&str>,
    start: Option<Value>,
    kwargs: Kwargs,
) -> Result<Value, Error> {
    let is_list = |v: &Value| matches!(v.kind(), ValueKind::Seq | ValueKind::Iterable);
    let given = start.clone().or(kwargs.get::<Option<Value>>("start")?);
    let Some(start) = given.filter(is_list) else {
        return minijinja::filters::sum(state, values, attribute, start, kwargs);
    };
    let attribute = match attribute {
        Some(a) => Some(a.to_string()),
        None => kwargs.get::<Option<String>>("attribute")?,
    };
    kwargs.assert_all_used()?;
    let mut out: Vec<Value> = start.try_iter()?.collect();
    for item in values.try_iter()? {
        let mut item = item;
        for part in attribute.iter().flat_map(|a| a.split('.')) {
            item = match part.parse::<i64>() {
                Ok(i) => item.get_item(&Value::from(i))?,
                Err(_) => item.get_attr(part)?,
            };
        }
        if item.is_undefined() {
            continue;
        }
        if !is_list(&item) {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("sum: cannot add {} to a list", item.kind()),
            ));
        }
        for x in item.try_iter()? {
            state.consume_fuel(1)?;
            out.push(x);
        }
    }
    Ok(Value::from(out))
}

// Python's string methods (minijinja-contrib), with those that can build far more than their
// input refused before they run when the fuel left cannot pay for the result.
fn methods(state: &mut State, value: &Value, method: &str, args: &[Value]) -> Result<Value, Error> {
    if let Some(s) = value.as_str() {
        let units = match method {
            "split" => Some(split_units(s, args)?),
            "splitlines" => {
                Some((s.matches('\n').count() as u64 + 1) * ITEM_UNITS + s.len() as u64)
            }
            "format" => {
                let printed = Settler::new(state, None).measure(&Value::from(args.to_vec()))?;
                let (fields, padding) = format_fields(s);
                Some(
                    fields
                        .saturating_mul(printed)
                        .saturating_add(padding)
                        .saturating_add(s.len() as u64),
                )
            }
            "join" => match args.first() {
                Some(items) => {
                    let printed = Settler::new(state, None).measure(items)?;
                    let n = items.len().unwrap_or(0) as u64;
                    Some(printed.saturating_add(n.saturating_mul(s.len() as u64)))
                }
                None => None,
            },
            _ => None,
        };
        if let Some(units) = units {
            ensure(state, units)?;
        }
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

// What `s.split(sep, maxsplit)` builds: a slot for each piece and the text. An empty separator
// is refused as Python refuses it (minijinja would split between every character).
fn split_units(s: &str, args: &[Value]) -> Result<u64, Error> {
    let sep = args.first().and_then(Value::as_str);
    if sep == Some("") {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "split: empty separator",
        ));
    }
    let pieces = match sep {
        Some(sep) => s.matches(sep).count() + 1,
        None => s.split_whitespace().count(),
    };
    let pieces = match args.get(1).and_then(Value::as_i64) {
        Some(max) if max >= 0 => pieces.min(max as usize + 1),
        _ => pieces,
    };
    Ok((pieces as u64).saturating_mul(ITEM_UNITS) + s.len() as u64)
}

// The replacement fields of a `str.format` template, and the padding their widths and
// precisions may ask for (`{:>1000000}`).
fn format_fields(s: &str) -> (u64, u64) {
    let (mut fields, mut padding) = (0u64, 0u64);
    let mut rest = s;
    while let Some(open) = rest.find('{') {
        rest = &rest[open + 1..];
        if let Some(escaped) = rest.strip_prefix('{') {
            rest = escaped;
            continue;
        }
        let field = &rest[..rest.find('}').unwrap_or(rest.len())];
        fields += 1;
        padding = field
            .split(|c: char| !c.is_ascii_digit())
            .filter_map(|d| d.parse::<u64>().ok())
            .fold(padding, u64::saturating_add);
    }
    (fields, padding)
}
