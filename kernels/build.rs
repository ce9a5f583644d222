//! Tells the crates that depend on this one where its sources are (`DEP_ROPE_CUDA_KERNELS_ROOT`
//! in their build scripts): `rope-cuda`'s `build.rs` compiles them to PTX, from the repository
//! or from wherever cargo unpacked this crate.
//!
//! And generates the list of entry points (`entry_list.rs`, included by `src/entries.rs`)
//! from the kernel axes below: every combination of their values is one entry point, its
//! name, key and generic arguments all made here from the axis values. A new value of an axis
//! is one line of its list; a new axis is one list and one loop.

use std::fmt::Write;

/// A value of an axis: the part of the entry point's name, the key field's value, and the
/// type (or expression) it puts in the body's generic arguments.
struct Value {
    name: &'static str,
    key: &'static str,
    ty: &'static str,
}

const fn v(name: &'static str, key: &'static str, ty: &'static str) -> Value {
    Value { name, key, ty }
}

/// Pairing: rotate-half (NeoX) or interleaved pairs (GPT-J).
const STYLES: [Value; 2] = [v("neox", "RopeStyle::NeoX", "NeoX"), v("gptj", "RopeStyle::GptJ", "GptJ")];
/// Element type of q, k, v and the cache; `ty` is the kernel's element type.
const DTYPES: [Value; 3] =
    [v("f32", "DType::F32", "F32"), v("f16", "DType::F16", "F16"), v("bf16", "DType::BF16", "Bf16")];
/// The library's source of cos and sin: its table, or computed (`_c`).
const SOURCES: [Value; 2] = [v("", "TableSource::Table", "LibTable"), v("_c", "TableSource::Computed", "Computed")];
/// Which table row a pair reads: the token's one position, or MRoPE's three streams (`_m`).
const ROWS: [Value; 2] = [v("", "false", "OneRow"), v("_m", "true", "StreamRows")];
/// RoPE access widths: element by element (`_s`), 16 bytes with several heads a thread
/// (`_v`), 16 bytes with one head a thread (`_p`).
const ROPE_WIDTHS: [Value; 3] =
    [v("s", "RopeWidth::Scalar", "s"), v("v", "RopeWidth::Vector", "v"), v("p", "RopeWidth::Single", "p")];
/// KV append widths: element by element (`_s`), 8 bytes (`_d`, decode), 16 bytes with one
/// head a thread (`_p`) and with several (`_v`); `_s` and `_d` scan for duplicate slots.
const KV_WIDTHS: [Value; 4] = [
    v("s", "KvWidth::Scalar", "s"),
    v("d", "KvWidth::Decode", "d"),
    v("p", "KvWidth::Prefill", "p"),
    v("v", "KvWidth::Vector", "v"),
];
/// The caller's tables (`_t`, the reference operation): GPT-J, one row, these widths.
const CALLER_WIDTHS: [usize; 3] = [0, 3, 1];

/// The body's load and store access types for a width (`s`: pairs of elements for GPT-J).
fn io(width: &str, style: &str, t: &str) -> (String, String) {
    match width {
        "s" if style == "GptJ" => (format!("Two<{t}>"), format!("One<{t}>")),
        "s" => (format!("One<{t}>"), format!("One<{t}>")),
        "d" => (format!("Vec8<{t}>"), format!("Vec8<{t}>")),
        _ => (format!("Vec16<{t}>"), format!("Vec16<{t}>")),
    }
}

fn size(t: &str) -> usize {
    if t == "F32" {
        4
    } else {
        2
    }
}

fn rope_rows(out: &mut String) {
    for style in &STYLES {
        for dtype in &DTYPES {
            for width in &ROPE_WIDTHS {
                for rows in &ROWS {
                    for source in &SOURCES {
                        let name =
                            format!("rope_{}_{}_{}{}{}", style.name, dtype.name, width.name, rows.name, source.name);
                        let (r, c) = io(width.ty, style.ty, dtype.ty);
                        let g = match width.ty {
                            "v" => format!(
                                "{{ heads_per_thread(true, {}, {}, {}) as usize }}",
                                style.ty == "NeoX",
                                size(dtype.ty),
                                source.ty == "Computed"
                            ),
                            _ => "1".into(),
                        };
                        writeln!(
                            out,
                            "        {name} {{ style: {}, dtype: {}, width: {}, mrope: {}, source: {} }} [{}, {r}, {c}, {}, {}, {g}];",
                            style.key, dtype.key, width.key, rows.key, source.key, style.ty, source.ty, rows.ty
                        )
                        .unwrap();
                    }
                }
            }
        }
    }
}

