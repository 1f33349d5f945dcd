"""The program table family by family, launchers, tools that write in place, users' rules files,
and what a Decision says decided it.

Pure Python: no machine is started. `pytest -s tests/test_programs.py` prints the accuracy per
label over these cases.
"""

from __future__ import annotations

import re
import tomllib
from collections import Counter
from importlib.resources import files
from pathlib import Path

import pytest

from rewind.errors import InvalidArgument
from rewind.guard import tooltable
from rewind.guard.classify import Kind, classify
from rewind.guard.programs import FAMILIES
from rewind.guard.userrules import NO_RULES, find_rules, read_rules

PROJECT = "/work/project"
N, G, F, E = Kind.NONE, Kind.GIT, Kind.FORK, Kind.EXTERNAL

# One list per family: (the kind, the command), the project being PROJECT.
CASES: dict[str, list[tuple[Kind, str]]] = {
    "launchers": [
        (E, "python -m twine upload dist/*"),
        (E, "python3 -m twine upload --repository pypi dist/*"),
        (F, "python3 -m pytest -q"),
        (F, "python -m http.server 8000"),
        (N, "python -m black --check src"),
        (G, "npx prettier --write src/x.js"),
        (N, "npx --yes prettier --check src"),
        (F, "npx -c 'rm -rf /tmp/x'"),
        (E, "npx semantic-release"),
        (G, "pnpm dlx prettier --write ."),
        (E, "pnpm exec npm publish"),
        (G, "bunx eslint --fix src"),
        (G, "uvx ruff check --fix"),
        (N, "uvx --from ruff==0.5 ruff check"),
        (E, "pipx run twine upload dist/*"),
        (F, "uv run pytest"),
        (E, "uv run --with twine twine upload dist/*"),
        (G, "poetry run black ."),
        (F, "pdm run test"),
        (G, "pdm run isort src"),
        (F, "hatch run test"),
        (F, "hatch run test:cov"),
        (E, "bundle exec gem push x.gem"),
        (F, "yarn dlx create-react-app app"),
        (E, "npm exec -- twine upload dist/*"),
        (F, "corepack pnpm install"),
        (E, "./gradlew publish"),
        (E, "./mvnw -B deploy"),
    ],
    # A bump is git: one that also commits and tags (npm, pnpm, bun and yarn 1 by default) is
    # taken back by the git tier too, which puts back branches and tags
    "version bumps": [
        (N, "npm version"),
        (G, "npm version patch"),  # commits and tags: the git tier takes both back
        (G, "npm version patch --no-git-tag-version"),
        (G, "npm pkg set scripts.test=vitest"),
        (N, "npm pkg get version"),
        (G, "pnpm version minor"),  # commits and tags: the git tier takes both back
        (G, "pnpm version 2.0.0 --no-git-tag-version"),
        (G, "pnpm pkg delete scripts.x"),
        (G, "yarn version --patch"),  # commits and tags: the git tier takes both back
        (G, "yarn version --new-version 1.2.0"),  # commits and tags: the git tier takes both back
        (G, "yarn version"),  # commits and tags: the git tier takes both back
        (G, "yarn version --minor --no-git-tag-version"),
        (G, "yarn version patch"),
        (G, "yarn version major --deferred"),
        (N, "yarn version check"),
        (G, "yarn version check --interactive"),
        (G, "yarn version apply --all"),
        (N, "bun pm version"),
        (G, "bun pm version patch"),  # commits and tags: the git tier takes both back
        (G, "bun pm version patch --no-git-tag-version"),
        (G, "bun pm pkg set name=x"),
        (N, "bun pm pkg get name"),
        (G, "poetry version minor"),
        (N, "poetry version --short"),
        (G, "hatch version minor"),
        (N, "hatch version"),
        (G, "cargo set-version 1.2.0"),
        (F, "cd /tmp && npm version patch --no-git-tag-version"),
    ],
    "formatters": [
        (G, "black src tests"),
        (N, "black --check --diff src"),
        (F, "black /opt/other/app.py"),
        (G, "ruff format"),
        (N, "ruff format --check"),
        (G, "ruff check --fix src"),
        (N, "ruff check src"),
        (F, "ruff check --fix /etc/tool/x.py"),
        (G, "prettier --write 'src/**/*.ts'"),
        (N, "prettier src/index.ts"),
        (G, "eslint --fix ."),
        (N, "eslint src"),
        (G, "gofmt -w main.go"),
        (N, "gofmt -l ."),
        (G, "goimports -w ./pkg"),
        (G, "rustfmt src/main.rs"),
        (N, "rustfmt --check src/main.rs"),
        (G, "cargo fmt"),
        (N, "cargo fmt --check"),
        (G, "clang-format -i src/a.c src/b.h"),
        (N, "clang-format src/a.c"),
        (F, "clang-format -i /usr/include/x.h"),
        (G, "isort ."),
        (N, "isort --check-only --diff ."),
        (G, "autopep8 -i app.py"),
        (N, "autopep8 app.py"),
        (G, "shfmt -w scripts/"),
        (N, "shfmt -d scripts/"),
        (G, "terraform fmt"),
        (N, "terraform fmt -check -recursive"),
        (G, "stylua src"),
        (G, "rubocop -A"),
        (N, "rubocop app/"),
        (G, "php-cs-fixer fix src"),
        (N, "php-cs-fixer fix --dry-run src"),
        (G, "dos2unix scripts/run.sh"),
        (F, "dos2unix /etc/profile"),
        (G, "mix format"),
        (G, "dotnet format"),
        (G, "deno fmt"),
        (N, "mypy src"),
        (G, "sed -i 's/a/b/' src/app.py"),
    ],
    "redirections": [
        (G, "jq . a.json > b.json"),
        (G, "sort x > y"),
        (G, "cat > notes.txt <<< \"hi\""),
        (G, "cat >notes.txt <<<hi"),
        (F, "cat > /etc/motd <<< \"hi\""),
        (G, "cat <<EOF > f.txt\nhi\nEOF"),
        (G, "tr a-z A-Z <<< \"$X\" > out.txt"),
        (E, "cat > notes.txt <<< \"$(git push)\""),
        (G, "yq '.a' x.yaml > y.yaml"),
    ],
    "clouds": [
        (E, "aws s3 rm s3://company-backups/2024 --recursive"),
        (E, "aws s3 cp dist/ s3://bucket/ --recursive"),
        (G, "aws s3 cp s3://bucket/data.csv data/"),
        (N, "aws s3 ls s3://bucket"),
        (E, "gcloud storage rm gs://b/x"),
        (G, "gcloud storage cp gs://b/x ./data/"),
        (N, "gcloud compute instances list"),
        (E, "gsutil rm -r gs://bucket/old"),
        (E, "gsutil -m cp -r build gs://bucket/"),
        (G, "gsutil cp gs://bucket/x.csv data/"),
        (N, "gsutil ls gs://bucket"),
        (E, "az vm delete -n vm1 -g rg"),
        (N, "az storage blob list --container-name c"),
        (E, "azcopy copy ./a https://acct.blob.core.windows.net/c"),
        (E, "azcopy remove https://acct.blob.core.windows.net/c/x"),
        (E, "doctl compute droplet delete web-1"),
        (N, "doctl compute droplet list"),
        (E, "oci compute instance terminate --instance-id ocid1.x"),
        (E, "ibmcloud cos object-delete --bucket b --key k"),
        (E, "rclone sync ./site remote:site"),
        (G, "rclone copy remote:backup ./restore"),
        (E, "rclone delete remote:old"),
        (N, "rclone lsd remote:"),
        (E, "s3cmd put file s3://bucket/"),
        (G, "s3cmd get s3://bucket/file"),
        (E, "s3cmd del s3://bucket/file"),
        (E, "mc rm --recursive --force myminio/bucket"),
        (N, "mc ls myminio/bucket"),
    ],
    "platforms": [
        (E, "heroku ps:scale web=2 --app shop"),
        (E, "heroku config:set KEY=v"),
        (N, "heroku config:get KEY"),
        (N, "heroku logs --tail"),
        (E, "heroku run rake db:migrate"),
        (F, "heroku local web"),
        (E, "fly deploy"),
        (E, "flyctl scale count 3"),
        (N, "fly status"),
        (N, "fly apps list"),
        (E, "fly secrets set KEY=v"),
        (E, "vercel --prod"),
        (E, "vercel deploy"),
        (N, "vercel ls"),
        (E, "netlify deploy --prod"),
        (N, "netlify status"),
        (E, "railway up"),
        (E, "railway variables --set KEY=v"),
        (N, "railway logs"),
        (E, "render deploys create srv-1"),
        (E, "cf push app"),
        (N, "cf apps"),
        (E, "firebase deploy --only hosting"),
        (N, "firebase projects:list"),
        (E, "wrangler deploy"),
        (E, "wrangler kv key put --binding=X k v"),
        (N, "wrangler kv key list --binding=X"),
        (E, "amplify push"),
        (N, "amplify status"),
        (E, "eb deploy prod"),
        (N, "eb status"),
    ],
    "containers": [
        (E, "docker push registry.example.com/app:1"),
        (E, "docker login && docker push app"),
        (F, "docker build -t app ."),
        (E, "docker buildx build --push -t app ."),
        (F, "docker run --rm app"),
        (N, "docker ps -a"),
        (E, "podman push app"),
        (E, "kubectl apply -f k8s/"),
        (E, "kubectl delete pod web-1"),
        (E, "kubectl scale deployment web --replicas=3"),
        (N, "kubectl get pods"),
        (N, "kubectl describe svc web"),
        (N, "kubectl apply -f k8s/ --dry-run=client"),
        (N, "kubectl rollout status deploy/web"),
        (E, "kubectl rollout restart deploy/web"),
        (E, "helm install web ./chart"),
        (E, "helm upgrade --install web ./chart"),
        (N, "helm upgrade --install web ./chart --dry-run"),
        (N, "helm list -A"),
        (N, "helm template web ./chart"),
        (G, "helm package ./chart"),
        (G, "kustomize edit set image app=app:2"),
        (N, "kustomize build overlays/prod"),
        (E, "eksctl create cluster -f cluster.yaml"),
        (N, "eksctl get clusters"),
        (F, "minikube start"),
        (N, "minikube status"),
        (F, "kind create cluster"),
        (N, "kind get clusters"),
    ],
    "infrastructure": [
        (E, "terraform apply -auto-approve"),
        (E, "terraform destroy"),
        (N, "terraform plan -out plan.bin"),
        (N, "terraform validate"),
        (E, "tofu apply"),
        (E, "terragrunt run-all apply"),
        (E, "pulumi up --yes"),
        (E, "pulumi destroy"),
        (N, "pulumi preview"),
        (E, "cdk deploy --all"),
        (F, "cdk synth"),
        (E, "serverless deploy --stage prod"),
        (F, "serverless invoke local -f hello"),
        (E, "packer build image.pkr.hcl"),
        (N, "packer validate image.pkr.hcl"),
        (F, "vagrant up"),
        (N, "vagrant status"),
        (E, "ansible-playbook -i inventory/prod site.yml"),
        (E, "ansible-playbook -i prod.ini --check site.yml"),  # a task can set check_mode: false
        (N, "ansible-playbook -i prod.ini --syntax-check site.yml"),
        (F, "ansible-playbook -i localhost, -c local site.yml"),
        (F, "ansible-playbook --connection=local site.yml"),
        (E, "ansible-playbook site.yml"),
        (E, "ansible web -i hosts -m shell -a 'reboot'"),
        (F, "ansible localhost -m ping"),
        (N, "ansible-inventory --list"),
        (F, "ansible-galaxy install -r requirements.yml"),
        (E, "salt '*' state.apply"),
        (N, "salt '*' test.ping"),
        (F, "puppet apply site.pp"),
        (N, "puppet apply --noop site.pp"),
        (F, "chef-client"),
        (N, "knife node list"),
        (E, "knife cookbook upload app"),
    ],
    "registries": [
        (E, "npm publish"),
        (N, "npm publish --dry-run"),
        (E, "yarn publish"),
        (E, "pnpm publish --access public"),
        (E, "twine upload dist/*"),
        (N, "twine check dist/*"),
        (E, "cargo publish"),
        (N, "cargo publish --dry-run"),
        (E, "gem push pkg/x-1.0.gem"),
        (E, "mvn deploy"),
        (E, "mvn -B -DskipTests clean deploy"),
        (F, "mvn package"),
        (E, "gradle publish"),
        (E, "./gradlew :lib:publishToSonatype"),
        (F, "gradle publishToMavenLocal"),
        (F, "gradle build"),
        (E, "dotnet nuget push pkg.nupkg -k KEY"),
        (F, "dotnet build"),
        (E, "poetry publish --build"),
        (E, "flit publish"),
        (E, "hatch publish"),
        (E, "uv publish"),
        (E, "dart pub publish --force"),
        (E, "flutter pub publish"),
        (E, "mix hex.publish"),
        (F, "composer require monolog/monolog"),
        (E, "bun publish"),
        (E, "deno publish"),
        (E, "cabal upload dist/x.tar.gz"),
        (E, "pod trunk push X.podspec"),
        (E, "vsce publish"),
        (E, "goreleaser release"),
        (F, "goreleaser release --snapshot"),
    ],
    "forges": [
        (N, "gh pr view 42"),
        (N, "gh pr list --state open"),
        (N, "gh issue list"),
        (E, "gh pr create --fill"),
        (E, "gh pr merge 42 --squash"),
        (E, "gh release create v1 dist/*"),
        (N, "gh api repos/o/r/pulls"),
        (E, "gh api -X DELETE repos/o/r/issues/1"),
        (G, "gh pr checkout 42"),
        (N, "glab mr list"),
        (N, "glab mr view 3"),
        (E, "glab mr create --fill"),
        (E, "glab mr merge 3"),
        (N, "glab ci status"),
        (E, "glab api --method POST projects/1/issues"),
        (E, "hub pull-request -m x"),
        (E, "hub push origin main"),
        (N, "hub ci-status"),
        (N, "tea pulls"),
        (E, "tea pr create"),
        (N, "tea issues list"),
    ],
    "chat and mail": [
        (E, "echo done | mail -s build ops@example.com"),
        (E, "sendmail -t < msg.txt"),
        (E, "mutt -s hi a@b.c < body.txt"),
        (E, "echo hi | slackcat -c ops"),
        (E, "ntfy publish alerts 'deploy done'"),
        (E, "curl -X POST -d '{\"text\":\"hi\"}' https://hooks.slack.com/services/T/B/X"),
    ],
    "remote shells": [
        (E, "ssh prod 'sudo systemctl restart app'"),
        (N, "ssh -G prod"),
        (E, "scp backup.sql deploy@db.example.com:/srv/"),
        (G, "scp deploy@db.example.com:/srv/dump.sql data/"),
        (E, "rsync -avz dist/ web:/var/www/"),
        (N, "rsync -n -avz dist/ web:/var/www/"),
        (E, "sftp deploy@host"),
        (E, "mosh host"),
        (E, "telnet mail.example.com 25"),
        (F, "telnet localhost 8080"),
        (E, "nc example.com 80 < req.txt"),
        (N, "nc -z example.com 443"),
        (F, "nc -l 9000"),
    ],
    "databases": [
        (E, "psql -h db.prod.example.com -U app -c 'DELETE FROM users'"),
        (F, "psql -U postgres -c 'DROP TABLE x'"),
        (E, "psql postgres://app@db.example.com/app"),
        (E, "mysql -h db.example.com -e 'DROP TABLE x'"),
        (E, "mongosh mongodb://db.example.com/app --eval 'db.x.drop()'"),
        (F, "mongosh --eval 'db.x.drop()'"),
        (E, "redis-cli -h cache.example.com FLUSHALL"),
        (F, "redis-cli FLUSHALL"),
        (G, "sqlite3 data/app.db 'DELETE FROM t'"),
        (F, "sqlite3 /var/lib/app.db 'DELETE FROM t'"),
        (N, "sqlite3 -readonly data/app.db 'SELECT * FROM t'"),
        (F, "sqlite3 data/app.db '.shell rm -rf /'"),
        (F, "sqlite3 data/app.db < schema.sql"),
        (G, "duckdb data/x.duckdb 'CREATE TABLE t(a INT)'"),
        (N, "pg_dump -h db.prod.example.com app"),
        (G, "pg_dump -h db.prod.example.com -f backup.sql app"),
        (G, "mysqldump -h db.example.com app > dump.sql"),
        (F, "alembic upgrade head"),
        (F, "prisma migrate deploy"),
    ],
}
ALL_CASES = [(family, kind, command) for family, cases in CASES.items() for kind, command in cases]


