"""``python -m tools.cluster up|down|status|link|rate|on`` (``make cluster`` / ``make cluster-down``)."""

from __future__ import annotations

import argparse
import os
import sys

from . import lifecycle, net, session, slurm
from .config import Config
from .proc import ClusterError, enter, netns_pids, ns_inode
from .state import Owner, Record


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.cluster", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("up", help="bring the cluster up (idempotent); writes .cluster/env")
    sub.add_parser("down", help="remove everything `up` made (safe at any time)")
    sub.add_parser("status", help="exit 0 when the cluster is up and healthy")
    lk = sub.add_parser("link", help="take a host's link down or up (fault injection)")
    lk.add_argument("host")
    lk.add_argument("state", choices=("up", "down"))
    rt = sub.add_parser("rate", help="change the storage link's cap (Mbit/s)")
    rt.add_argument("mbit", type=int)
    on = sub.add_parser("on", help="run a command inside a host's namespaces")
    on.add_argument("host")
    on.add_argument("command", nargs=argparse.REMAINDER)
    pids = sub.add_parser("pids", help="processes inside a host's network namespace")
    pids.add_argument("host")
    sub.add_parser("sweep", help="take down clusters that dead test sessions left (any checkout; `up` does this too)")
    reap = sub.add_parser("reap", help="(internal) a test session's reaper: read stdin to its end, then take the "
                                       "cluster down if that session still owns it (tools/cluster/session.py)")
    reap.add_argument("--owner-pid", type=int, required=True)
    reap.add_argument("--owner-start", required=True)
    a = p.parse_args(argv)
    cfg = Config.from_env()
    try:
        if a.cmd == "up":
            lifecycle.up(cfg)
        elif a.cmd == "down":
            lifecycle.down(cfg)
        elif a.cmd == "status":
            rec = Record(cfg.record)
            lifecycle.healthy(cfg, rec)
            states = slurm.node_states(cfg)
            owner = rec.owner
            print(" ".join(f"{n}:{s}" for n, s in sorted(states.items()))
                  + (f" (owner: {owner.describe()})" if owner else ""))
        elif a.cmd == "link":
            net.set_link(cfg, a.host, a.state == "up")
        elif a.cmd == "rate":
            net.set_storage_rate(cfg, a.mbit)
        elif a.cmd == "pids":
            inode = ns_inode(cfg.netns(a.host))
            print(" ".join(str(x) for x in netns_pids({inode} if inode else set())))
        elif a.cmd == "sweep":
            print(" ".join(str(r) for r in lifecycle.sweep()))
        elif a.cmd == "reap":
            start = None if a.owner_start == "None" else int(a.owner_start)
            return session.reap(cfg, Owner("session", a.owner_pid, start))
        elif a.cmd == "on":
            cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
            os.execvp("nsenter", [*enter(cfg, a.host), *(cmd or ["sh"])])
    except ClusterError as exc:
        print(f"cluster: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
