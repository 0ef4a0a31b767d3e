"""Which etcd endpoint answered how: HTTP servers on loopback that answer as etcd's gateway,
as another service, or as a proxy in front of etcd that refuses, and a port nobody
listens on."""

from __future__ import annotations

import contextlib
import http.server
import json
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import requests

from gpud.cluster.etcd import LOGIN_AGAIN_AFTER_S, EtcdClient, EtcdSettings
from gpud.errors import StoreRefused, Unavailable
from tools import certs


@dataclass
class Answers:
    """What the server says to each path: (status, body); a path not listed gets 404. A
    redirect's body (3xx) is where it leads (its ``Location``)."""

    by_path: dict[str, tuple[int, str]] = field(default_factory=dict)

    def __call__(self, path: str, request: bytes, token: str) -> tuple[int, str]:
        return self.by_path.get(path, (404, "404 page not found\n"))


Respond = Callable[[str, bytes, str], tuple[int, str]]
"""(path, request body, its Authorization header) -> (status, body) the server answers."""


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
            token = self.headers.get("Authorization") or ""
            status, body = answers(self.path, self.rfile.read(length), token)
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


def _etcd_error(message: str) -> tuple[int, str]:
    """A refusal as etcd's gateway answers it (gRPC InvalidArgument: HTTP 400)."""
    return 400, json.dumps({"error": message, "code": 3, "message": message})


@dataclass
class AuthEtcd:
    """etcd's gateway with authentication on or off; a proxy in front of it that drops
    the Authorization header where ``drops_token``. Tokens given are ``t1``, ``t2``, ..."""

    auth_on: bool = True
    drops_token: bool = False
    refuses_tokens: bool = False  # a token store of its own: each token it gave is invalid
    logins: int = 0
    calls: int = 0
    valid: set[str] = field(default_factory=set)

    def __call__(self, path: str, request: bytes, token: str) -> tuple[int, str]:
        if path == "/version":
            return ETCD["/version"]
        if path == "/v3/auth/authenticate":
            self.logins += 1
            if not self.auth_on:
                return _etcd_error("etcdserver: authentication is not enabled")
            issued = f"t{self.logins}"
            if not self.refuses_tokens:
                self.valid.add(issued)
            return 200, json.dumps({"header": {}, "token": issued})
        self.calls += 1
        token = "" if self.drops_token else token
        if token and token not in self.valid:
            return _etcd_error("etcdserver: invalid auth token")
        if self.auth_on and not token:
            return _etcd_error("etcdserver: user name is empty")
        return ETCD["/v3/kv/range"]


def _logged_in(endpoint: str, clock: Callable[[], float] | None = None) -> EtcdClient:
    settings = EtcdSettings(endpoints=(endpoint,), username="gpud", password="pw")
    return EtcdClient(settings) if clock is None else EtcdClient(settings, clock=clock)


def test_a_proxy_dropping_the_token_is_a_refusal_naming_it_without_a_login_per_call(
    servers: list[http.server.ThreadingHTTPServer],
) -> None:
    """Every call meets "user name is empty" though the login gave a token: said as a
    refusal naming the proxy, and logged in for once, not once per call (a raft write and
    a bcrypt on every etcd member each time)."""
    etcd = AuthEtcd(drops_token=True)
    endpoint = _endpoint(servers, etcd)
    client = _logged_in(endpoint)
    for _ in range(3):
        with pytest.raises(StoreRefused) as refused:
            client.get("/x")
        assert str(refused.value) == (
            "etcd refused /kv/range as a call without a user (etcdserver: user name is "
            f"empty), though {endpoint} accepted the login of user 'gpud' and the call "
            "carried its token: a proxy in front of etcd drops the Authorization header; "
            "let it pass that header, or name etcd itself in cluster.etcd_endpoints (not "
            "logging in again until a call there succeeds or a minute has passed)"
        )
    assert etcd.logins == 1
    etcd.drops_token = False  # the proxy mended: the token of that login serves
    assert client.get("/x") is None
    assert etcd.logins == 1


