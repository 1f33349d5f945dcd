"""exec: results, streaming, timeouts, caps, stdin, environment."""

from __future__ import annotations

import hashlib
import time

import pytest

from rewind import CommandFailed, InvalidArgument, Sandbox


def test_stdout_stderr_and_exit_code_are_kept_apart(sbx: Sandbox) -> None:
    r = sbx.exec("echo out; echo err >&2; exit 3")
    assert (r.exit_code, r.stdout, r.stderr, r.timed_out) == (3, "out\n", "err\n", False)
    assert not r.ok


def test_a_list_runs_the_program_directly(sbx: Sandbox) -> None:
    r = sbx.exec(["printf", "%s|", "a b", "$HOME", "*"])
    assert r.stdout == "a b|$HOME|*|"


def test_missing_program_is_exit_127(sbx: Sandbox) -> None:
    r = sbx.exec(["no-such-program-xyz"])
    assert r.exit_code == 127 and "not found" in r.stderr


def test_cwd_env_and_stdin(sbx: Sandbox) -> None:
    r = sbx.exec("pwd; echo $GREETING; cat", cwd="/tmp", env={"GREETING": "hi there"}, stdin="from stdin")
    assert r.stdout == "/tmp\nhi there\nfrom stdin"


def test_binary_stdin_passes_through(sbx: Sandbox) -> None:
    data = bytes(range(256)) * 1000
    r = sbx.exec("sha256sum | cut -d' ' -f1", stdin=data)
    assert r.stdout.strip() == hashlib.sha256(data).hexdigest()


def test_check_raises_only_when_asked(sbx: Sandbox) -> None:
    assert sbx.exec("false").exit_code == 1
    with pytest.raises(CommandFailed) as info:
        sbx.exec("exit 5", check=True)
    assert info.value.result.exit_code == 5


def test_output_streams_while_the_command_runs(sbx: Sandbox) -> None:
    seen: list[tuple[float, str]] = []
    r = sbx.exec("echo first; sleep 1.5; echo second >&2",
                 on_stdout=lambda s: seen.append((time.monotonic(), s)),
                 on_stderr=lambda s: seen.append((time.monotonic(), s)))
    done = time.monotonic()
    assert "".join(s for _, s in seen) == "first\nsecond\n"
    first_at = next(t for t, s in seen if "first" in s)
    assert done - first_at > 1.0, "stdout arrived only at the end, not streamed"
    assert r.stdout == "first\n" and r.stderr == "second\n"


def test_timeout_kills_the_whole_process_group(sbx: Sandbox) -> None:
    r = sbx.exec("sleep 1000 & sleep 1000; echo never", timeout=1.5)
    assert r.timed_out and r.exit_code == 124 and "never" not in r.stdout
    left = sbx.exec("pgrep -x sleep || true")
    assert left.stdout.strip() == "", f"sleep survived the timeout: {left.stdout}"


def test_background_process_outlives_its_exec(sbx: Sandbox) -> None:
    sbx.exec("nohup sleep 300 >/dev/null 2>&1 &")
    assert sbx.exec("pgrep -x sleep").exit_code == 0
    sbx.exec("pkill -x sleep")


def test_output_cap_sets_the_truncation_flag(sbx: Sandbox) -> None:
    r = sbx.exec("head -c 5000 /dev/zero | tr '\\0' x; echo e >&2", max_output=1000)
    assert len(r.stdout) == 1000 and r.stdout_truncated and not r.stderr_truncated and r.stderr == "e\n"


def test_large_output_is_complete(sbx: Sandbox) -> None:
    r = sbx.exec("seq 1 200000")
    assert r.stdout.splitlines()[-1] == "200000" and len(r.stdout.splitlines()) == 200000


@pytest.mark.parametrize("bad", [0, -1])
def test_timeout_must_be_positive(sbx: Sandbox, bad: float) -> None:
    with pytest.raises(InvalidArgument, match="timeout"):
        sbx.exec("true", timeout=bad)


def test_missing_cwd_is_a_clear_error(sbx: Sandbox) -> None:
    with pytest.raises(InvalidArgument, match="working directory does not exist: /nope"):
        sbx.exec("true", cwd="/nope")


@pytest.mark.parametrize("bad", ["", "   ", [], [""], [1]])
def test_empty_or_malformed_command_is_refused(sbx: Sandbox, bad) -> None:
    with pytest.raises(InvalidArgument):
        sbx.exec(bad)
