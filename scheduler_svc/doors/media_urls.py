"""The encoded bytes of an OpenAI ``image_url.url``: a ``data:`` URL, an http(s) URL or a ``file://`` URL.

Only ``data:image/...;base64`` URLs work out of the box. The others reach beyond the request, so each is off until
an operator turns it on (docs/SECURITY.md, "Image URLs"):

- ``http(s)://`` needs the host in ``--allowed-media-domains``. The loader resolves the host itself and refuses the
  fetch when *any* address is not public (loopback, private, link-local with the cloud metadata address, CGNAT,
  multicast, reserved, unspecified, and those same ranges inside IPv4-mapped, 6to4 and NAT64 addresses) unless it
  lies in ``--allowed-media-networks``. It then connects to the address it checked — the URL it sends has the IP
  in place of the name, with the name in the Host header and as the TLS server name, so the certificate is still
  verified for the name and a DNS answer that changes between check and connect (rebinding) is never used.
  Redirects are followed by hand, up to ``--media-fetch-max-redirects``, each hop checked as the first (scheme,
  allow-list, addresses). The whole fetch has ``--media-fetch-timeout-seconds``; the body is streamed and cut at
  ``--max-upload-bytes``; no proxy, credential, cookie or netrc comes from the environment.
- ``file://`` needs ``--allowed-local-media-path``: the path, with every symlink and ``..`` resolved, must stay
  inside that directory and name a regular file no larger than ``--max-upload-bytes``.

Every refusal is an ``InvalidArgument`` (or ``ResourceExhausted`` for a size) that names the request field, so a
URL the server cannot load is the client's error, never an unhandled exception. What the bytes are (format, pixels)
is the frontend's check, as for any inline image.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import ipaddress
import os
import re
import ssl
import stat
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlsplit

import httpx

from common.errors import InvalidArgument, ResourceExhausted
from scheduler_svc.doors.media_addresses import (
    IPNetwork,
    address_refusal,
    domain_allowed,
    host_of,
    is_ip_literal,
    parse_address,
    resolve_host,
)
from scheduler_svc.media_domains import normalize_domain

if TYPE_CHECKING:
    from scheduler_svc.config import SchedulerConfig

# (host, port) -> the addresses it resolves to. The loader's only name lookup; tests give their own.
Resolver = Callable[[str, int], Awaitable[Sequence[str]]]

# Named in the refusal of any other scheme, with the flag that turns each remote kind on.
ACCEPTED_SCHEMES = (
    "data:image/<type>;base64,... , http(s):// (--allowed-media-domains), file:// (--allowed-local-media-path)"
)
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
# Above this many characters load() decodes a data: URL in a thread: b64decode runs at about 1 GB/s, so a URL up
# to 1 MiB holds the event loop for about a millisecond and a 32 MiB one would hold it for tens.
THREAD_DECODE_CHARS = 1 << 20
_SHOWN_CHARS = 100  # characters of a URL quoted in an error: enough to recognise it, never a whole data: URL
_READ_CHUNK = 1 << 16  # bytes read from a local file at a time
_MAX_DATA_HEADER = 1024  # characters of a data: URL's media type and parameters, where its ',' is looked for


def _shown(url: str) -> str:
    """``url`` quoted for an error, cut when long (a data: URL may be megabytes)."""
    if len(url) <= _SHOWN_CHARS:
        return repr(url)
    return f"{url[:_SHOWN_CHARS]!r}... ({len(url)} characters)"


# --- policy ---------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class MediaPolicy:
    """What image URLs may reach, from the scheduler's settings. The defaults allow data: URLs only."""

    allowed_domains: tuple[
        str, ...
    ] = ()  # normalized hosts / IP literals / "*.suffix" whose http(s) URLs may be fetched; () = none
    local_root: str = ""  # realpath of the directory file:// URLs may read; "" = file URLs refused
    allowed_networks: tuple[IPNetwork, ...] = ()  # non-public networks fetches may still connect to
    max_bytes: int = 32 << 20  # bytes of one image, decoded or fetched or read (--max-upload-bytes)
    timeout_seconds: float = 10.0  # seconds one fetch may take in all: resolving, every hop, the body
    max_redirects: int = 3  # redirects one fetch follows before it is refused

    @classmethod
    def from_config(cls, config: SchedulerConfig) -> MediaPolicy:
        return cls(
            allowed_domains=tuple(normalize_domain(d) for d in config.allowed_media_domains),
            local_root=os.path.realpath(config.allowed_local_media_path) if config.allowed_local_media_path else "",
            allowed_networks=tuple(ipaddress.ip_network(c, strict=False) for c in config.allowed_media_networks),
            max_bytes=config.max_upload_bytes,
            timeout_seconds=config.media_fetch_timeout_seconds,
            max_redirects=config.media_fetch_max_redirects,
        )


