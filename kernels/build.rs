//! Tells the crates that depend on this one where its sources are (`DEP_ROPE_CUDA_KERNELS_ROOT`
//! in their build scripts): `rope-cuda`'s `build.rs` compiles them to PTX, from the repository
//! or from wherever cargo unpacked this crate.
//!
//! And generates the list of entry points (`entry_list.rs`, included by `src/entries.rs`) from
//! the support table (`src/support.rs`): every supported variant of the product of the kernel
//! axes is one entry point, its name, key and generic arguments all made here from the
//! variant's axis values. A new value of an axis is one value of its enum there (and its
//! key, type and name here); which combinations exist is said there alone.

use std::fmt::Write;

// The support table: the axes and the rules saying which of their combinations exist.
#[path = "src/support.rs"]
#[allow(dead_code)]
mod support;
use support::{axes, variants, Elem, Norm, Op, Pairs, Rows, Source, Store, Variant, Width};

/// The kernels' element type of an input type.
fn elem(e: Elem) -> &'static str {
    match e {
        Elem::F32 => "F32",
        Elem::F16 => "F16",
        Elem::Bf16 => "Bf16",
    }
}

/// `DType`'s variant of an input type.
fn dtype(e: Elem) -> &'static str {
    match e {
        Elem::Bf16 => "BF16",
        e => elem(e),
    }
}

fn size(e: Elem) -> usize {
    match e {
        Elem::F32 => 4,
        _ => 2,
    }
}

/// The body's access types of a variant (`_s`: pairs of elements for GPT-J): rotating lanes'
/// load and store, copying lanes' load and store, as the body's generic arguments.
fn io(v: &Variant) -> String {
    if v.op == Op::Shift {
        return shift_io(v);
    }
    // The KV kernels' 16-byte accesses as `tuning::KV_STREAMING` says.
    let cs = if v.op == Op::Kv { ", { crate::tuning::KV_STREAMING }" } else { "" };
    let pairs_of_two = v.width == Width::Scalar && v.pairs == Pairs::GptJ;
    let t = elem(v.elem);
    let (r, c) = match v.width {
        Width::Scalar if pairs_of_two => (format!("Two<{t}>"), format!("One<{t}>")),
        Width::Scalar => (format!("One<{t}>"), format!("One<{t}>")),
        Width::Decode => (format!("Vec8<{t}>"), format!("Vec8<{t}>")),
        _ => (format!("Vec16<{t}{cs}>"), format!("Vec16<{t}{cs}>")),
    };
    // A store moves as many elements as its load: of the same access where the types agree;
    // FP8, as many bytes as the load's elements (byte by byte where the load goes element by
    // element).
    let (w, d) = match (v.store, v.width) {
        (Store::Input, _) => (r.clone(), c.clone()),
        (Store::Fp8, Width::Scalar) if pairs_of_two => ("F8<2, false>".to_string(), "F8<1, false>".to_string()),
        (Store::Fp8, Width::Scalar) => ("F8<1, false>".to_string(), "F8<1, false>".to_string()),
        (Store::Fp8, width) => {
            let e = if width == Width::Decode { 8 } else { 16 } / size(v.elem);
            (format!("F8<{e}, true>"), format!("F8<{e}, true>"))
        }
    };
    format!("{r}, {w}, {c}, {d}")
}

/// The shift's access type, one for its load and its store (in place): 16 bytes (FP8: 8
/// codes) or element by element (GPT-J: a pair).
fn shift_io(v: &Variant) -> String {
    let t = elem(v.elem);
    let one = v.width == Width::Scalar;
    let gptj = v.pairs == Pairs::GptJ;
    let r = match v.store {
        Store::Input if !one => format!("Vec16<{t}, {{ crate::tuning::KV_STREAMING }}>"),
        Store::Input if gptj => format!("Two<{t}>"),
        Store::Input => format!("One<{t}>"),
        Store::Fp8 if !one => "F8<8, true>".to_string(),
        Store::Fp8 if gptj => "F8<2, false>".to_string(),
        Store::Fp8 => "F8<1, false>".to_string(),
    };
    format!("{r}, {r}")
}

/// The key pattern of a variant's operand types (FP8: either format).
fn types(v: &Variant) -> String {
    let i = dtype(v.elem);
    let o = match v.store {
        Store::Input => format!("DType::{i}"),
        Store::Fp8 => "DType::E4M3 | DType::E5M2".to_string(),
    };
    match v.op {
        Op::Shift => o,
        Op::Rope => format!("RopeTypes {{ q: DType::{i}, k: DType::{i}, q_out: {o}, k_out: {o} }}"),
        Op::Kv => format!("KvTypes {{ q: DType::{i}, k: DType::{i}, v: DType::{i}, cache_k: {o}, cache_v: {o} }}"),
    }
}