@pytest.mark.parametrize(
    ("fault", "said"),
    [
        (
            {"drops_token": True},
            "etcd refused /kv/range as a call without a user (etcdserver: user name is "
            "empty), though {proxy} accepted the login",
        ),
        ({"refuses_tokens": True}, "etcd refused /kv/range at {proxy}: etcdserver: invalid"),
    ],
    ids=["drops-the-token", "refuses-its-own-tokens"],
)
def test_an_endpoint_refusing_the_token_is_passed_over_for_the_next_that_serves(
    servers: list[http.server.ThreadingHTTPServer], fault: dict[str, bool], said: str
) -> None:
    """A proxy first in cluster.etcd_endpoints that drops the Authorization header, or an
    endpoint whose every token comes back ``invalid auth token``, beside an etcd that
    serves: calls are served by that etcd, and go on there; with neither serving, the
    refusal names each endpoint."""
    broken, etcd = AuthEtcd(**fault), AuthEtcd()
    proxy, etcd2 = _endpoint(servers, broken), _endpoint(servers, etcd)
    client = EtcdClient(
        EtcdSettings(endpoints=(proxy, etcd2), username="gpud", password="pw", timeout_s=2.0)
    )
    for _ in range(3):
        assert client.get("/x") is None
    assert (broken.calls, etcd.calls) == (1, 3)
    etcd.refuses_tokens, etcd.valid = True, set()
    with pytest.raises(StoreRefused) as refused:
        client.get("/x")
    assert str(refused.value).startswith(
        f"etcd refused /kv/range at {etcd2}: etcdserver: invalid auth token; "
        + said.format(proxy=proxy)
    ), str(refused.value)
    # each endpoint that refused the token of a login is not logged in to again per call
    # (a raft write and a bcrypt on every etcd member, each tick, from each node)
    for _ in range(4):
        with pytest.raises(StoreRefused):
            client.get("/x")
    assert (broken.logins, etcd.logins) == (1, 2)


def test_an_endpoint_mended_after_refusing_its_tokens_is_logged_in_to_again_a_minute_on(
    servers: list[http.server.ThreadingHTTPServer],
) -> None:
    """The one endpoint refuses each token it gives, then is mended with the token of
    that login expired meanwhile: no login there within LOGIN_AGAIN_AFTER_S of the one
    refused, one after it, which serves; refused again, it is held back afresh."""
    now = [0.0]
    etcd = AuthEtcd(refuses_tokens=True)
    client = _logged_in(_endpoint(servers, etcd), clock=lambda: now[0])
    for _ in range(3):
        with pytest.raises(StoreRefused):
            client.get("/x")
    assert etcd.logins == 1
    etcd.refuses_tokens = False  # mended; the token t1 it refused is not valid there
    now[0] = LOGIN_AGAIN_AFTER_S - 1
    with pytest.raises(StoreRefused):
        client.get("/x")
    assert etcd.logins == 1
    now[0] = LOGIN_AGAIN_AFTER_S + 1
    assert client.get("/x") is None
    assert client.get("/x") is None
    assert etcd.logins == 2
    etcd.refuses_tokens, etcd.valid = True, set()  # broken again: each new token refused
    for _ in range(3):
        with pytest.raises(StoreRefused):
            client.get("/x")
    assert etcd.logins == 3  # the expired token mended by a login, refused as it came
    now[0] += LOGIN_AGAIN_AFTER_S + 1
    for _ in range(3):
        with pytest.raises(StoreRefused):
            client.get("/x")
    assert etcd.logins == 4


def test_a_proxy_dropping_the_token_is_logged_in_through_again_once_a_minute(
    servers: list[http.server.ThreadingHTTPServer],
) -> None:
    """A proxy dropping the Authorization header meets one login, then none per call,
    then one more once LOGIN_AGAIN_AFTER_S has passed (it may have been mended)."""
    now = [0.0]
    etcd = AuthEtcd(drops_token=True)
    client = _logged_in(_endpoint(servers, etcd), clock=lambda: now[0])
    for step in (0.0, 20.0, 20.0, 21.0, 1.0):
        now[0] += step
        with pytest.raises(StoreRefused):
            client.get("/x")
    assert etcd.logins == 2


