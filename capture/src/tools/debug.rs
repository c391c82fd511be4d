//! Checks and measurements for GPU machines, behind `hslake debug`: the NCCL back end on one
//! GPU, and the throughput of our forward alone (no write; with a profile, where each rank's
//! time goes).
use std::rc::Rc;
use std::time::Instant;

use hslake_schemas::CapturePoint;
use tch::{Device, Kind, Tensor};

pub use super::kernels_check::{kernels_check, KernelCase};
pub use super::prefill_stream::StreamedPrefill;
use super::prefill_stream::{prefill_streamed, Shape};
use crate::checkpoint::Checkpoint;
use crate::engine::{root_cause, CheckedModel, EngineOptions};
use crate::error::{CaptureError, Result};
use crate::gpu::comm::{sync, Communicator, TimedComm};
use crate::gpu::cuda::{CopyStream, PinnedBuffer};
use crate::gpu::group;
use crate::gpu::nccl::{self, NcclComm};
use crate::gpu::sections;
pub use crate::gpu::sections::{table as parts_table, PartTime};
use crate::load::LoadCtx;
use crate::models::ModelConfig;
use crate::scalar;

/// What [`nccl_check`] found.
#[derive(Debug, Clone)]
pub struct NcclReport {
    /// The linked NCCL's version code (e.g. 22809 for 2.28.9).
    pub version: i32,
    /// Per dtype: whether an all-reduce over one rank left 2^20 random values unchanged.
    pub identity: Vec<(String, bool)>,
}

/// NCCL with one rank on GPU 0: initialisation, and an all-reduce per dtype compared with its
/// input.
pub fn nccl_check() -> Result<NcclReport> {
    if !tch::Cuda::is_available() {
        return Err(CaptureError::Cuda("CUDA is not available".into()));
    }
    let version = nccl::version()?;
    let comm = NcclComm::init(nccl::unique_id()?, 0, 1)?;
    let mut identity = vec![];
    for kind in [Kind::Float, Kind::BFloat16, Kind::Half] {
        let x = Tensor::f_randn([1 << 20], (Kind::Float, Device::Cuda(0)))?.f_to_kind(kind)?;
        let mut y = x.f_empty_like()?;
        y.f_copy_(&x)?;
        comm.all_reduce_sum(&mut y)?;
        identity.push((format!("{kind:?}"), y.f_equal(&x)?));
    }
    Ok(NcclReport { version, identity })
}

/// What [`prefill`] runs: the model on `tp` devices (GPUs `0..tp`, or CPU threads) and random
/// token ids.
#[derive(Debug, Clone)]
pub struct PrefillOptions {
    /// The model, device, TP size, dtype and kernels.
    pub engine: EngineOptions,
    /// Sequences per batch.
    pub batch: i64,
    /// Tokens per sequence.
    pub seq: i64,
    /// Timed iterations (after two warm-up ones).
    pub iters: usize,
    /// Points whose states the forward returns (kept on the device).
    pub points: Vec<CapturePoint>,
    /// Time each rank's compute and all-reduces apart, and rank 0's copy of the states to
    /// pinned host memory (the device is waited for around each; see [`RankProfile`]).
    pub profile: bool,
    /// Time each named part of rank 0's forward (norms, projections, RoPE, attention, routing,
    /// expert GEMMs...) with events on its stream, and its copy of the states to pinned host
    /// memory after the device is waited for: [`PrefillReport::parts`].
    pub profile_parts: bool,
}

/// What [`prefill`] measured.
#[derive(Debug, Clone)]
pub struct PrefillReport {
    /// Seconds the load took (the slowest rank).
    pub load_secs: f64,
    /// Tokens per second over the timed iterations, as rank 0 saw them.
    pub tokens_per_sec: f64,
    /// One per rank with `profile`, else empty.
    pub ranks: Vec<RankProfile>,
    /// Where the model was streamed (`--placement stream`, or `auto` over the budget).
    pub streamed: Option<StreamedPrefill>,
    /// With `profile_parts`: rank 0's time per named part over the timed iterations, in the
    /// order the parts first ran, and those iterations' wall time (for
    /// [`sections::table`]).
    pub parts: Vec<PartTime>,
    /// Seconds the timed iterations took, as rank 0 saw them.
    pub timed_secs: f64,
}

