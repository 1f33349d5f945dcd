"""Handlers: programs whose effect depends on their arguments in ways a table cannot say.

Each is an entry of the program table (rewind.guard.programs), or makes one (copier, git):
called with a program's run (a Call), it returns the verdicts that apply to it.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rewind.guard.entries import (
    ANOTHER_MACHINE,
    DATABASE,
    PACKAGES,
    PUSHES,
    READS,
    REPO,
    RUNS_CODE,
    SERVICES,
    SETTINGS,
    SHELL_STATE,
    SYSTEM,
    USAGE,
    Entry,
    request_rule,
    unknown,
    word_set,
)
from rewind.guard.inline import inline_python
from rewind.guard.inline_js import inline_js
from rewind.guard.inline_perl_ruby import inline_script
from rewind.guard.verdicts import Kind, Rule
from rewind.guard.words import (
    HERE,
    MAX_ALTERNATIVES,
    NO_OPTIONS,
    UNKNOWN,
    Options,
    Parsed,
    Word,
    file_words,
    folder_of,
    hosts,
    is_local,
    literal,
    remote_path,
    remote_url,
)

if TYPE_CHECKING:
    from rewind.guard.call import Call

# python -m NAME runs the program NAME, but for these
_MODULE_PROGRAMS = {"pip3": "pip"}


def change_folder(call: Call) -> list[Rule]:
    folders = [word for word in call.args if not (word.text or "").startswith("-") or word.text == "-"]
    call.shell.here = folder_of(folders[0], call.shell.here) if folders else None  # `cd` alone goes home
    return [Rule(Kind.NONE, "changes the shell's folder")]


def pop_folder(call: Call) -> list[Rule]:
    call.shell.here = None
    return [Rule(Kind.NONE, "changes the shell's folder")]


_READ_OPTIONS = Options(short_values="adinNptu")


def read_variables(call: Call) -> list[Rule]:
    for word in _READ_OPTIONS.parse(call.args).operands:
        call.shell.variables[word.text or ""] = None  # its value comes from the input
    return [SHELL_STATE]


def trap(call: Call) -> list[Rule]:
    operands = NO_OPTIONS.parse(call.args).operands
    if len(operands) > 1:
        call.shell_code(operands[0])  # the action runs later, on the signal
    return [SHELL_STATE]


_SHELL_OPTIONS = Options(short_values="oO", long_values=frozenset({"--rcfile", "--init-file"}))


def run_shell(call: Call) -> list[Rule]:
    parsed = _SHELL_OPTIONS.parse(call.args, permute=False)
    if parsed.has("-c"):
        if parsed.operands:
            call.shell_code(parsed.operands[0])
        return [Rule(Kind.FORK, "runs a string of shell code")]
    if parsed.has("-n"):
        return [Rule(Kind.NONE, "only checks a script's syntax")]
    if parsed.operands:
        return [Rule(Kind.FORK, "runs a shell script")]
    return [Rule(Kind.FORK, "runs shell commands from its input")]


def eval_string(call: Call) -> list[Rule]:
    texts = [word.text for word in call.args]
    if call.args and None not in texts:
        call.shell_code(literal(" ".join(t for t in texts if t is not None)))
    return [Rule(Kind.FORK, "runs a string as shell code")]


_SU_OPTIONS = Options(short_values="cgGsw", long_values=frozenset({"--command", "--group", "--shell"}),
                      aliases={"--command": "-c"})


def su(call: Call) -> list[Rule]:
    code = _SU_OPTIONS.parse(call.args).values("-c")
    if not code:
        return [Rule(Kind.FORK, "opens a shell as another user")]
    call.shell_code(code[-1])
    return [Rule(Kind.FORK, "runs shell code as another user")]


_PYTHON_OPTIONS = Options(short_values="cmWXQ")


def python(call: Call) -> list[Rule]:
    parsed = _PYTHON_OPTIONS.parse(call.args, permute=False)
    module = parsed.value("-m")
    if module is not None:  # python -m twine upload: judged as twine upload
        program = _MODULE_PROGRAMS.get(module, module)
        if call.knows(program):
            call.run([literal(program), *_after_module(call.args)])
            return []
        return [unknown(f"python -m {module}", f"runs the Python module {module}; its effect is not known")]
    if parsed.has("-c"):
        return inline_python(call, parsed.value("-c"))
    if parsed.has("-V") and not parsed.operands:
        return [Rule(Kind.NONE, "only prints its version")]
    return [RUNS_CODE]


@dataclass(frozen=True)
class Evaluates:
    """A JavaScript runtime given inline code by `-e CODE`, `--eval=CODE` or `-p CODE` (print
    its value; `-pe` is both) before its first operand: node, bun. The code is read; a module
    preloaded with it (`-r`) is not known. Without such a flag, `otherwise` judges."""

    runtime: str
    options: Options  # its flags, with the value of each that takes one, so a value is not code
    otherwise: Entry
    dir_flags: tuple[str, ...] = ()  # bun --cwd DIR

    def __call__(self, call: Call) -> list[Rule]:
        words = [literal("-e") if word.text in ("-pe", "-ep") else word for word in call.args]
        parsed = self.options.parse(words, permute=False)
        if not parsed.has("-e", "-p"):
            return self.otherwise(call)
        for folder in parsed.values(*self.dir_flags):
            call = call.shifted(call.args, call.shell.moved(folder))
        preloads = [Rule(Kind.FORK, "preloads a module, whose effect is not known here")] \
            if parsed.has("-r", "--import", "--loader", "--experimental-loader") else []
        return [*preloads, *(rule for code in parsed.values("-e", "-p") for rule in
                             inline_js(call, self.runtime, code.text))]


_DENO_EVAL_OPTIONS = Options(short_values="cL", long_values=word_set(
    "--ext --config --import-map --cert --location --seed --log-level"))


def deno_eval(call: Call) -> list[Rule]:
    """deno eval [OPTIONS] CODE [ARGS]: the code is read."""
    operands = _DENO_EVAL_OPTIONS.parse(call.args, permute=False).operands
    return inline_js(call, "deno", operands[0].text) if operands else [USAGE]


def _after_module(args: list[Word]) -> list[Word]:
    """The arguments after `-m MODULE`: they are the module's, flags included."""
    for i, word in enumerate(args):
        text = word.text or ""
        if text == "-m":
            return args[i + 2:]
        if text.startswith("-m"):
            return args[i + 1:]
    return []


