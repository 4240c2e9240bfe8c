"""stager: pack image datasets into verified shards, stage them onto node-local storage, and
stream shuffled, rank-partitioned batches into PyTorch DDP.

Data flow (see docs/architecture.md): pack -> manifest -> stage -> receipt -> loader.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
