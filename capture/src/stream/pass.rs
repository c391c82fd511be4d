//! One pass of streamed capture: every batch of the pass goes through the model one layer at a
//! time. Each layer's weights are copied into a slot while the layer before computes, loaded
//! from the slot, run over every batch, and dropped; the pass's residual streams stay on the
//! device throughout. Captured points leave as they are produced, through the caller's sink.
//! Streaming stops after the last layer anything is captured from.
use std::rc::Rc;
use std::time::Instant;

use hslake_schemas::CapturePoint;
use tch::{Device, Kind, Tensor};

use super::slots::{CopyTotals, Slots};
use crate::error::{CaptureError, Result};
use crate::gpu::comm::Communicator;
use crate::gpu::cuda::Event;
use crate::kernels::Kernels;
use crate::load::LoadCtx;
use crate::models::{BatchContext, Captures, LayeredModel};

/// Where a pass's captured states go, batch by batch and point by point.
pub(crate) trait PassSink {
    /// Batch `batch`'s (index in the pass) state at `points[point]`, on the device; every point
    /// of a batch arrives exactly once, in the order layers run.
    fn captured(&mut self, batch: usize, point: usize, state: Tensor) -> Result<()>;
}

/// A sink that drops every state (warm-ups, throughput measurements).
pub(crate) struct Discard;

impl PassSink for Discard {
    fn captured(&mut self, _batch: usize, _point: usize, _state: Tensor) -> Result<()> {
        Ok(())
    }
}

/// How the pass's layers load: what a [`LoadCtx`] needs besides its tensor source.
pub(crate) struct LayerLoad {
    /// The stream's communicator: a single rank.
    pub comm: Rc<dyn Communicator>,
    /// The stream's device.
    pub device: Device,
    /// The compute dtype.
    pub kind: Kind,
    /// How the layers compute.
    pub kernels: Kernels,
}

/// What one pass did.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct PassStats {
    /// Batches in the pass.
    pub batches: usize,
    /// Tokens (padded) in the pass.
    pub tokens: u64,
    /// Layers streamed.
    pub layers: usize,
    /// Weight bytes copied to the device and the time the copies took.
    pub copies: CopyTotals,
    /// Seconds from the pass's start to its end on the device (on the CPU, wall time).
    pub secs: f64,
    /// Of those, seconds the device waited for a layer's copy (exposed copy time).
    pub waited_secs: f64,
}

impl PassStats {
    /// Share of the copy time that ran hidden behind compute (1 = all of it).
    pub fn hidden_share(&self) -> f64 {
        if self.copies.secs <= 0.0 {
            return 1.0;
        }
        (1.0 - self.waited_secs / self.copies.secs).clamp(0.0, 1.0)
    }

    /// Copy rate in GB/s.
    pub fn copy_gb_per_sec(&self) -> f64 {
        match self.copies.secs > 0.0 {
            true => self.copies.bytes as f64 / self.copies.secs / 1e9,
            false => 0.0,
        }
    }

    /// Seconds the device computed (the pass less its waits for copies).
    pub fn compute_secs(&self) -> f64 {
        (self.secs - self.waited_secs).max(0.0)
    }
}

/// Device timestamps (CUDA) or wall time (CPU) of a pass and of its waits for copies.
enum Clock {
    Cpu {
        start: Instant,
        waited: f64,
    },
    Cuda {
        start: Event,
        /// Before and after each wait for a layer's copy.
        waits: Vec<(Event, Event)>,
    },
}

impl Clock {
    fn start(device: Device) -> Result<Self> {
        Ok(match device {
            Device::Cuda(_) => {
                let start = Event::timed()?;
                start.record_on_default()?;
                Clock::Cuda {
                    start,
                    waits: vec![],
                }
            }
            _ => Clock::Cpu {
                start: Instant::now(),
                waited: 0.0,
            },
        })
    }

