"""The workloads: conversations to replay, generated from a seed so that every run sends the same text.

Every workload is a list of conversations. A conversation's user turns are fixed in advance; the
assistant turns are whatever the server answers, so the history resent at each turn is the real one.
A single-turn workload (shared-prefix) is a list of one-turn conversations.

The copy-heavy workloads (repeat, code-edit, agent-loop) ask for text that is already in the context:
an earlier answer, a file with one change, a tool's output. They run one conversation at a time, greedy,
and let replies end where the model ends them, so that their time per output token is one stream's.
"""

import dataclasses
import json
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import resources
from typing import Any, Literal

from kvserve.flags import option
from kvserve_bench.errors import BenchError
from kvserve_bench.tokens import WORDS, TokenCounter, text_of_tokens

# How many conversations at the head of the ShareGPT file the sharegpt workload draws from.
_SHAREGPT_POOL = 2000


# An OpenAI chat message: role and content, and for an agent's history, tool calls and their results.
Message = dict[str, Any]


@dataclass(frozen=True)
class Conversation:
    """One conversation: its system prompt, the user turns sent one by one, and when its first turn starts.

    `group` names the system prompt it shares with others (conversations of one group share it) and
    `arrival_s` delays its first request from the start of the step that runs it (Poisson arrivals).
    `opening` is fixed history sent after the system prompt and before the first user turn (an agent's
    task, its tool calls and their results).
    """

    id: str
    group: int
    system: str | None
    user_turns: tuple[str, ...]
    arrival_s: float = 0.0
    opening: tuple[Message, ...] = ()


@dataclass(frozen=True)
class Workload:
    """What a run sends: conversations, the reply length of every turn, how many conversations run at once.

    `ignore_eos` asks for replies of exactly `max_tokens` (comparable lengths across servers); without it
    a reply ends where the model ends it. `figure` is the number the workload is about: the time to first
    token (what a prefix cache saves) or the time per output token (what speculation saves), of every turn
    or only of `figure_turn`.
    """

    name: str
    description: str
    conversations: tuple[Conversation, ...]
    max_tokens: int
    max_in_flight: int
    settings: dict[str, Any]
    ignore_eos: bool = True
    figure: Literal["ttft", "tpot"] = "ttft"
    figure_turn: int | None = None

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


@dataclass(frozen=True)
class RepeatSpec:
    conversations: int = option(4, "conversations, one at a time, each on its own topic")
    reply_tokens: int = option(300, "reply tokens at most, both turns")
    seed: int = option(0, "seed of the topics' order")


@dataclass(frozen=True)
class CodeEditSpec:
    conversations: int = option(2, "edits of the file, one at a time, each renaming another function")
    reply_tokens: int = option(1000, "reply tokens at most")
    seed: int = option(0, "seed of the renames' order")


@dataclass(frozen=True)
class AgentLoopSpec:
    conversations: int = option(2, "agent histories, one at a time")
    turns: int = option(4, "user turns, each asking to quote another earlier tool output (at most 5)")
    reply_tokens: int = option(300, "reply tokens at most")
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


REPEAT_TOPICS = (
    "fruits",
    "countries of Europe",
    "animals that live in the ocean",
    "famous scientists",
    "programming languages",
    "musical instruments",
    "kitchen tools",
    "board games",
    "rivers of the world",
    "sports played with a ball",
    "birds",
    "vegetables",
)
REPEAT_ASK = "Write a numbered list of 20 {topic}, one per line, each with a short description."
REPEAT_AGAIN = "Repeat your previous answer exactly, word for word."


def repeat(spec: RepeatSpec) -> Workload:
    """Turn 1 asks for a list, turn 2 for the same answer again: turn 2 copies the history's last reply.

    Turn 2's time per output token is the figure; conversations run one at a time, each on its own
    topic, so that no conversation's reply is another's.
    """
    _require_positive(conversations=spec.conversations, reply_tokens=spec.reply_tokens)
    if spec.conversations > len(REPEAT_TOPICS):
        raise BenchError(f"--conversations can be at most {len(REPEAT_TOPICS)} (one topic each)")
    topics = random.Random(f"{spec.seed}/repeat").sample(REPEAT_TOPICS, spec.conversations)
    conversations = tuple(
        Conversation(
            id=f"repeat{i}", group=i, system=None, user_turns=(REPEAT_ASK.format(topic=t), REPEAT_AGAIN)
        )
        for i, t in enumerate(topics)
    )
    description = (
        f"{spec.conversations} conversations one at a time: a list of up to {spec.reply_tokens} tokens, "
        "then the same answer again (the figure: turn 2's time per output token)"
    )
    return Workload(
        "repeat",
        description,
        conversations,
        spec.reply_tokens,
        1,
        _settings(spec),
        ignore_eos=False,
        figure="tpot",
        figure_turn=2,
    )