/// Where one rank's timed iterations went, with the device waited for before and after each
/// all-reduce and each copy: that removes every overlap, so the sum exceeds a plain run's time.
/// Ranks whose all-reduce times differ much are imbalanced: the faster one waits inside it.
#[derive(Debug, Clone, Copy, Default)]
pub struct RankProfile {
    /// The rank.
    pub rank: usize,
    /// Seconds of device work between all-reduces.
    pub compute_secs: f64,
    /// Seconds inside all-reduces (waiting for slower ranks included).
    pub all_reduce_secs: f64,
    /// All-reduces run.
    pub all_reduces: usize,
    /// Seconds rank 0 spent copying the states to pinned host memory (0 elsewhere and on CPU).
    pub copy_out_secs: f64,
}

/// Prefill-only throughput of our forward on random token ids, one thread per rank.
pub fn prefill(opts: &PrefillOptions) -> Result<PrefillReport> {
    let e = &opts.engine;
    if opts.batch <= 0 || opts.seq <= 0 || opts.iters == 0 {
        return Err(CaptureError::Option(format!(
            "prefill needs a positive batch, sequence length and iteration count, got {}, {}, {}",
            opts.batch, opts.seq, opts.iters
        )));
    }
    let vocab_ids = |vocab: i64| -> Result<Vec<i64>> {
        let ids = Tensor::f_randint(vocab, [opts.batch * opts.seq], (Kind::Int64, Device::Cpu))?;
        Ok(Vec::<i64>::try_from(ids)?)
    };
    // The placement as a capture decides it, for batches of this size.
    let mut checked = CheckedModel::check(e.clone())?;
    checked.plan((opts.batch * opts.seq) as usize, opts.points.len())?;
    let (config, checkpoint, kind, stream) = checked.parts();
    let ids = vocab_ids(config.info().vocab_size as i64)?;
    if let Some(plan) = stream {
        let shape = Shape {
            batch: opts.batch,
            seq: opts.seq,
            iters: opts.iters,
            points: &opts.points,
            profile_parts: opts.profile_parts,
        };
        let run = prefill_streamed(e, shape, config, checkpoint, kind, plan, &ids)?;
        return Ok(PrefillReport {
            load_secs: run.load_secs,
            tokens_per_sec: run.tokens_per_sec,
            ranks: vec![],
            streamed: Some(run.passes),
            parts: run.parts,
            timed_secs: run.timed_secs,
        });
    }
    // Resident: the check above ran the dry run for this TP size.
    let comms = group::join_group(e.device, e.tp)?;
    let runs: Vec<Result<RankRun>> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(rank, join)| {
                let (checkpoint, ids) = (&**checkpoint, &ids);
                s.spawn(move || {
                    let _no_grad = tch::no_grad_guard();
                    let comm = join()?;
                    let run = run_rank(rank, comm.clone(), config, checkpoint, opts, kind, ids);
                    if run.is_err() {
                        // No other rank may wait forever in a collective with this one.
                        comm.abort();
                    }
                    run
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(CaptureError::Pipeline("a prefill rank panicked".into()))
                })
            })
            .collect()
    });
    // The failing rank's own error, not another rank's echo of it ("collective abandoned").
    let (runs, errors): (Vec<_>, Vec<_>) = runs.into_iter().partition(|r| r.is_ok());
    if let Some(e) = root_cause(errors.into_iter().filter_map(|r| r.err()).collect()) {
        return Err(e);
    }
    let mut runs: Vec<RankRun> = runs.into_iter().filter_map(|r| r.ok()).collect();
    let secs = runs.first().map_or(0.0, |r| r.secs).max(1e-9);
    Ok(PrefillReport {
        load_secs: runs.iter().map(|r| r.load_secs).fold(0.0, f64::max),
        tokens_per_sec: (opts.iters as i64 * opts.batch * opts.seq) as f64 / secs,
        ranks: runs.iter().filter_map(|r| r.profile).collect(),
        streamed: None,
        parts: runs
            .first_mut()
            .map_or(vec![], |r| std::mem::take(&mut r.parts)),
        timed_secs: secs,
    })
}

/// One rank's load time, timed seconds and profiles.
struct RankRun {
    load_secs: f64,
    secs: f64,
    profile: Option<RankProfile>,
    parts: Vec<PartTime>,
}

