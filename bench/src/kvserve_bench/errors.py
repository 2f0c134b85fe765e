"""The one error the bench raises on purpose; the CLI prints its message as a single line."""

from kvserve.errors import KVServeError


class BenchError(KVServeError):
    """A benchmark cannot run as asked: a target is unreachable, a data set is missing, a size is invalid."""
