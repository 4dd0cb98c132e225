"""OpenAI-style error bodies, ``{"error": {"message", "type", "param", "code"}}`` with a string
``code``, shared by every refusal of the front door (handlers, middleware and the connection
guard, which writes raw HTTP before any handler runs)."""

from __future__ import annotations

import json
from http import HTTPStatus

from kvcompassd import http_server  # which imports this module: its Response is looked up when called

# The code an OpenAI client sees when a refusal names none of its own.
_DEFAULT_CODES = {
    400: "invalid_request", 401: "invalid_api_key", 403: "forbidden", 404: "not_found",
    405: "method_not_allowed", 408: "request_timeout", 413: "request_too_large",
    415: "unsupported_media_type", 422: "invalid_request", 429: "rate_limit_exceeded",
    431: "request_header_fields_too_large", 500: "internal_error", 502: "bad_gateway",
    503: "service_unavailable", 504: "gateway_timeout",
}


def error_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status == 429:
        return "rate_limit_error"
    return "invalid_request_error" if status < 500 else "server_error"


def default_code(status: int) -> str:
    return _DEFAULT_CODES.get(status) or HTTPStatus(status).phrase.lower().replace(" ", "_").replace("-", "_")


def error_body(status: int, message: str, *, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type(status), "param": param,
                      "code": code or default_code(status)}}


def error_json(status: int, message: str, *, code: str | None = None, param: str | None = None) -> bytes:
    return json.dumps(error_body(status, message, code=code, param=param), separators=(",", ":")).encode()


def error_response(status: int, message: str, *, code: str | None = None, param: str | None = None,
                   request_id: str | None = None, headers: dict[str, str] | None = None,
                   close: bool = False) -> http_server.Response:
    all_headers = dict(headers or {})
    if request_id:
        all_headers["X-Request-Id"] = request_id
    return http_server.Response(error_json(status, message, code=code, param=param), status=status,
                    headers=all_headers or None, close=close)


def raw_error_response(status: int, message: str, *, code: str | None = None, retry_after: int | None = None) -> bytes:
    """A complete HTTP/1.1 response that closes the connection, for refusals made below the
    handler (too many connections, a head too slow, too large or malformed)."""
    body = error_json(status, message, code=code)
    head = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}", "Content-Type: application/json",
            f"Content-Length: {len(body)}", "Connection: close"]
    if retry_after is not None:
        head.append(f"Retry-After: {retry_after}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body
