//! JSONL inputs: one JSON object per line, each read with serde_json straight into an input
//! record: the lists into the sample's types (no JSON value tree, which took 32 bytes a token),
//! every other field skipped. Lines are read through the schemas crate's bounded reader, so a
//! file without line breaks is refused instead of being buffered until memory runs out.
use std::fmt;
use std::fs::File;
use std::io::BufReader;
use std::path::Path;

use hslake_schemas::{JsonLine, JsonLines};
use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

use super::{input_err, Field, Ints, Location, RawId, Record, Rules};
use crate::error::{CaptureError, Result};

/// Hands every record of a JSONL file whose lines are at most `max_line` bytes to `each` until
/// it answers false; blank lines are skipped (but counted in line numbers).
pub(super) fn read_jsonl(
    path: &Path,
    max_line: usize,
    rules: Rules,
    each: &mut dyn FnMut(Record) -> Result<bool>,
) -> Result<()> {
    let io = |source| CaptureError::Io {
        path: path.to_path_buf(),
        source,
    };
    let reader = BufReader::with_capacity(1 << 20, File::open(path).map_err(io)?);
    let mut lines = JsonLines::new(reader, max_line);
    let mut scratch = Scratch::default();
    loop {
        let (number, bytes) = match lines.next_line().map_err(io)? {
            None => return Ok(()),
            Some(JsonLine::Text { number, bytes }) => (number, bytes),
            Some(JsonLine::TooLong { number }) => {
                let reason = lines.too_long_reason();
                return Err(input_err(path, &format!("line {number}"), reason));
            }
        };
        let location = Location::Line(number);
        let err = |m: String| input_err(path, &location.to_string(), m);
        if bytes.trim_ascii_start().first() != Some(&b'{') {
            // Valid JSON of another kind, or not JSON at all.
            return Err(err(match serde_json::from_slice::<IgnoredAny>(bytes) {
                Ok(_) => "expected a JSON object with \"input_ids\"".into(),
                Err(e) => format!("not valid JSON: {e}"),
            }));
        }
        let mut de = serde_json::Deserializer::from_slice(bytes);
        let parsed = RecordSeed {
            rules,
            scratch: &mut scratch,
        }
        .deserialize(&mut de)
        .and_then(|r| de.end().map(|()| r))
        .map_err(|e| err(format!("not valid JSON: {e}")))?;
        let record = Record {
            location,
            id: parsed.id,
            input_ids: parsed.input_ids,
            loss_mask: parsed.loss_mask,
        };
        if !each(record)? {
            return Ok(());
        }
    }
}

/// Lists are read into these and copied out at their exact length.
#[derive(Default)]
struct Scratch {
    tokens: Vec<i32>,
    mask: Vec<u8>,
}

struct Parsed {
    id: RawId,
    input_ids: Field<i32>,
    loss_mask: Field<u8>,
}

struct RecordSeed<'a> {
    rules: Rules,
    scratch: &'a mut Scratch,
}

impl<'de> DeserializeSeed<'de> for RecordSeed<'_> {
    type Value = Parsed;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Parsed, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for RecordSeed<'_> {
    type Value = Parsed;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object with \"input_ids\"")
    }

    // A key given twice counts as written last, as a JSON object read whole would have it.
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Parsed, A::Error> {
        let mut out = Parsed {
            id: RawId::None,
            input_ids: Field::Missing,
            loss_mask: Field::Missing,
        };
        let rules = self.rules;
        while let Some(key) = map.next_key::<Key>()? {
            match key {
                Key::InputIds => {
                    out.input_ids = map.next_value_seed(ListSeed {
                        buf: &mut self.scratch.tokens,
                        keep: rules.keep,
                        convert: |v| rules.token(v),
                    })?
                }
                Key::LossMask => {
                    out.loss_mask = map.next_value_seed(ListSeed {
                        buf: &mut self.scratch.mask,
                        keep: rules.keep,
                        convert: Rules::mask,
                    })?
                }
                Key::Id => out.id = map.next_value_seed(IdSeed)?,
                Key::Other => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(out)
    }
}

/// The keys a record is read by; any other is skipped.
enum Key {
    InputIds,
    LossMask,
    Id,
    Other,
}

impl<'de> serde::Deserialize<'de> for Key {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Key, D::Error> {
        struct KeyVisitor;
        impl Visitor<'_> for KeyVisitor {
            type Value = Key;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a field name")
            }
            fn visit_str<E>(self, v: &str) -> Result<Key, E> {
                Ok(match v {
                    "input_ids" => Key::InputIds,
                    "loss_mask" => Key::LossMask,
                    "id" => Key::Id,
                    _ => Key::Other,
                })
            }
        }
        d.deserialize_identifier(KeyVisitor)
    }
}

