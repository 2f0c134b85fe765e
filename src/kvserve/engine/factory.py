"""Engine wiring: one EngineConfig in, the parts an Engine runs on out.

`build_parts` loads the model (unless given one), sizes the KV pool, builds the model runner, the lower
cache tiers, the KVCacheManager, the scheduler, the request limits and the grammar compiler. The Engine
receives them ready (`Engine(parts)`; `Engine.from_config(config)` is the two together), so it holds no
construction logic, and a test can hand it parts built another way.
"""

import logging
import time
from dataclasses import dataclass, replace

import torch

from kvserve.cache.lower_tiers import LowerTiers
from kvserve.cache.manager import CacheConfig, KVCacheManager
from kvserve.cache.tiers import LowerTier
from kvserve.config import EngineConfig, format_bytes
from kvserve.engine.drafting import Drafter
from kvserve.engine.grammar import GrammarCompiler, GrammarLimits
from kvserve.engine.scheduler import Scheduler
from kvserve.engine.validation import RequestLimits
from kvserve.errors import ConfigError
from kvserve.model.fingerprint import model_fingerprint
from kvserve.model.gguf_weights import GgufWeights
from kvserve.model.heap import release_free_heap
from kvserve.model.kv_quant import kv_bytes_per_token
from kvserve.model.loader import LoadedModel, load_model
from kvserve.model.recurrent import state_specs
from kvserve.model.runner import TORCH_DTYPES, ModelRunner
from kvserve.model.spec import ROPE_LOCAL
from kvserve.secret import DISK_TIER_SEAL_PURPOSE, derive_key, load_or_create_secret

log = logging.getLogger("kvserve.engine")


@dataclass(frozen=True)
class EngineParts:
    """What an Engine runs on. `kv` owns the pool of `runner`'s KV cache; `scheduler` admits into `kv`;
    `limits` describe what a request may ask of this pool and model."""

    config: EngineConfig
    model: LoadedModel
    runner: ModelRunner
    kv: KVCacheManager
    scheduler: Scheduler
    limits: RequestLimits
    grammars: GrammarCompiler
    max_model_len: int
    bytes_per_block: int


def build_parts(config: EngineConfig, model: LoadedModel | None = None) -> EngineParts:
    """Build every part from `config`, loading the model unless `model` is given. Raises ConfigError for
    settings that cannot work with this model (a pool below one block, pins that would fill it, a
    context over what the model supports)."""
    if config.threads:
        torch.set_num_threads(config.threads)
    started = time.monotonic()
    loaded_here = model is None
    model = model or load_model(config.model, config.cache_dir)
    max_model_len = _max_model_len(config, model)
    bytes_per_block = kv_bytes_per_token(model.config, config.kv_cache_dtype) * config.block_size
    live_slots, checkpoint_slots, state_memory = state_slots(config, model)
    if live_slots and live_slots < config.max_num_seqs:
        log.info(
            "max_num_seqs %d -> %d: a running sequence's recurrent state takes a slot, and the live slots "
            "take at most a %dth of kv_cache_memory",
            config.max_num_seqs,
            live_slots,
            STATE_SHARE,
        )
        config = replace(config, max_num_seqs=live_slots)
    num_blocks = (config.kv_cache_memory - state_memory) // bytes_per_block
    if num_blocks < 1:
        raise ConfigError(
            f"kv_cache_memory {format_bytes(config.kv_cache_memory)} is below one KV block of this model "
            f"({format_bytes(bytes_per_block)}: {config.block_size} tokens): raise --kv-cache-memory or "
            "lower --block-size"
            + (f" (the recurrent states take {format_bytes(state_memory)} of it)" if state_memory else "")
        )
    num_blocks, num_sliding_blocks = _pools(config, model, max_model_len, num_blocks)
    runner = ModelRunner(
        model,
        num_blocks,
        config.block_size,
        max_model_len,
        config.device,
        config.dtype,
        config.weight_dtype,
        config.attention,
        config.cache_dir,
        config.kv_cache_dtype,
        config.activations == "int16",
        num_sliding_blocks or None,
        1 + live_slots + checkpoint_slots if live_slots else 1,
    )
    if loaded_here:
        # The runner's products hold the blocks they read (views of the mapped file); the loaded model
        # needs them no more, and the file pages that building them read leave the resident set (a page
        # read again comes back from the page cache).
        model = replace(model, quantized={})
        if isinstance(model.weights, GgufWeights):
            model.weights.file.drop_resident_pages()
    max_pinned_blocks = config.max_pinned_tokens // config.block_size
    if max_pinned_blocks >= num_blocks:
        raise ConfigError(
            f"max_pinned_tokens {config.max_pinned_tokens} leaves no room in a pool of "
            f"{num_blocks * config.block_size} tokens; lower it or raise kv_cache_memory"
        )
    cache_config = CacheConfig(
        num_blocks,
        config.block_size,
        config.enable_prefix_caching,
        max_pinned_blocks,
        max_pinned_blocks_per_namespace=(
            None
            if config.max_pinned_tokens_per_tenant is None
            else config.max_pinned_tokens_per_tenant // config.block_size
        ),
        num_sliding_blocks=num_sliding_blocks,
        sliding_window=max(w for w in model.config.windows if w is not None) if num_sliding_blocks else None,
        # Shares of what pins leave: the blocks every request may use.
        max_retained_blocks=int(config.max_retained * (num_blocks - max_pinned_blocks)),
        max_retained_blocks_per_namespace=int(config.retention_budget * (num_blocks - max_pinned_blocks)),
        live_state_slots=live_slots,
        state_checkpoint_slots=checkpoint_slots,
    )
    kv = KVCacheManager(cache_config, _lower_tiers(config, model, runner))
    limits = RequestLimits(
        vocab_size=model.config.vocab_size,
        max_model_len=max_model_len,
        # The KV tokens one request may use: the pool less what pins may hold.
        max_request_tokens=(num_blocks - max_pinned_blocks) * config.block_size,
        max_sequences_per_request=config.max_sequences_per_request,
    )
    tokenizer = model.tokenizer
    # Structured outputs: compiled where requests are validated, never on the engine thread's step.
    grammars = GrammarCompiler(
        tokenizer.backend,
        tokenizer.vocab_size,
        tokenizer.eos_token_ids,
        max_cached_bytes=config.grammar_cache_bytes,
        limits=GrammarLimits.from_config(config),
    )
    # What loading freed (the file's copies, the fingerprint's float rows) leaves the heap.
    release_free_heap()
    log.info(
        "engine ready in %.1fs: %s, %d KV blocks of %d tokens (%d tokens), %d sliding-layer blocks, "
        "max_model_len %d, prefix cache %s, disk tier %s, redis tier %s",
        time.monotonic() - started,
        model.name,
        num_blocks,
        config.block_size,
        num_blocks * config.block_size,
        num_sliding_blocks,
        max_model_len,
        "on" if config.enable_prefix_caching else "off",
        config.kv_disk or "off",
        "on" if config.kv_remote else "off",
    )
    drafter = Drafter(config.speculative_tokens) if config.speculative == "suffix" else None
    return EngineParts(
        config=config,
        model=model,
        runner=runner,
        kv=kv,
        scheduler=Scheduler(config, kv, drafter),
        limits=limits,
        grammars=grammars,
        max_model_len=max_model_len,
        # With a sliding pool of its own, a global block's share of the memory both pools take.
        bytes_per_block=config.kv_cache_memory // num_blocks if num_sliding_blocks else bytes_per_block,
    )


