//! The functions and filters transformers gives chat templates beyond Jinja's own: `tojson` as
//! Python's `json.dumps`, `raise_exception` and `strftime_now`. `tojson` pays for the text it
//! builds in the rendering's fuel before building it, so an indent cannot make it allocate more
//! than the fuel allows.
use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Error, ErrorKind, State};

// The text `tojson` builds, paid for in fuel before it grows: minijinja charges a filter's
// result only once it exists, and an indent makes the output far larger than the value.
struct FueledText<'s, 'a, 'e> {
    state: &'s State<'a, 'e>,
    out: String,
    unpaid: usize,
}

impl FueledText<'_, '_, '_> {
    fn pay(&mut self, bytes: usize) -> Result<(), Error> {
        self.unpaid = self.unpaid.saturating_add(bytes);
        if self.unpaid >= 64 {
            self.state.consume_fuel((self.unpaid / 64) as u64)?;
            self.unpaid %= 64;
        }
        Ok(())
    }

    fn push_str(&mut self, s: &str) -> Result<(), Error> {
        self.pay(s.len())?;
        self.out.push_str(s);
        Ok(())
    }

    fn push_repeated(&mut self, c: char, n: usize) -> Result<(), Error> {
        self.pay(n)?;
        self.out.extend(std::iter::repeat_n(c, n));
        Ok(())
    }

    // The items of a list or the keys of a map, each paid for as minijinja's own filters pay for
    // the items they visit (as much as 32 bytes).
    fn items(&mut self, v: &Value) -> Result<Vec<Value>, Error> {
        let mut items = vec![];
        for item in v.try_iter()? {
            self.pay(32)?;
            items.push(item);
        }
        Ok(items)
    }
}

/// Deepest nesting `tojson` serialises: a bound on its recursion (Python's own json stops at
/// its recursion limit), the guard's bound on every value.
const TOJSON_MAX_DEPTH: usize = crate::guard::MAX_DEPTH;

// Python's json.dumps(x, ensure_ascii=False, indent=indent, sort_keys=sort_keys), which
// transformers installs as `tojson` in place of Jinja's HTML-escaping one.
fn py_json(
    v: &Value,
    indent: Option<usize>,
    sort_keys: bool,
    level: usize,
    out: &mut FueledText,
) -> Result<(), Error> {
    if level > TOJSON_MAX_DEPTH {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("tojson: a value nested deeper than {TOJSON_MAX_DEPTH} levels"),
        ));
    }
    let newline = |out: &mut FueledText, level: usize| -> Result<(), Error> {
        if let Some(n) = indent {
            out.push_str("\n")?;
            out.push_repeated(' ', n.saturating_mul(level))?;
        }
        Ok(())
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    let json_str = |s: &str| {
        serde_json::to_string(s).map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))
    };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null")?,
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" })?,
        // minijinja prints numbers as Python does (2.0 stays 2.0).
        ValueKind::Number => out.push_str(&v.to_string())?,
        ValueKind::String => out.push_str(&json_str(v.as_str().unwrap_or_default())?)?,
        ValueKind::Seq | ValueKind::Iterable => {
            let items = out.items(v)?;
            if items.is_empty() {
                return out.push_str("[]");
            }
            out.push_str("[")?;
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep)?;
                }
                newline(out, level + 1)?;
                py_json(item, indent, sort_keys, level + 1, out)?;
            }
            newline(out, level)?;
            out.push_str("]")?;
        }
        ValueKind::Map => {
            let mut keys = out.items(v)?;
            if sort_keys {
                keys.sort();
            }
            if keys.is_empty() {
                return out.push_str("{}");
            }
            out.push_str("{")?;
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep)?;
                }
                newline(out, level + 1)?;
                let key = k
                    .as_str()
                    .map(str::to_string)
                    .unwrap_or_else(|| k.to_string());
                out.push_str(&json_str(&key)?)?;
                out.push_str(": ")?;
                py_json(&v.get_item(k)?, indent, sort_keys, level + 1, out)?;
            }
            newline(out, level)?;
            out.push_str("}")?;
        }
        _ => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: cannot serialise a value of kind {}", v.kind()),
            ))
        }
    }
    Ok(())
}

pub(crate) fn tojson(state: &State, v: Value, kwargs: Kwargs) -> Result<String, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    if ensure_ascii == Some(true) {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "tojson: ensure_ascii=True is not supported",
        ));
    }
    kwargs.assert_all_used()?;
    let mut out = FueledText {
        state,
        out: String::new(),
        unpaid: 0,
    };
    py_json(&v, indent, sort_keys.unwrap_or(false), 0, &mut out)?;
    Ok(out.out)
}

pub(crate) fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

pub(crate) fn strftime_now(format: String) -> Result<String, Error> {
    use std::fmt::Write;
    let mut out = String::new();
    // chrono reports an unknown specifier as a formatting error; write! surfaces it instead of
    // the panic `to_string` would raise.
    write!(out, "{}", chrono::Local::now().format(&format)).map_err(|_| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: invalid format {format:?}"),
        )
    })?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use crate::conversation::{Message, Role};
    use crate::limits::Limits;
    use crate::template::{test_template, ChatTemplate};

    fn render(text: &str) -> Result<String, crate::error::RecordError> {
        let t = test_template(text, Limits::default());
        let values = ChatTemplate::message_values(&[Message::new(Role::User, "x")]).unwrap();
        Ok(t.render(&values, false)?.text)
    }

    #[test]
    fn formats_tojson_like_python_json_dumps() {
        let r =
            render("{{ {'a': [1, 2.0, 'ü'], 'b': none} | tojson }}|{{ [1] | tojson(indent=2) }}")
                .unwrap();
        assert_eq!(r, "{\"a\": [1, 2.0, \"ü\"], \"b\": null}|[\n  1\n]");
    }

    #[test]
    fn refuses_values_nested_deeper_than_tojson_serialises() {
        // The template's guard refuses the nesting itself, at the depth tojson stops at.
        let e = render("{% set ns = namespace(x=[]) %}{% for i in range(600) %}{% set ns.x = [ns.x] %}{% endfor %}{{ ns.x | tojson }}")
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "chat template error: a value nested deeper than 512 levels"
        );
    }
}
