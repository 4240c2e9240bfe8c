"""Who reads what, when: pure numpy functions of the manifest's columns and (seed, epoch, world).

The node partition (:mod:`.partition`), the epoch plan (:mod:`.epoch`). The loader, ``stage
--partition`` and the prefetcher all import these one copies, so they agree without communicating.
"""
