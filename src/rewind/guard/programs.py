"""The program table: what each program does, by family, with the references it was built from.

Every entry is called with one program's run (a Call) and returns the verdicts that apply to
it; the kinds of entry are in rewind.guard.entries (a Rule, Writer, Subcommands, Wrapper,
Rewrites, Topics, Given) and rewind.guard.handlers (programs a table cannot describe). To
teach the guard a program, add it to its family here, with a test in tests/test_programs.py;
a hosted service's command-line tool (stripe, supabase, skopeo...) goes in tools.toml instead
(rewind.guard.tooltable). A family's `sources` are the reference pages its subcommand lists
were taken from.
"""

from __future__ import annotations

from rewind.errors import InvalidArgument
from rewind.guard import tooltable
from rewind.guard.entries import (
    ANOTHER_MACHINE,
    EDITOR,
    FOLDER,
    MAIL,
    MANIFEST,
    OWNERSHIP,
    PACKAGES,
    PROCESSES,
    PUBLISHES,
    PUSHES,
    READS,
    REMOTE,
    REPO,
    RUNS_CODE,
    SCHEDULES,
    SERVICES,
    SETTINGS,
    SHELL_STATE,
    SYSTEM,
    Entry,
    Family,
    Given,
    Subcommands,
    VersionBump,
    Wrapper,
    Writer,
    each,
    forge,
    package_manager,
    reads_unless,
    rewrites,
    rewrites_here,
    topics,
    unless_dry_run,
    verbs,
    word_set,
)
from rewind.guard.handlers import (
    RSYNC_OPTIONS,
    SCP_OPTIONS,
    Evaluates,
    ansible,
    awk,
    change_folder,
    chmod,
    cloud,
    compressor,
    copier,
    curl,
    database,
    dd,
    deno_eval,
    eval_string,
    find,
    gh_api,
    git,
    git_clean,
    git_config,
    git_creates,
    git_push,
    git_refs,
    git_writes,
    gradle,
    hostname,
    httpie,
    netcat,
    pacman,
    patch,
    perl,
    pop_folder,
    project_scripts,
    python,
    read_variables,
    remote_daemon,
    ruby,
    run_shell,
    salt,
    sed,
    service,
    sqlite,
    storage_copy,
    storage_target,
    su,
    sysctl,
    tar,
    trap,
    unzip,
    wget,
    yq,
)
from rewind.guard.verdicts import Kind, Rule
from rewind.guard.words import HERE, Options

# ---------------------------------------------------------------------------------------------
# Verdicts and option sets several families use

_CONTAINERS = Rule(Kind.FORK, "changes containers or images on this machine")
_LOCAL_CLUSTER = Rule(Kind.FORK, "changes a cluster or virtual machines on this machine")
_CLUSTER = Rule(Kind.EXTERNAL, "changes a remote cluster")
_INFRASTRUCTURE = Rule(Kind.EXTERNAL, "changes real infrastructure")
_PLATFORM = Rule(Kind.EXTERNAL, "changes a hosted app or its platform")
_DEPLOYS = Rule(Kind.EXTERNAL, "deploys to a hosting platform")
_STORAGE = Rule(Kind.EXTERNAL, "changes remote storage")
_CHAT = Rule(Kind.EXTERNAL, "posts a message to a chat or notification service")
_MIGRATES = Rule(Kind.FORK, "migrates a database")
_BUILDS = Rule(Kind.FORK, "builds or runs code (build scripts run too)")
_CLONES = Rule(Kind.GIT, "clones a repository into the current folder")
_LOSES_HISTORY = Rule(Kind.FORK, "can drop objects git needs to take changes back")
_ONE_STRING = Rule(Kind.FORK, "runs a command line given as one string")
_TARGET_DIRECTORY = Options(short_values="tS", long_values=frozenset({"--target-directory"}),
                            aliases={"--target-directory": "-t"})


# ---------------------------------------------------------------------------------------------
# The shell, files, and the system

_READ_ONLY = """
    ls ll dir vdir cat tac nl head tail less more most grep egrep fgrep zgrep rg ag ack wc cut tr paste join
    comm column fold fmt rev expand unexpand echo printf pwd which whereis type whatis apropos man info help
    ps pgrep pidof top pstree uptime free vmstat iostat mpstat lsof df du stat file tree namei
    lsattr diff diff3 sdiff cmp md5sum sha1sum sha224sum sha256sum sha384sum sha512sum b2sum cksum sum cal
    whoami id groups who w last users uname arch nproc lscpu lsblk lspci lsusb lsmod getconf locale tty
    printenv getent jq basename dirname realpath readlink test true false sleep seq yes expr bc dc factor
    numfmt shuf od hexdump strings base32 base64 basenc ping dig nslookup host whois traceroute tracepath ss
    netstat zcat bzcat xzcat zstdcat zless zmore zdiff nm objdump readelf ldd tput clear dirs jobs
"""
_SHELL_BUILTINS = """
    : exit return break continue shift set shopt ulimit umask alias unalias wait fg bg disown hash history
    let getopts mapfile readarray caller complete compgen
"""

SHELL = Family({
    **each(_READ_ONLY, READS),
    **each(_SHELL_BUILTINS, SHELL_STATE),
    "cd": change_folder, "pushd": change_folder, "popd": pop_folder, "read": read_variables, "trap": trap,
    **each("bash sh zsh dash ksh ash fish", run_shell),
    "eval": eval_string, "su": su,
    **each("source .", Rule(Kind.FORK, "runs a script in the current shell")),
}, sources=("https://www.gnu.org/software/bash/manual/bash.html",
            "https://www.gnu.org/software/coreutils/manual/coreutils.html"))

# Programs that run the command after their own flags: that command decides
WRAPPERS = Family({
    "sudo": Wrapper(
        Options(short_values="ugpChDrtTU",
                long_values=word_set("""--user --group --prompt --close-from --chdir --role --type
                                        --command-timeout --other-user --host"""),
                aliases={"--chdir": "-D", "--edit": "-e", "--list": "-l"}),
        assignments=True, dir_flags=("-D",), bare=Rule(Kind.FORK, "opens a root shell"),
        flag_rules={"-e": Rule(Kind.FORK, "edits files as root"), "-l": READS, "-v": READS, "-k": READS,
                    "-K": READS}),
    "doas": Wrapper(Options(short_values="uC"), bare=Rule(Kind.FORK, "opens a root shell")),
    "env": Wrapper(Options(short_values="uCS", long_values=word_set("--unset --chdir --split-string"),
                           aliases={"--chdir": "-C", "--split-string": "-S"}),
                   assignments=True, dir_flags=("-C",), flag_rules={"-S": _ONE_STRING}),
    **each("nohup builtin setsid", Wrapper()),
    "time": Wrapper(Options(short_values="fo")),
    "nice": Wrapper(Options(short_values="n", long_values=frozenset({"--adjustment"}))),
    "ionice": Wrapper(Options(short_values="cnp"), flag_rules={"-p": PROCESSES}),
    "stdbuf": Wrapper(Options(short_values="ioe", long_values=frozenset({"--input", "--output", "--error"}))),
    "timeout": Wrapper(Options(short_values="sk", long_values=frozenset({"--signal", "--kill-after"})),
                       leading=1),
    "flock": Wrapper(Options(short_values="wE", long_values=word_set("--timeout --conflict-exit-code")),
                     leading=1, flag_rules={"-c": _ONE_STRING}),
    "command": Wrapper(flag_rules={"-v": READS, "-V": READS}),
    "exec": Wrapper(Options(short_values="a"), bare=SHELL_STATE),
    "xargs": Wrapper(Options(short_values="adEILnPs", optional="eil", long_values=frozenset({
        "--arg-file", "--delimiter", "--max-args", "--max-procs", "--max-chars", "--process-slot-var"})),
        feeds_args=True),
}, sources=("https://www.sudo.ws/docs/man/sudo.man/",
            "https://www.gnu.org/software/coreutils/manual/html_node/env-invocation.html",
            "https://www.gnu.org/software/findutils/manual/html_node/find_html/xargs-options.html"))

