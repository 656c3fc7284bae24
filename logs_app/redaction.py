"""Redaction of secret-looking values (SPEC, "Security"): one module, used wherever such a
value could surface in text the system stores or shows (run logs, tracebacks)."""

from __future__ import annotations

import re

# Keys whose values are redacted before anything is stored (SPEC, "Security"). The runs
# around the keyword are bounded, so a long line cannot make the pattern backtrack for long.
KEYWORD = re.compile(r"password|passwd|token|secret|api[_-]?key|authorization", re.IGNORECASE)
SECRET = re.compile(
    r"""(?P<key>["']?(?<![\w-])[\w-]{0,40}?(?:password|passwd|token|secret|api[_-]?key|authorization)[\w-]{0,40}["']?)"""
    r"""(?P<sep>\s{0,8}[:=]\s{0,8})"""
    r"""(?P<value>b?"(?:[^"\\]|\\.)*"?|b?'(?:[^'\\]|\\.)*'?|\[[^\]]*\]?"""
    r"""|(?:bearer|basic|token)\s+\S+|[^\s,;&'"()\[\]{}<>]+)""",
    re.IGNORECASE,
)


def redact(text: str) -> str:
    """`password=hunter2` -> `password=[REDACTED]`; also JSON keys, header forms, bytes and
    list values."""
    if not KEYWORD.search(text):
        return text

    def hide(match: re.Match) -> str:
        value = match.group("value")
        opener = value[:2] if value[:2] in ('b"', "b'") else value[:1]
        if opener not in ('"', "'", 'b"', "b'", "["):
            opener = ""
        closer = {"[": "]"}.get(opener, opener[-1:]) if opener else ""
        return f"{match.group('key')}{match.group('sep')}{opener}[REDACTED]{closer}"

    return SECRET.sub(hide, text)
