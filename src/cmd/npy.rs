//! Minimal `.npy` (format 1.0) writing and reading of little-endian C-order arrays.
use std::io::Write;
use std::path::Path;

use anyhow::{bail, Context, Result};

/// Write a little-endian, C-order array as a version-1.0 `.npy` file.
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
    let mut f =
        std::fs::File::create(path).with_context(|| format!("create {}", path.display()))?;
    f.write_all(b"\x93NUMPY\x01\x00")?;
    f.write_all(&(header.len() as u16).to_le_bytes())?;
    f.write_all(header.as_bytes())?;
    f.write_all(data)?;
    Ok(())
}

/// Read a `.npy` file written by numpy: (descr, shape, data bytes).
pub fn read_npy(path: &Path) -> Result<(String, Vec<usize>, Vec<u8>)> {
    let b = std::fs::read(path).with_context(|| format!("read {}", path.display()))?;
    if b.len() < 10 || &b[..6] != b"\x93NUMPY" {
        bail!("{}: not a .npy file", path.display());
    }
    let (hlen, start) = match b[6] {
        1 => (u16::from_le_bytes([b[8], b[9]]) as usize, 10),
        2 | 3 => (u32::from_le_bytes([b[8], b[9], b[10], b[11]]) as usize, 12),
        v => bail!(
            "{}: .npy format version {v} is not supported",
            path.display()
        ),
    };
    let header = std::str::from_utf8(b.get(start..start + hlen).context("truncated header")?)?;
    let field = |key: &str| -> Result<&str> {
        let i = header
            .find(key)
            .with_context(|| format!("{}: header has no {key}", path.display()))?;
        Ok(header[i + key.len()..].trim_start_matches([':', ' ', '\'']))
    };
    if field("'fortran_order'")?.starts_with("True") {
        bail!("{}: Fortran-order arrays are not supported", path.display());
    }
    let descr = field("'descr'")?
        .split('\'')
        .next()
        .unwrap_or_default()
        .to_string();
    let shape_txt = field("'shape'")?;
    let shape_txt = &shape_txt
        [shape_txt.find('(').context("shape")? + 1..shape_txt.find(')').context("shape")?];
    let shape = shape_txt
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse::<usize>()
                .with_context(|| format!("{}: bad shape", path.display()))
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
    }
}
