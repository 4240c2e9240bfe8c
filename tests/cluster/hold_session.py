"""Not part of the suite (no ``test_`` prefix): the inner test session of test_cluster_teardown.py, run
as ``make test TESTS=tests/cluster/hold_session.py`` with its own CLUSTER_ROOT. It holds the cluster
fixture, says so in the file STAGER_HOLD_READY names (its pid), and waits to be killed."""

from __future__ import annotations

import os
import time
from pathlib import Path

from tools.cluster.client import Cluster


def test_hold_the_cluster_until_killed(cluster: Cluster) -> None:
    ready = Path(os.environ["STAGER_HOLD_READY"])
    tmp = ready.with_suffix(".tmp")
    tmp.write_text(str(os.getpid()))
    tmp.rename(ready)
    time.sleep(900)
