//! The one type every linear layer holds, [`Weight`]: its rank's part of an `[out, in]`
//! weight, dense or still quantized as the checkpoint stores it (the layouts are in
//! [`super`]'s docs), loaded, fused and stacked without dequantizing; a quantized one becomes
//! the compute-dtype matrix only when its layer runs.
use tch::{Kind, Tensor};

use super::config::Quantization;
use super::dequant::{self, Scheme, DEQUANTIZE_CHUNK};
use crate::error::{CaptureError, Result};
use crate::kernels::DequantKernel;
use crate::load::{LoadCtx, Shard};

/// A linear layer's `[out, in]` weight (this rank's part of it), dense or still quantized.
pub(crate) enum Weight {
    /// In the compute dtype.
    Dense(Tensor),
    /// float8_e4m3fn values and their f32 block scales.
    Fp8 {
        /// `[out, in]` float8_e4m3fn.
        weight: Tensor,
        /// `[ceil(out / bo), ceil(in / bi)]` f32.
        scale_inv: Tensor,
        /// `[bo, bi]`.
        block: [i64; 2],
        /// The compute dtype the matrix is produced in.
        kind: Kind,
        /// How the matrix is produced.
        dequant: DequantKernel,
    },
    /// Eight 4-bit codes per int32 and their f32 group scales.
    Int4 {
        /// `[out, in / 8]` int32.
        packed: Tensor,
        /// `[out, in / group]` f32.
        scale: Tensor,
        /// Inputs per scale.
        group: i64,
        /// The compute dtype the matrix is produced in.
        kind: Kind,
        /// How the matrix is produced.
        dequant: DequantKernel,
    },
}

impl Weight {
    /// Loads linear `<prefix>` of full shape `[out, in]`, this rank's `shard` of it (`Full`,
    /// or `Split` along dimension 0 or 1), in whatever format the checkpoint stores it.
    pub fn load(ctx: &LoadCtx, prefix: &str, out: usize, inp: usize, shard: Shard) -> Result<Self> {
        let name = |suffix: &str| format!("{prefix}.{suffix}");
        let source = ctx.source;
        match source.quantization() {
            Quantization::Fp8Block { block } if source.has(&name("weight_scale_inv")) => {
                let grid = [out.div_ceil(block[0]), inp.div_ceil(block[1])];
                check_grid(prefix, [out, inp], *block, shard, "FP8 block")?;
                let weight = source.stored(
                    &name("weight"),
                    &[out, inp],
                    shard,
                    ctx.device,
                    &[Kind::Float8e4m3fn],
                )?;
                let scale_inv = source.tensor(
                    &name("weight_scale_inv"),
                    &grid,
                    shard,
                    ctx.device,
                    Kind::Float,
                )?;
                Ok(Weight::Fp8 {
                    weight,
                    scale_inv,
                    block: [block[0] as i64, block[1] as i64],
                    kind: ctx.kind,
                    dequant: ctx.kernels.dequant,
                })
            }
            q @ Quantization::Int4Group { group_size, .. } if q.int4_module(prefix) => {
                let g = *group_size;
                if !inp.is_multiple_of(g) {
                    return Err(CaptureError::Quantization {
                        name: prefix.to_string(),
                        message: format!(
                            "{inp} input features do not divide into INT4 groups of \
                             group_size {g}"
                        ),
                    });
                }
                check_grid(prefix, [out, inp], [1, g], shard, "INT4 group")?;
                let packed = source.stored(
                    &name("weight_packed"),
                    &[out, inp / 8],
                    shard,
                    ctx.device,
                    &[Kind::Int],
                )?;
                let scale = source.tensor(
                    &name("weight_scale"),
                    &[out, inp / g],
                    shard,
                    ctx.device,
                    Kind::Float,
                )?;
                let shape = source.stored(
                    &name("weight_shape"),
                    &[2],
                    Shard::Full,
                    tch::Device::Cpu,
                    &[Kind::Int, Kind::Int64],
                )?;
                if source.reads_data() {
                    let got = Vec::<i64>::try_from(shape.f_to_kind(Kind::Int64)?)?;
                    if got != [out as i64, inp as i64] {
                        return Err(CaptureError::Quantization {
                            name: prefix.to_string(),
                            message: format!(
                                "weight_shape is {got:?}, expected [{out}, {inp}] from config.json"
                            ),
                        });
                    }
                }
                Ok(Weight::Int4 {
                    packed,
                    scale,
                    group: g as i64,
                    kind: ctx.kind,
                    dequant: ctx.kernels.dequant,
                })
            }
            _ => Ok(Weight::Dense(source.tensor(
                &name("weight"),
                &[out, inp],
                shard,
                ctx.device,
                ctx.kind,
            )?)),
        }
    }

