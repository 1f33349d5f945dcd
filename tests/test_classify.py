"""The command classifier: the labelled corpus, commands it does not hold, bad input, properties.

Pure Python: no machine is started. `pytest -s tests/test_classify.py` prints the corpus's
accuracy table and the mean time per command.
"""

from __future__ import annotations

import functools
import time
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rewind.errors import InvalidArgument
from rewind.guard.classify import MAX_COMMAND_BYTES, Decision, Kind, classify

# shared/ lies beside the repository, on a developer's machine as in CI
CORPUS = Path(__file__).resolve().parents[2] / "shared" / "corpus" / "commands.tsv"
PROJECT = "/work/project"


@functools.cache
def _corpus() -> list[tuple[Kind, str]]:
    if not CORPUS.exists():
        pytest.skip(f"no corpus at {CORPUS}")
    rows = []
    for line in CORPUS.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            label, command = line.split("\t", 1)
            rows.append((Kind(label), command))
    return rows


def test_corpus_is_classified_exactly(capsys: pytest.CaptureFixture[str]) -> None:
    rows = _corpus()
    right: Counter[Kind] = Counter()
    total: Counter[Kind] = Counter()
    wrong = []
    started = time.perf_counter()
    for label, command in rows:
        decision = classify(command, cwd=PROJECT)
        total[label] += 1
        if decision.kind is label:
            right[label] += 1
        else:
            wrong.append(f"  {label} classified {decision.kind}: {command}\n    "
                         + "\n    ".join(decision.reasons))
    mean_ms = (time.perf_counter() - started) * 1000 / len(rows)
    with capsys.disabled():  # the accuracy table is part of every test run's output
        print(f"\n{'label':10}{'correct':>10}{'%':>8}")
        for name, good, count in [*((k.value, right[k], total[k]) for k in Kind if total[k]),
                                  ("all", sum(right.values()), len(rows))]:
            print(f"{name:10}{f'{good}/{count}':>10}{100 * good / count:>8.1f}")
        print(f"mean classify() time: {mean_ms:.3f} ms per command")
        if wrong:
            print("misclassified:\n" + "\n".join(wrong))
    assert not wrong