@pytest.mark.parametrize(("family", "kind", "command"), ALL_CASES,
                         ids=[f"{family}: {command}" for family, _, command in ALL_CASES])
def test_programs_by_family(family: str, kind: Kind, command: str) -> None:
    decision = classify(command, cwd=PROJECT)
    assert decision.kind is kind, decision.reasons


def test_accuracy_per_label(capsys: pytest.CaptureFixture[str]) -> None:
    right: Counter[Kind] = Counter()
    total: Counter[Kind] = Counter()
    for _, kind, command in ALL_CASES:
        total[kind] += 1
        right[kind] += classify(command, cwd=PROJECT).kind is kind
    with capsys.disabled():
        print(f"\nprogram cases\n{'label':10}{'correct':>10}{'%':>8}")
        for kind in Kind:
            share = 100 * right[kind] / total[kind]
            print(f"{kind.value:10}{f'{right[kind]}/{total[kind]}':>10}{share:>8.1f}")
    assert right == total


def test_every_family_names_its_sources_and_no_program_twice() -> None:
    names = Counter(name for family in FAMILIES.values() for name in family.programs)
    assert not [name for name, count in names.items() if count > 1]
    assert all(family.sources for family in FAMILIES.values())


# ---------------------------------------------------------------------------------------------
# What decided

