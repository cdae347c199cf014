"""Greedy bf16 tokens of fixed prompts on the default model and the 0.5B file, each prompt alone and all together,
with whichever minivllm is first on sys.path: written as JSON, so that two checkouts' outputs compare by equality
(house_ab.sh). Usage: python scripts/bench/same_tokens.py OUT.json"""
import json
import sys

import minivllm
from minivllm import LLM, SamplingParams
from minivllm.model.fetch import fetch

prompts = ["Hello", "The capital of France is", "def fibonacci(n):", "请用三句话介绍一下长城的历史。",
           "Write a Python function that reverses a string.", "Explain continuous batching in two sentences."]
out = {"minivllm": minivllm.__file__}
for name, model in (("default", None), ("0.5B", str(fetch("qwen2.5-coder-0.5b-instruct-q4_k_m")))):
    llm = LLM(model=model, dtype="bfloat16", num_kv_blocks=256) if model else LLM(dtype="bfloat16", num_kv_blocks=256)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    alone = [llm.generate(p, params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    out[name] = {"alone": alone, "together": together}
json.dump(out, open(sys.argv[1], "w"))
print(out["minivllm"], "alone == together:", all(out[n]["alone"] == out[n]["together"] for n in ("default", "0.5B")))
