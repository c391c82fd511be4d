//! The pre-flight checkpoint check: the model's own `load`, run against a tensor source that
//! checks each requested tensor's name, full shape, dtype and TP split against the
//! checkpoint's headers and answers with a placeholder that holds no data. What is checked is
//! exactly what a real load reads, so there is no second list of tensors to keep in step.
use std::cell::RefCell;
use std::rc::Rc;

use tch::{Device, Kind, Tensor};

use crate::checkpoint::Checkpoint;
use crate::error::{CaptureError, Result, TensorProblem};
use crate::gpu::comm::Communicator;
use crate::kernels::{Kernels, MoeKernel};
use crate::load::{LoadCtx, Shard, TensorSource};
use crate::models::ModelConfig;
use crate::quant::config::Quantization;

/// A tensor a model reads: its checkpoint name and full (unsharded) shape, and what rank 0
/// holds of it in device memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TensorSpec {
    /// Checkpoint name.
    pub name: String,
    /// Full shape.
    pub shape: Vec<usize>,
    /// Rank 0's part of it.
    pub local: Vec<usize>,
    /// Its dtype in device memory: the compute dtype, f32 for what stays f32, or the stored
    /// dtype of a quantized weight.
    pub kind: Kind,
    /// Vocabulary rows of an embedding (never an operand of a GEMM).
    pub rows: bool,
}

impl TensorSpec {
    /// Bytes rank 0 holds of it.
    pub fn local_bytes(&self) -> u64 {
        self.local.iter().product::<usize>() as u64 * self.kind.elt_size_in_bytes() as u64
    }
}

/// What a model's load reads, in the order it reads it: the parts every layer shares
/// (embeddings, final norm), then each decoder layer's tensors.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct ModelReads {
    /// The stack's own tensors.
    pub stack: Vec<TensorSpec>,
    /// Each layer's tensors.
    pub layers: Vec<Vec<TensorSpec>>,
}

impl ModelReads {
    /// Every tensor the model reads.
    pub fn all(&self) -> impl Iterator<Item = &TensorSpec> {
        self.stack.iter().chain(self.layers.iter().flatten())
    }
}

/// Loads `cfg`'s model as rank 0 of `tp` against `checkpoint`'s headers, reading no tensor
/// data: every tensor the load asks for is checked, and all problems come back in one error.
pub(crate) fn check_checkpoint(
    cfg: &dyn ModelConfig,
    checkpoint: &Checkpoint,
    tp: usize,
    kind: Kind,
) -> Result<ModelReads> {
    let dry = DryRun {
        checkpoint: Some(checkpoint),
        read: RefCell::default(),
        problems: RefCell::default(),
    };
    let reads = dry.load(cfg, tp, kind)?;
    let problems = dry.problems.into_inner();
    if !problems.is_empty() {
        return Err(checkpoint.error(problems));
    }
    Ok(reads)
}

/// Every tensor `cfg`'s model reads at TP 1, with its full shape: what a checkpoint must hold.
#[cfg(test)]
pub(crate) fn tensors_read(cfg: &dyn ModelConfig) -> Result<Vec<TensorSpec>> {
    let dry = DryRun {
        checkpoint: None,
        read: RefCell::default(),
        problems: RefCell::default(),
    };
    Ok(dry.load(cfg, 1, Kind::Float)?.all().cloned().collect())
}

/// A tensor source that records and checks requests and reads nothing.
struct DryRun<'a> {
    /// Headers to check against; none when only recording.
    checkpoint: Option<&'a Checkpoint>,
    read: RefCell<Vec<TensorSpec>>,
    problems: RefCell<Vec<TensorProblem>>,
}

