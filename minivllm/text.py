"""A generated sequence's text: stop strings and the text a stream may show so far.

One copy for both places that detokenize: the in-process engine (engine/llm_engine.py, on its step thread)
and the frontend of the engine-core process (frontend/core_client.py), which detokenizes there so that the
engine's process spends its time on the model.
"""
from __future__ import annotations

from minivllm.model.tokenizer import IncrementalDetokenizer
from minivllm.sampling_params import SamplingParams


def cut_at_stop_string(detok: IncrementalDetokenizer, params: SamplingParams, delta: str) -> str | None:
    """The stop string that ends inside the newly decoded text `delta`, if any; then `detok.text` is cut
    before it (after it with include_stop_str_in_output)."""
    longest = max(len(s) for s in params.stop_strings)
    # Only a stop string that ends inside the new text can be new.
    window_start = max(0, len(detok.text) - len(delta) - longest + 1)
    for stop in params.stop_strings:
        at = detok.text.find(stop, window_start)
        if at >= 0:
            detok.text = detok.text[: at + (len(stop) if params.include_stop_str_in_output else 0)]
            return stop
    return None


def visible_text(text: str, params: SamplingParams, finished: bool) -> str:
    """What may be shown of an unfinished sequence's text: the tail that may be the start of a stop
    string is held back, so that a stream never shows one."""
    if finished or not params.stop_strings or params.include_stop_str_in_output:
        return text
    return text[: max(0, len(text) - max(len(s) for s in params.stop_strings) + 1)]
