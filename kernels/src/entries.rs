//! The one list of entry points. Each line names an entry point, the key the host asks for it
//! by, and the generic arguments of the body it runs; the macro `entry_points!` makes from it the
//! `extern "ptx-kernel"` functions (device build), the [`EntryPoint`] enum with every name, and
//! each key type's [`Key::entry_point`]. Adding a kernel is one line; a key, a name and a
//! parameter type cannot disagree, since all three come from that line.

#[cfg(feature = "bench")]
use crate::keys::{BenchEmpty, BenchSpin, BenchTouch};
use crate::keys::{ClaimKey, DType, KvKey, KvWidth, RopeKey, RopeStyle, RopeWidth, TableSource};
#[cfg(feature = "bench")]
use crate::params::Touch;
use crate::params::{KvParams, RopeParams};

#[cfg(all(target_arch = "nvptx64", feature = "bench"))]
use crate::bench::{empty, spin, touch};
#[cfg(target_arch = "nvptx64")]
use crate::{
    gpu::{Bf16, One, Two, Vec16, Vec8, F16, F32},
    kv::{claim, kv_append},
    params::{heads_per_thread, kv_heads_per_thread},
    rope::rope,
    rotate::{Computed, ElemTable, F32Table, GptJ, LibTable, NeoX, OneRow, StreamRows},
};

/// A kernel key: the parameters its entry points take, and the entry point of each key.
pub trait Key: Copy + core::fmt::Debug {
    /// The one by-value parameter of the key's entry points.
    type Params: Copy;
    /// The entry point for this key, if the list has one.
    fn entry_point(self) -> Option<EntryPoint>;
}