def test_decision_names_the_table_entry_and_subcommand() -> None:
    decision = classify("kubectl -n prod scale deployment web --replicas=0")
    assert decision.decided_by == ("table: kubectl (default, for scale)",)
    assert classify("git push").decided_by == ("table: git push",)
    assert classify("python -m twine upload dist/x").decided_by == ("table: twine (default, for upload)",)


def test_decision_names_shell_constructs() -> None:
    assert classify("echo x > /etc/motd").decided_by == ("shell: redirection",)
    assert classify("X=1").decided_by == ("shell: assignment",)


def test_unknown_programs_are_named_only_when_they_alone_decide() -> None:
    assert classify("frobnicate --all").unknown_programs == ("frobnicate",)
    assert classify("./deploy.sh && ls").unknown_programs == ("./deploy.sh",)
    assert classify("python -m mytool run").unknown_programs == ("python -m mytool",)
    assert classify("frobnicate && rm -rf /opt/x").unknown_programs == ()  # the rm is a fork anyway
    assert classify("frobnicate && git push").unknown_programs == ()
    assert classify("pytest").unknown_programs == ()  # known: it runs code, a fork in any case


# ---------------------------------------------------------------------------------------------
# Users' rules files

RULES = """
[[rule]]
program = "deploy-tool"
subcommand = "push"
kind = "external"

[[rule]]
program = "deploy-tool"
kind = "none"
reason = "it only reads unless told to push"

[[rule]]
path = "/srv/data/**"
kind = "external"
reason = "an NFS share"

[[rule]]
path = "scratch/**"
kind = "none"

[[rule]]
program = "kubectl"
subcommand = "apply"
kind = "fork"
"""


