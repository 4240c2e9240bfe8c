"""A node-local, content-addressed shard cache that outlives the job (``stager stage --cache DIR``).

Datasets staged through a cache leave a copy of each file (shards, companion files, the sample
index) under its verified hash; the next stage of the same dataset (or of another that shares those
files) copies nothing and links the objects into its destination. One module per concern:

* :mod:`~stager.cache.layout`: every name in a cache directory; content addressing (:func:`object_key`);
* :mod:`~stager.cache.config`: ``--cache``, ``$STAGER_CACHE``, quotas, the site configuration;
* :mod:`~stager.cache.store`: :class:`Cache`, a cache opened and checked (who may do what), objects,
  dataset records, the eviction log;
* :mod:`~stager.cache.locks`: fill locks (one copy of an object at a time);
* :mod:`~stager.cache.lease`: leases (what live jobs use), live or dead;
* :mod:`~stager.cache.evict`: LRU eviction that never removes what is in use, explained;
* :mod:`~stager.cache.objectcheck`: every object against its name;
* :mod:`~stager.cache.history`: when this user staged what (``stager hints``).

Staging through a cache is :mod:`stager.stage.cached`; reading from one is the loader's
(:mod:`stager.loader.shard_access`). docs/staging.md ("The shard cache") and docs/security.md describe the
rules.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stager.cache.config import CacheOptions, Quota, SiteConfig, site_config
    from stager.cache.layout import object_key
    from stager.cache.lease import Lease
    from stager.cache.store import Cache

# The public names load on first use: `stager stage` without --cache imports only the options
# (stager.cache.config), not the engine (docs/benchmarks.md, CLI start-up).
_HOMES = {"CacheOptions": "config", "Quota": "config", "SiteConfig": "config", "site_config": "config",
          "object_key": "layout", "Lease": "lease", "Cache": "store"}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(f"stager.cache.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'stager.cache' has no attribute {name!r}")


__all__ = ["Cache", "CacheOptions", "Lease", "Quota", "SiteConfig", "object_key", "site_config"]
