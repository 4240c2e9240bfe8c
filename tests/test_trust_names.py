"""Names are never made from secrets, and what others wrote is printed escaped (issue 39, item 4),
for real: the CLI, the loader and the unmodified tools/slurm scripts as unprivileged uids
(tests/asuser.py, tests/test_trust_prolog.py).

* A mix stream's default name comes from its location's path only (:func:`stager.redact.location_path`):
  a URL's ``?sig=...`` never becomes ``ds_sig_<SECRET>``, which was printed, stored in
  ``stager-mix.json``, made a directory (``DEST/<name>``) and, through the prolog, copied into the
  job's AdminComment and the world-readable failure record.
* Control characters in names others chose (a dataset path in a job's comment, a directory in a
  shared ``/tmp``) reach no terminal, record or log raw.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from stager.mix import Stream
from stager.stage.mix import stream_dest
from tests.asuser import ATTACKER, VICTIM, Node, python_as, run_as
from tests.test_trust_prolog import JOB, Service, service  # noqa: F401 (the fixture)
from tests.test_trust_prolog import VICTIM as JOB_USER

SECRET = "SECRET-7f3a9"


def _controls(text: str) -> list[str]:
    return [c for c in text if (ord(c) < 32 and c not in "\n\t") or 0x7F <= ord(c) <= 0x9F]


@pytest.mark.parametrize("url", [f"s3://bucket/data/ds?sig={SECRET}", f"https://u:{SECRET}@h/ds/manifest.json",
                                 f"gs://b/ds#{SECRET}", f"http://h/ds/?X-Amz-Signature={SECRET}&v=1"])
def test_a_streams_default_name_never_carries_a_secret(url: str, tmp_path: Path) -> None:
    s = Stream(url)
    assert s.name == "ds" and SECRET not in s.name
    assert SECRET not in stream_dest(tmp_path, s) and SECRET not in json.dumps(s.to_json())
    from stager.redact import location_path

    assert SECRET not in location_path(url)


def test_a_mix_streams_secret_reaches_no_output_or_record(service: Service, node: Node) -> None:  # noqa: F811
    """Row 6 (medium): a stream URL with a secret query gave the default name ``ds_sig_<SECRET>``, in
    stderr and ``--json``, and through the prolog in the AdminComment and the world-readable
    ``job<id>.failed``. (A local ``file://`` URL: the stream fails at once, and its error names it.)"""
    mix = node.data / "mix.json"
    mix.write_text(json.dumps({"streams": [{"path": f"file:///nonexistent/ds?sig={SECRET}"}]}))
    mix.chmod(0o644)
    r = run_as(JOB_USER, ["sh", "-c", 'exec "$0" -m stager stage "$1" "$2" --json', *_python(),
                          str(mix), str(node.home(JOB_USER) / "d")], env=node.env(JOB_USER))
    assert r.returncode != 0 and "stream 'ds'" in r.stderr, r.stderr
    assert SECRET not in r.stdout + r.stderr, r.stdout + r.stderr
    service.comment(f"stager:{mix}")
    assert service.run("stager-prolog", JOB_USER).returncode == 0
    record = service.failure_record.read_text()
    assert "stream 'ds'" in record, record
    for text in (record, service.admin_comment, service.run("stager-taskprolog", JOB_USER, as_user=JOB_USER).stdout):
        assert SECRET not in text, text


def _python() -> list[str]:
    from tests.asuser import python_argv

    return python_argv()


def test_a_dataset_path_with_terminal_escapes_is_printed_escaped(service: Service, node: Node) -> None:  # noqa: F811
    """The job's comment names a dataset whose path carries terminal escapes (anyone can make such a
    directory): the stage's error, the failure record, the AdminComment and the task prolog's lines in
    the job's output carry them escaped, never raw."""
    weird = node.tmp / "ds\x1b]0;owned\x07\x1b[2J\u202e"
    service.comment(f"stager:{weird}")
    assert service.run("stager-prolog", JOB_USER).returncode == 0
    record = service.failure_record.read_text()
    assert record.startswith("stager-prolog exit ") and "owned" in record, record
    t = service.run("stager-taskprolog", JOB_USER, as_user=JOB_USER)
    for text in (record, service.admin_comment, t.stdout):
        assert not _controls(text) and "\u202e" not in text, repr(text)


def test_the_loader_logs_a_planted_directory_name_escaped(node: Node) -> None:
    """Another user plants, in the shared ``$TMPDIR``, a directory whose name carries terminal escapes
    and a receipt for the victim's dataset: the victim's loader skips it and says so, escaped."""
    from stager.pack import pack
    from tests.test_trust_stage import forged_receipt, readable
    from tools.datagen import make_imagefolder

    src = node.data / "pack"
    pack(make_imagefolder(node.base / "if", num_classes=2, per_class=3, seed=1, size=(32, 32)), src, "tar",
         samples_per_shard=3)
    readable(src)
    planted = node.tmp / "0\x1b[2J\x1b]0;owned\x07"
    planted.mkdir(mode=0o755)
    forged_receipt(src, planted)
    os.chown(planted, ATTACKER.uid, ATTACKER.gid)
    code = ("import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stderr); "
            "from stager.loader.shard_access import resolve; resolve(sys.argv[1])")
    r = python_as(VICTIM, code, str(src), env=node.env(VICTIM))
    assert r.returncode == 0, r.stderr
    assert "skipped the staged copy" in r.stderr and "\\x1b[2J" in r.stderr, r.stderr
    assert not _controls(r.stderr), repr(r.stderr)
