"""A benchmark report as a table, as JSON and as a plot."""

from __future__ import annotations

import json
import os
from pathlib import Path

from rich.table import Table

from rewind.bench.model import Report
from rewind.errors import InvalidArgument


def _figure(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    digits = 1 if unit in ("ms", "MiB") else 3
    return f"{value:.{digits}f} {unit}"


def table(report: Report) -> Table:
    engines = list(report.peers)
    mode = "quick" if report.quick else "full"
    t = Table(title=f"rewind bench ({mode}, {report.machine.get('accel', '?')}, {report.rounds} rounds)")
    for column in ("what", "median", "min - max", "target", *(f"{e} (x rewind)" for e in engines)):
        t.add_column(column)
    for m in report.metrics:
        spread = f"{_figure(min(m.samples), m.unit)} - {_figure(max(m.samples), m.unit)}" \
            if len(m.samples) > 1 else ""
        if m.target is None:
            target = ""
        else:
            target = f"< {_figure(m.target, m.unit)}: " + ("[green]met[/]" if m.met else "[red]missed[/]")
        cells = []
        for engine in engines:
            value = m.peers.get(engine)
            if isinstance(value, str):
                cells.append(f"[dim]{value}[/]")
            elif value:
                median = m.peer_median(engine)
                ratio = f" ({median / m.median:.2f}x)" if median is not None and m.median else ""
                cells.append(_figure(median, m.unit) + ratio)
            else:
                cells.append("")
        t.add_row(m.what, _figure(m.median, m.unit), spread, target, *cells)
    return t


def write_json(report: Report, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(report.to_json(), indent=2))
    os.replace(tmp, path)


def check_plotting() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise InvalidArgument("plotting needs matplotlib: pip install 'rewind[bench]'") from None


def write_plot(report: Report, path: Path) -> None:
    """Checkpoint time against memory in use, one line per engine."""
    check_plotting()
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(7, 4.5))
    for engine, points in report.curve.items():
        if points:
            axes.plot([mib for mib, _ in points], [s for _, s in points], marker="o", label=engine)
    axes.set_xlabel("guest memory in use (MiB)")
    axes.set_ylabel("checkpoint time (s)")
    axes.set_title(f"Checkpoint cost against memory in use ({report.machine.get('accel', '?')})")
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    figure.savefig(tmp, dpi=120)
    pyplot.close(figure)
    os.replace(tmp, path)
