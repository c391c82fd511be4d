//! Safetensors checkpoints (one file or sharded with `model.safetensors.index.json`),
//! memory-mapped, with each rank copying only its slice of a weight out of the map.
use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
use tch::{Device, Kind, Tensor};

use crate::error::{CaptureError, Result, TensorProblem};
use crate::load::{Shard, TensorSource};
use crate::quant::config::Quantization;

struct MappedFile {
    path: PathBuf,
    map: Mmap,
    data_start: usize,
    infos: HashMap<String, safetensors::tensor::TensorInfo>,
}

/// One tensor's bytes inside the checkpoint's mapping, as stored.
pub(crate) struct RawTensor<'a> {
    /// The stored bytes (little-endian, row-major).
    pub bytes: &'a [u8],
    /// The stored dtype.
    pub kind: Kind,
    /// The full shape.
    pub shape: Vec<usize>,
}

/// A checkpoint directory's tensors, located by name, readable by slice.
pub(crate) struct Checkpoint {
    dir: PathBuf,
    files: Vec<MappedFile>,
    by_name: HashMap<String, usize>,
    quant: Quantization,
}

impl Checkpoint {
    /// Maps `model.safetensors`, or every file named by `model.safetensors.index.json`.
    pub fn open(dir: &Path) -> Result<Self> {
        let index = dir.join("model.safetensors.index.json");
        let names: Vec<String> = if index.exists() {
            let text = std::fs::read_to_string(&index).map_err(|source| CaptureError::Io {
                path: index.clone(),
                source,
            })?;
            let v: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| CaptureError::Safetensors {
                    path: index.clone(),
                    message: e.to_string(),
                })?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| CaptureError::Safetensors {
                    path: index.clone(),
                    message: "no \"weight_map\" object".into(),
                })?;
            let files: BTreeSet<String> = map
                .values()
                .filter_map(|f| f.as_str().map(str::to_string))
                .collect();
            files.into_iter().collect()
        } else {
            vec!["model.safetensors".to_string()]
        };
        let mut files = Vec::with_capacity(names.len());
        let mut by_name = HashMap::new();
        for name in names {
            let path = dir.join(&name);
            let file = File::open(&path).map_err(|source| CaptureError::Io {
                path: path.clone(),
                source,
            })?;
            // SAFETY: the map is read-only and the checkpoint is an input we never write; like every
            // mmap-based loader we rely on nobody truncating the file while the model loads.
            let map = unsafe { Mmap::map(&file) }.map_err(|source| CaptureError::Io {
                path: path.clone(),
                source,
            })?;
            let (header_len, meta) =
                SafeTensors::read_metadata(&map).map_err(|e| CaptureError::Safetensors {
                    path: path.clone(),
                    message: e.to_string(),
                })?;
            let infos: HashMap<String, _> = meta
                .tensors()
                .into_iter()
                .map(|(k, v)| (k, v.clone()))
                .collect();
            for k in infos.keys() {
                by_name.insert(k.clone(), files.len());
            }
            files.push(MappedFile {
                path,
                map,
                data_start: 8 + header_len,
                infos,
            });
        }
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            files,
            by_name,
            quant: Quantization::None,
        })
    }

    /// The same checkpoint, its linear weights stored as `quant` says (from its config.json).
    pub fn with_quantization(mut self, quant: Quantization) -> Self {
        self.quant = quant;
        self
    }

    /// The checkpoint's problems as one error that names the directory and its files.
    pub fn error(&self, problems: Vec<TensorProblem>) -> CaptureError {
        CaptureError::Checkpoint {
            dir: self.dir.clone(),
            files: self
                .files
                .iter()
                .map(|f| {
                    f.path
                        .file_name()
                        .map(|n| n.to_string_lossy().into_owned())
                        .unwrap_or_default()
                })
                .collect::<Vec<_>>()
                .join(", "),
            problems,
        }
    }

    /// `name`'s bytes as stored in the mapping, with its dtype and full shape (what a streamed
    /// layer copies to the device as it is).
    pub fn raw(&self, name: &str) -> std::result::Result<RawTensor<'_>, TensorProblem> {
        let (file, info) = self.info(name).ok_or_else(|| TensorProblem::Missing {
            name: name.to_string(),
        })?;
        let kind = kind_of(info.dtype).ok_or_else(|| TensorProblem::WrongDtype {
            name: name.into(),
            dtype: format!("{:?}", info.dtype),
            expected: dtype_names(&[
                Kind::BFloat16,
                Kind::Half,
                Kind::Float,
                Kind::Float8e4m3fn,
                Kind::Int,
                Kind::Int64,
            ]),
        })?;
        let (start, end) = info.data_offsets;
        Ok(RawTensor {
            bytes: &file.map[file.data_start + start..file.data_start + end],
            kind,
            shape: info.shape.clone(),
        })
    }

    /// Every mapped file of the checkpoint, whole, with its path.
    pub fn mapped_files(&self) -> impl Iterator<Item = (&Path, &[u8])> {
        self.files.iter().map(|f| (f.path.as_path(), &f.map[..]))
    }

    fn info(&self, name: &str) -> Option<(&MappedFile, &safetensors::tensor::TensorInfo)> {
        let file = &self.files[*self.by_name.get(name)?];
        Some((file, file.infos.get(name)?))
    }

    /// Checks that `name` exists with the full shape `expected` and a float dtype (converted
    /// to the compute dtype as it loads), reading no data; returns that dtype.
    pub fn check(
        &self,
        name: &str,
        expected: &[usize],
    ) -> std::result::Result<Kind, TensorProblem> {
        self.check_stored(name, expected, FLOATS)
    }

    /// Checks that `name` exists with the full shape `expected` and one of the dtypes
    /// `accept`, reading no data; returns that dtype.
    pub fn check_stored(
        &self,
        name: &str,
        expected: &[usize],
        accept: &[Kind],
    ) -> std::result::Result<Kind, TensorProblem> {
        let (_, info) = self.info(name).ok_or_else(|| TensorProblem::Missing {
            name: name.to_string(),
        })?;
        if info.shape != expected {
            return Err(TensorProblem::WrongShape {
                name: name.into(),
                expected: expected.to_vec(),
                got: info.shape.clone(),
            });
        }
        match kind_of(info.dtype) {
            Some(kind) if accept.contains(&kind) => Ok(kind),
            _ => Err(TensorProblem::WrongDtype {
                name: name.into(),
                dtype: format!("{:?}", info.dtype),
                expected: dtype_names(accept),
            }),
        }
    }

    /// This rank's `shard` of `name` (full shape `shape`, dtype one of `accept`), copied out of
    /// the map into a CPU tensor of the stored dtype.
    fn read(&self, name: &str, shape: &[usize], shard: Shard, accept: &[Kind]) -> Result<Tensor> {
        let problem = |p| self.error(vec![p]);
        let stored = self.check_stored(name, shape, accept).map_err(problem)?;
        let local = shard.local_shape(name, shape).map_err(problem)?;
        let (file, info) = self
            .info(name)
            .ok_or_else(|| problem(TensorProblem::Missing { name: name.into() }))?;
        let es = stored.elt_size_in_bytes();
        let bytes =
            &file.map[file.data_start + info.data_offsets.0..file.data_start + info.data_offsets.1];
        let data: std::borrow::Cow<[u8]> = match shard {
            Shard::Full => bytes.into(),
            Shard::Rows { start, end } => {
                let row = shape[1..].iter().product::<usize>() * es;
                bytes[start * row..end * row].into()
            }
            Shard::Split { dim, rank, .. } => {
                let (n, part) = (shape[dim], local[dim]);
                // Everything after `dim` is one contiguous block per index of `dim`; everything
                // before it repeats that layout, so a slice is `outer` runs of `part` blocks.
                let inner = shape[dim + 1..].iter().product::<usize>() * es;
                let outer: usize = shape[..dim].iter().product();
                let mut out = Vec::with_capacity(outer * part * inner);
                for o in 0..outer {
                    let base = (o * n + rank * part) * inner;
                    out.extend_from_slice(&bytes[base..base + part * inner]);
                }
                out.into()
            }
        };
        let dims: Vec<i64> = local.iter().map(|&d| d as i64).collect();
        Ok(Tensor::f_from_data_size(&data, &dims, stored)?)
    }
}

