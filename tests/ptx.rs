//! Checks on the embedded PTX text: what the kernels compiled to. (Registers and spills are
//! checked with ptxas in `.ci/run`.)

use rope_cuda::{ARCH, ENTRY_POINTS, PTX};

/// The text of entry point `name`, up to the next entry point.
fn body(name: &str) -> &'static str {
    let start =
        PTX.find(&format!(".entry {name}(")).unwrap_or_else(|| panic!("entry point {name} missing from the PTX"));
    let rest = &PTX[start + 1..];
    &PTX[start..start + 1 + rest.find(".entry ").unwrap_or(rest.len())]
}

#[test]
fn every_entry_point_is_present_once() {
    for name in ENTRY_POINTS {
        assert_eq!(PTX.matches(&format!(".entry {name}(")).count(), 1, "{name}");
    }
    assert_eq!(PTX.matches(".entry ").count(), ENTRY_POINTS.len(), "an entry point is not listed in ENTRY_POINTS");
}

#[test]
fn ptx_targets_the_configured_arch() {
    assert!(PTX.contains(&format!(".target {ARCH}")), "PTX is not for {ARCH}");
}

#[test]
fn vector_kernels_move_16_bytes_per_global_access() {
    for name in ENTRY_POINTS.iter().filter(|n| n.ends_with("_v4")) {
        let b = body(name);
        assert!(b.contains("ld.global.v4.f32"), "{name}: no 16-byte global load");
        assert!(b.contains("st.global.v4.f32"), "{name}: no 16-byte global store");
        let scalar = b.lines().filter(|l| l.contains("ld.global.f32") || l.contains("st.global.f32")).count();
        assert_eq!(scalar, 0, "{name}: scalar global accesses");
    }
}

#[test]
fn kernels_have_no_local_memory_or_panics() {
    assert!(!PTX.contains(".local"), "a kernel uses local memory (a stack frame)");
    assert!(!PTX.contains("panic"), "a kernel can reach a panic path");
}
