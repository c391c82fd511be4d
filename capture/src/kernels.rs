//! How the forward computes: the kernel choices, declared once here with their docs, names and
//! defaults, and carried whole as one [`Kernels`] value from the command line (with the `clap`
//! feature, the CLI flattens this very type) through the engine to every layer's load.

/// Declares a kernel choice: the enum with its documented variants (the default marked
/// `#[default]`), and the names the command line takes (`name`, `Display`, `FromStr`), so that
/// each choice's names are written once; an unknown name is refused listing the known ones.
macro_rules! kernel_choice {
    (
        $(#[$meta:meta])*
        $ty:ident, $what:literal, $hint:literal {
            $( $(#[$vmeta:meta])* $variant:ident = $name:literal $(| $alias:literal)* ),+ $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
        pub enum $ty {
            $( $(#[$vmeta])* $variant ),+
        }

        impl $ty {
            /// The name the command line takes.
            pub fn name(self) -> &'static str {
                match self {
                    $( $ty::$variant => $name ),+
                }
            }
        }

        impl std::fmt::Display for $ty {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.name())
            }
        }

        impl std::str::FromStr for $ty {
            type Err = String;
            fn from_str(s: &str) -> std::result::Result<Self, String> {
                match s {
                    $( $name $(| $alias)* => Ok($ty::$variant), )+
                    _ => Err(format!(
                        "unknown {} {s:?}; expected {}{}",
                        $what,
                        [$($name),+].join(" or "),
                        $hint
                    )),
                }
            }
        }
    };
}

kernel_choice! {
    /// How RMS norms are computed on CUDA.
    NormKernel, "norm kernel", "" {
        /// transformers' own sequence of operations (an f32 copy of `x`, its square, their mean,
        /// `(x * rstd)` rounded to the compute dtype, then `* weight` rounded again):
        /// bit-identical to transformers.
        Exact = "exact",
        /// The same two roundings, but the mean square comes from one f32 reduction over `x` (no
        /// f32 copy, no squared copy): 40 % of the memory traffic. `rstd` can differ from the
        /// exact one in its last f32 bit, which moves a bf16 rounding in about one element in
        /// 10^5.
        Fast = "fast",
        /// One NVRTC kernel per norm with the `fast` roundings, bf16 only (other dtypes run
        /// `fast`): one read and one write of `x`; after attention it also adds the residual
        /// (libtorch's bf16 add) and writes the sum beside the normed copy. Its f32 sum of
        /// squares is reduced in another order than `fast`'s, so `rstd` can differ in its last
        /// bit as `fast`'s does: at most 2 bf16 units in the last place off `fast` on an H100.
        /// The default: 3.6-4.7x `fast`'s speed alone, 1.9-2.0x with the residual add.
        #[default]
        Fused = "fused",
    }
}

kernel_choice! {
    /// How attention runs on CUDA (on the CPU always libtorch's default). Every choice is
    /// libtorch's `scaled_dot_product_attention`; they differ in which of its kernels it may
    /// pick.
    AttentionKernel, "attention kernel", "" {
        /// libtorch's own pick among its kernels (flash attention where the shapes allow;
        /// MLA's query/key width 192 with value width 128 falls to the memory-efficient kernel).
        #[default]
        Sdpa = "sdpa",
        /// cuDNN's fused attention only (a shape cuDNN refuses is an error naming this flag).
        Cudnn = "cudnn",
        /// libtorch's flash attention only; MLA's values are padded with zeros to the key width
        /// (flash needs one head width) and the padding is cut from the output.
        Flash = "flash",
    }
}

kernel_choice! {
    /// Whether an elementwise step runs as one NVRTC kernel of ours on CUDA or as libtorch's
    /// operations (the reference, and always on the CPU).
    Fusion, "fusion choice", "" {
        /// libtorch's operations.
        Torch = "torch",
        /// One kernel of ours per call, compiled at first use by NVRTC; shapes or dtypes it does
        /// not take keep the libtorch path. The default: on an H100 each gives libtorch's bits
        /// (the grouped sigmoid router's weights within 4 f32 units in the last place) at
        /// 1.6-10x its speed.
        #[default]
        Fused = "fused",
    }
}

kernel_choice! {
    /// How a MoE layer runs its routed experts.
    MoeKernel, "MoE kernel", "" {
        /// One GEMM pair per expert over its tokens (a stable sort by expert first); quantized
        /// experts are dequantized one at a time.
        Loop = "loop",
        /// All of a layer's experts in two grouped GEMMs (libtorch's `_grouped_mm`, as
        /// transformers' `grouped_mm` experts run), their weights stacked at load; a quantized
        /// stack is dequantized whole as the layer runs. Shapes the kernel cannot take keep the
        /// loop. The default: on an H200 1.49x the loop on Qwen3-30B-A3B's 128 narrow experts,
        /// equal on DeepSeek-V3's 256 wide ones.
        #[default]
        Grouped = "grouped",
    }
}

kernel_choice! {
    /// How FP8 and INT4 weights are dequantized on a GPU (on the CPU always with PyTorch
    /// operations). Both give the same bits.
    DequantKernel, "dequantization kernel", "" {
        /// One kernel of our own per weight, compiled at first use by NVRTC: reads each stored
        /// byte once and writes the matrix once (falls back to `torch` where it does not apply).
        #[default]
        Fused = "fused",
        /// PyTorch operations: two or three passes over memory.
        Torch = "torch",
    }
}

kernel_choice! {
    /// What a row-parallel linear sums across tensor-parallel ranks (unused at TP 1, where there
    /// is nothing to sum and the GEMM rounds its output once, as transformers' does).
    TpReduce, "tensor-parallel reduction", " (the compute dtype)" {
        /// Each rank's partial product stays in f32 (a bf16 x bf16 -> f32 GEMM), the all-reduce
        /// sums f32, and the sum (plus bias) is rounded to the compute dtype once: the single
        /// rounding of TP 1, at twice the all-reduce bytes.
        #[default]
        F32 = "f32",
        /// Partial products rounded to the compute dtype and summed in it: every row-parallel
        /// layer rounds twice more than at TP 1, and the error compounds through the depth.
        /// "bf16" is what the compute dtype is in practice; "compute" says it for f16.
        Compute = "bf16" | "compute",
    }
}

/// The kernel choices of a forward, fixed for an engine's life. Each field's doc is its flag's
/// help text (`--norm`, `--attention`, `--activation`, `--rope`, `--moe-route`, `--moe-kernel`,
/// `--dequant-kernel`, `--tp-reduce`), and each default is its enum's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "clap", derive(clap::Args))]
pub struct Kernels {
    /// RMS norm on cuda: fused (fast's roundings in one NVRTC kernel per norm, the residual
    /// add after attention folded in; bf16, other dtypes run fast; at most 2 units in the last
    /// place off fast, as near transformers as fast; 2-4.7x fast's speed on an H100), fast
    /// (libtorch, the mean square in one f32 pass, 40 % of the memory traffic; about one
    /// element in 10^5 one unit in the last place off transformers) or exact (transformers'
    /// own operations, bit-identical to it). CPU runs are always exact.
    #[cfg_attr(feature = "clap", arg(long, default_value_t))]
    pub norm: NormKernel,
    /// Attention on cuda: sdpa (libtorch picks; MLA gets the memory-efficient kernel), cudnn
    /// (cuDNN's fused attention only) or flash (libtorch's flash attention only, MLA's values
    /// zero-padded to the key width). Same math, another order of summation: floor-level apart.
    #[cfg_attr(feature = "clap", arg(long, default_value_t))]
    pub attention: AttentionKernel,
    /// SiLU-and-mul after the gate/up GEMM (dense MLPs, shared and routed experts) on cuda:
    /// fused (one NVRTC kernel with libtorch's two bf16 roundings, 40 % less memory traffic:
    /// the same bits as torch at 1.6x its speed on an H100, which `hslake debug kernels`
    /// checks) or torch (two libtorch kernels). CPU runs are always torch.
    #[cfg_attr(feature = "clap", arg(long, default_value_t))]
    pub activation: Fusion,
    /// Rotary embedding on cuda, both the rotate-half and DeepSeek's interleaved layouts: fused
    /// (one NVRTC kernel with the same roundings in the same order: the same bits as torch at
    /// 3.6-9.5x its speed on an H100, which `hslake debug kernels` checks) or torch (four
    /// libtorch kernels). CPU runs are always torch.
    #[cfg_attr(feature = "clap", arg(long, default_value_t))]
    pub rope: Fusion,
    /// MoE routing and token permutation on cuda (bf16 grouped experts): fused (NVRTC kernels:
    /// one router kernel with libtorch's reduction orders and top-k order, three for the
    /// experts' stable alignment, one gather that weights and sums each token's top-k rows in
    /// libtorch's order; the same bits as torch, but for the grouped sigmoid router's weights,
    /// within 4 f32 units in the last place with the same experts; which `hslake debug kernels`
    /// checks) or torch (about 15 small libtorch kernels: softmax or sigmoid, top-k, sort,
    /// counts, inverse permutation, weighted top-k sum). CPU runs are always torch.
    #[cfg_attr(
        feature = "clap",
        arg(long = "moe-route", value_name = "MOE_ROUTE", default_value_t)
    )]
    pub moe_route: Fusion,
    /// How MoE layers run their routed experts: grouped (a layer's experts in two grouped GEMMs,
    /// as transformers' grouped_mm experts; bf16 on CUDA, any dtype on CPU, other shapes fall
    /// back to the loop; FP8/INT4 experts are dequantized a whole layer at a time, which needs
    /// that layer's experts in bf16 as scratch) or loop (one GEMM pair per expert; quantized
    /// experts dequantized one at a time).
    #[cfg_attr(
        feature = "clap",
        arg(long = "moe-kernel", value_name = "MOE_KERNEL", default_value_t)
    )]
    pub moe: MoeKernel,
    /// How FP8/INT4 weights are dequantized on cuda, a layer at a time as it runs: fused (one
    /// kernel of ours, compiled at first use by NVRTC from the torch wheel: each stored byte
    /// read once, the matrix written once) or torch (PyTorch operations, two or three passes).
    /// Both give the same bits.
    #[cfg_attr(
        feature = "clap",
        arg(
            long = "dequant-kernel",
            value_name = "DEQUANT_KERNEL",
            default_value_t
        )
    )]
    pub dequant: DequantKernel,
    /// With --tp > 1, what the row-parallel layers sum across ranks: f32 (f32 partial products
    /// and sums, rounded to the dtype once, as at TP 1) or bf16 (partials rounded and summed in
    /// the compute dtype: half the all-reduce bytes, two more roundings per layer).
    #[cfg_attr(feature = "clap", arg(long, default_value_t))]
    pub tp_reduce: TpReduce,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn norm_kernel_parses_and_names_the_choices() {
        assert_eq!("fast".parse::<NormKernel>(), Ok(NormKernel::Fast));
        assert_eq!("exact".parse::<NormKernel>(), Ok(NormKernel::Exact));
        assert_eq!("fused".parse::<NormKernel>(), Ok(NormKernel::Fused));
        let err = "fast2".parse::<NormKernel>().unwrap_err();
        assert_eq!(
            err,
            "unknown norm kernel \"fast2\"; expected exact or fast or fused"
        );
    }

    #[test]
    fn tp_reduce_parses_both_names_and_prints_the_cli_one() {
        assert_eq!("f32".parse::<TpReduce>(), Ok(TpReduce::F32));
        assert_eq!("bf16".parse::<TpReduce>(), Ok(TpReduce::Compute));
        assert_eq!("compute".parse::<TpReduce>(), Ok(TpReduce::Compute));
        assert_eq!(TpReduce::Compute.to_string(), "bf16");
        let err = "f16x".parse::<TpReduce>().unwrap_err();
        assert_eq!(
            err,
            "unknown tensor-parallel reduction \"f16x\"; expected f32 or bf16 (the compute dtype)"
        );
    }

    #[test]
    fn every_name_parses_back_to_its_choice_and_unknown_ones_list_the_names() {
        for k in [MoeKernel::Loop, MoeKernel::Grouped] {
            assert_eq!(k.to_string().parse::<MoeKernel>(), Ok(k));
        }
        for k in [DequantKernel::Fused, DequantKernel::Torch] {
            assert_eq!(k.to_string().parse::<DequantKernel>(), Ok(k));
        }
        for k in [
            AttentionKernel::Sdpa,
            AttentionKernel::Cudnn,
            AttentionKernel::Flash,
        ] {
            assert_eq!(k.to_string().parse::<AttentionKernel>(), Ok(k));
        }
        for k in [Fusion::Torch, Fusion::Fused] {
            assert_eq!(k.to_string().parse::<Fusion>(), Ok(k));
        }
        assert_eq!(
            "fa3".parse::<AttentionKernel>().unwrap_err(),
            "unknown attention kernel \"fa3\"; expected sdpa or cudnn or flash"
        );
        assert_eq!(
            "x".parse::<MoeKernel>().unwrap_err(),
            "unknown MoE kernel \"x\"; expected loop or grouped"
        );
        assert_eq!(
            "x".parse::<DequantKernel>().unwrap_err(),
            "unknown dequantization kernel \"x\"; expected fused or torch"
        );
    }

    #[test]
    fn the_defaults_are_fused_norms_grouped_experts_fused_dequantization_and_f32_sums() {
        let k = Kernels::default();
        assert_eq!(
            (k.norm, k.moe, k.dequant, k.tp_reduce),
            (
                NormKernel::Fused,
                MoeKernel::Grouped,
                DequantKernel::Fused,
                TpReduce::F32
            )
        );
    }

    #[test]
    fn the_fused_kernels_measured_on_an_h100_are_on_and_attention_is_libtorchs_pick() {
        let k = Kernels::default();
        assert_eq!(
            (k.attention, k.activation, k.rope, k.moe_route),
            (
                AttentionKernel::Sdpa,
                Fusion::Fused,
                Fusion::Fused,
                Fusion::Fused
            )
        );
    }
}
