//! Checks on the embedded PTX text of every architecture: what the kernels compiled to.
//! (Registers and spills are checked with ptxas in `.ci/run`.)

use std::sync::LazyLock;

use rope_cuda_kernels::entries::axes::{
    CALLER_WIDTHS, DEINTERLEAVED_WIDTHS, FP8_TYPES, KV_WIDTHS, NORM_WIDTHS, ROPE_NORM_WIDTHS, ROPE_WHOLE_WIDTHS,
    ROPE_WIDTHS, ROWS, SOURCES, STYLES, TYPES, WHOLE_WIDTHS,
};
use rope_cuda_kernels::entries::EntryPoint;
use rope_cuda_kernels::tuning::KV_STREAMING;

/// Every embedded architecture's PTX text, oldest first.
static ALL: LazyLock<Vec<(&'static str, String)>> =
    LazyLock::new(|| rope_cuda::archs().map(|a| (a, rope_cuda::ptx(a).expect("embedded"))).collect());

/// Every entry point of the kernel list (the host resolves each one).
fn all_entry_points() -> impl Iterator<Item = &'static str> {
    EntryPoint::ALL.iter().map(|ep| ep.name())
}

/// The RoPE entry points, and the KV ones (library and caller tables).
fn named(prefix: &str) -> Vec<&'static str> {
    all_entry_points().filter(|n| n.starts_with(prefix)).collect()
}

/// The text of entry point `name` in `ptx`, up to the next entry point.
fn body<'p>(ptx: &'p str, name: &str) -> &'p str {
    let start =
        ptx.find(&format!(".entry {name}(")).unwrap_or_else(|| panic!("entry point {name} missing from the PTX"));
    let rest = &ptx[start + 1..];
    &ptx[start..start + 1 + rest.find(".entry ").unwrap_or(rest.len())]
}

#[test]
fn every_entry_point_is_present_once() {
    for (arch, ptx) in ALL.iter() {
        for name in all_entry_points() {
            assert_eq!(ptx.matches(&format!(".entry {name}(")).count(), 1, "{arch} {name}");
        }
        assert_eq!(ptx.matches(".entry ").count(), all_entry_points().count(), "{arch}: an entry point is not listed");
    }
}

#[test]
fn ptx_targets_its_arch() {
    assert_eq!(ALL.iter().map(|a| a.0).collect::<Vec<_>>(), ["sm_80", "sm_90", "sm_100"]);
    for (arch, ptx) in ALL.iter() {
        assert!(ptx.contains(&format!(".target {arch}\n")), "PTX is not for {arch}");
    }
}

/// The `_v` and `_p` kernels (and MRoPE's `_v_m`, `_p_m`) move q and k only in 16-byte
/// accesses; the `_s` kernels are the fallback for views whose addresses or dims do not allow it.
#[test]
fn vector_kernels_move_q_and_k_16_bytes_at_a_time() {
    let scalar = |n: &str| n.ends_with("_s") || n.contains("_s_");
    let vector: Vec<_> = named("rope_").into_iter().filter(|n| !scalar(n)).collect();
    // The counts are the products of the axes the list is generated from.
    let per_width = STYLES.len() * TYPES.len() * ROWS.len() * SOURCES.len();
    // RoPE by the caller's tables (`_t`): each style and type, one row kind, every width; and
    // the QK-norm's (`_n`, and `_w` for a whole projection) at their widths (all 16-byte),
    // with each row kind and source.
    let caller = STYLES.len() * TYPES.len();
    let (normed, whole) = (per_width * ROPE_NORM_WIDTHS.len(), per_width * ROPE_WHOLE_WIDTHS.len());
    let rope = (per_width + caller) * ROPE_WIDTHS.len() + normed + whole;
    assert_eq!(vector.len(), (per_width + caller) * (ROPE_WIDTHS.len() - 1) + normed + whole);
    assert_eq!(named("rope_").into_iter().filter(|n| n.ends_with("_n")).count(), normed);
    assert_eq!(named("rope_").into_iter().filter(|n| n.ends_with("_w")).count(), whole);
    assert_eq!(named("rope_").len(), rope);
    assert_eq!(named("rope_").into_iter().filter(|n| n.ends_with("_t")).count(), caller * ROPE_WIDTHS.len());
    // Every KV width with each row kind and source, into caches of the inputs' type and into
    // FP8 ones; the caller's tables (GPT-J, one row) at their widths in each element type; the
    // claim; the FP8 caches' read into each element type; the QK-norm's (`_n`, `_w`) at
    // their widths, with each row kind, source and operand type; and the de-interleaved GPT-J
    // pairs' (`kv_gptjd_`) at theirs and, normalizing MLA's kv_c, at the whole-projection
    // norm's (`_w`), one row kind, each source and operand type.
    let fp8_per_width = STYLES.len() * FP8_TYPES.len() * ROWS.len() * SOURCES.len();
    let deint_widths = DEINTERLEAVED_WIDTHS.len() + WHOLE_WIDTHS.len();
    let deinterleaved = (TYPES.len() + FP8_TYPES.len()) * SOURCES.len() * deint_widths;
    assert_eq!(named("kv_gptjd_").len(), deinterleaved);
    let kv = per_width * KV_WIDTHS.len()
        + deinterleaved
        + fp8_per_width * KV_WIDTHS.len()
        + (per_width + fp8_per_width) * (NORM_WIDTHS.len() + WHOLE_WIDTHS.len())
        + TYPES.len() * CALLER_WIDTHS.len()
        + 1
        + TYPES.len();
    assert_eq!(named("kv_read_").len(), TYPES.len());
    assert_eq!(named("kv_").len(), kv);
    // FP8 caches: every width.
    let fp8_widths = KV_WIDTHS.len() + NORM_WIDTHS.len() + WHOLE_WIDTHS.len();
    let fp8_deinterleaved = FP8_TYPES.len() * SOURCES.len() * deint_widths;
    assert_eq!(
        named("kv_").into_iter().filter(|n| n.contains("_fp8_")).count(),
        fp8_per_width * fp8_widths + fp8_deinterleaved
    );
    assert_eq!(
        named("kv_").into_iter().filter(|n| n.ends_with("_n")).count(),
        (per_width + fp8_per_width) * NORM_WIDTHS.len()
    );
    assert_eq!(
        named("kv_").into_iter().filter(|n| n.ends_with("_w")).count(),
        (per_width + fp8_per_width) * WHOLE_WIDTHS.len()
            + (TYPES.len() + FP8_TYPES.len()) * SOURCES.len() * WHOLE_WIDTHS.len()
    );
    // And the five benchmark kernels (the tests build with the feature `bench-kernels`).
    assert_eq!(named("").len(), rope + kv + 5);
    // The KV kernels' vector entry points: 16-byte loads and stores of q, k, v and the cache,
    // 8-byte ones in the decode kernels `_d` (tables in the element type are read 2 bytes at
    // a time, through the read-only path).
    for (_, ptx) in ALL.iter() {
        vector_accesses(ptx, &vector);
    }
}