def test_an_expired_token_is_logged_in_for_again_within_the_call(
    servers: list[http.server.ThreadingHTTPServer],
) -> None:
    etcd = AuthEtcd()
    client = _logged_in(_endpoint(servers, etcd))
    assert client.get("/x") is None
    etcd.valid.clear()  # etcd's simple tokens expire (--auth-token-ttl)
    assert client.get("/x") is None
    assert client.get("/x") is None
    assert etcd.logins == 2


def test_calls_serve_as_etcds_authentication_is_turned_on_and_off(
    servers: list[http.server.ThreadingHTTPServer],
) -> None:
    """Without a token while etcd's authentication is off, with one once it is on, and
    without it again after `etcdctl auth disable` (etcd refuses any token then), each
    change met within the call that meets it."""
    etcd = AuthEtcd(auth_on=False)
    client = _logged_in(_endpoint(servers, etcd))
    assert client.get("/x") is None
    for auth_on in (True, False, True):
        etcd.auth_on = auth_on
        if not auth_on:
            etcd.valid.clear()  # etcd refuses any token while its authentication is off
        for _ in range(2):
            assert client.get("/x") is None
    assert etcd.logins == 4


@pytest.mark.parametrize(
    ("answer", "said"),
    [
        ((504, "upstream timed out"), "HTTP Gateway Timeout 'upstream timed out'"),
        ((408, ""), "HTTP Request Timeout"),
        (
            (503, json.dumps({"code": 14, "message": "etcdserver: request timed out"})),
            "HTTP Service Unavailable 'etcdserver: request timed out'",
        ),
    ],
)
def test_an_http_failure_is_said_as_its_answer_not_as_no_answer(
    servers: list[http.server.ThreadingHTTPServer], answer: tuple[int, str], said: str
) -> None:
    """A 504 or 408 (a proxy in front of etcd whose backend timed out) or etcd's own 503
    answered at once: said by its reason and words, not as no answer within the timeout."""
    proxy = _endpoint(servers, Answers({**ETCD, "/v3/kv/range": answer}))
    with pytest.raises(Unavailable) as unreachable:
        _client(proxy).get("/x")
    assert str(unreachable.value) == f"etcd unreachable at {proxy} ({said})"


def _serve_tls(servers: list[http.server.ThreadingHTTPServer], ca: Path, tmp_path: Path) -> int:
    """The port of etcd served over TLS with a certificate of ``ca`` for host etcd1 and
    127.0.0.1."""
    cert, key = certs.make_node(ca, "etcd1", tmp_path / "etcd1")
    server = _serve(Answers(dict(ETCD)))
    servers.append(server)
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)
    server.socket = tls.wrap_socket(server.socket, server_side=True)
    return server.server_address[1]


def test_a_certificate_etcd_does_not_trust_is_said_with_the_tls_librarys_reason(
    servers: list[http.server.ThreadingHTTPServer], tmp_path: Path
) -> None:
    """etcd serves a certificate of another CA than cluster.etcd_ca_file: the reason
    (``certificate verify failed: ...``) is said whole, past urllib3's preamble."""
    served_ca, other_ca = tmp_path / "served-ca", tmp_path / "other-ca"
    certs.make_ca(served_ca)
    certs.make_ca(other_ca, name="another CA")
    endpoint = f"https://127.0.0.1:{_serve_tls(servers, served_ca, tmp_path)}"
    client = EtcdClient(EtcdSettings(endpoints=(endpoint,), ca_file=str(other_ca / "ca.pem")))
    with pytest.raises(Unavailable) as unreachable:
        client.get("/x")
    said = str(unreachable.value)
    assert said.startswith(
        f"etcd unreachable at {endpoint} (ConnectionFailedError '[SSL: "
        "CERTIFICATE_VERIFY_FAILED] certificate verify failed: unable to get local issuer "
        "certificate"
    ), said