FILES = Family({
    **each("rm rmdir unlink", Writer("removes", removes=True)),
    "mkdir": Writer("creates", Options(short_values="m")),
    "touch": Writer("touches", Options(short_values="dtr", long_values=frozenset({"--date", "--reference"}))),
    "chmod": chmod,
    "cp": Writer("copies into", _TARGET_DIRECTORY, written="last", target_flags=("-t",)),
    "mv": Writer("moves", _TARGET_DIRECTORY, target_flags=("-t",), removes=True),
    "ln": Writer("links", _TARGET_DIRECTORY, written="last", target_flags=("-t",)),
    "install": Writer("installs", Options(short_values="mogtS", aliases={"--target-directory": "-t"}),
                      target_flags=("-t",)),
    **each("tee sponge", Writer("writes")),
    "truncate": Writer("truncates", Options(short_values="sr",
                                            long_values=frozenset({"--size", "--reference"}))),
    "shred": Writer("shreds", Options(short_values="ns", long_values=frozenset({"--iterations", "--size"}))),
    "mkfifo": Writer("creates", Options(short_values="m")),
    "sort": Writer("writes", Options(short_values="kotST", long_values=frozenset({
        "--key", "--field-separator", "--output", "--buffer-size", "--temporary-directory", "--files0-from"}),
        aliases={"--output": "-o"}), written="none", target_flags=("-o",)),
    "uniq": Writer("writes", Options(short_values="fsw"), written="second"),
    "xxd": Writer("writes", Options(short_values="cglso"), written="second"),
    "zip": Writer("writes the archive", Options(short_values="bntP"), written="first"),
    "dd": dd, "tar": tar, "unzip": unzip, "patch": patch,
    **each("gzip gunzip bzip2 bunzip2 xz unxz zstd unzstd lz4 compress uncompress", compressor),
    "sed": sed, "perl": perl, "yq": yq,
    **each("awk gawk mawk nawk", awk),
    "find": find,
    **each("chown chgrp chattr setfacl", OWNERSHIP),
    **each("vi vim nvim nano emacs ed code", EDITOR),
    "mktemp": Rule(Kind.FORK, "creates a file in the temporary folder"),
}, sources=("https://www.gnu.org/software/coreutils/manual/coreutils.html",
            "https://www.gnu.org/software/sed/manual/sed.html", "https://www.gnu.org/software/tar/manual/"))

SYSTEM_TOOLS = Family({
    "systemctl": verbs("""status show cat list-units list-unit-files list-timers list-sockets
                          list-dependencies
                          list-jobs is-active is-enabled is-failed is-system-running get-default help""",
                       default=SERVICES, bare=READS),
    "service": service,
    "journalctl": reads_unless("""--vacuum-size --vacuum-time --vacuum-files --rotate --flush --sync
                                  --relinquish-var --setup-keys""", SYSTEM),
    "dmesg": reads_unless("-c -C --clear --read-clear -n --console-level", SYSTEM),
    "date": reads_unless("-s --set", Rule(Kind.FORK, "sets the system clock")),
    "ip": reads_unless("add del delete set change replace flush append", SYSTEM),
    "sysctl": sysctl, "hostname": hostname,
    **each("hostnamectl timedatectl localectl",
           verbs("status show list-timezones list-locales", default=SYSTEM, bare=READS)),
    "mount": Subcommands(each("-a --all", SYSTEM), default=SYSTEM, bare=READS, value_flags=word_set("-t -o")),
    **each("iptables ip6tables", Subcommands(each("-L -S --list --list-rules", READS), default=SYSTEM,
                                             bare=SYSTEM, value_flags=word_set("-t --table"))),
    "ufw": verbs("status", default=SYSTEM),
    "nft": verbs("list", default=SYSTEM),
    **each("""umount useradd userdel usermod groupadd groupdel groupmod adduser deluser passwd chpasswd
              visudo modprobe insmod rmmod swapon swapoff mkfs fdisk parted wipefs mkswap ldconfig
              update-alternatives update-grub locale-gen reboot shutdown poweroff halt""", SYSTEM),
    **each("kill pkill killall renice", PROCESSES),
    "crontab": Subcommands({"-l": READS}, default=SCHEDULES, bare=SCHEDULES, value_flags=word_set("-u")),
    **each("at batch", SCHEDULES),
    **each("ssh-keygen ssh-add gpg", Rule(Kind.FORK, "changes keys outside the project")),
}, sources=("https://www.freedesktop.org/software/systemd/man/latest/systemctl.html",
            "https://man7.org/linux/man-pages/"))

# ---------------------------------------------------------------------------------------------
# Git and the forges that host it

_GIT_COMMANDS = Subcommands(
    {
        **each("""status log diff show blame annotate grep describe shortlog ls-files ls-tree ls-remote
                  rev-parse rev-list cat-file show-ref for-each-ref show-branch whatchanged name-rev
                  merge-base count-objects fsck check-ignore check-attr check-ref-format version help var
                  cherry range-diff diff-tree diff-files diff-index verify-commit verify-tag verify-pack
                  difftool request-pull""", READS),
        **each("""add commit checkout switch restore reset merge rebase cherry-pick revert mv rm apply am
                  pull fetch bisect mergetool update-index update-ref symbolic-ref read-tree checkout-index
                  commit-tree write-tree hash-object sparse-checkout replace""", REPO),
        **each("gc prune repack maintenance", _LOSES_HISTORY),
        **each("filter-branch filter-repo", Rule(Kind.FORK, "rewrites the whole history")),
        "push": git_push,
        "send-email": MAIL,
        "svn": Rule(Kind.EXTERNAL, "talks to a Subversion server"),
        "hook": RUNS_CODE,
        "branch": git_refs("-d -D --delete -m -M --move -c -C --copy -u --set-upstream-to --unset-upstream "
                           "--edit-description -f --force",
                           "-l --list -a --all -r --remotes --show-current -v --verbose --contains "
                           "--no-contains --merged --no-merged --points-at -n"),
        "tag": git_refs("-d --delete -a --annotate -s --sign -u -m --message -F --file -f --force",
                        "-l --list -n --contains --no-contains --merged --no-merged --points-at -v "
                        "--verify"),
        "clean": git_clean,
        "config": git_config,
        "clone": git_creates(1),
        "init": git_creates(0),
        "archive": git_writes(None),
        "format-patch": git_writes(HERE),
        "stash": verbs("list show", default=REPO, bare=REPO),
        "remote": verbs("show get-url", default=REPO, bare=READS),
        "notes": verbs("list show", default=REPO, bare=READS),
        "worktree": verbs("list", default=REPO, add=git_creates(0)),
        "submodule": verbs("status summary", default=REPO, bare=READS, foreach=RUNS_CODE),
        "reflog": verbs("", default=READS, bare=READS, expire=_LOSES_HISTORY, delete=_LOSES_HISTORY),
        "bundle": verbs("", default=READS, create=Writer("writes", written="first"), unbundle=REPO),
        "lfs": verbs("ls-files status env version logs", default=REPO, push=PUSHES, install=SETTINGS,
                     uninstall=SETTINGS),
    },
    default=Rule(Kind.FORK, "is not a git command rewind knows (it may be an alias that runs anything)"),
)
_GIT = git(_GIT_COMMANDS)