/// Loads rank `rank`'s slice, warms up twice, then times `iters` forwards.
fn run_rank(
    rank: usize,
    comm: Rc<dyn Communicator>,
    config: &dyn ModelConfig,
    checkpoint: &Checkpoint,
    opts: &PrefillOptions,
    kind: Kind,
    ids: &[i64],
) -> Result<RankRun> {
    let e = &opts.engine;
    let device = e.device.device(rank);
    let timed = opts
        .profile
        .then(|| Rc::new(TimedComm::new(comm.clone(), device)));
    let t = Instant::now();
    let ctx = LoadCtx {
        source: checkpoint,
        comm: match &timed {
            Some(t) => t.clone() as Rc<dyn Communicator>,
            None => comm,
        },
        device,
        kind,
        kernels: e.kernels,
        hold_dequantized: false,
    };
    let model = config.load(&ctx)?;
    sync(device)?;
    let load_secs = t.elapsed().as_secs_f64();
    let ids = Tensor::f_from_slice(ids)?
        .f_view([opts.batch, opts.seq])?
        .f_to_device(device)?;
    // Rank 0 copies out as a capture does: on a side stream into pinned buffers made once.
    let parts = opts.profile_parts && rank == 0;
    let copy_out = match device {
        Device::Cuda(d) if (opts.profile || parts) && rank == 0 => Some(CopyStream::new(d)?),
        _ => None,
    };
    let mut buffers = vec![];
    for _ in 0..2 {
        let states = model.forward(&ids, &opts.points)?;
        if copy_out.is_some() && buffers.is_empty() {
            buffers = states
                .iter()
                .map(|s| PinnedBuffer::new(s.numel() * s.kind().elt_size_in_bytes()))
                .collect::<Result<_>>()?;
        }
    }
    if let Some(t) = &timed {
        t.reset()?;
    }
    sync(device)?;
    if parts {
        sections::start(device)?;
    }
    let mut copy_secs = 0.0;
    let t = Instant::now();
    for _ in 0..opts.iters {
        let states = model.forward(&ids, &opts.points)?;
        if let (Some(c), Some(timed)) = (&copy_out, &timed) {
            timed.lap()?;
            let started = Instant::now();
            c.start(states, &buffers)?.wait()?;
            copy_secs += started.elapsed().as_secs_f64();
            timed.skip();
        } else if let Some(c) = &copy_out {
            // The copy alone: the forward's kernels are done first.
            sync(device)?;
            let started = Instant::now();
            c.start(states, &buffers)?.wait()?;
            sections::add("capture copies", started.elapsed().as_secs_f64());
        }
    }
    sync(device)?;
    let secs = t.elapsed().as_secs_f64();
    let parts = sections::stop()?;
    let profile = match timed {
        Some(t) => {
            let times = t.times()?;
            Some(RankProfile {
                rank,
                compute_secs: times.compute.as_secs_f64(),
                all_reduce_secs: times.all_reduce.as_secs_f64(),
                all_reduces: times.calls,
                copy_out_secs: copy_secs,
            })
        }
        None => None,
    };
    Ok(RankRun {
        parts,
        load_secs,
        secs,
        profile,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::{write_model, TINY_LLAMA};

    #[test]
    fn a_profiled_tp_two_prefill_times_every_all_reduce_of_every_rank() {
        let d = tempfile::tempdir().unwrap();
        write_model(d.path(), TINY_LLAMA, None);
        let mut engine = EngineOptions::new(d.path().to_path_buf());
        engine.tp = 2;
        let opts = PrefillOptions {
            engine,
            batch: 2,
            seq: 8,
            iters: 3,
            points: vec![CapturePoint::LayerOutput(1)],
            profile: true,
            profile_parts: false,
        };
        let report = prefill(&opts).unwrap();
        assert!(report.tokens_per_sec > 0.0);
        // Per forward: the embedding, then attention and MLP of each of the 2 layers.
        let ranks: Vec<_> = report
            .ranks
            .iter()
            .map(|r| (r.rank, r.all_reduces))
            .collect();
        assert_eq!(ranks, vec![(0, 3 * 5), (1, 3 * 5)]);
    }

    #[test]
    fn a_streamed_prefill_runs_passes_of_whole_batches_up_to_the_layer_it_needs() {
        let d = tempfile::tempdir().unwrap();
        write_model(d.path(), TINY_LLAMA, None);
        let mut engine = EngineOptions::new(d.path().to_path_buf());
        engine.placement.placement = crate::engine::Placement::Stream;
        engine.placement.pass_tokens = Some(40);
        let opts = PrefillOptions {
            engine,
            batch: 2,
            seq: 8,
            iters: 2,
            points: vec![CapturePoint::LayerOutput(0)],
            profile: false,
            profile_parts: false,
        };
        let report = prefill(&opts).unwrap();
        let s = report.streamed.expect("streamed");
        // Two whole batches of 16 tokens fit a pass of 40; layer 0 is all it needs.
        assert_eq!((s.pass_tokens, s.layers), (32, 1));
        assert!(report.tokens_per_sec > 0.0 && s.secs_per_layer > 0.0);
        assert!(report.ranks.is_empty());
    }

    /// The parts a profiled prefill of `config` on the CPU lists, in the order they first ran.
    fn parts_of(config: &str, profile_parts: bool) -> Vec<&'static str> {
        let d = tempfile::tempdir().unwrap();
        write_model(d.path(), config, None);
        let opts = PrefillOptions {
            engine: EngineOptions::new(d.path().to_path_buf()),
            batch: 2,
            seq: 6,
            iters: 2,
            points: vec![CapturePoint::LayerOutput(1)],
            profile: false,
            profile_parts,
        };
        let report = prefill(&opts).unwrap();
        for p in &report.parts {
            assert_eq!(
                p.calls % 2,
                0,
                "{}: {} calls in 2 iterations",
                p.name,
                p.calls
            );
            assert!(p.secs > 0.0, "{}", p.name);
        }
        assert!(report.parts.iter().map(|p| p.secs).sum::<f64>() <= report.timed_secs);
        report.parts.iter().map(|p| p.name).collect()
    }

    #[test]
    fn profiled_parts_name_every_step_of_a_dense_and_two_moe_forwards() {
        let llama = parts_of(TINY_LLAMA, true);
        assert_eq!(
            llama,
            [
                "embed",
                "norm",
                "qkv projection",
                "rope",
                "attention",
                "o projection",
                "residual add",
                "mlp gate_up",
                "mlp silu * up",
                "mlp down"
            ]
        );
        let qwen = parts_of(
            r#"{"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 16, "head_dim": 8,
            "intermediate_size": 32,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 50, "moe_intermediate_size": 8, "num_experts": 4,
            "num_experts_per_tok": 2, "norm_topk_prob": true}"#,
            true,
        );
        for part in [
            "q/k norm",
            "router logits",
            "router top-k",
            "moe align",
            "moe permute",
            "expert GEMMs",
            "expert silu * up",
            "moe unpermute",
        ] {
            assert!(qwen.contains(&part), "{part} not in {qwen:?}");
        }
        let deepseek = parts_of(
            r#"{"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 16,
            "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
            "vocab_size": 50, "moe_intermediate_size": 8, "n_routed_experts": 4,
            "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1,
            "q_lora_rank": 8, "kv_lora_rank": 8, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4,
            "v_head_dim": 4}"#,
            true,
        );
        for part in [
            "mla q projections",
            "mla kv_a projection + norm",
            "mla kv_b projection",
            "mla q/k assembly",
            "shared expert gate_up",
            "moe + shared sum",
        ] {
            assert!(deepseek.contains(&part), "{part} not in {deepseek:?}");
        }
    }

    #[test]
    fn an_unprofiled_prefill_records_no_parts() {
        assert_eq!(parts_of(TINY_LLAMA, false), Vec::<&str>::new());
    }

    #[test]
    fn prefill_refuses_an_empty_batch_naming_the_sizes() {
        let d = tempfile::tempdir().unwrap();
        write_model(d.path(), TINY_LLAMA, None);
        let opts = PrefillOptions {
            engine: EngineOptions::new(d.path().to_path_buf()),
            batch: 0,
            seq: 8,
            iters: 1,
            points: vec![],
            profile: false,
            profile_parts: false,
        };
        let e = prefill(&opts).unwrap_err().to_string();
        assert!(e.contains("got 0, 8, 1"), "{e}");
    }
}

