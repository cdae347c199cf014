"""A random-weight checkpoint of a mixture-of-experts model's real shape, for the MoE benchmarks
(scripts/bench/moe_bench.sh): transformers builds it from the family's own config class on the meta
device, then each tensor is filled in bf16 one by one (a 7B shape stays within the machine's RAM).
Speed does not depend on the values. The tokenizer is the default model's (a directory of HF
tokenizer files): vocab 49152, so the families whose vocabulary is larger get 49152 rows.

    python scripts/bench/make_moe.py granite-1b-a400m|olmoe-1b-7b OUT_DIR TOKENIZER_DIR
"""
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
}


def main(shape: str, out: Path, tokenizer: Path) -> None:
    config = SHAPES[shape]()
    config.bos_token_id, config.eos_token_id, config.pad_token_id = 1, 2, 0
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
