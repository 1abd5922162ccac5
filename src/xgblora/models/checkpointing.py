"""Gradient checkpointing that keeps the KV cache: every decoder layer recomputed in the backward pass, also where a
forward runs on a cache, so that DPO's and GRPO's shared-prompt forward (a prompt's keys and values computed once and
read by all its completions, `models.scoring.shared_prefix_outputs`) keeps its cache under checkpointing.

transformers' own checkpointing (`gradient_checkpointing_enable`) drops the cache of a layer that writes it: the
backward pass replays the layer's forward, and a replayed `cache.update` would append the layer's keys and values a
second time. Here the replay first puts the layer's cache entry back as the first run found it, so the replay appends
to the same keys and values and recomputes exactly the tensors the first run saved. The cache's layers rebind their
tensors on update (`DynamicLayer.update` concatenates), so the entry's attributes are all the state there is.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers.modeling_layers import GradientCheckpointingLayer


def enable_checkpointing(model: nn.Module) -> None:
    """Checkpoint each of the model's decoder layers (non-reentrant), a layer given a cache keeping it
    (`cache_keeping_checkpoint`); a model without such layers is checkpointed as transformers does."""
    model.activation_checkpointing_enable()
    for module in model.modules():
        if isinstance(module, GradientCheckpointingLayer):
            module._can_checkpoint_with_cache = True  # the replay below keeps the cache right: no reason to drop it
            module._gradient_checkpointing_func = cache_keeping_checkpoint
        elif getattr(module, "gradient_checkpointing", False) and _has_layers(module):
            # the flag on the stack of layers only makes its forward turn use_cache off; the layers checkpoint
            module.gradient_checkpointing = False


def _has_layers(module: nn.Module) -> bool:
    return any(isinstance(m, GradientCheckpointingLayer) for m in module.modules())


def cache_keeping_checkpoint(forward: functools.partial, *args: Any) -> Any:
    """torch's non-reentrant checkpoint of one decoder layer's forward (`forward`: transformers' partial of the
    layer's forward with its keyword arguments), its cache entry restored before the replay."""
    cache = forward.keywords.get("cache") or forward.keywords.get("past_key_values")
    if cache is None:
        return checkpoint(forward, *args, use_reentrant=False)
    index = _layer_index(forward.args[0])
    if index >= len(cache.layers):  # a cache built without the model's config grows its entries as layers write
        raise ValueError(f"the cache has no entry for layer {index} yet: build it with the model's config")
    return checkpoint(_replayable(forward, cache.layers[index]), *args, use_reentrant=False)


def _replayable(forward: Callable[..., Any], entry: Any) -> Callable[..., Any]:
    """forward, run each time on the cache entry's state as it is now (before the layer's first run)."""
    state = dict(vars(entry))

    def run(*args: Any) -> Any:
        vars(entry).clear()
        vars(entry).update(state)
        return forward(*args)

    return run


def _layer_index(layer: nn.Module) -> int:
    """The index of a decoder layer's entry in the cache: its attention's layer_idx."""
    for module in layer.modules():
        if isinstance(getattr(module, "layer_idx", None), int):
            return module.layer_idx
    raise ValueError(f"{type(layer).__name__} has no attention module with a layer_idx: its cache entry is unknown")
