"""Tenants: namespaces derived from API keys keep one tenant's prompts out of another's cache hits, reply
memory, /tokenize and metrics; shared groups share on purpose; the timing audit cannot tell a prompt that
another tenant cached from one that nobody did."""

import asyncio
import os
import queue
import random
import signal
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families
from scipy.stats import ks_2samp

from kvserve.config import EngineConfig, default_cache_dir
from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine import Engine
from kvserve.errors import KVServeError
from kvserve.model.loader import LoadedModel
from kvserve.options import ServerOptions
from kvserve.server.app import create_app
from kvserve.server.http.tenants import (
    KeyFileError,
    Tenant,
    Tenants,
    load_or_create_secret,
    parse_key_file,
)
from tests.helpers import free_port, server_process

KEYS = {"a": "key-aaaaaaaa", "b": "key-bbbbbbbb", "c": "key-cccccccc", "d": "key-dddddddd"}
ADMIN_KEY = "admin-key-0000"
KEY_FILE = f"""# tenants a and b are isolated; c and d share the group "public"
a:{KEYS["a"]}
b:{KEYS["b"]}
c:{KEYS["c"]}:public
d:{KEYS["d"]}:public
"""
# Prompt length and probe count of the timing audit: long enough that a hit is plain in the time to
# first token on the real model, enough probes for the KS test, small enough for a 2-core machine. The
# model runs its default weights: int8's products (torch._int_mm) made each probe take seconds.
AUDIT_TOKENS = 64
AUDIT_PROBES = 30


@dataclass
class TenantServer:
    url: str
    tenants: Tenants
    async_engine: AsyncEngine

    def post(self, tenant: str, path: str, body: dict[str, Any]) -> httpx.Response:
        headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
        return httpx.post(f"{self.url}{path}", json=body, headers=headers, timeout=120)

    def complete(self, tenant: str, prompt: str | list[int], **extra: Any) -> dict[str, Any]:
        body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, **extra}
        r = self.post(tenant, "/v1/completions", body)
        assert r.status_code == 200, r.text
        result: dict[str, Any] = r.json()
        return result


def cached(result: dict[str, Any]) -> int:
    value: int = result["usage"]["prompt_tokens_details"]["cached_tokens"]
    return value


def _key_file_tenants(tmp_path_factory: pytest.TempPathFactory, name: str) -> Tenants:
    folder = tmp_path_factory.mktemp(name)
    key_file = folder / "keys"
    key_file.write_text(KEY_FILE)
    return Tenants(load_or_create_secret(str(folder)), key_file=str(key_file))


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory,
    make_engine: Callable[..., Engine],
    serve_app: Callable[[FastAPI], AbstractContextManager[str]],
) -> Iterator[TenantServer]:
    tenants = _key_file_tenants(tmp_path_factory, "tenants")
    async_engine = AsyncEngine(make_engine(kv_cache_memory=256 * 2**20, max_model_len=2048))
    with serve_app(create_app(async_engine, ServerOptions(admin_key=ADMIN_KEY), tenants)) as url:
        yield TenantServer(url, tenants, async_engine)


def test_key_file_parses_tenants_groups_and_comments() -> None:
    keys = parse_key_file(KEY_FILE + "a:key-a-rotated  # a second key for a\n\n")
    assert keys[KEYS["a"]] == keys["key-a-rotated"] == Tenant("a")
    assert keys[KEYS["c"]] == Tenant("c", "public")
    for bad, reason in [
        ("a", "expected tenant:key"),
        ("a:short", "8-512 printable"),
        ("a b:key-aaaaaaaa", "names are"),
        ("a:key-aaaaaaaa\nb:key-aaaaaaaa", "already given"),
        ("a:key-aaaaaaaa:g1\na:key-a2222222:g2", "two different shared groups"),
        ("# nothing\n", "no keys"),
    ]:
        with pytest.raises(KeyFileError, match=reason) as error:
            parse_key_file(bad)
        assert "key-aaaa" not in str(error.value)  # errors never echo a key


def test_secret_is_created_once_private_and_kept(tmp_path: Path) -> None:
    secret = load_or_create_secret(str(tmp_path / "cache"))
    path = tmp_path / "cache" / "tenant-secret"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_or_create_secret(str(tmp_path / "cache")) == secret and len(secret) == 32
    # The same secret gives the same namespaces after a restart; another secret gives others.
    again = Tenants(secret, api_key="sesame-key")
    assert again.namespace(Tenant("a")) == Tenants(secret).namespace(Tenant("a"))
    assert Tenants(os.urandom(32)).namespace(Tenant("a")) != again.namespace(Tenant("a"))
    path.chmod(0o644)
    with pytest.raises(KVServeError, match="chmod 600"):
        load_or_create_secret(str(tmp_path / "cache"))


