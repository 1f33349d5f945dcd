"""The kinds of entry in the program table (rewind.guard.programs), and the verdicts many
programs share.

An entry is called with one program's run (a Call: its name, arguments and shell) and returns
the verdicts (Rules) that apply to it; a Rule is itself an entry that always gives itself.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from rewind.guard.verdicts import Kind, Rule
from rewind.guard.words import HERE, NO_OPTIONS, UNKNOWN, Options, Word, file_words, literal, remote_url

if TYPE_CHECKING:
    from rewind.guard.call import Call

Entry = Callable[["Call"], list["Rule"]]

# Verdicts many programs share
READS = Rule(Kind.NONE, "only reads")
USAGE = Rule(Kind.NONE, "only prints its usage")
SHELL_STATE = Rule(Kind.NONE, "only changes the shell's own state")
PACKAGES = Rule(Kind.FORK, "installs or removes packages")
RUNS_CODE = Rule(Kind.FORK, "runs code whose effect cannot be known")
SERVICES = Rule(Kind.FORK, "changes system services")
PROCESSES = Rule(Kind.FORK, "signals or stops running processes")
SETTINGS = Rule(Kind.FORK, "changes settings outside the project")
SYSTEM = Rule(Kind.FORK, "changes the system's configuration")
DATABASE = Rule(Kind.FORK, "can change a database")
OWNERSHIP = Rule(Kind.FORK, "changes file ownership or attributes, which git does not record")
EDITOR = Rule(Kind.FORK, "opens an editor that can change any file")
REPO = Rule(Kind.GIT, "changes the repository or its work tree")
FOLDER = Rule(Kind.GIT, "writes files in the current folder")
MANIFEST = Rule(Kind.GIT, "edits the project's manifest (package.json, pyproject.toml) here")
PUBLISHES = Rule(Kind.EXTERNAL, "publishes to a remote registry")
PUSHES = Rule(Kind.EXTERNAL, "pushes to a remote repository")
REMOTE = Rule(Kind.EXTERNAL, "changes a remote system")
ANOTHER_MACHINE = Rule(Kind.EXTERNAL, "acts on another machine")
MAIL = Rule(Kind.EXTERNAL, "sends email")
SCHEDULES = Rule(Kind.FORK, "changes scheduled jobs")


@dataclass(frozen=True)
class Family:
    """Programs of one kind, and where what their entries say comes from."""

    programs: dict[str, Entry]
    sources: tuple[str, ...] = ()


@dataclass(frozen=True)
class Writer:
    """A program whose effect is changing the files it names: its operands (which ones:
    `written`) and the values of `target_flags`, as in `cp -t DIR`."""

    verb: str
    options: Options = NO_OPTIONS
    written: Literal["all", "last", "first", "second", "none"] = "all"
    target_flags: tuple[str, ...] = ()
    removes: bool = False  # it takes its files away: naming the project folder takes .git too

    def __call__(self, call: Call) -> list[Rule]:
        parsed = self.options.parse(call.args)
        ops = parsed.operands
        chosen = {"all": ops, "last": ops[-1:], "first": ops[:1], "second": ops[1:2],
                  "none": []}[self.written]
        return [call.writes([*chosen, *parsed.values(*self.target_flags)], self.verb, self.removes)]


@dataclass(frozen=True)
class Subcommands:
    """A program whose first operand picks what it does (`apt install`, `kubectl get`).

    `verbs` maps a subcommand (or a flag acting as one, as dpkg's `-l`) to its entry, which
    may be another Subcommands; other subcommands go to `default`, and no subcommand to
    `bare` (each given the arguments from the subcommand on). Flags before the subcommand are
    skipped, with their value when in `value_flags`.
    """

    verbs: Mapping[str, Entry]
    default: Entry
    bare: Entry | None = None  # None: the program alone prints its usage
    value_flags: frozenset[str] = frozenset()

    def __call__(self, call: Call) -> list[Rule]:
        i = 0
        while i < len(call.args):
            text = call.args[i].text
            if text in self.verbs:
                verb = call.shifted(call.args[i + 1:], entry=f"{call.entry} {text}")
                return [rule.sourced(f"table: {verb.entry}") for rule in self.verbs[text](verb)]
            if text is None or not text.startswith("-"):
                other = self.default(call.shifted(call.args[i:]))
                return [rule.sourced(f"table: {call.entry} (default, for {text or '?'})") for rule in other]
            i += 2 if text in self.value_flags else 1
        return (self.bare or USAGE)(call)


@dataclass(frozen=True)
class Wrapper:
    """A program that runs the command after its own flags (`sudo`, `env`, `xargs`): that
    command decides."""

    options: Options = NO_OPTIONS
    leading: int = 0  # operands before the command: timeout's DURATION
    assignments: bool = False  # NAME=value words may come before the command
    dir_flags: tuple[str, ...] = ()  # flags that set the command's folder: env -C DIR
    flag_rules: Mapping[str, Rule] = field(default_factory=dict)  # flags that decide alone: sudo -e
    feeds_args: bool = False  # xargs: the command gets more arguments, only known at run time
    bare: Rule | None = None  # the wrapper alone; None: it only reads

    def __call__(self, call: Call) -> list[Rule]:
        parsed = self.options.parse(call.args, permute=False)
        for flag, rule in self.flag_rules.items():
            if parsed.has(flag):
                return [rule]
        command = parsed.operands
        rules = []
        shell = call.shell
        while self.assignments and command and assigned(command[0]):
            name, text = assigned(command[0]), command[0].text or ""
            if name in RISKY_VARIABLES:
                rules.append(risky_variable(name))
            target = remote_target(name, literal(text.partition("=")[2]))
            shell = shell if target is None else shell.aimed_at(target)
            command = command[1:]
        command = command[self.leading:]
        if not command:
            return [*rules, self.bare or READS]
        for folder in parsed.values(*self.dir_flags):
            shell = shell.moved(folder)
        call.run([*command, UNKNOWN] if self.feeds_args else command, shell)
        return rules


def assigned(word: Word) -> str:
    """The variable a NAME=value word sets, or ''."""
    name, equals, _ = (word.text or "").partition("=")
    return name if equals and name.isidentifier() else ""


@dataclass(frozen=True)
class Topics:
    """A CLI whose commands are TOPIC[:ACTION] (heroku ps:scale, firebase hosting:disable): a
    command in `commands` is judged as given; a topic alone in `read_topics`, or any command
    whose last action is in `read_actions`, only reads; the rest goes to `default`."""

    commands: Mapping[str, Entry]
    read_topics: frozenset[str]
    read_actions: frozenset[str]
    default: Entry

    def __call__(self, call: Call) -> list[Rule]:
        commands = [(i, w.text) for i, w in enumerate(call.args) if not (w.text or "").startswith("-")]
        if not commands:
            return USAGE(call)
        i, text = commands[0]
        rest = call.shifted(call.args[i + 1:], entry=f"{call.entry} {text or '?'}")
        if text in self.commands:
            entry = self.commands[text]
        else:
            topic, colon, _ = (text or "").partition(":")
            action = (text or "").rpartition(":")[2] if colon else ""
            entry = READS if (not colon and topic in self.read_topics) or action in self.read_actions \
                else self.default
        return [rule.sourced(f"table: {rest.entry}") for rule in entry(rest)]


def topics(commands: Mapping[str, Entry], read_topics: str, read_actions: str, default: Entry) -> Topics:
    return Topics(commands, word_set(read_topics), word_set(read_actions), default)


@dataclass(frozen=True)
class Resources:
    """A CLI whose commands are RESOURCE... ACTION (stripe customers list, neonctl branches
    create): the command only reads when one of the `depth` words after the first `named`
    (the resource's name; 0 when a subcommand already named it: velero backup get) is in
    `actions` (or starts with one of `prefixes`: tccli's DescribeInstances), and goes to
    `default` otherwise. Only the words before the first flag count, so that a flag's value
    (--name list) is never taken for an action."""

    actions: frozenset[str]
    default: Entry
    depth: int = 1
    prefixes: tuple[str, ...] = ()
    named: int = 1

    def __call__(self, call: Call) -> list[Rule]:
        words: list[str] = []
        for word in call.args:
            if word.text is None or word.text.startswith("-"):
                break
            words.append(word.text)
        after = words[self.named:self.named + self.depth]
        reads = self.actions.intersection(after) or any(word.startswith(self.prefixes) for word in after)
        return (READS if reads else self.default)(call)


@dataclass(frozen=True)
class Given:
    """A program judged by `rule` when one of `words` (a flag or an operand, as written or
    before its `=`) is given, and by `otherwise` when none is."""

    words: frozenset[str]
    rule: Entry
    otherwise: Entry = READS

    def __call__(self, call: Call) -> list[Rule]:
        return (self.rule if given(call) & self.words else self.otherwise)(call)


def given(call: Call) -> set[str]:
    """The words of a call, each as written and before its `=` (--dry-run=client, --dry-run)."""
    return {text for word in call.args if word.text for text in (word.text, word.text.partition("=")[0])}


@dataclass(frozen=True)
class VersionBump:
    """A project tool's `version` verb (poetry version, hatch version, npm version): alone it
    prints the version; given one, or a bump, it writes it into the manifest (npm and yarn 1
    then also commit and tag, which the git tier takes back). `then`: what else a bump does
    (uv locks and syncs the environment), instead of only the manifest. `asks`: given no
    version, it asks for one and writes it (yarn 1) rather than printing the current one."""

    bump_flags: frozenset[str] = frozenset()
    then: Entry | None = None
    asks: bool = False

    def __call__(self, call: Call) -> list[Rule]:
        texts = [word.text for word in call.args]
        flags = {(t or "").partition("=")[0] for t in texts}
        bumps = self.asks or flags & self.bump_flags or any(t is None or not t.startswith("-") for t in texts)
        if not bumps:
            return [READS]
        if self.then is not None:
            return self.then(call)
        return [call.locally(MANIFEST)]


def reads_unless(words: str, rule: Entry) -> Given:
    return Given(word_set(words), rule)


def unless_dry_run(entry: Entry, flags: str = "--dry-run") -> Given:
    """`entry`, but only reading with a dry-run flag (npm publish --dry-run)."""
    return Given(word_set(flags), READS, otherwise=entry)


@dataclass(frozen=True)
class Rewrites:
    """A formatter or fixer: it rewrites the files it is given in place (black, prettier --write,
    gofmt -w), or `default` when given none (ruff walks the current folder); none and no
    default: it reads its input and prints.

    It writes always, or only with one of the flags in `writes`; never with one in `checks`.
    Flags are matched as written (before any `=`), so single-dash long flags (terraform fmt
    -check) work too. `options` names the flags that take a value, so values are not files.
    """

    writes: frozenset[str] = frozenset()  # empty: it always writes
    checks: frozenset[str] = frozenset()
    options: Options = NO_OPTIONS
    default: Word | None = None

    def __call__(self, call: Call) -> list[Rule]:
        flags = given(call)
        if (self.writes and not flags & self.writes) or flags & self.checks:
            return [READS]
        parsed = self.options.parse(call.args)
        files = file_words(parsed.operands) or ([self.default] if self.default else [])
        return [call.writes(files, "rewrites in place")] if files else [READS]


def rewrites(writes: str = "", checks: str = "", options: Options = NO_OPTIONS,
             default: Word | None = None) -> Rewrites:
    """A Rewrites entry from blank-separated flag lists."""
    return Rewrites(word_set(writes), word_set(checks), options, default)


rewrites_here = functools.partial(rewrites, default=HERE)  # tools that walk the current folder


def word_set(words: str) -> frozenset[str]:
    return frozenset(words.split())


def each(words: str, entry: Entry) -> dict[str, Entry]:
    """`entry` for each of the blank-separated `words`: a table's rows for programs or verbs alike."""
    return dict.fromkeys(words.split(), entry)


def verbs(reads: str, default: Entry, bare: Entry | None = None, **more: Entry) -> Subcommands:
    """Subcommands where the verbs in `reads` only read, those in `more` are judged as given
    (run_script stands for run-script), and the others get `default`."""
    return Subcommands({**each(reads, READS), **{k.replace("_", "-"): v for k, v in more.items()}},
                       default=default, bare=bare)


package_manager = functools.partial(verbs, default=PACKAGES)  # verbs that do not read change packages
forge = functools.partial(verbs, default=REMOTE)  # verbs that do not read change the forge


# Variables that change what programs run (LD_PRELOAD, GIT_PAGER) or where they work (GIT_DIR)
RISKY_VARIABLES = frozenset({
    "LD_PRELOAD", "LD_LIBRARY_PATH", "LD_AUDIT", "BASH_ENV", "ENV", "PROMPT_COMMAND", "GIT_SSH_COMMAND",
    "GIT_SSH", "GIT_PROXY_COMMAND", "GIT_EXTERNAL_DIFF", "GIT_PAGER", "PAGER", "MANPAGER", "GIT_EDITOR",
    "EDITOR", "VISUAL", "GIT_ASKPASS", "SSH_ASKPASS", "GIT_DIR", "GIT_WORK_TREE", "GIT_CONFIG_PARAMETERS",
    "GIT_CONFIG_GLOBAL", "GIT_CONFIG_SYSTEM", "GIT_CONFIG_COUNT", "GIT_EXEC_PATH", "LESSOPEN", "LESSCLOSE",
    "NODE_OPTIONS", "PERL5OPT", "RUBYOPT"})


def risky_variable(name: str) -> Rule:
    return Rule(Kind.FORK, f"sets {name}, which changes what programs run or where they work")


# Variables from which clients take the system they act on: a database migration run with
# DATABASE_URL naming another host changes that host's database, whatever the tool's entry says.
TARGET_VARIABLES = frozenset({
    "DATABASE_URL", "DB_URL", "DB_HOST", "PGHOST", "PGHOSTADDR", "MYSQL_HOST", "MYSQL_URL", "MONGO_URL",
    "MONGO_URI", "MONGODB_URI", "MONGODB_URL", "REDIS_URL", "REDIS_HOST", "AMQP_URL", "RABBITMQ_URL",
    "CELERY_BROKER_URL", "BROKER_URL", "KAFKA_BOOTSTRAP_SERVERS", "ELASTICSEARCH_URL", "OPENSEARCH_URL",
    "CLICKHOUSE_HOST", "CLICKHOUSE_URL", "DOCKER_HOST", "CONTAINER_HOST", "KUBECONFIG", "NOMAD_ADDR",
    "VAULT_ADDR", "CONSUL_HTTP_ADDR", "SUPABASE_URL", "FIREBASE_DATABASE_URL"})


def remote_target(name: str, value: Word) -> str | None:
    """`NAME=value` if setting `name` to `value` points a client at another machine: the value
    names another host or is only known at run time (KUBECONFIG's file always names a
    cluster); else None."""
    if name in TARGET_VARIABLES and (name == "KUBECONFIG" or remote_url(value)):
        return f"{name}={value.text if value.text is not None else '...'}"
    return None


def aimed(rule: Rule, target: str) -> Rule:
    """A command's verdict once a variable points it at another machine: what would change
    here (a fork) changes there; reads stay reads."""
    if rule.kind is not Kind.FORK:
        return rule
    return Rule(Kind.EXTERNAL, f"{rule.why}, on the machine {target} names, where no snapshot can take "
                               "it back", "environment: " + target.partition("=")[0])


def request_rule(remote: bool, method: str) -> Rule:
    if remote:
        return Rule(Kind.EXTERNAL, f"sends a {method} request to another machine")
    return Rule(Kind.FORK, f"sends a {method} request to a service on this machine")


def unknown(name: str, why: str) -> Rule:
    """The verdict on a program no rule or table knows: a fork, marked so it can be watched."""
    return Rule(Kind.FORK, why, "unknown program", unknown=name)