CODE_EDIT_FILE = "inventory.py.txt"
# Functions of the file and their new names; each conversation renames one.
CODE_EDIT_RENAMES = (
    ("load_items", "read_items"),
    ("parse_item", "decode_item"),
    ("stock_value", "inventory_value"),
    ("needs_reorder", "is_low_on_stock"),
    ("format_price", "price_text"),
    ("weekly_sales", "sales_per_week"),
    ("report_rows", "table_rows"),
    ("apply_movement", "record_movement"),
)
CODE_EDIT_ASK = (
    "Here is a Python file, inventory.py:\n\n```python\n{source}```\n\nRename the function `{old}` to "
    "`{new}` everywhere in this file. Reply with the whole changed file in one code block and nothing else."
)


def code_edit_source() -> str:
    """The file the code-edit workload edits: 1,327 tokens of the default model's tokenizer."""
    return resources.files("kvserve_bench.data").joinpath(CODE_EDIT_FILE).read_text()


def code_edit(spec: CodeEditSpec) -> Workload:
    """A source file in the prompt and "repeat it with one change" (a function renamed): the reply copies
    the prompt but for the new name."""
    _require_positive(conversations=spec.conversations, reply_tokens=spec.reply_tokens)
    if spec.conversations > len(CODE_EDIT_RENAMES):
        raise BenchError(f"--conversations can be at most {len(CODE_EDIT_RENAMES)} (one rename each)")
    source = code_edit_source()
    renames = random.Random(f"{spec.seed}/code-edit").sample(CODE_EDIT_RENAMES, spec.conversations)
    conversations = tuple(
        Conversation(
            id=f"edit{i}",
            group=0,
            system=None,
            user_turns=(CODE_EDIT_ASK.format(source=source, old=old, new=new),),
        )
        for i, (old, new) in enumerate(renames)
    )
    description = (
        f"{spec.conversations} edits one at a time of a {len(source.splitlines())}-line Python file: "
        f"the whole file again with one function renamed, up to {spec.reply_tokens} tokens"
    )
    return Workload(
        "code-edit",
        description,
        conversations,
        spec.reply_tokens,
        1,
        _settings(spec),
        ignore_eos=False,
        figure="tpot",
    )


AGENT_SYSTEM = "You are an operations agent. You call tools to look things up, and answer from their results."
AGENT_TASK = "Order {order} arrived late. Find out why."
# What each turn asks for, by the tool whose output it quotes.
AGENT_ASKS = {
    "get_order": "Quote the JSON object that get_order returned, exactly as it was, and nothing else.",
    "get_shipment": "Quote the JSON that get_shipment returned, exactly, and nothing else.",
    "read_file": "Quote config/shipping.yaml exactly as read_file returned it, and nothing else.",
    "search_logs": "Quote the log lines that search_logs found, exactly, and nothing else.",
    "get_customer": "Quote the JSON object that get_customer returned, exactly, and nothing else.",
}


def agent_loop(spec: AgentLoopSpec) -> Workload:
    """An agent's history of tool calls and results (JSON objects, a file, log lines), then turns that
    each ask to quote one of those outputs again: the reply copies a tool result from the history."""
    _require_positive(conversations=spec.conversations, turns=spec.turns, reply_tokens=spec.reply_tokens)
    if spec.turns > len(AGENT_ASKS):
        raise BenchError(f"--turns can be at most {len(AGENT_ASKS)} (one tool output each)")
    conversations = []
    for i in range(spec.conversations):
        rng = random.Random(f"{spec.seed}/agent-loop/{i}")
        order = f"A-{rng.randrange(10_000, 100_000)}"
        calls = _tool_calls(rng, order)
        opening: list[Message] = [{"role": "user", "content": AGENT_TASK.format(order=order)}]
        for n, (name, arguments, output) in enumerate(calls):
            call_id = f"call_{i}_{n}"
            function = {"name": name, "arguments": json.dumps(arguments)}
            opening.append(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": call_id, "type": "function", "function": function}],
                }
            )
            opening.append({"role": "tool", "tool_call_id": call_id, "content": output})
        quoted = rng.sample([name for name, _, _ in calls], spec.turns)
        conversations.append(
            Conversation(
                id=f"agent{i}",
                group=i,
                system=AGENT_SYSTEM,
                user_turns=tuple(AGENT_ASKS[name] for name in quoted),
                opening=tuple(opening),
            )
        )
    description = (
        f"{spec.conversations} agent histories one at a time, each with {len(AGENT_ASKS)} tool results; "
        f"{spec.turns} turns that each ask to quote one of them, up to {spec.reply_tokens} tokens"
    )
    return Workload(
        "agent-loop",
        description,
        tuple(conversations),
        spec.reply_tokens,
        1,
        _settings(spec),
        ignore_eos=False,
        figure="tpot",
    )


