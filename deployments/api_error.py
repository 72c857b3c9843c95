"""APIError: a request refused with an HTTP status, and the OpenAI error body it answers with."""

from pydantic import BaseModel


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class APIError(Exception):
    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: int | str | None = None,
        retry_after_s: float = 1.0,
    ) -> None:
        super().__init__(message)
        self.status, self.param, self.type, self.retry_after_s = status, param, type, retry_after_s
        self.code = status if code is None else code

    def response(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=str(self), type=self.type, param=self.param, code=self.code))
