//! Checks and measurements for GPU machines, behind `hslake debug`: the NCCL back end on one
//! GPU, and the throughput of our forward alone (no host copy, no write).
use std::rc::Rc;
use std::time::Instant;

use hslake_schemas::CapturePoint;
use tch::{Device, Kind, Tensor};

use crate::checkpoint::Checkpoint;
use crate::comm::{Communicator, SingleRank};
use crate::engine::{DeviceKind, EngineOptions};
use crate::error::{CaptureError, Result};
use crate::load::LoadCtx;
use crate::models::registry;
use crate::nccl::{self, NcclComm};

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

/// What [`prefill`] runs: the model on one device (GPU 0, or the CPU) and random token ids.
#[derive(Debug, Clone)]
pub struct PrefillOptions {
    /// The model, device (`tp` must be 1), dtype and norm kernel.
    pub engine: EngineOptions,
    /// Sequences per batch.
    pub batch: i64,
    /// Tokens per sequence.
    pub seq: i64,
    /// Timed iterations (after two warm-up ones).
    pub iters: usize,
    /// Points whose states the forward returns (kept on the device).
    pub points: Vec<CapturePoint>,
}

/// What [`prefill`] measured.
#[derive(Debug, Clone, Copy)]
pub struct PrefillReport {
    /// Seconds the load took.
    pub load_secs: f64,
    /// Tokens per second over the timed iterations.
    pub tokens_per_sec: f64,
}

/// Prefill-only throughput of our forward on random token ids.
pub fn prefill(opts: &PrefillOptions) -> Result<PrefillReport> {
    let e = &opts.engine;
    if e.tp != 1 || opts.batch <= 0 || opts.seq <= 0 {
        return Err(CaptureError::Option(
            "prefill runs on one device (--tp 1) with a positive batch and sequence length".into(),
        ));
    }
    let kind = e.compute_kind()?;
    let device = match e.device {
        DeviceKind::Cpu => Device::Cpu,
        DeviceKind::Cuda => Device::Cuda(0),
    };
    let sync = || {
        if let Device::Cuda(d) = device {
            tch::Cuda::synchronize(d as i64);
        }
    };
    let _no_grad = tch::no_grad_guard();
    let config = registry::read_config(&e.model_dir)?;
    let checkpoint = Checkpoint::open(&e.model_dir)?;
    crate::dry_run::check_checkpoint(&*config, &checkpoint, 1, kind)?;
    let t = Instant::now();
    let ctx = LoadCtx {
        source: &checkpoint,
        comm: Rc::new(SingleRank),
        device,
        kind,
        norm: e.norm,
    };
    let model = config.load(&ctx)?;
    sync();
    let load_secs = t.elapsed().as_secs_f64();
    let vocab = config.info().vocab_size as i64;
    let ids = Tensor::f_randint(vocab, [opts.batch, opts.seq], (Kind::Int64, device))?;
    for _ in 0..2 {
        model.forward(&ids, &opts.points)?;
    }
    sync();
    let t = Instant::now();
    for _ in 0..opts.iters {
        model.forward(&ids, &opts.points)?;
    }
    sync();
    let secs = t.elapsed().as_secs_f64().max(1e-9);
    Ok(PrefillReport {
        load_secs,
        tokens_per_sec: (opts.iters as i64 * opts.batch * opts.seq) as f64 / secs,
    })
}
