"""The undo an agent's tool layer uses, on real guests: try_in_copy, the git tier, guarded."""

from __future__ import annotations

import json

import pytest
from conftest import rewind_cli
from test_network import Listener

from rewind import Home, InvalidArgument, Refused, Sandbox, classify, try_in_copy
from rewind.engine.engine import Engine

# A server holding state only in memory: each connection gets one more than the last.
COUNTER_SERVER = r"""
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 7001)); s.listen()
n = 0
while True:
    c, _ = s.accept(); n += 1; c.sendall(f"{n}\n".encode()); c.close()
"""
ASK = "exec 3<>/dev/tcp/127.0.0.1/7001 && head -1 <&3"

# Everything the step below could touch, byte for byte, and every user process but our own probe.
FILES = "find /root /etc /usr/local -xdev -type f -exec md5sum {} + | sort"
PROCESSES = ("ps --ppid 2 -p 2 --deselect -o pid,ppid,args --no-headers > /tmp/ps.txt && "
             "grep -v -e ' ps --ppid' -e 'bash -c' /tmp/ps.txt | sort")  # kernel threads left out

REPO = "/root/project"
SETUP_REPO = f"""
set -e
mkdir -p {REPO} && cd {REPO}
git init -q -b main && git config user.email dev@example.com && git config user.name dev
printf 'keep\\n' > kept.txt && printf 'edit me\\n' > edited.txt && printf 'delete me\\n' > deleted.txt
printf '*.log\\n' > .gitignore
git add . && git commit -qm first
printf 'staged change\\n' >> kept.txt && git add kept.txt
printf 'not tracked yet\\n' > untracked.txt && printf 'ignored\\n' > build.log
"""
# The user's view of the repository: branch, HEAD, index, status and every file.
REPO_STATE = (f"cd {REPO} && git symbolic-ref HEAD && git rev-parse HEAD && git for-each-ref "
              "refs/heads refs/tags && git ls-files -s && "
              "git status --porcelain -uall --ignored && find . -path ./.git -prune -o -type f -print0 | "
              "sort -z | xargs -0 md5sum")


def state(sbx: Sandbox, command: str) -> str:
    return sbx.exec(command, check=True).stdout


def machines(home: Home) -> list[str]:
    return [m.name for m in Engine(home).list()]


def test_failed_try_leaves_the_original_as_it_was(home: Home) -> None:
    sbx = Sandbox.create("agent", home=home)
    sbx.exec(f"mkdir -p {REPO} && echo work > {REPO}/notes.txt", check=True)
    sbx.exec(f"setsid python3 -c '{COUNTER_SERVER}' > /dev/null 2>&1 < /dev/null &", check=True)
    sbx.exec(f"for i in $(seq 50); do {ASK} && exit 0; sleep 0.2; done; exit 1", check=True)
    files, processes = state(sbx, FILES), state(sbx, PROCESSES)

    outcome = try_in_copy(sbx, f"rm -rf {REPO} /etc/hostname && pkill -f '7001[)]' && echo step-output",
                          verify=f"test -d {REPO}")
    assert not outcome.passed and outcome.kept == "original"
    assert "step-output" in outcome.log and "verify exited with 1" in outcome.reason
    assert state(sbx, FILES) == files
    assert state(sbx, PROCESSES) == processes
    assert sbx.exec(ASK).stdout.strip() == "2"  # the server's memory did not see the copy's step
    assert machines(home) == ["agent"]  # the copy is gone
    # The original was held still while its memory was copied; its disk takes writes again
    # and they are in its next checkpoint.
    sbx.exec("echo after > /root/after && sync", check=True)
    point = sbx.checkpoint()
    sbx.exec("rm /root/after", check=True)
    sbx.restore(point.id)
    assert sbx.exec("cat /root/after", check=True).stdout == "after\n"


