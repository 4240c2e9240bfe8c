"""``model.fit`` over KerasBatches for 3 ranks (tests/test_keras.py): ``python keras_fit_script.py DATA OUT``.

Set KERAS_BACKEND before running. Records per rank which sample ids the loader handed to Keras in
each of 2 epochs, and the loader's position after fit.
"""

from __future__ import annotations

import json
import sys

import keras

from stager.loader.keras import KerasBatches
from stager.loader.numpy_loader import make_numpy_loader


def main() -> None:
    data, out = sys.argv[1], sys.argv[2]
    result = {"backend": keras.backend.backend(), "ranks": []}
    for rank in range(3):
        loader = make_numpy_loader(data, 8, rank=rank, world_size=3, num_workers=2, image_size=32, staged=False,
                                   multiprocessing_context="fork")
        fetched: list[list[int]] = []
        finish = loader._finish

        def record(batch, finish=finish, fetched=fetched):
            fetched.append(batch["index"].tolist())
            return finish(batch)

        loader._finish = record
        model = keras.Sequential([keras.Input((32, 32, 3)), keras.layers.Rescaling(1 / 255),
                                  keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10, activation="softmax")])
        model.compile("sgd", "sparse_categorical_crossentropy")
        hist = model.fit(KerasBatches(loader), epochs=2, verbose=0)
        result["ranks"].append({"len": len(loader), "fetched": fetched, "state": loader.state_dict(),
                                "loss": hist.history["loss"]})
        loader.close()
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