impl DryRun<'_> {
    /// Records `name` and checks it with `check`, answering with a placeholder of this rank's
    /// shape; a problem is noted and the load goes on with the expected shape, so that one run
    /// finds every problem.
    fn record(
        &self,
        name: &str,
        shape: &[usize],
        shard: Shard,
        kind: Kind,
        check: impl FnOnce(&Checkpoint) -> std::result::Result<Kind, TensorProblem>,
    ) -> Result<Tensor> {
        let checked = match self.checkpoint {
            Some(c) => check(c).map(drop),
            None => Ok(()),
        };
        let local = checked
            .and_then(|()| shard.local_shape(name, shape))
            .unwrap_or_else(|p| {
                self.problems.borrow_mut().push(p);
                shape.to_vec()
            });
        self.read.borrow_mut().push(TensorSpec {
            name: name.to_string(),
            shape: shape.to_vec(),
            local: local.clone(),
            kind,
            rows: matches!(shard, Shard::Rows { .. }),
        });
        placeholder(&local, kind)
    }

    /// Loads the stack, then each layer (as a resident load does), noting what each reads.
    fn load(&self, cfg: &dyn ModelConfig, tp: usize, kind: Kind) -> Result<ModelReads> {
        let ctx = LoadCtx {
            source: self,
            comm: Rc::new(NoCollectives { world: tp }),
            device: Device::Cpu,
            kind,
            // No data is read, so there is nothing to stack for grouped experts; the other
            // choices only say how loaded weights compute, which a dry run never does.
            kernels: Kernels {
                moe: MoeKernel::Loop,
                ..Kernels::default()
            },
            hold_dequantized: false,
        };
        let stack = cfg.load_stack(&ctx)?;
        let mut reads = ModelReads {
            stack: self.read.take(),
            layers: vec![],
        };
        for i in 0..stack.num_layers() {
            drop(stack.load_layer(&ctx, i)?);
            reads.layers.push(self.read.take());
        }
        Ok(reads)
    }
}

/// A tensor of `shape` that shares one element: shape-correct for views, free of memory.
fn placeholder(shape: &[usize], kind: Kind) -> Result<Tensor> {
    let dims: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
    Ok(Tensor::f_zeros([0i64; 0], (kind, Device::Cpu))?.f_expand(dims.as_slice(), false)?)
}

impl TensorSource for DryRun<'_> {
    fn tensor(
        &self,
        name: &str,
        shape: &[usize],
        shard: Shard,
        _device: Device,
        kind: Kind,
    ) -> Result<Tensor> {
        self.record(name, shape, shard, kind, |c| c.check(name, shape))
    }

    fn stored(
        &self,
        name: &str,
        shape: &[usize],
        shard: Shard,
        _device: Device,
        accept: &[Kind],
    ) -> Result<Tensor> {
        let kind = self
            .checkpoint
            .and_then(|c| c.check_stored(name, shape, accept).ok())
            .unwrap_or(accept[0]);
        self.record(name, shape, shard, kind, |c| {
            c.check_stored(name, shape, accept)
        })
    }

    fn has(&self, name: &str) -> bool {
        self.checkpoint.is_some_and(|c| c.has(name))
    }

    fn quantization(&self) -> &Quantization {
        static NONE: Quantization = Quantization::None;
        self.checkpoint.map_or(&NONE, |c| c.quantization())
    }

    fn reads_data(&self) -> bool {
        false
    }

    fn concat(&self, parts: Vec<Tensor>) -> Result<Tensor> {
        let sizes: Vec<Vec<i64>> = parts.iter().map(|t| t.size()).collect();
        let first = sizes
            .first()
            .ok_or_else(|| CaptureError::Pipeline("model load stacks no tensors".into()))?;
        if sizes
            .iter()
            .any(|s| s.len() != first.len() || s[1..] != first[1..])
        {
            return Err(CaptureError::Pipeline(format!(
                "model load stacks tensors of shapes {sizes:?}, which differ beyond dimension 0"
            )));
        }
        let mut shape: Vec<usize> = first.iter().map(|&d| d as usize).collect();
        shape[0] = sizes.iter().map(|s| s[0] as usize).sum();
        placeholder(&shape, parts[0].kind())
    }
}

/// The communicator of a dry run: the TP size the shards are cut for, and no collective
/// (loading never communicates).
struct NoCollectives {
    world: usize,
}

