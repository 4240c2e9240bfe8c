"""Who reads what, when: pure numpy functions of the manifest's columns and (seed, epoch, world).

Modules: :mod:`.partition` (shards to nodes for ``stage --partition``/``--shared`` and the loader
on such a copy), :mod:`.epoch` (each rank's and worker's samples in order: ``PlanConfig`` ->
``RankPlan`` of ``WorkerPlan``), :mod:`.reads` (which shard segments each worker reads while loading
which batch, and which of those reads open a file: ``ReadSchedule`` of ``WorkerReads``),
:mod:`.streams` (every random stream's key). The loader, ``stage --partition`` and the prefetcher
all import these one copies, so they agree without communicating. Nothing here imports torch,
the manifest or the loader: only numpy, :mod:`stager.errors` and each other.
"""
