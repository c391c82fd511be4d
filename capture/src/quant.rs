//! Quantized linear weights, read as published and kept quantized on the device: DeepSeek-V3's
//! FP8 block format and compressed-tensors' INT4 `pack-quantized` (Kimi-K2-Thinking, K2.5).
//! Every linear layer holds a [`Weight`], and a quantized one becomes the compute-dtype matrix
//! only when its layer runs.
//!
//! Layouts, for a linear `<m>` with weight `[out, in]`:
//! - FP8 block (`quant_method` `fp8`, `weight_block_size` `[bo, bi]`): `<m>.weight` `[out, in]`
//!   float8_e4m3fn and `<m>.weight_scale_inv` `[ceil(out / bo), ceil(in / bi)]`; element
//!   `(r, c)` is `weight[r, c] * weight_scale_inv[r / bo, c / bi]`. Which linears are quantized
//!   is whatever has a `weight_scale_inv` in the checkpoint (DeepSeek-V3 leaves embeddings, norms,
//!   the router and the LM head in bf16), as transformers decides it.
//! - INT4 (`quant_method` `compressed-tensors`, `format` `pack-quantized`, 4-bit symmetric int
//!   weights in groups of `g` along `in`): `<m>.weight_packed` `[out, in / 8]` int32 holding
//!   eight 4-bit codes, code `k` of word `j` (bits `4k..4k+4`) being column `8j + k` plus 8;
//!   `<m>.weight_scale` `[out, in / g]`; `<m>.weight_shape` `[2]` = `[out, in]`. Element `(r, c)`
//!   is `(code - 8) * weight_scale[r, c / g]`. The linears quantized are those the config's
//!   `targets` name and its `ignore` does not.
use regex::Regex;
use tch::{Kind, Tensor};

use crate::error::{CaptureError, Result};
use crate::fused_dequant;
use crate::load::{DequantKernel, LoadCtx, Shard};

/// How a checkpoint's linear weights are stored, from `config.json`'s `quantization_config`.
#[derive(Debug, Clone, Default)]
pub(crate) enum Quantization {
    /// Every weight in a float dtype (no `quantization_config`).
    #[default]
    None,
    /// DeepSeek-V3's float8_e4m3fn weights with one f32 scale per `block` tile.
    Fp8Block {
        /// `weight_block_size`: rows, columns of one scale's tile.
        block: [usize; 2],
    },
    /// compressed-tensors `pack-quantized` symmetric int4, one scale per `group_size` inputs.
    Int4Group {
        /// Inputs sharing one scale.
        group_size: usize,
        /// Modules quantized (`targets` of the config groups).
        targets: Vec<ModulePattern>,
        /// Modules left unquantized even if targeted.
        ignore: Vec<ModulePattern>,
    },
}

/// One entry of compressed-tensors' `targets` / `ignore`: a module name, `re:` and a regular
/// expression matched at the start of the name (Python's `re.match`), or a class name.
#[derive(Debug, Clone)]
pub(crate) enum ModulePattern {
    /// An exact module name, or a class name (every module we read through here is a
    /// `Linear`, so the class name `Linear` matches them all).
    Name(String),
    /// `re:<expr>`, anchored at the start of the module name.
    Regex(Regex),
}

impl ModulePattern {
    fn parse(s: &str) -> std::result::Result<Self, String> {
        match s.strip_prefix("re:") {
            Some(expr) => Regex::new(&format!("^(?:{expr})"))
                .map(ModulePattern::Regex)
                .map_err(|e| format!("pattern {s:?} is not a regular expression: {e}")),
            None => Ok(ModulePattern::Name(s.to_string())),
        }
    }

    /// As a `targets` entry: the module's name, or its class.
    fn matches(&self, module: &str) -> bool {
        match self {
            ModulePattern::Name(n) => n == module || n == "Linear",
            ModulePattern::Regex(r) => r.is_match(module),
        }
    }

    /// As an `ignore` entry: the module's name only (a class name there would ignore every
    /// linear, which no published config means).
    fn matches_exactly(&self, module: &str) -> bool {
        match self {
            ModulePattern::Name(n) => n == module,
            ModulePattern::Regex(r) => r.is_match(module),
        }
    }
}

