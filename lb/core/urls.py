"""What a replica or peer URL may be, and which addresses an admin may point `lb` at.

A URL names a server root: http or https, a host, a port in 1-65535, nothing else. User
information (`http://user:pw@host`) is refused because a URL is shown everywhere (replica ids,
the X-LB-Replica header, metrics labels, logs, `lb check-config`); a replica's credential
goes in its `api_key` field, which is never shown. The deny-list keeps the admin API from
making `lb` a proxy into cloud metadata endpoints (link-local addresses, metadata hostnames).
Pure: the daemon resolves host names and passes the addresses in.
"""
from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit, urlunsplit

# Link-local (cloud metadata lives at 169.254.169.254 and fd00:ec2::254) and metadata names.
DEFAULT_DENY = ("169.254.0.0/16", "fe80::/10", "fd00:ec2::254/128", "metadata.google.internal", "metadata.goog",
                "metadata")


def url_problem(url: str, key: str) -> str | None:
    """Why `url` cannot name a replica or peer (a sentence naming `key` and the fix), or None."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"{key}: {url_for_display(url)!r} is not an http(s) URL; write e.g. \"http://10.0.0.5:30000\""
    if parts.username is not None or parts.password is not None:
        return (f"{key}: credentials in the URL are refused (a URL is shown in replica ids, headers, metrics and "
                f"logs); write the URL without user:password@ and put the token in the replica's `api_key`")
    try:
        port = parts.port
    except ValueError:
        port = -1
    if port is not None and not 1 <= port <= 65535:
        return f"{key}: {url!r} has no valid port; use 1-65535"
    if parts.query or parts.fragment or "?" in url or "#" in url:
        return f"{key}: {url!r} has a query or fragment; give the server root, e.g. \"{parts.scheme}://{parts.netloc}\""
    if parts.path not in ("", "/"):
        return f"{key}: {url!r} has a path; give the server root, e.g. \"{parts.scheme}://{parts.netloc}\""
    return None


def url_for_display(url: str) -> str:
    """`url` with any password replaced by `***` (e.g. a Redis URL in `lb check-config`)."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        host = parts.netloc.rsplit("@", 1)[1]
        user = parts.username or ""
        return urlunsplit((parts.scheme, f"{user}:***@{host}", parts.path, parts.query, parts.fragment))
    except ValueError:
        return url


def parse_deny(entries: tuple[str, ...], key: str) -> tuple[list, set[str]]:
    """The deny-list as (networks, host names); ValueError naming `key` for a bad entry."""
    nets, names = [], set()
    for e in entries:
        if any(c.isdigit() for c in e) and ("/" in e or ":" in e or e.replace(".", "").isdigit()):
            try:
                nets.append(ipaddress.ip_network(e, strict=False))
                continue
            except ValueError:
                raise ValueError(f"{key}: {e!r} is neither an address range (e.g. 169.254.0.0/16) nor a host name")
        names.add(e.lower().rstrip("."))
    return nets, names


def denied(host: str, addresses: list[str], deny: tuple[list, set[str]]) -> str | None:
    """Which deny-list entry `host` (resolved to `addresses`) falls under, or None."""
    nets, names = deny
    name = host.lower().rstrip(".")
    if name in names:
        return name
    for a in [name, *addresses]:
        try:
            ip = ipaddress.ip_address(a.split("%", 1)[0])
        except ValueError:
            continue
        mapped = getattr(ip, "ipv4_mapped", None)
        for net in nets:
            if ip in net or (mapped is not None and mapped in net):
                return str(net)
    return None
