"""OpenAI image URLs to image bytes (scheduler_svc/doors/media_urls.py): data: URLs, http(s) fetches under the SSRF rules,
file:// reads under one directory.

The HTTP(S) servers are real (the standard library's, on 127.0.0.1, in a thread); what is replaced is only the name
lookup, through the loader's ``resolver`` argument, so a test can make ``media.test`` answer with any address.
Every fetch has a short timeout, so a rule that failed open would show up as a hang or a connection error rather
than as the refusal the test expects.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import http.server
import io
import os
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Iterator

import pytest
from PIL import Image

from common.errors import InvalidArgument, ResourceExhausted
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.doors.media_addresses import address_refusal, domain_allowed
from scheduler_svc.doors.media_urls import MediaLoader, MediaPolicy
from scheduler_svc.media_domains import normalize_domain
from tests.support.pki import make_pki

FIELD = "messages[0].content[1].image_url.url"
LOOPBACK = ("127.0.0.0/8",)


def _image(fmt: str) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 6), (200, 30, 90)).save(out, format=fmt)
    return out.getvalue()


PNG, JPEG = _image("PNG"), _image("JPEG")


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def policy(**kw) -> MediaPolicy:
    """A policy from the scheduler's own settings, so the tests go through config validation and from_config."""
    kw.setdefault("media_fetch_timeout_seconds", 2.0)
    return MediaPolicy.from_config(SchedulerConfig(**kw))


def load(loader: MediaLoader, url: str) -> bytes:
    return asyncio.run(loader.load(url, FIELD))


def refused(loader: MediaLoader, url: str, kind: type = InvalidArgument, *needles: str) -> str:
    """Loading ``url`` fails with ``kind``, about FIELD, with each needle in the message; returns the message."""
    with pytest.raises(kind) as info:
        load(loader, url)
    err = info.value
    assert type(err) is kind and err.fields == (FIELD,) and err.retry_after is None, err
    assert err.message.startswith(FIELD), err.message
    for needle in needles:
        assert needle in err.message, (needle, err.message)
    return err.message


def resolver(table: dict[str, list[str]], calls: list[str] | None = None):
    """A name lookup answering from ``table`` (a missing name fails as DNS does)."""

    async def resolve(host: str, port: int) -> list[str]:
        if calls is not None:
            calls.append(host)
        if host not in table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return table[host]

    return resolve


# --- a real HTTP server -------------------------------------------------------------------------------------------
class Server:
    """A ThreadingHTTPServer on 127.0.0.1 with the routes the tests need; records each request's path and headers."""

    def __init__(self, ssl_context: ssl.SSLContext | None = None) -> None:
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.sni: list[str | None] = []
        self.stop = threading.Event()
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                owner.requests.append((self.path, {k.lower(): v for k, v in self.headers.items()}))
                url = urllib.parse.urlsplit(self.path)
                query = dict(urllib.parse.parse_qsl(url.query, keep_blank_values=True))
                route = getattr(owner, "route_" + url.path.strip("/").split("/")[0].replace("-", "_"), None)
                if route is None:
                    self.reply(404, b"no such route")
                else:
                    route(self, url.path, query)

            def reply(
                self, status: int, body: bytes = b"", headers: dict[str, str] | None = None, length: bool = True
            ) -> None:
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                if length:
                    self.send_header("Content-Length", str(len(body)))
                else:
                    self.send_header("Connection", "close")  # the body ends when the connection does
                    self.close_connection = True
                self.end_headers()
                self.wfile.write(body)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.scheme = "http"
        if ssl_context is not None:
            ssl_context.sni_callback = lambda sock, name, ctx: self.sni.append(name)  # type: ignore[assignment]
            self.httpd.socket = ssl_context.wrap_socket(self.httpd.socket, server_side=True)
            self.scheme = "https"
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"{self.scheme}://{host}:{self.port}{path}"

    def close(self) -> None:
        self.stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    # routes: /<name>/... -> route_<name>(handler, path, query)
    def route_img(self, h, path, q) -> None:
        h.reply(200, PNG, {"Content-Type": "image/png"}, length=q.get("length", "1") == "1")

    def route_redirect(self, h, path, q) -> None:
        h.reply(int(q.get("status", "302")), headers={"Location": q["to"]})

    def route_loop(self, h, path, q) -> None:  # /loop/N -> /loop/N+1, relative
        n = int(path.rsplit("/", 1)[1])
        h.reply(302, headers={"Location": f"{n + 1}"})

    def route_big(self, h, path, q) -> None:
        h.reply(200, b"x" * int(q["n"]), length=q.get("length", "1") == "1")

    def route_status(self, h, path, q) -> None:
        h.reply(int(path.rsplit("/", 1)[1]), b"nope")

    def route_empty(self, h, path, q) -> None:
        h.reply(200, b"")

    def route_gzip(self, h, path, q) -> None:
        h.reply(200, b"\x1f\x8b" + b"\0" * 20, {"Content-Encoding": "gzip"})

    def route_slow(self, h, path, q) -> None:  # answers after the client's deadline (or when the test ends)
        self.stop.wait(float(q.get("s", "5")))
        h.reply(200, PNG)

    def route_drip(self, h, path, q) -> None:  # a byte every 50 ms: each read is quick, the whole is not
        h.send_response(200)
        h.send_header("Content-Length", "1000")
        h.end_headers()
        for _ in range(1000):
            if self.stop.wait(0.05):
                return
            h.wfile.write(b"x")
            h.wfile.flush()


