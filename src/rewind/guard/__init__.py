"""The guard: classify an agent's command and run it with the cheapest undo that covers it.

- classify.py: the entry point (`classify`), over walker.py (the shell syntax tree, walked
  with tree-sitter-bash), programs.py (the program table, by family), entries.py and
  handlers.py (what a table entry can say), inline.py, inline_js.py and inline_perl_ruby.py
  (inline programs: python -c, node -e, perl -e...), words.py, verdicts.py (Kind, Decision)
  and userrules.py (users' rewind.toml rules);
- guarded.py, trial.py, gittier.py: running a command with that undo.

Nothing is imported here: the classifier's parser costs 40 ms to load, and the SDK's
exec path imports trial.py without it."""
