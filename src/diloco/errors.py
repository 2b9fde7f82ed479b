"""Exceptions that end a run with one sentence and no traceback.

- `UserError` (exit code 2): bad input a user can fix (config, data, run directory, checkpoint).
- `RunFailed` (exit code 3): the run itself went wrong (a non-finite loss, ranks that diverged or
  hung, a worker process that died); the message names what and where, and the last good
  checkpoint is left intact.
Internal bugs raise ordinary exceptions instead.
"""

# The step a RunFailed message offers where a checkpoint can continue the run; the training loop
# (run/loop.py) names the run's own command in it, or, where the run saved no checkpoint, leaves
# only the other step.
RESUME_OR = "its last checkpoint is intact: continue with --resume RUN_DIR if the cause was passing, or "


def resume_step(message: str, command: str | None, run_dir: object) -> str:
    """A RunFailed `message` with RESUME_OR made real: `command` continues the run (e.g.
    "diloco train --resume runs/x"); None: the run has no checkpoint to continue from, and a new
    start needs its folder `run_dir` gone (or another --out)."""
    if command is None:
        return message.replace(
            RESUME_OR,
            f"it saved no checkpoint (--checkpoint-every N saves them), so delete {run_dir} (or give "
            "another --out) and ",
        )
    return message.replace(RESUME_OR, RESUME_OR.replace("--resume RUN_DIR", command))


def brief(error: BaseException, limit: int = 200) -> str:
    """An exception's message on one line for a UserError's parentheses: torch's state_dict errors
    span lines ("Error(s) in loading state_dict for GPT:" then a line per tensor), so the first
    specific line is kept, with how many more there were."""
    lines = [" ".join(line.split()) for line in str(error).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    if len(lines) > 1 and lines[0].endswith(":"):  # a heading, then the problems
        head, rest = lines[1], lines[2:]
    else:
        head, rest = lines[0], lines[1:]
    text = head.rstrip(".") + (f", and {len(rest)} more" if rest else "")
    return text if len(text) <= limit else text[: limit - 1] + "…"


class UserError(ValueError):
    """A problem with the user's input (config, data, run directory) and how to fix it.

    The message is one sentence that names the thing and the fix; the CLI prints it without a
    traceback and exits with code 2. Internal bugs raise ordinary exceptions instead.
    """


class Interrupted(Exception):
    """The user stopped a run (Ctrl-C); the message says whether and how it can be continued."""


class RunFailed(RuntimeError):
    """The run cannot go on (exit code 3); the message names what failed and where."""


class ReplicaMismatch(RunFailed):
    """Ranks of a real runtime hold different global parameters: the run cannot go on."""


class NonFinite(RunFailed):
    """A worker produced a NaN or Inf training loss or outer_grad (see --on-nonfinite)."""


class WorkerDied(RunFailed):
    """A process computing workers (--procs) or a rank (torchrun) died or hung."""
