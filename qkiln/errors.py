"""Typed errors raised at qkiln's edges (recipe, source model, artifact, request).

Every message says what went wrong *and what to do about it*; the CLI prints
`error: <message>` and exits non-zero instead of a traceback. Internal invariants
use `assert`, not these.
"""


class QkilnError(Exception):
    """Base class: a user-facing problem with a one-line explanation."""

    exit_code = 2


class SourceModelError(QkilnError):
    """A source model (HF directory, GGUF file, alias) is missing, corrupt or unsupported."""


class UnsupportedArchitectureError(SourceModelError):
    """The model's architecture is not one qkiln implements."""


class RecipeError(QkilnError):
    """A quantization recipe or scheme is malformed or does not fit the model."""


class CalibrationDataError(QkilnError):
    """Calibration or evaluation data cannot be read or is too short."""


class ArtifactError(QkilnError):
    """An artifact is incomplete, tampered, of an unknown version or for another target."""


class RequestError(QkilnError, ValueError):
    """A generation request is invalid (bad parameters, prompt too long). `param` names the
    request field at fault, which the server reports as OpenAI's `param`. A ValueError too, as
    vLLM's invalid SamplingParams are."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
