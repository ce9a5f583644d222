//! Checks on the embedded PTX text of every architecture: what the kernels compiled to.
//! (Registers and spills are checked with ptxas in `.ci/run`.)

use std::collections::BTreeSet;
use std::sync::LazyLock;

use rope_cuda_kernels::entries::{EntryPoint, Key};
use rope_cuda_kernels::keys::{
    DType, KvKey, KvTypes, KvWidth, RopeKey, RopeStyle, RopeTypes, RopeWidth, ShiftKey, TableSource,
};
use rope_cuda_kernels::support::{supported, variants, Source, Variant};
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

/// The entry points of the support table's variants (RoPE, the KV append and the KV shift;
/// not the claim, the read or the benchmark kernels).
fn table_entry_points() -> BTreeSet<&'static str> {
    all_entry_points()
        .filter(|n| {
            n.starts_with("rope_")
                || n.starts_with("shift_")
                || (n.starts_with("kv_") && *n != "kv_claim" && !n.starts_with("kv_read_"))
        })
        .collect()
}

/// The list is the support table: one entry point for each supported variant, named as the
/// variant says, and no other (besides the claim, the reads and the benchmark kernels).
#[test]
fn entry_points_are_the_supported_variants() {
    let table: Vec<Variant> = variants().collect();
    let listed = table_entry_points();
    assert_eq!(listed.len(), table.len());
    for v in &table {
        assert_eq!(listed.iter().filter(|n| v.is_named(n)).count(), 1, "{v:?}");
    }
    let others: Vec<_> = all_entry_points().filter(|n| !listed.contains(n)).collect();
    assert_eq!(
        others,
        ["kv_claim", "kv_read_f32", "kv_read_f16", "kv_read_bf16"].into_iter().chain(BENCH).collect::<Vec<_>>()
    );
}

/// The benchmark kernels (the tests build with the feature `bench-kernels`).
const BENCH: [&str; 5] = ["bench_empty", "bench_spin", "bench_touch", "bench_touch_rows", "bench_fp8"];

/// Every key the host can ask for, mixed operand types too: its entry point exists exactly
/// where its variant is supported, and is the variant's.
#[test]
fn keys_find_the_entry_points_of_their_variants() {
    let types = [DType::F32, DType::F16, DType::BF16, DType::E4M3, DType::E5M2];
    let sources = [TableSource::Table, TableSource::Computed, TableSource::Caller];
    let mut reached = BTreeSet::new();
    for style in [RopeStyle::NeoX, RopeStyle::GptJ] {
        for (i, o, other) in types.iter().flat_map(|&i| types.iter().flat_map(move |&o| types.map(|x| (i, o, x)))) {
            for (mrope, norm, whole) in [false, true]
                .into_iter()
                .flat_map(|m| [(false, false), (true, false), (true, true), (false, true)].map(|(n, w)| (m, n, w)))
            {
                for source in sources {
                    for width in [RopeWidth::Scalar, RopeWidth::Vector, RopeWidth::Single] {
                        for types in [
                            RopeTypes { q: i, k: i, q_out: o, k_out: o },
                            RopeTypes { k: other, ..RopeTypes { q: i, k: i, q_out: o, k_out: o } },
                        ] {
                            let key = RopeKey { style, types, width, mrope, source, norm, whole };
                            reached.extend(check(key, key.variant()));
                        }
                    }
                    for width in [KvWidth::Scalar, KvWidth::Decode, KvWidth::Prefill, KvWidth::Vector] {
                        for deinterleave in [false, true] {
                            let uniform = KvTypes { q: i, k: i, v: i, cache_k: o, cache_v: o };
                            for types in
                                [uniform, KvTypes { v: other, ..uniform }, KvTypes { cache_v: other, ..uniform }]
                            {
                                let key =
                                    KvKey { style, types, width, tables: source, mrope, norm, whole, deinterleave };
                                reached.extend(check(key, key.variant()));
                            }
                        }
                    }
                }
            }
        }
    }
    for style in [RopeStyle::NeoX, RopeStyle::GptJ] {
        for cache in types {
            for width in [RopeWidth::Scalar, RopeWidth::Vector, RopeWidth::Single] {
                let key = ShiftKey { style, cache, width };
                reached.extend(check(key, key.variant()));
            }
        }
    }
    // Every listed entry point was reached.
    assert_eq!(reached, table_entry_points());
}

