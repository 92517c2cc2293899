"""What tensor parallelism splits in one model family: a declarative plan, one per family module."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Tuple

# Styles of one split module.
COLWISE = "colwise"  # output features split: weight (and bias) Shard(0), input replicated
ROWWISE = "rowwise"  # input features split: weight Shard(1), bias replicated, output all-reduced


@dataclass(frozen=True)
class FamilyPlan:
    """Paths are attribute paths from the causal-LM root (`layers`, `embed`, `head`) or from one
    decoder layer (`layer_plan`, `attention`)."""

    name: str
    model_classes: Tuple[str, ...]  # HF causal-LM class names this plan applies to
    layer_class: str  # the decoder layer class (FSDP auto-wrap unit)
    layers: str
    embed: str
    head: str
    attention: str  # inside a layer: the module whose heads are split (its dropout is TP-local)
    layer_plan: Mapping[str, str] = field(default_factory=dict)
    # config attributes that must divide by the TP degree
    divisible: Tuple[str, ...] = ("num_attention_heads", "vocab_size")
    supports_tp: bool = True
    supports_cp: bool = True
    supports_ep: bool = False
