//! Store benchmarks: write and read+decode throughput of the shard format, compression
//! against raw, bytes fetched for one sample, and the physical layouts it was chosen over.
//! Shared by `hslake bench store` and `cargo bench -p hslake-store`.
use std::sync::Arc;
use std::time::Instant;

use arrow_array::cast::AsArray;
use arrow_array::{
    Array, ArrayRef, FixedSizeBinaryArray, LargeBinaryArray, ListArray, RecordBatch,
};
use arrow_buffer::OffsetBuffer;
use arrow_schema::{DataType, Field, Schema};
use bytes::Bytes;
use futures::TryStreamExt;
use hslake_schemas::{CapturePoint, DType, DatasetSchema, Sample};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, Encoding, ZstdLevel};
use parquet::file::properties::WriterProperties;
use serde::Serialize;

use crate::format::codec::decode_samples;
use crate::format::decode::{decode_value, ValueKind};
use crate::format::planes::{Checksums, ValueChecksum};
use crate::{Dataset, DatasetReader, DatasetWriter, Provenance, Result, StoreError, WriterOptions};

/// CPU seconds (user + system, all threads, exited ones included) this process has used.
/// Throughput per core is bytes over CPU time: unlike wall time it does not change when
/// other work shares the machine. Read from the kernel's per-process CPU clock, exact to the
/// nanosecond (`/proc/self/stat` counts in 10 ms ticks, 1.5 % of a 0.7 s read).
pub fn cpu_seconds() -> f64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `t` is a valid, writable timespec; the clock id is a constant the kernel knows.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut t) };
    if rc != 0 {
        return 0.0;
    }
    t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
}

/// Wall and CPU time of a piece of work.
struct Clock(Instant, f64);

impl Clock {
    fn start() -> Self {
        Clock(Instant::now(), cpu_seconds())
    }
    /// (wall seconds, CPU seconds).
    fn stop(&self) -> (f64, f64) {
        (
            self.0.elapsed().as_secs_f64(),
            (cpu_seconds() - self.1).max(1e-6),
        )
    }
}

/// Results of the shard-format benchmark.
#[derive(Debug, Clone, Serialize)]
pub struct StoreBench {
    /// Samples written.
    pub samples: usize,
    /// Raw tensor bytes.
    pub raw_bytes: u64,
    /// Shard bytes on disk.
    pub file_bytes: u64,
    /// raw / file.
    pub ratio: f64,
    /// Raw MB/s written (validate, statistics, split, compress, write) per CPU second.
    pub write_mb_s: f64,
    /// Raw MB/s read and decoded into `[seq_len, hidden]` buffers per CPU second.
    pub read_mb_s: f64,
    /// Raw MB/s written per wall-clock second.
    pub write_wall_mb_s: f64,
    /// Raw MB/s read and decoded per wall-clock second.
    pub read_wall_mb_s: f64,
    /// Bytes fetched for one random sample once footers are cached.
    pub one_sample_bytes: u64,
    /// Requests made for it.
    pub one_sample_requests: u64,
    /// Raw bytes of that sample's tensors.
    pub one_sample_raw: u64,
}

/// Write `samples` into a fresh dataset at `url` and measure the format.
pub async fn bench_store(
    url: &str,
    schema: DatasetSchema,
    samples: &[Sample],
    opts: WriterOptions,
) -> Result<StoreBench> {
    let ds = Dataset::create(
        url,
        schema.clone(),
        Provenance {
            software: "hslake bench".into(),
            ..Default::default()
        },
    )
    .await?;
    let mut w = DatasetWriter::new(&ds, opts).await?;
    let clock = Clock::start();
    for s in samples {
        w.append(s).await?;
    }
    w.commit().await?;
    let (write_wall, write_cpu) = clock.stop();
    let m = ds.manifest(None).await?;
    let (raw, file) = (m.raw_bytes(), m.bytes());

    let (read_wall, read_cpu) = read_all(&ds).await?;
    let r = DatasetReader::open(&ds, None).await?;

    for i in 0..m.shards.len() {
        r.shard_metadata(i).await?;
    }
    let pick = samples[samples.len() / 2].sample_id;
    let (b0, q0) = r.io();
    let one = r.get_sample(pick).await?;
    let (b1, q1) = r.io();
    Ok(StoreBench {
        samples: samples.len(),
        raw_bytes: raw,
        file_bytes: file,
        ratio: raw as f64 / file as f64,
        write_mb_s: raw as f64 / write_cpu / 1e6,
        read_mb_s: raw as f64 / read_cpu / 1e6,
        write_wall_mb_s: raw as f64 / write_wall / 1e6,
        read_wall_mb_s: raw as f64 / read_wall / 1e6,
        one_sample_bytes: b1 - b0,
        one_sample_requests: q1 - q0,
        one_sample_raw: one.tensors.iter().map(|t| t.data.len() as u64).sum(),
    })
}

