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
/// The KV appends' interleaved pairs written back de-interleaved (`gptjd`: pair `i`'s two
/// values at `i` and `rotary_dim / 2 + i`, as transformers' DeepSeek-V3 code writes them): the
/// widths of [`DEINTERLEAVED_WIDTHS`], one position row, the library's sources, every type.
const DEINTERLEAVED: Value = v("gptjd", "RopeStyle::GptJ", "Deinterleaved");
/// The widths that write de-interleaved: 8 and 16 bytes (a lane's pairs fill one access of
/// each half); with a whole-projection norm (MLA's `kv_c` normalized), [`WHOLE_WIDTHS`].
const DEINTERLEAVED_WIDTHS: [usize; 3] = [1, 2, 3];
/// Element types of the operands, one value per combination the kernels take: the name's
/// part, the inputs' type (q, k, v; q rotated in place keeps it) and the outputs' type
/// (RoPE's q and k outputs, the caches), each as `DType`'s variant.
const TYPES: [(&str, &str, &str); 3] = [("f32", "F32", "F32"), ("f16", "F16", "F16"), ("bf16", "BF16", "BF16")];
/// The KV appends' further operand types: FP8 caches (`FP8`: either format, the launch's),
/// from inputs of each type.
const FP8_TYPES: [(&str, &str, &str); 3] =
    [("f32_fp8", "F32", "FP8"), ("f16_fp8", "F16", "FP8"), ("bf16_fp8", "BF16", "FP8")];

/// The kernels' element type of a `DType` variant.
fn elem(d: &str) -> &'static str {
    match d {
        "F32" => "F32",
        "F16" => "F16",
        "BF16" => "Bf16",
        _ => panic!("no element type for DType::{d}"),
    }
}

/// The key pattern of a RoPE kernel's operand types.
fn rope_types((_, i, o): (&str, &str, &str)) -> String {
    format!("RopeTypes {{ q: DType::{i}, k: DType::{i}, q_out: DType::{o}, k_out: DType::{o} }}")
}

/// The key pattern of a KV kernel's operand types (FP8: either format).
fn kv_types((_, i, o): (&str, &str, &str)) -> String {
    let o = match o {
        "FP8" => "DType::E4M3 | DType::E5M2".to_string(),
        _ => format!("DType::{o}"),
    };
    format!("KvTypes {{ q: DType::{i}, k: DType::{i}, v: DType::{i}, cache_k: {o}, cache_v: {o} }}")
}
/// The library's source of cos and sin: its table, or computed (`_c`). The caller's tables
/// (`_t`) come in the rows that take them: RoPE's (one position row) and the reference
/// update's ([`CALLER_WIDTHS`]).
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
/// QK-norm before the rotation (`_n`): the KV appends of these widths (8 or 16 bytes, one head
/// a thread or several: a head's lanes sum their squares inside one warp), with the library's
/// sources, both position rows and every operand type.
const NORM_WIDTHS: [usize; 3] = [1, 2, 3];

/// QK-norm before the rotation in the RoPE kernels (`_n`): 16 bytes, several heads a thread
/// (`_v`) or one (`_p`), with the library's sources, both position rows and every operand type.
const ROPE_NORM_WIDTHS: [usize; 2] = [1, 2];

/// A whole-projection QK-norm (`_w`, OLMo 2's: one statistic per token over all of q's heads
/// and one over k's, each token's heads in one block): the one-head widths, KV's `_d` and
/// `_p` and RoPE's `_p`, with the library's sources, both position rows and every type.
const WHOLE_WIDTHS: [usize; 2] = [1, 2];
const ROPE_WHOLE_WIDTHS: [usize; 1] = [2];