@pytest.fixture
def rules_file(tmp_path: Path) -> Path:
    file = tmp_path / "rewind.toml"
    file.write_text(RULES)
    return file


@pytest.mark.parametrize(("kind", "command"), [
    (E, "deploy-tool push prod"),
    (E, "deploy-tool -v --env=prod push"),
    (E, "sudo deploy-tool push"),
    (E, "npx deploy-tool push"),
    (N, "deploy-tool status"),
    (N, "deploy-tool run push"),  # push is an argument of run here, not the subcommand
    (E, "cp x /srv/data/y"),
    (E, "rm -rf /srv/data"),
    (F, "rm -rf /srv/other"),
    (N, "rm -rf scratch/tmp"),
    (G, "rm -rf build"),
    (F, "kubectl -n prod apply -f k8s/"),
    (E, "kubectl delete pod x"),
])
def test_rules_come_before_the_table(rules_file: Path, kind: Kind, command: str) -> None:
    decision = classify(command, cwd=PROJECT, rules=read_rules(rules_file))
    assert decision.kind is kind, decision.reasons


def test_a_rule_is_named_as_what_decided(rules_file: Path) -> None:
    decision = classify("cp x /srv/data/y", cwd=PROJECT, rules=read_rules(rules_file))
    assert decision.decided_by == (f"rule: {rules_file}:12 #3",)  # the third [[rule]], on line 12
    assert decision.reasons == ("`cp x /srv/data/y` copies into /srv/data/y, declared external by a user's "
                                "rule: an NFS share (external)",)


