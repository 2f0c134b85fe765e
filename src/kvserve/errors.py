"""Errors that cross layers. Each says what is wrong and, where it can, what to do about it."""


class KVServeError(Exception):
    """Base class for every error kvserve raises on purpose."""


class ConfigError(KVServeError, ValueError):
    """A configuration cannot be used as given: raised by EngineConfig, ServerOptions and ClusterConfig
    on construction and by `build_parts` for what only the model decides. The message is one line that
    names the option to change; the command line prints it as `kvserve: error: ...` and exits with 2."""


class ModelLoadError(KVServeError):
    """A model file or folder could not be loaded; the message names the file and the reason."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"cannot load model from {path}: {reason}")
        self.path = path
        self.reason = reason


class KernelAbiError(KVServeError, RuntimeError):
    """A compiled kernel library and kvserve's ctypes declarations of it disagree (ABI version, struct
    sizes or a missing symbol): calling it would misread its arguments, so it is never used."""


class InvalidRequestError(KVServeError, ValueError):
    """A request can never be served as asked (bad sampling value, prompt too long, ...).

    `param` names the offending field so that the server can report it OpenAI-style, and `code`, when
    there is one, is the machine-readable reason a client may branch on. The server answers every one
    with a 400 (server/http/errors.py): it is the server's one type for a request refused as sent.
    """

    code: str | None = None

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code


class EngineOverloadedError(KVServeError):
    """The engine's queue is full; the caller should retry later."""