def _edits_in_place(call: Call, options: Options, script_flags: tuple[str, ...]) -> list[Rule]:
    """sed -i, yq -i: the files after the script are edited; the script is the first
    operand unless given by one of `script_flags`."""
    parsed = options.parse(call.args)
    if not parsed.has("-i"):
        return [READS]
    edited = parsed.operands if parsed.has(*script_flags) else parsed.operands[1:]
    return [call.writes(edited, "edits")]


_SED_OPTIONS = Options(short_values="efl", long_values=frozenset({"--expression", "--file", "--line-length"}),
                       optional="i", aliases={"--in-place": "-i", "--expression": "-e", "--file": "-f"})


def sed(call: Call) -> list[Rule]:
    return _edits_in_place(call, _SED_OPTIONS, ("-e", "-f"))


_PERL_OPTIONS = Options(short_values="eEIMm", optional="ixCdDF")  # -l and -0 take only digits: -le is -l -e
_RUBY_OPTIONS = Options(short_values="eIrCE", optional="FKTWx0i",
                        long_values=word_set("--encoding --external-encoding --internal-encoding"))


def perl(call: Call) -> list[Rule]:
    return _script(call, "perl", _PERL_OPTIONS.parse(call.args, permute=False), ("-e", "-E"), ("-M", "-m"))


def ruby(call: Call) -> list[Rule]:
    parsed = _RUBY_OPTIONS.parse(call.args, permute=False)
    for folder in parsed.values("-C"):  # ruby -C DIR: it runs there
        call = call.shifted(call.args, call.shell.moved(folder))
    return _script(call, "ruby", parsed, ("-e",), ("-r",))


def _script(call: Call, language: str, parsed: Parsed, code_flags: tuple[str, ...],
            module_flags: tuple[str, ...]) -> list[Rule]:
    """perl or ruby with its program given by `-e` (several join into one): the program is read;
    `-i` edits the files after it in place. A program from a file or the input is not known."""
    codes = [word.text for word in parsed.values(*code_flags)]
    if not codes:
        return [RUNS_CODE]
    code = None if None in codes else "\n".join(text or "" for text in codes)
    rules = inline_script(call, language, code, [word.text for word in parsed.values(*module_flags)])
    return [*rules, call.writes(parsed.operands, "edits")] if parsed.has("-i") else rules


_YQ_OPTIONS = Options(short_values="pPoIe", aliases={"--inplace": "-i"})


def yq(call: Call) -> list[Rule]:
    return _edits_in_place(call, _YQ_OPTIONS, ())


_AWK_OPTIONS = Options(short_values="FvfiEle", long_values=frozenset({"--file", "--include", "--assign",
                                                                       "--field-separator", "--source"}),
                       aliases={"--file": "-f", "--include": "-i", "--assign": "-v", "--source": "-e"})
# print > "file", print | "cmd", "cmd" | getline, system(): an awk program that writes or runs things
_AWK_EFFECTS = re.compile(r"\bsystem\s*\(|\|\s*&?\s*getline|\bprintf?\b[^;{}]*[>|]")


