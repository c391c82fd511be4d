//! `hslake debug prefill` of a layer-streamed model: passes of random batches through one
//! device, each layer copied in from host memory as the pass reaches it, states dropped. What
//! the capture engine's streams do per pass, without the writers, so the forward's throughput
//! and the copy's overlap can be read apart.
use std::rc::Rc;
use std::sync::Arc;
use std::time::Instant;

use tch::Tensor;

use hslake_schemas::CapturePoint;

use crate::checkpoint::Checkpoint;
use crate::engine::{EngineOptions, StreamPlan};
use crate::error::Result;
use crate::gpu::comm::{sync, SingleRank};
use crate::gpu::sections::{self, PartTime};
use crate::load::LoadCtx;
use crate::models::ModelConfig;
use crate::stream::pass::{run_pass, Discard, LayerLoad, PassStats};
use crate::stream::slots::Slots;

/// What a streamed prefill's timed passes did.
#[derive(Debug, Clone, Copy, Default)]
pub struct StreamedPrefill {
    /// Tokens per pass (whole batches of `batch x seq`).
    pub pass_tokens: u64,
    /// Layers each pass streamed.
    pub layers: usize,
    /// Seconds per layer per pass, on the device.
    pub secs_per_layer: f64,
    /// Rate of the weight copies, GB/s.
    pub copy_gb_per_sec: f64,
    /// Share of the copy time hidden behind compute (1 = all).
    pub hidden_share: f64,
}

/// A streamed prefill: its load, its rate over the timed passes, and what the passes did.
pub(super) struct StreamedRun {
    pub load_secs: f64,
    pub tokens_per_sec: f64,
    pub passes: StreamedPrefill,
    /// The named parts of the timed passes (with `profile_parts`), and the passes' seconds.
    pub parts: Vec<PartTime>,
    pub timed_secs: f64,
}

/// The shape of a prefill: `iters` timed passes of `batch x seq` random token ids.
pub(super) struct Shape<'a> {
    pub batch: i64,
    pub seq: i64,
    pub iters: usize,
    pub points: &'a [CapturePoint],
    pub profile_parts: bool,
}

/// Loads the resident parts and two slots on the plan's first device, runs one warm-up pass,
/// then `shape.iters` timed passes of `ids` (`[batch, seq]` token ids) repeated to the plan's
/// pass size.
pub(super) fn prefill_streamed(
    engine: &EngineOptions,
    shape: Shape<'_>,
    config: &dyn ModelConfig,
    checkpoint: &Arc<Checkpoint>,
    kind: tch::Kind,
    plan: &StreamPlan,
    ids: &[i64],
) -> Result<StreamedRun> {
    let _no_grad = tch::no_grad_guard();
    let device = engine
        .device
        .device(plan.devices.first().copied().unwrap_or(0));
    let t = Instant::now();
    let _registered = match device.is_cuda() {
        true => crate::engine::register(checkpoint),
        false => vec![],
    };
    let load = LayerLoad {
        comm: Rc::new(SingleRank),
        device,
        kind,
        kernels: engine.kernels,
    };
    let ctx = LoadCtx {
        source: &**checkpoint,
        comm: load.comm.clone(),
        device,
        kind,
        kernels: load.kernels,
        hold_dequantized: false,
    };
    let stack = config.load_stack(&ctx)?;
    let mut slots = Slots::new(checkpoint.clone(), plan.layouts.clone(), device)?;
    sync(device)?;
    let load_secs = t.elapsed().as_secs_f64();
    let batch_tokens = (shape.batch * shape.seq) as u64;
    let batches = (plan.pass_tokens / batch_tokens).max(1) as usize;
    let x = Tensor::f_from_slice(ids)?
        .f_view([shape.batch, shape.seq])?
        .f_to_device(device)?;
    let pass: Vec<Tensor> = (0..batches).map(|_| x.shallow_clone()).collect();
    let mut one_pass = || {
        run_pass(
            &*stack,
            &mut slots,
            &load,
            &pass,
            shape.points,
            &mut Discard,
        )
    };
    // One warm-up pass, untimed.
    one_pass()?;
    sync(device)?;
    let mut total = PassStats::default();
    if shape.profile_parts {
        sections::start(device)?;
    }
    let t = Instant::now();
    for _ in 0..shape.iters {
        let s = one_pass()?;
        total.tokens += s.tokens;
        total.layers = s.layers;
        total.secs += s.secs;
        total.waited_secs += s.waited_secs;
        total.copies.bytes += s.copies.bytes;
        total.copies.secs += s.copies.secs;
    }
    sync(device)?;
    let secs = t.elapsed().as_secs_f64().max(1e-9);
    Ok(StreamedRun {
        parts: sections::stop()?,
        timed_secs: secs,
        load_secs,
        tokens_per_sec: total.tokens as f64 / secs,
        passes: StreamedPrefill {
            pass_tokens: batches as u64 * batch_tokens,
            layers: total.layers,
            secs_per_layer: total.secs / (shape.iters * total.layers.max(1)) as f64,
            copy_gb_per_sec: total.copy_gb_per_sec(),
            hidden_share: total.hidden_share(),
        },
    })
}
