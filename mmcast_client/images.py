"""Turning image inputs into encoded bytes and content hashes, once, and remembering what the server holds.

An input is one of: encoded bytes; a path (read as-is, never re-encoded); a PIL image or a uint8 numpy array
(encoded to PNG once; PIL images are cached by identity while alive, so mutate a copy, not an image already sent);
a `data:` URL; or `"sha256:<hex>"`, the reference an earlier upload returned. The server identifies an image by the
sha256 of its encoded bytes, so the same bytes are uploaded once per client and referenced by hash afterwards.
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import hashlib
import io
import os
import re
import threading
import weakref
from collections.abc import Iterable
from typing import Any

from mmcast_client.errors import InvalidArgument

SHA_PREFIX = "sha256:"
_HEX64 = re.compile(r"[0-9a-f]{64}")


def sha256_hex(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def parse_reference(text: str) -> str | None:
    """The lowercase hex of a `"sha256:<hex>"` reference, None when `text` is not one."""
    if not text.startswith(SHA_PREFIX):
        return None
    digest = text[len(SHA_PREFIX) :].lower()
    if not _HEX64.fullmatch(digest):
        raise InvalidArgument(message=f"image reference {text!r} is not 'sha256:' followed by 64 hex digits")
    return digest


@dataclasses.dataclass(frozen=True)
class ImageRef:
    """One image of a request: its content hash and, when at hand, how to get its bytes."""

    sha256: str  # lowercase hex sha256 of the encoded bytes: the server's name for the image
    data: bytes | None = None  # the encoded bytes, when already in memory
    path: str | None = None  # a file holding them, read only when the bytes are needed


class _LRU(collections.OrderedDict):
    """A dict that keeps its `limit` most recently used keys (a `get` counts as a use)."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def get(self, key, default=None):
        if key not in self:
            return default
        self.move_to_end(key)
        return self[key]

    def put(self, key, value) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.limit:
            self.popitem(last=False)


DEFAULT_MAX_IMAGES = 8192
DEFAULT_RESEND_CACHE_BYTES = 256 << 20