def test_passed_try_hands_the_copy_over(home: Home) -> None:
    sbx = Sandbox.create("agent", home=home, labels={"team": "a"})
    sbx.network.set(internet=True, deny=["10.9.0.0/16"])
    identity = state(sbx, "hostname; cat /etc/machine-id")
    outcome = try_in_copy(sbx, "echo installed > /usr/local/marker && ip route get 10.1.1.1 || true",
                          verify="grep -q installed /usr/local/marker")
    assert outcome.passed and outcome.kept == "copy", outcome.reason
    assert machines(home) == ["agent"]
    # The same handle, name, identity, labels and rules now reach the copy, which has the step's result.
    assert sbx.exec("cat /usr/local/marker", check=True).stdout == "installed\n"
    assert state(sbx, "hostname; cat /etc/machine-id") == identity
    assert sbx.labels == {"team": "a"}
    assert sbx.network.get() == {"internet": True, "allow": [], "deny": ["10.9.0.0/16"]}
    again = Sandbox.get("agent", home=home)
    assert again.info().status == "running"
    # Its history starts at the moment before the step: undo is one restore away.
    again.restore("~0")
    assert again.exec("test -e /usr/local/marker").exit_code == 1


def test_try_survives_a_step_that_kills_the_guest(home: Home) -> None:
    sbx = Sandbox.create("agent", home=home)
    files = state(sbx, FILES)
    outcome = try_in_copy(sbx, "echo o > /proc/sysrq-trigger", verify="true", timeout=60)
    assert not outcome.passed and outcome.kept == "original"
    # The poweroff is asynchronous: the step may end first, and then verify finds the copy gone.
    assert "step failed" in outcome.reason or "verify failed" in outcome.reason
    assert state(sbx, FILES) == files and machines(home) == ["agent"]

    slow = try_in_copy(sbx, "true", verify="sleep 600", timeout=3)
    assert not slow.passed and "verify timed out" in slow.reason
    assert machines(home) == ["agent"]


def test_try_copy_is_offline_unless_asked(home: Home) -> None:
    listener = Listener("127.0.0.1")
    try:
        sbx = Sandbox.create("agent", home=home, network={"internet": False, "allow": ["127.0.0.1"]})
        reach = f"exec 3<>/dev/tcp/10.0.2.2/{listener.port} && head -1 <&3"
        assert sbx.exec(reach).ok
        offline = try_in_copy(sbx, reach)
        assert not offline.passed and "refused" in offline.log.lower()
        online = try_in_copy(sbx, reach, offline=False)
        assert online.passed and "hello from the host" in online.log
        assert sbx.network.get()["allow"] == ["127.0.0.1/32"]
    finally:
        listener.close()


def test_a_migration_aimed_at_another_host_is_refused_and_never_reaches_it(home: Home) -> None:
    """DATABASE_URL points the tool at a database elsewhere (10.0.2.2 is the host's loopback,
    which these rules let the machine reach): judged external before anything runs, so the
    listener standing in for the remote database sees no connection."""
    listener = Listener("127.0.0.1")
    try:
        sbx = Sandbox.create("agent", home=home, network={"internet": True, "allow": ["127.0.0.1"]})
        reach = f"exec 3<>/dev/tcp/10.0.2.2/{listener.port} && head -1 <&3"
        step = f"DATABASE_URL=postgres://10.0.2.2:{listener.port}/app alembic upgrade head; {reach}"
        with pytest.raises(Refused, match="DATABASE_URL"):
            sbx.guarded(step, cwd="/root")
        assert listener.accepted == 0
        assert sbx.exec(reach).ok and listener.accepted == 1  # the rules let it through: the refusal did
    finally:
        listener.close()


def test_git_tier_puts_the_project_back(home: Home) -> None:
    sbx = Sandbox.create("agent", home=home)
    sbx.exec(SETUP_REPO, check=True)
    sbx.exec(f"cd {REPO} && git tag v1 && git tag -a -m old moved", check=True)
    before = state(sbx, REPO_STATE)
    # Branches and tags too: made (v2, other), moved (an annotated tag) and deleted (v1).
    step = ("sed -i s/edit/edited/ edited.txt && rm deleted.txt && echo new > new.txt && mkdir -p d/e && "
            "echo x > d/e/f && git add -A && git commit -qm step && git tag v2 && "
            "git tag -f -a -m new moved && git tag -d v1 && git checkout -qb other && false")
    done = sbx.guarded(step, cwd=REPO)
    assert (done.kind, done.path, done.undone) == ("git", "git", True), done
    assert state(sbx, REPO_STATE) == before
    assert sbx.exec(f"cd {REPO} && git rev-parse --verify -q refs/rewind/guard").exit_code == 0
    assert machines(home) == ["agent"]

    kept = sbx.guarded("echo more >> edited.txt", cwd=REPO, verify="grep -q more edited.txt")
    assert (kept.path, kept.undone, kept.ok) == ("git", False, True)
    assert "more" in sbx.files.read_text(f"{REPO}/edited.txt")
    # The user's branch, index and history were never touched by the tier itself.
    assert state(sbx, f"cd {REPO} && git log --format=%s main && git diff --cached --stat") == \
        state(sbx, f"cd {REPO} && git log --format=%s && git diff --cached --stat")