    /// Marks the point before libtorch's stream waits for a copy; returns what
    /// [`Clock::after_wait`] takes.
    fn before_wait(&mut self) -> Result<Option<Event>> {
        match self {
            Clock::Cpu { .. } => Ok(None),
            Clock::Cuda { .. } => {
                let e = Event::timed()?;
                e.record_on_default()?;
                Ok(Some(e))
            }
        }
    }

    fn after_wait(&mut self, before: Option<Event>, cpu_secs: f64) -> Result<()> {
        match (self, before) {
            (Clock::Cpu { waited, .. }, _) => *waited += cpu_secs,
            (Clock::Cuda { waits, .. }, Some(b)) => {
                let a = Event::timed()?;
                a.record_on_default()?;
                waits.push((b, a));
            }
            (Clock::Cuda { .. }, None) => {}
        }
        Ok(())
    }

    /// (seconds of the pass, seconds waited); on CUDA this waits for the pass to finish.
    fn finish(self) -> Result<(f64, f64)> {
        match self {
            Clock::Cpu { start, waited } => Ok((start.elapsed().as_secs_f64(), waited)),
            Clock::Cuda { start, waits } => {
                let end = Event::timed()?;
                end.record_on_default()?;
                end.synchronize()?;
                let mut waited = 0.0;
                for (b, a) in &waits {
                    waited += f64::from(a.elapsed_ms(b)?) / 1e3;
                }
                Ok((f64::from(end.elapsed_ms(&start)?) / 1e3, waited))
            }
        }
    }
}