@pytest.fixture
def server() -> Iterator[Server]:
    s = Server()
    yield s
    s.close()


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def _tls_server(leaf) -> Server:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(leaf.cert, leaf.key)
    return Server(ctx)


# --- data: URLs ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("data,mime", [(PNG, "image/png"), (JPEG, "image/jpeg"), (JPEG, "IMAGE/JPEG")])
def test_a_data_url_gives_the_image_bytes(data, mime):
    loader = MediaLoader(MediaPolicy())
    assert loader.decode_data_url(data_url(data, mime), FIELD) == data
    assert load(loader, data_url(data, mime)) == data  # load() takes every scheme
    assert Image.open(io.BytesIO(loader.decode_data_url(data_url(data, mime), FIELD))).size == (8, 6)
    # parameters before ;base64 are allowed (RFC 2397)
    with_params = f"data:{mime};name=a.png;charset=binary;base64,{base64.b64encode(data).decode()}"
    assert loader.decode_data_url(with_params, FIELD) == data


def test_a_data_url_above_a_megabyte_is_decoded_in_a_thread_and_still_right():
    data = os.urandom(3 << 20)
    loader = MediaLoader(MediaPolicy(max_bytes=4 << 20))
    assert load(loader, data_url(data)) == data


def _decode_refused(url: str, kind: type = InvalidArgument, *needles: str, max_bytes: int = 1 << 20) -> str:
    with pytest.raises(kind) as info:
        MediaLoader(MediaPolicy(max_bytes=max_bytes)).decode_data_url(url, FIELD)
    err = info.value
    assert type(err) is kind and err.fields == (FIELD,) and err.retry_after is None
    assert err.message.startswith(FIELD)
    for needle in needles:
        assert needle in err.message, (needle, err.message)
    return err.message


def test_a_data_url_that_is_not_base64_is_refused():
    _decode_refused("data:image/png,%89PNG%0D%0A", InvalidArgument, "not base64-encoded", ";base64,")
    _decode_refused("data:image/png;base64;charset=x,AAAA", InvalidArgument, "not base64-encoded")
    _decode_refused("data:image/png;base64", InvalidArgument, "no ','")


@pytest.mark.parametrize("mime", ["text/plain", "application/octet-stream", "", "image/", "imagex/png", "text/html"])
def test_a_data_url_of_another_media_type_is_refused_naming_the_accepted_ones(mime):
    message = _decode_refused(data_url(PNG, mime), InvalidArgument, "is not an image", "accepted: image/*")
    assert repr(mime or "(none)") in message


@pytest.mark.parametrize(
    "payload",
    [
        "iVBORw0K GgoAAAA",  # whitespace
        "iVBORw0KGgoAAAA\n",  # a line break
        "iVBORw0KGgo-_AA=",  # the URL-safe alphabet
        "iVBORw0KGgoAAA",  # missing padding
        "@@@@",
        "iVBORw0KGgoAAAé",  # not ASCII
    ],
)
def test_invalid_base64_is_refused_strictly(payload):
    _decode_refused(f"data:image/png;base64,{payload}", InvalidArgument, "not valid base64", "no whitespace")


