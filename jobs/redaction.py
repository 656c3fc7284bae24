"""Redaction of secret-looking values (docs/security.md): the one module, used wherever such
a value could surface in what the system stores or shows: run logs, tracebacks, stored
results, and every admin page that shows args, kwargs, a spec, a version or a result.

Two forms: `redact(text)` for text (a log line, a traceback, a repr), `redact_value(value)`
for data (JSON-like values, and tuples and sets), at any depth. The API keeps returning an
owner's own args and kwargs as given: they are the owner's data, this is for everyone else.
"""

from __future__ import annotations

import logging
import re
import traceback

MASK = "[REDACTED]"

# Keys whose values are secrets. Used on dict keys as they are, and inside text.
KEYWORD = re.compile(r"password|passwd|token|secret|api[_-]?key|authorization", re.IGNORECASE)
# A key in text, with its separator: `password=`, `"api_key": `, `Authorization: `, or a
# bare space (`password hunter2`, judged by the value: see _looks_secret). The runs around
# the keyword are bounded, so a long line cannot make the pattern backtrack for long.
_KEY = re.compile(
    r"""(?P<key>(?P<quote>["']?)(?<![\w-])[\w-]{0,40}?"""
    r"""(?:password|passwd|token|secret|api[_-]?key|authorization)[\w-]{0,40}(?P=quote))"""
    r"""(?P<sep>\s{0,8}[:=]\s{0,8}|[ \t]{1,8})""",
    re.IGNORECASE,
)
# A bare value (neither quoted nor bracketed) ends at any of these.
_BARE_END = re.compile(r"""[\s,;&'"()\[\]{}<>]""")
_SCHEME = re.compile(r"(?:bearer|basic|token)\s+", re.IGNORECASE)
# `scheme://user:password@host`: the password, whatever the key around it.
_URL_PASSWORD = re.compile(r"(?P<head>[a-z][a-z0-9+.-]{0,30}://[^\s:/@]{0,200}:)[^\s@/]{1,200}@",
                           re.IGNORECASE)  # fmt: skip
_CLOSERS = {"[": "]", "(": ")", "{": "}"}
# A value that follows its key after a bare space is a secret when it looks like one: it
# has a digit or a symbol, or is long (`token for bob` stays, `password hunter2` goes).
_SECRET_SHAPE = re.compile(r"[\d_+/=.!@#$%^*~-]|\S{16,}")
# Scans stop here: a bracketed value longer than this is redacted to its end of text.
_MAX_VALUE = 100_000


def redact(text: str) -> str:
    """`password=hunter2` -> `password=[REDACTED]`; JSON keys, header forms (`Authorization:
    Bearer ...`), quoted, bytes, bracketed values (dicts, lists, tuples, sets, nested),
    `password hunter2`, and `postgres://u:[REDACTED]@db/x`."""
    if "://" in text:
        text = _URL_PASSWORD.sub(lambda m: f"{m.group('head')}{MASK}@", text)
    if not KEYWORD.search(text):
        return text
    out, done = [], 0
    for match in _KEY.finditer(text):
        start = match.end()
        if start < done:
            continue  # inside a value already redacted
        end, shown = _value_span(text, start, bare_space=not match.group("sep").strip())
        if end is None:
            continue
        out.append(text[done:start])
        out.append(shown)
        done = end
    out.append(text[done:])
    return "".join(out)


