"""The startup probe: a few timed steps of the real model, with and without draft rows, so that the
drafter knows what a row costs on this machine and model before the first request.

Each probe step decodes 1 or 4 sequences, each with 0, 2 or 4 draft rows, at a short and a longer context,
on blocks taken from the pool's free list for that step only and handed back in the order taken (the
free list is then as it was). Nothing else is touched: no sequence is admitted, nothing is published to
the prefix cache or counted, and no request sees the blocks' contents (a block's KV is always written
before it is read). The shapes run in up to ROUNDS rounds and each keeps its fastest time: another process
on the cores only ever slows a step, and one slowed step among a handful would skew the fit (which a
server that always decodes one sequence never corrects: its steps cannot tell the fixed part from a
row). The steps stop once `budget_s` is spent (after the warm-up and MIN_STEPS shapes), so a big model
probes with three steps. `probe_steps` gives the steps one at a time, so that a server answers between
them (engine/async_engine.py runs them once it listens). A server that does not draft runs the warm-up
step alone (`warm_up_steps`), so that its first request does not pay for mapping the weights.
"""

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvserve.cache.manager import KVCacheManager
from kvserve.model.runner import ForwardBatch, ModelRunner, SequenceChunk

# A second at most, the default model's probe taking about a third of it (the budget bounds big models).
PROBE_BUDGET_S = 1.0
# (decodes, draft rows per decode), in the order run: the first warms the kernels and is not kept.
SHAPES = ((1, 0), (1, 0), (1, 4), (4, 0), (4, 2), (1, 2))
# The shapes kept whatever the budget: a decode alone and with draft rows, the least that tells a row's cost.
MIN_STEPS = 2
# Rounds of the shapes (the warm-up runs once), budget permitting.
ROUNDS = 3
# The decodes' context lengths, taken in turn; cut to what the pool and the context allow.
CONTEXTS = (32, 512)


@dataclass(frozen=True)
class ProbeStep:
    decodes: int
    drafts: int
    seconds: float


def probe_steps(
    runner: ModelRunner,
    kv: KVCacheManager,
    max_model_len: int,
    clock: Callable[[], float],
    budget_s: float = PROBE_BUDGET_S,
) -> Iterator[ProbeStep | None]:
    """The probe's steps, each run as it is asked for (yielding None), then each shape of `SHAPES` (the
    warm-up left out) with its fastest time over the rounds run, which runs nothing: fewer shapes when the
    budget runs out (MIN_STEPS at least), none when the pool or the context cannot hold the smallest one.
    Each step takes its blocks from the free list as it is then and hands them back before it yields."""
    fastest: dict[int, ProbeStep] = {}
    started = clock()
    vocab = runner.transformer.config.vocab_size
    runs = [(0, SHAPES[0])] + [(i, shape) for _ in range(ROUNDS) for i, shape in enumerate(SHAPES) if i]
    for i, (decodes, drafts) in runs:
        context = _context(kv, max_model_len, decodes, drafts, CONTEXTS[i % len(CONTEXTS)])
        if context < 1:
            continue
        seconds = timed_step(runner, kv, clock, decodes, drafts, context, vocab)
        yield None
        if i == 0:
            continue
        if i not in fastest or seconds < fastest[i].seconds:
            fastest[i] = ProbeStep(decodes, drafts, seconds)
        if len(fastest) >= MIN_STEPS and clock() - started >= budget_s:
            break
    yield from (fastest[i] for i in sorted(fastest))


def warm_up_steps(
    runner: ModelRunner, kv: KVCacheManager, max_model_len: int, clock: Callable[[], float]
) -> Iterator[None]:
    """The probe's warm-up step alone, for a server that does not draft (no costs to probe): one decode
    reads every weight, so the first request finds the file's pages mapped (the load drops them) and the
    kernels' paths warm, as llama-server's warm-up run at load does. Nothing when the pool or the context
    cannot hold it."""
    decodes, drafts = SHAPES[0]
    context = _context(kv, max_model_len, decodes, drafts, CONTEXTS[0])
    if context >= 1:
        timed_step(runner, kv, clock, decodes, drafts, context, runner.transformer.config.vocab_size)
        yield None


def _context(kv: KVCacheManager, max_model_len: int, decodes: int, drafts: int, wanted: int) -> int:
    """The longest context up to `wanted` whose step the free blocks (of both pools) and the model hold."""
    free = kv.sliding.free_blocks(kv.pool.num_free)
    per_sequence = free // decodes * kv.block_size
    return min(wanted, per_sequence - drafts - 1, max_model_len - drafts - 1)


def timed_step(
    runner: ModelRunner,
    kv: KVCacheManager,
    clock: Callable[[], float],
    decodes: int,
    drafts: int,
    context: int,
    vocab: int,
) -> float:
    per_sequence = math.ceil((context + 1 + drafts) / kv.block_size)
    taken = kv.pool.allocate(per_sequence * decodes)
    sliding = kv.sliding.take(len(taken))
    try:
        chunks: list[SequenceChunk] = []
        for s in range(decodes):
            table = taken[s * per_sequence : (s + 1) * per_sequence]
            sliding_table = None if sliding is None else sliding[s * per_sequence : (s + 1) * per_sequence]
            for j in range(1 + drafts):
                token = (7919 * (s * 16 + j) + 1) % vocab
                chunks.append(SequenceChunk([token], context + j, table, True, sliding_table=sliding_table))
        began = clock()
        runner.execute(ForwardBatch(decodes=chunks))
        return clock() - began
    finally:
        # In reverse: each release appends to the free list, which then reads as before the allocation.
        for block in reversed(taken):
            kv.pool.release(block)
        kv.sliding.give_back(sliding)
