"""Object storage and HTTP as sources and destinations, against real servers on 127.0.0.1.

An S3 API (moto in server mode, a child process), a static HTTP server that honours Range, and a
fault-injecting HTTP proxy in front of either (tools/objstore_servers.py). Faults are counted, not
random ("the next 3 GETs are cut after 1000 bytes"), and every check is an invariant on what ends up
where: byte-identical shards, every sample exactly once, no partial file under a final name, the
exit code; never a timing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stager.cli import main
from stager.errors import MissingBackendError, RemoteUnavailableError, UsageError
from stager.fs.open import effective_options, parse_storage_options
from stager.manifest import load_manifest
from stager.order.partition import assign_shards_to_nodes
from stager.pack import pack
from stager.shardcheck import verify
from stager.stage import stage
from tools.objstore_servers import CREDENTIALS, AzuriteServer, FaultProxy, MotoServer, RangeHTTPServer, azurite_path

pytest.importorskip("s3fs", reason="s3fs is not installed (pip install 'stager[test]'; make venv does)")
pytest.importorskip("moto", reason="moto is not installed (pip install 'stager[test]'; make venv does)")

FAST_RETRIES = {"STAGER_RETRIES": "4", "STAGER_RETRY_BASE": "0.01", "STAGER_RETRY_CAP": "0.05",
                "STAGER_REQUEST_TIMEOUT": "3"}
# botocore retries inside one request too (s3fs as well, up to 5 times); the exhaustion test switches
# botocore's off, so that stager's own policy decides when to give up.
NO_INNER_RETRIES = ["--storage-option", "config_kwargs.retries.max_attempts=1"]


@pytest.fixture(scope="module")
def moto() -> MotoServer:
    server = MotoServer()
    yield server
    server.stop()


@pytest.fixture
def proxy(moto: MotoServer) -> FaultProxy:
    p = FaultProxy(moto.endpoint)
    yield p
    p.stop()


@pytest.fixture
def s3env(moto: MotoServer, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Credentials, the endpoint and a fast retry policy, in this process and for subprocesses."""
    env = {**moto.env(), **FAST_RETRIES}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


def _fs(endpoint: str):
    import s3fs

    return s3fs.S3FileSystem(key="testing", secret="testing", client_kwargs={"endpoint_url": endpoint})


