//! The native half of the Python module `hslake`: datasets, the loader and zero-copy batch
//! buffers. The pure-Python package `hslake` (python/hslake/) wraps these into torch tensors.
#![deny(missing_docs)]

use std::ffi::c_int;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hslake_loader::{
    BatchStream, HostTensor, Loader, LoaderConfig, LoaderError, LoaderState, Preset,
    DECODE_THREADS, IO_TIMEOUT,
};
use hslake_store::format::guard::guarded;
use hslake_store::{Dataset, StoreError};
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::ffi;
use pyo3::prelude::*;
use tokio::runtime::Runtime;

mod read;

create_exception!(
    _hslake,
    HslakeError,
    PyException,
    "An hslake operation failed; the message names what is wrong."
);
create_exception!(
    _hslake,
    ConfigError,
    HslakeError,
    "An argument or resume state that cannot work with this dataset."
);

pub(crate) fn to_py(e: LoaderError) -> PyErr {
    match e {
        LoaderError::Config(_)
        | LoaderError::Option(_)
        | LoaderError::MissingPoint { .. }
        | LoaderError::PresetMismatch { .. }
        | LoaderError::StateMismatch { .. }
        | LoaderError::BadState(_)
        | LoaderError::Store(StoreError::VersionNotFound { .. })
        | LoaderError::Store(StoreError::InvalidUrl { .. }) => ConfigError::new_err(e.to_string()),
        other => HslakeError::new_err(other.to_string()),
    }
}

/// `timeout` seconds of `hslake.Dataset` or Ray's reader, checked against the loader's
/// `timeout` range (a number past it, or NaN, is a named error, not a panic converting it).
pub(crate) fn io_timeout(timeout: f64) -> PyResult<Duration> {
    IO_TIMEOUT
        .check_seconds("timeout", timeout)
        .map_err(|e| to_py(LoaderError::Option(e)))?;
    Ok(Duration::from_secs_f64(timeout))
}

/// The I/O runtime of `threads` worker threads (the loader's `decode_threads`, checked against
/// its declared range first); a thread the OS refuses is a named error, not a panic.
pub(crate) fn runtime(threads: usize) -> PyResult<Arc<Runtime>> {
    DECODE_THREADS
        .check_whole("decode_threads", threads as u64)
        .map_err(|e| to_py(LoaderError::Option(e)))?;
    // tokio panics where the OS refuses its first thread ("OS can't spawn worker thread").
    let built = guarded(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads.max(1))
            .thread_name("hslake-io")
            .enable_all()
            .build()
    });
    match built {
        Ok(Ok(rt)) => Ok(Arc::new(rt)),
        Ok(Err(e)) => Err(e.to_string()),
        Err(panic) => Err(panic),
    }
    .map_err(|e| {
        HslakeError::new_err(format!(
            "cannot start the I/O runtime of {threads} threads (decode_threads): {e}"
        ))
    })
}

/// A dense host buffer exported through the buffer protocol (writable, 64-byte aligned),
/// so `torch.frombuffer` wraps it without a copy.
#[pyclass(module = "hslake._hslake")]
pub(crate) struct Buffer {
    tensor: HostTensor,
    // Address of the tensor's heap bytes: stable for the buffer's life (never reallocated).
    addr: usize,
}

#[pymethods]
impl Buffer {
    /// Number of bytes.
    fn __len__(&self) -> usize {
        self.tensor.bytes().len()
    }

    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let (addr, len) = {
            let me = slf.borrow();
            (me.addr, me.tensor.bytes().len())
        };
        // SAFETY: `view` comes from the interpreter; the bytes live as long as `slf`, which
        // the view keeps a reference to (PyBuffer_FillInfo increments it).
        let rc = unsafe {
            ffi::PyBuffer_FillInfo(
                view,
                slf.as_ptr(),
                addr as *mut std::ffi::c_void,
                len as ffi::Py_ssize_t,
                0,
                flags,
            )
        };
        if rc != 0 {
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }

    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}
}

pub(crate) fn buffer(mut tensor: HostTensor) -> Buffer {
    let addr = tensor.bytes_mut().as_mut_ptr() as usize;
    Buffer { tensor, addr }
}

/// A dataset: schema, versions and counts.
#[pyclass(module = "hslake._hslake")]
struct NativeDataset {
    rt: Arc<Runtime>,
    ds: Dataset,
}