fn vector_accesses(ptx: &str, vector: &[&str]) {
    let scalar = |n: &str| n.ends_with("_s") || n.contains("_s_");
    let kv = named("kv_").into_iter().filter(|n| !scalar(n) && *n != "kv_claim" && !n.starts_with("kv_read_"));
    for name in kv {
        let b = body(ptx, name);
        let v = if name.contains("_d") { "v2" } else { "v4" };
        // The 16-byte accesses marked streaming (`.cs`) as `tuning::KV_STREAMING` says, all of
        // them; the 8-byte ones plain.
        let (cs, plain) = (KV_STREAMING && v == "v4", format!("ld.global.{v}.b32"));
        let mark = if cs { ".cs" } else { "" };
        let (ld, st) = (format!("ld.global{mark}.{v}.b32"), format!("st.global{mark}.{v}.b32"));
        assert!(b.contains(&ld) && b.contains(&st), "{name}: no {v} access {ld} / {st}");
        assert!(!cs || !b.contains(&plain), "{name}: a 16-byte load not marked streaming");
        // FP8 caches take as many bytes as the loads' elements: 8 from 16 bytes of 16-bit
        // inputs, 4 from f32's (and from 8 bytes of 16-bit inputs), 2 from 8 bytes of f32.
        let fp8_store = match (name.contains("_fp8_"), name.contains("f32"), v) {
            (false, ..) => None,
            (true, false, "v4") => Some("st.global.v2.b32"),
            (true, true, "v2") => Some("st.global.b16"),
            (true, ..) => Some("st.global.b32"),
        };
        if let Some(st) = fp8_store {
            assert!(b.contains(st), "{name}: no FP8 store {st}");
        }
        for narrow in ["ld.global.b32", "ld.global.b16", "st.global.b32", "st.global.b16", "st.global.b8"] {
            assert!(!b.contains(narrow) || fp8_store == Some(narrow), "{name}: narrow access {narrow}");
        }
    }
    for &name in vector {
        let b = body(ptx, name);
        // The QK-norm's twins (`_n`, `_w`) read and write as their plain kernels.
        let name = name.strip_suffix("_n").or_else(|| name.strip_suffix("_w")).unwrap_or(name);
        assert!(b.contains("ld.global.v4.b32"), "{name}: no 16-byte global load");
        assert!(b.contains("st.global.v4.b32"), "{name}: no 16-byte global store");
        // (The RoPE kernels' are not marked streaming: see `tuning::KV_STREAMING`.)
        assert!(!b.contains(".cs."), "{name}: a streaming access");
        for narrow in ["ld.global.b32", "ld.global.b16", "st.global.b32", "st.global.b16", "ld.global.f32"] {
            assert!(!b.contains(narrow), "{name}: narrow access {narrow}");
        }
        if name.ends_with("_c") {
            // No table: each pair's frequency comes through the read-only path, 16 bytes at
            // once.
            assert!(b.contains("ld.global.nc.v4.b32"), "{name}: frequencies are not loaded 16 bytes at a time");
            assert!(!b.contains("ld.global.nc.v4.f32"), "{name}: reads a table");
        } else {
            // Tables come through the read-only path, 16 bytes at a time (a lane holds at least
            // 4 pairs: GPT-J lanes are two vectors) except MRoPE, whose pairs may read rows of
            // different positions (then one entry at a time).
            // The caller's tables (`_t`, in q's element type) are read an element at a time.
            let table = match (name.ends_with("_m"), name.ends_with("_t"), name.contains("_f32_")) {
                (true, ..) => "ld.global.nc.f32",
                (_, true, true) => "ld.global.nc.b32",
                (_, true, false) => "ld.global.nc.b16",
                _ => "ld.global.nc.v4.f32",
            };
            assert!(b.contains(table), "{name}: table loads are not {table}");
        }
    }
}

