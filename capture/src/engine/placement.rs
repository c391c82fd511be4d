//! Where a model's weights live while it captures: resident on the GPUs (split by tensor
//! parallelism), or streamed layer by layer from host memory through each device (see
//! [`crate::stream`]). The memory pre-flight decides: `auto` keeps a model resident where it
//! fits the GPU budget and streams it otherwise, and logs the numbers behind the choice.
use hslake_schemas::units::SizeRange;
use tch::Kind;

use super::memory::{MemoryNeed, GIB, RESERVE_BYTES};
use crate::error::{CaptureError, Result};
use crate::stream::layout::LayerLayout;
use crate::tools::dry_run::{ModelReads, TensorSpec};

/// Tokens of the largest pass `auto` picks: a pass hides a layer's copy behind its compute
/// once its tokens' FLOPs outlast the copy (for DeepSeek-V3-sized MoE layers on an H200, from
/// about 100k tokens); beyond that a larger pass only holds more captured states in host
/// memory and delays the first sample.
pub const MAX_AUTO_PASS_TOKENS: u64 = 1 << 18;

/// The GPU memory a capture may use on each device: 1 MiB to 1 PiB; a bare number is GiB.
pub const GPU_MEMORY: SizeRange = SizeRange::bytes("--gpu-memory", 1 << 20, 1 << 50).bare_gib();

/// Where a capture's weights live, the GPU memory it may use, and how it streams.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[cfg_attr(feature = "clap", derive(clap::Args))]
pub struct PlacementOptions {
    /// Where the weights live: auto (resident on the GPUs where the model fits --gpu-memory,
    /// else streamed), resident (every weight on the GPUs, split by --tp) or stream (each layer
    /// copied from host memory to each device as a pass of batches reaches it; any model size on
    /// one GPU).
    #[cfg_attr(feature = "clap", arg(long, default_value_t))]
    pub placement: Placement,
    /// GPU memory capture may use on each device (e.g. 24GiB; a bare number is GiB), instead of
    /// what the driver reports free; the pre-flight sizes everything from it (and then also
    /// checks a CPU run).
    #[cfg_attr(
        feature = "clap",
        arg(long, alias = "gpu-memory-gib", value_name = "SIZE", value_parser = GPU_MEMORY.parser())
    )]
    pub gpu_memory: Option<u64>,
    /// Tokens of one streamed pass: every batch of a pass goes through a layer before the next
    /// layer is copied in (default: what --gpu-memory leaves, up to 262144).
    #[cfg_attr(feature = "clap", arg(long))]
    pub pass_tokens: Option<u64>,
    /// GPUs that stream, each running its own passes over its share of the samples from the one
    /// host copy of the weights, with no collective (e.g. 0,1; default the first --tp GPUs). A
    /// GPU named twice runs two streams on it; on cpu each entry (0) is one stream.
    #[cfg_attr(feature = "clap", arg(long, value_delimiter = ','))]
    pub devices: Vec<usize>,
}

/// Where the weights live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Placement {
    /// Resident where the model fits the GPU budget, streamed otherwise.
    #[default]
    Auto,
    /// Every weight on the GPUs for the engine's life, split by tensor parallelism.
    Resident,
    /// Layers copied from host memory to each device as passes reach them.
    Stream,
}

impl std::str::FromStr for Placement {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(Placement::Auto),
            "resident" => Ok(Placement::Resident),
            "stream" => Ok(Placement::Stream),
            _ => Err(format!(
                "unknown placement {s:?}; expected auto, resident or stream"
            )),
        }
    }
}

impl std::fmt::Display for Placement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Placement::Auto => "auto",
            Placement::Resident => "resident",
            Placement::Stream => "stream",
        })
    }
}

/// One streaming device's memory need.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StreamNeed {
    /// What stays resident: embeddings, final norm.
    pub resident: u64,
    /// One layer slot: the largest layer's stored bytes (two are held).
    pub slot: u64,
    /// What a loaded layer holds beyond its slot (weights converted to the compute dtype,
    /// grouped experts stacked) and dequantizes as it runs, for the largest layer.
    pub layer_scratch: u64,
    /// Activations of one batch, per token (as the resident estimate counts them).
    pub per_token: u64,
    /// Tokens of one batch.
    pub batch_tokens: u64,
    /// The residual stream the pass keeps on the device, per token.
    pub residual_per_token: u64,
}

