"""The only module that talks to etcd: its v3 JSON gateway, through ``etcd3gw``.

Why ``etcd3gw`` (OpenStack's client, the ``etcd`` extra): it speaks the gRPC gateway that
etcd 3.4 and 3.5 (and 3.6) serve on the client port, over HTTP(S) with ``requests``, and
discovers the API path from ``/version``; it carries no generated protobuf code, so it
cannot clash with the protobuf runtime gpud's own API needs. The gRPC clients
(``etcd3``: unmaintained since 2020, protobuf 3 gencode; ``aetcd``: its own gencode) tie
us to the protobuf they were generated with.

What etcd sees (``etcdctl get --prefix /gpud/cluster``)::

    <prefix>/leader        {"node": ..., "address": ...}   attached to the leader's lease
    <prefix>/tags/<job>    "<dscp>"                         written by the leader only, in a
                                                            transaction that checks the
                                                            leader key is still its own

Several endpoints are tried in turn; TLS (CA, client certificate) and user/password
authentication are supported (with etcd's authentication off, calls go without a token, as
etcdctl's do; a login again mends ``user name is empty`` once it is on and an expired token,
within the call that meets it, once per endpoint and call; an endpoint that still refuses
this node's token, a proxy dropping the ``Authorization`` header, is passed over for the
next, and a refusal only where none serves). Every failure to reach etcd is
:class:`~gpud.errors.Unavailable`, naming each endpoint with its own failure (the kernel's
``Connection refused``, no answer within the timeout: a stopped etcd, or the HTTP reason of
a 500, 503, 408 or 504: etcd's, or a proxy's own);
so is an endpoint that answers but not as etcd (its peer port, another service: the
next endpoint is tried, and the error names each such endpoint, logged once); a write
refused because etcd is out of space is :class:`~gpud.errors.StoreFull`
(``etcdctl alarm list`` shows ``alarm:NOSPACE``); any other refusal (the login, the user's
keys, a proxy in front of etcd answering 401, 403 or 413) is
:class:`~gpud.errors.StoreRefused`, naming the request refused (``/version``,
``/auth/authenticate`` or the v3 path).
"""

from __future__ import annotations

import base64
import json
import logging
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

from gpud.errors import ConfigError, GpudError, StoreFull, StoreRefused, Unavailable

log = logging.getLogger(__name__)


NOSPACE = "NOSPACE"
NOSPACE_ADVICE = (
    "etcd is out of space (alarm NOSPACE) and refuses every write: no leader can be "
    "elected and no new tag saved, and the last order stays in force; free space "
    "(etcdctl compact REV, then etcdctl defrag), then run etcdctl alarm disarm"
)


def _gateway_body(err: BaseException) -> dict[str, Any] | None:
    """The JSON object etcd's gateway says a refusal in (``{"code", "message"}``, or
    ``{"error"}`` on a stream), which etcd3gw keeps apart from the HTTP reason; None when
    the answer carried none (an HTML page, a proxy's words)."""
    detail = getattr(err, "detail_text", None)
    try:
        body = json.loads(detail) if isinstance(detail, str) else None
    except ValueError:
        return None
    if isinstance(body, dict) and ("message" in body or "error" in body):
        return body
    return None


def _refusal(err: BaseException) -> str:
    """What etcd said: its gateway's message, as the HTTP reason alone says only "Too Many
    Requests"; the reason when another server (a proxy in front of etcd) refused."""
    body = _gateway_body(err)
    if body is not None and body.get("message"):
        return str(body["message"])
    return str(err)


# HTTP reasons that say the server has no such API: etcd's peer port (2380) and other
# services answer etcd's paths so; a 401, 403 or 413 from a proxy in front of etcd is a
# refusal instead
_NO_SUCH_API = frozenset({"Not Found", "Method Not Allowed", "Not Implemented"})
_AUTH_REFUSALS = frozenset({"Unauthorized", "Forbidden", "Proxy Authentication Required"})
AUTH_OFF = "authentication is not enabled"  # etcd's answer to a login while auth is off
# refusals that a login again mends: a token expired, or a call without one (authentication
# turned on after calls went without it)
NO_USER = "user name is empty"  # etcd's answer to a call that carried no token
INVALID_TOKEN = "invalid auth token"  # etcd's answer to a token it did not give or let expire
_LOGIN_AGAIN = (INVALID_TOKEN, NO_USER)
# an endpoint that refused the token of a login is logged in to again after this long:
# at most one login a minute there (a raft write and a bcrypt on every etcd member), and
# one mended meanwhile, whose old token has expired, serves again without a restart
LOGIN_AGAIN_AFTER_S = 60.0
VERSION_PATH = "/version"  # where etcd3gw discovers the API path, once per endpoint


_CLIP = 120  # characters of another server's answer said in an error
_PATH = re.compile(r"/[^\s'\"]+")  # an absolute path (or a URL's) in an error's text


class _NotEtcd(Unavailable):
    """An endpoint that answered :data:`VERSION_PATH` with 200, but not with etcd's
    ``{"etcdserver": "X.Y.Z"}`` (a web server's page, a proxy's login form), or that
    redirected it to anything but etcd's answer."""


