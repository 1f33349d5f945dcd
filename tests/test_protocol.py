"""The agent protocol's framing, without a guest: round trips and resynchronisation."""

from __future__ import annotations

import contextlib
import io
import socket
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import rewind.engine.agent as agent_module
from rewind.engine.agent import AgentClient
from rewind.errors import AgentError, AgentGone, GuestFileError
from rewind.guest.protocol import _PREFIX, MAGIC, Decoder, encode

headers = st.dictionaries(st.text(max_size=8), st.one_of(st.integers(), st.text(max_size=20)), max_size=4)
frames = st.lists(st.tuples(headers, st.binary(max_size=3000)), min_size=1, max_size=8)


@given(frames, st.integers(min_value=1, max_value=500))
def test_frames_survive_any_split(items, step) -> None:
    wire = b"".join(encode(h, p) for h, p in items)
    dec = Decoder()
    out = []
    for at in range(0, len(wire), step):
        dec.feed(wire[at : at + step])
        while (f := dec.next()) is not None:
            out.append(f)
    assert out == items


@given(st.binary(max_size=2000), frames)
def test_decoder_resynchronises_after_garbage(garbage, items) -> None:
    """A reader that starts mid-stream (its peer died mid-frame) finds the next whole frame."""
    dec = Decoder()
    dec.feed(garbage.replace(MAGIC, b"") + b"".join(encode(h, p) for h, p in items))
    out = []
    while (f := dec.next()) is not None:
        out.append(f)
    assert out[-len(items):] == items


def test_truncated_frame_waits_for_the_rest() -> None:
    wire = encode({"t": "data"}, b"x" * 100)
    dec = Decoder()
    dec.feed(wire[:-1])
    assert dec.next() is None
    dec.feed(wire[-1:])
    assert dec.next() == ({"t": "data"}, b"x" * 100)


# ---- the host client's heartbeats, against a scripted agent on a unix socket ----


class ScriptedAgent:
    """Answers hello, then runs `script(conn, request)` on the first request."""

    def __init__(self, path: Path, script) -> None:
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(path))
        self.server.listen(1)
        self.thread = threading.Thread(target=self._serve, args=(script,), daemon=True)
        self.thread.start()

    def _serve(self, script) -> None:
        conn, _ = self.server.accept()
        with conn:
            for header in frames_of(conn):
                if header["t"] == "hello":
                    conn.sendall(encode({"t": "hello", "nonce": header["nonce"]}))
                else:
                    script(conn, header, frames_of(conn))
                    return

    def close(self) -> None:
        self.thread.join(timeout=5)
        self.server.close()


def frames_of(conn: socket.socket):
    dec = Decoder()
    while True:
        while (frame := dec.next()) is not None:
            yield frame[0]
        data = conn.recv(65536)
        if not data:
            return
        dec.feed(data)


def exit_frame() -> bytes:
    return encode({"t": "exit", "code": 0, "timed_out": False, "truncated": [False, False]})


def test_a_late_pong_from_an_earlier_request_is_not_taken_for_a_restart(tmp_path: Path) -> None:
    """The agent answers a heartbeat of the previous request after that request ended:
    the idle pong reaches the next request, which must not think the agent restarted."""
    def script(conn, _request, _rest) -> None:
        conn.sendall(encode({"t": "pong", "id": "earlier", "busy": False}) + exit_frame())

    agent = ScriptedAgent(tmp_path / "a.sock", script)
    with AgentClient(tmp_path / "a.sock") as client:
        assert client.exec(["true"]).exit_code == 0
    agent.close()


