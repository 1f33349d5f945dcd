"""The host's trust in a machine (`host_trust=True`): the host's CA certificates in the guest's
store and its proxies as command defaults, so that on a host behind a TLS-inspecting proxy
(this one) an agent's first `pip install` and `npm install` work; also in an image of the
user's own, and across restore."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest
from images import make_busybox_archive

from rewind import Home, InvalidArgument, Sandbox
from rewind.engine.engine import Engine
from rewind.engine.network.hosttrust import GUEST_BUNDLE, HostTrust
from rewind.image.custom import build_from_image, remove_image


def first_host_certificate() -> str:
    """A line from the middle of the host's last CA certificate (a company's own CA is
    usually added last), to look for in the guest."""
    pem = HostTrust.collect().certificates.decode().strip().split("-----BEGIN CERTIFICATE-----")[-1]
    return pem.splitlines()[3]


@pytest.mark.slow  # over 30 s here
def test_pip_and_npm_install_from_their_registries_with_the_hosts_trust(home: Home) -> None:
    with Sandbox.create(home=home, host_trust=True) as sbx:
        env = sbx.exec("echo $SSL_CERT_FILE $NODE_EXTRA_CA_CERTS").stdout.split()
        assert env == [GUEST_BUNDLE, GUEST_BUNDLE]
        assert sbx.exec(["grep", "-qF", first_host_certificate(), GUEST_BUNDLE]).ok
        # Both at once (two vCPUs): each takes a minute or more under emulation.
        pip = ("python3 -m venv /root/venv && /root/venv/bin/pip install -q six "
               "&& /root/venv/bin/python -c 'import six; print(\"six\", six.__version__)'")
        npm = ("mkdir -p /root/app && cd /root/app && npm install --no-audit --no-fund left-pad "
               "&& node -e 'console.log(\"padded\", require(\"left-pad\")(\"x\", 3))'")
        both = sbx.exec(f"({pip}) > /tmp/pip.log 2>&1 & a=$!; ({npm}) > /tmp/npm.log 2>&1 & b=$!; "
                        "wait $a; p=$?; wait $b; n=$?; cat /tmp/pip.log /tmp/npm.log; echo \"pip=$p npm=$n\"",
                        timeout=900)
        assert both.stdout.endswith("pip=0 npm=0\n"), both.stdout[-3000:]
        assert "\nsix 1." in f"\n{both.stdout}" and "padded   x" in both.stdout


def test_an_image_of_ones_own_takes_the_trust_and_keeps_it_across_restore(home: Home,
                                                                         tmp_path: Path) -> None:
    name = f"bb-trust-{secrets.token_hex(3)}"
    build_from_image(home.images, name, make_busybox_archive(tmp_path / "bb.tar", "oci"))
    try:
        with Sandbox.create(image=name, home=home, host_trust=True) as sbx:
            line = first_host_certificate()
            assert sbx.exec(["grep", "-qF", line, GUEST_BUNDLE]).ok  # no update-ca-certificates: appended
            point = sbx.checkpoint()
            sbx.exec(f"rm {GUEST_BUNDLE}", check=True)
            sbx.restore(point.id)
            assert sbx.exec(["grep", "-qF", line, GUEST_BUNDLE]).ok
            assert sbx.exec("echo $REQUESTS_CA_BUNDLE").stdout.strip() == GUEST_BUNDLE
    finally:
        Engine(home).settle()
        remove_image(home.images, name, [])


def test_host_trust_needs_a_bundle_and_says_which_proxy_it_takes(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="not a file"):
        HostTrust.collect({"SSL_CERT_FILE": str(tmp_path / "missing.pem")})
    empty = tmp_path / "empty.pem"
    empty.write_text("no certificates here\n")
    with pytest.raises(InvalidArgument, match="no PEM certificate"):
        HostTrust.collect({"SSL_CERT_FILE": str(empty)})
    trust = HostTrust.collect({"https_proxy": "http://127.0.0.1:3128", "NO_PROXY": "localhost"})
    # A proxy on the host's loopback is the host's alias address from the guest.
    assert trust.proxies["HTTPS_PROXY"] == trust.proxies["https_proxy"] == "http://10.0.2.2:3128"
    assert trust.proxies["NO_PROXY"] == "localhost"
    assert "HTTPS_PROXY" in trust.describe() and trust.env()["SSL_CERT_FILE"] == GUEST_BUNDLE