impl Communicator for NoCollectives {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        self.world
    }
    fn all_reduce_sum(&self, _t: &mut Tensor) -> Result<()> {
        Err(CaptureError::Pipeline(
            "a dry-run load tried to communicate; loading must not run collectives".into(),
        ))
    }
    fn abort(&self) {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::{write_model, TINY_LLAMA};
    use crate::models::registry;
    use safetensors::tensor::TensorView;

    #[test]
    fn placeholders_have_the_slice_shape_and_no_memory_of_their_own() {
        let dry = DryRun {
            checkpoint: None,
            read: RefCell::default(),
            problems: RefCell::default(),
        };
        let split = Shard::Split {
            dim: 0,
            rank: 0,
            world: 4,
        };
        let a = dry
            .tensor("a", &[8, 6], split, Device::Cpu, Kind::BFloat16)
            .unwrap();
        assert_eq!(
            (a.size(), a.stride(), a.kind()),
            (vec![2, 6], vec![0, 0], Kind::BFloat16)
        );
        let b = dry
            .tensor("b", &[4, 6], split, Device::Cpu, Kind::BFloat16)
            .unwrap();
        let ab = dry.concat(vec![a, b]).unwrap();
        assert_eq!((ab.size(), ab.stride()), (vec![3, 6], vec![0, 0]));
        let names: Vec<String> = dry.read.into_inner().into_iter().map(|s| s.name).collect();
        assert_eq!(names, ["a", "b"]);
    }

    #[test]
    fn a_405b_shaped_model_is_listed_without_allocating_it() {
        // Llama-3.1-405B's shapes: ~800 GB of bf16 if the dry run held any weight.
        let config = r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 16384,
            "intermediate_size": 53248, "num_hidden_layers": 126, "num_attention_heads": 128,
            "num_key_value_heads": 8, "vocab_size": 128256}"#;
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("config.json"), config).unwrap();
        let specs = tensors_read(&*registry::read_config(d.path()).unwrap()).unwrap();
        // Embedding and final norm, and per layer 2 norms, q/k/v/o and gate/up/down.
        assert_eq!(specs.len(), 2 + 126 * 9);
        let total: usize = specs
            .iter()
            .map(|s| s.shape.iter().product::<usize>())
            .sum();
        assert!(total > 400_000_000_000, "{total} parameters");
    }

    /// The tiny Llama's checkpoint rewritten with `edit` applied to its tensor list.
    fn edited(dir: &std::path::Path, edit: impl Fn(&mut Vec<(String, Vec<usize>)>)) -> Checkpoint {
        write_model(dir, TINY_LLAMA, None);
        let cfg = registry::read_config(dir).unwrap();
        let mut tensors: Vec<(String, Vec<usize>)> = tensors_read(&*cfg)
            .unwrap()
            .into_iter()
            .map(|s| (s.name, s.shape))
            .collect();
        edit(&mut tensors);
        let bytes: Vec<Vec<u8>> = tensors
            .iter()
            .map(|(_, s)| vec![0u8; 4 * s.iter().product::<usize>()])
            .collect();
        let views: Vec<(String, TensorView)> = tensors
            .iter()
            .zip(&bytes)
            .map(|((n, s), b)| {
                (
                    n.clone(),
                    TensorView::new(safetensors::Dtype::F32, s.clone(), b).unwrap(),
                )
            })
            .collect();
        safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
        Checkpoint::open(dir).unwrap()
    }

    #[test]
    fn every_problem_is_reported_with_its_tensor_and_expected_shape() {
        let d = tempfile::tempdir().unwrap();
        let checkpoint = edited(d.path(), |t| {
            t.retain(|(n, _)| n != "model.layers.1.self_attn.k_proj.weight");
            for (n, s) in t.iter_mut() {
                if n == "model.layers.0.mlp.down_proj.weight" {
                    *s = vec![16, 30];
                }
            }
        });
        let cfg = registry::read_config(d.path()).unwrap();
        let e = check_checkpoint(&*cfg, &checkpoint, 1, Kind::Float)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("does not fit config.json: 2 tensor problems"),
            "{e}"
        );
        assert!(
            e.contains("\n  tensor \"model.layers.0.mlp.down_proj.weight\" has shape [16, 30], expected [16, 32] from config.json"),
            "{e}"
        );
        assert!(
            e.contains("\n  missing tensor \"model.layers.1.self_attn.k_proj.weight\""),
            "{e}"
        );
    }

    #[test]
    fn a_tp_size_that_cuts_a_weight_unevenly_is_a_problem_of_that_weight() {
        let d = tempfile::tempdir().unwrap();
        let checkpoint = edited(d.path(), |_| {});
        let cfg = registry::read_config(d.path()).unwrap();
        assert!(check_checkpoint(&*cfg, &checkpoint, 2, Kind::Float).is_ok());
        let e = check_checkpoint(&*cfg, &checkpoint, 3, Kind::Float)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("tensor \"model.layers.0.self_attn.q_proj.weight\": dimension 0 of size 16 does not split into 3 equal parts"),
            "{e}"
        );
    }

    /// The tiny Llama with FP8 blocks of 4 x 8 on every projection (4 rows, so that its 8-row
    /// k_proj splits 2 ways into whole blocks); `f32_weight` names one
    /// projection whose weight is left in F32 beside its scales.
    fn fp8_llama(dir: &std::path::Path, f32_weight: Option<&str>) -> Checkpoint {
        write_model(dir, TINY_LLAMA, None);
        let plain = tensors_read(&*registry::read_config(dir).unwrap()).unwrap();
        let mut tensors: Vec<(String, Vec<usize>, safetensors::Dtype)> = vec![];
        for s in plain {
            let Some(module) = s.name.strip_suffix("_proj.weight") else {
                tensors.push((s.name, s.shape, safetensors::Dtype::F32));
                continue;
            };
            let grid = vec![s.shape[0].div_ceil(4), s.shape[1].div_ceil(8)];
            tensors.push((
                format!("{module}_proj.weight_scale_inv"),
                grid,
                safetensors::Dtype::F32,
            ));
            let dtype = match f32_weight == Some(s.name.as_str()) {
                true => safetensors::Dtype::F32,
                false => safetensors::Dtype::F8_E4M3,
            };
            tensors.push((s.name, s.shape, dtype));
        }
        let bytes: Vec<Vec<u8>> = tensors
            .iter()
            .map(|(_, s, d)| vec![0u8; d.bitsize() / 8 * s.iter().product::<usize>()])
            .collect();
        let views: Vec<(String, TensorView)> = tensors
            .iter()
            .zip(&bytes)
            .map(|((n, s, d), b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
            .collect();
        safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
        let config: serde_json::Value = serde_json::json!({"quantization_config": {
            "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [4, 8]}});
        let quant = crate::quant::config::Quantization::from_config(&config).unwrap();
        Checkpoint::open(dir).unwrap().with_quantization(quant)
    }

    #[test]
    fn quantized_weights_are_listed_with_their_stored_dtype_and_scales() {
        let d = tempfile::tempdir().unwrap();
        let checkpoint = fp8_llama(d.path(), None);
        let cfg = registry::read_config(d.path()).unwrap();
        let reads = check_checkpoint(&*cfg, &checkpoint, 2, Kind::BFloat16).unwrap();
        let specs: Vec<&TensorSpec> = reads.all().collect();
        let find = |n: &str| *specs.iter().find(|s| s.name == n).unwrap();
        let q = find("model.layers.0.self_attn.q_proj.weight");
        assert_eq!((q.local.clone(), q.kind), (vec![8, 16], Kind::Float8e4m3fn));
        let down = find("model.layers.1.mlp.down_proj.weight_scale_inv");
        // [16, 32] in blocks of 4 x 8, split along its inputs: [4, 4] scales, 2 columns a rank.
        assert_eq!((down.local.clone(), down.kind), (vec![4, 2], Kind::Float));
        // Every projection (7 per layer) adds its scales; norms and the embedding stay bf16.
        assert_eq!(specs.len(), 2 + 2 * 9 + 2 * 7);
        assert_eq!(find("model.norm.weight").kind, Kind::BFloat16);
    }

    #[test]
    fn a_quantized_weight_stored_as_floats_is_named_with_the_dtype_expected() {
        let d = tempfile::tempdir().unwrap();
        let checkpoint = fp8_llama(d.path(), Some("model.layers.1.mlp.up_proj.weight"));
        let cfg = registry::read_config(d.path()).unwrap();
        let e = check_checkpoint(&*cfg, &checkpoint, 1, Kind::BFloat16)
            .unwrap_err()
            .to_string();
        assert!(
            e.ends_with(
                ": tensor \"model.layers.1.mlp.up_proj.weight\" has dtype F32, expected F8_E4M3"
            ),
            "{e}"
        );
    }
}
