"""TLS: the listener's HTTPS (with optional client certificates) and the client side of
connections to replicas and peer LBs (a CA bundle, an optional client certificate).

Only the standard library's `ssl`: no dependency. Errors are `ValueError`s that name the key
and the fix; config.py turns them into `ConfigError`s when it checks a file, and a SIGHUP that
cannot load a new certificate keeps the running one.
"""
from __future__ import annotations

import ssl


def _load_chain(ctx: ssl.SSLContext, cert: str, key: str, where: str) -> None:
    try:
        ctx.load_cert_chain(cert, key or None)
    except FileNotFoundError as e:
        raise ValueError(f"{where}: {e.filename or cert} does not exist; give a readable PEM file") from None
    except (ssl.SSLError, OSError) as e:
        raise ValueError(f"{where}: cannot load {cert} with key {key or cert}: {e}; give a PEM certificate "
                         "(chain) and its matching private key") from None


def _load_ca(ctx: ssl.SSLContext, ca_file: str, where: str) -> None:
    try:
        ctx.load_verify_locations(cafile=ca_file)
    except FileNotFoundError:
        raise ValueError(f"{where}: {ca_file} does not exist; give a PEM CA bundle") from None
    except (ssl.SSLError, OSError) as e:
        raise ValueError(f"{where}: cannot load CA bundle {ca_file}: {e}; give PEM certificates") from None


def server_context(cert: str, key: str, client_ca: str = "", section: str = "server") -> ssl.SSLContext | None:
    """The listener's context, or None when `tls_cert` is empty (plain HTTP). With
    `tls_client_ca` a client must present a certificate that CA signed (mTLS: peer LBs)."""
    if not cert:
        if key or client_ca:
            raise ValueError(f"{section}.tls_key/tls_client_ca: set without {section}.tls_cert; "
                             f"give {section}.tls_cert too, or remove them")
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    reload_server(ctx, cert, key, client_ca, section)
    return ctx


def reload_server(ctx: ssl.SSLContext, cert: str, key: str, client_ca: str = "", section: str = "server") -> None:
    """Load (again) into the live context: connections accepted from now on use the new
    certificate, open ones keep theirs (each handshake reads the context's current chain)."""
    _load_chain(ctx, cert, key, f"{section}.tls_cert/tls_key")
    if client_ca:
        _load_ca(ctx, client_ca, f"{section}.tls_client_ca")
        ctx.verify_mode = ssl.CERT_REQUIRED
    else:
        ctx.verify_mode = ssl.CERT_NONE


def client_context(ca_file: str, cert: str, key: str, section: str) -> ssl.SSLContext | bool:
    """What aiohttp's connector takes as `ssl=`: True (system CAs, verified) when nothing is
    set, else a context that trusts `tls_ca_file` and presents `tls_client_cert`."""
    if not (ca_file or cert or key):
        return True
    if key and not cert:
        raise ValueError(f"{section}.tls_client_key: set without {section}.tls_client_cert; give both or neither")
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    if ca_file:
        _load_ca(ctx, ca_file, f"{section}.tls_ca_file")
    if cert:
        _load_chain(ctx, cert, key, f"{section}.tls_client_cert/tls_client_key")
    return ctx


def upstream_ssl(cfg) -> ssl.SSLContext | bool:
    """For connections to replicas (requests and probes): `[upstream] tls_*`."""
    u = cfg.upstream
    return client_context(u.tls_ca_file, u.tls_client_cert, u.tls_client_key, "upstream")


def peer_ssl(cfg) -> ssl.SSLContext | bool:
    """For connections to peer LBs (status probes and forwards): `[peering] tls_*`."""
    p = cfg.peering
    return client_context(p.tls_ca_file, p.tls_client_cert, p.tls_client_key, "peering")