def test_guarded_takes_the_path_of_the_kind(home: Home) -> None:
    sbx = Sandbox.create("agent", home=home)
    read = sbx.guarded("ls /")
    assert (read.kind, read.path, read.ok) == ("none", "direct", True) and "etc" in read.result.stdout

    risky = sbx.guarded("echo broken > /etc/motd && exit 3")
    assert (risky.kind, risky.path, risky.undone) == ("fork", "copy", True)
    assert risky.result is not None and risky.result.exit_code == 3
    assert "broken" not in sbx.files.read_text("/etc/motd")

    fine = sbx.guarded("echo tuned > /etc/motd")
    assert (fine.path, fine.undone) == ("copy", False)
    assert sbx.files.read_text("/etc/motd") == "tuned\n"

    with pytest.raises(Refused, match="outside the machine"):
        sbx.guarded("git push origin main")
    pushed = sbx.guarded("curl -s -X POST http://10.0.2.2:1/ || true", allow_external=True)
    assert (pushed.kind, pushed.path) == ("external", "checkpoint") and pushed.checkpoint
    assert sbx.history()[0].id == pushed.checkpoint


# Programs in no table: one that leaves a mark and tries to reach an address outside the
# machine (TEST-NET-1, denied by the machine's rules so that it is refused at once), and
# one that only writes a file.
PHONES_HOME = "#!/bin/bash\necho called > /root/called\nexec 3<>/dev/tcp/192.0.2.7/443\n"
TIDIES_UP = "#!/bin/bash\necho tidy > /srv/tidied\n"


def test_an_unknown_program_is_watched_in_an_offline_copy(home: Home) -> None:
    sbx = Sandbox.create("agent", home=home, network={"internet": True, "deny": ["192.0.2.0/24"]})
    sbx.files.write("/usr/local/bin/phone-home", PHONES_HOME, mode=0o755)
    sbx.files.write("/usr/local/bin/tidy-up", TIDIES_UP, mode=0o755)
    assert classify("phone-home").unknown_programs == ("phone-home",)

    with pytest.raises(Refused, match=r"phone-home tried to reach outside.*tcp 192\.0\.2\.7:443") as refused:
        sbx.guarded("phone-home")
    assert refused.value.attempted == ("tcp 192.0.2.7:443",)
    assert not sbx.exec("test -e /root/called").ok  # the copy it ran in is gone
    assert machines(home) == ["agent"]

    tidy = sbx.guarded("tidy-up")
    assert (tidy.kind, tidy.path, tidy.undone, tidy.ok) == ("fork", "copy", False, True), tidy
    assert tidy.outcome is not None and tidy.outcome.attempted == ()
    assert sbx.files.read_text("/srv/tidied") == "tidy\n"

    allowed = sbx.guarded("phone-home || true", allow_external=True)
    assert allowed.path == "checkpoint" and "tcp 192.0.2.7:443" in allowed.note, allowed
    assert sbx.exec("test -e /root/called").ok
    assert sbx.history()[0].id == allowed.checkpoint


