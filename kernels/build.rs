//! Tells the crates that depend on this one where its sources are (`DEP_ROPE_CUDA_KERNELS_ROOT`
//! in their build scripts): `rope-cuda`'s `build.rs` compiles them to PTX, from the repository
//! or from wherever cargo unpacked this crate.

fn main() {
    let root = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    println!("cargo:root={root}");
    println!("cargo:rerun-if-changed=build.rs");
}
