"""The stored responses of /v1/responses (`store: true`): each response object with the
conversation it ends (for `previous_response_id`) and its input items, kept in memory within a count and a byte
bound; past either, the oldest finished responses are dropped first."""

from __future__ import annotations

import asyncio
import json
import logging
from collections import OrderedDict
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


@dataclass
class StoredResponse:
    response: dict  # the Response object as GET returns it
    messages: list[dict] = field(default_factory=list)  # the conversation (no instructions) it ends
    input_items: list[dict] = field(
        default_factory=list
    )  # its request's input, as GET .../input_items lists it
    task: asyncio.Task | None = None  # a background response's run while it is not finished
    size: int = 0

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()


class ResponseStore:
    def __init__(self, max_count: int, max_bytes: int) -> None:
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.total_bytes = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._entries.get(response_id)

    def put(self, entry: StoredResponse) -> None:
        """Store (or replace) `entry`; then drop the oldest finished entries until both bounds
        hold. An entry larger than the byte bound alone is not kept."""
        response_id = entry.response["id"]
        self.delete(response_id)
        entry.size = sum(
            len(json.dumps(part)) for part in (entry.response, entry.messages, entry.input_items)
        )
        if entry.size > self.max_bytes:
            logger.warning("response %s (%d bytes) is larger than the store's bound; not stored", response_id,
                           entry.size)  # fmt: skip
            return
        self._entries[response_id] = entry
        self.total_bytes += entry.size
        self._evict()

    def delete(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.total_bytes -= entry.size
        return entry

    def _evict(self) -> None:
        for response_id in list(self._entries):
            if len(self._entries) <= self.max_count and self.total_bytes <= self.max_bytes:
                return
            if not self._entries[response_id].running:
                self.delete(response_id)
