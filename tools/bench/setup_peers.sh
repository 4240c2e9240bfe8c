#!/usr/bin/env bash
# Install the pack benchmark's peers (MosaicML streaming, LitData; webdataset comes with [test]) into
# the virtual environment given as $1 (its root, or its bin/ directory as the Makefile passes it)
# WITHOUT letting them touch torch: both pin torchvision (and streaming an old numpy), which would make
# pip replace our torch==2.13.0 CPU build. So: the peers with --no-deps, then only the runtime modules
# their import paths need, under a constraint file that pins torch/numpy/pillow/xxhash to what is
# installed, and a stub `torchvision` package only when no real one exists (neither peer uses it to
# write datasets; they import it at module load).
set -euo pipefail
V=${1:?usage: setup_peers.sh VENV_DIR}
if [ -x "$V/bin/python" ]; then PY="$V/bin/python"; elif [ -x "$V/python" ]; then PY="$V/python"; else
  echo "setup_peers: no python in $V or $V/bin" >&2; exit 2; fi
CON=$(mktemp)
trap 'rm -f "$CON"' EXIT
"$PY" - "$CON" <<'PY'
import importlib.metadata as md, sys
pins = ["torch==2.13.0"]
for dist in ("numpy", "pillow", "xxhash", "fsspec"):
    try:
        pins.append(f"{dist}=={md.version(dist)}")
    except md.PackageNotFoundError:
        pass
open(sys.argv[1], "w").write("\n".join(pins) + "\n")
PY
echo "setup_peers: constraints: $(tr '\n' ' ' < "$CON")"
"$PY" -m pip install -q --no-deps "mosaicml-streaming" "litdata" "webdataset>=0.2.90"
# bench_clips: PyAV (H.264 writing, the seeking baseline) and DALI's CPU readers.sequence (~0.4 GB).
"$PY" -m pip install -q -c "$CON" "av>=12" "nvidia-dali-cuda120>=1.30"
# Runtime needs found with trial imports (`import streaming; from streaming import MDSWriter`,
# `from litdata import optimize`); network/cloud clients are imported lazily by both and skipped.
"$PY" -m pip install -q -c "$CON" zstd brotli python-snappy tqdm catalogue lightning-utilities filelock \
  boto3 requests "urllib3>=1.26" tifffile obstore
# Stub packages, only where no real one is installed: `import streaming` imports torchvision
# (datasets.VisionDataset, transforms.functional.to_tensor) and transformers (BatchFeature,
# BatchEncoding, AutoTokenizer) at module load for its vision/text helpers, which the benchmark never
# uses. Real torchvision/transformers would pull a different torch. Each stub module answers any
# attribute with a placeholder class that raises when instantiated; there is no dist-info, so version probes see no package.
"$PY" - <<'PY'
import importlib.util, os, sysconfig
site = sysconfig.get_paths()["purelib"]
STUB = (
    '"""Stub created by stager tools/bench/setup_peers.sh so benchmark peers import; not usable.\n'
    'Delete this package before installing the real one."""\n\n\n'
    "def __getattr__(name):\n"
    "    if name.startswith('__'):\n"
    "        raise AttributeError(name)\n"
    "    def unusable(*a, **k):\n"
    "        raise RuntimeError(f'{__name__}.{name} is a stub from stager setup_peers.sh; install the real package')\n"
    "    return type(name, (), {'__module__': __name__, '__init__': unusable})\n"
)
TREES = {
    "torchvision": ["", "datasets", "transforms", "transforms/functional", "io"],
    "transformers": ["", "feature_extraction_utils", "tokenization_utils_base", "models", "models/auto",
                     "models/auto/tokenization_auto"],
}
for pkg, mods in TREES.items():
    if importlib.util.find_spec(pkg) is not None:
        continue
    for m in mods:
        d = os.path.join(site, pkg, m)
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "__init__.py"), "w") as f:
            f.write(STUB)
    print(f"setup_peers: installed a stub {pkg} in {site} (no real {pkg} present)")
PY
"$PY" - <<'PY'
import torch
from streaming import MDSWriter  # noqa: F401
from litdata import optimize  # noqa: F401
import webdataset  # noqa: F401
assert torch.__version__.startswith("2.13.0"), torch.__version__
print(f"setup_peers: ok (torch {torch.__version__}; streaming, litdata, webdataset import)")
PY