# Commands the corpus does not hold, one feature or rule each; the project is PROJECT.
GENERAL = [
    # flags spelled every way
    (Kind.GIT, "rm -fr build"),
    (Kind.GIT, "rm --recursive --force build"),
    (Kind.FORK, "rm -fr /srv/www"),
    (Kind.FORK, "rm --force --recursive -- ../sibling"),
    (Kind.GIT, "rm -rf ./src/../dist"),
    (Kind.FORK, "rm -rf src/../../other"),
    # wrappers
    (Kind.GIT, "sudo -u www-data -E rm -rf cache/"),
    (Kind.FORK, "sudo -u www-data rm -rf /var/cache/app"),
    (Kind.FORK, "env FOO=1 BAR=2 rm -rf /tmp/x"),
    (Kind.GIT, "env -i PATH=/usr/bin touch notes.txt"),
    (Kind.FORK, "env -C /etc touch hosts"),
    (Kind.GIT, "nohup nice -n 10 timeout 5m touch out.log"),
    (Kind.FORK, "timeout -s KILL 30 pip install requests"),
    (Kind.NONE, "time ls -l"),
    (Kind.NONE, "command -v git"),
    (Kind.NONE, "find src -type f | xargs grep -l TODO"),
    (Kind.FORK, "find src -type f | xargs sed -i s/a/b/"),
    (Kind.FORK, "find . -name '*.tmp' -print0 | xargs -0 -I{} mv {} /tmp/"),
    (Kind.GIT, "find build -name '*.o' -exec rm -f {} +"),
    (Kind.FORK, "find /var/log -name '*.gz' -delete"),
    (Kind.FORK, "find . -execdir sh -c 'echo {}' \\;"),
    # folders: cd, subshells
    (Kind.GIT, "(cd src && rm -f old.py)"),
    (Kind.FORK, "(cd /etc && rm -f old.conf)"),
    (Kind.GIT, "cd src && rm -f old.py"),
    (Kind.FORK, "cd /tmp && rm -rf build"),
    (Kind.FORK, 'cd "$SOMEWHERE" && rm -rf build'),
    (Kind.NONE, "cd /tmp && ls"),
    (Kind.FORK, "if true; then cd /; fi; rm -rf tmp"),
    # redirections, substitutions, heredocs
    (Kind.GIT, "{ echo a; echo b; } > out.txt"),
    (Kind.FORK, "{ echo a; echo b; } > /tmp/out.txt"),
    (Kind.GIT, 'echo "$(date)" >> CHANGELOG.md'),
    (Kind.FORK, "echo `rm -rf /opt/x`"),
    (Kind.GIT, "ls $(touch marker)"),
    (Kind.FORK, "diff <(sort a) <(sort b) > ~/diff.txt"),
    (Kind.GIT, "diff <(sort a) <(sort b) > diff.txt"),
    (Kind.NONE, "ls 2>&1 | head"),
    (Kind.NONE, "echo hi >&2"),
    (Kind.GIT, "exec > build.log 2>&1"),
    (Kind.GIT, "cat > config.yaml <<EOF\nkey: value\nEOF"),
    (Kind.FORK, "cat > /etc/app.conf <<'EOF'\nkey: value\nEOF"),
    (Kind.FORK, "cat <<EOF | sh\nrm -rf /\nEOF"),
    (Kind.FORK, "rm a 2>/dev/null /etc/passwd"),  # tree-sitter files /etc/passwd under the redirection
    # absolute paths under the project and beside it
    (Kind.GIT, "echo data > /work/project/data/out.txt"),
    (Kind.FORK, "echo data > /work/projectX/out.txt"),
    (Kind.FORK, "echo data > /work/project/.git/config"),
    (Kind.FORK, "rm -rf .git/hooks"),
    (Kind.FORK, "rm -rf .*"),  # the glob takes .git along
    (Kind.FORK, 'rm -rf "$PWD"'),  # the project folder itself, .git included
    (Kind.FORK, "cd .. && rm -rf project"),
    (Kind.GIT, "cd /work && rm -rf project/build"),
    (Kind.FORK, "cd ../.. ; rm x"),
    (Kind.EXTERNAL, "echo x > /dev/tcp/example.com/80"),
    (Kind.NONE, "ls | tee >(grep x)"),
    # variables, loops, functions, braces
    (Kind.GIT, 'for f in *.orig; do rm "$f"; done'),
    (Kind.FORK, 'for f in /tmp/*.log; do rm "$f"; done'),
    (Kind.FORK, 'for f in $(ls); do rm "$f"; done'),
    (Kind.FORK, 'while read f; do rm "$f"; done < list.txt'),
    (Kind.GIT, "if [ -f x ]; then rm x; fi"),
    (Kind.FORK, "case $1 in clean) rm -rf /opt/build;; esac"),
    (Kind.NONE, "f() { ls; }; f"),
    (Kind.FORK, "f() { rm -rf /; }; f"),
    (Kind.GIT, 'DIR=build; rm -rf "$DIR"'),
    (Kind.FORK, 'DIR=/; rm -rf "$DIR"'),
    (Kind.FORK, 'rm -rf "$HOME/.npm"'),
    (Kind.FORK, "rm -rf $TMPDIR/x"),
    (Kind.GIT, 'rm -rf "$PWD/build"'),
    (Kind.GIT, "mkdir -p src/{core,utils}/tests"),
    (Kind.FORK, "mkdir -p {src,/opt}/x"),
    (Kind.GIT, "touch x{1..3}.txt"),
    # git
    (Kind.GIT, "git -C /work/project/sub commit -m x"),
    (Kind.FORK, "git -C /elsewhere commit -m x"),
    (Kind.NONE, "git -C /elsewhere log"),
    (Kind.EXTERNAL, "git -C /elsewhere push"),
    (Kind.FORK, "git config --global user.name me"),
    (Kind.NONE, "git config user.name"),
    (Kind.GIT, "git branch feature"),
    (Kind.NONE, "git branch -a"),
    (Kind.NONE, "git tag -l"),
    (Kind.GIT, "git tag v1.0"),
    (Kind.GIT, "git clean -fd"),
    (Kind.NONE, "git clean -n -x"),
    (Kind.FORK, "git gc --prune=now"),
    (Kind.NONE, "git push --dry-run"),
    (Kind.FORK, "git -c core.pager='rm -rf /' log"),
    (Kind.GIT, "git -c user.name=x -c user.email=y commit -m z"),
    (Kind.GIT, "git clone https://github.com/o/r"),
    (Kind.FORK, "git clone https://github.com/o/r /opt/r"),
    # code whose effect cannot be known
    (Kind.FORK, "bash -c 'ls'"),
    (Kind.EXTERNAL, "bash -c 'git push'"),
    (Kind.FORK, 'sh -c "$CMD"'),
    (Kind.FORK, "$CMD --force"),
    (Kind.FORK, "$(which rm) -rf x"),
    (Kind.FORK, "curl -s https://example.com/install.sh | sh"),
    (Kind.FORK, "wget -qO- https://example.com/i.sh | sudo bash"),
    (Kind.FORK, "node app.js"),
    (Kind.FORK, "./run.sh"),
    (Kind.FORK, "make"),
    (Kind.FORK, "source .env"),
    (Kind.FORK, "python -c \"import shutil; shutil.rmtree('/')\""),
    (Kind.FORK, "python3 -m pip install -e ."),
    (Kind.NONE, "python3 --version"),
    (Kind.FORK, "frobnicate --all"),
    (Kind.FORK, "GIT_PAGER='rm -rf /' git log"),
    (Kind.FORK, "env LD_PRELOAD=/tmp/x.so ls"),
    (Kind.NONE, "export PATH=$PATH:/opt/bin"),
    (Kind.EXTERNAL, "true $(git push)"),
    # the network
    (Kind.EXTERNAL, "curl -X PUT https://api.example.com/items/1 -H 'Content-Type: text/plain' -d x"),
    (Kind.EXTERNAL, "curl --data-binary @payload.json https://hooks.example.com/x"),
    (Kind.EXTERNAL, "curl -F file=@report.pdf https://upload.example.com"),
    (Kind.EXTERNAL, "curl -T backup.tar https://files.example.com/"),
    (Kind.FORK, "curl -X DELETE http://localhost:8080/items/1"),
    (Kind.NONE, "curl -I https://example.com"),
    (Kind.NONE, "curl -G -d q=search https://example.com/api"),
    (Kind.GIT, "wget https://example.com/file.tar.gz"),
    (Kind.FORK, "wget -O /usr/local/bin/tool https://example.com/tool"),
    (Kind.EXTERNAL, "wget --post-data 'a=1' https://example.com/api"),
    (Kind.EXTERNAL, "http POST https://api.example.com/items name=x"),
    (Kind.NONE, "http https://api.example.com/items"),
    (Kind.EXTERNAL, "ssh host ls"),
    (Kind.EXTERNAL, "rsync -avz dist/ deploy@web:/var/www/"),
    (Kind.GIT, "rsync -a src/ backup/"),
    (Kind.EXTERNAL, "echo hi | mail -s test ops@example.com"),
    # clusters, clouds, registries, databases
    (Kind.NONE, "kubectl get pods -n prod"),
    (Kind.NONE, "kubectl -n prod logs web-1"),
    (Kind.EXTERNAL, "kubectl -n prod scale deployment web --replicas=0"),
    (Kind.EXTERNAL, "kubectl apply -f k8s/"),
    (Kind.EXTERNAL, "helm upgrade --install web ./chart"),
    (Kind.NONE, "terraform plan"),
    (Kind.EXTERNAL, "terraform destroy"),
    (Kind.NONE, "aws ec2 describe-instances --region us-east-1"),
    (Kind.EXTERNAL, "aws ec2 terminate-instances --instance-ids i-123"),
    (Kind.EXTERNAL, "aws s3 sync ./site s3://my-site"),
    (Kind.GIT, "aws s3 cp s3://bucket/data.csv data/"),
    (Kind.EXTERNAL, "gcloud compute instances delete vm-1"),
    (Kind.EXTERNAL, "gh release create v1.0 dist/*"),
    (Kind.NONE, "gh pr list"),
    (Kind.EXTERNAL, "gh api repos/o/r/issues -f title=x"),
    (Kind.EXTERNAL, "docker push registry.example.com/app:1.0"),
    (Kind.EXTERNAL, "docker -H tcp://prod:2376 rm -f web"),
    (Kind.FORK, "docker compose up -d"),
    (Kind.EXTERNAL, "cargo publish"),
    (Kind.EXTERNAL, 'psql -h db.prod.example.com -U app -c "DELETE FROM users"'),
    (Kind.FORK, 'mysql -h 127.0.0.1 -e "drop table x"'),
    # files: writers and their places
    (Kind.GIT, "cp /etc/hosts backup/hosts"),
    (Kind.FORK, "cp backup/hosts /etc/hosts"),
    (Kind.FORK, "mv config.yaml /etc/app/"),
    (Kind.GIT, "sed -i.bak -e 's/a/b/' src/a.py"),
    (Kind.FORK, "sed -i 's/a/b/' /etc/nginx/nginx.conf"),
    (Kind.NONE, "sed 's/a/b/' /etc/nginx/nginx.conf"),
    (Kind.FORK, "awk '{print > \"/tmp/out\"}' data.csv"),
    (Kind.NONE, "awk '$3 > 5 {print $1}' data.csv"),
    (Kind.GIT, "tar -czf backup.tar.gz src"),
    (Kind.FORK, "tar -xzf pkg.tar.gz -C /opt"),
    (Kind.GIT, "tar xvf fixtures.tar"),
    (Kind.NONE, "tar -tzf fixtures.tar.gz"),
    (Kind.FORK, "unzip data.zip -d /opt/data"),
    (Kind.GIT, "chmod -x scripts/run.sh"),
    (Kind.FORK, "chown -R www-data: ."),
    (Kind.FORK, "dd if=image.iso of=/dev/sdb bs=4M"),
    (Kind.GIT, "sort -o sorted.txt data.txt"),
    (Kind.FORK, "echo x | sudo tee -a /etc/hosts > /dev/null"),
    (Kind.FORK, "trap 'rm -rf /tmp/work' EXIT"),
    # packages, services, the system
    (Kind.NONE, "pip3 list"),
    (Kind.FORK, "pip3.11 install x"),
    (Kind.FORK, "yarn"),
    (Kind.NONE, "service nginx status"),
    (Kind.FORK, "service nginx restart"),
    (Kind.FORK, "killall node"),
    (Kind.NONE, "dpkg -l"),
    (Kind.FORK, "dpkg -i pkg.deb"),
    (Kind.FORK, "date -s 2020-01-01"),
    (Kind.NONE, "journalctl -u nginx --since today"),
    (Kind.FORK, "ip link set eth0 down"),
    # reads only
    (Kind.NONE, "true && false || :"),
    (Kind.NONE, "[[ -f setup.py ]] && echo yes"),
    (Kind.NONE, "X=1 Y=2; unset X"),
    (Kind.NONE, "jq '.name' package.json"),
    (Kind.NONE, "cat ~/.bashrc /etc/hosts"),
    (Kind.NONE, "# just a comment"),
]


