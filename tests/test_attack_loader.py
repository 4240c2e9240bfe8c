"""The loader's batch transport under attack: another user of the node, and a user's own odd set-ups.

Real processes throughout: a victim trainer run as one uid and an attacker as another
(tests/asuser.py), a trainer that forks, a process at its open-file limit, a sandbox (a real seccomp
filter) that refuses ``memfd_create``, a Loader inside a DataLoader worker. Waits are on processes and
their output lines, never on time (the timeouts only end a hung run, as a failure).

* Another uid on the node must not be able to reach, stall or feed the transport (stager.loader.shm): the
  workers' descriptors used to travel over a listening socket at an abstract address, readable by anyone
  in ``/proc/net/unix``, whose listen backlog the attacker could fill so that the workers' ``connect``
  (and so the epoch) hung forever; now a socket pair with no address.
* A process forked from a trainer (``os.fork``) that drops its copy of the Loader, or exits, must leave the
  parent's batches and DataLoader workers alone: its finalizers freed the parent's held ring slots (the
  worker then overwrote a batch the parent still held), and torch's iterator and multiprocessing's exit
  handler stopped or terminated the parent's workers.
* A process at its ``ulimit -n`` gets one stager line saying what to do (keep fewer batches, raise the
  limit), not torch's advice about sharing strategies, and never a hang (the kernel drops a descriptor it
  cannot install, and the epoch waited for it).
* A Loader built inside a DataLoader worker runs in that process (``num_workers=0``), or refuses in one line
  to start workers of its own there.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.asuser import ATTACKER, VICTIM, Node, popen_as, python_argv

# ---- another user of the node ----------------------------------------------------------------------

VICTIM_TRAINER = """
import os, sys
from multiprocessing.context import ForkContext, ForkProcess
from stager.loader import make_loader

class GatedProcess(ForkProcess):
    waiting = [True]
    def start(self):
        # The first worker waits until the test says go: the epoch's transport exists, no worker runs yet.
        if self.waiting:
            self.waiting.clear()
            print("READY", os.getpid(), flush=True)
            sys.stdin.readline()
        super().start()

class Gated(ForkContext):
    Process = GatedProcess

loader = make_loader(sys.argv[1], 8, rank=0, world_size=1, num_workers=2, persistent_workers=sys.argv[2] == "1",
                     image_size=8, transform="eval", staged=False, multiprocessing_context=Gated())
epochs = [sorted({int(i) for b in loader for i in b["index"]}) for _ in range(2)]
print("EPOCHS", *[len(e) for e in epochs], flush=True)
"""

ATTACKER_SCRIPT = """
import json, os, socket, sys
victim = sys.argv[1]
# The victim's names only (its pid began the transport's address): other users' trainers on this machine
# are not this test's to flood.
names = sorted({p[7] for p in (line.split() for line in open("/proc/net/unix").read().splitlines()[1:])
                if len(p) >= 8 and p[7].startswith("@stager-" + victim)})
held, refused = [], []
for name in names:
    for _ in range(5000):  # past any listen backlog (net.core.somaxconn)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.setblocking(False)
        try:
            s.connect(("\\0" + name[1:]) if name.startswith("@") else name)
        except OSError as e:
            refused.append(e.errno)
            s.close()
            break
        held.append(s)
try:
    fds = os.listdir(f"/proc/{victim}/fd")
except PermissionError:
    fds = None
print(json.dumps({"names": names, "connected": len(held), "victim_fds": fds}), flush=True)
sys.stdin.read()  # the connections stay open until the test is done
"""


def _bound_unix_names(pid: int) -> list[str]:
    """The addresses (abstract or path) of the Unix sockets process ``pid`` holds (read as root)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    names = []
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 8 and parts[6] in inodes:
            names.append(parts[7])
    return names