@pytest.fixture(scope="module")
def local_pack(imagenet_tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6 tar shards of 4 JPEGs (~40 KB each)."""
    out = tmp_path_factory.mktemp("objstore") / "packed"
    pack(imagenet_tiny, out, samples_per_shard=4)
    return out


_bucket_seq = iter(range(1_000_000))


@pytest.fixture
def bucket(moto: MotoServer) -> str:
    name = f"b{next(_bucket_seq)}-{os.getpid()}"
    _fs(moto.endpoint).mkdir(name)
    return name


def _upload(moto: MotoServer, local: Path, url: str) -> None:
    fs = _fs(moto.endpoint)
    for p in sorted(local.iterdir()):
        fs.put_file(str(p), f"{url.removeprefix('s3://')}/{p.name}")


def _cli(args: list[str], env: dict[str, str], *, cwd: Path | None = None,
         timeout: float = 120) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, **env}
    return subprocess.run([sys.executable, "-m", "stager", *args], env=full, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, check=False)


def _same_files(a: Path, b: Path, names: list[str]) -> None:
    for n in names:
        assert (a / n).read_bytes() == (b / n).read_bytes(), n


def _no_partials(d: Path) -> None:
    assert not [p.name for p in d.rglob("*.partial")] if d.exists() else True


# ---- the opener: backends, options ---------------------------------------------------------------------
@pytest.mark.parametrize(("url", "module", "extra"), [("s3://b/ds", "s3fs", "s3"), ("https://h/ds", "aiohttp", "http"),
                                                      ("az://c/ds", "adlfs", "azure")])
def test_missing_backend_is_one_line_naming_the_extra(url: str, module: str, extra: str, *, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    monkeypatch.chdir(tmp_path)
    for argv in (["stage", url, str(tmp_path / "dest")], ["verify", url], ["inspect", url],
                 ["pack", str(tmp_path), url, "--format", "tar"]):
        assert main(argv) == MissingBackendError.exit_code == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"pip install {module}" in err, err
        assert f".[{extra}]" in err and url in err, err
    assert list(tmp_path.iterdir()) == [], "nothing was written locally (no 's3:' directory)"


def test_url_looking_out_is_never_a_local_directory(imagenet_tiny: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["pack", str(imagenet_tiny), "nosuchscheme://bucket/ds", "--format", "tar"]) == UsageError.exit_code
    assert list(tmp_path.iterdir()) == []


def test_hints_refuses_a_url_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["hints", "s3://bucket/ds"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "s3://bucket/ds" in err and "stager inspect" in err


def test_storage_options_parse_nested_json_values() -> None:
    got = parse_storage_options(["client_kwargs.endpoint_url=http://h:9000", "anon=true", "config_kwargs.retries."
                                 "max_attempts=2", "token=null", "name=plain text", "x={\"a\": [1]}"])
    assert got == {"client_kwargs": {"endpoint_url": "http://h:9000"}, "anon": True,
                   "config_kwargs": {"retries": {"max_attempts": 2}}, "token": None, "name": "plain text",
                   "x": {"a": [1]}}
    for bad in ("novalue", "=1", "a..b=1"):
        with pytest.raises(UsageError):
            parse_storage_options([bad])
    with pytest.raises(UsageError):
        parse_storage_options(["a=1", "a.b=2"])


def test_s3_endpoint_from_the_environment_unless_given() -> None:
    env = {"AWS_ENDPOINT_URL": "http://env:1"}
    assert effective_options("s3://b/x", {}, env) == {"client_kwargs": {"endpoint_url": "http://env:1"}}
    given = {"client_kwargs": {"endpoint_url": "http://flag:2", "region_name": "r"}}
    assert effective_options("s3://b/x", given, env) == given
    assert effective_options("s3://b/x", {"endpoint_url": "http://top:3"}, env) == {"endpoint_url": "http://top:3"}
    assert effective_options("https://h/x", {}, env) == {}


def test_bad_storage_option_flag_is_a_usage_error(tmp_path: Path) -> None:
    r = _cli(["stage", "s3://b/x", str(tmp_path), "--storage-option", "novalue"], {})
    assert r.returncode == 2 and "KEY=VALUE" in r.stderr


# ---- pack to S3, verify, inspect, stage, load -------------------------------------------------------------
def test_pack_to_s3_then_verify_inspect_stage_and_load(imagenet_tiny: Path, local_pack: Path, moto: MotoServer,
                                                        bucket: str, tmp_path: Path) -> None:
    """The whole road through S3, configured by --storage-option only (no endpoint in the environment)."""
    url = f"s3://{bucket}/ds"
    env = {**CREDENTIALS, **FAST_RETRIES}
    so = ["--storage-option", f"client_kwargs.endpoint_url={moto.endpoint}"]
    r = _cli(["pack", str(imagenet_tiny), url, "--format", "tar", "--samples-per-shard", "4", "--workers", "2",
              "--json", *so], env)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["out"] == url and res["shards"] == 6 and res["manifest"] == f"{url}/manifest.json"
    m = load_manifest(url, {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": moto.endpoint}})
    local = load_manifest(local_pack)
    assert [(s.name, s.bytes, s.hash) for s in m.shards] == [(s.name, s.bytes, s.hash) for s in local.shards]
    listed = _fs(moto.endpoint).ls(f"{bucket}/ds", refresh=True)
    assert m.index is not None
    assert sorted(p.rsplit("/", 1)[1] for p in listed) == sorted([*(s.name for s in m.shards), m.index.name,
                                                                  "manifest.json"])

    r = _cli(["verify", url, "--deep", "--json", *so], env)
    assert r.returncode == 0 and json.loads(r.stdout)["ok"], r.stderr
    r = _cli(["inspect", url, "--json", *so], env)
    assert r.returncode == 0 and json.loads(r.stdout)["samples"] == 24, r.stderr

    share = [local.shards[i].name for i in assign_shards_to_nodes(local.shard_bytes, 2, 0)[1]]
    partition = ["--partition", "--node", "1", "--num-nodes", "2"]
    for extra, want in (([], [s.name for s in local.shards]), (partition, share)):
        dest = tmp_path / f"dest{len(extra)}"
        r = _cli(["stage", url, str(dest), "--json", *so, *extra], env)
        assert r.returncode == 0, r.stderr
        assert sorted(json.loads((dest / "stager-receipt.json").read_text())["shards"]) == sorted(want)
        assert sorted(p.name for p in dest.glob("shard-*")) == sorted(want)
        _same_files(dest, local_pack, want)
        _no_partials(dest)


def test_loader_streams_every_sample_once_from_s3(local_pack: Path, moto: MotoServer, bucket: str, s3env: dict,
                                                  proxy: FaultProxy) -> None:
    """Two ranks stream from S3 through a proxy that cuts, resets and 503s some range reads."""
    from stager.loader import make_loader

    url = f"s3://{bucket}/ds"
    _upload(moto, local_pack, url)
    so = {"client_kwargs": {"endpoint_url": proxy.url}}
    proxy.inject("cut", 3, after=500, path="shard-")
    proxy.inject("reset", 2, path="shard-")
    proxy.inject("status", 2, status=503, path="shard-")
    want = {}
    for batch in make_loader(local_pack, 5, rank=0, world_size=1, decode="raw", shuffle=False, staged=False):
        want.update({k: bytes(v) for k, v in zip(batch["key"], batch["image"], strict=True)})
    seen: list[str] = []
    for rank in range(2):
        loader = make_loader(url, 4, rank=rank, world_size=2, decode="raw", seed=3, staged=False,
                             storage_options=so, drop_last=True)
        for batch in loader:
            for k, v in zip(batch["key"], batch["image"], strict=True):
                assert bytes(v) == want[k], k
                seen.append(k)
    assert sorted(seen) == sorted(want) and len(seen) == 24, "every sample exactly once across the ranks"
    assert proxy.stats.faults == 7


# ---- faults while staging ------------------------------------------------------------------------------------
def test_stage_survives_cuts_resets_stalls_and_throttling(local_pack: Path, *, moto: MotoServer, bucket: str,
                                                          s3env: dict, proxy: FaultProxy, tmp_path: Path) -> None:
    url = f"s3://{bucket}/ds"
    _upload(moto, local_pack, url)
    proxy.inject("cut", 4, after=1000, path="shard-")
    proxy.inject("reset", 2, path="shard-")
    proxy.inject("status", 3, status=503, path="shard-")
    proxy.inject("stall", 1, after=100, stall=20, path="shard-")
    res = stage(url, tmp_path / "dest", workers=2, storage_options={"client_kwargs": {"endpoint_url": proxy.url}})
    assert res.files_copied == 6 and proxy.stats.faults == 10
    names = [s.name for s in load_manifest(local_pack).shards]
    _same_files(tmp_path / "dest", local_pack, [*names, "manifest.json"])
    _no_partials(tmp_path / "dest")
    assert verify(tmp_path / "dest").ok


def test_stage_gives_up_with_exit_5_and_publishes_nothing(local_pack: Path, *, moto: MotoServer, bucket: str,
                                                          s3env: dict, proxy: FaultProxy, tmp_path: Path) -> None:
    url = f"s3://{bucket}/ds"
    _upload(moto, local_pack, url)
    proxy.inject("status", 10_000, status=503, path="shard-00003")  # one shard never comes back
    dest = tmp_path / "dest"
    r = _cli(["stage", url, str(dest), "-j", "2", "-q", "--storage-option",
              f"client_kwargs.endpoint_url={proxy.url}", *NO_INNER_RETRIES], {**s3env, "STAGER_RETRIES": "2"})
    assert r.returncode == RemoteUnavailableError.exit_code == 5, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "shard-00003.tar" in lines[0] and "failed 2 times" in lines[0], r.stderr
    assert not (dest / "manifest.json").exists() and not (dest / "stager-receipt.json").exists()
    assert not (dest / "shard-00003.tar").exists()
    _no_partials(dest)
    # The store recovers: a rerun completes, keeping what was verified.
    proxy.clear()
    r = _cli(["stage", url, str(dest), "--json", "--storage-option", f"client_kwargs.endpoint_url={proxy.url}"], s3env)
    assert r.returncode == 0, r.stderr
    assert verify(dest).ok


def test_collective_stage_from_s3_with_faults(local_pack: Path, *, moto: MotoServer, bucket: str, s3env: dict,
                                              proxy: FaultProxy, tmp_path: Path) -> None:
    """Two nodes read disjoint shares of the bucket (through cuts and 503s) and end byte-identical."""

    url = f"s3://{bucket}/ds"
    _upload(moto, local_pack, url)
    proxy.inject("cut", 2, after=700, path="shard-")
    proxy.inject("status", 2, status=503, path="shard-")
    _collective_on_two_nodes(url, tmp_path, local_pack, {},
                             ["--storage-option", f"client_kwargs.endpoint_url={proxy.url}"])
    assert proxy.stats.faults == 4


def _collective_on_two_nodes(url: str, tmp_path: Path, local_pack: Path, env_extra: dict[str, str],
                             args: list[str]) -> None:
    """``stager stage URL --collective`` as 2 local nodes into ``tmp_path/dest{0,1}``: both succeed
    collectively and hold the pack's shards byte for byte, nothing partial left."""
    from tests.test_collective import _finish, _free_port

    port = _free_port()
    procs = []
    for i in range(2):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC"))}
        env.update(env_extra, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(i), WORLD_SIZE="2",
                   LOCAL_WORLD_SIZE="1")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "stager", "stage", url, str(tmp_path / f"dest{i}"), "--collective", "--json",
             "--chunk-size", "16384", "--timeout", "120", *args],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    m = load_manifest(local_pack)
    for rc, res, err in _finish(procs):
        assert rc == 0, err
        assert res["collective"] and res["fallback"] is None
    for i in range(2):
        _same_files(tmp_path / f"dest{i}", local_pack, [s.name for s in m.shards])
        _no_partials(tmp_path / f"dest{i}")