macro_rules! entry_points {
    // Each group gets its `cfg` (`all()`, always, where the list gives none), then the list
    // is made in one go.
    (@gate [$($done:tt)*]) => { entry_points! { @make $($done)* } };
    (@gate [$($done:tt)*] #[cfg($cfg:meta)] $key:ident($params:ty) => $body:ident { $($rows:tt)* } $($rest:tt)*) => {
        entry_points! { @gate [$($done)* #[cfg($cfg)] $key($params) => $body { $($rows)* }] $($rest)* }
    };
    (@gate [$($done:tt)*] $key:ident($params:ty) => $body:ident { $($rows:tt)* } $($rest:tt)*) => {
        entry_points! { @gate [$($done)* #[cfg(all())] $key($params) => $body { $($rows)* }] $($rest)* }
    };
    (@make $(
        #[cfg($cfg:meta)]
        $key:ident($params:ty) => $body:ident {
            $($name:ident { $($field:ident: $val:pat),* } [$($g:tt)*];)*
        }
    )*) => {
        /// Every entry point of the PTX, named as in the PTX.
        #[allow(non_camel_case_types)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum EntryPoint { $($(#[cfg($cfg)] #[doc = concat!("`", stringify!($name), "`")] $name,)*)* }

        impl EntryPoint {
            /// Every entry point, in the order of the list (`ep as usize` is its index).
            pub const ALL: &'static [EntryPoint] = &[$($(#[cfg($cfg)] EntryPoint::$name,)*)*];

            /// The entry point's name in the PTX.
            pub const fn name(self) -> &'static str {
                match self { $($(#[cfg($cfg)] EntryPoint::$name => stringify!($name),)*)* }
            }
        }

        $(
            #[cfg($cfg)]
            impl Key for $key {
                type Params = $params;
                #[inline]
                fn entry_point(self) -> Option<EntryPoint> {
                    #[allow(unreachable_patterns)]
                    match self {
                        $($key { $($field: $val),* } => Some(EntryPoint::$name),)*
                        _ => None,
                    }
                }
            }

            $(
                /// An entry point of the list in `entries.rs`: the body named there, with the
                /// generic arguments of its line.
                ///
                /// # Safety
                /// Launched only by the host library, after the checks the body's `# Safety`
                /// section asks for.
                #[cfg(target_arch = "nvptx64")]
                #[cfg($cfg)]
                #[no_mangle]
                pub unsafe extern "ptx-kernel" fn $name(p: $params) {
                    // SAFETY: the host launches this only after the body's checks.
                    unsafe { $body::<$($g)*>(&p) }
                }
            )*
        )*
    };
}

entry_points! { @gate []
    RopeKey(RopeParams) => rope {
        rope_neox_f32_s { style: RopeStyle::NeoX, dtype: DType::F32, width: RopeWidth::Scalar, mrope: false, source: TableSource::Table } [NeoX, One<F32>, One<F32>, LibTable, OneRow, 1];
        rope_neox_f32_s_c { style: RopeStyle::NeoX, dtype: DType::F32, width: RopeWidth::Scalar, mrope: false, source: TableSource::Computed } [NeoX, One<F32>, One<F32>, Computed, OneRow, 1];
        rope_neox_f32_v { style: RopeStyle::NeoX, dtype: DType::F32, width: RopeWidth::Vector, mrope: false, source: TableSource::Table } [NeoX, Vec16<F32>, Vec16<F32>, LibTable, OneRow, { heads_per_thread(true, true, 4, false) as usize }];
        rope_neox_f32_v_c { style: RopeStyle::NeoX, dtype: DType::F32, width: RopeWidth::Vector, mrope: false, source: TableSource::Computed } [NeoX, Vec16<F32>, Vec16<F32>, Computed, OneRow, { heads_per_thread(true, true, 4, true) as usize }];
        rope_neox_f32_p { style: RopeStyle::NeoX, dtype: DType::F32, width: RopeWidth::Single, mrope: false, source: TableSource::Table } [NeoX, Vec16<F32>, Vec16<F32>, LibTable, OneRow, 1];
        rope_neox_f32_p_c { style: RopeStyle::NeoX, dtype: DType::F32, width: RopeWidth::Single, mrope: false, source: TableSource::Computed } [NeoX, Vec16<F32>, Vec16<F32>, Computed, OneRow, 1];
        rope_neox_f16_s { style: RopeStyle::NeoX, dtype: DType::F16, width: RopeWidth::Scalar, mrope: false, source: TableSource::Table } [NeoX, One<F16>, One<F16>, LibTable, OneRow, 1];
        rope_neox_f16_s_c { style: RopeStyle::NeoX, dtype: DType::F16, width: RopeWidth::Scalar, mrope: false, source: TableSource::Computed } [NeoX, One<F16>, One<F16>, Computed, OneRow, 1];
        rope_neox_f16_v { style: RopeStyle::NeoX, dtype: DType::F16, width: RopeWidth::Vector, mrope: false, source: TableSource::Table } [NeoX, Vec16<F16>, Vec16<F16>, LibTable, OneRow, { heads_per_thread(true, true, 2, false) as usize }];
        rope_neox_f16_v_c { style: RopeStyle::NeoX, dtype: DType::F16, width: RopeWidth::Vector, mrope: false, source: TableSource::Computed } [NeoX, Vec16<F16>, Vec16<F16>, Computed, OneRow, { heads_per_thread(true, true, 2, true) as usize }];
        rope_neox_f16_p { style: RopeStyle::NeoX, dtype: DType::F16, width: RopeWidth::Single, mrope: false, source: TableSource::Table } [NeoX, Vec16<F16>, Vec16<F16>, LibTable, OneRow, 1];
        rope_neox_f16_p_c { style: RopeStyle::NeoX, dtype: DType::F16, width: RopeWidth::Single, mrope: false, source: TableSource::Computed } [NeoX, Vec16<F16>, Vec16<F16>, Computed, OneRow, 1];
        rope_neox_bf16_s { style: RopeStyle::NeoX, dtype: DType::BF16, width: RopeWidth::Scalar, mrope: false, source: TableSource::Table } [NeoX, One<Bf16>, One<Bf16>, LibTable, OneRow, 1];
        rope_neox_bf16_s_c { style: RopeStyle::NeoX, dtype: DType::BF16, width: RopeWidth::Scalar, mrope: false, source: TableSource::Computed } [NeoX, One<Bf16>, One<Bf16>, Computed, OneRow, 1];
        rope_neox_bf16_v { style: RopeStyle::NeoX, dtype: DType::BF16, width: RopeWidth::Vector, mrope: false, source: TableSource::Table } [NeoX, Vec16<Bf16>, Vec16<Bf16>, LibTable, OneRow, { heads_per_thread(true, true, 2, false) as usize }];
        rope_neox_bf16_v_c { style: RopeStyle::NeoX, dtype: DType::BF16, width: RopeWidth::Vector, mrope: false, source: TableSource::Computed } [NeoX, Vec16<Bf16>, Vec16<Bf16>, Computed, OneRow, { heads_per_thread(true, true, 2, true) as usize }];
        rope_neox_bf16_p { style: RopeStyle::NeoX, dtype: DType::BF16, width: RopeWidth::Single, mrope: false, source: TableSource::Table } [NeoX, Vec16<Bf16>, Vec16<Bf16>, LibTable, OneRow, 1];
        rope_neox_bf16_p_c { style: RopeStyle::NeoX, dtype: DType::BF16, width: RopeWidth::Single, mrope: false, source: TableSource::Computed } [NeoX, Vec16<Bf16>, Vec16<Bf16>, Computed, OneRow, 1];
        rope_gptj_f32_s { style: RopeStyle::GptJ, dtype: DType::F32, width: RopeWidth::Scalar, mrope: false, source: TableSource::Table } [GptJ, Two<F32>, One<F32>, LibTable, OneRow, 1];
        rope_gptj_f32_s_c { style: RopeStyle::GptJ, dtype: DType::F32, width: RopeWidth::Scalar, mrope: false, source: TableSource::Computed } [GptJ, Two<F32>, One<F32>, Computed, OneRow, 1];
        rope_gptj_f32_v { style: RopeStyle::GptJ, dtype: DType::F32, width: RopeWidth::Vector, mrope: false, source: TableSource::Table } [GptJ, Vec16<F32>, Vec16<F32>, LibTable, OneRow, { heads_per_thread(true, false, 4, false) as usize }];
        rope_gptj_f32_v_c { style: RopeStyle::GptJ, dtype: DType::F32, width: RopeWidth::Vector, mrope: false, source: TableSource::Computed } [GptJ, Vec16<F32>, Vec16<F32>, Computed, OneRow, { heads_per_thread(true, false, 4, true) as usize }];
        rope_gptj_f32_p { style: RopeStyle::GptJ, dtype: DType::F32, width: RopeWidth::Single, mrope: false, source: TableSource::Table } [GptJ, Vec16<F32>, Vec16<F32>, LibTable, OneRow, 1];
        rope_gptj_f32_p_c { style: RopeStyle::GptJ, dtype: DType::F32, width: RopeWidth::Single, mrope: false, source: TableSource::Computed } [GptJ, Vec16<F32>, Vec16<F32>, Computed, OneRow, 1];
        rope_gptj_f16_s { style: RopeStyle::GptJ, dtype: DType::F16, width: RopeWidth::Scalar, mrope: false, source: TableSource::Table } [GptJ, Two<F16>, One<F16>, LibTable, OneRow, 1];
        rope_gptj_f16_s_c { style: RopeStyle::GptJ, dtype: DType::F16, width: RopeWidth::Scalar, mrope: false, source: TableSource::Computed } [GptJ, Two<F16>, One<F16>, Computed, OneRow, 1];
        rope_gptj_f16_v { style: RopeStyle::GptJ, dtype: DType::F16, width: RopeWidth::Vector, mrope: false, source: TableSource::Table } [GptJ, Vec16<F16>, Vec16<F16>, LibTable, OneRow, { heads_per_thread(true, false, 2, false) as usize }];
        rope_gptj_f16_v_c { style: RopeStyle::GptJ, dtype: DType::F16, width: RopeWidth::Vector, mrope: false, source: TableSource::Computed } [GptJ, Vec16<F16>, Vec16<F16>, Computed, OneRow, { heads_per_thread(true, false, 2, true) as usize }];
        rope_gptj_f16_p { style: RopeStyle::GptJ, dtype: DType::F16, width: RopeWidth::Single, mrope: false, source: TableSource::Table } [GptJ, Vec16<F16>, Vec16<F16>, LibTable, OneRow, 1];
        rope_gptj_f16_p_c { style: RopeStyle::GptJ, dtype: DType::F16, width: RopeWidth::Single, mrope: false, source: TableSource::Computed } [GptJ, Vec16<F16>, Vec16<F16>, Computed, OneRow, 1];
        rope_gptj_bf16_s { style: RopeStyle::GptJ, dtype: DType::BF16, width: RopeWidth::Scalar, mrope: false, source: TableSource::Table } [GptJ, Two<Bf16>, One<Bf16>, LibTable, OneRow, 1];
        rope_gptj_bf16_s_c { style: RopeStyle::GptJ, dtype: DType::BF16, width: RopeWidth::Scalar, mrope: false, source: TableSource::Computed } [GptJ, Two<Bf16>, One<Bf16>, Computed, OneRow, 1];
        rope_gptj_bf16_v { style: RopeStyle::GptJ, dtype: DType::BF16, width: RopeWidth::Vector, mrope: false, source: TableSource::Table } [GptJ, Vec16<Bf16>, Vec16<Bf16>, LibTable, OneRow, { heads_per_thread(true, false, 2, false) as usize }];
        rope_gptj_bf16_v_c { style: RopeStyle::GptJ, dtype: DType::BF16, width: RopeWidth::Vector, mrope: false, source: TableSource::Computed } [GptJ, Vec16<Bf16>, Vec16<Bf16>, Computed, OneRow, { heads_per_thread(true, false, 2, true) as usize }];
        rope_gptj_bf16_p { style: RopeStyle::GptJ, dtype: DType::BF16, width: RopeWidth::Single, mrope: false, source: TableSource::Table } [GptJ, Vec16<Bf16>, Vec16<Bf16>, LibTable, OneRow, 1];
        rope_gptj_bf16_p_c { style: RopeStyle::GptJ, dtype: DType::BF16, width: RopeWidth::Single, mrope: false, source: TableSource::Computed } [GptJ, Vec16<Bf16>, Vec16<Bf16>, Computed, OneRow, 1];
        rope_neox_f32_s_m { style: RopeStyle::NeoX, dtype: DType::F32, width: RopeWidth::Scalar, mrope: true, source: TableSource::Table } [NeoX, One<F32>, One<F32>, LibTable, StreamRows, 1];
        rope_neox_f32_s_m_c { style: RopeStyle::NeoX, dtype: DType::F32, width: RopeWidth::Scalar, mrope: true, source: TableSource::Computed } [NeoX, One<F32>, One<F32>, Computed, StreamRows, 1];
        rope_neox_f32_p_m { style: RopeStyle::NeoX, dtype: DType::F32, width: RopeWidth::Single, mrope: true, source: TableSource::Table } [NeoX, Vec16<F32>, Vec16<F32>, LibTable, StreamRows, 1];
        rope_neox_f32_p_m_c { style: RopeStyle::NeoX, dtype: DType::F32, width: RopeWidth::Single, mrope: true, source: TableSource::Computed } [NeoX, Vec16<F32>, Vec16<F32>, Computed, StreamRows, 1];
        rope_neox_f16_s_m { style: RopeStyle::NeoX, dtype: DType::F16, width: RopeWidth::Scalar, mrope: true, source: TableSource::Table } [NeoX, One<F16>, One<F16>, LibTable, StreamRows, 1];
        rope_neox_f16_s_m_c { style: RopeStyle::NeoX, dtype: DType::F16, width: RopeWidth::Scalar, mrope: true, source: TableSource::Computed } [NeoX, One<F16>, One<F16>, Computed, StreamRows, 1];
        rope_neox_f16_p_m { style: RopeStyle::NeoX, dtype: DType::F16, width: RopeWidth::Single, mrope: true, source: TableSource::Table } [NeoX, Vec16<F16>, Vec16<F16>, LibTable, StreamRows, 1];
        rope_neox_f16_p_m_c { style: RopeStyle::NeoX, dtype: DType::F16, width: RopeWidth::Single, mrope: true, source: TableSource::Computed } [NeoX, Vec16<F16>, Vec16<F16>, Computed, StreamRows, 1];
        rope_neox_bf16_s_m { style: RopeStyle::NeoX, dtype: DType::BF16, width: RopeWidth::Scalar, mrope: true, source: TableSource::Table } [NeoX, One<Bf16>, One<Bf16>, LibTable, StreamRows, 1];
        rope_neox_bf16_s_m_c { style: RopeStyle::NeoX, dtype: DType::BF16, width: RopeWidth::Scalar, mrope: true, source: TableSource::Computed } [NeoX, One<Bf16>, One<Bf16>, Computed, StreamRows, 1];
        rope_neox_bf16_p_m { style: RopeStyle::NeoX, dtype: DType::BF16, width: RopeWidth::Single, mrope: true, source: TableSource::Table } [NeoX, Vec16<Bf16>, Vec16<Bf16>, LibTable, StreamRows, 1];
        rope_neox_bf16_p_m_c { style: RopeStyle::NeoX, dtype: DType::BF16, width: RopeWidth::Single, mrope: true, source: TableSource::Computed } [NeoX, Vec16<Bf16>, Vec16<Bf16>, Computed, StreamRows, 1];
        rope_gptj_f32_s_m { style: RopeStyle::GptJ, dtype: DType::F32, width: RopeWidth::Scalar, mrope: true, source: TableSource::Table } [GptJ, Two<F32>, One<F32>, LibTable, StreamRows, 1];
        rope_gptj_f32_s_m_c { style: RopeStyle::GptJ, dtype: DType::F32, width: RopeWidth::Scalar, mrope: true, source: TableSource::Computed } [GptJ, Two<F32>, One<F32>, Computed, StreamRows, 1];
        rope_gptj_f32_p_m { style: RopeStyle::GptJ, dtype: DType::F32, width: RopeWidth::Single, mrope: true, source: TableSource::Table } [GptJ, Vec16<F32>, Vec16<F32>, LibTable, StreamRows, 1];
        rope_gptj_f32_p_m_c { style: RopeStyle::GptJ, dtype: DType::F32, width: RopeWidth::Single, mrope: true, source: TableSource::Computed } [GptJ, Vec16<F32>, Vec16<F32>, Computed, StreamRows, 1];
        rope_gptj_f16_s_m { style: RopeStyle::GptJ, dtype: DType::F16, width: RopeWidth::Scalar, mrope: true, source: TableSource::Table } [GptJ, Two<F16>, One<F16>, LibTable, StreamRows, 1];
        rope_gptj_f16_s_m_c { style: RopeStyle::GptJ, dtype: DType::F16, width: RopeWidth::Scalar, mrope: true, source: TableSource::Computed } [GptJ, Two<F16>, One<F16>, Computed, StreamRows, 1];
        rope_gptj_f16_p_m { style: RopeStyle::GptJ, dtype: DType::F16, width: RopeWidth::Single, mrope: true, source: TableSource::Table } [GptJ, Vec16<F16>, Vec16<F16>, LibTable, StreamRows, 1];
        rope_gptj_f16_p_m_c { style: RopeStyle::GptJ, dtype: DType::F16, width: RopeWidth::Single, mrope: true, source: TableSource::Computed } [GptJ, Vec16<F16>, Vec16<F16>, Computed, StreamRows, 1];
        rope_gptj_bf16_s_m { style: RopeStyle::GptJ, dtype: DType::BF16, width: RopeWidth::Scalar, mrope: true, source: TableSource::Table } [GptJ, Two<Bf16>, One<Bf16>, LibTable, StreamRows, 1];
        rope_gptj_bf16_s_m_c { style: RopeStyle::GptJ, dtype: DType::BF16, width: RopeWidth::Scalar, mrope: true, source: TableSource::Computed } [GptJ, Two<Bf16>, One<Bf16>, Computed, StreamRows, 1];
        rope_gptj_bf16_p_m { style: RopeStyle::GptJ, dtype: DType::BF16, width: RopeWidth::Single, mrope: true, source: TableSource::Table } [GptJ, Vec16<Bf16>, Vec16<Bf16>, LibTable, StreamRows, 1];
        rope_gptj_bf16_p_m_c { style: RopeStyle::GptJ, dtype: DType::BF16, width: RopeWidth::Single, mrope: true, source: TableSource::Computed } [GptJ, Vec16<Bf16>, Vec16<Bf16>, Computed, StreamRows, 1];
        rope_neox_f32_v_m { style: RopeStyle::NeoX, dtype: DType::F32, width: RopeWidth::Vector, mrope: true, source: TableSource::Table } [NeoX, Vec16<F32>, Vec16<F32>, LibTable, StreamRows, { heads_per_thread(true, true, 4, false) as usize }];
        rope_neox_f32_v_m_c { style: RopeStyle::NeoX, dtype: DType::F32, width: RopeWidth::Vector, mrope: true, source: TableSource::Computed } [NeoX, Vec16<F32>, Vec16<F32>, Computed, StreamRows, { heads_per_thread(true, true, 4, true) as usize }];
        rope_neox_f16_v_m { style: RopeStyle::NeoX, dtype: DType::F16, width: RopeWidth::Vector, mrope: true, source: TableSource::Table } [NeoX, Vec16<F16>, Vec16<F16>, LibTable, StreamRows, { heads_per_thread(true, true, 2, false) as usize }];
        rope_neox_f16_v_m_c { style: RopeStyle::NeoX, dtype: DType::F16, width: RopeWidth::Vector, mrope: true, source: TableSource::Computed } [NeoX, Vec16<F16>, Vec16<F16>, Computed, StreamRows, { heads_per_thread(true, true, 2, true) as usize }];
        rope_neox_bf16_v_m { style: RopeStyle::NeoX, dtype: DType::BF16, width: RopeWidth::Vector, mrope: true, source: TableSource::Table } [NeoX, Vec16<Bf16>, Vec16<Bf16>, LibTable, StreamRows, { heads_per_thread(true, true, 2, false) as usize }];
        rope_neox_bf16_v_m_c { style: RopeStyle::NeoX, dtype: DType::BF16, width: RopeWidth::Vector, mrope: true, source: TableSource::Computed } [NeoX, Vec16<Bf16>, Vec16<Bf16>, Computed, StreamRows, { heads_per_thread(true, true, 2, true) as usize }];
        rope_gptj_f32_v_m { style: RopeStyle::GptJ, dtype: DType::F32, width: RopeWidth::Vector, mrope: true, source: TableSource::Table } [GptJ, Vec16<F32>, Vec16<F32>, LibTable, StreamRows, { heads_per_thread(true, false, 4, false) as usize }];
        rope_gptj_f32_v_m_c { style: RopeStyle::GptJ, dtype: DType::F32, width: RopeWidth::Vector, mrope: true, source: TableSource::Computed } [GptJ, Vec16<F32>, Vec16<F32>, Computed, StreamRows, { heads_per_thread(true, false, 4, true) as usize }];
        rope_gptj_f16_v_m { style: RopeStyle::GptJ, dtype: DType::F16, width: RopeWidth::Vector, mrope: true, source: TableSource::Table } [GptJ, Vec16<F16>, Vec16<F16>, LibTable, StreamRows, { heads_per_thread(true, false, 2, false) as usize }];
        rope_gptj_f16_v_m_c { style: RopeStyle::GptJ, dtype: DType::F16, width: RopeWidth::Vector, mrope: true, source: TableSource::Computed } [GptJ, Vec16<F16>, Vec16<F16>, Computed, StreamRows, { heads_per_thread(true, false, 2, true) as usize }];
        rope_gptj_bf16_v_m { style: RopeStyle::GptJ, dtype: DType::BF16, width: RopeWidth::Vector, mrope: true, source: TableSource::Table } [GptJ, Vec16<Bf16>, Vec16<Bf16>, LibTable, StreamRows, { heads_per_thread(true, false, 2, false) as usize }];
        rope_gptj_bf16_v_m_c { style: RopeStyle::GptJ, dtype: DType::BF16, width: RopeWidth::Vector, mrope: true, source: TableSource::Computed } [GptJ, Vec16<Bf16>, Vec16<Bf16>, Computed, StreamRows, { heads_per_thread(true, false, 2, true) as usize }];
    }
    KvKey(KvParams) => kv_append {
        kv_neox_f32_s { style: RopeStyle::NeoX, dtype: DType::F32, width: KvWidth::Scalar, tables: TableSource::Table, mrope: false } [NeoX, One<F32>, One<F32>, LibTable, OneRow, 1, true];
        kv_neox_f32_s_c { style: RopeStyle::NeoX, dtype: DType::F32, width: KvWidth::Scalar, tables: TableSource::Computed, mrope: false } [NeoX, One<F32>, One<F32>, Computed, OneRow, 1, true];
        kv_neox_f32_v { style: RopeStyle::NeoX, dtype: DType::F32, width: KvWidth::Vector, tables: TableSource::Table, mrope: false } [NeoX, Vec16<F32>, Vec16<F32>, LibTable, OneRow, { kv_heads_per_thread(true, false, 4) as usize }, false];
        kv_neox_f32_v_c { style: RopeStyle::NeoX, dtype: DType::F32, width: KvWidth::Vector, tables: TableSource::Computed, mrope: false } [NeoX, Vec16<F32>, Vec16<F32>, Computed, OneRow, { kv_heads_per_thread(true, false, 4) as usize }, false];
        kv_neox_f32_d { style: RopeStyle::NeoX, dtype: DType::F32, width: KvWidth::Decode, tables: TableSource::Table, mrope: false } [NeoX, Vec8<F32>, Vec8<F32>, LibTable, OneRow, 1, true];
        kv_neox_f32_d_c { style: RopeStyle::NeoX, dtype: DType::F32, width: KvWidth::Decode, tables: TableSource::Computed, mrope: false } [NeoX, Vec8<F32>, Vec8<F32>, Computed, OneRow, 1, true];
        kv_neox_f32_p { style: RopeStyle::NeoX, dtype: DType::F32, width: KvWidth::Prefill, tables: TableSource::Table, mrope: false } [NeoX, Vec16<F32>, Vec16<F32>, LibTable, OneRow, 1, false];
        kv_neox_f32_p_c { style: RopeStyle::NeoX, dtype: DType::F32, width: KvWidth::Prefill, tables: TableSource::Computed, mrope: false } [NeoX, Vec16<F32>, Vec16<F32>, Computed, OneRow, 1, false];
        kv_neox_f16_s { style: RopeStyle::NeoX, dtype: DType::F16, width: KvWidth::Scalar, tables: TableSource::Table, mrope: false } [NeoX, One<F16>, One<F16>, LibTable, OneRow, 1, true];
        kv_neox_f16_s_c { style: RopeStyle::NeoX, dtype: DType::F16, width: KvWidth::Scalar, tables: TableSource::Computed, mrope: false } [NeoX, One<F16>, One<F16>, Computed, OneRow, 1, true];
        kv_neox_f16_v { style: RopeStyle::NeoX, dtype: DType::F16, width: KvWidth::Vector, tables: TableSource::Table, mrope: false } [NeoX, Vec16<F16>, Vec16<F16>, LibTable, OneRow, { kv_heads_per_thread(true, false, 2) as usize }, false];
        kv_neox_f16_v_c { style: RopeStyle::NeoX, dtype: DType::F16, width: KvWidth::Vector, tables: TableSource::Computed, mrope: false } [NeoX, Vec16<F16>, Vec16<F16>, Computed, OneRow, { kv_heads_per_thread(true, false, 2) as usize }, false];
        kv_neox_f16_d { style: RopeStyle::NeoX, dtype: DType::F16, width: KvWidth::Decode, tables: TableSource::Table, mrope: false } [NeoX, Vec8<F16>, Vec8<F16>, LibTable, OneRow, 1, true];
        kv_neox_f16_d_c { style: RopeStyle::NeoX, dtype: DType::F16, width: KvWidth::Decode, tables: TableSource::Computed, mrope: false } [NeoX, Vec8<F16>, Vec8<F16>, Computed, OneRow, 1, true];
        kv_neox_f16_p { style: RopeStyle::NeoX, dtype: DType::F16, width: KvWidth::Prefill, tables: TableSource::Table, mrope: false } [NeoX, Vec16<F16>, Vec16<F16>, LibTable, OneRow, 1, false];
        kv_neox_f16_p_c { style: RopeStyle::NeoX, dtype: DType::F16, width: KvWidth::Prefill, tables: TableSource::Computed, mrope: false } [NeoX, Vec16<F16>, Vec16<F16>, Computed, OneRow, 1, false];
        kv_neox_bf16_s { style: RopeStyle::NeoX, dtype: DType::BF16, width: KvWidth::Scalar, tables: TableSource::Table, mrope: false } [NeoX, One<Bf16>, One<Bf16>, LibTable, OneRow, 1, true];
        kv_neox_bf16_s_c { style: RopeStyle::NeoX, dtype: DType::BF16, width: KvWidth::Scalar, tables: TableSource::Computed, mrope: false } [NeoX, One<Bf16>, One<Bf16>, Computed, OneRow, 1, true];
        kv_neox_bf16_v { style: RopeStyle::NeoX, dtype: DType::BF16, width: KvWidth::Vector, tables: TableSource::Table, mrope: false } [NeoX, Vec16<Bf16>, Vec16<Bf16>, LibTable, OneRow, { kv_heads_per_thread(true, false, 2) as usize }, false];
        kv_neox_bf16_v_c { style: RopeStyle::NeoX, dtype: DType::BF16, width: KvWidth::Vector, tables: TableSource::Computed, mrope: false } [NeoX, Vec16<Bf16>, Vec16<Bf16>, Computed, OneRow, { kv_heads_per_thread(true, false, 2) as usize }, false];
        kv_neox_bf16_d { style: RopeStyle::NeoX, dtype: DType::BF16, width: KvWidth::Decode, tables: TableSource::Table, mrope: false } [NeoX, Vec8<Bf16>, Vec8<Bf16>, LibTable, OneRow, 1, true];
        kv_neox_bf16_d_c { style: RopeStyle::NeoX, dtype: DType::BF16, width: KvWidth::Decode, tables: TableSource::Computed, mrope: false } [NeoX, Vec8<Bf16>, Vec8<Bf16>, Computed, OneRow, 1, true];
        kv_neox_bf16_p { style: RopeStyle::NeoX, dtype: DType::BF16, width: KvWidth::Prefill, tables: TableSource::Table, mrope: false } [NeoX, Vec16<Bf16>, Vec16<Bf16>, LibTable, OneRow, 1, false];
        kv_neox_bf16_p_c { style: RopeStyle::NeoX, dtype: DType::BF16, width: KvWidth::Prefill, tables: TableSource::Computed, mrope: false } [NeoX, Vec16<Bf16>, Vec16<Bf16>, Computed, OneRow, 1, false];
        kv_gptj_f32_s { style: RopeStyle::GptJ, dtype: DType::F32, width: KvWidth::Scalar, tables: TableSource::Table, mrope: false } [GptJ, Two<F32>, One<F32>, LibTable, OneRow, 1, true];
        kv_gptj_f32_s_c { style: RopeStyle::GptJ, dtype: DType::F32, width: KvWidth::Scalar, tables: TableSource::Computed, mrope: false } [GptJ, Two<F32>, One<F32>, Computed, OneRow, 1, true];
        kv_gptj_f32_v { style: RopeStyle::GptJ, dtype: DType::F32, width: KvWidth::Vector, tables: TableSource::Table, mrope: false } [GptJ, Vec16<F32>, Vec16<F32>, LibTable, OneRow, { kv_heads_per_thread(true, true, 4) as usize }, false];
        kv_gptj_f32_v_c { style: RopeStyle::GptJ, dtype: DType::F32, width: KvWidth::Vector, tables: TableSource::Computed, mrope: false } [GptJ, Vec16<F32>, Vec16<F32>, Computed, OneRow, { kv_heads_per_thread(true, true, 4) as usize }, false];
        kv_gptj_f32_d { style: RopeStyle::GptJ, dtype: DType::F32, width: KvWidth::Decode, tables: TableSource::Table, mrope: false } [GptJ, Vec8<F32>, Vec8<F32>, LibTable, OneRow, 1, true];
        kv_gptj_f32_d_c { style: RopeStyle::GptJ, dtype: DType::F32, width: KvWidth::Decode, tables: TableSource::Computed, mrope: false } [GptJ, Vec8<F32>, Vec8<F32>, Computed, OneRow, 1, true];
        kv_gptj_f32_p { style: RopeStyle::GptJ, dtype: DType::F32, width: KvWidth::Prefill, tables: TableSource::Table, mrope: false } [GptJ, Vec16<F32>, Vec16<F32>, LibTable, OneRow, 1, false];
        kv_gptj_f32_p_c { style: RopeStyle::GptJ, dtype: DType::F32, width: KvWidth::Prefill, tables: TableSource::Computed, mrope: false } [GptJ, Vec16<F32>, Vec16<F32>, Computed, OneRow, 1, false];
        kv_gptj_f16_s { style: RopeStyle::GptJ, dtype: DType::F16, width: KvWidth::Scalar, tables: TableSource::Table, mrope: false } [GptJ, Two<F16>, One<F16>, LibTable, OneRow, 1, true];
        kv_gptj_f16_s_c { style: RopeStyle::GptJ, dtype: DType::F16, width: KvWidth::Scalar, tables: TableSource::Computed, mrope: false } [GptJ, Two<F16>, One<F16>, Computed, OneRow, 1, true];
        kv_gptj_f16_v { style: RopeStyle::GptJ, dtype: DType::F16, width: KvWidth::Vector, tables: TableSource::Table, mrope: false } [GptJ, Vec16<F16>, Vec16<F16>, LibTable, OneRow, { kv_heads_per_thread(true, true, 2) as usize }, false];
        kv_gptj_f16_v_c { style: RopeStyle::GptJ, dtype: DType::F16, width: KvWidth::Vector, tables: TableSource::Computed, mrope: false } [GptJ, Vec16<F16>, Vec16<F16>, Computed, OneRow, { kv_heads_per_thread(true, true, 2) as usize }, false];
        kv_gptj_f16_d { style: RopeStyle::GptJ, dtype: DType::F16, width: KvWidth::Decode, tables: TableSource::Table, mrope: false } [GptJ, Vec8<F16>, Vec8<F16>, LibTable, OneRow, 1, true];
        kv_gptj_f16_d_c { style: RopeStyle::GptJ, dtype: DType::F16, width: KvWidth::Decode, tables: TableSource::Computed, mrope: false } [GptJ, Vec8<F16>, Vec8<F16>, Computed, OneRow, 1, true];
        kv_gptj_f16_p { style: RopeStyle::GptJ, dtype: DType::F16, width: KvWidth::Prefill, tables: TableSource::Table, mrope: false } [GptJ, Vec16<F16>, Vec16<F16>, LibTable, OneRow, 1, false];
        kv_gptj_f16_p_c { style: RopeStyle::GptJ, dtype: DType::F16, width: KvWidth::Prefill, tables: TableSource::Computed, mrope: false } [GptJ, Vec16<F16>, Vec16<F16>, Computed, OneRow, 1, false];
        kv_gptj_bf16_s { style: RopeStyle::GptJ, dtype: DType::BF16, width: KvWidth::Scalar, tables: TableSource::Table, mrope: false } [GptJ, Two<Bf16>, One<Bf16>, LibTable, OneRow, 1, true];
        kv_gptj_bf16_s_c { style: RopeStyle::GptJ, dtype: DType::BF16, width: KvWidth::Scalar, tables: TableSource::Computed, mrope: false } [GptJ, Two<Bf16>, One<Bf16>, Computed, OneRow, 1, true];
        kv_gptj_bf16_v { style: RopeStyle::GptJ, dtype: DType::BF16, width: KvWidth::Vector, tables: TableSource::Table, mrope: false } [GptJ, Vec16<Bf16>, Vec16<Bf16>, LibTable, OneRow, { kv_heads_per_thread(true, true, 2) as usize }, false];
        kv_gptj_bf16_v_c { style: RopeStyle::GptJ, dtype: DType::BF16, width: KvWidth::Vector, tables: TableSource::Computed, mrope: false } [GptJ, Vec16<Bf16>, Vec16<Bf16>, Computed, OneRow, { kv_heads_per_thread(true, true, 2) as usize }, false];
        kv_gptj_bf16_d { style: RopeStyle::GptJ, dtype: DType::BF16, width: KvWidth::Decode, tables: TableSource::Table, mrope: false } [GptJ, Vec8<Bf16>, Vec8<Bf16>, LibTable, OneRow, 1, true];
        kv_gptj_bf16_d_c { style: RopeStyle::GptJ, dtype: DType::BF16, width: KvWidth::Decode, tables: TableSource::Computed, mrope: false } [GptJ, Vec8<Bf16>, Vec8<Bf16>, Computed, OneRow, 1, true];
        kv_gptj_bf16_p { style: RopeStyle::GptJ, dtype: DType::BF16, width: KvWidth::Prefill, tables: TableSource::Table, mrope: false } [GptJ, Vec16<Bf16>, Vec16<Bf16>, LibTable, OneRow, 1, false];
        kv_gptj_bf16_p_c { style: RopeStyle::GptJ, dtype: DType::BF16, width: KvWidth::Prefill, tables: TableSource::Computed, mrope: false } [GptJ, Vec16<Bf16>, Vec16<Bf16>, Computed, OneRow, 1, false];
        kv_gptj_f16_s_t { style: RopeStyle::GptJ, dtype: DType::F16, width: KvWidth::Scalar, tables: TableSource::Caller, mrope: false } [GptJ, Two<F16>, One<F16>, ElemTable<F16>, OneRow, 1, true];
        kv_gptj_f16_v_t { style: RopeStyle::GptJ, dtype: DType::F16, width: KvWidth::Vector, tables: TableSource::Caller, mrope: false } [GptJ, Vec16<F16>, Vec16<F16>, ElemTable<F16>, OneRow, { kv_heads_per_thread(true, true, 2) as usize }, false];
        kv_gptj_f16_d_t { style: RopeStyle::GptJ, dtype: DType::F16, width: KvWidth::Decode, tables: TableSource::Caller, mrope: false } [GptJ, Vec8<F16>, Vec8<F16>, ElemTable<F16>, OneRow, 1, true];
        kv_gptj_bf16_s_t { style: RopeStyle::GptJ, dtype: DType::BF16, width: KvWidth::Scalar, tables: TableSource::Caller, mrope: false } [GptJ, Two<Bf16>, One<Bf16>, ElemTable<Bf16>, OneRow, 1, true];
        kv_gptj_bf16_v_t { style: RopeStyle::GptJ, dtype: DType::BF16, width: KvWidth::Vector, tables: TableSource::Caller, mrope: false } [GptJ, Vec16<Bf16>, Vec16<Bf16>, ElemTable<Bf16>, OneRow, { kv_heads_per_thread(true, true, 2) as usize }, false];
        kv_gptj_bf16_d_t { style: RopeStyle::GptJ, dtype: DType::BF16, width: KvWidth::Decode, tables: TableSource::Caller, mrope: false } [GptJ, Vec8<Bf16>, Vec8<Bf16>, ElemTable<Bf16>, OneRow, 1, true];
        kv_gptj_f32_s_t { style: RopeStyle::GptJ, dtype: DType::F32, width: KvWidth::Scalar, tables: TableSource::Caller, mrope: false } [GptJ, Two<F32>, One<F32>, F32Table, OneRow, 1, true];
        kv_gptj_f32_v_t { style: RopeStyle::GptJ, dtype: DType::F32, width: KvWidth::Vector, tables: TableSource::Caller, mrope: false } [GptJ, Vec16<F32>, Vec16<F32>, F32Table, OneRow, { kv_heads_per_thread(true, true, 4) as usize }, false];
        kv_gptj_f32_d_t { style: RopeStyle::GptJ, dtype: DType::F32, width: KvWidth::Decode, tables: TableSource::Caller, mrope: false } [GptJ, Vec8<F32>, Vec8<F32>, F32Table, OneRow, 1, true];
        kv_neox_f32_s_m { style: RopeStyle::NeoX, dtype: DType::F32, width: KvWidth::Scalar, tables: TableSource::Table, mrope: true } [NeoX, One<F32>, One<F32>, LibTable, StreamRows, 1, true];
        kv_neox_f32_s_m_c { style: RopeStyle::NeoX, dtype: DType::F32, width: KvWidth::Scalar, tables: TableSource::Computed, mrope: true } [NeoX, One<F32>, One<F32>, Computed, StreamRows, 1, true];
        kv_neox_f32_d_m { style: RopeStyle::NeoX, dtype: DType::F32, width: KvWidth::Decode, tables: TableSource::Table, mrope: true } [NeoX, Vec8<F32>, Vec8<F32>, LibTable, StreamRows, 1, true];
        kv_neox_f32_d_m_c { style: RopeStyle::NeoX, dtype: DType::F32, width: KvWidth::Decode, tables: TableSource::Computed, mrope: true } [NeoX, Vec8<F32>, Vec8<F32>, Computed, StreamRows, 1, true];
        kv_neox_f32_p_m { style: RopeStyle::NeoX, dtype: DType::F32, width: KvWidth::Prefill, tables: TableSource::Table, mrope: true } [NeoX, Vec16<F32>, Vec16<F32>, LibTable, StreamRows, 1, false];
        kv_neox_f32_p_m_c { style: RopeStyle::NeoX, dtype: DType::F32, width: KvWidth::Prefill, tables: TableSource::Computed, mrope: true } [NeoX, Vec16<F32>, Vec16<F32>, Computed, StreamRows, 1, false];
        kv_neox_f16_s_m { style: RopeStyle::NeoX, dtype: DType::F16, width: KvWidth::Scalar, tables: TableSource::Table, mrope: true } [NeoX, One<F16>, One<F16>, LibTable, StreamRows, 1, true];
        kv_neox_f16_s_m_c { style: RopeStyle::NeoX, dtype: DType::F16, width: KvWidth::Scalar, tables: TableSource::Computed, mrope: true } [NeoX, One<F16>, One<F16>, Computed, StreamRows, 1, true];
        kv_neox_f16_d_m { style: RopeStyle::NeoX, dtype: DType::F16, width: KvWidth::Decode, tables: TableSource::Table, mrope: true } [NeoX, Vec8<F16>, Vec8<F16>, LibTable, StreamRows, 1, true];
        kv_neox_f16_d_m_c { style: RopeStyle::NeoX, dtype: DType::F16, width: KvWidth::Decode, tables: TableSource::Computed, mrope: true } [NeoX, Vec8<F16>, Vec8<F16>, Computed, StreamRows, 1, true];
        kv_neox_f16_p_m { style: RopeStyle::NeoX, dtype: DType::F16, width: KvWidth::Prefill, tables: TableSource::Table, mrope: true } [NeoX, Vec16<F16>, Vec16<F16>, LibTable, StreamRows, 1, false];
        kv_neox_f16_p_m_c { style: RopeStyle::NeoX, dtype: DType::F16, width: KvWidth::Prefill, tables: TableSource::Computed, mrope: true } [NeoX, Vec16<F16>, Vec16<F16>, Computed, StreamRows, 1, false];
        kv_neox_bf16_s_m { style: RopeStyle::NeoX, dtype: DType::BF16, width: KvWidth::Scalar, tables: TableSource::Table, mrope: true } [NeoX, One<Bf16>, One<Bf16>, LibTable, StreamRows, 1, true];
        kv_neox_bf16_s_m_c { style: RopeStyle::NeoX, dtype: DType::BF16, width: KvWidth::Scalar, tables: TableSource::Computed, mrope: true } [NeoX, One<Bf16>, One<Bf16>, Computed, StreamRows, 1, true];
        kv_neox_bf16_d_m { style: RopeStyle::NeoX, dtype: DType::BF16, width: KvWidth::Decode, tables: TableSource::Table, mrope: true } [NeoX, Vec8<Bf16>, Vec8<Bf16>, LibTable, StreamRows, 1, true];
        kv_neox_bf16_d_m_c { style: RopeStyle::NeoX, dtype: DType::BF16, width: KvWidth::Decode, tables: TableSource::Computed, mrope: true } [NeoX, Vec8<Bf16>, Vec8<Bf16>, Computed, StreamRows, 1, true];
        kv_neox_bf16_p_m { style: RopeStyle::NeoX, dtype: DType::BF16, width: KvWidth::Prefill, tables: TableSource::Table, mrope: true } [NeoX, Vec16<Bf16>, Vec16<Bf16>, LibTable, StreamRows, 1, false];
        kv_neox_bf16_p_m_c { style: RopeStyle::NeoX, dtype: DType::BF16, width: KvWidth::Prefill, tables: TableSource::Computed, mrope: true } [NeoX, Vec16<Bf16>, Vec16<Bf16>, Computed, StreamRows, 1, false];
        kv_gptj_f32_s_m { style: RopeStyle::GptJ, dtype: DType::F32, width: KvWidth::Scalar, tables: TableSource::Table, mrope: true } [GptJ, Two<F32>, One<F32>, LibTable, StreamRows, 1, true];
        kv_gptj_f32_s_m_c { style: RopeStyle::GptJ, dtype: DType::F32, width: KvWidth::Scalar, tables: TableSource::Computed, mrope: true } [GptJ, Two<F32>, One<F32>, Computed, StreamRows, 1, true];
        kv_gptj_f32_d_m { style: RopeStyle::GptJ, dtype: DType::F32, width: KvWidth::Decode, tables: TableSource::Table, mrope: true } [GptJ, Vec8<F32>, Vec8<F32>, LibTable, StreamRows, 1, true];
        kv_gptj_f32_d_m_c { style: RopeStyle::GptJ, dtype: DType::F32, width: KvWidth::Decode, tables: TableSource::Computed, mrope: true } [GptJ, Vec8<F32>, Vec8<F32>, Computed, StreamRows, 1, true];
        kv_gptj_f32_p_m { style: RopeStyle::GptJ, dtype: DType::F32, width: KvWidth::Prefill, tables: TableSource::Table, mrope: true } [GptJ, Vec16<F32>, Vec16<F32>, LibTable, StreamRows, 1, false];
        kv_gptj_f32_p_m_c { style: RopeStyle::GptJ, dtype: DType::F32, width: KvWidth::Prefill, tables: TableSource::Computed, mrope: true } [GptJ, Vec16<F32>, Vec16<F32>, Computed, StreamRows, 1, false];
        kv_gptj_f16_s_m { style: RopeStyle::GptJ, dtype: DType::F16, width: KvWidth::Scalar, tables: TableSource::Table, mrope: true } [GptJ, Two<F16>, One<F16>, LibTable, StreamRows, 1, true];
        kv_gptj_f16_s_m_c { style: RopeStyle::GptJ, dtype: DType::F16, width: KvWidth::Scalar, tables: TableSource::Computed, mrope: true } [GptJ, Two<F16>, One<F16>, Computed, StreamRows, 1, true];
        kv_gptj_f16_d_m { style: RopeStyle::GptJ, dtype: DType::F16, width: KvWidth::Decode, tables: TableSource::Table, mrope: true } [GptJ, Vec8<F16>, Vec8<F16>, LibTable, StreamRows, 1, true];
        kv_gptj_f16_d_m_c { style: RopeStyle::GptJ, dtype: DType::F16, width: KvWidth::Decode, tables: TableSource::Computed, mrope: true } [GptJ, Vec8<F16>, Vec8<F16>, Computed, StreamRows, 1, true];
        kv_gptj_f16_p_m { style: RopeStyle::GptJ, dtype: DType::F16, width: KvWidth::Prefill, tables: TableSource::Table, mrope: true } [GptJ, Vec16<F16>, Vec16<F16>, LibTable, StreamRows, 1, false];
        kv_gptj_f16_p_m_c { style: RopeStyle::GptJ, dtype: DType::F16, width: KvWidth::Prefill, tables: TableSource::Computed, mrope: true } [GptJ, Vec16<F16>, Vec16<F16>, Computed, StreamRows, 1, false];
        kv_gptj_bf16_s_m { style: RopeStyle::GptJ, dtype: DType::BF16, width: KvWidth::Scalar, tables: TableSource::Table, mrope: true } [GptJ, Two<Bf16>, One<Bf16>, LibTable, StreamRows, 1, true];
        kv_gptj_bf16_s_m_c { style: RopeStyle::GptJ, dtype: DType::BF16, width: KvWidth::Scalar, tables: TableSource::Computed, mrope: true } [GptJ, Two<Bf16>, One<Bf16>, Computed, StreamRows, 1, true];
        kv_gptj_bf16_d_m { style: RopeStyle::GptJ, dtype: DType::BF16, width: KvWidth::Decode, tables: TableSource::Table, mrope: true } [GptJ, Vec8<Bf16>, Vec8<Bf16>, LibTable, StreamRows, 1, true];
        kv_gptj_bf16_d_m_c { style: RopeStyle::GptJ, dtype: DType::BF16, width: KvWidth::Decode, tables: TableSource::Computed, mrope: true } [GptJ, Vec8<Bf16>, Vec8<Bf16>, Computed, StreamRows, 1, true];
        kv_gptj_bf16_p_m { style: RopeStyle::GptJ, dtype: DType::BF16, width: KvWidth::Prefill, tables: TableSource::Table, mrope: true } [GptJ, Vec16<Bf16>, Vec16<Bf16>, LibTable, StreamRows, 1, false];
        kv_gptj_bf16_p_m_c { style: RopeStyle::GptJ, dtype: DType::BF16, width: KvWidth::Prefill, tables: TableSource::Computed, mrope: true } [GptJ, Vec16<Bf16>, Vec16<Bf16>, Computed, StreamRows, 1, false];
        kv_neox_f32_v_m { style: RopeStyle::NeoX, dtype: DType::F32, width: KvWidth::Vector, tables: TableSource::Table, mrope: true } [NeoX, Vec16<F32>, Vec16<F32>, LibTable, StreamRows, { kv_heads_per_thread(true, false, 4) as usize }, false];
        kv_neox_f32_v_m_c { style: RopeStyle::NeoX, dtype: DType::F32, width: KvWidth::Vector, tables: TableSource::Computed, mrope: true } [NeoX, Vec16<F32>, Vec16<F32>, Computed, StreamRows, { kv_heads_per_thread(true, false, 4) as usize }, false];
        kv_neox_f16_v_m { style: RopeStyle::NeoX, dtype: DType::F16, width: KvWidth::Vector, tables: TableSource::Table, mrope: true } [NeoX, Vec16<F16>, Vec16<F16>, LibTable, StreamRows, { kv_heads_per_thread(true, false, 2) as usize }, false];
        kv_neox_f16_v_m_c { style: RopeStyle::NeoX, dtype: DType::F16, width: KvWidth::Vector, tables: TableSource::Computed, mrope: true } [NeoX, Vec16<F16>, Vec16<F16>, Computed, StreamRows, { kv_heads_per_thread(true, false, 2) as usize }, false];
        kv_neox_bf16_v_m { style: RopeStyle::NeoX, dtype: DType::BF16, width: KvWidth::Vector, tables: TableSource::Table, mrope: true } [NeoX, Vec16<Bf16>, Vec16<Bf16>, LibTable, StreamRows, { kv_heads_per_thread(true, false, 2) as usize }, false];
        kv_neox_bf16_v_m_c { style: RopeStyle::NeoX, dtype: DType::BF16, width: KvWidth::Vector, tables: TableSource::Computed, mrope: true } [NeoX, Vec16<Bf16>, Vec16<Bf16>, Computed, StreamRows, { kv_heads_per_thread(true, false, 2) as usize }, false];
        kv_gptj_f32_v_m { style: RopeStyle::GptJ, dtype: DType::F32, width: KvWidth::Vector, tables: TableSource::Table, mrope: true } [GptJ, Vec16<F32>, Vec16<F32>, LibTable, StreamRows, { kv_heads_per_thread(true, true, 4) as usize }, false];
        kv_gptj_f32_v_m_c { style: RopeStyle::GptJ, dtype: DType::F32, width: KvWidth::Vector, tables: TableSource::Computed, mrope: true } [GptJ, Vec16<F32>, Vec16<F32>, Computed, StreamRows, { kv_heads_per_thread(true, true, 4) as usize }, false];
        kv_gptj_f16_v_m { style: RopeStyle::GptJ, dtype: DType::F16, width: KvWidth::Vector, tables: TableSource::Table, mrope: true } [GptJ, Vec16<F16>, Vec16<F16>, LibTable, StreamRows, { kv_heads_per_thread(true, true, 2) as usize }, false];
        kv_gptj_f16_v_m_c { style: RopeStyle::GptJ, dtype: DType::F16, width: KvWidth::Vector, tables: TableSource::Computed, mrope: true } [GptJ, Vec16<F16>, Vec16<F16>, Computed, StreamRows, { kv_heads_per_thread(true, true, 2) as usize }, false];
        kv_gptj_bf16_v_m { style: RopeStyle::GptJ, dtype: DType::BF16, width: KvWidth::Vector, tables: TableSource::Table, mrope: true } [GptJ, Vec16<Bf16>, Vec16<Bf16>, LibTable, StreamRows, { kv_heads_per_thread(true, true, 2) as usize }, false];
        kv_gptj_bf16_v_m_c { style: RopeStyle::GptJ, dtype: DType::BF16, width: KvWidth::Vector, tables: TableSource::Computed, mrope: true } [GptJ, Vec16<Bf16>, Vec16<Bf16>, Computed, StreamRows, { kv_heads_per_thread(true, true, 2) as usize }, false];
    }
    ClaimKey(KvParams) => claim {
        kv_claim {} [];
    }
    #[cfg(feature = "bench")]
    BenchEmpty(u64) => empty {
        bench_empty {} [];
    }
    #[cfg(feature = "bench")]
    BenchSpin(u64) => spin {
        bench_spin {} [];
    }
    #[cfg(feature = "bench")]
    BenchTouch(Touch) => touch {
        bench_touch {} [];
    }
}