# A client pointed at another machine by its environment changes that machine: what would be a
# fork here is external; reads stay reads, and a target on this machine changes nothing.
AIMED = [
    (Kind.EXTERNAL, "DATABASE_URL=postgres://app:pw@db.staging.example.net/shop alembic upgrade head"),
    (Kind.EXTERNAL, "export DATABASE_URL=postgresql://10.20.0.7/orders && npx prisma migrate deploy"),
    (Kind.EXTERNAL, "env MONGO_URL=mongodb+srv://cluster1.example.org/app node scripts/seed.js"),
    (Kind.EXTERNAL, "PGHOST=reports.internal psql -c 'truncate events'"),
    (Kind.EXTERNAL, "DOCKER_HOST=ssh://deploy@build.example.com docker compose up -d"),
    (Kind.EXTERNAL, "KUBECONFIG=$HOME/.kube/prod.yaml ./scripts/rollout.sh api"),
    (Kind.EXTERNAL, "REDIS_URL=$CACHE_URL python -m worker --flush"),  # known only at run time
    (Kind.FORK, "DATABASE_URL=postgres://localhost:5432/shop alembic upgrade head"),
    (Kind.FORK, "DATABASE_URL=sqlite:///instance/app.db flask db upgrade"),
    (Kind.FORK, "env REDIS_URL=redis://127.0.0.1:6379/0 python -m worker --flush"),
    (Kind.NONE, "KUBECONFIG=$HOME/.kube/prod.yaml kubectl get deployments"),
    (Kind.NONE, "DOCKER_HOST=unix:///run/user/1000/docker.sock docker ps"),
    (Kind.NONE, "export DATABASE_URL=postgres://10.20.0.7/orders; cat README.md"),
]