def awk(call: Call) -> list[Rule]:
    parsed = _AWK_OPTIONS.parse(call.args)
    if parsed.has("-f"):
        return [Rule(Kind.FORK, "runs an awk program from a file")]
    programs = parsed.values("-e") or parsed.operands[:1]
    if any(p.text is None or _AWK_EFFECTS.search(p.text) for p in programs):
        return [Rule(Kind.FORK, "runs an awk program that can write files or run commands")]
    if "inplace" in (parsed.value("-i") or ""):
        return [call.writes(parsed.operands[0 if parsed.has("-e") else 1:], "edits")]
    return [READS]


_FIND_EXEC = ("-exec", "-execdir", "-ok", "-okdir")
_FIND_WRITES = ("-fprint", "-fprint0", "-fprintf", "-fls")


def find(call: Call) -> list[Rule]:
    """find [-H -L -P -D X -OX] [START...] EXPRESSION: what -exec runs, -delete and -fprint decide,
    each for the files under the starting points."""
    args = call.args
    i = 0
    while i < len(args) and (args[i].text or "")[:2] in ("-H", "-L", "-P", "-D", "-O"):
        i += 2 if args[i].text == "-D" else 1
    starts: list[Word] = []
    while i < len(args) and not (args[i].text and args[i].text[0] in "-(!),"):  # the expression begins
        starts.append(args[i])
        i += 1
    starts = starts or [HERE]
    # {} stands for a file under one of the starting points
    under = [posixpath.join(value, "*") for start in starts for value in start.values or ("",)]
    found = UNKNOWN if any(start.values is None for start in starts) or len(under) > MAX_ALTERNATIVES \
        else Word(tuple(under))
    rules: list[Rule] = []
    while i < len(args):
        action = args[i].text
        if action in _FIND_EXEC:
            end = next((j for j in range(i + 1, len(args)) if args[j].text in (";", "+")), len(args))
            command = [_substitute(word, found) for word in args[i + 1:end]]
            if command and action.endswith("dir"):  # run from the found file's folder
                call.run(command, call.shell.moved(starts[0] if len(starts) == 1 else UNKNOWN))
            elif command:
                call.run(command)
            i = end
        elif action == "-delete":
            rules.append(call.writes(starts, "deletes files under"))
        elif action in _FIND_WRITES and i + 1 < len(args):
            rules.append(call.writes(args[i + 1:i + 2], "writes"))
        i += 1
    return rules or [READS]


def _substitute(word: Word, found: Word) -> Word:
    if word.values is None or not any("{}" in value for value in word.values):
        return word
    if found.values is None:
        return UNKNOWN
    return Word(tuple(v.replace("{}", f) for v in word.values for f in found.values))


_CHMOD_OPTIONS = Options(long_values=frozenset({"--reference"}))


def chmod(call: Call) -> list[Rule]:
    """chmod MODE FILE...: the mode is the first operand, unless --reference gives it or it was
    written like a flag (chmod -x FILE)."""
    parsed = _CHMOD_OPTIONS.parse(call.args)
    mode_given = parsed.has("--reference") or \
        any(re.fullmatch(r"-[rwxXst]+", word.text or "") for word in call.args)
    return [call.writes(parsed.operands if mode_given else parsed.operands[1:], "changes the mode of")]


_TAR_OPTIONS = Options(
    short_values="fCbTXgHIKLNV",
    long_values=frozenset({"--file", "--directory", "--files-from", "--exclude-from", "--to-command",
                           "--use-compress-program", "--exclude", "--transform", "--owner", "--group"}),
    aliases={"--extract": "-x", "--get": "-x", "--create": "-c", "--append": "-r", "--update": "-u",
             "--catenate": "-A", "--concatenate": "-A", "--list": "-t", "--file": "-f", "--directory": "-C",
             "--to-stdout": "-O", "--use-compress-program": "-I"})


def tar(call: Call) -> list[Rule]:
    args = call.args
    first = args[0].text if args else None
    if first and not first.startswith("-"):
        args = [literal("-" + first), *args[1:]]  # the old style: tar xzf a.tgz
    parsed = _TAR_OPTIONS.parse(args)
    if parsed.has("-I", "--to-command"):
        return [RUNS_CODE]
    if parsed.has("-x") and not parsed.has("-O"):
        return [call.writes(parsed.values("-C")[-1:] or [HERE], "extracts an archive into")]
    if parsed.has("-c", "-r", "-u", "-A", "--delete"):
        return [call.writes(file_words(parsed.values("-f")), "writes the archive")]
    return [READS]


_UNZIP_OPTIONS = Options(short_values="dP")


def unzip(call: Call) -> list[Rule]:
    parsed = _UNZIP_OPTIONS.parse(call.args)
    if parsed.has("-l", "-t", "-v", "-p", "-c", "-z", "-Z"):
        return [READS]
    return [call.writes(parsed.values("-d") or [HERE], "extracts an archive into")]


_COMPRESS_OPTIONS = Options(short_values="So", long_values=frozenset({"--suffix"}),
                            aliases={"--stdout": "-c", "--to-stdout": "-c", "--list": "-l", "--test": "-t"})


