"""Choosing the accelerator by an actual probe.

/dev/kvm existing proves nothing: on some hosts (nested, paravirtual KVM) a
standard kernel hangs under it. So boot the image's own kernel with a tiny
initramfs that prints a marker and powers off; KVM is used only if the marker
appears within a few seconds. The verdict is cached per host; REWIND_ACCEL
overrides it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from rewind.engine.process.qemu import qemu_build
from rewind.errors import InvalidArgument, QemuError
from rewind.image import Image
from rewind.store.durable import replace_durably

log = logging.getLogger("rewind")
PROBE_MARKER = b"REWIND-PROBE-OK"
PROBE_TIMEOUT = 8.0
ACCELS = ("kvm", "tcg")


@dataclass(frozen=True)
class AccelChoice:
    accel: str  # "kvm" or "tcg"
    reason: str
    source: str  # "probe", "cache" or "REWIND_ACCEL"


def _host_key() -> str:
    try:
        qemu = qemu_build().banner
    except QemuError:
        qemu = "?"
    return f"{platform.node()}|{platform.release()}|{qemu}"


def choose_accel(cache_dir: Path, image: Image | None) -> AccelChoice:
    """The accelerator to use; `image` (the default one) provides the probe's kernel."""
    forced = os.environ.get("REWIND_ACCEL")
    if forced:
        if forced not in ACCELS:
            raise InvalidArgument(f"REWIND_ACCEL must be one of {', '.join(ACCELS)}, not {forced!r}")
        return AccelChoice(forced, "set by REWIND_ACCEL", "REWIND_ACCEL")
    cache = cache_dir / "accel.json"
    key = _host_key()
    try:  # a verdict per host and QEMU: a host may run two QEMUs (REWIND_QEMU)
        verdicts = json.loads(cache.read_text())["verdicts"]
        verdicts = verdicts if isinstance(verdicts, dict) else {}
    except (OSError, ValueError, KeyError, TypeError):
        verdicts = {}
    if isinstance(cached := verdicts.get(key), dict):
        with contextlib.suppress(KeyError):
            return AccelChoice(cached["accel"], cached["reason"], "cache")
    if image is None or not image.probe_initrd.is_file():
        log.warning("using TCG: no probe image to test KVM with (run `rewind image build`)")
        return AccelChoice("tcg", "no probe image to test KVM with", "default")
    accel, reason = probe_kvm(image.kernel, image.probe_initrd)
    if accel == "tcg":
        log.warning("using TCG (software emulation, slower): %s", reason)
    cache_dir.mkdir(parents=True, exist_ok=True)
    verdicts[key] = asdict(AccelChoice(accel, reason, "probe"))
    replace_durably(cache, json.dumps({"verdicts": verdicts}).encode())
    return AccelChoice(accel, reason, "probe")


def probe_kvm(kernel: Path, probe_initrd: Path) -> tuple[str, str]:
    """("kvm", why) if a guest really boots under KVM in time, else ("tcg", why)."""
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return "tcg", "/dev/kvm is not available"
    build = qemu_build()
    argv = [build.binary, "-nodefaults", "-no-user-config", "-display", "none", "-machine", "q35",
            "-accel", "kvm", "-cpu", "max", "-m", "128M", "-kernel", str(kernel), "-initrd",
            str(probe_initrd), "-append", "console=ttyS0 quiet panic=-1", "-serial", "stdio",
            "-no-reboot"]
    proc = subprocess.Popen(argv, env=build.environ(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=PROBE_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return "tcg", f"a guest did not boot under KVM within {PROBE_TIMEOUT:.0f} s"
    if PROBE_MARKER in out:
        return "kvm", "a probe guest booted under KVM"
    last = err.decode(errors="replace").strip().splitlines()
    return "tcg", f"KVM failed to boot a guest ({last[-1] if last else f'exit {proc.returncode}'})"