/// Runs the batches `ids` (right-padded `[b, t]` token ids on the device) through `model`
/// layer by layer, loading each layer from `slots`, handing every captured state to `sink`.
/// Once the last needed layer is loaded, layer 0 is prefetched for the next pass.
pub(crate) fn run_pass(
    model: &dyn LayeredModel,
    slots: &mut Slots,
    load: &LayerLoad,
    ids: &[Tensor],
    points: &[CapturePoint],
    sink: &mut dyn PassSink,
) -> Result<PassStats> {
    let n = model.num_layers();
    let last = Captures::new(points, n)?.last_layer(n);
    let mut clock = Clock::start(load.device)?;
    let mut stats = PassStats {
        batches: ids.len(),
        tokens: ids.iter().map(|t| t.numel() as u64).sum(),
        layers: last + 1,
        ..Default::default()
    };
    // 1. Layer 0's copy (if the last pass did not start it) overlaps the embedding of every
    //    batch; each batch's residual stream, [b, t, hidden], stays on the device for the pass.
    slots.prefetch(0)?;
    let mut xs: Vec<(Tensor, BatchContext)> =
        ids.iter().map(|t| model.embed(t)).collect::<Result<_>>()?;
    for i in 0..=last {
        // 2. The next layer's copy (after the last layer, the next pass's first) begins before
        //    this layer is queued, so that it overlaps this layer's compute, and is queued in
        //    parts as the batches go (see `Slots::begin`).
        slots.begin(if i < last { i + 1 } else { 0 })?;
        let parts = xs.len() + 1;
        slots.advance(1, parts)?;
        let before = clock.before_wait()?;
        let t = Instant::now();
        let source = slots.take(i)?;
        let copy_secs = t.elapsed().as_secs_f64();
        clock.after_wait(before, copy_secs)?;
        let ctx = LoadCtx {
            source: &source,
            comm: load.comm.clone(),
            device: load.device,
            kind: load.kind,
            kernels: load.kernels,
            hold_dequantized: true,
        };
        let layer = model.load_layer(&ctx, i)?;
        // 3. The layer over every batch of the pass; its captured points leave at once.
        for (j, (x, batch)) in xs.iter_mut().enumerate() {
            *x = layer.forward(x, batch)?;
            slots.advance(j + 2, parts)?;
            for (p, _) in points
                .iter()
                .enumerate()
                .filter(|(_, p)| **p == CapturePoint::LayerOutput(i as u32))
            {
                sink.captured(j, p, x.shallow_clone())?;
            }
        }
        drop(layer);
        slots.finish()?;
        slots.release()?;
    }
    // 4. The final norm, where it is captured.
    if let Some(p) = points.iter().position(|p| *p == CapturePoint::FinalNorm) {
        for (j, (x, _)) in xs.iter().enumerate() {
            sink.captured(j, p, model.final_norm(x)?)?;
        }
    }
    drop(xs);
    let (secs, waited) = clock.finish()?;
    stats.secs = secs;
    stats.waited_secs = waited;
    stats.copies = slots.copy_totals()?;
    if stats.layers == 0 {
        return Err(CaptureError::Pipeline("a pass with no layer".into()));
    }
    Ok(stats)
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::sync::Arc;

    use super::*;
    use crate::checkpoint::Checkpoint;
    use crate::gpu::comm::SingleRank;
    use crate::kernels::{DequantKernel, MoeKernel, NormKernel, TpReduce};
    use crate::models::registry;
    use crate::stream::layouts;

    /// Tiny models of every decoder family with hidden 64 and 3 layers: Llama with biases,
    /// Mistral with a window narrower than the batches, Qwen3, Qwen3-MoE and DeepSeek-V3 (MLA,
    /// one dense layer, then experts).
    const TINY: &[(&str, &str)] = &[
        (
            "llama_bias",
            r#"{"architectures": ["LlamaForCausalLM"], "attention_bias": true, "mlp_bias": true}"#,
        ),
        (
            "mistral_window",
            r#"{"architectures": ["MistralForCausalLM"], "sliding_window": 5}"#,
        ),
        (
            "qwen3",
            r#"{"architectures": ["Qwen3ForCausalLM"], "head_dim": 16}"#,
        ),
        (
            "qwen3_moe",
            r#"{"architectures": ["Qwen3MoeForCausalLM"], "head_dim": 16,
                "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
                "mlp_only_layers": [0]}"#,
        ),
        (
            "deepseek_v3",
            r#"{"architectures": ["DeepseekV3ForCausalLM"], "num_attention_heads": 4,
                "moe_intermediate_size": 32, "n_routed_experts": 8, "num_experts_per_tok": 2,
                "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1, "q_lora_rank": 24,
                "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
                "v_head_dim": 12}"#,
        ),
    ];

    fn config(arch: &str) -> String {
        let mut c: serde_json::Value = serde_json::from_str(arch).unwrap();
        let shared = serde_json::json!({"hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 4,
            "vocab_size": 50, "rms_norm_eps": 1e-5, "rope_theta": 10000.0});
        for (k, v) in shared.as_object().unwrap() {
            if c.get(k).is_none() {
                c[k] = v.clone();
            }
        }
        c.to_string()
    }

    fn ctx<'a>(source: &'a dyn crate::load::TensorSource, kind: Kind) -> LoadCtx<'a> {
        LoadCtx {
            source,
            comm: Rc::new(SingleRank),
            device: Device::Cpu,
            kind,
            kernels: kernels(),
            hold_dequantized: false,
        }
    }

    fn kernels() -> Kernels {
        Kernels {
            norm: NormKernel::Exact,
            moe: MoeKernel::Grouped,
            dequant: DequantKernel::Torch,
            tp_reduce: TpReduce::F32,
            ..Kernels::default()
        }
    }

    /// Three right-padded batches of different shapes, wider than Mistral's window.
    fn batches() -> Vec<Tensor> {
        [(2, 9), (1, 13), (3, 4)]
            .iter()
            .enumerate()
            .map(|(k, &(b, t))| {
                let ids: Vec<i64> = (0..b * t)
                    .map(|i| (i * 7 + k as i64 * 11 + 3) % 50)
                    .collect();
                Tensor::from_slice(&ids).view([b, t])
            })
            .collect()
    }

    /// Collects what a pass captures, by (batch, point).
    #[derive(Default)]
    struct Collect(Vec<(usize, usize, Tensor)>);

    impl PassSink for Collect {
        fn captured(&mut self, batch: usize, point: usize, state: Tensor) -> Result<()> {
            self.0.push((batch, point, state));
            Ok(())
        }
    }

    /// The resident model's states and the streamed pass's, by batch and point, with the
    /// pass's statistics.
    fn both(
        dir: &Path,
        kind: Kind,
        points: &[CapturePoint],
    ) -> (Vec<Vec<Tensor>>, Vec<Vec<Tensor>>, PassStats) {
        let _no_grad = tch::no_grad_guard();
        let cfg = registry::read_config(dir).unwrap();
        let checkpoint = Arc::new(Checkpoint::open(dir).unwrap());
        let resident = cfg.load(&ctx(&*checkpoint, kind)).unwrap();
        let want: Vec<Vec<Tensor>> = batches()
            .iter()
            .map(|ids| resident.forward(ids, points).unwrap())
            .collect();
        let reads = crate::tools::dry_run::check_checkpoint(&*cfg, &checkpoint, 1, kind).unwrap();
        let layouts = Arc::new(layouts(&reads, &checkpoint).unwrap());
        let stack = cfg.load_stack(&ctx(&*checkpoint, kind)).unwrap();
        let mut slots = Slots::new(checkpoint.clone(), layouts, Device::Cpu).unwrap();
        let load = LayerLoad {
            comm: Rc::new(SingleRank),
            device: Device::Cpu,
            kind,
            kernels: kernels(),
        };
        let mut sink = Collect::default();
        let stats = run_pass(&*stack, &mut slots, &load, &batches(), points, &mut sink).unwrap();
        let mut got: Vec<Vec<Option<Tensor>>> = (0..3)
            .map(|_| points.iter().map(|_| None).collect())
            .collect();
        for (b, p, t) in sink.0 {
            assert!(
                got[b][p].replace(t).is_none(),
                "batch {b} point {p} came twice"
            );
        }
        let got = got
            .into_iter()
            .map(|b| {
                b.into_iter()
                    .map(|t| t.expect("a point never came"))
                    .collect()
            })
            .collect();
        (want, got, stats)
    }

    #[test]
    fn a_streamed_pass_stores_the_resident_bits_for_every_family_in_f32_and_bf16() {
        let d = tempfile::tempdir().unwrap();
        let points: Vec<CapturePoint> = (0..3)
            .map(CapturePoint::LayerOutput)
            .chain([CapturePoint::FinalNorm])
            .collect();
        for (name, arch) in TINY {
            let dir = d.path().join(name);
            crate::fixtures::write_model(&dir, &config(arch), None);
            for kind in [Kind::Float, Kind::BFloat16] {
                let (want, got, stats) = both(&dir, kind, &points);
                for (b, (w, g)) in want.iter().zip(&got).enumerate() {
                    for (p, (w, g)) in w.iter().zip(g).enumerate() {
                        assert_eq!(w.size(), g.size(), "{name} {kind:?} batch {b} point {p}");
                        assert!(
                            w.view_dtype(Kind::Uint8).equal(&g.view_dtype(Kind::Uint8)),
                            "{name} {kind:?}: batch {b} point {p} differs from the resident run"
                        );
                    }
                }
                assert_eq!((stats.batches, stats.layers), (3, 3), "{name}");
                assert!(stats.copies.bytes > 0, "{name}");
            }
        }
    }

    #[test]
    fn streaming_stops_after_the_last_captured_layer() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("m");
        crate::fixtures::write_model(&dir, &config(TINY[0].1), None);
        let points = [CapturePoint::LayerOutput(1)];
        let (want, got, stats) = both(&dir, Kind::Float, &points);
        assert_eq!(stats.layers, 2);
        for (w, g) in want.iter().zip(&got) {
            assert!(w[0].equal(&g[0]));
        }
    }
}
