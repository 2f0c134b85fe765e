"""The workloads: conversations to replay, generated from a seed so that every run sends the same text.

Every workload is a list of conversations. A conversation's user turns are fixed in advance; the
assistant turns are whatever the server answers, so the history resent at each turn is the real one.
A single-turn workload (shared-prefix) is a list of one-turn conversations.
"""

import dataclasses
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvserve.bench.errors import BenchError
from kvserve.bench.tokens import TokenCounter, text_of_tokens
from kvserve.flags import option

# How many conversations at the head of the ShareGPT file the sharegpt workload draws from.
_SHAREGPT_POOL = 2000


@dataclass(frozen=True)
class Conversation:
    """One conversation: its system prompt, the user turns sent one by one, and when its first turn starts.

    `group` names the system prompt it shares with others (conversations of one group share it) and
    `arrival_s` delays its first request from the start of the step that runs it (Poisson arrivals).
    """

    id: str
    group: int
    system: str | None
    user_turns: tuple[str, ...]
    arrival_s: float = 0.0


@dataclass(frozen=True)
class Workload:
    """What a run sends: conversations, the reply length of every turn, how many conversations run at once."""

    name: str
    description: str
    conversations: tuple[Conversation, ...]
    max_tokens: int
    max_in_flight: int
    settings: dict[str, Any]

    @property
    def num_requests(self) -> int:
        return sum(len(c.user_turns) for c in self.conversations)


# The specs' fields are `kvserve bench`'s flags (kvserve.flags): each default and help is written here.
_SEED = "seed of the generated texts and of the arrivals"
_IN_FLIGHT = "conversations at once"


@dataclass(frozen=True)
class MultiturnSpec:
    conversations: int = option(4)
    turns: int = option(6)
    system_tokens: int = option(1000)
    shared_system: bool = option(True, "one system prompt per conversation", name="--unique-system")
    user_tokens: int = option(40)
    reply_tokens: int = option(32)
    max_in_flight: int = option(4, _IN_FLIGHT)
    seed: int = option(0, _SEED)


@dataclass(frozen=True)
class SharedPrefixSpec:
    """SGLang's generated-shared-prefix shape; `request_rate` of inf sends every prompt at once."""

    groups: int = option(2)
    prompts_per_group: int = option(8)
    system_tokens: int = option(1000)
    question_tokens: int = option(50)
    output_tokens: int = option(16)
    request_rate: float = option(math.inf, "Poisson arrivals per second; inf: all at once")
    seed: int = option(0, _SEED)


@dataclass(frozen=True)
class SharegptSpec:
    conversations: int = option(8)
    min_turns: int = option(2)
    max_turns: int = option(4)
    max_user_tokens: int = option(256)
    reply_tokens: int = option(64)
    max_in_flight: int = option(4, _IN_FLIGHT)
    seed: int = option(0, _SEED)


def multiturn(spec: MultiturnSpec, count: TokenCounter) -> Workload:
    _require_positive(
        conversations=spec.conversations,
        turns=spec.turns,
        reply_tokens=spec.reply_tokens,
        max_in_flight=spec.max_in_flight,
    )

    def system(group: int) -> str | None:
        if spec.system_tokens == 0:
            return None
        return text_of_tokens(spec.system_tokens, f"{spec.seed}/multiturn/system/{group}", count)

    shared = system(0)
    conversations = tuple(
        Conversation(
            id=f"c{i}",
            group=0 if spec.shared_system else i,
            system=shared if spec.shared_system else system(i),
            user_turns=tuple(
                text_of_tokens(spec.user_tokens, f"{spec.seed}/multiturn/user/{i}/{t}", count)
                for t in range(spec.turns)
            ),
        )
        for i in range(spec.conversations)
    )
    sharing = "one shared" if spec.shared_system else "a unique"
    description = (
        f"{spec.conversations} conversations x {spec.turns} turns, {sharing} system prompt of "
        f"{spec.system_tokens} tokens, user turns of {spec.user_tokens} tokens, replies of "
        f"{spec.reply_tokens} tokens, {spec.max_in_flight} conversations in flight"
    )
    return Workload(
        "multiturn", description, conversations, spec.reply_tokens, spec.max_in_flight, _settings(spec)
    )


