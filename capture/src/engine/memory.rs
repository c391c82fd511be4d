//! The memory pre-flight: before a model loads, whether one rank's weights and one batch's
//! activations fit the memory its GPU has free, and what to change if they do not.
use tch::Kind;

use crate::error::{CaptureError, Result};
use crate::tools::dry_run::TensorSpec;

pub(super) const GIB: f64 = (1u64 << 30) as f64;

/// Room kept for what the estimate does not itemise: cuBLAS and attention workspaces, the
/// caching allocator's fragmentation, NCCL's buffers.
pub(super) const RESERVE_BYTES: u64 = 1 << 30;

/// One rank's memory need, from the dry run's tensors (rank 0 holds the most: its vocabulary
/// rows round up, and every rank holds as many experts).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MemoryNeed {
    /// Weights as they sit on the device: quantized ones at their stored size, replicated
    /// ones whole, split ones this rank's part.
    pub weights: u64,
    /// Activations of one batch, per token.
    pub per_token: u64,
    /// Scratch that does not grow with the batch: the largest dequantized matrix, and
    /// [`RESERVE_BYTES`].
    pub fixed: u64,
    /// Tokens of one batch (`--max-tokens-per-batch`).
    pub tokens: u64,
}

impl MemoryNeed {
    /// The estimate, for `tokens` per batch, `captured` capture points, residual width
    /// `hidden` and compute dtype `kind`.
    ///
    /// Per token, in the compute dtype's `e` bytes (f32 partial sums at 4 bytes):
    /// - `6 * hidden * e`: the residual stream, its normed copy, a sublayer's output, the
    ///   residual sum, and a MoE layer's gathered tokens and their zeroed output;
    /// - `2 * hidden * 4`: the f32 partial sum of a row-parallel layer and its bias-added copy;
    /// - `4 * widest * e`: the widest per-rank projection output (fused gate|up, or the query
    ///   heads), its activation and the product that feeds the next GEMM;
    /// - `2 * captured * hidden * e`: captured states held on the device until rank 0 copies
    ///   them out (their host copies do not count), twice: the previous batch's are still being
    ///   copied while this one's are made, and on bf16 GPU runs rank 0 splits each batch's
    ///   states into planes of the same size before the copy.
    ///
    /// Attention scores are not counted: on CUDA scaled-dot-product attention runs fused,
    /// without a `[t, t]` matrix. `widest` is the largest output width of any rank-local
    /// weight (vocabulary rows excepted).
    ///
    /// Fixed: a quantized weight is dequantized to f32 and then to the compute dtype as its
    /// layer runs (INT4 codes pass through int32 first), so `2 * largest * (8 + e)` bytes for
    /// the largest quantized matrix, doubled for a fused gate|up pair. With `grouped_experts`
    /// (`--moe-kernel grouped`) a layer's quantized experts are dequantized as one stack: the
    /// largest layer's quantized expert values in the compute dtype, plus the temporaries of one
    /// dequantization chunk (or of the whole stack, if smaller) at `4 + e` bytes a value; the
    /// larger of the two counts.
    pub fn estimate(
        specs: &[TensorSpec],
        tokens: usize,
        captured: usize,
        hidden: usize,
        kind: Kind,
        grouped_experts: bool,
    ) -> Self {
        let e = kind.elt_size_in_bytes() as u64;
        let weights = specs.iter().map(TensorSpec::local_bytes).sum();
        let widest = specs
            .iter()
            .filter(|s| s.local.len() == 2 && !s.rows)
            .map(|s| s.local[0] as u64)
            .max()
            .unwrap_or(0);
        let quantized_values = |s: &TensorSpec| {
            let values_per_element = match s.kind {
                Kind::Float8e4m3fn => 1,
                // Eight 4-bit codes per int32 (the 2-element `weight_shape` is negligible).
                Kind::Int => 8,
                _ => return None,
            };
            Some(s.local.iter().product::<usize>() as u64 * values_per_element)
        };
        let largest_quantized = specs.iter().filter_map(quantized_values).max().unwrap_or(0);
        let mut stacks = std::collections::HashMap::<&str, u64>::new();
        if grouped_experts {
            for s in specs {
                if let (Some(values), Some(at)) = (quantized_values(s), s.name.find(".experts.")) {
                    *stacks.entry(&s.name[..at]).or_default() += values;
                }
            }
        }
        // A stack smaller than one chunk is dequantized in one go: its temporaries are its own size.
        let stack_scratch = match stacks.values().max() {
            Some(&values) => {
                values * e + values.min(crate::quant::dequant::DEQUANTIZE_CHUNK as u64) * (4 + e)
            }
            None => 0,
        };
        let h = hidden as u64;
        MemoryNeed {
            weights,
            per_token: 6 * h * e + 2 * h * 4 + 4 * widest * e + 2 * captured as u64 * h * e,
            fixed: (2 * largest_quantized * (8 + e)).max(stack_scratch) + RESERVE_BYTES,
            tokens: tokens as u64,
        }
    }

    /// Everything one rank needs.
    pub fn total(&self) -> u64 {
        self.weights + self.fixed + self.per_token * self.tokens
    }