/// What this crate reads; named in every refusal.
const SUPPORTED: &str = "supported: quant_method \"fp8\" with weight_block_size (DeepSeek-V3 \
     FP8 blocks) and \"compressed-tensors\" with format \"pack-quantized\" (4-bit symmetric int \
     groups)";

impl Quantization {
    /// Reads `quantization_config` of `json` (a config.json, or a wrapper's, whose
    /// `text_config` may hold it instead); `Err` says what is wrong and what is supported.
    pub fn from_config(json: &serde_json::Value) -> std::result::Result<Self, String> {
        let section = json
            .get("quantization_config")
            .or_else(|| json.get("text_config")?.get("quantization_config"));
        let Some(q) = section.filter(|q| !q.is_null()) else {
            return Ok(Quantization::None);
        };
        let text = |key: &str| q.get(key).and_then(|v| v.as_str());
        match text("quant_method") {
            Some("fp8") => parse_fp8(q),
            Some("compressed-tensors") => parse_compressed(q),
            Some(other) => Err(format!(
                "quantization_config.quant_method = {other:?} is not supported; {SUPPORTED}"
            )),
            None => Err(format!(
                "quantization_config has no quant_method; {SUPPORTED}"
            )),
        }
    }

    /// The scheme as the manifest's provenance records it; `None` for float weights.
    pub fn describe(&self) -> Option<String> {
        match self {
            Quantization::None => None,
            Quantization::Fp8Block { block } => Some(format!(
                "fp8 e4m3 block-quantized, weight_block_size [{}, {}], weight_scale_inv",
                block[0], block[1]
            )),
            Quantization::Int4Group { group_size, .. } => Some(format!(
                "compressed-tensors pack-quantized int4 symmetric, group_size {group_size}"
            )),
        }
    }

    /// Whether the config quantizes linear `module` to INT4.
    fn int4_module(&self, module: &str) -> bool {
        match self {
            Quantization::Int4Group {
                targets, ignore, ..
            } => {
                targets.iter().any(|t| t.matches(module))
                    && !ignore.iter().any(|i| i.matches_exactly(module))
            }
            _ => false,
        }
    }
}

fn parse_fp8(q: &serde_json::Value) -> std::result::Result<Quantization, String> {
    if let Some(fmt) = q.get("fmt").and_then(|v| v.as_str()) {
        if fmt != "e4m3" {
            return Err(format!(
                "quantization_config.fmt = {fmt:?}; only \"e4m3\" FP8 weights are supported"
            ));
        }
    }
    let block = q
        .get("weight_block_size")
        .and_then(|v| v.as_array())
        .map(|a| a.iter().map(|d| d.as_u64()).collect::<Option<Vec<u64>>>());
    match block {
        Some(Some(b)) if b.len() == 2 && b.iter().all(|&d| d > 0) => Ok(Quantization::Fp8Block {
            block: [b[0] as usize, b[1] as usize],
        }),
        _ => Err(format!(
            "quantization_config.weight_block_size = {}; expected two positive integers such \
             as [128, 128] (per-tensor FP8 is not supported)",
            q.get("weight_block_size")
                .map_or("absent".to_string(), |v| v.to_string())
        )),
    }
}

