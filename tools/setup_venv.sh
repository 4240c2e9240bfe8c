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
echo "setup: $("$VENV/bin/python" -c 'import torch, stager; print("torch", torch.__version__, "stager", stager.__version__)')"
