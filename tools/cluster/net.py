"""Network: a bridge inside a namespace of its own (the switch), one veth link per host.

Each namespace is kept alive by a bind mount on a file under .cluster/ns (``unshare --net=FILE``), so
nothing is registered in /run/netns and ``down`` finds all of them in one directory. No address is
ever given to this machine's root namespace and nothing routes off the bridge: the switch namespace
has only the bridge and the hosts' ports; each host namespace has only ``lo`` and its link, with a
/24 on-link route and no default route. The storage host's link is capped with ``tc tbf`` in both
directions (its egress is what the shared file system serves).
"""

from __future__ import annotations

import os
from pathlib import Path

from .config import IFACE, Config
from .proc import ClusterError, run
from .state import Record

SWITCH = "switch"
BRIDGE = "br0"


def ns(cfg: Config, host: str) -> list[str]:
    """Prefix that runs a command in ``host``'s network namespace."""
    return ["nsenter", f"--net={cfg.netns(host)}", "--"]


def add_netns(cfg: Config, rec: Record, host: str) -> None:
    f = cfg.netns(host)
    f.touch()
    run(["unshare", f"--net={f}", "ip", "link", "set", "lo", "up"])
    rec.add_netns(host, os.stat(f).st_ino)


def build(cfg: Config, rec: Record) -> None:
    add_netns(cfg, rec, SWITCH)
    sw = ns(cfg, SWITCH)
    run([*sw, "ip", "link", "add", BRIDGE, "type", "bridge"])
    run([*sw, "ip", "link", "set", BRIDGE, "up"])
    for host in cfg.hosts:
        add_netns(cfg, rec, host)
        port = cfg.port_name(host)
        # Both ends are created directly inside their namespaces: no link ever appears in the root one.
        run(["ip", "link", "add", IFACE, "netns", str(cfg.netns(host)), "type", "veth", "peer", "name", port,
             "netns", str(cfg.netns(SWITCH))])
        run([*sw, "ip", "link", "set", port, "master", BRIDGE])
        run([*sw, "ip", "link", "set", port, "up"])
        run([*ns(cfg, host), "ip", "addr", "add", f"{cfg.addr(host)}/24", "dev", IFACE])
        run([*ns(cfg, host), "ip", "link", "set", IFACE, "up"])
    set_storage_rate(cfg, cfg.storage_mbit)


def set_storage_rate(cfg: Config, mbit: int) -> None:
    """Cap the storage host's link at ``mbit`` in both directions (tc tbf; netem is not available)."""
    burst = max(64 * 1024, mbit * 1_000_000 // 8 // 250)  # >= 4 ms of traffic, never below a GSO packet
    for host, dev in (("storage", IFACE), (SWITCH, cfg.port_name("storage"))):
        run([*ns(cfg, host), "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit",
             "burst", str(burst), "latency", "200ms"])


def set_link(cfg: Config, host: str, up: bool) -> None:
    """Take a host's link down or up (inside its namespace, as a pulled cable would)."""
    run([*ns(cfg, host), "ip", "link", "set", IFACE, "up" if up else "down"])


def bound(cfg: Config) -> list[Path]:
    """Network namespace files under .cluster/ns that hold a namespace now."""
    from .proc import mounts_under

    return [Path(m) for m in mounts_under(cfg.nsdir) if m.endswith(".net")]


def check_isolated(cfg: Config) -> None:
    """No host namespace has a default route; the root namespace has no address in our subnet."""
    for host in cfg.hosts:
        routes = run([*ns(cfg, host), "ip", "route", "show", "default"]).stdout.strip()
        if routes:
            raise ClusterError(f"{host} has a default route ({routes}); the bridge must stay isolated")
    mine = run(["ip", "-o", "addr", "show"]).stdout
    if f" {cfg.subnet}." in mine:
        raise ClusterError(f"the root namespace holds an address in {cfg.subnet}.0/24")
