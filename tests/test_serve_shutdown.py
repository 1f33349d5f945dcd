"""A `rewind serve` ended in the middle of work (restores, forks, deletions and creations in
flight): by SIGTERM, as systemd and `kill` do, which lets what is in flight finish, or by
SIGKILL, as the OOM killer does. Whatever it was doing, the home is whole after it: no QEMU
runs for a machine that is gone, every machine answers, every point runs, and `rewind rm`
then ends every process the home has."""

from __future__ import annotations

import os
import secrets
import signal
import threading
from pathlib import Path

import httpx2
import pytest
from invariants import assert_home_whole, unrecorded_processes, wait_until
from serving import daemon_pid

from rewind import Home
from rewind.bench.load import processes_naming
from rewind.serve.process import serve_process


def _qemus(home: Home) -> int:
    return sum(Path(f"/proc/{pid}/comm").read_text().startswith("qemu-system")
               for pid in processes_naming(str(home.root)) if Path(f"/proc/{pid}").exists())


def _ended(pid: int) -> bool:
    """Gone, or a zombie its parent (serve_process) has not reaped yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["term", "kill"])
def test_a_daemon_ended_in_the_middle_of_work_leaves_the_home_whole(
        how: signal.Signals, home: Home, tmp_path: Path) -> None:
    token_file = tmp_path / "serve.token"
    token_file.write_text(secrets.token_urlsafe(24))
    answers: list[int | str] = []

    def call(http: httpx2.Client, method: str, path: str, body: dict | None = None) -> None:
        try:
            answers.append(http.request(method, path, json=body).status_code)
        except httpx2.TransportError as e:  # the daemon went away under it: what we test
            answers.append(type(e).__name__)

    with serve_process(home, tmp_path / "serve.log", ["--token-file", str(token_file)]) as url:
        http = httpx2.Client(base_url=url, headers={"Authorization": f"Bearer {token_file.read_text()}"},
                             timeout=httpx2.Timeout(180, connect=5))
        for name in ("a", "b"):
            assert http.post("/machines", json={"name": name}).status_code == 201
        assert http.post("/machines/a/exec", json={"cmd": "echo before > /root/mark"}).status_code == 200
        assert http.post("/machines/a/checkpoints", json={"name": "p"}).status_code == 201
        running = _qemus(home)
        work = [("POST", "/machines/a/restore", {"ref": "p"}), ("POST", "/machines/a/fork", {"count": 2}),
                ("DELETE", "/machines/b", None), ("POST", "/machines", {"name": "c"})]
        clients = [httpx2.Client(base_url=url, headers=http.headers, timeout=http.timeout) for _ in work]
        threads = [threading.Thread(target=call, args=(c, *w)) for c, w in zip(clients, work, strict=True)]
        for t in threads:
            t.start()
        # Ended once the work has started QEMUs of its own: in the middle of it.
        wait_until(lambda: _qemus(home) > running, "a QEMU started by the work in flight", timeout=60)
        server = daemon_pid(http.base_url.port)
        os.kill(server, how)
        for t in threads:
            t.join(timeout=120)
        wait_until(lambda: _ended(server), "the daemon to end")
    for c in (http, *clients):
        c.close()
    assert len(answers) == len(work)
    if how == signal.SIGTERM:  # it finished what it had taken on before ending, and nothing is astray
        assert all(isinstance(a, int) and a < 300 for a in answers), answers
        wait_until(lambda: not unrecorded_processes(home), "no QEMU without its machine")
    # After SIGKILL a machine may be left half made, with its next QEMUs: `rm` ends them.
    assert_home_whole(home, keep=[], probed=set())
    assert not processes_naming(str(home.root))
