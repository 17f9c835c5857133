"""HTTP for openai_probe and openai_bench: bounded in time and size, no redirects, errors as HttpError.

A server under test may be slow, broken or hostile. So every request has an overall deadline
(a server trickling one byte per second would pass any socket timeout forever), every answer a
size cap (a 400 MiB SSE line or /metrics body is not an answer), a cut stream (IncompleteRead,
a reset connection) is an HttpError like any other failure, and a redirect is refused rather
than followed: urllib would resend the Authorization header to wherever it points.

Standard library only (runs on managed nodes).
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import json
import socket
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from ansible.module_utils.safe_io import lone_surrogate

# /metrics of a busy vLLM is a few hundred KiB; a completion answer a few KiB.
MAX_BODY_BYTES = 32 * 1024 * 1024
# One server-sent event line carries one chunk of a few tokens.
MAX_LINE_BYTES = 1024 * 1024
_READ = 64 * 1024


# A request that takes longer than a day is a hang, whatever the budget; beyond this the timers overflow.
MAX_TIMEOUT_S = 24 * 3600


def settings_problem(url: str, api_key: str | None, timeout: float) -> str | None:
    """What is wrong with a server URL, API key and per-request timeout, or None when nothing is.

    Never repeats the key: it names what is wrong with it only.
    """
    if not url.startswith(("http://", "https://")):
        return f"url {url[:200]!r} must start with http:// or https://, e.g. http://127.0.0.1:8000"
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as exc:
        return f"url {url[:200]!r} is not a valid URL ({exc}); give it as http://HOST:PORT, e.g. http://127.0.0.1:8000"
    if not parts.hostname:
        return f"url {url[:200]!r} names no host; give it as http://HOST:PORT, e.g. http://127.0.0.1:8000"
    if any(ord(c) < 0x21 or ord(c) == 0x7F for c in url):
        return f"url {url[:200]!r} holds a space or a control character; give the bare URL"
    if port == 0:
        return f"url {url[:200]!r} has port 0; give the port the server listens on"
    if api_key and any(ord(c) < 0x20 or ord(c) >= 0x7F for c in api_key):
        return (
            "api_key holds a control or non-ASCII character (a trailing newline?), which an HTTP header cannot"
            " carry; check where the key comes from (its value is not shown)"
        )
    if not 1 <= timeout <= MAX_TIMEOUT_S:
        return f"timeout must be from 1 to {MAX_TIMEOUT_S} seconds, not {timeout}"
    return None


def loads_answer(text: str, what: str) -> Any:
    """The JSON value of the body ``text`` of the answer to ``what`` ("GET http://.../v1/models").

    ``json.loads``, and a ValueError (what the modules report as an answer the OpenAI API does not
    give) for a string holding a lone surrogate: ``"\\ud800"`` is valid JSON, but the str it parses
    into cannot be encoded as UTF-8, and the controller refuses a module result that carries one.
    """
    value = json.loads(text)
    escape = lone_surrogate(value, text)
    if escape is not None:
        raise ValueError(
            f"{what}: a string in the answer holds a lone surrogate ({escape} escape), which no UTF-8 text can hold"
        )
    return value


class HttpError(Exception):
    """The request failed: no answer, a cut or oversized answer, a redirect, or past its deadline."""


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        raise HttpError(
            f"{req.get_method()} {req.full_url} answered HTTP {code}, a redirect to {newurl}: redirects are not"
            " followed (the API key would go along); give the server's own URL"
        )


class _Watch:
    """The sockets of one request, shut down when its deadline passes: a server trickling its status
    line or headers (read before any body) cannot outlast the deadline either."""

    def __init__(self) -> None:
        self.sockets: list[socket.socket] = []
        self.expired = False
        self._lock = threading.Lock()

    def add(self, sock: socket.socket) -> None:
        with self._lock:
            self.sockets.append(sock)
            if self.expired:
                self._shut(sock)

    def expire(self) -> None:
        with self._lock:
            self.expired = True
            for sock in self.sockets:
                self._shut(sock)

    @staticmethod
    def _shut(sock: socket.socket) -> None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


class _Watched:
    """A connection whose socket (plain, or TLS-wrapped after the handshake) the watch can shut."""

    def __init__(self, *args: Any, watch: _Watch, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._watch = watch

    def connect(self) -> None:
        super().connect()  # type: ignore[misc]
        self._watch.add(self.sock)  # type: ignore[attr-defined]


class _Conn(_Watched, http.client.HTTPConnection):
    pass


class _TLSConn(_Watched, http.client.HTTPSConnection):
    pass


class _Handler(urllib.request.HTTPHandler):
    def __init__(self, watch: _Watch) -> None:
        super().__init__()
        self._watch = watch

    def http_open(self, req):  # type: ignore[no-untyped-def]
        return self.do_open(functools.partial(_Conn, watch=self._watch), req)


class _TLSHandler(urllib.request.HTTPSHandler):
    def __init__(self, context: ssl.SSLContext, watch: _Watch) -> None:
        super().__init__(context=context)
        self._tls = context
        self._watch = watch

    def https_open(self, req):  # type: ignore[no-untyped-def]
        return self.do_open(functools.partial(_TLSConn, watch=self._watch), req, context=self._tls)


class Transport:
    """What a run's requests share: one TLS context (costly to build). No proxy, redirects refused."""

    def __init__(self) -> None:
        self.context = ssl.create_default_context()

    def opener(self, watch: _Watch) -> urllib.request.OpenerDirector:
        return urllib.request.build_opener(
            urllib.request.ProxyHandler({}), _Handler(watch), _TLSHandler(self.context, watch), _NoRedirect()
        )


