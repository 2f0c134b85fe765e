"""TierLoads: the memory tier's one object for the tiers below it, and NoTiers when there are none.

It joins the LowerTiers (which keys, offers, reads and lands blocks, lower_tiers.py) with the
BlockLoader that reads them off the engine thread (loader.py). The KVCacheManager asks it to start a
load that would continue a memory match, to read a pin's blocks at once, to land what arrived into
fresh memory blocks of a sequence (`land`: each joins the tree as if just computed), and offers it
every newly published full block (and a hybrid model's every new checkpoint, `offer_state`; one read
joins the tree through `write_state`). `NoTiers` answers the same calls with nothing to read and nowhere
to write.

Invariant: the loader holds host tensors only (no pool block, no reference, no tree node is ever its),
and a block read from a tier is verified there before it is landed.
"""

import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

import torch

from kvserve.cache.accounting import BlockAccounts
from kvserve.cache.loader import LOAD_BUDGET_S, BlockLoader, LoadJob
from kvserve.cache.lower_tiers import LowerTiers
from kvserve.cache.sequence_blocks import SequenceBlocks
from kvserve.cache.state_pool import StatePool
from kvserve.cache.tier_states import FoundState, TierStates, WantedState
from kvserve.cache.tiers import TIER_MEMORY, Arrived, TierUsage
from kvserve.model.recurrent import StateShapeError

log = logging.getLogger("kvserve.cache")


class NoTiers:
    """No tier below memory: nothing to load, nothing to offer."""

    enabled = False

    def set_budget(self, seconds: float) -> None:
        """How long a request waits at most for blocks read from the tiers (tests change it)."""

    def start_load(self, namespace: str, prompt: Sequence[int], states: bool = False) -> LoadJob | None:
        """A job reading the blocks of `prompt` past its memory match that a tier may hold, or None:
        nothing to read. With `states` (a hybrid model's) the job also looks for a checkpoint past
        memory's last one, within the KV it reaches."""
        return None

    @staticmethod
    def ready(job: LoadJob) -> bool:
        """Whether the job's blocks have arrived, or its budget is over."""
        return BlockLoader.ready(job)

    def restart_load(self, job: LoadJob) -> LoadJob | None:
        """The job read again from where memory's match now ends, or None: `job` is fine as it is."""
        return None

    def cancel(self, job: LoadJob) -> None:
        """Drop the job and what it read."""

    def take(self, job: LoadJob | None) -> list[Arrived]:
        """The blocks that arrived for `job`; the job is over."""
        return []

    def take_state(self, job: LoadJob | None) -> FoundState | None:
        """The state checkpoint found for `job` (before `take`)."""
        return None

    @property
    def pending(self) -> int:
        """Loads started and neither taken nor cancelled."""
        return 0

    def wait(self, timeout_s: float) -> None:
        """Return once a load is ready (at once if one is), or after `timeout_s`."""

    def read_now(self, namespace: str, tokens: Sequence[int], start: int) -> list[Arrived]:
        """The full blocks `start..` of `tokens` that the tiers hold, read on this thread within the
        loader's budget."""
        return []

    def land(
        self,
        seq: SequenceBlocks,
        tokens: Sequence[int],
        arrived: Sequence[Arrived],
        hits: dict[str, int],
        job: LoadJob | None = None,
    ) -> int:
        """Copy `arrived` (read from the lower tiers, for `job` or at once) into fresh blocks of `seq`,
        continuing its memory match of `tokens`; each joins the tree and stays locked for `seq`, and
        `hits` counts them by tier. Returns how many landed."""
        return 0

    def offer(
        self,
        keys: list[bytes],
        namespace: str,
        tokens: Sequence[int],
        blocks: Sequence[int],
        start: int,
        sliding: Sequence[int] | None,
    ) -> None:
        """Blocks `start..` of `blocks` were just computed: every tier that lacks one gets a copy."""

    def offer_state(
        self,
        keys: list[bytes],
        namespace: str,
        tokens: Sequence[int],
        position: int,
        slot: int,
        pool: StatePool,
    ) -> None:
        """The checkpoint in `slot` (after `tokens[:position]`) joined the tree: every tier that lacks it
        gets a copy."""

    def write_state(self, slot: int, found: FoundState, pool: StatePool) -> bool:
        """Write a checkpoint read from a tier into `slot`; False, writing nothing, where its tensors
        disagree with the model's state."""
        return False

    def usage(self) -> tuple[TierUsage, ...]:
        return ()

    def down(self) -> bool:
        """Whether a tier below memory is down now (its blocks cannot come back)."""
        return False

    def flush(self) -> None:
        """Wait until every load is ready and every offered block written (tests)."""

    def close(self) -> None:
        """Stop the loader, write what is queued, stop the tiers."""


