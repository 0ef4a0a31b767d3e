"""Which etcd endpoint answered how: HTTP servers on loopback that answer as etcd's gateway,
as another service, or as a proxy in front of etcd that refuses, and a port nobody
listens on."""

from __future__ import annotations

import http.server
import json
import logging
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

from gpud.cluster.etcd import EtcdClient, EtcdSettings
from gpud.errors import StoreRefused, Unavailable


@dataclass
class Answers:
    """What the server says to each path: (status, body); a path not listed gets 404. A
    redirect's body (3xx) is where it leads (its ``Location``)."""

    by_path: dict[str, tuple[int, str]] = field(default_factory=dict)

    def __call__(self, path: str, request: bytes) -> tuple[int, str]:
        return self.by_path.get(path, (404, "404 page not found\n"))


Respond = Callable[[str, bytes], tuple[int, str]]
"""(path, request body) -> (status, body) the server answers."""


ETCD = {
    "/version": (200, json.dumps({"etcdserver": "3.5.0", "etcdcluster": "3.5.0"})),
    "/v3/kv/range": (200, json.dumps({"header": {"revision": "1"}})),
}


def _serve(answers: Respond) -> http.server.ThreadingHTTPServer:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.do_POST()

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            status, body = answers(self.path, self.rfile.read(length))
            raw = body.encode()
            self.send_response(status)
            if 300 <= status < 400:
                self.send_header("Location", body)
                raw = b""
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def servers() -> Iterator[list[http.server.ThreadingHTTPServer]]:
    started: list[http.server.ThreadingHTTPServer] = []
    yield started
    for server in started:
        server.shutdown()
        server.server_close()


def _endpoint(servers: list[http.server.ThreadingHTTPServer], answers: Respond) -> str:
    server = _serve(answers)
    servers.append(server)
    return f"http://127.0.0.1:{server.server_address[1]}"