def test_an_oversize_data_url_is_refused_from_its_length_before_any_decoding():
    # '!' is not base64: had the loader decoded first, this would be "not valid base64", not the size.
    message = _decode_refused(
        "data:image/png;base64," + "!" * 4000,
        ResourceExhausted,
        "3000 bytes",
        "limit is 2999",
        "--max-upload-bytes",
        max_bytes=2999,
    )
    assert "!!!!!!!!" not in message[150:]  # the URL is quoted cut, never whole
    # exact at the limit: 3000 bytes pass a 3000-byte limit, 3001 do not (padding counted)
    loader = MediaLoader(MediaPolicy(max_bytes=3000))
    assert len(loader.decode_data_url(data_url(b"a" * 3000), FIELD)) == 3000
    _decode_refused(data_url(b"a" * 3001), ResourceExhausted, "3001 bytes", max_bytes=3000)
    # and it costs nothing: 48 MiB of base64 (36 MiB decoded) is refused in far less time than decoding takes
    huge = "data:image/png;base64," + "A" * (48 << 20)
    loader = MediaLoader(MediaPolicy(max_bytes=32 << 20))
    start = time.perf_counter()
    with pytest.raises(ResourceExhausted, match="--max-upload-bytes"):
        loader.decode_data_url(huge, FIELD)
    refused_in = time.perf_counter() - start
    start = time.perf_counter()
    base64.b64decode(huge[22:], validate=True)
    assert refused_in < (time.perf_counter() - start) / 10


def test_an_empty_data_url_is_refused():
    _decode_refused("data:image/png;base64,", InvalidArgument, "empty")


@pytest.mark.parametrize(
    "url", ["ftp://example.com/a.png", "javascript:alert(1)", "gopher://x/", "", "/tmp/a.png", "C:\\images\\a.png"]
)
def test_other_schemes_are_refused_naming_the_accepted_ones(url):
    refused(
        MediaLoader(MediaPolicy()),
        url,
        InvalidArgument,
        "accepted: data:image/",
        "http(s)://",
        "file://",
        "--allowed-media-domains",
        "--allowed-local-media-path",
    )


# --- http(s): off by default, loopback refused, allowed networks --------------------------------------------------
def test_remote_urls_are_off_by_default_and_the_message_names_the_flag(server):
    loader = MediaLoader(MediaPolicy.from_config(SchedulerConfig()))
    refused(loader, server.url("/img/a.png"), InvalidArgument, "remote image URLs are off", "--allowed-media-domains")
    refused(loader, "https://example.com/a.png", InvalidArgument, "--allowed-media-domains")
    assert server.requests == []


def test_a_loopback_server_is_refused_even_when_its_name_is_allowed(server):
    loader = MediaLoader(policy(allowed_media_domains=["127.0.0.1", "localhost"]))
    refused(
        loader, server.url("/img/a.png"), InvalidArgument, "127.0.0.1 is a loopback address", "--allowed-media-networks"
    )
    # localhost through the real system resolver: every answer (127.0.0.1, ::1) is loopback
    refused(loader, server.url("/img/a.png", host="localhost"), InvalidArgument, "localhost resolves to", "loopback")
    assert server.requests == []  # refused before connecting


def test_an_allowed_network_makes_the_loopback_server_reachable(server, monkeypatch):
    # A proxy from the environment would break the fetch: it must not be used (trust_env=False).
    for var in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")
    loader = MediaLoader(policy(allowed_media_domains=["127.0.0.1"], allowed_media_networks=list(LOOPBACK)))
    assert load(loader, server.url("/img/a.png")) == PNG
    assert load(loader, server.url("/img/a.png?length=0")) == PNG  # a body without Content-Length
    path, headers = server.requests[0]
    assert path == "/img/a.png" and headers["host"] == f"127.0.0.1:{server.port}"
    assert not {"authorization", "cookie", "proxy-authorization"} & set(headers)