/// Read and decode every sample of the newest version of `ds` once, as the store benchmark's
/// read figure does: (wall seconds, CPU seconds).
pub async fn read_all(ds: &Dataset) -> Result<(f64, f64)> {
    let r = DatasetReader::open(ds, None).await?;
    let clock = Clock::start();
    let mut scan = r.scan(None);
    while let Some(b) = scan.try_next().await? {
        std::hint::black_box(decode_samples(r.schema(), &b)?);
    }
    Ok(clock.stop())
}

/// Decode every tensor value of `samples`, encoded once per checksum kind of `kinds` (`None`:
/// without), `rounds` times through the one decoder, alternating kinds round by round: raw MB
/// decoded per CPU second, one figure per round, per kind. Values only (no Parquet, no IO), so
/// the figures show the checksum's cost in the decoder itself, which a full read dilutes.
pub fn bench_value_decode(
    samples: &[Sample],
    zstd_level: i32,
    kinds: &[Option<ValueChecksum>],
    rounds: usize,
) -> Result<Vec<Vec<f64>>> {
    let encoded: Vec<Vec<(Vec<u8>, ValueKind, usize)>> = kinds
        .iter()
        .map(|&k| {
            samples
                .iter()
                .flat_map(|s| s.tensors.iter())
                .map(|t| {
                    let kind = ValueKind::Tensor {
                        dtype: t.dtype,
                        hidden: t.shape.last().copied().unwrap_or(1),
                    };
                    let tokens = t.shape.first().copied().unwrap_or(0);
                    let v = crate::format::planes::encode(&t.data, t.dtype.size(), zstd_level, k)
                        .map_err(|e| StoreError::Usage(e.to_string()))?;
                    Ok((v, kind, tokens))
                })
                .collect::<Result<Vec<_>>>()
        })
        .collect::<Result<_>>()?;
    let raw: usize = samples
        .iter()
        .flat_map(|s| s.tensors.iter())
        .map(|t| t.data.len())
        .sum();
    let mut out = vec![Vec::with_capacity(rounds); kinds.len()];
    let mut buf = Vec::new();
    for _ in 0..rounds {
        for ((values, &k), figures) in encoded.iter().zip(kinds).zip(out.iter_mut()) {
            let checks = k.map_or(Checksums::IfPresent, Checksums::Declared);
            let clock = Clock::start();
            for (v, kind, tokens) in values {
                decode_value(v, *kind, *tokens, checks, &mut buf)
                    .map_err(|e| StoreError::Usage(e.reason))?;
                std::hint::black_box(&buf);
            }
            let (_, cpu) = clock.stop();
            figures.push(raw as f64 / cpu / 1e6);
        }
    }
    Ok(out)
}

/// One candidate physical layout's figures.
#[derive(Debug, Clone, Serialize)]
pub struct LayoutBench {
    /// Layout name.
    pub layout: &'static str,
    /// raw / file bytes.
    pub ratio: f64,
    /// Raw MB/s encoded and compressed per CPU second.
    pub write_mb_s: f64,
    /// Raw MB/s decoded to contiguous `[seq_len, hidden]` buffers per CPU second.
    pub read_mb_s: f64,
}

