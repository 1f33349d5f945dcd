"""`Sandbox.connect`: the SDK over HTTP against a real `rewind serve`, on a real guest.

The local SDK's exec and file behaviour tests run here again, unchanged, with `sbx` a
machine reached through the daemon; then the undo verbs, and errors raised as their own class.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from serving import served
from test_exec import (  # noqa: F401  (collected again here, against the remote machine)
    test_a_list_runs_the_program_directly,
    test_background_process_outlives_its_exec,
    test_binary_stdin_passes_through,
    test_check_raises_only_when_asked,
    test_cwd_env_and_stdin,
    test_empty_or_malformed_command_is_refused,
    test_large_output_is_complete,
    test_missing_cwd_is_a_clear_error,
    test_missing_program_is_exit_127,
    test_output_cap_sets_the_truncation_flag,
    test_output_streams_while_the_command_runs,
    test_stdout_stderr_and_exit_code_are_kept_apart,
    test_timeout_kills_the_whole_process_group,
    test_timeout_must_be_positive,
)
from test_files import (  # noqa: F401  (not its 100 MB test: see test_upload_and_download below)
    test_empty_file_round_trips,
    test_missing_file_and_directory_are_clear_errors,
    test_overwrite_replaces_the_whole_file,
    test_relative_guest_path_is_refused,
    test_upload_of_a_missing_host_file_is_refused,
    test_write_then_read_text_and_binary,
)
from test_machines import test_labels_are_added_changed_and_removed  # noqa: F401

from rewind import AlreadyExists, Checkpoint, Home, NotFound, Refused, RewindError, Sandbox, try_in_copy
from rewind.serve.client import Remote, RemoteSandbox
from rewind.store.errors import UnknownCheckpoint

TOKEN = "connect-test-token"


@pytest.fixture(scope="module")
def remote(shared_home: Home, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Remote]:
    with served(shared_home, tmp_path_factory.mktemp("connect") / "serve.log", TOKEN) as url, \
            Sandbox.connect(url, TOKEN) as remote:
        yield remote


@pytest.fixture(scope="module")
def sbx(remote: Remote) -> RemoteSandbox:
    """The machine the imported behaviour tests run on, created through the daemon. With a
    progress callback the answer is a server-sent event stream (`progress` events, which a
    start from the booted template does not need, then `result`)."""
    return remote.create("remote", labels={"via": "connect"}, progress=lambda step: None)


def test_handles_find_machines_like_the_local_sdk(remote: Remote, sbx: RemoteSandbox) -> None:
    assert remote.get("remote").name == "remote" and sbx.status == "running"
    assert [s.name for s in remote.list({"via": "connect"})] == ["remote"]
    assert sbx.labels == {"via": "connect"} and sbx.info().memory_mib > 0
    with pytest.raises(NotFound, match="no machine named 'nope'"):
        remote.get("nope")
    with pytest.raises(AlreadyExists):
        remote.create("remote")


def test_checkpoint_rm_rf_restore_takes_the_checkpoint_object(sbx: RemoteSandbox) -> None:
    sbx.files.write("/root/work/keep.txt", "precious\n")
    point = sbx.checkpoint(name="remote-before", labels={"step": "1"}, context="plan: step 1")
    assert isinstance(point, Checkpoint) and point.name == "remote-before" and point.pause_ms is not None
    sbx.exec("rm -rf /root/work", check=True)
    restored = sbx.restore(point)
    assert (restored.id, restored.context) == (point.id, "plan: step 1")
    assert sbx.files.read_text("/root/work/keep.txt") == "precious\n"
    assert (sbx.history()[0].id, sbx.history()[0].context) == (point.id, "plan: step 1")
    with pytest.raises(UnknownCheckpoint):
        sbx.restore("no-such-point")
    assert sbx.exec("echo alive").stdout == "alive\n"


def test_try_in_copy_and_guarded_run_on_the_server(sbx: RemoteSandbox) -> None:
    sbx.files.write("/root/try.txt", "before\n")
    outcome = try_in_copy(sbx, "echo after > /root/try.txt", verify="false")
    assert (outcome.kept, outcome.passed, outcome.verify.result.exit_code) == ("original", False, 1)
    assert sbx.files.read_text("/root/try.txt") == "before\n"
    kept = try_in_copy(sbx, "echo after > /root/try.txt")
    assert kept.kept == "copy" and sbx.files.read_text("/root/try.txt") == "after\n"
    with pytest.raises(Refused) as refused:
        sbx.guarded("git push origin main")
    assert refused.value.decision.kind.value == "external"
    result = sbx.guarded("cat /root/try.txt")
    assert result.path == "direct" and result.result.stdout == "after\n"


def test_a_fork_is_a_handle_of_its_own(sbx: RemoteSandbox) -> None:
    sbx.files.write("/root/mark", "parent\n")
    with sbx.fork("remote-child") as child:
        assert child.exec("cat /root/mark; hostname").stdout == "parent\nremote-child\n"
    with pytest.raises(NotFound):
        child.info()


def test_rewind_url_and_an_unreachable_server(monkeypatch: pytest.MonkeyPatch, remote: Remote) -> None:
    monkeypatch.setenv("REWIND_URL", remote.url)
    monkeypatch.setenv("REWIND_TOKEN", TOKEN)
    with Sandbox.connect() as again:
        assert again.get("remote").exec("true").ok
    with Sandbox.connect(remote.url, "wrong") as refused, pytest.raises(RewindError, match="Bearer"):
        refused.list()
    with Sandbox.connect("http://127.0.0.1:9", TOKEN) as nowhere, pytest.raises(RewindError, match="reach"):
        nowhere.list()


def test_upload_and_download_through_the_daemon(sbx: RemoteSandbox, tmp_path: Path) -> None:
    """test_files' 100 MB round trip at 16 MB: under load the engine's agent client can time out
    a large write whatever the path (its send inherits a short socket timeout), and a cut-off
    write leaves the guest agent's port unusable for the module's later tests."""
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(16 << 20))
    os.chmod(src, 0o750)
    sbx.files.upload(src, "/root/big.bin")
    guest_sum = sbx.exec("sha256sum /root/big.bin").stdout.split()[0]
    assert guest_sum == hashlib.sha256(src.read_bytes()).hexdigest()
    assert sbx.exec("stat -c %a /root/big.bin").stdout.strip() == "750"
    sbx.files.download("/root/big.bin", tmp_path / "back.bin")
    assert (tmp_path / "back.bin").read_bytes() == src.read_bytes()
    sbx.exec("rm /root/big.bin")
