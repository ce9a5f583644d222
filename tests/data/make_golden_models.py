#!/usr/bin/env python3
"""Golden data from each model family's own rotary code in transformers (5.x), one tiny
random model per `model_type`:

    python3 tests/data/make_golden_models.py tests/data/models

For each model type: a config of that type with 2 layers (4 where the per-layer rule needs
more) and small sizes is built through `AutoConfig.for_model`, its text model is
instantiated with random weights in float32, and one forward pass runs on random token ids
at random positions (for MRoPE models: three position streams holding two text tokens, a
2x2 image grid and a text token after it). Every module-level apply function of the model's
modeling file (`apply_rotary_pos_emb`, `apply_multimodal_rotary_pos_emb`, `apply_rotary_emb`,
`apply_rotary_pos_emb_interleave`, ...) is wrapped for the pass: each call records the
tensors it rotates and what it returns, with the calling attention layer's index. So the
data is what the model itself does: its rotary embedding module, its apply function, its
per-layer rule (a layer that skips RoPE records nothing), in float32 as the model runs.

Written per model type `T`:
- `T.json`: the config, as `config.to_json_string(use_diff=False)` writes it (composite
  models: the whole config, with the text model's under `text_config`; Kimi K2's with its
  own `model_type` and no `rope_interleave`, as it ships);
- `T.bin`, little-endian:
      b"RPMD1\\0\\0\\0"
      u32 streams (1, or 3 for MRoPE), u32 seq
      i64 positions[streams * seq]
      u32 records
      records x { u32 layer, u32 heads, u32 dim, f32 input[seq * heads * dim],
                  f32 output[seq * heads * dim] }      # [seq, heads, dim]
  (`dim` is the last axis the apply function saw: the head, or only its rotary part where
  the model splits it off before the call);
- `manifest.json`: per model type the layer count, the layers that rotated, the layer types,
  and where the code lives (apply functions and rotary classes: file and line).

Positions stay below 64 so that transformers' float32 angles are within 1e-5 relative.
"""
import importlib
import inspect
import json
import os
import re
import struct
import sys
import traceback

import numpy as np
import torch
import transformers
from transformers import AutoConfig, AutoModel

SEQ = 7  # no other axis has this size: it identifies the token axis
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
    bos_token_id=1,
    eos_token_id=2,
)
# Mixture-of-experts sizes, for the types that have experts (only those get them: every
# keyword ends up in the config written).
MOE = dict(
    num_experts=4,
    num_local_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
)
# DeepSeek's latent attention and router.
MLA = dict(
    MOE,
    n_routed_experts=4,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_rope_head_dim=16,
    qk_nope_head_dim=16,
    v_head_dim=16,
    head_dim=None,
    num_key_value_heads=4,
)

# (name, top-level model_type, text model_type or None, text overrides, top overrides)
CASES = [
    ("llama", "llama", None, {}, {}),
    ("llama4", "llama4", "llama4_text", dict(MOE, num_hidden_layers=4, no_rope_layers=None, intermediate_size_mlp=64), {}),
    ("mistral", "mistral", None, {}, {}),
    ("mixtral", "mixtral", None, MOE, {}),
    ("qwen2", "qwen2", None, {}, {}),
    ("qwen2_moe", "qwen2_moe", None, MOE, {}),
    ("qwen3", "qwen3", None, {}, {}),
    ("qwen3_moe", "qwen3_moe", None, MOE, {}),
    ("qwen2_vl", "qwen2_vl", "qwen2_vl_text", dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]}), {}),
    ("qwen2_5_vl", "qwen2_5_vl", "qwen2_5_vl_text", dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]}), {}),
    ("qwen3_vl", "qwen3_vl", "qwen3_vl_text", dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [6, 5, 5], "mrope_interleaved": True}), {}),
    ("glm4v", "glm4v", "glm4v_text", dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3], "partial_rotary_factor": 0.5}), {}),
    ("gemma", "gemma", None, {}, {}),
    ("gemma2", "gemma2", None, {}, {}),
    ("gemma3", "gemma3", "gemma3_text", dict(layer_types=["sliding_attention", "full_attention"]), {}),
    ("gemma3_text", "gemma3_text", None, dict(layer_types=["sliding_attention", "full_attention"]), {}),
    ("gemma4", "gemma4", "gemma4_text", dict(layer_types=["sliding_attention", "full_attention"]), {}),
    ("phi3", "phi3", None, {}, {}),
    ("phi4_mini", "phi3", None, dict(partial_rotary_factor=0.75), {}),
    ("phi4_multimodal", "phi4_multimodal", None, dict(partial_rotary_factor=0.75), {}),
    ("stablelm", "stablelm", None, {}, {}),
    ("gpt_neox", "gpt_neox", None, {}, {}),
    ("gptj", "gptj", None, dict(n_embd=128, n_head=4, n_layer=2, rotary_dim=16, n_positions=512), {}),
    ("falcon", "falcon", None, dict(head_dim=None, num_kv_heads=2, new_decoder_architecture=True), {}),
    ("olmo2", "olmo2", None, {}, {}),
    ("cohere", "cohere", None, {}, {}),
    ("cohere2", "cohere2", None, dict(num_hidden_layers=4, layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]), {}),
    ("glm", "glm", None, {}, {}),
    ("glm4", "glm4", None, {}, {}),
    ("glm4_moe", "glm4_moe", None, MOE, {}),
    ("deepseek_v2", "deepseek_v2", None, MLA, {}),
    ("deepseek_v3", "deepseek_v3", None, MLA, {}),
    # Kimi K2's config.json names `kimi_k2` and the DeepSeek-V3 architecture
    # (`DeepseekV3ForCausalLM`), without `rope_interleave`: its golden is DeepSeek-V3's code,
    # with the config written the way Kimi K2 ships it.
    ("kimi_k2", "deepseek_v3", None, MLA, {}, {"model_type": "kimi_k2", "rope_interleave": None}),
    ("gpt_oss", "gpt_oss", None, dict(MOE, layer_types=["sliding_attention", "full_attention"]), {}),
    ("granite", "granite", None, {}, {}),
    ("ernie4_5", "ernie4_5", None, {}, {}),
    ("ernie4_5_moe", "ernie4_5_moe", None, MOE, {}),
]

