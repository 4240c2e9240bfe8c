"""The one redaction of locations: what stager prints or stores never carries a URL's secrets.

A URL may carry credentials in its userinfo (``https://user:password@host/...``) or its query and
fragment (``?token=...``, a presigned ``X-Amz-Signature=...``). Every location that is printed (the
CLI's text and ``--json``, error messages, log lines, ``stager inspect``) or stored (receipts,
manifests, journals, state files) passes through :func:`redact` (one location) or
:func:`redact_text` (free text that may contain URLs) first. :class:`~stager.errors.StagerError`
applies :func:`redact_text` to its message, so no error can leak one.

The contract, for any string ``s``: ``redact(redact(s)) == redact(s)``; a string without ``://`` is
returned unchanged (local paths are never altered); in a URL, the scheme, host, port and path are
kept, userinfo becomes ``***`` and every query or fragment value becomes ``***`` (keys are kept: they
say which parameter was given, not its value).

Printed text is also made harmless: :func:`printable` escapes control characters (``ESC`` and the
other C0 and C1 controls, ``DEL``, the bidirectional overrides) and bytes that are not UTF-8 (a file
name's raw ``0x9b`` is an 8-bit CSI to some terminals), so a name someone else wrote (a
file, a lease, a dataset path) can never move the cursor, recolour or rewrite a terminal or forge a
line; :func:`redact_text` applies it to everything it returns (keeping newlines and tabs, which the
CLI's own multi-line text uses), so the CLI's text, ``--json`` strings, warnings and every
:class:`~stager.errors.StagerError` message are printable.

This module is pure string handling with no imports from stager: it sits at the bottom layer so that
:mod:`stager.errors` can use it.
"""

from __future__ import annotations

import os
import re

MASK = "***"
# C0 controls, DEL, C1 controls, the bidirectional embeddings, overrides and isolates, and the bytes of
# a name that are not UTF-8 (os.listdir and sys.argv carry them as lone surrogates U+DC80-U+DCFF, which
# the CLI's stdout writes back as the raw byte: a lone 0x9b is a terminal's 8-bit CSI).
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\udc80-\udcff]")
_CONTROL_BUT_LINES = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\udc80-\udcff]")
_URL = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://(?P<auth>[^/?#]*)(?P<path>[^?#]*)"
                  r"(?:\?(?P<query>[^#]*))?(?:#(?P<frag>.*))?$", re.S)
# A URL inside free text: up to whitespace or a quote/bracket; trailing punctuation is not part of it.
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>`]*[^\s'\"<>`.,;:)\]}]")


def _mask_pairs(text: str) -> str:
    """``a=1&b=2`` -> ``a=***&b=***``; an item without ``=`` is masked whole."""
    out = []
    for item in re.split(r"([&;])", text):
        if item in ("&", ";", ""):
            out.append(item)
        elif "=" in item:
            out.append(item.split("=", 1)[0] + "=" + MASK)
        else:
            out.append(MASK)
    return "".join(out)


def redact(location: str | os.PathLike[str]) -> str:
    """``location`` with a URL's userinfo and query/fragment values masked (see the module docstring).

    ``https://u:pw@h:8080/d/x.tar?token=abc&v=1`` -> ``https://***@h:8080/d/x.tar?token=***&v=***``;
    ``/lustre/proj/data`` -> unchanged.
    """
    s = os.fspath(location)
    if "://" not in s:
        return s
    m = _URL.match(s)
    if m is None:
        return s
    auth = m.group("auth")
    if "@" in auth:
        auth = MASK + "@" + auth.rsplit("@", 1)[1]
    out = f"{m.group('scheme')}://{auth}{m.group('path')}"
    if m.group("query") is not None:
        out += "?" + _mask_pairs(m.group("query"))
    if m.group("frag") is not None:
        out += "#" + _mask_pairs(m.group("frag"))
    return out


def _escape(m: re.Match[str]) -> str:
    c = ord(m.group(0))
    if 0xDC80 <= c <= 0xDCFF:
        return f"\\x{c - 0xDC00:02x}"  # the byte that was not UTF-8, as such
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def printable(text: str, *, lines: bool = False) -> str:
    """``text`` with every control character escaped as ``\\xNN`` (``\\uNNNN`` for the bidirectional
    controls): ``"a\\x1b[2Jb"`` stays visible as such instead of clearing the screen. ``lines=True``
    keeps newlines and tabs (text that is meant to have several lines); else they are escaped too
    (one value on one line). Idempotent; text without control characters is returned unchanged."""
    return (_CONTROL_BUT_LINES if lines else _CONTROL).sub(_escape, text)


def redact_text(text: str) -> str:
    """``text`` with every URL in it passed through :func:`redact` (free text: messages, logs), and its
    control characters escaped (:func:`printable`, newlines and tabs kept)."""
    text = printable(text, lines=True)
    if "://" not in text:
        return text
    return _URL_IN_TEXT.sub(lambda m: redact(m.group(0)), text)


def location_path(location: str | os.PathLike[str]) -> str:
    """The part of ``location`` a name may be made from: a URL's path (no scheme, host, userinfo, query
    or fragment: ``https://u:pw@h/d/ds?sig=X`` -> ``/d/ds``), a local path unchanged. Names built from
    a location (a mix stream's default name, a spool file) start here, so they never carry a secret."""
    s = os.fspath(location)
    if "://" not in s:
        return s
    m = _URL.match(s)
    return m.group("path") if m is not None else ""


def has_secret(location: str | os.PathLike[str]) -> bool:
    """Whether ``location`` is a URL whose redaction hides something (userinfo, query or fragment)."""
    return redact(location) != os.fspath(location)


__all__ = ["MASK", "has_secret", "location_path", "printable", "redact", "redact_text"]
