"""CIFAR-10 python batches, read with a restricted unpickler (no code from the files runs).

Samples are (32, 32, 3) uint8 arrays in batch order, keyed ``<batch file>/<row:05d>``; a locator
is ``<batch file>#<row>``. The batches are read when the source is opened and kept (a pickled copy
drops them and reloads each on first use).
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np

from stager.errors import SourceError, UsageError
from stager.formats.base import Sample
from stager.pack.sources.base import SampleRef, Source

CIFAR_SPLITS = {"train": tuple(f"data_batch_{i}" for i in range(1, 6)), "test": ("test_batch",)}


CIFAR_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def _latin1_encode(text: str, encoding: str = "latin1") -> bytes:
    # Python 3 writes ``bytes`` in protocol-2 pickles as ``_codecs.encode(text, 'latin1')``; allow
    # exactly that and no other codec.
    if encoding not in ("latin1", "latin-1") or not isinstance(text, str):
        raise pickle.UnpicklingError(f"refusing _codecs.encode with encoding {encoding!r}")
    return text.encode("latin1")


def _allowed_globals() -> dict[tuple[str, str], Any]:
    # numpy 2 moved numpy.core to numpy._core; resolve whichever this numpy has (never by the
    # module name a pickle asks for).
    core = getattr(np, "_core", None) or np.core
    reconstruct = core.multiarray._reconstruct
    frombuffer = core.numeric._frombuffer
    allowed: dict[tuple[str, str], Any] = {("_codecs", "encode"): _latin1_encode}
    for mod in ("numpy.core.multiarray", "numpy._core.multiarray"):
        allowed[(mod, "_reconstruct")] = reconstruct
    for mod in ("numpy.core.numeric", "numpy._core.numeric"):
        allowed[(mod, "_frombuffer")] = frombuffer
    allowed[("numpy", "ndarray")] = np.ndarray
    allowed[("numpy", "dtype")] = np.dtype
    return allowed


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickle plain containers, bytes/str/numbers and numpy arrays; refuse every other global.

    Pickle opcodes for dict/list/tuple/bytes/str/int need no globals; numpy arrays need
    ``_reconstruct``/``_frombuffer``, ``ndarray`` and ``dtype``. Anything else (``os.system``,
    ``builtins.eval``, ...) raises before it can run, because ``find_class`` is the only way a pickle
    reaches a callable.
    """

    def __init__(self, file: io.BufferedIOBase | io.BytesIO, where: str) -> None:
        super().__init__(file, encoding="bytes")
        self.where = where
        self.allowed = _allowed_globals()

    def find_class(self, module: str, name: str) -> Any:
        obj = self.allowed.get((module, name))
        if obj is None:
            raise SourceError(
                f"{self.where}: refusing to unpickle {module}.{name} (only containers, bytes/str/numbers and "
                "numpy arrays are allowed in CIFAR batches); the file is not a genuine CIFAR batch, do not load it"
            )
        return obj


def restricted_load(path: str | os.PathLike[str]) -> Any:
    """Load a pickle file with :class:`RestrictedUnpickler`; errors name the file."""
    where = os.fspath(path)
    try:
        with open(path, "rb") as f:
            return RestrictedUnpickler(f, where).load()
    except SourceError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError) as exc:
        raise SourceError(f"{where}: not a readable CIFAR batch ({type(exc).__name__}: {exc})") from exc


class CifarSource(Source):
    """CIFAR-10 python batches; ``split`` selects train (data_batch_1..5) or test (test_batch)."""

    kind = "cifar"
    sample_kind = "decoded"

    def __init__(self, root: Path, split: str = "train") -> None:
        super().__init__(root)
        if split not in CIFAR_SPLITS:
            raise UsageError(f"unknown CIFAR split {split!r}; expected one of {', '.join(CIFAR_SPLITS)}")
        self.split = split
        self.batches = [b for b in CIFAR_SPLITS[split] if (root / b).is_file()]
        if not self.batches:
            raise SourceError(f"{root}: no {' / '.join(CIFAR_SPLITS[split])} file for split {split!r}")
        self._cache: dict[str, np.ndarray] = {}
        meta = root / "batches.meta"
        names: list[str] = []
        if meta.is_file():
            m = restricted_load(meta)
            raw = m.get(b"label_names") if isinstance(m, dict) else None
            if isinstance(raw, list):
                names = [n.decode() if isinstance(n, bytes) else str(n) for n in raw]
        refs = []
        max_label = -1
        for b in self.batches:
            data, labels = self._load_batch(b)
            st = (root / b).stat()
            for i, lab in enumerate(labels):
                refs.append(SampleRef(f"{b}/{i:05d}", lab, f"{b}#{i}", 3072, st.st_mtime_ns))
            max_label = max(max_label, *labels) if labels else max_label
            self._cache[b] = data
        self.classes = names or (CIFAR_CLASSES if max_label < 10 else [str(i) for i in range(max_label + 1)])
        if max_label >= len(self.classes):
            raise SourceError(f"{root}: label {max_label} out of range for {len(self.classes)} classes in batches.meta")
        self.refs = refs
        self.image_shape = (32, 32, 3)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "split": self.split}

    def _load_batch(self, name: str) -> tuple[np.ndarray, list[int]]:
        path = self.root / name
        d = restricted_load(path)
        data = d.get(b"data") if isinstance(d, dict) else None
        labels = d.get(b"labels", d.get(b"fine_labels")) if isinstance(d, dict) else None
        if not (isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.ndim == 2 and data.shape[1] == 3072):
            raise SourceError(f"{path}: expected b'data' as a uint8 array of shape (N, 3072)")
        if not (isinstance(labels, list) and len(labels) == len(data) and all(isinstance(x, int) for x in labels)):
            raise SourceError(f"{path}: expected b'labels' as a list of {len(data)} integers")
        if labels and min(labels) < 0:
            raise SourceError(f"{path}: negative label")
        return data, [int(x) for x in labels]

    def load(self, ref: SampleRef) -> Sample:
        batch, idx = ref.locator.rsplit("#", 1)
        data = self._cache.get(batch)
        if data is None:
            data = self._cache[batch] = self._load_batch(batch)[0]
        # CIFAR rows are channel-major: 1024 R, 1024 G, 1024 B.
        img = np.ascontiguousarray(data[int(idx)].reshape(3, 32, 32).transpose(1, 2, 0))
        return Sample(ref.key, ref.label, img, "png", {"source": ref.locator})

    def path_of(self, ref: SampleRef) -> str:
        batch, idx = ref.locator.rsplit("#", 1)
        return f"{self.root / batch}[{idx}]"

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_cache": {}}

    def close(self) -> None:
        self._cache.clear()
