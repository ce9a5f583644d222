#!/usr/bin/env python3
"""Golden numbers for RoPE scaling, from transformers itself (run where transformers is):

    python3 tests/data/make_golden_scaling.py tests/data

For each model config in tests/data/configs (shaped like the released ones), transformers
reads the config.json (AutoConfig) and its own code computes inv_freq and the attention factor:
`ROPE_INIT_FUNCTIONS[rope_type]` for the scaled types, the model's default otherwise (GPT-J:
its `create_sinusoidal_positions`). cos and sin follow the models' rotary forward: in float32
on the CPU, `position * inv_freq` then cos/sin, times the attention factor. Stored as JSON
(each float32 written as the shortest decimal of its exact value, so it reads back exactly).

Dynamic NTK and LongRoPE depend on the sequence length: each has a case at the trained length
(seq_len null) and one beyond it.
"""
import json
import math
import os
import sys
import tempfile

import torch
import transformers
from transformers import AutoConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

POSITIONS = [0, 1, 4095, 4096, 32767, 131071]
CASES = [
    ("llama-3.1-8b", None),
    ("qwen2.5-7b", None),
    ("phi-3-mini-128k", None),
    ("phi-3-mini-128k", 131072),
    ("deepseek-v2-lite", None),
    ("qwen3-yarn", None),
    ("gpt-neox-20b", None),
    ("gpt-j-6b", None),
    ("llama-linear", None),
    ("llama-dynamic", None),
    ("llama-dynamic", 16384),
    ("proportional", None),
]


def load(path):
    with tempfile.TemporaryDirectory() as d:
        with open(path) as f, open(os.path.join(d, "config.json"), "w") as g:
            g.write(f.read())
        return AutoConfig.from_pretrained(d)


def default_params(cfg):
    rp = cfg.rope_parameters
    base = rp["rope_theta"]
    fraction = rp.get("partial_rotary_factor", 1.0)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dim = int(head_dim * fraction)
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))
    return inv_freq, 1.0


def params(name, cfg, seq_len):
    if cfg.model_type == "gptj":
        from transformers.models.gptj.modeling_gptj import create_sinusoidal_positions

        table = create_sinusoidal_positions(max(POSITIONS) + 1, cfg.rotary_dim)
        half = cfg.rotary_dim // 2
        sin, cos = table[:, :half], table[:, half:]
        inv_freq = 1.0 / (10000 ** (torch.arange(0, cfg.rotary_dim, 2, dtype=torch.int64) / cfg.rotary_dim))
        return inv_freq.float(), 1.0, cos[POSITIONS], sin[POSITIONS]
    rope_type = cfg.rope_parameters.get("rope_type", "default")
    if rope_type == "default":
        inv_freq, attention = default_params(cfg)
    else:
        inv_freq, attention = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu", seq_len=seq_len)
    inv_freq = inv_freq.float()
    pos = torch.tensor(POSITIONS, dtype=torch.int64)
    freqs = (inv_freq[None, :, None] @ pos[None, None, :].float()).transpose(1, 2)[0]
    return inv_freq, attention, freqs.cos() * attention, freqs.sin() * attention


def floats(t):
    return [float(x) for x in t.reshape(-1).tolist()]


def main(out_dir):
    here = os.path.dirname(os.path.abspath(__file__))
    cases = []
    for name, seq_len in CASES:
        cfg = load(os.path.join(here, "configs", name + ".json"))
        inv_freq, attention, cos, sin = params(name, cfg, seq_len)
        cases.append({
            "config": name + ".json",
            "seq_len": seq_len,
            "attention": float(attention),
            "inv_freq": floats(inv_freq),
            "cos": [floats(r) for r in cos.float()],
            "sin": [floats(r) for r in sin.float()],
        })
        print(f"{name} seq_len={seq_len}: {len(cases[-1]['inv_freq'])} pairs, attention {attention}")
    data = {"transformers": transformers.__version__, "torch": torch.__version__, "positions": POSITIONS, "cases": cases}
    path = os.path.join(out_dir, "golden_scaling.json")
    with open(path, "w") as f:
        json.dump(data, f, separators=(",", ":"))
        f.write("\n")
    print(f"{path}: {os.path.getsize(path)} bytes")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