def _tool_calls(rng: random.Random, order: str) -> list[tuple[str, dict[str, str], str]]:
    """The agent's calls, in the order it made them: (tool, arguments, output), outputs seeded by `rng`."""

    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    def stamp(day: int) -> str:
        return f"2026-03-{day:02d}T{rng.randrange(24):02d}:{rng.randrange(60):02d}:00Z"

    customer = f"C-{rng.randrange(1000, 10_000)}"
    lines = [(rng.randrange(1, 6), rng.randrange(200, 9000) / 100) for _ in range(4)]
    items = [
        {
            "sku": f"SKU-{rng.randrange(100_000, 1_000_000)}",
            "name": words(2),
            "quantity": quantity,
            "unit_price": price,
        }
        for quantity, price in lines
    ]
    total = round(sum(quantity * price for quantity, price in lines), 2)
    order_json = {
        "order_id": order,
        "status": "delivered",
        "created_at": stamp(2),
        "customer_id": customer,
        "items": items,
        "total": total,
        "shipping": {"method": "express", "promised_by": stamp(4)},
    }
    places = [words(1).title() for _ in range(5)]
    statuses = ("picked up", "in transit", "held at depot", "out for delivery", "delivered")
    shipment = {
        "order_id": order,
        "carrier": rng.choice(("DHL", "UPS", "GLS", "DPD")),
        "tracking_number": f"1Z{rng.randrange(10**11, 10**12)}",
        "events": [
            {"time": stamp(3 + n), "location": place, "status": status}
            for n, (place, status) in enumerate(zip(places, statuses, strict=True))
        ],
    }
    config = "".join(
        f'{carrier}:\n  cutoff: "{rng.randrange(12, 18)}:00"\n  max_weight_kg: {rng.randrange(5, 40)}\n'
        f"  depots: [{', '.join(words(1) for _ in range(3))}]\n"
        for carrier in ("dhl", "ups", "gls", "dpd")
    )
    logs = "\n".join(
        f"{stamp(2 + n // 2)} {rng.choice(('warehouse', 'billing', 'carrier-api'))} "
        f"{rng.choice(('INFO', 'WARN'))} {order} {words(6)}"
        for n in range(6)
    )
    customer_json = {
        "customer_id": customer,
        "name": words(2).title(),
        "email": f"{rng.choice(WORDS)}.{rng.choice(WORDS)}@example.com",
        "address": {"street": f"{rng.randrange(1, 200)} {words(2).title()} Street", "city": words(1).title()},
        "tier": rng.choice(("standard", "gold", "platinum")),
        "orders_last_year": rng.randrange(1, 40),
    }
    return [
        ("get_order", {"order_id": order}, json.dumps(order_json, indent=2)),
        ("get_shipment", {"order_id": order}, json.dumps(shipment, indent=2)),
        ("read_file", {"path": "config/shipping.yaml"}, config),
        ("search_logs", {"query": order}, logs),
        ("get_customer", {"customer_id": customer}, json.dumps(customer_json, indent=2)),
    ]


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


def _settings(
    spec: MultiturnSpec | SharedPrefixSpec | SharegptSpec | RepeatSpec | CodeEditSpec | AgentLoopSpec,
) -> dict[str, Any]:
    settings = dataclasses.asdict(spec)
    # JSON has no infinity; "inf" reads as what it means.
    return {k: "inf" if isinstance(v, float) and math.isinf(v) else v for k, v in settings.items()}