@dataclass(frozen=True, slots=True)
class _Failure:
    """How one endpoint failed a request, as a call says it: ``unreachable`` (``said``
    names the endpoint and why) and ``refused`` go on to the next endpoint, as does
    ``wrong`` (it answered, but not as etcd); ``final`` is raised at once as ``error``,
    as no other endpoint would serve it either (etcd refused the login, a NOSPACE)."""

    kind: Literal["unreachable", "refused", "wrong", "final"]
    said: str
    error: type[GpudError] = StoreRefused


class _AwaitedLoginFailed(Exception):
    """A login at an endpoint failed, or was still under way when this call's timeout
    ran out: raised in the thread that logged in and in each thread that waited for that
    login, which all take its ``failure`` alike (the same words, the same next step)."""

    def __init__(self, failure: _Failure) -> None:
        super().__init__(failure.said)
        self.failure = failure


def _etcd_version(body: str) -> str:
    """etcd's version in its ``/version`` answer, or "" when the body is not etcd's."""
    try:
        answer = json.loads(body)
    except ValueError:
        return ""
    version = answer.get("etcdserver") if isinstance(answer, dict) else None
    if isinstance(version, str) and all(p.isdigit() for p in version.split(".", 2)[:2]):
        return version
    return ""


def _clipped(text: str, *, paths: bool = False) -> str:
    """``text`` on one line, quoted, its first :data:`_CLIP` characters; with ``paths``, a
    path that begins within them is said to its end (it names the file to mend)."""
    said = " ".join(text.split())
    end = _CLIP
    if paths:
        cut = next((m for m in _PATH.finditer(said) if m.start() < end < m.end()), None)
        end = cut.end() if cut else end
    return f"{said[:end]!r}" + (" (clipped)" if len(said) > end else "")


def _checked_version_get(
    endpoint: str, get: Callable[..., Any], max_redirects: int
) -> Callable[..., Any]:
    """``get`` (``endpoint``'s session's, which etcd3gw calls for :data:`VERSION_PATH`
    alone), judging the answer to :data:`VERSION_PATH` as etcd's before etcd3gw parses it
    as JSON (a page would be said as a ``JSONDecodeError``): :class:`_NotEtcd` for a 200
    without etcd's version, and for redirects that end anywhere but at etcd's version (a
    proxy's login form, a 404, a loop), said with the first redirect and where it led. A
    refusal without a redirect (a proxy's 401) is left to etcd3gw, a refusal.

    Only this request follows a redirect to etcd: etcd3gw POSTs every API call to the
    endpoint's base URL, and a 301 or 302 would turn those POSTs into GETs, so an endpoint
    must be the URL etcd answers on itself (``https://...`` where etcd serves TLS)."""

    def checked(url: str, *args: Any, **kwargs: Any) -> Any:
        if urlsplit(url).path != VERSION_PATH:
            return get(url, *args, **kwargs)
        import requests  # etcd3gw's transport

        try:
            resp = get(url, *args, **kwargs)
        except requests.exceptions.TooManyRedirects as err:
            last = err.response.url if err.response is not None else url
            said = f"redirects without end (more than {max_redirects}, the last to {last})"
            raise _NotEtcd(_said_not_etcd(endpoint, VERSION_PATH, said)) from err
        status = resp.status_code
        if resp.history:
            if status == 200 and _etcd_version(resp.text):
                return resp  # etcd's own answer at the end: the redirect is followed
            first = resp.history[0].status_code
            said = f"a redirect (HTTP {first}) to {resp.url}, answered there HTTP {status}"
            raise _NotEtcd(_said_not_etcd(endpoint, VERSION_PATH, f"{said} {_clipped(resp.text)}"))
        if status == 200 and not _etcd_version(resp.text):
            raise _NotEtcd(_said_200_not_etcd(endpoint, VERSION_PATH, resp.text))
        return resp

    return checked


def _said_not_etcd(endpoint: str, request: str, said: str) -> str:
    return (
        f"{endpoint} answered {request} with {said}, not as etcd's client API: is it "
        "etcd's client port (2379 by default; 2380 is the peer port)? check "
        "cluster.etcd_endpoints"
    )


def _said_200_not_etcd(endpoint: str, request: str, body: str) -> str:
    """``endpoint`` answered ``request`` with 200 and ``body``, which is not etcd's (a web
    server's page, a proxy's login form)."""
    return _said_not_etcd(endpoint, request, f"HTTP 200 {_clipped(body)}")


def _not_etcd(err: BaseException, endpoint: str, request: str) -> str:
    """Why ``endpoint`` is no etcd client port, from the error of ``request`` to it
    (:data:`VERSION_PATH`, ``/auth/authenticate`` or a v3 path), or "" when etcd, or a
    proxy in front of it, refused. etcd answers ``/version`` with ``{"etcdserver": ...}``
    and each refusal with a JSON body; an answer without one comes from something else
    when it says there is no such API (404, 405, 501) or ``/version`` fails other than
    for a login a proxy asks (401, 403, 407)."""
    if type(err).__name__ != "ApiVersionDiscoveryFailedError":
        if _gateway_body(err) is not None:
            return ""
        reason = " ".join(str(err).split())
        discovery = request == VERSION_PATH and reason not in _AUTH_REFUSALS
        if not discovery and reason not in _NO_SUCH_API:
            return ""
    said = " ".join(str(err).split()) or type(err).__name__
    return _said_not_etcd(endpoint, request, repr(said))


