"""AsyncEngine: the Engine on its own thread, fed by a command queue, streaming into asyncio queues.

The engine thread is the only one that touches engine state. Callers on the event loop submit and abort
through a thread-safe queue; each step's deltas come back with one call_soon_threadsafe per step.

If anything raises on the engine thread, the engine is dead: its state may be half-updated, so it never
steps again. Every request in flight fails with EngineFailedError, later calls fail at once, the error
is logged with its traceback, and `on_failure` tells the owner (the server exits non-zero so that a
supervisor restarts it). Nothing ever waits on a dead engine.

Capacity is counted in sequences (each of a request's n samples is one generate call) and shared between
tenants: `max_waiting + max_num_seqs` sequences may be held, and a tenant under its equal share of them
(that total over the tenants holding some, itself included) is admitted even when others have filled
the rest. So one tenant's flood can neither turn another away nor grow the queue past twice the limit.
The door owns that count, and the one rule for it (`_hold`): a sequence is held from the moment its
request reserves room (`reserve`, before any of its work) or, unreserved, from its `generate`, until its
stream ends; a reserved sequence that `generate` takes stays held, so it is counted once whether it is
reserved, waiting or running.

It is the server's one door to the engine: besides generate and reserve, it validates requests
(`validate`, the one check of a request, on the caller's thread), encodes chats with the reply splice
(`encode_chat`), and offers the cache views (`stats`, `snapshot`, `cache_view`), pins, retentions and
the reset, each run on the engine thread between steps. `engine` is reached only from here (and by tests).
"""

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
from collections import Counter
from collections.abc import AsyncGenerator, Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from kvserve.config import EngineConfig
from kvserve.engine.chat import encode_chat, reply_turn_start
from kvserve.engine.engine import Engine, EngineStats
from kvserve.engine.outputs import RequestDelta
from kvserve.engine.request import DEFAULT_TENANT
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.snapshot import CacheView, PinView, Snapshot, pin_view, take_cache_view, take_snapshot
from kvserve.engine.validation import CheckedPrompt, TooManySequencesError, check_sequences
from kvserve.errors import EngineOverloadedError, KVServeError
from kvserve.model import openmp
from kvserve.model.heap import release_free_heap, release_startup_pages
from kvserve.model.tokenizer import NO_TEMPLATE_ARGS, KnownReply, MessageDict, ReplyLookup, TemplateArgs

log = logging.getLogger("kvserve.engine")

# Seconds the engine waits without work after its last step before it returns the free heap.
HEAP_TRIM_IDLE_S = 0.5


class EngineDeadError(KVServeError):
    """The engine no longer runs (the server is shutting down, or the engine failed)."""


class EngineFailedError(EngineDeadError):
    """The engine thread raised; the requests in flight and every later one fail with this."""


@dataclass
class _Submit:
    request_id: str
    prompt: CheckedPrompt
    params: SamplingParams
    namespace: str
    tenant: str
    loop: asyncio.AbstractEventLoop
    out: "asyncio.Queue[RequestDelta | BaseException]"
    checkpoints: Sequence[int] = ()


@dataclass
class Reservation:
    """Room for one request's sequences in the engine's queue, held for `tenant` from before any of them
    is built: `count` is what is left of it. Each `generate` given the reservation takes one sequence of
    it; what is left goes back when `AsyncEngine.reserve`'s block ends, however it ends."""

    tenant: str
    count: int

    def take(self, tenant: str) -> None:
        """One sequence of the reservation reaches the engine (it stays held, now in flight)."""
        if tenant != self.tenant or self.count < 1:
            raise ValueError(
                f"the reservation of {self.tenant!r} has no room left for a sequence of {tenant!r}"
            )
        self.count -= 1


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Callable[[Engine], Any]
    future: "Future[Any]"


