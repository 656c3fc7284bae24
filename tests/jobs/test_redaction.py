"""The one redaction module (jobs.redaction): secret-looking values in text and in data, at
any depth, in any container, and passwords inside URLs."""

import pytest

from jobs.redaction import MASK, redact, redact_value


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("password=hunter2 next", "password=[REDACTED] next"),
        ('{"api_key": "abc123", "user": "bob"}', '{"api_key": "[REDACTED]", "user": "bob"}'),
        ("Authorization: Bearer eyJhbGci.x.y", "Authorization: [REDACTED]"),
        ("db_token='s3cr3t'", "db_token='[REDACTED]'"),
        ("client_secret: zz; ok", "client_secret: [REDACTED]; ok"),
        ("nothing to hide here", "nothing to hide here"),
        ("args=('a', 'password=hunter2') next", "args=('a', 'password=[REDACTED]') next"),
        ("url?token=abc&x=1", "url?token=[REDACTED]&x=1"),
        ("refreshing the token for bob", "refreshing the token for bob"),
        # a key, a space, no separator
        ("login with password hunter2 now", "login with password [REDACTED] now"),
        ("Authorization Bearer abc.def", "Authorization [REDACTED]"),
        ("the token (for bob)", "the token (for bob)"),
        # containers under a secret key, nested, with quotes and brackets inside
        ("{'password': {'a': 1, 'b': [2, '}']}, 'x': 1}", "{'password': {[REDACTED]}, 'x': 1}"),
        ("secret=('s1', 's2') tail", "secret=([REDACTED]) tail"),
        ("{'api_key': {'k1', 'k2'}}", "{'api_key': {[REDACTED]}}"),
        ('{"token": ["a", ["b"]], "ok": 2}', '{"token": [[REDACTED]], "ok": 2}'),
        ("b'token': b'abc'", "b'token': b'[REDACTED]'"),
        # passwords inside URLs, whatever the key
        ("dsn postgres://u:s3cret@db/x ok", "dsn postgres://u:[REDACTED]@db/x ok"),
        ("amqp://guest:guest@rabbit:5672//", "amqp://guest:[REDACTED]@rabbit:5672//"),
        ("see https://example.com/a:b", "see https://example.com/a:b"),
        ("an unclosed password=[abc", "an unclosed password=[[REDACTED]"),
    ],
)
def test_secret_looking_values_in_text_are_redacted(line, expected):
    assert redact(line) == expected


def test_values_under_secret_keys_are_masked_at_any_depth_in_any_container():
    value = {
        "user": "bob",
        "password": {"nested": "canary-1"},
        "list": [{"api_key": ["canary-2"]}, ("x", {"Authorization": "canary-3"})],
        "set": {"postgres://u:canary-4@db/x"},
        "note": "token=canary-5",
        "deep": {"a": {"b": {"c": {"client_secret": 7}}}},
    }
    shown = redact_value(value)
    assert "canary" not in repr(shown)
    assert shown["user"] == "bob"
    assert shown["password"] == MASK
    assert shown["list"][0] == {"api_key": MASK}
    assert shown["list"][1] == ["x", {"Authorization": MASK}]
    assert shown["set"] == ["postgres://u:[REDACTED]@db/x"]
    assert shown["deep"]["a"]["b"]["c"] == {"client_secret": MASK}
    assert value["password"] == {"nested": "canary-1"}  # a copy: the original is unchanged


def test_a_long_line_without_a_closing_bracket_is_bounded():
    line = "password=[" + "a," * 200_000
    assert redact(line).startswith("password=[[REDACTED]")


@pytest.mark.parametrize(
    "text",
    ["password=hunter2", 'conf {"password": "x", "token": [1, 2]}', "postgres://u:pw@h/x",
     "token: abc123XYZ9", "api_key=(1, 2) and secret hunter2hunter2"],
)  # fmt: skip
def test_redacting_twice_changes_nothing_more(text):
    # A log line passes the process's own handler's filter, then the capture's redaction.
    once = redact(text)
    assert redact(once) == once
