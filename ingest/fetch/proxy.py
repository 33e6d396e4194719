"""The HTTP proxy a data connection goes through: ``HTTPS_PROXY``, ``HTTP_PROXY``, ``NO_PROXY``.

Behind a site's egress proxy every connection to S3 must go through it, not
only the aiobotocore client's (botocore reads the same variables). The data
path's own connections (``threaded_http.py``) ask here: an ``https`` endpoint
is reached through a ``CONNECT`` tunnel (TLS end to end, the proxy sees only
the host name), an ``http`` one by sending the absolute URL to the proxy, as
curl and botocore do. ``NO_PROXY`` is read as the standard library reads it
(host names, domain suffixes, ``host:port``, ``*``). Credentials in the proxy
URL (``http://user:pass@proxy:3128``) go as ``Proxy-Authorization: Basic``.
The proxy itself is spoken to in plain HTTP, as most egress proxies listen.
"""

from __future__ import annotations

import base64
import os
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

from ingest.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Proxy:
    """A proxy to send one endpoint's requests through."""

    host: str
    port: int
    authorization: str | None = field(default=None, repr=False)

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def headers(self) -> dict[str, str]:
        """What the proxy wants on the request (or the ``CONNECT``): its credentials."""
        return {"Proxy-Authorization": self.authorization} if self.authorization else {}


def _variable(environ: Mapping[str, str], name: str) -> str:
    return (environ.get(name.lower()) or environ.get(name.upper()) or "").strip()


def proxy_for(scheme: str, netloc: str, environ: Mapping[str, str] | None = None) -> Proxy | None:
    """The proxy for ``scheme://netloc`` per the environment, or None (connect directly).

    Raises:
        ConfigError: the proxy variable is not a URL with a host.
    """
    env = os.environ if environ is None else environ
    url = _variable(env, f"{scheme}_proxy")
    if not url:
        return None
    no_proxy = _variable(env, "no_proxy")
    bypass = urllib.request.proxy_bypass_environment  # type: ignore[attr-defined]
    if no_proxy and bypass(netloc, {"no": no_proxy}):
        return None
    if "://" not in url:
        url = f"http://{url}"
    parts = urlsplit(url)
    try:
        port = parts.port or 80
    except ValueError as exc:
        raise ConfigError(f"{scheme.upper()}_PROXY: {exc}") from None
    if not parts.hostname:
        raise ConfigError(f"{scheme.upper()}_PROXY: expected http://host:port, got no host")
    authorization = None
    if parts.username is not None:
        pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
        authorization = "Basic " + base64.b64encode(pair.encode()).decode()
    return Proxy(parts.hostname, port, authorization)
