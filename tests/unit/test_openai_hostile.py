"""openai_bench and openai_probe against a hostile server on 127.0.0.1 (issue 23, item 6).

The server (a raw socket handler, so it can send exactly the bytes a broken or hostile engine
would) cuts streams mid-chunk, trickles bytes, sends oversized bodies and lines, and redirects to
a second server on 127.0.0.1 that records whether the API key reached it. Only 127.0.0.1.
"""

from __future__ import annotations

import json
import socketserver
import threading
import time

import openai_bench
import openai_probe
import pytest
from ansible.module_utils.openai_http import HttpError, build_opener, send
from ansible.module_utils.testing import patch_module_args
from module_results import all_text_is_utf8

KEY = "sk-hostile-5e1d"
MODELS = json.dumps({"data": [{"id": "m"}]}).encode()
CHUNK = b'data: {"choices": [{"text": "x"}]}\n\n'
DONE = b"data: [DONE]\n\n"


def head(status: str = "200 OK", extra: str = "") -> bytes:
    return f"HTTP/1.1 {status}\r\nConnection: close\r\n{extra}".encode()


def fixed(body: bytes, status: str = "200 OK") -> bytes:
    return head(status, f"Content-Length: {len(body)}\r\n\r\n") + body


class Hostile:
    """Behaviour by path; ``seen`` records (path, Authorization header) of every request."""

    def __init__(self) -> None:
        self.behaviour: dict[str, object] = {}
        self.seen: list[tuple[str, str | None]] = []
        self.count = 0
        outer = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                request = self.rfile.readline().decode("latin-1")
                headers: dict[str, str] = {}
                while (line := self.rfile.readline().decode("latin-1").strip()) != "":
                    name, _, value = line.partition(":")
                    headers[name.strip().lower()] = value.strip()
                length = int(headers.get("content-length", 0))
                if length:
                    self.rfile.read(length)
                path = request.split(" ")[1]
                with threading.Lock():
                    outer.seen.append((path, headers.get("authorization")))
                    outer.count += 1
                    n = outer.count
                act = outer.behaviour.get(path, fixed(b"not found", "404 Not Found"))
                try:
                    if callable(act):
                        act(self.wfile, n)
                    else:
                        self.wfile.write(act)
                except OSError:
                    pass

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hostile():
    servers: list[Hostile] = []

    def make() -> Hostile:
        servers.append(Hostile())
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def cut_mid_chunk(w, n) -> None:
    """A chunked SSE stream whose second chunk is announced longer than what is sent: IncompleteRead."""
    w.write(head(extra="Content-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"))
    w.write(b"%x\r\n%s\r\n" % (len(CHUNK), CHUNK))
    w.write(b"400\r\n" + CHUNK[:10])
    w.flush()


def good_stream(w, n) -> None:
    body = CHUNK * 3 + DONE
    w.write(fixed(body))


def trickle(w, n) -> None:
    w.write(head(extra="Content-Length: 100000\r\n\r\n"))
    for _ in range(200):
        w.write(b"x")
        w.flush()
        time.sleep(0.1)


def trickle_headers(w, n) -> None:
    w.write(b"HTTP/1.1 200 OK\r\n")
    for i in range(200):
        w.write(b"X-Slow-%d: 1\r\n" % i)
        w.flush()
        time.sleep(0.1)


def endless_line(w, n) -> None:
    w.write(head(extra="Content-Type: text/event-stream\r\n\r\n"))
    for _ in range(64):
        w.write(b"data: " + b"a" * 64 * 1024)


def healthy(server: Hostile) -> None:
    server.behaviour["/health"] = fixed(b"")
    server.behaviour["/v1/models"] = fixed(MODELS)
    server.behaviour["/metrics"] = fixed(b"")


def bench(args: dict, capsys) -> dict:
    with patch_module_args(args), pytest.raises(SystemExit):
        openai_bench.main()
    return json.loads(capsys.readouterr().out)


def probe(args: dict, capsys) -> dict:
    with patch_module_args(args), pytest.raises(SystemExit):
        openai_probe.main()
    return json.loads(capsys.readouterr().out)


def test_a_stream_cut_mid_chunk_fails_the_level_instead_of_passing_as_fewer_requests(hostile, capsys):
    server = hostile()
    healthy(server)
    # Every third completion is cut mid-chunk; the others are complete.
    server.behaviour["/v1/completions"] = lambda w, n: (cut_mid_chunk if n % 3 == 0 else good_stream)(w, n)
    out = bench(
        {"url": server.url, "prompts": ["p"], "concurrency": [2], "requests_per_level": 8, "warmup": 0, "timeout": 5},
        capsys,
    )
    assert out["failed"] is True, out
    assert "the answer was cut off (IncompleteRead" in out["msg"]
    assert out["msg"].startswith(f"benchmark of {server.url} failed: request ")


