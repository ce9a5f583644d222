//! The slice of `cuda_std` these kernels need, on rustc's own NVPTX backend.
//!
//! `cuda_std` targets `rustc_codegen_nvvm`, which is not usable with a current toolchain
//! (see the README); `core::arch::nvptx` offers the special registers directly, and the
//! memory accesses below name the global state space explicitly: kernel arguments arrive
//! inside a params struct, so LLVM cannot prove pointers global and would emit generic
//! `ld`/`st`.

use core::arch::{asm, nvptx};

use crate::fp8::Fp8;
use crate::keys::DType;
use crate::math::Narrow;

/// `threadIdx.x`, `threadIdx.y`.
#[inline(always)]
pub fn thread_idx() -> (u32, u32) {
    // SAFETY: reading special registers has no preconditions.
    unsafe { (nvptx::_thread_idx_x() as u32, nvptx::_thread_idx_y() as u32) }
}

/// `blockIdx.x`, `blockIdx.y`.
#[inline(always)]
pub fn block_idx() -> (u32, u32) {
    // SAFETY: as above.
    unsafe { (nvptx::_block_idx_x() as u32, nvptx::_block_idx_y() as u32) }
}

/// `blockDim.x`, `blockDim.y`.
#[inline(always)]
pub fn block_dim() -> (u32, u32) {
    // SAFETY: as above.
    unsafe { (nvptx::_block_dim_x() as u32, nvptx::_block_dim_y() as u32) }
}

/// Up to 8 values in f32, the widest a lane handles; only the first `E` are meaningful.
pub type Lane = [f32; 8];

/// Up to 16 bytes of raw element bits.
pub type Bits = [u32; 4];

/// How a kernel moves `E` elements of one dtype between global memory and f32 registers.
pub trait Io {
    /// Elements per access.
    const E: usize;
    /// Whether an access is one vector instruction (8 or 16 bytes), not element by element.
    const VECTOR: bool;
    /// Bytes per element.
    const SIZE: usize;
    /// The element type's [`Elem::NARROW`].
    const NARROW: Option<Narrow>;
    /// The element type (FP8 accesses: [`DType::E4M3`], standing for either format).
    const DTYPE: DType;
    /// Whether the elements are FP8, of the format the launch gives each store: a value is
    /// divided by its head's scale before [`Io::put`] (see `rotate.rs`'s `Quant`). FP8
    /// accesses only store.
    const FP8: bool = false;
    /// Loads the bits of `E` elements at `p` (widen them with [`Io::get`] where used, so a
    /// prefetched row costs 4 registers, not `E` f32).
    ///
    /// # Safety
    /// `p` is a global address valid for `E` elements and aligned for the access.
    unsafe fn load_raw(p: *const u8) -> Bits;
    /// Element `i` of bits loaded by [`Io::load_raw`], widened to f32.
    fn get(raw: &Bits, i: usize) -> f32;
    /// Element `i`'s value: [`Io::get`]; FP8 elements (the KV shift's loads), the code's value
    /// in format `fmt` times `scale`, an f32 product.
    #[inline(always)]
    fn value(raw: &Bits, i: usize, fmt: Fp8, scale: f32) -> f32 {
        let _ = (fmt, scale);
        Self::get(raw, i)
    }
    /// Writes output element `i` (taken in order `0, 1, ..`) into `out`, rounded to the
    /// element type (to nearest, ties to even; FP8: to the format `fmt`, saturating, see
    /// [`Fp8`]; other types ignore `fmt`). 2-byte and FP8 elements are narrowed in pairs: an
    /// even element waits in `pending` for its odd neighbour, so a lane's results take `E / 2`
    /// registers or fewer as soon as they exist rather than `E` floats until the store.
    fn put(out: &mut Bits, pending: &mut f32, i: usize, v: f32, fmt: Fp8);
    /// Stores bits made by [`Io::put`] at `p`.
    ///
    /// # Safety
    /// As [`Io::load_raw`], for writes.
    unsafe fn store_raw(p: *mut u8, v: Bits);
}

