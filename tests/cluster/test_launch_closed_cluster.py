"""`kvserve cluster` is closed by default (one replica, a real Redis and a real SMG, on loopback): SMG's
control plane refuses whoever lacks its generated key, while clients' inference calls go through with
their own key (the router's and the replicas', both given by the environment); its Prometheus port
binds loopback; no child's command line holds a credential; the replica's KV reaches the closed Redis
with the password from its file; and a replica proves who it is only with the nonce it was given."""

import secrets
import time
from collections.abc import Iterator

import httpx
import psutil
import pytest
import redis

from kvserve.cluster.launch import Cluster, ClusterConfig
from kvserve.cluster.redis_process import free_port
from kvserve.cluster.router import API_KEY_ENV, CONTROL_PLANE_KEY_ENV, router_arguments
from kvserve.credentials import identity_proof
from tests.cluster.cluster_harness import MODEL, system_prompt

CLIENT_KEY = "client-" + secrets.token_hex(8)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(
        ClusterConfig(
            replicas=1,
            threads=2,
            port=free_port(),
            redis_maxmemory="64mb",
            serve_args=["--kv-cache-memory", "64MiB"],
            run_dir=str(tmp_path_factory.mktemp("cluster") / "run"),
        )
    )
    # A client key as the README sets one: SMG's (KVSERVE_ROUTER_API_KEY) and the replicas'
    # (KVSERVE_API_KEY), from the launcher's environment, which its children inherit.
    with pytest.MonkeyPatch.context() as env:
        env.setenv(API_KEY_ENV, CLIENT_KEY)
        env.setenv("KVSERVE_API_KEY", CLIENT_KEY)
        c.start()
    yield c
    c.stop()


def chat(cluster: Cluster, messages: list[dict[str, str]], key: str | None) -> httpx.Response:
    body = {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0}
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.post(f"{cluster.url}/v1/chat/completions", json=body, headers=headers, timeout=300)


def admin(cluster: Cluster) -> dict[str, str]:
    return {"Authorization": f"Bearer {cluster.control_plane_key}"}


def test_smg_refuses_an_unauthenticated_control_plane(cluster: Cluster) -> None:
    workers = f"{cluster.url}/workers"
    listed = httpx.get(workers, headers=admin(cluster), timeout=30)
    assert listed.status_code == 200
    [worker] = listed.json()["workers"]
    assert worker["url"] == cluster.replicas[0].url
    for headers in ({}, {"Authorization": "Bearer guessed"}):
        assert httpx.get(workers, headers=headers, timeout=30).status_code == 401
        # The review's attack: add a forged worker, remove the real one.
        added = httpx.post(workers, json={"url": "http://127.0.0.1:9"}, headers=headers, timeout=30)
        assert added.status_code == 401
        removed = httpx.delete(f"{workers}/{worker['id']}", headers=headers, timeout=30)
        assert removed.status_code == 401
    [still] = httpx.get(workers, headers=admin(cluster), timeout=30).json()["workers"]
    assert still["url"] == cluster.replicas[0].url


def test_clients_call_the_router_with_their_key_and_kv_reaches_the_closed_redis(cluster: Cluster) -> None:
    messages = [{"role": "system", "content": system_prompt("plums")}, {"role": "user", "content": "Sum?"}]
    reply = chat(cluster, messages, CLIENT_KEY)
    assert reply.status_code == 200, reply.text
    # The two keys are apart: the control-plane key is no client key, and the other way round.
    assert chat(cluster, messages, None).status_code == 401
    assert chat(cluster, messages, cluster.control_plane_key).status_code == 401
    workers = httpx.get(f"{cluster.url}/workers", headers={"Authorization": f"Bearer {CLIENT_KEY}"})
    assert workers.status_code == 401
    # The replica's blocks reach Redis (written behind the step): it authenticated with the password
    # from its file.
    assert cluster.redis is not None
    assert reply.json()["usage"]["prompt_tokens"] > 32
    admin_client = cluster.redis.client()
    try:
        deadline = time.monotonic() + 60
        while admin_client.dbsize() == 0:
            assert time.monotonic() < deadline, "the replica never wrote its blocks to Redis"
            time.sleep(0.2)
    finally:
        admin_client.close()
    with pytest.raises(redis.RedisError):
        redis.Redis(host="127.0.0.1", port=cluster.redis.port, socket_timeout=5).dbsize()


def test_no_child_has_a_credential_on_its_command_line(cluster: Cluster) -> None:
    assert cluster.redis is not None and cluster.redis.process is not None and cluster.router is not None
    credentials = [cluster.redis.password, cluster.control_plane_key, CLIENT_KEY]
    credentials += [r.nonce.hex() for r in cluster.replicas]
    pids = [cluster.redis.process.pid, cluster.router.pid]
    pids += [r.process.pid for r in cluster.replicas if r.process is not None]
    assert len(pids) == 3
    for pid in pids:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read()
        for credential in credentials:
            assert credential.encode() not in argv, f"a credential is on the command line of {argv!r}"


def test_the_routers_metrics_listen_on_loopback_only(cluster: Cluster) -> None:
    assert cluster.router is not None
    listening = [
        c.laddr
        for c in psutil.Process(cluster.router.pid).net_connections("inet")
        if c.status == psutil.CONN_LISTEN
    ]
    # The router itself and its Prometheus endpoint, both on the router's loopback address.
    assert len(listening) >= 2
    assert all(address.ip == "127.0.0.1" for address in listening), listening


def test_a_replica_proves_its_identity_only_with_its_nonce(cluster: Cluster) -> None:
    replica = cluster.replicas[0]
    assert replica.process is not None
    challenge = secrets.token_bytes(32)
    r = httpx.get(f"{replica.url}/identity", params={"challenge": challenge.hex()}, timeout=30)
    assert r.status_code == 200
    assert r.json() == {
        "pid": replica.process.pid,
        "proof": identity_proof(replica.nonce, challenge, replica.process.pid),
    }
    assert replica.nonce.hex() not in r.text
    for bad in ("", "zz" * 32, "ab" * 8, "ab" * 65):
        assert httpx.get(f"{replica.url}/identity", params={"challenge": bad}, timeout=30).status_code == 400


def test_the_router_takes_its_keys_from_the_environment_only() -> None:
    environ = {CONTROL_PLANE_KEY_ENV: "cp-key", API_KEY_ENV: "client-key", "OTHER": "kept"}
    arguments = router_arguments(["--port", "8000"], environ)
    assert arguments == [
        "--port", "8000",
        "--control-plane-api-keys", "kvserve-cluster:kvserve cluster:admin:cp-key",
        "--api-key", "client-key",
    ]  # fmt: skip
    # Taken out, so that nothing the router starts inherits them.
    assert environ == {"OTHER": "kept"}
    # Never an open control plane.
    with pytest.raises(SystemExit, match=CONTROL_PLANE_KEY_ENV):
        router_arguments(["--port", "8000"], {API_KEY_ENV: "client-key"})


def test_a_replica_that_exited_is_removed_from_the_router(cluster: Cluster) -> None:
    # Last in this module: it kills the module's replica. Left in the router, the replica's freed port
    # would be routed to again as soon as any process bound it and answered /health.
    cluster.kill_replica(0)
    assert cluster.forget_exited_replicas() == [0]
    assert cluster.forget_exited_replicas() == []
    deadline = time.monotonic() + 60
    while httpx.get(f"{cluster.url}/workers", headers=admin(cluster), timeout=30).json()["workers"]:
        assert time.monotonic() < deadline, "the router kept the exited replica"
        time.sleep(0.5)
