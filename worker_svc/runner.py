"""The model side of a rank: loads the checkpoint, runs the vision encoder, and runs the language model once per
step over every scheduled window, its KV read and written in place in the block pool.

Loading is the plain transformers path (``AutoModelForImageTextToText.from_pretrained``), so a real Qwen2-VL
checkpoint loads exactly like the tiny one; with ``world_size > 1`` the decoder is sharded by transformers' tensor
parallel plan (``DistributedConfig(tp_size=N)``) after the process group exists, and the vision tower stays
replicated. The TP size is checked against ``config.json`` first (``common/model_checks.py``); with more ranks
than KV heads, each rank holds a replica of the KV head its query heads read (``worker_svc/kv_replication.py``).

The language model runs on ``inputs_embeds`` built here: the token embeddings of the step's tokens with the image
rows of this window scattered at their placeholder positions. This is what the model's own merge does
(``masked_scatter`` at the image-token positions) but by position rather than by token id, so it also holds for
``is_embed`` ranges, for a window that cuts an image, and for a batch whose rows cover different items.
Positions are always given explicitly: sliced from the whole prompt's M-RoPE positions, or for a family without
M-RoPE (LLaVA) each token's index.

One forward per step: the windows of every request (prefill chunks and decode tokens alike) are packed into one
sequence of batch 1, positions ``(3, 1, tokens)`` (``(1, tokens)`` without M-RoPE); the library's text model runs it with the attention function of
``worker_svc/attention_backends.py`` (selected for the text config only; one backend per device), which writes each
token's KV at the slot its block table gives and attends per request over the pool. The final norm's output is kept only at the
last token of windows that sample, and only those rows go through ``lm_head``. On a one-rank float32 CPU group the
decoder's linear layers multiply by oneDNN-packed weights (``worker_svc/cpu_linear.py``, ``--cpu-linear``).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
from collections.abc import Sequence

import torch

from common import model_checks
from common.families import family_of
from common.mrope import uses_mrope
from common.multimodal import (
    ENCODED_FIELD,
    FRAME_INDICES_FIELD,
    VIDEO_ENCODED_FIELD,
    Modality,
    MultiModalFeatureSpec,
    PayloadEncoding,
)
from worker_svc import attention_backends, cpu_linear, kv_pool, kv_replication, kv_sizing, patch_conv
from worker_svc.config import WorkerConfig

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Payload field names the processor produces per modality: (pixels, grid). A family without a grid field
# (``Family.grid_field`` None: LLaVA) has the pixels alone.
ENCODER_FIELDS = {
    Modality.IMAGE: ("pixel_values", "image_grid_thw"),
    Modality.VIDEO: ("pixel_values_videos", "video_grid_thw"),
}


def encoder_fields(feature: MultiModalFeatureSpec, family=None) -> tuple[str, ...]:
    """The fields a rank needs to encode the item: payload, then grid where the family has one (``family`` None:
    the Qwen-VL families') — the payload being the file's bytes for an encoded image, and for an encoded video
    the file and the frames to decode."""
    pixels, grid = ENCODER_FIELDS[feature.modality]
    if feature.encoding is PayloadEncoding.ENCODED and feature.modality is Modality.VIDEO:
        return VIDEO_ENCODED_FIELD, FRAME_INDICES_FIELD, grid
    if feature.encoding is PayloadEncoding.ENCODED:
        pixels = ENCODED_FIELD
    if family is not None and family.grid_field is None:
        return (pixels,)
    return pixels, grid


def resolve_device(name: str, rank: int) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        name = f"cuda:{rank % max(torch.cuda.device_count(), 1)}"
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


@dataclasses.dataclass
class ForwardInput:
    """One request's share of a forward: the tokens ``[start, start + len(token_ids))`` of its sequence."""

    block_ids: Sequence[int]  # the request's block table; covers at least start + len(token_ids) tokens
    start: int  # tokens already computed (their KV is in the pool at block_ids)
    token_ids: list[int]  # the window's token ids
    # (3, len(token_ids)) int64 M-RoPE positions (or (1, len) for 1-D RoPE); or an int p: the positions p, p + 1, ...
    # on every row (a window past the prompt), built with the step's others in one tensor (``ModelRunner._positions``)
    positions: torch.Tensor | int
    mm_rows: list[tuple[torch.Tensor, torch.Tensor]]  # (window-local indices, encoder rows) per overlapping item
    want_logits: bool  # True when the window ends at the request's last known token


@dataclasses.dataclass(frozen=True)
class StepLogits:
    """The last-token logits of a forward's windows: one float32 ``[wanted, vocab]`` tensor for every window that
    samples (sampled in one call, ``worker_svc/sampling.py``'s ``sample_batch``), and each window's row in it."""

    batch: torch.Tensor | None  # [rows, vocab]; None when no window samples
    rows: list[int | None]  # per window, in forward order: its row of ``batch``, or None

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> torch.Tensor | None:
        """Window ``i``'s ``[vocab]`` logits (a view of ``batch``), or None."""
        row = self.rows[i]
        return None if row is None else self.batch[row]


class ModelRunner:
    """Owns the model and the KV pool of this rank. Not thread-safe: one compute thread calls it."""

    def __init__(self, config: WorkerConfig) -> None:
        from transformers import AutoConfig, AutoModelForImageTextToText

        # config.json alone, before any weight: worker_svc/main.py ran the same check already; a library caller
        # gets it here.
        model_checks.check_checkpoint(config.model, config.world_size, "--world-size")
        self.device = resolve_device(config.device, config.rank)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.world_size = config.world_size
        self.encoder_threads = config.encoder_threads  # torch threads while the vision encoder runs (encode)
        kwargs: dict = {"dtype": self.dtype, "local_files_only": True}  # a local folder; never the hub
        model_config = AutoConfig.from_pretrained(config.model, local_files_only=True)
        shape = model_checks.check_tp(model_config, config.world_size, "--world-size")
        # What differs by model generation: encoder call, extra decoder inputs, TP plan, positions (common/families/).
        self.family = family_of(model_config)
        if config.world_size > 1:
            from transformers.distributed import DistributedConfig

            if self.device.type == "cuda":
                os.environ.setdefault("LOCAL_RANK", str(self.device.index or 0))  # transformers binds this device
            plan = self.family.tp_plan(model_config, config.world_size)
            override = kv_replication.tp_plan_override(model_config, config.world_size, plan)
            kwargs["distributed_config"] = DistributedConfig(tp_size=config.world_size, tp_plan=override or plan)
        model = AutoModelForImageTextToText.from_pretrained(config.model, config=model_config, **kwargs)
        # The decoder's attention reads and writes the pool through the device's backend
        # (worker_svc/attention_backends.py); the vision tower keeps the implementation it loaded with.
        self.attention = attention_backends.select(config.attention_backend, self.device, self.dtype)
        model.set_attn_implementation({"text_config": attention_backends.register()})
        if shape.kv_replicas(config.world_size) > 1:
            kv_replication.keep_rank_kv_heads(model, shape, config.world_size, config.rank)
        if config.world_size == 1:
            model = model.to(self.device)
        # Serving never trains: no parameter asks autograd to record, whatever path calls the model.
        self.model = model.eval().requires_grad_(False)
        # the vision tower's patch embedding as one product (worker_svc/patch_conv.py)
        self.patch_convolutions = patch_conv.swap_patch_convolutions(model)
        self.linear_layout = self._pack_linear(config, model)
        self.config = model.config
        text = model.config.get_text_config(decoder=True)
        self.text_config = text
        layer_types = set(getattr(text, "layer_types", None) or ["full_attention"])
        if layer_types != {"full_attention"}:
            raise ValueError(
                f"{config.model}: decoder layer types {sorted(layer_types)}; the paged attention serves "
                "full attention only (use_sliding_window must be false)"
            )
        # Given as the text model's attention_mask: a prepared mask per layer type, so it builds none.
        self._no_masks = {"full_attention": None}
        self.vocab_size = int(text.vocab_size)
        self.max_model_len = int(getattr(text, "max_position_embeddings", 0) or 0)
        kv_heads_local = shape.kv_heads_local(config.world_size)
        self.block_size = config.block_size
        self.pool = self._make_pool(config, text, kv_heads_local)
        self.uses_mrope = uses_mrope(model.config)
        self.rope_kwargs = self.family.rope_kwargs(model.config) if self.uses_mrope else {}
        self.embed = model.get_input_embeddings()
        # Encoder-output rows as the language model consumes them (``_embeds`` casts to this dtype): the unit of
        # the sharded placement's broadcast, identical on every rank.
        self.row_dtype = self.embed.weight.dtype
        self.hidden = int(self.embed.embedding_dim)
        self.row_width = self.family.row_width(model.config, self.hidden)
        log.info(
            "model loaded",
            extra={
                "model_type": model.config.model_type,
                "device": str(self.device),
                "dtype": str(self.dtype),
                "kv_pool_bytes": self.pool.nbytes,
                "kv_heads_local": kv_heads_local,
                "kv_replicas": shape.kv_replicas(config.world_size),
                "linear_layout": self.linear_layout,
            },
        )

    def _pack_linear(self, config: WorkerConfig, model) -> str:
        """The decoder's linear layers packed for oneDNN where ``--cpu-linear`` asks and the device allows; the
        layout they end in."""
        if config.cpu_linear == "dense":
            return "dense"
        why = cpu_linear.unsupported(self.device, self.dtype, config.world_size)
        if why is not None:
            log.debug("decoder linear layers stay dense", extra={"reason": why})
            return "dense"
        auto = config.cpu_linear == "auto"
        packed = cpu_linear.pack_decoder(model, cpu_linear.AUTO_MIN_ELEMENTS if auto else 0)
        if not packed["layers"]:
            return "dense"
        return "onednn" if not auto else "auto"

    def _make_pool(self, config: WorkerConfig, text, kv_heads_local: int) -> kv_pool.KVPool:
        """The KV block pool, sized after the weights are in place, so the memory left is what it may take
        (kv_sizing.py)."""
        head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
        num_layers = int(text.num_hidden_layers)
        size = self._pool_size(config, num_layers, kv_heads_local, head_dim)
        log.info(
            "KV pool sized",
            extra={
                "kv_blocks": size.blocks,
                "kv_pool_bytes": size.nbytes,
                "block_bytes": size.block_bytes,
                "why": size.reason,
            },
        )
        return kv_pool.KVPool(
            num_layers=num_layers,
            kv_heads=kv_heads_local,
            head_dim=head_dim,
            num_blocks=size.blocks,
            block_size=config.block_size,
            dtype=self.dtype,
            device=self.device,
        )

    # --- encoder ---------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def _pool_size(self, config: WorkerConfig, num_layers: int, kv_heads: int, head_dim: int) -> kv_sizing.PoolSize:
        per_block = kv_sizing.block_bytes(
            num_layers=num_layers,
            kv_heads=kv_heads,
            head_dim=head_dim,
            block_size=config.block_size,
            dtype_bytes=self.dtype.itemsize,
        )
        if config.kv_blocks > 0:
            return kv_sizing.size_pool(
                block_bytes=per_block, kv_blocks=config.kv_blocks, available_bytes=0, fraction=1.0, max_bytes=0
            )
        available, source = kv_sizing.available_memory(self.device)
        return kv_sizing.size_pool(
            block_bytes=per_block,
            kv_blocks=0,
            available_bytes=available,
            fraction=config.kv_cache_memory_fraction,
            max_bytes=config.kv_cache_max_bytes,
            sharers=config.local_ranks if self.device.type == "cpu" else 1,
            source=source,
        )

    def encoder_input_problem(self, feature: MultiModalFeatureSpec) -> str | None:
        """Why ``encode`` could not run on this item's fields (their shapes disagree), or None.

        Checked while planning, so a malformed item is refused before any rank starts the step."""
        pixels_name, grid_name = ENCODER_FIELDS[feature.modality]
        video = feature.modality is Modality.VIDEO
        if video and self.family.grid_field is None:
            return f"this model ({self.family.name}) takes no video"
        if feature.encoding is PayloadEncoding.ENCODED:
            pixels_name = VIDEO_ENCODED_FIELD if video else ENCODED_FIELD
        pixels = feature.data[pixels_name].data
        grid = feature.data[grid_name].data if self.family.grid_field is not None else None
        problem = self.family.grid_problem(self.config, grid, grid_name)
        if problem is not None:
            return problem
        if feature.encoding is PayloadEncoding.ENCODED:  # decoded by the item's owner, which checks the rest
            if pixels.dim() != 1 or pixels.dtype != torch.uint8:
                return f"{pixels_name} must be a 1-D uint8 tensor (the file's bytes); got {pixels.dtype}{tuple(pixels.shape)}"
            if video:
                frames = feature.data[FRAME_INDICES_FIELD].data
                if frames.dim() != 1 or frames.dtype != torch.int64 or frames.numel() == 0:
                    return (
                        f"{FRAME_INDICES_FIELD} must be a non-empty 1-D int64 tensor; got "
                        f"{frames.dtype}{tuple(frames.shape)}"
                    )
            return None
        return self.family.pixel_problem(self.config, pixels, grid, pixels_name, grid_name)

    def encoder_fields(self, feature: MultiModalFeatureSpec) -> tuple[str, ...]:
        """The fields this model's vision tower reads of the item (``encoder_fields`` for its family)."""
        return encoder_fields(feature, self.family)

    @torch.inference_mode()
    def encode(self, feature: MultiModalFeatureSpec) -> torch.Tensor:
        """The encoder output rows of a whole item (``[num_embeds, hidden]``), on this rank's device.

        Under inference mode: with autograd recording, the rows the encoder cache keeps would hold the vision
        tower's whole graph and every activation it saved for a backward pass (at Qwen2-VL-2B's widths ~1.5 GB per
        1280x720 image, kept until the item is evicted)."""
        pixels_name, grid_name = ENCODER_FIELDS[feature.modality]
        pixels = feature.data[pixels_name].data.to(self.device, non_blocking=True)
        grid = None
        if self.family.grid_field is not None:
            grid = feature.data[grid_name].data.reshape(-1, 3).to(self.device)
        threads = torch.get_num_threads()
        if self.encoder_threads != threads:
            torch.set_num_threads(self.encoder_threads)  # --encoder-threads, for this call only
        try:
            return self.family.encode(self.model, pixels, grid, video=feature.modality is Modality.VIDEO)
        finally:
            if self.encoder_threads != threads:
                torch.set_num_threads(threads)

    def empty_rows(self, num_rows: int) -> torch.Tensor:
        """A buffer for an item's encoder output received over the group's collective."""
        return torch.empty(num_rows, self.row_width, dtype=self.row_dtype, device=self.device)

    # --- language model --------------------------------------------------------------------------------------

    def _embeds(self, items: Sequence[ForwardInput]) -> torch.Tensor:
        """The packed step's input embeddings: one lookup for every window's tokens (not one per window: a decode
        step's cost would grow by a module call, and under TP a collective, per request), then the encoder rows."""
        flat = list(itertools.chain.from_iterable(it.token_ids for it in items))
        embeds = self.embed(torch.tensor(flat, dtype=torch.long, device=self.device))
        base = 0
        for it in items:
            for local, rows in it.mm_rows:
                embeds[local.to(self.device) + base] = rows[:, : self.hidden].to(self.device, embeds.dtype)
            base += len(it.token_ids)
        return embeds

    def _encoder_kwargs(self, items: Sequence[ForwardInput]) -> dict:
        """The family's extra text-model inputs for the packed sequence (none for the Qwen2-VL family)."""
        if self.row_width == self.hidden:
            return {}
        indices, rows, base = [], [], 0
        for it in items:
            for local, item_rows in it.mm_rows:
                indices.append(local.to(self.device) + base)
                rows.append(item_rows.to(self.device))
            base += len(it.token_ids)
        if not indices:
            return {}
        flat = torch.cat(indices)
        order = torch.argsort(flat)  # the model takes rows in sequence order
        return self.family.text_model_kwargs(self.hidden, base, flat[order], torch.cat(rows)[order])

    def _positions(self, items: Sequence[ForwardInput]) -> torch.Tensor:
        """The packed step's positions ``(rows, 1, tokens)``. A step of windows past their prompts (decode tokens)
        builds them in one tensor from Python ints: a tensor per window and their concatenation cost ~4 tensor
        operations a request, each several microseconds on a CPU."""
        rows = 3 if self.uses_mrope else 1
        if all(isinstance(it.positions, int) for it in items):
            flat = [p for it in items for p in range(it.positions, it.positions + len(it.token_ids))]
            return torch.tensor(flat, dtype=torch.long, device=self.device).expand(rows, 1, -1)
        parts = [
            (torch.arange(len(it.token_ids)) + it.positions).expand(rows, -1) if isinstance(it.positions, int)
            else it.positions
            for it in items
        ]  # fmt: skip
        return torch.cat(parts, dim=1).to(self.device)[:, None, :]

    @torch.inference_mode()
    def forward(self, items: Sequence[ForwardInput]) -> StepLogits:
        """Runs every item's window in one forward and returns its last-token logits (float32 ``[vocab]``) where
        wanted. Each window's KV lands in the pool at its block table's slots."""
        if not items:
            return StepLogits(None, [])
        windows = [(it.block_ids, it.start, it.start + len(it.token_ids)) for it in items]
        step = attention_backends.BoundStep(
            self.attention, self.attention.plan(self.pool.data, windows, self.block_size)
        )
        embeds = self._embeds(items)[None]
        positions = self._positions(items)
        text_model = self.model.model.language_model
        hidden = text_model(
            inputs_embeds=embeds,
            position_ids=positions if self.uses_mrope else positions[0],
            attention_mask=self._no_masks,  # the attention masks by span itself; no dense mask is built
            use_cache=False,
            paged_step=step,
            **self._encoder_kwargs(items),
        ).last_hidden_state[0]
        ends = itertools.accumulate(len(it.token_ids) for it in items)
        wanted = [end - 1 for end, it in zip(ends, items, strict=True) if it.want_logits]
        if not wanted:
            return StepLogits(None, [None] * len(items))
        logits = self.model.lm_head(hidden[torch.tensor(wanted, device=hidden.device)]).float()
        rows = iter(range(len(wanted)))
        return StepLogits(logits, [next(rows) if it.want_logits else None for it in items])
