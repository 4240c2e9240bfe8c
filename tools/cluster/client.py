"""Use a running cluster from Python (the tests and the benchmarks): its environment, jobs, counters
and fault switches. Everything goes through the same commands a user has after ``source .cluster/env``.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import net
from .config import Config
from .proc import enter, netns_pids, ns_inode

TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
            "DEADLINE")


def read_env(path: Path) -> dict[str, str]:
    """The variables .cluster/env exports (it is written as ``export NAME=<shell-quoted value>``)."""
    out = {}
    for line in path.read_text().splitlines():
        if line.startswith("export "):
            name, _, value = line[len("export "):].partition("=")
            words = shlex.split(value)
            out[name] = words[0] if words else ""
    return out


def parse_job(text: str) -> dict[str, str]:
    """``scontrol show job -o`` as a dict (values may contain spaces; keys are ``Word=``)."""
    return dict(re.findall(r"(?:^| )([A-Za-z][A-Za-z:/_]*)=(.*?)(?= [A-Za-z][A-Za-z:/_]*=|$)", text.strip()))


@dataclass
class Job:
    id: int
    info: dict[str, str] = field(default_factory=dict)
    output: str = ""
    tasks: Path | None = None  # a directory of per-task output files (srun --output=DIR/%N.out), if any

    @property
    def state(self) -> str:
        return self.info.get("JobState", "?")

    @property
    def exit_code(self) -> int:
        """The job's exit code (Slurm's ``ExitCode=rc:signal``)."""
        return int(self.info.get("ExitCode", "0:0").split(":")[0])

    def describe(self) -> str:
        text = (f"job {self.id}: {self.state} ExitCode={self.info.get('ExitCode')} "
                f"Reason={self.info.get('Reason')} AdminComment={self.info.get('AdminComment', '')}\n"
                f"--- output ---\n{self.output[-6000:]}")
        if self.tasks is not None and self.tasks.is_dir():
            for f in sorted(self.tasks.iterdir()):
                text += f"\n--- {f.name} ---\n{f.read_text(errors='replace')[-3000:]}"
        return text


class Cluster:
    """A handle on the cluster this checkout's ``make cluster`` brought up."""

    def __init__(self, cfg: Config | None = None) -> None:
        self.cfg = cfg or Config.from_env()
        self.env = read_env(self.cfg.env_file)
        self.nodes = self.env["CLUSTER_NODE_NAMES"].split()
        self.shared = Path(self.env["CLUSTER_SHARED"])
        self.export = Path(self.env["CLUSTER_SHARED_EXPORT"])
        self.local = Path(self.env["CLUSTER_LOCAL"])
        self.beeond = Path(self.env["CLUSTER_BEEOND"])

    # --- environment -------------------------------------------------------------------------------
    def shell_env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {**os.environ, **self.env}
        env["PATH"] = f"{self.cfg.bin}:{env.get('PATH', '')}"
        env.update(extra or {})
        return env

    def run(self, cmd: list[str], *, timeout: float = 120, check: bool = True,
            env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        """A command in this machine's shell with .cluster/env sourced."""
        res = subprocess.run(cmd, env=self.shell_env(env), cwd=cwd, capture_output=True, text=True, timeout=timeout,
                             check=False)
        if check and res.returncode != 0:
            raise RuntimeError(f"`{shlex.join(cmd)}` exited {res.returncode}: {res.stderr.strip()}")
        return res

    def shared_path(self, export_path: Path) -> Path:
        """Where the nodes see a path of the served directory."""
        return self.shared / Path(export_path).relative_to(self.export)

    def node_path(self, node: str, path: Path) -> Path:
        """Where this machine sees a node's path under CLUSTER_LOCAL or CLUSTER_LOCAL_SMALL (its private
        disks; the small one of CLUSTER_SMALL_NODE is a tmpfs only that node sees)."""
        path = Path(path)
        for name, mount in (("local", self.local), ("small", Path(self.env["CLUSTER_LOCAL_SMALL"]))):
            if path == mount or mount in path.parents:
                return self.cfg.node_dir(node) / name / path.relative_to(mount)
        raise ValueError(f"{path} is not on a node-local disk ({self.local}, {self.env['CLUSTER_LOCAL_SMALL']})")

    # --- jobs ------------------------------------------------------------------------------------------
    def submit(self, args: list[str], *, env: dict[str, str] | None = None, cwd: Path | None = None) -> int:
        """``sbatch --parsable ARGS``; the job id."""
        res = self.run(["sbatch", "--parsable", *args], env=env, cwd=cwd)
        return int(res.stdout.strip().split(";")[0])

    def job(self, job_id: int, output: Path | None = None) -> Job:
        res = self.run(["scontrol", "show", "job", "-o", str(job_id)], check=False)
        info = parse_job(res.stdout) if res.returncode == 0 else {}
        out = output.read_text(errors="replace") if output is not None and output.exists() else ""
        return Job(job_id, info, out)

    def wait(self, job_id: int, *, timeout: float = 300, output: Path | None = None) -> Job:
        """Poll until the job has ended (a terminal state and not completing); scancel it on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            j = self.job(job_id, output)
            if j.state in TERMINAL and not self.completing(job_id):
                return j
            if time.monotonic() > deadline:
                self.run(["scancel", str(job_id)], check=False)
                raise TimeoutError(f"job {job_id} still {j.state} after {timeout:.0f}s\n{j.describe()}")
            time.sleep(0.3)

    def completing(self, job_id: int) -> bool:
        """True while the job's epilog still runs on some node (squeue shows it as CG)."""
        res = self.run(["squeue", "-h", "-j", str(job_id), "-o", "%t"], check=False)
        return res.stdout.strip() == "CG"

    def sbatch(self, args: list[str], *, output: Path, env: dict[str, str] | None = None, cwd: Path | None = None,
               timeout: float = 300) -> Job:
        """Submit (``--output=OUTPUT``) and wait until the job and its epilogs have finished."""
        job_id = self.submit([f"--output={output}", *args], env=env, cwd=cwd)
        return self.wait(job_id, timeout=timeout, output=output)

    def wait_state(self, job_id: int, states: tuple[str, ...], timeout: float = 120) -> Job:
        deadline = time.monotonic() + timeout
        while True:
            j = self.job(job_id)
            if j.state in states:
                return j
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} never reached {states}: {j.describe()}")
            time.sleep(0.2)

    def node_states(self) -> dict[str, str]:
        res = self.run(["sinfo", "-h", "-N", "-o", "%N %T"])
        return dict(line.split() for line in res.stdout.splitlines() if line.strip())

    # --- counters and faults -------------------------------------------------------------------------
    def served_bytes(self) -> int:
        """Bytes the storage host has sent so far (CLUSTER_SERVED_BYTES)."""
        return int(subprocess.run(self.env["CLUSTER_SERVED_BYTES"], shell=True, check=True, capture_output=True,
                                  text=True).stdout.strip())

    def set_link(self, host: str, up: bool) -> None:
        net.set_link(self.cfg, host, up)

    def set_storage_rate(self, mbit: int) -> None:
        net.set_storage_rate(self.cfg, mbit)

    def processes(self, host: str, needle: str) -> list[int]:
        """Pids inside ``host``'s network namespace whose command line contains ``needle``."""
        found = []
        inode = ns_inode(self.cfg.netns(host))
        for pid in netns_pids({inode} if inode else set()):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if needle in cmd:
                found.append(pid)
        return found

    def kill(self, host: str, needle: str, sig: int = signal.SIGKILL) -> list[int]:
        """Send ``sig`` to every process of ``host`` whose command line contains ``needle``
        (from inside the host's namespaces, as a node's own admin would)."""
        pids = self.processes(host, needle)
        if pids:
            subprocess.run([*enter(self.cfg, host), "kill", f"-{int(sig)}", *map(str, pids)], check=False,
                           capture_output=True)
        return pids

    def on(self, host: str, cmd: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """A command inside ``host``'s namespaces (its mounts: CLUSTER_SHARED, CLUSTER_LOCAL, ...)."""
        return subprocess.run([*enter(self.cfg, host), *cmd], capture_output=True, text=True, timeout=timeout,
                              check=False, env=self.shell_env())
