"""The stored responses of /v1/responses (`store`, default true as OpenAI's), for `GET`, `DELETE` and
`previous_response_id`.

In this process's memory only: a restart forgets them all, and behind a router a conversation needs
its replica (sticky routing). Bounded by count and by bytes (the JSON of the response and of the
conversation it ends): the least recently used entries are evicted first, each eviction logged with
its id. A response larger than the byte bound is not stored (and said so).
"""
from __future__ import annotations

import json
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass
class StoredResponse:
    response: dict[str, Any]  # as returned to the client
    conversation: list[dict[str, Any]]  # the chat messages through its output (without instructions)
    size: int


class ResponseStore:
    def __init__(self, max_entries: int, max_bytes: int) -> None:
        if max_entries < 0 or max_bytes < 0:
            raise ValueError("the response store's bounds must be >= 0")
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> bool:
        """Store (replacing one of the same id); False if it alone is over the byte bound."""
        size = len(json.dumps(response)) + len(json.dumps(conversation))
        self.delete(response["id"])
        if size > self.max_bytes or self.max_entries == 0:
            logger.warning("response %s not stored: %d bytes, the store holds at most %d entries, %d bytes",
                           response["id"], size, self.max_entries, self.max_bytes)
            return False
        self._entries[response["id"]] = StoredResponse(response, conversation, size)
        self.bytes += size
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            evicted, entry = self._entries.popitem(last=False)
            self.bytes -= entry.size
            logger.info("response store full: evicted %s (least recently used, %d bytes)", evicted, entry.size)
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.bytes -= entry.size
        return entry is not None