def test_namespaces_come_from_the_tenant_not_the_client(server: TenantServer) -> None:
    t = server.tenants
    a, b, c, d = (t.authenticate(KEYS[name]) for name in "abcd")
    assert a is not None and b is not None and c is not None and d is not None
    assert t.authenticate("key-wrong") is None and t.authenticate(None) is None
    assert t.namespace(a) != t.namespace(b)
    assert t.namespace(c) == t.namespace(d) != t.namespace(a)
    # A salt splits a tenant's namespace, and no salt of b's reaches a's namespace (or a's salted one).
    assert t.namespace(a, "s") not in {t.namespace(a), t.namespace(b, "s"), t.namespace(c, "s")}
    assert len({t.namespace(x, s) for x in (a, b, c) for s in (None, "", "a", "b", "public")}) == 15


def test_every_route_needs_a_tenant_key(server: TenantServer) -> None:
    for headers in ({}, {"Authorization": "Bearer key-wrong"}, {"Authorization": KEYS["a"]}):
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    # The generated docs would describe the API to anyone: off when the server has keys.
    assert httpx.get(f"{server.url}/openapi.json").status_code == 404
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_another_tenants_prompt_never_hits_but_a_shared_group_does(server: TenantServer) -> None:
    prompt = "Tenant isolation check: the quick brown fox jumps over the lazy dog, then naps in the sun."
    first = server.complete("a", prompt)
    assert cached(first) == 0
    # b sends a's exact prompt: a miss, and the same greedy reply (computed afresh, the same way).
    other = server.complete("b", prompt)
    assert cached(other) == 0
    assert other["choices"][0]["text"] == first["choices"][0]["text"]
    # a's repeat hits its own namespace: everything but the last prompt token.
    repeat = server.complete("a", prompt)
    assert cached(repeat) == repeat["usage"]["prompt_tokens"] - 1
    assert repeat["choices"][0]["text"] == first["choices"][0]["text"]

    shared = "Shared group check: a public system prompt that the members of one group may all reuse."
    assert cached(server.complete("c", shared)) == 0
    hit = server.complete("d", shared)
    assert cached(hit) == hit["usage"]["prompt_tokens"] - 1
    # The group's namespace is its members' only.
    for outsider in "ab":
        assert cached(server.complete(outsider, shared)) == 0

    # A cache_salt splits a tenant's own namespace further.
    salted = "Salt check: one tenant splits its own namespace in two with a salt of its choosing."
    assert cached(server.complete("a", salted, cache_salt="s1")) == 0
    assert cached(server.complete("a", salted, cache_salt="s2")) == 0
    assert cached(server.complete("a", salted)) == 0
    hit = server.complete("a", salted, cache_salt="s1")
    assert cached(hit) == hit["usage"]["prompt_tokens"] - 1
    assert cached(server.complete("b", salted, cache_salt="s1")) == 0


def test_reply_memory_and_tokenize_are_per_namespace(server: TenantServer) -> None:
    reply = "A remembered reply, spelled in tokens of its own."
    spliced = [7, 8, 9]
    namespace_a = server.tenants.namespace(Tenant("a"))
    asyncio.run(server.async_engine.call(lambda e: e.replies.remember(namespace_a, reply, spliced)))
    chat = {
        "messages": [
            {"role": "user", "content": "Say something."},
            {"role": "assistant", "content": reply},
            {"role": "user", "content": "Again."},
        ]
    }

    def tokens(tenant: str, **extra: Any) -> list[int]:
        r = server.post(tenant, "/tokenize", {**chat, **extra})
        assert r.status_code == 200, r.text
        ids: list[int] = r.json()["tokens"]
        return ids

    def contains(ids: list[int], part: list[int]) -> bool:
        return any(ids[i : i + len(part)] == part for i in range(len(ids)))

    assert contains(tokens("a"), spliced)
    # Other tenants, and a's own salted namespace, tokenize the reply's text as text.
    for other in (tokens("b"), tokens("c"), tokens("a", cache_salt="x")):
        assert not contains(other, spliced)
        assert other == tokens("b")