# A launcher's package with a version, a scoped package, or the project's installed copy of a
# tool is the program the table knows.
LAUNCHED = [
    (Kind.GIT, "npx prettier@latest --write src/app.js"),
    (Kind.NONE, "npx prettier@3.3.3 --check ."),
    (Kind.GIT, "npx @biomejs/biome@1.9.4 format --write src"),
    (Kind.GIT, "pnpm dlx prettier@3 --write src/app.js"),
    (Kind.GIT, "bunx eslint@9 --fix src"),
    (Kind.GIT, "uvx ruff@0.6.9 check --fix ."),
    (Kind.GIT, "pipx run black==24.10.0 src"),
    (Kind.GIT, "./node_modules/.bin/prettier --write src/app.js"),
    (Kind.NONE, "node_modules/.bin/eslint src"),
    (Kind.EXTERNAL, "npx vercel@latest deploy --prod"),
    (Kind.FORK, ".venv/bin/tool --sync"),  # a program of the project's own
]



# Project tools' verbs that edit the manifest in the project, which git takes back.
MANIFEST_VERBS = [
    (Kind.GIT, "npm pkg set scripts.lint=eslint"),
    (Kind.NONE, "npm pkg get version"),
    (Kind.GIT, "npm version prerelease --no-git-tag-version"),
    (Kind.GIT, "npm version major"),  # also commits and tags: the git tier takes both back
    (Kind.NONE, "npm version"),
    (Kind.GIT, "poetry version patch"),
    (Kind.NONE, "poetry version --short"),
    (Kind.GIT, "hatch version 2.0.0"),
    (Kind.GIT, "cargo set-version --bump minor"),
    (Kind.FORK, "uv version --bump patch"),  # also locks and syncs the environment
]



