"""The shared file system: OpenSSH's sftp-server on the storage host, sshfs (FUSE) on every node.

The kernel here has no NFS (client or server) but FUSE works, so the "Lustre" of this cluster is
sshfs talking SFTP straight over TCP (``-o directport``) to ``sftp-server`` processes that
tools/cluster/sftpd.py starts per connection in the storage host's namespace. Every byte a node reads
crosses the bridge and the storage host's tbf-capped link, so the storage host's transmit counter
is the number of bytes the shared file system served. Caches are off (``dir_cache=no``, zero
attribute/entry timeouts, no kernel page cache across opens): what one node or the host writes is
what every node sees, as on a coherent parallel file system.
"""

from __future__ import annotations

import sys
from pathlib import Path

from .config import SFTP_PORT, Config
from .proc import ClusterError, enter, run, spawn, wait_for
from .state import Record

SSHFS_OPTS = ("directport={port},allow_other,reconnect,dir_cache=no,attr_timeout=0,entry_timeout=0,"
              "negative_timeout=0,max_read=131072")


def start_server(cfg: Config, rec: Record) -> None:
    cmd = [sys.executable, str(Path(__file__).with_name("sftpd.py")), "--listen", cfg.addr("storage"),
           "--port", str(SFTP_PORT), "--root", str(cfg.export)]
    rec.add_daemon("sftpd", spawn(cfg, "storage", "sftpd", cmd))
    wait_for("sftpd listening", lambda: listening(cfg), timeout=60)


def listening(cfg: Config) -> bool:
    res = run([*enter(cfg, "storage", mount=False), "ss", "-Hltn"], check=False)
    return f"{cfg.addr('storage')}:{SFTP_PORT} " in res.stdout


def mounted(cfg: Config, node: str) -> bool:
    res = run([*enter(cfg, node), "cat", "/proc/self/mountinfo"], check=False)
    return any(line.split()[4] == str(cfg.shared) and " fuse.sshfs " in line for line in res.stdout.splitlines())


def mount(cfg: Config, rec: Record, node: str) -> None:
    cmd = ["sshfs", "-f", "-o", SSHFS_OPTS.format(port=SFTP_PORT), f"storage:{cfg.export}", str(cfg.shared)]
    rec.add_daemon(f"sshfs-{node}", spawn(cfg, node, f"sshfs-{node}", cmd))


def check(cfg: Config, node: str) -> None:
    """The node sees the served directory: a probe file written by the host is readable there."""
    probe = cfg.export / ".stgr-probe"
    probe.write_text(node)
    try:
        res = run([*enter(cfg, node), "cat", str(cfg.shared / ".stgr-probe")], check=False, timeout=30)
        if res.returncode != 0 or res.stdout != node:
            raise ClusterError(f"{node}: {cfg.shared} does not show the storage host's files "
                               f"({res.stderr.strip() or res.stdout!r})")
    finally:
        probe.unlink(missing_ok=True)


def mount_all(cfg: Config, rec: Record) -> None:
    start_server(cfg, rec)
    for node in cfg.node_names:
        mount(cfg, rec, node)
    for node in cfg.node_names:
        wait_for(f"sshfs on {node}", lambda n=node: mounted(cfg, n), timeout=60)  # type: ignore[misc]
        check(cfg, node)