/// The body's access types for a width (`s`: pairs of elements for GPT-J), inputs of type
/// `i` and outputs of type `o` (`DType` variants, or `FP8`): rotating lanes' load and store,
/// copying lanes' load and store, as the body's generic arguments.
fn io(width: &str, style: &str, i: &str, o: &str, kv: bool) -> String {
    // The KV kernels' 16-byte accesses as `tuning::KV_STREAMING` says.
    let cs = if kv { ", { crate::tuning::KV_STREAMING }" } else { "" };
    let access = |t: &str| match width {
        "s" if style == "GptJ" => (format!("Two<{t}>"), format!("One<{t}>")),
        "s" => (format!("One<{t}>"), format!("One<{t}>")),
        "d" => (format!("Vec8<{t}>"), format!("Vec8<{t}>")),
        _ => (format!("Vec16<{t}{cs}>"), format!("Vec16<{t}{cs}>")),
    };
    let (r, c) = access(elem(i));
    // A store moves as many elements as its load: of the same access where the sizes agree;
    // FP8, as many bytes as the load's elements (byte by byte where the load goes element by
    // element).
    let (w, d) = match o {
        "FP8" => match width {
            "s" if style == "GptJ" => ("F8<2, false>".to_string(), "F8<1, false>".to_string()),
            "s" => ("F8<1, false>".to_string(), "F8<1, false>".to_string()),
            _ => {
                let e = if width == "d" { 8 } else { 16 } / size(elem(i));
                (format!("F8<{e}, true>"), format!("F8<{e}, true>"))
            }
        },
        _ => {
            assert_eq!(size(elem(i)), size(elem(o)), "no store access for {i} -> {o}");
            access(elem(o))
        }
    };
    format!("{r}, {w}, {c}, {d}")
}

fn size(t: &str) -> usize {
    if t == "F32" {
        4
    } else {
        2
    }
}

type Types = (&'static str, &'static str, &'static str);

/// Every (width, position rows, source) of `widths` with the library's sources, in the
/// list's order.
fn variants(widths: &'static [Value]) -> impl Iterator<Item = (&'static Value, &'static Value, &'static Value)> {
    widths.iter().flat_map(|w| ROWS.iter().flat_map(move |r| SOURCES.iter().map(move |s| (w, r, s))))
}

/// A source as a row takes it: the name's part, the key's value and the body's type.
type Source<'a> = (&'a str, &'a str, &'a str);

/// The caller's tables in the inputs' type `i` (a `DType` variant), entries read one by one
/// (no alignment asked of the caller's tables).
fn caller_source(i: &str) -> (&'static str, &'static str, String) {
    ("_t", "TableSource::Caller", format!("ElemTable<{}>", elem(i)))
}