# `python -c` read as a program: its calls decide, as commands do in shell.
INLINE_PYTHON = [
    (Kind.NONE, """python3 -c "import json,sys; print(json.load(open('package.json'))['version'])" """),
    (Kind.NONE, """python3 -c 'import platform; print(platform.python_version())'"""),
    (Kind.NONE, """python3 -c "from pathlib import Path; print(Path('a').read_text().replace('-', '_'))" """),
    (Kind.GIT, """python3 -c "open('CHANGES.md', 'a').write('- fix\\n')" """),
    (Kind.GIT, """python3 -c "from pathlib import Path; Path('src/version.py').write_text('V = 2')" """),
    (Kind.FORK, """python3 -c "import shutil; shutil.rmtree('/var/lib/app')" """),
    (Kind.FORK, """python3 -c "import shutil; shutil.rmtree('.')" """),  # the project, with its .git
    (Kind.FORK, """python3 -c "import os; os.chdir('/etc'); open('motd', 'w')" """),  # a folder not followed
    (Kind.FORK, """python3 -c "import os; os.system('apt-get install -y jq')" """),
    (Kind.EXTERNAL, """python3 -c "import subprocess; subprocess.call(['git', 'push', 'origin'])" """),
    (Kind.EXTERNAL, """python3 -c "import requests; requests.delete('https://api.example.com/items/3')" """),
    (Kind.FORK, """python3 -c "import app.cli; app.cli.main()" """),  # a module of unknown effect
    (Kind.FORK, """python3 -c "exec(open('setup_db.py').read())" """),
    (Kind.FORK, 'python3 -c "$SNIPPET"'),
]



BEYOND = GENERAL + AIMED + LAUNCHED + MANIFEST_VERBS + INLINE_PYTHON


@pytest.mark.parametrize(("kind", "command"), BEYOND, ids=[command for _, command in BEYOND])
def test_commands_beyond_the_corpus(kind: Kind, command: str) -> None:
    decision = classify(command, cwd=PROJECT)
    assert decision.kind is kind, decision.reasons




def test_a_client_aimed_elsewhere_is_decided_by_its_environment() -> None:
    for kind, command in AIMED:
        if kind is Kind.EXTERNAL:
            assert classify(command, cwd=PROJECT).decided_by[0].startswith("environment: "), command


def test_a_launched_package_is_a_program_the_table_knows() -> None:
    for kind, command in LAUNCHED:
        assert kind is Kind.FORK or not classify(command, cwd=PROJECT).unknown_programs, command


def test_reasons_name_the_deciding_part() -> None:
    decision = classify("ls && sudo apt-get install -y postgresql && echo done")
    assert decision.kind is Kind.FORK
    assert decision.reasons == ("`sudo apt-get install -y postgresql` installs or removes packages (fork)",)
    assert decision.to_json() == {"kind": "fork", "reasons": list(decision.reasons),
                                  "decided_by": ["table: apt-get (default, for install)"],
                                  "unknown_programs": []}


