"""benchmarks/reproduce_lane.sh: issue 36's four invocations in order, in their folders, the
ledgers seeded once. The python it is given is a stand-in that prints its arguments, so the test
reads the commands the lane runs (reproduce_diloco.py itself is what the integration tests run)."""

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "reproduce_lane.sh"


def _lane(tmp_path, py: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path / "lane"), py],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.timeout(60)
def test_the_lane_runs_the_four_invocations_in_order_and_seeds_its_ledgers_once(tmp_path):
    fake = tmp_path / "py"
    fake.write_text('#!/bin/bash\necho "RUN $*"\n')
    fake.chmod(0o755)
    assert _lane(tmp_path, str(fake)).returncode == 0
    lane = tmp_path / "lane"
    assert (lane / "ledger" / "runs.jsonl").read_text() == (
        ROOT / "benchmarks" / "results" / "reproduce_ledger" / "runs.jsonl"
    ).read_text()
    assert (lane / "micro_ledger" / "runs.jsonl").is_file()
    runs = [line.split()[1:] for line in (lane / "log").read_text().splitlines() if line.startswith("RUN")]
    assert [r[0] for r in runs] == ["benchmarks/reproduce_diloco.py"] * 4
    outs = [r[r.index("--out") + 1] for r in runs]
    assert [Path(o).name for o in outs] == [
        "reproduce_diloco.json",
        "reproduce_diloco_k8.json",
        "reproduce_diloco_micro_k8.json",
        "reproduce_diloco_micro.json",
    ]
    assert runs[0][runs[0].index("--part") + 1] == "H500,drop,dp"  # the headline, then drop
    assert runs[1][runs[1].index("--starts") + 1] == "warm,scratch"  # nano k = 8 at H = 10 both starts
    for r in runs:
        assert r[r.index("--jobs") + 1] == "2"
        micro = "micro" in r
        assert r[r.index("--ledger") + 1] == str(lane / ("micro_ledger" if micro else "ledger"))
        assert r[r.index("--workdir") + 1] == str(lane / ("micro_work" if micro else "work"))
    assert (lane / "log").read_text().rstrip().endswith("LANE DONE")
    # started again: the seeded ledgers are the lane's now, not copied over
    (lane / "ledger" / "runs.jsonl").write_text("")
    assert _lane(tmp_path, str(fake)).returncode == 0
    assert (lane / "ledger" / "runs.jsonl").read_text() == ""


@pytest.mark.timeout(60)
def test_the_lane_stops_at_the_first_invocation_that_fails(tmp_path):
    fake = tmp_path / "py"
    fake.write_text('#!/bin/bash\necho "RUN $*"\nexit 1\n')
    fake.chmod(0o755)
    _lane(tmp_path, str(fake))
    log = (tmp_path / "lane" / "log").read_text()
    assert log.count("RUN ") == 1 and "LANE DONE" not in log


@pytest.mark.timeout(60)
def test_the_lane_without_its_folder_says_how_to_call_it(tmp_path):
    p = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "usage: reproduce_lane.sh LANE [PYTHON]" in p.stderr
    p = subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path / "l")], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 2 and "run from a worktree's root" in p.stderr


@pytest.mark.timeout(60)
def test_the_lane_pending_chains_each_invocation_after_the_earlier_ones_and_sums(tmp_path):
    """--pending starts nothing: each invocation's --pending gets the earlier ones' outputs
    (--pending-after) and the total is their sum. The stand-in python answers --pending with a
    JSON of 1.5 h (and runs python itself for the sum)."""
    fake = tmp_path / "py"
    fake.write_text(
        "#!/bin/bash\n"
        'if [ "$1" = -c ]; then exec python3 "$@"; fi\n'
        'echo "$*" >> "$(dirname "$0")/calls"\n'
        'echo \'{"run_time_h": 1.5, "runs": ["a"]}\'\n'
    )
    fake.chmod(0o755)
    p = subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path / "lane"), str(fake), "--pending"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    calls = (tmp_path / "calls").read_text().splitlines()
    assert len(calls) == 4 and all("--pending" in c for c in calls)
    lane = tmp_path / "lane"
    for i, call in enumerate(calls):
        after = call.split("--pending-after")[1].split() if "--pending-after" in call else []
        assert after == [str(lane / f"pending_{j}.json") for j in range(i)]
    assert "the lane: 6.0 h of run time, 3.0 h elapsed two at a time" in p.stdout
    assert not (lane / "log").exists()  # nothing ran