def compressor(call: Call) -> list[Rule]:
    parsed = _COMPRESS_OPTIONS.parse(call.args)
    files = file_words(parsed.operands)
    if parsed.has("-c", "-l", "-t") or not files:
        return [READS]  # standard input to standard output, or a look at an archive
    return [call.writes([*files, *parsed.values("-o")], "replaces")]


_PATCH_OPTIONS = Options(short_values="pdoiBrDFVYzg", aliases={"--directory": "-d", "--output": "-o",
                                                                  "--input": "-i"})


def patch(call: Call) -> list[Rule]:
    parsed = _PATCH_OPTIONS.parse(call.args)
    if parsed.has("--dry-run", "--check", "-C"):  # -C: BSD patch's --check
        return [READS]
    # the files named in the patch, under -d DIR or here; or the file given; or -o FILE
    named = parsed.values("-o") or parsed.operands[:1] or parsed.values("-d") or [HERE]
    return [call.writes(named, "patches")]


def dd(call: Call) -> list[Rule]:
    outputs = [literal(word.text[3:]) if word.text else UNKNOWN
               for word in call.args if word.text is None or word.text.startswith("of=")]
    return [call.writes(outputs, "writes")] if outputs else [READS]


_CURL_OPTIONS = Options(
    short_values="AbcCdDeEFHKmoPQrTtuUwxXyYz",
    long_values=frozenset({
        "--data", "--data-raw", "--data-binary", "--data-ascii", "--data-urlencode", "--json", "--form",
        "--form-string", "--upload-file", "--request", "--output", "--output-dir", "--header", "--user",
        "--user-agent", "--url", "--cookie", "--cookie-jar", "--dump-header", "--config", "--max-time",
        "--connect-timeout", "--retry", "--retry-delay", "--retry-max-time", "--proxy", "--referer", "--cert",
        "--key", "--cacert", "--capath", "--write-out", "--range", "--resolve", "--connect-to", "--interface",
        "--limit-rate", "--trace", "--trace-ascii", "--stderr", "--etag-save", "--etag-compare",
        "--time-cond", "--continue-at", "--max-filesize", "--oauth2-bearer", "--aws-sigv4", "--variable"}),
    aliases={"--data": "-d", "--data-raw": "-d", "--data-binary": "-d", "--data-ascii": "-d",
             "--data-urlencode": "-d", "--json": "-d", "--form": "-F", "--form-string": "-F",
             "--upload-file": "-T", "--request": "-X", "--output": "-o", "--remote-name": "-O",
             "--remote-name-all": "-O", "--head": "-I", "--get": "-G", "--dump-header": "-D",
             "--cookie-jar": "-c", "--config": "-K"})


def curl(call: Call) -> list[Rule]:
    parsed = _CURL_OPTIONS.parse(call.args)
    if parsed.has("-K"):
        return [Rule(Kind.FORK, "reads more options from a file")]
    method = (parsed.value("-X") or "").upper()
    if not method:
        method = "POST" if parsed.has("-d", "-F") and not parsed.has("-G") else \
            "PUT" if parsed.has("-T") else "GET"
    urls = [*parsed.operands, *parsed.values("--url")]
    rules = [] if method in ("GET", "HEAD") or parsed.has("-I") else \
        [request_rule(any(remote_url(url) for url in urls), method)]
    targets = file_words(parsed.values("-o", "-D", "-c", "--trace", "--trace-ascii", "--stderr",
                                       "--etag-save"))
    if parsed.has("-O"):
        targets += parsed.values("--output-dir") or [HERE]
    if targets:
        rules.append(call.writes(targets, "downloads into"))
    return rules or [Rule(Kind.NONE, "only fetches to its output")]


_WGET_OPTIONS = Options(
    short_values="oaOPtTwQeUlARDIXBi",
    long_values=frozenset({"--output-document", "--directory-prefix", "--output-file", "--append-output",
                           "--post-data", "--post-file", "--body-data", "--body-file", "--method", "--header",
                           "--user", "--password", "--user-agent", "--tries", "--timeout"}),
    aliases={"--output-document": "-O", "--directory-prefix": "-P", "--output-file": "-o",
             "--append-output": "-a"})


def wget(call: Call) -> list[Rule]:
    parsed = _WGET_OPTIONS.parse(call.args)
    rules = []
    method = (parsed.value("--method") or "").upper() or \
        ("POST" if parsed.has("--post-data", "--post-file", "--body-data", "--body-file") else "GET")
    if method not in ("GET", "HEAD"):
        rules.append(request_rule(any(remote_url(url) for url in parsed.operands), method))
    documents = parsed.values("-O")
    if parsed.has("--spider"):
        downloads = []
    elif documents:
        downloads = file_words(documents)
    else:
        downloads = parsed.values("-P") or [HERE]
    targets = [*downloads, *file_words(parsed.values("-o", "-a"))]
    if targets:
        rules.append(call.writes(targets, "downloads into"))
    return rules or [Rule(Kind.NONE, "only fetches to its output")]


