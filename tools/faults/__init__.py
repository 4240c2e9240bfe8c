"""Fault injection and hostile-input trials for stager, with counts (docs/reliability.md).

Modules: :mod:`.harness` (real ``python -m stager`` subprocesses, kill points, tree snapshots,
small datasets), :mod:`.tally` (the figures each trial records), :mod:`.kill` (kill -9 during
pack / stage / stage --unpack / training), :mod:`.space` (RLIMIT_FSIZE and a real full tmpfs),
:mod:`.corrupt` (damaged shards and manifests, loader ``on_error``), :mod:`.concurrency`
(several stagers and loaders on one node), :mod:`.report` (runs the suites, writes the table).

The trial functions return plain counts; the tests in ``tests/faults/`` assert on them and record
them, so the table in docs/reliability.md is exactly what the assertions checked.
"""
