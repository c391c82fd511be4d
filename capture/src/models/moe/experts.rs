//! This rank's routed experts (expert parallelism: whole experts per rank, never cut) and their
//! two ways to run: one GEMM pair per expert, or every expert of the layer in two grouped GEMMs
//! over weights stacked at load.
use tch::{Device, Kind, Tensor};

use super::align::Aligned;
use super::spec::MoeSpec;
use crate::error::{CaptureError, Result};
use crate::gpu::sections;
use crate::kernels::{Fusion, MoeKernel};
use crate::load::LoadCtx;
use crate::models::layers::silu_mul;
use crate::models::tp::check_split;
use crate::quant::weight::Weight;
use crate::scalar;

/// One routed expert: SwiGLU with gate and up stacked into one weight (quantized experts stay
/// quantized until the expert runs).
struct Expert {
    /// `[2 * moe_intermediate, hidden]`: gate rows, then up rows.
    gate_up: Weight,
    /// `[hidden, moe_intermediate]`.
    down: Weight,
}

/// This rank's routed experts: whole experts `first..first + local.len()` of `num_experts`.
pub(super) struct Experts {
    local: Vec<Expert>,
    first: usize,
    num_experts: i64,
    intermediate: i64,
    /// With [`MoeKernel::Grouped`]: the experts' weights stacked, `local`'s dense matrices being
    /// views into them (one copy in memory).
    stacked: Option<Stacked>,
    /// `--activation` and `--moe-route`.
    activation: Fusion,
    route: Fusion,
}

/// A layer's expert weights stacked for grouped GEMMs, in the checkpoint's `[out, in]` layout
/// per expert, stored as the checkpoint stores them: a quantized stack is dequantized as one
/// tensor when the layer runs (a few kernels for all experts, not a few per expert).
struct Stacked {
    /// `[experts, 2 * moe_intermediate, hidden]`.
    gate_up: Weight,
    /// `[experts, hidden, moe_intermediate]`.
    down: Weight,
}

impl Stacked {
    /// Empty stacks for `count` experts stored like `first`, when `_grouped_mm` can run them:
    /// bf16 matrices on CUDA (the kernel's only dtype there), rows whose byte strides are
    /// multiples of 16 (the kernel's alignment), and FP8 rows in whole blocks. `None` keeps the
    /// loop.
    fn for_experts_like(first: &Expert, count: usize, device: Device) -> Result<Option<Stacked>> {
        let kind = first.gate_up.kind();
        let aligned = |w: &Weight| {
            w.shape().last().copied().unwrap_or(0) * kind.elt_size_in_bytes() as i64 % 16 == 0
        };
        if (device.is_cuda() && kind != Kind::BFloat16)
            || !aligned(&first.gate_up)
            || !aligned(&first.down)
        {
            return Ok(None);
        }
        match (
            first.gate_up.empty_stack(count)?,
            first.down.empty_stack(count)?,
        ) {
            (Some(gate_up), Some(down)) => Ok(Some(Stacked { gate_up, down })),
            _ => Ok(None),
        }
    }

    /// The stacks dequantized once, for a layer that serves many batches (a streamed pass):
    /// the per-forward dequantization of every expert of the layer was a large share of a
    /// quantized MoE layer's time. The experts' own views keep the quantized stacks until they
    /// are dropped with the layer; the grouped path reads only these.
    fn into_dense(self) -> Result<Stacked> {
        Ok(Stacked {
            gate_up: self.gate_up.into_dense()?,
            down: self.down.into_dense()?,
        })
    }

    /// Copies expert `j`'s weights into the stacks and points it at them, so that its own
    /// tensors are freed as it is loaded: one layer's experts never exist twice.
    fn adopt(&self, j: usize, expert: &mut Expert) -> Result<()> {
        for (stack, weight) in [
            (&self.gate_up, &mut expert.gate_up),
            (&self.down, &mut expert.down),
        ] {
            if !weight.move_into(stack, j)? {
                return Err(CaptureError::Unsupported(format!(
                    "--moe-kernel grouped: this rank's expert {j} of the layer is stored in another \
                     format than its first (dense or quantized), and grouped GEMMs need one; use \
                     --moe-kernel loop"
                )));
            }
        }
        Ok(())
    }
}

