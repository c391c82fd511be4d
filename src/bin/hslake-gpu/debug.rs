//! `hslake debug`: checks and measurements for GPU machines (hidden from the help): the NCCL
//! back end on GPU 0, our kernels against libtorch's, and the throughput of our forward alone.
use std::process::ExitCode;

use anyhow::bail;
use hslake_capture::debug::{
    dequant_check, kernels_check, nccl_check, parts_table, prefill, split_check, PrefillOptions,
};
use hslake_capture::DeviceKind;
use hslake_schemas::CapturePoint;

use crate::capture::ForwardArgs;

/// The debug subcommands.
#[derive(clap::Subcommand)]
pub enum Debug {
    /// NCCL back end with one rank on GPU 0: init, and an all-reduce per dtype compared with its input.
    NcclCheck,
    /// Prefill-only throughput of our forward on random token ids (no write); --profile adds
    /// each rank's compute / all-reduce split and rank 0's copy to host memory.
    Prefill(PrefillArgs),
    /// The fused FP8/INT4 dequantization kernels against PyTorch operations on GPU 0: same
    /// bits, and the time of each.
    Dequant {
        /// Timed runs per matrix.
        #[arg(long, default_value_t = 20)]
        iters: usize,
    },
    /// Our fused kernels (SiLU-and-mul, RoPE, RMS norm with the residual add, MoE routing,
    /// alignment and un-permutation) and each attention choice against libtorch's path on GPU
    /// 0, at Llama-3.1-8B, Qwen3-30B-A3B, DeepSeek-V3 and Kimi-K2 shapes: the same bits (or
    /// the stated floor), and the time of each.
    Kernels {
        /// Timed runs per kernel.
        #[arg(long, default_value_t = 10)]
        iters: usize,
    },
    /// The plane split kernel (states into the store's planes and row statistics before the
    /// host copy) against the reference split on the CPU: same planes, same statistics, and
    /// its time.
    Split {
        /// Timed runs.
        #[arg(long, default_value_t = 20)]
        iters: usize,
    },
}

/// Arguments of `hslake debug prefill`.
#[derive(clap::Args)]
pub struct PrefillArgs {
    /// The model and how its forward computes (as `hslake capture` takes them).
    #[command(flatten)]
    forward: ForwardArgs,
    /// Sequences per batch.
    #[arg(long, default_value_t = 8)]
    batch: i64,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 2048)]
    seq: i64,
    /// Timed iterations (after two warm-up ones).
    #[arg(long, default_value_t = 5)]
    iters: usize,
    /// Layers whose outputs the forward returns (kept on the device).
    #[arg(long, value_delimiter = ',', default_value = "2,16,29,31")]
    layers: Vec<CapturePoint>,
    /// Where the forward runs: cuda (GPU 0) or cpu.
    #[arg(long, default_value = "cuda")]
    device: DeviceKind,
    /// Per rank: time in compute and in all-reduces, and rank 0's copy-out, with the device
    /// waited for around each (slower than a plain run; the split is what it is for).
    #[arg(long)]
    profile: bool,
    /// Rank 0's time per part of the forward (norms, projections, RoPE, attention, routing,
    /// alignment, expert GEMMs, un-permutation, shared expert, residual adds, capture copies),
    /// from events on its stream (the forward is not slowed; the copy is timed alone).
    #[arg(long)]
    profile_parts: bool,
}

/// Runs one debug subcommand and prints what it found.
pub fn run(d: Debug) -> anyhow::Result<ExitCode> {
    match d {
        Debug::NcclCheck => {
            let report = nccl_check()?;
            println!("nccl version code {}", report.version);
            for (kind, same) in &report.identity {
                println!(
                    "nccl all-reduce {kind} world=1 on 2^20 elements: identical to input = {same}"
                );
            }
            if let Some((kind, _)) = report.identity.iter().find(|(_, same)| !same) {
                bail!("all-reduce over one rank changed the values ({kind})");
            }
        }
        Debug::Dequant { iters } => {
            let cases = dequant_check(iters)?;
            for c in &cases {
                println!(
                    "dequant {}: fused {:.3} ms ({:.0} GB/s), torch {:.3} ms, {:.1}x, identical = {}",
                    c.what,
                    c.fused_ms,
                    c.fused_gb_per_s,
                    c.torch_ms,
                    c.torch_ms / c.fused_ms,
                    c.identical
                );
            }
            if let Some(c) = cases.iter().find(|c| !c.identical) {
                bail!("the fused kernel and PyTorch disagree on {}", c.what);
            }
        }
        Debug::Kernels { iters } => {
            let cases = kernels_check(iters)?;
            for c in &cases {
                println!(
                    "kernel {}: reference {:.3} ms, ours {:.3} ms ({:.2}x); {}; {}",
                    c.what,
                    c.reference_ms,
                    c.ours_ms,
                    c.reference_ms / c.ours_ms,
                    c.agreement,
                    if c.ok { "ok" } else { "NOT AS PROMISED" }
                );
            }
            let failed: Vec<&str> = cases
                .iter()
                .filter(|c| !c.ok)
                .map(|c| c.what.as_str())
                .collect();
            if !failed.is_empty() {
                bail!("kernels not as promised: {}", failed.join("; "));
            }
            println!("kernels: all {} as promised", cases.len());
        }
        Debug::Split { iters } => {
            let r = split_check(iters)?;
            println!(
                "split {}: {:.3} ms ({:.0} GB/s); samples whose planes differ {:?}, token rows \
                 whose statistics differ {}",
                r.what, r.ms, r.gb_per_s, r.planes_differ, r.stats_differ
            );
            if !r.planes_differ.is_empty() || r.stats_differ > 0 {
                bail!("the plane split kernel and the reference split disagree");
            }
        }
        Debug::Prefill(a) => {
            let report = prefill(&PrefillOptions {
                engine: a.forward.options(a.device),
                batch: a.batch,
                seq: a.seq,
                iters: a.iters,
                points: a.layers,
                profile: a.profile,
                profile_parts: a.profile_parts,
            })?;
            println!("ours load secs {:.1}", report.load_secs);
            let label = if a.profile { "profiled " } else { "" };
            println!("ours {label}prefill tokens/s {:.0}", report.tokens_per_sec);
            for r in &report.ranks {
                let per_iter = |s: f64| 1e3 * s / a.iters as f64;
                println!(
                    "rank {} per iteration: compute {:.1} ms, all-reduce {:.1} ms ({} calls), copy-out {:.1} ms",
                    r.rank,
                    per_iter(r.compute_secs),
                    per_iter(r.all_reduce_secs),
                    r.all_reduces / a.iters.max(1),
                    per_iter(r.copy_out_secs)
                );
            }
            if a.profile_parts {
                print!("{}", parts_table(&report.parts, report.timed_secs, a.iters));
            }
            if let Some(s) = report.streamed {
                println!(
                    "streamed passes of {} tokens through {} layers: {:.4} s per layer, copies at {:.1} GB/s, {:.0}% of the copy time hidden behind compute",
                    s.pass_tokens,
                    s.layers,
                    s.secs_per_layer,
                    s.copy_gb_per_sec,
                    100.0 * s.hidden_share
                );
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