def shared_prefix(spec: SharedPrefixSpec, count: TokenCounter) -> Workload:
    _require_positive(
        groups=spec.groups, prompts_per_group=spec.prompts_per_group, output_tokens=spec.output_tokens
    )
    if not spec.request_rate > 0:
        raise BenchError("the request rate must be positive (inf sends every prompt at once)")
    systems = [
        text_of_tokens(spec.system_tokens, f"{spec.seed}/shared-prefix/system/{g}", count)
        for g in range(spec.groups)
    ]
    prompts = [
        (g, p, text_of_tokens(spec.question_tokens, f"{spec.seed}/shared-prefix/question/{g}/{p}", count))
        for g in range(spec.groups)
        for p in range(spec.prompts_per_group)
    ]
    rng = random.Random(f"{spec.seed}/shared-prefix/order")
    # Shuffled as in SGLang's benchmark, so a group's prompts do not arrive back to back.
    rng.shuffle(prompts)
    arrivals = _poisson_arrivals(len(prompts), spec.request_rate, rng)
    conversations = tuple(
        Conversation(id=f"g{g}p{p}", group=g, system=systems[g], user_turns=(question,), arrival_s=arrival)
        for (g, p, question), arrival in zip(prompts, arrivals, strict=True)
    )
    arriving = "all at once" if math.isinf(spec.request_rate) else f"at {spec.request_rate:g} requests/s"
    description = (
        f"{spec.groups} groups x {spec.prompts_per_group} prompts, a system prompt of {spec.system_tokens} "
        f"tokens per group, questions of {spec.question_tokens} tokens, {spec.output_tokens} output "
        f"tokens, arriving {arriving}"
    )
    return Workload(
        "shared-prefix", description, conversations, spec.output_tokens, len(conversations), _settings(spec)
    )


def sharegpt(spec: SharegptSpec, count: TokenCounter, dataset: Iterable[list[str]]) -> Workload:
    """Real conversations: the first `max_turns` human turns of conversations whose turns all fit.

    Conversations are drawn (seeded) from the first `_SHAREGPT_POOL` of the data set, so that a run
    reads a few megabytes rather than the whole file.
    """
    _require_positive(
        conversations=spec.conversations,
        min_turns=spec.min_turns,
        reply_tokens=spec.reply_tokens,
        max_in_flight=spec.max_in_flight,
    )
    if spec.max_turns < spec.min_turns:
        raise BenchError("--max-turns must be at least --min-turns")
    candidates: list[tuple[int, tuple[str, ...]]] = []
    for index, turns in enumerate(dataset):
        if index >= _SHAREGPT_POOL:
            break
        kept = tuple(turns[: spec.max_turns])
        # A token rarely spans more than 8 characters, so longer turns cannot fit: no need to count them.
        if len(kept) >= spec.min_turns and all(
            t.strip() and len(t) <= 8 * spec.max_user_tokens for t in kept
        ):
            candidates.append((index, kept))
    random.Random(f"{spec.seed}/sharegpt").shuffle(candidates)
    conversations: list[Conversation] = []
    for index, kept in candidates:
        if len(conversations) == spec.conversations:
            break
        if all(count(t) <= spec.max_user_tokens for t in kept):
            conversations.append(
                Conversation(id=f"sharegpt{index}", group=index, system=None, user_turns=kept)
            )
    if len(conversations) < spec.conversations:
        raise BenchError(
            f"only {len(conversations)} ShareGPT conversations have {spec.min_turns}+ turns of at most "
            f"{spec.max_user_tokens} tokens; ask for fewer or raise --max-user-tokens"
        )
    description = (
        f"{spec.conversations} ShareGPT conversations, {spec.min_turns} to {spec.max_turns} turns with "
        f"user turns of at most {spec.max_user_tokens} tokens, replies of {spec.reply_tokens} tokens, "
        f"{spec.max_in_flight} conversations in flight"
    )
    return Workload(
        "sharegpt", description, tuple(conversations), spec.reply_tokens, spec.max_in_flight, _settings(spec)
    )


def _poisson_arrivals(n: int, rate: float, rng: random.Random) -> list[float]:
    if math.isinf(rate):
        return [0.0] * n
    arrivals: list[float] = []
    now = 0.0
    for _ in range(n):
        arrivals.append(now)
        now += rng.expovariate(rate)
    return arrivals


def _require_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise BenchError(f"--{name.replace('_', '-')} must be at least 1, not {value}")


def _settings(spec: MultiturnSpec | SharedPrefixSpec | SharegptSpec) -> dict[str, Any]:
    settings = dataclasses.asdict(spec)
    # JSON has no infinity; "inf" reads as what it means.
    return {k: "inf" if isinstance(v, float) and math.isinf(v) else v for k, v in settings.items()}