def test_a_known_program_of_a_rule_is_no_longer_unknown(rules_file: Path) -> None:
    assert classify("python -m deploy-tool push", rules=read_rules(rules_file)).kind is E
    assert classify("deploy-tool push").unknown_programs == ("deploy-tool",)


def test_project_rules_come_before_the_users(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    project, config = tmp_path / "project", tmp_path / "config"
    (project / "sub").mkdir(parents=True)
    (config / "rewind").mkdir(parents=True)
    (project / "rewind.toml").write_text('[[rule]]\nprogram = "tool"\nkind = "git"\n')
    (config / "rewind" / "rewind.toml").write_text('[[rule]]\nprogram = "tool"\nkind = "external"\n'
                                                   '[[rule]]\nprogram = "other"\nkind = "none"\n')
    monkeypatch.setenv("XDG_CONFIG_HOME", str(config))
    rules = find_rules(project / "sub")  # found from a folder below the project's
    assert classify("tool", rules=rules).kind is G
    assert classify("other", rules=rules).kind is N
    assert classify("tool").kind is F and NO_RULES.rules == ()


@pytest.mark.parametrize(("text", "message"), [
    ("[[rule]\n", "not valid TOML"),
    ('[[rule]]\nprogram = "x"\nkind = "maybe"\n', ":1: rule #1: kind must be one of none, git, fork, "),
    ('[[rule]]\nprogram = "x"\nkind = "none"\n\n[[rule]]\nkind = "fork"\n', ":5: rule #2: give either"),
    ('[[rule]]\nprogram = "x"\npath = "/a"\nkind = "none"\n', "give either program or path"),
    ('[[rule]]\npath = "/a"\nsubcommand = "b"\nkind = "none"\n', "subcommand needs a program"),
    ('[[rule]]\nprogram = "x"\nkind = "none"\nkinds = "fork"\n', "unknown field 'kinds'"),
    ('[[rule]]\nprogram = 3\nkind = "none"\n', "program must be a non-empty string"),
    ('rule = 3\n', "`rule` must be an array of tables"),
    ('[rules]\n', "unknown table or key 'rules'"),
])
def test_bad_rules_files_are_refused_in_one_line(tmp_path: Path, text: str, message: str) -> None:
    file = tmp_path / "rewind.toml"
    file.write_text(text)
    with pytest.raises(InvalidArgument) as caught:
        read_rules(file)
    assert message in str(caught.value) and str(caught.value).startswith(str(file))
    assert "\n" not in str(caught.value)


# ---------------------------------------------------------------------------------------------
# The table of hosted services' tools (src/rewind/guard/tools.toml)

def test_tool_table_loads_and_every_row_names_its_reference() -> None:
    rows = tomllib.loads(files("rewind.guard").joinpath(tooltable.DATA).read_text())
    programs = [row for family in rows.values() for row in family.values() if isinstance(row, dict)]
    assert all(row["source"].startswith("https://") for row in programs)
    tool_families = tooltable.load()
    assert sum(len(family.programs) for family in tool_families.values()) >= 200
    assert all(FAMILIES[name] == family for name, family in tool_families.items())


def test_tool_table_names_no_program_of_the_hand_written_families() -> None:
    tools = {name for family in tooltable.load().values() for name in family.programs}
    by_hand = {name for key, family in FAMILIES.items() if key not in tooltable.load()
               for name in family.programs}
    assert tools and by_hand and not tools & by_hand


# (a command that only reads, one that changes the service, one that changes only this
# machine's settings for it, or None when the tool has none)
SERVICE_TOOLS = [
    ("stripe customers list", "stripe customers create --email a@b.c", "stripe login"),
    ("twilio api:core:messages:list", "twilio api:core:messages:create --to +1555 --body hi", "twilio login"),
    ("vonage apps list", "vonage apps create shop", "vonage auth set"),
    ("confluent kafka topic list", "confluent kafka topic create orders", "confluent login"),
    ("rpk cluster info", "rpk topic create orders", "rpk cloud login"),
    ("mmctl channel list team", "mmctl post create team:town --message hi", "mmctl auth login https://chat"),
    ("supabase migration list", "supabase db push", "supabase login"),
    ("neonctl branches list", "neonctl branches create --name dev", "neonctl auth"),
    ("turso db list", "turso db create app", "turso auth login"),
    ("pscale branch list app", "pscale deploy-request create app dev", "pscale auth login"),
    ("atlas clusters list", "atlas clusters create c1 --provider AWS", "atlas auth login"),
    ("fauna schema status", "fauna schema push", "fauna login"),
    ("hasura migrate status", "hasura metadata apply", "hasura update-cli"),
    ("databricks clusters list", "databricks clusters delete 0123", "databricks auth login"),
    ("snow object list table", "snow sql -q 'drop table t'", "snow connection add"),
    ("convex env list", "convex deploy", "convex login"),
    ("skopeo inspect docker://quay.io/x", "skopeo copy docker://a/x docker://b/x", "skopeo login quay.io"),
    ("crane ls gcr.io/p/x", "crane copy gcr.io/p/x gcr.io/q/x", "crane auth login gcr.io"),
    ("oras repo tags r.io/x", "oras push r.io/x:1 a.txt", "oras login r.io"),
    ("regctl tag ls r.io/x", "regctl image copy r.io/x r.io/y", "regctl registry login r.io"),
    ("cosign verify r.io/x", "cosign sign r.io/x", "cosign login r.io"),
    ("civo instance list", "civo instance create web", "civo apikey save k v"),
    ("stackit server list", "stackit server create --name web", "stackit auth login"),
    ("openstack server list", "openstack server delete web", None),
    ("azd env list", "azd up", "azd auth login"),
    ("sam logs -n fn", "sam deploy --guided", None),
    ("koyeb apps list", "koyeb apps create shop", "koyeb login"),
    ("platform environment:list", "platform environment:delete dev", "platform login"),
    ("surge list", "surge ./dist shop.surge.sh", "surge login"),
    ("velero backup get", "velero backup create nightly", "velero client config set namespace=x"),
    ("argo list", "argo submit wf.yaml", None),
    ("tkn pipeline list", "tkn pipeline start build", None),
    ("okteto namespace list", "okteto deploy", "okteto context use https://okteto.example"),
    ("rosa list clusters", "rosa create cluster --cluster-name c1", "rosa login --token t"),
    ("circleci config validate", "circleci context create github org ctx", "circleci setup"),
    ("bk build list", "bk build new", "bk configure"),
    ("drone build ls o/r", "drone build restart o/r 12", None),
    ("sentry-cli releases list", "sentry-cli releases new v1", "sentry-cli login"),
    ("newrelic nrql query -q 'SELECT 1'", "newrelic apm deployment create --revision 2",
     "newrelic profile add"),
    ("ldcli flags list", "ldcli flags toggle-on --flag beta", "ldcli login"),
    ("checkly env ls", "checkly deploy", "checkly login"),
    ("vault kv get secret/app", "vault kv put secret/app key=v", "vault login"),
    ("bw list items", "bw delete item 1f2e", "bw login"),
    ("auth0 apps list", "auth0 apps create", "auth0 login"),
    ("tsh ls", "tsh ssh root@node", "tsh login --proxy p.example"),
    ("consul kv get config/app", "consul kv put config/app x", "consul login -method oidc"),
    ("nomad job status", "nomad job run app.nomad", "nomad login"),
    ("snyk test", "snyk monitor", "snyk auth"),
    ("algolia indices list", "algolia indices delete products", "algolia profile add"),
    ("sanity dataset list", "sanity deploy", "sanity login"),
    ("shopify theme list", "shopify theme push", "shopify auth logout"),
    ("jira issue list", "jira issue create -s 'title'", "jira init"),
    ("cloudflared tunnel list", "cloudflared tunnel create web", "cloudflared tunnel login"),
    ("ngrok diagnose", "ngrok http 8000", "ngrok config add-authtoken t"),
    ("fastly service list", "fastly purge --all", "fastly profile create"),
    ("eas build:list", "eas submit -p ios", "eas login"),
    ("modal app list", "modal deploy app.py", "modal setup"),
    ("wandb artifact ls proj", "wandb sync run-dir", "wandb login"),
    ("kaggle datasets list", "kaggle competitions submit -c titanic -f s.csv", "kaggle config set -n k -v v"),
    ("huggingface-cli whoami", "huggingface-cli upload me/model .", "huggingface-cli login"),
    ("sky status", "sky launch task.yaml", "sky api login"),
    ("tailscale status", "tailscale funnel 443", None),
]


@pytest.mark.parametrize(("reads", "changes", "setting"), SERVICE_TOOLS,
                         ids=[reads.split()[0] for reads, _, _ in SERVICE_TOOLS])
def test_service_tools_read_change_the_service_or_only_this_machine(reads: str, changes: str,
                                                                     setting: str | None) -> None:
    tools = {name for family in tooltable.load().values() for name in family.programs}
    assert reads.split()[0] in tools
    assert classify(reads, cwd=PROJECT).kind is N
    assert classify(changes, cwd=PROJECT).kind is E
    assert setting is None or classify(setting, cwd=PROJECT).kind is F


def test_service_tools_sample_is_large_enough() -> None:
    assert len({reads.split()[0] for reads, _, _ in SERVICE_TOOLS}) >= 40


@pytest.mark.parametrize(("kind", "command"), [
    (E, "stripe customers create --description list"),  # a flag's value is no action
    (E, "stripe customers delete list"),
    (E, "infisical run --env=prod -- git push"),
    (F, "infisical run -- npm test"),
    (N, "tccli cvm DescribeInstances"),
    (E, "tccli cvm RunInstances --InstanceType S5"),
    (N, "octodns-sync --config-file dns.yaml"),
    (E, "octodns-sync --config-file dns.yaml --doit"),
    (N, "certbot renew --dry-run"),
    (E, "certbot renew"),
    (G, "dvc pull"),
    (E, "dvc push"),
    (F, "dvc repro"),
    (F, "kubectx prod"),
    (N, "kubectx"),
    (F, "act -j test"),
    (N, "act -l"),
    (E, "jsr publish"),
    (N, "jsr publish --dry-run"),
    (G, "supabase db diff -f init"),
    (F, "supabase start"),
    (F, "cd /tmp && supabase init"),
])
def test_service_tools_special_rows(kind: Kind, command: str) -> None:
    decision = classify(command, cwd=PROJECT)
    assert decision.kind is kind, decision.reasons


@pytest.mark.parametrize(("text", "message"), [
    ("[f\n", "tools.toml: not valid TOML"),
    ("f = 1\n", "tools.toml: f: a family must be a table of programs"),
    ('[f.x]\nreads = "list"\n', "tools.toml: x: source must be the https address"),
    ('[f.x]\nsource = "http://x.example/cli"\n', "tools.toml: x: source must be the https address"),
    ('[f.x]\nsource = "https://x.example"\ndefault = "maybe"\n', "x: default must be one of none, git, fork"),
    ('[f.x]\nsource = "https://x.example"\ngroups.db = { bare = "often" }\n', "x db: bare must be one of"),
    ('[f.x]\nsource = "https://x.example"\nreads = "a"\nsettings = "a"\n', "x: a is in two lists"),
    ('[f.x]\nsource = "https://x.example"\nkinds = "a"\n', "x: unknown field 'kinds'"),
    ('[f.x]\nsource = "https://x.example"\nreads = ["a"]\n', "x: reads must be a string"),
    ('[f.x]\nsource = "https://x.example"\ndepth = 0\n', "x: depth must be a whole number from 1"),
    ('[f.x]\nsource = "https://x.example"\n[g.x]\nsource = "https://x.example"\n', "x: defined twice"),
])
def test_bad_tool_tables_are_refused_naming_the_program(text: str, message: str) -> None:
    with pytest.raises(InvalidArgument, match=re.escape(message)):
        tooltable.load(text)
