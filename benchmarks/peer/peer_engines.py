"""The two engines of ``benchmarks/peer/compare.py``, each started alone on the machine and stopped before the next one.

- vLLM: its CPU build from ``.venv-peer`` (``scripts/install-vllm-peer.sh``), ``vllm serve`` in a process group of
  its own (the API server spawns an engine-core process; the group is what is stopped), float32, eager (no
  compilation: mmcast compiles nothing either), prefix caching on (vLLM's default), ``cached_tokens`` reported.
  Video (``VLLM_VIDEO_ARGS``): vLLM 0.32 refuses a request's ``mm_processor_kwargs`` unless started with
  ``--trust-request-mm-kwargs``; and its Qwen2-VL path samples a video's frames in its own loader (the ``qwen2_vl``
  loader, transformers' fps rule, OpenCV decoding) and hands the processor the sampled frames without their
  metadata, so a model folder whose ``video_preprocessor_config.json`` says ``do_sample_frames: true`` (the
  checkpoints', and the tiny model's) fails in the processor ("sampling with fps needs video metadata") unless the
  server turns that second sampling off (``--mm-processor-kwargs {"do_sample_frames": false}``). Neither flag
  touches images.
- mmcast: a ``LocalGroup`` (scheduler + TP ranks, the lazy transfer mode, float32 default) with its HTTP API.

Both expose ``base_url`` (".../v1"), ``pids`` (name -> pid, for CPU clocks and the profiler), ``startup_s`` and
``metrics_url``: mmcast's scheduler /metrics (its request-stage histogram); None for vLLM, which has no such
breakdown.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PEER_VENV = os.path.join(ROOT, ".venv-peer")
MAX_MODEL_LEN = 8192  # 26 cached 448x448 images (256 tokens each) and four 1280x720 ones (1,196 each) fit
# vLLM's CPU KV cache in GiB: far above what the workloads hold (head64: 2 kB per token), far below the 24 GiB.
KV_CACHE_GIB = 4
# mmcast's KV pool in 16-token blocks (128k tokens): like vLLM's, large enough that nothing the workloads reuse is
# evicted.
MMCAST_KV_BLOCKS = 8192
# vLLM's flags for the video workload (see the module docstring); the frames it samples are transformers' choice,
# which is mmcast's too: prompt token counts must then agree (peer_analysis.video_prompt_tokens checks).
VLLM_VIDEO_ARGS = ("--trust-request-mm-kwargs", "--mm-processor-kwargs", '{"do_sample_frames": false}')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


class Vllm:
    name = "vllm"

    def __init__(self, model_dir: str, log_path: str, ready_timeout: float = 300.0) -> None:
        self.model_dir = model_dir
        self.log_path = log_path
        self.ready_timeout = ready_timeout
        self.port = _free_port()
        self.proc: subprocess.Popen | None = None
        self.startup_s = 0.0

    metrics_url = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def pids(self) -> dict[str, int]:
        if self.proc is None:
            return {}
        out = {"api_server": self.proc.pid}
        for i, child in enumerate(_children(self.proc.pid)):
            out[f"child{i}"] = child
        return out

    def __enter__(self) -> Vllm:
        exe = os.path.join(PEER_VENV, "bin", "vllm")
        if not os.path.exists(exe):
            raise FileNotFoundError(f"{exe} is missing: run `bash scripts/install-vllm-peer.sh` (make bench-peer does)")
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB),
            "VLLM_HOST_IP": "127.0.0.1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
        }
        # the project's allocator settings (common/process.py) are mmcast's tuning; vLLM runs with its own defaults
        for key in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "PYTHONPATH"):
            env.pop(key, None)
        argv = [exe, "serve", self.model_dir, "--dtype", "float32", "--enforce-eager",
                "--enable-prompt-tokens-details", "--max-model-len", str(MAX_MODEL_LEN),
                "--host", "127.0.0.1", "--port", str(self.port), *VLLM_VIDEO_ARGS]  # fmt: skip
        t0 = time.monotonic()
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                     cwd=ROOT)  # fmt: skip
        log.close()
        try:
            self._wait_ready(t0)
        except BaseException:
            self.__exit__()
            raise
        self.startup_s = time.monotonic() - t0
        return self

    def _wait_ready(self, t0: float) -> None:
        while time.monotonic() - t0 < self.ready_timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}; see {self.log_path}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        raise TimeoutError(f"vllm serve not ready after {self.ready_timeout:.0f} s; see {self.log_path}")

    def __exit__(self, *exc: object) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        pgid = self.proc.pid  # start_new_session: the server leads its own group, engine core included
        os.killpg(pgid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self.proc.wait()
        # the engine core may outlive the server by a moment; the next engine must have the machine alone
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.5)
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Mmcast:
    def __init__(
        self,
        model_dir: str,
        tp: int,
        log_dir: str,
        threads: int | None = None,
        stall_ms: int | None = None,
        local_streams: bool = True,
    ) -> None:
        self.model_dir = model_dir
        self.tp = tp
        self.threads = threads  # the ranks' --threads; None: their default (the CPUs less one, divided among the ranks)
        self.stall_ms = stall_ms  # the scheduler's --max-decode-stall-ms; None: its default
        self.local_streams = local_streams  # the Step streams on the ranks' sockets (False: gRPC on their ports)
        self.name = (f"mmcast_tp{tp}" + (f"_threads{threads}" if threads else "")
                     + (f"_stall{stall_ms}" if stall_ms is not None else "")
                     + ("" if local_streams else "_grpc"))  # fmt: skip
        self.log_dir = log_dir
        self.group = None
        self.startup_s = 0.0

    @property
    def base_url(self) -> str:
        return self.group.openai_base_url

    @property
    def metrics_url(self) -> str:
        return self.group.metrics_urls["scheduler"]

    @property
    def pids(self) -> dict[str, int]:
        return {k: v for k, v in self.group.pids().items() if v}

    def __enter__(self) -> Mmcast:
        from mmcast_local.supervisor import LocalGroup

        t0 = time.monotonic()
        self.group = LocalGroup(self.model_dir, self.tp, "lazy", http_port=0, kv_blocks=MMCAST_KV_BLOCKS,
                                log_dir=self.log_dir,
                                worker_args=("--threads", str(self.threads)) if self.threads else (),
                                scheduler_args=("--max-decode-stall-ms", str(self.stall_ms))
                                if self.stall_ms is not None else (),
                                local_streams=self.local_streams)  # fmt: skip
        self.group.__enter__()
        self.startup_s = time.monotonic() - t0
        return self

    def __exit__(self, *exc: object) -> None:
        if self.group is not None:
            self.group.__exit__(*exc)
