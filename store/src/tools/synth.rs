//! Synthetic samples whose values look like real residual-stream activations.
//!
//! Real hidden states are far from Gaussian: a handful of channels carry values tens of
//! times larger than the rest (the "massive activation" channels), the first token acts as
//! an attention sink with a much larger norm, norms grow with depth, and the per-element
//! distribution has heavy tails. The generator reproduces each of these, deterministically
//! from `(seed, sample_id)`, so any subset of samples can be generated independently:
//! - channel scale `c_j`: log-normal (σ = 0.5); 0.5 % of channels (at least 2) ×30–100;
//! - token scale `t_i`: log-normal (σ = 0.3); token 0 ×20;
//! - depth scale `d = 1 + layer / 8`;
//! - element `x_ij = d · t_i · c_j · z`, with `z` standard normal, widened ×4 with
//!   probability 0.1 (a scale mixture, i.e. heavy tails);
//! - then rounded to the dataset dtype (fp8 with one scale per token, `max|x| / 448`).
//!
//! [`write_dataset`] writes such a dataset; `hslake synth` and Python's `write_synthetic` are
//! thin front ends of it.
use std::sync::mpsc;

use hslake_schemas::{
    f32_to_bf16_bits, f32_to_fp8_e4m3, CapturePoint, DType, DatasetSchema, Sample, TensorData,
    LAYER_CONVENTION,
};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, LogNormal, StandardNormal};

use crate::{
    encode_sample, Dataset, DatasetWriter, Provenance, Result, StoreError, WriterOptions,
    WriterStats,
};

/// Fixed per-dataset structure: the channel scales of each capture point.
#[derive(Debug, Clone)]
pub struct SynthModel {
    schema: DatasetSchema,
    seq_len: (usize, usize),
    seed: u64,
    channel_scales: Vec<Vec<f32>>,
}

impl SynthModel {
    /// A generator for `schema` with sequence lengths uniform in `seq_len` (inclusive).
    pub fn new(schema: DatasetSchema, seq_len: (usize, usize), seed: u64) -> Self {
        let h = schema.hidden_size;
        let mut rng = SmallRng::seed_from_u64(seed ^ 0x5eed_c4a2);
        let ln = LogNormal::new(0.0, 0.5).expect("valid log-normal");
        let n_out = (h / 200).max(2).min(h);
        let channel_scales = schema
            .points
            .iter()
            .map(|_| {
                let mut c: Vec<f32> = (0..h).map(|_| ln.sample(&mut rng) as f32).collect();
                for _ in 0..n_out {
                    let j = rng.random_range(0..h);
                    c[j] *= rng.random_range(30.0..100.0);
                }
                c
            })
            .collect();
        SynthModel {
            schema,
            seq_len,
            seed,
            channel_scales,
        }
    }

    /// The sample with this id.
    pub fn sample(&self, sample_id: u64) -> Sample {
        let mut rng =
            SmallRng::seed_from_u64(self.seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ sample_id);
        let (lo, hi) = self.seq_len;
        let n = rng.random_range(lo..=hi.max(lo));
        let vocab = self.schema.vocab_size as i32;
        let input_ids: Vec<i32> = (0..n).map(|_| rng.random_range(0..vocab)).collect();
        // A prompt without loss, then the answer with loss, as in chat data.
        let prompt = (n as f64 * rng.random_range(0.1..0.6)) as usize;
        let loss_mask: Vec<u8> = (0..n).map(|i| (i >= prompt) as u8).collect();
        let ln = LogNormal::new(0.0, 0.3).expect("valid log-normal");
        let token_scales: Vec<f32> = (0..n)
            .map(|i| ln.sample(&mut rng) as f32 * if i == 0 { 20.0 } else { 1.0 })
            .collect();
        let tensors = self
            .schema
            .points
            .iter()
            .zip(&self.channel_scales)
            .map(|(p, cs)| {
                let depth = match p {
                    CapturePoint::LayerOutput(l) => 1.0 + *l as f32 / 8.0,
                    CapturePoint::FinalNorm => 1.0,
                };
                let vals: Vec<f32> = (0..n * cs.len())
                    .map(|k| {
                        let (i, j) = (k / cs.len(), k % cs.len());
                        let z: f32 = rng.sample(StandardNormal);
                        let wide = if rng.random_bool(0.1) { 4.0 } else { 1.0 };
                        depth * token_scales[i] * cs[j] * z * wide
                    })
                    .collect();
                to_dtype(&vals, n, cs.len(), self.schema.dtype)
            })
            .collect();
        Sample {
            sample_id,
            input_ids,
            loss_mask,
            tensors,
        }
    }
}

