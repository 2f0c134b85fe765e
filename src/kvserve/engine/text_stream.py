"""TextStream: detokenize one request incrementally, cut stop strings, hold back text that may be one."""

from kvserve.model.tokenizer import IncrementalDecoder


class TextStream:
    """Accumulates decoded text. `push` returns the text now safe to show, `stopped` tells whether a stop
    string appeared (the text is then cut just before it, or just after it with `include_stop`, and nothing
    after it is ever shown)."""

    def __init__(self, decoder: IncrementalDecoder, stop: list[str], include_stop: bool = False) -> None:
        self._decoder = decoder
        self._stop = stop
        self._include_stop = include_stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self._shown = 0
        self.stopped = False

    def push(self, token_id: int, check_stop: bool = True) -> str:
        """Add a token; `check_stop=False` (before min_tokens) lets stop strings pass."""
        piece = self._decoder.step(token_id)
        if not piece:
            return ""
        start = max(0, len(self.text) - self._hold)
        self.text += piece
        for s in self._stop if check_stop else ():
            at = self.text.find(s, start)
            if at >= 0:
                self.text = self.text[: at + len(s) if self._include_stop else at]
                self.stopped = True
        if self.stopped:
            return self.flush()
        visible = max(self._shown, len(self.text) - self._hold)
        delta = self.text[self._shown : visible]
        self._shown = visible
        return delta

    def flush(self) -> str:
        delta = self.text[self._shown :]
        self._shown = len(self.text)
        return delta