def _descendants(pid: int) -> list[int]:
    """The live processes ``pid`` started, and theirs (by the parent pid in ``/proc/<pid>/stat``)."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parent[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    out, todo = [], [pid]
    while todo:
        of = todo.pop()
        kids = [k for k, ppid in parent.items() if ppid == of]
        out += kids
        todo += kids
    return out


def _shared_copy(pack: Path, node: Node) -> Path:
    """``pack`` copied where every user of the node can read it."""
    dst = node.data / pack.name
    shutil.copytree(pack, dst)
    for d, _dirs, files in os.walk(dst):
        os.chmod(d, 0o755)
        for f in files:
            os.chmod(os.path.join(d, f), 0o644)
    return dst


@pytest.mark.timeout(600)
@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "fresh"])
def test_another_user_cannot_find_stall_or_feed_the_batch_transport(frameworks_pack: Path, node: Node,
                                                                     persistent: bool) -> None:
    data = _shared_copy(frameworks_pack, node)
    (node.bin / "victim.py").write_text(textwrap.dedent(VICTIM_TRAINER))
    (node.bin / "attacker.py").write_text(textwrap.dedent(ATTACKER_SCRIPT))
    py = python_argv()
    victim = popen_as(VICTIM, [*py, node.bin / "victim.py", data, "1" if persistent else "0"],
                      env=node.env(VICTIM), cwd=node.home(VICTIM))
    attacker = None
    try:
        assert victim.stdout is not None and victim.stdin is not None
        line = victim.stdout.readline()
        assert line.startswith("READY"), (line, victim.stderr.read() if victim.stderr else "")
        pid = int(line.split()[1])
        addresses = _bound_unix_names(pid)  # the epoch's transport exists now, no worker runs yet
        attacker = popen_as(ATTACKER, [*py, node.bin / "attacker.py", str(pid)], env=node.env(ATTACKER),
                            cwd=node.home(ATTACKER))
        assert attacker.stdout is not None
        report = attacker.stdout.readline()
        assert report, attacker.stderr.read() if attacker.stderr else ""
        seen = json.loads(report)
        victim.stdin.write("go\n")
        victim.stdin.flush()
        try:
            out, err = victim.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the victim's epoch hung while another user held {seen['connected']} connections to "
                        f"{seen['names']}")
        assert victim.returncode == 0, err[-3000:]
        assert out.split()[-3:] == ["EPOCHS", "203", "203"], out
        assert addresses == [], "the victim's batch transport has an address other users can look up"
        assert seen["names"] == [] and seen["connected"] == 0, f"another user found the transport: {seen}"
        assert seen["victim_fds"] is None, "another user listed the victim's descriptors"
    finally:
        for p in (victim, attacker):
            if p is not None:
                for pid in [*_descendants(p.pid), p.pid]:  # a hung victim's workers hold its output pipes
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                p.communicate()


# ---- a user's own process forks -----------------------------------------------------------------------

FORKING_TRAINER = """
import gc, json, os, sys
import torch
from stager.loader import make_loader

loader = make_loader(sys.argv[1], 8, rank=0, world_size=1, num_workers=1, persistent_workers=sys.argv[2] == "1",
                     shuffle=False, image_size=8, transform="eval", staged=False, multiprocessing_context="fork")
if sys.argv[2] == "1":
    list(loader)  # a previous epoch: the persistent pool runs
it = iter(loader)
held = next(it)  # kept: its ring slot must stay the parent's
copy = held["image"].clone()
r, w = os.pipe()
pid = os.fork()
if pid == 0:  # drops every copy it has (the slot's finalizer runs), then a normal exit (atexit handlers run)
    try:
        next(it)  # the parent's epoch: its workers' batches are the parent's
        said = "continued the parent's epoch"
    except Exception as e:
        said = f"{type(e).__name__}: {e}"
    os.write(w, said.encode())
    del held, it
    loader = None
    gc.collect()
    sys.exit(0)
os.close(w)
child_said = os.read(r, 4096).decode()
_, status = os.waitpid(pid, 0)
rest = [b["index"].tolist() for b in it]  # the workers go on writing the epoch's batches into free slots
intact = torch.equal(held["image"], copy)
nxt = sorted(i for b in loader for i in b["index"].tolist())
print(json.dumps({"status": status, "rest": len(rest), "intact": intact, "next": nxt, "child": child_said}),
      flush=True)
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "fresh"])
def test_a_forked_child_leaves_the_parents_batches_and_workers_alone(frameworks_pack: Path, tmp_path: Path,
                                                                     persistent: bool) -> None:
    script = tmp_path / "forking.py"
    script.write_text(textwrap.dedent(FORKING_TRAINER))
    p = subprocess.run([sys.executable, str(script), str(frameworks_pack), "1" if persistent else "0"],
                       capture_output=True, text=True, timeout=240, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.splitlines()[-1])
    assert got["status"] == 0
    assert got["child"].startswith("UsageError: this epoch's batches come from the DataLoader workers of process")
    assert "\n" not in got["child"]
    assert got["intact"], "a batch the parent holds was overwritten after its forked child exited"
    assert got["rest"] == 25
    assert got["next"] == list(range(203)), "the next epoch, on the parent's workers"