/// A synthetic dataset to write: its shape, its samples and how they are written.
#[derive(Debug, Clone)]
pub struct SynthSpec {
    /// Number of samples.
    pub samples: u64,
    /// Sequence lengths, uniform in `min..=max`.
    pub seq_len: (usize, usize),
    /// Hidden size.
    pub hidden: usize,
    /// Decoder layers whose outputs are "captured", 0-based.
    pub layers: Vec<u32>,
    /// Also a final-norm column.
    pub final_norm: bool,
    /// Decoder layers of the pretend model (`None`: the last captured layer + 1).
    pub num_layers: Option<usize>,
    /// Vocabulary size of the pretend model.
    pub vocab_size: usize,
    /// Element type.
    pub dtype: DType,
    /// Seed: with the sample id it fixes every value.
    pub seed: u64,
    /// First sample id.
    pub first_id: u64,
    /// Shard and row-group sizes, zstd level.
    pub writer: WriterOptions,
    /// Commit every this many samples (0: once at the end).
    pub commit_every: u64,
}

impl SynthSpec {
    /// The dataset schema the samples follow.
    pub fn schema(&self) -> Result<DatasetSchema> {
        let (lo, hi) = self.seq_len;
        if lo == 0 || hi < lo {
            return Err(StoreError::Usage(format!(
                "seq_len ({lo}, {hi}): expected (min, max) with 1 <= min <= max"
            )));
        }
        let mut points: Vec<CapturePoint> = self
            .layers
            .iter()
            .map(|&l| CapturePoint::LayerOutput(l))
            .collect();
        if self.final_norm {
            points.push(CapturePoint::FinalNorm);
        }
        let num_layers = self
            .num_layers
            .unwrap_or_else(|| self.layers.iter().max().map_or(1, |m| *m as usize + 1));
        Ok(DatasetSchema::new(
            "synthetic",
            "Synthetic",
            self.hidden,
            num_layers,
            self.vocab_size,
            self.dtype,
            points,
        )?)
    }

    /// The provenance recorded with the dataset.
    fn provenance(&self, schema: &DatasetSchema) -> Provenance {
        Provenance {
            model: "synthetic".into(),
            architecture: "Synthetic".into(),
            dtype: self.dtype.to_string(),
            layers: schema.points.clone(),
            layer_convention: LAYER_CONVENTION.into(),
            software: format!("hslake {}", env!("CARGO_PKG_VERSION")),
            extra: [("synth_seed".to_string(), serde_json::json!(self.seed))]
                .into_iter()
                .collect(),
            ..Default::default()
        }
    }
}

/// What [`write_dataset`] wrote.
#[derive(Debug, Clone)]
pub struct SynthReport {
    /// The dataset.
    pub dataset: Dataset,
    /// The version of the last commit (`None`: nothing to commit).
    pub version: Option<u64>,
    /// The writer's counters.
    pub stats: WriterStats,
}

/// Write `spec`'s samples into the dataset at `url` (created, or opened when its schema is the
/// same), calling `on_sample` after each. Samples are generated and encoded on up to 8 threads
/// and appended in id order, so the shards are the same whatever the thread count.
pub async fn write_dataset(
    url: &str,
    spec: &SynthSpec,
    mut on_sample: impl FnMut(),
) -> Result<SynthReport> {
    let schema = spec.schema()?;
    let ds = Dataset::open_or_create(url, schema.clone(), spec.provenance(&schema)).await?;
    let opts = spec.writer;
    let mut w = DatasetWriter::new(&ds, opts).await?;
    let gen = SynthModel::new(schema.clone(), spec.seq_len, spec.seed);

    // Each thread has its own bounded channel and results are taken round-robin, which keeps
    // the order deterministic.
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, 8) as u64;
    let mut rxs = vec![];
    let mut handles = vec![];
    for t in 0..threads {
        let (tx, rx) = mpsc::sync_channel(4);
        rxs.push(rx);
        let (gen, schema) = (gen.clone(), schema.clone());
        let (first, n) = (spec.first_id, spec.samples);
        handles.push(std::thread::spawn(move || {
            let mut i = t;
            while i < n {
                let enc = encode_sample(&schema, &opts, &gen.sample(first + i));
                if tx.send(enc).is_err() {
                    return;
                }
                i += threads;
            }
        }));
    }
    for i in 0..spec.samples {
        let enc = rxs[(i % threads) as usize]
            .recv()
            .map_err(|_| StoreError::Usage("a synthetic-sample thread stopped".into()))??;
        w.append_encoded(enc).await?;
        on_sample();
        if spec.commit_every > 0 && (i + 1) % spec.commit_every == 0 {
            w.commit().await?;
        }
    }
    for h in handles {
        let _ = h.join();
    }
    let version = w.commit().await?;
    Ok(SynthReport {
        dataset: ds,
        version,
        stats: w.stats(),
    })
}