    /// This rank's part of dimension `dim` of the `[out, in]` weight of linear `prefix`, in the
    /// checkpoint's format (dense or quantized).
    pub fn split(ctx: &LoadCtx, prefix: &str, out: usize, inp: usize, dim: usize) -> Result<Self> {
        Weight::load(ctx, prefix, out, inp, ctx.split_shard(dim))
    }

    /// The whole `[out, in]` weight of linear `prefix`, in the checkpoint's format.
    pub fn full(ctx: &LoadCtx, prefix: &str, out: usize, inp: usize) -> Result<Self> {
        Weight::load(ctx, prefix, out, inp, Shard::Full)
    }

    /// `parts` (of one format, as one fused load reads them) stacked along the output rows.
    /// Quantized parts stay quantized; their scale grids must start on a tile boundary.
    pub fn cat(ctx: &LoadCtx, prefixes: &[&str], mut parts: Vec<Weight>) -> Result<Self> {
        if parts.len() == 1 {
            return Ok(parts.remove(0));
        }
        let mixed = || CaptureError::Quantization {
            name: prefixes.join(" + "),
            message: "the weights fused into one GEMM are stored in different formats".into(),
        };
        match &parts[0] {
            Weight::Dense(_) => {
                let dense = parts
                    .into_iter()
                    .map(|p| match p {
                        Weight::Dense(t) => Ok(t),
                        _ => Err(mixed()),
                    })
                    .collect::<Result<Vec<_>>>()?;
                Ok(Weight::Dense(ctx.concat(dense)?))
            }
            Weight::Fp8 { block, kind: k, .. } => {
                let (block, kind) = (*block, *k);
                let (mut ws, mut ss) = (vec![], vec![]);
                for (p, prefix) in parts.into_iter().zip(prefixes) {
                    let Weight::Fp8 {
                        weight, scale_inv, ..
                    } = p
                    else {
                        return Err(mixed());
                    };
                    if weight.size()[0] % block[0] != 0 {
                        return Err(CaptureError::Quantization {
                            name: prefix.to_string(),
                            message: format!(
                                "{} output rows are not whole FP8 blocks of {} rows, so it \
                                 cannot be fused with {}",
                                weight.size()[0],
                                block[0],
                                prefixes.join(" + ")
                            ),
                        });
                    }
                    ws.push(weight);
                    ss.push(scale_inv);
                }
                Ok(Weight::Fp8 {
                    weight: ctx.concat(ws)?,
                    scale_inv: ctx.concat(ss)?,
                    block,
                    kind,
                    dequant: ctx.kernels.dequant,
                })
            }
            Weight::Int4 { group, kind: k, .. } => {
                let (group, kind) = (*group, *k);
                let (mut ps, mut ss) = (vec![], vec![]);
                for p in parts {
                    let Weight::Int4 { packed, scale, .. } = p else {
                        return Err(mixed());
                    };
                    ps.push(packed);
                    ss.push(scale);
                }
                Ok(Weight::Int4 {
                    packed: ctx.concat(ps)?,
                    scale: ctx.concat(ss)?,
                    group,
                    kind,
                    dequant: ctx.kernels.dequant,
                })
            }
        }
    }

    /// The dtype of [`Weight::matrix`].
    pub fn kind(&self) -> Kind {
        match self {
            Weight::Dense(t) => t.kind(),
            Weight::Fp8 { kind, .. } | Weight::Int4 { kind, .. } => *kind,
        }
    }

    /// The `[out, in]` matrix in the compute dtype (`[count, out, in]` for a stack made by
    /// [`Weight::empty_stack`]): the tensor itself when dense, else dequantized now
    /// ([`dequant::matrix`]).
    pub fn matrix(&self) -> Result<Tensor> {
        self.matrix_in_chunks(DEQUANTIZE_CHUNK)
    }

    /// The weight as its [`Weight::matrix`], held dense from now on: dequantized once, where
    /// it would otherwise be at every use. The quantized tensors are dropped.
    pub fn into_dense(self) -> Result<Weight> {
        Ok(match self {
            Weight::Dense(_) => self,
            quantized => Weight::Dense(quantized.matrix()?),
        })
    }