#[pymethods]
impl NativeDataset {
    #[new]
    #[pyo3(signature = (url, timeout=60.0))]
    fn new(py: Python<'_>, url: String, timeout: f64) -> PyResult<Self> {
        let limit = io_timeout(timeout)?;
        let rt = runtime(1)?;
        let ds = py.detach(|| {
            rt.block_on(async { tokio::time::timeout(limit, Dataset::open(&url)).await })
        });
        let ds = match ds {
            Ok(Ok(ds)) => ds,
            Ok(Err(e)) => return Err(to_py(e.into())),
            Err(_) => {
                return Err(HslakeError::new_err(format!(
                    "opening {url} did not finish within {timeout} s"
                )))
            }
        };
        Ok(NativeDataset { rt, ds })
    }

    /// The canonical URL.
    #[getter]
    fn url(&self) -> String {
        self.ds.url().to_string()
    }

    /// Committed versions.
    fn versions(&self, py: Python<'_>) -> PyResult<Vec<u64>> {
        py.detach(|| self.rt.block_on(self.ds.versions()))
            .map_err(|e| to_py(e.into()))
    }

    /// The manifest of a version (`None`: latest) as JSON.
    #[pyo3(signature = (version=None))]
    fn manifest_json(&self, py: Python<'_>, version: Option<u64>) -> PyResult<String> {
        let m = py
            .detach(|| self.rt.block_on(self.ds.manifest(version)))
            .map_err(|e| to_py(e.into()))?;
        let counts = serde_json::json!({
            "num_samples": m.num_samples(), "num_tokens": m.num_tokens(),
            "bytes": m.bytes(), "raw_bytes": m.raw_bytes(),
        });
        let mut v = serde_json::to_value(&m).map_err(|e| HslakeError::new_err(e.to_string()))?;
        if let Some(o) = v.as_object_mut() {
            o.insert("counts".into(), counts);
        }
        Ok(v.to_string())
    }
}

/// An open loader (one rank, one worker) over a pinned version.
#[pyclass(module = "hslake._hslake")]
struct NativeLoader {
    rt: Arc<Runtime>,
    loader: Arc<Loader>,
}

#[pymethods]
impl NativeLoader {
    /// `options_json`: the keyword arguments the user gave, as a JSON object; the loader's
    /// own defaults fill in the rest (`hslake_loader::LoaderConfig`).
    #[new]
    fn new(py: Python<'_>, url: String, options_json: &str) -> PyResult<Self> {
        let config = LoaderConfig::from_json(options_json).map_err(to_py)?;
        // Every option checked before any thread is started for them.
        config.check().map_err(to_py)?;
        let rt = runtime(config.decode_threads)?;
        let loader = py
            .detach(|| rt.block_on(Loader::open(&url, config)))
            .map_err(to_py)?;
        Ok(NativeLoader {
            rt,
            loader: Arc::new(loader),
        })
    }

    /// The state at the start of epoch 0, as JSON.
    fn initial_state(&self) -> String {
        self.loader.initial_state().to_json()
    }

    /// The epoch a JSON state is in.
    fn state_epoch(&self, state_json: &str) -> PyResult<u64> {
        Ok(LoaderState::from_json(state_json).map_err(to_py)?.epoch)
    }

    /// The state at the start of `epoch`.
    fn epoch_state(&self, epoch: u64) -> String {
        let mut s = self.loader.initial_state();
        s.epoch = epoch;
        s.to_json()
    }

    /// The pinned version.
    #[getter]
    fn version(&self) -> u64 {
        self.loader.version()
    }

    /// Ranks the samples are split over.
    #[getter]
    fn world_size(&self) -> usize {
        self.loader.config().world_size
    }

    /// Samples this reader visits per epoch.
    #[getter]
    fn samples_per_epoch(&self) -> u64 {
        self.loader.samples_per_epoch()
    }

    /// Auxiliary capture points, in concatenation order.
    #[getter]
    fn aux_layers(&self) -> Vec<String> {
        self.loader
            .aux_points()
            .iter()
            .map(|p| p.column())
            .collect()
    }

    /// The target capture point.
    #[getter]
    fn target(&self) -> String {
        self.loader.target_point().column()
    }

