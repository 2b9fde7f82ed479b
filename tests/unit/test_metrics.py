"""Strict JSON in metrics.jsonl and a perplexity that never raises."""

import json
import math
import signal
import threading

import pytest

from diloco.rundir.metrics import MetricsWriter, interrupts_deferred, json_safe, perplexity, read_metrics


@pytest.mark.timeout(10)
def test_json_safe_replaces_every_non_finite_float_recursively():
    obj = {"a": math.nan, "b": [1.0, math.inf, (-math.inf, 2)], "c": {"d": {"e": math.nan}}, "f": "nan"}
    safe = json_safe(obj)
    assert safe == {"a": None, "b": [1.0, None, [None, 2]], "c": {"d": {"e": None}}, "f": "nan"}
    json.dumps(safe, allow_nan=False)  # strict JSON now
    assert obj["a"] is not None and math.isinf(obj["b"][1])  # the input is left alone
    assert json_safe(3) == 3 and json_safe(True) is True and json_safe(None) is None


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "loss,expected",
    [(0.0, 1.0), (2.0, math.exp(2.0)), (709.0, math.exp(709.0)), (1e4, None), (710.0, None)]
    + [(math.nan, None), (math.inf, None), (-math.inf, None), (None, None)],
)
def test_perplexity_is_exp_or_none_and_never_raises(loss, expected):
    assert perplexity(loss) == expected


@pytest.mark.timeout(60)
def test_metrics_jsonl_is_strict_json_with_non_finite_values(tmp_path):
    writer = MetricsWriter(tmp_path)
    writer.log("eval", inner_step=4, val_loss=math.nan, val_ppl=perplexity(math.nan), tokens=10)
    writer.log("inner", inner_step=5, train_loss=math.inf, grad_norm=[1.0, -math.inf], worker=1)
    writer.log("inner", inner_step=6, train_loss=2.5, worker=0)
    writer.close()
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    for line in text.splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    lines = read_metrics(tmp_path)
    assert lines[0] == {"kind": "eval", "inner_step": 4, "val_loss": None, "val_ppl": None, "tokens": 10}
    assert lines[1]["train_loss"] is None and lines[1]["grad_norm"] == [1.0, None]
    assert lines[2]["train_loss"] == 2.5
    assert any(p.name.startswith("events.out.tfevents") for p in tmp_path.iterdir())


@pytest.mark.timeout(60)
def test_lines_logged_from_several_threads_are_written_in_order_by_the_writers_thread(tmp_path):
    writer = MetricsWriter(tmp_path)

    def log(w: int) -> None:
        for i in range(200):
            writer.log("inner", inner_step=i, train_loss=float(i), worker=w)

    threads = [threading.Thread(target=log, args=(w,)) for w in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    size = writer.offset()  # every line logged is in the file, and counted
    assert size == (tmp_path / "metrics.jsonl").stat().st_size
    lines = read_metrics(tmp_path)
    assert len(lines) == 600
    for w in range(3):
        assert [m["inner_step"] for m in lines if m["worker"] == w] == list(range(200))
    writer.log("eval", inner_step=200, val_loss=1.0)
    writer.close()  # writes what is queued
    assert read_metrics(tmp_path)[-1] == {"kind": "eval", "inner_step": 200, "val_loss": 1.0}


@pytest.mark.timeout(60)
def test_a_write_that_fails_in_the_writers_thread_is_raised_to_the_caller(tmp_path):
    (tmp_path / "metrics.jsonl").symlink_to("/dev/full")  # every write: ENOSPC, as on a full disk
    writer = MetricsWriter(tmp_path)
    writer.log("eval", inner_step=1, val_loss=1.0)
    with pytest.raises(OSError, match="No space"):
        writer.flush()
    with pytest.raises(OSError, match="No space"):
        writer.log("eval", inner_step=2, val_loss=1.0)
    with pytest.raises(OSError):
        writer.close()


@pytest.mark.timeout(10)
def test_a_ctrl_c_inside_the_tensorboard_writer_acts_once_the_writer_is_done():
    done = []
    # Python's own Ctrl-C handler (a shell may start the tests with SIGINT ignored)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            with interrupts_deferred():
                signal.raise_signal(signal.SIGINT)  # what Ctrl-C does, here mid-write
                done.append("the write finished")
        assert done == ["the write finished"]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is back
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.mark.timeout(10)
def test_a_sigterm_inside_the_writer_reaches_the_handler_the_run_set_afterwards():
    seen = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        with interrupts_deferred():
            signal.raise_signal(signal.SIGTERM)
            signal.raise_signal(signal.SIGTERM)  # twice: the handler runs once, after the block
            assert seen == []
        assert seen == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, before)