/// `asm!` of a 16-byte access: its streaming form `$cs` (`.cs`: touched once, evicted first)
/// where the access type says so (`CS`, see [`Vec16`]), else `$plain`.
macro_rules! head_asm {
    ($cs:literal, $plain:literal, $($operands:tt)*) => {
        if CS {
            asm!($cs, $($operands)*)
        } else {
            asm!($plain, $($operands)*)
        }
    };
}

/// Loads 16 bytes.
///
/// # Safety
/// `p` is a global address valid for the access and aligned to its width.
#[inline(always)]
unsafe fn ld_v4<const CS: bool>(p: *const u8) -> Bits {
    // SAFETY: the caller's contract (see the function's `# Safety`).
    unsafe {
        let (a, b, c, d): (u32, u32, u32, u32);
        head_asm!(
            "ld.global.cs.v4.b32 {{{}, {}, {}, {}}}, [{}];",
            "ld.global.v4.b32 {{{}, {}, {}, {}}}, [{}];",
            out(reg32) a, out(reg32) b, out(reg32) c, out(reg32) d, in(reg64) p,
            options(readonly, nostack, preserves_flags),
        );
        [a, b, c, d]
    }
}

/// Asks the L2 cache for the line holding `p`: nothing waits on it and no register holds
/// the data; a later load of the line then finds it in L2.
///
/// # Safety
/// `p` is a global address valid for reads.
#[inline(always)]
pub unsafe fn prefetch_l2(p: *const u8) {
    // SAFETY: the caller's contract; a prefetch changes nothing the program can observe.
    unsafe { asm!("prefetch.global.L2 [{}];", in(reg64) p, options(nostack, preserves_flags)) }
}

/// Stores 16 bytes.
///
/// # Safety
/// `p` is a global address valid for the access and aligned to its width.
#[inline(always)]
unsafe fn st_v4<const CS: bool>(p: *mut u8, v: Bits) {
    // SAFETY: the caller's contract (see the function's `# Safety`).
    unsafe {
        head_asm!(
            "st.global.cs.v4.b32 [{}], {{{}, {}, {}, {}}};",
            "st.global.v4.b32 [{}], {{{}, {}, {}, {}}};",
            in(reg64) p, in(reg32) v[0], in(reg32) v[1], in(reg32) v[2], in(reg32) v[3],
            options(nostack, preserves_flags),
        );
    }
}

/// Loads 8 bytes (into the first two words).
///
/// # Safety
/// `p` is a global address valid for the access and aligned to its width.
#[inline(always)]
unsafe fn ld_v2(p: *const u8) -> Bits {
    // SAFETY: the caller's contract (see the function's `# Safety`).
    unsafe {
        let (a, b): (u32, u32);
        asm!(
            "ld.global.v2.b32 {{{}, {}}}, [{}];",
            out(reg32) a, out(reg32) b, in(reg64) p,
            options(readonly, nostack, preserves_flags),
        );
        [a, b, 0, 0]
    }
}

/// Stores the first two words (8 bytes).
///
/// # Safety
/// `p` is a global address valid for the access and aligned to its width.
#[inline(always)]
unsafe fn st_v2(p: *mut u8, v: Bits) {
    // SAFETY: the caller's contract (see the function's `# Safety`).
    unsafe {
        asm!(
            "st.global.v2.b32 [{}], {{{}, {}}};",
            in(reg64) p, in(reg32) v[0], in(reg32) v[1],
            options(nostack, preserves_flags),
        );
    }
}

/// Loads 4 bytes.
///
/// # Safety
/// `p` is a global address valid for the access and aligned to its width.
#[inline(always)]
unsafe fn ld_b32(p: *const u8) -> u32 {
    // SAFETY: the caller's contract (see the function's `# Safety`).
    unsafe {
        let v: u32;
        asm!("ld.global.b32 {}, [{}];", out(reg32) v, in(reg64) p, options(readonly, nostack, preserves_flags));
        v
    }
}