def test_a_ca_file_gone_since_the_start_is_said_with_its_path(tmp_path: Path) -> None:
    """cluster.etcd_ca_file removed (or its mount lost) after gpud started: the error names
    the file requests could not load, not only the kind of error."""
    ca = tmp_path / "ca.pem"
    certs.make_ca(tmp_path)
    endpoint = _nobody().replace("http:", "https:")
    client = EtcdClient(EtcdSettings(endpoints=(endpoint,), ca_file=str(ca)))
    ca.unlink()
    with pytest.raises(Unavailable) as unreachable:
        client.get("/x")
    said = str(unreachable.value)
    assert said.startswith(f"etcd unreachable at {endpoint} (OSError '"), said
    assert str(ca) in said, said


class _Failing:
    """An endpoint's session whose every API call fails with ``error`` before it reaches
    etcd (a failure on this host, or the TLS library's), after etcd's ``/version``."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def get(self, url: str, **kwargs: object) -> requests.Response:
        answer = requests.Response()
        answer.status_code, answer._content = 200, ETCD["/version"][1].encode()
        return answer

    def post(self, url: str, **kwargs: object) -> requests.Response:
        raise self.error


def _failing(error: BaseException) -> str:
    """What a call says when each of its requests fails with ``error``."""
    client = _client("http://127.0.0.1:2379")
    client._clients[0].session = _Failing(error)
    with pytest.raises(Unavailable) as unreachable:
        client.get("/x")
    return str(unreachable.value)


def test_a_long_failure_on_this_host_is_said_clipped_with_the_path_it_names_whole() -> None:
    """A failure on this host (not etcd's, nor HTTP's) says the file to mend to its end,
    however deep, and not the pages of text a library may add after it."""
    path = "/etc/gpud/pki/" + "/".join(["deep"] * 30) + "/etcd-ca.pem"
    said = _failing(
        OSError(f"Could not find a suitable TLS CA bundle, invalid path: {path}\n{'more ' * 100}")
    )
    assert said == (
        "etcd unreachable at http://127.0.0.1:2379 (OSError 'Could not find a suitable TLS "
        f"CA bundle, invalid path: {path}' (clipped))"
    )


def test_a_tls_reason_over_lines_is_said_without_the_preamble() -> None:
    """The TLS library's reason on a line of its own past urllib3's preamble: said from
    the reason to the source line that ends it, on one line."""
    said = _failing(
        requests.exceptions.SSLError(
            "HTTPSConnectionPool(host='127.0.0.1', port=2379): Max retries exceeded with url: "
            "/version (Caused by SSLError(SSLCertVerificationError(1, '[SSL: "
            "CERTIFICATE_VERIFY_FAILED] certificate verify failed:\nself-signed certificate "
            "in certificate chain (_ssl.c:1006)')))"
        )
    )
    assert said == (
        "etcd unreachable at http://127.0.0.1:2379 (ConnectionFailedError '[SSL: "
        "CERTIFICATE_VERIFY_FAILED] certificate verify failed: self-signed certificate in "
        "certificate chain')"
    )


def test_a_certificate_for_another_host_is_said_with_the_host_it_is_not_valid_for(
    servers: list[http.server.ThreadingHTTPServer], tmp_path: Path
) -> None:
    """etcd serves a certificate that does not name the host of its endpoint: the TLS
    library's reason is said to its end, with the host it quotes."""
    ca = tmp_path / "ca"
    certs.make_ca(ca)
    endpoint = f"https://localhost:{_serve_tls(servers, ca, tmp_path)}"
    client = EtcdClient(EtcdSettings(endpoints=(endpoint,), ca_file=str(ca / "ca.pem")))
    with pytest.raises(Unavailable) as unreachable:
        client.get("/x")
    assert str(unreachable.value) == (
        f'etcd unreachable at {endpoint} (ConnectionFailedError "[SSL: '
        "CERTIFICATE_VERIFY_FAILED] certificate verify failed: Hostname mismatch, "
        "certificate is not valid for 'localhost'.\")"
    )


