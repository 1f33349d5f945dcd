"""Inline programs read as programs (node -e, deno eval, bun -e, perl -e, ruby -e), and
`rewind classify --explain` saying what decided each reason.

Pure Python: no machine is started.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from rewind.cli import cli
from rewind.errors import InvalidArgument
from rewind.guard.classify import Kind, classify
from rewind.guard.verdicts import explained

PROJECT = "/work/project"
N, G, F, E = Kind.NONE, Kind.GIT, Kind.FORK, Kind.EXTERNAL

JAVASCRIPT = [
    # reads and prints
    (N, """node -e "console.log(require('./package.json').version)" """),
    (N, """node -p "require('fs').readFileSync('VERSION', 'utf8').trim()" """),
    (N, """node -pe "JSON.parse(fs.readFileSync('package.json')).scripts" """),  # fs is a global in -e
    (N, """node -e "fs.writeSync(1, os.hostname())" """),  # to standard output
    (N, """deno eval "console.log(Deno.readTextFileSync('deno.json'))" """),
    (N, """bun -e "console.log(Bun.version, Bun.argv)" """),
    # writes inside the project
    (G, """node -e "require('fs').writeFileSync('dist/meta.json', '{}')" """),
    (G, """node -e "const {appendFileSync: add} = require('node:fs'); add('CHANGES.md', '- fix')" """),
    (G, """node -e "import('fs').then(m => m.promises.mkdir('build/cache', {recursive: true}))" """),
    (G, """deno eval "await Deno.writeTextFile('src/version.ts', 'export const V = 2')" """),
    (G, """bun -e "await Bun.write('public/robots.txt', 'User-agent: *')" """),
    (G, """bun -e "await Bun.file('tmp/old.log').delete()" """),
    # writes and removals elsewhere, or where only known at run time
    (F, """node -e "require('fs').rmSync('/var/lib/app', {recursive: true, force: true})" """),
    (F, """node -e "fs.rmSync('.', {recursive: true})" """),  # the project folder, with .git
    (F, """node -e "fs.writeFileSync(process.argv[1], 'x')" """),
    (F, """node -e "const w = fs.unlinkSync; ['a'].forEach(w)" """),  # handed on: arguments unknown
    (F, """node -e "process.chdir('/etc'); fs.writeFileSync('motd', 'hi')" """),
    (F, """deno eval "Deno.removeSync('/etc/app.conf')" """),
    (F, """bun -e "await Bun.write('/etc/hosts', '127.0.0.1 db')" """),
    # processes: the command they run decides
    (N, """node -e "require('child_process').execFileSync('git', ['status'])" """),
    (F, """node -e "require('child_process').execSync('apt-get install -y jq')" """),
    (E, """node -e "const {exec} = require('child_process'); exec('git push origin main')" """),
    (E, """node -e "require('child_process').spawn('npm publish', {shell: true})" """),
    (F, """node -e "require('child_process').exec(process.env.CMD)" """),
    (E, """deno eval "new Deno.Command('git', {args: ['push', '--tags']}).outputSync()" """),
    (E, """bun -e "Bun.spawnSync(['npm', 'publish'])" """),
    (N, """bun -e 'import {$} from "bun"; console.log(await $`git log -1`.text())'"""),
    # the network: a GET reads; other methods change what they reach
    (N, """node -e "fetch('https://registry.npmjs.org/react').then(r => r.json()).then(console.log)" """),
    (E, """node -e "fetch('https://api.example.com/items/3', {method: 'DELETE'})" """),
    (E, """node -e "require('axios').post('https://hooks.example.com/deploy', {ref: 'main'})" """),
    (E, """node -e "require('https').request({hostname: 'api.example.com', method: 'PUT'}).end()" """),
    (E, """node -e "fetch(new Request('https://api.example.com/x', {method: 'POST'}))" """),
    (F, """node -e "fetch('http://localhost:3000/reset', {method: 'POST'})" """),
    (E, """deno eval "await fetch('https://api.example.com/x', {method: 'POST', body: '{}'})" """),
    # what cannot be read is a fork
    (F, """node -e "const x = ;" """),
    (F, """node -e "$SNIPPET" """),
    (F, """node -e "require('./scripts/seed.js')" """),
    (F, """node -e "require('left-pad')" """),
    (F, """node --eval="eval(process.argv[1])" """),
    (F, """node -e "globalThis['ev' + 'al']('1')" """),
    (F, """node -e "''.constructor.constructor('return process')().exit()" """),
    (F, """node -e "[require('fs')].map(m => m.rmSync('/opt/app'))" """),
    (F, """node -r dotenv/config -e "console.log(1)" """),
    (F, """deno eval "const x: number = 1" """),  # TypeScript: not read as JavaScript
    (F, "node server.js"),
    (F, "bun run build"),
]

PERL = [
    (N, "perl -ne 'print if /TODO/' src/main.c"),
    (N, "perl -le 'print for 1..3'"),
    (N, """perl -e 'open(my $fh, "<", "notes.txt") or die; print <$fh>'"""),
    (N, """perl -MData::Dumper -e 'print Dumper(\\%ENV)'"""),
    (N, """perl -e 'print "no files to use\\n"'"""),
    (G, "perl -pi -e 's/foo/bar/g' lib/App.pm"),
    (G, """perl -e 'open(my $fh, ">", "notes.txt") or die; print $fh "x"'"""),
    (G, """perl -e 'unlink "build/out.o"'"""),
    (F, "perl -i -pe 's/^#//' /etc/ssh/sshd_config"),
    (F, """perl -e 'open(LOG, ">>/var/log/app.log"); print LOG "x"'"""),
    (F, """perl -e 'unlink glob("/tmp/*.lock")'"""),
    (N, """perl -e 'system("ls", "-la")'"""),
    (F, """perl -e 'my $out = `apt-get install -y jq`'"""),
    (E, """perl -e 'system("git push origin main") == 0 or die'"""),
    (E, """perl -MLWP::Simple -e 'getstore("https://example.com/x", "x")'"""),
    (E, """perl -MHTTP::Tiny -e 'print HTTP::Tiny->new->get("https://example.com")->{content}'"""),
    (F, """perl -e 'eval $ARGV[0]' 'print 1'"""),
    (F, """perl -e 'use Foo::Bar; Foo::Bar::run()'"""),
    (F, """perl -e "$CODE" """),
    (F, "perl script.pl"),
]

RUBY = [
    (N, """ruby -e 'puts File.read("Gemfile")'"""),
    (N, """ruby -e 'require "json"; puts JSON.parse(File.read("package.json"))["version"]'"""),
    (N, """ruby -rjson -e 'puts JSON.generate({a: 1})'"""),
    (N, """ruby -e 'File.open("README.md") { |f| puts f.read }'"""),
    (G, """ruby -e 'File.write("config/version.rb", "V = 2")'"""),
    (G, """ruby -e 'File.open("out.txt", "w") { |f| f.puts "x" }'"""),
    (G, """ruby -e 'require "fileutils"; FileUtils.mkdir_p("tmp/cache")'"""),
    (G, """ruby -pi -e 'gsub(/foo/, "bar")' lib/a.rb"""),
    (F, """ruby -e 'File.write("/etc/motd", "hi")'"""),
    (F, """ruby -e 'require "fileutils"; FileUtils.rm_rf("/var/lib/app")'"""),
    (F, """ruby -e 'require "tempfile"; Tempfile.create("x") { |f| f.write("y") }'"""),
    (F, """ruby -C /srv -e 'File.write("x", "y")'"""),
    (N, """ruby -e 'system("git", "status")'"""),
    (F, """ruby -e 'open("|rm -rf /tmp/x")'"""),
    (E, """ruby -e 'system("git push")'"""),
    (E, """ruby -e 'puts `npm publish`'"""),
    (E, """ruby -e 'require "net/http"; Net::HTTP.post(URI("https://api.example.com/x"), "{}")'"""),
    (E, """ruby -e 'require "open-uri"; puts URI.open("https://example.com").read'"""),
    (F, """ruby -e 'eval(ARGV[0])'"""),
    (F, """ruby -e 'Object.send(ARGV[0].to_sym, ARGV[1])'"""),
    (F, """ruby -e 'require "rails"'"""),
    (F, "ruby script.rb"),
]

CASES = JAVASCRIPT + PERL + RUBY


@pytest.mark.parametrize(("kind", "command"), CASES, ids=[command for _, command in CASES])
def test_inline_programs_are_judged_by_what_they_do(kind: Kind, command: str) -> None:
    decision = classify(command, cwd=PROJECT)
    assert decision.kind is kind, decision.reasons


def test_an_inline_decision_names_the_language_and_the_call() -> None:
    assert classify("node -e \"fs.writeFileSync('/etc/motd', 'hi')\"").decided_by == \
        ("inline: node: fs.writeFileSync(...)",)
    assert classify("python3 -c \"import shutil; shutil.rmtree('/srv')\"").decided_by == \
        ("inline: python: shutil.rmtree(...)",)
    assert classify("ruby -e 'File.delete(\"/etc/x\")'").decided_by == ("inline: ruby: File.delete(...)",)
    assert classify("node -e 'console.log(1)'").decided_by == ("inline: node: reads only",)
    assert classify("node -e 'console.log('").decided_by == ("inline: node: syntax error",)
    # a command the program runs is decided by its own entry, run by the call
    assert classify("bun -e \"Bun.spawnSync(['git', 'push'])\"").decided_by == \
        ("table: git push (via inline: bun: Bun.spawnSync(...))",)


@pytest.mark.parametrize(("source", "words"), [
    ("table: kubectl (default, for scale)", "the program table's entry for `kubectl (default, for scale)`"),
    ("rule: /app/rewind.toml:7 #2", "the user's rule at /app/rewind.toml:7 #2"),
    ("inline: node: fs.writeFileSync(...)", "the inline node program's call fs.writeFileSync(...)"),
    ("inline: perl: reads only", "the inline perl program, which only reads"),
    ("environment: DATABASE_URL", "the variable DATABASE_URL, which aims the client at another machine"),
    ("shell: redirection", "the shell itself (redirection)"),
    ("unknown program", "no table or rule: the program is unknown"),
    ("table: git push (via inline: node: execSync(...))",
     "the program table's entry for `git push`, run by the inline node program's call execSync(...)"),
])
def test_sources_are_explained_in_words(source: str, words: str) -> None:
    assert explained(source) == words


def test_classify_explain_on_the_command_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REWIND_URL", raising=False)
    rules = tmp_path / "rewind.toml"
    rules.write_text('# the team\'s tools\n\n[[rule]]\nprogram = "deploy-tool"\nkind = "external"\n')
    runner = CliRunner()

    def explain(command: str) -> list[str]:
        done = runner.invoke(cli, ["classify", "--explain", "--rules", str(rules), "--cwd", PROJECT, "--",
                                   command])
        assert done.exit_code == 0, done.output
        return done.output.splitlines()

    assert explain("node -e \"require('fs').rmSync('/var/lib/app', {recursive: true})\"") == [
        "fork",
        "  `node -e \"require('fs').rmSync('/var/lib/app', {recursive: true})\"` changes /var/lib/app, "
        "outside the project (fork)",
        "    decided by the inline node program's call require('fs').rmSync(...)"]
    assert explain("deploy-tool push")[2] == f"    decided by the user's rule at {rules}:3 #1"
    assert explain("git push")[2] == "    decided by the program table's entry for `git push`"
    assert explain("DATABASE_URL=postgres://db.example.net/shop alembic upgrade head")[2] == \
        "    decided by the variable DATABASE_URL, which aims the client at another machine"
    assert explain("perl -e 'system(\"git push\")'")[2] == \
        "    decided by the program table's entry for `git push`, run by the inline perl program's call " \
        "system(...)"
    plain = runner.invoke(cli, ["classify", "--rules", str(rules), "--", "git push"])
    assert plain.output.splitlines() == ["external", "  `git push` pushes to a remote repository (external)"]
    deno = "deno eval \"Deno.writeTextFileSync('/etc/x', '')\""
    shown = runner.invoke(cli, ["classify", "--json", "--", deno])
    assert json.loads(shown.output)["decided_by"] == ["inline: deno: Deno.writeTextFileSync(...)"]


# Pieces of the languages read, so that random programs reach deep into each reading
CODE_PIECES = st.lists(st.sampled_from([
    *"abx(){}[];,.=:'\"`$@#/\\|<>\n +-!?*&", "require", "import", "fs", "child_process", "exec", "spawn",
    "writeFileSync", "rmSync", "fetch", "method", "Deno", "Bun", "then", "=>", "await", "constructor",
    "system", "open", "unlink", "File", "FileUtils", "eval", "send", "qx", "%x", "use ", "-|", "'/etc/x'",
    "'src/a'", "'git push'", "\U0010ffff"]), max_size=40).map("".join)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["node -e", "deno eval", "bun -e", "perl -e", "ruby -e", "python3 -c"]),
       st.one_of(st.text(), CODE_PIECES))
def test_any_inline_program_is_classified(runner: str, code: str) -> None:
    try:
        decision = classify(f"{runner} {shlex.quote(code)}", cwd=PROJECT)
    except InvalidArgument:
        return
    assert decision.reasons and len(decision.reasons) == len(decision.decided_by)