_FORGE_SETTINGS = verbs("status token get list ls", default=SETTINGS)

FORGES = Family({
    "git": _GIT,
    "gh": Subcommands({
        "pr": forge("list view status diff checks", checkout=REPO),
        "repo": forge("view list", clone=_CLONES),
        "release": forge("list view", download=FOLDER),
        "run": forge("list view watch", download=FOLDER),
        **each("issue workflow gist label secret variable ruleset cache project codespace org ssh-key "
               "gpg-key", forge("list view status")),
        **each("auth config extension ext alias", _FORGE_SETTINGS),
        **each("browse status search completion help version", READS),
        "api": gh_api,
    }, default=REMOTE, value_flags=word_set("-R --repo")),
    "glab": Subcommands({
        "mr": forge("list view diff issues", checkout=REPO),
        "repo": forge("view list search contributors", clone=_CLONES),
        "release": forge("list view", download=FOLDER),
        **each("ci pipeline", forge("list view status trace get lint", artifact=FOLDER)),
        **each("issue label variable snippet milestone deploy-key schedule incident", forge("list view get")),
        **each("auth config alias", _FORGE_SETTINGS),
        **each("version help completion check-update", READS),
        "api": gh_api,
    }, default=REMOTE, value_flags=word_set("-R --repo")),
    "hub": Subcommands({  # hub wraps git: what it does not add is git's
        **each("pull-request create fork delete", REMOTE),
        **each("release issue", forge("show", bare=READS)),
        **each("ci-status browse compare", READS),
        "sync": REPO,
        "api": gh_api,
    }, default=_GIT),
    "tea": Subcommands({
        **each("pulls pull pr", forge("list ls", bare=READS, checkout=REPO, clean=REPO)),
        **each("issues issue i releases release r milestones ms labels organizations org repos repo "
               "notifications n times t", forge("list ls", bare=READS)),
        **each("logins login logout", SETTINGS),
        **each("whoami open o", READS),
        "clone": _CLONES,
    }, default=REMOTE),
}, sources=("https://git-scm.com/docs", "https://cli.github.com/manual/",
            "https://gitlab.com/gitlab-org/cli/-/tree/main/docs",
            "https://hub.github.com/hub.1.html", "https://gitea.com/gitea/tea"))


# ---------------------------------------------------------------------------------------------
# Interpreters, build tools, and launchers that run a program by name (npx prettier): that
# program decides

_NPX = Wrapper(Options(short_values="pc", long_values=word_set("--package --call --cache --userconfig"),
                       aliases={"--call": "-c"}), flag_rules={"-c": _ONE_STRING})
_UVX = Wrapper(Options(short_values="p", long_values=word_set(
    """--from --with --with-requirements --with-editable --python --index --default-index --index-url
       --extra-index-url --constraints --overrides --directory --project""")))
_UV_RUN = Wrapper(Options(short_values="p", long_values=word_set(
    """--with --with-requirements --with-editable --python --package --env-file --extra --group --only-group
       --index --default-index --index-url --extra-index-url --directory --project"""),
    aliases={"--directory": "-D"}), dir_flags=("-D",))
_RUN_IN = Wrapper()  # poetry run, bundle exec, pipenv run: the command after it
_CONDA_RUN = Wrapper(Options(short_values="np", long_values=word_set("--name --prefix --cwd"),
                             aliases={"--cwd": "-C"}), dir_flags=("-C",))
_SCRIPTS_OR_PROGRAM = project_scripts(Wrapper(Options(long_values=word_set("--venv --env"))))

LAUNCHERS = Family({
    **each("python pypy", python),
    **each("npx pnpx", _NPX),
    "bunx": Wrapper(Options(short_values="p", long_values=word_set("--package"))),
    "uvx": _UVX,
    **each("pipenv rye", verbs("graph --where --venv --py", default=PACKAGES, run=_RUN_IN)),
    **each("pyenv rbenv nodenv goenv", verbs("version versions which whence root prefix --version",
                                             default=SETTINGS, exec=_RUN_IN)),
    **each("asdf mise", verbs("current list ls where which version --version", default=SETTINGS,
                              exec=_RUN_IN, x=_RUN_IN, run=RUNS_CODE)),
    "nvm": verbs("ls list current version which ls-remote", default=SETTINGS,
                 exec=Wrapper(leading=1), run=RUNS_CODE),
    **each("volta fnm", verbs("list ls current which", default=SETTINGS, run=_RUN_IN, exec=_RUN_IN)),
    "corepack": Subcommands(each("enable disable install prepare use pack up", SETTINGS), default=_RUN_IN),
    "pixi": verbs("list tree info search --version", default=PACKAGES, run=_SCRIPTS_OR_PROGRAM, exec=_RUN_IN),
    **each("op doppler", verbs("--version", default=SETTINGS, run=Wrapper(Options(long_values=word_set(
        "--env-file --project --config"))))),
    "aws-vault": verbs("list ls --version", default=SETTINGS, exec=Wrapper(leading=1)),
    **each("node nodejs", Evaluates("node", Options(short_values="eprC", long_values=word_set(
        """--eval --print --require --import --loader --experimental-loader --input-type --conditions
           --title --env-file"""), aliases={"--eval": "-e", "--print": "-p", "--require": "-r"}), RUNS_CODE)),
    "ruby": ruby,
    **each("""php Rscript julia java lua luajit make gmake cmake ninja ant bazel meson
              scons rake pytest tox nox jest vitest mocha pre-commit django-admin flask rails""", RUNS_CODE),
}, sources=("https://docs.python.org/3/using/cmdline.html#cmdoption-m",
            "https://docs.npmjs.com/cli/commands/npx",
            "https://docs.astral.sh/uv/reference/cli/", "https://python-poetry.org/docs/cli/#run",
            "https://pdm-project.org/latest/reference/cli/#run",
            "https://hatch.pypa.io/latest/cli/reference/",
            "https://bun.sh/docs/cli/bunx", "https://pnpm.io/cli/dlx", "https://pipx.pypa.io/stable/docs/"))

# ---------------------------------------------------------------------------------------------
# Packages, and the registries of every ecosystem they are published to