def test_a_login_leaves_the_session_threads_send_on_as_it_was(
    servers: list[http.server.ThreadingHTTPServer],
) -> None:
    """Threads call on one client, each request merging its endpoint's session headers:
    the token of a login, given and dropped as etcd's authentication is turned on and
    off, goes with each request (etcd still sees it) and never into the shared session,
    where a change under a request being sent is ``OrderedDict mutated during
    iteration``."""
    etcd = AuthEtcd(auth_on=False)
    client = _logged_in(_endpoint(servers, etcd))
    session = client._clients[0].session
    before = dict(session.headers)
    for auth_on in (False, True, False, True):
        etcd.auth_on = auth_on
        if not auth_on:
            etcd.valid.clear()
        assert client.get("/x") is None
        assert dict(session.headers) == before
    assert etcd.logins == 4


@dataclass
class MeetingLoginEtcd(AuthEtcd):
    """Each login waits for a second one to arrive before it is answered (or for
    ``meeting`` to give up): two threads that log in at once are both seen logging in."""

    meeting: threading.Barrier = field(default_factory=lambda: threading.Barrier(2, timeout=1.0))

    def __call__(self, path: str, request: bytes, token: str) -> tuple[int, str]:
        if path == "/v3/auth/authenticate":
            # broken: the one login of this node, no other came
            with contextlib.suppress(threading.BrokenBarrierError):
                self.meeting.wait()
        return super().__call__(path, request, token)