    /// Counters: row groups read and skipped, samples skipped, batches.
    fn stats(&self) -> std::collections::HashMap<&'static str, u64> {
        use std::sync::atomic::Ordering::Relaxed;
        let s = self.loader.stats();
        [
            ("row_groups_read", s.row_groups_read.load(Relaxed)),
            ("row_groups_skipped", s.row_groups_skipped.load(Relaxed)),
            ("samples_skipped", s.samples_skipped.load(Relaxed)),
            ("batches", s.batches.load(Relaxed)),
        ]
        .into_iter()
        .collect()
    }

    /// Check that a JSON state belongs to this loader's settings and version.
    fn check_state(&self, state_json: &str) -> PyResult<()> {
        let state = LoaderState::from_json(state_json).map_err(to_py)?;
        state
            .check_matches(self.loader.config(), self.loader.version())
            .map_err(to_py)
    }

    /// Start a pass from a JSON state.
    fn start(&self, state_json: &str) -> PyResult<NativeStream> {
        let state = LoaderState::from_json(state_json).map_err(to_py)?;
        let _guard = self.rt.enter();
        let stream = self.loader.stream(&state).map_err(to_py)?;
        Ok(NativeStream {
            _rt: self.rt.clone(),
            stream: Mutex::new(stream),
        })
    }
}

/// One pass of batches.
#[pyclass(module = "hslake._hslake")]
struct NativeStream {
    // Keeps the runtime that runs the stream's tasks alive.
    _rt: Arc<Runtime>,
    stream: Mutex<BatchStream>,
}

type Field = (&'static str, &'static str, Vec<usize>, Buffer);

#[pymethods]
impl NativeStream {
    /// The next batch as (fields, state JSON), each field (name, torch dtype name, shape,
    /// buffer); `None` at the end of the pass.
    fn next(&self, py: Python<'_>) -> PyResult<Option<(Vec<Field>, String)>> {
        let item = py.detach(|| match self.stream.lock() {
            Ok(mut s) => Ok(s.blocking_next()),
            Err(_) => Err("the stream's lock was poisoned by an earlier panic"),
        });
        let item = item.map_err(HslakeError::new_err)?;
        match item {
            None => Ok(None),
            Some(Err(e)) => Err(to_py(e)),
            Some(Ok(batch)) => {
                let state = batch.state.to_json();
                let fields = batch
                    .fields
                    .into_iter()
                    .map(|(name, t)| (name, t.dtype.torch_name(), t.shape.clone(), buffer(t)))
                    .collect();
                Ok(Some((fields, state)))
            }
        }
    }

    /// The state after the last batch delivered (after the end: the start of the next pass).
    fn state(&self) -> PyResult<String> {
        match self.stream.lock() {
            Ok(s) => Ok(s.state().to_json()),
            Err(_) => Err(HslakeError::new_err(
                "the stream's lock was poisoned by an earlier panic",
            )),
        }
    }
}

/// Write a synthetic dataset (values shaped like real activations, from the store's
/// generator; the same as `hslake synth`) and return its committed version: for tests and
/// benchmarks without the CLI. `value_checksum` names the checksum every value carries
/// (`"crc32"`, the default; `"zstd_xxh64"` as format 2 wrote; `None` for none, as writers
/// before checksums did): the checksum cost benchmark reads them side by side.
#[pyfunction]
#[pyo3(signature = (url, samples, seq_len, hidden, layers, final_norm=false, seed=0, first_id=0,
                    row_group_bytes=32 << 20, shard_bytes=256 << 20, dtype="bf16",
                    value_checksum=Some("crc32")))]
#[allow(clippy::too_many_arguments)]
fn write_synthetic(
    py: Python<'_>,
    url: String,
    samples: u64,
    seq_len: (usize, usize),
    hidden: usize,
    layers: Vec<u32>,
    final_norm: bool,
    seed: u64,
    first_id: u64,
    row_group_bytes: u64,
    shard_bytes: u64,
    dtype: &str,
    value_checksum: Option<&str>,
) -> PyResult<Option<u64>> {
    use hslake_store::format::planes::ValueChecksum;
    use hslake_store::tools::synth::{write_dataset, SynthSpec};
    use hslake_store::WriterOptions;
    let dtype = dtype
        .parse()
        .map_err(|e: hslake_schemas::SchemaError| ConfigError::new_err(e.to_string()))?;
    let value_checksum = value_checksum
        .map(|name| {
            ValueChecksum::from_name(name).ok_or_else(|| {
                ConfigError::new_err(format!(
                    "value_checksum {name:?}: expected \"crc32\", \"zstd_xxh64\" or None"
                ))
            })
        })
        .transpose()?;
    let spec = SynthSpec {
        samples,
        seq_len,
        hidden,
        layers,
        final_norm,
        num_layers: None,
        vocab_size: 32000,
        dtype,
        seed,
        first_id,
        writer: WriterOptions {
            shard_target_bytes: shard_bytes,
            row_group_target_bytes: row_group_bytes,
            value_checksum,
            ..Default::default()
        },
        commit_every: 0,
    };
    let rt = runtime(2)?;
    let report = py
        .detach(|| rt.block_on(write_dataset(&url, &spec, || {})))
        .map_err(|e| match e {
            StoreError::Usage(_) | StoreError::Schema(_) => ConfigError::new_err(e.to_string()),
            e => to_py(e.into()),
        })?;
    Ok(report.version)
}

