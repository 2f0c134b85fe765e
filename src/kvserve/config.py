"""EngineConfig: every knob of the engine in one frozen, validated dataclass; the fields that
`kvserve` commands set carry their flag (kvserve.flags)."""

import os
import re
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from kvserve.errors import ConfigError
from kvserve.flags import option, positive_int

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(value: str | int) -> int:
    """'2GiB' -> 2147483648; plain integers are bytes."""
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", value)
    if m is None or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"invalid size {value!r}: use a number with an optional unit, e.g. 512MiB or 2GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_bytes(value: int) -> str:
    """2147483648 -> '2GiB': the largest binary unit that divides it, which parse_bytes reads back."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        size = _UNITS[unit.lower()]
        if value and value % size == 0:
            return f"{value // size}{unit}"
    return str(value)


# Each choice list is defined here once: the flags offer it, validation checks it, the model maps it.
# float64 is for reference runs (exact enough that batch shapes never flip a greedy token).
COMPUTE_DTYPES = ("float32", "float16", "bfloat16", "float64")
WEIGHT_DTYPES = ("gguf", "q8_0", "float32", "float16", "int8")
ACTIVATIONS = ("int16", "float32")
KV_DTYPES = ("auto", *COMPUTE_DTYPES, "q8_0")
ATTENTION_BACKENDS = ("auto", "native", "torch")
SPECULATIVE = ("suffix", "off")
# Draft tokens one sequence may verify in a step at most: each is a row of the step.
MAX_SPECULATIVE_TOKENS = 64

# The grammar library's limits (engine/grammar.py, GrammarLimits) and the compiled-grammar cache's size.
# Real constraints (JSON schemas with strings of 200 characters, formats and patterns, 64 tools, 1,024
# choices) stay within 3,000 lexer states and a step fuel of 10,000; a Lark grammar of 60 overlapping
# regex terminals reached the library's own cap of 250,000 states (about 155 MiB) in 12 tokens.
GRAMMAR_MAX_LEXER_STATES = 10_000
GRAMMAR_STEP_LEXER_FUEL = 50_000
GRAMMAR_STEP_MAX_ITEMS = 50_000
GRAMMAR_INITIAL_LEXER_FUEL = 1_000_000
GRAMMAR_MAX_SIZE = 500_000
DEFAULT_GRAMMAR_CACHE_BYTES = 32 * 2**20


def _threads_or_none(text: str) -> int | None:
    """--single-token-threads: 0 turns the separate count off (every step uses --threads)."""
    number = int(text)
    return None if number == 0 else number


def check_kv_remote_secret(kv_remote: str | None, secret_given: bool) -> None:
    """The Redis tier's rule, for EngineConfig (`secret`) and ServerOptions (`tenant_secret_file`) alike:
    a Redis URL needs a secret given on purpose, never the cache folder's own, which differs per replica."""
    if kv_remote is not None and not secret_given:
        raise ConfigError(
            "--kv-remote needs --tenant-secret-file (or KVSERVE_TENANT_SECRET_FILE; EngineConfig.secret in "
            "Python) naming a secret that every replica shares: each replica's own secret would give a "
            "tenant another namespace on each replica (so nothing in Redis would ever match) and another "
            "key for the blocks' seals"
        )


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.environ.get("KVSERVE_CACHE_DIR") or os.path.join(base, "kvserve")


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs one model. Validated on construction: a bad value raises ConfigError at startup.

    `kv_cache_memory` is the byte budget of the paged KV pool; `max_num_batched_tokens` bounds the tokens
    of one forward pass (decodes plus prefill chunks), which is what keeps long prefills from stalling
    running streams. `max_model_len=None` takes the model's own context length. `seed` seeds the sampling
    of requests that bring no seed of their own. `single_token_threads`, when set, is the thread count
    of a step that computes one token (one stream decoding alone), for a machine where the server's
    event loop should keep cores of its own; unset, every step runs on `threads` (docs/design.md,
    Threads, says why that is the default). `attention` is the attention backend of decode and
    prefill rows: "native" (a C kernel built on first use; bitwise batch-invariant), "torch" (portable)
    or "auto" (native where it can run: CPU, float32 or float64, a C compiler present).
    `kv_dtype` is the KV cache's dtype (see `kv_cache_dtype`); with float16 the cache holds twice the
    tokens per byte, with q8_0 (kvserve.model.kv_quant) 1.88x float16's, and every attention path reads
    the same rounded values.

    `kv_disk`, when set, is the folder of the disk tier: blocks computed in memory are also written
    there (behind the step) and found again after eviction or a restart; `kv_disk_size` bounds it.
    `kv_remote`, when set, is the URL of a Redis server that replicas share as the tier below the disk
    (redis://host:port/db, redis://user:password@host:port/db; not in the repr); it needs `secret` set to
    the secret every replica shares, from which the tier derives its sealing and key-name keys.
    `max_pinned_tokens` is how much of the pool prefixes may be pinned in (0: pinning off); it is held
    back from the largest request the engine accepts, so that pins never starve a request.
    `max_pinned_tokens_per_tenant` caps one cache namespace's pins (a tenant's, or a shared group's;
    None: the whole `max_pinned_tokens`).
    `retention_budget` and `max_retained` are shares of the pool left after pins: what one cache
    namespace's retentions (prompt-cache breakpoints, cache/retention.py) may hold, and what all of them
    together may; past either, the oldest retentions are trimmed, and `max_retained` 0 turns
    retention off (as the prefix cache off does). Retained blocks are not held back from requests: they
    give way when a request could not run otherwise.

    `max_sequences_per_request` caps the sequences one request may start: its `n`, and prompts x n for a
    batch of prompts (each sequence is one engine request, counted in the queue and its tenant's share).
    `max_waiting + max_num_seqs` is how many sequences may be in flight; each tenant is guaranteed an
    equal share of them (docs/design.md, *Policy apart from mechanism*).

    `secret` is the server secret (kvserve.secret): the disk tier's files are sealed under a key derived
    from it. None takes the cache folder's (created on first use), the one `kvserve serve` uses too, so
    the server and offline `LLM` runs on one cache folder read each other's disk tier. It never shows in
    the config's repr.
    """

    model: str | None = option(None, "GGUF file or Hugging Face folder (default: SmolLM2-135M-Instruct)")
    device: str = option("cpu", "torch device, e.g. cpu or cuda")
    dtype: str = option("float32", choices=COMPUTE_DTYPES)
    weight_dtype: str = option(
        "gguf",
        "storage of the linear weights: gguf (a GGUF's own quantized blocks, run natively; the float32 "
        "model at a fraction of its bytes; float16 for other models), q8_0 (8-bit blocks made at load), "
        "float32 (exact), float16 (half the bytes) or int8 (per-channel); default %(default)s",
        choices=WEIGHT_DTYPES,
    )
    activations: str = option(
        "int16",
        "with gguf or q8_0 weights, the activations of every row of the integer blocks' products: int16 "
        "(quantized per block of 32, exact integer products: nearly float32's predictions, at every batch "
        "size faster, 1.1-1.8x, as measured in docs/benchmarks.md) or float32 (the exact mode: the float32 "
        "model up to summation order); a row's bits never depend on its batch either way; default "
        "%(default)s",
        choices=ACTIVATIONS,
    )
    kv_dtype: str = option(
        "auto",
        "dtype of the KV cache: auto (float16 under --dtype float32, else --dtype), float16 (twice the "
        "tokens per byte), q8_0 (blocks of 32 int8 values and a float16 scale: 1.88x float16's tokens "
        "per byte; needs a head size that is a multiple of 32) or float32; default %(default)s",
        choices=KV_DTYPES,
    )
    attention: str = option(
        "auto",
        "attention of decode and prefill rows: native (a C kernel built on first use, reads the paged "
        "cache in place, bitwise batch-invariant), torch (portable) or auto (native where it can run); "
        "default %(default)s",
        choices=ATTENTION_BACKENDS,
    )
    block_size: int = option(16, "tokens per KV block")
    kv_cache_memory: int = option(
        2 * 2**30,
        "KV cache budget, e.g. 512MiB or 2GiB (default %(default)s)",
        parse=parse_bytes,
        show=format_bytes,
    )
    max_model_len: int | None = option(None, "context length (default: the model's)")
    max_num_seqs: int = option(64, "requests decoded together at most")
    max_num_batched_tokens: int = option(1024, "tokens per forward pass at most")
    max_waiting: int = option(1024, "queued requests before answering 503")
    speculative: str = option(
        "suffix",
        "speculative decoding: suffix (drafts from the request's own text and its namespace's recent "
        "replies, verified exactly as extra rows of the step) or off; default %(default)s",
        choices=SPECULATIVE,
    )
    speculative_tokens: int = option(
        8,
        f"draft tokens one sequence may verify in a step, 1 to {MAX_SPECULATIVE_TOKENS} "
        "(default %(default)s)",
        parse=positive_int,
    )
    max_sequences_per_request: int = option(
        256,
        "sequences (prompts x n) one request may start before answering 400 (default %(default)s)",
        parse=positive_int,
    )
    enable_prefix_caching: bool = option(
        True, "disable prefix caching (for baselines)", name="--no-prefix-cache"
    )
    state_checkpoint_interval: int = option(
        0,
        "hybrid models: keep a checkpoint of the recurrent state every N tokens of a sequence, besides "
        "the structural ones (prompt and reply ends, message boundaries); 0: only those "
        "(default %(default)s)",
    )
    state_checkpoints: int = option(
        256,
        "hybrid models: recurrent-state checkpoints the prefix cache may keep, counted in "
        "--kv-cache-memory (default %(default)s)",
    )
    cache_aware_scheduling_bound: int = 32
    threads: int | None = option(None, "torch CPU threads (default: torch's choice)")
    single_token_threads: int | None = option(
        None,
        "threads for a step of one token (one stream decoding alone), leaving the other cores to HTTP; "
        "0 or unset: --threads for every step",
        parse=_threads_or_none,
    )
    seed: int = 0
    cache_dir: str = field(default_factory=default_cache_dir)
    kv_disk: str | None = option(
        None,
        "disk tier: keep KV blocks in DIR too, found again after eviction or a restart",
        metavar="DIR",
    )
    kv_disk_size: int = option(20 * 2**30, "disk tier budget, e.g. 20GiB (default 20GiB)", parse=parse_bytes)
    # Out of the repr: in Python (never on a command line) the URL may carry the Redis password.
    kv_remote: str | None = field(default=None, repr=False)
    max_pinned_tokens: int = option(
        0, "KV tokens that POST /v1/cache/pin may hold in memory (held back from requests); 0: off"
    )
    max_pinned_tokens_per_tenant: int | None = option(
        None, "of those, what one tenant (or shared group) may pin (default: all of them)"
    )
    retention_budget: float = option(
        0.25,
        "share of the KV pool (less pins) one tenant's (or shared group's) cache_control retentions may "
        "hold; past it the tenant's oldest retentions are trimmed (default %(default)s)",
    )
    max_retained: float = option(
        0.5,
        "share of the KV pool (less pins) all retentions together may hold, below 1; 0: retention off "
        "(default %(default)s)",
    )
    grammar_max_lexer_states: int = option(
        GRAMMAR_MAX_LEXER_STATES,
        "lexer states one request's constraint may build (about 0.65 KB each); a request that needs "
        "more ends with finish_reason grammar_limit (default %(default)s)",
        parse=positive_int,
    )
    grammar_step_lexer_fuel: int = option(
        GRAMMAR_STEP_LEXER_FUEL,
        "lexer work one token's mask may take (the library's fuel, about 14,000 a millisecond); over "
        "it the request ends with grammar_limit (default %(default)s)",
        parse=positive_int,
    )
    grammar_step_max_items: int = option(
        GRAMMAR_STEP_MAX_ITEMS,
        "parser items one token's mask may build (default %(default)s)",
        parse=positive_int,
    )
    grammar_initial_lexer_fuel: int = option(
        GRAMMAR_INITIAL_LEXER_FUEL,
        "lexer work building a constraint's matcher may take; over it the request is a 400 "
        "(default %(default)s)",
        parse=positive_int,
    )
    grammar_max_size: int = option(
        GRAMMAR_MAX_SIZE,
        "symbols a constraint's grammar may have; over it the request is a 400 (default %(default)s)",
        parse=positive_int,
    )
    grammar_cache_bytes: int = option(
        DEFAULT_GRAMMAR_CACHE_BYTES,
        "bytes the compiled-grammar cache may hold, e.g. 32MiB (default %(default)s)",
        parse=parse_bytes,
        show=format_bytes,
    )
    secret: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        for name in ("kv_cache_memory", "kv_disk_size", "grammar_cache_bytes"):
            if isinstance(getattr(self, name), str):
                object.__setattr__(self, name, parse_bytes(getattr(self, name)))
        checks: list[tuple[bool, str]] = [
            (
                self.block_size > 0 and self.block_size & (self.block_size - 1) == 0,
                f"block_size must be a power of 2, not {self.block_size}",
            ),
            (self.kv_cache_memory > 0, "kv_cache_memory must be positive"),
            (self.kv_disk_size > 0, "kv_disk_size must be positive"),
            (
                self.kv_disk is None or self.enable_prefix_caching,
                "kv_disk needs the prefix cache: drop --no-prefix-cache or --kv-disk",
            ),
            (
                self.kv_remote is None or self.enable_prefix_caching,
                "kv_remote needs the prefix cache: drop --no-prefix-cache or --kv-remote",
            ),
            (
                self.kv_remote is None or urlsplit(self.kv_remote).scheme in ("redis", "rediss", "unix"),
                # Without the URL itself, which may hold a password.
                "kv_remote must be a redis://, rediss:// or unix:// URL",
            ),
            (self.max_pinned_tokens >= 0, "max_pinned_tokens must be >= 0"),
            (0 <= self.retention_budget <= 1, "retention_budget must be between 0 and 1"),
            (0 <= self.max_retained < 1, "max_retained must be at least 0 and below 1"),
            *(
                # The library takes machine-sized integers: a larger value would fail in it, not here.
                (0 < getattr(self, name) < 2**31, f"{name} must be between 1 and {2**31 - 1}")
                for name in (
                    "grammar_max_lexer_states",
                    "grammar_step_lexer_fuel",
                    "grammar_step_max_items",
                    "grammar_initial_lexer_fuel",
                    "grammar_max_size",
                )
            ),
            (self.grammar_cache_bytes > 0, "grammar_cache_bytes must be positive"),
            (self.secret is None or len(self.secret) >= 16, "secret must be at least 16 bytes"),
            (
                self.max_pinned_tokens_per_tenant is None or self.max_pinned_tokens_per_tenant >= 0,
                "max_pinned_tokens_per_tenant must be >= 0",
            ),
            (self.max_model_len is None or self.max_model_len > 0, "max_model_len must be positive"),
            (self.max_num_seqs > 0, "max_num_seqs must be positive"),
            (self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be positive"),
            (self.max_waiting > 0, "max_waiting must be positive"),
            (self.speculative in SPECULATIVE, f"speculative must be one of {', '.join(SPECULATIVE)}"),
            (
                0 < self.speculative_tokens <= MAX_SPECULATIVE_TOKENS,
                f"speculative_tokens must be between 1 and {MAX_SPECULATIVE_TOKENS}",
            ),
            (self.max_sequences_per_request > 0, "max_sequences_per_request must be positive"),
            (self.state_checkpoint_interval >= 0, "state_checkpoint_interval must be >= 0"),
            (self.state_checkpoints >= 0, "state_checkpoints must be >= 0"),
            (self.cache_aware_scheduling_bound >= 0, "cache_aware_scheduling_bound must be >= 0"),
            (self.threads is None or self.threads > 0, "threads must be positive"),
            (
                self.single_token_threads is None or self.single_token_threads > 0,
                "single_token_threads must be positive",
            ),
            (self.dtype in COMPUTE_DTYPES, f"dtype must be one of {', '.join(COMPUTE_DTYPES)}"),
            (
                self.attention in ATTENTION_BACKENDS,
                f"attention must be one of {', '.join(ATTENTION_BACKENDS)}",
            ),
            (self.kv_dtype in KV_DTYPES, f"kv_dtype must be one of {', '.join(KV_DTYPES)}"),
            (
                self.activations in ACTIVATIONS,
                f"activations must be one of {', '.join(ACTIVATIONS)}",
            ),
            (self.weight_dtype in WEIGHT_DTYPES, f"weight_dtype must be one of {', '.join(WEIGHT_DTYPES)}"),
            (
                self.weight_dtype != "int8"
                or (self.device.split(":")[0] == "cpu" and self.dtype == "float32"),
                "weight_dtype int8 needs device cpu and dtype float32: use weight_dtype float32 or float16",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        check_kv_remote_secret(self.kv_remote, self.secret is not None)

    @property
    def kv_cache_dtype(self) -> str:
        """The KV cache's dtype: `kv_dtype`, where "auto" is float16 under float32 compute (half the bytes
        per cached token; the greedy replies are float32's, see tests/model/test_kv_quant_float16.py) and the
        compute dtype otherwise (float64 reference runs stay exact)."""
        if self.kv_dtype != "auto":
            return self.kv_dtype
        return "float16" if self.dtype == "float32" else self.dtype
