"""HTTP with retries, shared by every reward computed elsewhere (``lean reward serve``'s client, other servers' and
chat endpoints' clients).

:func:`post_with_retries` makes ``1 + retries`` attempts of ``timeout_s`` each and waits ``backoff_s · 2^k`` seconds
after failed attempt k (k = 0, 1, ...). Refused connections, timeouts, HTTP 5xx / 408 / 429 and answers the caller's
``parse`` rejects (``ValueError``) are retried; any other 4xx (a wrong token, a request the server refuses) is not.
The last failure is one :class:`RewardServerError` line naming the reward, the URL and the problem.
"""

from __future__ import annotations

import http.client
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from lean.config.checks import check_positive

RETRIED_STATUS = frozenset({408, 429})  # and every 5xx
T = TypeVar("T")


class RewardServerError(RuntimeError):
    """A reward server did not answer usably after the retries; the message names the URL and the last problem."""


@dataclass
class RetryOptions:
    """How a client waits for a server: the fields every remote reward's options share (they subclass this)."""

    timeout_s: float = 120.0
    """Per request."""
    retries: int = 3
    """Attempts after the first; then a RewardServerError naming the URL."""
    backoff_s: float = 1.0
    """The wait after failed attempt k is backoff_s * 2^k."""

    def validate_retries(self, key: str) -> None:
        check_positive(f"{key}.timeout_s", self.timeout_s)
        check_positive(f"{key}.retries", self.retries, strict=False)
        check_positive(f"{key}.backoff_s", self.backoff_s, strict=False)


def json_headers(token_env: str | None) -> dict[str, str]:
    """A JSON request's headers, with ``Authorization: Bearer <token>`` when ``token_env`` names the token's
    environment variable."""
    headers = {"Content-Type": "application/json"}
    if token_env is not None:
        headers["Authorization"] = f"Bearer {os.environ.get(token_env, '')}"
    return headers


def post_with_retries(
    what: str, url: str, body: bytes, headers: dict[str, str], options: RetryOptions, parse: Callable[[bytes], T]
) -> T:
    """``parse(answer)`` of the first usable answer to ``POST url``; ``what`` names the reward in the error."""
    attempts = 1 + options.retries
    for k in range(attempts):
        try:
            return parse(post_once(what, url, body, headers, options.timeout_s))
        except (_Retry, ValueError) as err:
            problem = str(err)
        if k + 1 < attempts:
            time.sleep(options.backoff_s * 2**k)
    raise RewardServerError(f"{what}: server {url}: {problem} (after {attempts} attempt(s))")


def post_once(what: str, url: str, body: bytes, headers: dict[str, str], timeout_s: float) -> bytes:
    """One attempt: the answer, :class:`_Retry` for a failure worth retrying, :class:`RewardServerError` else."""
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.read()
    except urllib.error.HTTPError as err:
        detail = error_detail(err.read(65536))
        if err.code >= 500 or err.code in RETRIED_STATUS:
            raise _Retry(f"HTTP {err.code} {detail}") from None
        raise RewardServerError(f"{what}: server {url}: HTTP {err.code} {detail}") from None
    except (urllib.error.URLError, http.client.HTTPException, OSError) as err:  # refused, reset, timed out, junk
        reason = getattr(err, "reason", err)
        raise _Retry(f"{type(reason).__name__}: {reason}" if str(reason) else type(reason).__name__) from None


def error_detail(body: bytes) -> str:
    """One line of an error answer: its last non-blank line, at most 200 characters (a Python server's traceback
    ends with the exception, FlowGRPO's servers answer HTTP 500 with one)."""
    lines = [line.strip() for line in body.decode(errors="replace").splitlines() if line.strip()]
    return lines[-1][:200] if lines else ""


class _Retry(Exception):
    """A failed attempt that another attempt may fix."""