/// Stores 4 bytes.
///
/// # Safety
/// `p` is a global address valid for the access and aligned to its width.
#[inline(always)]
unsafe fn st_b32(p: *mut u8, v: u32) {
    // SAFETY: the caller's contract (see the function's `# Safety`).
    unsafe {
        asm!("st.global.b32 [{}], {};", in(reg64) p, in(reg32) v, options(nostack, preserves_flags));
    }
}

/// Loads 2 bytes.
///
/// # Safety
/// `p` is a global address valid for the access and aligned to its width.
#[inline(always)]
unsafe fn ld_b16(p: *const u8) -> u16 {
    // SAFETY: the caller's contract (see the function's `# Safety`).
    unsafe {
        let v: u16;
        asm!("ld.global.b16 {}, [{}];", out(reg16) v, in(reg64) p, options(readonly, nostack, preserves_flags));
        v
    }
}

/// Stores 2 bytes.
///
/// # Safety
/// `p` is a global address valid for the access and aligned to its width.
#[inline(always)]
unsafe fn st_b16(p: *mut u8, v: u16) {
    // SAFETY: the caller's contract (see the function's `# Safety`).
    unsafe {
        asm!("st.global.b16 [{}], {};", in(reg64) p, in(reg16) v, options(nostack, preserves_flags));
    }
}

/// Stores 1 byte.
///
/// # Safety
/// `p` is a global address valid for the access.
#[inline(always)]
unsafe fn st_b8(p: *mut u8, v: u32) {
    // SAFETY: the caller's contract (see the function's `# Safety`).
    unsafe {
        asm!("st.global.b8 [{}], {};", in(reg64) p, in(reg16) v as u16, options(nostack, preserves_flags));
    }
}

/// Loads 1 byte (a plain load: the kernel may write the byte after).
///
/// # Safety
/// `p` is a global address valid for the access.
#[inline(always)]
unsafe fn ld_b8(p: *const u8) -> u32 {
    let v: u16;
    // SAFETY: the caller's contract (see the function's `# Safety`).
    unsafe { asm!("ld.global.u8 {}, [{}];", out(reg16) v, in(reg64) p, options(readonly, nostack, preserves_flags)) };
    v as u32 & 0xFF
}

/// Loads 1 byte through the read-only cache.
///
/// # Safety
/// `p` is a global address valid for the access, not written during the kernel.
#[inline(always)]
pub unsafe fn load_u8_nc(p: *const u8) -> u8 {
    let v: u16;
    // SAFETY: the caller's contract (see the function's `# Safety`).
    unsafe {
        asm!("ld.global.nc.u8 {}, [{}];", out(reg16) v, in(reg64) p, options(readonly, nostack, preserves_flags))
    };
    v as u8
}

/// Element types: conversion between storage bits and f32.
pub trait Elem {
    /// The element type's key value.
    const DTYPE: DType;
    /// Bytes per element.
    const SIZE: usize;
    /// For narrow formats, when the fast rotation must be redone exactly.
    const NARROW: Option<Narrow>;
    /// Widens the element whose bits are `b` (in the low `8 * SIZE` bits).
    fn widen(b: u32) -> f32;
    /// Rounds `v` to the nearest element (ties to even) and returns its bits.
    fn narrow(v: f32) -> u32;
    /// For 2-byte elements: rounds `lo` and `hi` and packs them, `lo` in the low half.
    fn narrow2(lo: f32, hi: f32) -> u32 {
        Self::narrow(lo) | (Self::narrow(hi) << 16)
    }
}

/// f32.
pub struct F32;
/// IEEE binary16.
pub struct F16;
/// bfloat16.
pub struct Bf16;

impl Elem for F32 {
    const DTYPE: DType = DType::F32;
    const SIZE: usize = 4;
    const NARROW: Option<Narrow> = None;
    #[inline(always)]
    fn widen(b: u32) -> f32 {
        f32::from_bits(b)
    }
    #[inline(always)]
    fn narrow(v: f32) -> u32 {
        v.to_bits()
    }
}

