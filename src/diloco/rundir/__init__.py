"""The run directory: creating it (never over another run), finding where a run resumes, and
the files that say what the run is (config.json, and launch.json under torchrun).

Everything here runs in the main process only (rank 0 under torchrun, which tells the other
ranks what it found), and every problem a user can cause is a UserError before anything is
written.

    python -c "from pathlib import Path; from diloco.rundir import load_run_config as f; \
print(f(Path('runs/diloco-k4-H50-s0')).num_workers)"
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
from pathlib import Path
from typing import IO, Any

from diloco.config import TrainConfig, from_dict, load_json
from diloco.errors import UserError
from diloco.rundir import checkpoint

LAUNCH_FILE = "launch.json"  # the id of the torchrun launch that owns the run directory
LOCK_FILE = "server.lock"  # locked by the live server of a run directory, which it names
CHECKPOINT_FORMAT = 2  # 2: one layout for every runtime (outer, workers, runtime)


def _owned_by_this_launch(run_dir: Path, launch: str | None) -> bool:
    """Whether run_dir was created by this very torchrun launch (a restart may take it again)."""
    try:
        return json.loads((run_dir / LAUNCH_FILE).read_text()).get("run_id") == launch
    except (OSError, ValueError, AttributeError):
        return False


def new_run_dir(cfg: TrainConfig, *, restarted: bool = False, launch: str | None = None) -> tuple[Path, bool]:
    """The run directory, created; returns (it, whether it is this launch's own from an earlier
    attempt). `launch` is the id of the torchrun launch this process belongs to (the same in every
    restart of it, new for every launch; runtime/torchrun.py), None outside torchrun. A torchrun
    restart takes the directory again only if this launch created it: an `--out` that holds
    another run stays refused on every attempt and is never touched."""
    run_dir = cfg.run_dir
    if restarted and run_dir.is_dir() and _owned_by_this_launch(run_dir, launch):
        return run_dir, True
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"--out {run_dir} is a file, not a directory; choose another --out.")
    if cfg.runtime == "collective" and run_dir.exists() and any(run_dir.iterdir()):
        raise UserError(
            f"run directory {run_dir} already exists; the collective runtime never renames it (its "
            f"restarts must find it): choose another --out, delete it, or add --resume {run_dir}."
        )
    if cfg.out:
        if run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir())):
            raise UserError(
                f"run directory {run_dir} already exists; choose another --out, delete it, "
                f"or continue it with --resume {run_dir}."
            )
    else:  # default names never clobber an earlier run: add -2, -3, ...
        n = 2
        while run_dir.exists():
            run_dir = cfg.run_dir.with_name(f"{cfg.run_dir.name}-{n}")
            n += 1
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(
            f"cannot create run directory {run_dir} ({e.strerror}); choose another --out."
        ) from None
    if launch is not None:
        checkpoint.atomic_write_text(run_dir / LAUNCH_FILE, json.dumps({"run_id": launch}))
    return run_dir, False


def load_run_config(run_dir: Path) -> TrainConfig:
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"{run_dir} is a file, not a run directory; give the folder a run wrote (its --out).")
    if not run_dir.is_dir():
        raise UserError(f"run directory {run_dir} does not exist; give the folder a run wrote (its --out).")
    return from_dict(load_json(run_dir / "config.json"), where=str(run_dir / "config.json"))


def write_config(cfg: TrainConfig, run_dir: Path) -> TrainConfig:
    """config.json: the run directory and, after a move, the runtime the run goes on in."""
    cfg = dataclasses.replace(cfg, out=str(run_dir))
    checkpoint.atomic_write_json(run_dir / "config.json", cfg.to_dict())
    return cfg


def open_run(
    cfg: TrainConfig, resume: Path | None, *, restarted: bool, launch: str | None = None
) -> tuple[Path, dict[str, Any] | None]:
    """The run directory and the checkpoint state to resume from (None: start from scratch):
    `resume`'s newest valid checkpoint, or, after a torchrun restart of this launch (`launch`,
    see `new_run_dir`), its own directory's; otherwise a new directory."""
    run_dir, own = (
        (resume, True) if resume is not None else new_run_dir(cfg, restarted=restarted, launch=launch)
    )
    if resume is None and not own:
        return run_dir, None
    latest = checkpoint.latest_valid(run_dir / "checkpoints")
    if latest is None:
        if resume is not None:
            raise UserError(
                f"run directory {resume} has no checkpoint to resume from; "
                "checkpoints are saved only with --checkpoint-every or --stop-after."
            )
        return run_dir, None  # a torchrun restart before any checkpoint starts over
    if not (run_dir / "metrics.jsonl").is_file():
        raise UserError(f"run directory {run_dir} has no metrics.jsonl; it is not a complete diloco run.")
    path, state = latest
    if state.get("format") != CHECKPOINT_FORMAT:
        raise UserError(
            f"checkpoint {path} was written by an older diloco (checkpoint format "
            f"{state.get('format', 1)}, this one reads {CHECKPOINT_FORMAT}); finish that run with "
            "the version that started it, or start it again."
        )
    return run_dir, state


def resume_command(cfg: TrainConfig, run_dir: Path) -> str | None:
    """The command that continues the run from its latest checkpoint (None: it has none)."""
    if checkpoint.latest(run_dir / "checkpoints") is None:
        return None
    return f"{'diloco serve' if cfg.runtime == 'server' else 'diloco train'} --resume {run_dir}"


def finished(run_dir: Path) -> bool:
    """Whether the run has ended: its summary.json is written last, after the final evaluation."""
    return (run_dir / "summary.json").is_file()


def lock(run_dir: Path, *, probe: bool = False) -> IO[str] | None:
    """An exclusive lock on `run_dir` (flock of RUN_DIR/server.lock), held while the returned file
    stays open, and so released when the process ends, however it ends. A second server on the
    same directory is refused before it writes anything, naming the live one (`say_holder`).
    `probe`: only refuse a live one's directory (early, before the data is prepared), hold nothing."""
    f = open(run_dir / LOCK_FILE, "a+")  # neither creates nor changes anything when it is there
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "a server that is starting"
        f.close()
        raise UserError(
            f"run directory {run_dir} is in use by a live server ({holder}); stop that one first "
            "(Ctrl-C), or give another run directory."
        ) from None
    if probe:
        f.close()
        return None
    say_holder(f, f"pid {os.getpid()}")
    return f


def say_holder(f: IO[str], holder: str) -> None:
    """What the refusal of a second server says about the one holding the lock."""
    f.seek(0)
    f.truncate()
    f.write(holder + "\n")
    f.flush()