_NPM_VERSION = VersionBump()
_NPM_LAUNCH = {"exec": _NPX, "x": _NPX, "dlx": _NPX}
_NPM = verbs(
    "ls list ll la view info show v outdated search help whoami ping explain why fund root prefix bin doctor",
    default=RUNS_CODE,  # run, test, start, and scripts run by name (yarn build)
    **each("install i ci add uninstall remove rm un update up upgrade link ln prune dedupe rebuild",
           PACKAGES),
    publish=unless_dry_run(PUBLISHES),
    **each("unpublish deprecate dist-tag owner access team star unstar", PUBLISHES),
    audit=verbs("", default=READS, bare=READS, fix=PACKAGES),
    config=verbs("get list ls", default=SETTINGS),
    pkg=verbs("get", default=MANIFEST),
    version=_NPM_VERSION,  # pnpm's too (its own since pnpm 11, npm's before)
    **_NPM_LAUNCH,
)
_PIP = package_manager("list show freeze check search help index inspect debug hash",
                       config=verbs("list get debug", default=SETTINGS),
                       cache=verbs("list dir info", default=SETTINGS))
# yarn 1 bumps with flags (--patch, --new-version X), or asks for the version, then commits and
# tags as npm does; yarn 2 and later take a strategy (yarn version patch) and only write manifests
_YARN_VERSION = Subcommands(
    {"check": Given(word_set("-i --interactive"), FOLDER), "apply": MANIFEST},
    default=MANIFEST,
    bare=VersionBump(asks=True),
    value_flags=word_set("--new-version --preid --message -m"),
)
_PUB = verbs("deps outdated token", default=PACKAGES, publish=unless_dry_run(PUBLISHES, "--dry-run -n"),
             lish=unless_dry_run(PUBLISHES, "--dry-run -n"))

PACKAGES_AND_REGISTRIES = Family({
    "pip": _PIP,
    **each("npm pnpm", _NPM),
    "yarn": Subcommands({**_NPM.verbs, "version": _YARN_VERSION}, default=RUNS_CODE,
                        bare=PACKAGES),  # yarn alone installs
    "bun": Evaluates("bun", Options(short_values="epr",
                                    long_values=word_set("--eval --print --preload --cwd"),
                                    aliases={"--eval": "-e", "--print": "-p", "--preload": "-r"}),
                     verbs("--revision", default=RUNS_CODE,
                           pm=Subcommands({"version": _NPM_VERSION, "pkg": verbs("get", default=MANIFEST)},
                                          default=READS), publish=unless_dry_run(PUBLISHES), x=_NPX,
                           **each("install i add a remove rm update link unlink", PACKAGES)),
                     dir_flags=("--cwd",)),
    "deno": verbs("check info doc types lint-rules completions --version", default=RUNS_CODE, eval=deno_eval,
                  **each("install add remove uninstall cache outdated upgrade", PACKAGES),
                  publish=unless_dry_run(PUBLISHES), fmt=rewrites_here(checks="--check"),
                  lint=rewrites_here(writes="--fix"), compile=FOLDER, init=FOLDER),
    "cargo": verbs(
        "metadata tree search version help locate-project pkgid read-manifest verify-project",
        default=_BUILDS,
        **each("install uninstall add remove rm update fetch vendor", PACKAGES),
        publish=unless_dry_run(PUBLISHES, "--dry-run -n"),
        **each("yank owner login logout", PUBLISHES),
        fmt=rewrites_here(checks="--check"),
        **each("new init", FOLDER),
        set_version=MANIFEST,  # cargo-edit's
    ),
    "gem": package_manager(
        "list search info query specification contents environment help which outdated dependency",
        build=_BUILDS, **each("push yank owner signin signout", PUBLISHES)),
    "bundle": package_manager("list show outdated check info", bare=PACKAGES, exec=_RUN_IN),
    "go": verbs("vet list version env doc help", default=_BUILDS,
                **each("install get mod work clean", PACKAGES), fmt=FOLDER),
    "twine": verbs("check", default=PUBLISHES),
    "poetry": package_manager("show check search about", version=VersionBump(),
                              publish=unless_dry_run(PUBLISHES), run=_RUN_IN, shell=RUNS_CODE, build=_BUILDS,
                              init=FOLDER, new=FOLDER),
    # uv version's bump also locks and syncs the environment
    "uv": package_manager("tree help", version=VersionBump(word_set("--bump"), then=PACKAGES), pip=_PIP,
                          run=_UV_RUN, publish=unless_dry_run(PUBLISHES),
                          tool=verbs("list dir", default=PACKAGES, run=_UVX), build=_BUILDS, init=FOLDER,
                          format=rewrites_here(checks="--check --diff")),
    "pipx": package_manager("list environment", run=Wrapper(Options(long_values=word_set(
        "--spec --python --index-url --pip-args")))),
    "pdm": package_manager("list show info search config --version", run=_SCRIPTS_OR_PROGRAM,
                           publish=unless_dry_run(PUBLISHES), build=_BUILDS, init=FOLDER),
    "hatch": verbs("status --version", version=VersionBump(), default=PACKAGES, run=_SCRIPTS_OR_PROGRAM,
                   publish=PUBLISHES, build=_BUILDS, test=RUNS_CODE, shell=RUNS_CODE, new=FOLDER,
                   clean=FOLDER, fmt=rewrites_here(checks="--check"),
                   env=verbs("show find", default=PACKAGES), dep=READS, project=READS),
    "flit": verbs("--version", default=PACKAGES, publish=PUBLISHES, build=FOLDER, init=FOLDER),
    **each("conda mamba micromamba", package_manager("list info search", run=_CONDA_RUN)),
    "anaconda": verbs("whoami show search --version", default=SETTINGS, upload=PUBLISHES),
    "composer": package_manager("show outdated validate licenses search", run_script=RUNS_CODE,
                                exec=_RUN_IN, bare=READS),
    **each("mvn mvnw", Given(word_set("deploy deploy:deploy release:perform release:prepare site-deploy "
                                      "site:deploy jib:build"),
                             Rule(Kind.EXTERNAL, "publishes to a remote repository or registry"),
                             otherwise=RUNS_CODE)),
    **each("gradle gradlew", gradle),
    "dotnet": verbs("--info --list-sdks --list-runtimes --version list sln help", default=RUNS_CODE,
                    **each("add remove restore workload", PACKAGES), new=FOLDER,
                    format=rewrites_here(checks="--verify-no-changes"),
                    tool=verbs("list search", default=PACKAGES, run=_RUN_IN),
                    nuget=verbs("locals verify why", default=SETTINGS, **each("push delete", PUBLISHES),
                                list=READS)),
    "nuget": package_manager("list search locals help", **each("push delete", PUBLISHES)),
    **each("dart flutter", verbs("analyze doctor devices --version info", default=RUNS_CODE, pub=_PUB,
                                 packages=_PUB, create=FOLDER, clean=FOLDER,
                                 format=rewrites_here(checks="--output=none --output=show --output=json"),
                                 fix=rewrites_here(writes="--apply"), config=SETTINGS,
                                 **each("upgrade downgrade channel", PACKAGES))),
    "pub": _PUB,
    "mix": verbs("help hex.info hex.search hex.outdated hex.audit deps.tree", default=RUNS_CODE,
                 **each("hex.publish hex.retire hex.owner", unless_dry_run(PUBLISHES)),
                 **each("deps.get deps.update deps.unlock deps.clean local.hex local.rebar archive.install",
                        PACKAGES),
                 format=rewrites_here(checks="--check-formatted --dry-run"),
                 **each("ecto.migrate ecto.rollback ecto.reset ecto.drop ecto.create", _MIGRATES)),
    **each("cabal stack", verbs("list info --version path", default=_BUILDS, upload=PUBLISHES,
                                **each("install update", PACKAGES))),
    "opam": package_manager("list show search info config var switch env", publish=PUBLISHES),
    "pod": package_manager("search list spec env", trunk=verbs("me info", default=PUBLISHES),
                           lib=RUNS_CODE),
    **each("vsce ovsx", verbs("ls show --version", default=PUBLISHES, package=_BUILDS)),
    **each("semantic-release release-it np", unless_dry_run(PUBLISHES)),
    "lerna": verbs("list ls info diff changed", default=RUNS_CODE, publish=PUBLISHES,
                   version=Rule(Kind.EXTERNAL, "tags and pushes a release")),
    "changeset": verbs("status", default=FOLDER, publish=PUBLISHES),
    "goreleaser": verbs("check --version", default=_BUILDS,
                        release=Given(word_set("--snapshot --skip-publish"), _BUILDS, otherwise=PUBLISHES)),
    "apt": package_manager("list search show policy depends rdepends changelog"),
    "apt-get": package_manager("check changelog source"),
    **each("apt-cache dpkg-query", READS),
    "aptitude": package_manager("search show why why-not"),
    "dpkg": package_manager("""-l -L -s -S -c -I -p --list --listfiles --status --search --contents --info
                               --print-avail --get-selections --print-architecture --compare-versions""",
                            bare=PACKAGES),
    **each("yum dnf microdnf", package_manager("list info search provides repolist check-update history")),
    "zypper": package_manager("search se info if list-updates lu repos lr"),
    "apk": package_manager("info search list policy stats"),
    "pacman": pacman,
    "snap": package_manager("list info find version"),
    "flatpak": package_manager("list info search remotes"),
    "brew": package_manager("list ls info search outdated deps uses config doctor --prefix leaves"),
}, sources=("https://docs.npmjs.com/cli/commands", "https://pip.pypa.io/en/stable/cli/",
            "https://twine.readthedocs.io/en/stable/", "https://doc.rust-lang.org/cargo/commands/",
            "https://guides.rubygems.org/command-reference/", "https://maven.apache.org/plugins/",
            "https://docs.gradle.org/current/userguide/publishing_setup.html",
            "https://learn.microsoft.com/dotnet/core/tools/", "https://dart.dev/tools/pub/cmd",
            "https://hexdocs.pm/hex/Mix.Tasks.Hex.Publish.html", "https://python-poetry.org/docs/cli/",
            "https://flit.pypa.io/en/stable/cmdline.html", "https://hatch.pypa.io/latest/cli/reference/",
            "https://docs.astral.sh/uv/reference/cli/", "https://getcomposer.org/doc/03-cli.md",
            "https://goreleaser.com/cmd/goreleaser_release/"))

