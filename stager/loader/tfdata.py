"""tf.data: a ``tf.data.Dataset`` over a stager loader, for TensorFlow users.

``tf_dataset(loader)`` wraps a :class:`~stager.loader.numpy_loader.NumpyLoader` (numpy batches, no
torch) in ``tf.data.Dataset.from_generator`` with an ``output_signature``: each pass over the
dataset is one stager epoch of this rank's share, shuffled by the loader's seed, in equal batch
counts on every rank; the next pass is the next epoch. The elements are already batches (do not
``.batch()`` again): ``(x, y)`` as the :class:`~stager.loader.mapping.BatchMapping` says, image
``uint8`` (B, H, W, C) (or ``x_dtype``), label ``int64`` (B,).

Resume: ``loader.state_dict()`` is the position in batches handed to tf.data, which (with the
prefetch that tf.data's optimiser would inject, and its parallelising of a plain ``.map(f)`` after
it, turned off) is the batches the model took. Save it with the checkpoint at a step boundary; after
a restart ``loader.load_state_dict(state)`` and a new ``tf_dataset(loader)`` continue with exactly
the epoch's remaining batches. A ``.prefetch(k)`` or a ``.map(f, num_parallel_calls=...)`` after it
moves the loader ahead of the model (up to ``k`` batches, or the map's parallelism), so save
``state`` of a pipeline without either, or subtract what is in flight (docs/training.md, "tf.data").

When TF's own ``tf.data.TFRecordDataset`` over the record shards is the better choice instead:
docs/training.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import tensorflow as tf

from stager.loader.base import LoaderBase
from stager.loader.mapping import BatchMapping, Names, field_names

# Each batch field's element spec: dtype and shape (B first; images (B, H, W, C)).
FIELD_SPECS: dict[str, tuple[Any, tuple[int | None, ...]]] = {
    "image": (tf.uint8, (None, None, None, None)),
    "label": (tf.int64, (None,)),
    "index": (tf.int64, (None,)),
    "key": (tf.string, (None,)),
}


def _spec(spec: Names, dtype: str | None) -> Any:
    specs = [
        tf.TensorSpec(shape=FIELD_SPECS[n][1], dtype=tf.as_dtype(dtype) if dtype else FIELD_SPECS[n][0], name=n)
        for n in field_names(spec)
    ]
    return specs[0] if isinstance(spec, str) else tuple(specs)


def tf_dataset(loader: LoaderBase, x: Names = "image", y: Names = "label", *, x_dtype: str | None = None,
               fn: Any = None, output_signature: Any = None) -> tf.data.Dataset:
    """``loader``'s batches as a ``tf.data.Dataset`` of ``(x, y)`` (module docstring).

    With ``fn`` (a batch dict -> structure of arrays) pass its ``output_signature`` too. A name in
    ``x``/``y`` that is not a batch field is a one-line :class:`~stager.errors.UsageError`.
    """
    mapping = BatchMapping(x, y, fn, x_dtype)
    mapping.check(loader.fields, "the tf.data mapping")
    if output_signature is None:
        if fn is not None:
            raise TypeError("tf_dataset(fn=...) needs the output_signature of what fn returns")
        output_signature = _spec(x, x_dtype) if y is None else (_spec(x, x_dtype), _spec(y, None))

    def batches() -> Iterator[Any]:
        for batch in loader:
            yield mapping(batch)

    ds = tf.data.Dataset.from_generator(batches, output_signature=output_signature)
    # tf.data's default optimisations inject a prefetch after the generator, so the iterator pulls one
    # or two batches more than the model has taken (measured with TF 2.21), and a state_dict() saved at
    # a step boundary would skip them on resume. Without it the loader's position is exactly what the
    # model has consumed; the loader's workers prefetch already. Likewise map_parallelization, which
    # rewrites a user's plain .map(f) after it (f stateless: any preprocessing) into a parallel map that
    # runs 1-2 batches ahead; a map given num_parallel_calls is the user's own read-ahead, as .prefetch().
    options = tf.data.Options()
    options.experimental_optimization.inject_prefetch = False
    options.experimental_optimization.map_parallelization = False
    return ds.with_options(options)
