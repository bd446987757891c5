"""A Ray cluster of several nodes on this machine for tests (``ray.cluster_utils.Cluster``).

Every node binds on 127.0.0.1 and keeps its files in a fresh temporary directory (Ray would
otherwise turn 127.0.0.1 into this machine's outward address when a driver connects: its
single-machine switch keeps the loopback); leaving the
context shuts down only this cluster's processes (never ``ray stop``, which would end every Ray
process on the machine).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator

from ray._private import ray_constants
from ray.cluster_utils import Cluster

RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # read at import by processes Ray starts
    "OMP_NUM_THREADS": "1",
}


@contextlib.contextmanager
def local_cluster(head_cpus: int, head_labels: dict[str, str], nodes: list[dict]) -> Iterator[Cluster]:
    """A head node and one more node per entry of ``nodes`` (``{"num_cpus": .., "labels": {..}}``)."""
    # Short: Ray's socket paths below it must stay under the 107 bytes of a Unix socket name.
    tmp = tempfile.mkdtemp(prefix="asyncrl-ray-")
    saved = {k: os.environ.get(k) for k in [*RAY_ENV, "RAY_TMPDIR"]}
    os.environ.update(RAY_ENV, RAY_TMPDIR=tmp)
    single_machine, ray_constants.ENABLE_RAY_CLUSTER = ray_constants.ENABLE_RAY_CLUSTER, False
    cluster = None
    try:
        cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": head_cpus,
                "labels": head_labels,
                "node_ip_address": "127.0.0.1",
                "include_dashboard": False,
            },
        )
        for node in nodes:
            cluster.add_node(node_ip_address="127.0.0.1", **node)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        if cluster is not None:
            cluster.shutdown()
        ray_constants.ENABLE_RAY_CLUSTER = single_machine
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(tmp, ignore_errors=True)
