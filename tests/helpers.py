"""Helpers shared by the tests that run the real model (fixtures live in conftest.py)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from minivllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.outputs import RequestOutput

NEW_TOKENS = 32

# Prompts of different lengths and languages: one token, short, code, Chinese, German, and one
# over 200 tokens (long enough to be chunked and to cross many KV blocks).
LONG_PROMPT = (
    "The history of the printing press begins long before Johannes Gutenberg. Woodblock printing was "
    "practised in China by the ninth century, and movable type made of baked clay was described by the "
    "scholar Shen Kuo, who credited an artisan named Bi Sheng with its invention around the year 1040. "
    "Later, Korean printers cast movable type in bronze, and the oldest surviving book printed with metal "
    "type dates from 1377. In Europe, Gutenberg combined several ideas in the middle of the fifteenth "
    "century: an adjustable hand mould for casting uniform letters, an oil-based ink that clung to metal, "
    "and a screw press adapted from those used to make wine and olive oil. His workshop in Mainz produced "
    "the famous Bible around 1455, and within fifty years presses had spread to more than two hundred "
    "cities. Books became cheaper, literacy rose, scholars could compare identical copies of a text, and "
    "new ideas travelled faster than ever before. Summarize the consequences of this invention in three "
    "short points:"
)
EQUALITY_PROMPTS = [
    "Hello",
    "The capital of France is",
    "def fibonacci(n):",
    "请用三句话介绍一下长城的历史。",
    "Die wichtigsten Flüsse in Deutschland sind",
    LONG_PROMPT,
]


def greedy(num_tokens: int = NEW_TOKENS, **kwargs: Any) -> SamplingParams:
    """Greedy with exactly `num_tokens` new tokens, as HF's `min_new_tokens = max_new_tokens` does."""
    return SamplingParams(temperature=0, max_tokens=num_tokens, min_tokens=num_tokens, ignore_eos=True, **kwargs)


def assert_idle(engine: LLMEngine) -> None:
    """Nothing left running, and every KV block back in the free pool."""
    assert not engine.has_unfinished_requests()
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, f"{bm.num_blocks - bm.num_free_blocks} KV blocks leaked"
    bm.check_invariants([])


def drain(engine: LLMEngine) -> None:
    """Abort whatever a failed test left behind, so that the next test finds the engine idle."""
    for request_id in list(engine.requests):
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()


def stream(engine: LLMEngine, prompt: str | list[int], params: SamplingParams) -> list[RequestOutput]:
    """Every RequestOutput the engine emits for one request, in order, until it finishes."""
    request_id = engine.add_request(None, prompt, params)
    outputs: list[RequestOutput] = []
    while not outputs or not outputs[-1].finished:
        outputs.extend(o for o in engine.step() if o.request_id == request_id)
    return outputs


def mismatch_report(hf_model: Any, prompt_ids: list[int], ours: list[int], reference: list[int]) -> str:
    """Where our tokens first leave the reference, and the reference's logit gap there: a gap below
    ~1e-4 is a near tie that float rounding may flip, anything larger is a bug."""
    import torch

    i = next((k for k, (a, b) in enumerate(zip(ours, reference)) if a != b), min(len(ours), len(reference)))
    if i == min(len(ours), len(reference)):
        return f"lengths differ: {len(ours)} tokens vs {len(reference)} in the reference"
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt_ids + reference[:i]])).logits[0, -1]
    gap = (logits[reference[i]] - logits[ours[i]]).item()
    return (f"first difference at output token {i}: ours {ours[i]}, reference {reference[i]}; "
            f"reference logit gap {gap:.3g} (ours {ours[:i + 1]}, reference {reference[:i + 1]})")