/// A list of integers (booleans count as 0 and 1), converted by `convert`; anything else is a
/// [`Field::Bad`], null a [`Field::Missing`].
struct ListSeed<'a, T, C> {
    buf: &'a mut Vec<T>,
    keep: usize,
    convert: C,
}

impl<'de, T: Clone, C: Fn(i64) -> Option<T>> DeserializeSeed<'de> for ListSeed<'_, T, C> {
    type Value = Field<T>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Field<T>, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de, T: Clone, C: Fn(i64) -> Option<T>> Visitor<'de> for ListSeed<'_, T, C> {
    type Value = Field<T>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a list of integers")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Field<T>, A::Error> {
        self.buf.clear();
        let (mut len, mut first_bad) = (0, None);
        while let Some(element) = seq.next_element::<Element>()? {
            let Element::Int(v) = element else {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                return Ok(Field::Bad(String::new()));
            };
            match (self.convert)(v) {
                Some(c) if len < self.keep => self.buf.push(c),
                Some(_) => {}
                None => {
                    first_bad.get_or_insert((len, v));
                }
            }
            len += 1;
        }
        Ok(Field::List(Ints {
            kept: self.buf.clone(),
            len,
            first_bad,
        }))
    }

    fn visit_unit<E>(self) -> Result<Field<T>, E> {
        Ok(Field::Missing)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Field<T>, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Field::Bad(String::new()))
    }

    fn visit_bool<E>(self, _: bool) -> Result<Field<T>, E> {
        Ok(Field::Bad(String::new()))
    }

    fn visit_i64<E>(self, _: i64) -> Result<Field<T>, E> {
        Ok(Field::Bad(String::new()))
    }

    fn visit_u64<E>(self, _: u64) -> Result<Field<T>, E> {
        Ok(Field::Bad(String::new()))
    }

    fn visit_f64<E>(self, _: f64) -> Result<Field<T>, E> {
        Ok(Field::Bad(String::new()))
    }

    fn visit_str<E>(self, _: &str) -> Result<Field<T>, E> {
        Ok(Field::Bad(String::new()))
    }
}

/// One element of a list: an integer (a boolean as 0 or 1), or something else.
enum Element {
    Int(i64),
    Other,
}

impl<'de> serde::Deserialize<'de> for Element {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Element, D::Error> {
        d.deserialize_any(ElementVisitor)
    }
}

struct ElementVisitor;

impl<'de> Visitor<'de> for ElementVisitor {
    type Value = Element;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an integer")
    }

    fn visit_i64<E>(self, v: i64) -> Result<Element, E> {
        Ok(Element::Int(v))
    }

    // Beyond i64: not an integer this reader takes.
    fn visit_u64<E>(self, v: u64) -> Result<Element, E> {
        Ok(i64::try_from(v).map_or(Element::Other, Element::Int))
    }

    fn visit_bool<E>(self, v: bool) -> Result<Element, E> {
        Ok(Element::Int(v.into()))
    }

    fn visit_f64<E>(self, _: f64) -> Result<Element, E> {
        Ok(Element::Other)
    }

    fn visit_str<E>(self, _: &str) -> Result<Element, E> {
        Ok(Element::Other)
    }

    fn visit_unit<E>(self) -> Result<Element, E> {
        Ok(Element::Other)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Element, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Element::Other)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Element, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Element::Other)
    }
}

/// An `id`: an integer, a string, null, or something the error names.
struct IdSeed;

impl<'de> DeserializeSeed<'de> for IdSeed {
    type Value = RawId;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<RawId, D::Error> {
        d.deserialize_any(self)
    }
}

impl IdSeed {
    fn bad(got: impl fmt::Display) -> RawId {
        RawId::Bad(format!("\"id\" must be an integer or a string, got {got}"))
    }
}

impl<'de> Visitor<'de> for IdSeed {
    type Value = RawId;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an integer or a string")
    }

    fn visit_i64<E>(self, v: i64) -> Result<RawId, E> {
        Ok(RawId::Int(v))
    }

    fn visit_u64<E>(self, v: u64) -> Result<RawId, E> {
        Ok(i64::try_from(v).map_or_else(|_| Self::bad(v), RawId::Int))
    }

    // Printed as JSON prints it (4.5, 1e300).
    fn visit_f64<E>(self, v: f64) -> Result<RawId, E> {
        Ok(match serde_json::Number::from_f64(v) {
            Some(n) => Self::bad(n),
            None => Self::bad(v),
        })
    }

    fn visit_bool<E>(self, v: bool) -> Result<RawId, E> {
        Ok(Self::bad(v))
    }

    fn visit_str<E>(self, _: &str) -> Result<RawId, E> {
        Ok(RawId::Str)
    }

    fn visit_unit<E>(self) -> Result<RawId, E> {
        Ok(RawId::None)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<RawId, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Self::bad("a list"))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawId, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Self::bad("an object"))
    }
}
