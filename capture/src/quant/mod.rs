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
//!
//! [`config`] reads the scheme from `config.json`, [`weight`] holds and loads the weights,
//! [`dequant`] (with its GPU kernels in `fused`) makes their matrices.
pub(crate) mod config;
pub(crate) mod dequant;
mod fused;
pub(crate) mod weight;
