"""The guard: classify an agent's command (classify.py) and run it with the cheapest undo
that covers it (guarded.py, trial.py, gittier.py).

Nothing is imported here: the classifier's parser costs 40 ms to load, and the SDK's
exec path imports trial.py without it."""
