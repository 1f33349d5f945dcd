"""What a guarded step's copy may reach while it is watched.

Every step the guard runs in a copy is watched: its copy's network filter refuses and
records what the step reaches beyond plain work, and a step that reached anything is
external (refused, or run on the machine after a checkpoint when allowed). Plain work is
fetching code: the package registries and code hosts below, when the machine itself may
reach them. Writing to them is judged before anything runs (`git push`, `npm publish` and
the like are external in the tables), so reading them from a copy is safe to allow.
"""

from __future__ import annotations

from rewind.engine.network.netrules import NetworkRules, is_range, name_matches

# The names package managers and build tools fetch from by default: Python (pip, uv,
# poetry), JavaScript (npm, yarn, pnpm, bun, deno), Debian, Rust, Go, Ruby, Java, PHP, .NET,
# and the code hosts dependencies are cloned from.
REGISTRIES = (
    "pypi.org", "files.pythonhosted.org",
    "registry.npmjs.org", "registry.yarnpkg.com", "jsr.io", "deno.land",
    "deb.debian.org", "security.debian.org",
    "crates.io", "index.crates.io", "static.crates.io",
    "proxy.golang.org", "sum.golang.org",
    "rubygems.org", "index.rubygems.org",
    "repo.maven.apache.org", "repo1.maven.org", "plugins.gradle.org", "services.gradle.org",
    "repo.packagist.org", "api.nuget.org",
    "github.com", "codeload.github.com", "objects.githubusercontent.com",
    "raw.githubusercontent.com", "gitlab.com", "bitbucket.org",
)


def watched_rules(machine: NetworkRules) -> NetworkRules:
    """The rules of a copy of a machine with `machine`'s rules: only the registries it may
    reach itself (its deny rules still win); everything else is refused and recorded."""
    allowed = tuple(name for name in REGISTRIES if _reaches_by_name(machine, name))
    return NetworkRules(internet=False, allow=allowed, deny=machine.deny)


def _reaches_by_name(machine: NetworkRules, name: str) -> bool:
    """Does `machine` reach `name` wherever it resolves? A machine that reaches it only
    through an allowed range is not counted: allowing the name in the copy would let it
    reach addresses outside that range (the copy then reaches less, never more)."""
    if any(name_matches(rule, name) for rule in machine.deny if not is_range(rule)):
        return False
    return machine.internet or any(not is_range(rule) and name_matches(rule, name) for rule in machine.allow)
