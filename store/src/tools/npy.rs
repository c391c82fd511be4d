//! Minimal `.npy` writing (format 1.0) and reading of little-endian C-order arrays: how
//! `hslake export` hands tensors to numpy and how real activations come into the benchmark.
use std::io::Write;
use std::path::Path;

use crate::tools::files;
use crate::{Result, StoreError};

/// Write a little-endian, C-order array as a version-1.0 `.npy` file, created anew: a name
/// that exists already (a symbolic link included, which is never followed) is refused, and a
/// file left incomplete by a failed write is removed.
pub fn write_npy(path: &Path, descr: &str, shape: &[usize], data: &[u8]) -> Result<()> {
    let dims = match shape {
        [n] => format!("({n},)"),
        _ => format!(
            "({})",
            shape
                .iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    let mut header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {dims}, }}");
    // The header is padded with spaces so that the data starts on a 64-byte boundary.
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let io = |e: std::io::Error| StoreError::Usage(format!("{}: {e}", path.display()));
    let mut f = files::create_new(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::AlreadyExists => StoreError::Usage(format!(
            "{}: already exists; an export never overwrites a file or writes through a link \
             (choose an empty directory)",
            path.display()
        )),
        _ => io(e),
    })?;
    let written = f
        .write_all(b"\x93NUMPY\x01\x00")
        .and_then(|()| f.write_all(&(header.len() as u16).to_le_bytes()))
        .and_then(|()| f.write_all(header.as_bytes()))
        .and_then(|()| f.write_all(data));
    if let Err(e) = written {
        let _ = std::fs::remove_file(path);
        return Err(io(e));
    }
    Ok(())
}

/// Read a `.npy` file written by numpy: (descr, shape, data bytes).
pub fn read_npy(path: &Path) -> Result<(String, Vec<usize>, Vec<u8>)> {
    let bad = |m: String| StoreError::Usage(format!("{}: {m}", path.display()));
    let b = std::fs::read(path).map_err(|e| bad(e.to_string()))?;
    if b.len() < 12 || &b[..6] != b"\x93NUMPY" {
        return Err(bad("not a .npy file".into()));
    }
    let (hlen, start) = match b[6] {
        1 => (u16::from_le_bytes([b[8], b[9]]) as usize, 10),
        2 | 3 => (u32::from_le_bytes([b[8], b[9], b[10], b[11]]) as usize, 12),
        v => return Err(bad(format!(".npy format version {v} is not supported"))),
    };
    let header = b
        .get(start..start + hlen)
        .and_then(|h| std::str::from_utf8(h).ok())
        .ok_or_else(|| bad("truncated or non-UTF-8 header".into()))?;
    let field = |key: &str| -> Result<&str> {
        let i = header
            .find(key)
            .ok_or_else(|| bad(format!("header has no {key}")))?;
        Ok(header[i + key.len()..].trim_start_matches([':', ' ', '\'']))
    };
    if field("'fortran_order'")?.starts_with("True") {
        return Err(bad("Fortran-order arrays are not supported".into()));
    }
    let descr = field("'descr'")?
        .split('\'')
        .next()
        .unwrap_or_default()
        .to_string();
    let shape_txt = field("'shape'")?;
    let (open, close) = shape_txt
        .find('(')
        .zip(shape_txt.find(')'))
        .ok_or_else(|| bad("header has no shape tuple".into()))?;
    let shape = shape_txt[open + 1..close]
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse::<usize>()
                .map_err(|_| bad(format!("bad shape dimension {s:?}")))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((descr, shape, b[start + hlen..].to_vec()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_back_what_it_writes() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("a.npy");
        write_npy(&p, "<u2", &[2, 3], &[1, 0, 2, 0, 3, 0, 4, 0, 5, 0, 6, 0]).unwrap();
        let (descr, shape, data) = read_npy(&p).unwrap();
        assert_eq!((descr.as_str(), shape, data.len()), ("<u2", vec![2, 3], 12));
        let err = write_npy(&p, "<u2", &[1], &[0, 0]).unwrap_err().to_string();
        assert!(err.contains("a.npy: already exists"), "{err}");
        assert_eq!(read_npy(&p).unwrap().1, vec![2, 3]);
    }
}