# Where the asked states leave no room for KV, the share of --kv-cache-memory a hybrid model's live states
# take, and its checkpoints as much again, so that the attention layers' KV keeps half. A real shape's
# state is megabytes: Qwen3.5-0.8B's is 19 MiB (1,644 tokens of its KV), so the default 64 running
# sequences and 256 checkpoints would take 6 GiB of the default 2.
STATE_SHARE = 4


def state_slots(config: EngineConfig, model: LoadedModel) -> tuple[int, int, int]:
    """A hybrid model's state pool (cache/state_pool.py): its live slots (one per running sequence, so at
    most `max_num_seqs`), its checkpoint slots (drafts' snapshots take theirs there), and the bytes they
    take with the model's scratch slot, out of --kv-cache-memory; (0, 0, 0) for any other model. Where
    `max_num_seqs` live slots and `state_checkpoints` leave less than a KV block, each group takes
    1 / STATE_SHARE of the memory instead, and the engine runs as many sequences as it has live slots."""
    if not model.config.hybrid:
        return 0, 0, 0
    per_slot = sum(
        s.num_bytes for s in state_specs(model.config, TORCH_DTYPES[config.dtype]) if s is not None
    )
    live = config.max_num_seqs
    # Without the prefix cache the checkpoint slots serve drafts' snapshots only: one per sequence.
    checkpoints = config.state_checkpoints if config.enable_prefix_caching else 0
    if config.speculative != "off" and not config.enable_prefix_caching:
        checkpoints = live
    block = kv_bytes_per_token(model.config, config.kv_cache_dtype) * config.block_size
    if (1 + live + checkpoints) * per_slot + block > config.kv_cache_memory:
        share = config.kv_cache_memory // STATE_SHARE // per_slot
        if share < 1:
            raise ConfigError(
                f"kv_cache_memory {format_bytes(config.kv_cache_memory)} holds no running sequence's "
                f"recurrent state ({format_bytes(per_slot)}, at most a {STATE_SHARE}th of it where the "
                "asked states do not fit): raise --kv-cache-memory"
            )
        live, checkpoints = min(live, share), min(checkpoints, share)
    return live, checkpoints, (1 + live + checkpoints) * per_slot


# What an all-sliding model's rope tables may take whatever its KV pool (see _max_model_len).
MIN_ROPE_TABLE_BYTES = 64 << 20
# The most blocks of an all-sliding model's global group (ids only, no KV memory): 1M blocks, about 50 MiB.
MAX_ID_BLOCKS = 1 << 20


