//! Tools around the forward: the pre-flight check of a checkpoint against a model's load
//! ([`dry_run`]), and the checks and measurements behind `hslake debug` ([`debug`]; a streamed
//! model's prefill in `prefill_stream`, the fused kernels against libtorch in `kernels_check`).
pub mod debug;
pub(crate) mod dry_run;
mod kernels_check;
mod prefill_stream;
