"""The loader's side of a mix of datasets (docs/loader.md, "Mixing datasets"); what a mix is: :mod:`stager.mix`.

* :mod:`.members`: one checked :class:`~stager.loader.rank.RankDataset` per stream (staged or source, kinds,
  common fields);
* :mod:`.feed`: a worker's feed per stream (its own schedule and fetcher; ids, keys, labels and gather
  orders in the layout's order, a window of batches at a time);
* :mod:`.dataset`: :class:`~stager.loader.mix.dataset.MixDataset`, the mix's plan, hooks and batches
  assembled in the layout's order (no torch; what the numpy loader runs);
* :mod:`.torch_dataset`: the same on the torch transport (``MixTorchRankDataset``, what a Loader of a mix
  holds, and ``MixShardedDataset``, a torch ``IterableDataset``).

Its ``__init__`` imports none of them: ``stager.loader.mix.dataset`` works without torch.
"""
