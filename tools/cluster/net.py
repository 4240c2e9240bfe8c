"""Network: a bridge inside a namespace of its own (the switch), one veth link per host.

No address is ever given to this machine's root namespace and nothing routes off the bridge: the
switch namespace has only the bridge and the hosts' ports; each host namespace has only ``lo`` and
its link, with a /24 on-link route and no default route. The storage host's link is capped with
``tc tbf`` in both directions (its egress is what the shared file system serves).
"""

from __future__ import annotations

from pathlib import Path

from .config import IFACE, Config
from .proc import ClusterError, run
from .state import Record

SWITCH = "switch"
BRIDGE = "br0"


def ensure_run_netns(rec: Record) -> None:
    """`ip netns add` makes /run/netns (a mount) on first use; remember whether we caused that."""
    if not Path("/run/netns").exists():
        rec.set("run_netns_created", True)


def add_netns(cfg: Config, rec: Record, host: str) -> None:
    name = cfg.netns(host)
    rec.add_netns(name)  # recorded before it exists: down tolerates names that are absent
    run(["ip", "netns", "add", name])
    run(["ip", "-n", name, "link", "set", "lo", "up"])


def build(cfg: Config, rec: Record) -> None:
    ensure_run_netns(rec)
    sw = cfg.netns(SWITCH)
    add_netns(cfg, rec, SWITCH)
    run(["ip", "-n", sw, "link", "add", BRIDGE, "type", "bridge"])
    run(["ip", "-n", sw, "link", "set", BRIDGE, "up"])
    for host in cfg.hosts:
        ns = cfg.netns(host)
        add_netns(cfg, rec, host)
        port = cfg.port_name(host)
        # Both ends are created directly inside their namespaces: no link ever appears in the root one.
        run(["ip", "link", "add", IFACE, "netns", ns, "type", "veth", "peer", "name", port, "netns", sw])
        run(["ip", "-n", sw, "link", "set", port, "master", BRIDGE])
        run(["ip", "-n", sw, "link", "set", port, "up"])
        run(["ip", "-n", ns, "addr", "add", f"{cfg.addr(host)}/24", "dev", IFACE])
        run(["ip", "-n", ns, "link", "set", IFACE, "up"])
    set_storage_rate(cfg, cfg.storage_mbit)


def set_storage_rate(cfg: Config, mbit: int) -> None:
    """Cap the storage host's link at ``mbit`` in both directions (tc tbf; netem is not available)."""
    burst = max(64 * 1024, mbit * 1_000_000 // 8 // 250)  # >= 4 ms of traffic, never below a GSO packet
    for ns, dev in ((cfg.netns("storage"), IFACE), (cfg.netns(SWITCH), cfg.port_name("storage"))):
        run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit",
             "burst", str(burst), "latency", "200ms"])


def set_link(cfg: Config, host: str, up: bool) -> None:
    """Take a host's link down or up (inside its namespace, as a pulled cable would)."""
    run(["ip", "-n", cfg.netns(host), "link", "set", IFACE, "up" if up else "down"])


def tx_bytes(cfg: Config, host: str) -> int:
    res = run(["ip", "netns", "exec", cfg.netns(host), "cat", f"/sys/class/net/{IFACE}/statistics/tx_bytes"])
    return int(res.stdout.strip())


def existing(cfg: Config) -> list[str]:
    """This checkout's namespaces that exist now (by prefix: found even without a record)."""
    res = run(["ip", "netns", "list"], check=False)
    if res.returncode != 0:
        return []
    names = [ln.split()[0] for ln in res.stdout.splitlines() if ln.strip()]
    return [n for n in names if n.startswith(cfg.prefix)]


def check_isolated(cfg: Config) -> None:
    """No host namespace has a default route; the root namespace has no address in our subnet."""
    for host in cfg.hosts:
        routes = run(["ip", "-n", cfg.netns(host), "route", "show", "default"]).stdout.strip()
        if routes:
            raise ClusterError(f"{host} has a default route ({routes}); the bridge must stay isolated")
    mine = run(["ip", "-o", "addr", "show"]).stdout
    if f" {cfg.subnet}." in mine:
        raise ClusterError(f"the root namespace holds an address in {cfg.subnet}.0/24")