/// The layouts compared: tensor columns only, same zstd level, one row group per 32 MiB raw.
/// `blob-plane-zstd` compresses its values itself ([`crate::format::planes`]); the others leave
/// compression to Parquet.
pub const LAYOUTS: [&str; 5] = [
    "blob-plane-zstd (chosen)",
    "blob-split",
    "blob-plain",
    "list-bss",
    "row-per-token",
];

/// Measure every layout of [`LAYOUTS`] on the same samples.
pub fn bench_layouts(
    schema: &DatasetSchema,
    samples: &[Sample],
    zstd_level: i32,
) -> Result<Vec<LayoutBench>> {
    let raw: u64 = samples
        .iter()
        .flat_map(|s| s.tensors.iter())
        .map(|t| t.data.len() as u64)
        .sum();
    let k = schema.dtype.size();
    let h = schema.hidden_size;
    let level = ZstdLevel::try_new(zstd_level).map_err(|e| StoreError::Usage(e.to_string()))?;
    let mut out = vec![];
    for layout in LAYOUTS {
        let clock = Clock::start();
        let mut buf = Vec::new();
        let batch0 = layout_batch(layout, schema, &samples[..1], zstd_level)?;
        let compression = if layout.starts_with("blob-plane-zstd") {
            Compression::UNCOMPRESSED
        } else {
            Compression::ZSTD(level)
        };
        let mut props = WriterProperties::builder()
            .set_compression(compression)
            .set_dictionary_enabled(false);
        if layout == "list-bss" {
            props = props.set_encoding(Encoding::BYTE_STREAM_SPLIT);
        }
        let mut w = ArrowWriter::try_new(&mut buf, batch0.schema(), Some(props.build()))
            .map_err(|e| StoreError::pq(layout, e))?;
        let per_group = (32usize << 20)
            / (samples[0]
                .tensors
                .iter()
                .map(|t| t.data.len())
                .sum::<usize>()
                .max(1));
        for chunk in samples.chunks(per_group.max(1)) {
            let b = layout_batch(layout, schema, chunk, zstd_level)?;
            w.write(&b).map_err(|e| StoreError::pq(layout, e))?;
            w.flush().map_err(|e| StoreError::pq(layout, e))?;
        }
        w.close().map_err(|e| StoreError::pq(layout, e))?;
        let (_, write_s) = clock.stop();
        let file = buf.len() as u64;

        let clock = Clock::start();
        let reader = ParquetRecordBatchReaderBuilder::try_new(Bytes::from(buf))
            .and_then(|b| b.with_batch_size(4096).build())
            .map_err(|e| StoreError::pq(layout, e))?;
        let mut sink = 0u64;
        for b in reader {
            let b = b.map_err(|e| StoreError::Arrow {
                context: layout.into(),
                source: e,
            })?;
            sink += decode_layout(layout, &b, k, h);
        }
        let (_, read_s) = clock.stop();
        debug_assert_eq!(sink, raw);
        out.push(LayoutBench {
            layout,
            ratio: raw as f64 / file as f64,
            write_mb_s: raw as f64 / write_s / 1e6,
            read_mb_s: raw as f64 / read_s / 1e6,
        });
    }
    Ok(out)
}

/// The `blob-split` layout's values (format version 1's encoding): byte 0 of every
/// `elem_size`-byte little-endian element, then byte 1 of every element, and so on, so that
/// exponent bytes end up together for Parquet's zstd.
fn split(data: &[u8], elem_size: usize) -> Vec<u8> {
    let n = data.len() / elem_size;
    let mut out = vec![0u8; data.len()];
    match elem_size {
        1 => out.copy_from_slice(data),
        2 => {
            let (lo, hi) = out.split_at_mut(n);
            for ((l, h), v) in lo.iter_mut().zip(hi.iter_mut()).zip(data.chunks_exact(2)) {
                *l = v[0];
                *h = v[1];
            }
        }
        k => {
            for (i, v) in data.chunks_exact(k).enumerate() {
                for (b, &byte) in v.iter().enumerate() {
                    out[b * n + i] = byte;
                }
            }
        }
    }
    out
}

