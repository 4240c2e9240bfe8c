"""Hosts: each one's hostname (UTS namespace) and mounts (mount namespace), kept alive by bind-mounting
the namespace files under .cluster/ns (a private mount, as unshare(1) requires).

Inside every host's mount namespace: /etc/hosts is .cluster/etc/hosts (names resolve both ways; the
machine's own /etc/hosts is untouched). On compute nodes also: CLUSTER_LOCAL is that node's own
directory, CLUSTER_LOCAL_SMALL its small one (a size-limited tmpfs on the last node, for full-disk
tests), CLUSTER_BEEOND the BeeOND stand-in shared by all nodes. CLUSTER_SHARED is mounted later
(sharedfs.py) because its client has to run in the node's network namespace.
"""

from __future__ import annotations

import shlex

from .config import Config
from .proc import ClusterError, mounts_under, run


def write_hosts_file(cfg: Config) -> None:
    lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
    lines += [f"{cfg.addr(h)}\t{h}" for h in cfg.hosts]
    # The same addresses as IPv4-mapped IPv6: a dual-stack listener (torch's TCPStore) sees its peers
    # as ::ffff:a.b.c.d, and c10d warns when those do not resolve back to a name.
    lines += [f"::ffff:{cfg.addr(h)}\t{h}" for h in cfg.hosts]
    cfg.etc.mkdir(parents=True, exist_ok=True)
    (cfg.etc / "hosts").write_text("\n".join(lines) + "\n")


def prepare_nsdir(cfg: Config) -> None:
    cfg.nsdir.mkdir(parents=True, exist_ok=True)
    if str(cfg.nsdir) not in mounts_under(cfg.nsdir):
        run(["mount", "--bind", str(cfg.nsdir), str(cfg.nsdir)])
        run(["mount", "--make-private", str(cfg.nsdir)])


def _mount_script(cfg: Config, host: str) -> str:
    steps = [
        ["umount", "-l", str(cfg.nsdir)],  # this namespace need not hold the other hosts' namespaces
        ["hostname", host],
        ["mount", "--bind", str(cfg.etc / "hosts"), "/etc/hosts"],
    ]
    if host.startswith("node"):
        d = cfg.node_dir(host)
        steps.append(["mount", "--bind", str(d / "local"), str(cfg.local)])
        if host == cfg.small_node and cfg.small_mb > 0:
            steps.append(["mount", "-t", "tmpfs", "-o", f"size={cfg.small_mb}m,mode=1777", f"stgr-small-{host}",
                          str(cfg.local_small)])
        else:
            steps.append(["mount", "--bind", str(d / "small"), str(cfg.local_small)])
        steps.append(["mount", "--bind", str(cfg.beeond_backing), str(cfg.beeond)])
    return " && ".join(shlex.join(s) for s in steps)


def create(cfg: Config, host: str) -> None:
    if host.startswith("node"):
        for sub in ("local", "small"):
            (cfg.node_dir(host) / sub).mkdir(parents=True, exist_ok=True)
    mnt, uts = cfg.ns_file(host, "mnt"), cfg.ns_file(host, "uts")
    for f in (mnt, uts):
        f.touch()
    run(["nsenter", f"--net={cfg.netns(host)}", "--", "unshare", f"--mount={mnt}", f"--uts={uts}",
         "--propagation", "slave", "sh", "-c", _mount_script(cfg, host)])


def check(cfg: Config, host: str) -> None:
    res = run(["nsenter", f"--mount={cfg.ns_file(host, 'mnt')}", f"--uts={cfg.ns_file(host, 'uts')}", "--",
               "sh", "-c", "hostname; getent hosts \"$(hostname)\""])
    name, resolved = res.stdout.split("\n", 1)
    if name.strip() != host or cfg.addr(host) not in resolved:
        raise ClusterError(f"{host}: hostname {name!r} resolves to {resolved.strip()!r}")


def make_dirs(cfg: Config) -> None:
    for d in (cfg.etc, cfg.logs, cfg.bin, cfg.export, cfg.beeond_backing, cfg.shared, cfg.local, cfg.local_small,
              cfg.beeond):
        d.mkdir(parents=True, exist_ok=True)
