"""The on-disk contract every stage reads: ``manifest.json`` (per-shard facts and the dataset's
schema, :mod:`~stager.manifest.document`), its shards' entries (:mod:`~stager.manifest.shard`) and
its sample index (per-sample columns in a mapped table file, :mod:`~stager.manifest.samples` over
:mod:`~stager.manifest.table`). docs/formats.md is
normative."""

from stager.manifest.document import (
    FORMATS,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    SCHEMA,
    SCHEMA_V1,
    IndexRef,
    Manifest,
    _digest_of,
    bytes_for_copy,
    check_safe_name,
    dataset_root,
    load_manifest,
    manifest_path,
    remove_stale_indexes,
    shard_index_arrays,
    shard_root,
)
from stager.manifest.samples import (
    CORE,
    INDEX_PARTIAL_BASE,
    INDEX_SUFFIX,
    SampleIndex,
    index_file_name,
    is_index_file_name,
)
from stager.manifest.shard import AuxFile, ShardInfo
from stager.manifest.table import Column, Ragged, Strings, Table, open_table, parse_table, write_table

__all__ = [
    "CORE", "FORMATS", "INDEX_PARTIAL_BASE", "INDEX_SUFFIX", "MANIFEST_NAME", "MAX_MANIFEST_BYTES", "SCHEMA",
    "SCHEMA_V1", "AuxFile", "Column", "IndexRef", "Manifest", "Ragged", "SampleIndex", "ShardInfo", "Strings",
    "Table", "_digest_of", "bytes_for_copy", "check_safe_name", "dataset_root", "index_file_name",
    "is_index_file_name", "load_manifest", "manifest_path", "open_table", "parse_table", "remove_stale_indexes",
    "shard_index_arrays", "shard_root", "write_table",
]