impl StreamNeed {
    /// The need for batches of `batch_tokens` capturing `captured` points of a model `hidden`
    /// wide, from what the dry run saw each part read (`reads`, in device memory) and each
    /// layer's stored layout.
    pub fn estimate(
        reads: &ModelReads,
        layouts: &[LayerLayout],
        batch_tokens: usize,
        captured: usize,
        hidden: usize,
        kind: Kind,
        grouped_experts: bool,
    ) -> Self {
        let all: Vec<TensorSpec> = reads.all().cloned().collect();
        let whole =
            MemoryNeed::estimate(&all, batch_tokens, captured, hidden, kind, grouped_experts);
        let layer_scratch = reads
            .layers
            .iter()
            .zip(layouts)
            .map(|(specs, layout)| {
                let held_apart: u64 = specs
                    .iter()
                    .filter(|s| {
                        let stored = layout.get(&s.name).map(|p| p.stored.kind);
                        stored != Some(s.kind) || (grouped_experts && s.name.contains(".experts."))
                    })
                    .map(TensorSpec::local_bytes)
                    .sum();
                let dequant = MemoryNeed::estimate(specs, 0, 0, hidden, kind, grouped_experts)
                    .fixed
                    .saturating_sub(RESERVE_BYTES);
                held_apart + dequant
            })
            .max()
            .unwrap_or(0);
        StreamNeed {
            resident: reads.stack.iter().map(TensorSpec::local_bytes).sum(),
            slot: layouts.iter().map(|l| l.bytes as u64).max().unwrap_or(0),
            layer_scratch,
            per_token: whole.per_token,
            batch_tokens: batch_tokens as u64,
            residual_per_token: hidden as u64 * kind.elt_size_in_bytes() as u64,
        }
    }

    /// Everything but the pass's residual stream.
    pub fn fixed(&self) -> u64 {
        self.resident
            + 2 * self.slot
            + self.layer_scratch
            + self.per_token * self.batch_tokens
            + RESERVE_BYTES
    }

    /// Everything, for a pass of `pass_tokens`.
    pub fn total(&self, pass_tokens: u64) -> u64 {
        self.fixed() + self.residual_per_token * pass_tokens
    }

    /// The pass size: `asked`, checked against `budget`; or the most `budget` allows up to
    /// [`MAX_AUTO_PASS_TOKENS`]. At least one batch; a budget that cannot hold the resident
    /// parts, both slots, a layer and one batch is refused by name.
    pub fn pass_tokens(&self, budget: u64, asked: Option<u64>) -> Result<u64> {
        let gib = |b: u64| b as f64 / GIB;
        let one_batch = self.batch_tokens.max(1);
        if self.total(one_batch) > budget {
            return Err(CaptureError::Memory(format!(
                "{:.2} GiB of GPU memory is too small to stream this model: it needs {:.2} GiB \
                 for one layer at a time (resident embeddings and norm {:.2} GiB + two layer \
                 slots of {:.2} GiB + the layer's own copies and dequantization scratch {:.2} GiB \
                 + one batch of {} tokens {:.2} GiB + reserve {:.2} GiB); raise --gpu-memory or \
                 lower --max-tokens-per-batch",
                gib(budget),
                gib(self.total(one_batch)),
                gib(self.resident),
                gib(self.slot),
                gib(self.layer_scratch),
                self.batch_tokens,
                gib(self.per_token * self.batch_tokens + self.residual_per_token * one_batch),
                gib(RESERVE_BYTES),
            )));
        }
        let most = (budget - self.fixed()) / self.residual_per_token.max(1);
        match asked {
            Some(t) if t > most => Err(CaptureError::Memory(format!(
                "--pass-tokens {t} does not fit {:.2} GiB of GPU memory: the pass's residual \
                 stream takes {:.2} GiB on top of {:.2} GiB for the layers and one batch; at most \
                 {most} tokens fit",
                gib(budget),
                gib(self.residual_per_token * t),
                gib(self.fixed()),
            ))),
            Some(t) => Ok(t.max(one_batch)),
            None => Ok(most.min(MAX_AUTO_PASS_TOKENS).max(one_batch)),
        }
    }

    /// The numbers, for the log.
    pub fn describe(&self, pass_tokens: u64) -> String {
        let gib = |b: u64| b as f64 / GIB;
        format!(
            "{:.2} GiB (resident embeddings and norm {:.2} + two layer slots of {:.2} + layer \
             copies and scratch {:.2} + one batch {:.2} + the pass's residual stream of {} tokens \
             {:.2} + reserve {:.2})",
            gib(self.total(pass_tokens)),
            gib(self.resident),
            gib(self.slot),
            gib(self.layer_scratch),
            gib(self.per_token * self.batch_tokens),
            pass_tokens,
            gib(self.residual_per_token * pass_tokens),
            gib(RESERVE_BYTES),
        )
    }
}