def test_an_idle_answer_to_this_requests_heartbeat_means_a_restart(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(agent_module, "HEARTBEAT_AFTER", 0.1)

    def script(conn, _request, rest) -> None:
        ping = next(rest)  # silent until the client pings, then answer as a fresh agent would
        assert ping["t"] == "ping"
        conn.sendall(encode({"t": "pong", "id": ping["id"], "busy": False}))

    agent = ScriptedAgent(tmp_path / "a.sock", script)
    with AgentClient(tmp_path / "a.sock") as client, pytest.raises(AgentGone, match="restarted"):
        client.exec(["sleep", "9"])
    agent.close()


def test_a_write_waits_for_a_guest_slow_to_read(tmp_path: Path, monkeypatch) -> None:
    """A guest that stops reading for longer than the client's receive timeout (a busy host)
    slows a write down; it does not fail it (a 100 MB write failed after 2 s under load)."""
    monkeypatch.setattr(agent_module, "HEARTBEAT_AFTER", 0.2)
    got = []

    def script(conn, _request, rest) -> None:
        conn.sendall(encode({"t": "ready"}))
        time.sleep(1.0)  # the client's send buffer fills while nothing is read
        for frame in rest:
            got.append(frame["t"])
            if frame["t"] == "end":
                conn.sendall(encode({"t": "ok"}))
                return

    agent = ScriptedAgent(tmp_path / "a.sock", script)
    with AgentClient(tmp_path / "a.sock") as client:
        client.write_file("/root/big", io.BytesIO(bytes(16 << 20)))
    agent.close()
    assert got[-1] == "end" and got.count("data") > 1


def test_a_deeply_nested_header_is_skipped_like_garbage() -> None:
    nested = b"[" * 5000 + b"]" * 5000
    frame = _PREFIX.pack(MAGIC, len(nested), 0) + nested
    dec = Decoder()
    dec.feed(frame + encode({"t": "after"}))
    assert dec.next() == ({"t": "after"}, b"")


@pytest.mark.parametrize("exit_header", [{"t": "exit", "code": "7"}, {"t": "exit", "code": True},
                                         {"t": "exit"}, {"t": "exit", "code": 0, "truncated": 5}])
def test_a_malformed_exit_from_the_guest_is_an_agent_error(tmp_path: Path, exit_header: dict) -> None:
    def script(conn, _request, _rest) -> None:
        conn.sendall(encode(exit_header))

    agent = ScriptedAgent(tmp_path / "a.sock", script)
    with AgentClient(tmp_path / "a.sock") as client, pytest.raises(AgentError, match="malformed exit"):
        client.exec(["true"])
    agent.close()


# ---- what the host keeps of a guest that does not keep to the protocol's bounds ----


def test_output_past_max_output_is_cut_on_the_host(tmp_path: Path) -> None:
    """An agent that ignores max_output: the host keeps that much of each stream and says so."""
    def script(conn, request, _rest) -> None:
        assert request["max_output"] == 1000
        for _ in range(5):
            conn.sendall(encode({"t": "out", "fd": 1}, b"x" * 700) + encode({"t": "out", "fd": 2}, b"e" * 10))
        conn.sendall(exit_frame())

    agent = ScriptedAgent(tmp_path / "a.sock", script)
    with AgentClient(tmp_path / "a.sock") as client:
        result = client.exec(["yes"], max_output=1000)
    agent.close()
    assert len(result.stdout) == 1000 and result.stdout_truncated
    assert result.stderr == "e" * 50 and not result.stderr_truncated


def test_a_command_past_its_timeout_ends_on_the_host(tmp_path: Path, monkeypatch) -> None:
    """An agent that keeps answering heartbeats but never ends the command: the call returns
    timed out once the timeout and the guest's grace have passed."""
    monkeypatch.setattr(agent_module, "HEARTBEAT_AFTER", 0.1)
    monkeypatch.setattr(agent_module, "EXEC_DEADLINE_GRACE", 0.5)

    def script(conn, _request, rest) -> None:
        conn.sendall(encode({"t": "out", "fd": 1}, b"partial"))
        for frame in rest:  # answer every ping as a busy agent, forever
            if frame["t"] == "ping":
                conn.sendall(encode({"t": "pong", "id": frame["id"], "busy": True}))

    agent = ScriptedAgent(tmp_path / "a.sock", script)
    started = time.monotonic()
    with AgentClient(tmp_path / "a.sock") as client:
        result = client.exec(["sleep", "inf"], timeout=0.5)
    took = time.monotonic() - started
    agent.close()
    assert result.timed_out and result.exit_code == 124 and result.stdout == "partial"
    assert 1.0 <= took < 5.0


def test_a_read_stops_at_max_bytes(tmp_path: Path) -> None:
    """An agent sending a file without end: the read fails once it passes max_bytes."""
    def script(conn, _request, _rest) -> None:
        conn.sendall(encode({"t": "file", "mode": 0o644}))
        with contextlib.suppress(OSError):
            while True:
                conn.sendall(encode({"t": "data"}, bytes(65536)))

    agent = ScriptedAgent(tmp_path / "a.sock", script)
    sink = io.BytesIO()
    with AgentClient(tmp_path / "a.sock") as client, pytest.raises(GuestFileError, match="larger than"):
        client.read_file("/dev/zero-ish", sink, max_bytes=1_000_000)
    agent.close()
    assert sink.tell() <= 1_000_000