impl Elem for F16 {
    const DTYPE: DType = DType::F16;
    const SIZE: usize = 2;
    const NARROW: Option<Narrow> = Some(Narrow::F16);
    #[inline(always)]
    fn widen(b: u32) -> f32 {
        f16::from_bits(b as u16) as f32 // cvt.f32.f16
    }
    #[inline(always)]
    fn narrow(v: f32) -> u32 {
        (v as f16).to_bits() as u32 // cvt.rn.f16.f32
    }
    #[inline(always)]
    fn narrow2(lo: f32, hi: f32) -> u32 {
        let d: u32;
        // SAFETY: a register-only conversion; the first source goes to the upper half.
        unsafe {
            asm!("cvt.rn.f16x2.f32 {}, {}, {};", out(reg32) d, in(reg32) hi, in(reg32) lo, options(pure, nomem, nostack))
        };
        d
    }
}

impl Elem for Bf16 {
    const DTYPE: DType = DType::BF16;
    const SIZE: usize = 2;
    const NARROW: Option<Narrow> = Some(Narrow::BF16);
    #[inline(always)]
    fn widen(b: u32) -> f32 {
        f32::from_bits(b << 16)
    }
    #[inline(always)]
    fn narrow(v: f32) -> u32 {
        let b: u16;
        // SAFETY: a register-only conversion (sm_80 and later).
        unsafe { asm!("cvt.rn.bf16.f32 {}, {};", out(reg16) b, in(reg32) v, options(pure, nomem, nostack)) };
        b as u32
    }
    #[inline(always)]
    fn narrow2(lo: f32, hi: f32) -> u32 {
        let d: u32;
        // SAFETY: a register-only conversion (sm_80 and later); the first source goes to the
        // upper half.
        unsafe {
            asm!("cvt.rn.bf16x2.f32 {}, {}, {};", out(reg32) d, in(reg32) hi, in(reg32) lo, options(pure, nomem, nostack))
        };
        d
    }
}

/// 16 bytes per access: 4 f32 or 8 16-bit elements; with `CS`, marked streaming (`.cs`, the KV
/// kernels' heads: [`crate::tuning::KV_STREAMING`]).
pub struct Vec16<T, const CS: bool = false>(core::marker::PhantomData<T>);
/// 8 bytes per access: half the work per thread of [`Vec16`], for latency-bound launches.
pub struct Vec8<T>(core::marker::PhantomData<T>);
/// One element per access.
pub struct One<T>(core::marker::PhantomData<T>);
/// Two elements (one interleaved pair) per access, element by element.
pub struct Two<T>(core::marker::PhantomData<T>);

impl<T: Elem, const CS: bool> Io for Vec16<T, CS> {
    const NARROW: Option<Narrow> = T::NARROW;
    const DTYPE: DType = T::DTYPE;
    const E: usize = 16 / T::SIZE;
    const VECTOR: bool = true;
    const SIZE: usize = T::SIZE;
    #[inline(always)]
    unsafe fn load_raw(p: *const u8) -> Bits {
        // SAFETY: the trait method's contract.
        unsafe { ld_v4::<CS>(p) }
    }
    #[inline(always)]
    fn get(w: &Bits, i: usize) -> f32 {
        if T::SIZE == 4 {
            T::widen(w[i])
        } else {
            T::widen((w[i / 2] >> (16 * (i % 2))) & 0xFFFF)
        }
    }
    #[inline(always)]
    fn put(out: &mut Bits, pending: &mut f32, i: usize, v: f32, _: Fp8) {
        put_elem::<T>(out, pending, i, v)
    }
    #[inline(always)]
    unsafe fn store_raw(p: *mut u8, v: Bits) {
        // SAFETY: the trait method's contract.
        unsafe {
            st_v4::<CS>(p, v);
        }
    }
}