def test_the_request_goes_to_the_checked_address_with_the_name_as_host(server):
    # media.test exists only in this resolver: the fetch works only if the loader connects to the address it
    # checked (pinned) rather than letting the HTTP client resolve the name again.
    calls: list[str] = []
    loader = MediaLoader(
        policy(allowed_media_domains=["media.test"], allowed_media_networks=list(LOOPBACK)),
        resolver=resolver({"media.test": ["127.0.0.1"]}, calls),
    )
    assert load(loader, server.url("/img/a.png", host="media.test")) == PNG
    assert calls == ["media.test"]  # one lookup, the checked one
    assert server.requests[0][1]["host"] == f"media.test:{server.port}"


def test_dns_rebinding_gets_no_second_lookup(server):
    # A resolver that answers with a public address first and loopback afterwards: the loader checks the first
    # answer and connects to it, so the loopback answer is never asked for (and nothing reaches the server).
    answers = iter([["203.0.113.7"], ["127.0.0.1"]])
    calls: list[str] = []

    async def rebinding(host: str, port: int) -> list[str]:
        calls.append(host)
        return next(answers)

    # 203.0.113.0/24 is documentation space (not global): allow it so the check passes and a connect is tried.
    loader = MediaLoader(
        policy(
            allowed_media_domains=["media.test"],
            allowed_media_networks=["203.0.113.0/24"],
            media_fetch_timeout_seconds=0.5,
        ),
        resolver=rebinding,
    )
    refused(loader, server.url("/img/a.png", host="media.test"), InvalidArgument, "media.test")
    assert calls == ["media.test"] and server.requests == []


def test_a_host_outside_the_allow_list_is_refused_and_wildcards_match_subdomains_only(server):
    table = {h: ["127.0.0.1"] for h in ("img.example.test", "a.b.example.test", "example.test", "evilexample.test")}
    loader = MediaLoader(
        policy(allowed_media_domains=["*.example.test"], allowed_media_networks=list(LOOPBACK)),
        resolver=resolver(table),
    )
    assert load(loader, server.url("/img/a.png", host="img.example.test")) == PNG
    assert load(loader, server.url("/img/a.png", host="A.B.Example.Test.")) == PNG  # case and trailing dot
    for host in ("example.test", "evilexample.test", "127.0.0.1"):
        refused(
            loader,
            server.url("/img/a.png", host=host),
            InvalidArgument,
            f"the host {host} is not in",
            "--allowed-media-domains",
        )
    assert len(server.requests) == 2


def test_a_private_answer_from_the_resolver_is_refused_without_connecting(server):
    table = {
        "private.test": ["10.1.2.3"],
        "mixed.test": ["93.184.216.34", "10.0.0.1"],
        "mapped.test": ["::ffff:169.254.169.254"],
        "nowhere.test": [],
    }
    loader = MediaLoader(policy(allowed_media_domains=list(table) + ["missing.test"]), resolver=resolver(table))
    refused(loader, "http://private.test/a.png", InvalidArgument, "private.test resolves to 10.1.2.3", "private")
    # any one non-public answer refuses the host: the client might connect to that one
    refused(loader, "http://mixed.test/a.png", InvalidArgument, "resolves to 10.0.0.1", "private")
    refused(loader, "http://mapped.test/a.png", InvalidArgument, "link-local")
    refused(loader, "http://nowhere.test/a.png", InvalidArgument, "resolves to no address")
    refused(loader, "http://missing.test/a.png", InvalidArgument, "cannot resolve the host missing.test")