/// How a capture will hold its model, once decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decided {
    /// Resident, split over `tp` ranks.
    Resident,
    /// Streamed, with passes of this many tokens.
    Stream {
        /// Tokens per pass.
        pass_tokens: u64,
    },
}

/// Decides the placement: `asked`, or for `auto` resident where `resident` fits `budget` (no
/// budget: a CPU run without `--gpu-memory`, always resident) and streamed otherwise; a
/// streamed placement gets its pass size. Logs the numbers behind the choice.
pub(crate) fn decide(
    asked: Placement,
    resident: &MemoryNeed,
    stream: &StreamNeed,
    budget: Option<u64>,
    pass_tokens: Option<u64>,
) -> Result<Decided> {
    let gib = |b: u64| b as f64 / GIB;
    let stream_in = |budget: u64| -> Result<Decided> {
        let pass_tokens = stream.pass_tokens(budget, pass_tokens)?;
        tracing::info!(
            "placement stream: each device needs {} of {:.2} GiB",
            stream.describe(pass_tokens),
            gib(budget)
        );
        Ok(Decided::Stream { pass_tokens })
    };
    match (asked, budget) {
        (Placement::Resident, _) => Ok(Decided::Resident),
        (Placement::Stream, Some(b)) => stream_in(b),
        (Placement::Stream, None) => Ok(Decided::Stream {
            pass_tokens: pass_tokens.unwrap_or(MAX_AUTO_PASS_TOKENS),
        }),
        (Placement::Auto, None) => Ok(Decided::Resident),
        (Placement::Auto, Some(b)) if resident.total() <= b => {
            tracing::info!(
                "placement auto: resident, the model fits ({:.2} GiB per GPU of {:.2} GiB)",
                gib(resident.total()),
                gib(b)
            );
            Ok(Decided::Resident)
        }
        (Placement::Auto, Some(b)) => {
            tracing::info!(
                "placement auto: stream, the model does not fit resident ({:.2} GiB per GPU: \
                 weights {:.2} + activations {:.2} + scratch {:.2}; budget {:.2} GiB)",
                gib(resident.total()),
                gib(resident.weights),
                gib(resident.per_token * resident.tokens),
                gib(resident.fixed),
                gib(b)
            );
            stream_in(b)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn need() -> StreamNeed {
        StreamNeed {
            resident: 2 << 30,
            slot: 10 << 30,
            layer_scratch: 10 << 30,
            per_token: 1 << 20,
            batch_tokens: 16384,
            residual_per_token: 14336,
        }
    }

    fn resident(weights: u64) -> MemoryNeed {
        MemoryNeed {
            weights,
            per_token: 1 << 20,
            fixed: 1 << 30,
            tokens: 16384,
        }
    }

    #[test]
    fn auto_keeps_a_model_that_fits_resident_and_streams_one_that_does_not() {
        let budget = Some(139u64 << 30);
        assert_eq!(
            decide(Placement::Auto, &resident(100 << 30), &need(), budget, None).unwrap(),
            Decided::Resident
        );
        let streamed = decide(Placement::Auto, &resident(600 << 30), &need(), budget, None);
        assert_eq!(
            streamed.unwrap(),
            Decided::Stream {
                pass_tokens: MAX_AUTO_PASS_TOKENS
            }
        );
        // A CPU run with no budget stays resident unless streaming is asked for.
        assert_eq!(
            decide(Placement::Auto, &resident(600 << 30), &need(), None, None).unwrap(),
            Decided::Resident
        );
    }

    #[test]
    fn the_pass_fills_what_the_budget_leaves_and_asked_sizes_are_checked() {
        let n = need();
        let one_batch = n.fixed() + 16_384 * n.residual_per_token;
        assert_eq!(n.pass_tokens(one_batch, None).unwrap(), 16_384);
        let roomy = n.fixed() + 50_000 * n.residual_per_token;
        assert_eq!(n.pass_tokens(roomy, None).unwrap(), 50_000);
        assert_eq!(n.pass_tokens(roomy, Some(20_000)).unwrap(), 20_000);
        let e = n.pass_tokens(roomy, Some(60_000)).unwrap_err().to_string();
        assert!(
            e.contains("--pass-tokens 60000") && e.contains("at most 50000"),
            "{e}"
        );
    }

    #[test]
    fn a_budget_too_small_for_one_layer_is_refused_by_name() {
        let n = need();
        let e = n.pass_tokens(24 << 30, None).unwrap_err().to_string();
        assert!(
            e.contains("24.00 GiB of GPU memory is too small to stream this model")
                && e.contains("two layer slots of 10.00 GiB"),
            "{e}"
        );
    }
}
