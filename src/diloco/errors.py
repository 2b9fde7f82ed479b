"""The one exception a user can cause: the CLI prints its sentence and exits with code 2."""


class UserError(ValueError):
    """A problem with the user's input (config, data, run directory) and how to fix it.

    The message is one sentence that names the thing and the fix; the CLI prints it without a
    traceback and exits with code 2. Internal bugs raise ordinary exceptions instead.
    """


class Interrupted(Exception):
    """The user stopped a run (Ctrl-C); the message says whether and how it can be continued."""


class ReplicaMismatch(RuntimeError):
    """Ranks of a real runtime hold different global parameters: the run cannot go on."""
