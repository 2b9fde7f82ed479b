"""benchmarks/reproduce_diloco.py's Scheduler: the order a tuned grid's reads and its runs'
finishes come in, scripted, so the race the bytes_to_loss lane hit (a grid run finishing between
two reads of its grid) is tested without depending on thread timing.

The Scheduler is the real one; the context it drives is a stand-in that records which runs were
started (starting `diloco train` is what the integration tests cover)."""

import threading

import pytest
from conftest import benchmark_module


def _rd():
    return benchmark_module("reproduce_diloco")


class _Ctx:
    """What Scheduler asks of a context: jobs, finished, result, train. Run `a` (the grid's)
    finishes only once its summary has landed (`landed`, set by the grid's read)."""

    jobs = 2

    def __init__(self):
        self.done: set[str] = set()
        self.trained: list[str] = []
        self.landed = threading.Event()

    def finished(self, run, model=False):
        return run.name in self.done

    def result(self, run):
        return {"val_loss": 1.0} if run.name in self.done else None

    def train(self, run):
        self.trained.append(run.name)
        if run.name == "a":
            assert self.landed.wait(10), "the grid was never read after run c finished"
        self.done.add(run.name)
        return True, 0.0


class _Grid:
    """A grid of one lr (run `a`) that widens to two (`b`) once `a` has finished. The read made
    just after the other run (`c`) finishes sees `a` unfinished and `a`'s summary lands right
    after it: a worker thread finishing between two of the main loop's reads."""

    def __init__(self, rd):
        self.a = rd.Run("a", "lr 1", 0, ("--outer-lr", "1"))
        self.b = rd.Run("b", "lr 1.4", 0, ("--outer-lr", "1.4"))
        self.seed1 = rd.Run("s1", "lr 1.4 seed 1", 1, ("--outer-lr", "1.4"))

    def grid_runs(self, ctx):
        if "a" in ctx.done:
            return [self.a, self.b]
        if "c" in ctx.done:  # stale: a's summary lands just after this read
            ctx.done.add("a")
            ctx.landed.set()
        return [self.a]

    def runs(self, ctx):
        return [self.seed1]


@pytest.mark.timeout(30)
def test_a_grid_widened_between_two_reads_still_runs_its_new_lr():
    rd = _rd()
    ctx, grid = _Ctx(), _Grid(rd)
    plan = rd.Plan(runs=[rd.Run("c", "other", 0, ("--x",))], tuned=[grid])
    n = rd.Scheduler(ctx, lambda part, span, done: None).execute({"p": plan})
    # one read would have seen [a] all finished and stopped waiting: b would never have run
    assert sorted(ctx.trained[:2]) == ["a", "c"] and ctx.trained[2:] == ["b", "s1"]
    assert n == 4


class _Widens:
    """A grid of one lr (run `a`) that widens to two (`b`) once `a` has finished; then one seed."""

    def __init__(self, rd):
        self.a, self.b = (rd.Run(n, n, 0, (f"--{n}",)) for n in ("a", "b"))
        self.seed1 = rd.Run("s1", "s1", 1, ("--s1",))

    def grid_runs(self, ctx):
        return [self.a, self.b] if "a" in ctx.done else [self.a]

    def runs(self, ctx):
        return [self.seed1]


class _One(_Ctx):
    jobs = 1

    def train(self, run):
        self.trained.append(run.name)
        self.done.add(run.name)
        return True, 0.0


@pytest.mark.timeout(30)
def test_a_grid_runs_before_fixed_runs_of_its_kind_even_once_widened():
    """Grid runs gate the runs waiting for a pick, so they go first of their kind, a widened
    grid's new lr too (it used to queue behind every run added before it)."""
    rd = _rd()
    ctx = _One()
    fixed = [rd.Run(n, n, 0, (f"--{n}",)) for n in ("r1", "r2")]
    rd.Scheduler(ctx, lambda part, span, done: None).execute({"p": rd.Plan(runs=fixed, tuned=[_Widens(rd)])})
    assert ctx.trained == ["a", "b", "r1", "r2", "s1"]


class _Killed(_Ctx):
    """Run `k` is killed by a signal (the lane stopped) while run `slow` is still going."""

    def __init__(self, rd):
        super().__init__()
        self.rd = rd
        self.killed = threading.Event()

    def train(self, run):
        self.trained.append(run.name)
        if run.name == "k":
            self.killed.set()
            raise self.rd.Stopped("k was stopped by signal 15: not recorded")
        assert self.killed.wait(10)
        self.done.add(run.name)
        return True, 0.0


@pytest.mark.timeout(30)
def test_a_run_killed_by_a_signal_stops_the_lane_and_is_not_recorded():
    """A run whose process a signal killed is no result (a restart runs it again): the scheduler
    starts nothing more, lets the running one finish, and says it stopped."""
    rd = _rd()
    ctx = _Killed(rd)
    runs = [rd.Run(name, name, 0, (f"--{name}",)) for name in ("slow", "k", "next")]
    scheduler = rd.Scheduler(ctx, lambda part, span, done: None)
    n = scheduler.execute({"p": rd.Plan(runs=runs)})
    assert scheduler.stopped and sorted(ctx.trained) == ["k", "slow"]  # "next" never started
    assert ctx.done == {"slow"} and n == 1


class _Slow(_One):
    """One run that takes a while: the scheduler's ticks come while it is in flight."""

    def train(self, run):
        self.trained.append(run.name)
        threading.Event().wait(0.5)
        self.done.add(run.name)
        return True, 0.5


@pytest.mark.timeout(30)
def test_a_part_records_its_elapsed_time_while_a_run_is_in_flight():
    """A lane killed at a session's end (SIGKILL: nothing runs on the way out) had counted its
    part's time only up to its last finished run; the scheduler now records it each tick too,
    with the runs done so far, so the part's elapsed time reaches the last tick before the kill."""
    rd = _rd()
    calls: list[tuple[str, float, int]] = []
    scheduler = rd.Scheduler(_Slow(), lambda part, span, done: calls.append((part, span, done)))
    scheduler.TICK_S = 0.05
    scheduler.execute({"p": rd.Plan(runs=[rd.Run("r", "r", 0, ("--r",))])})
    ticks = [c for c in calls if c[2] == 0]  # before the run finished
    assert len(ticks) >= 3 and all(part == "p" for part, _, _ in ticks)
    spans = [span for _, span, _ in calls]
    assert spans == sorted(spans) and 0 < ticks[0][1] < 0.5 <= calls[-1][1]  # growing, to the finish
    assert calls[-1][0] == "p" and calls[-1][2] == 1