def build_opener() -> Transport:
    """The transport for a run's requests (see Transport)."""
    return Transport()


class Answer:
    """A response read in bounded pieces before a deadline (time.monotonic seconds)."""

    def __init__(
        self, status: int, resp: Any, what: str, deadline: float, timeout: float, watch: _Watch | None = None
    ) -> None:
        self.status = status
        self._watch = watch or _Watch()
        self._timer: threading.Timer | None = None
        self._resp = resp
        self._read = getattr(resp, "read1", None) or resp.read
        self._what = what
        self._deadline = deadline
        self._timeout = timeout
        self._buffer = b""

    def _late(self) -> HttpError:
        return HttpError(f"{self._what}: no complete answer within {self._timeout:g} s; the server is too slow")

    def _chunk(self) -> bytes:
        if time.monotonic() > self._deadline or self._watch.expired:
            raise self._late()
        try:
            chunk = self._read(_READ)
        except (http.client.HTTPException, OSError, ValueError) as exc:
            if self._watch.expired:
                raise self._late() from None
            raise HttpError(f"{self._what}: the answer was cut off ({type(exc).__name__}: {exc})") from None
        if not chunk and self._watch.expired:
            raise self._late()
        missing = getattr(self._resp, "length", None)
        if not chunk and isinstance(missing, int) and missing > 0:
            # read1 answers b"" at a short body's end where read() raises IncompleteRead.
            raise HttpError(f"{self._what}: the answer was cut off (IncompleteRead: {missing} announced bytes missing)")
        return chunk

    def body(self, limit: int = MAX_BODY_BYTES) -> bytes:
        """The whole body, at most ``limit`` bytes."""
        parts = [self._buffer]
        size = len(self._buffer)
        self._buffer = b""
        while True:
            chunk = self._chunk()
            if not chunk:
                return b"".join(parts)
            size += len(chunk)
            if size > limit:
                raise HttpError(f"{self._what}: the answer is larger than {limit} bytes; it is not what this API sends")
            parts.append(chunk)

    def text(self, limit: int = MAX_BODY_BYTES) -> str:
        return self.body(limit).decode("utf-8", "replace")

    def readline(self, limit: int = MAX_LINE_BYTES) -> bytes:
        """The next line with its newline; b"" at the end of the body."""
        while b"\n" not in self._buffer:
            if len(self._buffer) > limit:
                raise HttpError(f"{self._what}: a line of the stream is longer than {limit} bytes")
            chunk = self._chunk()
            if not chunk:
                line, self._buffer = self._buffer, b""
                return line
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        if len(line) > limit:
            raise HttpError(f"{self._what}: a line of the stream is longer than {limit} bytes")
        return line + b"\n"

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        # Closing a broken connection may fail; nothing to do then.
        with contextlib.suppress(Exception):
            self._resp.close()


def send(
    transport: Transport,
    method: str,
    url: str,
    headers: dict[str, str],
    body: dict | None,
    timeout: float,
) -> Answer:
    """Send one request; the answer (any HTTP status) must be read before ``timeout`` seconds from now."""
    what = f"{method} {url}"
    problem = settings_problem(url, headers.get("Authorization"), timeout)
    if problem is not None:
        raise HttpError(f"{what[:200]}: {problem}")
    deadline = time.monotonic() + timeout
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers=headers, method=method)
    watch = _Watch()
    timer = threading.Timer(timeout, watch.expire)
    timer.daemon = True
    timer.start()
    try:
        resp = transport.opener(watch).open(request, timeout=timeout)
    except urllib.error.HTTPError as exc:
        answer = Answer(exc.code, exc, what, deadline, timeout, watch)
    except HttpError:
        timer.cancel()
        raise
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as exc:
        timer.cancel()
        if watch.expired:
            raise HttpError(f"{what}: no complete answer within {timeout:g} s; the server is too slow") from None
        raise HttpError(f"{what}: {getattr(exc, 'reason', None) or exc}") from None
    else:
        answer = Answer(resp.status, resp, what, deadline, timeout, watch)
    answer._timer = timer
    return answer
