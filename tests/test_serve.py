"""`rewind serve`: the HTTP API driven by an HTTP client against a real daemon on loopback,
with real guests: auth, OpenAPI, JSON and streamed exec, checkpoints, fork with a count,
Idempotency-Key, problem+json errors, MCP at /mcp, and the CLI's refusals."""

from __future__ import annotations

import json
import secrets
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx2
import pytest
from conftest import rewind_cli
from invariants import wait_until
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from openapi_spec_validator import validate
from prometheus_client.parser import text_string_to_metric_families
from serving import home_env, served

from rewind import Home
from rewind.serve.process import serve_process

TOKEN = secrets.token_urlsafe(24)
PROBLEM = "application/problem+json"


@pytest.fixture(scope="module")
def url(shared_home: Home, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with served(shared_home, tmp_path_factory.mktemp("serve") / "serve.log", TOKEN) as url:
        yield url


@pytest.fixture(scope="module")
def http(url: str) -> Iterator[httpx2.Client]:
    with httpx2.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"},
                       timeout=httpx2.Timeout(120, connect=5)) as client:
        yield client


@pytest.fixture(scope="module")
def machine(http: httpx2.Client) -> str:
    r = http.post("/machines", json={"name": "api", "labels": {"via": "http"}})
    assert r.status_code == 201, r.text
    return r.json()["name"]


def _problem(r: httpx2.Response, status: int, title: str) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == PROBLEM
    body = r.json()
    assert body["title"] == title and body["type"] == f"/errors/{title}" and body["status"] == status
    return body


def test_requests_without_the_token_are_refused(url: str) -> None:
    # Readiness and the API's description need no token; operations do.
    assert httpx2.get(f"{url}/health").status_code == 200
    assert httpx2.get(f"{url}/openapi.json").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        _problem(httpx2.get(f"{url}/machines", headers=headers), 401, "Unauthorized")
        _problem(httpx2.post(f"{url}/machines", json={}, headers=headers), 401, "Unauthorized")
    _problem(httpx2.post(f"{url}/mcp", json={}), 401, "Unauthorized")


def test_web_pages_are_refused_before_any_machine_is_touched(url: str, http: httpx2.Client,
                                                             machine: str) -> None:
    # What a page in a browser on this host can send: a rebinding page's own name in Host, a
    # foreign Origin, a form POST (no preflight needed), a fetch the browser marks cross-site;
    # and a request without the token. None may stop or delete the machine, even with the token.
    auth = {"Authorization": f"Bearer {TOKEN}"}
    hostile = [
        ({**auth, "Host": "rebound.example"}, {}, 421, "MisdirectedRequest"),
        ({**auth, "Origin": "http://evil.example"}, {}, 403, "Forbidden"),
        ({**auth, "Origin": "null"}, {}, 403, "Forbidden"),
        ({**auth, "Sec-Fetch-Site": "cross-site"}, {}, 403, "Forbidden"),
        (auth, {"data": {"a": "b"}}, 415, "UnsupportedMediaType"),
        (auth, {"content": b"x", "headers": {"Content-Type": "text/plain"}}, 415, "UnsupportedMediaType"),
        ({}, {}, 401, "Unauthorized"),
    ]
    for headers, body, status, title in hostile:
        extra = body.pop("headers", {})
        for method, path in (("POST", f"/machines/{machine}/stop"), ("DELETE", f"/machines/{machine}")):
            r = httpx2.request(method, f"{url}{path}", headers={**headers, **extra}, **body)
            _problem(r, status, title)
    _problem(httpx2.post(f"{url}/mcp", json={}, headers={**auth, "Host": "rebound.example"}),
             421, "MisdirectedRequest")
    _problem(httpx2.post(f"{url}/mcp", json={}, headers={**auth, "Origin": "http://evil.example"}),
             403, "Forbidden")
    assert http.get(f"/machines/{machine}").json()["status"] == "running"
    assert http.post(f"/machines/{machine}/exec", json={"cmd": "echo alive"}).json()["stdout"] == "alive\n"
    # The server's own origin (a page it serves, such as /docs) and a JSON body pass.
    own = http.get("/machines", headers={"Origin": url})
    assert own.status_code == 200 and machine in [m["name"] for m in own.json()]


