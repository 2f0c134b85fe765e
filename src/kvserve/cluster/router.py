"""`python -m kvserve.cluster.router SMG-ARGS...`: SMG's `smg launch`, with its keys taken from the
environment rather than the command line.

SMG takes its control-plane keys only as `--control-plane-api-keys id:name:role:key` arguments and its
client key as `--api-key KEY`, and every local user can read a process's arguments. So `kvserve cluster`
(or an operator, see docs/cluster.md) puts the keys in this process's environment (readable by its own user
only): $KVSERVE_ROUTER_CONTROL_PLANE_KEY, required (the control plane is never open), and
$KVSERVE_ROUTER_API_KEY, optional. This module takes them out of the environment and adds them to the
arguments that SMG's own Python launcher parses in this process: the keys reach the router but never
/proc/PID/cmdline.
"""

import os
import sys
from collections.abc import MutableMapping

CONTROL_PLANE_KEY_ENV = "KVSERVE_ROUTER_CONTROL_PLANE_KEY"
API_KEY_ENV = "KVSERVE_ROUTER_API_KEY"
# The key's id and name in SMG's audit log; it has the admin role.
CONTROL_PLANE_KEY_ID = "kvserve-cluster"


def router_arguments(argv: list[str], environ: MutableMapping[str, str]) -> list[str]:
    """SMG's arguments: `argv` and the keys taken out of `environ`. Raises SystemExit without a
    control-plane key."""
    key = environ.pop(CONTROL_PLANE_KEY_ENV, "")
    if not key:
        raise SystemExit(f"kvserve.cluster.router: ${CONTROL_PLANE_KEY_ENV} is not set")
    arguments = [*argv, "--control-plane-api-keys", f"{CONTROL_PLANE_KEY_ID}:kvserve cluster:admin:{key}"]
    api_key = environ.pop(API_KEY_ENV, "")
    if api_key:
        arguments += ["--api-key", api_key]
    return arguments


def main(argv: list[str]) -> None:
    from smg.launch_router import launch_router, parse_router_args

    launch_router(parse_router_args(router_arguments(argv, os.environ)))


if __name__ == "__main__":
    main(sys.argv[1:])
