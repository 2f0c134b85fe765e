"""A local process that binds a replica's port before the replica does is never handed to the router:
`kvserve cluster` asks what answers there to prove that it is the replica it spawned (the HMAC of a
fresh challenge under the replica's nonce, and its PID), and stops with a clear error when it is not."""

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kvserve.cluster.launch import Cluster, ClusterConfig
from kvserve.cluster.redis_process import free_port


class AnswersEverything(BaseHTTPRequestHandler):
    """A squatter as the review ran one: 200 and an empty JSON object on any route."""

    def do_GET(self) -> None:
        body = b"{}"
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_POST = do_GET

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    run_dir = str(tmp_path / "run")
    config = ClusterConfig(replicas=1, threads=1, port=free_port(), redis=False, run_dir=run_dir)
    c = Cluster(config)
    yield c
    c.stop()


def test_a_process_squatting_a_replicas_port_is_not_handed_to_the_router(cluster: Cluster) -> None:
    squatter = ThreadingHTTPServer(("127.0.0.1", cluster.replicas[0].port), AnswersEverything)
    thread = threading.Thread(target=squatter.serve_forever, daemon=True)
    thread.start()
    try:
        refused = f"port {cluster.replicas[0].port} answers, but not as the replica"
        with pytest.raises(RuntimeError, match=refused):
            cluster.start()
    finally:
        squatter.shutdown()
        squatter.server_close()
    # The router never started, and the replica the launcher spawned was stopped.
    assert cluster.router is None
    process = cluster.replicas[0].process
    assert process is not None and process.poll() is not None