APPLY = re.compile(r"^_?apply.*(rot|rope)|^apply_multimodal", re.IGNORECASE)


def positions(seed, streams):
    rng = np.random.default_rng(seed)
    if streams == 1:
        return rng.integers(0, 48, size=(1, SEQ)).astype(np.int64)
    # Two text tokens, a 2x2 image at one temporal position, one text token after it.
    p = np.zeros((3, SEQ), dtype=np.int64)
    start = int(rng.integers(3, 20))
    p[:, 0], p[:, 1] = start, start + 1
    t0 = start + 2
    for i in range(4):
        p[0, 2 + i], p[1, 2 + i], p[2, 2 + i] = t0, t0 + 3 * (i // 2) + 1, t0 + 5 * (i % 2) + 2
    p[:, 6] = t0 + 9
    return p


def to_rows(t):
    """A captured tensor as [seq, heads, dim]."""
    t = t.detach().float().cpu()
    axes = [i for i, n in enumerate(t.shape[:-1]) if n == SEQ]
    assert len(axes) == 1, f"token axis of {tuple(t.shape)}"
    t = t.movedim(axes[0], 0)
    return t.reshape(SEQ, -1, t.shape[-1]).contiguous()


def where(obj):
    try:
        return f"{os.path.relpath(inspect.getsourcefile(obj), os.path.dirname(transformers.__file__))}:{inspect.getsourcelines(obj)[1]}"
    except (TypeError, OSError):
        return "?"


def rope_lines(module):
    """Lines of the attention and decoder classes that call an apply function or decide
    whether a layer rotates, with their line numbers."""
    out = []
    src, first = inspect.getsourcelines(module)
    for i, line in enumerate(src):
        s = line.strip()
        if re.search(r"apply_\w*rot\w*\(|apply_multimodal\w*\(|use_rope|no_rope|rope_interleave|sliding_window is not None", s):
            if not s.startswith(("def ", "#", '"', "r\"")):
                out.append(f"{first + i}: {s}")
    return out


def run(case, outdir, seed):
    name, top_type, text_type, text_kw, top_kw = case[:5]
    edits = case[5] if len(case) > 5 else {}
    kw = dict(TEXT)
    kw.update(text_kw)
    kw = {k: v for k, v in kw.items() if v is not None or k == "no_rope_layers"}  # None: leave unset
    if text_type is None:
        cfg = AutoConfig.for_model(top_type, **kw, **top_kw)
        text = cfg
    else:
        text = AutoConfig.for_model(text_type, **kw)
        cfg = AutoConfig.for_model(top_type, text_config=text.to_dict(), **top_kw)
        text = cfg.text_config if hasattr(cfg, "text_config") else cfg.get_text_config()
    text._attn_implementation = "eager"
    model = AutoModel.from_config(text).float().eval()
    mod = importlib.import_module(type(model).__module__)

    records, depth = [], [0]
    originals = {}
    for fname, fn in list(vars(mod).items()):
        if callable(fn) and inspect.isfunction(fn) and APPLY.search(fname) and "vision" not in fname:
            originals[fname] = fn

            def wrapper(*args, __fn=fn, __name=fname, **kwargs):
                depth[0] += 1
                try:
                    out = __fn(*args, **kwargs)
                finally:
                    depth[0] -= 1
                if depth[0] == 0:
                    frame = sys._getframe(1)
                    owner = frame.f_locals.get("self")
                    layer = getattr(owner, "layer_idx", None)
                    ins = [a for a in args if torch.is_tensor(a) and a.dim() >= 3]
                    outs = list(out) if isinstance(out, (tuple, list)) else [out]
                    used = set()
                    for o in outs:
                        for j, a in enumerate(ins):
                            if j not in used and a.shape == o.shape and a.dtype == o.dtype:
                                used.add(j)
                                records.append((layer, __name, to_rows(a), to_rows(o)))
                                break
                return out

            setattr(mod, fname, wrapper)
    mrope = any("mrope" in k for k in json.dumps(text.to_dict()).split('"'))
    streams = 3 if mrope else 1
    pos = positions(seed, streams)
    ids = torch.from_numpy(np.random.default_rng(seed + 1).integers(0, 128, size=(1, SEQ)))
    pid = torch.from_numpy(pos).reshape(streams, 1, SEQ) if streams == 3 else torch.from_numpy(pos)
    try:
        with torch.no_grad():
            model(input_ids=ids, position_ids=pid, use_cache=False)
    finally:
        for fname, fn in originals.items():
            setattr(mod, fname, fn)
    if not records:
        raise RuntimeError(f"no apply call recorded (patched: {sorted(originals)})")

    written = json.loads(cfg.to_json_string(use_diff=False))
    for key, value in edits.items():  # None: the key is left out
        if value is None:
            written.pop(key, None)
        else:
            written[key] = value
    with open(f"{outdir}/{name}.json", "w") as f:
        json.dump(written, f, indent=2, sort_keys=True)
    blob = bytearray(b"RPMD1\0\0\0")
    blob += struct.pack("<II", streams, SEQ)
    blob += pos.reshape(-1).astype("<i8").tobytes()
    blob += struct.pack("<I", len(records))
    for layer, _, a, o in records:
        blob += struct.pack("<III", layer if layer is not None else 0xFFFFFFFF, a.shape[1], a.shape[2])
        blob += a.numpy().astype("<f4").tobytes() + o.numpy().astype("<f4").tobytes()
    with open(f"{outdir}/{name}.bin", "wb") as f:
        f.write(blob)

    rotary = [c for n, c in vars(mod).items() if inspect.isclass(c) and n.endswith("RotaryEmbedding") and "Vision" not in n]
    attn = [c for n, c in vars(mod).items() if inspect.isclass(c) and (n.endswith("Attention") or n.endswith("DecoderLayer")) and "Vision" not in n]
    layers = getattr(text, "num_hidden_layers", None) or getattr(text, "n_layer", None)
    info = {
        "model_type": cfg.model_type,
        "text_model_type": text.model_type,
        "model_class": type(model).__name__,
        "layers": layers,
        "rope_layers": sorted({r[0] for r in records if r[0] is not None}),
        "layer_types": getattr(text, "layer_types", None),
        "records": [[r[0], r[1], list(r[2].shape)] for r in records],
        "apply": {n: where(f) for n, f in originals.items()},
        "rotary": {c.__name__: where(c) for c in rotary},
        "lines": {c.__name__: rope_lines(c) for c in attn},
        "file": os.path.relpath(mod.__file__, os.path.dirname(transformers.__file__)),
    }
    print(f"{name}: {info['model_class']}, {len(records)} records, rope layers {info['rope_layers']} of {layers}, streams {streams}")
    return info


def main():
    outdir = sys.argv[1] if len(sys.argv) > 1 else "tests/data/models"
    os.makedirs(outdir, exist_ok=True)
    torch.manual_seed(0)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    manifest = {"transformers": transformers.__version__, "torch": torch.__version__, "models": {}, "failed": {}}
    only = set(sys.argv[2:])
    for i, case in enumerate(CASES):
        if only and case[0] not in only:
            continue
        try:
            manifest["models"][case[0]] = run(case, outdir, 1000 + i)
        except Exception as e:  # a model this version cannot build is reported, not fatal
            manifest["failed"][case[0]] = f"{type(e).__name__}: {e}"
            print(f"{case[0]}: FAILED {type(e).__name__}: {e}")
            traceback.print_exc()
    with open(f"{outdir}/manifest.json", "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
