//! JSON Lines input files read line by line with a bound on a line's length, so that a file
//! without line breaks (`/dev/zero`, a binary file given by mistake) is refused instead of being
//! buffered until memory runs out. Capture's sample inputs and prepare's conversations both read
//! JSONL through this one reader.
use std::io::{BufRead, Read};

/// The longest JSONL line accepted: far above any real sample or conversation (a million tokens
/// is ~10 MB of JSON), and a bound on what a file without line breaks can make a reader buffer.
pub const MAX_LINE_BYTES: usize = 256 << 20;

/// One step of [`JsonLines::next_line`].
#[derive(Debug, PartialEq, Eq)]
pub enum JsonLine<'a> {
    /// A line that is not blank, without its line break.
    Text {
        /// 1-based line number (blank lines count).
        number: u64,
        /// The line's bytes.
        bytes: &'a [u8],
    },
    /// A line with no line break within the bound; the reader cannot go on past it.
    TooLong {
        /// 1-based line number.
        number: u64,
    },
}

/// The non-blank lines of a JSONL file, each at most `max_line` bytes before its line break.
pub struct JsonLines<R> {
    reader: R,
    max_line: usize,
    number: u64,
    buf: Vec<u8>,
}

impl<R: BufRead> JsonLines<R> {
    /// Reads `reader` line by line; `max_line` is usually [`MAX_LINE_BYTES`].
    pub fn new(reader: R, max_line: usize) -> Self {
        JsonLines {
            reader,
            max_line,
            number: 0,
            buf: Vec::new(),
        }
    }

    /// The next non-blank line, `None` at the end of the input. After [`JsonLine::TooLong`] the
    /// input is no longer read: the line's end is unknown, so nothing after it is a record.
    pub fn next_line(&mut self) -> std::io::Result<Option<JsonLine<'_>>> {
        loop {
            self.buf.clear();
            // One byte past the bound tells a line of exactly `max_line` bytes plus its break
            // from a longer one.
            let n = (&mut self.reader)
                .take(self.max_line as u64 + 1)
                .read_until(b'\n', &mut self.buf)?;
            if n == 0 {
                return Ok(None);
            }
            self.number += 1;
            if n > self.max_line && self.buf.last() != Some(&b'\n') {
                return Ok(Some(JsonLine::TooLong {
                    number: self.number,
                }));
            }
            if !self.buf.trim_ascii().is_empty() {
                break;
            }
        }
        let bytes = self.buf.strip_suffix(b"\n").unwrap_or(&self.buf);
        Ok(Some(JsonLine::Text {
            number: self.number,
            bytes,
        }))
    }

    /// Why a [`JsonLine::TooLong`] line is refused, naming the bound.
    pub fn too_long_reason(&self) -> String {
        format!(
            "longer than {} bytes without a line break; expected one JSON object per line (is \
             this a JSONL file?)",
            self.max_line
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(input: &[u8], max: usize) -> Vec<String> {
        let mut r = JsonLines::new(input, max);
        let mut out = vec![];
        while let Some(line) = r.next_line().unwrap() {
            match line {
                JsonLine::Text { number, bytes } => {
                    out.push(format!("{number}:{}", String::from_utf8_lossy(bytes)))
                }
                JsonLine::TooLong { number } => {
                    out.push(format!("{number}: too long"));
                    break;
                }
            }
        }
        out
    }

    #[test]
    fn numbers_lines_counting_blank_ones_and_drops_line_breaks() {
        assert_eq!(
            lines(b"{}\n\n  \n{\"a\": 1}\n{}", 16),
            ["1:{}", "4:{\"a\": 1}", "5:{}"]
        );
    }

    #[test]
    fn refuses_a_line_longer_than_the_bound_but_not_one_exactly_at_it() {
        assert_eq!(lines(b"1234\n12345\n", 4), ["1:1234", "2: too long"]);
        // The bound holds without a final line break too.
        assert_eq!(lines(b"12345", 4), ["1: too long"]);
        let r = JsonLines::new(&b""[..], 4);
        assert_eq!(
            r.too_long_reason(),
            "longer than 4 bytes without a line break; expected one JSON object per line (is \
             this a JSONL file?)"
        );
    }

    #[test]
    fn stops_at_a_bound_on_an_endless_line() {
        // /dev/zero: one line that never ends.
        let zero = std::io::BufReader::new(std::io::repeat(0));
        let mut r = JsonLines::new(zero, 1 << 16);
        assert_eq!(
            r.next_line().unwrap(),
            Some(JsonLine::TooLong { number: 1 })
        );
    }
}