# ---- stager index over a bucket ------------------------------------------------------------------------------
def test_index_webdataset_tars_in_a_bucket_then_verify_stage_and_load(moto: MotoServer, bucket: str, s3env: dict,
                                                                      proxy: FaultProxy, tmp_path: Path) -> None:
    """``stager index s3://... --out DIR``: each object read once through cuts, the manifest names the
    bucket; verify --deep, stage and the loader read the shards there; a replaced object is caught (exit 3)."""
    from tests.test_index import read_all, write_wds

    truth = write_wds(tmp_path / "wds")
    url = f"s3://{bucket}/wds"
    _upload(moto, tmp_path / "wds", url)
    proxy.inject("cut", 2, after=1000, path="train-")
    through_proxy = ["--storage-option", f"client_kwargs.endpoint_url={proxy.url}"]
    r = _cli(["index", url, "--out", str(tmp_path / "idx"), "--json", "-j", "2", "-q", *through_proxy], s3env)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert (res["kind"], res["shards"], res["samples"], res["shard_root"]) == ("tar", 3, 23, url)
    assert proxy.stats.faults == 2
    assert not (tmp_path / "idx" / ".stager-index").exists()
    assert read_all(tmp_path / "idx", staged=False) == truth
    assert verify(tmp_path / "idx", deep=True).ok
    assert stage(tmp_path / "idx", tmp_path / "dest").files_copied == 3
    assert verify(tmp_path / "dest").ok and read_all(tmp_path / "dest") == truth
    # Someone replaces a shard in the bucket: verify names it, exit 3.
    first = load_manifest(tmp_path / "idx").shards[0].name
    _fs(moto.endpoint).pipe_file(f"{bucket}/wds/{first}", b"x" * 10240)
    r = _cli(["verify", str(tmp_path / "idx"), "-q"], s3env)
    assert r.returncode == 3 and first in r.stderr + r.stdout, r.stderr