class AsyncEngine:
    def __init__(self, engine: Engine, on_failure: Callable[[BaseException], None] | None = None) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.on_failure = on_failure
        self.failure: EngineFailedError | None = None
        self._commands: queue.SimpleQueue[_Submit | _Abort | _Call | None] = queue.SimpleQueue()
        self._streams: dict[str, _Submit] = {}
        self._in_flight = 0
        # Sequences held per tenant: reserved, or in flight (tenants holding none are absent).
        self._held: Counter[str] = Counter()
        self._ids = itertools.count()
        # From here the engine thread runs every step: the OpenMP workers this thread kept (from loading
        # the model) would only make libgomp stop spin-waiting between the engine's parallel regions.
        openmp.release_thread_pool()
        # An engine built with its startup probe pending runs it here, a step at a time between commands
        # (so /health answers), once `start_probe` says the server is up and idle; a request's step
        # finishes it first.
        self._probe_started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        self._thread.start()

    @property
    def num_in_flight(self) -> int:
        return self._in_flight

    def start_probe(self) -> None:
        """Let the engine thread run what is left of the engine's startup probe."""
        self._probe_started.set()
        self._commands.put(_Call(lambda engine: None, Future()))

    def _probing(self) -> bool:
        return self.engine.probing and self._probe_started.is_set()

    def shutdown(self) -> None:
        """Stop the engine thread, then let the cache tiers write what they have queued."""
        self._commands.put(None)
        self._thread.join(timeout=30)
        self.engine.close()

    @property
    def capacity(self) -> int:
        """Sequences the engine takes in flight: its waiting queue and its running batch."""
        return self.engine.config.max_waiting + self.engine.config.max_num_seqs

    @contextmanager
    def reserve(self, tenant: str, num_prompts: int, n: int) -> Iterator[Reservation]:
        """Hold room for a request of `num_prompts` prompts x `n` samples until the block ends, before any
        of them is built: two requests prepared at once cannot both count the same room, and nothing is
        submitted and then aborted for lack of it. Refuses a request over the cap of one request
        (`check_sequences`), or larger than the whole queue (it can never run) with a
        TooManySequencesError, and one there is no room for now with EngineOverloadedError. On the
        event loop only."""
        check_sequences(self.engine.limits.max_sequences_per_request, num_prompts, n)
        # n < 1 is refused when the request's params are made; it holds nothing meanwhile.
        count = max(num_prompts * n, 0)
        if count > self.capacity:
            raise TooManySequencesError(
                f"This request has {count} sequences (prompts x n); the server queues at most "
                f"{self.capacity} at once (--max-waiting). Send fewer prompts or a smaller n.",
                "n",
            )
        self._hold(tenant, count)
        room = Reservation(tenant, count)
        try:
            yield room
        finally:
            self._let_go(tenant, room.count)
            room.count = 0

    def _hold(self, tenant: str, count: int) -> None:
        """Hold `count` more sequences of `tenant`, or refuse them all: the one capacity rule."""
        if count == 0:
            return
        if not has_room(self.capacity, self._held, tenant, count):
            raise EngineOverloadedError(
                f"the server is at capacity ({self.capacity} sequences in flight, "
                f"{fair_share(self.capacity, self._held, tenant)} for this tenant) and has no room for "
                f"{count} more; retry later"
            )
        self._held[tenant] += count

    def _let_go(self, tenant: str, count: int) -> None:
        if count == 0:
            return
        self._held[tenant] -= count
        if not self._held[tenant]:
            del self._held[tenant]

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def model_name(self) -> str:
        return self.engine.model.name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def pinning_enabled(self) -> bool:
        return self.engine.config.enable_prefix_caching and self.engine.kv.max_pinned_blocks > 0

    def validate(
        self, prompts: Sequence[Sequence[int] | CheckedPrompt], params: SamplingParams, namespace: str = ""
    ) -> list[CheckedPrompt]:
        """Check a request (its prompts, each run params.n times): the one check of engine/validation.py.
        Any thread may call it, and since it reads every prompt token and compiles the request's
        constraint, callers on the event loop should not; `generate` takes what it returns unchecked."""
        return self.engine.validate_request(prompts, params, namespace)

    def encode_chat(
        self,
        messages: Sequence[MessageDict],
        namespace: str = "",
        add_generation_prompt: bool = True,
        args: TemplateArgs = NO_TEMPLATE_ARGS,
        known_reply: ReplyLookup | None = None,
    ) -> list[int]:
        """A conversation's token ids, earlier replies in `namespace` spliced in as their generated ids
        (engine/chat.py); off the event loop for a long chat. `args` carries the template, the tools
        and the template variables when they are not the tokenizer's defaults; `known_reply`, when
        given, is asked for replies' ids instead of the reply memory."""
        return encode_chat(
            self.tokenizer, self.engine.replies, messages, namespace, add_generation_prompt, args, known_reply
        )

    @property
    def keeps_states(self) -> bool:
        """A hybrid model: its recurrent state is kept only at chosen positions (checkpoints)."""
        return self.engine.kv.states.enabled

    def reply_turn_start(
        self, messages: Sequence[MessageDict], args: TemplateArgs, token_ids: Sequence[int]
    ) -> int | None:
        """A chat prompt's position where its generation prompt parts from the reply's turn as the next
        turn renders it (engine/chat.py), a checkpoint for a hybrid model. Any thread; it renders the
        chat again."""
        return reply_turn_start(self.tokenizer, messages, args, token_ids)

    def lookup_reply(self, namespace: str, text: str) -> KnownReply | None:
        """The reply memory's ids of the reply `text` stands for in `namespace` (a reply, or a part or
        key of one: engine/reply_memory.py). Any thread."""
        return self.engine.replies.lookup_reply(namespace, text)

    def remember_reply(self, namespace: str, key: str, token_ids: Sequence[int], tenant: str) -> None:
        """Remember a reply's ids under `key` (a harmony reply's key: server/core/harmony.py). Any
        thread."""
        self.engine.replies.remember(namespace, key, token_ids, tenant)

    def remember_reply_part(self, namespace: str, part: str, whole: str, tenant: str) -> None:
        """Remember that `tenant`'s reply `whole` came back to its client as `part` (its content after its
        think block), so that a later turn that renders the block again splices the whole reply's ids
        (engine/reply_memory.py; the entry counts in `tenant`'s bound). Any thread: the memory has its
        own lock."""
        self.engine.replies.remember_part(namespace, part, whole, tenant)

    async def generate(
        self,
        prompt: Sequence[int] | CheckedPrompt,
        params: SamplingParams,
        namespace: str = "",
        request_id: str | None = None,
        tenant: str = DEFAULT_TENANT,
        room: Reservation | None = None,
        checkpoints: Sequence[int] = (),
    ) -> AsyncGenerator[RequestDelta, None]:
        """Stream a request's deltas (one sample: n > 1 runs as n calls with `params.for_sample(i)`);
        leaving the iteration early (or cancelling) aborts the request.

        The sample is held from `room` (its request's reservation), or, without one, from what is free:
        EngineOverloadedError if the engine is at capacity and `tenant` holds its share of it. Raises
        InvalidRequestError before anything is queued if the request can never be served. A prompt that
        `validate` checked with these params (or the request's, of which these are a sample) is not
        checked again, here or by the engine (`Engine.checked_prompt`). `checkpoints`: prompt positions
        where a hybrid model keeps its state (breakpoints; message ends are found by the engine).
        """
        if self.failure is not None:
            raise self.failure
        if room is None:
            self._hold(tenant, 1)
        else:
            room.take(tenant)
        rid = request_id or f"req-{next(self._ids)}"
        submitted = finished = False
        try:
            checked = self.engine.checked_prompt(prompt, params, namespace)
            out: asyncio.Queue[RequestDelta | BaseException] = asyncio.Queue()
            self._in_flight += 1
            submitted = True
            self._commands.put(
                _Submit(rid, checked, params, namespace, tenant, asyncio.get_running_loop(), out, checkpoints)
            )
            while True:
                item = await out.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._let_go(tenant, 1)
            if submitted:
                self._in_flight -= 1
                if not finished:
                    self._commands.put(_Abort(rid))

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        """Run fn(engine) on the engine thread between steps (stats, cache reset) and return its result."""
        if self.failure is not None:
            raise self.failure
        future: Future[Any] = Future()
        self._commands.put(_Call(fn, future))
        return await asyncio.wrap_future(future)

    async def ping(self) -> None:
        """Return once the engine thread has answered (it steps, or waits for work)."""
        await self.call(lambda e: None)

    async def stats(self) -> EngineStats:
        stats: EngineStats = await self.call(lambda e: e.stats())
        return stats

    async def snapshot(self, namespace: str | None = None) -> Snapshot:
        """The engine now (engine/snapshot.py), limited to one namespace when it is given."""
        snapshot: Snapshot = await self.call(lambda e: take_snapshot(e, namespace))
        return snapshot

    async def cache_view(self, namespace: str, whole_pool: bool) -> CacheView:
        """The pool and its lower tiers, and `namespace`'s pins (see take_cache_view)."""
        view: CacheView = await self.call(lambda e: take_cache_view(e, namespace, whole_pool))
        return view

    async def reset_prefix_cache(self) -> int:
        """Drop every cached block no request is using; how many were freed."""
        freed: int = await self.call(lambda e: e.reset_prefix_cache())
        return freed

    async def pin(self, namespace: str, tokens: Sequence[int], ttl_s: float) -> PinView | None:
        """Pin the full blocks of `tokens` (see Engine.pin): None if they are not all cached; PinRefused
        when the cache cannot take the pin."""

        def pin(engine: Engine) -> PinView | None:
            found = engine.pin(namespace, tokens, ttl_s)
            return None if found is None else pin_view(engine, found)

        view: PinView | None = await self.call(pin)
        return view

    async def unpin(self, namespace: str, pin_id: str) -> bool:
        found: bool = await self.call(lambda e: e.unpin(namespace, pin_id))
        return found

    @property
    def retention_enabled(self) -> bool:
        return self.engine.kv.retention_enabled

    def retainable_length(self, num_tokens: int) -> int:
        """The most of a breakpoint's `num_tokens` tokens a retention could hold: fixed by the
        configuration, so read here without an engine call."""
        return self.engine.kv.retainable_length(num_tokens)

    async def retain(
        self, namespace: str, tokens: Sequence[int], breakpoints: Sequence[tuple[int, float]]
    ) -> list[int]:
        """Hold the cached prefix of `tokens` up to each breakpoint (length, ttl_s) against eviction, on
        the engine thread (see Engine.retain); the tokens held for each. Raises for nothing the
        breakpoints or tokens hold."""
        held: list[int] = await self.call(lambda e: e.retain(namespace, tokens, breakpoints))
        return held

    def _apply(self, command: _Submit | _Abort | _Call) -> None:
        if isinstance(command, _Submit):
            try:
                self.engine.add_request(
                    command.request_id,
                    command.prompt,
                    command.params,
                    command.namespace,
                    command.tenant,
                    command.checkpoints,
                )
            except Exception as e:
                command.loop.call_soon_threadsafe(command.out.put_nowait, e)
                return
            self._streams[command.request_id] = command
        elif isinstance(command, _Abort):
            if self._streams.pop(command.request_id, None) is not None:
                self.engine.abort_request(command.request_id)
        # A call whose caller stopped waiting (a /health timeout) is skipped: completing a cancelled
        # future raises, and on this thread that would stop the engine for everyone.
        elif command.future.set_running_or_notify_cancel():
            try:
                result = command.fn(self.engine)
            except Exception as e:
                command.future.set_exception(e)
            else:
                command.future.set_result(result)

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as e:
            log.exception("the engine failed; failing the requests in flight")
            self.failure = EngineFailedError(
                f"the engine failed ({type(e).__name__}); the server log has the details"
            )
            # The owner hears first: a client that reads its 500 then finds the failure already handled.
            if self.on_failure is not None:
                self.on_failure(e)
            self._fail_all(self.failure)
            self._refuse_until_shutdown(self.failure)

    def _serve(self) -> None:
        # Whether steps ran since the heap's free memory was last returned.
        stepped = False
        while True:
            idle = not self.engine.has_unfinished_requests() and not self._probing()
            wait = HEAP_TRIM_IDLE_S if idle and stepped else None
            try:
                command = self._commands.get(block=idle, timeout=wait)
            except queue.Empty:
                if idle:
                    # The steps freed their activations, but glibc keeps such memory in its heaps,
                    # resident (about 70 MiB after a few long prompts). Returned once the engine has
                    # been idle a while, so that back-to-back requests never wait for it (returning
                    # that much takes tens of milliseconds).
                    release_free_heap()
                    stepped = False
                    continue
            else:
                try:
                    while True:
                        if command is None:
                            for rid in list(self._streams):
                                self.engine.abort_request(rid)
                            self._fail_all(EngineDeadError("the server is shutting down"))
                            return
                        self._apply(command)
                        command = self._commands.get_nowait()
                except queue.Empty:
                    pass
            if self.engine.has_unfinished_requests():
                self._dispatch(self.engine.step())
                stepped = True
            elif self._probing():
                self.engine.probe_step()
                stepped = True
                if not self.engine.probing:
                    # Startup's end: what only the probe ran leaves the resident set, as `serve` lets
                    # go of what loading ran (server/app.py).
                    release_startup_pages()

    def _refuse_until_shutdown(self, error: EngineDeadError) -> None:
        """A dead engine still answers every command, with the error, so that no caller waits forever."""
        while (command := self._commands.get()) is not None:
            if isinstance(command, _Submit):
                _send(command.loop, command.out, error)
            elif isinstance(command, _Call) and command.future.set_running_or_notify_cancel():
                command.future.set_exception(error)

    def _dispatch(self, deltas: list[RequestDelta]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Any], RequestDelta]]] = {}
        for delta in deltas:
            stream = self._streams.get(delta.request_id)
            if stream is None:
                continue
            if delta.finished:
                del self._streams[delta.request_id]
            by_loop.setdefault(stream.loop, []).append((stream.out, delta))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _fail_all(self, error: BaseException) -> None:
        for stream in self._streams.values():
            _send(stream.loop, stream.out, error)
        self._streams.clear()


def fair_share(limit: int, in_flight: Mapping[str, int], tenant: str) -> int:
    """A tenant's equal share of `limit`: over the tenants in flight, itself included."""
    return limit // (len(in_flight) + (0 if in_flight.get(tenant) else 1))


def has_room(limit: int, in_flight: Mapping[str, int], tenant: str, count: int) -> bool:
    """Whether `count` more sequences of `tenant` may be taken: all of them fit within `limit`, or the
    tenant stays within its equal share of it (so one tenant's flood never turns another away)."""
    if sum(in_flight.values()) + count <= limit:
        return True
    return in_flight.get(tenant, 0) + count <= fair_share(limit, in_flight, tenant)


def _send(loop: asyncio.AbstractEventLoop, out: "asyncio.Queue[Any]", item: Any) -> None:
    # The caller's loop may already be closed (a client gone at shutdown): nobody is left to tell.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(out.put_nowait, item)


def _put_all(items: list[tuple["asyncio.Queue[Any]", RequestDelta]]) -> None:
    for out, delta in items:
        out.put_nowait(delta)