def test_a_trickling_server_hits_the_overall_deadline(hostile, capsys):
    server = hostile()
    server.behaviour["/health"] = trickle
    started = time.monotonic()
    out = bench({"url": server.url, "prompts": ["p"], "concurrency": [1], "timeout": 1}, capsys)
    assert time.monotonic() - started < 5
    assert out["failed"] is True
    assert out["msg"] == (
        f"the server at {server.url} is not healthy: GET {server.url}/health: no complete answer within 1 s;"
        " the server is too slow"
    )
    started = time.monotonic()
    result = probe({"url": server.url, "timeout": 1}, capsys)
    assert time.monotonic() - started < 5
    assert result["error"].endswith("no complete answer within 1 s; the server is too slow")


def test_an_endless_sse_line_and_an_oversized_body_are_refused(hostile, capsys):
    server = hostile()
    healthy(server)
    server.behaviour["/v1/completions"] = endless_line
    out = bench({"url": server.url, "prompts": ["p"], "concurrency": [1], "warmup": 0, "timeout": 10}, capsys)
    assert out["failed"] is True
    assert "a line of the stream is longer than 1048576 bytes" in out["msg"]
    answer = send(build_opener(), "GET", f"{server.url}/v1/completions", {}, None, 10)
    with pytest.raises(HttpError, match="the answer is larger than 100000 bytes"):
        answer.body(100000)


def test_a_short_or_garbled_models_body_is_an_error_not_a_crash(hostile, capsys):
    server = hostile()
    healthy(server)
    server.behaviour["/v1/models"] = head(extra="Content-Length: 500\r\n\r\n") + b'{"data": ['
    out = bench({"url": server.url, "prompts": ["p"], "concurrency": [1], "timeout": 5}, capsys)
    assert out["failed"] is True
    assert "the answer was cut off (IncompleteRead" in out["msg"]
    server.behaviour["/v1/models"] = fixed(b'{"data": ["str"]}')
    out = bench({"url": server.url, "prompts": ["p"], "concurrency": [1], "timeout": 5}, capsys)
    assert out["msg"].startswith(f"the server at {server.url} did not answer as the OpenAI API does: TypeError")
    server.behaviour["/v1/completions"] = fixed(b'{"choices": ["str"], "usage": {"completion_tokens": 1e400}}')
    server.behaviour["/v1/models"] = fixed(MODELS)
    result = probe({"url": server.url, "requests": 1, "timeout": 5}, capsys)
    assert result["error"].startswith("the server's answer is not what the OpenAI API returns: AttributeError")


@pytest.mark.parametrize("module", ["bench", "probe"])
def test_a_redirect_to_another_server_is_refused_and_the_key_never_sent_there(hostile, capsys, module):
    server, elsewhere = hostile(), hostile()
    healthy(elsewhere)
    server.behaviour["/health"] = head("302 Found", f"Location: {elsewhere.url}/health\r\nContent-Length: 0\r\n\r\n")
    if module == "bench":
        out = bench({"url": server.url, "api_key": KEY, "prompts": ["p"], "concurrency": [1], "timeout": 5}, capsys)
        message = out["msg"]
    else:
        message = probe({"url": server.url, "api_key": KEY, "timeout": 5}, capsys)["error"]
    assert f"answered HTTP 302, a redirect to {elsewhere.url}/health: redirects are not followed" in message
    assert server.seen == [("/health", f"Bearer {KEY}")]
    assert elsewhere.seen == []
    assert KEY not in message


def test_a_server_trickling_its_headers_hits_the_deadline_too(hostile, capsys):
    server = hostile()
    server.behaviour["/health"] = trickle_headers
    started = time.monotonic()
    result = probe({"url": server.url, "timeout": 1}, capsys)
    assert time.monotonic() - started < 4
    assert result["error"] == f"GET {server.url}/health: no complete answer within 1 s; the server is too slow"


BAD_SETTINGS = [
    (
        {"api_key": KEY + "\r\nX-Injected: 1"},
        "api_key holds a control or non-ASCII character (a trailing newline?), which an HTTP header cannot carry;"
        " check where the key comes from (its value is not shown)",
    ),
    ({"url": "http://[::1"}, "url 'http://[::1' is not a valid URL (Invalid IPv6 URL); give it as http://HOST:PORT"),
    ({"url": "http://127.0.0.1:99999"}, "url 'http://127.0.0.1:99999' is not a valid URL (Port out of range 0-65535)"),
    ({"url": "http://"}, "url 'http://' names no host; give it as http://HOST:PORT, e.g. http://127.0.0.1:8000"),
    ({"url": "http://127.0.0.1:1/\r\nX: y"}, "holds a space or a control character; give the bare URL"),
    ({"timeout": 10**30}, f"timeout must be from 1 to 86400 seconds, not {10**30}"),
]


@pytest.mark.parametrize("module", ["bench", "probe"])
@pytest.mark.parametrize(("bad", "message"), BAD_SETTINGS)
def test_settings_no_request_can_carry_are_refused_without_echoing_the_key(hostile, capsys, module, bad, message):
    """An invalid URL or a huge timeout raised ValueError/OverflowError out of the modules, and a key with a
    newline was echoed in http.client's 'Invalid header value' message (issue 23, LOW and item 2's rule)."""
    server = hostile()
    healthy(server)
    args = {"url": server.url, "api_key": KEY, "timeout": 5, **bad}
    if module == "bench":
        out = bench({**args, "prompts": ["p"], "concurrency": [1]}, capsys)
    else:
        out = probe({**args, "requests": 1}, capsys)
    assert out["failed"] is True, out
    assert message in out["msg"]
    assert KEY not in json.dumps(out)
    assert server.seen == []


