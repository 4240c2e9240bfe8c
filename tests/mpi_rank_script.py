"""One rank's epoch under a real launcher (tests/test_mpi.py): ``python mpi_rank_script.py DATA OUT MODE``.

MODE ``both``: the torch loader and the numpy loader, same settings; ``numpy``: the numpy loader only
(no torch imported). Writes ``OUT/rank<r>.json`` with the detected topology and each loader's sample ids
of epoch 0 and 1, batch by batch.
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

from stager.world import World


def main() -> None:
    data, out, mode = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    w = World.detect()
    kw = {"seed": 7, "staged": False, "image_size": 32, "decode": "raw"}
    from stager.loader.numpy_loader import make_numpy_loader

    record = {"rank": w.rank, "world_size": w.world_size, "local_rank": w.local_rank, "node": w.node,
              "source": w.source, "host": socket.gethostname()}
    loaders = {"numpy": make_numpy_loader(data, 8, num_workers=2, multiprocessing_context="fork", **kw)}
    if mode == "both":
        from stager.loader import make_loader

        loaders["torch"] = make_loader(data, 8, num_workers=2, multiprocessing_context="fork", **kw)
    for name, loader in loaders.items():
        record[name] = [[b["index"].tolist() for b in loader] for _epoch in range(2)]
        loader.close()
    record["torch_imported"] = "torch" in sys.modules
    (out / f"rank{w.rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