def _nobody() -> str:
    """An endpoint nobody listens on: connections to it are refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def _client(*endpoints: str) -> EtcdClient:
    return EtcdClient(EtcdSettings(endpoints=endpoints, timeout_s=2.0))


def test_an_endpoint_not_etcd_is_named_whichever_endpoint_fails_last(
    servers: list[http.server.ThreadingHTTPServer],
) -> None:
    """etcd's peer port beside a client port that is down: the error names both, in either
    order, not only the one tried last."""
    peer = _endpoint(servers, Answers({"/version": ETCD["/version"]}))
    down = _nobody()
    for endpoints in ((peer, down), (down, peer)):
        with pytest.raises(Unavailable) as unreachable:
            _client(*endpoints).get("/x")
        said = str(unreachable.value)
        assert said.startswith(f"etcd unreachable at {down} (Connection refused); "), said
        assert f"{peer} answered /kv/range with 'Not Found', not as etcd's client API" in said


def test_an_endpoint_not_etcd_is_logged_once_while_the_next_one_answers(
    servers: list[http.server.ThreadingHTTPServer], caplog: pytest.LogCaptureFixture
) -> None:
    other = _endpoint(servers, Answers())
    etcd = _endpoint(servers, Answers(dict(ETCD)))
    client = _client(other, etcd)
    with caplog.at_level(logging.WARNING, logger="gpud.cluster.etcd"):
        for _ in range(2):
            assert client.get("/x") is None
        assert _client(other, etcd).get("/x") is None  # gpud started again: said again
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and all(other in m and "check cluster.etcd_endpoints" in m for m in said)


@pytest.mark.parametrize(
    ("reason", "request_path", "answers"),
    [
        ("Request Entity Too Large", "/kv/range", {**ETCD, "/v3/kv/range": (413, "<html>")}),
        ("Unauthorized", "/version", {"/version": (401, "<html>")}),
        ("Forbidden", "/kv/range", {**ETCD, "/v3/kv/range": (403, "denied")}),
    ],
)
def test_a_proxy_that_refuses_is_a_refusal_naming_the_request_not_a_wrong_port(
    servers: list[http.server.ThreadingHTTPServer],
    reason: str,
    request_path: str,
    answers: dict[str, tuple[int, str]],
) -> None:
    proxy = _endpoint(servers, Answers(answers))
    with pytest.raises(StoreRefused) as refused:
        _client(proxy).get("/x")
    assert str(refused.value) == (
        f"etcd refused {request_path}: {reason} (answered by {proxy} without etcd's error body)"
    )


def test_etcds_own_refusal_is_said_in_its_words(
    servers: list[http.server.ThreadingHTTPServer],
) -> None:
    body = json.dumps({"code": 3, "message": "etcdserver: request is too large"})
    etcd = _endpoint(servers, Answers({**ETCD, "/v3/kv/put": (400, body)}))
    with pytest.raises(StoreRefused) as refused:
        _client(etcd).put("/x", "1")
    assert str(refused.value) == "etcd refused /kv/put: etcdserver: request is too large"


LOGIN_PAGE = "<html><head><title>Sign in</title></head><body>" + "x" * 500 + "</body></html>"


@pytest.mark.parametrize(
    "version",
    [
        LOGIN_PAGE,
        json.dumps({"status": "ok", "app": "grafana"}),
        json.dumps(["3.5.0"]),
        json.dumps({"etcdserver": "not-a-version"}),
    ],
)
def test_an_endpoint_answering_version_with_200_but_not_as_etcd_is_said_not_etcd(
    servers: list[http.server.ThreadingHTTPServer], version: str
) -> None:
    """A web server or a proxy's login page at the configured address answers /version
    with 200: said as an endpoint that is not etcd, with what it answered (clipped), not
    as a JSON parse error."""
    page = _endpoint(servers, Answers({"/version": (200, version)}))
    with pytest.raises(Unavailable) as unreachable:
        _client(page).get("/x")
    said = str(unreachable.value)
    assert said.startswith(f"etcd unreachable: {page} answered /version with HTTP 200 "), said
    assert version[:40] in said and "check cluster.etcd_endpoints" in said, said
    assert "JSONDecodeError" not in said and len(said) < len(LOGIN_PAGE), said


def test_an_endpoint_answering_version_with_a_page_is_passed_over_for_etcd(
    servers: list[http.server.ThreadingHTTPServer], caplog: pytest.LogCaptureFixture
) -> None:
    page = _endpoint(servers, Answers({"/version": (200, LOGIN_PAGE)}))
    etcd = _endpoint(servers, Answers(dict(ETCD)))
    with caplog.at_level(logging.WARNING, logger="gpud.cluster.etcd"):
        assert _client(page, etcd).get("/x") is None
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and f"{page} answered /version with HTTP 200 '<html>" in said[0]


def test_an_endpoint_redirecting_version_to_a_login_page_is_said_not_etcd(
    servers: list[http.server.ThreadingHTTPServer],
) -> None:
    """A proxy that sends /version to its login form (302, then the form with 200) is said
    as an endpoint that is not etcd, with the redirect and the page, not as a JSON parse
    error."""
    proxy = _endpoint(servers, Answers({"/version": (302, "/login"), "/login": (200, LOGIN_PAGE)}))
    with pytest.raises(Unavailable) as unreachable:
        _client(proxy).get("/x")
    said = str(unreachable.value)
    assert said.startswith(
        f"etcd unreachable: {proxy} answered /version with a redirect (HTTP 302) to "
        f"{proxy}/login, answered there HTTP 200 '<html>"
    ), said
    assert "check cluster.etcd_endpoints" in said and "JSONDecodeError" not in said, said


def test_an_endpoint_redirecting_version_to_etcd_is_etcd(
    servers: list[http.server.ThreadingHTTPServer],
) -> None:
    """A redirect from /version to etcd's own /version (another address) is followed, and
    etcd's answer there taken (the API calls go to the endpoint as configured)."""
    etcd = _endpoint(servers, Answers(dict(ETCD)))
    moved = _endpoint(
        servers,
        Answers(
            {
                "/version": (307, f"{etcd}/version"),
                **{k: v for k, v in ETCD.items() if k != "/version"},
            }
        ),
    )
    assert _client(moved).get("/x") is None


