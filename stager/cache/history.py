"""The staging history: when this user staged which dataset, so ``stager hints`` can say a cache pays.

Every ``stager stage`` appends one line (dataset id, source, bytes read from SRC, seconds, host, and
whether a cache served it) to ``$STAGER_HISTORY``, else ``$XDG_STATE_HOME/stager/history.jsonl``, else
``~/.local/state/stager/history.jsonl`` of the effective user (from the password database, not
``$HOME``: a prolog that drops to the user keeps root's environment). ``STAGER_HISTORY=off``
disables it. Writing it never fails a stage; the file is the user's (0600) and is trimmed to its
last :data:`KEEP` lines.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import time
from pathlib import Path
from typing import Any

HISTORY_ENV = "STAGER_HISTORY"
KEEP = 2000
REPEAT_WINDOW_S = 86400.0  # "staged again within a day"


def history_path(env: dict[str, str] | None = None) -> Path | None:
    env = dict(os.environ) if env is None else env
    given = env.get(HISTORY_ENV)
    if given:
        return None if given.lower() in ("off", "0", "no", "none") else Path(given)
    state = env.get("XDG_STATE_HOME")
    if state:
        return Path(state) / "stager" / "history.jsonl"
    try:
        home = pwd.getpwuid(os.geteuid()).pw_dir
    except KeyError:
        return None
    return Path(home) / ".local" / "state" / "stager" / "history.jsonl"


def record_stage(entry: dict[str, Any], env: dict[str, str] | None = None) -> None:
    """Append one stage to the history (quietly does nothing when it cannot)."""
    path = history_path(env)
    if path is None:
        return
    line = (json.dumps({"time": time.time(), "host": os.uname().nodename, **entry}) + "\n").encode()
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            if os.fstat(fd).st_uid != os.geteuid():
                return
            os.write(fd, line)
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        if size > KEEP * 400:
            lines = path.read_bytes().splitlines(keepends=True)[-KEEP // 2:]
            tmp = path.with_name(path.name + ".trim")
            tmp.write_bytes(b"".join(lines))
            os.replace(tmp, path)


def stages_of(dataset_id: str, env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """This user's recorded stages of ``dataset_id``, oldest first."""
    path = history_path(env)
    if path is None:
        return []
    out = []
    try:
        data = path.read_bytes()
    except OSError:
        return []
    for ln in data.splitlines():
        with contextlib.suppress(ValueError):
            rec = json.loads(ln)
            if isinstance(rec, dict) and rec.get("dataset_id") == dataset_id:
                out.append(rec)
    return out


def repeat_advice(dataset_id: str, bytes_total: int, env: dict[str, str] | None = None,
                  now: float | None = None) -> dict[str, Any]:
    """Would a cache pay for this dataset? ``{"stages_24h", "uncached_stages_24h", "bytes_reread",
    "seconds_reread", "pays", "reason"}``: it pays when the dataset was staged again within a day
    without a cache (every such stage read it all from SRC again)."""
    now = time.time() if now is None else now
    recent = [r for r in stages_of(dataset_id, env) if now - float(r.get("time", 0)) <= REPEAT_WINDOW_S]
    uncached = [r for r in recent if not r.get("cache")]
    reread = sum(int(r.get("bytes_copied", 0)) for r in uncached[1:])
    seconds = sum(float(r.get("seconds", 0)) for r in uncached[1:])
    pays = len(recent) >= 2 and len(uncached) >= 2
    if pays:
        reason = (f"staged {len(recent)} times in the last 24 h, {len(uncached)} of them without a cache: "
                  f"{reread / 1e9:.2f} GB and {seconds:.0f} s spent reading it again; with --cache DIR on the "
                  "node's local disk the next stages link the cached shards instead")
    elif recent and all(r.get("cache") for r in recent):
        reason = f"staged {len(recent)} times in the last 24 h, served by a cache"
    else:
        reason = f"staged {len(recent)} time(s) in the last 24 h: a cache pays once a dataset is staged again"
    return {"stages_24h": len(recent), "uncached_stages_24h": len(uncached), "bytes_reread": reread,
            "seconds_reread": round(seconds, 3), "pays": pays, "reason": reason, "dataset_bytes": bytes_total}