fn parse_compressed(q: &serde_json::Value) -> std::result::Result<Quantization, String> {
    let format = q.get("format").and_then(|v| v.as_str());
    let groups = q
        .get("config_groups")
        .and_then(|g| g.as_object())
        .filter(|g| !g.is_empty())
        .ok_or("compressed-tensors quantization_config has no config_groups")?;
    let mut group_size = None;
    let mut targets = Vec::new();
    for (name, group) in groups {
        let fmt = group.get("format").and_then(|v| v.as_str()).or(format);
        if fmt != Some("pack-quantized") {
            return Err(format!(
                "compressed-tensors config group {name:?} has format {fmt:?}; {SUPPORTED}"
            ));
        }
        let w = group
            .get("weights")
            .filter(|w| w.is_object())
            .ok_or_else(|| format!("config group {name:?} has no \"weights\" arguments"))?;
        let field = |k: &str| w.get(k).cloned().unwrap_or(serde_json::Value::Null);
        let size = field("group_size").as_u64().unwrap_or(0) as usize;
        let expected = [
            ("num_bits", serde_json::json!(4)),
            ("type", serde_json::json!("int")),
            ("symmetric", serde_json::json!(true)),
            ("strategy", serde_json::json!("group")),
        ];
        for (k, want) in expected {
            if field(k) != want {
                return Err(format!(
                    "config group {name:?}: weights.{k} = {}; only {k} = {want} is supported \
                     (4-bit symmetric int weights in groups)",
                    field(k)
                ));
            }
        }
        if size == 0 || !size.is_multiple_of(8) {
            return Err(format!(
                "config group {name:?}: weights.group_size = {}; it must be a positive \
                 multiple of 8 (eight 4-bit values per int32)",
                field("group_size")
            ));
        }
        if group_size.is_some_and(|g| g != size) {
            return Err(format!(
                "config groups with different group sizes ({} and {size}) are not supported",
                group_size.unwrap_or_default()
            ));
        }
        group_size = Some(size);
        let list = group
            .get("targets")
            .and_then(|t| t.as_array())
            .ok_or_else(|| format!("config group {name:?} has no \"targets\" list"))?;
        for t in list {
            let t = t
                .as_str()
                .ok_or_else(|| format!("config group {name:?}: target {t} is not a string"))?;
            targets.push(ModulePattern::parse(t)?);
        }
    }
    let ignore = match q.get("ignore") {
        None | Some(serde_json::Value::Null) => Vec::new(),
        Some(serde_json::Value::Array(list)) => list
            .iter()
            .map(|i| {
                i.as_str()
                    .ok_or_else(|| format!("ignore entry {i} is not a string"))
                    .and_then(ModulePattern::parse)
            })
            .collect::<std::result::Result<_, _>>()?,
        Some(other) => {
            return Err(format!(
                "quantization_config.ignore = {other}; expected a list"
            ))
        }
    };
    Ok(Quantization::Int4Group {
        group_size: group_size.unwrap_or(32),
        targets,
        ignore,
    })
}

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
                    dequant: ctx.dequant,
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
                    dequant: ctx.dequant,
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
                    dequant: ctx.dequant,
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
                    dequant: ctx.dequant,
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
    /// [`Weight::empty_stack`]): the tensor itself when dense, else dequantized now: each value
    /// times its f32 scale computed in f32 (one f32 rounding, as the published dequantization
    /// does) and rounded to the compute dtype as it is stored. The result lives until the
    /// caller's GEMM is done; libtorch's caching allocator hands its block to the next layer's
    /// matrix of the same size, so the scratch is reused without a buffer of our own, and only
    /// one layer's matrix exists at a time.
    pub fn matrix(&self) -> Result<Tensor> {
        self.matrix_in_chunks(DEQUANTIZE_CHUNK)
    }

    /// [`Weight::matrix`], a stack dequantized about `chunk` values at a time.
    fn matrix_in_chunks(&self, chunk: i64) -> Result<Tensor> {
        let values = match self {
            Weight::Dense(t) => return Ok(t.shallow_clone()),
            Weight::Fp8 { weight, .. } => weight,
            Weight::Int4 { packed, .. } => packed,
        };
        let shape = self.shape();
        let product = Tensor::f_empty(shape.as_slice(), (self.kind(), values.device()))?;
        // The fused kernel has no temporaries: a stack goes in one launch, as one matrix of
        // its stacked rows (whole FP8 tiles, checked when the stack was made, keep each value's
        // scale in place).
        let as_matrix = |t: &Tensor| {
            if shape.len() == 3 {
                t.f_flatten(0, 1)
            } else {
                Ok(t.shallow_clone())
            }
        };
        let whole = self
            .tensors()
            .into_iter()
            .map(as_matrix)
            .collect::<std::result::Result<Vec<_>, _>>()?;
        if self.dequantize_fused(whole.iter().collect(), &as_matrix(&product)?)? {
            return Ok(product);
        }
        if shape.len() == 2 {
            self.dequantize_into(self.tensors(), &product)?;
            return Ok(product);
        }
        // A stack is dequantized a few matrices at a time: the temporaries (an INT4 chunk's
        // unpacked int32 codes are 4 bytes a value) then exist for one chunk, not the stack.
        let (count, each) = (shape[0], shape[1] * shape[2]);
        let per_chunk = (chunk / each).max(1);
        let mut start = 0;
        while start < count {
            let n = per_chunk.min(count - start);
            // Leading `n` entries of a stacked tensor as one 2-D matrix: whole FP8 tiles
            // (checked when the stack was made) keep each value's scale in place.
            let part = |t: &Tensor| t.f_narrow(0, start, n)?.f_flatten(0, 1);
            let parts = self
                .tensors()
                .into_iter()
                .map(part)
                .collect::<std::result::Result<Vec<_>, _>>()?;
            self.dequantize_into(parts.iter().collect(), &part(&product)?)?;
            start += n;
        }
        Ok(product)
    }

    /// [`Weight::dequantize_into`] in one fused GPU kernel where this weight asks for it and
    /// the kernel applies; `false`, nothing written, otherwise.
    fn dequantize_fused(&self, parts: Vec<&Tensor>, product: &Tensor) -> Result<bool> {
        match (self, parts.as_slice()) {
            (
                Weight::Fp8 {
                    block,
                    dequant: DequantKernel::Fused,
                    ..
                },
                [weight, scale_inv],
            ) => fused_dequant::fp8(weight, scale_inv, *block, product),
            (
                Weight::Int4 {
                    group,
                    dequant: DequantKernel::Fused,
                    ..
                },
                [packed, scale],
            ) => fused_dequant::int4(packed, scale, *group, product),
            _ => Ok(false),
        }
    }

    /// Dequantizes `parts` (this weight's [`Weight::tensors`], or 2-D slices of them) into the
    /// 2-D `product` with PyTorch operations.
    fn dequantize_into(&self, parts: Vec<&Tensor>, product: &Tensor) -> Result<()> {
        match (self, parts.as_slice()) {
            (Weight::Fp8 { block, .. }, [weight, scale_inv]) => {
                dequantize_fp8(weight, scale_inv, *block, product)
            }
            (Weight::Int4 { group, .. }, [packed, scale]) => {
                dequantize_int4(packed, scale, *group, product)
            }
            _ => Err(CaptureError::Pipeline(
                "dequantize_into: parts do not match the weight's format".into(),
            )),
        }
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

/// Values dequantized at once when a stack is: 128 Mi, so that a chunk's temporaries stay
/// within about 1 GiB.
pub(crate) const DEQUANTIZE_CHUNK: i64 = 1 << 27;

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

/// `weight [out, in]` (float8_e4m3fn) times its block scales `[ceil(out/bo), ceil(in/bi)]`,
/// written into `product [out, in]` (the compute dtype).
///
/// Two kernels and 7 bytes of traffic per weight (bf16) instead of three and 19: every e4m3
/// value is exact in bf16, f16 and f32, so the codes go straight to the compute dtype; the
/// multiply by the f32 scale is computed in f32 (type promotion) and rounded as it is stored,
/// the same bits as an f32 product rounded afterwards.
fn dequantize_fp8(
    weight: &Tensor,
    scale_inv: &Tensor,
    block: [i64; 2],
    product: &Tensor,
) -> Result<()> {
    let (out, inp) = (weight.size()[0], weight.size()[1]);
    let [bo, bi] = block;
    let w = weight.f_to_kind(product.kind())?;
    if out % bo == 0 && inp % bi == 0 {
        // Whole tiles: one broadcast multiply, no expanded copy of the scales.
        let tiles = w.f_view([out / bo, bo, inp / bi, bi])?;
        let s = scale_inv.f_view([out / bo, 1, inp / bi, 1])?;
        let _ = tiles.f_mul_out(&product.f_view([out / bo, bo, inp / bi, bi])?, &s)?;
        return Ok(());
    }
    // A partial last tile (e.g. DeepSeek's 576-row kv_a_proj_with_mqa over 128-row blocks).
    let s = scale_inv
        .f_repeat_interleave_self_int(bo, 0, None)?
        .f_narrow(0, 0, out)?
        .f_repeat_interleave_self_int(bi, 1, None)?
        .f_narrow(1, 0, inp)?;
    let _ = w.f_mul_out(product, &s)?;
    Ok(())
}

/// `packed [out, in/8]` (int32, eight offset-by-8 codes each, lowest bits first) times its
/// group scales `[out, in/group]`, written into `product [out, in]`: the codes (-8..=7, exact
/// in every float dtype) are unpacked as bytes, and the multiply by the f32 scale is computed
/// in f32 and rounded to the compute dtype as it is stored.
///
/// About 7 bytes of memory traffic per value (unpacking two nibbles a byte, the -8 on bytes,
/// the multiply) where unpacking through int32 took about 26: the dequantization of a layer's
/// experts is bandwidth-bound, so this is most of its cost.
fn dequantize_int4(packed: &Tensor, scale: &Tensor, group: i64, product: &Tensor) -> Result<()> {
    let (out, words) = (packed.size()[0], packed.size()[1]);
    let inp = words * 8;
    // Little-endian int32 words as bytes [out, in/2]: byte b holds column 2b in its low nibble
    // and 2b + 1 in its high one (code k of a word is bits 4k..4k+4).
    let bytes = packed.f_contiguous()?.f_view_dtype(Kind::Uint8)?;
    let codes = Tensor::f_empty([out, inp / 2, 2], (Kind::Uint8, packed.device()))?;
    let _ = bytes.f_bitwise_and_scalar_out(&codes.f_select(-1, 0)?, 15)?;
    let _ = bytes.f_bitwise_right_shift_tensor_scalar_out(&codes.f_select(-1, 1)?, 4)?;
    // code - 8 wraps modulo 256 in uint8, which read as int8 is the signed value.
    let mut codes = codes.f_view([out, inp / group, group])?;
    let _ = codes.f_sub_scalar_(8)?;
    let codes = codes.f_view_dtype(Kind::Int8)?;
    let _ = codes.f_mul_out(
        &product.f_view([out, inp / group, group])?,
        &scale.f_unsqueeze(-1)?,
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    /// e4m3fn decoded from its bit fields: sign, 4 exponent bits (bias 7), 3 mantissa bits;
    /// exponent 0 is subnormal, and S.1111.111 is NaN (no infinities).
    fn e4m3_reference(code: u8) -> f32 {
        let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
        let (exp, man) = ((code >> 3) & 0xF, code & 7);
        if exp == 0xF && man == 7 {
            return f32::NAN;
        }
        let magnitude = if exp == 0 {
            man as f32 / 8.0 * 2f32.powi(-6)
        } else {
            (1.0 + man as f32 / 8.0) * 2f32.powi(exp as i32 - 7)
        };
        sign * magnitude
    }

    #[test]
    fn every_e4m3_code_decodes_to_its_bit_field_value() {
        let codes: Vec<u8> = (0..=255).collect();
        let t = Tensor::from_slice(&codes)
            .f_view_dtype(Kind::Float8e4m3fn)
            .unwrap();
        let got = Vec::<f32>::try_from(t.to_kind(Kind::Float)).unwrap();
        for (code, v) in codes.iter().zip(got) {
            let want = e4m3_reference(*code);
            assert!(
                v == want || (v.is_nan() && want.is_nan()),
                "code {code:#04x}: {v} vs {want}"
            );
        }
        assert_eq!(e4m3_reference(0x7E), 448.0);
    }

    fn fp8(codes: &[u8], shape: [i64; 2]) -> Tensor {
        Tensor::from_slice(codes)
            .f_view_dtype(Kind::Float8e4m3fn)
            .unwrap()
            .view(shape)
    }

    fn fp8_weight(weight: &Tensor, scale_inv: &Tensor, block: [i64; 2], kind: Kind) -> Weight {
        Weight::Fp8 {
            weight: weight.shallow_clone(),
            scale_inv: scale_inv.shallow_clone(),
            block,
            kind,
            dequant: DequantKernel::Fused,
        }
    }

    fn fp8_matrix(weight: &Tensor, scale_inv: &Tensor, block: [i64; 2], kind: Kind) -> Tensor {
        fp8_weight(weight, scale_inv, block, kind).matrix().unwrap()
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

    fn int4_matrix(packed: &Tensor, scale: &Tensor, group: i64, kind: Kind) -> Tensor {
        int4_weight(packed, scale, group, kind).matrix().unwrap()
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
    fn fp8_blocks_scale_their_own_tile_including_a_partial_last_one() {
        // [3, 5] over [2, 2] blocks: a 2 x 3 grid whose last row and column are partial.
        let codes: Vec<u8> = (0..15).map(|i| 0x30 + i as u8).collect();
        let scale: Vec<f32> = vec![1.0, 2.0, 4.0, 8.0, 16.0, 32.0];
        let s = Tensor::from_slice(&scale).view([2, 3]);
        let got = fp8_matrix(&fp8(&codes, [3, 5]), &s, [2, 2], Kind::Float);
        for r in 0..3 {
            for c in 0..5 {
                let want = e4m3_reference(codes[r * 5 + c]) * scale[(r / 2) * 3 + c / 2];
                assert_eq!(
                    got.double_value(&[r as i64, c as i64]) as f32,
                    want,
                    "({r}, {c})"
                );
            }
        }
        // Whole tiles take the broadcast path; each element still gets its own tile's scale.
        let codes: Vec<u8> = (0..16).map(|i| 0x28 + i as u8).collect();
        let scale = [0.5f32, 3.0, -1.0, 0.25];
        let s = Tensor::from_slice(&scale).view([2, 2]);
        let got = fp8_matrix(&fp8(&codes, [4, 4]), &s, [2, 2], Kind::Float);
        for r in 0..4 {
            for c in 0..4 {
                let want = e4m3_reference(codes[r * 4 + c]) * scale[(r / 2) * 2 + c / 2];
                assert_eq!(
                    got.double_value(&[r as i64, c as i64]) as f32,
                    want,
                    "({r}, {c})"
                );
            }
        }
    }

    #[test]
    fn int4_codes_unpack_lowest_bits_first_and_take_their_group_scale() {
        // One row of 16 values in groups of 8: codes 0..16 mod 16, i.e. values -8..7, -8..7.
        let values: Vec<i32> = (0..16).map(|i| (i % 16) - 8).collect();
        let word = |j: usize| -> i32 {
            (0..8).fold(0u32, |w, k| {
                w | (((values[8 * j + k] + 8) as u32) << (4 * k))
            }) as i32
        };
        let packed = Tensor::from_slice(&[word(0), word(1)]).view([1, 2]);
        let scale = Tensor::from_slice(&[0.5f32, 2.0]).view([1, 2]);
        let got = Vec::<f32>::try_from(int4_matrix(&packed, &scale, 8, Kind::Float).flatten(0, -1))
            .unwrap();
        let want: Vec<f32> = values
            .iter()
            .enumerate()
            .map(|(c, &v)| v as f32 * [0.5, 2.0][c / 8])
            .collect();
        assert_eq!(got, want);
    }

    #[test]
    fn bf16_matrices_are_the_f32_dequantization_rounded_once() {
        // Every e4m3 code (NaNs aside) over [2, 2] tiles with scales that are not powers of
        // two, so that the products need rounding; and int4 codes with such scales.
        let codes: Vec<u8> = (0..=255u8).filter(|c| c & 0x7f != 0x7f).collect();
        let n = codes.len() as i64; // 254 = 2 * 127
        let scale = Tensor::from_slice(&[0.3f32, 1.7]).view([1, 2]);
        let w = fp8(&codes, [2, n / 2]);
        let grid = scale
            .repeat([1, n / 4])
            .f_narrow(1, 0, (n / 2 + 1) / 2)
            .unwrap();
        let f32_then_round = fp8_matrix(&w, &grid, [2, 2], Kind::Float).to_kind(Kind::BFloat16);
        let direct = fp8_matrix(&w, &grid, [2, 2], Kind::BFloat16);
        assert_eq!(direct.kind(), Kind::BFloat16);
        assert!(
            direct.equal(&f32_then_round),
            "fp8: bf16 result differs from f32 rounded once"
        );

        let packed =
            Tensor::from_slice(&[0x7654_3210u32 as i32, 0xfedc_ba98u32 as i32]).view([1, 2]);
        let scale = Tensor::from_slice(&[0.3f32, 1.7]).view([1, 2]);
        let f32_then_round = int4_matrix(&packed, &scale, 8, Kind::Float).to_kind(Kind::BFloat16);
        let direct = int4_matrix(&packed, &scale, 8, Kind::BFloat16);
        assert!(
            direct.equal(&f32_then_round),
            "int4: bf16 result differs from f32 rounded once"
        );
    }

    fn config(q: serde_json::Value) -> std::result::Result<Quantization, String> {
        Quantization::from_config(&serde_json::json!({ "quantization_config": q }))
    }

    fn kimi_int4() -> serde_json::Value {
        serde_json::json!({"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4,
            "type": "int", "symmetric": true, "strategy": "group", "group_size": 32,
            "dynamic": false}}},
            "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                       "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]})
    }

    #[test]
    fn int4_targets_the_routed_experts_and_ignores_what_the_config_names() {
        let q = config(kimi_int4()).unwrap();
        assert!(q.int4_module("model.layers.3.mlp.experts.7.gate_proj"));
        assert!(!q.int4_module("model.layers.3.mlp.shared_experts.up_proj"));
        assert!(!q.int4_module("model.layers.0.mlp.down_proj"));
        assert!(!q.int4_module("model.layers.3.self_attn.q_a_proj"));
        assert_eq!(
            q.describe().unwrap(),
            "compressed-tensors pack-quantized int4 symmetric, group_size 32"
        );
        // Named targets are exact names; `re:` matches from the start of the name only.
        let mut named = kimi_int4();
        named["config_groups"]["group_0"]["targets"] =
            serde_json::json!(["re:model\\.layers\\.1\\.", "model.layers.0.mlp.up_proj"]);
        named["ignore"] = serde_json::json!(["re:layers"]);
        let q = config(named).unwrap();
        assert!(q.int4_module("model.layers.1.mlp.down_proj"));
        assert!(q.int4_module("model.layers.0.mlp.up_proj"));
        assert!(!q.int4_module("model.layers.0.mlp.gate_proj"));
    }

    #[test]
    fn unknown_or_unsupported_schemes_are_named_with_what_is_supported() {
        let e = config(serde_json::json!({"quant_method": "awq", "bits": 4})).unwrap_err();
        assert!(e.starts_with("quantization_config.quant_method = \"awq\" is not supported; supported: quant_method \"fp8\""), "{e}");
        let e = config(serde_json::json!({"quant_method": "fp8", "fmt": "e4m3"})).unwrap_err();
        assert!(e.contains("weight_block_size = absent"), "{e}");
        let mut odd = kimi_int4();
        odd["config_groups"]["group_0"]["weights"]["group_size"] = serde_json::json!(12);
        let e = config(odd).unwrap_err();
        assert!(e.contains("weights.group_size = 12"), "{e}");
        let mut asym = kimi_int4();
        asym["config_groups"]["group_0"]["weights"]["symmetric"] = serde_json::json!(false);
        assert!(config(asym)
            .unwrap_err()
            .contains("weights.symmetric = false"));
        let mut float = kimi_int4();
        float["format"] = serde_json::json!("float-quantized");
        assert!(config(float)
            .unwrap_err()
            .contains("format Some(\"float-quantized\")"));
        let q = config(serde_json::json!({"quant_method": "fp8", "fmt": "e4m3",
            "activation_scheme": "dynamic", "weight_block_size": [128, 128]}))
        .unwrap();
        assert!(matches!(q, Quantization::Fp8Block { block: [128, 128] }));
        assert!(matches!(
            Quantization::from_config(&serde_json::json!({})),
            Ok(Quantization::None)
        ));
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
