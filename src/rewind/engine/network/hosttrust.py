"""The host's trust and proxies, given to a machine when asked (`--host-trust`).

On a host behind a TLS-inspecting proxy, every HTTPS request from a guest fails with "self-
signed certificate in certificate chain" until the guest trusts the host's CA certificates
(seen here: pip's first request, until the host's bundle was copied in). A machine asked to
take the host's trust gets the host's CA bundle installed into its trust store and the
host's proxy settings as defaults of every command, with the variables that make Python,
pip, curl and Node.js read that store. Both live in the machine (its files, its record), so
they are kept across restore and fork and by the points it leaves.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from rewind.engine.network.netrules import HOST_ALIAS
from rewind.errors import InvalidArgument

# Where hosts keep their CA bundle, after what the environment names.
BUNDLE_VARIABLES = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")
SYSTEM_BUNDLES = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt",
                  "/etc/ssl/cert.pem")
PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "ALL_PROXY")
GUEST_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
GUEST_ADDED = "/usr/local/share/ca-certificates/rewind-host.crt"
# Each reads the guest's store through one of these (Node.js only adds to its own list).
CERT_VARIABLES = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "PIP_CERT", "NODE_EXTRA_CA_CERTS")
_PEM = re.compile(rb"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", re.DOTALL)
# Installs the host's certificates into the guest's store: through the image's own tool if it
# has one (Debian's update-ca-certificates keeps them when it rebuilds the bundle), else
# appended to the bundle, made if missing.
INSTALL = f"""set -e
if command -v update-ca-certificates >/dev/null 2>&1; then
    update-ca-certificates >/dev/null 2>&1
fi
if ! grep -qF "$(sed -n 2p {GUEST_ADDED})" {GUEST_BUNDLE} 2>/dev/null; then
    mkdir -p "$(dirname {GUEST_BUNDLE})"
    cat {GUEST_ADDED} >> {GUEST_BUNDLE}
fi
"""


@dataclass(frozen=True)
class HostTrust:
    """What a machine takes from this host: CA certificates (PEM) and proxy settings."""

    certificates: bytes
    bundle: str  # where the certificates were read
    proxies: dict[str, str] = field(default_factory=dict)

    @classmethod
    def collect(cls, environ: dict[str, str] | None = None) -> HostTrust:
        env = dict(os.environ if environ is None else environ)
        bundle = _find_bundle(env)
        pems = _PEM.findall(Path(bundle).read_bytes())
        if not pems:
            raise InvalidArgument(f"the host's CA bundle {bundle} holds no PEM certificate")
        proxies = {}
        for name in PROXY_VARIABLES:
            value = env.get(name) or env.get(name.lower())
            if value:
                proxies[name] = value if name == "NO_PROXY" else _guest_proxy(value)
                proxies[name.lower()] = proxies[name]
        return cls(certificates=b"\n".join(pems) + b"\n", bundle=bundle, proxies=proxies)

    def env(self) -> dict[str, str]:
        """Every command's defaults in a machine that took this trust."""
        return {**{name: GUEST_BUNDLE for name in CERT_VARIABLES}, **self.proxies}

    def describe(self) -> str:
        named = sorted(n for n in self.proxies if n.isupper())
        return (f"this host's CA certificates ({self.certificates.count(b'BEGIN CERTIFICATE')} from "
                f"{self.bundle}){' and proxy settings (' + ', '.join(named) + ')' if named else ''}")


def _find_bundle(env: dict[str, str]) -> str:
    for name in BUNDLE_VARIABLES:
        if env.get(name):
            if not Path(env[name]).is_file():
                raise InvalidArgument(f"{name} names {env[name]}, which is not a file")
            return env[name]
    for path in SYSTEM_BUNDLES:
        if Path(path).is_file():
            return path
    raise InvalidArgument("this host has no CA bundle to give (set SSL_CERT_FILE to one)")


def _guest_proxy(url: str) -> str:
    """A proxy on the host's loopback is, from the guest, at the host's alias address (which
    the machine's network rules must then allow: an allow rule covering 127.0.0.1)."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.hostname in ("127.0.0.1", "localhost", "::1"):
        netloc = parts.netloc.replace(parts.hostname, str(HOST_ALIAS), 1).replace("[::1]", str(HOST_ALIAS))
        return urlunsplit(parts._replace(netloc=netloc))
    return url