impl<T: Elem> Io for Vec8<T> {
    const NARROW: Option<Narrow> = T::NARROW;
    const DTYPE: DType = T::DTYPE;
    const E: usize = 8 / T::SIZE;
    const VECTOR: bool = true;
    const SIZE: usize = T::SIZE;
    #[inline(always)]
    unsafe fn load_raw(p: *const u8) -> Bits {
        // SAFETY: the trait method's contract.
        unsafe { ld_v2(p) }
    }
    #[inline(always)]
    fn get(w: &Bits, i: usize) -> f32 {
        Vec16::<T>::get(w, i)
    }
    #[inline(always)]
    fn put(out: &mut Bits, pending: &mut f32, i: usize, v: f32, _: Fp8) {
        put_elem::<T>(out, pending, i, v)
    }
    #[inline(always)]
    unsafe fn store_raw(p: *mut u8, v: Bits) {
        // SAFETY: the trait method's contract.
        unsafe {
            st_v2(p, v);
        }
    }
}

/// [`Io::put`] for 16-byte vectors of `T`.
#[inline(always)]
fn put_elem<T: Elem>(out: &mut Bits, pending: &mut f32, i: usize, v: f32) {
    if T::SIZE == 4 {
        out[i] = T::narrow(v);
    } else if i % 2 == 0 {
        *pending = v;
    } else {
        out[i / 2] = T::narrow2(*pending, v);
    }
}

/// Loads the bits of one element of type `T` at `p`.
///
/// # Safety
/// `p` is a global address valid for the access and aligned to its width.
#[inline(always)]
unsafe fn ld_elem<T: Elem>(p: *const u8) -> u32 {
    // SAFETY: the caller's contract (see the function's `# Safety`).
    unsafe {
        if T::SIZE == 4 {
            ld_b32(p)
        } else {
            ld_b16(p) as u32
        }
    }
}

/// Stores the bits of one element of type `T`.
///
/// # Safety
/// `p` is a global address valid for the access and aligned to its width.
#[inline(always)]
unsafe fn st_elem<T: Elem>(p: *mut u8, b: u32) {
    // SAFETY: the caller's contract (see the function's `# Safety`).
    unsafe {
        if T::SIZE == 4 {
            st_b32(p, b)
        } else {
            st_b16(p, b as u16)
        }
    }
}

impl<T: Elem> Io for One<T> {
    const NARROW: Option<Narrow> = T::NARROW;
    const DTYPE: DType = T::DTYPE;
    const E: usize = 1;
    const VECTOR: bool = false;
    const SIZE: usize = T::SIZE;
    #[inline(always)]
    unsafe fn load_raw(p: *const u8) -> Bits {
        // SAFETY: the trait method's contract.
        unsafe { [ld_elem::<T>(p), 0, 0, 0] }
    }
    #[inline(always)]
    fn get(w: &Bits, i: usize) -> f32 {
        T::widen(w[i])
    }
    #[inline(always)]
    fn put(out: &mut Bits, _: &mut f32, _: usize, v: f32, _: Fp8) {
        out[0] = T::narrow(v);
    }
    #[inline(always)]
    unsafe fn store_raw(p: *mut u8, v: Bits) {
        // SAFETY: the trait method's contract.
        unsafe {
            st_elem::<T>(p, v[0]);
        }
    }
}

impl<T: Elem> Io for Two<T> {
    const NARROW: Option<Narrow> = T::NARROW;
    const DTYPE: DType = T::DTYPE;
    const E: usize = 2;
    const VECTOR: bool = false;
    const SIZE: usize = T::SIZE;
    #[inline(always)]
    unsafe fn load_raw(p: *const u8) -> Bits {
        // SAFETY: the trait method's contract.
        unsafe { [ld_elem::<T>(p), ld_elem::<T>(p.add(T::SIZE)), 0, 0] }
    }
    #[inline(always)]
    fn get(w: &Bits, i: usize) -> f32 {
        T::widen(w[i])
    }
    #[inline(always)]
    fn put(out: &mut Bits, _: &mut f32, i: usize, v: f32, _: Fp8) {
        out[i] = T::narrow(v);
    }
    #[inline(always)]
    unsafe fn store_raw(p: *mut u8, v: Bits) {
        // SAFETY: the trait method's contract.
        unsafe {
            st_elem::<T>(p, v[0]);
            st_elem::<T>(p.add(T::SIZE), v[1]);
        }
    }
}

