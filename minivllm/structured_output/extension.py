"""Structured outputs' part in the step: an admission gate and a step extension (seams.py).

A request's grammar compiles in the compiler's pool from the moment it is added; the gate holds the
request back until then (the others go ahead, as in vLLM v1), and the step before scheduling gives it
its parse state. The sampler's row of each constrained sequence gets its grammar's token mask, and
each sampled token advances the grammar.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from minivllm.engine.seams import StepExtension
from minivllm.engine.sequence import Sequence
from minivllm.model.batch import SamplingRow
from minivllm.model.tokenizer import Tokenizer
from minivllm.sampling_params import StructuredOutputsParams
from minivllm.structured_output.grammar import StructuredOutputManager, allowed_tokens

logger = logging.getLogger(__name__)


def waiting_for_grammar(seq: Sequence) -> bool:
    return seq.grammar_future is not None and seq.grammar is None


class StructuredOutputs(StepExtension):
    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, abort: Callable[[str], None]) -> None:
        self.tokenizer, self.vocab_size, self.abort = tokenizer, vocab_size, abort
        self._manager: StructuredOutputManager | None = None  # made on first use
        self._lock = threading.Lock()
        self._compiling: list[Sequence] = []  # requests whose grammar may still be compiling

    @property
    def manager(self) -> StructuredOutputManager:
        """The grammar compiler, made on first use (its vocabulary index takes a fraction of a second)."""
        with self._lock:
            if self._manager is None:
                self._manager = StructuredOutputManager(self.tokenizer.hf, self.vocab_size,
                                                        self.tokenizer.eos_token_ids)
            return self._manager

    def compile(self, params: StructuredOutputsParams) -> Future:
        """The grammar of `params`, compiled in the pool (cached): the frontends check a request's
        grammar with it before they add the request."""
        return self.manager.compile(params)

    def admits(self, seq: Sequence, running: list[Sequence]) -> bool:
        return not waiting_for_grammar(seq)

    def on_add(self, seq: Sequence, options: dict[str, Any]) -> None:
        if seq.params.structured_outputs is not None:
            seq.grammar_future = self.manager.compile(seq.params.structured_outputs)
            self._compiling.append(seq)

    def before_schedule(self) -> None:
        """Give each request whose grammar has compiled its parse state, so that it can be scheduled;
        a grammar that failed (the server and LLM check first, so rarely) aborts its request."""
        if not self._compiling:
            return
        self._compiling = [s for s in self._compiling if waiting_for_grammar(s)]  # aborted ones drop out
        for seq in [s for s in self._compiling if s.grammar_future.done()]:
            self._compiling.remove(seq)
            try:
                seq.grammar = self.manager.grammar(seq.grammar_future.result())
            except ValueError:
                logger.exception("request %s: grammar failed to compile", seq.request_id)
                self.abort(seq.request_id)

    def pending(self) -> list[Future]:
        return [s.grammar_future for s in self._compiling if waiting_for_grammar(s)]

    def prepare_sampling(self, rows: list[tuple[Sequence, SamplingRow]]) -> None:
        constrained = [(seq, row) for seq, row in rows if seq.grammar is not None]
        if constrained:
            masks = allowed_tokens([seq.grammar for seq, _ in constrained], self.vocab_size)
            for (_, row), mask in zip(constrained, masks):
                row.grammar_mask = mask

    def on_token(self, seq: Sequence, token: int) -> None:
        if seq.grammar is not None and not seq.grammar.accept(token) and token not in seq.eos_token_ids:
            logger.warning("request %s: token %d is outside its grammar", seq.request_id, token)

    def on_finish(self, seq: Sequence) -> None:
        seq.grammar = seq.grammar_future = None  # release the parse state

    def close(self) -> None:
        if self._manager is not None:
            self._manager.close()