/// Where every routed-expert weight is read: one whole linear `name` (a module prefix), dense
/// or quantized as the checkpoint stores it.
fn expert_weight(
    ctx: &LoadCtx,
    name: &str,
    out_features: usize,
    in_features: usize,
) -> Result<Weight> {
    Weight::full(ctx, name, out_features, in_features)
}

impl Experts {
    /// Loads this rank's `<prefix>.<j>.{gate,up,down}_proj.weight`.
    pub fn load(ctx: &LoadCtx, prefix: &str, hidden: usize, spec: &MoeSpec) -> Result<Self> {
        let (e, i, tp) = (
            spec.num_experts,
            spec.intermediate_size,
            ctx.comm.world_size(),
        );
        // Experts are never cut: a TP size that does not divide them is refused by name.
        check_split(tp, &[(spec.experts_field, e)])?;
        let per_rank = e / tp;
        let first = ctx.comm.rank() * per_rank;
        let mut local = Vec::with_capacity(per_rank);
        let mut stacked = None;
        for j in first..first + per_rank {
            let name = |proj: &str| format!("{prefix}.{j}.{proj}");
            let (gate, up) = (name("gate_proj"), name("up_proj"));
            let parts = vec![
                expert_weight(ctx, &gate, i, hidden)?,
                expert_weight(ctx, &up, i, hidden)?,
            ];
            let mut expert = Expert {
                gate_up: Weight::cat(ctx, &[&gate, &up], parts)?,
                down: expert_weight(ctx, &name("down_proj"), hidden, i)?,
            };
            if j == first && ctx.kernels.moe == MoeKernel::Grouped {
                stacked = Stacked::for_experts_like(&expert, per_rank, ctx.device)?;
                if stacked.is_none() {
                    tracing::debug!("{prefix}: experts keep the per-expert loop (a dtype, width or FP8 block layout grouped GEMMs cannot take)");
                }
            }
            if let Some(s) = &stacked {
                s.adopt(j - first, &mut expert)?;
            }
            local.push(expert);
        }
        if ctx.hold_dequantized {
            stacked = stacked.map(Stacked::into_dense).transpose()?;
        }
        Ok(Experts {
            local,
            first,
            num_experts: e as i64,
            intermediate: i as i64,
            stacked,
            activation: ctx.kernels.activation,
            route: ctx.kernels.moe_route,
        })
    }

    /// The weighted sum of this rank's experts' outputs for tokens `x: [n, hidden]` routed by
    /// `weights`/`ids` `[n, top_k]`: `[n, hidden]` in `x`'s dtype, zero where no local expert
    /// was chosen.
    ///
    /// Tokens are grouped by expert (a stable sort of the chosen ids), so each expert runs one
    /// GEMM pair over its contiguous slice of assignments, and experts nobody chose are skipped.
    /// Results are scattered back with `index_add_` expert by expert in ascending order, as
    /// transformers adds them; a token meets each expert at most once, so the sum's order
    /// within an expert does not matter.
    pub fn forward(&self, x: &Tensor, weights: &Tensor, ids: &Tensor) -> Result<Tensor> {
        if let Some(stacked) = &self.stacked {
            return self.forward_grouped(stacked, x, weights, ids);
        }
        sections::time("experts (loop)", || self.forward_loop(x, weights, ids))
    }