/// `key` has an entry point exactly where its variant is supported, the variant's.
fn check<K: Key>(key: K, variant: Option<Variant>) -> Option<&'static str> {
    let want = variant.filter(|v| supported(v).is_ok());
    match (key.entry_point(), want) {
        (Some(ep), Some(v)) => {
            assert!(v.is_named(ep.name()), "{key:?}: {} is not {v:?}'s", ep.name());
            Some(ep.name())
        }
        (None, None) => None,
        (ep, _) => panic!("{key:?}: entry point {ep:?}, variant {variant:?} ({:?})", variant.map(|v| supported(&v))),
    }
}

/// The `_v` and `_p` kernels (and MRoPE's `_v_m`, `_p_m`) move q and k only in 16-byte
/// accesses; the `_s` kernels are the fallback for views whose addresses or dims do not allow it.
#[test]
fn vector_kernels_move_q_and_k_16_bytes_at_a_time() {
    let scalar = |n: &str| n.ends_with("_s") || n.contains("_s_");
    let vector: Vec<_> = named("rope_").into_iter().filter(|n| !scalar(n)).collect();
    assert!(!vector.is_empty());
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
    // The shift's 16-byte kernels: in place, 16-byte streaming loads and stores (FP8: 8
    // bytes of codes, plain), and the frequencies 16 bytes at a time.
    for name in named("shift_").into_iter().filter(|n| !n.contains("_s_")) {
        let b = body(ptx, name);
        let access = if name.contains("_fp8_") { ".v2.b32" } else { ".cs.v4.b32" };
        for op in ["ld.global", "st.global"] {
            assert!(b.contains(&format!("{op}{access}")), "{name}: no {op}{access}");
        }
        assert!(b.contains("ld.global.nc.v4.b32"), "{name}: frequencies are not loaded 16 bytes at a time");
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

/// The FP8 shift decodes its codes with `cvt.rn.f16x2.{e4m3x2,e5m2x2}` where the architecture
/// has it (sm_89 and later) and with integer arithmetic on sm_80, whose PTX holds no FP8
/// conversion at all; each format's decodes and encodes come in equal numbers (one copy of
/// the rotation per format). Its 16-byte kernels (`_v`) take several heads a thread
/// (`shift_heads_per_thread`) and ask the L2 cache for the later ones.
#[test]
fn the_fp8_shift_converts_with_each_architectures_instructions() {
    use rope_cuda_kernels::params::shift_heads_per_thread;
    for (arch, ptx) in ALL.iter() {
        let hardware = *arch != "sm_80";
        for name in named("shift_").into_iter().filter(|n| n.contains("_fp8_")) {
            let b = body(ptx, name);
            let count = |op: &str| b.matches(op).count();
            let decodes = (count("cvt.rn.f16x2.e4m3x2"), count("cvt.rn.f16x2.e5m2x2"));
            let encodes = (count("cvt.rn.satfinite.e4m3x2.f32"), count("cvt.rn.satfinite.e5m2x2.f32"));
            match hardware {
                true => assert!(
                    decodes.0 > 0 && decodes.0 == decodes.1 && encodes.0 > 0 && encodes.0 == encodes.1,
                    "{arch} {name}: decodes {decodes:?}, encodes {encodes:?}"
                ),
                false => assert_eq!((decodes, encodes), ((0, 0), (0, 0)), "{arch} {name}"),
            }
            let vector = !name.contains("_s_");
            assert_eq!(
                b.contains("prefetch.global.L2"),
                shift_heads_per_thread(vector, true) > 1,
                "{arch} {name}: the later heads' prefetch"
            );
        }
        for name in named("shift_").into_iter().filter(|n| !n.contains("_fp8_")) {
            assert!(!body(ptx, name).contains("cvt.rn.f16x2.e"), "{arch} {name}: an FP8 decode");
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
    // Every RoPE and KV kernel of the library's table has a computed twin.
    let table: Vec<Variant> = variants().collect();
    for v in table.iter().filter(|v| v.source == Source::Table) {
        let twin = Variant { source: Source::Computed, ..*v };
        assert!(table.contains(&twin), "{v:?} has no computed twin");
    }
    assert_eq!(computed.len(), table.iter().filter(|v| v.source == Source::Computed).count());
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
