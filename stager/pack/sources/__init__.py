"""Pack sources: where samples come from before they become shards.

A source lists lightweight :class:`SampleRef` objects (key, label, locator, size estimate, mtime) that
the planner uses without reading any image, and materialises :class:`~stager.formats.base.Sample`
objects on demand with :meth:`Source.load_many`. Four kinds are recognised by :func:`open_source`:

* ``imagefolder``: ``root/<class>/**/<image>``; labels are indices into the sorted class names
  (torchvision's rule); image extensions match case-insensitively; hidden files/folders are skipped.
* ``cifar``: a CIFAR-10 python batches directory (``data_batch_1..5`` = split ``train``,
  ``test_batch`` = split ``test``), read with a restricted unpickler (:func:`restricted_load`).
  Samples are (32, 32, 3) uint8 arrays; ``stager.pack`` PNG-encodes them for encoded formats.
* ``list``: a ``.csv`` (header ``path,label``) or ``.jsonl`` (objects ``{"path", "label"}``) file;
  labels are ints or class names; relative paths resolve against the list file's directory.
* ``recordio``/``lmdb``: MXNet ``.rec`` files and LMDBs (Caffe Datums, pickled samples), indexed in
  memory as ``stager index`` does and read by their byte extents (raw Datums as decoded arrays).
* ``pack``: an existing stager pack (a directory with ``manifest.json``), re-read through the format
  readers so that any format converts to any other with keys, labels and classes preserved.

Keys are the relative path without its extension, with dots in the last component replaced by
``_`` (webdataset splits keys at the first dot); collisions get a deterministic ``_<n>`` suffix in
sorted path order. Sources are picklable (loaded batches/readers are dropped on pickling) so pack
workers receive them once.
"""

from stager.pack.sources.adopted import AdoptedSource
from stager.pack.sources.base import IMAGE_EXTENSIONS, SampleRef, Source, key_for, unique_keys
from stager.pack.sources.checks import check_encoded, prepare_sample, probe_hw
from stager.pack.sources.cifar import CIFAR_CLASSES, CifarSource, restricted_load
from stager.pack.sources.imagefolder import ImageFolderSource
from stager.pack.sources.listfile import ListSource
from stager.pack.sources.packed import PackSource
from stager.pack.sources.select import open_source

__all__ = [
    "CIFAR_CLASSES",
    "IMAGE_EXTENSIONS",
    "AdoptedSource",
    "CifarSource",
    "ImageFolderSource",
    "ListSource",
    "PackSource",
    "SampleRef",
    "Source",
    "check_encoded",
    "key_for",
    "open_source",
    "prepare_sample",
    "probe_hw",
    "restricted_load",
    "unique_keys",
]