/// Inverse of [`split`], writing into `out` (same length as `split`).
fn unsplit_into(split: &[u8], elem_size: usize, out: &mut [u8]) {
    let n = split.len() / elem_size;
    match elem_size {
        1 => out.copy_from_slice(split),
        2 => {
            let (lo, hi) = split.split_at(n);
            for ((o, &l), &h) in out.chunks_exact_mut(2).zip(lo).zip(hi) {
                o[0] = l;
                o[1] = h;
            }
        }
        k => {
            for (i, o) in out.chunks_exact_mut(k).enumerate() {
                for (b, byte) in o.iter_mut().enumerate() {
                    *byte = split[b * n + i];
                }
            }
        }
    }
}

fn layout_batch(
    layout: &str,
    schema: &DatasetSchema,
    rows: &[Sample],
    level: i32,
) -> Result<RecordBatch> {
    let k = schema.dtype.size();
    let h = schema.hidden_size;
    let mut fields = vec![];
    let mut cols: Vec<ArrayRef> = vec![];
    for (i, p) in schema.points.iter().enumerate() {
        let name = p.column();
        let (field, col): (Field, ArrayRef) = match layout {
            "blob-plane-zstd (chosen)" | "blob-split" | "blob-plain" => {
                let vals: Vec<Vec<u8>> = rows
                    .iter()
                    .map(|s| match layout {
                        "blob-plain" => Ok(s.tensors[i].data.clone()),
                        "blob-split" => Ok(split(&s.tensors[i].data, k)),
                        _ => crate::format::planes::encode(
                            &s.tensors[i].data,
                            k,
                            level,
                            Some(crate::format::planes::ValueChecksum::DEFAULT),
                        )
                        .map_err(|e| StoreError::Usage(e.to_string())),
                    })
                    .collect::<Result<_>>()?;
                (
                    Field::new(name, DataType::LargeBinary, false),
                    Arc::new(LargeBinaryArray::from_iter_values(vals.iter())),
                )
            }
            "list-bss" => {
                let values: Vec<&[u8]> = rows
                    .iter()
                    .flat_map(|s| s.tensors[i].data.chunks_exact(k))
                    .collect();
                let inner =
                    FixedSizeBinaryArray::try_from_iter(values.into_iter()).map_err(|e| {
                        StoreError::Arrow {
                            context: layout.into(),
                            source: e,
                        }
                    })?;
                let item = Arc::new(Field::new(
                    "item",
                    DataType::FixedSizeBinary(k as i32),
                    false,
                ));
                let offsets =
                    OffsetBuffer::from_lengths(rows.iter().map(|s| s.tensors[i].data.len() / k));
                let list = ListArray::try_new(item.clone(), offsets, Arc::new(inner), None)
                    .map_err(|e| StoreError::Arrow {
                        context: layout.into(),
                        source: e,
                    })?;
                (
                    Field::new(name, DataType::List(item), false),
                    Arc::new(list),
                )
            }
            _ => {
                // One row per token: each token's hidden vector as one fixed-size value.
                let values = rows
                    .iter()
                    .flat_map(|s| s.tensors[i].data.chunks_exact(h * k));
                let arr =
                    FixedSizeBinaryArray::try_from_iter(values).map_err(|e| StoreError::Arrow {
                        context: layout.into(),
                        source: e,
                    })?;
                (
                    Field::new(name, DataType::FixedSizeBinary((h * k) as i32), false),
                    Arc::new(arr),
                )
            }
        };
        fields.push(field);
        cols.push(col);
    }
    RecordBatch::try_new(Arc::new(Schema::new(fields)), cols).map_err(|e| StoreError::Arrow {
        context: layout.into(),
        source: e,
    })
}