/// The dtypes a dense weight may be stored in.
pub(crate) const FLOATS: &[Kind] = &[Kind::BFloat16, Kind::Half, Kind::Float];

impl TensorSource for Checkpoint {
    /// Copies this rank's slice of `name` out of the map to `device` as `kind`.
    fn tensor(
        &self,
        name: &str,
        shape: &[usize],
        shard: Shard,
        device: Device,
        kind: Kind,
    ) -> Result<Tensor> {
        let t = self.read(name, shape, shard, FLOATS)?;
        Ok(t.f_to_device(device)?.f_to_kind(kind)?)
    }

    fn stored(
        &self,
        name: &str,
        shape: &[usize],
        shard: Shard,
        device: Device,
        accept: &[Kind],
    ) -> Result<Tensor> {
        Ok(self.read(name, shape, shard, accept)?.f_to_device(device)?)
    }

    fn has(&self, name: &str) -> bool {
        self.info(name).is_some()
    }

    fn quantization(&self) -> &Quantization {
        &self.quant
    }

    fn reads_data(&self) -> bool {
        true
    }

    fn concat(&self, mut parts: Vec<Tensor>) -> Result<Tensor> {
        Ok(match parts.len() {
            1 => parts.remove(0),
            _ => Tensor::f_cat(&parts, 0)?,
        })
    }
}

/// The libtorch dtype of a safetensors dtype this crate reads.
fn kind_of(dtype: Dtype) -> Option<Kind> {
    Some(match dtype {
        Dtype::BF16 => Kind::BFloat16,
        Dtype::F16 => Kind::Half,
        Dtype::F32 => Kind::Float,
        Dtype::F8_E4M3 => Kind::Float8e4m3fn,
        Dtype::I32 => Kind::Int,
        Dtype::I64 => Kind::Int64,
        _ => return None,
    })
}