/// FP8 elements, of the format the launch gives each access, `N` per access: in one
/// instruction (`VECTOR`, `N` of 2, 4 or 8) or byte by byte (`N` of 1 or 2: views not aligned
/// for vectors). Element `i` is byte `i % 4` of word `i / 4`. The appends only store them; the
/// KV shift loads them too, and reads their values with [`Io::value`] (their [`Io::get`] is
/// the code's value unscaled, in E4M3).
pub struct F8<const N: usize, const VECTOR: bool>;

/// [`Io::put`] for FP8 elements: pairs converted together ([`Fp8::pack2`]), element `i`
/// in byte `i % 4` of word `i / 4` (a word's first pair written alone, its second joined to
/// it, [`join16`]); an odd count's last element alone.
#[inline(always)]
fn put_fp8<const N: usize>(out: &mut Bits, pending: &mut f32, i: usize, v: f32, fmt: Fp8) {
    if N == 1 {
        out[0] = (fmt.pack2(0.0, v) & 0xFF) as u32;
    } else if i % 2 == 0 {
        *pending = v;
    } else if i % 4 == 1 {
        out[i / 4] = fmt.pack2(v, *pending) as u32;
    } else {
        out[i / 4] = join16(out[i / 4] as u16, fmt.pack2(v, *pending));
    }
}

/// `lo` in the low half of a word, `hi` in the high half: one `mov.b32 d, {lo, hi}` (which
/// the assembler folds into the conversions' merges, where an integer shift and or would
/// cost three instructions a word).
#[inline(always)]
fn join16(lo: u16, hi: u16) -> u32 {
    #[cfg(target_arch = "nvptx64")]
    {
        let w: u32;
        // SAFETY: a register-only move.
        unsafe {
            asm!(
                "mov.b32 {}, {{{}, {}}};",
                out(reg32) w, in(reg16) lo, in(reg16) hi,
                options(pure, nomem, nostack, preserves_flags),
            )
        };
        w
    }
    #[cfg(not(target_arch = "nvptx64"))]
    {
        lo as u32 | (hi as u32) << 16
    }
}

impl<const N: usize, const VECTOR: bool> Io for F8<N, VECTOR> {
    const NARROW: Option<Narrow> = None;
    const DTYPE: DType = DType::E4M3;
    const FP8: bool = true;
    const E: usize = N;
    const VECTOR: bool = VECTOR;
    const SIZE: usize = 1;
    #[inline(always)]
    unsafe fn load_raw(p: *const u8) -> Bits {
        const { assert!(if VECTOR { N == 2 || N == 4 || N == 8 } else { N == 1 || N == 2 }, "no such FP8 access") };
        // SAFETY: the trait method's contract.
        unsafe {
            match (VECTOR, N) {
                (true, 2) => [ld_b16(p) as u32, 0, 0, 0],
                (true, 4) => [ld_b32(p), 0, 0, 0],
                (true, _) => ld_v2(p),
                (false, 1) => [ld_b8(p), 0, 0, 0],
                (false, _) => [ld_b8(p) | ld_b8(p.add(1)) << 8, 0, 0, 0],
            }
        }
    }
    #[inline(always)]
    fn get(raw: &Bits, i: usize) -> f32 {
        Self::value(raw, i, Fp8::E4M3, 1.0)
    }
    #[inline(always)]
    fn value(raw: &Bits, i: usize, fmt: Fp8, scale: f32) -> f32 {
        // Codes `2k` and `2k + 1` decode together ([`Fp8::unpack2`]: the calls for a lane's
        // neighbours share one conversion).
        let (lo, hi) = fmt.unpack2((raw[i / 4] >> (16 * ((i / 2) % 2))) as u16);
        (if i % 2 == 0 { lo } else { hi }) * scale
    }
    #[inline(always)]
    fn put(out: &mut Bits, pending: &mut f32, i: usize, v: f32, fmt: Fp8) {
        put_fp8::<N>(out, pending, i, v, fmt)
    }
    #[inline(always)]
    unsafe fn store_raw(p: *mut u8, v: Bits) {
        const { assert!(if VECTOR { N == 2 || N == 4 || N == 8 } else { N == 1 || N == 2 }, "no such FP8 access") };
        // SAFETY: the trait method's contract.
        unsafe {
            match (VECTOR, N) {
                (true, 2) => st_b16(p, v[0] as u16),
                (true, 4) => st_b32(p, v[0]),
                (true, _) => st_v2(p, v),
                (false, _) => {
                    for i in 0..N {
                        st_b8(p.add(i), v[0] >> (8 * i));
                    }
                }
            }
        }
    }
}