    /// [`Weight::matrix`], a stack dequantized about `chunk` values at a time.
    fn matrix_in_chunks(&self, chunk: i64) -> Result<Tensor> {
        let (scheme, kernel, kind, parts) = match self {
            Weight::Dense(t) => return Ok(t.shallow_clone()),
            Weight::Fp8 {
                weight,
                scale_inv,
                block,
                kind,
                dequant,
            } => (
                Scheme::Fp8 { block: *block },
                *dequant,
                *kind,
                [weight, scale_inv],
            ),
            Weight::Int4 {
                packed,
                scale,
                group,
                kind,
                dequant,
            } => (
                Scheme::Int4 { group: *group },
                *dequant,
                *kind,
                [packed, scale],
            ),
        };
        dequant::matrix(scheme, kernel, parts, &self.shape(), kind, chunk)
    }

    /// The shape of [`Weight::matrix`]: `[out, in]`, or `[count, out, in]` for a stack.
    pub fn shape(&self) -> Vec<i64> {
        match self {
            Weight::Dense(t) => t.size(),
            Weight::Fp8 { weight, .. } => weight.size(),
            Weight::Int4 { packed, .. } => {
                let mut s = packed.size();
                if let Some(last) = s.last_mut() {
                    *last *= 8;
                }
                s
            }
        }
    }

    /// The tensors that hold it: the values, then the scales (if quantized).
    fn tensors(&self) -> Vec<&Tensor> {
        match self {
            Weight::Dense(t) => vec![t],
            Weight::Fp8 {
                weight, scale_inv, ..
            } => vec![weight, scale_inv],
            Weight::Int4 { packed, scale, .. } => vec![packed, scale],
        }
    }

    /// [`Weight::tensors`], to be replaced.
    fn tensors_mut(&mut self) -> Vec<&mut Tensor> {
        match self {
            Weight::Dense(t) => vec![t],
            Weight::Fp8 {
                weight, scale_inv, ..
            } => vec![weight, scale_inv],
            Weight::Int4 { packed, scale, .. } => vec![packed, scale],
        }
    }

    /// An uninitialised stack for `count` weights stored as this one is (every tensor gains a
    /// leading `count` dimension), whose [`Weight::matrix`] is all of them at once; `None` for
    /// FP8 whose rows are not whole blocks, which cannot be dequantized as one matrix.
    pub fn empty_stack(&self, count: usize) -> Result<Option<Weight>> {
        if let Weight::Fp8 { weight, block, .. } = self {
            if weight.size()[0] % block[0] != 0 {
                return Ok(None);
            }
        }
        let stack = |t: &Tensor| -> Result<Tensor> {
            let mut shape = vec![count as i64];
            shape.extend(t.size());
            Ok(Tensor::f_empty(shape.as_slice(), (t.kind(), t.device()))?)
        };
        Ok(Some(match self {
            Weight::Dense(t) => Weight::Dense(stack(t)?),
            Weight::Fp8 {
                weight,
                scale_inv,
                block,
                kind,
                dequant,
            } => Weight::Fp8 {
                weight: stack(weight)?,
                scale_inv: stack(scale_inv)?,
                block: *block,
                kind: *kind,
                dequant: *dequant,
            },
            Weight::Int4 {
                packed,
                scale,
                group,
                kind,
                dequant,
            } => Weight::Int4 {
                packed: stack(packed)?,
                scale: stack(scale)?,
                group: *group,
                kind: *kind,
                dequant: *dequant,
            },
        }))
    }

    /// Copies this weight into entry `j` of `stack` (from [`Weight::empty_stack`] of a weight
    /// stored alike) and makes it a view of that entry, freeing its own tensors. `false`, and
    /// nothing changed, if the two are stored in different formats.
    pub fn move_into(&mut self, stack: &Weight, j: usize) -> Result<bool> {
        if std::mem::discriminant(self) != std::mem::discriminant(stack) {
            return Ok(false);
        }
        for (mine, stacked) in self.tensors_mut().into_iter().zip(stack.tensors()) {
            let mut slot = stacked.f_select(0, j as i64)?;
            slot.f_copy_(mine)?;
            *mine = slot;
        }
        Ok(true)
    }
}

