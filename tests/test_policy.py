"""The operator's policy for steps (serve/policy.py) on real guests, through the service both
faces share and through the official MCP client: under `guarded` a failed step leaves the
machine as it was and raw exec is not offered; under `checkpoint-each` a point comes before
every step; under both a step that acts outside the machine is refused unless the operator,
not the agent, allowed it."""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any

import anyio
import httpx2
import pytest
from conftest import rewind_cli
from mcp import Client

from rewind import Home, InvalidArgument, Sandbox
from rewind.results import Refused
from rewind.serve.mcpserver import build_server
from rewind.serve.policy import Policy, StepPolicy
from rewind.serve.process import home_env, serve_process
from rewind.serve.service import DaemonConfig, Service

EXTERNAL = "curl -X POST https://api.example.com/v1/charges -d amount=100"
FAILS = "echo changed > /root/policy-mark && false"


def _service(home: Home, policy: Policy) -> Service:
    return Service(home, config=DaemonConfig(policy=policy))


@pytest.fixture(scope="module")
def machine(shared_home: Home) -> str:
    return Sandbox.create("policed", home=shared_home).name


def test_policies_parse_from_flags_and_bad_ones_are_one_line_errors() -> None:
    p = Policy.parse("guarded", ("web=open", "db=checkpoint-each"), ("web",))
    assert (p.of("web"), p.of("db"), p.of("other")) == (StepPolicy.OPEN, StepPolicy.CHECKPOINT_EACH,
                                                         StepPolicy.GUARDED)
    assert p.allows_external("web") and not p.allows_external("db")
    assert Policy.parse("open", external=("*",)).allows_external("any")
    with pytest.raises(InvalidArgument, match="no policy 'careful'"):
        Policy.parse("careful")
    with pytest.raises(InvalidArgument, match="NAME=POLICY"):
        Policy.parse("open", ("web",))
    done = rewind_cli("mcp", "--machine-policy", "web")
    assert done.returncode != 0 and b"NAME=POLICY" in done.stderr and b"Traceback" not in done.stderr


def test_the_calls_environment_counts_in_the_verdict() -> None:
    local = Service.decision("psql -c 'drop table users'", None, {"DATABASE_URL": "postgres://localhost/app"})
    remote = Service.decision("psql -c 'drop table users'", None, {"DATABASE_URL": "postgres://db.example.com/app"})
    assert local is not None and local.kind.value != "external"
    assert remote is not None and remote.kind.value == "external"


def test_under_guarded_a_failed_exec_leaves_the_machine_and_an_external_one_is_refused(
        shared_home: Home, machine: str) -> None:
    service = _service(shared_home, Policy(StepPolicy.GUARDED))
    failed = service.exec(machine, FAILS)
    assert failed["exit_code"] != 0 and failed["policy"] == "guarded" and failed["guarded"]["undone"]
    assert service.exec(machine, "test -e /root/policy-mark || echo absent")["stdout"] == "absent\n"
    with pytest.raises(Refused, match="policy"):
        service.exec(machine, EXTERNAL)
    with pytest.raises(Refused):  # the agent cannot allow it itself
        service.guarded(machine, EXTERNAL, allow_external=True)
    with pytest.raises(InvalidArgument, match="stdin"):
        service.exec(machine, "cat", stdin="x")


def test_under_checkpoint_each_every_exec_has_a_point_before_it(shared_home: Home, machine: str) -> None:
    service = _service(shared_home, Policy(StepPolicy.CHECKPOINT_EACH, external=frozenset({machine})))
    ran = service.exec(machine, "echo step > /root/policy-step")
    assert ran["exit_code"] == 0 and ran["policy"] == "checkpoint-each"
    service.restore(machine, ran["checkpoint"])
    assert service.exec(machine, "test -e /root/policy-step || echo before")["stdout"] == "before\n"
    other = _service(shared_home, Policy(StepPolicy.CHECKPOINT_EACH))
    with pytest.raises(Refused):
        other.exec(machine, EXTERNAL)


def test_over_mcp_under_guarded_there_is_no_raw_exec_and_a_failed_step_is_taken_back(
        shared_home: Home, machine: str) -> None:
    async def main() -> None:
        async with Client(build_server(_service(shared_home, Policy(StepPolicy.GUARDED))),
                          read_timeout_seconds=300) as client:
            tools = {t.name: t for t in (await client.list_tools()).tools}
            assert "exec" not in tools and "operator" in (tools["guarded_exec"].description or "")
            result: Any = await client.call_tool("guarded_exec", {"name": machine, "command": FAILS})
            assert not result.is_error and result.structured_content["undone"]
            refused = await client.call_tool("guarded_exec", {"name": machine, "command": EXTERNAL,
                                                              "allow_external": True})
            assert refused.is_error and "Refused: refused by the daemon's policy" in refused.content[0].text
    anyio.run(main)
    after = Sandbox.get(machine, home=shared_home).exec("test -e /root/policy-mark || echo absent")
    assert after.stdout == "absent\n"


def test_a_daemon_shows_its_policy_in_health_config_and_the_doctor(tmp_path: Path) -> None:
    home = Home(root=tmp_path / "home", images=tmp_path / "images")
    token = tmp_path / "token"
    token.write_text(secrets.token_urlsafe(24))
    args = ["--token-file", str(token), "--policy", "guarded", "--machine-policy", "web=open",
            "--allow-external", "web"]
    with serve_process(home, tmp_path / "serve.log", args) as url:
        want = {"default": "guarded", "machines": {"web": "open"}, "allow_external": ["web"]}
        assert httpx2.get(f"{url}/health").json()["policy"] == want
        config = httpx2.get(f"{url}/config", headers={"Authorization": f"Bearer {token.read_text()}"})
        assert config.json()["policy"] == want
        env = {**home_env(home), "REWIND_URL": url, "REWIND_TOKEN": token.read_text()}
        doctor = rewind_cli("doctor", "--json", env=env)
        assert json.loads(doctor.stdout)["policy"] == want, doctor.stderr