/// Loads 16 read-only bytes as four words (a frequency's [`crate::math::Turns`] and pad).
///
/// # Safety
/// `p` is a global address of 16 bytes, 16-byte aligned, not written during the kernel.
#[inline(always)]
pub unsafe fn load_words_nc(p: *const u32) -> [u32; 4] {
    let (a, b, c, d): (u32, u32, u32, u32);
    // SAFETY: the caller's contract.
    unsafe {
        asm!(
            "ld.global.nc.v4.b32 {{{}, {}, {}, {}}}, [{}];",
            out(reg32) a, out(reg32) b, out(reg32) c, out(reg32) d, in(reg64) p,
            options(readonly, nostack, preserves_flags),
        )
    };
    [a, b, c, d]
}

/// Loads `n` (1, 2, 4 or 8) consecutive f32 of a read-only table at `p`, through the
/// non-coherent (read-only) cache, with accesses as wide as `n` allows.
///
/// # Safety
/// `p` is a global address valid for `n` f32, aligned to `4 * min(n, 4)` bytes, and not
/// written during the kernel.
#[inline(always)]
pub unsafe fn load_table(p: *const f32, n: usize) -> Lane {
    // SAFETY: the caller's contract (see the function's `# Safety`).
    unsafe {
        let mut v = [0.0f32; 8];
        match n {
            1 => {
                asm!("ld.global.nc.f32 {}, [{}];", out(reg32) v[0], in(reg64) p, options(readonly, nostack, preserves_flags))
            }
            2 => asm!(
                "ld.global.nc.v2.f32 {{{}, {}}}, [{}];",
                out(reg32) v[0], out(reg32) v[1], in(reg64) p,
                options(readonly, nostack, preserves_flags),
            ),
            _ => {
                for h in 0..n / 4 {
                    let (a, b, c, d): (f32, f32, f32, f32);
                    asm!(
                        "ld.global.nc.v4.f32 {{{}, {}, {}, {}}}, [{}];",
                        out(reg32) a, out(reg32) b, out(reg32) c, out(reg32) d, in(reg64) p.add(4 * h),
                        options(readonly, nostack, preserves_flags),
                    );
                    v[4 * h..4 * h + 4].copy_from_slice(&[a, b, c, d]);
                }
            }
        }
        v
    }
}

/// The shared-window address (32 bits) of a generic pointer into the block's shared memory:
/// one register instead of two for addresses kept across a kernel.
#[inline(always)]
#[expect(clippy::pointers_in_nomem_asm_block, reason = "an address conversion: nothing is read or written")]
pub fn shared_addr(p: *const f32) -> u32 {
    let a: u32;
    // SAFETY: register-only conversions.
    unsafe {
        asm!(
            "{{ .reg .u64 t; cvta.to.shared.u64 t, {p}; cvt.u32.u64 {a}, t; }}",
            p = in(reg64) p, a = out(reg32) a,
            options(pure, nomem, nostack, preserves_flags),
        )
    };
    a
}

