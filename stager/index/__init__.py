"""``stager index``: adopt existing shards in place (webdataset tars, TFRecords, parquet, MXNet RecordIO, LMDB).

One module per input kind (:mod:`stager.index.tar`, :mod:`stager.index.record`,
:mod:`stager.index.parquet`) turns one shard file into a :class:`~stager.index.scan.ShardScan`;
:mod:`stager.index.api` runs them over a directory and publishes the manifest. docs/index.md.
"""

from stager.index.api import IndexResult, adopt_in_memory, index_dataset, rescan_shard
from stager.index.options import KINDS, IndexOptions

__all__ = ["KINDS", "IndexOptions", "IndexResult", "adopt_in_memory", "index_dataset", "rescan_shard"]
