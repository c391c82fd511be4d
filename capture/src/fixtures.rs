//! Test fixtures shared by the crate's tests: tiny random checkpoints holding exactly the
//! tensors the model's own (dry-run) load reads, token inputs, and datasets read back.
use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

use hslake_store::{Dataset, DatasetReader};
use safetensors::tensor::TensorView;

use crate::models::{registry, ModelConfig};
use crate::tools::dry_run::tensors_read;

/// A 2-layer Llama: hidden 16, 4 query heads over 2 KV heads, MLP 32, vocabulary 50.
pub(crate) const TINY_LLAMA: &str = r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 16, "intermediate_size": 32,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 50,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0}"#;

/// Writes `config` and a checkpoint of random f32 values in [-0.5, 0.5) for every tensor its
/// model reads; `nan_in` names a tensor to fill with NaN instead.
pub(crate) fn write_model(dir: &Path, config: &str, nan_in: Option<&str>) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), config).unwrap();
    let cfg = registry::read_config(dir).unwrap();
    let specs = tensors_read(&*cfg).unwrap();
    let mut seed = 12345u64;
    let bytes: Vec<Vec<u8>> = specs
        .iter()
        .map(|spec| {
            (0..spec.shape.iter().product::<usize>())
                .flat_map(|_| {
                    seed = seed
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    let v = match nan_in == Some(spec.name.as_str()) {
                        true => f32::NAN,
                        false => (seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5,
                    };
                    v.to_le_bytes()
                })
                .collect()
        })
        .collect();
    let views: Vec<(String, TensorView)> = specs
        .iter()
        .zip(&bytes)
        .map(|(spec, b)| {
            let view = TensorView::new(safetensors::Dtype::F32, spec.shape.clone(), b).unwrap();
            (spec.name.clone(), view)
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
}

/// The bias tensors decoder layer `layer` of `cfg`'s model reads, in the order it reads them.
pub(crate) fn layer_biases(cfg: &dyn ModelConfig, layer: usize) -> Vec<String> {
    let prefix = format!("model.layers.{layer}.");
    tensors_read(cfg)
        .unwrap()
        .into_iter()
        .map(|s| s.name)
        .filter(|n| n.starts_with(&prefix) && n.ends_with(".bias"))
        .collect()
}

/// `n` JSONL samples of 3 to 13 tokens below 50, sample `i` on line `i + 1`.
pub(crate) fn write_inputs(path: &Path, n: usize) {
    let mut f = std::fs::File::create(path).unwrap();
    for i in 0..n {
        let ids: Vec<usize> = (0..(3 + i * 7 % 11)).map(|t| (t * 13 + i) % 50).collect();
        writeln!(f, "{}", serde_json::json!({ "input_ids": ids })).unwrap();
    }
}

/// Every sample of the newest version: id -> all its tensors' values, concatenated.
pub(crate) async fn values(url: &str) -> BTreeMap<u64, Vec<f32>> {
    let ds = Dataset::open(url).await.unwrap();
    let r = DatasetReader::open(&ds, None).await.unwrap();
    let mut out = BTreeMap::new();
    for id in r.sample_ids().await.unwrap() {
        let s = r.get_sample(id).await.unwrap();
        out.insert(id, s.tensors.iter().flat_map(|t| t.to_f32_vec()).collect());
    }
    out
}

/// Asserts the same samples with values within 1e-5 of each other.
pub(crate) fn assert_close(a: &BTreeMap<u64, Vec<f32>>, b: &BTreeMap<u64, Vec<f32>>) {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    for (id, va) in a {
        assert_eq!(va.len(), b[id].len());
        let worst = va
            .iter()
            .zip(&b[id])
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max);
        assert!(worst <= 1e-5, "sample {id}: differs by {worst}");
    }
}