/// Loads one f32 of shared memory at the shared-window address `a`, as a volatile access: the
/// compiler keeps it where the code puts it (on the rare path, whose loads would otherwise be
/// hoisted ahead of the branch and held in registers).
///
/// # Safety
/// `a` is a shared address valid for an f32, 4-byte aligned.
#[inline(always)]
pub unsafe fn load_shared32_volatile(a: u32) -> f32 {
    let v: f32;
    // SAFETY: the caller's contract.
    unsafe { asm!("ld.volatile.shared.f32 {}, [{}];", out(reg32) v, in(reg32) a, options(nostack, preserves_flags)) };
    v
}

/// Loads `n` (1, 2, 4 or 8) consecutive f32 of shared memory at the shared-window address `a`.
///
/// # Safety
/// `a` is a shared address valid for `n` f32, aligned to `4 * min(n, 4)` bytes.
#[inline(always)]
pub unsafe fn load_shared32(a: u32, n: usize) -> Lane {
    let mut v = [0.0f32; 8];
    // SAFETY: the caller's contract.
    unsafe {
        match n {
            1 => {
                asm!("ld.shared.f32 {}, [{}];", out(reg32) v[0], in(reg32) a, options(readonly, nostack, preserves_flags))
            }
            2 => asm!(
                "ld.shared.v2.f32 {{{}, {}}}, [{}];",
                out(reg32) v[0], out(reg32) v[1], in(reg32) a,
                options(readonly, nostack, preserves_flags),
            ),
            _ => {
                for h in 0..n / 4 {
                    let (x, y, z, w): (f32, f32, f32, f32);
                    asm!(
                        "ld.shared.v4.f32 {{{}, {}, {}, {}}}, [{}];",
                        out(reg32) x, out(reg32) y, out(reg32) z, out(reg32) w, in(reg32) a + 16 * h as u32,
                        options(readonly, nostack, preserves_flags),
                    );
                    v[4 * h..4 * h + 4].copy_from_slice(&[x, y, z, w]);
                }
            }
        }
    }
    v
}

/// Loads the bits of one read-only element of type `T` at `p` (read-only cache).
///
/// # Safety
/// `p` is a valid, aligned global address not written during the kernel.
#[inline(always)]
pub unsafe fn load_elem_nc<T: Elem>(p: *const u8) -> u32 {
    // SAFETY: the caller's contract (see the function's `# Safety`).
    unsafe {
        if T::SIZE == 4 {
            let v: u32;
            asm!("ld.global.nc.b32 {}, [{}];", out(reg32) v, in(reg64) p, options(readonly, nostack, preserves_flags));
            v
        } else {
            let v: u16;
            asm!("ld.global.nc.b16 {}, [{}];", out(reg16) v, in(reg64) p, options(readonly, nostack, preserves_flags));
            v as u32
        }
    }
}

#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    // SAFETY: `trap` aborts the kernel; nothing runs after it.
    unsafe { nvptx::trap() }
}

/// Calls `f(j)` for each `j` in `0..n` (`n <= 8`), unrolled: after inlining every `j` is a
/// constant, so the lane arrays `f` indexes stay in registers. (LLVM does not unroll the
/// larger loop bodies by itself, and one dynamic index puts a whole array in local memory.)
#[inline(always)]
pub(crate) fn unrolled(n: usize, mut f: impl FnMut(usize)) {
    if n > 0 {
        f(0)
    }
    if n > 1 {
        f(1)
    }
    if n > 2 {
        f(2)
    }
    if n > 3 {
        f(3)
    }
    if n > 4 {
        f(4)
    }
    if n > 5 {
        f(5)
    }
    if n > 6 {
        f(6)
    }
    if n > 7 {
        f(7)
    }
}