/// Rebuild contiguous little-endian tensors from a batch of a layout; returns bytes produced.
fn decode_layout(layout: &str, b: &RecordBatch, k: usize, h: usize) -> u64 {
    let mut total = 0u64;
    for col in b.columns() {
        match layout {
            "blob-plane-zstd (chosen)" | "blob-split" | "blob-plain" => {
                let a = col.as_binary::<i64>();
                for r in 0..a.len() {
                    let v = a.value(r);
                    let out = match layout {
                        "blob-plain" => v.to_vec(),
                        "blob-split" => {
                            let mut out = vec![0u8; v.len()];
                            unsplit_into(v, k, &mut out);
                            out
                        }
                        _ => crate::format::planes::decode(
                            v,
                            k,
                            crate::format::planes::Checksums::IfPresent,
                        )
                        .unwrap_or_default(),
                    };
                    total += std::hint::black_box(out).len() as u64;
                }
            }
            "list-bss" => {
                let l = col.as_list::<i32>();
                let data = l.values().as_fixed_size_binary().value_data();
                for w in l.value_offsets().windows(2) {
                    let out = data[w[0] as usize * k..w[1] as usize * k].to_vec();
                    total += std::hint::black_box(out).len() as u64;
                }
            }
            _ => {
                let f = col.as_fixed_size_binary();
                let out = f.value_data()[..f.len() * h * k].to_vec();
                total += std::hint::black_box(out).len() as u64;
            }
        }
    }
    total
}

/// Samples from a directory of `input_ids.npy` (`[N, T]` int32) and `layer_<i>.npy` (`[N, T, H]`
/// bf16 bits as uint16), as `benchmarks/cpu/real_activations.py` writes them; at most `limit`.
pub fn samples_from_npy(
    dir: &std::path::Path,
    limit: usize,
) -> Result<(DatasetSchema, Vec<Sample>)> {
    let (_, ishape, ids) = crate::tools::npy::read_npy(&dir.join("input_ids.npy"))?;
    let [n, t] = ishape[..] else {
        return Err(StoreError::Usage(format!(
            "input_ids.npy: expected [N, T], got {ishape:?}"
        )));
    };
    let mut layers: Vec<u32> = std::fs::read_dir(dir)
        .map_err(|e| StoreError::Usage(format!("{}: {e}", dir.display())))?
        .filter_map(|e| {
            e.ok()?
                .file_name()
                .to_str()?
                .strip_prefix("layer_")?
                .strip_suffix(".npy")?
                .parse()
                .ok()
        })
        .collect();
    layers.sort_unstable();
    let mut tensors = vec![];
    let mut hidden = 0;
    for l in &layers {
        let (descr, shape, data) =
            crate::tools::npy::read_npy(&dir.join(format!("layer_{l}.npy")))?;
        if descr != "<u2" || shape.len() != 3 || shape[..2] != [n, t] {
            return Err(StoreError::Usage(format!(
                "layer_{l}.npy: expected <u2 [{n}, {t}, H], got {descr} {shape:?}"
            )));
        }
        hidden = shape[2];
        tensors.push(data);
    }
    let points = layers
        .iter()
        .map(|&l| CapturePoint::LayerOutput(l))
        .collect();
    let top = layers.iter().max().map_or(1, |m| *m as usize + 2);
    let schema = DatasetSchema::new(
        "real activations",
        "LlamaForCausalLM",
        hidden,
        top,
        1 << 20,
        DType::Bf16,
        points,
    )?;
    let per = t * hidden * 2;
    let samples = (0..n.min(limit))
        .map(|i| Sample {
            sample_id: i as u64,
            input_ids: ids[i * t * 4..(i + 1) * t * 4]
                .chunks_exact(4)
                .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            loss_mask: vec![1; t],
            tensors: tensors
                .iter()
                .map(|d| hslake_schemas::TensorData {
                    dtype: DType::Bf16,
                    shape: vec![t, hidden],
                    data: d[i * per..(i + 1) * per].to_vec(),
                    scales: None,
                })
                .collect(),
        })
        .collect();
    Ok((schema, samples))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_and_unsplit_are_inverse_for_every_width() {
        for k in [1usize, 2, 4] {
            let data: Vec<u8> = (0..(k * 37)).map(|i| (i * 31 % 251) as u8).collect();
            let s = split(&data, k);
            let mut back = vec![0; data.len()];
            unsplit_into(&s, k, &mut back);
            assert_eq!(back, data);
        }
    }

    #[test]
    fn split_groups_high_bytes_of_bf16() {
        assert_eq!(
            split(&[0x11, 0xaa, 0x22, 0xbb], 2),
            vec![0x11, 0x22, 0xaa, 0xbb]
        );
    }
}
