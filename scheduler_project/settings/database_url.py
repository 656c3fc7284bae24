"""DATABASE_URL as Django's DATABASES entry, including libpq's multi-host form.

`postgresql://user@host1:5432,host2:5432/db?target_session_attrs=read-write` is how libpq
and every high-availability guide name a primary and its standbys: libpq tries the hosts in
turn and keeps the first that accepts writes, so after a failover a new connection finds
the new primary by itself. dj_database_url refuses a netloc with several hosts, so the
hosts are taken out here and given to Django as libpq's comma-separated lists (HOST
"host1,host2", PORT "5432,5432"), which psycopg passes on unchanged; everything else (user,
password, name, query options) is dj_database_url's. Reads nothing from the environment.
"""

from __future__ import annotations

from urllib.parse import unquote, urlsplit, urlunsplit

import dj_database_url

DEFAULT_PORT = 5432


def database_hosts_split(netloc_hosts: str) -> list[tuple[str, int | None]]:
    """The (host, port) pairs of a netloc's host part, `h1:p1,h2,[::1]:p3`; a missing port
    is None. Raises ValueError for a port that is not a number."""
    pairs: list[tuple[str, int | None]] = []
    for item in netloc_hosts.split(","):
        if item.startswith("["):  # an IPv6 address, [::1] or [::1]:5432
            host, _, rest = item[1:].partition("]")
            port_text = rest.removeprefix(":")
        else:
            host, _, port_text = item.partition(":")
        if port_text and not port_text.isdigit():
            raise ValueError(f"DATABASE_URL: port {port_text!r} of host {host!r} is not a number")
        pairs.append((unquote(host), int(port_text) if port_text else None))
    return pairs


def database_url_hosts(url: str) -> list[tuple[str, int]]:
    """Every (host, port) the URL names, in order, the default port filled in; a Unix
    socket's folder is a host too (as PostgreSQL names it). An empty host is 127.0.0.1."""
    netloc = urlsplit(url).netloc
    hosts = netloc.rsplit("@", 1)[-1]
    return [
        (host or "127.0.0.1", port or DEFAULT_PORT) for host, port in database_hosts_split(hosts)
    ]


def database_url_parse(url: str, **kwargs) -> dict:
    """Django's DATABASES entry for `url` (dj_database_url.parse's, with its `kwargs`),
    where the netloc may name several hosts."""
    parts = urlsplit(url)
    userinfo, at, hosts = parts.netloc.rpartition("@")
    if "," not in hosts:
        return dj_database_url.parse(url, **kwargs)
    pairs = database_hosts_split(hosts)
    single = urlunsplit(parts._replace(netloc=f"{userinfo}{at}{hosts.split(',')[0]}"))
    config = dj_database_url.parse(single, **kwargs)
    config["HOST"] = ",".join(host for host, _ in pairs)
    config["PORT"] = ",".join(str(port or DEFAULT_PORT) for _, port in pairs)
    return config
