"""Writes a small random-weight GQA Llama for the vLLM end-to-end tests.

Nothing is downloaded: the config is written here and the weights are drawn
from a fixed seed. The weights are scaled up (``initializer_range``) so the
model's greedy tokens depend sharply on its KV cache: a wrong KV byte
changes what it says, which is what the tests rely on.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

#: The model's shape: 4 layers, 4 query heads and 2 KV heads of 64 (GQA),
#: fp32 weights, a 512-token vocabulary.
CONFIG = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    initializer_range=0.25,
    bos_token_id=1,
    eos_token_id=2,
)


def make(out: Path, seed: int = 0) -> Path:
    """Writes the model to ``out`` (config + safetensors) unless already there."""
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**CONFIG)  # type: ignore[arg-type]
    config.torch_dtype = torch.float32  # type: ignore[attr-defined]
    model = LlamaForCausalLM(config)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    # An eos the prompts never produce early would make every run stop at
    # max_tokens; keep eos out of the way by pointing it at token 2 and
    # letting the tests set ignore_eos.
    gen = out / "generation_config.json"
    if gen.exists():
        data = json.loads(gen.read_text())
        data.pop("eos_token_id", None)
        gen.write_text(json.dumps(data))
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    print(make(args.out))


def make_lora(out: Path, seed: int, rank: int = 8) -> Path:
    """Writes a LoRA adapter (PEFT's file layout) for the model above to
    ``out``: rank ``rank`` on every layer's q, k, v and o projections, with
    both factors drawn from ``seed`` (PEFT starts B at zero, which would
    change nothing), so the adapter changes the prompt's KV."""
    if (out / "adapter_config.json").exists() and (out / "adapter_model.safetensors").exists():
        return out
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    hidden = CONFIG["hidden_size"]
    kv = CONFIG["num_key_value_heads"] * CONFIG["head_dim"]
    outs = {"q_proj": CONFIG["num_attention_heads"] * CONFIG["head_dim"], "k_proj": kv, "v_proj": kv,
            "o_proj": hidden}
    tensors = {}
    for layer in range(int(CONFIG["num_hidden_layers"])):
        for proj, out_features in outs.items():
            in_features = hidden if proj != "o_proj" else CONFIG["num_attention_heads"] * CONFIG["head_dim"]
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, int(in_features), generator=g) * 0.2
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(int(out_features), rank, generator=g) * 0.2
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
        "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "base_model_name_or_path": "tiny-gqa-llama",
        "target_modules": sorted(outs),
    }))
    return out