/// `kinds` as safetensors names them, for errors: "one of BF16, F16, F32".
fn dtype_names(kinds: &[Kind]) -> String {
    let name = |k: &Kind| match k {
        Kind::BFloat16 => "BF16",
        Kind::Half => "F16",
        Kind::Float => "F32",
        Kind::Float8e4m3fn => "F8_E4M3",
        Kind::Int => "I32",
        Kind::Int64 => "I64",
        _ => "?",
    };
    match kinds {
        [one] => name(one).to_string(),
        many => format!(
            "one of {}",
            many.iter().map(name).collect::<Vec<_>>().join(", ")
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::tensor::TensorView;

    fn write(dir: &Path, file: &str, tensors: &[(&str, Vec<usize>, Vec<f32>)]) {
        let bytes: Vec<Vec<u8>> = tensors
            .iter()
            .map(|(_, _, v)| v.iter().flat_map(|x| x.to_le_bytes()).collect())
            .collect();
        let views: Vec<(String, TensorView)> = tensors
            .iter()
            .zip(&bytes)
            .map(|((n, s, _), b)| {
                (
                    n.to_string(),
                    TensorView::new(Dtype::F32, s.clone(), b).unwrap(),
                )
            })
            .collect();
        safetensors::serialize_to_file(views, None, &dir.join(file)).unwrap();
    }

    fn values(t: &Tensor) -> Vec<f32> {
        Vec::<f32>::try_from(t.flatten(0, -1)).unwrap()
    }

    #[test]
    fn row_and_column_slices_match_narrow_of_the_full_tensor() {
        let d = tempfile::tempdir().unwrap();
        let v: Vec<f32> = (0..24).map(|x| x as f32).collect();
        write(d.path(), "model.safetensors", &[("w", vec![4, 6], v)]);
        let w = Checkpoint::open(d.path()).unwrap();
        let full = w
            .tensor("w", &[4, 6], Shard::Full, Device::Cpu, Kind::Float)
            .unwrap();
        for rank in 0..2 {
            let rows = w
                .tensor(
                    "w",
                    &[4, 6],
                    Shard::Split {
                        dim: 0,
                        rank,
                        world: 2,
                    },
                    Device::Cpu,
                    Kind::Float,
                )
                .unwrap();
            assert_eq!(values(&rows), values(&full.narrow(0, 2 * rank as i64, 2)));
            let cols = w
                .tensor(
                    "w",
                    &[4, 6],
                    Shard::Split {
                        dim: 1,
                        rank,
                        world: 2,
                    },
                    Device::Cpu,
                    Kind::Float,
                )
                .unwrap();
            assert_eq!(cols.size(), vec![4, 3]);
            assert_eq!(
                values(&cols),
                values(&full.narrow(1, 3 * rank as i64, 3).contiguous())
            );
        }
        let rows = w
            .tensor(
                "w",
                &[4, 6],
                Shard::Rows { start: 3, end: 4 },
                Device::Cpu,
                Kind::Float,
            )
            .unwrap();
        assert_eq!(
            values(&rows),
            (18..24).map(|x| x as f32).collect::<Vec<_>>()
        );
    }

    #[test]
    fn sharded_index_finds_tensors_in_every_file() {
        let d = tempfile::tempdir().unwrap();
        write(d.path(), "a.safetensors", &[("x", vec![2], vec![1.0, 2.0])]);
        write(d.path(), "b.safetensors", &[("y", vec![1], vec![3.0])]);
        std::fs::write(
            d.path().join("model.safetensors.index.json"),
            r#"{"metadata": {}, "weight_map": {"x": "a.safetensors", "y": "b.safetensors"}}"#,
        )
        .unwrap();
        let w = Checkpoint::open(d.path()).unwrap();
        assert_eq!(
            values(
                &w.tensor("y", &[1], Shard::Full, Device::Cpu, Kind::Float)
                    .unwrap()
            ),
            vec![3.0]
        );
        assert_eq!(
            values(
                &w.tensor("x", &[2], Shard::Full, Device::Cpu, Kind::Float)
                    .unwrap()
            ),
            vec![1.0, 2.0]
        );
    }

    #[test]
    fn names_missing_tensor_wrong_shape_and_the_checkpoint_files() {
        let d = tempfile::tempdir().unwrap();
        write(
            d.path(),
            "model.safetensors",
            &[("w", vec![2, 2], vec![0.0; 4])],
        );
        let w = Checkpoint::open(d.path()).unwrap();
        assert_eq!(
            w.check("v", &[2, 2]),
            Err(TensorProblem::Missing { name: "v".into() })
        );
        let e = w
            .tensor("w", &[2, 3], Shard::Full, Device::Cpu, Kind::Float)
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            format!(
                "checkpoint {} (model.safetensors): tensor \"w\" has shape [2, 2], expected [2, 3] from config.json",
                d.path().display()
            )
        );
    }
}
