"""`rewind bench --quick` runs whole and reports well-formed figures (not their speed)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from conftest import rewind_cli

from rewind import Home
from rewind.bench.load import processes_naming

EXPECTED = {
    "start_to_first_exec_s", "exec_true_ms", "file_write_10mb_s", "file_read_10mb_s",
    "checkpoint_pause_guest_ms", "checkpoint_pause_qemu_ms", "checkpoint_call_s", "store_one_checkpoint_mib",
    "store_check_read_data_s", "restore_to_first_exec_s", "create_from_checkpoint_s",
    "branch_to_child_exec_s", "branch_source_pause_ms", "memory_per_idle_child_1_mib", "fan_out_1_answered_s",
    "guard_none_added_ms", "guard_git_added_ms", "guard_fork_added_ms",
    "curve_64_checkpoint_s", "curve_128_pause_ms", "curve_128_size_mib", "curve_restore_s",
    "loop_checkpoint_s", "loop_restore_to_exec_s", "loop_failed_try_s", "loop_passed_try_s",
    "loop_guarded_git_s", "loop_background_cpu_s", "loop_shm_peak_mib",
    "real_loop_work_s", "real_loop_checkpoint_s", "real_loop_restore_to_exec_s", "real_loop_failed_try_s",
    "real_loop_background_cpu_s", "real_loop_shm_peak_mib",
    "http_call_added_ms", "mcp_call_added_ms",
    "http_exec_added_ms", "http_checkpoint_added_ms", "http_restore_added_ms", "mcp_exec_added_ms",
    "mcp_checkpoint_added_ms", "mcp_restore_added_ms", "cli_help_s", "cli_exec_added_s",
    "checkpoint_flush_ms", "checkpoint_call_after_write_s", "diff_first_s", "diff_points_1mib_s",
    "diff_live_1mib_s", "own_image_build_s", "own_image_first_start_s", "own_image_start_s",
    "own_image_store_mib",
}
# A quick bench's work steps: pip's and pytest's are the full bench's only (bench/work.py).
WORK_STEPS = ("python_start", "cpu", "file_write", "spawn", "grep", "tar", "git", "sqlite")
WORK = {f"work_{step}_x" for step in WORK_STEPS} | {"work_median_x"}
EXPECTED |= WORK


@pytest.mark.slow  # over 30 s here
def test_quick_bench_reports_everything(home: Home, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    done = rewind_cli("bench", "--quick", "--json", str(out), timeout=900)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    text = done.stdout.decode()
    assert "rewind bench (quick" in text and "checkpoint call until it returns" in text
    assert "plain QEMU" in text and "gVisor" in text  # each peer has a column, figures or a reason

    report = json.loads(out.read_text())
    assert {"cpu", "accel", "qemu", "cores", "memory_mib"} <= set(report["machine"])
    metrics = {m["key"]: m for m in report["metrics"]}
    assert set(metrics) >= EXPECTED
    for m in metrics.values():
        assert m["samples"] and all(isinstance(s, int | float) for s in m["samples"]), m
        assert m["median"] is not None
        assert m["met"] in (True, False, None)
    assert set(report["peers"]) == {"plain QEMU", "gVisor", "buildah"}
    assert metrics["own_image_build_s"]["peers"]["buildah"]  # its import of the same archive
    assert all(isinstance(status, str) and status for status in report["peers"].values())
    assert not [k for k in metrics if k.startswith("s3_")]  # the bucket is not measured quickly
    assert [p["touched_mib"] for p in report["curve"]["rewind"]] == [64, 128]
    _check_work_rows(metrics)
    assert "median of the steps" in text  # the work section's own table
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(Path(tempfile.gettempdir()).glob("rewind-bench-*")), "the benchmark left files behind"
    assert not processes_naming("/rewind-bench-"), "the benchmark left processes behind"


def _check_work_rows(metrics: dict[str, dict]) -> None:
    """Each work step's ratios are its machine seconds over the host's, repeat by repeat."""
    for step in WORK_STEPS:
        m = metrics[f"work_{step}_x"]
        seconds, host = m["seconds"], m["seconds"]["host"]
        assert host and seconds["rewind"] and all(s > 0 for s in host + seconds["rewind"]), m
        assert m["samples"] == [ours / h for ours, h in zip(seconds["rewind"], host, strict=True)]
        assert m["peers"]["gVisor"]  # its ratios, or why it has none (--quick: not run)
    median = metrics["work_median_x"]
    assert len(median["samples"]) == len(WORK_STEPS) and median["target"] == 6.0
    assert metrics["work_spawn_x"]["target"] == 5.0


def test_work_bench_refuses_what_it_cannot_draw(home: Home, tmp_path: Path) -> None:
    """`--work` has no checkpoint curve to plot: refused before anything is measured. (The
    work section itself runs in the quick bench above; `--work` runs that section alone.)"""
    done = rewind_cli("bench", "--work", "--plot", str(tmp_path / "work.png"))
    assert done.returncode != 0 and "plot" in done.stderr.decode() and not (tmp_path / "work.png").exists()
    assert done.stderr.decode().strip().count("\n") == 0
