"""``stager pack``: turn a source (ImageFolder, CIFAR batches, list file, another pack) into shards.

:func:`pack` (:mod:`.api`) runs the phases check, list, plan, resume, write, publish. Below it:
:mod:`.options` (the options, checked once), :mod:`.sources` (what samples come from), :mod:`.plan`
(pure: which sample goes to which shard), :mod:`.shard` (writing one shard; the layer the driver
and the workers share), :mod:`.resume` (what a previous run left in OUT), :mod:`.workers` (the
process pool of ``--workers N``).
"""

from stager.pack.api import PackResult, format_result, pack

__all__ = ["PackResult", "format_result", "pack"]