def test_the_metadata_address_is_refused_without_any_connection_attempt():
    async def no_lookup(host: str, port: int) -> list[str]:
        raise AssertionError("an IP literal needs no lookup")

    # 169.254.169.254 must be allowed as a domain to get this far; an allowed network elsewhere changes nothing.
    loader = MediaLoader(
        policy(
            allowed_media_domains=["169.254.169.254", "fd00:ec2::254"],
            allowed_media_networks=["10.0.0.0/8"],
            media_fetch_timeout_seconds=5.0,
        ),
        resolver=no_lookup,
    )
    start = time.perf_counter()
    refused(
        loader,
        "http://169.254.169.254/latest/meta-data/iam/",
        InvalidArgument,
        "169.254.169.254 is a link-local address",
    )
    refused(loader, "http://[fd00:ec2::254]/latest/meta-data/", InvalidArgument, "private")
    # a connection attempt would have taken the 5 s timeout or failed with a connect error instead
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize(
    "address,reason",
    [
        ("127.0.0.1", "loopback"),
        ("::1", "loopback"),
        ("10.0.0.1", "private"),
        ("172.16.5.4", "private"),
        ("192.168.1.1", "private"),
        ("169.254.169.254", "link-local"),
        ("fe80::1", "link-local"),
        ("fe80::1%eth0", "link-local"),
        ("fd00::1", "private"),
        ("0.0.0.0", "unspecified"),
        ("::", "unspecified"),
        ("100.64.0.1", "CGNAT"),
        ("224.0.0.1", "multicast"),
        ("ff02::1", "multicast"),
        ("240.0.0.1", "reserved"),
        ("255.255.255.255", "reserved"),
        ("192.0.2.1", "private"),
        ("fec0::1", "site-local"),
        ("::ffff:127.0.0.1", "loopback (inside the IPv6 address"),
        ("::ffff:10.0.0.1", "private (inside"),
        ("2002:a00:1::1", "private (inside"),
        ("64:ff9b::a9fe:a9fe", "link-local (inside"),
    ],
)
def test_non_public_addresses_are_refused(address, reason):
    from scheduler_svc.doors.media_addresses import parse_address as _address

    got = address_refusal(_address(address))
    assert got is not None and reason in got, (address, got)


def test_public_addresses_pass_and_allowed_networks_open_only_themselves():
    import ipaddress

    from scheduler_svc.doors.media_addresses import parse_address as _address

    for address in ("93.184.216.34", "8.8.8.8", "2606:4700:4700::1111", "::ffff:8.8.8.8", "64:ff9b::808:808"):
        assert address_refusal(_address(address)) is None, address
    nets = (ipaddress.ip_network("10.0.0.0/8"),)
    assert address_refusal(_address("10.9.9.9"), nets) is None
    assert address_refusal(_address("::ffff:10.9.9.9"), nets) is None  # the mapped form of an allowed address
    assert address_refusal(_address("11.0.0.1"), nets) is None  # public anyway
    assert address_refusal(_address("192.168.0.1"), nets) == "private"
    assert address_refusal(_address("169.254.169.254"), nets) == "link-local"


# --- redirects ----------------------------------------------------------------------------------------------------
def _loopback_loader(**kw) -> MediaLoader:
    kw.setdefault("allowed_media_domains", ["127.0.0.1"])
    return MediaLoader(policy(allowed_media_networks=list(LOOPBACK), **kw))


def _redirect(server: Server, to: str, status: int = 302) -> str:
    return server.url("/redirect?" + urllib.parse.urlencode({"to": to, "status": status}))


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_a_redirect_within_the_rules_is_followed(server, status):
    loader = _loopback_loader()
    assert load(loader, _redirect(server, server.url("/img/a.png"), status)) == PNG
    assert load(loader, _redirect(server, "/img/relative.png", status)) == PNG  # relative Location


def test_a_redirect_to_the_metadata_address_is_refused(server):
    metadata = "http://169.254.169.254/latest/meta-data/"
    refused(
        _loopback_loader(),
        _redirect(server, metadata),
        InvalidArgument,
        "redirect 1 to",
        "the host 169.254.169.254 is not in --allowed-media-domains",
    )
    # even with the address allowed as a domain, its address check refuses it
    loader = _loopback_loader(allowed_media_domains=["127.0.0.1", "169.254.169.254"])
    refused(loader, _redirect(server, metadata), InvalidArgument, "169.254.169.254 is a link-local address")


def test_a_redirect_to_a_host_outside_the_allow_list_or_to_another_scheme_is_refused(server):
    loader = _loopback_loader()
    refused(loader, _redirect(server, "http://evil.test/a.png"), InvalidArgument, "the host evil.test is not in")
    refused(loader, _redirect(server, "file:///etc/passwd"), InvalidArgument, "only http and https")
    refused(loader, _redirect(server, "data:image/png;base64,AAAA"), InvalidArgument, "only http and https")
    refused(
        loader, _redirect(server, f"http://user:pw@127.0.0.1:{server.port}/img/a.png"), InvalidArgument, "credentials"
    )


