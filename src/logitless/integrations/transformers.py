"""Attention entropy captured from a transformers model while it runs its own attention.

``AttentionEntropyRecorder`` registers one attention function and one attention-mask function
in transformers' registries (``AttentionInterface``, ``AttentionMaskInterface``) under a key
of its own and points the model's config at that key for the duration of the ``with`` block.
The attention function calls the implementation the model was configured with (eager, sdpa,
flash-attention, ...) with exactly the arguments it received, so outputs and logits are
bit-identical; next to it, for the chosen layers, it runs ``logitless.attention_entropy`` on
that layer's ``q`` and ``k`` (after RoPE). The mask function returns the configured
implementation's own mask and notes what the entropy needs: the 2D padding mask, and where
packed sequences start (read from the mask function transformers composed).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

import torch
from transformers.configuration_utils import PreTrainedConfig
from transformers.masking_utils import (
    ALL_MASK_ATTENTION_FUNCTIONS,
    AttentionMaskInterface,
    flash_attention_mask,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from logitless.fused_losses.head.attention_entropy import attention_entropy

__all__ = ["AttentionEntropyRecorder"]


class AttentionEntropyRecorder:
    """Context manager that records per-query attention entropy of chosen layers and heads.

    ``with AttentionEntropyRecorder(model, layers=None, heads=None) as rec: model(**batch)``;
    ``layers`` / ``heads``: indices (``None`` = all). Then

    - ``rec.per_layer()``: fp32 ``[L, B, H, T]`` (chosen layers and query heads, in increasing
      order), ``rec.per_layer(reduce_heads="mean")``: ``[L, B, T]``;
    - ``rec.per_token()``: ``[B, T]``, the mean over the chosen heads and layers.

    Values come from the most recent forward pass inside the block (each forward replaces
    them). Padding positions (``attention_mask`` 0) hold 0. Entropy is that of the softmax the
    model computes: same scaling, GQA head sharing, causal / sliding-window / packed-sequence /
    padding masks, logit softcap. Works with left and right padding and with packed inputs
    (``position_ids`` restarting at each sequence, or flash-attn ``cu_seq_lens_q``), under
    ``torch.no_grad()`` or with grad (the entropy is computed from detached ``q``, ``k``).

    Needs one full pass over the sequence (no past keys), a 2D ``attention_mask`` (or none),
    and text masks (causal/bidirectional, sliding window, padding, packing).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        layers: Sequence[int] | None = None,
        heads: Sequence[int] | None = None,
    ) -> None:
        config = getattr(model, "config", None)
        if not isinstance(config, PreTrainedConfig):
            raise ValueError("model must be a transformers PreTrainedModel (with a .config)")
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        n_layers = text.num_hidden_layers
        n_heads = text.num_attention_heads
        self.layers = self._indices("layers", layers, n_layers)
        self.heads = self._indices("heads", heads, n_heads)
        self.model = model
        self._key = f"logitless_entropy_{id(self):x}"
        self._saved: list[tuple[PreTrainedConfig, str | None]] = []
        self._hooks: list = []
        self._records: dict[int, torch.Tensor] = {}
        self._padding: torch.Tensor | None = None
        self._seg_starts: torch.Tensor | None = None
        self._calls = 0

    @staticmethod
    def _indices(name: str, chosen: Sequence[int] | None, n: int) -> list[int]:
        if chosen is None:
            return list(range(n))
        values = [int(i) for i in chosen]
        if not values or any(i < 0 or i >= n for i in values) or len(set(values)) != len(values):
            raise ValueError(f"{name} must be distinct indices in [0, {n}), got {list(chosen)}")
        return sorted(values)

    # -- context -------------------------------------------------------------------------------

    def __enter__(self) -> AttentionEntropyRecorder:
        configs = {id(self.model.config): self.model.config}
        for module in self.model.modules():
            cfg = getattr(module, "config", None)
            if isinstance(cfg, PreTrainedConfig):
                configs.setdefault(id(cfg), cfg)
        AttentionInterface.register(self._key, self._attention)
        AttentionMaskInterface.register(self._key, self._mask)
        # The private attribute, not the property: the property's setter also rewrites
        # sub-configs, which would make restoring them order-dependent.
        self._saved = [(cfg, cfg._attn_implementation_internal) for cfg in configs.values()]
        for cfg, _ in self._saved:
            cfg._attn_implementation_internal = self._key
        # On the base model too, so that calling it directly also starts a fresh record.
        bases = (self.model, getattr(self.model, "base_model", None))
        modules = {id(m): m for m in bases if m is not None}
        self._hooks = [
            m.register_forward_pre_hook(self._on_forward, with_kwargs=True)
            for m in modules.values()
        ]
        self._records = {}
        return self

    def __exit__(self, *exc) -> None:
        for cfg, impl in self._saved:
            cfg._attn_implementation_internal = impl
        for hook in self._hooks:
            hook.remove()
        AttentionInterface._global_mapping.pop(self._key, None)
        AttentionMaskInterface._global_mapping.pop(self._key, None)

    def _original(self, config: PreTrainedConfig | None) -> str:
        for cfg, impl in self._saved:
            if cfg is config:
                return impl or "eager"
        return self._saved[0][1] or "eager"

    # -- results -------------------------------------------------------------------------------

    def per_layer(self, reduce_heads: str | None = None) -> torch.Tensor:
        """fp32 ``[L, B, H, T]`` for the chosen layers and heads; ``"mean"``: ``[L, B, T]``."""
        if reduce_heads not in (None, "mean"):
            raise ValueError(f"reduce_heads must be None or 'mean', got {reduce_heads!r}")
        missing = [i for i in self.layers if i not in self._records]
        if missing:
            raise ValueError(
                f"no attention entropy recorded for layers {missing}: run the model inside the "
                "`with AttentionEntropyRecorder(...)` block first"
            )
        out = torch.stack([self._records[i] for i in self.layers])
        return out.mean(2) if reduce_heads == "mean" else out

    def per_token(self) -> torch.Tensor:
        """fp32 ``[B, T]``: mean over the chosen heads and layers."""
        return self.per_layer(reduce_heads="mean").mean(0)

    # -- hooks ---------------------------------------------------------------------------------

    def _on_forward(self, module, args, kwargs) -> None:
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 2):
            raise ValueError(
                "AttentionEntropyRecorder needs attention_mask as a 2D [B, T] padding mask "
                f"(or None), got {type(mask).__name__}"
                + (f" of shape {list(mask.shape)}" if isinstance(mask, torch.Tensor) else "")
            )
        self._records = {}
        self._padding = None
        self._seg_starts = None
        self._calls = 0

    def _mask(self, **kwargs):
        """The configured implementation's mask, unchanged; notes padding and packing."""
        impl = self._original(kwargs.get("config"))
        padding = kwargs.get("attention_mask")
        self._padding = None if padding is None else padding.bool()
        self._seg_starts = self._probe_packing(kwargs)
        if impl in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
            return ALL_MASK_ATTENTION_FUNCTIONS[impl](**kwargs)
        return None

    @staticmethod
    def _probe_packing(kwargs) -> torch.Tensor | None:
        """Where packed sequences start, from transformers' composed mask function.

        A query always sees the key just before it unless a new sequence starts there (or a
        window of 1, which no model uses), so evaluating the mask function at ``(i, i - 1)``
        finds the starts in O(T) without building a mask.
        """
        fn: Callable | None = kwargs.get("mask_function")
        q_len, kv_len = kwargs.get("q_length"), kwargs.get("kv_length")
        if fn is None or q_len is None or q_len != kv_len or q_len < 2:
            return None
        device = kwargs.get("device", "cpu")
        batch = kwargs["batch_size"]
        i = torch.arange(1, q_len, device=device)[None, :]
        b = torch.arange(batch, device=device)[:, None]
        head = torch.zeros((), dtype=torch.long, device=device)
        q_idx = i + kwargs.get("q_offset", 0)
        kv_idx = i - 1 + kwargs.get("kv_offset", 0)
        sees_previous = fn(b, head, q_idx, kv_idx)
        sees_previous = torch.as_tensor(sees_previous, device=device).expand(batch, q_len - 1)
        if bool(sees_previous.all()):
            return None
        starts = torch.ones(batch, q_len, dtype=torch.bool, device=device)
        starts[:, 1:] = ~sees_previous
        return starts

    def _attention(self, module, query, key, value, attention_mask, *args, **kwargs):
        config = getattr(module, "config", None)
        impl = self._original(config)
        eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        fn = ALL_ATTENTION_FUNCTIONS.get_interface(impl, eager)
        if fn is None:
            raise ValueError(
                f"{type(module).__name__}: no eager_attention_forward in its module to run "
                f"attn_implementation={impl!r}"
            )
        # The implementation may read the config (flash-attention picks its kernel by name).
        if config is not None:
            config._attn_implementation_internal = impl
        try:
            out = fn(module, query, key, value, attention_mask, *args, **kwargs)
        finally:
            if config is not None:
                config._attn_implementation_internal = self._key
        layer = getattr(module, "layer_idx", None)
        if layer is None:
            layer = self._calls
        self._calls += 1
        if layer in self.layers:
            self._records[layer] = self._entropy(module, query, key, attention_mask, impl, kwargs)
        return out

    def _entropy(self, module, query, key, attention_mask, impl, kwargs) -> torch.Tensor:
        bsz, n_q_heads, t, _ = query.shape
        if key.shape[2] != t:
            raise ValueError(
                "AttentionEntropyRecorder needs one full pass over the sequence: got "
                f"{t} queries against {key.shape[2]} keys (a cache with past keys?)"
            )
        group = n_q_heads // key.shape[1]
        heads = torch.tensor(self.heads, device=query.device)
        q = query.detach().index_select(1, heads)
        k = key.detach().index_select(1, heads // group)
        causal = bool(kwargs.get("is_causal", getattr(module, "is_causal", True)))
        window = kwargs.get("sliding_window")
        if window is not None and not causal:
            # transformers' bidirectional window keeps |i - j| <= sliding_window.
            window = window + 1
        common = dict(
            causal=causal,
            scale=kwargs.get("scaling"),
            window=window,
            softcap=kwargs.get("softcap"),
        )

        padding, starts = self._padding, self._seg_starts
        mask_fn = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(impl)
        if "flash" in impl or mask_fn is flash_attention_mask:
            # flash-attention (and any implementation that takes its 2D mask): the padding mask
            # reaches the attention function; packing comes from cu_seq_lens_q or
            # position_ids, as in transformers' _flash_attention_forward.
            padding = attention_mask.bool() if isinstance(attention_mask, torch.Tensor) else None
            starts = None
            cu = kwargs.get("cu_seq_lens_q")
            position_ids = kwargs.get("position_ids")
            if padding is None and cu is not None:
                starts = torch.zeros(bsz * t, dtype=torch.bool, device=query.device)
                first = cu[:-1].long()
                starts[first[first < bsz * t]] = True
                starts = starts.view(bsz, t)
            elif padding is None and position_ids is not None and bsz == 1:
                # Sequences start where the position is the smallest (0, or padding_idx + 1).
                starts = position_ids == position_ids.min()
                starts = starts if int(starts.sum()) > 1 else None
        if padding is not None and padding.shape != (bsz, t):
            raise ValueError(
                f"AttentionEntropyRecorder: padding mask of shape {list(padding.shape)} does not "
                f"match the layer's {bsz} x {t} queries"
            )

        if starts is None:
            return attention_entropy(q, k, attention_mask=padding, **common)
        # Packed rows: flatten [B, T] into one packed batch whose sequences also end at rows.
        starts = starts.clone()
        starts[:, 0] = True
        flat = starts.reshape(-1).nonzero().squeeze(1)
        cu_seqlens = torch.cat([flat, flat.new_tensor([bsz * t])])
        h = attention_entropy(
            q.transpose(1, 2).reshape(bsz * t, len(self.heads), -1),
            k.transpose(1, 2).reshape(bsz * t, len(self.heads), -1),
            cu_seqlens=cu_seqlens,
            **common,
        )
        return h.view(bsz, t, -1).transpose(1, 2)
