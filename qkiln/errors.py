"""Typed errors raised at qkiln's edges (recipe, source model, artifact, request).

Every message says what went wrong *and what to do about it*; the CLI prints
`error: <message>` and exits with the class's `exit_code` instead of a traceback, so a
build-then-deploy script can tell a retry elsewhere (7) from a rebuild (6) or a fix to its own
command (2). Exit 1 with a traceback is a bug. Internal invariants use `assert`, not these.
"""

import sys
from contextlib import contextmanager
from typing import NoReturn


class QkilnError(Exception):
    """Base class: a user-facing problem with a one-line explanation. Raised as itself, it is a
    usage error (an option, a combination of options, a missing optional package)."""

    exit_code = 2  # what click gives a malformed command line


class SourceModelError(QkilnError):
    """A source model (HF directory, GGUF file, alias) is missing, corrupt or unsupported."""

    exit_code = 3


class UnsupportedArchitectureError(SourceModelError):
    """The model's architecture is not one qkiln implements."""


class RecipeError(QkilnError):
    """A quantization recipe or scheme is malformed or does not fit the model."""

    exit_code = 4


class CalibrationDataError(QkilnError):
    """Calibration or evaluation data cannot be read or is too short."""

    exit_code = 5


class ArtifactError(QkilnError):
    """An artifact (or engine, or archive) is missing, incomplete, tampered or of an unknown
    version, or an output path is taken."""

    exit_code = 6


class TargetUnavailableError(ArtifactError):
    """A sound artifact built for a device this machine lacks (no CUDA, an older GPU): run it
    elsewhere or rebuild it for this machine."""

    exit_code = 7


class RequestError(QkilnError, ValueError):
    """A generation request is invalid (bad parameters, prompt too long). `param` names the
    request field at fault, which the server reports as OpenAI's `param`. A ValueError too, as
    vLLM's invalid SamplingParams are."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def exit_with(error: QkilnError) -> NoReturn:
    """The command line's one way out on a user-facing failure: `error: <message>` on stderr and
    the class's exit code (SystemExit, which click and its test runner pass through as that code)."""
    print(f"error: {error}", file=sys.stderr)
    raise SystemExit(error.exit_code)


@contextmanager
def exit_on_error():
    """Run a command's body; a QkilnError out of it becomes `exit_with`'s line and exit code. So
    does a PermissionError: a path under a folder this user may not enter (Python 3.11's
    Path.exists() and is_dir() raise there, rather than say False) is the command's to fix."""
    try:
        yield
    except QkilnError as e:
        exit_with(e)
    except PermissionError as e:
        exit_with(permission_error(e))


def permission_error(e: PermissionError) -> QkilnError:
    """A PermissionError as the one line a command says for it."""
    where = e.filename if e.filename is not None else "a path this command uses"
    return QkilnError(f"{where}: permission denied (this user may not enter a folder on the way to it, or read or "
                      "write it); change the permissions (chmod) or choose another path")