def test_a_redirect_to_a_name_that_resolves_to_a_private_address_is_refused(server):
    loader = MediaLoader(
        policy(allowed_media_domains=["127.0.0.1", "inner.test"], allowed_media_networks=list(LOOPBACK)),
        resolver=resolver({"inner.test": ["192.168.0.10"]}),
    )
    refused(
        loader,
        _redirect(server, "http://inner.test/a.png"),
        InvalidArgument,
        "inner.test resolves to 192.168.0.10",
        "private",
    )


def test_too_many_redirects_are_refused(server):
    start = server.url("/loop/0")
    refused(
        _loopback_loader(media_fetch_max_redirects=3),
        start,
        InvalidArgument,
        "redirects more than 3 times",
        "--media-fetch-max-redirects",
    )
    assert [p for p, _ in server.requests] == ["/loop/0", "/loop/1", "/loop/2", "/loop/3"]
    refused(
        _loopback_loader(media_fetch_max_redirects=0),
        _redirect(server, server.url("/img/a.png")),
        InvalidArgument,
        "more than 0 times",
    )


# --- size, time, status -------------------------------------------------------------------------------------------
def test_an_oversize_body_is_refused_with_and_without_content_length(server):
    loader = _loopback_loader(max_upload_bytes=10_000)
    assert len(load(loader, server.url("/big?n=10000"))) == 10_000
    refused(
        loader,
        server.url("/big?n=10001"),
        ResourceExhausted,
        "announces 10001 bytes",
        "limit is 10000",
        "--max-upload-bytes",
    )
    # without Content-Length the body is streamed and cut past the limit (the server may send far more)
    assert len(load(loader, server.url("/big?n=10000&length=0"))) == 10_000
    refused(
        loader, server.url("/big?n=5000000&length=0"), ResourceExhausted, "exceeds 10000 bytes", "--max-upload-bytes"
    )


def test_a_slow_server_hits_the_timeout(server):
    loader = _loopback_loader(media_fetch_timeout_seconds=0.3)
    start = time.perf_counter()
    refused(loader, server.url("/slow"), InvalidArgument, "took more than 0.3 s", "--media-fetch-timeout-seconds")
    # a body that trickles in: every read is quick, the whole fetch is not
    refused(loader, server.url("/drip"), InvalidArgument, "took more than 0.3 s")
    assert time.perf_counter() - start < 2.0


def test_a_non_2xx_answer_is_refused_naming_the_status(server):
    loader = _loopback_loader()
    refused(loader, server.url("/status/404"), InvalidArgument, "answered HTTP 404 Not Found")
    refused(loader, server.url("/status/500"), InvalidArgument, "HTTP 500")
    refused(loader, server.url("/status/204"), InvalidArgument, "empty body")  # 2xx, but no image
    refused(loader, server.url("/empty"), InvalidArgument, "empty body")
    refused(loader, server.url("/gzip"), InvalidArgument, "Content-Encoding 'gzip'")
    refused(loader, server.url("/redirect?to="), InvalidArgument, "without a Location")


def test_a_refused_connection_is_an_invalid_argument_naming_the_host():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    refused(_loopback_loader(), f"http://127.0.0.1:{port}/a.png", InvalidArgument, "cannot connect to 127.0.0.1")


# --- https: the name is verified although the address is pinned ---------------------------------------------------
def test_https_verifies_the_certificate_for_the_url_name_at_the_pinned_address(pki):
    trust = ssl.create_default_context(cafile=str(pki.ca))
    name = "not-this-host.example"  # the name pki.wrong_name's certificate is for
    srv = _tls_server(pki.wrong_name)
    try:
        loader = MediaLoader(
            policy(allowed_media_domains=[name, "media.test"], allowed_media_networks=list(LOOPBACK)),
            resolver=resolver({name: ["127.0.0.1"], "media.test": ["127.0.0.1"]}),
            ssl_context=trust,
        )
        assert load(loader, srv.url("/img/a.png", host=name)) == PNG
        assert srv.sni == [name] and srv.requests[0][1]["host"] == f"{name}:{srv.port}"
        # the same server under another name: the certificate does not match, so nothing is fetched
        refused(
            loader,
            srv.url("/img/a.png", host="media.test"),
            InvalidArgument,
            "cannot connect to media.test",
            "certificate",
        )
        assert len(srv.requests) == 1
    finally:
        srv.close()
    rogue = _tls_server(pki.rogue_server)  # a CA nobody trusts
    try:
        loader = MediaLoader(
            policy(allowed_media_domains=["127.0.0.1"], allowed_media_networks=list(LOOPBACK)), ssl_context=trust
        )
        refused(loader, rogue.url("/img/a.png"), InvalidArgument, "certificate")
        assert rogue.requests == []
    finally:
        rogue.close()