def _at_once(calls: int, call: Callable[[], object]) -> None:
    threads = [threading.Thread(target=call) for _ in range(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def test_threads_that_call_at_once_before_a_login_make_one_login(
    servers: list[http.server.ThreadingHTTPServer],
) -> None:
    etcd = MeetingLoginEtcd()
    client = _logged_in(_endpoint(servers, etcd))
    results: list[object] = []
    _at_once(2, lambda: results.append(client.get("/x")))
    assert results == [None, None]
    assert etcd.logins == 1 and etcd.calls == 2


class MeetingSet(set[str]):
    """A set of endpoints logged: each look-up, once made, waits for a second one (or for
    ``meeting`` to give up) before it answers, so that two threads that meet the same
    endpoint both look before either adds it."""

    def __init__(self) -> None:
        super().__init__()
        self.meeting = threading.Barrier(2, timeout=1.0)

    def __contains__(self, endpoint: object) -> bool:
        seen = super().__contains__(endpoint)
        with contextlib.suppress(threading.BrokenBarrierError):
            self.meeting.wait()
        return seen


def test_an_endpoint_not_etcd_met_by_threads_at_once_is_logged_once(
    servers: list[http.server.ThreadingHTTPServer], caplog: pytest.LogCaptureFixture
) -> None:
    other = _endpoint(servers, Answers())
    etcd = _endpoint(servers, Answers(dict(ETCD)))
    client = _client(other, etcd)
    client._said_not_etcd = MeetingSet()
    with caplog.at_level(logging.WARNING, logger="gpud.cluster.etcd"):
        _at_once(2, lambda: client.get("/x"))
    said = [r.getMessage() for r in caplog.records if other in r.getMessage()]
    assert len(said) == 1, said


def test_etcds_authentication_off_met_by_threads_at_once_is_logged_once(
    servers: list[http.server.ThreadingHTTPServer], caplog: pytest.LogCaptureFixture
) -> None:
    client = _logged_in(_endpoint(servers, AuthEtcd(auth_on=False)))
    client._said_auth_off = MeetingSet()
    with caplog.at_level(logging.WARNING, logger="gpud.cluster.etcd"):
        _at_once(2, lambda: client.get("/x"))
    said = [r.getMessage() for r in caplog.records if "authentication off" in r.getMessage()]
    assert len(said) == 1, said


@dataclass
class HungLoginEtcd(AuthEtcd):
    """etcd whose logins get no answer until ``released`` (a hung etcd: stopped, its disk
    stalled): the one thread that logs in times out, the others waited for it."""

    released: threading.Event = field(default_factory=threading.Event)
    hung: int = 0  # logins made, counted as they arrive

    def __call__(self, path: str, request: bytes, token: str) -> tuple[int, str]:
        if path == "/v3/auth/authenticate":
            self.hung += 1
            self.released.wait(10.0)
        return super().__call__(path, request, token)


def test_threads_queued_behind_a_hung_login_take_its_failure_without_logging_in_again(
    servers: list[http.server.ThreadingHTTPServer],
) -> None:
    """The leader's keepalive meeting an expired token while the alarms reader, problem
    board and tag store log in: each call fails within its own timeout, not one timeout
    per thread ahead of it, and etcd sees one login."""
    etcd = HungLoginEtcd()
    endpoint = _endpoint(servers, etcd)
    settings = EtcdSettings(endpoints=(endpoint,), username="gpud", password="pw", timeout_s=0.5)
    client = EtcdClient(settings)
    failures: list[str] = []

    def call() -> None:
        with pytest.raises(Unavailable) as unreachable:
            client.get("/x")
        failures.append(str(unreachable.value))

    def timed() -> None:
        start = time.monotonic()
        call()
        lasted.append(time.monotonic() - start)

    lasted: list[float] = []
    try:
        _at_once(4, timed)
    finally:
        etcd.released.set()
    no_answer = f"etcd unreachable at {endpoint} (no answer within 0.5 s, cluster.etcd_timeout_s)"
    # a thread that waited on the login out to its own timeout, or saw it fail first
    under_way = f"etcd unreachable at {endpoint} (login at {endpoint} still under way after 0.5 s)"
    assert len(failures) == 4 and no_answer in failures, failures
    assert set(failures) <= {no_answer, under_way}, failures
    assert etcd.hung == 1
    # one timeout each, not one per thread queued ahead: 4 would pass 2 s
    assert max(lasted) < 5 * settings.timeout_s, lasted


def test_a_watch_cancelled_for_a_compaction_records_the_revision_compacted_to(
    servers: list[http.server.ThreadingHTTPServer],
) -> None:
    """etcd's answer to a watch from a compacted revision: the change the caller reads
    again, and the revision a later watch may start at."""
    cancelled = {"result": {"canceled": True, "compact_revision": "51"}}
    answers = Answers({**ETCD, "/v3/watch": (200, json.dumps(cancelled))})
    client = _client(_endpoint(servers, answers))
    assert client.compacted_revision == 0
    assert client.wait_for_change("/c/leader", 11, 1.0)
    assert client.compacted_revision == 51


def test_a_compaction_recorded_is_forgotten_once_a_read_says_the_store_is_behind_it(
    servers: list[http.server.ThreadingHTTPServer],
) -> None:
    """etcd wiped, or restored from an older snapshot, since a watch was cancelled for a
    compaction: its revisions start again at 1, and a read's header below the compaction
    recorded forgets it (a watch from there would wait for revisions not reached); a
    read past it keeps it."""
    cancelled = {"result": {"canceled": True, "compact_revision": "51"}}
    answers = Answers({**ETCD, "/v3/watch": (200, json.dumps(cancelled))})
    answers.by_path["/v3/kv/range"] = (200, json.dumps({"header": {"revision": "60"}}))
    client = _client(_endpoint(servers, answers))
    assert client.wait_for_change("/c/leader", 11, 1.0)
    assert client.get("/c/leader") is None
    assert client.compacted_revision == 51
    answers.by_path["/v3/kv/range"] = (200, json.dumps({"header": {"revision": "7"}}))
    assert client.get_prefix_kvs("/c/") == {}
    assert client.compacted_revision == 0


class QueuedLogin:
    """An endpoint's login lock that counts the threads queued on it: a login held until
    ``threads`` wait behind it is awaited by each of them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.queued = threading.Condition()
        self.waiting = 0

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if blocking:
            with self.queued:
                self.waiting += 1
                self.queued.notify_all()
        return self.lock.acquire(blocking, timeout)

    def release(self) -> None:
        self.lock.release()

    def until_queued(self, threads: int) -> None:
        with self.queued:
            self.queued.wait_for(lambda: self.waiting >= threads, timeout=10.0)


@dataclass
class QueuedLoginEtcd(AuthEtcd):
    """An endpoint whose login is answered ``login`` once three other threads wait for
    it."""

    login: tuple[int, str] = (200, "")
    queue: QueuedLogin = field(default_factory=QueuedLogin)

    def __call__(self, path: str, request: bytes, token: str) -> tuple[int, str]:
        if path != "/v3/auth/authenticate":
            return super().__call__(path, request, token)
        self.logins += 1
        self.queue.until_queued(3)
        return self.login


def _four_at_once_behind_one_login(
    endpoints: tuple[str, ...], etcd: QueuedLoginEtcd
) -> list[BaseException]:
    """What each of four calls at once raises, three of them queued behind the one login
    at the first endpoint."""
    settings = EtcdSettings(endpoints=endpoints, username="gpud", password="pw", timeout_s=10.0)
    client = EtcdClient(settings)
    client._logging_in[0] = etcd.queue  # type: ignore[assignment]  # counts who waits
    raised: list[BaseException] = []

    def call() -> None:
        with pytest.raises(Exception) as failed:
            client.get("/x")
        raised.append(failed.value)

    _at_once(4, call)
    return raised


@pytest.mark.parametrize(
    ("login", "said"),
    [
        ((404, "404 page not found\n"), "'Not Found'"),
        (
            (200, "<html><body>Sign in</body></html>"),
            "HTTP 200 '<html><body>Sign in</body></html>'",
        ),
    ],
    ids=["not-found", "a-page"],
)
def test_threads_queued_behind_a_login_answered_not_as_etcd_say_so_as_its_thread_does(
    servers: list[http.server.ThreadingHTTPServer], login: tuple[int, str], said: str
) -> None:
    """A login answered by another service (a 404, a web page): each thread that waited
    for it says the endpoint answered not as etcd, naming the setting, as the one that
    logged in does, not that etcd refused it."""
    etcd = QueuedLoginEtcd(login=login)
    endpoint = _endpoint(servers, etcd)
    raised = _four_at_once_behind_one_login((endpoint,), etcd)
    assert {type(e) for e in raised} == {Unavailable}, raised
    assert {str(e) for e in raised} == {
        f"etcd unreachable: {endpoint} answered /auth/authenticate with {said}, not as "
        "etcd's client API: is it etcd's client port (2379 by default; 2380 is the peer "
        "port)? check cluster.etcd_endpoints"
    }
    assert etcd.logins == 1


def test_threads_queued_behind_a_login_etcd_refused_raise_its_refusal_at_once(
    servers: list[http.server.ThreadingHTTPServer],
) -> None:
    """A wrong password with two endpoints: the thread that logged in and each one that
    waited for it say etcd refused the login, naming the settings, without a login at
    the next endpoint (a raft write and a bcrypt on every etcd member)."""
    refusal = _etcd_error("etcdserver: authentication failed, invalid user ID or password")
    etcd, etcd2 = QueuedLoginEtcd(login=refusal), AuthEtcd()
    endpoints = (_endpoint(servers, etcd), _endpoint(servers, etcd2))
    raised = _four_at_once_behind_one_login(endpoints, etcd)
    assert {type(e) for e in raised} == {StoreRefused}, raised
    assert {str(e) for e in raised} == {
        "etcd refused the login of user 'gpud' (etcdserver: authentication failed, invalid "
        "user ID or password): check cluster.etcd_username and the password in "
        "cluster.etcd_password_file"
    }
    assert (etcd.logins, etcd2.logins) == (1, 0)