fn rope_row(
    out: &mut String,
    style: &Value,
    types: Types,
    (width, rows, source): (&Value, &Value, Source<'_>),
    (norm, whole): (bool, bool),
) {
    let (source_name, source_key, source_ty) = source;
    let n = match (norm, whole) {
        (true, true) => "_w",
        (true, false) => "_n",
        _ => "",
    };
    let name = format!("rope_{}_{}_{}{}{}{n}", style.name, types.0, width.name, rows.name, source_name);
    let access = io(width.ty, style.ty, types.1, types.2, false);
    let g = match width.ty {
        "v" => format!(
            "{{ heads_per_thread(true, {}, {}, {}) as usize }}",
            style.ty == "NeoX",
            size(elem(types.1)),
            source_ty == "Computed"
        ),
        _ => "1".into(),
    };
    writeln!(
        out,
        "        {name} {{ style: {}, types: {}, width: {}, mrope: {}, source: {}, norm: {norm}, whole: {whole} }} [{}, {access}, {}, {}, {g}, {norm}, {whole}];",
        style.key,
        rope_types(types),
        width.key,
        rows.key,
        source_key,
        style.ty,
        source_ty,
        rows.ty
    )
    .unwrap();
}

fn rope_rows(out: &mut String) {
    for style in &STYLES {
        for types in TYPES {
            for (width, rows, source) in variants(&ROPE_WIDTHS) {
                rope_row(out, style, types, (width, rows, (source.name, source.key, source.ty)), (false, false));
            }
            for (widths, whole) in [(&ROPE_NORM_WIDTHS[..], false), (&ROPE_WHOLE_WIDTHS[..], true)] {
                for (width, rows, source) in widths
                    .iter()
                    .flat_map(|&w| ROWS.iter().flat_map(move |r| SOURCES.iter().map(move |s| (&ROPE_WIDTHS[w], r, s))))
                {
                    rope_row(out, style, types, (width, rows, (source.name, source.key, source.ty)), (true, whole));
                }
            }
            // The caller's tables (candle's drop-ins), one position row.
            let (name, key, ty) = caller_source(types.1);
            for width in &ROPE_WIDTHS {
                rope_row(out, style, types, (width, &ROWS[0], (name, key, &ty)), (false, false));
            }
        }
    }
}

fn kv_row(
    out: &mut String,
    style: &Value,
    types: Types,
    (width, rows, source): (&Value, &Value, Source<'_>),
    (norm, whole): (bool, bool),
) {
    let deinterleave = style.ty == DEINTERLEAVED.ty;
    let n = match (norm, whole) {
        (true, true) => "_w",
        (true, false) => "_n",
        _ => "",
    };
    let name = format!("kv_{}_{}_{}{}{}{n}", style.name, types.0, width.name, rows.name, source.0);
    let access = io(width.ty, style.ty, types.1, types.2, true);
    let g = match width.ty {
        "v" => format!("{{ kv_heads_per_thread(true, {}, {}) as usize }}", style.ty != "NeoX", size(elem(types.1))),
        _ => "1".into(),
    };
    let scan = matches!(width.ty, "s" | "d");
    writeln!(
        out,
        "        {name} {{ style: {}, types: {}, width: {}, tables: {}, mrope: {}, norm: {norm}, whole: {whole}, deinterleave: {deinterleave} }} [{}, {access}, {}, {}, {g}, {scan}, {norm}, {whole}];",
        style.key, kv_types(types), width.key, source.1, rows.key, style.ty, source.2, rows.ty
    )
    .unwrap();
}

fn kv_rows(out: &mut String) {
    for style in &STYLES {
        for types in TYPES.into_iter().chain(FP8_TYPES) {
            for (width, rows, source) in variants(&KV_WIDTHS) {
                kv_row(out, style, types, (width, rows, (source.name, source.key, source.ty)), (false, false));
            }
            for (widths, whole) in [(&NORM_WIDTHS[..], false), (&WHOLE_WIDTHS[..], true)] {
                for &w in widths {
                    for rows in &ROWS {
                        for source in &SOURCES {
                            let source = (source.name, source.key, source.ty);
                            kv_row(out, style, types, (&KV_WIDTHS[w], rows, source), (true, whole));
                        }
                    }
                }
            }
            if style.ty == "GptJ" {
                // De-interleaved (MLA's option), with the whole-projection kernels that
                // normalize its kv_c.
                let widths =
                    DEINTERLEAVED_WIDTHS.map(|w| (w, false)).into_iter().chain(WHOLE_WIDTHS.map(|w| (w, true)));
                for (w, whole) in widths {
                    for source in &SOURCES {
                        let source = (source.name, source.key, source.ty);
                        kv_row(out, &DEINTERLEAVED, types, (&KV_WIDTHS[w], &ROWS[0], source), (whole, whole));
                    }
                }
            }
            if style.ty == "GptJ" && types.2 != "FP8" {
                // The caller's tables, in the inputs' type (f32: its own table type).
                let t = elem(types.1);
                let table = if t == "F32" { "F32Table".to_string() } else { format!("ElemTable<{t}>") };
                for &w in &CALLER_WIDTHS {
                    let source = ("_t", "TableSource::Caller", table.as_str());
                    kv_row(out, style, types, (&KV_WIDTHS[w], &ROWS[0], source), (false, false));
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
    // The dequantizing read of FP8 caches, into each element type.
    list += "    ReadKey(ReadParams) => read {\n";
    for (name, d, _) in TYPES {
        writeln!(list, "        kv_read_{name} {{ out: DType::{d} }} [{}];", elem(d)).unwrap();
    }
    list += "    }\n";
    for (key, params, body, name) in [
        ("BenchEmpty", "u64", "empty", "bench_empty"),
        ("BenchSpin", "u64", "spin", "bench_spin"),
        ("BenchTouch", "Touch", "touch", "bench_touch"),
        ("BenchTouchRows", "TouchRows", "touch_rows", "bench_touch_rows"),
        ("BenchFp8", "Touch", "fp8", "bench_fp8"),
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
        (
            "Element types of the operands (inputs, outputs)",
            "TYPES",
            TYPES.iter().map(|t| format!("{:?}", t.0)).collect::<Vec<_>>().join(", "),
        ),
        (
            "The KV appends' further operand types (FP8 caches)",
            "FP8_TYPES",
            FP8_TYPES.iter().map(|t| format!("{:?}", t.0)).collect::<Vec<_>>().join(", "),
        ),
        ("Sources of cos and sin (the library's)", "SOURCES", names(&SOURCES)),
        ("Position rows (one position, MRoPE's streams)", "ROWS", names(&ROWS)),
        ("RoPE widths", "ROPE_WIDTHS", names(&ROPE_WIDTHS)),
        ("KV widths", "KV_WIDTHS", names(&KV_WIDTHS)),
    ] {
        writeln!(list, "    /// {doc}.\n    pub const {name}: &[&str] = &[{values}];").unwrap();
    }
    let caller: Vec<String> = CALLER_WIDTHS.iter().map(|&w| format!("{:?}", KV_WIDTHS[w].name)).collect();
    writeln!(list, "    /// KV widths with the caller's tables (GPT-J, one position row).\n    pub const CALLER_WIDTHS: &[&str] = &[{}];", caller.join(", ")).unwrap();
    let norm: Vec<String> = ROPE_NORM_WIDTHS.iter().map(|&w| format!("{:?}", ROPE_WIDTHS[w].name)).collect();
    writeln!(list, "    /// RoPE widths with QK-norm (`_n`; the library's sources, both position rows).\n    pub const ROPE_NORM_WIDTHS: &[&str] = &[{}];", norm.join(", ")).unwrap();
    let d: Vec<String> = DEINTERLEAVED_WIDTHS.iter().map(|&w| format!("{:?}", KV_WIDTHS[w].name)).collect();
    writeln!(list, "    /// KV widths that write GPT-J pairs de-interleaved (`kv_gptjd_`: one position row, the library's sources).\n    pub const DEINTERLEAVED_WIDTHS: &[&str] = &[{}];", d.join(", ")).unwrap();
    let norm: Vec<String> = NORM_WIDTHS.iter().map(|&w| format!("{:?}", KV_WIDTHS[w].name)).collect();
    writeln!(list, "    /// KV widths with QK-norm (`_n`; the library's sources, both position rows).\n    pub const NORM_WIDTHS: &[&str] = &[{}];", norm.join(", ")).unwrap();
    let whole: Vec<String> = ROPE_WHOLE_WIDTHS.iter().map(|&w| format!("{:?}", ROPE_WIDTHS[w].name)).collect();
    writeln!(list, "    /// RoPE widths with a whole-projection QK-norm (`_w`; the library's sources, both position rows).\n    pub const ROPE_WHOLE_WIDTHS: &[&str] = &[{}];", whole.join(", ")).unwrap();
    let whole: Vec<String> = WHOLE_WIDTHS.iter().map(|&w| format!("{:?}", KV_WIDTHS[w].name)).collect();
    writeln!(list, "    /// KV widths with a whole-projection QK-norm (`_w`; the library's sources, both position rows).\n    pub const WHOLE_WIDTHS: &[&str] = &[{}];", whole.join(", ")).unwrap();
    list += "}\n";
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("entry_list.rs");
    if std::fs::read_to_string(&out).ok().as_deref() != Some(list.as_str()) {
        std::fs::write(&out, list).expect("writing entry_list.rs");
    }
}