_HTTPIE_OPTIONS = Options(short_values="aAo", long_values=frozenset({"--auth", "--auth-type", "--output",
                                                                     "--session", "--verify", "--cert",
                                                                     "--timeout", "--proxy"}),
                          aliases={"--output": "-o", "--download": "-d", "--form": "-f"})
_HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def httpie(call: Call) -> list[Rule]:
    """http [METHOD] URL [ITEM...]: data items (a=b, a:=b, f@file) make it a POST."""
    parsed = _HTTPIE_OPTIONS.parse(call.args)
    operands = parsed.operands
    method = operands[0].text if operands and operands[0].text in _HTTP_METHODS else None
    if method:
        operands = operands[1:]
    items = [word.text or "=" for word in operands[1:]]
    sends = any("==" not in item and ("=" in item or "@" in item) for item in items) or parsed.has("-f")
    method = method or ("POST" if sends else "GET")
    sent = method not in ("GET", "HEAD") and operands
    rules = [request_rule(remote_url(operands[0]), method)] if sent else []
    if parsed.has("-d", "-o"):
        rules.append(call.writes(parsed.values("-o") or [HERE], "downloads into"))
    return rules or [Rule(Kind.NONE, "only fetches to its output")]


SCP_OPTIONS = Options(short_values="cFiJloPS")
RSYNC_OPTIONS = Options(
    short_values="efBT",
    long_values=frozenset({"--exclude", "--include", "--exclude-from", "--include-from", "--filter", "--rsh",
                           "--files-from", "--temp-dir", "--partial-dir", "--backup-dir", "--log-file",
                           "--password-file", "--port", "--chmod", "--chown", "--bwlimit", "--timeout",
                           "--compare-dest", "--copy-dest", "--link-dest", "--suffix", "--max-size",
                           "--min-size", "--out-format"}),
    aliases={"--dry-run": "-n", "--rsh": "-e"})


def copier(options: Options) -> Entry:
    """scp and rsync: to a remote destination is external; otherwise the destination is written."""
    def judge(call: Call) -> list[Rule]:
        parsed = options.parse(call.args)
        if len(parsed.operands) < 2 or parsed.has("-n"):
            return [READS]  # rsync with one operand lists it; -n is a dry run
        if remote_path(parsed.operands[-1].text):
            return [Rule(Kind.EXTERNAL, "copies files to another machine")]
        return [call.writes([parsed.operands[-1], *parsed.values("--log-file")], "copies into")]
    return judge


def database(call: Call) -> list[Rule]:
    """A database client: a server on another machine is external; one here is a fork."""
    if any(remote_url(host) for host in hosts(call.args, "-h")):
        return [Rule(Kind.EXTERNAL, "can change a database on another machine")]
    return [DATABASE]


_SQLITE_OPTIONS = Options(long_values=word_set("--cmd --separator --nullvalue --newline --vfs --init -A"))
# What lets SQLite's or DuckDB's SQL reach beyond the database file: dot commands that write files or
# run programs, ATTACH, extensions, COPY ... TO
_SQL_ESCAPES = re.compile(r"(?im)^\s*\.(shell|system|output|once|backup|save|import|excel|open|load|restore|"
                          r"clone|log|trace|cd)\b|\b(attach|load_extension|writefile|edit|copy|install|export)\b")


def sqlite(call: Call) -> list[Rule]:
    """sqlite3 and duckdb: SQL given on the command line changes only the database file (git when
    it is in the project); SQL from the input, or SQL that reaches other files or programs, may
    do anything."""
    long = [literal("-" + w.text) if re.match(r"-[a-z]{2,}", w.text or "") else w for w in call.args]
    parsed = _SQLITE_OPTIONS.parse(long)  # both take -flag and --flag
    database, *sql = parsed.operands or [literal(":memory:")]
    sql += parsed.values("--cmd")
    if parsed.has("--init") or not sql or any(w.text is None or _SQL_ESCAPES.search(w.text) for w in sql):
        return [Rule(Kind.FORK, "runs SQL that can write other files or run programs")]
    if parsed.has("--readonly") or database.text in (":memory:", ""):
        return [READS]
    return [call.writes([database], "can change the database")]


_NETCAT_OPTIONS = Options(short_values="pswiqxXIOTVe")


def netcat(call: Call) -> list[Rule]:
    """nc HOST PORT sends its input to HOST; -l listens here; -z only checks ports."""
    parsed = _NETCAT_OPTIONS.parse(call.args)
    if parsed.has("-l"):
        return [Rule(Kind.FORK, "listens for connections on this machine")]
    if parsed.has("-z"):
        return [Rule(Kind.NONE, "only checks whether ports are open")]
    if not parsed.operands or remote_url(parsed.operands[0]):
        return [ANOTHER_MACHINE]
    return [Rule(Kind.FORK, "talks to a service on this machine")]


