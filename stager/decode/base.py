"""What every decode backend provides, and the probe result that carries header facts between steps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from stager.decode.crop import Box


@dataclass(frozen=True)
class Probe:
    """An image's ``height``/``width`` from its header, plus backend-private state (``handle``)
    so that decoding after choosing the crop does not parse the header again."""

    height: int
    width: int
    handle: object = None


class Decoder(Protocol):
    """A backend. Every method returns C-contiguous uint8 RGB arrays and raises CorruptSampleError
    for undecodable bytes (the caller adds the shard and key)."""

    name: str

    def probe(self, data: bytes) -> Probe:
        """Header only: size (and whatever the backend needs later). Refuses decompression bombs."""
        ...

    def decode_rgb(self, data: bytes) -> np.ndarray:
        """Full image, shape (H, W, 3)."""
        ...

    def crop_resize(self, data: bytes, probe: Probe, box: Box, size: int) -> np.ndarray:
        """Region ``box`` (top, left, height, width) resized to (size, size, 3), bilinear."""
        ...

    def center_crop(self, data: bytes, probe: Probe, size: int, resize: int) -> np.ndarray:
        """Shorter side resized to ``resize``, then the central (size, size, 3)."""
        ...

    def flip(self, arr: np.ndarray) -> np.ndarray:
        """Horizontal mirror of an (H, W, 3) array, C-contiguous."""
        ...