# ---- the open-file limit ----------------------------------------------------------------------------

HOARDER = """
import resource, sys
from stager.loader import make_loader

loader = make_loader(sys.argv[1], 1, rank=0, world_size=1, num_workers=2, image_size=8, transform="eval",
                     staged=False, multiprocessing_context="fork")
resource.setrlimit(resource.RLIMIT_NOFILE, (128, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
held = []
try:
    for batch in loader:
        held.append(batch)  # 203 batches kept: more than the rings' slots, each one-off keeps a descriptor
except Exception as e:
    print("ERROR", type(e).__name__, len(held), str(e), flush=True)
    sys.exit(3)
print("HELD", len(held), flush=True)
"""


@pytest.mark.timeout(300)
def test_a_process_at_its_open_file_limit_gets_one_line_saying_what_to_do(frameworks_pack: Path,
                                                                         tmp_path: Path) -> None:
    script = tmp_path / "hoarder.py"
    script.write_text(textwrap.dedent(HOARDER))
    p = subprocess.run([sys.executable, str(script), str(frameworks_pack)], capture_output=True, text=True,
                       timeout=240, check=False)
    lines = p.stdout.splitlines()
    assert p.returncode == 3 and lines, (p.stdout, p.stderr[-3000:])
    _, kind, held, msg = lines[-1].split(" ", 3)
    assert kind == "ResourceLimitError", lines[-1]
    assert 50 < int(held) < 128
    assert "limit of 128 open files (ulimit -n)" in msg and "keep fewer batches" in msg, msg
    assert "sharing_strategy" not in msg


# ---- a sandbox that refuses memfd_create -------------------------------------------------------------

NO_MEMFD = """
import ctypes, errno, os, platform, struct, sys
# A real seccomp filter (as a container runtime's profile installs): memfd_create fails with EPERM.
nr = {"x86_64": 319, "aarch64": 279}[platform.machine()]
arch = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}[platform.machine()]
def op(code, k, jt=0, jf=0):
    return struct.pack("HBBI", code, jt, jf, k)
prog = b"".join([op(0x20, 4), op(0x15, arch, 1, 0), op(0x06, 0x7FFF0000),
                 op(0x20, 0), op(0x15, nr, 0, 1), op(0x06, 0x00050000 | errno.EPERM), op(0x06, 0x7FFF0000)])
buf = ctypes.create_string_buffer(prog)
class Fprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
libc = ctypes.CDLL(None, use_errno=True)
assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
assert libc.prctl(22, 2, ctypes.byref(Fprog(len(prog) // 8, ctypes.addressof(buf))), 0, 0) == 0  # SECCOMP
try:
    os.memfd_create("probe")
    sys.exit("the filter did not refuse memfd_create")
except PermissionError:
    pass
from stager.loader import make_loader
from stager.loader import shm
for persistent in (True, False):
    loader = make_loader(sys.argv[1], 8, rank=0, world_size=1, num_workers=2, persistent_workers=persistent,
                         image_size=8, transform="eval", staged=False, multiprocessing_context="fork")
    print("EPOCHS", shm.available(), *[len({int(i) for b in loader for i in b["index"]}) for _ in range(2)])
"""


@pytest.mark.timeout(300)
@pytest.mark.skipif(os.uname().machine not in ("x86_64", "aarch64") or not sys.platform.startswith("linux"),
                    reason="the seccomp filter here knows memfd_create's number on x86_64 and aarch64 Linux")
