"""Request errors of the reference engine, rendered as OpenAI-style error bodies."""

from __future__ import annotations


class EngineError(Exception):
    """A request the engine refuses or could not finish.

    Rendered as HTTP ``status`` with the OpenAI error body
    ``{"error": {"message", "type", "param", "code"}}`` (the shape the OpenAI API documents;
    SGLang's own ErrorResponse carries the same four facts).

    Args:
        status: HTTP status code (4xx for the client's fault, 5xx for the engine's or its peer's).
        message: human-readable reason, naming the bad field or the failed room.
        param: the request field at fault, if any.
    """

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    @property
    def error_type(self) -> str:
        """OpenAI-style error type for the HTTP status (404 NotFoundError, 409 ConflictError, other 4xx
        BadRequestError, 5xx InternalServerError)."""
        if self.status == 404:
            return "NotFoundError"
        if self.status == 409:
            return "ConflictError"
        if self.status < 500:
            return "BadRequestError"
        return "InternalServerError"

    def body(self) -> dict:
        """The JSON error body."""
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.status,
            }
        }


def bad_request(message: str, param: str | None = None) -> EngineError:
    """A 400 for invalid client input."""
    return EngineError(400, message, param)


class EngineSettingsError(ValueError):
    """An engine setting that cannot run (pd.engines.settings); ``str()`` is the message, naming the flag.
    ``pdserve engine`` exits 2 with it, the doctor reports it.

    Args:
        flag: the flag (or environment variable) at fault, e.g. ``--speculative-eagle-topk``.
        message: what is wrong, starting with the flag.
    """

    def __init__(self, flag: str, message: str):
        super().__init__(message)
        self.flag = flag