    /// [`Experts::forward`] one GEMM pair per expert.
    fn forward_loop(&self, x: &Tensor, weights: &Tensor, ids: &Tensor) -> Result<Tensor> {
        let k = ids.size()[1];
        // 1. Assignments [n * k] sorted by expert: their tokens and weights.
        let flat = ids.f_reshape([-1])?;
        let order = flat.f_argsort_stable(true, 0, false)?;
        let tokens = order.f_floor_divide(&scalar::int(k)?)?;
        let slot_weights = weights.f_reshape([-1])?.f_index_select(0, &order)?;
        // 2. How many assignments each expert has: one small copy to the host per layer.
        let counts = flat
            .f_bincount::<Tensor>(None, self.num_experts)?
            .f_to_device(Device::Cpu)?;
        let counts = Vec::<i64>::try_from(counts)?;
        let mut out = x.f_zeros_like()?;
        let mut start: i64 = counts[..self.first].iter().sum();
        for (expert, &count) in self.local.iter().zip(&counts[self.first..]) {
            if count > 0 {
                // 3. [count, hidden] -> [count, 2 * inter] -> [count, inter] -> [count, hidden].
                let rows = tokens.f_narrow(0, start, count)?;
                // A quantized expert's matrices are made here, only for experts that run.
                let gate_up = x
                    .f_index_select(0, &rows)?
                    .f_linear::<Tensor>(&expert.gate_up.matrix()?, None)?;
                let i = self.intermediate;
                let act = gate_up
                    .f_narrow(-1, 0, i)?
                    .f_silu()?
                    .f_mul(&gate_up.f_narrow(-1, i, i)?)?;
                // The weight multiplies in its own dtype (f32 for DeepSeek) before the rounding
                // to x's dtype, as transformers does.
                let y = act
                    .f_linear::<Tensor>(&expert.down.matrix()?, None)?
                    .f_mul(&slot_weights.f_narrow(0, start, count)?.f_unsqueeze(1)?)?
                    .f_to_kind(x.kind())?;
                let _ = out.f_index_add_(0, &rows, &y)?;
            }
            start += count;
        }
        Ok(out)
    }
}