/// One comparison of [`dequant_check`].
#[derive(Debug, Clone)]
pub struct DequantCase {
    /// What was dequantized, e.g. `fp8 [16384, 7168] block 128x128 -> BFloat16`.
    pub what: String,
    /// Milliseconds per matrix, fused kernel.
    pub fused_ms: f64,
    /// Milliseconds per matrix, PyTorch operations.
    pub torch_ms: f64,
    /// Bytes read and written per matrix by an ideal single pass, over the fused time: GB/s.
    pub fused_gb_per_s: f64,
    /// Whether both gave the same bits.
    pub identical: bool,
}

/// The fused dequantization kernels against the PyTorch formulation on GPU 0: same bits for
/// every output dtype, FP8 with whole and partial tiles, INT4 with groups of 32 and 128, a
/// stack of experts; and the time of each (`iters` timed runs after a warm-up).
pub fn dequant_check(iters: usize) -> Result<Vec<DequantCase>> {
    use crate::kernels::DequantKernel;
    use crate::quant::weight::Weight;
    if !tch::Cuda::is_available() {
        return Err(CaptureError::Cuda("CUDA is not available".into()));
    }
    let dev = Device::Cuda(0);
    tch::manual_seed(7);
    let fp8 = |shape: &[i64]| -> Result<Tensor> {
        let codes =
            Tensor::f_randint_low(0, 256, shape, (Kind::Int, dev))?.f_to_kind(Kind::Uint8)?;
        // NaN codes (S.1111.111) would compare unequal to themselves; every other code is kept.
        let low7 = scalar::int(0x7f)?;
        let nan = codes.f_bitwise_and_tensor(&low7)?.f_eq_tensor(&low7)?;
        Ok(codes
            .f_masked_fill_tensor(&nan, &scalar::int(0)?)?
            .f_view_dtype(Kind::Float8e4m3fn)?)
    };
    let scales = |shape: &[i64]| -> Result<Tensor> {
        Ok(Tensor::f_rand(shape, (Kind::Float, dev))?
            .f_add(&scalar::float(0.5)?)?
            .f_mul(&scalar::float(1e-2)?)?)
    };
    let mut cases = vec![];
    for kind in [Kind::BFloat16, Kind::Half, Kind::Float] {
        // (what, the fused kernel's weight, the PyTorch path's, values)
        let mut weights: Vec<(String, Weight, Weight, i64)> = vec![];
        for shape in [vec![16384i64, 7168], vec![576, 7168], vec![8, 4096, 7168]] {
            let w = fp8(&shape)?;
            let mut grid = shape.clone();
            let n = grid.len();
            grid[n - 2] = (grid[n - 2] + 127) / 128;
            grid[n - 1] = (grid[n - 1] + 127) / 128;
            let s = scales(&grid)?;
            let values: i64 = shape.iter().product();
            let make = |dequant| Weight::Fp8 {
                weight: w.shallow_clone(),
                scale_inv: s.shallow_clone(),
                block: [128, 128],
                kind,
                dequant,
            };
            weights.push((
                format!("fp8 {shape:?} block 128x128 -> {kind:?}"),
                make(DequantKernel::Fused),
                make(DequantKernel::Torch),
                values,
            ));
        }
        for (shape, group) in [([16384i64, 7168], 32), ([4096, 7168], 128)] {
            let packed = Tensor::f_randint_low(
                i32::MIN as i64,
                i32::MAX as i64,
                [shape[0], shape[1] / 8],
                (Kind::Int, dev),
            )?;
            let s = scales(&[shape[0], shape[1] / group])?;
            let make = |dequant| Weight::Int4 {
                packed: packed.shallow_clone(),
                scale: s.shallow_clone(),
                group,
                kind,
                dequant,
            };
            weights.push((
                format!("int4 {shape:?} group {group} -> {kind:?}"),
                make(DequantKernel::Fused),
                make(DequantKernel::Torch),
                shape[0] * shape[1],
            ));
        }
        for (what, fused, torch, values) in weights {
            let bits = |t: &Tensor| {
                t.f_view_dtype(if kind == Kind::Float {
                    Kind::Int
                } else {
                    Kind::Int16
                })
            };
            let a = fused.matrix()?;
            let b = torch.matrix()?;
            let identical = bool::try_from(bits(&a)?.f_eq_tensor(&bits(&b)?)?.f_all()?)?;
            drop((a, b));
            let time = |w: &Weight| -> Result<f64> {
                drop(w.matrix()?);
                sync(dev)?;
                let t = Instant::now();
                for _ in 0..iters {
                    drop(w.matrix()?);
                }
                sync(dev)?;
                Ok(t.elapsed().as_secs_f64() * 1e3 / iters as f64)
            };
            let (fused_ms, torch_ms) = (time(&fused)?, time(&torch)?);
            let stored = if what.starts_with("fp8") { 1.0 } else { 0.5 };
            let bytes = values as f64 * (stored + kind.elt_size_in_bytes() as f64);
            cases.push(DequantCase {
                what,
                fused_ms,
                torch_ms,
                fused_gb_per_s: bytes / fused_ms / 1e6,
                identical,
            });
        }
    }
    Ok(cases)
}