def test_a_sandbox_refusing_memfd_create_falls_back_to_torchs_shared_tensors(frameworks_pack: Path,
                                                                             tmp_path: Path) -> None:
    script = tmp_path / "no_memfd.py"
    script.write_text(textwrap.dedent(NO_MEMFD))
    p = subprocess.run([sys.executable, str(script), str(frameworks_pack)], capture_output=True, text=True,
                       timeout=240, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.splitlines() == ["EPOCHS False 203 203"] * 2


# ---- a Loader inside a DataLoader worker ---------------------------------------------------------------


class _LoaderInside(torch.utils.data.IterableDataset):
    """A user's dataset whose workers each build and run a stager Loader."""

    def __init__(self, pack: Path, num_workers: int) -> None:
        self.pack = pack
        self.num_workers = num_workers

    def __iter__(self) -> Iterator[torch.Tensor]:
        from stager.loader import make_loader

        loader = make_loader(self.pack, 8, rank=0, world_size=1, num_workers=self.num_workers, image_size=8,
                             transform="eval", staged=False)
        for batch in loader:
            yield batch["index"]


@pytest.mark.timeout(300)
def test_a_loader_inside_a_dataloader_worker_runs_there_or_refuses_in_one_line(frameworks_pack: Path) -> None:
    from stager.errors import UsageError

    outer = torch.utils.data.DataLoader(_LoaderInside(frameworks_pack, 0), batch_size=None, num_workers=2,
                                        multiprocessing_context="fork")
    ids = sorted(int(i) for t in outer for i in t)
    assert ids == sorted(list(range(203)) * 2), "each outer worker ran the whole Loader in its own process"
    nested = torch.utils.data.DataLoader(_LoaderInside(frameworks_pack, 1), batch_size=None, num_workers=1,
                                         multiprocessing_context="fork")
    with pytest.raises(UsageError) as e:
        list(nested)
    assert "cannot start worker processes inside a daemonic process" in str(e.value)
    assert "build it with num_workers=0 there" in str(e.value)


# ---- Accelerate's gather over a mix ------------------------------------------------------------------------


def test_gather_over_a_mix_gives_advice_that_applies_to_a_mix(mix_sets: dict[str, Path],
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """A mix's padding cannot be dropped by ``gather_for_metrics`` (each stream is padded on its own): the log
    must not tell a user who already evaluates with ``shuffle=False`` to evaluate with ``shuffle=False``."""
    from stager.loader import make_loader
    from stager.loader.frameworks.hooks import gather_remainder

    loader = make_loader([str(mix_sets["tar"]), str(mix_sets["record"])], 8, rank=0, world_size=3, shuffle=False,
                         image_size=8, transform="eval", staged=False)
    with caplog.at_level(logging.INFO, logger="stager.loader"):
        assert gather_remainder(loader) == 0
    said = [r.getMessage() for r in caplog.records if "gather_for_metrics keeps them" in r.getMessage()]
    assert len(said) == 1 and "evaluate with shuffle=False" not in said[0], said
    assert "each dataset with its own shuffle=False loader" in said[0]


# ---- Accelerate and the HF Trainer at the edges (held: regressions) -------------------------------------

ACCELERATE_EVAL = """
import json, sys
from pathlib import Path
from accelerate import Accelerator
from torch.utils.data import DataLoader
from stager.loader import make_loader

acc = Accelerator()
out = {}
for batch, drop_last in ((8, False), (8, True), (5, False), (7, True), (16, False)):
    loader = acc.prepare(make_loader(sys.argv[1], batch, shuffle=False, drop_last=drop_last, num_workers=1,
                                     image_size=8, transform="eval", staged=False))
    passes = []
    for _ in range(2):  # an eval loader reused every epoch
        passes.append([i for b in loader for i in acc.gather_for_metrics(b["index"]).tolist()])
    theirs = acc.prepare(DataLoader(list(range(203)), batch_size=batch, drop_last=drop_last))
    ref = [i for b in theirs for i in acc.gather_for_metrics(b).tolist()]
    out[f"{batch}-{drop_last}"] = {"passes": passes, "accelerate": ref}
Path(sys.argv[2], f"rank{acc.process_index}.json").write_text(json.dumps(out))
"""


@pytest.mark.timeout(600)
def test_gather_for_metrics_on_3_processes_is_accelerates_own_order(frameworks_pack: Path, tmp_path: Path) -> None:
    """``shuffle=False`` under ``accelerator.prepare`` on 3 processes (203 samples: uneven tails), with and without
    ``drop_last``, the loader reused for a second pass: ``gather_for_metrics`` gives exactly what Accelerate's own
    DataLoader gives (the dataset's order, padding dropped), on every rank and every pass."""
    pytest.importorskip("accelerate", reason="accelerate is in the test extra: make venv (tools/setup_venv.sh)")
    from tests.frameworks.common import free_port, python, run

    script = tmp_path / "accelerate_eval.py"
    script.write_text(textwrap.dedent(ACCELERATE_EVAL))
    run([python(), "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "3", "--num_machines", "1",
         "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()), str(script),
         str(frameworks_pack), str(tmp_path)], cwd=tmp_path, env={"ACCELERATE_USE_CPU": "1"})
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    for case, got in ranks[0].items():
        assert got["passes"] == [got["accelerate"]] * 2, case
        assert got["accelerate"] == list(range(len(got["accelerate"]))), case
        assert all(r[case] == got for r in ranks[1:]), case


TRAINER_ACCUMULATING = """
import json, sys
from pathlib import Path
import torch
from transformers import Trainer, TrainingArguments
from stager.loader import make_loader

DATA, OUT = sys.argv[1], Path(sys.argv[2])

class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.seen = []
    def forward(self, image, labels, index):
        self.seen.append(index.tolist())
        return {"loss": self.w.sum() * 0.0 + image.float().mean() * 0.0}

class LoaderTrainer(Trainer):
    def get_train_dataloader(self):
        loader = make_loader(DATA, 8, num_workers=1, image_size=8, transform="train", staged=False, seed=7)
        loader.collate_fn = lambda b: {"image": b["image"], "labels": b["label"], "index": b["index"]}
        return loader

def run(resume):
    args = TrainingArguments(output_dir=str(OUT / "ckpt"), per_device_train_batch_size=8, num_train_epochs=3,
                             gradient_accumulation_steps=3, save_strategy="steps", save_steps=1, report_to="none",
                             use_cpu=True, logging_strategy="no", disable_tqdm=True, seed=7, dataloader_num_workers=1)
    model = Tiny()
    trainer = LoaderTrainer(model=model, args=args)
    trainer.train(resume_from_checkpoint=None if resume is None else str(OUT / "ckpt" / f"checkpoint-{resume}"))
    return model.seen, trainer.args.process_index, trainer.state.global_step

full, rank, steps = run(None)
resumed = {k: run(k)[0] for k in (1, 4, 5, 7, 15)}
(OUT / f"rank{rank}.json").write_text(json.dumps({"full": full, "steps": steps, "resumed": resumed}))
"""


@pytest.mark.timeout(600)
def test_trainer_resume_with_gradient_accumulation_at_the_edges(frameworks_pack: Path, tmp_path: Path) -> None:
    """The HF Trainer over ``make_loader(...)`` with ``gradient_accumulation_steps=3`` (13 batches per epoch: optimizer
    steps at batches 3, 6, 9, 12 and the epoch's last), resumed from the first step, the step before an epoch's
    partial accumulation, an epoch's end, mid-epoch and the last step: the resumed run's batches are exactly the
    uninterrupted run's from the batch after that step (none after the last)."""
    pytest.importorskip("transformers", reason="transformers is in the test extra: make venv (tools/setup_venv.sh)")
    from tests.frameworks.common import PER_RANK_BATCHES, free_port, python, run

    script = tmp_path / "trainer_accumulating.py"
    script.write_text(textwrap.dedent(TRAINER_ACCUMULATING))
    run([python(), "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
         str(script), str(frameworks_pack), str(tmp_path)], cwd=tmp_path)
    per_epoch = -(-PER_RANK_BATCHES // 3)  # optimizer steps per epoch: 5
    for r in range(2):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert got["steps"] == 3 * per_epoch and len(got["full"]) == 3 * PER_RANK_BATCHES
        for step, seen in got["resumed"].items():
            epoch, within = divmod(int(step), per_epoch)
            done = epoch * PER_RANK_BATCHES + min(3 * within, PER_RANK_BATCHES)
            assert seen == got["full"][done:], f"rank {r} resumed at step {step}"