# --- file:// ------------------------------------------------------------------------------------------------------
@pytest.fixture
def media_dir(tmp_path):
    root = tmp_path / "media"
    (root / "sub").mkdir(parents=True)
    (root / "a.png").write_bytes(PNG)
    (root / "sub" / "my image.jpg").write_bytes(JPEG)
    (tmp_path / "secret.png").write_bytes(b"outside")
    return root


def _file_loader(root, **kw) -> MediaLoader:
    return MediaLoader(policy(allowed_local_media_path=str(root), **kw))


def test_file_urls_are_off_by_default(media_dir):
    refused(
        MediaLoader(MediaPolicy()),
        f"file://{media_dir}/a.png",
        InvalidArgument,
        "file URLs are off",
        "--allowed-local-media-path",
    )


def test_a_file_inside_the_directory_is_read(media_dir):
    loader = _file_loader(media_dir)
    assert load(loader, f"file://{media_dir}/a.png") == PNG
    assert load(loader, f"file://localhost{media_dir}/a.png") == PNG
    assert load(loader, f"file://{media_dir}/sub/my%20image.jpg") == JPEG
    assert load(loader, f"file://{media_dir}/sub/../a.png") == PNG  # '..' that stays inside
    os.symlink(media_dir / "a.png", media_dir / "inner-link.png")
    assert load(loader, f"file://{media_dir}/inner-link.png") == PNG


def test_a_file_outside_the_directory_is_refused_however_it_is_reached(media_dir):
    loader = _file_loader(media_dir)
    outside = media_dir.parent / "secret.png"
    refused(loader, f"file://{outside}", InvalidArgument, "outside the directory", "--allowed-local-media-path")
    refused(loader, f"file://{media_dir}/../secret.png", InvalidArgument, "outside the directory")
    refused(loader, f"file://{media_dir}/sub/%2e%2e/%2e%2e/secret.png", InvalidArgument, "outside the directory")
    refused(loader, "file:///etc/passwd", InvalidArgument, "outside the directory")
    os.symlink(outside, media_dir / "escape.png")
    refused(loader, f"file://{media_dir}/escape.png", InvalidArgument, "outside the directory")
    os.symlink(media_dir.parent, media_dir / "up")
    refused(loader, f"file://{media_dir}/up/secret.png", InvalidArgument, "outside the directory")
    # a sibling whose name starts with the directory's is outside too
    (media_dir.parent / "media-other").mkdir()
    (media_dir.parent / "media-other" / "x.png").write_bytes(PNG)
    refused(loader, f"file://{media_dir}-other/x.png", InvalidArgument, "outside the directory")


def test_only_regular_files_of_bounded_size_are_read(media_dir):
    loader = _file_loader(media_dir, max_upload_bytes=1000)
    refused(loader, f"file://{media_dir}/sub", InvalidArgument, "not a regular file")
    os.mkfifo(media_dir / "pipe.png")  # opening it must not block
    refused(loader, f"file://{media_dir}/pipe.png", InvalidArgument, "not a regular file")
    with open(media_dir / "huge.png", "wb") as fh:
        fh.truncate(10 << 30)  # sparse: its size is refused from the metadata, nothing is read
    refused(
        loader,
        f"file://{media_dir}/huge.png",
        ResourceExhausted,
        f"has {10 << 30} bytes",
        "limit is 1000",
        "--max-upload-bytes",
    )
    (media_dir / "empty.png").write_bytes(b"")
    refused(loader, f"file://{media_dir}/empty.png", InvalidArgument, "empty")
    refused(loader, f"file://{media_dir}/missing.png", InvalidArgument, "cannot read")
    refused(loader, f"file://otherhost{media_dir}/a.png", InvalidArgument, "not a local absolute file URL")


