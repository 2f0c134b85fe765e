"""ServerOptions: every option of the HTTP server that is not the engine's, in one frozen, validated
dataclass beside EngineConfig; `kvserve serve`'s flags are built from its fields (kvserve.flags)."""

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvserve.config import check_kv_remote_secret, format_bytes, parse_bytes
from kvserve.credentials import check_url_without_password
from kvserve.errors import ConfigError
from kvserve.flags import option

# Kept here, below the server, so that the command line offers them without importing it; the server's
# registries (server/tool_formats, server/core/chat_setup.py) hold the same names.
TOOL_CALL_FORMATS = ("auto", "generic", "phi4", "mistral", "qwen3_xml", "hermes", "llama3_json")
REASONING_PARSERS = ("auto", "off", "think")


def parse_origins(text: str) -> tuple[str, ...]:
    """A JSON list (as vLLM takes it) or a comma-separated list of origins."""
    if text.lstrip().startswith("["):
        origins = json.loads(text)
        if not isinstance(origins, list) or not all(isinstance(o, str) for o in origins):
            raise ValueError("--allowed-origins must be a JSON list of strings")
        return tuple(origins)
    return tuple(o.strip() for o in text.split(",") if o.strip())


def parse_model_name(text: str) -> str:
    """One served model name: what a client writes in `model`, so neither empty nor padded."""
    if not text or text != text.strip():
        raise ValueError(f"a served model name must be non-empty, without spaces around it, not {text!r}")
    return text