def _value_span(text: str, start: int, *, bare_space: bool) -> tuple[int | None, str]:
    """(end of the value that starts at `start`, what to show instead); end None: no value
    to redact there."""
    if start >= len(text):
        return None, ""
    if text.startswith(MASK, start):
        return None, ""  # redacted already: redacting is idempotent
    opener = text[start]
    if bare_space and (opener in _CLOSERS or opener in "\"'"):
        return None, ""  # `the token (for bob)`: prose, not an assignment
    if text.startswith(("b'", 'b"'), start):
        opener, start = text[start : start + 2], start + 1
    if opener[-1] in "\"'":
        quote = opener[-1]
        end = _quoted_end(text, start, quote)
        return end, f"{opener}{MASK}{quote if text[end - 1 : end] == quote else ''}"
    if opener in _CLOSERS:
        end = _bracket_end(text, start)
        closed = text[end - 1 : end] == _CLOSERS[opener]
        return end, f"{opener}{MASK}{_CLOSERS[opener] if closed else ''}"
    scheme = _SCHEME.match(text, start)
    value_start = scheme.end() if scheme else start
    bare = _BARE_END.search(text, value_start)
    end = bare.start() if bare else len(text)
    if end == value_start:
        return None, ""
    if bare_space and not scheme and not _SECRET_SHAPE.search(text, value_start, end):
        return None, ""
    return end, MASK


def _quoted_end(text: str, start: int, quote: str) -> int:
    """The index after the closing quote of the string opening at `start` (or the end)."""
    index = start + 1
    limit = min(len(text), start + _MAX_VALUE)
    while index < limit:
        char = text[index]
        if char == "\\":
            index += 2
            continue
        if char == quote:
            return index + 1
        index += 1
    return len(text)


def _bracket_end(text: str, start: int) -> int:
    """The index after the bracket that closes the one at `start`, skipping quoted strings
    and nested brackets (or the end of the text when it never closes)."""
    depth, index = 0, start
    limit = min(len(text), start + _MAX_VALUE)
    while index < limit:
        char = text[index]
        if char in "\"'":
            index = _quoted_end(text, index, char)
            continue
        if char in _CLOSERS:
            depth += 1
        elif char in ")]}":
            depth -= 1
            if depth == 0:
                return index + 1
        index += 1
    return len(text)


def redact_value(value):
    """A copy of `value` with everything under a secret-looking key masked, at any depth, in
    dicts, lists, tuples and sets (sets and tuples become lists: the result is for JSON),
    and strings redacted as text."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {
            key: MASK if isinstance(key, str) and KEYWORD.search(key) else redact_value(item)
            for key, item in value.items()
        }
    if isinstance(value, list | tuple | set | frozenset):
        return [redact_value(item) for item in value]
    return value


def unmask(value, stored):
    """`value` as edited from a page that showed `stored` through `redact_value`: where the
    editor left a masked value as it was shown, the stored one stays (a secret is kept
    unless it is replaced, as a password field keeps it)."""
    if value == MASK and stored is not None:
        return stored
    if isinstance(value, str) and isinstance(stored, str) and value == redact(stored):
        return stored  # a string shown partly masked (a URL's password), left as it was
    if isinstance(value, dict) and isinstance(stored, dict):
        return {key: unmask(item, stored.get(key)) for key, item in value.items()}
    if isinstance(value, list) and isinstance(stored, list | tuple) and len(value) == len(stored):
        return [unmask(item, old) for item, old in zip(value, stored, strict=True)]
    return value


def redact_change(change: dict) -> dict:
    """A spec diff's entry `{field, from, to}` (`field` a dotted path) as shown to anyone
    but the owner: masked whole under a secret-looking field, its values redacted else."""
    shown = redact_value({change["field"]: [change["from"], change["to"]]})[change["field"]]
    if shown == MASK:
        return {**change, "from": MASK, "to": MASK}
    return {**change, "from": shown[0], "to": shown[1]}


class RedactingFilter(logging.Filter):
    """On a logging handler: the record's message (and traceback) redacted before any
    handler after it formats the record, so a handler's `ctx.logger` line or an error's
    arguments reach a process's own log, or Sentry, with their secrets masked."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format string is logging's to report
            return True
        record.msg, record.args = redact(message), None
        if record.exc_info and not record.exc_text:
            record.exc_text = redact("".join(traceback.format_exception(*record.exc_info)).rstrip())
        return True


def redact_event(event, hint=None):
    """Sentry's before_send and before_breadcrumb: the event with every secret masked."""
    return redact_value(event)
