"""What the benchmark scripts share: arguments, a scratch home beside the built image,
summaries and the report."""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rewind import Home, Sandbox
from rewind.engine.machine import Engine


def arguments(doc: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    return parser.parse_args()


@contextmanager
def scratch_home() -> Iterator[Home]:
    """A temporary REWIND_HOME sharing the built image and the default template; every
    machine and memory file made in it is removed afterwards, even on failure."""
    with tempfile.TemporaryDirectory(prefix="rewind-bench-") as tmp:
        home = Home(root=Path(tmp), images=Home.from_env().images)
        Engine(home).template(512, 2)  # saved once; not part of what is measured
        try:
            yield home
        finally:
            for left in Sandbox.list(home=home):
                left.delete()
            shutil.rmtree(home.runtime, ignore_errors=True)


def summary(samples: list[float]) -> dict[str, float]:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "n": len(samples)}


def report(results: dict[str, object], json_path: Path | None) -> None:
    for key, value in results.items():
        if isinstance(value, dict) and "median" in value:
            print(f"{key:30} median {value['median']:8.3f}  min {value['min']:8.3f}  max {value['max']:8.3f}"
                  f"  (n={value['n']})")
        else:
            print(f"{key:30} {value}")
    if json_path:
        json_path.write_text(json.dumps(results, indent=2))