@dataclass(frozen=True)
class ServerOptions:
    """How the HTTP server around an engine behaves: its address, its keys and tenants, the limits of
    one request, CORS and the dashboard. The keys never show in the repr.

    `api_key` is the one key of a single-tenant server; `api_key_file` names tenants' keys (it wins
    over `api_key` for tenancy, see server/http/tenants.py); `admin_key` opens the admin routes and every
    namespace's dashboard. `tenant_secret_file` is the secret replicas share (default: this server's
    own, in its cache folder); `kv_remote`, the URL of the Redis tier they share, needs it: it reaches
    EngineConfig.kv_remote together with that secret once `serve` has read it. Its password comes from
    `kv_remote_password_file` or $KVSERVE_KV_REMOTE_PASSWORD, never from the URL (refused: the command
    line shows it). `launch_nonce` is set by `kvserve serve` when `kvserve cluster` started it (from the
    environment, kvserve.credentials): GET /identity proves with it that this is the replica it spawned.
    `preparation_threads` prepare requests off the event loop, at most `max_preparing_per_tenant` of
    them for one tenant at once (server/core/preparation.py). `served_model_name` holds the names a request's
    `model` may be (one string counts as one name): the first is the one answers show, the others are
    aliases (vLLM's meaning). `shutdown_grace_s` is how long requests in flight get after SIGTERM.
    """

    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(8000, "port to listen on")
    api_key: str | None = option(
        None,
        "require this bearer token on every route but /health (default: $KVSERVE_API_KEY, which unlike an "
        "argument does not show in ps)",
        env="KVSERVE_API_KEY",
        repr=False,
    )
    admin_key: str | None = option(
        None,
        "bearer token for admin routes (POST /reset_prefix_cache), needed there once keys are set "
        "(default: $KVSERVE_ADMIN_KEY)",
        env="KVSERVE_ADMIN_KEY",
        repr=False,
    )
    api_key_file: str | None = option(
        None,
        "one 'tenant:key' or 'tenant:key:shared-group' per line; each tenant gets its own prefix-cache "
        "namespace (members of a shared group share one); re-read on SIGHUP",
    )
    served_model_name: Sequence[str] = option(
        (),
        "the names clients may send as the model: the first is the one /v1/models and replies show, the "
        "others are aliases, such as the model ids agents send by default (default: the model's own name)",
        parse=parse_model_name,
        nargs="+",
        metavar="NAME",
    )
    allowed_origins: Sequence[str] = option(
        (),
        "origins browsers may call from (CORS): a JSON list such as '[\"https://a.example\"]' or a "
        "comma-separated list; '*' allows any",
        parse=parse_origins,
    )
    dashboard_show_text: bool = option(
        False,
        "show the first tokens of cached prefixes as text on /dashboard (off: prompts are private)",
    )
    max_request_bytes: int = option(
        8 * 2**20,
        "largest request body, e.g. 8MiB (413 above it; default %(default)s)",
        parse=parse_bytes,
        show=format_bytes,
    )
    max_in_flight_per_tenant: int = option(
        256, "requests one tenant may have in flight before answering 429 (default %(default)s)"
    )
    preparation_threads: int = option(
        8,
        "threads that prepare requests (templating, tokenizing, compiling constraints) off the event "
        "loop (default %(default)s)",
    )
    max_preparing_per_tenant: int = option(
        2,
        "of those, how many one tenant's requests may hold at once; its others wait in its own queue "
        "(default %(default)s)",
    )
    kv_remote: str | None = option(
        None,
        "a Redis server that replicas share as the cache tier below the disk, e.g. redis://10.0.0.5:6379/0 "
        "or redis://USER@10.0.0.5:6379/0 (needs --tenant-secret-file; no password in it: see "
        "--kv-remote-password-file)",
        metavar="URL",
    )
    kv_remote_password_file: str | None = option(
        None,
        "a file (mode 600) holding the password of --kv-remote's Redis, read once at startup (default: "
        "$KVSERVE_KV_REMOTE_PASSWORD, which unlike an argument does not show in ps)",
        metavar="FILE",
    )
    tenant_secret_file: str | None = option(
        None,
        "the server secret (64 hex digits, mode 600) that derives tenants' cache namespaces; give every "
        "replica the same file so that a tenant has one namespace across them (default: "
        "$KVSERVE_TENANT_SECRET_FILE, else one created in the cache folder)",
        env="KVSERVE_TENANT_SECRET_FILE",
        metavar="FILE",
    )
    chat_template: str | None = option(
        None,
        "a file holding a Jinja chat template to use instead of the model's own",
        metavar="FILE",
    )
    tool_call_format: str = option(
        "auto",
        "how tools and tool calls are written: 'auto' takes the chat template's own format when it renders "
        "tools (Hermes/Qwen <tool_call>, Llama 3 JSON, Mistral [TOOL_CALLS], Phi-4 <|tool_call|>), else "
        "the generic format (default %(default)s)",
        choices=TOOL_CALL_FORMATS,
    )
    reasoning_parser: str = option(
        "auto",
        "split <think>...</think> off replies as reasoning_content: 'auto' when the chat template mentions "
        "<think> (default %(default)s)",
        choices=REASONING_PARSERS,
    )
    responses_max_stored: int = option(
        1024,
        "stored responses (POST /v1/responses with store) kept per tenant, least recently used first "
        "(default %(default)s)",
    )
    responses_max_stored_bytes: int = option(
        64 * 2**20,
        "bytes of stored responses kept per tenant, as memory holds them, e.g. 64MiB (default %(default)s)",
        parse=parse_bytes,
        show=format_bytes,
    )
    responses_max_total_bytes: int = option(
        2**30,
        "bytes of stored responses kept across all tenants, least recently used first, e.g. 1GiB: past it "
        "a store evicts other tenants' responses too (default %(default)s)",
        parse=parse_bytes,
        show=format_bytes,
    )
    responses_ttl_s: float = option(
        24 * 3600.0, "seconds a stored response is kept after it was made (default %(default)s)"
    )
    shutdown_grace_s: int = option(
        30,
        "seconds that requests in flight (streams included) get to finish after SIGTERM before their "
        "connections are cut (default %(default)s)",
        name="--shutdown-grace",
        metavar="SECONDS",
    )
    launch_nonce: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        # Kept as a tuple (a caller may pass a list); a bare string would read as one origin per letter.
        if isinstance(self.allowed_origins, str):
            raise ConfigError("allowed_origins must be a sequence of origins, not one string")
        object.__setattr__(self, "allowed_origins", tuple(self.allowed_origins))
        # One name may be given as a string (not as its letters); several as a sequence, kept as a tuple.
        names = self.served_model_name
        names = (names,) if isinstance(names, str) else tuple(names)
        for name in names:
            try:
                parse_model_name(name)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        object.__setattr__(self, "served_model_name", names)
        # Checked here, before anything loads: a bad option fails in a second, not after the model.
        check_kv_remote_secret(self.kv_remote, self.tenant_secret_file is not None)
        check_url_without_password("--kv-remote", self.kv_remote)
        if self.kv_remote_password_file is not None and self.kv_remote is None:
            raise ConfigError("--kv-remote-password-file needs --kv-remote")
        if not 0 <= self.port < 2**16:
            raise ConfigError(f"port must be between 0 and 65535, not {self.port}")
        if self.max_request_bytes < 1:
            raise ConfigError("max_request_bytes must be positive")
        if self.max_in_flight_per_tenant < 1:
            raise ConfigError("max_in_flight_per_tenant must be positive")
        if not 1 <= self.preparation_threads <= 1024:
            raise ConfigError("preparation_threads must be between 1 and 1024")
        if self.tool_call_format not in TOOL_CALL_FORMATS:
            raise ConfigError(f"tool_call_format must be one of {', '.join(TOOL_CALL_FORMATS)}")
        if self.reasoning_parser not in REASONING_PARSERS:
            raise ConfigError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}")
        if (
            min(self.responses_max_stored, self.responses_max_stored_bytes, self.responses_max_total_bytes)
            < 1
        ):
            raise ConfigError(
                "responses_max_stored, responses_max_stored_bytes and responses_max_total_bytes must be "
                "positive"
            )
        if not 0 < self.responses_ttl_s <= 365 * 24 * 3600:
            raise ConfigError("responses_ttl_s must be positive and at most a year")
        if not 0 <= self.shutdown_grace_s <= 24 * 3600:
            raise ConfigError("shutdown_grace_s (--shutdown-grace) must be between 0 and a day")
        if not 1 <= self.max_preparing_per_tenant <= self.preparation_threads:
            raise ConfigError("max_preparing_per_tenant must be between 1 and preparation_threads")