def test_send_itself_refuses_what_no_request_can_carry():
    with pytest.raises(HttpError, match=r"^GET http://\[::1/health: url 'http://\[::1/health' is not a valid URL"):
        send(build_opener(), "GET", "http://[::1/health", {}, None, 5)
    with pytest.raises(HttpError, match=r"api_key holds a control") as caught:
        send(build_opener(), "GET", "http://127.0.0.1:9/health", {"Authorization": f"Bearer {KEY}\n"}, None, 5)
    assert KEY not in str(caught.value)


@pytest.mark.parametrize(
    ("path", "body", "error"),
    [
        (
            "/v1/completions",
            b'{"choices": [{"text": "x"}], "usage": {"completion_tokens": 1e400}}',
            "the server's answer cannot be measured: usage.completion_tokens is inf, not a count of tokens",
        ),
        (
            "/metrics",
            b"vllm:spec_decode_num_drafts_total +Inf\n",
            "vllm:spec_decode_num_drafts_total is inf, not a count; the server's /metrics is broken",
        ),
    ],
)
def test_numbers_past_any_count_in_a_completion_or_metrics_are_an_error(hostile, capsys, path, body, error):
    """completion_tokens: 1e400 crashed the probe; an Inf counter gave a NaN acceptance length (issue 23)."""
    server = hostile()
    healthy(server)
    server.behaviour["/v1/completions"] = fixed(b'{"choices": [{"text": "x"}], "usage": {"completion_tokens": 1}}')
    server.behaviour[path] = fixed(body)
    result = probe({"url": server.url, "requests": 1, "timeout": 5}, capsys)
    assert result["error"].startswith(error), result
    assert "mean_acceptance_length" not in result


SURROGATE = "lone surrogate (\\ud800 escape), which no UTF-8 text can hold"


def utf8_result(out: dict) -> bool:
    """What the controller checks: the result encodes as UTF-8 (a lone surrogate does not)."""
    json.dumps(out, ensure_ascii=False).encode("utf-8")
    return all_text_is_utf8(out)


def test_a_lone_surrogate_in_the_model_id_is_an_error_and_the_result_stays_utf8(hostile, capsys):
    """/v1/models answering "m\\ud800" (valid JSON, a str no UTF-8 can carry) made both modules return that model
    id, and the controller refused their result (issue 23)."""
    server = hostile()
    healthy(server)
    server.behaviour["/v1/models"] = fixed(b'{"data": [{"id": "m\\ud800"}]}')
    server.behaviour["/v1/completions"] = fixed(b'{"choices": [{"text": "x"}], "usage": {"completion_tokens": 1}}')
    result = probe({"url": server.url, "requests": 1, "timeout": 5}, capsys)
    assert result["error"] == (
        f"the server's answer is not what the OpenAI API returns: ValueError: GET {server.url}/v1/models: a string in"
        f" the answer holds a {SURROGATE}"
    )
    assert "model" not in result
    assert utf8_result(result)
    out = bench({"url": server.url, "prompts": ["p"], "concurrency": [1], "warmup": 0, "timeout": 5}, capsys)
    assert out["failed"] is True
    assert out["msg"] == (
        f"the server at {server.url} did not answer as the OpenAI API does: ValueError: GET {server.url}/v1/models: a"
        f" string in the answer holds a {SURROGATE}"
    )
    assert "model" not in out
    assert utf8_result(out)


def test_a_lone_surrogate_in_a_completion_or_a_stream_chunk_is_an_error_too(hostile, capsys):
    """The probe returns the completion's text; the bench echoed a chunk's "error" in its message."""
    server = hostile()
    healthy(server)
    server.behaviour["/v1/completions"] = fixed(
        b'{"choices": [{"text": " Rome\\ud800"}], "usage": {"completion_tokens": 1}}'
    )
    result = probe({"url": server.url, "requests": 1, "timeout": 5}, capsys)
    assert result["error"] == (
        f"the server's answer is not what the OpenAI API returns: ValueError: POST {server.url}/v1/completions: a"
        f" string in the answer holds a {SURROGATE}"
    )
    assert "completion_text" not in result
    assert utf8_result(result)
    server.behaviour["/v1/completions"] = fixed(CHUNK + b'data: {"error": "overloaded \\ud800"}\n\n' + DONE)
    out = bench({"url": server.url, "prompts": ["p"], "concurrency": [1], "warmup": 0, "timeout": 5}, capsys)
    assert out["failed"] is True
    assert out["msg"] == (
        f"benchmark of {server.url} failed: request 1 at concurrency 1: stream chunk holds a {SURROGATE}"
    )
    assert utf8_result(out)
