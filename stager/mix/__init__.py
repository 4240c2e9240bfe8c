"""Several datasets read as one: the mix's request (:mod:`.spec`) and its file (:mod:`.file`).

``Mix`` (streams, composition, epoch length) and ``Stream`` (a dataset path with a weight, an
absolute ``samples`` per epoch, or a ``repeat``) are what ``make_loader`` and ``stager stage`` take
in place of one dataset path; ``as_mix`` builds one from a list of ``(path, weight)`` pairs, stream
objects or a YAML/JSON mix file. The order the loader reads a mix in is :mod:`stager.order.mix`'s;
the loader's side is :mod:`stager.loader.mix.dataset` (docs/loader.md, "Mixing datasets").
"""

from __future__ import annotations

from stager.mix.file import as_mix, is_mix, is_mix_path, load_mix_file
from stager.mix.spec import COMPOSITIONS, Mix, Stream, mix_of, named_error, stream_of

__all__ = ["COMPOSITIONS", "Mix", "Stream", "as_mix", "is_mix", "is_mix_path", "load_mix_file", "mix_of",
           "named_error", "stream_of"]
