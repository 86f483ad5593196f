"""The decoder's linear layers on oneDNN-packed weights (worker_svc/cpu_linear.py): the same products as the dense
layers to float32 rounding, the dense copies released except a weight the embedding shares, and only where packing
applies."""

from __future__ import annotations

import pytest
import torch

from worker_svc import cpu_linear
from worker_svc.config import WorkerConfig
from worker_svc.runner import ModelRunner

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this PyTorch build")


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 24)
        self.proj = torch.nn.Linear(24, 40, bias=True)
        self.back = torch.nn.Linear(40, 24, bias=False)
        self.head = torch.nn.Linear(24, 50, bias=False)
        self.head.weight = self.embed.weight


@pytest.mark.parametrize("op", ["linear_pointwise", "mkldnn_linear"])
@pytest.mark.parametrize("shape", [(1, 24), (16, 24), (1, 7, 24), (3, 5, 24), (0, 24)])
def test_packed_layers_give_the_dense_products_for_any_leading_shape(shape, op, monkeypatch):
    if op == "mkldnn_linear":  # the public op on converted tensors: a PyTorch build without the pointwise op
        monkeypatch.setattr(cpu_linear, "_POINTWISE", None)
    elif cpu_linear._POINTWISE is None:
        pytest.skip("this PyTorch build has no mkldnn._linear_pointwise")
    torch.manual_seed(0)
    net = _Tied()
    x = torch.randn(shape)
    with torch.inference_mode():
        want = net.head(net.back(net.proj(x)))
        sizes = cpu_linear.pack([net.proj, net.back, net.head], keep=[net.embed.weight])
        got = net.head(net.back(net.proj(x)))
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # Dense weights released, the shared one kept (the embedding still reads it), its bytes reported.
    assert net.proj.weight is None and net.back.weight is None
    assert net.head.weight is net.embed.weight and net.embed.weight.numel() == 50 * 24
    assert sizes == {"packed": 4 * (40 * 24 + 24 * 40 + 50 * 24), "kept": 4 * 50 * 24}


def test_packing_twice_leaves_a_packed_layer_alone():
    net = _Tied()
    first = cpu_linear.pack([net.proj])
    assert cpu_linear.pack([net.proj]) == {"packed": 0, "kept": 0} and first["packed"] == 4 * 40 * 24


@pytest.mark.parametrize(
    ("device", "dtype", "world", "needle"),
    [("meta", torch.float32, 1, "device meta"), ("cpu", torch.bfloat16, 1, "dtype torch.bfloat16"),
     ("cpu", torch.float32, 2, "world size 2"), ("cpu", torch.float32, 1, None)],
)  # fmt: skip
def test_packing_applies_to_one_float32_cpu_rank_only(device, dtype, world, needle):
    why = cpu_linear.unsupported(torch.device(device), dtype, world)
    assert why == needle if needle is None else needle in why


@pytest.mark.parametrize("layout", ["onednn", "dense"])
def test_a_rank_packs_its_decoder_unless_told_dense_and_answers_alike(tiny_model_dir, layout):
    from tests.support.worker_driver import rank_token_file
    from worker_svc.runner import ForwardInput

    runner = ModelRunner(
        WorkerConfig(model=str(tiny_model_dir), kv_blocks=16, cpu_linear=layout, shared_token_file=rank_token_file())
    )
    assert runner.linear_layout == layout
    language = runner.model.model.language_model
    dense = [m for m in language.modules() if isinstance(m, torch.nn.Linear) and m.weight is not None]
    assert (len(dense) == 0) == (layout == "onednn")
    assert runner.model.model.visual is not None and all(
        m.weight is not None for m in runner.model.model.visual.modules() if isinstance(m, torch.nn.Linear)
    )
    ids = list(range(10, 30))
    positions = torch.arange(len(ids)).expand(3, -1).contiguous()
    logits = runner.forward([ForwardInput([0, 1], 0, ids, positions, [], True)])[0]
    from transformers import AutoModelForImageTextToText

    plain = AutoModelForImageTextToText.from_pretrained(tiny_model_dir).eval()
    with torch.inference_mode():
        want = plain(input_ids=torch.tensor([ids]), position_ids=positions[:, None]).logits[0, -1]
    torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)


def test_auto_packs_only_the_layers_of_at_least_300k_weights(tiny_model_dir):
    from tests.support.worker_driver import rank_token_file

    runner = ModelRunner(WorkerConfig(model=str(tiny_model_dir), kv_blocks=16, shared_token_file=rank_token_file()))
    assert WorkerConfig.__dataclass_fields__["cpu_linear"].default == "auto"
    # the tiny model's layers are all far below the threshold: every one stays dense, and the rank says so
    layers = [m for m in runner.model.model.language_model.modules() if isinstance(m, torch.nn.Linear)]
    assert layers and all(m.weight is not None and "forward" not in vars(m) for m in layers)
    assert runner.linear_layout == "dense"
    big, small = torch.nn.Linear(1536, 256), torch.nn.Linear(256, 1024)  # 393k (2B's KV projection), 262k
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.language_model = torch.nn.ModuleList([big, small])
    model.get_input_embeddings = lambda: torch.nn.Embedding(4, 4)
    model.get_output_embeddings = lambda: None
    sizes = cpu_linear.pack_decoder(model, cpu_linear.AUTO_MIN_ELEMENTS)
    assert sizes["layers"] == 1 and "forward" in vars(big) and "forward" not in vars(small)
    assert sizes["packed"] == 4 * 1536 * 256