_ANSIBLE_OPTIONS = Options(short_values="ifmaMuckeblt", long_values=word_set(
    """--inventory --inventory-file --forks --module-name --args --module-path --user --connection --timeout
       --extra-vars --become-method --become-user --limit --tags --skip-tags --vault-id --vault-password-file
       --private-key --start-at-task --ssh-common-args --ssh-extra-args --scp-extra-args
       --sftp-extra-args"""),
    aliases={"--inventory": "-i", "--inventory-file": "-i", "--connection": "-c", "--limit": "-l",
             "--module-name": "-m"})
_ANSIBLE_LISTS = ("--list-hosts", "--list-tasks", "--list-tags", "--syntax-check")


def ansible(playbook: bool) -> Entry:
    """ansible HOSTS and ansible-playbook PLAYBOOK: they act on the inventory's hosts, so they are
    external unless the connection is local (-c local) or the hosts are this machine. --check is
    no dry run to trust: a task can set check_mode: false and run anyway."""
    def judge(call: Call) -> list[Rule]:
        parsed = _ANSIBLE_OPTIONS.parse(call.args)
        if parsed.has(*_ANSIBLE_LISTS):
            return [READS]
        inventory = [host for word in parsed.values("-i") for host in (word.text or "/").split(",") if host]
        hosts = inventory or ([] if playbook else [(w.text or "*") for w in parsed.operands[:1]])
        local = parsed.value("-c") == "local" or (bool(hosts) and all(is_local(h) for h in hosts))
        if local:
            return [Rule(Kind.FORK, "runs configuration tasks on this machine")]
        return [Rule(Kind.EXTERNAL, "runs configuration tasks on the inventory's hosts")]
    return judge


_SALT_READS = ("test.", "grains.items", "grains.get", "grains.ls", "pillar.items", "pillar.get", "sys.",
               "state.show", "pkg.list", "status.", "network.interfaces")


def salt(call: Call) -> list[Rule]:
    """salt TARGET FUNCTION: a function that only reads (test.ping, grains.items) reads; the rest
    changes the minions."""
    operands = NO_OPTIONS.parse(call.args).operands
    function = operands[1].text if len(operands) > 1 else None
    if function is not None and function.startswith(_SALT_READS) and "setval" not in function:
        return [READS]
    return [Rule(Kind.EXTERNAL, "runs configuration tasks on remote minions")]


def gradle(call: Call) -> list[Rule]:
    """gradle TASK...: publishing tasks (publish, publishToSonatype, but not publishToMavenLocal)
    upload; the rest builds or runs code."""
    for word in call.args:
        task = (word.text or "").rpartition(":")[2]
        if task.startswith(("publish", "upload", "bintrayUpload", "artifactoryPublish", "jib")) \
                and not task.endswith("MavenLocal") and task != "jibDockerBuild":
            return [Rule(Kind.EXTERNAL, f"runs the task {task}, which publishes to a remote registry")]
    return [RUNS_CODE]


_PROJECT_SCRIPTS = word_set("test tests lint fmt format check build docs cov coverage typing types all dev "
                            "serve start release")


def project_scripts(launcher: Entry) -> Entry:
    """pdm run, hatch run, pixi run: a name projects give their scripts (`hatch run test`), or
    hatch's ENV:SCRIPT, runs the project's script; another name is the program `launcher` runs."""
    def judge(call: Call) -> list[Rule]:
        name = next((w.text for w in call.args if not (w.text or "-").startswith("-")), None)
        if name is not None and (name in _PROJECT_SCRIPTS or ":" in name):
            return [Rule(Kind.FORK, "runs one of the project's scripts, whose effect cannot be known")]
        return launcher(call)
    return judge


def remote_daemon(entry: Entry) -> Entry:
    """docker and podman: with -H naming another machine's daemon, what they change is there."""
    def judge(call: Call) -> list[Rule]:
        rules = entry(call)
        if any(remote_url(host) for host in hosts(call.args, "-H")):
            remote = Rule(Kind.EXTERNAL, "changes containers on another machine")
            return [remote if rule.kind is Kind.FORK else rule for rule in rules]
        return rules
    return judge


def service(call: Call) -> list[Rule]:
    texts = [word.text for word in call.args]
    return [READS if "--status-all" in texts or texts[1:2] == ["status"] else SERVICES]


def pacman(call: Call) -> list[Rule]:
    operation = next((w.text for w in call.args if w.text and w.text.startswith("-")), "")
    return [READS if operation.startswith(("-Q", "--query")) else PACKAGES]


def sysctl(call: Call) -> list[Rule]:
    texts = [word.text or "=" for word in call.args]
    sets = any(t in ("-w", "-p", "--write", "--load", "--system") or "=" in t for t in texts)
    return [SYSTEM if sets else READS]