/// Round f32 values to a dtype.
pub fn to_dtype(vals: &[f32], tokens: usize, hidden: usize, dtype: DType) -> TensorData {
    let shape = vec![tokens, hidden];
    match dtype {
        DType::F32 => TensorData::from_f32(vals, shape),
        DType::Bf16 => TensorData::from_bf16_bits(
            &vals
                .iter()
                .map(|&v| f32_to_bf16_bits(v))
                .collect::<Vec<_>>(),
            shape,
        ),
        DType::F16 => {
            let data = vals
                .iter()
                .flat_map(|&v| half::f16::from_f32(v).to_bits().to_le_bytes())
                .collect();
            TensorData {
                dtype,
                shape,
                data,
                scales: None,
            }
        }
        DType::Fp8E4m3 => {
            let mut data = Vec::with_capacity(vals.len());
            let mut scales = Vec::with_capacity(tokens);
            for row in vals.chunks(hidden.max(1)) {
                let m = row.iter().fold(0f32, |a, v| a.max(v.abs()));
                let s = if m > 0.0 { m / 448.0 } else { 1.0 };
                scales.push(s);
                data.extend(row.iter().map(|&v| f32_to_fp8_e4m3(v / s)));
            }
            TensorData {
                dtype,
                shape,
                data,
                scales: Some(scales),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schema() -> DatasetSchema {
        DatasetSchema::new(
            "synth",
            "LlamaForCausalLM",
            64,
            4,
            1000,
            DType::Bf16,
            vec![CapturePoint::LayerOutput(3)],
        )
        .unwrap()
    }

    #[test]
    fn same_seed_and_id_give_the_same_sample() {
        let a = SynthModel::new(schema(), (4, 9), 1);
        let b = SynthModel::new(schema(), (4, 9), 1);
        assert_eq!(a.sample(17), b.sample(17));
        assert_ne!(a.sample(17), a.sample(18));
    }

    #[tokio::test]
    async fn write_dataset_is_deterministic_and_records_its_provenance() {
        let spec = SynthSpec {
            samples: 12,
            seq_len: (3, 9),
            hidden: 8,
            layers: vec![1, 3],
            final_norm: true,
            num_layers: None,
            vocab_size: 100,
            dtype: DType::Bf16,
            seed: 5,
            first_id: 0,
            writer: WriterOptions {
                row_group_target_bytes: 500,
                ..Default::default()
            },
            commit_every: 5,
        };
        let mut seen = 0;
        let a = write_dataset("memory://synth-write-a", &spec, || seen += 1)
            .await
            .unwrap();
        assert_eq!(seen, 12);
        assert_eq!(a.version, Some(3), "commits after 5, 10 and 12 samples");
        let b = write_dataset("memory://synth-write-b", &spec, || {})
            .await
            .unwrap();
        let (ma, mb) = (
            a.dataset.manifest(None).await.unwrap(),
            b.dataset.manifest(None).await.unwrap(),
        );
        assert_eq!(ma.num_samples(), 12);
        assert_eq!(ma.provenance.layers, ma.schema.points);
        assert_eq!(ma.provenance.layer_convention, LAYER_CONVENTION);
        assert_eq!(ma.provenance.extra["synth_seed"], 5);
        assert!(ma.provenance.software.starts_with("hslake "));
        for (sa, sb) in ma.shards.iter().zip(&mb.shards) {
            assert_eq!((sa.bytes, sa.crc32c), (sb.bytes, sb.crc32c));
        }
        let bad = SynthSpec {
            seq_len: (9, 3),
            ..spec
        };
        let err = write_dataset("memory://synth-write-c", &bad, || {})
            .await
            .unwrap_err();
        assert!(err.to_string().contains("1 <= min <= max"), "{err}");
    }

    #[test]
    fn samples_have_outlier_channels_and_validate() {
        let m = SynthModel::new(schema(), (32, 32), 3);
        let s = m.sample(0);
        m.schema.validate(&s).unwrap();
        let v = s.tensors[0].to_f32_vec();
        let max = v.iter().fold(0f32, |a, x| a.max(x.abs()));
        let mut sorted: Vec<f32> = v.iter().map(|x| x.abs()).collect();
        sorted.sort_by(f32::total_cmp);
        let median = sorted[sorted.len() / 2];
        assert!(max > 50.0 * median, "max {max} median {median}");
    }
}
