"""The OCR example end to end on 2 ranks, shrunk to seconds (`make demo` runs it full size)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from launch import run_ringrun

pytest.importorskip("lightning")
pytest.importorskip("PIL")
pytestmark = pytest.mark.multirank

EXAMPLES = Path(__file__).parent.parent / "examples" / "ocr"


def test_the_lightning_ocr_example_trains_reports_cer_and_writes_a_timeline(tmp_path):
    timeline = tmp_path / "timeline.json"
    result = run_ringrun(
        "-np",
        "2",
        sys.executable,
        str(EXAMPLES / "train_lightning.py"),
        "--lines",
        "256",
        "--val-lines",
        "64",
        "--epochs",
        "2",
        "--timeline",
        str(timeline),
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rates = [
        float(r)
        for r in re.findall(r"\[0\] epoch \d+: character error rate ([\d.]+)", result.stdout)
    ]
    assert len(rates) == 2 and all(0 <= r <= 1.5 for r in rates)
    assert "[1] epoch" not in result.stdout  # rank 0 reports
    assert re.search(r"final character error rate [\d.]+ after 2 epochs on 2 ranks", result.stdout)
    events = json.loads(timeline.read_text())
    trace = events["traceEvents"] if isinstance(events, dict) else events
    rows = {event["args"]["name"] for event in trace if event.get("name") == "thread_name"}
    assert any(row.startswith("gradients.") for row in rows)  # a row per gradient bucket
    assert any(event.get("name") == "ALLREDUCE" for event in trace)


def test_the_keras_ocr_example_trains_and_reports_cer(tmp_path):
    pytest.importorskip("keras")
    pytest.importorskip("tensorflow")
    result = run_ringrun(
        "-np",
        "2",
        sys.executable,
        str(EXAMPLES / "train_keras.py"),
        "--lines",
        "256",
        "--val-lines",
        "64",
        "--epochs",
        "2",
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert len(re.findall(r"\[0\] epoch \d+: character error rate [\d.]+", result.stdout)) == 2
    assert re.search(r"final character error rate [\d.]+ after 2 epochs on 2 ranks", result.stdout)