def hostname(call: Call) -> list[Rule]:
    parsed = NO_OPTIONS.parse(call.args)
    return [Rule(Kind.FORK, "renames the machine") if parsed.operands or parsed.has("-F", "-b") else READS]


_GH_API_OPTIONS = Options(
    short_values="XfFHpqt",
    long_values=word_set("--method --field --raw-field --header --input --jq --template --preview "
                         "--hostname"),
    aliases={"--method": "-X", "--field": "-F", "--raw-field": "-f", "--header": "-H"})


def gh_api(call: Call) -> list[Rule]:
    parsed = _GH_API_OPTIONS.parse(call.args)
    method = (parsed.value("-X") or "").upper() or \
        ("POST" if parsed.has("-f", "-F", "--input") else "GET")
    return [READS] if method in ("GET", "HEAD") else [request_rule(True, method)]


_CLOUD_OPTIONS = Options(long_values=frozenset({
    "--region", "--profile", "--output", "--endpoint-url", "--query", "--color", "--ca-bundle", "--project",
    "--account", "--configuration", "--format", "--subscription", "--zone", "--exclude", "--include", "--acl",
    "--storage-class", "--content-type", "--cache-control", "--sse", "--expires"}))
_CLOUD_READ_VERBS = word_set("""list ls describe show get info version help wait tail cat read search status
                                presign logs history diff whoami head top inspect check""")
_CLOUD_READ_PREFIXES = ("describe-", "list-", "get-", "show-", "batch-get-", "search-", "filter-")
_CLOUD_SETTINGS = frozenset({"configure", "config", "auth", "login", "logout", "account", "components",
                             "extension", "init", "sso"})
_CLOUD_STORAGE = frozenset({"s3", "storage"})  # aws s3 cp, gcloud storage cp
_CLOUD = Rule(Kind.EXTERNAL, "changes cloud resources")
_STORAGE = Rule(Kind.EXTERNAL, "changes remote storage")


def cloud(call: Call) -> list[Rule]:
    """CLIs shaped like aws, gcloud and az (TOOL GROUP... VERB): verbs that describe or list only
    read; settings are local; copies in their storage groups are judged by where they go; the
    rest changes cloud resources."""
    parsed = _CLOUD_OPTIONS.parse(call.args)
    words = [word.text for word in parsed.operands[:4]]
    if not words:
        return [USAGE]
    actions = words[1:] if call.name == "aws" else words  # aws SERVICE VERB; gcloud GROUP... VERB
    reads = any(a in _CLOUD_READ_VERBS or a.startswith(_CLOUD_READ_PREFIXES) for a in actions if a)
    if words[0] in _CLOUD_SETTINGS:
        return [READS if reads else SETTINGS]
    if words[0] in _CLOUD_STORAGE and words[1:2] in (["cp"], ["mv"], ["sync"], ["rsync"]):
        return storage_copy(call.shifted(parsed.operands[2:], entry=f"{call.entry} {words[0]} {words[1]}"))
    return [READS if reads else _CLOUD]


def storage_copy(call: Call) -> list[Rule]:
    """SOURCE... DESTINATION after cp, mv or sync: to remote storage (s3://, gs://, remote:path)
    is external, as is moving from it; otherwise the destination is written (a download)."""
    operands = [word for word in call.args if not (word.text or "").startswith("-")]
    if len(operands) < 2:
        operands = [*operands, HERE]  # s3cmd get s3://b/x: into the current folder
    *sources, destination = operands
    moves = call.entry.rpartition(" ")[2] in ("mv", "move", "moveto")
    if remote_path(destination.text) or (moves and any(remote_path(s.text) for s in sources)):
        return [_STORAGE]
    return [call.writes([destination], "downloads into")]


def storage_target(call: Call) -> list[Rule]:
    """VERB TARGET... (rm, mkdir, delete): external when a target is remote storage, else a write."""
    targets = [word for word in call.args if not (word.text or "").startswith("-")]
    if any(remote_path(word.text) for word in targets):
        return [_STORAGE]
    return [call.writes(targets, "changes")]


_GIT_OPTIONS = Options(short_values="Cc", long_values=frozenset({
    "--git-dir", "--work-tree", "--namespace", "--super-prefix", "--config-env"}))
# git -c settings (and their prefixes, and suffixes) that name a program for git to run
_GIT_PROGRAM_SETTINGS = ("alias.", "pager.", "filter.", "core.pager", "core.editor", "core.sshcommand",
                         "core.fsmonitor", "core.hookspath", "core.askpass", "core.gitproxy", "diff.external",
                         "credential.helper", "sequence.editor", "gpg.program", "uploadpack.packobjectshook")
_GIT_PROGRAM_SUFFIXES = (".command", ".cmd", ".textconv", ".tool", ".helper")