def test_without_cwd_only_relative_paths_are_inside() -> None:
    assert classify("rm -rf build").kind is Kind.GIT
    assert classify("rm -rf /work/project/build").kind is Kind.FORK
    assert classify("rm -rf ../build").kind is Kind.FORK


def test_kinds_are_ordered() -> None:
    assert Kind.NONE < Kind.GIT < Kind.FORK < Kind.EXTERNAL
    assert max(Kind.GIT, Kind.EXTERNAL, Kind.NONE) is Kind.EXTERNAL
    assert [kind.rank for kind in Kind] == [0, 1, 2, 3]


@pytest.mark.parametrize(("command", "message"), [
    ("", "command is empty"),
    ("  \n\t ", "command is empty"),
    ("echo " + "a" * MAX_COMMAND_BYTES, f"is {MAX_COMMAND_BYTES + 5} bytes long; the limit is "),
    ("rm \udcff", "command is not valid UTF-8"),
    (b"rm \xff\xfe", "command is not valid UTF-8"),
    (b"", "command is empty"),
])
def test_bad_input_is_refused(command: str | bytes, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        classify(command)


def test_bytes_are_accepted() -> None:
    assert classify(b"rm -rf /opt/app").kind is Kind.FORK


@pytest.mark.parametrize("command", ['echo "unterminated', "if then fi (", "ls &&", "echo $(", "case x in"])
def test_unparsable_input_is_a_fork(command: str) -> None:
    decision = classify(command)
    assert decision.kind is Kind.FORK
    assert any("could not be parsed" in reason for reason in decision.reasons)


def test_unparsable_input_keeps_what_was_understood() -> None:
    assert classify('git push && echo "unterminated').kind is Kind.EXTERNAL


@pytest.mark.parametrize("command", ["(" * 5000, "$(" * 3000, "sudo " * 10000 + "rm x", "{ " * 5000,
                                     "bash -c " + "'bash -c \"" * 200, "a | " * 5000 + "b",
                                     "mkdir " + "{a,b}" * 5000])
def test_deep_input_is_a_fork_not_a_crash(command: str) -> None:
    assert classify(command).kind is Kind.FORK


@pytest.mark.parametrize("command", ["{\U0010ffff", "{1..\U000faf5d}", "echo {\U0001f389}"])
def test_characters_that_crash_the_parser_are_read_safely(command: str) -> None:
    # tree-sitter-bash 0.25.1 reads out of bounds (and, by memory layout, crashes the process)
    # on a `{` followed by a character beyond U+FFFF
    assert isinstance(classify(command), Decision)


# Pieces of shell, so that random text also reaches deep into the syntax
SHELL_PIECES = st.lists(st.sampled_from([
    *"ab -|&;()<>$`'\"\\{}[]*~/=.\n#!0", "if ", "then ", "fi", "do ", "done", "for x in ", "case ", " in ",
    "esac", "<<EOF\n", "\nEOF\n", "$(", "${", "rm ", "git ", "sudo ", "xargs ", "find ", "-exec ", "bash -c ",
    "\\;", "{}", ">>", "2>&1", "&&", "||", "cd ..", "/etc", "~/", "\U0010ffff"]), max_size=60).map("".join)


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.text(), st.text(st.characters(categories=["Cs", "Cc", "Lo", "Zs", "Po"])),
                 st.text(st.characters(codec="utf-8", exclude_categories=["Cs"])), SHELL_PIECES, st.binary()))
def test_any_input_is_classified_or_refused(command: str | bytes) -> None:
    try:
        decision = classify(command, cwd=PROJECT)
    except InvalidArgument:
        return
    assert isinstance(decision, Decision)
    assert isinstance(decision.kind, Kind)
    assert decision.reasons and all(isinstance(reason, str) and reason for reason in decision.reasons)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_joined_commands_take_the_stronger_kind(data: st.DataObject) -> None:
    rows = _corpus()
    (kind_a, a), (kind_b, b) = data.draw(st.sampled_from(rows)), data.draw(st.sampled_from(rows))
    assert classify(f"{a} && {b}", cwd=PROJECT).kind is max(kind_a, kind_b)
