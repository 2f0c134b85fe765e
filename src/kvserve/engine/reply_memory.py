"""ReplyMemory: the token ids generated for recent replies, keyed by their text.

Chat clients send a reply back as text in the next turn. Tokenizing that text again can give other ids
than the ones generated (BPE is not unique), which would break the cached prefix right at the reply; the
exact ids are looked up here instead.
"""

import threading
from collections import OrderedDict
from collections.abc import Sequence


class ReplyMemory:
    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._ids: OrderedDict[tuple[str, str], tuple[int, ...]] = OrderedDict()
        # The engine thread remembers while server threads look up.
        self._lock = threading.Lock()

    def remember(self, namespace: str, text: str, token_ids: Sequence[int]) -> None:
        if not text or not token_ids:
            return
        key = (namespace, text)
        with self._lock:
            self._ids[key] = tuple(token_ids)
            self._ids.move_to_end(key)
            while len(self._ids) > self.capacity:
                self._ids.popitem(last=False)

    def lookup(self, namespace: str, text: str) -> list[int] | None:
        with self._lock:
            ids = self._ids.get((namespace, text))
        return None if ids is None else list(ids)
