//! Small deterministic datasets for the tests of this crate.
use hslake_schemas::{CapturePoint, DType, DatasetSchema, FinitePolicy, Sample, TensorData};
use hslake_store::{Dataset, DatasetWriter, Provenance, WriterOptions};

/// Hidden size of the test datasets.
pub const HIDDEN: usize = 4;

/// Value of element (token `t`, channel `h`) of layer 2 in sample `i`: small multiples of 0.5,
/// exact in every dtype, so expected results can be worked out by hand.
pub fn layer2_value(i: u64, t: usize, h: usize) -> f32 {
    let sign = if t % 2 == 1 { -1.0 } else { 1.0 };
    ((i % 3) as f32 + 1.0) * (h as f32 - 1.5) * sign
}

fn tensor(dtype: DType, values: &[f32], tokens: usize) -> TensorData {
    let shape = vec![tokens, HIDDEN];
    match dtype {
        DType::F32 => TensorData::from_f32(values, shape),
        DType::Bf16 => TensorData::from_bf16_bits(
            &values
                .iter()
                .map(|&v| hslake_schemas::f32_to_bf16_bits(v))
                .collect::<Vec<_>>(),
            shape,
        ),
        DType::F16 => TensorData {
            dtype,
            shape,
            data: values
                .iter()
                .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
                .collect(),
            scales: None,
        },
        DType::Fp8E4m3 => {
            // Values are multiples of 0.5 up to 9: store v / 2 (e4m3 is exact for them) with
            // a per-token scale of 2, so only a reader that applies scales gets them back.
            let data = values.iter().map(|&v| fp8_encode(v / 2.0)).collect();
            TensorData {
                dtype,
                shape,
                data,
                scales: Some(vec![2.0; tokens]),
            }
        }
    }
}

/// e4m3fn encoding of values exactly representable in it (test inputs only).
fn fp8_encode(v: f32) -> u8 {
    if v.is_nan() {
        return 0x7f;
    }
    (0u8..=0x7e)
        .find(|&b| hslake_schemas::fp8_e4m3_to_f32(b) == v.abs())
        .map_or(0x7e, |b| b | if v < 0.0 { 0x80 } else { 0 })
}

/// Write a dataset of `n` samples: seq_len `3 + i % 4`, loss on every second token, layers 2
/// and 30 (`layer_30 = 2 * layer_2`, except sample 3 whose first layer-30 value is NaN).
/// `shards` shards are committed as one version each.
pub async fn write(url: &str, dtype: DType, n: u64, shards: u64) -> Dataset {
    let schema = DatasetSchema::new(
        "test-model",
        "LlamaForCausalLM",
        HIDDEN,
        32,
        1000,
        dtype,
        vec![CapturePoint::LayerOutput(2), CapturePoint::LayerOutput(30)],
    )
    .unwrap();
    let ds = Dataset::create(url, schema, Provenance::default())
        .await
        .unwrap();
    let per = n.div_ceil(shards);
    let opts = || WriterOptions {
        finite_policy: FinitePolicy::Record,
        ..WriterOptions::default()
    };
    let mut w = DatasetWriter::new(&ds, opts()).await.unwrap();
    for i in 0..n {
        let tokens = 3 + (i % 4) as usize;
        let l2: Vec<f32> = (0..tokens * HIDDEN)
            .map(|k| layer2_value(i, k / HIDDEN, k % HIDDEN))
            .collect();
        let mut l30: Vec<f32> = l2.iter().map(|v| v * 2.0).collect();
        if i == 3 {
            l30[0] = f32::NAN;
        }
        let s = Sample {
            sample_id: i,
            input_ids: (0..tokens as i32).map(|t| t + i as i32).collect(),
            loss_mask: (0..tokens).map(|t| (t % 2) as u8).collect(),
            tensors: vec![tensor(dtype, &l2, tokens), tensor(dtype, &l30, tokens)],
        };
        w.append(&s).await.unwrap();
        if (i + 1) % per == 0 {
            w.commit().await.unwrap();
        }
    }
    w.commit().await.unwrap();
    ds
}

/// Write `n` synthetic samples of `tokens` tokens of `hidden` bf16 values, one column
/// (`layer_1`), for tests that need values of some size (`tokens × hidden × 2` bytes raw).
pub async fn write_wide(url: &str, n: u64, tokens: usize, hidden: usize) -> Dataset {
    use hslake_store::tools::synth::{write_dataset, SynthSpec};
    let spec = SynthSpec {
        samples: n,
        seq_len: (tokens, tokens),
        hidden,
        layers: vec![1],
        final_norm: false,
        num_layers: None,
        vocab_size: 1000,
        dtype: DType::Bf16,
        seed: 1,
        first_id: 0,
        writer: WriterOptions::default(),
        commit_every: 0,
    };
    write_dataset(url, &spec, || {}).await.unwrap().dataset
}
