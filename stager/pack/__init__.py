"""``stager pack``: turn a source (ImageFolder, CIFAR batches, list file, another pack) into shards."""

from stager.pack.api import PackResult, format_result, pack

__all__ = ["PackResult", "format_result", "pack"]
