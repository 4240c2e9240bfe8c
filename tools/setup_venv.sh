#!/usr/bin/env bash
# Create the project's virtual environment. torch is installed as the pinned 2.13.0 CPU wheel only
# when the interpreter has none: a bare `torch` requirement would pull the newest release plus
# gigabytes of CUDA wheels, and on clusters users bring their own build.
set -euo pipefail
PY=${1:-python3}
VENV=${2:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  echo "setup: installing torch==2.13.0 (CPU wheel)"
  "$VENV/bin/python" -m pip install -q "torch==2.13.0"
fi
# The test extra's lightning, accelerate and transformers depend on torch: pin the one present so that
# pip never replaces it (a bare `torch` requirement would pull the newest release and its CUDA wheels).
"$VENV/bin/python" -c 'import torch; print("torch==" + torch.__version__.split("+")[0])' > "$VENV/torch-constraint.txt"
"$VENV/bin/python" -m pip install -q -c "$VENV/torch-constraint.txt" -e ".[test,lint]"
# Azure's Blob emulator for tests/test_objstore.py (npm registry). Without npm, those tests skip.
if command -v npm >/dev/null 2>&1 && [ ! -x "$VENV/azurite/node_modules/.bin/azurite-blob" ]; then
  npm install --prefix "$VENV/azurite" --no-audit --no-fund --silent azurite@3 >/dev/null 2>&1 \
    || echo "setup: azurite could not be installed with npm; the Azure tests will be skipped"
fi
# Open MPI's mpirun for tests/test_mpi.py (Debian's openmpi-bin; root and apt only). Without it,
# those tests skip with one line saying how to install it.
if ! command -v mpirun >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    { DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends openmpi-bin >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive \
           apt-get install -y -q --no-install-recommends openmpi-bin >/dev/null 2>&1; }; } \
      || echo "setup: openmpi-bin could not be installed with apt; the mpirun tests will be skipped"
  else
    echo "setup: no mpirun (apt-get install -y openmpi-bin as root); the mpirun tests will be skipped"
  fi
fi
# SquashFS tools for tests/test_squashfs_*.py (Debian: mksquashfs/unsquashfs, squashfuse, gensquashfs/tar2sqfs/
# sqfs2tar/rdsquashfs, fusermount3) and liblzo2-dev, which python-lzo builds against (LZO images). Root and apt
# only; without them those tests skip with one line naming the package.
SQFS_DEBS="squashfs-tools squashfuse squashfs-tools-ng fuse3 liblzo2-dev"
if ! command -v mksquashfs >/dev/null 2>&1 || ! command -v squashfuse >/dev/null 2>&1 \
   || ! command -v sqfs2tar >/dev/null 2>&1 || ! command -v fusermount3 >/dev/null 2>&1 \
   || [ ! -e /usr/include/lzo/lzo1x.h ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    # shellcheck disable=SC2086
    { DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $SQFS_DEBS >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive \
           apt-get install -y -q --no-install-recommends $SQFS_DEBS >/dev/null 2>&1; }; } \
      || echo "setup: $SQFS_DEBS could not be installed with apt; the SquashFS tool tests will be skipped"
  else
    echo "setup: no SquashFS tools (apt-get install -y $SQFS_DEBS as root); the SquashFS tool tests will be skipped"
  fi
fi
# python-lzo reads LZO-compressed SquashFS images; it builds only where liblzo2-dev is installed.
if ! "$VENV/bin/python" -c "import lzo" >/dev/null 2>&1; then
  "$VENV/bin/python" -m pip install -q python-lzo >/dev/null 2>&1 \
    || echo "setup: python-lzo did not build (apt-get install liblzo2-dev); LZO images are refused with that hint"
fi
echo "setup: $("$VENV/bin/python" -c 'import torch, stager; print("torch", torch.__version__, "stager", stager.__version__)')"
