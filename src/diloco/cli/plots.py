"""Plots: validation loss of several runs on one figure, against simulated time, inner steps
(per worker, or all workers' local steps), outer updates or bytes sent. Reads only run
directories (config.json, metrics.jsonl).

    diloco plot runs/sync runs/async --x sim_time_s --out loss.png
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from diloco import settings
from diloco.config import TrainConfig, load_json, upgrade
from diloco.errors import UserError
from diloco.rundir.metrics import read_metrics

X_AXES = {
    "sim_time_s": ("sim_time_s", "simulated time (s)"),
    "inner_steps": ("inner_step", "inner steps per worker"),
    "local_steps": ("inner_step", "local steps, all workers"),  # × the run's workers
    "outer_updates": ("version", "outer updates"),
    "bytes_sent": ("bytes_sent", "bytes sent, all workers"),
}


def run_label(config: dict) -> str:
    """A short name for a run from its config, e.g. 'async dn+DyLU k=4 H=50'."""
    method = config.get("method", "?")
    label = method
    if method == "async":
        config = upgrade(config)  # an older run's config.json: "server", async.dylu
        label += f" {config.get('async', {}).get('rule', '?')}"
    dylu = config.get("dylu", {})
    if dylu.get("enabled") is not False and (method == "async" or dylu.get("enabled")):
        label += "+DyLU"
    if method != "single":
        label += f" k={config.get('num_workers')}"
    return label + f" H={config.get('inner_steps')}"


# what run_label shows already, and settings that never change a run's results
_NOT_IN_LEGEND = {"method", "num_workers", "inner_steps", "async.rule", "dylu.enabled", "dylu.oracle"}
_NOT_IN_LEGEND |= {"out", "threads", "sim.procs", "data.cache_dir", "timeout_s"}


def _flat(config: dict, prefix: str = "") -> dict[str, Any]:
    """{dotted path: value} of a nested config.json."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def _shown(value: Any) -> str:
    text = ",".join(map(str, value)) if isinstance(value, list) else str(value)
    return text if len(text) <= 24 else text[:23] + "…"


def run_labels(configs: list[dict]) -> list[str]:
    """A legend label per run: `run_label`, then the settings whose values differ between these
    runs, by flag name (e.g. 'diloco k=2 H=5 codec=int8'); runs that still share a label get a
    number."""
    flats = [_flat(upgrade(c)) for c in configs]  # older runs: "server" read as "async"
    paths = sorted({p for f in flats for p in f} - _NOT_IN_LEGEND)
    differ = [p for p in paths if len({repr(f.get(p)) for f in flats}) > 1]
    flags = {s.path: s.flag.lstrip("-") for s in settings.walk(TrainConfig) if s.flag}
    labels = [
        " ".join([run_label(c)] + [f"{flags.get(p, p)}={_shown(f.get(p))}" for p in differ])
        for c, f in zip(configs, flats, strict=True)
    ]
    return [f"{label} #{i + 1}" if labels.count(label) > 1 else label for i, label in enumerate(labels)]


def curve(run_dir: Path, x: str) -> tuple[list[float], list[float]]:
    """The run's subset evaluations as (x values, validation losses)."""
    key = X_AXES[x][0]
    if not (run_dir / "metrics.jsonl").is_file():
        raise UserError(f"{run_dir} has no metrics.jsonl; pass run directories written by diloco train.")
    evals = [m for m in read_metrics(run_dir) if m["kind"] == "eval" and m.get("split") == "subset"]
    if not evals or key not in evals[0]:
        raise UserError(f"{run_dir} has no evaluations with {key}; it was written by an older diloco.")
    xs = [m[key] for m in evals]
    if x == "local_steps":
        config = load_json(run_dir / "config.json")
        xs = [v * (1 if config.get("method") == "single" else config.get("num_workers", 1)) for v in xs]
    return xs, [m["val_loss"] for m in evals]


def plot_runs(
    run_dirs: list[Path],
    *,
    x: str,
    out: Path,
    labels: list[str] | None = None,
    title: str | None = None,
    ymax: float | None = None,
) -> Path:
    """Draw validation loss (the fixed subset) of each run against `x`; write `out` (PNG)."""
    if x not in X_AXES:
        raise UserError(f"--x must be one of {', '.join(X_AXES)}, got {x!r}.")
    if labels is not None and len(labels) != len(run_dirs):
        raise UserError(f"--labels gives {len(labels)} labels for {len(run_dirs)} runs; give one per run.")
    curves = [curve(run_dir, x) for run_dir in run_dirs]
    labels = labels or run_labels([load_json(run_dir / "config.json") for run_dir in run_dirs])
    return plot_curves(curves, labels, axis_label=X_AXES[x][1], out=out, title=title, ymax=ymax)


def plot_curves(
    curves: list[tuple[list[float], list[float]]],
    labels: list[str],
    *,
    axis_label: str,
    out: Path,
    title: str | None = None,
    ymax: float | None = None,
) -> Path:
    """Draw each (x values, validation losses) curve with its label; write `out` (PNG, PDF, SVG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.backend_bases import FigureCanvasBase

    kind = out.suffix[1:].lower()
    if kind and kind not in FigureCanvasBase.get_supported_filetypes():
        raise UserError(f"--out {out}: a plot cannot be written as .{kind}; name a .png, .pdf or .svg file.")

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    lowest = float("inf")
    styles = ("-", "--", ":")  # the colour cycle has 10 colours: the 11th curve on is dashed
    for i, ((xs, ys), label) in enumerate(zip(curves, labels, strict=True)):
        lowest = min(lowest, *ys)
        ax.plot(xs, ys, marker=".", label=label, linestyle=styles[i // 10 % len(styles)])
    ax.set_xlabel(axis_label)
    ax.set_ylabel("validation loss")
    if ymax is not None:  # a diverged run would otherwise flatten the others
        ax.set_ylim(lowest - 0.05 * (ymax - lowest), ymax)
    ax.set_title(title or f"validation loss against {axis_label}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out)
    except OSError as e:
        raise UserError(f"cannot write {out} ({e.strerror}); choose another --out.") from None
    finally:
        plt.close(fig)
    return out