def test_a_known_program_is_watched_in_its_copy_too(home: Home) -> None:
    """python3 running a script is in the tables (a fork: it runs code), so its copy keeps the
    machine's network, but only for package registries: the script's connection to the
    host's loopback, which the machine itself may reach, is refused in the copy, names the
    step external, and never reaches the listener."""
    listener = Listener("127.0.0.1")
    try:
        sbx = Sandbox.create("agent", home=home, network={"internet": False, "allow": ["127.0.0.1"]})
        sbx.files.write("/root/report.py", "import socket, pathlib\n"
                        "pathlib.Path('/root/sent').write_text('x')\n"
                        f"socket.create_connection(('10.0.2.2', {listener.port}), timeout=3).close()\n")
        assert classify("python3 /root/report.py").unknown_programs == ()
        tried = rf"the step tried to reach .*10\.0\.2\.2:{listener.port}"
        with pytest.raises(Refused, match=tried) as refused:
            sbx.guarded("python3 /root/report.py")
        assert refused.value.attempted and listener.accepted == 0
        assert not sbx.exec("test -e /root/sent").ok and machines(home) == ["agent"]  # the copy is gone

        quiet = sbx.guarded("python3 -c 'open(\"/srv/quiet\", \"w\").write(\"ok\")'")
        assert (quiet.path, quiet.undone) == ("copy", False) and quiet.outcome.attempted == (), quiet
        # The kept copy runs under the machine's own rules again, not the watch's.
        assert sbx.network.get() == {"internet": False, "allow": ["127.0.0.1/32"], "deny": []}

        ran = sbx.guarded("python3 /root/report.py", allow_external=True)
        assert ran.path == "checkpoint" and ran.ok and listener.accepted == 1, ran
        assert sbx.exec("test -e /root/sent").ok and sbx.history()[0].id == ran.checkpoint
    finally:
        listener.close()


def test_a_copy_may_fetch_only_from_registries_the_machine_may_reach() -> None:
    from rewind.engine.network.netrules import NetworkRules
    from rewind.guard.watch import REGISTRIES, watched_rules

    everything = watched_rules(NetworkRules())
    assert (everything.internet, everything.allow, everything.deny) == (False, REGISTRIES, ())
    some = watched_rules(NetworkRules.parse(internet=False, deny=["192.0.2.0/24"],
                                            allow=["pypi.org", "*.pythonhosted.org", "10.0.0.0/8"]))
    assert some.allow == ("pypi.org", "files.pythonhosted.org") and some.deny == ("192.0.2.0/24",)
    assert watched_rules(NetworkRules.parse(deny=["github.com"])).allow == tuple(
        r for r in REGISTRIES if r != "github.com")


def test_guard_bad_input(home: Home) -> None:
    sbx = Sandbox.create("agent", home=home)
    for bad in ("", "   ", "x" * (1 << 20), "echo \udcff"):
        with pytest.raises(InvalidArgument):
            sbx.guarded(bad)
    for bad in ("", "x" * (1 << 20), b"echo \xff"):
        with pytest.raises(InvalidArgument):
            try_in_copy(sbx, bad, verify="true")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="verify command is empty"):
        try_in_copy(sbx, "true", verify=" ")
    with pytest.raises(InvalidArgument):
        try_in_copy(sbx, "true", verify="true", timeout=0)
    assert machines(home) == ["agent"] and sbx.exec("true").ok


def test_guard_cli(home: Home) -> None:
    decided = rewind_cli("classify", "--json", "--", "rm -rf /var/lib/app")
    assert decided.returncode == 0 and json.loads(decided.stdout)["kind"] == "fork"
    assert rewind_cli("classify", "--", "").returncode != 0
    bad = rewind_cli("classify", "--", b"echo \xff".decode(errors="surrogateescape"))
    assert bad.returncode == 1 and b"UTF-8" in bad.stderr and b"Traceback" not in bad.stderr

    assert rewind_cli("start", "agent", "--no-internet", "--allow", "*.example.com").returncode == 0
    shown = json.loads(rewind_cli("network", "agent", "--json").stdout)
    assert shown == {"internet": False, "allow": ["*.example.com"], "deny": []}
    refused = rewind_cli("network", "agent", "--allow", "not a host!")
    assert refused.returncode == 1 and b"not a host name" in refused.stderr

    tried = rewind_cli("try", "agent", "--json", "--verify", "test -f /root/x", "--", "touch /root/y")
    assert tried.returncode == 1 and json.loads(tried.stdout)["kept"] == "original"
    tried = rewind_cli("try", "agent", "--json", "--verify", "test -f /root/x", "--", "touch /root/x")
    assert tried.returncode == 0 and json.loads(tried.stdout)["kept"] == "copy"

    guarded = rewind_cli("exec", "--guard", "--json", "agent", "--", "cat /root/x")
    assert guarded.returncode == 0 and json.loads(guarded.stdout)["path"] == "direct"
    refused = rewind_cli("exec", "--guard", "agent", "--", "git push")
    assert refused.returncode == 1 and b"refused" in refused.stderr