@dataclasses.dataclass(frozen=True)
class _Redirect:
    location: str  # absolute URL of the next hop


class MediaLoader:
    """Turns image URLs into encoded image bytes under a ``MediaPolicy``. One per server; safe to share between
    concurrent requests (each fetch has its own connections)."""

    def __init__(
        self, policy: MediaPolicy, *, resolver: Resolver = resolve_host, ssl_context: ssl.SSLContext | None = None
    ) -> None:
        self.policy = policy
        self._resolve = resolver  # the one name lookup of a fetch; its answer is checked, then connected to
        # Built on the first https fetch and kept (loading the CA bundle takes ~20 ms); tests pass their own CA's.
        self._ssl = ssl_context

    # --- data: ------------------------------------------------------------------------------------------------------
    def decode_data_url(self, url: str, field: str, kind: str = "image") -> bytes:
        """The bytes of ``data:image/<type>[;params];base64,<data>`` (RFC 2397; ``kind`` "video": ``data:video/``).
        Pure, no I/O.

        The size is checked from the base64 length before anything is decoded, so an oversize URL costs nothing.
        Base64 is the standard alphabet, padded, with no whitespace or line breaks (strict decoding)."""
        if url[:5].lower() != "data:":
            raise InvalidArgument(f"{field}: {_shown(url)} is not a data: URL", field=field)
        # Nothing of the data is copied before its size is checked: a refused URL costs a scan of its header only.
        comma = url.find(",", 5, 5 + _MAX_DATA_HEADER)
        if comma < 0:
            raise InvalidArgument(
                f"{field}: {_shown(url)} has no ',' before its data (data:image/png;base64,...)", field=field
            )
        params = [p.strip().lower() for p in url[5:comma].split(";")]
        mime = params[0]
        if len(params) < 2 or params[-1] != "base64":
            raise InvalidArgument(
                f"{field}: {_shown(url)} is not base64-encoded: an image data: URL is data:image/<type>;base64,<data>",
                field=field,
            )
        subtype = mime[len(kind) + 1 :] if mime.startswith(f"{kind}/") else ""
        if not subtype or not re.fullmatch(r"[a-z0-9][a-z0-9!#$&^_.+-]*", subtype):
            accepted = (
                "image/* (image/png, image/jpeg, image/webp, ...; the format itself is checked against --image-formats)"
                if kind == "image"
                else "video/* (video/mp4, video/webm, ...; the container and codec themselves are checked)"
            )
            raise InvalidArgument(
                f"{field}: media type {mime or '(none)'!r} is not {'an image' if kind == 'image' else 'a video'}; "
                f"accepted: {accepted}",
                field=field,
            )
        chars = len(url) - comma - 1
        padding = min(chars, 2 if url.endswith("==") else 1 if url.endswith("=") else 0)
        size = chars * 3 // 4 - padding  # exact for valid base64, which is a multiple of 4 characters
        if size > self.policy.max_bytes:
            raise ResourceExhausted(
                f"{field}: the data: URL decodes to {size} bytes; the limit is "
                f"{self.policy.max_bytes} (--max-upload-bytes)",
                field=field,
            )
        if not chars:
            raise InvalidArgument(f"{field}: the data: URL is empty (no bytes after the ',')", field=field)
        try:
            data = base64.b64decode(url[comma + 1 :], validate=True)
        except ValueError:  # binascii.Error, and non-ASCII text
            raise InvalidArgument(
                f"{field}: the data: URL's data is not valid base64 (standard alphabet A-Z a-z "
                "0-9 + /, '=' padding to a multiple of 4 characters, no whitespace or line "
                "breaks)",
                field=field,
            ) from None
        if not data:
            raise InvalidArgument(f"{field}: the data: URL is empty", field=field)
        return data

    # --- every scheme ---------------------------------------------------------------------------------------------
    async def load(self, url: str, field: str, kind: str = "image") -> bytes:
        """The encoded image (``kind`` "video": the video file) ``url`` stands for; ``field`` is its request path
        (``messages[0].content[1].image_url.url``) and is named in every refusal. A large data: URL is decoded in a
        thread, off the event loop."""
        scheme = url.split(":", 1)[0].strip().lower() if ":" in url else ""
        if scheme == "data":
            if len(url) > THREAD_DECODE_CHARS:
                return await asyncio.to_thread(self.decode_data_url, url, field, kind)
            return self.decode_data_url(url, field, kind)
        if scheme in ("http", "https"):
            return await self._fetch(url, field, kind)
        if scheme == "file":
            return await asyncio.to_thread(self._read_file, url, field)
        raise InvalidArgument(
            f"{field}: {_shown(url)} is not a URL of an accepted scheme; accepted: {ACCEPTED_SCHEMES}", field=field
        )

    # --- file:// --------------------------------------------------------------------------------------------------
    def _read_file(self, url: str, field: str) -> bytes:
        root = self.policy.local_root
        if not root:
            raise InvalidArgument(
                f"{field}: file URLs are off on this server ({_shown(url)}); the operator turns "
                "them on for one directory with --allowed-local-media-path",
                field=field,
            )
        parts = urlsplit(url)
        path = unquote(parts.path)
        if parts.netloc not in ("", "localhost") or not path.startswith("/") or "\0" in path:
            raise InvalidArgument(
                f"{field}: {_shown(url)} is not a local absolute file URL (file:///dir/name.png)", field=field
            )
        # Symlinks and '..' are resolved first, so only where the path really leads counts.
        real = os.path.realpath(path)
        if os.path.commonpath([real, root]) != root:
            raise InvalidArgument(
                f"{field}: {_shown(url)} is outside the directory file URLs may read (--allowed-local-media-path)",
                field=field,
            )
        try:
            # O_NOFOLLOW: the resolved path swapped for a symlink since is refused; O_NONBLOCK: a FIFO does not
            # block the open (it is then refused as not a regular file).
            fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise InvalidArgument(f"{field}: cannot read {_shown(url)}: {exc.strerror or exc}", field=field) from None
        limit = self.policy.max_bytes
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise InvalidArgument(f"{field}: {_shown(url)} is not a regular file", field=field)
            if info.st_size > limit:
                raise ResourceExhausted(
                    f"{field}: {_shown(url)} has {info.st_size} bytes; the limit is {limit} (--max-upload-bytes)",
                    field=field,
                )
            chunks, size = [], 0
            while size <= limit:  # bounded even if the file grew since the fstat
                chunk = os.read(fd, min(_READ_CHUNK, limit + 1 - size))
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
        finally:
            os.close(fd)
        data = b"".join(chunks)
        if len(data) > limit:
            raise ResourceExhausted(
                f"{field}: {_shown(url)} has more than {limit} bytes (--max-upload-bytes)", field=field
            )
        if not data:
            raise InvalidArgument(f"{field}: {_shown(url)} is empty", field=field)
        return data

    # --- http(s):// -----------------------------------------------------------------------------------------------
    async def _fetch(self, url: str, field: str, kind: str = "image") -> bytes:
        policy = self.policy
        if not policy.allowed_domains:
            raise InvalidArgument(
                f"{field}: remote image URLs are off on this server ({_shown(url)}); send the image "
                "as a data: URL, or the operator allows hosts with --allowed-media-domains",
                field=field,
            )
        hops = [url]  # the URL of each hop, the last one being fetched
        try:
            async with asyncio.timeout(policy.timeout_seconds):
                return await self._follow(hops, field, kind)
        except (TimeoutError, httpx.TimeoutException):
            raise InvalidArgument(
                f"{field}: fetching {_shown(hops[-1])} took more than {policy.timeout_seconds} s "
                "(--media-fetch-timeout-seconds)",
                field=field,
            ) from None

    def _checked_url(self, url: str, field: str, hop: int) -> httpx.URL:
        """The hop's URL, parsed, when its scheme and host may be fetched."""
        where = f"{field}: {_shown(url)}" if hop == 0 else f"{field}: redirect {hop} to {_shown(url)}"
        try:
            target = httpx.URL(url)
            host = host_of(target)
        except (httpx.InvalidURL, ValueError, UnicodeError):
            raise InvalidArgument(f"{where} is not a valid URL", field=field) from None
        if target.scheme not in ("http", "https"):
            raise InvalidArgument(f"{where}: only http and https are fetched", field=field)
        if target.userinfo:  # would become an Authorization header; credentials have no place in an image URL
            raise InvalidArgument(f"{where} carries credentials (user:password@); they are not sent", field=field)
        if not host:
            raise InvalidArgument(f"{where} has no host", field=field)
        if not domain_allowed(host, self.policy.allowed_domains):
            raise InvalidArgument(f"{where}: the host {host} is not in --allowed-media-domains", field=field)
        return target

    async def _checked_addresses(self, host: str, port: int, field: str) -> list[str]:
        """The addresses to connect to for ``host``: all of them public (or in an allowed network), else refused."""
        if is_ip_literal(host):
            addresses = [host]  # checked like a resolved name; host_of gave it in canonical form
        else:
            try:
                addresses = list(await self._resolve(host, port))
            except (OSError, UnicodeError) as exc:  # socket.gaierror is an OSError
                raise InvalidArgument(f"{field}: cannot resolve the host {host}: {exc}", field=field) from None
            if not addresses:
                raise InvalidArgument(f"{field}: the host {host} resolves to no address", field=field)
        for text in addresses:
            reason = address_refusal(parse_address(text), self.policy.allowed_networks)
            if reason is not None:
                shown = host if text == host else f"{host} resolves to {text}, which"
                raise InvalidArgument(
                    f"{field}: {shown} is a {reason} address; image URLs are fetched from public addresses only "
                    "(--allowed-media-networks names networks allowed besides)",
                    field=field,
                )
        return addresses

    async def _follow(self, hops: list[str], field: str, kind: str = "image") -> bytes:
        for hop in range(self.policy.max_redirects + 1):
            target = self._checked_url(hops[-1], field, hop)
            host = host_of(target)
            port = target.port or (443 if target.scheme == "https" else 80)
            addresses = await self._checked_addresses(host, port, field)
            answer = await self._get(target, host, addresses, field, kind)
            if isinstance(answer, bytes):
                return answer
            hops.append(answer.location)
        raise InvalidArgument(
            f"{field}: {_shown(hops[0])} redirects more than {self.policy.max_redirects} times "
            "(--media-fetch-max-redirects)",
            field=field,
        )

    async def _get(
        self, target: httpx.URL, host: str, addresses: list[str], field: str, kind: str = "image"
    ) -> bytes | _Redirect:
        """One GET of ``target`` at the first of ``addresses`` that accepts a connection."""
        # A transport (connection pool) per hop: a connection verified for one name never carries a request for
        # another. The transport, unlike httpx's client, adds nothing of its own: no redirect handling, cookies,
        # authentication or proxy from the environment.
        timeout = httpx.Timeout(self.policy.timeout_seconds).as_dict()
        if self._ssl is None:
            self._ssl = httpx.create_ssl_context()
        async with httpx.AsyncHTTPTransport(verify=self._ssl) as transport:
            error: Exception | None = None
            for address in addresses:
                # Pinned: the request goes to the checked address; the name travels as Host and TLS server name.
                extensions: dict[str, object] = {"timeout": timeout}
                if target.scheme == "https":
                    extensions["sni_hostname"] = host
                request = httpx.Request(
                    "GET",
                    target.copy_with(host=str(parse_address(address)), fragment=None),
                    headers={
                        "Host": target.netloc.decode("ascii"),
                        "Accept": f"{kind}/*",
                        "Accept-Encoding": "identity",
                        "User-Agent": "mmcast-media-fetch",
                    },
                    extensions=extensions,
                )
                try:
                    response = await transport.handle_async_request(request)
                except httpx.TimeoutException:
                    raise
                except httpx.ConnectError as exc:  # refused, unreachable, TLS handshake or certificate: next address
                    error = exc
                    continue
                except httpx.HTTPError as exc:
                    raise InvalidArgument(
                        f"{field}: fetching from {host} failed: {type(exc).__name__}: {exc}", field=field
                    ) from None
                try:
                    return await self._answer(response, target, host, field)
                except httpx.TimeoutException:
                    raise
                except httpx.HTTPError as exc:
                    raise InvalidArgument(
                        f"{field}: reading from {host} failed: {type(exc).__name__}: {exc}", field=field
                    ) from None
                finally:
                    await response.aclose()
            raise InvalidArgument(f"{field}: cannot connect to {host} ({', '.join(addresses)}): {error}", field=field)

    async def _answer(self, response: httpx.Response, target: httpx.URL, host: str, field: str) -> bytes | _Redirect:
        """The body of a 2xx answer, or where a redirect points; anything else refused."""
        status, limit = response.status_code, self.policy.max_bytes
        if status in REDIRECT_STATUSES:
            location = response.headers.get("location")
            if not location:
                raise InvalidArgument(f"{field}: {host} answered HTTP {status} without a Location", field=field)
            try:
                return _Redirect(str(target.join(location)))  # relative to the name, not to the pinned address
            except (httpx.InvalidURL, ValueError):
                raise InvalidArgument(
                    f"{field}: {host} redirects to {_shown(location)}, not a valid URL", field=field
                ) from None
        if not 200 <= status < 300:
            raise InvalidArgument(
                f"{field}: {host} answered HTTP {status} {response.reason_phrase} for {_shown(str(target))}",
                field=field,
            )
        encoding = response.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):  # a compressed body could expand past any chunk bound when decoded
            raise InvalidArgument(
                f"{field}: {host} sent the image with Content-Encoding {encoding!r}; only identity is accepted",
                field=field,
            )
        declared = response.headers.get("content-length", "")
        if declared.strip().isdigit() and int(declared) > limit:
            raise ResourceExhausted(
                f"{field}: {host} announces {int(declared)} bytes (Content-Length); the limit is "
                f"{limit} (--max-upload-bytes)",
                field=field,
            )
        body = bytearray()
        async for chunk in response.aiter_raw():
            body += chunk
            if len(body) > limit:
                raise ResourceExhausted(
                    f"{field}: the image from {host} exceeds {limit} bytes (--max-upload-bytes)", field=field
                )
        if not body:
            raise InvalidArgument(f"{field}: {host} answered HTTP {status} with an empty body", field=field)
        return bytes(body)
