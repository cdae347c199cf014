"""A random-weight checkpoint of a mixture-of-experts model's real shape, for the MoE benchmarks
(scripts/bench/moe_bench.sh): transformers builds it from the family's own config class on the meta
device, then each tensor is filled in bf16 one by one (a 7B shape stays within the machine's RAM).
Speed does not depend on the values. The tokenizer is the default model's (a directory of HF
tokenizer files): vocab 49152, so the families whose vocabulary is larger get 49152 rows; gpt-oss-20b
keeps its 201,088 (its LM head is a real share of a token's bytes), and its experts are written as
OpenAI's checkpoint holds them, MXFP4 blocks and scales (random bytes), one layer per shard.

    python scripts/bench/make_moe.py granite-1b-a400m|olmoe-1b-7b|gpt-oss-20b OUT_DIR TOKENIZER_DIR
"""
import json
import shutil
import sys
from pathlib import Path

import torch
import transformers

SHAPES = {
    # ibm-granite/granite-3.1-1b-a400m-instruct's config.json, with its multipliers
    "granite-1b-a400m": lambda: transformers.GraniteMoeConfig(
        vocab_size=49152, hidden_size=1024, intermediate_size=512, num_hidden_layers=24, num_attention_heads=16,
        num_key_value_heads=8, num_local_experts=32, num_experts_per_tok=8, max_position_embeddings=4096,
        tie_word_embeddings=True, embedding_multiplier=12.0, attention_multiplier=0.015625, residual_multiplier=0.22,
        logits_scaling=6.0),
    # allenai/OLMoE-1B-7B-0924's (vocab 50304 there)
    "olmoe-1b-7b": lambda: transformers.OlmoeConfig(
        vocab_size=49152, hidden_size=2048, intermediate_size=1024, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=16, num_experts=64, num_experts_per_tok=8, max_position_embeddings=4096,
        tie_word_embeddings=False, norm_topk_prob=False),
    # openai/gpt-oss-20b's (transformers' defaults are the 120b's)
    "gpt-oss-20b": lambda: transformers.GptOssConfig(
        num_hidden_layers=24, num_local_experts=32, num_experts_per_tok=4, vocab_size=201088),
}


def save_gpt_oss(config, out: Path) -> None:
    """Layer by layer, each a shard: its attention and router in bf16, its experts in MXFP4 (blocks of
    random bytes, scales 2^-9 .. 2^-5, about a trained model's), as OpenAI's checkpoints hold them."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    shapes = {n: p.shape for n, p in model.named_parameters()}
    weight_map = {}

    def write(shard: str, names: list[str]) -> None:
        tensors = {}
        for n in names:
            shape = shapes[n]
            if n.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [E, in, out] -> [E, out, in / 32, ...]
                blocks = (shape[0], shape[2], shape[1] // 32)
                tensors[n + "_blocks"] = torch.randint(0, 256, (*blocks, 16), dtype=torch.uint8)
                tensors[n + "_scales"] = torch.randint(118, 123, blocks, dtype=torch.uint8)
            else:
                t = torch.empty(shape, dtype=torch.bfloat16)
                tensors[n] = t.uniform_(0.5, 1.5) if "norm" in n else t.normal_(0.0, 0.02)
        save_file(tensors, out / shard, metadata={"format": "pt"})
        weight_map.update({n: shard for n in tensors})

    out.mkdir(parents=True, exist_ok=True)
    for i in range(config.num_hidden_layers):
        write(f"layer-{i:02d}.safetensors", [n for n in shapes if n.startswith(f"model.layers.{i}.")])
        print(f"layer {i} written", flush=True)
    write("rest.safetensors", [n for n in shapes if not n.startswith("model.layers.")])
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config.quantization_config = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    config.architectures = ["GptOssForCausalLM"]
    config.save_pretrained(out)


def main(shape: str, out: Path, tokenizer: Path) -> None:
    config = SHAPES[shape]()
    config.bos_token_id, config.eos_token_id, config.pad_token_id = 1, 2, 0
    if shape == "gpt-oss-20b":
        save_gpt_oss(config, out)
        shutil.copytree(tokenizer, out, dirs_exist_ok=True)
        return
    torch.manual_seed(0)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.02)
    print(f"{shape}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters", flush=True)
    model.save_pretrained(out, max_shard_size="2GB")
    shutil.copytree(tokenizer, out, dirs_exist_ok=True)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
