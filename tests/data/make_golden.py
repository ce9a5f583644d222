#!/usr/bin/env python3
"""Golden vectors for the seed RoPE operation, from the seed's own PyTorch formulation.

Run on a CUDA machine (float64 on the GPU; in float32 the seed's angles are off by up to
about 0.06 rad at position 2^20):

    python3 tests/data/make_golden.py tests/data

Inputs are not stored: both this script and the Rust tests generate them with the same
seeded SplitMix64 (`rope_cuda::reference::uniform`), on a 2^-23 grid in [-1, 1) so that they
are exact in f32. Each file holds selected output rows in float64, plus (where stated) three
float64 moments of the whole outputs: sum, sum of squares, and the sum weighted by a second
seeded tensor (so a misplaced row changes it).

File format, little-endian:
    b"RPGOLD1\\0"
    u32 dim, u32 max_seq_len, f64 base, u64 seed
    u32 q_shape[4], u32 k_shape[4]          # [B, H, N, D]
    u32 nrows
    nrows x { u32 tensor (0 = q, 1 = k), u32 b, u32 h, u32 n, f64 out[dim] }
    u32 has_moments
    if has_moments: for q then k: f64 sum, f64 sumsq, f64 weighted_sum (weights: tensor 2 + t)
"""
import struct
import sys

import numpy as np
import torch

M64 = (1 << 64) - 1


def splitmix64(z):
    """Vectorised SplitMix64 finaliser on a numpy uint64 array (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def uniform(seed, tensor, index):
    """Matches rope_cuda::reference::uniform for a numpy array of flat indices."""
    key0 = splitmix64(np.array([seed ^ (tensor << 32)], dtype=np.uint64))[0]
    with np.errstate(over="ignore"):
        key = key0 + index.astype(np.uint64)
    bits = splitmix64(key) >> np.uint64(40)
    return bits.astype(np.float64) * (1.0 / (1 << 23)) - 1.0


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class Model(torch.nn.Module):
    """The seed module, in float64."""

    def __init__(self, dim, max_seq_len, base, device):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim))
        t = torch.arange(max_seq_len, dtype=torch.float64, device=device)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos()
        self.sin = emb.sin()

    def forward(self, q, k):
        n = q.shape[2]
        cos = self.cos[:n][None, None]
        sin = self.sin[:n][None, None]
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def make_input(seed, tensor, shape, rows, device):
    """The seeded tensor; with `rows`, only those (b, h, n) rows are filled (others zero)."""
    b_, h_, n_, d = shape
    if rows is None:
        idx = np.arange(b_ * h_ * n_ * d, dtype=np.uint64)
        x = uniform(seed, tensor, idx).reshape(shape)
        return torch.from_numpy(x).to(device)
    x = torch.zeros(shape, dtype=torch.float64, device=device)
    for b, h, n in rows:
        start = ((b * h_ + h) * n_ + n) * d
        vals = uniform(seed, tensor, np.arange(start, start + d, dtype=np.uint64))
        x[b, h, n] = torch.from_numpy(vals).to(device)
    return x


def write_case(path, dim, max_seq_len, base, seed, q_shape, k_shape, rows_of, moments, device):
    """rows_of(tensor, shape) -> list of (b, h, n); None means every row."""
    model = Model(dim, max_seq_len, base, device)
    sparse = not moments
    q_rows, k_rows = rows_of(0, q_shape), rows_of(1, k_shape)
    q = make_input(seed, 0, q_shape, q_rows if sparse else None, device)
    k = make_input(seed, 1, k_shape, k_rows if sparse else None, device)
    q_out, k_out = model(q, k)
    out = bytearray(b"RPGOLD1\0")
    out += struct.pack("<IIdQ", dim, max_seq_len, base, seed)
    out += struct.pack("<4I", *q_shape) + struct.pack("<4I", *k_shape)
    rows = [(0, r) for r in q_rows] + [(1, r) for r in k_rows]
    out += struct.pack("<I", len(rows))
    for t, (b, h, n) in rows:
        vals = (q_out if t == 0 else k_out)[b, h, n].double().cpu().numpy()
        out += struct.pack("<4I", t, b, h, n) + vals.astype("<f8").tobytes()
    out += struct.pack("<I", 1 if moments else 0)
    if moments:
        for t, o in ((0, q_out), (1, k_out)):
            flat = o.reshape(-1)
            w = torch.from_numpy(uniform(seed, 2 + t, np.arange(flat.numel(), dtype=np.uint64))).to(device)
            out += struct.pack("<3d", flat.sum().item(), (flat * flat).sum().item(), (flat * w).sum().item())
    with open(path, "wb") as f:
        f.write(out)
    print(f"{path}: {len(rows)} rows, {len(out)} bytes, q {q_shape}, k {k_shape}, base {base}")


def all_rows(shape):
    b_, h_, n_, _ = shape
    return [(b, h, n) for b in range(b_) for h in range(h_) for n in range(n_)]


def main():
    outdir = sys.argv[1] if len(sys.argv) > 1 else "tests/data"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"torch {torch.__version__} on {device}"
          + (f" ({torch.cuda.get_device_name()})" if device == "cuda" else ""))
    # The seed shape: selected rows, moments over the whole outputs.
    seed_ns = [0, 1, 2, 63, 64, 128, 200, 255]
    write_case(f"{outdir}/golden_seed.bin", 64, 256, 10000.0, 1, [4, 8, 256, 64], [4, 8, 256, 64],
               lambda t, s: [(b, h, n) for b in range(s[0]) for h in range(s[1]) for n in seed_ns],
               True, device)
    # An odd shape, k with fewer heads: every row, and moments.
    write_case(f"{outdir}/golden_odd.bin", 80, 17, 10000.0, 2, [1, 3, 17, 80], [1, 2, 17, 80],
               lambda t, s: all_rows(s), True, device)
    # Large positions, up to 2^20: selected rows only (the rest of the inputs are zero).
    n = (1 << 20) + 2
    big_ns = [0, 1, 4095, 4096, 32767, 65535, 65536, 131071, 524287, (1 << 20) - 1, 1 << 20, (1 << 20) + 1]
    write_case(f"{outdir}/golden_large_pos.bin", 64, n, 10000.0, 3, [1, 2, n, 64], [1, 1, n, 64],
               lambda t, s: [(0, h, m) for h in range(s[1]) for m in big_ns], False, device)


if __name__ == "__main__":
    main()
