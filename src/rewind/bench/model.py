"""What a benchmark run produces: metrics with their raw samples, peers' figures beside
them, the checkpoint-cost curve, and the machine it ran on."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field


@dataclass
class Metric:
    """One measured quantity: every sample, and the same operation on each peer engine
    (its samples, or the reason it has none)."""

    key: str
    what: str
    unit: str
    samples: list[float] = field(default_factory=list)
    target: float | None = None  # met when the median is below it
    peers: dict[str, list[float] | str] = field(default_factory=dict)
    # A ratio's raw times: environment -> seconds of each repeat (bench/work.py)
    seconds: dict[str, list[float]] = field(default_factory=dict)

    @property
    def median(self) -> float | None:
        return statistics.median(self.samples) if self.samples else None

    @property
    def met(self) -> bool | None:
        if self.target is None or self.median is None:
            return None
        return self.median < self.target


@dataclass
class Report:
    machine: dict[str, str]
    quick: bool
    rounds: int
    metrics: list[Metric] = field(default_factory=list)
    # engine -> [(MiB of guest memory in use, seconds for a checkpoint)]
    curve: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    peers: dict[str, str] = field(default_factory=dict)  # engine -> "ok" or why it could not run
    seconds: float = 0.0

    def add(self, key: str, what: str, unit: str, samples: list[float],
            target: float | None = None) -> Metric:
        metric = Metric(key, what, unit, list(samples), target)
        self.metrics.append(metric)
        return metric

    def metric(self, key: str) -> Metric:
        return next(m for m in self.metrics if m.key == key)

    def to_json(self) -> dict:
        return {
            "machine": self.machine, "quick": self.quick, "rounds": self.rounds,
            "seconds": round(self.seconds, 1),
            "peers": self.peers,
            "metrics": [{**{k: v for k, v in asdict(m).items() if k != "seconds" or v},
                         "median": m.median, "met": m.met} for m in self.metrics],
            "curve": {engine: [{"touched_mib": mib, "checkpoint_s": s} for mib, s in points]
                      for engine, points in self.curve.items()},
        }