#[test]
fn kernels_have_no_local_memory_or_panics() {
    for (arch, ptx) in ALL.iter() {
        assert!(!ptx.contains(".local"), "{arch}: a kernel uses local memory (a stack frame)");
        assert!(!ptx.contains("panic"), "{arch}: a kernel can reach a panic path");
    }
}

/// The kernels computing cos and sin (`_c`) use no FP64 (most GPUs other than the data-centre
/// ones run it at 1/64 rate): integer and f32 arithmetic only.
#[test]
fn computed_kernels_use_no_fp64() {
    let computed = named("")
        .into_iter()
        .filter(|n| n.ends_with("_c") || n.ends_with("_c_n") || n.ends_with("_c_w"))
        .collect::<Vec<_>>();
    let kv_widths = KV_WIDTHS.len() + NORM_WIDTHS.len() + WHOLE_WIDTHS.len();
    let rope_widths = ROPE_WIDTHS.len() + ROPE_NORM_WIDTHS.len() + ROPE_WHOLE_WIDTHS.len();
    // And the de-interleaved KV kernels' (one row kind, every operand type, with and without
    // kv_c's norm).
    let deinterleaved = (TYPES.len() + FP8_TYPES.len()) * (DEINTERLEAVED_WIDTHS.len() + WHOLE_WIDTHS.len());
    assert_eq!(
        computed.len(),
        STYLES.len() * ROWS.len() * (TYPES.len() * (rope_widths + kv_widths) + FP8_TYPES.len() * kv_widths)
            + deinterleaved,
        "every RoPE and KV kernel of the library has a computed twin"
    );
    for (arch, ptx) in ALL.iter() {
        for &name in &computed {
            assert!(!body(ptx, name).contains(".f64"), "{arch} {name}: an FP64 instruction");
        }
    }
}

/// The FP8 kernels convert with sm_89's instruction where the PTX's architecture has it
/// (sm_90, sm_100) and with the integer twin in sm_80's, and divide by the scale exactly: its
/// correctly rounded reciprocal (`rcp.rn.f32`) and a correction (`div_by`), or the IEEE
/// division (`div.rn.f32`) out of line, never an approximation; the other kernels convert
/// nothing to FP8.
#[test]
fn fp8_kernels_convert_by_architecture_and_divide_exactly() {
    let fp8: Vec<_> = named("kv_").into_iter().filter(|n| n.contains("_fp8_")).collect();
    assert!(!fp8.is_empty());
    for (arch, ptx) in ALL.iter() {
        let hardware = *arch != "sm_80";
        for &name in &fp8 {
            let b = body(ptx, name);
            for f in ["e4m3x2", "e5m2x2"] {
                let cvt = format!("cvt.rn.satfinite.{f}.f32");
                assert_eq!(b.contains(&cvt), hardware, "{arch} {name}: {cvt}");
            }
            // The scale's reciprocal rounded to nearest (`div_by` corrects the product), and
            // the IEEE division of unusual scales called out of line.
            assert!(b.contains("rcp.rn.f32"), "{arch} {name}: no correctly rounded reciprocal");
            assert!(b.contains("call.uni"), "{arch} {name}: no call of the out-of-line division");
            for approx in ["div.approx", "div.full", "rcp.approx"] {
                assert!(!b.contains(approx), "{arch} {name}: an approximate division ({approx})");
            }
        }
        // That division is IEEE's: the body of its definition (not its declaration).
        let defined = ptx.match_indices("6divide(").any(|(i, _)| {
            let rest = &ptx[i..];
            let after = rest[rest.find(')').unwrap_or(0) + 1..].trim_start();
            after.starts_with('{') && after[..after.find('}').unwrap_or(after.len())].contains("div.rn.f32")
        });
        assert!(defined, "{arch}: no out-of-line IEEE division");
        let others = named("").into_iter().filter(|n| !n.contains("_fp8_") && *n != "bench_fp8");
        for name in others {
            assert!(!body(ptx, name).contains("satfinite.e"), "{arch} {name}: converts to FP8");
        }
    }
}