# ---------------------------------------------------------------------------------------------
# Formatters and fixers: they rewrite the files they are given, in place, with the flag that says
# so (or always); with a check flag, or without the write flag, they only read

_BLACK = rewrites(checks="--check --diff -c --code", options=Options(
    short_values="ltSWc", long_values=word_set("""--line-length --target-version --include --exclude
                                                  --extend-exclude --force-exclude --stdin-filename --config
                                                  --required-version --python-cell-magics --workers""")))
_ESLINT = rewrites_here(writes="--fix", options=Options(short_values="cfo", long_values=word_set(
    "--config --ext --format --output-file --rule --plugin --parser --resolve-plugins-relative-to")))
_RUFF_OPTIONS = Options(long_values=word_set("""--config --select --ignore --extend-select --extend-ignore
                                               --line-length --target-version --exclude --extend-exclude
                                               --output-format --fixable --unfixable --per-file-ignores"""))
_RUFF_CHECK = rewrites_here(writes="--fix", checks="--diff --no-fix", options=_RUFF_OPTIONS)
_BIOME_WRITES = "--write --fix --apply --apply-unsafe"

FORMATTERS = Family({
    **each("black blue pyink", _BLACK),
    "isort": rewrites(checks="--check-only --check -c --diff --stdout -d"),
    **each("autopep8 yapf", rewrites(writes="-i --in-place", checks="-d --diff")),
    "autoflake": rewrites(writes="-i --in-place", checks="-c --check --check-diff"),
    "docformatter": rewrites(writes="-i --in-place", checks="-c --check"),
    **each("pyupgrade add-trailing-comma reorder-python-imports", rewrites()),
    "flynt": rewrites(checks="--dry-run --fail-on-change"),
    "2to3": rewrites(writes="-w --write"),
    "ruff": Subcommands({"format": rewrites_here(checks="--check --diff", options=_RUFF_OPTIONS),
                         "check": _RUFF_CHECK, "clean": FOLDER,
                         **each("rule config linter version help analyze server", READS)},
                        default=_RUFF_CHECK),  # ruff PATH: the old spelling of ruff check PATH
    "prettier": rewrites(writes="--write -w", checks="--check -c --list-different -l"),
    **each("eslint eslint_d", _ESLINT),
    **each("stylelint standard xo markdownlint markdownlint-cli2", rewrites(writes="--fix")),
    "biome": Subcommands({**each("format lint check migrate", rewrites_here(writes=_BIOME_WRITES)),
                          **each("ci version explain rage", READS), "init": FOLDER}, default=READS),
    "dprint": verbs("check output-file-paths config license --version", default=READS, fmt=rewrites_here()),
    "gofmt": rewrites(writes="-w"),
    **each("goimports gofumpt", rewrites(writes="-w")),
    "golangci-lint": verbs("linters version help config", default=READS,
                           run=rewrites_here(writes="--fix"), fmt=rewrites_here(checks="--diff -d")),
    "rustfmt": rewrites(checks="--check --emit=stdout"),
    "clang-format": rewrites(writes="-i", checks="--dry-run -n"),
    "clang-tidy": rewrites(writes="--fix --fix-errors -fix -fix-errors"),
    "shfmt": rewrites(writes="-w --write", checks="-d --diff"),
    "stylua": rewrites(checks="--check -c"),
    **each("rubocop", rewrites_here(writes="-a -A -x --autocorrect --autocorrect-all --auto-correct "
                                           "--auto-correct-all --fix-layout")),
    "standardrb": rewrites_here(writes="--fix"),
    "php-cs-fixer": verbs("check describe list help", default=READS, fix=rewrites_here(checks="--dry-run")),
    "phpcbf": rewrites_here(),
    **each("dos2unix unix2dos mac2unix unix2mac", rewrites()),
    "mdformat": rewrites(checks="--check"),
    "taplo": verbs("lint check get --version", default=READS, **each("fmt format", rewrites_here(
        checks="--check"))),
    "yamlfmt": rewrites_here(checks="-lint -dry"),
    **each("nixfmt alejandra", rewrites_here(checks="--check -c")),
    "buildifier": rewrites(checks="-mode=check --mode=check -mode=diff --mode=diff -lint=warn"),
    "sqlfluff": verbs("lint parse render dialects rules version", default=READS,
                      **each("fix format", rewrites_here())),
    **each("cmake-format jsonnetfmt ocamlformat", rewrites(writes="-i --in-place --inplace")),
    "latexindent": rewrites(writes="-w --overwrite --overwriteIfDifferent"),
    "tidy": rewrites(writes="-m -modify --modify"),
    "elm-format": rewrites(checks="--validate --stdout"),
    "swift-format": rewrites(writes="-i --in-place"),
    "swiftformat": rewrites(checks="--lint --dryrun"),
    "ktlint": rewrites(writes="-F --format"),
    "scalafmt": rewrites_here(checks="--test --check --list"),
    "google-java-format": rewrites(writes="-i --replace -r"),
    **each("ormolu fourmolu", rewrites(writes="-i --mode=inplace")),
    "stylish-haskell": rewrites(writes="-i --inplace"),
    "djlint": rewrites(writes="--reformat"),
    **each("codespell typos", rewrites(writes="-w --write-changes")),
    "semgrep": rewrites_here(writes="--autofix"),
    "csharpier": verbs("check --version", default=rewrites_here(checks="--check"),
                       format=rewrites_here(checks="--check")),
    "sort-package-json": rewrites(checks="--check -c"),
    "ansible-lint": rewrites_here(writes="--fix"),
    # Linters and checkers: they only read
    **each("""flake8 pylint mypy pyright pyflakes pycodestyle pydocstyle bandit vulture shellcheck hadolint
              yamllint tflint tfsec checkov cppcheck cpplint staticcheck govulncheck actionlint jsonlint
              htmlhint vale proselint phpstan psalm phpcs trivy grype gitleaks cloc tokei scc""", READS),
}, sources=("https://black.readthedocs.io/en/stable/usage_and_configuration/the_basics.html",
            "https://docs.astral.sh/ruff/", "https://prettier.io/docs/en/cli.html",
            "https://eslint.org/docs/latest/use/command-line-interface", "https://pkg.go.dev/cmd/gofmt",
            "https://github.com/rust-lang/rustfmt", "https://clang.llvm.org/docs/ClangFormat.html",
            "https://github.com/mvdan/sh", "https://docs.rubocop.org/rubocop/usage/basic_usage.html",
            "https://cs.symfony.com/doc/usage.html", "https://pycqa.github.io/isort/",
            "https://biomejs.dev/reference/cli/"))