@dataclass(frozen=True, slots=True)
class EtcdSettings:
    """How to reach etcd: ``endpoints`` are ``http(s)://HOST:PORT``."""

    endpoints: tuple[str, ...] = ("http://127.0.0.1:2379",)
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    username: str = ""
    password: str = ""
    password_file: str = ""  # where the password came from, named when etcd refuses it
    timeout_s: float = 2.0


@dataclass(frozen=True, slots=True)
class KeyValue:
    """A key as etcd answered a range for it; ``read_revision``: the store's revision in
    that answer's header (0 where unknown), past every change to the key then. A watch
    from it misses none, and starts at a revision that etcd keeps until a later
    compaction (``etcdctl compact REV``), which the key's own ``mod_revision``, as old as
    the key where it is never written again, does not."""

    value: bytes
    create_revision: int
    mod_revision: int
    lease: int
    read_revision: int = 0


def _b64(data: str | bytes) -> str:
    raw = data.encode() if isinstance(data, str) else data
    return base64.b64encode(raw).decode()


def _unb64(data: str) -> bytes:
    return base64.b64decode(data)


def _key_value(kv: Mapping[str, Any], read_revision: int = 0) -> KeyValue:
    """One of the gateway's ``kvs`` (numbers come as strings, absent when 0), read at the
    store's ``read_revision``."""
    return KeyValue(
        value=_unb64(kv.get("value", "")),
        create_revision=int(kv.get("create_revision", 0)),
        mod_revision=int(kv.get("mod_revision", 0)),
        lease=int(kv.get("lease", 0)),
        read_revision=read_revision,
    )


def _header_revision(result: Mapping[str, Any]) -> int:
    """The store's revision in an answer's header (0 where it carried none)."""
    header = result.get("header")
    return int(header.get("revision", 0)) if isinstance(header, Mapping) else 0


def _prefix_end(prefix: bytes) -> bytes:
    """The range end that covers every key starting with ``prefix``."""
    return prefix[:-1] + bytes([prefix[-1] + 1])


