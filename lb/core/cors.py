"""Cross-origin browser access (CORS): which browser pages may call `lb`, decided here.

Off unless `server.cors_allowed_origins` names origins, as vLLM's own server is since it
stopped allowing every origin by default (`--allowed-origins`, "Cross-origin browser access
is disabled by default"): a browser page that called a vLLM or SGLang replica with CORS on
keeps working when `lb` is put in front of it only if `lb` answers the same way. The
answers follow the Fetch standard as Starlette's `CORSMiddleware` (which both engines
use) gives them with its defaults: any request header may be sent (the preflight's
`Access-Control-Request-Headers` is echoed), no credentials, a preflight cached 600 s.

`"*"` allows every origin and answers `*`; otherwise the request's origin is echoed, with
`Vary: Origin` so a cache does not hand one origin's answer to another.
"""
from __future__ import annotations

import re

# methods lb serves on some route (docs/api.md); a preflight for another is refused
METHODS = ("DELETE", "GET", "POST")
MAX_AGE_S = 600
_ORIGIN = re.compile(r"https?://[A-Za-z0-9.-]+(:[0-9]{1,5})?|https?://\[[0-9A-Fa-f:.]+\](:[0-9]{1,5})?")


def origin_problem(origin: object, key: str) -> str | None:
    """Why a configured entry is not an origin (None: it is one, or "*")."""
    if origin == "*":
        return None
    if not isinstance(origin, str) or not _ORIGIN.fullmatch(origin):
        return (f"{key}: {origin!r} is not an origin; write scheme://host[:port] with no path or trailing "
                f"slash (\"https://app.example.com\"), or \"*\" for any origin")
    return None


def allowed(origin: str | None, origins: tuple[str, ...]) -> bool:
    return bool(origin) and ("*" in origins or origin in origins)


def is_preflight(method: str, has_request_method: bool) -> bool:
    """A browser's preflight: OPTIONS carrying Access-Control-Request-Method."""
    return method == "OPTIONS" and has_request_method


def response_headers(origin: str | None, origins: tuple[str, ...], vary: str | None = None) -> dict[str, str]:
    """Headers an answer to a cross-origin request carries (none when the origin is not allowed:
    the browser then keeps the answer from the page); `vary`: the answer's own Vary, kept."""
    if not allowed(origin, origins):
        return {}
    if "*" in origins:
        return {"Access-Control-Allow-Origin": "*"}
    return {"Access-Control-Allow-Origin": origin, "Vary": f"{vary}, Origin" if vary else "Origin"}


def preflight(origin: str | None, method: str | None, request_headers: str | None,
              origins: tuple[str, ...]) -> tuple[dict[str, str], str | None]:
    """A preflight's answer: (headers, None) to allow it, or (vary headers, why not)."""
    vary = {} if "*" in origins else {"Vary": "Origin"}
    if not allowed(origin, origins):
        return vary, f"origin {origin!r} is not in server.cors_allowed_origins"
    if (method or "").upper() not in METHODS:
        return vary, f"method {method!r} is not served by lb; it serves {', '.join(METHODS)}"
    headers = {**response_headers(origin, origins), "Access-Control-Allow-Methods": ", ".join(METHODS),
               "Access-Control-Max-Age": str(MAX_AGE_S)}
    if request_headers:
        headers["Access-Control-Allow-Headers"] = request_headers
    return headers, None