# ---------------------------------------------------------------------------------------------
# The network, other machines, and messages

NETWORK = Family({
    "curl": curl, "wget": wget,
    **each("http https xh", httpie),
    "scp": copier(SCP_OPTIONS), "rsync": copier(RSYNC_OPTIONS),
    "ssh": Given(word_set("-G -V -Q"), READS, otherwise=ANOTHER_MACHINE),
    **each("mosh sftp ftp lftp ssh-copy-id autossh sshfs socat", ANOTHER_MACHINE),
    **each("nc ncat netcat telnet", netcat),
}, sources=("https://curl.se/docs/manpage.html", "https://man.openbsd.org/ssh", "https://man.openbsd.org/nc",
            "https://download.samba.org/pub/rsync/rsync.1"))

CHAT_AND_MAIL = Family({
    **each("sendmail mail mailx mutt neomutt s-nail msmtp ssmtp swaks", MAIL),
    **each("slackcat slack-notify telegram-send apprise", _CHAT),
    "slack": verbs("version help doctor list --version", default=_PLATFORM, run=RUNS_CODE,
                   **each("login logout auth", SETTINGS)),
    "ntfy": verbs("subscribe sub --help", default=_CHAT, serve=SERVICES),
}, sources=("https://man7.org/linux/man-pages/man1/mail.1p.html", "https://api.slack.com/automation/cli",
            "https://docs.ntfy.sh/subscribe/cli/"))

# Databases: a fork when the server is on this machine, external when it is not
DATABASES = Family({
    **each("""psql mysql mariadb mongo mongosh redis-cli clickhouse-client cqlsh pg_restore mysqladmin dropdb
              createdb createuser dropuser mongorestore mongoimport sqlcmd""", database),
    **each("sqlite3 duckdb", sqlite),
    **each("pg_dump pg_dumpall", Writer("dumps into", Options(short_values="fhUpdnNtTZjEST", aliases={
        "--file": "-f"}), written="none", target_flags=("-f",))),
    "mysqldump": Writer("dumps into", Options(short_values="rhuPS", aliases={"--result-file": "-r"}),
                        written="none", target_flags=("-r",)),
    "mongodump": Writer("dumps into", Options(short_values="ohudc", aliases={"--out": "-o"}),
                        written="none", target_flags=("-o",)),
    "pg_isready": READS,
    "snowsql": Rule(Kind.EXTERNAL, "runs SQL on a remote database"),
    "alembic": verbs("current history heads branches show check", default=_MIGRATES),
    **each("flyway liquibase dbmate", verbs("info validate status history diff version --version",
                                            default=_MIGRATES)),
    "prisma": verbs("validate version --version", default=_MIGRATES, format=FOLDER, init=FOLDER,
                    generate=RUNS_CODE),
}, sources=("https://www.postgresql.org/docs/current/app-psql.html", "https://sqlite.org/cli.html",
            "https://duckdb.org/docs/api/cli/overview", "https://dev.mysql.com/doc/refman/8.0/en/mysql.html"))

# ---------------------------------------------------------------------------------------------
# Containers and clusters

_PUSHES_IMAGE = Given(word_set("--push --output=type=registry"), PUBLISHES, otherwise=_CONTAINERS)
_DOCKER_OBJECT = verbs("ls list inspect history", default=_CONTAINERS, push=PUBLISHES, build=_PUSHES_IMAGE)
_DOCKER = remote_daemon(Subcommands(
    {**each("ps images inspect logs version info history search top stats port diff events", READS),
     **each("image container volume network context buildx plugin system", _DOCKER_OBJECT),
     **each("login logout", SETTINGS),
     **each("push", PUBLISHES), "build": _PUSHES_IMAGE,
     "manifest": verbs("inspect", default=_CONTAINERS, push=PUBLISHES),
     "compose": verbs("ps logs config ls top images version port", default=_CONTAINERS, push=PUBLISHES)},
    default=_CONTAINERS,
    value_flags=word_set("-H --host --context --config -c --log-level"),
))
_KUBECTL = Subcommands(
    {**each("""get describe logs top explain version api-resources api-versions cluster-info diff auth wait
               events completion plugin options help kustomize""", READS),
     "config": verbs("view get-contexts current-context get-clusters get-users", default=SETTINGS),
     "rollout": verbs("status history", default=_CLUSTER)},
    default=unless_dry_run(_CLUSTER),
    value_flags=word_set("-n --namespace --context --kubeconfig --cluster --user -s --server --token"),
)
_HELM = Subcommands(
    {**each("list ls status get history show inspect template search version lint env verify help "
            "completion", READS),
     **each("plugin registry", SETTINGS),
     **each("pull fetch package create", FOLDER),
     **each("dependency dep", verbs("list ls", default=FOLDER)),
     "push": PUBLISHES,
     "repo": verbs("list ls", default=SETTINGS)},
    default=unless_dry_run(_CLUSTER),
    value_flags=word_set("-n --namespace --kube-context --kubeconfig"),
)