/// The capture points a trainer preset needs for a model of `num_layers` layers: (aux
/// columns in concatenation order, target column, whether the target is after the final norm).
/// Which build the module is: profile, opt-level and debug assertions of its store, and
/// whether that is optimised enough for benchmarks (`hslake_store::build_info`).
#[pyfunction]
fn build_info(py: Python<'_>) -> PyResult<Bound<'_, pyo3::types::PyDict>> {
    use hslake_store::build_info as b;
    let d = pyo3::types::PyDict::new(py);
    d.set_item("version", env!("CARGO_PKG_VERSION"))?;
    d.set_item("profile", b::PROFILE)?;
    d.set_item("opt_level", b::OPT_LEVEL)?;
    d.set_item("debug_assertions", b::DEBUG_ASSERTIONS)?;
    d.set_item("optimized", b::optimized())?;
    d.set_item("describe", b::describe())?;
    d.set_item("benchmark_warning", b::benchmark_warning())?;
    Ok(d)
}

#[pyfunction]
fn preset_points(preset: &str, num_layers: usize) -> PyResult<(Vec<String>, String, bool)> {
    let preset: Preset = preset.parse().map_err(to_py)?;
    let p = preset.points(num_layers).map_err(to_py)?;
    Ok((
        p.aux.iter().map(|q| q.column()).collect(),
        p.target.column(),
        preset.post_norm_target(),
    ))
}

/// Every option `hslake.Loader` takes, as (name, default as JSON, doc), in declaration order:
/// the one declaration of the loader's options (`hslake_loader::LoaderConfig`), which the
/// Python wrapper documents its keywords from.
#[pyfunction]
fn loader_options() -> Vec<(&'static str, String, String)> {
    let defaults = LoaderConfig::defaults_json();
    LoaderConfig::OPTIONS
        .iter()
        .map(|o| {
            let default = defaults.get(o.name).cloned().unwrap_or_default();
            (o.name, default.to_string(), o.text())
        })
        .collect()
}

/// Write a dataset version in a trainer's own file layout (`preset`: `speculators` or
/// `specforge`) into the empty or absent directory `dir`; returns (version, samples, tokens).
#[pyfunction]
#[pyo3(signature = (url, preset, dir, version=None, rows_per_dir=5000, decode_threads=2))]
fn export_trainer_files(
    py: Python<'_>,
    url: String,
    preset: &str,
    dir: std::path::PathBuf,
    version: Option<u64>,
    rows_per_dir: usize,
    decode_threads: usize,
) -> PyResult<(u64, u64, u64)> {
    let preset: Preset = preset.parse().map_err(to_py)?;
    let opts = hslake_loader::export::ExportOptions {
        version,
        rows_per_dir,
        decode_threads,
    };
    let rt = runtime(decode_threads)?;
    let s = py
        .detach(|| {
            rt.block_on(hslake_loader::export::export_trainer_files(
                &url,
                preset,
                &dir,
                &opts,
                |_, _| {},
            ))
        })
        .map_err(to_py)?;
    Ok((s.version, s.samples, s.tokens))
}

/// The native module.
#[pymodule]
fn _hslake(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Buffer>()?;
    m.add_class::<NativeDataset>()?;
    m.add_class::<NativeLoader>()?;
    m.add_class::<NativeStream>()?;
    m.add_class::<read::NativeReader>()?;
    m.add_function(wrap_pyfunction!(write_synthetic, m)?)?;
    m.add_function(wrap_pyfunction!(preset_points, m)?)?;
    m.add_function(wrap_pyfunction!(build_info, m)?)?;
    m.add_function(wrap_pyfunction!(export_trainer_files, m)?)?;
    m.add_function(wrap_pyfunction!(loader_options, m)?)?;
    m.add("HslakeError", m.py().get_type::<HslakeError>())?;
    m.add("ConfigError", m.py().get_type::<ConfigError>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
