"""Transport security and tenant isolation on real processes.

One scheduler + one rank (``LocalGroup``) with everything on: the client port serves mutual TLS (a throwaway CA
generated here) and requires bearer tokens of two tenants; the rank's port serves mutual TLS and requires the
shared token; both also serve plaintext health on a separate port. Every refused connection or call is made
while a correct client's request runs, which must still succeed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mmcast.v1 import generation_pb2 as pb
from mmcast.v1 import generation_pb2_grpc as pb_grpc
from mmcast.v1 import worker_pb2
from mmcast_client import Client, NotFound
from mmcast_local.child_processes import free_ports
from mmcast_local.supervisor import LocalGroup
from tests.support import security_catalogue as cat
from tests.support.pki import make_pki
from tests.support.security_support import new_token, scrape, secret_file, serving, wait_for

pytestmark = pytest.mark.slow

RESULTS: list[dict] = []


@dataclasses.dataclass
class Setup:
    group: LocalGroup
    pki: object
    tokens: dict[str, str]  # tenant -> token
    worker_token: str
    token_files: dict[str, str]  # tenant -> file holding its token (for the CLI)
    health_port: int  # the scheduler's plaintext health port
    worker_health_port: int

    def credentials(self, *, ca=None, client=True, rogue_client=False) -> grpc.ChannelCredentials:
        leaf = self.pki.rogue_client if rogue_client else self.pki.client
        return grpc.ssl_channel_credentials(
            root_certificates=(ca or self.pki.ca).read_bytes(),
            private_key=leaf.key_bytes if client else None,
            certificate_chain=leaf.cert_bytes if client else None,
        )

    def client(self, tenant: str = "alpha", **kwargs) -> Client:
        return Client(
            self.group.target,
            root_certificates=self.pki.ca.read_bytes(),
            private_key=self.pki.client.key_bytes,
            certificate_chain=self.pki.client.cert_bytes,
            token=self.tokens[tenant],
            retries=0,
            timeout=60,
            **kwargs,
        )


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("transport")
    pki = make_pki(folder / "pki")
    tokens = {"alpha": new_token(), "beta": new_token(), "gamma": new_token()}  # gamma: one test's fresh tenant
    worker_token = new_token()
    secret_file(folder / "tokens.json", json.dumps({token: tenant for tenant, token in tokens.items()}))
    secret_file(folder / "worker-token", worker_token)
    token_files = {t: str(secret_file(folder / f"{t}.token", tok + "\n")) for t, tok in tokens.items()}
    health_port, worker_health_port = free_ports(2)
    server_tls = [
        "--tls-cert-file",
        str(pki.server.cert),
        "--tls-key-file",
        str(pki.server.key),
        "--tls-client-ca-file",
        str(pki.ca),
    ]
    group = LocalGroup(
        tiny_model_dir,
        1,
        "lazy",
        log_dir=folder / "logs",
        scheduler_args=[
            *server_tls,
            "--auth-tokens-file",
            str(folder / "tokens.json"),
            "--health-port",
            str(health_port),
            "--worker-tls-ca-file",
            str(pki.ca),
            "--worker-tls-cert-file",
            str(pki.client.cert),
            "--worker-tls-key-file",
            str(pki.client.key),
            "--worker-token-file",
            str(folder / "worker-token"),
        ],
        worker_args=[
            *server_tls,
            "--shared-token-file",
            str(folder / "worker-token"),
            "--health-port",
            str(worker_health_port),
        ],
    )
    group.start()
    try:
        s = Setup(group, pki, tokens, worker_token, token_files, health_port, worker_health_port)
        # Readiness through the TLS port itself (health needs no token), as a client would see it.
        wait_for(
            lambda: group.failure or serving(group.target, "mmcast.v1.GenerationService", s.credentials()),
            180,
            f"the TLS group is not ready:\n{group.log_tails()}",
            interval=0.2,
        )
        assert group.failure is None, group.failure
        yield s
    finally:
        group.stop()
        if os.environ.get("MMCAST_SECURITY_REPORT_DIR"):
            with open(os.path.join(os.environ["MMCAST_SECURITY_REPORT_DIR"], "transport.json"), "w") as f:
                json.dump(RESULTS, f, indent=1)


# --- who may connect ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Attempt:
    id: str
    port: str  # "client" or "rank"
    what: str
    code: str  # expected status
    call: Callable  # (setup) -> None, raises grpc.RpcError


def generate_with(credentials: Callable | None, token: Callable | None = None, server_name: str | None = None):
    """A Generate call with the given channel credentials (None: plaintext) and token."""

    def call(s: Setup):
        options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
        channel = (
            grpc.secure_channel(s.group.target, credentials(s), options=options)
            if credentials
            else grpc.insecure_channel(s.group.target)
        )
        with channel:
            metadata = (("authorization", f"Bearer {token(s)}"),) if token else ()
            list(pb_grpc.GenerationServiceStub(channel).Generate(cat.good_request(), metadata=metadata, timeout=20))

    return call


def step_with(credentials: Callable | None, token: Callable | None = None):
    """Opens a Step stream on the rank (a well-formed handshake; it must never get that far)."""

    def call(s: Setup):
        target = s.group.worker_targets[0]
        channel = grpc.secure_channel(target, credentials(s)) if credentials else grpc.insecure_channel(target)
        with channel:
            step = channel.stream_stream(
                "/mmcast.v1.WorkerService/Step",
                request_serializer=lambda b: b,
                response_deserializer=worker_pb2.StepResponse.FromString,
            )
            frame = worker_pb2.StepRequest(handshake=worker_pb2.Handshake(protocol_version=1, rank=0, world_size=1))
            metadata = (("authorization", f"Bearer {token(s)}"),) if token else ()
            list(step(iter([frame.SerializeToString()]), metadata=metadata, timeout=20))

    return call


GOOD_CERT = lambda s: s.credentials()  # noqa: E731 - table entries
NO_CERT = lambda s: s.credentials(client=False)  # noqa: E731
ROGUE_CERT = lambda s: s.credentials(rogue_client=True)  # noqa: E731
UNTRUSTED_SERVER = lambda s: s.credentials(ca=s.pki.rogue_ca)  # noqa: E731
ALPHA = lambda s: s.tokens["alpha"]  # noqa: E731
WRONG = lambda s: "w" * 40  # noqa: E731
WORKER_TOKEN = lambda s: s.worker_token  # noqa: E731

ATTEMPTS = [
    Attempt(
        "client-plaintext-to-tls",
        "client",
        "plaintext HTTP/2 to the TLS client port",
        "UNAVAILABLE",
        generate_with(None, ALPHA),
    ),
    Attempt(
        "client-no-certificate",
        "client",
        "TLS without a client certificate (mutual TLS required)",
        "UNAVAILABLE",
        generate_with(NO_CERT, ALPHA),
    ),
    Attempt(
        "client-untrusted-certificate",
        "client",
        "a client certificate signed by an unknown CA",
        "UNAVAILABLE",
        generate_with(ROGUE_CERT, ALPHA),
    ),
    Attempt(
        "client-untrusted-server",
        "client",
        "a client that trusts another CA than the server's",
        "UNAVAILABLE",
        generate_with(UNTRUSTED_SERVER, ALPHA),
    ),
    Attempt(
        "client-wrong-server-name",
        "client",
        "the server's certificate checked against another host name",
        "UNAVAILABLE",
        generate_with(GOOD_CERT, ALPHA, server_name="not-this-host.example"),
    ),
    Attempt(
        "client-token-missing",
        "client",
        "mutual TLS but no bearer token",
        "UNAUTHENTICATED",
        generate_with(GOOD_CERT, None),
    ),
    Attempt(
        "client-token-wrong",
        "client",
        "mutual TLS and an unknown bearer token",
        "UNAUTHENTICATED",
        generate_with(GOOD_CERT, WRONG),
    ),
    Attempt(
        "client-worker-token",
        "client",
        "the ranks' shared token used as a client token",
        "UNAUTHENTICATED",
        generate_with(GOOD_CERT, WORKER_TOKEN),
    ),
    Attempt(
        "rank-plaintext-to-tls",
        "rank",
        "plaintext to the rank's TLS port",
        "UNAVAILABLE",
        step_with(None, WORKER_TOKEN),
    ),
    Attempt(
        "rank-no-certificate",
        "rank",
        "TLS to the rank without the scheduler's client certificate",
        "UNAVAILABLE",
        step_with(NO_CERT, WORKER_TOKEN),
    ),
    Attempt(
        "rank-untrusted-certificate",
        "rank",
        "a client certificate signed by an unknown CA",
        "UNAVAILABLE",
        step_with(ROGUE_CERT, WORKER_TOKEN),
    ),
    Attempt(
        "rank-token-missing",
        "rank",
        "the scheduler's certificate but no shared token",
        "UNAUTHENTICATED",
        step_with(GOOD_CERT, None),
    ),
    Attempt(
        "rank-client-token",
        "rank",
        "the scheduler's certificate and a tenant's token",
        "UNAUTHENTICATED",
        step_with(GOOD_CERT, ALPHA),
    ),
]


@pytest.mark.parametrize("attempt", ATTEMPTS, ids=[a.id for a in ATTEMPTS])
def test_refused_while_a_correct_client_is_served(setup, attempt):
    box: dict = {}

    def correct():
        try:
            with setup.client() as client:
                box["result"] = client.generate("Who is there?", images=[cat.GOOD_IMAGE], max_tokens=4, ignore_eos=True)
        except BaseException as exc:  # noqa: BLE001 - checked below
            box["error"] = exc

    thread = threading.Thread(target=correct, daemon=True)
    thread.start()
    t0 = time.perf_counter()
    with pytest.raises(grpc.RpcError) as caught:
        attempt.call(setup)
    seconds = time.perf_counter() - t0
    code, message = caught.value.code().name, caught.value.details() or ""
    RESULTS.append(
        {
            "id": attempt.id,
            "endpoint": attempt.port,
            "what": attempt.what,
            "code": code,
            "expected": attempt.code,
            "message": message,
            "seconds": round(seconds, 4),
        }
    )
    assert code == attempt.code, f"{attempt.id}: expected {attempt.code}, got {code}: {message}"
    thread.join(60)
    assert "error" not in box, f"the correct client failed meanwhile: {box['error']!r}"
    assert box["result"].finish_reason == "length" and len(box["result"].token_ids) == 4
    assert setup.group.restarts == 0 and setup.group.failure is None


def test_health_and_reflection_need_no_token(setup):
    channel = grpc.secure_channel(setup.group.target, setup.credentials())
    with channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="mmcast.v1.GenerationService"), timeout=5
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    grpcurl = os.path.join(os.path.dirname(sys.executable), "grpcurl")
    if os.path.exists(grpcurl):
        listing = subprocess.run(
            [
                grpcurl,
                "-cacert",
                str(setup.pki.ca),
                "-cert",
                str(setup.pki.client.cert),
                "-key",
                str(setup.pki.client.key),
                setup.group.target,
                "list",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert "mmcast.v1.GenerationService" in listing.stdout, listing.stderr


def test_plaintext_health_ports_serve_health_only(setup):
    """For probes that cannot speak TLS (the kubelet): health in plaintext on its own port, nothing else there."""
    assert serving(f"127.0.0.1:{setup.health_port}", "mmcast.v1.GenerationService")
    assert serving(f"127.0.0.1:{setup.worker_health_port}", "mmcast.v1.WorkerService")
    with grpc.insecure_channel(f"127.0.0.1:{setup.health_port}") as channel:
        with pytest.raises(grpc.RpcError) as caught:
            list(pb_grpc.GenerationServiceStub(channel).Generate(cat.good_request(), timeout=10))
        assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_sdk_and_cli_over_mutual_tls(setup, tmp_path):
    with setup.client() as client:
        info = client.get_server_info()
        assert info.group_ready and info.tensor_parallel_size == 1
        ref = client.upload_image(cat.png(48, 48, seed=11))
        result = client.generate(
            [{"role": "user", "content": [{"type": "image", "image": ref}, {"type": "text", "text": "Hi"}]}],
            max_tokens=3,
        )
        assert result.usage.images == 1
    image = tmp_path / "picture.png"
    image.write_bytes(cat.png(40, 40, seed=12))
    mmcast = os.path.join(os.path.dirname(sys.executable), "mmcast")
    base = [
        mmcast,
        "generate",
        "Describe it.",
        "--target",
        setup.group.target,
        "--image",
        str(image),
        "--max-tokens",
        "3",
        "--tls-ca",
        str(setup.pki.ca),
    ]
    ok = subprocess.run(
        [
            *base,
            "--tls-cert",
            str(setup.pki.client.cert),
            "--tls-key",
            str(setup.pki.client.key),
            "--token-file",
            setup.token_files["beta"],
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ok.returncode == 0, ok.stderr
    assert "usage: prompt_tokens=" in ok.stderr and "completion_tokens=3" in ok.stderr
    no_token = subprocess.run(
        [*base, "--tls-cert", str(setup.pki.client.cert), "--tls-key", str(setup.pki.client.key)],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if k != "MMCAST_TOKEN"},
    )
    assert no_token.returncode == 1 and "UNAUTHENTICATED" in no_token.stderr


# --- tenant isolation ------------------------------------------------------------------------------------------


def test_another_tenants_upload_is_not_found_like_an_unknown_hash(setup):
    image = cat.png(72, 72, seed=21)
    sha = hashlib.sha256(image).hexdigest()
    with setup.client("alpha") as alpha:
        alpha.upload_image(image)
        assert alpha.generate(
            [
                {
                    "role": "user",
                    "content": [{"type": "image", "image": f"sha256:{sha}"}, {"type": "text", "text": "Hi"}],
                }
            ],
            max_tokens=2,
        )
    unknown = hashlib.sha256(b"nobody uploaded this").hexdigest()
    messages = {}
    for name, digest in (("alpha's", sha), ("unknown", unknown)):
        with setup.client("beta", upload_images=False) as beta, pytest.raises(NotFound) as caught:
            beta.generate(
                [
                    {
                        "role": "user",
                        "content": [{"type": "image", "image": f"sha256:{digest}"}, {"type": "text", "text": "Hi"}],
                    }
                ],
                max_tokens=2,
            )
        messages[name] = caught.value.message.replace(digest, "<hash>")
    assert messages["alpha's"] == messages["unknown"], messages
    # Uploading the same bytes: beta learns nothing about alpha's copy.
    channel = grpc.secure_channel(setup.group.target, setup.credentials())
    with channel:
        reply = pb_grpc.GenerationServiceStub(channel).UploadImage(
            iter([pb.UploadImageRequest(data=image)]),
            metadata=(("authorization", f"Bearer {setup.tokens['beta']}"),),
            timeout=20,
        )
    assert reply.sha256 == sha and not reply.already_present


def test_no_cache_is_shared_across_tenants(setup):
    """Alpha's second request hits the prefix cache; gamma's first request (a tenant that never sent anything) with
    the same image and text hits nothing: no cached tokens, nothing the rank holds, the image sent and encoded
    again."""
    image = cat.png(96, 64, seed=31)
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": image},
                {"type": "text", "text": "What is in this picture, in detail?"},
            ],
        }
    ]
    url = setup.group.metrics_urls["scheduler"]
    with setup.client("alpha", upload_images=False) as alpha:
        first = alpha.generate(messages, max_tokens=2, ignore_eos=True)
        second = alpha.generate(messages, max_tokens=2, ignore_eos=True)
    assert first.usage.images_sent == 1
    assert second.usage.cached_tokens > 0 and second.usage.images_sent == 0
    runs_before = scrape(url)["mmcast_encoder_runs_total"]
    with setup.client("gamma", upload_images=False) as gamma:
        other = gamma.generate(messages, max_tokens=2, ignore_eos=True)
    assert other.usage.cached_tokens == 0, other.usage
    assert other.usage.images_rank_cached == 0 and other.usage.images_stripped == 0, other.usage
    assert other.usage.images_sent == 1 and other.usage.payload_bytes_broadcast > 0, other.usage
    # encoded anew from gamma's own bytes: alpha's encoder output is not gamma's to reuse
    assert other.usage.encoder_runs == 1, other.usage
    assert scrape(url)["mmcast_encoder_runs_total"] == runs_before + 1, "gamma's image was not encoded anew"
    assert other.token_ids == first.token_ids  # the same answer: isolation changes caching, not results


def test_request_ids_are_per_tenant(setup):
    """A request id in flight for alpha is free for beta (ALREADY_EXISTS would tell beta alpha's ids), and each
    sees its own id back."""
    channel = grpc.secure_channel(setup.group.target, setup.credentials())
    with channel:
        stub = pb_grpc.GenerationServiceStub(channel)

        def auth(tenant):
            return (("authorization", f"Bearer {setup.tokens[tenant]}"),)

        long = pb.GenerateRequest(
            request_id="shared-id",
            messages=[cat.user(cat.text("Tell a long story."))],
            sampling=pb.SamplingParams(max_tokens=300, ignore_eos=True),
        )
        alpha_stream = stub.Generate(long, metadata=auth("alpha"), timeout=60)
        next(alpha_stream)
        short = pb.GenerateRequest(
            request_id="shared-id", messages=[cat.user(cat.text("Hi"))], sampling=pb.SamplingParams(max_tokens=2)
        )
        beta_final = list(stub.Generate(short, metadata=auth("beta"), timeout=60))[-1].final
        assert beta_final.request_id == "shared-id" and beta_final.finish_reason == pb.FINISH_REASON_LENGTH
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(short, metadata=auth("alpha"), timeout=60))
        assert caught.value.code() == grpc.StatusCode.ALREADY_EXISTS
        alpha_stream.cancel()
    assert not re.search(r"(alpha|beta)/", beta_final.request_id)


# --- the OpenAI-compatible HTTP API: the client port's TLS files and tokens ------------------------------------------


def test_openai_api_over_mutual_tls_with_tokens(setup):
    """The HTTP port takes the client port's mutual TLS and bearer tokens: HTTPS with the client certificate and a
    tenant's token is served; without the certificate, with another CA, in plaintext or without a token it is not;
    an image one tenant sent is invisible to another (404 naming the uuid)."""
    import base64
    import ssl

    import httpx

    base = f"https://127.0.0.1:{setup.group.http_port}"

    def context(*, client=True, ca=None) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(ca or setup.pki.ca))
        if client:
            ctx.load_cert_chain(str(setup.pki.client.cert), str(setup.pki.client.key))
        return ctx

    img = cat.png(40, 48, seed=21)
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(img).decode()}}
    model = setup.group.model_dir.rstrip("/").rsplit("/", 1)[-1]
    body = {
        "model": model,
        "max_tokens": 3,
        "messages": [{"role": "user", "content": [part, {"type": "text", "text": "Hi"}]}],
    }
    alpha = {"authorization": f"Bearer {setup.tokens['alpha']}"}
    with httpx.Client(verify=context(), timeout=60) as http:
        ok = http.post(base + "/v1/chat/completions", json=body, headers=alpha)
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["completion_tokens"] == 3
        assert http.post(base + "/v1/chat/completions", json=body).status_code == 401
        assert http.get(base + "/health").status_code == 200  # no token needed, TLS still
        ref = {"type": "image_url", "image_url": None, "uuid": "sha256:" + hashlib.sha256(img).hexdigest()}
        by_ref = {**body, "messages": [{"role": "user", "content": [ref, {"type": "text", "text": "Hi"}]}]}
        assert http.post(base + "/v1/chat/completions", json=by_ref, headers=alpha).status_code == 200
        other = http.post(
            base + "/v1/chat/completions", json=by_ref, headers={"authorization": f"Bearer {setup.tokens['beta']}"}
        )
        assert other.status_code == 404 and other.json()["error"]["param"] == "messages[0].content[0].uuid"
    for refused in (context(client=False), context(ca=setup.pki.rogue_ca)):
        with httpx.Client(verify=refused, timeout=10) as http, pytest.raises(httpx.TransportError):
            http.post(base + "/v1/chat/completions", json=body, headers=alpha)
    with httpx.Client(timeout=10) as http, pytest.raises(httpx.TransportError):
        http.post(base.replace("https", "http") + "/v1/chat/completions", json=body, headers=alpha)
