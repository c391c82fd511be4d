//! SpecForge 0.2 offline layout: one `torch.save` dict per sample,
//! `rows_{first}-{last}/data_{sample_id}.ckpt`, holding `input_ids` `[T]`, `loss_mask` `[T]`
//! (int64), `hidden_state` `[1, T, H]` (after the final norm) and `aux_hidden_state`
//! `[1, T, 3H]` — what its `OfflineEagle3Dataset` / offline reader loads with `torch.load`.
//! Its reader walks the tree for `*.ckpt`, so files written as `*.ckpt.tmp` and renamed when
//! complete are never seen half-written.
use std::path::{Path, PathBuf};

use super::torch_save::{fits_without_zip64, torch_save_bytes, TensorRef};
use super::{create_dir, io_err, write_atomic, TrainerSample, TrainerSink};
use crate::{ElemType, LoaderError};

/// Writes the SpecForge layout under one directory.
pub struct SpecforgeSink {
    dir: PathBuf,
    rows_per_dir: usize,
}

impl SpecforgeSink {
    /// Start an export into the (empty) directory `dir`, `rows_per_dir` samples per folder.
    pub fn new(dir: &Path, rows_per_dir: usize) -> Self {
        SpecforgeSink {
            dir: dir.to_path_buf(),
            rows_per_dir,
        }
    }

    fn folder(&self, index: usize) -> PathBuf {
        let first = index / self.rows_per_dir * self.rows_per_dir;
        self.dir
            .join(format!("rows_{first}-{}", first + self.rows_per_dir))
    }
}

fn i64_bytes(v: &[i64]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

impl TrainerSink for SpecforgeSink {
    fn write(&mut self, s: &TrainerSample<'_>) -> Result<(), LoaderError> {
        let n = s.input_ids.len();
        let h = *s.target.shape.last().unwrap_or(&0);
        let kh = *s.aux.shape.last().unwrap_or(&0);
        let folder = self.folder(s.index);
        let path = folder.join(format!("data_{}.ckpt", s.sample_id));
        if h == 0 || kh != 3 * h {
            return Err(io_err(
                &path,
                format!("SpecForge needs 3 aux layers of width {h} per token, got aux width {kh}"),
            ));
        }
        let size = s.aux.bytes().len() + s.target.bytes().len() + 16 * n;
        if !fits_without_zip64(size) {
            return Err(io_err(
                &path,
                format!(
                    "a sample of {size} bytes is over the 4 GiB a torch.save file without zip64 \
                     holds"
                ),
            ));
        }
        let (ids, mask) = (i64_bytes(&s.input_ids), i64_bytes(&s.loss_mask));
        let entries = [
            (
                "input_ids",
                TensorRef {
                    dtype: ElemType::I64,
                    shape: vec![n],
                    bytes: &ids,
                },
            ),
            (
                "loss_mask",
                TensorRef {
                    dtype: ElemType::I64,
                    shape: vec![n],
                    bytes: &mask,
                },
            ),
            (
                "hidden_state",
                TensorRef {
                    dtype: s.target.dtype,
                    shape: vec![1, n, h],
                    bytes: s.target.bytes(),
                },
            ),
            (
                "aux_hidden_state",
                TensorRef {
                    dtype: s.aux.dtype,
                    shape: vec![1, n, kh],
                    bytes: s.aux.bytes(),
                },
            ),
        ];
        if s.index.is_multiple_of(self.rows_per_dir) {
            create_dir(&folder)?;
        }
        write_atomic(&path, &torch_save_bytes(&entries))
    }

    fn finish(self: Box<Self>) -> Result<(), LoaderError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn folders_hold_rows_per_dir_samples_each() {
        let s = SpecforgeSink::new(Path::new("/out"), 5000);
        assert_eq!(s.folder(0), Path::new("/out/rows_0-5000"));
        assert_eq!(s.folder(4999), Path::new("/out/rows_0-5000"));
        assert_eq!(s.folder(5000), Path::new("/out/rows_5000-10000"));
    }
}