def git(commands: Entry) -> Entry:
    """git [-C DIR]... SUBCOMMAND, judged by `commands`: the repository is the folder -C,
    --work-tree or --git-dir name."""
    def judge(call: Call) -> list[Rule]:
        parsed = _GIT_OPTIONS.parse(call.args, permute=False)
        here = call.shell.here
        rules = []
        for name, value in parsed.flags:
            if name in ("-C", "--work-tree") and value is not None:
                here = folder_of(value, here)
            elif name == "--git-dir" and value is not None:
                git_dir = folder_of(value, here)
                here = posixpath.dirname(git_dir) if git_dir else None
            elif name == "--exec-path" and value is not None:
                rules.append(Rule(Kind.FORK, "sets where git finds its programs"))
            elif name in ("-c", "--config-env") and value is not None:
                key = (value.text or "").partition("=")[0].lower()
                if not key or key.startswith(_GIT_PROGRAM_SETTINGS) or key.endswith(_GIT_PROGRAM_SUFFIXES):
                    rules.append(Rule(Kind.FORK, f"sets the git setting {key or 'only known at run time'}, "
                                                 "which can name a program to run"))
        shell = call.shell.copy()
        shell.here = here
        return [*rules, *commands(call.shifted(parsed.operands, shell))]
    return judge


def git_push(call: Call) -> list[Rule]:
    return [READS] if NO_OPTIONS.parse(call.args).has("-n", "--dry-run") else [PUSHES]


# git branch and git tag: -u, -m and -F take a value (the upstream, a message, a message file)
_REF_OPTIONS = Options(short_values="umF", long_values=word_set(
    """--contains --no-contains --merged --no-merged --points-at --sort --format --set-upstream-to --message
       --file"""))


def git_refs(changes: str, lists: str) -> Entry:
    """git branch and git tag: they list, unless given a name or a flag of `changes` (create, delete,
    move); with a flag of `lists`, names are patterns to list."""
    def judge(call: Call) -> list[Rule]:
        parsed = _REF_OPTIONS.parse(call.args)
        if parsed.has(*changes.split()) or (parsed.operands and not parsed.has(*lists.split())):
            return [call.locally(REPO)]
        return [READS]
    return judge


_GIT_CLEAN_OPTIONS = Options(short_values="e", aliases={"--dry-run": "-n"})


def git_clean(call: Call) -> list[Rule]:
    parsed = _GIT_CLEAN_OPTIONS.parse(call.args)
    if parsed.has("-n"):
        return [READS]
    if parsed.has("-x", "-X"):
        return [Rule(Kind.FORK, "removes ignored files, which git cannot take back")]
    return [call.locally(Rule(Kind.GIT, "removes untracked files"))]


_GIT_CONFIG_OPTIONS = Options(short_values="f", long_values=frozenset({"--file", "--blob", "--type",
                                                                       "--default", "--comment"}))
_GIT_CONFIG_READS = ("--get", "--get-all", "--get-regexp", "--get-urlmatch", "--get-color", "--get-colorbool",
                     "-l", "--list")


def git_config(call: Call) -> list[Rule]:
    parsed = _GIT_CONFIG_OPTIONS.parse(call.args)
    first = parsed.operands[0].text if parsed.operands else None
    if parsed.has(*_GIT_CONFIG_READS) or first in ("get", "list") or \
            (len(parsed.operands) == 1 and first not in ("set", "unset", "edit", "rename-section",
                                                          "remove-section") and not parsed.has("--unset")):
        return [READS]
    if parsed.has("--global", "--system", "-f", "--file"):
        return [Rule(Kind.FORK, "changes git settings outside the project")]
    return [call.locally(Rule(Kind.GIT, "changes the repository's settings"))]


_GIT_CLONE_OPTIONS = Options(short_values="bocujd", long_values=frozenset({
    "--branch", "--origin", "--config", "--upload-pack", "--jobs", "--depth", "--reference", "--template",
    "--separate-git-dir", "--filter", "--shallow-since", "--shallow-exclude", "--initial-branch",
    "--object-format"}))


def git_creates(skip: int) -> Entry:
    """git clone URL [DIR] (skip 1), git init [DIR] (skip 0): the new repository's folder is written."""
    def judge(call: Call) -> list[Rule]:
        folder = _GIT_CLONE_OPTIONS.parse(call.args).operands[skip:skip + 1]
        return [call.writes(folder or [HERE], "creates a repository in")]
    return judge


_GIT_OUTPUT_OPTIONS = Options(short_values="o", aliases={"--output": "-o", "--output-directory": "-o"})


def git_writes(default: Word | None) -> Entry:
    """git archive (to its output) and git format-patch (into the current folder): or -o FILE."""
    def judge(call: Call) -> list[Rule]:
        parsed = _GIT_OUTPUT_OPTIONS.parse(call.args)
        written = parsed.values("-o") or ([default] if default and not parsed.has("--stdout") else [])
        return [call.writes(written, "writes")]
    return judge