class TierLoads(NoTiers):
    """The tiers below memory and the loader that reads them off the engine thread."""

    enabled = True

    def __init__(self, lower: LowerTiers, accounts: BlockAccounts, budget_s: float = LOAD_BUDGET_S) -> None:
        self.lower = lower
        self.accounts = accounts
        self.states = TierStates(lower, lower.state_io) if lower.state_io is not None else None
        self.loader = BlockLoader(lower, states=self.states, budget_s=budget_s)
        # State checkpoints read from a tier whose tensors disagreed with the model's (a miss), by tier:
        # counted in that tier's `loads_failed` beside the values the tier itself refused.
        self.states_refused: Counter[str] = Counter()

    def _matched(self, namespace: str, tokens: Sequence[int]) -> int:
        """How many whole blocks of `tokens` memory holds now (nothing locked)."""
        return len(self.accounts.tree.match(namespace, tokens, record_hit=False).blocks)

    def set_budget(self, seconds: float) -> None:
        self.loader.budget_s = seconds

    def _wanted(self, namespace: str, prompt: Sequence[int]) -> WantedState:
        """A hybrid model's state lookup as memory stands now: past its last checkpoint of `prompt`,
        within the KV it holds."""
        tree = self.accounts.tree
        after = tree.match(namespace, prompt, record_hit=False, checkpointed=True).num_tokens
        end = tree.match(namespace, prompt, record_hit=False).num_tokens
        return WantedState(after, end, tuple(prompt))

    def start_load(self, namespace: str, prompt: Sequence[int], states: bool = False) -> LoadJob | None:
        start = self._matched(namespace, prompt)
        blocks = self.lower.may_continue(namespace, prompt, start)
        bs = self.accounts.block_size
        whole = len(prompt) // bs * bs
        if not states:
            return self.loader.submit(namespace, tuple(prompt[:whole]), start) if blocks else None
        if self.states is None:
            return None
        wanted = self._wanted(namespace, prompt)
        if not blocks and wanted.end <= wanted.after:
            return None
        # Blocks from `start` too, whatever `blocks` said (a tier may have one by the time it is read).
        return self.loader.submit(namespace, tuple(prompt[:whole]), start, wanted=wanted)

    def restart_load(self, job: LoadJob) -> LoadJob | None:
        """A ready job that memory's losses made stale is read again from what memory still holds,
        within the same budget: its blocks no longer continue the memory match, or (a hybrid model's)
        memory lost the checkpoint the job's state lookup started after and the job found none newer,
        so the lookup must reach back to memory's last one now."""
        if job.deadline is None or time.monotonic() >= job.deadline:
            return None
        start = self._matched(job.namespace, job.tokens)
        wanted, lost_state = job.wanted, False
        if job.wanted is not None:
            wanted = self._wanted(job.namespace, job.wanted.tokens)
            lost_state = job.state is None and wanted.after < job.wanted.after
        if start >= job.start and not lost_state:
            return None
        self.loader.cancel(job)
        return self.loader.submit(job.namespace, job.tokens, start, job.deadline, wanted)

    def cancel(self, job: LoadJob) -> None:
        self.loader.cancel(job)

    def take(self, job: LoadJob | None) -> list[Arrived]:
        return self.loader.take(job) if job is not None else []

    def take_state(self, job: LoadJob | None) -> FoundState | None:
        return self.loader.take_state(job) if job is not None else None

    def offer_state(
        self,
        keys: list[bytes],
        namespace: str,
        tokens: Sequence[int],
        position: int,
        slot: int,
        pool: StatePool,
    ) -> None:
        if self.states is not None:
            states = self.states
            self.states.offer(
                keys, namespace, tokens, position, lambda: states.io.read_slot(self._now(pool, slot))
            )

    def write_state(self, slot: int, found: FoundState, pool: StatePool) -> bool:
        if self.states is None:
            return False
        try:
            self.states.io.write_slot(self._now(pool, slot), self.states.unpack(found.packed))
        except StateShapeError as e:
            # Never a wrong state, never a crash: a miss.
            self.states_refused[found.tier] += 1
            log.warning("a state checkpoint read from %s was refused (%s); recomputed", found.tier, e)
            return False
        return True

    def _now(self, pool: StatePool, slot: int) -> int:
        """Run the state copies logged so far, in order, so that `slot` may be read or written directly
        (the runner runs the rest before the next forward pass, as ever); returns `slot`."""
        assert self.states is not None
        self.states.io.apply(pool.take_copies())
        return slot

    @property
    def pending(self) -> int:
        return self.loader.pending

    def wait(self, timeout_s: float) -> None:
        self.loader.wait(timeout_s)

    def read_now(self, namespace: str, tokens: Sequence[int], start: int) -> list[Arrived]:
        arrived: list[Arrived] = []
        deadline = time.monotonic() + self.loader.budget_s

        def keep(tier: str, kv: torch.Tensor) -> bool:
            arrived.append((tier, kv))
            return True

        self.lower.read_run(namespace, tokens, start, lambda: time.monotonic() >= deadline, keep)
        return arrived

    def land(
        self,
        seq: SequenceBlocks,
        tokens: Sequence[int],
        arrived: Sequence[Arrived],
        hits: dict[str, int],
        job: LoadJob | None = None,
    ) -> int:
        """With a sliding pool only the blocks of the run's last window get their sliding part (the
        others join the tree as tombstones), and the sequence keeps the longest usable prefix."""
        if job is not None:
            arrived = self._continuing(job, seq, tokens, arrived)
        if not arrived:
            return 0
        accounts, sliding = self.accounts, self.accounts.sliding
        bs, start = accounts.block_size, len(seq.blocks)
        first_read = sliding.first_read((start + len(arrived)) * bs)

        def fresh_block() -> tuple[int, int | None] | None:
            if not accounts.extend(seq, (len(seq.blocks) + 1) * bs):
                return None
            return seq.blocks[-1], sliding.landing(seq, first_read)

        def landed(block: int) -> None:
            n = len(seq.blocks)
            accounts.tree.insert(seq.namespace, tokens[: n * bs], seq.blocks, sliding.entries(seq, n))

        loaded = self.lower.land(arrived, fresh_block, landed)
        # A block taken for a load that did not land holds nothing.
        accounts.truncate(seq, start + len(loaded.blocks))
        accounts.truncate(seq, sliding.keep_usable(seq))
        num_landed = max(0, len(seq.blocks) - start)
        for tier in loaded.tiers[:num_landed]:
            hits[tier] = hits.get(tier, 0) + bs
        if num_landed:
            hits[TIER_MEMORY] = start * bs
        return num_landed

    @staticmethod
    def _continuing(
        job: LoadJob, seq: SequenceBlocks, prompt: Sequence[int], arrived: Sequence[Arrived]
    ) -> Sequence[Arrived]:
        """The blocks of `arrived` (read for `job`) that continue `seq`'s memory match of `prompt`. Memory
        may have changed while they were read: blocks it holds now are skipped, and if it lost some
        before the job's first block, the loaded ones no longer continue it and are dropped."""
        skip = len(seq.blocks) - job.start
        if skip < 0 or job.namespace != seq.namespace or tuple(prompt[: len(job.tokens)]) != job.tokens:
            return []
        return arrived[skip:]

    def offer(
        self,
        keys: list[bytes],
        namespace: str,
        tokens: Sequence[int],
        blocks: Sequence[int],
        start: int,
        sliding: Sequence[int] | None,
    ) -> None:
        self.lower.offer(keys, namespace, tokens, blocks, start, sliding)

    def usage(self) -> tuple[TierUsage, ...]:
        return tuple(
            replace(t, loads_failed=t.loads_failed + self.states_refused[t.name]) for t in self.lower.usage()
        )

    def down(self) -> bool:
        return self.lower.down()

    def flush(self) -> None:
        self.loader.settle()
        self.lower.flush()

    def close(self) -> None:
        self.loader.close()
        self.lower.close()