def _pools(config: EngineConfig, model: LoadedModel, max_model_len: int, one_pool: int) -> tuple[int, int]:
    """The global pool's blocks and the sliding layers' own pool's (0: none, the sliding layers share the
    global ids) from `--kv-cache-memory`; `one_pool` is the blocks of every layer it holds.

    A sliding model splits the memory (with the prefix cache on or off) so that one request at `max_model_len`
    fills both pools alike: global bytes / sliding bytes = G * L / (S * (W + 2 * block_size)), G and S
    the global and sliding layers, L the context and W the largest window. The sliding pool holds at
    least one request's window and largest chunk, so a request the global pool fits is always admitted.
    An all-sliding model's global group costs no KV memory: its pool is sized in blocks, a whole context
    per sequence the sliding pool holds and the scheduler runs at once, within MAX_ID_BLOCKS (block ids
    cost about 50 bytes each, and a context of 2**24 tokens times 64 sequences would be 4 GiB of them) but
    never below one whole context. The split is taken only where it holds at least as many tokens as one
    pool would, so that it never shrinks what a request may use.
    """
    c, bs = model.config, config.block_size
    windows = [w for w in c.windows if w is not None]
    if not windows:
        return one_pool, 0
    layer_block = kv_bytes_per_token(c, config.kv_cache_dtype) // c.num_layers * bs
    num_sliding, num_global = len(windows), c.num_layers - len(windows)
    window = max(windows)
    need = -(-(window + config.max_num_batched_tokens) // bs) + 1
    memory = config.kv_cache_memory
    if num_global:
        share = num_sliding * (window + 2 * bs)
        sliding_bytes = memory * share // (num_global * max_model_len + share)
        sliding = max(need, sliding_bytes // (num_sliding * layer_block))
        global_blocks = (memory - sliding * num_sliding * layer_block) // (num_global * layer_block)
    else:
        sliding = memory // (num_sliding * layer_block)
        context = -(-max_model_len // bs)
        sequences = min(config.max_num_seqs, max(1, sliding // (-(-window // bs) + 1)))
        global_blocks = max(context, min(context * sequences, MAX_ID_BLOCKS))
    if sliding < need or global_blocks < one_pool:
        return one_pool, 0
    return global_blocks, sliding


def _lower_tiers(config: EngineConfig, model: LoadedModel, runner: ModelRunner) -> LowerTiers | None:
    """The disk and Redis tiers that config asks for, in that order below memory; None when neither."""
    if config.kv_disk is None and config.kv_remote is None:
        return None
    # Imported here: a server without tiers never loads the Redis client (a tenth of a second).
    from kvserve.cache.disk_tier import DiskTier
    from kvserve.cache.redis_tier import RedisTier

    fingerprint = model_fingerprint(
        model,
        config.weight_dtype,
        config.activations,
        config.block_size,
        config.kv_cache_dtype,
        config.cache_dir,
    )
    secret = config.secret if config.secret is not None else load_or_create_secret(config.cache_dir)
    tiers: list[LowerTier] = []
    if config.kv_disk is not None:
        seal_key = derive_key(secret, DISK_TIER_SEAL_PURPOSE)
        tiers.append(DiskTier(config.kv_disk, config.kv_disk_size, fingerprint, seal_key))
    if config.kv_remote is not None:
        tiers.append(RedisTier(config.kv_remote, secret))
    return LowerTiers(tiers, runner.kv_cache, fingerprint, config.block_size, runner.state)


def _max_model_len(config: EngineConfig, model: LoadedModel) -> int:
    """The context served: `--max-model-len`, else the model's own maximum (both attention backends
    apply a sliding layer's window, so the context runs to it whatever the windows).

    The rope tables hold a row per position the global pool holds (4 * rotary_dim bytes, cos and sin in
    float32). A model with a global layer fills its KV pool long before its tables cost as much; an
    all-sliding model's sequences hold only their windows of KV, so its context is bounded by the tables
    instead: at most what `kv_cache_memory` would hold of them (or MIN_ROPE_TABLE_BYTES, for a small
    pool). Past that, the model's own maximum is capped (and logged), and an asked one refused."""
    c = model.config
    limit = c.max_position_embeddings
    asked = config.max_model_len
    if asked is not None and asked > limit:
        raise ConfigError(f"max_model_len {asked} exceeds what the model supports ({limit})")
    if not c.windows or None in c.windows:
        return asked or limit
    row = 4 * c.rotary_dim * (2 if ROPE_LOCAL in c.layer_ropes else 1)
    fits = max(config.kv_cache_memory, MIN_ROPE_TABLE_BYTES) // row
    if asked is not None and asked > fits:
        raise ConfigError(
            f"max_model_len {asked} needs {format_bytes(asked * row)} of rope tables, more than "
            f"kv_cache_memory {format_bytes(config.kv_cache_memory)} (or "
            f"{format_bytes(MIN_ROPE_TABLE_BYTES)}): lower --max-model-len or raise --kv-cache-memory"
        )
    if asked is None and limit > fits:
        log.info(
            "the model's context of %d tokens is capped to %d: every layer slides, and the rope tables of "
            "more would take more than kv_cache_memory (--max-model-len sets it)",
            limit,
            fits,
        )
        return fits
    return asked or limit