CONTAINERS = Family({
    **each("docker podman nerdctl", _DOCKER),
    **each("kubectl oc", _KUBECTL),
    "helm": _HELM,
    "kustomize": verbs("build version help docs-fn", default=FOLDER),
    "eksctl": verbs("get info version completion help", default=_CLUSTER,
                    utils=verbs("describe-stacks describe-addon-versions describe-addon-configuration schema",
                                default=_CLUSTER, write_kubeconfig=SETTINGS)),
    "minikube": verbs("status ip version logs profile update-check docker-env podman-env completion help",
                      default=_LOCAL_CLUSTER, addons=verbs("list images", default=_LOCAL_CLUSTER),
                      service=verbs("list", default=_LOCAL_CLUSTER)),
    **each("kind k3d", verbs("get version help completion", default=_LOCAL_CLUSTER,
                             cluster=verbs("list get", default=_LOCAL_CLUSTER),
                             export=verbs("", default=SETTINGS, logs=_LOCAL_CLUSTER))),
    "skaffold": verbs("render diagnose version schema fix survey options completion help inspect",
                      default=_CLUSTER, init=FOLDER, config=SETTINGS),
    "k9s": Rule(Kind.EXTERNAL, "opens a console that can change a remote cluster"),
    **each("argocd flux", cloud),
}, sources=("https://docs.docker.com/reference/cli/docker/", "https://kubernetes.io/docs/reference/kubectl/",
            "https://helm.sh/docs/helm/", "https://eksctl.io/usage/",
            "https://minikube.sigs.k8s.io/docs/commands/",
            "https://kind.sigs.k8s.io/docs/user/quick-start/", "https://skaffold.dev/docs/references/cli/"))

# ---------------------------------------------------------------------------------------------
# Infrastructure as code and configuration management

_TERRAFORM = verbs(
    "plan show output validate version providers graph console help",
    default=_INFRASTRUCTURE,
    **each("init get login logout", SETTINGS),
    fmt=rewrites_here(checks="-check -write=false"),
    state=verbs("list show pull", default=REMOTE),
    workspace=verbs("list show", default=REMOTE, select=SETTINGS),
)

INFRASTRUCTURE = Family({
    **each("terraform tofu", _TERRAFORM),
    "terragrunt": Subcommands({**_TERRAFORM.verbs, "run-all": _TERRAFORM, "run": _TERRAFORM},
                              default=_INFRASTRUCTURE),
    "pulumi": verbs("preview whoami version about logs help", default=_INFRASTRUCTURE,
                    **each("login logout plugin install", SETTINGS),
                    config=verbs("get", default=FOLDER, bare=READS),
                    stack=verbs("ls output history export select", default=REMOTE)),
    "cdk": verbs("docs doctor version acknowledge notices --version", default=_INFRASTRUCTURE,
                 **each("synth synthesize diff list ls watch", RUNS_CODE),  # they run the app's code
                 **each("init context", FOLDER)),
    **each("serverless sls", verbs("info logs print metrics --version", default=_INFRASTRUCTURE,
                                   invoke=verbs("", default=_INFRASTRUCTURE, local=RUNS_CODE),
                                   **each("package offline", RUNS_CODE), create=FOLDER,
                                   **each("login logout config", SETTINGS),
                                   plugin=verbs("list search", default=PACKAGES))),
    "packer": verbs("validate inspect version console --version", default=_INFRASTRUCTURE,
                    fmt=rewrites_here(checks="-check -write=false"),
                    **each("init plugins", SETTINGS), hcl2_upgrade=FOLDER),
    "vagrant": verbs("status global-status ssh-config version port validate --version",
                     default=_LOCAL_CLUSTER,
                     init=FOLDER, box=verbs("list outdated", default=SETTINGS), push=_DEPLOYS,
                     cloud=verbs("search", default=PUBLISHES)),
    "ansible": ansible(playbook=False),
    "ansible-playbook": ansible(playbook=True),
    "ansible-pull": Rule(Kind.FORK, "runs configuration tasks on this machine"),
    "ansible-galaxy": Subcommands({
        **each("role collection", verbs("list info search", default=PACKAGES, init=FOLDER,
                                        **each("publish import", PUBLISHES))),
        **each("install remove", PACKAGES), **each("list info search", READS)}, default=PACKAGES),
    "ansible-vault": verbs("view encrypt_string", **each("encrypt decrypt rekey create", Writer("rewrites")),
                           edit=EDITOR, default=READS),
    **each("ansible-inventory ansible-doc ansible-config", READS),
    "salt": salt,
    **each("salt-ssh salt-run salt-cloud", Rule(Kind.EXTERNAL, "acts on remote minions or cloud machines")),
    **each("salt-call salt-key", Rule(Kind.FORK, "changes this machine's configuration or keys")),
    "puppet": Subcommands({
        **each("apply agent", Given(word_set("--noop"), READS, otherwise=SYSTEM)),
        **each("parser lookup facts help describe", READS),
        "module": verbs("list search", default=PACKAGES),
        "config": verbs("print", default=SETTINGS),
    }, default=SYSTEM),
    "bolt": verbs("--version", default=ANOTHER_MACHINE, **each("inventory plan task", verbs(
        "show", default=ANOTHER_MACHINE))),
    "chef-client": Given(word_set("-W --why-run"), READS, otherwise=SYSTEM),
    "chef-solo": SYSTEM,
    "knife": cloud,
    "chef": verbs("--version env", default=RUNS_CODE, generate=FOLDER, install=PACKAGES, push=PUBLISHES),
    "chef-run": ANOTHER_MACHINE,
}, sources=("https://developer.hashicorp.com/terraform/cli/commands",
            "https://www.pulumi.com/docs/cli/commands/",
            "https://docs.aws.amazon.com/cdk/v2/guide/cli.html",
            "https://www.serverless.com/framework/docs/providers/aws/cli-reference",
            "https://developer.hashicorp.com/packer/docs/commands",
            "https://developer.hashicorp.com/vagrant/docs/cli",
            "https://docs.ansible.com/ansible/latest/cli/ansible-playbook.html",
            "https://docs.ansible.com/ansible/latest/playbook_guide/playbooks_checkmode.html",
            "https://docs.saltproject.io/en/latest/ref/cli/",
            "https://www.puppet.com/docs/puppet/latest/man/apply",
            "https://docs.chef.io/ctl_chef_client/"))

# ---------------------------------------------------------------------------------------------
# Clouds and their storage

_COPIES = each("cp mv sync rsync copy copyto move moveto get put", storage_copy)
_OBJECT_READS = """ls lsd lsl lsf lsjson la du stat cat head tree size check md5sum sha1sum hash info help
                   version"""

CLOUDS = Family({
    **each("aws gcloud az doctl oci ibmcloud hcloud linode-cli scw exo vultr-cli aliyun bq", cloud),
    "gsutil": Subcommands({**each(_OBJECT_READS + " signurl", READS), **_COPIES,
                           **each("rm rb mb", storage_target), "config": SETTINGS},
                          default=_STORAGE, value_flags=word_set("-o -h -u -p")),
    "azcopy": verbs("list jobs env --version", default=_STORAGE, **_COPIES,
                    **each("login logout", SETTINGS), remove=storage_target),
    "s3cmd": verbs(_OBJECT_READS, default=_STORAGE, **_COPIES, **each("del rm rb mb", storage_target),
                   configure=SETTINGS),
    "rclone": verbs(_OBJECT_READS + " listremotes about config", default=_STORAGE, **_COPIES,
                    **each("bisync", _STORAGE),
                    **each("delete deletefile purge rmdir rmdirs mkdir touch", storage_target),
                    serve=SERVICES),
    "mc": verbs(_OBJECT_READS + " find diff ping ready", default=_STORAGE, alias=SETTINGS),
}, sources=("https://docs.aws.amazon.com/cli/latest/reference/",
            "https://docs.aws.amazon.com/cli/latest/reference/s3/",
            "https://cloud.google.com/sdk/gcloud/reference", "https://cloud.google.com/storage/docs/gsutil",
            "https://learn.microsoft.com/cli/azure/reference-index",
            "https://learn.microsoft.com/azure/storage/common/storage-ref-azcopy",
            "https://docs.digitalocean.com/reference/doctl/",
            "https://docs.oracle.com/iaas/tools/oci-cli/latest/",
            "https://rclone.org/commands/", "https://s3tools.org/usage",
            "https://min.io/docs/minio/linux/reference/minio-mc.html"))