    /// `Ok` if this fits `free` bytes (the least any GPU has free); else an error that names
    /// the need, the have, and what to change.
    pub fn check(&self, free: u64, tp: usize, quantized: bool) -> Result<()> {
        if self.total() <= free {
            return Ok(());
        }
        let gib = |b: u64| b as f64 / GIB;
        let mut advice = Vec::new();
        let room = free.saturating_sub(self.weights + self.fixed);
        let fitting_tokens = room / self.per_token.max(1);
        if fitting_tokens > 0 {
            advice.push(format!(
                "lower --max-tokens-per-batch to {fitting_tokens} or less"
            ));
        }
        // Weights shrink about in proportion to the TP size (embeddings and replicated
        // projections do not, so this is a lower bound on the TP size needed).
        let per_rank_weights_at = |t: usize| self.weights * tp as u64 / t as u64;
        if let Some(t) = [2, 4, 8, 16, 32, 64]
            .into_iter()
            .filter(|&t| t > tp)
            .find(|&t| per_rank_weights_at(t) + self.fixed + self.per_token * self.tokens <= free)
        {
            advice.push(format!(
                "raise --tp to {t} or more (if the model splits that way)"
            ));
        } else {
            advice.push("raise --tp (with more GPUs)".into());
        }
        if !quantized {
            advice.push(
                "use a quantized checkpoint (FP8 blocks halve bf16 weights; INT4 quarters them)"
                    .into(),
            );
        }
        Err(CaptureError::Memory(format!(
            "each GPU needs about {:.2} GiB at --tp {tp} (weights {:.2} GiB + activations of \
             --max-tokens-per-batch {} {:.2} GiB + scratch {:.2} GiB), but only {:.2} GiB is \
             free; {}",
            gib(self.total()),
            gib(self.weights),
            self.tokens,
            gib(self.per_token * self.tokens),
            gib(self.fixed),
            gib(free),
            advice.join(", or ")
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(local: &[usize], kind: Kind, rows: bool) -> TensorSpec {
        TensorSpec {
            name: "t".into(),
            shape: local.to_vec(),
            local: local.to_vec(),
            kind,
            rows,
        }
    }

    #[test]
    fn weights_count_stored_bytes_and_activations_the_widest_local_projection() {
        let specs = [
            // Embedding rows: counted as weights, never as a width.
            spec(&[1000, 64], Kind::BFloat16, true),
            spec(&[256, 64], Kind::BFloat16, false),
            // An FP8 expert and its f32 scales.
            spec(&[128, 64], Kind::Float8e4m3fn, false),
            spec(&[1, 1], Kind::Float, false),
            // An INT4 expert: 64 inputs in 8 int32 words per row.
            spec(&[32, 8], Kind::Int, false),
        ];
        let need = MemoryNeed::estimate(&specs, 100, 2, 64, Kind::BFloat16, false);
        assert_eq!(
            need.weights,
            1000 * 64 * 2 + 256 * 64 * 2 + 128 * 64 + 4 + 32 * 8 * 4
        );
        assert_eq!(
            need.per_token,
            6 * 64 * 2 + 2 * 64 * 4 + 4 * 256 * 2 + 2 * 2 * 64 * 2
        );
        // The FP8 matrix (128 x 64) is the larger dequantized one (INT4: 32 x 64).
        assert_eq!(need.fixed, 2 * 128 * 64 * (8 + 2) + RESERVE_BYTES);
        assert_eq!(
            need.total(),
            need.weights + need.fixed + 100 * need.per_token
        );
    }

    #[test]
    fn grouped_quantized_experts_count_their_largest_layer_dequantized_at_once() {
        let named = |name: &str, local: &[usize], kind: Kind| TensorSpec {
            name: name.into(),
            ..spec(local, kind, false)
        };
        // Layer 1 has four INT4 experts of [2048, 512] (64 words a row), layer 2 one.
        let expert = |l: usize, j: usize| {
            named(
                &format!("model.layers.{l}.mlp.experts.{j}.down_proj.weight_packed"),
                &[2048, 64],
                Kind::Int,
            )
        };
        let specs = [
            expert(1, 0),
            expert(1, 1),
            expert(1, 2),
            expert(1, 3),
            expert(2, 0),
        ];
        let e = 2u64;
        let looped = MemoryNeed::estimate(&specs, 1, 1, 64, Kind::BFloat16, false);
        assert_eq!(looped.fixed, 2 * 2048 * 512 * (8 + e) + RESERVE_BYTES);
        let grouped = MemoryNeed::estimate(&specs, 1, 1, 64, Kind::BFloat16, true);
        // Layer 1's stack (4 M values) is smaller than a chunk: its temporaries are its own size.
        assert_eq!(
            grouped.fixed,
            4 * 2048 * 512 * e + 4 * 2048 * 512 * (4 + e) + RESERVE_BYTES
        );
    }

    #[test]
    fn refusal_names_need_have_and_what_to_change() {
        let need = MemoryNeed {
            weights: 60 << 30,
            per_token: 1 << 20,
            fixed: 1 << 30,
            tokens: 16384,
        };
        assert!(need.check(80 << 30, 1, false).is_ok());
        let e = need.check(70 << 30, 1, false).unwrap_err().to_string();
        assert_eq!(
            e,
            "not enough GPU memory: each GPU needs about 77.00 GiB at --tp 1 (weights 60.00 GiB \
             + activations of --max-tokens-per-batch 16384 16.00 GiB + scratch 1.00 GiB), but \
             only 70.00 GiB is free; lower --max-tokens-per-batch to 9216 or less, or raise \
             --tp to 2 or more (if the model splits that way), or use a quantized checkpoint \
             (FP8 blocks halve bf16 weights; INT4 quarters them)"
        );
        // Weights alone too large: no batch size helps, and a quantized model is not told
        // to quantize.
        let e = need.check(50 << 30, 1, true).unwrap_err().to_string();
        assert!(
            e.ends_with("free; raise --tp to 2 or more (if the model splits that way)"),
            "{e}"
        );
    }
}
