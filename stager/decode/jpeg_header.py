"""Read a JPEG's frame header (size, components, sampling, scan layout) without decoding it.

A few microseconds in Python: markers sit in the first few hundred bytes, and we stop at the first
start-of-scan. What the fast decoder needs from it:

* the size, to draw the crop before decoding (and to refuse decompression bombs);
* whether the file is *single-scan sequential* (SOF0/SOF1, first scan interleaving every component),
  because only then is the image coded top to bottom in one pass, so lowering the frame height makes
  libjpeg decode just the top rows (see :func:`with_height`);
* the MCU height, to cut on a whole MCU row plus one row of margin so chroma upsampling at the
  crop's bottom edge sees the same neighbours as in a full decode.
"""

from __future__ import annotations

from dataclasses import dataclass

# Start-of-frame markers: C0-CF except DHT (C4), JPG (C8), DAC (CC).
# Start-of-frame markers (baseline, progressive, lossless, arithmetic): the frame header follows.
SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_STANDALONE = frozenset(range(0xD0, 0xD8)) | {0x01}
_SOS, _EOI = 0xDA, 0xD9


@dataclass(frozen=True)
class JpegHeader:
    """What the frame and first scan headers say. ``height`` may be 0 (size given later by DNL)."""

    height: int
    width: int
    components: int
    precision: int
    sof: int  # the start-of-frame marker byte: 0xC0 baseline, 0xC1 extended, 0xC2 progressive, ...
    mcu_height: int  # 8 * max vertical sampling factor: rows per interleaved MCU row
    height_offset: int  # byte offset of the 16-bit frame height (to rewrite it)
    first_scan_components: int  # components in the first scan; 0 if no scan header was seen

    @property
    def single_scan(self) -> bool:
        """True when the whole image is one sequential Huffman scan coded top to bottom."""
        return self.sof in (0xC0, 0xC1) and self.first_scan_components == self.components and self.height > 0


class HeaderError(ValueError):
    """The bytes start like a JPEG but the marker structure is broken."""


def is_jpeg(data: bytes | bytearray | memoryview) -> bool:
    """True when ``data`` starts with the JPEG SOI marker followed by another marker."""
    return len(data) >= 4 and data[0] == 0xFF and data[1] == 0xD8 and data[2] == 0xFF


def parse_jpeg_header(data: bytes | bytearray | memoryview) -> JpegHeader:
    """Parse markers up to the first SOS; raise HeaderError when there is no usable frame header."""
    n = len(data)
    p = 2
    frame: tuple[int, int, int, int, int, int, int] | None = None
    while p + 4 <= n:
        if data[p] != 0xFF:
            raise HeaderError(f"expected a marker at byte {p}, got 0x{data[p]:02x}")
        marker = data[p + 1]
        if marker == 0xFF:  # fill byte
            p += 1
            continue
        if marker in _STANDALONE:
            p += 2
            continue
        if marker == _EOI:
            break
        seglen = (data[p + 2] << 8) | data[p + 3]
        if seglen < 2 or p + 2 + seglen > n:
            raise HeaderError(f"segment 0x{marker:02x} at byte {p} has length {seglen} past the end ({n} bytes)")
        if marker in SOF_MARKERS:
            if seglen < 8:
                raise HeaderError(f"frame header too short ({seglen} bytes)")
            precision = data[p + 4]
            height = (data[p + 5] << 8) | data[p + 6]
            width = (data[p + 7] << 8) | data[p + 8]
            ncomp = data[p + 9]
            if seglen < 8 + 3 * ncomp or ncomp == 0 or width == 0:
                raise HeaderError(f"bad frame header: {ncomp} components, width {width}")
            vmax = max((data[p + 11 + 3 * c] & 0x0F) for c in range(ncomp))
            frame = (height, width, ncomp, precision, marker, 8 * max(vmax, 1), p + 5)
        elif marker == _SOS:
            if frame is None:
                raise HeaderError("scan before frame header")
            return JpegHeader(*frame, first_scan_components=data[p + 4])
        p += 2 + seglen
    if frame is None:
        raise HeaderError("no frame header (SOF) found")
    return JpegHeader(*frame, first_scan_components=0)


def with_height(data: bytes, header: JpegHeader, rows: int) -> bytes:
    """A copy of ``data`` whose frame header declares ``rows`` rows (``0 < rows <= height``).

    For a single-scan sequential JPEG a decoder then stops after ``rows`` rows; those rows are
    bit-identical to a full decode except within one MCU row of the new bottom edge (upsampling
    context), which callers keep as margin. The entropy data after them is left in place, so a
    strict decoder reports "extraneous bytes" once it has written every row.
    """
    if not header.single_scan or not 0 < rows <= header.height:
        raise ValueError(f"cannot truncate to {rows} rows (single_scan={header.single_scan}, height={header.height})")
    o = header.height_offset
    return b"".join((data[:o], rows.to_bytes(2, "big"), data[o + 2 :]))