def test_serve_without_a_token_flag_makes_a_private_token_file(tmp_path: Path, images_dir: Path) -> None:
    home = Home(root=tmp_path / "home", images=images_dir)
    with serve_process(home, tmp_path / "serve.log", []) as url:
        token = home.serve_token.read_text().strip()
        assert home.serve_token.stat().st_mode & 0o777 == 0o600 and len(token) >= 32
        assert "serve.token" in (tmp_path / "serve.log").read_text()
        _problem(httpx2.get(f"{url}/machines"), 401, "Unauthorized")
        assert httpx2.get(f"{url}/machines", headers={"Authorization": f"Bearer {token}"}).json() == []
        # This home's CLI finds the token by itself for a daemon on loopback.
        r = rewind_cli("ls", "--json", env={**home_env(home), "REWIND_URL": url, "REWIND_TOKEN": ""})
        assert r.returncode == 0 and json.loads(r.stdout) == [], r.stderr
    with serve_process(home, tmp_path / "again.log", []):
        assert home.serve_token.read_text().strip() == token  # kept: clients still hold it


def test_no_auth_gets_the_same_host_and_origin_checks(tmp_path: Path, images_dir: Path) -> None:
    home = Home(root=tmp_path / "home", images=images_dir)
    with serve_process(home, tmp_path / "serve.log", ["--no-auth", "--allow-host", "box.internal",
                                                       "--allow-origin", "https://app.example"]) as url:
        assert httpx2.get(f"{url}/machines").json() == []
        assert httpx2.get(f"{url}/machines", headers={"Host": "box.internal"}).status_code == 200
        rebound = httpx2.get(f"{url}/machines", headers={"Host": "rebound.example"})
        _problem(rebound, 421, "MisdirectedRequest")
        _problem(httpx2.post(f"{url}/machines", json={}, headers={"Origin": "http://evil.example"}),
                 403, "Forbidden")
        _problem(httpx2.post(f"{url}/machines", data={"name": "x"}), 415, "UnsupportedMediaType")
        # An allowed origin gets CORS answers; its preflight names it.
        preflight = httpx2.options(f"{url}/machines", headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST"})
        assert preflight.headers["access-control-allow-origin"] == "https://app.example"
        assert not home.machines.exists() or not any(home.machines.iterdir())


def test_openapi_document_is_valid(http: httpx2.Client) -> None:
    doc = http.get("/openapi.json").json()
    validate(doc)
    assert doc["components"]["securitySchemes"]["bearer"] == {"type": "http", "scheme": "bearer"}
    verbs = ("exec", "checkpoints", "restore", "fork", "try", "guarded", "files", "network", "start", "stop")
    for path in ("/machines", "/classify", "/checkpoints/{ref}/export", "/checkpoints/import",
                 *(f"/machines/{{name}}/{verb}" for verb in verbs)):
        assert path in doc["paths"], path


def test_exec_answers_json_with_the_guards_verdict(http: httpx2.Client, machine: str) -> None:
    r = http.post(f"/machines/{machine}/exec", json={"cmd": "echo out; echo err >&2; exit 3"})
    body = r.json()
    assert (body["exit_code"], body["stdout"], body["stderr"], body["ok"]) == (3, "out\n", "err\n", False)
    assert body["verdict"]["kind"] == "none"
    r = http.post(f"/machines/{machine}/exec", json={"cmd": ["cat"], "stdin": "from stdin"})
    assert r.json()["stdout"] == "from stdin" and r.json()["verdict"] is None
    r = http.post(f"/machines/{machine}/exec", json={"cmd": "rm -rf /opt"})
    assert r.json()["verdict"]["kind"] == "fork"


def test_exec_streams_server_sent_events(http: httpx2.Client, machine: str) -> None:
    events: list[tuple[float, str, object]] = []
    with http.sse(f"/machines/{machine}/exec", method="POST",
                  json={"cmd": "echo first; sleep 1.5; echo second >&2; exit 4"}) as source:
        for sse in source:
            events.append((time.monotonic(), sse.event, sse.json()))
    assert [(e, d) for _, e, d in events[:-1]] == [("stdout", "first\n"), ("stderr", "second\n")]
    done_at, last, result = events[-1]
    assert last == "exit" and result["exit_code"] == 4 and result["stdout"] == "first\n"
    assert done_at - events[0][0] > 1.0, "stdout came only at the end, not streamed"


def test_checkpoint_rm_rf_restore_one_answer_per_idempotency_key(http: httpx2.Client, machine: str) -> None:
    put = http.put(f"/machines/{machine}/files", params={"path": "/root/work/keep.txt"},
                   content=b"precious\n", headers={"Content-Type": "application/octet-stream"})
    assert put.status_code == 204, put.text
    key = {"Idempotency-Key": secrets.token_hex(8)}
    first = http.post(f"/machines/{machine}/checkpoints", json={"name": "before-rm"}, headers=key)
    again = http.post(f"/machines/{machine}/checkpoints", json={"name": "before-rm"}, headers=key)
    assert first.status_code == again.status_code == 201
    assert first.json() == again.json()
    assert (first.headers["Idempotent-Replayed"], again.headers["Idempotent-Replayed"]) == ("false", "true")
    _problem(http.post(f"/machines/{machine}/checkpoints", json={"name": "other"}, headers=key), 400,
             "InvalidArgument")
    history = http.get(f"/machines/{machine}/checkpoints").json()
    assert [p["name"] for p in history].count("before-rm") == 1

    assert http.post(f"/machines/{machine}/exec", json={"cmd": "rm -rf /root/work"}).json()["ok"]
    _problem(http.get(f"/machines/{machine}/files", params={"path": "/root/work/keep.txt"}), 422,
             "GuestFileError")
    restored = http.post(f"/machines/{machine}/restore", json={"ref": "before-rm"})
    assert restored.json()["id"] == first.json()["id"]
    got = http.get(f"/machines/{machine}/files", params={"path": "/root/work/keep.txt"})
    assert got.content == b"precious\n" and got.headers["content-type"] == "application/octet-stream"
    assert got.headers["X-Rewind-Mode"] == "644"


def test_fork_with_a_count_gives_one_machine_per_copy(http: httpx2.Client, machine: str) -> None:
    http.post(f"/machines/{machine}/exec", json={"cmd": "echo forked > /root/mark"})
    r = http.post(f"/machines/{machine}/fork", json={"count": 2, "labels": {"role": "child"}})
    assert r.status_code == 201, r.text
    children = [c["name"] for c in r.json()]
    try:
        assert len(set(children)) == 2
        for child in children:
            out = http.post(f"/machines/{child}/exec", json={"cmd": "cat /root/mark; hostname"})
            assert out.json()["stdout"] == f"forked\n{child}\n"
        listed = http.get("/machines", params={"label": "role=child"}).json()
        assert sorted(m["name"] for m in listed) == sorted(children)
        lineage = http.get(f"/checkpoints/{http.get(f'/machines/{children[0]}/checkpoints').json()[0]['id']}")
        assert lineage.status_code == 200 and lineage.json()["history"][0]["ref"] == "~0"
    finally:
        for child in children:
            assert http.delete(f"/machines/{child}").status_code == 204


def test_create_with_a_repeated_idempotency_key_makes_one_machine(http: httpx2.Client) -> None:
    key = {"Idempotency-Key": secrets.token_hex(8)}
    first = http.post("/machines", json={"labels": {"idem": "1"}}, headers=key)
    again = http.post("/machines", json={"labels": {"idem": "1"}}, headers=key)
    assert first.status_code == again.status_code == 201 and first.json() == again.json()
    listed = http.get("/machines", params={"label": "idem=1"}).json()
    assert [m["name"] for m in listed] == [first.json()["name"]]
    assert http.delete(f"/machines/{first.json()['name']}").status_code == 204
    _problem(http.get(f"/machines/{first.json()['name']}"), 404, "NotFound")


def test_try_and_guarded_leave_the_machine_untouched_on_failure(http: httpx2.Client, machine: str) -> None:
    http.put(f"/machines/{machine}/files", params={"path": "/root/proj/a.txt"}, content=b"a\n")
    tried = http.post(f"/machines/{machine}/try", json={"step": "rm -rf /root/proj && false"}).json()
    assert (tried["kept"], tried["passed"]) == ("original", False)
    guarded = http.post(f"/machines/{machine}/guarded",
                        json={"cmd": "rm -f a.txt && exit 1", "cwd": "/root/proj"}).json()
    assert (guarded["path"], guarded["undone"]) == ("git", True)
    assert http.get(f"/machines/{machine}/files", params={"path": "/root/proj/a.txt"}).content == b"a\n"
    refused = _problem(http.post(f"/machines/{machine}/guarded", json={"cmd": "git push origin main"}),
                       403, "Refused")
    assert refused["decision"]["kind"] == "external"
    assert http.post("/classify", json={"command": "git push"}).json()["kind"] == "external"


def test_errors_are_problem_documents_and_the_machine_survives(http: httpx2.Client, machine: str) -> None:
    _problem(http.get("/machines/nope"), 404, "NotFound")
    _problem(http.post("/machines/nope/exec", json={"cmd": "true"}), 404, "NotFound")
    exec_ = f"/machines/{machine}/exec"
    _problem(http.post(exec_, json={"cmd": ""}), 400, "InvalidArgument")
    _problem(http.post(exec_, json={"cmd": [1]}), 422, "InvalidArgument")
    _problem(http.post(exec_, json={"cmd": "true", "timeout": -1}), 400, "InvalidArgument")
    _problem(http.post(f"/machines/{machine}/restore", json={"ref": "no-such-point"}), 404,
             "UnknownCheckpoint")
    _problem(http.post("/machines", json={"name": machine}), 409, "AlreadyExists")
    _problem(http.post("/checkpoints/import", content=b"not an export"), 400, "BadExport")
    _problem(http.get("/no/such/route"), 404, "NotFound")
    assert http.get(f"/machines/{machine}").json()["status"] == "running"
    assert http.post(f"/machines/{machine}/exec", json={"cmd": "echo alive"}).json()["stdout"] == "alive\n"


def test_export_then_import_into_the_same_store_is_a_duplicate(http: httpx2.Client, machine: str) -> None:
    point = http.post(f"/machines/{machine}/checkpoints", json={"name": "to-export", "wait": True}).json()
    exported = http.get(f"/checkpoints/{point['id']}/export")
    assert exported.status_code == 200 and len(exported.content) > 1 << 20
    _problem(http.post("/checkpoints/import", content=exported.content), 409, "CheckpointExists")


def test_network_rules_round_trip(http: httpx2.Client, machine: str) -> None:
    rules = http.put(f"/machines/{machine}/network", json={"internet": False, "allow": ["pypi.org"]}).json()
    assert rules == {"internet": False, "allow": ["pypi.org"], "deny": []}
    assert http.get(f"/machines/{machine}/network").json() == rules
    http.put(f"/machines/{machine}/network", json={"internet": True})


def test_mcp_is_served_at_slash_mcp_with_the_same_token(url: str, machine: str) -> None:
    async def session() -> None:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with httpx2.AsyncClient(headers=headers, timeout=60) as http, \
                Client(streamable_http_client(f"{url}/mcp", http_client=http)) as client:
            assert "exec" in {t.name for t in (await client.list_tools()).tools}
            result = await client.call_tool("exec", {"name": machine, "command": "echo via mcp"})
            assert not result.is_error and result.structured_content["stdout"] == "via mcp\n"
    anyio.run(session)


def _port_in_use() -> tuple[socket.socket, int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock, sock.getsockname()[1]


def test_the_cli_refuses_bad_setups_in_one_line(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n")
    holder, busy = _port_in_use()
    with holder:
        token = tmp_path / "token"
        token.write_text("t0k3n\n")
        cases = [
            (("--token-file", str(tmp_path / "missing")), "cannot read the token file"),
            (("--token-file", str(empty)), "is empty"),
            (("--no-auth", "--host", "0.0.0.0"), "only allowed on a loopback address"),
            (("--token-file", str(token), "--port", str(busy)), f"cannot listen on 127.0.0.1:{busy}"),
        ]
        for args, message in cases:
            r = rewind_cli("serve", *args, timeout=60)
            err = r.stderr.decode()
            assert r.returncode == 1 and message in err and len(err.strip().splitlines()) == 1, (args, err)
            assert "Traceback" not in err


def test_labels_are_a_merge_patch(http: httpx2.Client, machine: str) -> None:
    r = http.patch(f"/machines/{machine}/labels", json={"stage": "draft"})
    assert r.status_code == 200 and r.json() == {"via": "http", "stage": "draft"}
    assert http.patch(f"/machines/{machine}/labels", json={"stage": None}).json() == {"via": "http"}
    _problem(http.patch(f"/machines/{machine}/labels", json={"bad key": "x"}), 400, "InvalidArgument")
    assert http.get(f"/machines/{machine}").json()["labels"] == {"via": "http"}


def test_the_cli_uses_the_daemon_at_rewind_url(url: str, machine: str, tmp_path: Path) -> None:
    # An empty home of its own: anything the CLI did on this host would find no machine.
    env = {"REWIND_URL": url, "REWIND_TOKEN": TOKEN, "REWIND_HOME": str(tmp_path / "elsewhere")}

    def cli(*args: str) -> tuple[int, str, str]:
        r = rewind_cli(*args, env=env)
        return r.returncode, r.stdout.decode(), r.stderr.decode()

    code, out, _ = cli("ls", "--json")
    assert code == 0 and machine in [m["name"] for m in json.loads(out)]
    assert cli("exec", machine, "--", "sh", "-c", "echo out; echo err >&2; exit 3") == (3, "out\n", "err\n")
    code, out, _ = cli("label", machine, "cli=yes", "--json")
    assert code == 0 and json.loads(out)["cli"] == "yes"
    code, out, _ = cli("checkpoint", machine, "--name", "via-cli", "--json")
    assert code == 0 and json.loads(out)["name"] == "via-cli"
    assert cli("exec", machine, "--", "rm", "-f", "/etc/hostname")[0] == 0
    code, out, _ = cli("log", machine, "--json")
    assert code == 0 and json.loads(out)[0]["name"] == "via-cli"
    assert cli("restore", machine, "via-cli")[0] == 0
    assert cli("exec", machine, "--", "test", "-f", "/etc/hostname")[0] == 0
    assert cli("label", machine, "--remove", "cli")[0] == 0
    for args, message in [(("gc",), "works on this host's store only"),
                          (("exec", "no-such", "--", "true"), "no machine named 'no-such'")]:
        code, _, err = cli(*args)
        assert code == 1 and message in err and len(err.strip().splitlines()) == 1, err
    r = rewind_cli("ls", env={**env, "REWIND_TOKEN": "wrong"})
    assert r.returncode == 1 and len(r.stderr.decode().strip().splitlines()) == 1, r.stderr


def test_ports_over_http_reach_a_guest_server(http: httpx2.Client, machine: str) -> None:
    start = "setsid python3 -m http.server 8080 --bind 0.0.0.0 --directory /etc >/dev/null 2>&1 < /dev/null &"
    assert http.post(f"/machines/{machine}/exec", json={"cmd": start}).json()["exit_code"] == 0
    r = http.post(f"/machines/{machine}/ports", json={"guest_port": 8080})
    assert r.status_code == 201, r.text
    forward = r.json()
    assert forward["host"] == "127.0.0.1" and forward["guest_port"] == 8080
    assert http.get(f"/machines/{machine}/ports").json() == [forward]

    def page() -> int | None:
        try:
            return httpx2.get(f"http://127.0.0.1:{forward['port']}/hostname", timeout=10).status_code
        except httpx2.TransportError:
            return None
    wait_until(lambda: page() == 200, "the guest's server through the forward", timeout=60)
    _problem(http.post(f"/machines/{machine}/ports", json={"guest_port": 8080}), 409, "AlreadyExists")
    _problem(http.post(f"/machines/{machine}/ports", json={"guest_port": 0}), 422, "InvalidArgument")
    assert http.delete(f"/machines/{machine}/ports/8080").json() == forward
    assert http.get(f"/machines/{machine}/ports").json() == []


def test_metrics_parse_and_move_with_operations(http: httpx2.Client, machine: str) -> None:
    def scrape() -> dict[tuple[str, tuple], float]:
        r = http.get("/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(r.text) for s in family.samples}

    before = scrape()
    ok_execs = ("rewind_operations_total", (("kind", "exec"), ("outcome", "ok")))
    missing = ("rewind_operations_total", (("kind", "exec"), ("outcome", "NotFound")))
    assert http.post(f"/machines/{machine}/exec", json={"cmd": "true"}).status_code == 200
    assert http.post("/machines/no-such/exec", json={"cmd": "true"}).status_code == 404
    after = scrape()
    assert after[ok_execs] == before.get(ok_execs, 0) + 1
    assert after[missing] == before.get(missing, 0) + 1
    assert after[("rewind_operation_seconds_count", (("kind", "exec"),))] >= 2
    assert after[("rewind_machines", (("state", "running"),))] >= 1
    assert after[("rewind_shm_bytes", ())] > 0 and ("rewind_store_bytes", ()) in after
    assert ("rewind_uploads_queued", ()) in after


def test_every_answer_carries_a_request_id(url: str, http: httpx2.Client) -> None:
    r = http.get("/machines", headers={"X-Request-Id": "trace-42"})
    assert r.headers["x-request-id"] == "trace-42"
    refused = httpx2.get(f"{url}/machines")  # no token: refused, still with an id
    assert refused.status_code == 401 and len(refused.headers["x-request-id"]) == 16
    assert http.get("/health", headers={"X-Request-Id": "bad id with spaces"}).headers["x-request-id"] != \
        "bad id with spaces"


def test_images_are_listed(http: httpx2.Client) -> None:
    rows = http.get("/images").json()
    default = [row for row in rows if row["default"]]
    assert len(default) == 1 and default[0]["size_mib"] > 0 and default[0]["kernel"]
