"""`python -m kvserve.cluster.router SMG-ARGS...`: SMG's `smg launch`, with its control-plane key taken
from the environment rather than the command line.

SMG takes control-plane keys only as `--control-plane-api-keys id:name:role:key` arguments, and every
local user can read a process's arguments. So the launcher puts the key in this child's environment
($KVSERVE_ROUTER_CONTROL_PLANE_KEY, readable by its own user only) and this module, running SMG's own
Python launcher in-process, adds the argument to the list it parses: the key reaches the router but
never /proc/PID/cmdline.
"""

import os
import sys

CONTROL_PLANE_KEY_ENV = "KVSERVE_ROUTER_CONTROL_PLANE_KEY"
# The key's id and name in SMG's audit log and /workers answers; it has the admin role.
CONTROL_PLANE_KEY_ID = "kvserve-cluster"


def control_plane_argument(key: str) -> str:
    return f"{CONTROL_PLANE_KEY_ID}:kvserve cluster launcher:admin:{key}"


def main(argv: list[str]) -> None:
    from smg.launch_router import launch_router, parse_router_args

    key = os.environ.pop(CONTROL_PLANE_KEY_ENV, None)
    if not key:
        # Never an open control plane: this module exists to start SMG with a key.
        sys.exit(f"kvserve.cluster.router: ${CONTROL_PLANE_KEY_ENV} is not set")
    launch_router(parse_router_args([*argv, "--control-plane-api-keys", control_plane_argument(key)]))


if __name__ == "__main__":
    main(sys.argv[1:])
