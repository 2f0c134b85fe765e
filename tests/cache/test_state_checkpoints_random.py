"""A hybrid model's state slots under random programs, with each slot's content played symbolically:
the state after tokens t is the tuple t. Sequences are admitted (resuming from a checkpoint), computed
in chunks, checkpointed at random positions and released (leaving their end as a checkpoint), in pools
of blocks and of checkpoint slots small enough to evict; every copy the manager logs is played in order
before each "forward pass". Whatever happens, a live slot holds the state after its sequence's computed
tokens, an admission's state is the state after the tokens it skips, and `check()` holds after every
call."""

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.cache.manager import CacheConfig, KVCacheManager, SequenceBlocks
from kvserve.cache.prefix_cache import PrefixCache
from kvserve.model.recurrent import ZERO


@dataclass
class _Seq:
    tokens: list[int]
    kv: SequenceBlocks
    computed: int


@dataclass
class _States:
    content: dict[int, tuple[int, ...]] = field(default_factory=dict)

    def play(self, kv: KVCacheManager) -> None:
        for src, dst in kv.take_state_copies():
            self.content[dst] = () if src == ZERO else self.content[src]


_action = st.tuples(
    st.sampled_from(["admit", "admit", "compute", "compute", "compute", "checkpoint", "release"]),
    st.integers(0, 2**16),
)


@settings(max_examples=150, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 4]),
    num_blocks=st.integers(12, 40),
    checkpoints=st.integers(0, 6),
    prompts=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=14), min_size=1, max_size=6),
    actions=st.lists(_action, max_size=60),
)
def test_live_states_and_checkpoints_hold_the_state_of_their_tokens(
    block_size: int,
    num_blocks: int,
    checkpoints: int,
    prompts: list[list[int]],
    actions: list[tuple[str, int]],
) -> None:
    live_slots = 3
    kv = KVCacheManager(
        CacheConfig(num_blocks, block_size, live_state_slots=live_slots, state_checkpoint_slots=checkpoints)
    )
    states = _States()
    running: list[_Seq] = []
    for action, r in actions:
        if action == "admit" and len(running) < live_slots:
            base = prompts[r % len(prompts)]
            # Some prompts extend an earlier one (a chat's next turn), so hits are common.
            tokens = base + prompts[(r // 7) % len(prompts)][: r % 5]
            admission = kv.admit("", tokens, 1 + r % 6)
            if admission is not None:
                states.play(kv)
                seq = _Seq(tokens, admission.seq, admission.num_cached_tokens)
                assert admission.seq.state_slot is not None
                assert states.content[admission.seq.state_slot] == tuple(tokens[: seq.computed])
                # The first chunk runs at once.
                seq.computed += admission.num_new_tokens
                states.content[admission.seq.state_slot] = tuple(tokens[: seq.computed])
                kv.publish(seq.kv, tokens, seq.computed)
                running.append(seq)
        elif action == "compute" and running:
            seq = running[r % len(running)]
            n = min(1 + r % 4, len(seq.tokens) - seq.computed)
            if n and kv.grow(seq.kv, seq.computed + n):
                states.play(kv)
                slot = seq.kv.state_slot
                assert slot is not None and states.content[slot] == tuple(seq.tokens[: seq.computed])
                seq.computed += n
                states.content[slot] = tuple(seq.tokens[: seq.computed])
                kv.publish(seq.kv, seq.tokens, seq.computed)
        elif action == "checkpoint" and running:
            seq = running[r % len(running)]
            kv.checkpoint(seq.kv, seq.tokens, seq.computed)
        elif action == "release" and running:
            seq = running.pop(r % len(running))
            kv.release(seq.kv, seq.tokens, seq.computed)
        kv.check()
    for seq in running:
        kv.release(seq.kv, seq.tokens, seq.computed)
    kv.check()
    states.play(kv)
    # Every checkpoint left in the tree holds the state after its own prefix.
    tree = kv.prefix_cache
    assert isinstance(tree, PrefixCache)
    for slot in tree.checkpoint_slots():
        node, k = tree._checkpoints[slot]
        prefix: list[int] = list(node.tokens[:k])
        up = node.parent
        while up is not None and up.parent is not None:
            prefix = list(up.tokens) + prefix
            up = up.parent
        assert states.content[slot] == tuple(prefix)