/// What [`split_check`] found.
#[derive(Debug, Clone)]
pub struct SplitReport {
    /// The batch split, e.g. `[8, 2048, 7168] bf16, lengths [...]`.
    pub what: String,
    /// Samples whose planes differ from the reference split's (none when the kernel is right).
    pub planes_differ: Vec<usize>,
    /// Token rows whose statistics differ beyond f64 summation order.
    pub stats_differ: usize,
    /// Milliseconds per split on the GPU.
    pub ms: f64,
    /// Bytes read and written by one pass, over that time: GB/s.
    pub gb_per_s: f64,
}

/// The plane split kernel on GPU 0 against the reference split on the CPU (the store's own
/// `to_planes` and a loop for the statistics), on a DeepSeek-V3-wide batch of mixed lengths
/// (padding the kernel must skip, a sample of one token, an empty slot) holding NaN, ±Inf and
/// values near bf16's largest; then its time (`iters` timed runs after a warm-up).
pub fn split_check(iters: usize) -> Result<SplitReport> {
    use crate::gpu::plane_split::{row_field, split, SplitLayout, ROW_STATS};
    if !tch::Cuda::is_available() {
        return Err(CaptureError::Cuda("CUDA is not available".into()));
    }
    let dev = Device::Cuda(0);
    tch::manual_seed(11);
    let (rows, cols, hidden) = (8i64, 2048i64, 7168i64);
    let lens = [2048usize, 1000, 1, 0, 2047, 1536, 7, 2048];
    // Activation-like values: normal, times a per-channel scale spread over two decades.
    let scale = Tensor::f_randn([hidden], (Kind::Float, dev))?
        .f_mul(&scalar::float(1.2)?)?
        .f_exp()?;
    let states = Tensor::f_randn([rows, cols, hidden], (Kind::Float, dev))?
        .f_mul(&scale)?
        .f_to_kind(Kind::BFloat16)?;
    let flat = states.f_view([-1])?;
    for (at, v) in [
        (5i64, f64::NAN),
        (hidden * cols + 3, f64::INFINITY),
        (hidden * cols + hidden + 9, f64::NEG_INFINITY),
        (7 * hidden * cols + 11, 3.0e38),
        (7 * hidden * cols + 12, -3.0e38),
    ] {
        let _ = flat
            .f_narrow(0, at, 1)?
            .f_fill_tensor_(&scalar::float(v)?)?;
    }
    let layout = SplitLayout {
        rows: rows as usize,
        cols: cols as usize,
        hidden: hidden as usize,
    };
    let bytes_of = |t: &Tensor| -> Result<Vec<u8>> {
        let t = t.f_to_device(Device::Cpu)?;
        let mut b = vec![0u8; t.numel()];
        t.f_copy_data_u8(&mut b, t.numel())?;
        Ok(b)
    };
    let gpu = bytes_of(&split(&states, &lens)?)?;
    let cpu = bytes_of(&split(&states.f_to_device(Device::Cpu)?, &lens)?)?;
    let planes_differ = (0..lens.len())
        .filter(|&i| gpu[layout.planes(i, lens[i])] != cpu[layout.planes(i, lens[i])])
        .collect();
    let mut stats_differ = 0;
    for (i, &len) in lens.iter().enumerate() {
        let at = layout.stats(i, len);
        for (g, c) in gpu[at.clone()]
            .chunks_exact(ROW_STATS)
            .zip(cpu[at].chunks_exact(ROW_STATS))
        {
            let f = row_field;
            let sq_close = (f(g, 0) - f(c, 0)).abs() <= f(c, 0).abs() * 1e-12;
            if !sq_close || (1..4).any(|k| f(g, k) != f(c, k)) {
                stats_differ += 1;
            }
        }
    }
    drop(split(&states, &lens)?);
    sync(dev)?;
    let t = Instant::now();
    for _ in 0..iters {
        drop(split(&states, &lens)?);
    }
    sync(dev)?;
    let ms = t.elapsed().as_secs_f64() * 1e3 / iters.max(1) as f64;
    let tokens: usize = lens.iter().sum();
    let moved = tokens * hidden as usize * 4 + tokens * ROW_STATS;
    Ok(SplitReport {
        what: format!("[{rows}, {cols}, {hidden}] bf16, lengths {lens:?}"),
        planes_differ,
        stats_differ,
        ms,
        gb_per_s: moved as f64 / ms / 1e6,
    })
}
