#!/usr/bin/env python3
"""Golden FP8 codes from PyTorch's own casts, for the kernels' conversion (issue 26).

Run on a CUDA machine (the casts run on the GPU, from float32 CUDA tensors):

    python3 tests/data/make_golden_fp8.py tests/data

Each input x is cast as an FP8 cache is filled in PyTorch:
`torch.clamp(x, -max, max).to(torch.float8_e4m3fn)` (max 448) and
`torch.clamp(x, -max, max).to(torch.float8_e5m2)` (max 57344), the codes read with
`.view(torch.uint8)`. On every non-NaN input that is what `cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32`
gives (round to nearest even, saturate to ± the largest finite). On a NaN the instruction
returns 0x7F whatever the sign and PyTorch keeps the sign (0xFF), so a NaN input's code is
compared as "a NaN encoding": E4M3 `(c & 0x7F) == 0x7F`, E5M2 `(c & 0x7C) == 0x7C` with
`c & 0x03` nonzero. tests/fp8_golden.rs compares the portable twin (`Fp8::from_f32`, on the
CPU) and every architecture's `Fp8::pack2` (on the GPU) with them, bit for bit.

Inputs:
- structured, stored in full with both codes: for both formats, every finite value and each
  midpoint between neighbouring values with the f32 one ulp either side of it, all with both
  signs (so ±0, every subnormal, every exponent, ties to even at every exponent); around the
  saturation point max, max + half the ulp of the top binade, max + that ulp, 2 max and
  f32::MAX, with both signs and their f32 neighbours; ±infinity; NaNs of both signs (quiet,
  signalling, with payloads); f32 subnormals and the smallest f32 normal. Duplicates dropped.
- random, not stored: 10^6 values from SplitMix64 (`rope_cuda::reference::splitmix64`) with
  the seed in the file, as tests/common's `fp8_random` makes them: for i in 0 .. 500000,
  r = splitmix64(seed ^ i) gives two values, the bits `r as u32` (uniform f32 bit patterns,
  NaNs included), then sign bit 63 of r, exponent `(r >> 40) % 40 - 22` (2^-22 .. 2^17:
  both formats' ranges and past them) and mantissa the low 23 bits of `r >> 32`. They are
  checked by digests: in blocks of `block` values, the 64-bit FNV-1a of the block's inputs
  (their f32 bits, little-endian) and of its E4M3 and of its E5M2 codes (one byte each), a
  NaN input's code counted as 0x7F when it is a NaN encoding (the script refuses PyTorch
  codes that are not). A wrong code shows as its block's digest.

File format `golden_fp8.bin`, little-endian:
    b"RPFP8GL1"
    u64 seed
    u32 len, u8 producer[len]          # UTF-8, e.g. "torch 2.5.1+cu124, NVIDIA H200"
    u32 n                              # structured inputs
    u32 x[n]                           # their f32 bits
    u8 e4m3[n], u8 e5m2[n]             # PyTorch's codes, as cast (NaN signs kept)
    u32 count, u32 block               # random inputs (10^6) and values per block (4096)
    ceil(count / block) x { u64 fnv_inputs, u64 fnv_e4m3, u64 fnv_e5m2 }

Without a GPU or PyTorch, `--inputs-only PATH` writes the inputs instead (u32 n, f32 x[n]
structured, u32 count, f32 x[count] random) and prints its SHA-256.
"""
import hashlib
import struct
import sys

import numpy as np

MAGIC = b"RPFP8GL1"
SEED = 26  # the number
COUNT = 1_000_000
BLOCK = 4096

# name, mantissa bits, bias, largest finite, PyTorch dtype name.
FORMATS = (("e4m3", 3, 7, 448.0, "float8_e4m3fn"), ("e5m2", 2, 15, 57344.0, "float8_e5m2"))


