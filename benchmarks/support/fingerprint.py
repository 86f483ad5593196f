"""Cost of the model fingerprint (common/hashing.py) on a folder of large weight files.

    python -m benchmarks.support.fingerprint --gib 4 --files 4 [--dir /tmp/fp-bench]

Writes ``--files`` random files totalling ``--gib`` GiB (kept for reuse when ``--dir`` is given), then times one
fingerprint without any digest cache (every byte hashed, files in parallel), one with the sidecar cache only (a
new process's restart) and one with the in-process cache. The files are in the page cache after writing, so the
first figure is the hashing cost, not the disk's.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import tempfile
import time

import common.hashing as hashing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=4.0)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--dir", default="")
    args = parser.parse_args()
    folder = pathlib.Path(args.dir or tempfile.mkdtemp(prefix="mmcast-fp-"))
    folder.mkdir(parents=True, exist_ok=True)
    size = int(args.gib * (1 << 30)) // args.files
    for i in range(args.files):
        path = folder / f"model-{i:05d}.safetensors"
        if not path.is_file() or path.stat().st_size != size:
            with path.open("wb") as f:
                for _ in range(size // (64 << 20)):
                    f.write(os.urandom(64 << 20))
                f.write(os.urandom(size % (64 << 20)))
    with tempfile.TemporaryDirectory() as cache:
        os.environ["MMCAST_CACHE_DIR"] = cache
        hashing._digests.clear()
        t = time.perf_counter()
        cold = hashing.model_fingerprint(folder)
        cold_s = time.perf_counter() - t
        hashing._digests.clear()  # as a restarted process: only the sidecar file is left
        t = time.perf_counter()
        sidecar = hashing.model_fingerprint(folder)
        sidecar_s = time.perf_counter() - t
        t = time.perf_counter()
        inproc = hashing.model_fingerprint(folder)
        inproc_s = time.perf_counter() - t
    assert cold == sidecar == inproc
    total = size * args.files / (1 << 30)
    print(
        f"{total:.1f} GiB in {args.files} files: no cache {cold_s:.2f} s ({total / cold_s:.2f} GiB/s), "
        f"sidecar cache {sidecar_s * 1e3:.1f} ms, in-process cache {inproc_s * 1e3:.2f} ms"
    )


if __name__ == "__main__":
    main()
