"""Pieces of ``tools/train.py``: models, distributed setup, LR schedule, checkpoints, metrics, data.

One concept per module so each can be read (and tested) on its own; ``tools/train.py`` wires them
into the training loop.
"""
