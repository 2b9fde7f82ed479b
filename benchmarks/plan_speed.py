"""How long `diloco plan` takes to answer a sweep at the scale issue 34 names (target < 10 s):
a 10B model, 64 workers, 24 configurations (H × codec × fragments), the bandwidth for 95%
utilisation searched for each. The command runs as a user runs it (a new process, imports
included), three times; the median is reported.

    python benchmarks/plan_speed.py     # writes benchmarks/results/plan_speed.json
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

COMMAND = [
    "plan", "--model", "10b", "--workers", "64", "--rounds", "200", "--step-s", "0.8", "--link-mbps", "10000",
    "--sweep", "H=50,100,250", "--sweep", "codec=fp32,fp4", "--sweep", "fragments=1,4,8,16", "--json",
]  # fmt: skip


def main() -> None:
    times, rows = [], []
    for _ in range(3):
        start = time.perf_counter()
        command = [sys.executable, "-m", "diloco", *COMMAND]
        out = subprocess.run(command, capture_output=True, text=True, check=True)
        times.append(time.perf_counter() - start)
        rows = json.loads(out.stdout)
    result = {
        "benchmark": "plan_speed",
        "command": "diloco " + " ".join(COMMAND),
        "configurations": len(rows),
        "seconds": statistics.median(times),
        "seconds_each_run": times,
        "target_seconds": 10.0,
    }
    out_file = Path(__file__).parent / "results" / "plan_speed.json"
    out_file.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