class EtcdClient:
    """A small, synchronous etcd v3 client (call it from a worker thread)."""

    def __init__(
        self, settings: EtcdSettings, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        try:
            import etcd3gw  # the optional extra: imported only when etcd is configured
        except ImportError as err:
            raise ConfigError(
                "election = etcd needs the etcd client: pip install 'gpud[etcd]'",
                key="cluster.election",
            ) from err

        if not settings.endpoints:
            raise ConfigError("at least one endpoint is needed", key="cluster.etcd_endpoints")
        self._settings = settings
        self._clock = clock
        exc = etcd3gw.exceptions
        self._unreachable: tuple[type[BaseException], ...] = (
            exc.ConnectionFailedError,
            exc.ConnectionTimeoutError,
            exc.InternalServerError,
            OSError,
        )
        self._refused: tuple[type[BaseException], ...] = (exc.Etcd3Exception,)
        import requests  # etcd3gw's transport

        # requests' own (simplejson's where that is installed, which json's does not cover)
        self._not_json: type[json.JSONDecodeError] = requests.exceptions.JSONDecodeError
        self._timeout: type[BaseException] = requests.exceptions.Timeout
        self._clients: list[Any] = []
        for endpoint in settings.endpoints:
            url = urlsplit(endpoint)
            if url.scheme not in ("http", "https") or not url.hostname or not url.port:
                raise ConfigError(
                    f"{endpoint!r} is not http(s)://HOST:PORT", key="cluster.etcd_endpoints"
                )
            client = etcd3gw.Etcd3Client(
                host=url.hostname,
                port=url.port,
                protocol=url.scheme,
                ca_cert=settings.ca_file or None,
                cert_cert=settings.cert_file or None,
                cert_key=settings.key_file or None,
                timeout=settings.timeout_s,
            )
            # an instance attribute over requests' method: etcd3gw calls session.get for
            # /version alone, and a response hook would see each answer of a redirect
            # chain before its history is set
            session: Any = client.session
            session.get = _checked_version_get(endpoint, session.get, session.max_redirects)
            if settings.ca_file:
                # requests lets $REQUESTS_CA_BUNDLE / $CURL_CA_BUNDLE override a session's
                # CA (https://github.com/psf/requests/issues/3829): etcd's CA would be
                # ignored and every call fail verification. Configured files win; this also
                # leaves the proxy variables and ~/.netrc out of etcd's connections.
                client.session.trust_env = False
            self._clients.append(client)
        self._current = 0
        self._lock = threading.Lock()
        # guarded by _lock with the sets below: threads call on one client at once
        self._tokens: dict[int, str] = {}  # each endpoint's token of this node's login
        self._authenticated: set[int] = set()
        # endpoints logged in while etcd had authentication off: their calls carry no token
        self._tokenless: set[int] = set()
        # endpoints whose token a login had just given was not seen by etcd (a proxy that
        # drops the Authorization header), each with the monotonic time of the login it
        # met: no login again there until a call succeeds or LOGIN_AGAIN_AFTER_S passes
        self._token_lost: dict[int, float] = {}
        # endpoints that answered a token a login had just given as invalid (a token store
        # of its own, a proxy), each with the monotonic time of that login: no login again
        # there until a call succeeds or LOGIN_AGAIN_AFTER_S passes
        self._token_refused: dict[int, float] = {}
        self._said_not_etcd: set[str] = set()  # endpoints logged as answering not as etcd
        self._said_auth_off: set[str] = set()  # endpoints logged as having auth off
        # one login at a time per endpoint: threads that meet it unlogged at once wait
        # for the first one's token (each login is a raft write and a bcrypt on every
        # etcd member)
        self._logging_in = [threading.Lock() for _ in self._clients]
        # each endpoint's count of logins ended (given a token or failed), and how the
        # last failed one failed, guarded by _lock: a thread that waited for a login tells
        # by the count whether the one it awaited ended, and takes its failure
        self._logins_ended = [0 for _ in self._clients]
        self._login_failed: dict[int, _Failure] = {}
        # the highest compact_revision a watch was cancelled with, guarded by _lock
        self._compacted = 0

    def _read_at(self, result: Mapping[str, Any]) -> int:
        """The store's revision in ``result``'s header (0 where it carried none),
        forgetting a compaction recorded past it: etcd's revisions start again at 1 once
        its data is wiped or restored from an older snapshot, and a watch from the old
        compaction would wait for revisions the store has not reached."""
        revision = _header_revision(result)
        if revision:
            with self._lock:
                if revision < self._compacted:
                    self._compacted = 0
        return revision

    @property
    def timeout_s(self) -> float:
        return self._settings.timeout_s

    @property
    def compacted_revision(self) -> int:
        """The revision etcd was last seen compacted to (``etcdctl compact REV``, its
        auto-compaction): the ``compact_revision`` etcd cancelled a watch from an earlier
        revision with; 0 before any, and again once a read's answer says a store
        revision below it (etcd wiped or restored from an older snapshot). A watch
        starting at it or later is served."""
        with self._lock:
            return self._compacted

    # -- transport -----------------------------------------------------------------------

    def _post(self, path: str, body: Mapping[str, Any]) -> Any:
        """POST to the current endpoint, moving on to the next on failure."""
        last: BaseException | None = None
        wrong: list[str] = []  # endpoints that answered, but not as etcd
        unreachable: list[str] = []  # the others that failed, each with why
        # endpoints that refused this node's token (their own proxy or token store; the
        # next endpoint may take it), each said as the refusal it gave
        refused: list[str] = []
        with self._lock:
            start = self._current
        for i in range(len(self._clients)):
            index = (start + i) % len(self._clients)
            client = self._clients[index]
            request = VERSION_PATH  # get_url asks the endpoint's version the first time
            fresh = False
            try:
                url = client.get_url(path)
                request = "/auth/authenticate"
                fresh = self._authenticate(index, client)
                request = path
                try:
                    result = client.post(url, data=json.dumps(body), headers=self._token(index))
                except self._refused as err:
                    if not self._forget_login_if_mendable(index, _refusal(err), fresh):
                        raise
                    # once per endpoint and call: a second refusal is said as it is
                    request = "/auth/authenticate"
                    fresh = self._authenticate(index, client)
                    request = path
                    result = client.post(url, data=json.dumps(body), headers=self._token(index))
            except Exception as err:
                failure = self._failure(err, index, request, fresh)
                if failure is None:
                    raise
                if failure.kind == "final":
                    raise failure.error(failure.said) from err
                if failure.kind == "wrong":
                    wrong.append(failure.said)
                else:
                    last = err
                    into = unreachable if failure.kind == "unreachable" else refused
                    into.append(failure.said)
                continue
            with self._lock:
                self._token_lost.pop(index, None)
                self._token_refused.pop(index, None)
                self._current = index
            return result
        if refused:
            # an endpoint that answered and refused says more than one that did not answer
            failed = [f"etcd unreachable at {', '.join(unreachable)}"] if unreachable else []
            raise StoreRefused("; ".join([*refused, *failed, *wrong])) from last
        # every endpoint named wrong is said, whichever was tried last
        if last is None:
            raise Unavailable(f"etcd unreachable: {'; '.join(wrong)}")
        # each endpoint's own failure: a dead one refuses at once, a hung etcd (stopped,
        # overloaded, a blackholed route) times out, and the last alone would hide the other
        said = f"etcd unreachable at {', '.join(unreachable)}"
        raise Unavailable("; ".join([said, *wrong])) from last

    def _failure(
        self, err: BaseException, index: int, request: str, fresh: bool
    ) -> _Failure | None:
        """How endpoint ``index`` failed ``request`` (:data:`VERSION_PATH`,
        ``/auth/authenticate`` or the v3 path) with ``err``, or None for an error of this
        process's own (raised as it is). ``fresh``: the call's login has just given the
        token ``request`` carried."""
        endpoint = self._settings.endpoints[index]
        if isinstance(err, _AwaitedLoginFailed):
            return err.failure
        if isinstance(err, _NotEtcd):
            self._say_not_etcd(endpoint, str(err))
            return _Failure("wrong", str(err))
        if isinstance(err, self._not_json):
            # a 200 whose body is no JSON (requests' error is an OSError too, and would
            # read as unreachable): etcd's gateway answers every API path in JSON
            not_etcd = _said_200_not_etcd(endpoint, request, err.doc)
            self._say_not_etcd(endpoint, not_etcd)
            return _Failure("wrong", not_etcd)
        if isinstance(err, self._unreachable):
            return _Failure("unreachable", f"{endpoint} ({self._why_unreachable(err)})")
        if not isinstance(err, self._refused):
            return None
        not_etcd = _not_etcd(err, endpoint, request)
        if not_etcd:  # the next endpoint may be etcd
            self._say_not_etcd(endpoint, not_etcd)
            return _Failure("wrong", not_etcd)
        said = _refusal(err)
        if self._token_unseen(index, said):
            with self._lock:
                # each later call meets it too: the mark keeps its login's time
                if fresh or index not in self._token_lost:
                    self._token_lost[index] = self._clock()
            return _Failure("refused", self._said_token_lost(endpoint, request, said))
        if self._settings.username and any(w in said for w in _LOGIN_AGAIN):
            # a login again did not mend it here (a token store of its own, a proxy):
            # another endpoint may take this node's token
            if fresh and INVALID_TOKEN in said:
                with self._lock:
                    self._token_refused[index] = self._clock()
            return _Failure("refused", f"etcd refused {request} at {endpoint}: {said}")
        login = self._login_refusal(said)
        if login:
            return _Failure("final", login)
        if "database space exceeded" in said:
            # the alarm is the cluster's: no other endpoint takes the write either
            advice = f"etcd refused {request}: {NOSPACE_ADVICE} ({said})"
            return _Failure("final", advice, StoreFull)
        if _gateway_body(err) is None:  # a proxy's words, or another server's
            said = f"{said} (answered by {endpoint} without etcd's error body)"
        return _Failure("final", f"etcd refused {request}: {said}")

    def _why_unreachable(self, err: BaseException) -> str:
        """Why one endpoint gave no answer, in the kernel's words where it said any
        (``Connection refused``, ``No route to host``, a name that does not resolve), or
        the TLS library's, or the HTTP reason it was answered with; etcd3gw keeps
        requests' text in ``detail_text``, not ``str``."""
        if isinstance(err.__context__, self._timeout) or (
            type(err).__name__ == "ConnectionTimeoutError" and not str(err)
        ):
            return f"no answer within {self._settings.timeout_s:g} s, cluster.etcd_timeout_s"
        if str(err) and isinstance(err, self._refused):
            # an HTTP answer etcd3gw counts as a failure to reach etcd (500, 503, and 408
            # or 504 from a proxy in front of it): its reason, and etcd's message or the
            # proxy's body where it has one
            body = _refusal(err) if _gateway_body(err) else getattr(err, "detail_text", None)
            body = body or ""
            return f"HTTP {err}" + (f" {_clipped(body)}" if body.strip() else "")
        text = getattr(err, "detail_text", None) or ""
        if not text and not isinstance(err, self._refused) and str(err):
            # not etcd3gw's (whose str is an HTTP reason): a failure on this host, a CA
            # file gone since the start, said with the path it names whole (what to mend)
            return f"{type(err).__name__} {_clipped(str(err), paths=True)}"
        kernel = re.search(r"\[Errno -?\d+\] ([^'\"()]+)", text)
        if kernel:
            return kernel.group(1).strip()
        cause = text.split("Caused by ", 1)[-1]  # urllib3's preamble names the pool
        # the TLS library's reason ends its text, past a preamble that a clip would keep;
        # it may quote a host name ("not valid for 'etcd1'") and ends before OpenSSL's
        # source line or the quote that closes it
        tls = re.search(r"\[SSL: [A-Z_]+\].*?(?= \(_ssl|\"|'\)|$)", cause, re.S)
        if tls:
            cause = tls.group(0)
        return f"{type(err).__name__} {_clipped(cause)}" if cause.strip() else type(err).__name__

    def _first_said(self, said: set[str], endpoint: str) -> bool:
        """Whether ``endpoint`` is not in ``said`` yet, adding it: True for one thread
        alone, however many meet the same endpoint at once."""
        with self._lock:
            first = endpoint not in said
            said.add(endpoint)
        return first

    def _say_not_etcd(self, endpoint: str, not_etcd: str) -> None:
        # once, even while another endpoint works: the list is wrong
        if self._first_said(self._said_not_etcd, endpoint):
            log.warning("cluster: %s", not_etcd)

    def _login_refusal(self, said: str) -> str:
        """What to change when etcd refused this node's login, a call without one or the
        user's keys ("" when ``said`` is another refusal): etcd's own words name no
        setting. Each begins "etcd refused", as every refusal does (an older gpuctl tells
        these from an etcd it cannot reach by it)."""
        s = self._settings
        if "authentication failed" in said:
            return (
                f"etcd refused the login of user {s.username!r} ({said}): check "
                f"{self._login_settings()}"
            )
        if "user name is empty" in said:
            return (
                f"etcd refused a call without a user: it has authentication on ({said}): set "
                "cluster.etcd_username and cluster.etcd_password_file, or a client "
                "certificate whose common name is an etcd user (cluster.etcd_cert_file)"
            )
        if "permission denied" in said:
            return (
                f"etcd refused user {s.username or '(of the client certificate)'} the keys "
                f"under cluster.etcd_prefix ({said}): grant its role readwrite on them "
                "(etcdctl role grant-permission --prefix ROLE readwrite PREFIX)"
            )
        return ""

    def _login_settings(self) -> str:
        source = self._settings.password_file
        return "cluster.etcd_username and the password in cluster.etcd_password_file" + (
            f" ({source})" if source else ""
        )

    def _forget_login_if_mendable(self, index: int, said: str, fresh: bool) -> bool:
        """Whether etcd's refusal ``said`` of a call to endpoint ``index`` is mended by a
        login again, forgetting its login when it is: a token expired (``invalid auth
        token``), or a call without one where etcd's authentication has been turned on
        since (``user name is empty`` to a node that logged in while it was off). A token
        a login of this call (``fresh``) has just given is not logged in for again, nor
        one etcd never saw since that login, nor one it refused as invalid as soon as a
        login gave it: a proxy dropping the Authorization header, or one with a token
        store of its own, would have every call log in (a raft write and a bcrypt on
        every etcd member). Such an endpoint is logged in to again once
        :data:`LOGIN_AGAIN_AFTER_S` has passed since: mended meanwhile, it would refuse
        the old token as expired for good (etcd's simple tokens live 5 minutes)."""
        if not self._settings.username or not any(w in said for w in _LOGIN_AGAIN):
            return False
        with self._lock:
            token_refused = (
                fresh
                or (NO_USER in said and self._held_back(self._token_lost, index))
                or (INVALID_TOKEN in said and self._held_back(self._token_refused, index))
            )
            if index not in self._tokenless and token_refused:
                return False
            self._authenticated.discard(index)
            return True

    def _held_back(self, marks: dict[int, float], index: int) -> bool:
        """Whether endpoint ``index`` is marked in ``marks`` by a login less than
        :data:`LOGIN_AGAIN_AFTER_S` ago (called with ``_lock`` held)."""
        since = marks.get(index)
        return since is not None and self._clock() - since < LOGIN_AGAIN_AFTER_S

    def _token_unseen(self, index: int, said: str) -> bool:
        """Whether etcd answered ``user name is empty`` to a call that carried the token
        of this node's login at endpoint ``index``."""
        if not self._settings.username or NO_USER not in said:
            return False
        with self._lock:
            return index in self._authenticated and index not in self._tokenless

    def _token(self, index: int) -> dict[str, str]:
        """The headers that carry this node's token to endpoint ``index`` (etcd reads it
        from ``Authorization``); none before a login, or while etcd has authentication
        off. Given with each request, not set on the session: other threads send on it."""
        with self._lock:
            token = self._tokens.get(index)
        return {"Authorization": token} if token else {}

    def _said_token_lost(self, endpoint: str, request: str, said: str) -> str:
        return (
            f"etcd refused {request} as a call without a user ({said}), though {endpoint} "
            f"accepted the login of user {self._settings.username!r} and the call carried "
            "its token: a proxy in front of etcd drops the Authorization header; let it "
            "pass that header, or name etcd itself in cluster.etcd_endpoints (not logging "
            "in again until a call there succeeds or a minute has passed)"
        )

    def _authenticate(self, index: int, client: Any) -> bool:
        """Log in at endpoint ``index`` where a user is set and it is not logged in: True
        when a login was made, this thread's or another's it waited for (threads that
        meet the endpoint unlogged at once make one login). The token goes in the
        ``Authorization`` header of each call (:meth:`_token`); none while etcd has
        authentication off (a token of an earlier login would be refused as ``invalid auth
        token``).

        A thread that waits for another's login waits no longer than
        ``cluster.etcd_timeout_s``, and takes that login's failure as its own
        (:class:`_AwaitedLoginFailed`) rather than logging in again, said in the same
        words and met the same way as by the thread that logged in (the next endpoint
        after one unreachable or answering not as etcd, a refused login raised at once):
        etcd sees one login per endpoint however many threads met it, and a hung etcd
        costs each of them one timeout, not one per thread queued ahead of it."""
        if not self._settings.username:
            return False
        with self._lock:
            if index in self._authenticated:
                return False
            awaited = self._logins_ended[index]
        # only threads about to log in take this lock: one that waits on it waits for a login
        logging_in = self._logging_in[index]
        waited = not logging_in.acquire(blocking=False)
        if waited and not logging_in.acquire(timeout=self._settings.timeout_s):
            endpoint = self._settings.endpoints[index]
            said = f"login at {endpoint} still under way after {self._settings.timeout_s:g} s"
            raise _AwaitedLoginFailed(_Failure("unreachable", f"{endpoint} ({said})"))
        try:
            with self._lock:
                if index in self._authenticated:
                    # a token another thread's login gave while this one waited is as
                    # fresh as its own: not logged in for again within this call either
                    return waited
                failed = self._login_failed.get(index)
                if failed is not None and self._logins_ended[index] != awaited:
                    # a new exception per thread: one raised in two at once would
                    # share one traceback
                    raise _AwaitedLoginFailed(failed)
            try:
                return self._login(index, client)
            except BaseException as err:
                failure = self._login_failure(index, err)
                if failure is None:
                    endpoint = self._settings.endpoints[index]
                    said = f"the login failed: {type(err).__name__} {_clipped(str(err))}"
                    self._login_ended(index, _Failure("unreachable", f"{endpoint} ({said})"))
                    raise
                self._login_ended(index, failure)
                raise _AwaitedLoginFailed(failure) from err
        finally:
            logging_in.release()

    def _login_failure(self, index: int, err: BaseException) -> _Failure | None:
        """How the login at endpoint ``index`` failed with ``err``, said alike by this
        thread and those that waited for it; None for an error of this process's own,
        raised as it is here (the waiters say it as the login failing)."""
        if isinstance(err, StoreRefused):  # answered without a token: no etcd's login
            return _Failure("final", str(err))
        return self._failure(err, index, "/auth/authenticate", fresh=False)

    def _login_ended(self, index: int, failed: _Failure) -> None:
        with self._lock:
            self._logins_ended[index] += 1
            self._login_failed[index] = failed

    def _login(self, index: int, client: Any) -> bool:
        """:meth:`_authenticate`'s login at endpoint ``index`` (its login lock held)."""
        try:
            result = client.post(
                client.get_url("/auth/authenticate"),
                data=json.dumps(
                    {"name": self._settings.username, "password": self._settings.password}
                ),
            )
        except self._refused as err:
            if AUTH_OFF not in _refusal(err):
                raise
            # etcd's own client (clientv3, etcdctl) calls on without a token then: the
            # user can be set up before `etcdctl auth enable`, which a call then meets as
            # "user name is empty" and logs in again
            endpoint = self._settings.endpoints[index]
            if self._first_said(self._said_auth_off, endpoint):
                log.warning(
                    "cluster: etcd at %s has authentication off: calls go without the login "
                    "of cluster.etcd_username %r until it is on (etcdctl auth enable)",
                    endpoint,
                    self._settings.username,
                )
            # etcd refuses a token once its authentication is off (`etcdctl auth disable`)
            with self._lock:
                self._tokens.pop(index, None)
                self._tokenless.add(index)
                self._authenticated.add(index)
                self._logins_ended[index] += 1
                self._login_failed.pop(index, None)
            return True
        token = result.get("token") if isinstance(result, dict) else None
        if not isinstance(token, str) or not token:
            # etcd answers a login it accepts with a token and one it refuses with an
            # error; a 200 without a token is something else answering for it
            raise StoreRefused(
                f"etcd refused the login of user {self._settings.username!r}: "
                f"{self._settings.endpoints[index]} answered /auth/authenticate with HTTP 200 "
                f"{_clipped(json.dumps(result))}, which carried no token: check "
                f"{self._login_settings()}, and that cluster.etcd_endpoints names etcd's "
                "client port (2379 by default)"
            )
        with self._lock:
            self._tokens[index] = token
            self._tokenless.discard(index)
            self._authenticated.add(index)
            self._logins_ended[index] += 1
            self._login_failed.pop(index, None)
        return True

    def alarms(self) -> tuple[str, ...]:
        """The alarms raised on the cluster, e.g. ``("NOSPACE",)`` (``etcdctl alarm list``);
        readable while etcd refuses writes."""
        result = self._post("/maintenance/alarm", {"action": "GET"})
        return tuple(sorted({str(a.get("alarm", "")) for a in result.get("alarms") or []} - {""}))

    # -- leases --------------------------------------------------------------------------

    def grant(self, ttl_s: int) -> tuple[int, int]:
        """A new lease: (id, the TTL etcd granted, which may be longer than asked)."""
        result = self._post("/lease/grant", {"TTL": ttl_s, "ID": 0})
        return int(result["ID"]), int(result["TTL"])

    def keepalive(self, lease: int) -> int:
        """Renew ``lease``; its new TTL, or -1 if it had expired."""
        result = self._post("/lease/keepalive", {"ID": lease})
        return int(result.get("result", {}).get("TTL", -1))

    def time_to_live(self, lease: int) -> tuple[int, int]:
        """(seconds left, TTL granted) of ``lease`` (``etcdctl lease timetolive``); the
        seconds left are -1 once it has expired."""
        result = self._post("/lease/timetolive", {"ID": lease})
        return int(result.get("TTL", -1)), int(result.get("grantedTTL", 0))

    def revoke(self, lease: int) -> None:
        """Drop ``lease`` and every key attached to it (a lease that is gone is fine)."""
        try:
            self._post("/lease/revoke", {"ID": lease})
        except Unavailable:
            raise
        except GpudError as err:
            if "not found" not in str(err).lower():
                raise

    # -- keys ----------------------------------------------------------------------------

    def get(self, key: str) -> KeyValue | None:
        result = self._post("/kv/range", {"key": _b64(key)})
        kvs = result.get("kvs") or []
        read = self._read_at(result)  # an absent key's answer carries it too
        return _key_value(kvs[0], read) if kvs else None

    def get_prefix(self, prefix: str) -> dict[str, bytes]:
        return {key: kv.value for key, kv in self.get_prefix_kvs(prefix).items()}

    def get_prefix_kvs(self, prefix: str) -> dict[str, KeyValue]:
        """Every key under ``prefix`` with its value, revisions and lease."""
        raw = prefix.encode()
        result = self._post("/kv/range", {"key": _b64(raw), "range_end": _b64(_prefix_end(raw))})
        read = self._read_at(result)
        return {_unb64(kv["key"]).decode(): _key_value(kv, read) for kv in result.get("kvs") or []}

    def create(self, key: str, value: str, lease: int) -> int | None:
        """Put ``key`` only if it does not exist; its create revision, or None if it did."""
        result = self._post(
            "/kv/txn",
            {
                "compare": [
                    {"key": _b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": 0}
                ],
                "success": [
                    {"request_put": {"key": _b64(key), "value": _b64(value), "lease": lease}}
                ],
                "failure": [],
            },
        )
        if not result.get("succeeded"):
            return None
        return int(result["header"]["revision"])

    def wait_for_change(self, key: str, after_revision: int, timeout_s: float) -> bool:
        """Watch ``key`` for up to ``timeout_s``: True as soon as it changes after
        ``after_revision`` (put or delete; none is missed in between), False on timeout.

        One watch stream per call (``etcdctl watch KEY --rev R``), on the current endpoint.
        Its TCP connect waits no longer than ``timeout_s`` either (the client's timeout
        where that is shorter): an endpoint that does not answer the SYN (unreachable
        after a resume from a suspend, say) gives False within ``timeout_s``.
        """
        import requests  # etcd3gw's transport

        with self._lock:
            index = self._current
        client = self._clients[index]
        body = {"create_request": {"key": _b64(key), "start_revision": after_revision + 1}}
        try:
            with client.session.post(
                client.get_url("/watch"),
                data=json.dumps(body),
                stream=True,
                timeout=(min(self._settings.timeout_s, timeout_s), timeout_s),
                headers=self._token(index),
            ) as resp:
                if resp.status_code != 200:
                    raise Unavailable(f"etcd watch of {key}: HTTP {resp.status_code}")
                for line in resp.iter_lines():
                    if not line.strip():
                        continue
                    result = json.loads(line).get("result", {})
                    compacted = int(result.get("compact_revision") or 0)
                    if compacted:
                        # compacted past our revision: the key is read again, and watched
                        # from here on where etcd's answer gives no revision to start at
                        with self._lock:
                            self._compacted = max(self._compacted, compacted)
                        return True
                    if result.get("events") or result.get("canceled"):
                        return True
        except requests.exceptions.ConnectionError as err:
            if "timed out" in str(err).lower():
                return False
            raise Unavailable(f"etcd watch of {key}: {err}") from err
        except requests.exceptions.RequestException as err:
            if isinstance(err, requests.exceptions.Timeout):
                return False
            raise Unavailable(f"etcd watch of {key}: {err}") from err
        return False

    def put(self, key: str, value: str, lease: int = 0) -> None:
        """``etcdctl put KEY VALUE [--lease ID]``: a key on a lease goes when the lease does."""
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = lease
        self._post("/kv/put", body)

    def delete(self, key: str) -> None:
        """``etcdctl del KEY`` (a key that is not there is fine)."""
        self._post("/kv/deleterange", {"key": _b64(key)})

    def guarded_update(
        self,
        guard_key: str,
        guard_create_revision: int,
        guard_lease: int,
        puts: Mapping[str, str],
        deletes: list[str],
    ) -> bool:
        """Apply ``puts`` and ``deletes`` in one transaction, only while ``guard_key`` is the
        one created at ``guard_create_revision`` and held by ``guard_lease`` (a deposed
        leader writes nothing).

        etcd compares both in the txn (``target`` ``CREATE`` and ``LEASE``): its revisions
        start again at 1 on a fresh etcd (a wiped data dir, a new cluster, a restore of an
        older snapshot), so a new leader key there may carry an old leader's create
        revision; its lease ID is the new leader's own."""
        ops: list[dict[str, Any]] = [
            {"request_put": {"key": _b64(k), "value": _b64(v)}} for k, v in puts.items()
        ]
        ops += [{"request_delete_range": {"key": _b64(k)}} for k in deletes]
        result = self._post(
            "/kv/txn",
            {
                "compare": [
                    {
                        "key": _b64(guard_key),
                        "result": "EQUAL",
                        "target": "CREATE",
                        "create_revision": guard_create_revision,
                    },
                    {
                        "key": _b64(guard_key),
                        "result": "EQUAL",
                        "target": "LEASE",
                        "lease": guard_lease,
                    },
                ],
                "success": ops,
                "failure": [],
            },
        )
        return bool(result.get("succeeded"))