# --- settings -----------------------------------------------------------------------------------------------------
def test_settings_are_checked_when_the_scheduler_starts(tmp_path):
    cases: list[tuple[dict, str]] = [
        ({"allowed_media_networks": ["10.0.0.0/33"]}, "--allowed-media-networks"),
        ({"allowed_media_networks": ["localhost"]}, "not a CIDR"),
        ({"allowed_local_media_path": str(tmp_path / "nope")}, "--allowed-local-media-path"),
        ({"allowed_media_domains": ["a..b"]}, "--allowed-media-domains"),
        ({"allowed_media_domains": ["*"]}, "--allowed-media-domains"),
        ({"allowed_media_domains": ["*.com"]}, "two labels"),
        ({"allowed_media_domains": ["bücher.example"]}, "xn--"),
        ({"media_fetch_max_redirects": -1}, "--media-fetch-max-redirects"),
        ({"media_fetch_timeout_seconds": 0}, "--media-fetch-timeout-seconds"),
    ]
    for kw, needle in cases:
        with pytest.raises(ValueError) as info:
            SchedulerConfig(**kw)
        assert needle in str(info.value), (kw, str(info.value))
    config = SchedulerConfig(
        allowed_media_domains="Media.Example.COM., *.cdn.test,[::1]",
        allowed_media_networks="10.0.0.0/8, fd00::/8",
        allowed_local_media_path=str(tmp_path),
    )
    p = MediaPolicy.from_config(config)
    assert p.allowed_domains == ("media.example.com", "*.cdn.test", "::1")
    assert [str(n) for n in p.allowed_networks] == ["10.0.0.0/8", "fd00::/8"]
    assert p.local_root == os.path.realpath(tmp_path) and p.max_bytes == config.max_upload_bytes
    assert domain_allowed("x.cdn.test", p.allowed_domains) and not domain_allowed("cdn.test", p.allowed_domains)
    assert normalize_domain("[::1]") == "::1"


def test_a_data_url_sent_again_is_not_decoded_while_the_upload_store_holds_its_bytes():
    """The OpenAI door remembers an admitted data: URL's text (its sha256) per tenant: sent again, its bytes come
    from the upload store, neither decoded nor hashed; another tenant, another kind of media, a refused request's
    URL and bytes evicted from the store are decoded as before."""
    from scheduler_svc.doors import media_aliases, openai_schema
    from scheduler_svc.doors.openai_bodies import Call
    from scheduler_svc.doors.openai_media import MediaParts
    from scheduler_svc.engine.upload_store import UploadStore

    class Door(MediaParts):
        def __init__(self) -> None:
            self.media = MediaLoader(policy())
            self.uploads = UploadStore(1 << 20)
            self.aliases = media_aliases.MediaAliases()
            self.data_urls = media_aliases.MediaAliases()

    door = Door()
    decoded: list[str] = []
    real = door.media.load

    async def counted(url, field, kind="image"):
        decoded.append(url)
        return await real(url, field, kind)

    door.media.load = counted
    part = openai_schema.ImageContentPart(type="image_url", image_url=openai_schema.ImageURL(url=data_url(PNG)))

    def send(tenant="", admit=True, where="messages[0].content[0]"):
        call = Call("r", tenant, "m", "chat", {})
        out = asyncio.run(door._media(call, part, where, "image"))
        if admit:
            door._keep_inline(call)
        return out

    sha = hashlib.sha256(PNG).hexdigest()
    assert send(admit=False) == (PNG, None, "messages[0].content[0].image_url", sha) and len(decoded) == 1
    send()  # refused before: decoded again, then admitted
    assert len(decoded) == 2
    data, digest, field, got = send(where="messages[2].content[1]")
    assert (data, digest, got) == (PNG, None, sha) and field == "messages[2].content[1].image_url"
    assert len(decoded) == 2  # from the store
    send(tenant="other")
    assert len(decoded) == 3  # per tenant
    as_video = openai_schema.VideoContentPart(type="video_url", video_url=openai_schema.VideoURL(url=data_url(PNG)))
    with pytest.raises(InvalidArgument, match="is not a video"):  # the same text as a video: checked, refused
        asyncio.run(door._media(Call("r", "", "m", "chat", {}), as_video, "messages[0].content[0]", "video"))
    assert len(decoded) == 4
    door.uploads = UploadStore(1 << 20)  # the bytes gone from the store (evicted): decoded again
    send()
    assert len(decoded) == 5