@pytest.mark.parametrize(
    ("answers", "said"),
    [
        pytest.param(
            # asked as /log%20in: the page there is still judged as /version's answer
            {"/version": (302, "/log in"), "/log%20in": (200, LOGIN_PAGE)},
            "a redirect (HTTP 302) to {proxy}/log%20in, answered there HTTP 200 '<html>",
            id="location-quoted-again",
        ),
        pytest.param(
            {"/version": (302, "/version")},
            "redirects without end (more than 30, the last to {proxy}/version), not as etcd's",
            id="loop",
        ),
        pytest.param(
            {"/version": (301, "/gone")},
            "a redirect (HTTP 301) to {proxy}/gone, answered there HTTP 404 '404 page not "
            "found', not as etcd's",
            id="to-a-missing-page",
        ),
    ],
)
def test_redirects_from_version_ending_anywhere_but_at_etcd_are_said_not_etcd(
    servers: list[http.server.ThreadingHTTPServer],
    answers: dict[str, tuple[int, str]],
    said: str,
) -> None:
    proxy = _endpoint(servers, Answers(answers))
    with pytest.raises(Unavailable) as unreachable:
        _client(proxy).get("/x")
    got = str(unreachable.value)
    assert got.startswith(
        f"etcd unreachable: {proxy} answered /version with {said.format(proxy=proxy)}"
    ), got
    assert "JSONDecodeError" not in got and "check cluster.etcd_endpoints" in got, got


def test_an_endpoint_answering_an_api_path_with_a_page_is_said_not_etcd_and_passed_over(
    servers: list[http.server.ThreadingHTTPServer], caplog: pytest.LogCaptureFixture
) -> None:
    """A proxy that answers etcd's /version but the v3 API with its own page (200): said as
    an endpoint that is not etcd, with the page clipped, as for /version, not as a JSON
    parse error of an etcd unreachable; the next endpoint, etcd, answers."""
    page = _endpoint(servers, Answers({**ETCD, "/v3/kv/range": (200, LOGIN_PAGE)}))
    with pytest.raises(Unavailable) as unreachable:
        _client(page).get("/x")
    said = str(unreachable.value)
    assert said.startswith(f"etcd unreachable: {page} answered /kv/range with HTTP 200 "), said
    assert "'<html><head><title>Sign in" in said and "check cluster.etcd_endpoints" in said
    assert "JSONDecodeError" not in said and len(said) < len(LOGIN_PAGE), said
    etcd = _endpoint(servers, Answers(dict(ETCD)))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gpud.cluster.etcd"):
        assert _client(page, etcd).get("/x") is None
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 1 and f"{page} answered /kv/range with HTTP 200 '<html>" in logged[0]


@pytest.mark.parametrize("answer", [{}, {"header": {"revision": "1"}}, {"token": ""}, ["t"]])
def test_a_login_answered_without_a_token_is_a_refusal_naming_the_endpoint_and_settings(
    servers: list[http.server.ThreadingHTTPServer], answer: object
) -> None:
    login = Answers({**ETCD, "/v3/auth/authenticate": (200, json.dumps(answer))})
    endpoint = _endpoint(servers, login)
    settings = EtcdSettings(
        endpoints=(endpoint,), username="gpud", password="pw", password_file="/etc/gpud/pw"
    )
    with pytest.raises(StoreRefused) as refused:
        EtcdClient(settings).get("/x")
    assert str(refused.value) == (
        f"etcd refused the login of user 'gpud': {endpoint} answered /auth/authenticate "
        f"with HTTP 200 {json.dumps(answer)!r}, which carried no token: check "
        "cluster.etcd_username and the password in cluster.etcd_password_file "
        "(/etc/gpud/pw), and that cluster.etcd_endpoints names etcd's client port "
        "(2379 by default)"
    )


@pytest.fixture
def hung() -> Iterator[str]:
    """An endpoint whose kernel takes the connection but that never answers: an etcd
    stopped (SIGSTOP), overloaded, or a proxy whose backend hangs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


def test_each_endpoint_unreachable_is_said_with_its_own_failure(hung: str) -> None:
    """A dead endpoint beside a hung etcd: the error says the one refused the connection
    and the other gave no answer in time, naming the setting, in either order, not only
    the failure of the one tried last."""
    down = _nobody()
    for endpoints in ((hung, down), (down, hung)):
        client = EtcdClient(EtcdSettings(endpoints=endpoints, timeout_s=0.2))
        with pytest.raises(Unavailable) as unreachable:
            client.get("/x")
        reasons = {
            hung: "no answer within 0.2 s, cluster.etcd_timeout_s",
            down: "Connection refused",
        }
        said = ", ".join(f"{e} ({reasons[e]})" for e in endpoints)
        assert str(unreachable.value) == f"etcd unreachable at {said}"
