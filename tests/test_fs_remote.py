"""The opener's remote layer without a server: the retry policy and the retried range read on
scripted filesystems, and a pack written to and staged from fsspec's ``memory://`` (a store without
atomic PUT: objects go up under a temporary name and are moved). No timing is asserted."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from stager.errors import RemoteAccessError, RemotePermissionError, RemoteUnavailableError, StagerError
from stager.fs.remote import RemoteFile, read_range
from stager.fs.retry import RetryPolicy, is_transient, with_retries

FAST = RetryPolicy(attempts=3, base=0.0, cap=0.0, timeout=0)
DATA = bytes(range(256)) * 64


class ScriptedFS:
    """``cat_file`` follows a script: each step returns that many bytes of the range (a short body)
    or raises the exception given; after the script, whole answers."""

    def __init__(self, script: list[object]) -> None:
        self.script = list(script)
        self.calls: list[tuple[int, int]] = []

    def size(self, path: str) -> int:
        return len(DATA)

    def cat_file(self, path: str, start: int, end: int) -> bytes:
        self.calls.append((start, end))
        step = self.script.pop(0) if self.script else None
        if isinstance(step, BaseException):
            raise step
        if isinstance(step, int):
            return DATA[start:start + step]
        return DATA[start:end]


class _ClientError(Exception):
    def __init__(self, code: str, status: int) -> None:
        super().__init__(code)
        self.response = {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}


@pytest.mark.parametrize(("exc", "transient"), [
    (ConnectionResetError(), True),
    (TimeoutError(), True),
    (OSError(errno.EBUSY, "SlowDown"), True),
    (_ClientError("SlowDown", 503), True),
    (_ClientError("InternalError", 500), True),
    (_ClientError("AccessDenied", 403), False),
    (FileNotFoundError("x"), False),
    (PermissionError("x"), False),
    (ValueError("bad"), False),
    (type("ClientPayloadError", (Exception,), {})("cut"), True),
])
def test_transient_errors(exc: BaseException, transient: bool) -> None:
    assert is_transient(exc) is transient


def test_a_cut_body_resumes_at_the_offset_reached() -> None:
    fs = ScriptedFS([1000, 0, ConnectionResetError(), 500])
    assert read_range(fs, "p", 100, 5000, "s3://b/p", policy=FAST) == DATA[100:5000]
    # Each retry asks only for what is missing.
    assert fs.calls == [(100, 5000), (1100, 5000), (1100, 5000), (1100, 5000), (1600, 5000)]


def test_progress_resets_the_count_and_retries_run_out_on_none() -> None:
    fs = ScriptedFS([10] * 20)  # every response cut after 10 bytes: slow, but every byte arrives
    assert read_range(fs, "p", 0, 150, "s3://b/p", policy=FAST) == DATA[:150]
    dead = ScriptedFS([ConnectionResetError()] * 3)
    with pytest.raises(RemoteUnavailableError, match=r"s3://b/p: GET bytes 0-99 failed 3 times") as info:
        read_range(dead, "p", 0, 100, "s3://b/p", policy=FAST)
    assert info.value.exit_code == 5 and len(str(info.value).splitlines()) == 1


def test_permanent_errors_are_not_retried_and_read_as_one_line() -> None:
    fs = ScriptedFS([_ClientError("AccessDenied", 403)])
    with pytest.raises(RemoteAccessError, match="s3://b/p: GET refused"):
        read_range(fs, "p", 0, 10, "s3://b/p", policy=FAST)
    assert len(fs.calls) == 1
    with pytest.raises(RemotePermissionError):  # still a PermissionError for callers
        with_retries(lambda: (_ for _ in ()).throw(PermissionError("no")), "s3://b/p", "HEAD", FAST)
    with pytest.raises(FileNotFoundError):  # callers name the missing shard themselves
        with_retries(lambda: (_ for _ in ()).throw(FileNotFoundError("x")), "s3://b/p", "HEAD", FAST)


def test_a_server_that_ignores_range_is_refused() -> None:
    class WholeFS(ScriptedFS):
        def cat_file(self, path: str, start: int, end: int) -> bytes:
            return DATA

    with pytest.raises(StagerError, match="ignores Range"):
        read_range(WholeFS([]), "p", 10, 20, "http://h/p", policy=FAST)


def test_remote_file_reads_like_a_file() -> None:
    f = RemoteFile(ScriptedFS([7, ConnectionResetError()]), "p", "s3://b/p", policy=FAST)
    buf = bytearray(4096)
    assert f.readinto(buf) == 4096 and bytes(buf) == DATA[:4096]
    assert f.read() == DATA[4096:] and f.read() == b""
    f.seek(10)
    assert f.read(5) == DATA[10:15]


def test_pack_to_a_store_without_atomic_put_and_stage_from_it(imagenet_tiny: Path, tmp_path: Path) -> None:
    import fsspec

    from stager.manifest import load_manifest
    from stager.pack import pack
    from stager.shardcheck import verify
    from stager.stage import stage

    url = f"memory://stager-test-{tmp_path.name}/ds"
    res = pack(imagenet_tiny, url, "tar", samples_per_shard=5)
    local = pack(imagenet_tiny, tmp_path / "local", "tar", samples_per_shard=5)
    assert res.out == url and res.manifest is not None and local.manifest is not None
    fs = fsspec.filesystem("memory")
    names = sorted(p.rsplit("/", 1)[1] for p in fs.find(url.removeprefix("memory://")))
    index = local.manifest.index.name  # type: ignore[union-attr]
    assert names == sorted([*(s.name for s in local.manifest.shards), index, "manifest.json"]), "no temporary objects"
    assert [(s.name, s.hash) for s in load_manifest(url).shards] == [(s.name, s.hash) for s in local.manifest.shards]
    assert verify(url, deep=True).ok
    assert pack(imagenet_tiny, url, "tar", samples_per_shard=5).reused == len(local.manifest.shards)
    staged = stage(url, tmp_path / "dest")
    assert staged.files_copied == len(local.manifest.shards) and verify(tmp_path / "dest").ok


def test_the_cli_parser_does_not_load_the_url_opener() -> None:
    """``--storage-option`` is registered on four commands without importing the opener (its retry
    and streaming modules and their dependencies cost ~15 ms of every ``stager`` start-up)."""
    import subprocess
    import sys

    code = ("import sys; from stager.cli import build_parser; build_parser(); "
            "print(sorted(m for m in sys.modules if m in ('stager.fs.open', 'stager.fs.remote', 'stager.fs.retry', "
            "'asyncio', 'random')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.parametrize("value", ["abc", "-1", "nan"])
def test_a_bad_retry_setting_is_a_usage_error_not_the_default(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from stager.errors import UsageError

    monkeypatch.setenv("STAGER_RETRIES", value)
    with pytest.raises(UsageError, match=f"STAGER_RETRIES={value!r}"):
        RetryPolicy.from_env()
    monkeypatch.setenv("STAGER_RETRIES", "")
    assert RetryPolicy.from_env().attempts == RetryPolicy.attempts
