"""stager.redact: the one redaction of locations. A URL's userinfo and query/fragment values never
survive it, anything else is untouched, and it is idempotent; every StagerError message goes through it."""

from __future__ import annotations

from hypothesis import assume, given
from hypothesis import strategies as st

from stager.errors import SourceNotFoundError
from stager.redact import MASK, has_secret, printable, redact, redact_text

SECRET = st.text(alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.~%+", min_size=6,
                 max_size=20)


def test_examples() -> None:
    assert redact("https://alice:pw@host:8080/d/x.tar?token=abc&v=1#frag") == \
        "https://***@host:8080/d/x.tar?token=***&v=***#***"
    assert redact("s3://bucket/data/manifest.json") == "s3://bucket/data/manifest.json"
    assert redact("/lustre/proj/a b?c=d@e") == "/lustre/proj/a b?c=d@e"
    assert redact("http://h/x?sig") == "http://h/x?***"
    assert not has_secret("s3://b/k") and has_secret("http://u@h/")
    assert redact_text("stager stage http://u:p@h/d?X-Amz-Signature=zz: failed, see s3://b/k.") == \
        "stager stage http://***@h/d?X-Amz-Signature=***: failed, see s3://b/k."


@given(user=SECRET, password=SECRET, token=SECRET, path=st.sampled_from(["/", "/d/manifest.json", "/a/b.tar"]),
       scheme=st.sampled_from(["http", "https", "s3", "gs", "az"]))
def test_secrets_never_survive(user: str, password: str, token: str, path: str, scheme: str) -> None:
    url = f"{scheme}://{user}:{password}@host.example{path}?token={token}&X-Amz-Credential={token}"
    # A generated secret that is part of what stays (e.g. "manife" of manifest.json) is no leak.
    kept = (f"{scheme}://{MASK}@host.example{path}?token={MASK}&X-Amz-Credential={MASK}"
            ': no such object gone {"source": ""}')
    assume(password not in kept and token not in kept and f"{user}:" not in kept)
    for out in (redact(url), redact_text(f"{url}: no such object"), str(SourceNotFoundError(f"{url}: gone")),
                redact_text(f'{{"source": "{url}"}}')):
        assert password not in out and token not in out and f"{user}:" not in out, out
        assert f"host.example{path}" in out and MASK in out
    assert redact(redact(url)) == redact(url)


@given(st.text(max_size=60).filter(lambda s: "://" not in s))
def test_everything_else_is_untouched(text: str) -> None:
    """redact() never alters a path; redact_text() alters it only to escape control characters."""
    assert redact(text) == text
    assert redact_text(text) == printable(text, lines=True)
    if not any((ord(c) < 32 and c not in "\n\t") or 0x7F <= ord(c) <= 0x9F or 0x202A <= ord(c) <= 0x202E
               or 0x2066 <= ord(c) <= 0x2069 for c in text):
        assert redact_text(text) == text


@given(st.text(max_size=60))
def test_printed_text_never_carries_control_characters(text: str) -> None:
    """Issue 39: a name someone else wrote (a lease's text, a dataset path) reached the admin's terminal
    with its escape sequences. printable() escapes every control character (newlines too, unless the
    text is meant to have lines), is idempotent, and so is every StagerError message."""
    for out in (printable(text), redact_text(text), str(SourceNotFoundError(text))):
        assert not any((ord(c) < 32 and c not in "\n\t") or 0x7F <= ord(c) <= 0x9F for c in out), out
        assert "\x1b" not in out and "\u202e" not in out
    assert "\n" not in printable(text) and printable(printable(text)) == printable(text)
    assert printable("a\x1b[2Jb\u202ec") == "a\\x1b[2Jb\\u202ec"