def splitmix64(z):
    """SplitMix64's finaliser on a numpy uint64 array, as rope_cuda::reference::splitmix64."""
    with np.errstate(over="ignore"):
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def fnv1a_blocks(data, block):
    """64-bit FNV-1a of each `block`-byte piece of the uint8 array `data` (the last may be shorter)."""
    n = len(data)
    nb = -(-n // block)
    rows = np.zeros(nb * block, dtype=np.uint8)
    rows[:n] = data
    rows = rows.reshape(nb, block).astype(np.uint64)
    lens = np.full(nb, block)
    lens[-1] = n - (nb - 1) * block
    h = np.full(nb, 0xCBF29CE484222325, dtype=np.uint64)
    prime = np.uint64(0x100000001B3)
    with np.errstate(over="ignore"):
        for j in range(block):
            h = np.where(j < lens, (h ^ rows[:, j]) * prime, h)
    return h


def f32(bits):
    return np.array(bits, dtype=np.uint32).view(np.float32)


def bits(x):
    return np.array(x, dtype=np.float32).view(np.uint32)


def values(m, bias):
    """The non-negative finite values of a format, ascending (codes 0x00 up, NaN/inf dropped)."""
    out = []
    for c in range(0x80):
        e, frac = c >> m, c & ((1 << m) - 1)
        if (m == 3 and c == 0x7F) or (m == 2 and e == 31):
            continue
        out.append(frac * 2.0 ** (1 - bias - m) if e == 0 else (1 + frac / 2**m) * 2.0 ** (e - bias))
    return out


def structured():
    """The structured inputs as f32 bits (uint32), in a fixed order, duplicates dropped."""
    xs = []

    def both_signs(vs):
        for v in np.asarray(vs, dtype=np.float32):
            xs.extend([int(bits(v)), int(bits(v)) | 0x8000_0000])

    for _, m, bias, fmax, _ in FORMATS:
        vals = values(m, bias)
        assert vals[-1] == fmax
        both_signs(vals)
        for lo, hi in zip(vals, vals[1:]):
            mid = np.float32((lo + hi) / 2)
            assert float(mid) == (lo + hi) / 2  # exact: both are short binary fractions
            b = int(bits(mid))
            both_signs(f32([b, b - 1, b + 1]))
        step = vals[-1] - vals[-2]  # the ulp of the top binade
        for v in np.asarray([fmax, fmax + step / 2, fmax + step, 2 * fmax, np.finfo(np.float32).max], np.float32):
            b = int(bits(v))
            both_signs(f32([b, b - 1, b + 1] if b < 0x7F7F_FFFF else [b, b - 1]))
    xs += [0x7F80_0000, 0xFF80_0000]  # ±infinity
    xs += [0x7FC0_0000, 0xFFC0_0000, 0x7F80_0001, 0xFF80_0001, 0x7FFF_FFFF, 0xFFFF_FFFF, 0x7FC0_1234, 0xFFA0_0001]
    both_signs(f32([0x0000_0001, 0x0000_0002, 0x0040_0000, 0x007F_FFFF, 0x0080_0000, 0x0080_0001]))
    seen, out = set(), []
    for b in xs:
        if b not in seen:
            seen.add(b)
            out.append(b)
    if len(out) % 2:
        out.append(int(bits(np.float32(1.0))) + 1)  # an even count: the GPU converts pairs
    return np.array(out, dtype=np.uint32)


def random_inputs(seed, count):
    """The random inputs as f32 bits (uint32), as tests/common's `fp8_random(seed, count / 2)`."""
    r = splitmix64(np.uint64(seed) ^ np.arange(count // 2, dtype=np.uint64))
    uniform = (r & np.uint64(0xFFFF_FFFF)).astype(np.uint32)
    e = (r >> np.uint64(40)) % np.uint64(40)  # exponent + 22
    spread = (
        ((e + np.uint64(127 - 22)) << np.uint64(23))
        | ((r >> np.uint64(32)) & np.uint64(0x7F_FFFF))
        | ((r >> np.uint64(63)) << np.uint64(31))
    ).astype(np.uint32)
    out = np.empty(count // 2 * 2, dtype=np.uint32)
    out[0::2], out[1::2] = uniform, spread
    return out


def is_nan_code(m, codes):
    if m == 3:
        return (codes & 0x7F) == 0x7F
    return ((codes & 0x7C) == 0x7C) & ((codes & 0x03) != 0)


def golden(seed, xs, rs, cast, producer):
    """The file's bytes: `cast(bits, format)` gives a format's codes (uint8) for f32 bits."""
    data = bytearray(MAGIC)
    data += struct.pack("<Q", seed)
    p = producer.encode()
    data += struct.pack("<I", len(p)) + p
    data += struct.pack("<I", len(xs)) + xs.astype("<u4").tobytes()
    for fmt in FORMATS:
        data += cast(xs, fmt).astype(np.uint8).tobytes()
    data += struct.pack("<II", len(rs), BLOCK)
    digests = [fnv1a_blocks(rs.astype("<u4").view(np.uint8), 4 * BLOCK)]
    nan = np.isnan(f32(rs))
    for fmt in FORMATS:
        codes = cast(rs, fmt).astype(np.uint8)
        named = is_nan_code(fmt[1], codes)
        bad = np.flatnonzero(nan & ~named)
        if len(bad):
            sys.exit(f"{fmt[0]}: NaN input {rs[bad[0]]:#010x} gave {codes[bad[0]]:#04x}, not a NaN encoding")
        digests.append(fnv1a_blocks(np.where(nan & named, np.uint8(0x7F), codes), BLOCK))
    data += np.stack(digests, axis=1).astype("<u8").tobytes()
    return bytes(data)


def torch_cast():
    """PyTorch's casts on the GPU, and the producer line."""
    import torch

    assert torch.cuda.is_available(), "the golden FP8 codes come from PyTorch's casts on a CUDA device"

    def cast(xbits, fmt):
        _, _, _, fmax, dtype = fmt
        x = torch.from_numpy(xbits.astype(np.uint32).view(np.int32)).to("cuda").view(torch.float32)
        y = torch.clamp(x, -fmax, fmax).to(getattr(torch, dtype))
        return y.view(torch.uint8).cpu().numpy()

    return cast, f"torch {torch.__version__}, {torch.cuda.get_device_name()}"


def main():
    xs, rs = structured(), random_inputs(SEED, COUNT)
    if sys.argv[1:2] == ["--inputs-only"]:
        path = sys.argv[2]
        with open(path, "wb") as f:
            f.write(struct.pack("<I", len(xs)) + xs.astype("<u4").tobytes())
            f.write(struct.pack("<I", len(rs)) + rs.astype("<u4").tobytes())
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        print(f"{path}: {len(xs)} structured and {len(rs)} random inputs (seed {SEED}), sha256 {digest}")
        return
    outdir = sys.argv[1] if len(sys.argv) > 1 else "tests/data"
    cast, producer = torch_cast()
    print(producer)
    data = golden(SEED, xs, rs, cast, producer)
    path = f"{outdir}/golden_fp8.bin"
    with open(path, "wb") as f:
        f.write(data)
    print(f"{path}: {len(xs)} structured inputs, {len(rs)} random (seed {SEED}), {len(data)} bytes")


if __name__ == "__main__":
    main()