# ---------------------------------------------------------------------------------------------
# Platforms as a service: deploying, scaling and configuring hosted apps acts outside

_HEROKU_READS = """apps ps config releases addons domains logs status whoami regions stacks features
                   buildpacks drains access certs pipelines spaces teams members labs plugins version help
                   info open sessions
                   authorizations clients keys notifications orgs"""
_READ_ACTIONS = "info list ls get show status logs log whoami wait diff open outputs"
_PLATFORM_SETTINGS = {**each("login logout auth:login auth:logout auth:token link unlink use", SETTINGS),
                      **each("plugins:install plugins:uninstall plugins:update update", SETTINGS)}

PLATFORMS = Family({
    "heroku": topics({**_PLATFORM_SETTINGS, **each("local local:run local:start", RUNS_CODE),
                      "git:remote": REPO, "git:clone": _CLONES},
                     _HEROKU_READS, _READ_ACTIONS, _PLATFORM),
    **each("fly flyctl", verbs(
        "status logs version doctor info releases ips ping dashboard open history",
        default=_PLATFORM, auth=verbs("whoami token", default=SETTINGS), **each("login logout", SETTINGS),
        **each("apps secrets machine machines volumes certs regions scale postgres redis image ips",
               verbs("list ls show status", default=_PLATFORM)),
        config=verbs("show display env validate", default=_PLATFORM, save=FOLDER),
        ssh=ANOTHER_MACHINE, deploy=_DEPLOYS)),
    "vercel": verbs("ls list inspect logs whoami --version help", default=_PLATFORM, bare=_DEPLOYS,
                    **each("deploy promote rollback redeploy", _DEPLOYS), **each("dev build", RUNS_CODE),
                    **each("link pull", FOLDER), **each("login logout switch", SETTINGS),
                    **each("env domains projects dns certs secrets teams alias",
                           verbs("ls list", default=_PLATFORM, pull=FOLDER))),
    "netlify": topics({**_PLATFORM_SETTINGS, **each("dev build serve functions:serve", RUNS_CODE),
                       **each("link init", FOLDER), "deploy": _DEPLOYS},
                      "status sites logs open watch api help", _READ_ACTIONS, _PLATFORM),
    "railway": verbs("status logs whoami list open docs version --version", default=_PLATFORM,
                     up=_DEPLOYS, **each("login logout link unlink", SETTINGS), run=_RUN_IN, shell=RUNS_CODE,
                     variables=Given(word_set("--set -s"), _PLATFORM, otherwise=READS)),
    "render": verbs("services logs whoami workspaces --version", default=_PLATFORM,
                    deploys=verbs("list", default=_DEPLOYS), **each("login", SETTINGS), ssh=ANOTHER_MACHINE),
    "cf": verbs("""apps app logs services service env routes domains marketplace stacks buildpacks orgs org
                   spaces
                   space events quotas target version help curl""", default=_PLATFORM,
                **each("login logout api auth", SETTINGS), push=_DEPLOYS, ssh=ANOTHER_MACHINE),
    "firebase": topics({**_PLATFORM_SETTINGS, **each("emulators:start emulators:exec serve", RUNS_CODE),
                        "init": FOLDER, "deploy": _DEPLOYS, "hosting:channel:deploy": _DEPLOYS},
                       "projects apps help open", _READ_ACTIONS + " config:get functions:log", _PLATFORM),
    "wrangler": verbs("whoami tail types --version docs", default=_PLATFORM,
                      **each("deploy publish", _DEPLOYS), dev=RUNS_CODE, **each("login logout", SETTINGS),
                      **each("init generate", FOLDER),
                      **each("kv kv:key kv:namespace kv:bulk r2 d1 secret queues versions deployments pages "
                             "vectorize hyperdrive", verbs("list get info view status", default=_PLATFORM,
                                                           key=verbs("list get", default=_PLATFORM),
                                                           namespace=verbs("list", default=_PLATFORM),
                                                           object=verbs("get", default=_PLATFORM),
                                                           bucket=verbs("list", default=_PLATFORM),
                                                           project=verbs("list", default=_PLATFORM),
                                                           deployment=verbs("list", default=_PLATFORM)))),
    "amplify": verbs("status env console --version help", default=_PLATFORM,
                     **each("push publish", _DEPLOYS), **each("pull add update remove codegen", FOLDER),
                     mock=RUNS_CODE, configure=SETTINGS),
    "eb": verbs("status health logs list events printenv open console platform labs --version",
                default=_PLATFORM,
                deploy=_DEPLOYS, init=FOLDER, ssh=ANOTHER_MACHINE, local=RUNS_CODE),
    "kamal": verbs("details version help --version", default=_DEPLOYS, init=FOLDER,
                   app=verbs("details logs containers images version", default=_DEPLOYS)),
}, sources=("https://devcenter.heroku.com/articles/heroku-cli-commands", "https://fly.io/docs/flyctl/",
            "https://vercel.com/docs/cli", "https://cli.netlify.com/",
            "https://docs.railway.com/reference/cli-api",
            "https://render.com/docs/cli", "https://cli.cloudfoundry.org/en-US/v8/",
            "https://firebase.google.com/docs/cli",
            "https://developers.cloudflare.com/workers/wrangler/commands/",
            "https://docs.amplify.aws/gen1/javascript/tools/cli/commands/",
            "https://docs.aws.amazon.com/elasticbeanstalk/latest/dg/eb-cli3.html",
            "https://kamal-deploy.org/docs/commands/"))


# ---------------------------------------------------------------------------------------------
# The table: the families above, and those of hosted services' tools in tools.toml

FAMILIES: dict[str, Family] = {
    "shell": SHELL, "wrappers": WRAPPERS, "files": FILES, "system": SYSTEM_TOOLS, "git and forges": FORGES,
    "launchers": LAUNCHERS, "packages and registries": PACKAGES_AND_REGISTRIES, "formatters": FORMATTERS,
    "network": NETWORK, "chat and mail": CHAT_AND_MAIL, "databases": DATABASES, "containers": CONTAINERS,
    "infrastructure": INFRASTRUCTURE, "clouds": CLOUDS, "platforms": PLATFORMS,
    **tooltable.load(),
}


def _merged(families: dict[str, Family]) -> dict[str, Entry]:
    """Every family's programs; a program in two families (a row of tools.toml the families
    above have too) is an error, so that no row is silently shadowed."""
    programs: dict[str, Entry] = {}
    for name, family in families.items():
        if twice := programs.keys() & family.programs.keys():
            raise InvalidArgument(f"{', '.join(sorted(twice))}: in the family {name!r} and in another")
        programs.update(family.programs)
    return programs


PROGRAMS: dict[str, Entry] = _merged(FAMILIES)
