#!/usr/bin/env python3
"""Golden data for the QK-norm in the fused append, from transformers' own attention modules:

    python3 tests/data/make_golden_qknorm.py tests/data/qknorm

One tiny random model per family whose attention normalizes q and k: Qwen3 (RMSNorm of each
head with a weight, before the rotation), Gemma 3 (RMSNorm with 1 + w, before the rotation),
Llama 4 (a weightless RMS norm after the rotation, on its RoPE layers) and OLMo 2 (RMSNorm of
the whole q and k projections, across heads, before the rotation). Each is built with
`AutoConfig.for_model` in float32 with 2 or 4 layers and small sizes, its norm weights drawn at
random (Qwen3's and OLMo 2's around 1, Gemma 3's around 0), and q_proj's and k_proj's rows of
head 0 scaled by 2^-10 so that eps matters there (OLMo 2: all of layer 0's rows, since its
statistic is the whole projection's). One forward pass runs on random token ids at random
positions below 64 (transformers forms its angles in float32), and the pass records, per
attention layer, q and k as they enter the norm-and-rotation (Qwen3 and Gemma 3: the norm
modules' inputs; Llama 4: the rotary function's inputs) and as they leave it (the rotary
function's outputs; Llama 4: its norm module's outputs).

Written per model type `T`:
- `T.json`: the config (`config.to_json_string(use_diff=False)`);
- `T.bin`, little-endian:
      b"RPQKN1\\0\\0"
      u32 seq, i64 positions[seq], u32 records
      records x { u32 layer, u32 which (0: q, 1: k), u32 heads, u32 dim, u32 weighted,
                  f32 weight[dim] if weighted == 1, f32 weight[heads * dim] if weighted == 2,
                  f32 before[seq * heads * dim], f32 after[seq * heads * dim] }   # [seq, heads, dim]
"""
import json
import os
import struct
import sys

import torch
import transformers
from transformers import AutoConfig, AutoModel

SEQ = 7
TEXT = dict(
    vocab_size=128,
    hidden_size=128,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=512,
    pad_token_id=0,
    rms_norm_eps=1e-6,
)
MODELS = {
    "qwen3": dict(),
    "gemma3_text": dict(sliding_window=16),
    "llama4_text": dict(
        num_hidden_layers=4,
        use_qk_norm=True,
        intermediate_size_mlp=64,
        num_local_experts=2,
        interleave_moe_layer_step=1,
        rms_norm_eps=1e-5,
        no_rope_layers=[1, 1, 1, 0],
        attention_chunk_size=512,
    ),
    "olmo2": dict(),
}


def build(model_type, extra):
    config = AutoConfig.for_model(model_type, **{**TEXT, **extra})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = AutoModel.from_config(config, dtype=torch.float32).eval()
    return config, model


def attention_layers(model):
    return [(i, layer.self_attn) for i, layer in enumerate(model.layers)]


def main(out):
    os.makedirs(out, exist_ok=True)
    print("transformers", transformers.__version__)
    for model_type, extra in MODELS.items():
        config, model = build(model_type, extra)
        module = sys.modules[type(model).__module__]
        gen = torch.Generator().manual_seed(1)
        d = config.head_dim
        records = {}
        current = {}
        for i, attn in attention_layers(model):
            with torch.no_grad():
                for proj in (attn.q_proj, attn.k_proj):
                    if model_type == "olmo2":
                        if i == 0:
                            proj.weight *= 2.0**-10
                    else:
                        proj.weight[:d] *= 2.0**-10
                for name in ("q_norm", "k_norm"):
                    norm = getattr(attn, name, None)
                    if norm is not None and hasattr(norm, "weight"):
                        w = torch.rand(norm.weight.shape, generator=gen) - 0.5
                        norm.weight.copy_(w + 1.0 if model_type in ("qwen3", "olmo2") else w)
            attn.register_forward_pre_hook(lambda m, a, i=i: current.__setitem__("layer", i))
            for which, name in ((0, "q_norm"), (1, "k_norm")):
                norm = getattr(attn, name, None)
                if norm is not None:
                    def pre(m, args, i=i, which=which, norm=norm):
                        records[(i, which)] = dict(before=args[0].detach().clone(), weight=norm.weight.detach().clone())
                    norm.register_forward_pre_hook(pre)
            qk = getattr(attn, "qk_norm", None)
            if qk is not None:
                def post(m, args, output, i=i):
                    # One module, called on q, then on k.
                    for w in (0, 1):
                        r = records.get((i, w))
                        if r is not None and "after" not in r:
                            r["after"] = output.detach().clone()
                            return
                qk.register_forward_hook(post)

        names = [n for n in ("apply_rotary_pos_emb", "apply_rotary_emb") if hasattr(module, n)]
        original = {n: getattr(module, n) for n in names}

        def wrap(name):
            fn = original[name]

            def wrapped(q, k, *args, **kwargs):
                out_q, out_k = fn(q, k, *args, **kwargs)
                i = current["layer"]
                if model_type == "llama4_text":
                    # Before the rotation ([B, T, H, D]); the norm's outputs come after.
                    records[(i, 0)] = dict(before=q.detach().clone(), weight=None)
                    records[(i, 1)] = dict(before=k.detach().clone(), weight=None)
                else:
                    # [B, H, T, D] -> [B, T, H, D]
                    records[(i, 0)]["after"] = out_q.detach().transpose(1, 2).clone()
                    records[(i, 1)]["after"] = out_k.detach().transpose(1, 2).clone()
                return out_q, out_k

            return wrapped

        for n in names:
            setattr(module, n, wrap(n))
        ids = torch.randint(1, config.vocab_size, (1, SEQ), generator=gen)
        positions = torch.randperm(64, generator=gen)[:SEQ].sort().values
        with torch.no_grad():
            model(input_ids=ids, position_ids=positions[None])
        for n in names:
            setattr(module, n, original[n])

        blob = bytearray(b"RPQKN1\0\0")
        blob += struct.pack("<I", SEQ)
        blob += struct.pack(f"<{SEQ}q", *positions.tolist())
        done = sorted(k for k, r in records.items() if "after" in r)
        blob += struct.pack("<I", len(done))
        for (layer, which) in done:
            r = records[(layer, which)]
            # [T, H, D] (Gemma 3 normalizes [H, T, D]; OLMo 2 the projection, [T, H * D]).
            tokens_first = lambda x: x if x.shape[0] == SEQ else x.transpose(0, 1)
            after = tokens_first(r["after"][0].float())
            before = r["before"][0].float()
            before = before.reshape(SEQ, -1, d) if before.dim() == 2 else tokens_first(before)
            assert before.shape == after.shape and before.shape[0] == SEQ, (model_type, before.shape, after.shape)
            heads, dim = before.shape[1], before.shape[2]
            weighted = 0 if r["weight"] is None else (1 if r["weight"].numel() == dim else 2)
            blob += struct.pack("<IIIII", layer, which, heads, dim, weighted)
            if r["weight"] is not None:
                blob += r["weight"].float().contiguous().numpy().tobytes()
            blob += before.contiguous().numpy().tobytes()
            blob += after.contiguous().numpy().tobytes()
        with open(os.path.join(out, f"{model_type}.bin"), "wb") as f:
            f.write(bytes(blob))
        with open(os.path.join(out, f"{model_type}.json"), "w") as f:
            f.write(config.to_json_string(use_diff=False))
        print(model_type, "records", done)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/data/qknorm")
