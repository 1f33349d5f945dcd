"""Images of the user's own, run as real machines: OCI and Docker archives of a busybox-only
root (two layers, a whiteout, no Python, no init, no bash), with the image's Env,
WorkingDir and User as every command's defaults; checkpoint, restore, fork and create-from
on them; `rewind image ls/rm` and the errors."""

from __future__ import annotations

import contextlib
import json
import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import cleanup_home, rewind_cli
from images import make_busybox_archive
from serving import home_env

from rewind import AlreadyExists, Home, ImageError, InvalidArgument, NotFound, Sandbox
from rewind.engine.engine import Engine
from rewind.image.custom import build_from_dockerfile, build_from_image, remove_image
from rewind.image.dockerfile import Builder, builder_for
from rewind.signers import signing_key, trust
from rewind.store import export_checkpoint, import_checkpoint, open_store

ENV = {"PATH": "/bin", "GREETING": "from the image"}


@pytest.fixture(scope="module")
def built(shared_home: Home, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """An image from an oci-archive and one from a docker-archive (running as user 1000)."""
    folder = tmp_path_factory.mktemp("archives")
    suffix = secrets.token_hex(3)
    names = {"oci": f"bb-oci-{suffix}", "docker": f"bb-docker-{suffix}"}
    oci = make_busybox_archive(folder / "oci.tar", "oci", env=ENV, workdir="/home/user")
    docker = make_busybox_archive(folder / "docker.tar", "docker", env=ENV, workdir="/home/user", user="user")
    build_from_image(shared_home.images, names["oci"], oci)
    build_from_image(shared_home.images, names["docker"], docker)
    yield names
    engine = Engine(shared_home)
    for machine in engine.list():
        machine.delete()
    engine.settle()  # points still being stored read the images' disks
    for name in names.values():
        remove_image(shared_home.images, name, [])


def test_an_oci_image_runs_with_its_env_and_working_dir(shared_home: Home, built: dict[str, str]) -> None:
    with Sandbox.create(image=built["oci"], home=shared_home) as sbx:
        r = sbx.exec('echo "$GREETING"; pwd; id -u; ls /etc; command -v python3 bash || echo none')
        assert r.ok, r
        greeting, cwd, uid, *rest = r.stdout.splitlines()
        assert (greeting, cwd, uid) == ("from the image", "/home/user", "0")
        assert "remove-me" not in rest and "hostname" in rest  # layer 2's whiteout and file
        assert rest[-1] == "none"  # no Python, no bash: the agent runs all the same
        own = sbx.exec("pwd; echo $GREETING", cwd="/tmp", env={"GREETING": "from the call"})
        assert own.stdout == "/tmp\nfrom the call\n"  # a call's own cwd and env win
        assert sbx.exec(["cat", "/proc/1/cmdline"]).stdout.startswith("/usr/lib/rewind/bin/busybox")


def test_a_docker_image_runs_commands_as_its_user(shared_home: Home, built: dict[str, str]) -> None:
    with Sandbox.create(image=built["docker"], home=shared_home) as sbx:
        r = sbx.exec("id -u; echo $HOME; pwd; echo $GREETING")
        assert r.stdout.splitlines() == ["1000", "/home/user", "/home/user", "from the image"], r


def test_checkpoint_restore_fork_and_create_from_on_an_image(shared_home: Home,
                                                             built: dict[str, str]) -> None:
    with Sandbox.create(image=built["oci"], home=shared_home) as sbx:
        sbx.exec("echo kept > /root/state && sleep 1000 > /dev/null 2>&1 &", check=True)
        point = sbx.checkpoint(wait=True)
        sbx.exec("rm -rf /bin/ls /root/state", check=True)
        sbx.restore(point.id)
        back = sbx.exec("cat /root/state; ls /bin/ls; ps | grep -c 'sleep 100[0]'")
        assert back.stdout == "kept\n/bin/ls\n1\n", back  # files and the running process
        with sbx.fork() as child, Sandbox.create(from_checkpoint=point, home=shared_home) as copy:
            for machine in (child, copy):
                assert machine.exec("cat /root/state; echo $GREETING").stdout == "kept\nfrom the image\n"


def test_image_ls_rm_and_bad_builds_are_clear(shared_home: Home, built: dict[str, str],
                                              tmp_path: Path) -> None:
    env = home_env(shared_home)
    r = rewind_cli("image", "ls", "--json", env=env)
    rows = {row["id"]: row for row in json.loads(r.stdout)}
    row = rows[built["oci"]]
    assert row["digest"].startswith("sha256:") and row["source"]["kind"] == "oci-archive"
    assert not row["default"] and row["size_mib"] > 0

    machine = Sandbox.create(image=built["oci"], home=shared_home)
    refused = rewind_cli("image", "rm", built["oci"], env=env)
    err = refused.stderr.decode()
    assert refused.returncode == 1 and f"machine {machine.name}" in err and len(err.strip().splitlines()) == 1
    assert machine.exec("true").ok  # the refusal touched nothing

    with pytest.raises(AlreadyExists):
        build_from_image(shared_home.images, built["oci"], f"oci-archive:{tmp_path / 'x.tar'}")
    for source, message in ((f"oci-archive:{tmp_path / 'missing.tar'}", "no such file"),
                            ("docker://debian", "oci-archive:PATH")):
        cli = rewind_cli("image", "build", "--from", source, "--name", "never", env=env)
        err = cli.stderr.decode()
        assert cli.returncode == 1 and message in err and "Traceback" not in err, err
    with pytest.raises(InvalidArgument, match="invalid image name"):
        build_from_image(shared_home.images, "../escape", f"oci-archive:{tmp_path}")
    assert not (shared_home.images / "never").exists()
    assert not [p for p in shared_home.images.iterdir() if p.name.startswith(".build-")]


def test_a_point_of_an_image_runs_in_a_home_that_lacks_the_image(shared_home: Home, built: dict[str, str],
                                                                 tmp_path: Path) -> None:
    # A second home whose images are only the default one: the point brings the image's
    # disk, and the default image its kernel and runtime.
    other_images = tmp_path / "images"
    other_images.mkdir()
    default = Engine(shared_home).image()
    (other_images / default.id).symlink_to(default.path)
    other = Home(root=tmp_path / "other", images=other_images)
    trust(other, signing_key(shared_home).public)  # the point is signed by the first home
    with Sandbox.create(image=built["oci"], home=shared_home) as sbx:
        sbx.exec("echo travelled > /root/state", check=True)
        point = sbx.checkpoint(wait=True)
    digest = Engine(shared_home).image(built["oci"]).source["digest"]
    assert open_store(shared_home.store).get(point.id).meta["image_digest"] == digest
    # Through the shared store, and through an export file into the other home's own store.
    exported = tmp_path / "point.rewind"
    export_checkpoint(open_store(shared_home.store), point.id, exported)
    imported = import_checkpoint(open_store(other.store, create=True), exported)
    try:
        for store in (shared_home.store, other.store):
            with Sandbox.create(from_checkpoint=imported.id, home=other, store=store) as copy:
                r = copy.exec("cat /root/state; pwd; echo $GREETING; command -v bash || echo none")
                assert r.stdout == "travelled\n/home/user\nfrom the image\nnone\n", (store, r)
    finally:
        cleanup_home(other)


@pytest.fixture(scope="module")
def builder(shared_home: Home) -> Iterator[Builder]:
    made = builder_for(shared_home.root)
    yield made
    made.remove_all()


@pytest.mark.slow  # over 30 s here
def test_a_debian_image_from_a_dockerfile_runs(shared_home: Home, builder: Builder, tmp_path: Path) -> None:
    # FROM an image made here: an mmdebstrap root imported into the builder (no registry).
    root = tmp_path / "debian"
    subprocess.run(["mmdebstrap", "--quiet", "--variant=minbase", "bookworm", str(root)], check=True)
    builder.import_root(root, "rewind-test-debian")
    context = tmp_path / "context"
    (context / "conf").mkdir(parents=True)
    (context / "hello.txt").write_text("hello from the context\n")
    (context / "conf" / "app.ini").write_text("mode = test\n")
    (context / "Dockerfile").write_text(
        "FROM rewind-test-debian\n"
        "ENV APP_MODE=test\n"
        "WORKDIR /app\n"
        "COPY hello.txt ./\n"
        "COPY conf/ /etc/app/\n"
        "RUN echo built > /app/built && useradd -m -u 1000 app && chown app /app\n"
        "USER app\n")
    name = f"deb-{secrets.token_hex(3)}"
    image = build_from_dockerfile(shared_home.images, builder, name, context / "Dockerfile", context)
    try:
        assert image.source["kind"] == "dockerfile" and image.exec["user"] == "app"
        with Sandbox.create(image=name, home=shared_home) as sbx:
            r = sbx.exec("cat hello.txt built /etc/app/app.ini; echo $APP_MODE; pwd; id -un; touch mine")
            assert r.stdout == "hello from the context\nbuilt\nmode = test\ntest\n/app\napp\n", r
            point = sbx.checkpoint()
            sbx.exec("rm -f /app/hello.txt", check=True)
            sbx.restore(point.id)
            back = sbx.exec("cat /app/hello.txt; stat -c %U /app/mine")
            assert back.stdout == "hello from the context\napp\n", back
    finally:
        Engine(shared_home).settle()
        remove_image(shared_home.images, name, [])


def test_a_dockerfile_builds_from_an_image_made_from_an_archive(shared_home: Home, builder: Builder,
                                                               tmp_path: Path) -> None:
    base = f"bb-base-{secrets.token_hex(3)}"
    build_from_image(shared_home.images, base, make_busybox_archive(tmp_path / "bb.tar", "oci", env=ENV))
    (tmp_path / "Dockerfile").write_text(f"FROM {base}\nRUN echo layered > /etc/layered\nWORKDIR /tmp\n")
    name = f"bb-top-{secrets.token_hex(3)}"
    env = home_env(shared_home)
    try:
        dockerfile = str(tmp_path / "Dockerfile")
        r = rewind_cli("image", "build", "-f", dockerfile, "--name", name, "--json", env=env)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["source"]["kind"] == "dockerfile"
        with Sandbox.create(image=name, home=shared_home) as sbx:
            r = sbx.exec("cat /etc/layered; pwd; echo $GREETING")
            assert r.stdout == "layered\n/tmp\nfrom the image\n", r
        bad = tmp_path / "Bad.dockerfile"
        bad.write_text(f"FROM {base}\nRUN echo about to fail >&2; exit 3\n")
        failed = rewind_cli("image", "build", "-f", str(bad), "--name", "never", "--json", env=env)
        err = failed.stderr.decode()
        assert failed.returncode == 1 and "exit 3" in err and len(err.strip().splitlines()) == 1, err
        log = Path(err.split("full log: ")[1].rstrip(")\n"))
        assert "about to fail" in log.read_text()  # the whole log outlives the failed build
        log.unlink()
        assert not (shared_home.images / "never").exists()
    finally:
        Engine(shared_home).settle()
        for made in (name, base):
            with contextlib.suppress(NotFound, ImageError):
                remove_image(shared_home.images, made, [])
