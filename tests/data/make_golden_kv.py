#!/usr/bin/env python3
"""Golden vectors for the reference KV-cache update, from the seed's own PyTorch loop.

Run on a CUDA machine (float64 on the GPU):

    python3 tests/data/make_golden_kv.py tests/data

The operation (the second reference kernel): k_new and v_new [B, T, H, D], cos and sin
[S, D/2] supplied by the caller, positions int32 [B, T], caches [B, S, H, D]. k_new is rotated
in interleaved (GPT-J) pairs with cos/sin at positions[b, t] and written, with v_new, into
copies of the caches at that position, token by token (so a later token of a sequence wins a
duplicated position); the result is both caches stacked as [2, B, S, H, D].

Inputs are not stored: the script and the Rust tests generate them with the same seeded
SplitMix64 (`rope_cuda::reference::uniform`, exact in f32): tensor 0 is k_new, 1 v_new,
2 cache_k, 3 cache_v, 4 the weights of the moments. The tables are stored (as the f32 values
the kernel reads: the f32 nearest float64 cos/sin of position * inv_freq, base 10000), and the
reference works in float64 on exactly those values.

File format, little-endian:
    b"RPKVGLD1"
    u32 B, T, H, D, S; u64 seed
    i32 positions[B * T]
    f32 cos[S * D / 2], f32 sin[S * D / 2]
    for each (b, t) in order: f64 out_k[b, positions[b, t]][H * D]   (the final cache row)
    f64 sum, f64 sum of squares, f64 weighted sum of the whole stacked output
"""
import os
import struct
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_golden import uniform  # noqa: E402


def seeded(seed, tensor, shape, device):
    n = int(np.prod(shape))
    return torch.from_numpy(uniform(seed, tensor, np.arange(n, dtype=np.uint64)).reshape(shape)).to(device)


def update_kv_cache(k_new, v_new, cos, sin, cache_k, cache_v, positions):
    """The seed's loop, in float64."""
    B, T, H, D = k_new.shape
    cache_k = cache_k.clone()
    cache_v = cache_v.clone()
    for b in range(B):
        for t in range(T):
            p = int(positions[b, t])
            c, s = cos[p], sin[p]
            x = k_new[b, t]
            x0, x1 = x[..., 0::2], x[..., 1::2]
            cache_k[b, p] = torch.stack((x0 * c - x1 * s, x1 * c + x0 * s), dim=-1).flatten(-2)
            cache_v[b, p] = v_new[b, t]
    return torch.stack((cache_k, cache_v))


def write_case(path, B, T, H, D, S, seed, positions, device):
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64, device=device) / D))
    angles = torch.outer(torch.arange(S, dtype=torch.float64, device=device), inv_freq)
    cos = angles.cos().float().double()
    sin = angles.sin().float().double()
    k_new = seeded(seed, 0, (B, T, H, D), device)
    v_new = seeded(seed, 1, (B, T, H, D), device)
    cache_k = seeded(seed, 2, (B, S, H, D), device)
    cache_v = seeded(seed, 3, (B, S, H, D), device)
    pos = torch.tensor(positions, dtype=torch.int32).reshape(B, T)
    out = update_kv_cache(k_new, v_new, cos, sin, cache_k, cache_v, pos)
    data = bytearray(b"RPKVGLD1")
    data += struct.pack("<5IQ", B, T, H, D, S, seed)
    data += pos.numpy().astype("<i4").tobytes()
    data += cos.float().cpu().numpy().astype("<f4").tobytes()
    data += sin.float().cpu().numpy().astype("<f4").tobytes()
    for b in range(B):
        for t in range(T):
            data += out[0, b, int(pos[b, t])].reshape(-1).cpu().numpy().astype("<f8").tobytes()
    flat = out.reshape(-1)
    w = seeded(seed, 4, (flat.numel(),), device)
    data += struct.pack("<3d", flat.sum().item(), (flat * flat).sum().item(), (flat * w).sum().item())
    with open(path, "wb") as f:
        f.write(data)
    print(f"{path}: B={B} T={T} H={H} D={D} S={S}, {len(data)} bytes")


def main():
    outdir = sys.argv[1] if len(sys.argv) > 1 else "tests/data"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"torch {torch.__version__} on {device}"
          + (f" ({torch.cuda.get_device_name()})" if device == "cuda" else ""))
    # The seed shape and positions.
    B, T, H, D, S = 2, 16, 4, 32, 128
    write_case(f"{outdir}/golden_kv_seed.bin", B, T, H, D, S, 11,
               [(t + [7, 31][b]) % S for b in range(B) for t in range(T)], device)
    # A larger one: 6 heads, positions spread over the cache, with 0, S - 1 and a duplicate
    # (token 39 names token 5's position; the later one wins) in each sequence.
    B, T, H, D, S = 3, 40, 6, 64, 512
    pos = [[(b * 131 + t * 17) % S for t in range(T)] for b in range(B)]
    for b in range(B):
        pos[b][37], pos[b][38], pos[b][39] = 0, S - 1, pos[b][5]
    write_case(f"{outdir}/golden_kv_large.bin", B, T, H, D, S, 12, [p for row in pos for p in row], device)


if __name__ == "__main__":
    main()
