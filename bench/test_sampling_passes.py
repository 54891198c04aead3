"""bench.sampling_passes end to end on the tiny random-weight Llama: the kernel's threshold search counted (on CPU
through the Triton interpreter, in a process of its own so that the interpreter is on before pagedkernels loads)."""
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.bench_e2e


def test_counts_the_passes_and_writes_json(tiny_llama, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    done = subprocess.run([sys.executable, "-m", "bench.sampling_passes", "--model", tiny_llama, "--new-tokens", "2",
                           "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    [path] = tmp_path.glob("*-sampling-passes-*.json")
    report = json.loads(path.read_text())
    assert report["rows"] == 10 and report["vocab"] > 0
    for row in report["configs"].values():
        # Every row filters, so every row searches at least once; the histogram counts every row.
        assert 1 <= row["mean_passes"] <= row["max_passes"] and sum(row["histogram"]) == 10, row
        assert row["histogram"][0] == 0