/// One line of the list: the entry point's name, its key pattern and its body's generic
/// arguments.
fn row(out: &mut String, v: &Variant) {
    let name = v.name();
    let style = match v.pairs {
        Pairs::NeoX => "NeoX",
        Pairs::GptJ => "GptJ",
        Pairs::Deinterleaved => "Deinterleaved",
    };
    let key_style = if v.pairs == Pairs::NeoX { "RopeStyle::NeoX" } else { "RopeStyle::GptJ" };
    let (source_key, source_ty) = match v.source {
        Source::Table => ("TableSource::Table", "LibTable".to_string()),
        Source::Computed => ("TableSource::Computed", "Computed".to_string()),
        // The caller's tables in the inputs' type, entries read one by one (no alignment asked
        // of them); the append's f32 ones as its own table type.
        Source::Caller if v.op == Op::Kv && v.elem == Elem::F32 => ("TableSource::Caller", "F32Table".to_string()),
        Source::Caller => ("TableSource::Caller", format!("ElemTable<{}>", elem(v.elem))),
    };
    let (mrope, rows_ty) = match v.rows {
        Rows::One => (false, "OneRow"),
        Rows::Streams => (true, "StreamRows"),
    };
    let (norm, whole) = (v.norm != Norm::None, v.norm == Norm::Whole);
    let norm_ty = match v.norm {
        Norm::None => "NoNorm",
        Norm::Head => "HeadNorm",
        Norm::Whole => "WholeNorm",
    };

    let access = io(v);
    match v.op {
        Op::Rope => {
            let width = match v.width {
                Width::Scalar => "RopeWidth::Scalar",
                Width::Vector => "RopeWidth::Vector",
                _ => "RopeWidth::Single",
            };
            let g = match v.width {
                Width::Vector => format!(
                    "{{ heads_per_thread(true, {}, {}, {}) as usize }}",
                    v.pairs == Pairs::NeoX,
                    size(v.elem),
                    v.source == Source::Computed
                ),
                _ => "1".into(),
            };
            writeln!(
                out,
                "        {name} {{ style: {key_style}, types: {}, width: {width}, mrope: {mrope}, source: {source_key}, norm: {norm}, whole: {whole} }} [{style}, {access}, {source_ty}, {rows_ty}, {norm_ty}, {g}];",
                types(v),
            )
            .unwrap();
        }
        Op::Shift => {
            let width = match v.width {
                Width::Scalar => "RopeWidth::Scalar",
                Width::Vector => "RopeWidth::Vector",
                _ => "RopeWidth::Single",
            };
            writeln!(
                out,
                "        {name} {{ style: {key_style}, cache: {}, width: {width} }} [{style}, {access}];",
                types(v)
            )
            .unwrap();
        }
        Op::Kv => {
            let width = match v.width {
                Width::Scalar => "KvWidth::Scalar",
                Width::Decode => "KvWidth::Decode",
                Width::Single => "KvWidth::Prefill",
                Width::Vector => "KvWidth::Vector",
            };
            let g = match v.width {
                Width::Vector => {
                    format!(
                        "{{ kv_heads_per_thread(true, {}, {}, {}) as usize }}",
                        v.pairs != Pairs::NeoX,
                        size(v.elem),
                        v.norm == Norm::Head
                    )
                }
                _ => "1".into(),
            };
            // The element and 8-byte kernels scan for duplicate slots.
            let scan = matches!(v.width, Width::Scalar | Width::Decode);
            let deinterleave = v.pairs == Pairs::Deinterleaved;
            writeln!(
                out,
                "        {name} {{ style: {key_style}, types: {}, width: {width}, tables: {source_key}, mrope: {mrope}, norm: {norm}, whole: {whole}, deinterleave: {deinterleave} }} [{style}, {access}, {source_ty}, {rows_ty}, {norm_ty}, {g}, {scan}];",
                types(v),
            )
            .unwrap();
        }
    }
}

fn main() {
    let root = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    println!("cargo:root={root}");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=src/support.rs");

    let mut list =
        String::from("// Generated by rope-cuda-kernels' build.rs from its axis lists.\nentry_points! { @gate []\n");
    list += "    RopeKey(RopeParams) => rope {\n";
    variants().filter(|v| v.op == Op::Rope).for_each(|v| row(&mut list, &v));
    list += "    }\n    KvKey(KvParams) => kv_append {\n";
    variants().filter(|v| v.op == Op::Kv).for_each(|v| row(&mut list, &v));
    list += "    }\n    ShiftKey(ShiftParams) => shift {\n";
    variants().filter(|v| v.op == Op::Shift).for_each(|v| row(&mut list, &v));
    list += "    }\n    ClaimKey(KvParams) => claim {\n        kv_claim {} [];\n    }\n";
    // The dequantizing read of FP8 caches, into each element type.
    list += "    ReadKey(ReadParams) => read {\n";
    for e in axes::ELEMS {
        writeln!(list, "        kv_read_{} {{ out: DType::{} }} [{}];", elem(e).to_lowercase(), dtype(e), elem(e))
            .unwrap();
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
    list += "}\n";
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("entry_list.rs");
    if std::fs::read_to_string(&out).ok().as_deref() != Some(list.as_str()) {
        std::fs::write(&out, list).expect("writing entry_list.rs");
    }
}