impl Experts {
    /// [`Experts::forward`] as two grouped GEMMs over every assignment at once, in transformers'
    /// `grouped_mm_experts_forward` order: assignments sorted by expert (this rank's; others'
    /// sort past the last group and are zeroed), `gate_up`, SwiGLU, `down`, times the routing
    /// weight in its dtype, back in token order, summed over the top-k in that dtype and
    /// rounded to `x`'s. No copy to the host: the groups' ends stay on the device.
    fn forward_grouped(
        &self,
        s: &Stacked,
        x: &Tensor,
        weights: &Tensor,
        ids: &Tensor,
    ) -> Result<Tensor> {
        let (first, local) = (self.first as i64, self.local.len() as i64);
        // 1-2. Assignments sorted stably by expert (others' past the last group), group ends.
        let aligned = sections::time("moe align", || Aligned::new(ids, first, local, self.route))?;
        let xs = sections::time("moe permute", || Ok(x.f_index_select(0, &aligned.rows)?))?;
        // A quantized stack's matrices exist from here to their GEMM.
        let gemm = |input: &Tensor, w: &Weight| -> Result<Tensor> {
            Ok(input.f_internal_grouped_mm(
                &w.matrix()?.f_transpose(-2, -1)?,
                Some(&aligned.ends),
                None::<&Tensor>,
                None,
            )?)
        };
        let gate_up = sections::time("expert GEMMs", || gemm(&xs, &s.gate_up))?;
        let act = sections::time("expert silu * up", || {
            silu_mul(&gate_up, self.intermediate, self.activation)
        })?;
        let y = sections::time("expert GEMMs", || gemm(&act, &s.down))?;
        // 3-4. Weighted (rows past the last group, left unwritten by the kernel, replaced by
        //      zero), back in assignment order, summed over each token's top-k.
        sections::time("moe unpermute", || {
            aligned.unpermute(&y, ids, weights, (first, local), x.kind())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::DequantKernel;

    /// Scattered values in [-1, 1] fixed by `salt`, without the global generator: tests run
    /// in parallel threads, and two that seed it at once would draw each other's numbers (an
    /// expert set built twice must have the same weights both times).
    fn scattered(shape: &[i64], salt: i64) -> Tensor {
        let n: i64 = shape.iter().product();
        (Tensor::arange(n, (Kind::Float, Device::Cpu)) * 0.73 + salt as f64 * 1.37)
            .sin()
            .view(shape)
    }

    /// Experts `first..first + count` of 6 (hidden 8, width 4) with scattered weights.
    fn experts(first: usize, count: usize) -> Experts {
        let all: Vec<Expert> = (0..6)
            .map(|j| Expert {
                gate_up: Weight::Dense(scattered(&[8, 8], 2 * j)),
                down: Weight::Dense(scattered(&[8, 4], 2 * j + 1)),
            })
            .collect();
        Experts {
            local: all.into_iter().skip(first).take(count).collect(),
            first,
            num_experts: 6,
            intermediate: 4,
            stacked: None,
            activation: Fusion::Torch,
            route: Fusion::Torch,
        }
    }

    /// [`experts`] with the grouped kernel's stacked weights.
    fn grouped_experts(first: usize, count: usize) -> Experts {
        let mut ex = experts(first, count);
        let stacked = Stacked::for_experts_like(&ex.local[0], count, Device::Cpu)
            .unwrap()
            .expect("hidden 8 and width 4 in f32 are 16-byte rows");
        for (j, e) in ex.local.iter_mut().enumerate() {
            stacked.adopt(j, e).unwrap();
        }
        ex.stacked = Some(stacked);
        ex
    }

    /// Token by token, choice by choice: `sum_j w_j * down_e(silu(gate_e x) * up_e x)` over
    /// the choices `e` that `ex` holds.
    fn naive(ex: &Experts, x: &Tensor, w: &Tensor, ids: &Tensor) -> Tensor {
        let out = x.zeros_like();
        for n in 0..x.size()[0] {
            for j in 0..ids.size()[1] {
                let e = ids.int64_value(&[n, j]) as usize;
                let Some(expert) = e.checked_sub(ex.first).and_then(|l| ex.local.get(l)) else {
                    continue;
                };
                let gu = x
                    .get(n)
                    .linear::<Tensor>(&expert.gate_up.matrix().unwrap(), None);
                let act = gu.narrow(0, 0, 4).silu() * gu.narrow(0, 4, 4);
                let y = act.linear::<Tensor>(&expert.down.matrix().unwrap(), None)
                    * w.double_value(&[n, j]);
                let _ = out.get(n).f_add_(&y).unwrap();
            }
        }
        out
    }

    #[test]
    fn grouped_experts_equal_a_token_by_token_loop_and_split_across_ranks() {
        tch::manual_seed(22);
        let x = Tensor::randn([10, 8], (Kind::Float, Device::Cpu));
        let w = Tensor::rand([10, 2], (Kind::Float, Device::Cpu));
        // Two distinct experts per token; expert 5 is never chosen.
        let firsts: Vec<i64> = (0..10).map(|n| n % 5).collect();
        let ids = Tensor::stack(
            &[
                Tensor::from_slice(&firsts),
                Tensor::from_slice(&firsts).remainder(4).g_add_scalar(1),
            ],
            1,
        );
        let whole = experts(0, 6);
        let got = whole.forward(&x, &w, &ids).unwrap();
        let want = naive(&whole, &x, &w, &ids);
        assert!(got.allclose(&want, 1e-5, 1e-5, false));
        // Ranks of 3 experts each sum to the whole.
        let (r0, r1) = (experts(0, 3), experts(3, 3));
        let halves = r0.forward(&x, &w, &ids).unwrap() + r1.forward(&x, &w, &ids).unwrap();
        assert!(halves.allclose(&got, 1e-5, 1e-5, false));
        assert!(r1.forward(&x, &w, &ids).unwrap().allclose(
            &naive(&r1, &x, &w, &ids),
            1e-5,
            1e-5,
            false
        ));
    }

    /// Twelve tokens of hidden 8 (seeded by `seed`), their routing weights, and two distinct
    /// experts each: expert 5 is never chosen, expert 0 by every fourth token (empty and small
    /// groups).
    fn twelve_tokens(seed: i64) -> (Tensor, Tensor, Tensor) {
        tch::manual_seed(seed);
        let x = Tensor::randn([12, 8], (Kind::Float, Device::Cpu));
        let w = Tensor::rand([12, 2], (Kind::Float, Device::Cpu));
        let a: Vec<i64> = (0..12).map(|n| [0, 1, 2, 3][n % 4]).collect();
        let b: Vec<i64> = (0..12).map(|n| [4, 3, 1, 2][n % 4]).collect();
        let ids = Tensor::stack(&[Tensor::from_slice(&a), Tensor::from_slice(&b)], 1);
        (x, w, ids)
    }

    #[test]
    fn grouped_gemm_experts_equal_the_loop_on_every_rank() {
        let (x, w, ids) = twelve_tokens(23);
        for (first, count) in [(0, 6), (0, 3), (3, 3), (2, 2)] {
            let looped = experts(first, count).forward(&x, &w, &ids).unwrap();
            let grouped = grouped_experts(first, count).forward(&x, &w, &ids).unwrap();
            assert!(
                grouped.allclose(&looped, 1e-5, 1e-5, false),
                "experts {first}..{}: max diff {}",
                first + count,
                (&grouped - &looped).abs().max().double_value(&[])
            );
        }
    }

    /// Experts `first..first + count` of 6 (hidden 8, width 8) with scattered INT4 weights
    /// (groups of 8), stacked for the grouped kernel if `grouped`.
    fn int4_experts(first: usize, count: usize, grouped: bool) -> Experts {
        let int4 = |out: i64, salt: i64| Weight::Int4 {
            // Every bit pattern of the words: scattered values across the whole i32 range.
            packed: (scattered(&[out, 1], salt) * i32::MAX as f64).to_kind(Kind::Int),
            scale: scattered(&[out, 1], salt + 100).abs() * 0.2,
            group: 8,
            kind: Kind::Float,
            dequant: DequantKernel::Fused,
        };
        let all: Vec<Expert> = (0..6)
            .map(|j| Expert {
                gate_up: int4(16, 2 * j),
                down: int4(8, 2 * j + 1),
            })
            .collect();
        let mut ex = Experts {
            local: all.into_iter().skip(first).take(count).collect(),
            first,
            num_experts: 6,
            intermediate: 8,
            stacked: None,
            activation: Fusion::Torch,
            route: Fusion::Torch,
        };
        if grouped {
            let stacked = Stacked::for_experts_like(&ex.local[0], count, Device::Cpu)
                .unwrap()
                .expect("INT4 experts stack");
            for (j, e) in ex.local.iter_mut().enumerate() {
                stacked.adopt(j, e).unwrap();
            }
            ex.stacked = Some(stacked);
        }
        ex
    }

    #[test]
    fn grouped_gemms_over_a_dequantized_stack_equal_the_loop_over_each_expert() {
        let (x, w, ids) = twelve_tokens(25);
        for (first, count) in [(0, 6), (3, 3)] {
            let looped = int4_experts(first, count, false)
                .forward(&x, &w, &ids)
                .unwrap();
            let grouped = int4_experts(first, count, true)
                .forward(&x, &w, &ids)
                .unwrap();
            assert!(
                grouped.allclose(&looped, 1e-5, 1e-5, false),
                "experts {first}..{}: max diff {}",
                first + count,
                (&grouped - &looped).abs().max().double_value(&[])
            );
            assert!(looped.abs().max().double_value(&[]) > 0.0);
        }
    }

    #[test]
    fn experts_dequantized_once_at_load_equal_them_dequantized_per_forward_bit_for_bit() {
        let (x, w, ids) = twelve_tokens(26);
        let per_forward = int4_experts(0, 6, true);
        let mut held = int4_experts(0, 6, true);
        held.stacked = held.stacked.take().map(|s| s.into_dense().unwrap());
        assert!(matches!(
            held.stacked.as_ref().map(|s| &s.gate_up),
            Some(Weight::Dense(_))
        ));
        // Two forwards, as two batches of a pass use one held stack.
        for _ in 0..2 {
            let want = per_forward.forward(&x, &w, &ids).unwrap();
            let got = held.forward(&x, &w, &ids).unwrap();
            assert!(got.equal(&want));
            assert!(want.abs().max().double_value(&[]) > 0.0);
        }
    }

    #[test]
    fn grouped_gemms_are_not_used_where_the_kernel_cannot_run_them() {
        // A width whose f32 rows are not a multiple of 16 bytes keeps the loop.
        let odd = Expert {
            gate_up: Weight::Dense(Tensor::randn([6, 5], (Kind::Float, Device::Cpu))),
            down: Weight::Dense(Tensor::randn([5, 3], (Kind::Float, Device::Cpu))),
        };
        assert!(Stacked::for_experts_like(&odd, 2, Device::Cpu)
            .unwrap()
            .is_none());
    }
}