fn kv_row(out: &mut String, style: &Value, dtype: &Value, width: &Value, rows: &Value, source: (&str, &str, &str)) {
    let name = format!("kv_{}_{}_{}{}{}", style.name, dtype.name, width.name, rows.name, source.0);
    let (r, c) = io(width.ty, style.ty, dtype.ty);
    let g = match width.ty {
        "v" => format!("{{ kv_heads_per_thread(true, {}, {}) as usize }}", style.ty == "GptJ", size(dtype.ty)),
        _ => "1".into(),
    };
    let scan = matches!(width.ty, "s" | "d");
    writeln!(
        out,
        "        {name} {{ style: {}, dtype: {}, width: {}, tables: {}, mrope: {} }} [{}, {r}, {c}, {}, {}, {g}, {scan}];",
        style.key, dtype.key, width.key, source.1, rows.key, style.ty, source.2, rows.ty
    )
    .unwrap();
}

fn kv_rows(out: &mut String) {
    for style in &STYLES {
        for dtype in &DTYPES {
            for width in &KV_WIDTHS {
                for rows in &ROWS {
                    for source in &SOURCES {
                        kv_row(out, style, dtype, width, rows, (source.name, source.key, source.ty));
                    }
                }
            }
            if style.ty == "GptJ" {
                // The caller's tables, in the element type (f32: its own table type).
                let table = if dtype.ty == "F32" { "F32Table".to_string() } else { format!("ElemTable<{}>", dtype.ty) };
                for &w in &CALLER_WIDTHS {
                    kv_row(out, style, dtype, &KV_WIDTHS[w], &ROWS[0], ("_t", "TableSource::Caller", &table));
                }
            }
        }
    }
}

fn names(values: &[Value]) -> String {
    values.iter().map(|v| format!("{:?}", v.name)).collect::<Vec<_>>().join(", ")
}

fn main() {
    let root = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    println!("cargo:root={root}");
    println!("cargo:rerun-if-changed=build.rs");

    let mut list =
        String::from("// Generated by rope-cuda-kernels' build.rs from its axis lists.\nentry_points! { @gate []\n");
    list += "    RopeKey(RopeParams) => rope {\n";
    rope_rows(&mut list);
    list += "    }\n    KvKey(KvParams) => kv_append {\n";
    kv_rows(&mut list);
    list += "    }\n    ClaimKey(KvParams) => claim {\n        kv_claim {} [];\n    }\n";
    for (key, params, body, name) in [
        ("BenchEmpty", "u64", "empty", "bench_empty"),
        ("BenchSpin", "u64", "spin", "bench_spin"),
        ("BenchTouch", "Touch", "touch", "bench_touch"),
    ] {
        writeln!(
            list,
            "    #[cfg(feature = \"bench\")]\n    {key}({params}) => {body} {{\n        {name} {{}} [];\n    }}"
        )
        .unwrap();
    }
    list += "}\n\n/// The kernel axes the entry points are the products of (the names' parts; `\"\"` for a\n/// value that adds nothing to the name).\npub mod axes {\n";
    for (doc, name, values) in [
        ("Styles", "STYLES", names(&STYLES)),
        ("Element types", "DTYPES", names(&DTYPES)),
        ("Sources of cos and sin (the library's)", "SOURCES", names(&SOURCES)),
        ("Position rows (one position, MRoPE's streams)", "ROWS", names(&ROWS)),
        ("RoPE widths", "ROPE_WIDTHS", names(&ROPE_WIDTHS)),
        ("KV widths", "KV_WIDTHS", names(&KV_WIDTHS)),
    ] {
        writeln!(list, "    /// {doc}.\n    pub const {name}: &[&str] = &[{values}];").unwrap();
    }
    let caller: Vec<String> = CALLER_WIDTHS.iter().map(|&w| format!("{:?}", KV_WIDTHS[w].name)).collect();
    writeln!(list, "    /// KV widths with the caller's tables (GPT-J, one position row).\n    pub const CALLER_WIDTHS: &[&str] = &[{}];", caller.join(", ")).unwrap();
    list += "}\n";
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("entry_list.rs");
    if std::fs::read_to_string(&out).ok().as_deref() != Some(list.as_str()) {
        std::fs::write(&out, list).expect("writing entry_list.rs");
    }
}
