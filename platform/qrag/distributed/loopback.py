"""A Ray that this process starts for itself stays on this machine: bound to 127.0.0.1.

Ray on Linux replaces a node address of 127.0.0.1 (``ray.init(_node_ip_address=...)``,
``ray start --node-ip-address``) by the machine's own address and listens on every interface.
Its single-machine mode, the one it uses on macOS and Windows, keeps every server and the node's
address on 127.0.0.1; ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` selects it on any system (a head
started so takes no other nodes). Used where qrag starts a local Ray, never where it joins a
cluster.
"""

from __future__ import annotations

import os
import sys

SINGLE_MACHINE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def keep_ray_on_loopback() -> None:
    """Call before starting a local Ray. Sets the variable for this process and the Ray processes
    it starts; Ray reads it when imported, so an already imported Ray is told too."""
    os.environ[SINGLE_MACHINE_ENV] = "0"
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None and hasattr(constants, "ENABLE_RAY_CLUSTER"):
        constants.ENABLE_RAY_CLUSTER = False