class ImageStore:
    """A client's image bookkeeping; thread-safe, and bounded so a long-running client does not grow.

    - which hashes the server holds (uploaded or found present by this client; forgotten on NOT_FOUND): the
      `max_images` most recently used; an image that fell out is uploaded again on its next use (the server
      answers `already_present` when it still has it);
    - the hash of each file (keyed by path, size and mtime; `max_images` most recent) and of each live PIL image
      (an entry lives as long as the image), so neither is re-read, re-encoded or re-hashed;
    - where to find the bytes behind recent hashes: in memory (`resend_cache_bytes` at most) or in a file (the
      `max_images` most recent paths), so an image the server evicted can be uploaded again even when the caller
      passed only its reference. A reference whose bytes fell out of both is sent as is, and the server's
      NOT_FOUND reaches the caller.
    Each entry costs a few hundred bytes: the default bound keeps the maps under ~10 MB.
    """

    def __init__(self, resend_cache_bytes: int = DEFAULT_RESEND_CACHE_BYTES, max_images: int = DEFAULT_MAX_IMAGES):
        if resend_cache_bytes < 0:
            raise ValueError(f"resend_cache_bytes={resend_cache_bytes} must be >= 0")
        if max_images < 1:
            raise ValueError(f"max_images={max_images} must be >= 1")
        self._lock = threading.Lock()
        self._held: _LRU = _LRU(max_images)  # sha -> None: the server holds it (a set in LRU order)
        self._file_sha: _LRU = _LRU(max_images)  # (realpath, size, mtime_ns) -> sha
        self._pil: dict[int, tuple[weakref.ref, ImageRef]] = {}  # id(image) -> ref; dropped when the image dies
        self._paths: _LRU = _LRU(max_images)  # sha -> a file with those bytes
        self._blobs: collections.OrderedDict[str, bytes] = collections.OrderedDict()  # sha -> bytes, LRU
        self._blob_bytes = 0
        self._blob_limit = resend_cache_bytes
        self.max_images = max_images

    def sizes(self) -> dict[str, int]:
        """Entries per map (for monitoring; each map is bounded as the class docstring says)."""
        with self._lock:
            return {
                "held": len(self._held),
                "file_sha": len(self._file_sha),
                "pil": len(self._pil),
                "paths": len(self._paths),
                "blobs": len(self._blobs),
                "blob_bytes": self._blob_bytes,
            }

    # -- what the server holds -----------------------------------------------------------------------------------
    def is_held(self, sha: str) -> bool:
        with self._lock:
            if sha not in self._held:
                return False
            self._held.move_to_end(sha)
            return True

    def mark_held(self, sha: str) -> None:
        with self._lock:
            self._held.put(sha, None)

    def forget(self, shas: Iterable[str]) -> None:
        with self._lock:
            for sha in shas:
                self._held.pop(sha, None)

    # -- inputs -> references ------------------------------------------------------------------------------------
    def resolve(self, image: Any, where: str) -> ImageRef:
        """The reference for one image input; `where` names it in errors (e.g. "messages[0].content[1]")."""
        if isinstance(image, bytes | bytearray | memoryview):
            data = bytes(image)
            if not data:
                raise InvalidArgument(message=f"{where}: the image is empty (0 bytes)")
            return self._remember(ImageRef(sha256_hex(data), data=data))
        if isinstance(image, str):
            digest = parse_reference(image)
            if digest is not None:
                return ImageRef(digest)
            if image.startswith("data:"):
                return self.resolve(_decode_data_url(image, where), where)
            if image.startswith("file://"):
                return self._resolve_path(image[len("file://") :], where)
            if image.startswith(("http://", "https://")):
                raise InvalidArgument(
                    message=f"{where}: the SDK does not fetch URLs ({image[:60]!r}); pass the bytes or a local path"
                )
            return self._resolve_path(image, where)
        if isinstance(image, os.PathLike):
            return self._resolve_path(os.fspath(image), where)
        if _is_pil_image(image):
            return self._resolve_pil(image)
        if type(image).__module__ == "numpy" and getattr(image, "dtype", None) is not None:
            return self._remember(_png_ref(_array_to_pil(image, where)))
        raise InvalidArgument(
            message=f"{where}: unsupported image of type {type(image).__name__}; pass a path, encoded bytes, "
            "a PIL image, a numpy uint8 array, a data: URL or an uploaded 'sha256:<hex>' reference"
        )

    def load(self, ref: ImageRef) -> bytes | None:
        """The encoded bytes of `ref`, or None when this client has never seen them."""
        if ref.data is not None:
            return ref.data
        path = ref.path
        with self._lock:
            blob = self._blobs.get(ref.sha256)
            if blob is not None:
                self._blobs.move_to_end(ref.sha256)
                return blob
            path = path or self._paths.get(ref.sha256)
        if path is None:
            return None
        with open(path, "rb") as f:
            data = f.read()
        if sha256_hex(data) != ref.sha256:
            return None  # the file changed since; the caller treats the image as unknown
        return data

    # -- internals -----------------------------------------------------------------------------------------------
    def _resolve_path(self, path: str, where: str) -> ImageRef:
        try:
            st = os.stat(path)
        except OSError as e:
            raise InvalidArgument(message=f"{where}: cannot read image file {path!r}: {e.strerror}") from None
        key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
        with self._lock:
            sha = self._file_sha.get(key)
        if sha is not None:
            return ImageRef(sha, path=path)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            raise InvalidArgument(message=f"{where}: cannot read image file {path!r}: {e.strerror}") from None
        if not data:
            raise InvalidArgument(message=f"{where}: image file {path!r} is empty")
        sha = sha256_hex(data)
        with self._lock:
            self._file_sha.put(key, sha)
            self._paths.put(sha, path)
        return ImageRef(sha, data=data, path=path)

    def _resolve_pil(self, image) -> ImageRef:
        key = id(image)
        with self._lock:
            entry = self._pil.get(key)
            if entry is not None and entry[0]() is image:
                return entry[1]
        ref = self._remember(_png_ref(image))

        def _drop(_, key=key, store=weakref.ref(self)):
            s = store()
            if s is not None:
                with s._lock:
                    s._pil.pop(key, None)

        with self._lock:
            self._pil[key] = (weakref.ref(image, _drop), ref)
        return ref

    def _remember(self, ref: ImageRef) -> ImageRef:
        assert ref.data is not None
        with self._lock:
            if ref.sha256 in self._blobs:
                self._blobs.move_to_end(ref.sha256)
                return ref
            if len(ref.data) > self._blob_limit:
                return ref
            self._blobs[ref.sha256] = ref.data
            self._blob_bytes += len(ref.data)
            while self._blob_bytes > self._blob_limit:
                _, old = self._blobs.popitem(last=False)
                self._blob_bytes -= len(old)
        return ref


def _is_pil_image(obj: Any) -> bool:
    if not type(obj).__module__.startswith("PIL."):
        return False
    from PIL import Image

    return isinstance(obj, Image.Image)


def _png_ref(image) -> ImageRef:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    data = buffer.getvalue()
    return ImageRef(sha256_hex(data), data=data)


def _array_to_pil(array, where: str):
    from PIL import Image

    if str(array.dtype) != "uint8" or array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[2] not in (3, 4)):
        raise InvalidArgument(
            message=f"{where}: a numpy image must be uint8 HxW, HxWx3 or HxWx4; got {array.dtype} {array.shape}"
        )
    return Image.fromarray(array)


def _decode_data_url(url: str, where: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise InvalidArgument(message=f"{where}: only base64 data: URLs are supported (data:image/png;base64,...)")
    try:
        return base64.b64decode(payload, validate=True)
    except ValueError:
        raise InvalidArgument(message=f"{where}: the data: URL is not valid base64") from None