def test_index_tfrecords_in_a_bucket_sniffed_and_resumed(moto: MotoServer, bucket: str, s3env: dict,
                                                         tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TensorFlow's suffix-less file names are sniffed with one ranged GET; DALI index files go into OUT;
    a killed run resumes the objects it finished (identity: size, ETag and modification time)."""
    from stager.index import IndexOptions, api, index_dataset
    from tests.test_index import read_all, write_tfrecords

    truth = write_tfrecords(tmp_path / "tfr", n=30, files=3)
    url = f"s3://{bucket}/tfr/"
    _upload(moto, tmp_path / "tfr", url.rstrip("/"))
    real = api.SCANNERS["record"]
    calls: list[str] = []

    def killed_on_the_third(path: str, name: str, *a: object) -> object:
        calls.append(name)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(path, name, *a)

    monkeypatch.setitem(api.SCANNERS, "record", killed_on_the_third)
    opts = IndexOptions(label_offset=-1)
    with pytest.raises(KeyboardInterrupt):
        index_dataset(url, tmp_path / "idx", opts)
    assert not list((tmp_path / "idx" / ".stager-index").glob("*.partial"))  # the copy down is gone
    monkeypatch.setitem(api.SCANNERS, "record", real)
    r = index_dataset(url, tmp_path / "idx", opts)
    assert (r.kind, r.resumed, r.scanned, r.samples) == ("record", 2, 1, 30)
    assert sorted(Path(p).name for p in r.dali_index) == [f"train-{f:05d}-of-00003.idx" for f in range(3)]
    assert read_all(tmp_path / "idx", staged=False) == truth
    with pytest.raises(UsageError, match="--out"):
        index_dataset(url)


# ---- pack: killed mid-upload, resumed -------------------------------------------------------------------------
def test_pack_to_s3_killed_mid_upload_resumes_and_readers_never_see_a_partial_pack(
        imagenet_tiny: Path, *, local_pack: Path, moto: MotoServer, bucket: str, s3env: dict, proxy: FaultProxy,
        tmp_path: Path) -> None:
    url = f"s3://{bucket}/ds"
    so = ["--storage-option", f"client_kwargs.endpoint_url={proxy.url}"]
    proxy.inject("stall", 1, method="PUT", path="shard-00003", stall=60)  # the 4th shard's upload hangs
    proc = subprocess.Popen([sys.executable, "-m", "stager", "pack", str(imagenet_tiny), url, "--format", "tar",
                             "--samples-per-shard", "4", "-q", *so],
                            env={**os.environ, **s3env, "STAGER_REQUEST_TIMEOUT": "120"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180  # a hang guard: pack starts and uploads 3 shards first
    while proxy.stats.faults == 0 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proxy.stats.faults == 1, proc.communicate()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    fs = _fs(moto.endpoint)
    names = {p.rsplit("/", 1)[1] for p in fs.find(f"{bucket}/ds")}
    assert "manifest.json" not in names, "no manifest: readers see no pack"
    assert {"shard-00000.tar", "shard-00001.tar", "shard-00002.tar"} <= names and "shard-00003.tar" not in names
    r = _cli(["stage", url, str(tmp_path / "early"), *so], s3env)
    assert r.returncode == 2 and "no manifest" in r.stderr  # stage refuses the unfinished pack (not a pack yet)
    proxy.clear()
    r = _cli(["pack", str(imagenet_tiny), url, "--format", "tar", "--samples-per-shard", "4", "--json", *so], s3env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["reused_shards"] == 3
    names = {p.rsplit("/", 1)[1] for p in fs.find(f"{bucket}/ds")}
    lm = load_manifest(local_pack)
    assert names == {*(s.name for s in lm.shards), lm.index.name, "manifest.json"}, "state objects removed"  # type: ignore[union-attr]
    m = load_manifest(url)
    assert [(s.name, s.hash) for s in m.shards] == [(s.name, s.hash) for s in load_manifest(local_pack).shards]
    assert verify(url).ok


# ---- HTTP ---------------------------------------------------------------------------------------------------
@pytest.fixture
def http_pack(local_pack: Path) -> RangeHTTPServer:
    server = RangeHTTPServer(local_pack.parent)
    yield server
    server.stop()


def test_stage_and_load_over_https_style_range_reads_with_cuts(local_pack: Path, http_pack: RangeHTTPServer,
                                                               tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """fsspec's HTTP filesystem does not retry: every cut here is resumed by stager at the offset reached."""
    from stager.loader import make_loader

    for k, v in FAST_RETRIES.items():
        monkeypatch.setenv(k, v)
    proxy = FaultProxy(http_pack.url)
    try:
        url = f"{proxy.url}/{local_pack.name}"
        proxy.inject("cut", 5, after=3000, path="shard-")
        proxy.inject("reset", 1, path="shard-")
        proxy.inject("status", 1, status=500, path="shard-")
        res = stage(url, tmp_path / "dest", workers=2)
        assert res.files_copied == 6 and proxy.stats.faults == 7
        names = [s.name for s in load_manifest(local_pack).shards]
        _same_files(tmp_path / "dest", local_pack, [*names, "manifest.json"])
        proxy.inject("cut", 4, after=200, path="shard-")
        keys = [k for b in make_loader(url, 6, rank=0, world_size=1, decode="raw", staged=False) for k in b["key"]]
        assert sorted(keys) == sorted(k for s in load_manifest(local_pack).shards for k in s.keys)
        assert proxy.stats.faults == 11
    finally:
        proxy.stop()


def test_collective_and_partition_stage_over_http_with_cuts(local_pack: Path, http_pack: RangeHTTPServer,
                                                           tmp_path: Path) -> None:
    """stager[http] serves collective staging too: two nodes read disjoint shares over HTTP (through cuts
    and a 500) and end byte-identical; a --partition stage holds exactly its node's share."""

    proxy = FaultProxy(http_pack.url)
    try:
        url = f"{proxy.url}/{local_pack.name}"
        proxy.inject("cut", 2, after=700, path="shard-")
        proxy.inject("status", 1, status=500, path="shard-")
        _collective_on_two_nodes(url, tmp_path, local_pack, FAST_RETRIES, [])
        assert proxy.stats.faults == 3
        m = load_manifest(local_pack)

        r = _cli(["stage", url, str(tmp_path / "part1"), "--partition", "--node", "1", "--num-nodes", "2",
                  "-q", "--json"], FAST_RETRIES)
        assert r.returncode == 0, r.stderr
        share = sorted(m.shards[i].name for i in assign_shards_to_nodes(m.shard_bytes, 2, 0)[1])
        assert sorted(p.name for p in (tmp_path / "part1").glob("shard-*")) == share
    finally:
        proxy.stop()


def _plain_http_server(directory: Path) -> tuple[subprocess.Popen[str], str]:
    """Python's http.server on ``directory`` (directory listings, no Range support): ``(process, base URL)``."""
    handler = f"""
import functools, http.server, sys
h = functools.partial(http.server.SimpleHTTPRequestHandler, directory={str(directory)!r})
s = http.server.ThreadingHTTPServer(("127.0.0.1", 0), h)
print(s.server_address[1], flush=True)
s.serve_forever()
"""
    srv = subprocess.Popen([sys.executable, "-c", handler], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                           text=True)
    assert srv.stdout is not None
    return srv, f"http://127.0.0.1:{int(srv.stdout.readline())}"


def test_http_server_without_range_support(local_pack: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """python's http.server ignores Range: whole objects still stage (a range from 0 to the end is the
    whole body), but the loader's sample reads are refused with one line naming the URL, not misread."""
    from stager.errors import StagerError
    from stager.loader import make_loader

    for k, v in FAST_RETRIES.items():
        monkeypatch.setenv(k, v)
    srv, base = _plain_http_server(local_pack.parent)
    try:
        url = f"{base}/{local_pack.name}"
        r = _cli(["stage", url, str(tmp_path / "d"), "-q"], FAST_RETRIES)
        assert r.returncode == 0, r.stderr
        assert verify(tmp_path / "d").ok
        with pytest.raises(StagerError, match="ignores Range") as info:
            for _ in make_loader(url, 4, rank=0, world_size=1, decode="raw", staged=False):
                pass
        assert url in str(info.value) and len(str(info.value).splitlines()) == 1
    finally:
        srv.kill()
        srv.wait()


def test_index_over_http_a_listed_directory_and_one_object(tmp_path: Path) -> None:
    """``stager index https://...``: a web server's directory listing names the shards (fsspec reads
    its links; no ETags there, so resume trusts sizes and verify the hashes); one object's URL works
    on any Range server. The staged copy holds every sample once with its label."""
    from tests.test_index import read_all, write_wds

    truth = write_wds(tmp_path / "wds")
    srv, base = _plain_http_server(tmp_path)
    try:
        r = _cli(["index", f"{base}/wds/", "--out", str(tmp_path / "idx"), "--json", "-q"], FAST_RETRIES)
        assert r.returncode == 0, r.stderr
        res = json.loads(r.stdout)
        assert (res["kind"], res["shards"], res["samples"], res["shard_root"]) == ("tar", 3, 23, f"{base}/wds")
        assert verify(tmp_path / "idx").ok
        assert stage(tmp_path / "idx", tmp_path / "dest").files_copied == 3
        assert read_all(tmp_path / "dest") == truth
    finally:
        srv.kill()
        srv.wait()
    one = RangeHTTPServer(tmp_path / "wds")
    try:
        r = _cli(["index", f"{one.url}/train-000001.tar", "--out", str(tmp_path / "one"), "--json", "-q"],
                 FAST_RETRIES)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["samples"] == 8
        got = read_all(tmp_path / "one", staged=False)
        assert len(got) == 8 and all(truth[k] == v for k, v in got.items())
    finally:
        one.stop()


# ---- Azure Blob (azurite) ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def azurite() -> AzuriteServer:
    pytest.importorskip("adlfs", reason="adlfs is not installed (pip install 'stager[azure]')")
    exe = azurite_path()
    if exe is None:
        pytest.skip("azurite not installed (tools/setup_venv.sh installs it with npm)")
    server = AzuriteServer(exe)
    yield server
    server.stop()


def test_azure_pack_verify_stage_and_load_through_faults(imagenet_tiny: Path, local_pack: Path, *,
                                                         azurite: AzuriteServer, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """az:// as OUT and SRC (adlfs, the credentials from AZURE_STORAGE_CONNECTION_STRING): pack, verify,
    then stage and stream through a proxy that cuts and throttles (adlfs answers ranges whole: each
    failed read is retried as a whole)."""
    import adlfs

    from stager.loader import make_loader

    for k, v in FAST_RETRIES.items():
        monkeypatch.setenv(k, v)
    adlfs.AzureBlobFileSystem(connection_string=azurite.connection_string()).mkdir("packs")
    env = {**FAST_RETRIES, "AZURE_STORAGE_CONNECTION_STRING": azurite.connection_string()}
    url = "az://packs/ds"
    r = _cli(["pack", str(imagenet_tiny), url, "--format", "tar", "--samples-per-shard", "4", "--json", "-q"], env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["shards"] == 6
    r = _cli(["verify", url, "--deep"], env)
    assert r.returncode == 0, r.stderr
    proxy = FaultProxy(azurite.endpoint)
    try:
        monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite.connection_string(proxy.url))
        proxy.inject("cut", 2, after=1000, path="shard-")
        proxy.inject("status", 2, status=503, path="shard-")
        res = stage(url, tmp_path / "dest", workers=2)
        assert res.files_copied == 6 and proxy.stats.faults == 4
        names = [s.name for s in load_manifest(local_pack).shards]
        _same_files(tmp_path / "dest", local_pack, names)
        _no_partials(tmp_path / "dest")
        proxy.inject("cut", 2, after=100, path="shard-")
        keys = [k for b in make_loader(url, 6, rank=0, world_size=1, decode="raw", staged=False) for k in b["key"]]
        assert sorted(keys) == sorted(k for s in load_manifest(local_pack).shards for k in s.keys)
    finally:
        proxy.stop()


def test_index_recordio_and_lmdb_in_a_bucket(moto: MotoServer, bucket: str, s3env: dict, tmp_path: Path) -> None:
    """MXNet .rec files and an LMDB's data.mdb as objects: each copied down once, scanned, read in the bucket."""
    pytest.importorskip("lmdb", reason="lmdb is not installed (pip install 'stager[lmdb]')")
    from tests.test_index_legacy import _lmdb_truth, write_rec_pair
    from tools.datagen import make_caffe_lmdb

    truth = write_rec_pair(tmp_path / "rec")
    url = f"s3://{bucket}/rec"
    _upload(moto, tmp_path / "rec", url)
    r = _cli(["index", url, "--out", str(tmp_path / "idx"), "--json", "-q"], s3env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["kind"] == "recordio" and (tmp_path / "idx" / "a.idx").is_file()  # .idx into OUT
    got = read_all_by_bytes(tmp_path / "idx")
    assert got == sorted((d, lab) for d, lab in truth.values())
    assert verify(tmp_path / "idx", deep=True).ok
    make_caffe_lmdb(tmp_path / "db", 20, size=16)
    _upload(moto, tmp_path / "db", f"s3://{bucket}/db")
    r = _cli(["index", f"s3://{bucket}/db", "--out", str(tmp_path / "lm"), "--json", "-q"], s3env)
    assert r.returncode == 0, r.stderr
    from tests.test_index import read_all

    assert read_all(tmp_path / "lm", staged=False) == _lmdb_truth(tmp_path / "db", "caffe")
    assert stage(tmp_path / "lm", tmp_path / "dest").files_copied == 1


def read_all_by_bytes(path: Path) -> list[tuple[bytes, int]]:
    from tests.test_index import read_all

    return sorted(read_all(path, staged=False).values())
