#!/usr/bin/env python3
"""Keras 3 ResNet50V2 on a stager-packed CIFAR-10: the BSC hands-on (Keras + Slurm) in small.

    KERAS_BACKEND=torch python tools/train_keras.py --data /scratch/cifar-packed --epochs 5
    KERAS_BACKEND=tensorflow srun --ntasks-per-node 4 python tools/train_keras.py --data ...

The data come from a :class:`stager.loader.numpy_loader.NumpyLoader` (numpy batches from worker
processes, no torch needed) through :class:`stager.loader.keras.KerasBatches` (a
``keras.utils.PyDataset``), each batch dict mapped to ``(x, y)`` by ``--x``/``--y``. Under a
launcher (srun, mpirun, horovodrun, torchrun) each process trains on its rank's share
(:mod:`stager.world`); averaging gradients across ranks is the framework's job (Horovod's
``hvd.DistributedOptimizer``, ``tf.distribute.MultiWorkerMirroredStrategy``; docs/training.md),
so without one the ranks train independent replicas on disjoint shares.

The model is ``keras.applications.ResNet50V2(weights=None)`` after a ``Rescaling(1/255)``, trained
with SGD and sparse categorical cross-entropy. ``--steps`` caps the steps per epoch (a smoke run).
The last stdout line is a JSON summary (``--json`` prints only that). A ``--x``/``--y`` naming a
field the batches lack exits 2 with one line naming the fields there are.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stager.errors import StagerError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--data", required=True, help="a stager-packed dataset (path or URL)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--steps", type=int, help="steps per epoch (default: the whole rank share)")
    p.add_argument("--batch-size", type=int, default=64, help="images per rank per step")
    p.add_argument("--image-size", type=int, default=32, help="decoded image side (CIFAR: 32)")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--workers", type=int, default=2, help="loader worker processes per rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--x", default="image", help="batch field(s) for the model input (comma list)")
    p.add_argument("--y", default="label", help="batch field for the target")
    p.add_argument("--json", action="store_true", help="print only the JSON summary")
    return p.parse_args(argv)


def build_model(keras: Any, size: int, classes: int) -> Any:
    inputs = keras.Input((size, size, 3))
    x = keras.layers.Rescaling(1.0 / 255)(inputs)
    net = keras.applications.ResNet50V2(weights=None, input_shape=(size, size, 3), classes=classes)
    return keras.Model(inputs, net(x))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from stager.loader.mapping import BatchMapping
    from stager.loader.numpy_loader import make_numpy_loader

    x_fields = args.x.split(",")
    x = x_fields[0] if len(x_fields) == 1 else tuple(x_fields)
    try:
        loader = make_numpy_loader(args.data, args.batch_size, num_workers=args.workers, seed=args.seed,
                                   image_size=args.image_size, multiprocessing_context="spawn")
        BatchMapping(x, args.y).check(loader.fields, "--x/--y")  # before the seconds keras takes to import
    except StagerError as exc:
        print(f"train_keras: error: {exc}", file=sys.stderr)
        return 2
    import keras

    from stager.loader.keras import KerasBatches

    batches = KerasBatches(loader, x, args.y)

    keras.utils.set_random_seed(args.seed)
    model = build_model(keras, args.image_size, args.classes)
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=args.lr, momentum=0.9),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    t0 = time.perf_counter()
    hist = model.fit(batches, epochs=args.epochs, steps_per_epoch=args.steps, verbose=0 if args.json else 2)
    seconds = time.perf_counter() - t0
    stats = loader.stats()
    loader.close()
    summary = {
        "event": "summary", "backend": keras.backend.backend(), "rank": loader.dataset.rank,
        "world_size": loader.dataset.world_size, "epochs": args.epochs, "steps_per_epoch": args.steps or len(loader),
        "loss": [float(v) for v in hist.history["loss"]], "samples": stats["samples"], "seconds": round(seconds, 2),
        "params": int(model.count_params()), "loader_state": loader.state_dict(),
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