/// Refuses a TP split that would cut a scale's tile (an FP8 block or an INT4 group): each
/// rank's part of the split dimension must be whole tiles.
fn check_grid(
    prefix: &str,
    shape: [usize; 2],
    tile: [usize; 2],
    shard: Shard,
    what: &str,
) -> Result<()> {
    if let Shard::Split { dim, world, .. } = shard {
        let (n, t) = (shape[dim], tile[dim]);
        if n.is_multiple_of(world) && !(n / world).is_multiple_of(t) {
            return Err(CaptureError::Quantization {
                name: prefix.to_string(),
                message: format!(
                    "split {world} ways along dimension {dim}, each rank gets {} of {n}, which \
                     is not a whole number of {what} tiles of {t}; use a TP size that keeps \
                     {} a multiple of {t}",
                    n / world,
                    if dim == 0 {
                        "out_features / tp"
                    } else {
                        "in_features / tp"
                    }
                ),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    fn fp8_weight(weight: &Tensor, scale_inv: &Tensor, block: [i64; 2], kind: Kind) -> Weight {
        Weight::Fp8 {
            weight: weight.shallow_clone(),
            scale_inv: scale_inv.shallow_clone(),
            block,
            kind,
            dequant: DequantKernel::Fused,
        }
    }

    fn int4_weight(packed: &Tensor, scale: &Tensor, group: i64, kind: Kind) -> Weight {
        Weight::Int4 {
            packed: packed.shallow_clone(),
            scale: scale.shallow_clone(),
            group,
            kind,
            dequant: DequantKernel::Fused,
        }
    }

    #[test]
    fn a_stack_dequantizes_to_the_stack_of_its_matrices_in_any_chunking() {
        tch::manual_seed(5);
        // Three FP8 [4, 8] weights over [2, 4] tiles, three INT4 [2, 16] weights in groups of 8.
        let fp8s: Vec<Weight> = (0..3)
            .map(|_| {
                let w = (Tensor::randn([4, 8], (Kind::Float, Device::Cpu)) * 4.0)
                    .to_kind(Kind::Float8e4m3fn);
                fp8_weight(
                    &w,
                    &Tensor::rand([2, 2], (Kind::Float, Device::Cpu)),
                    [2, 4],
                    Kind::BFloat16,
                )
            })
            .collect();
        let int4s: Vec<Weight> = (0..3)
            .map(|_| {
                let p = Tensor::randint_low(
                    i32::MIN as i64,
                    i32::MAX as i64,
                    [2, 2],
                    (Kind::Int, Device::Cpu),
                );
                int4_weight(
                    &p,
                    &Tensor::rand([2, 2], (Kind::Float, Device::Cpu)),
                    8,
                    Kind::BFloat16,
                )
            })
            .collect();
        for weights in [fp8s, int4s] {
            let want = Tensor::stack(
                &weights
                    .iter()
                    .map(|w| w.matrix().unwrap())
                    .collect::<Vec<_>>(),
                0,
            );
            let stack = weights[0]
                .empty_stack(3)
                .unwrap()
                .expect("whole tiles stack");
            for (j, mut w) in weights.into_iter().enumerate() {
                assert!(w.move_into(&stack, j).unwrap());
                // The weight is now a view of its entry: the same matrix.
                assert!(w.matrix().unwrap().equal(&want.get(j as i64)));
            }
            assert_eq!(stack.shape(), want.size());
            // One matrix per chunk, two per chunk (a short last one), all at once.
            for chunk in [1, 40, 1 << 20] {
                assert!(
                    stack.matrix_in_chunks(chunk).unwrap().equal(&want),
                    "chunk {chunk}"
                );
            }
        }
    }

    #[test]
    fn fp8_rows_that_are_not_whole_blocks_are_not_stacked_and_formats_do_not_mix() {
        let w = Tensor::zeros([3, 4], (Kind::Float, Device::Cpu)).to_kind(Kind::Float8e4m3fn);
        let partial = fp8_weight(
            &w,
            &Tensor::ones([2, 1], (Kind::Float, Device::Cpu)),
            [2, 4],
            Kind::Float,
        );
        assert!(partial.empty_stack(2).unwrap().is_none());
        let dense = Weight::Dense(Tensor::zeros([3, 4], (Kind::Float, Device::Cpu)));
        let stack = dense.empty_stack(2).unwrap().unwrap();
        let mut quantized = partial;
        assert!(!quantized.move_into(&stack, 0).unwrap());
    }

    #[test]
    fn a_split_that_cuts_a_tile_is_refused_by_name() {
        let split = |dim, world| Shard::Split {
            dim,
            rank: 0,
            world,
        };
        assert!(check_grid("m", [256, 64], [128, 128], split(0, 2), "FP8 block").is_ok());
        let e = check_grid("m", [256, 64], [128, 128], split(0, 4), "FP8 block")
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "quantized weight \"m\": split 4 ways along dimension 0, each rank gets 64 of 256, \
             which is not a whole number of FP8 block tiles of 128; use a TP size that keeps \
             out_features / tp a multiple of 128"
        );
        let e = check_grid("m", [8, 96], [1, 32], split(1, 2), "INT4 group")
            .unwrap_err()
            .to_string();
        assert!(e.contains("in_features / tp a multiple of 32"), "{e}");
    }
}
