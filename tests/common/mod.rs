//! What the end-to-end tests share: running the built `hslake` binary.
use std::process::{Command, Output};

/// Run the `hslake` binary of this build with `args`, logging warnings only, and wait for it.
pub fn hslake(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_hslake"))
        .args(args)
        .env("HSLAKE_LOG", "warn")
        .output()
        .expect("run hslake")
}
