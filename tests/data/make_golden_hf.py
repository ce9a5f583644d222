#!/usr/bin/env python3
"""Golden vectors from transformers' own rotary code, run in float64 on a CUDA machine:

    python3 tests/data/make_golden_hf.py tests/data

- NeoX (rotate-half): `transformers.models.llama.modeling_llama.apply_rotary_pos_emb`,
  with partial rotary applied as GPT-NeoX does (rotate the first rotary_dim dims, keep the rest).
- GPT-J (interleaved): `transformers.models.gptj.modeling_gptj.apply_rotary_pos_emb`, on the
  first rotary_dim dims as GPTJAttention does.

The models build their cos/sin tables in float32; here they are built in float64 with the same
formula (inv_freq = 1 / base^(2i / rotary_dim), angle = position * inv_freq), so the golden
data is the exact math the library targets. Inputs are the seeded tensors of
`rope_cuda::reference::uniform(seed, 0, i)` over q in [B, S, H, D] order.

File format, little-endian:
    b"RPHF1\\0\\0\\0"
    u32 style (0 = NeoX, 1 = GPT-J), u32 head_dim, u32 rotary_dim, f64 base, u64 seed
    u32 batch, u32 seq, u32 heads
    i64 positions[batch * seq]
    f64 out[batch * seq * heads * head_dim]      # [B, S, H, D]
"""
import struct
import sys

import numpy as np
import torch
import transformers
from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb as gptj_apply
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_apply

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from make_golden import splitmix64, uniform  # noqa: E402


def case(path, style, head_dim, rotary_dim, base, seed, batch, seq, heads, max_pos, device):
    n = batch * seq * heads * head_dim
    x = torch.from_numpy(uniform(seed, 0, np.arange(n, dtype=np.uint64))).reshape(batch, seq, heads, head_dim)
    x = x.to(device)
    r = splitmix64(np.arange(batch * seq, dtype=np.uint64) ^ np.uint64(seed * 7919)) % np.uint64(max_pos)
    pos = r.astype(np.int64)
    pos[0], pos[-1] = 0, max_pos - 1
    p = torch.from_numpy(pos).to(device).reshape(batch, seq).double()
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=device) / rotary_dim))
    freqs = p[..., None] * inv_freq  # [B, S, rot/2]
    rot, keep = x[..., :rotary_dim], x[..., rotary_dim:]
    if style == 0:
        emb = torch.cat((freqs, freqs), dim=-1)  # [B, S, rot]
        q = rot.transpose(1, 2)  # [B, H, S, rot], as Llama's attention holds it
        q_rot, _ = llama_apply(q, q, emb.cos(), emb.sin())
        out = torch.cat((q_rot.transpose(1, 2), keep), dim=-1)
    else:
        out = torch.cat((gptj_apply(rot, freqs.sin(), freqs.cos()), keep), dim=-1)
    blob = bytearray(b"RPHF1\0\0\0")
    blob += struct.pack("<IIIdQ", style, head_dim, rotary_dim, base, seed)
    blob += struct.pack("<III", batch, seq, heads)
    blob += pos.astype("<i8").tobytes()
    blob += out.double().cpu().numpy().astype("<f8").tobytes()
    with open(path, "wb") as f:
        f.write(blob)
    print(f"{path}: {'neox' if style == 0 else 'gptj'} head_dim {head_dim} rotary_dim {rotary_dim}, {len(blob)} bytes")


def main():
    outdir = sys.argv[1] if len(sys.argv) > 1 else "tests/data"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"transformers {transformers.__version__}, torch {torch.__version__} on {device}")
    case(f"{outdir}/golden_hf_neox_128.bin", 0, 128, 128, 10000.0, 21, 2, 5, 3, 131072, device)
    case(f"{outdir}/golden_hf_neox_partial_96_24.bin", 0, 96, 24, 10000.0, 22, 2, 4, 3, 2048, device)
    case(f"{outdir}/golden_hf_gptj_partial_256_64.bin", 1, 256, 64, 10000.0, 23, 2, 4, 2, 2048, device)
    case(f"{outdir}/golden_hf_gptj_64.bin", 1, 64, 64, 1000000.0, 24, 1, 6, 2, 1 << 20, device)


if __name__ == "__main__":
    main()
