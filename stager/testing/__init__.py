"""Conformance suites a new backend subclasses (as zarr's ``zarr.testing.store.StoreTests``).

:mod:`stager.testing.formats`: :class:`~stager.testing.formats.ReaderTests` for every shard format,
:class:`~stager.testing.formats.FormatTests` for the ones stager writes. They are pytest classes: a
test module subclasses one, names its format, and pytest runs every inherited test. This package
imports pytest, so only tests import it.
"""