def test_prefix_cache_metrics_per_tenant(server: TenantServer) -> None:
    prompt = "Metrics per tenant: count my cached tokens and nobody else's, please."
    before = _tenant_hits(server)
    server.complete("b", prompt)
    hit = server.complete("b", prompt)
    server.complete("a", prompt + " And more.")
    after = _tenant_hits(server)
    assert after["b"][1] - before.get("b", (0, 0))[1] == cached(hit) > 0
    assert after["b"][0] - before.get("b", (0, 0))[0] == 2 * hit["usage"]["prompt_tokens"]
    assert after["a"][1] == before.get("a", (0, 0))[1]


def test_metrics_need_the_admin_key_once_keys_are_set(server: TenantServer) -> None:
    """/metrics has a row per tenant (names, cached tokens request by request): the operator's view, not
    a tenant's."""
    server.complete("b", "A prompt of b's, to put b's name into the metrics.")
    for headers in ({"Authorization": f"Bearer {KEYS['a']}"}, {}, {"Authorization": "Bearer"}):
        r = httpx.get(f"{server.url}/metrics", headers=headers)
        assert r.status_code == 401 and 'tenant="b"' not in r.text, headers
    r = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert r.status_code == 200 and 'tenant="b"' in r.text


def _tenant_hits(server: TenantServer) -> dict[str, tuple[float, float]]:
    r = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert r.status_code == 200
    queries: dict[str, float] = {}
    hits: dict[str, float] = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            if sample.name == "kvserve_tenant_prefix_cache_queries_total":
                queries[sample.labels["tenant"]] = sample.value
            elif sample.name == "kvserve_tenant_prefix_cache_hits_total":
                hits[sample.labels["tenant"]] = sample.value
    return {t: (queries[t], hits.get(t, 0.0)) for t in queries}


def _audit(server: TenantServer, seed: int) -> tuple[float, float, dict[str, list[float]]]:
    """One audit: (isolated KS p-value, shared-group KS p-value, the TTFT samples)."""
    rng = random.Random(seed)
    vocab = range(1000, 40000)
    # Every prompt starts with a token no other prompt starts with, so probes never hit each other.
    firsts = rng.sample(vocab, 4 * AUDIT_PROBES)

    def prompt(i: int) -> list[int]:
        return [firsts[i], *rng.choices(vocab, k=AUDIT_TOKENS - 1)]

    client_headers = {name: {"Authorization": f"Bearer {key}"} for name, key in KEYS.items()}
    samples: dict[str, list[float]] = {
        "isolated-hit": [],
        "isolated-miss": [],
        "shared-hit": [],
        "shared-miss": [],
    }
    with httpx.Client(base_url=server.url, timeout=120) as client:

        def ttft(tenant: str, ids: list[int]) -> tuple[float, int]:
            body = {"prompt": ids, "max_tokens": 1, "temperature": 0}
            start = time.perf_counter()
            r = client.post("/v1/completions", json=body, headers=client_headers[tenant])
            elapsed = time.perf_counter() - start
            assert r.status_code == 200, r.text
            return elapsed, cached(r.json())

        for i in range(AUDIT_PROBES):
            owner_isolated, fresh_isolated, owner_shared, fresh_shared = (prompt(4 * i + j) for j in range(4))
            ttft("a", owner_isolated)
            ttft("c", owner_shared)
            probes = [
                ("isolated-hit", "b", owner_isolated),
                ("isolated-miss", "b", fresh_isolated),
                ("shared-hit", "d", owner_shared),
                ("shared-miss", "d", fresh_shared),
            ]
            rng.shuffle(probes)
            for kind, tenant, ids in probes:
                elapsed, hit = ttft(tenant, ids)
                assert hit == (AUDIT_TOKENS - 1 if kind == "shared-hit" else 0), kind
                samples[kind].append(elapsed)

    isolated = ks_2samp(samples["isolated-hit"], samples["isolated-miss"])
    shared = ks_2samp(samples["shared-hit"], samples["shared-miss"])
    print(f"\ntiming audit: isolated KS p = {isolated.pvalue:.3g}, shared group KS p = {shared.pvalue:.3g}")
    return isolated.pvalue, shared.pvalue, samples


