"""Which cache, how big, and whom to trust: the command line, the environment and the site configuration.

* ``stager stage --cache DIR`` (else ``$STAGER_CACHE``) names the cache a stage fills and links from.
* The quota (``--cache-quota``, else ``$STAGER_CACHE_QUOTA``, else the one recorded in the cache's
  marker, else :data:`DEFAULT_QUOTA`) is bytes (``200G``, ``500GB``) or a fraction of the cache's file
  system (``0.5``, ``50%``): :class:`Quota`.
* The site configuration is the prolog service's file (``/etc/stager/prolog.conf``, or
  ``$STAGER_PROLOG_CONF``; shell ``KEY=VALUE`` lines, tools/slurm/stager-prolog): ``STAGER_CACHE_DIR``
  (the site-wide cache), ``STAGER_CACHE_USER`` (the service account that alone writes it),
  ``STAGER_CACHE_QUOTA`` and ``STAGER_CACHE_LEASE_DAYS`` (the longest a lease of a user other than the
  cache's owner keeps objects: :data:`DEFAULT_DEST_LEASE_DAYS`; give it the site's longest job). It is
  read only when root or the caller owns it and nobody else may write it: otherwise it is ignored
  (and said so), since it decides whose files a reader trusts.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from stager.errors import UnsafePathError, UsageError

CACHE_ENV = "STAGER_CACHE"
QUOTA_ENV = "STAGER_CACHE_QUOTA"
SITE_CONF_ENV = "STAGER_PROLOG_CONF"
SITE_CONF = "/etc/stager/prolog.conf"
DEFAULT_QUOTA = "50%"  # of the cache's file system: leaves room for the jobs' own scratch
DEFAULT_DEST_LEASE_DAYS = 7.0  # a destination lease expires after this; and any lease of another user's
MAX_LEASE_DAYS = 366.0  # what STAGER_CACHE_LEASE_DAYS may say at most

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}
_SI = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15}


@dataclass(frozen=True)
class Quota:
    """At most ``bytes`` of objects, or ``fraction`` of the file system's size (exactly one is set);
    ``text`` is how it was given."""

    text: str
    bytes: int | None = None
    fraction: float | None = None

    @classmethod
    def parse(cls, text: str, where: str = "--cache-quota") -> Quota:
        """``"200G"`` (1024-based, as ``stager pack``'s sizes; ``200GB`` is 1000-based), ``"0.5"`` or
        ``"50%"`` (of the disk). A bad value is a one-line :class:`UsageError` naming ``where``."""
        t = text.strip()
        m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*%", t)
        if m:
            frac = float(m.group(1)) / 100
        elif re.fullmatch(r"0?\.\d+|1(\.0*)?", t):
            frac = float(t)
        else:
            m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmgtpKMGTP]?)(i?)([bB]?)", t)
            if not m:
                raise UsageError(f"{where}: invalid quota {text!r}: expected bytes (200G, 500GB) or a fraction of "
                                 "the disk (0.5 or 50%)")
            num, unit, iec, b = m.groups()
            unit = unit.lower()
            n = int(float(num) * (_SI[unit] if unit and b and not iec else _UNITS[unit]))
            if n < 1:
                raise UsageError(f"{where}: invalid quota {text!r}: must be at least 1 byte")
            return cls(t, bytes=n)
        if not 0 < frac <= 1:
            raise UsageError(f"{where}: invalid quota {text!r}: a fraction of the disk must be in (0, 1]")
        return cls(t, fraction=frac)

    def resolve(self, disk_bytes: int, where: str, fix: str = "give at most the disk's size or a fraction (0.5)"
                ) -> int:
        """The quota in bytes on a file system of ``disk_bytes``; bytes beyond the disk's size are a
        one-line :class:`UsageError` ending in ``fix`` (a quota the disk cannot hold would never evict)."""
        if self.fraction is not None:
            return int(self.fraction * disk_bytes)
        assert self.bytes is not None
        if self.bytes > disk_bytes:
            raise UsageError(f"{where}: quota {self.text} ({self.bytes / 1e9:.2f} GB) is larger than its disk "
                             f"({disk_bytes / 1e9:.2f} GB); {fix}")
        return self.bytes

    def check_fits(self, path: str | os.PathLike[str], where: str) -> None:
        """Refuse (:meth:`resolve`'s :class:`UsageError`) a quota larger than the disk that holds, or will
        hold, ``path`` (its nearest existing directory): called before anything is created or recorded,
        so a refused quota is never written to a cache's marker."""
        resolve_on = os.path.abspath(os.fspath(path))
        while not os.path.isdir(resolve_on) and os.path.dirname(resolve_on) != resolve_on:
            resolve_on = os.path.dirname(resolve_on)
        self.resolve(disk_size(resolve_on), where)


def disk_size(path: str | os.PathLike[str]) -> int:
    """Bytes of the file system holding ``path`` (``f_blocks * f_frsize``: what a fraction quota is of)."""
    sv = os.statvfs(path)
    return sv.f_blocks * sv.f_frsize


@dataclass(frozen=True)
class CacheOptions:
    """What ``stager stage`` was asked about the cache: ``dir``; ``quota`` (None: the cache's own or
    the default); ``only``: fill the cache without a destination (``--cache-only``, the prolog's
    service account); ``verify``: re-hash every object found before it is linked (``--verify-cache``;
    else only those whose seal no longer matches, :mod:`stager.cache.seal`)."""

    dir: str
    quota: Quota | None = None
    only: bool = False
    verify: bool = False


@dataclass(frozen=True)
class SiteConfig:
    """The site's cache settings (see the module docstring); ``warnings`` say why a file was ignored."""

    cache_dir: str | None = None
    service_uid: int | None = None
    quota: Quota | None = None
    path: str = ""
    warnings: list[str] = field(default_factory=list)
    lease_days: float = DEFAULT_DEST_LEASE_DAYS

    @property
    def trusted_owners(self) -> frozenset[int]:
        """Owners whose site cache a reader may trust besides itself: root and the service account."""
        return frozenset({0} | ({self.service_uid} if self.service_uid is not None else set()))


def _shell_value(raw: str) -> str:
    v = raw.strip()
    if len(v) >= 2 and v[0] == v[-1] and v[0] in "'\"":
        return v[1:-1]
    return v.split("#", 1)[0].strip()


def _uid_of(name: str) -> int | None:
    import pwd  # noqa: PLC0415 (only when a configuration names the service account)

    if name.isdigit():
        return int(name)
    try:
        return pwd.getpwnam(name).pw_uid
    except KeyError:
        return None


def site_config(env: dict[str, str] | None = None) -> SiteConfig:
    """Read the site configuration (``$STAGER_PROLOG_CONF`` or :data:`SITE_CONF`); an absent file is an
    empty configuration, an untrustworthy one is ignored with a warning."""
    env = dict(os.environ) if env is None else env
    path = env.get(SITE_CONF_ENV) or SITE_CONF
    # Imported here: every `stager stage` imports these options, only --cache and the loader read the site's.
    from stager.fs.safe import read_trusted  # noqa: PLC0415

    try:
        data = read_trusted(path, what="site configuration", limit=1 << 20)  # root's or yours, nobody else's
    except UnsafePathError as exc:
        return SiteConfig(path=path, warnings=[f"ignored: {exc}"])
    except OSError:
        data = None
    if data is None:
        return SiteConfig(path=path)
    text = data.decode(errors="replace")
    values: dict[str, str] = {}
    for line in text.splitlines():
        m = re.match(r"\s*(?:export\s+)?([A-Z_][A-Z0-9_]*)=(.*)$", line)
        if m:
            values[m.group(1)] = _shell_value(m.group(2))
    warnings = []
    uid = None
    if values.get("STAGER_CACHE_USER"):
        uid = _uid_of(values["STAGER_CACHE_USER"])
        if uid is None:
            warnings.append(f"{path}: STAGER_CACHE_USER={values['STAGER_CACHE_USER']}: no such user")
    quota = None
    if values.get("STAGER_CACHE_QUOTA"):
        # A typo here is the site's, not the user's: every stage and loader on the node reads this file,
        # so it is a warning and the default quota, never a failure of theirs (as STAGER_CACHE_LEASE_DAYS).
        try:
            quota = Quota.parse(values["STAGER_CACHE_QUOTA"], f"{path}: STAGER_CACHE_QUOTA")
        except UsageError as exc:
            warnings.append(f"{exc}; using the cache's own or {DEFAULT_QUOTA}")
    lease_days = DEFAULT_DEST_LEASE_DAYS
    given = values.get("STAGER_CACHE_LEASE_DAYS")
    if given:
        try:
            lease_days = float(given)
        except ValueError:
            lease_days = -1.0
        if not 0 < lease_days <= MAX_LEASE_DAYS:
            warnings.append(f"{path}: STAGER_CACHE_LEASE_DAYS={given}: expected days in (0, {MAX_LEASE_DAYS:g}]; "
                            f"using {DEFAULT_DEST_LEASE_DAYS:g}")
            lease_days = DEFAULT_DEST_LEASE_DAYS
    return SiteConfig(cache_dir=values.get("STAGER_CACHE_DIR") or None, service_uid=uid, quota=quota, path=path,
                      warnings=warnings, lease_days=lease_days)


def cache_from_env(env: dict[str, str] | None = None) -> str | None:
    """``$STAGER_CACHE`` (the user's default cache for ``stager stage``), or None."""
    env = dict(os.environ) if env is None else env
    return env.get(CACHE_ENV) or None


def quota_from_env(env: dict[str, str] | None = None) -> Quota | None:
    env = dict(os.environ) if env is None else env
    text = env.get(QUOTA_ENV)
    return Quota.parse(text, f"${QUOTA_ENV}") if text else None


def reader_caches(env: dict[str, str] | None = None) -> list[Path]:
    """Caches the loader looks in for a dataset that no receipt names: ``$STAGER_CACHE`` (``:``-separated)
    and the site cache."""
    env = dict(os.environ) if env is None else env
    out = [Path(p) for p in (env.get(CACHE_ENV) or "").split(":") if p]
    site = site_config(env).cache_dir
    if site:
        out.append(Path(site))
    seen: set[Path] = set()
    return [p for p in out if not (p in seen or seen.add(p))]  # type: ignore[func-returns-value]
