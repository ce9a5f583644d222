//! Compiles `kernels/` to PTX with rustc's NVPTX backend and leaves it in `OUT_DIR` for the
//! host library to embed. This plays the part `cuda_builder` would (see README.md, "Why not
//! cuda_builder / cuda_std").
//!
//! The kernel build is a nested `cargo` run on the pinned nightly, in a clean environment
//! (nothing of the outer build's `RUSTFLAGS`, `RUSTC`, wrappers or target dir leaks in), with
//! its own target dir under `OUT_DIR`. Only that nested run needs the nightly, so a crate built
//! with stable Rust can depend on `rope-cuda`.
//!
//! Settings: `ROPE_CUDA_ARCH` (default `sm_80`: PTX that the driver also compiles for Ada and
//! Hopper) and `ROPE_CUDA_KERNEL_TOOLCHAIN` (default: the channel of `rust-toolchain.toml`).

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The toolchain the kernels are verified with; `rust-toolchain.toml` names the same.
const TOOLCHAIN: &str = "nightly-2026-10-15";
/// Components the kernel build needs from that toolchain.
const COMPONENTS: [&str; 3] = ["rust-src", "llvm-tools", "llvm-bitcode-linker"];
const TARGET: &str = "nvptx64-nvidia-cuda";
const CRATE: &str = "rope_cuda_kernels";

fn main() {
    let root = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let kernels = root.join("kernels");
    println!("cargo:rerun-if-changed={}", kernels.join("src").display());
    println!("cargo:rerun-if-changed={}", kernels.join("Cargo.toml").display());
    println!("cargo:rerun-if-env-changed=ROPE_CUDA_ARCH");
    println!("cargo:rerun-if-env-changed=ROPE_CUDA_KERNEL_TOOLCHAIN");
    println!("cargo:rerun-if-env-changed=ROPE_CUDA_HEADS_PER_THREAD");
    println!("cargo:rerun-if-env-changed=ROPE_CUDA_KV_HEADS_PER_THREAD");

    let arch = env::var("ROPE_CUDA_ARCH").unwrap_or_else(|_| "sm_80".to_string());
    if !arch.starts_with("sm_") || arch[3..].is_empty() || !arch[3..].bytes().all(|b| b.is_ascii_alphanumeric()) {
        fail(&format!("ROPE_CUDA_ARCH={arch:?} is not a GPU architecture such as sm_80 or sm_90"));
    }
    let toolchain = env::var("ROPE_CUDA_KERNEL_TOOLCHAIN").unwrap_or_else(|_| TOOLCHAIN.to_string());
    check_toolchain(&toolchain);

    let target_dir = out.join("kernels-target");
    let mut cmd = Command::new("rustup");
    cmd.args(["run", &toolchain, "cargo", "build", "--release", "--lib"])
        .args(["--target", TARGET, "-Zbuild-std=core"])
        .arg("--manifest-path")
        .arg(kernels.join("Cargo.toml"))
        .arg("--target-dir")
        .arg(&target_dir)
        // Profile settings for the device build only; the workspace's own profiles stay as
        // they are (unwinding) for host builds.
        .args(["--config", "profile.release.panic=\"abort\""])
        .args(["--config", "profile.release.lto=true"])
        .args(["--config", "profile.release.codegen-units=1"])
        .args(["--config", "profile.release.opt-level=3"])
        .args(["--config", "profile.release.debug=false"]);
    for (key, _) in env::vars_os() {
        let key = key.to_string_lossy();
        if key.starts_with("CARGO") || key.starts_with("RUST") {
            cmd.env_remove(key.as_ref());
        }
    }
    cmd.env("RUSTUP_TOOLCHAIN", &toolchain).env("RUSTFLAGS", format!("-C target-cpu={arch}"));

    let status = cmd.status().unwrap_or_else(|e| fail(&format!("could not run `rustup run {toolchain} cargo`: {e}")));
    if !status.success() {
        fail(&format!("the kernel build for {TARGET} ({arch}) failed; its output is above"));
    }
    let ptx = target_dir.join(TARGET).join("release").join(format!("{CRATE}.ptx"));
    copy(&ptx, &out.join(format!("{CRATE}.ptx")));
    println!("cargo:rustc-env=ROPE_CUDA_ARCH={arch}");
}

/// Fails with the exact install command when the kernel toolchain or a component is missing.
fn check_toolchain(toolchain: &str) {
    let install = format!("rustup toolchain install {toolchain} --profile minimal -c {}", COMPONENTS.join(" -c "));
    let listed = Command::new("rustup")
        .args(["component", "list", "--installed", "--toolchain", toolchain])
        .env_remove("RUSTUP_TOOLCHAIN")
        .output();
    let listed = match listed {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).into_owned(),
        Ok(_) => fail(&format!(
            "the toolchain {toolchain}, which compiles the CUDA kernels, is not installed.\n\
             Install it with:\n    {install}"
        )),
        Err(e) => fail(&format!(
            "rustup is needed to build the CUDA kernels with {toolchain}, but running it failed ({e}).\n\
             Install rustup (https://rustup.rs), then:\n    {install}"
        )),
    };
    for component in COMPONENTS {
        if !listed.lines().any(|l| l == component || l.starts_with(&format!("{component}-"))) {
            fail(&format!(
                "the component {component} of toolchain {toolchain}, needed to build the CUDA kernels, \
                 is not installed.\nInstall it with:\n    rustup component add --toolchain {toolchain} {component}\n\
                 or everything at once with:\n    {install}"
            ));
        }
    }
}

fn copy(from: &Path, to: &Path) {
    std::fs::copy(from, to).unwrap_or_else(|e| fail(&format!("copying {} failed: {e}", from.display())));
}

fn fail(msg: &str) -> ! {
    eprintln!("\nerror: rope-cuda: {msg}\n");
    std::process::exit(1);
}