def test_timing_audit_finds_no_hit_across_tenants_and_finds_one_within_a_group(
    server: TenantServer,
) -> None:
    """Gu et al.'s audit as a test: the time to first token of tenant B's probes on prompts that tenant
    A has just cached, against probes on prompts nobody has cached. Isolated tenants (a, b) must look
    the same to a two-sample Kolmogorov-Smirnov test; tenants of one shared group (c, d) must not,
    which shows that the audit can fail. Rounds interleave every kind of probe, in random order, so
    that the machine's noise falls on all samples alike.

    With no difference the isolated p-value is uniform, so p <= 0.01 happens 1% of the time by chance:
    such a run is audited once more, independently. A real leak gives p-values like the shared group's
    (1e-15) every time, so it still fails; a false alarm now needs two in a row (1e-4)."""
    isolated, shared, samples = _audit(server, 11)
    if isolated <= 0.01:
        isolated, shared, samples = _audit(server, 12)
    assert isolated > 0.01, samples
    assert shared < 0.001, samples


def test_sighup_reloads_the_key_file(tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("a:key-aaaaaaaa\n")
    port = free_port()
    argv = [sys.executable, "-m", "kvserve", "serve", "--port", str(port), "--kv-cache-memory", "32MiB"]
    argv += ["--max-model-len", "256", "--api-key-file", str(key_file)]
    with server_process(argv, port) as (process, url):
        assert process.stdout is not None

        def status(key: str) -> int:
            headers = {"Authorization": f"Bearer {key}"}
            return httpx.get(f"{url}/v1/models", headers=headers, timeout=30).status_code

        # Read on a thread, so that a server that stops logging fails the test instead of hanging it.
        lines: queue.Queue[str] = queue.Queue()
        stdout = process.stdout

        def read_log() -> None:
            for line in iter(stdout.readline, b""):
                lines.put(line.decode())
            lines.put("")  # the end of the log

        threading.Thread(target=read_log, daemon=True).start()

        def log_until(text: str, timeout_s: float = 60) -> str:
            deadline = time.monotonic() + timeout_s
            seen = ""
            while text not in seen:
                try:
                    line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    raise AssertionError(f"no {text!r} in the log within {timeout_s} s: {seen}") from None
                assert line, f"the server exited before logging {text!r}: {seen}"
                seen += line
            return seen

        startup = log_until("tenancy:")
        assert "tenancy: 1 tenants" in startup
        assert status("key-aaaaaaaa") == 200 and status("key-bbbbbbbb") == 401
        # A broken file is refused, and the keys in force stay.
        key_file.write_text("a:short\n")
        process.send_signal(signal.SIGHUP)
        refused = log_until("key file not reloaded")
        assert "key-aaaaaaaa" not in refused and "short" not in refused  # the log never shows a key
        assert status("key-aaaaaaaa") == 200
        key_file.write_text("b:key-bbbbbbbb\n")
        process.send_signal(signal.SIGHUP)
        log_until("key file reloaded")
        assert status("key-bbbbbbbb") == 200 and status("key-aaaaaaaa") == 401
    secret = Path(default_cache_dir()) / "tenant-secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--api-key", ""], {}, "--api-key"),
        ([], {"KVSERVE_API_KEY": " "}, "KVSERVE_API_KEY"),
        ([], {"KVSERVE_ADMIN_KEY": ""}, "KVSERVE_ADMIN_KEY"),
        (["--admin-key", "  "], {}, "--admin-key"),
        (["--admin-key", "short"], {}, "8-512"),
        (["--api-key", "same-key-1", "--admin-key", "same-key-1"], {}, "differ"),
    ],
)
def test_an_empty_or_bad_key_is_refused_at_startup(
    argv: list[str],
    env: dict[str, str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    """docker-compose writes `KVSERVE_ADMIN_KEY=` for an unset variable: that empty key would make a bare
    `Authorization: Bearer` an admin. Every such key stops the server before the model loads."""
    from kvserve.cli import main

    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    for name in ("KVSERVE_API_KEY", "KVSERVE_ADMIN_KEY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["serve", "--port", str(free_port()), *argv]) == 2
    error = capsys.readouterr().err
    assert message in error and "same-key-1" not in error


def test_the_admin_key_differs_from_every_tenant_key_also_on_reload(tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("a:key-aaaaaaaa\n")
    with pytest.raises(KVServeError, match="admin key"):
        Tenants(os.urandom(32), key_file=str(key_file), admin_key="key-aaaaaaaa")
    tenants = Tenants(os.urandom(32), key_file=str(key_file), admin_key="admin-key-1")
    key_file.write_text("a:key-aaaaaaaa\nb:admin-key-1\n")
    tenants.reload()
    assert tenants.authenticate("admin-key-1") is None
    assert tenants.authenticate("key-aaaaaaaa") == Tenant("a")


def test_a_hash_inside_a_key_is_part_of_the_key() -> None:
    keys = parse_key_file("# comment\na:key#with#hash:group1\nb:key-bbbbbbbb # comment\n  # indented\n")
    assert keys == {"key#with#hash": Tenant("a", "group1"), "key-bbbbbbbb": Tenant("b")}


def test_a_key_file_without_a_final_newline_is_refused_on_reload(tmp_path: Path) -> None:
    """A file caught half-written (a key cut short that still parses) must not become the keys."""
    key_file = tmp_path / "keys"
    key_file.write_text("a:key-aaaaaaaa\n")
    tenants = Tenants(os.urandom(32), key_file=str(key_file))
    key_file.write_text("a:key-aaaaaaaa\nb:key-bbbb")  # b's key-bbbbbbbbbbbb, cut short
    tenants.reload()
    assert tenants.authenticate("key-bbbb") is None
    assert tenants.authenticate("key-aaaaaaaa") == Tenant("a")


def test_a_fifo_in_place_of_the_key_file_does_not_block_the_reload(tmp_path: Path) -> None:
    """SIGHUP's reload runs on the event loop's thread: opening a FIFO there would freeze the server."""
    key_file = tmp_path / "keys"
    key_file.write_text("a:key-aaaaaaaa\n")
    tenants = Tenants(os.urandom(32), key_file=str(key_file))
    key_file.unlink()
    os.mkfifo(key_file)
    tenants.reload()
    assert tenants.authenticate("key-aaaaaaaa") == Tenant("a")


PIN_PROMPT = list(range(2000, 2048))  # three whole blocks of 16 tokens


@pytest.fixture(scope="module")
def pin_server(
    tmp_path_factory: pytest.TempPathFactory,
    tiny_model: LoadedModel,
    serve_app: Callable[[FastAPI], AbstractContextManager[str]],
) -> Iterator[TenantServer]:
    """Tenants on the tiny model with pinning on: the cache routes' isolation, not the model, is tested."""
    tenants = _key_file_tenants(tmp_path_factory, "tenant-pins")
    config = EngineConfig(
        kv_cache_memory=4 * 2**20, max_model_len=256, weight_dtype="float32", max_pinned_tokens=256
    )
    async_engine = AsyncEngine(Engine.from_config(config, model=tiny_model))
    with serve_app(create_app(async_engine, ServerOptions(admin_key=ADMIN_KEY), tenants)) as url:
        yield TenantServer(url, tenants, async_engine)


@pytest.mark.usefixtures("one_thread")
def test_cache_routes_and_pins_are_per_tenant_and_the_admin_sees_all(pin_server: TenantServer) -> None:
    def get(key: str, path: str) -> httpx.Response:
        return httpx.get(f"{pin_server.url}{path}", headers={"Authorization": f"Bearer {key}"}, timeout=60)

    def pins(tenant: str) -> list[str]:
        r = get(KEYS[tenant], "/v1/cache")
        assert r.status_code == 200, r.text
        return [p["id"] for p in r.json()["pins"]]

    r = pin_server.post("a", "/v1/cache/pin", {"prompt": PIN_PROMPT, "ttl_s": 60})
    assert r.status_code == 200, r.text
    pin_a = r.json()
    assert pin_a["pinned_tokens"] == 48
    status = get(KEYS["a"], "/v1/cache").json()
    assert [p["id"] for p in status["pins"]] == [pin_a["id"]]
    assert status["tiers"][0]["pinned_blocks"] == 3
    # Other tenants neither see a's pin nor can remove it; a shared group sees its members' pins.
    assert pins("b") == pins("c") == [] and get(ADMIN_KEY, "/v1/cache").json()["pins"] == []
    gone = httpx.delete(
        f"{pin_server.url}/v1/cache/pin/{pin_a['id']}", headers={"Authorization": f"Bearer {KEYS['b']}"}
    )
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "pin_not_found"
    assert pins("a") == [pin_a["id"]]
    pin_c = pin_server.post("c", "/v1/cache/pin", {"prompt": PIN_PROMPT, "ttl_s": 60}).json()
    assert pins("d") == pins("c") == [pin_c["id"]] and pins("a") == [pin_a["id"]]

    # a's pinned prefix serves a's completion and nobody else's.
    hit = pin_server.complete("a", [*PIN_PROMPT, 7])
    assert cached(hit) == 48
    assert cached(pin_server.complete("b", [*PIN_PROMPT, 7])) == 0

    # The dashboard's data: a tenant sees its own prefixes and counters only, the admin every tenant's.
    mine = get(KEYS["a"], "/v1/cache/stats").json()
    assert mine["scope"] == "tenant" and mine["history"] == []
    assert {b["namespace"] for b in mine["branches"]} == {"a"}
    # a's completions: one, of 49 prompt tokens, 48 of them from the pin (a pin's own prefill is no
    # completion, and is not counted).
    assert (mine["counters"]["cache_queries"], mine["counters"]["cache_hits"]) == (49, 48)
    assert mine["requests"] == [] and mine["num_requests"] == 0
    every = get(ADMIN_KEY, "/v1/cache/stats").json()
    assert every["scope"] == "all"
    assert {"a"} <= {b["namespace"] for b in every["branches"]}
    assert get(KEYS["b"], "/v1/cache/stats").json()["branches"] == []
    for pin in (pin_a, pin_c):
        owner = "a" if pin is pin_a else "d"
        r = httpx.delete(
            f"{pin_server.url}/v1/cache/pin/{pin['id']}", headers={"Authorization": f"Bearer {KEYS[owner]}"}
        )
        assert r.status_code == 200, r.text
    assert pins("a") == pins("c") == []


@pytest.fixture(scope="module")
def disk_server(
    tmp_path_factory: pytest.TempPathFactory,
    tiny_model: LoadedModel,
    serve_app: Callable[[FastAPI], AbstractContextManager[str]],
) -> Iterator[TenantServer]:
    """Tenants on the tiny model with a disk tier below memory: what each may count of the cache."""
    tenants = _key_file_tenants(tmp_path_factory, "tenant-counts")
    config = EngineConfig(
        kv_cache_memory=4 * 2**20,
        max_model_len=256,
        weight_dtype="float32",
        kv_disk=str(tmp_path_factory.mktemp("tenant-counts-disk")),
    )
    async_engine = AsyncEngine(Engine.from_config(config, model=tiny_model))
    with serve_app(create_app(async_engine, ServerOptions(admin_key=ADMIN_KEY), tenants)) as url:
        yield TenantServer(url, tenants, async_engine)


@pytest.mark.usefixtures("one_thread")
def test_a_tenant_counts_its_own_cached_blocks_never_the_shared_tiers(disk_server: TenantServer) -> None:
    def status(key: str) -> dict[str, Any]:
        r = httpx.get(f"{disk_server.url}/v1/cache", headers={"Authorization": f"Bearer {key}"}, timeout=60)
        assert r.status_code == 200, r.text
        result: dict[str, Any] = r.json()
        return result

    disk_server.complete("a", PIN_PROMPT)
    disk_server.complete("c", PIN_PROMPT[:32])
    admin = status(ADMIN_KEY)
    memory, disk = admin["tiers"]
    per_block = memory["bytes_used"] // memory["blocks"]
    assert disk["name"] == "disk" and isinstance(disk["blocks"], int) and isinstance(disk["bytes_used"], int)
    mine = {tenant: status(KEYS[tenant])["tiers"] for tenant in KEYS}
    counts = {tenant: tiers[0]["blocks"] for tenant, tiers in mine.items()}
    # a's prefixes, and the group's (c and d share one namespace), are the whole tree; b has none.
    assert counts["a"] >= 3 and counts["c"] >= 2 and counts["b"] == 0 and counts["c"] == counts["d"]
    assert counts["a"] + counts["c"] == memory["blocks"]
    for tiers in mine.values():
        own, lower = tiers
        assert own["bytes_used"] == own["blocks"] * per_block
        assert own["capacity_bytes"] == memory["capacity_bytes"]
        assert lower["name"] == "disk" and lower["blocks"] is None and lower["bytes_used"] is None
    # The dashboard's data counts the same way: the pool-wide parts only for the admin.
    every = httpx.get(f"{disk_server.url}/v1/cache/stats", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert every.json()["pool"]["free"] is not None and every.json()["pool"]["tiers"][0]["blocks"] is not None
    for tenant, blocks in counts.items():
        headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
        pool = httpx.get(f"{disk_server.url}/v1/cache/stats", headers=headers).json()["pool"]
        assert (pool["cached"], pool["pinned"]) == (blocks, 0)
        assert pool["free"] is pool["in_use"] is pool["evicted"] is pool["usage"] is None
        assert pool["tiers"][0]["blocks"] is None and pool["tiers"][0]["bytes_used"] is None
