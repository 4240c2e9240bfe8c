"""The on-disk contract every stage reads: ``manifest.json`` (per-shard facts and the dataset's
schema, :mod:`~stager.manifest.document`), its shards' entries (:mod:`~stager.manifest.shard`) and
its sample index (per-sample columns in a mapped table file, :mod:`~stager.manifest.samples` over
:mod:`~stager.manifest.table`). docs/formats.md is
normative."""

from stager.manifest.document import (
    BAD_NAME_CHARS,
    FORMATS,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    MIX_RECEIPT_NAME,
    NAME_MAX_BYTES,
    PACK_STATE_NAME,
    RECEIPT_NAME,
    RESERVED_NAMES,
    SCHEMA,
    SCHEMA_V1,
    UNLABELED,
    UNPACK_DIR_NAME,
    IndexRef,
    Manifest,
    _digest_of,
    bytes_for_copy,
    check_entry_name,
    check_file_name,
    class_dir_name,
    check_safe_name,
    dataset_root,
    entry_name_problem,
    load_manifest,
    manifest_path,
    remove_stale_indexes,
    shard_index_arrays,
    shard_root,
    unpacked_stem,
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
    "BAD_NAME_CHARS", "CORE", "FORMATS", "INDEX_PARTIAL_BASE", "INDEX_SUFFIX", "MANIFEST_NAME", "MAX_MANIFEST_BYTES", "MIX_RECEIPT_NAME",
    "NAME_MAX_BYTES", "PACK_STATE_NAME", "RECEIPT_NAME",
    "RESERVED_NAMES", "SCHEMA", "SCHEMA_V1", "UNLABELED", "UNPACK_DIR_NAME", "AuxFile", "Column", "IndexRef", "Manifest",
    "Ragged", "SampleIndex", "ShardInfo", "Strings", "Table", "_digest_of", "bytes_for_copy", "check_entry_name", "check_file_name", "class_dir_name",
    "check_safe_name", "dataset_root", "entry_name_problem", "index_file_name", "is_index_file_name", "load_manifest", "manifest_path",
    "open_table", "parse_table", "remove_stale_indexes", "shard_index_arrays", "shard_root", "unpacked_stem", "write_table",
]
