"""GPT-J state dicts between Hugging Face's layout and smp's (SPEC §7.6); exact inverses."""

from __future__ import annotations

from typing import Any, Dict, Optional

from smshim.modelparallel.torch.tensor_parallel.nn.hf_layouts import hf_to_smp, smp_to_hf

__all__ = ["translate_state_dict_to_hf_gptj", "translate_hf_gptj_state_dict_to_smdistributed_gptj"]


def translate_state_dict_to_hf_gptj(state_dict: Dict[str, Any],
        max_seq_len: Optional[int] = None) -> Dict[str, Any]:
    """smp's GPT-J state dict (e.g. `model.state_dict()` of the DistributedModel) in the Hugging
    Face model's layout; `max_seq_len` also writes the causal-mask buffers that transformers 4.x
    kept in state dicts (newer versions do not: leave it None for them)."""
    return smp_to_hf("gptj", state_dict, max_seq_len)


def translate_hf_gptj_state_dict_to_smdistributed_gptj(
        state_dict: Dict[str, Any]) -> Dict[str, Any]:
    """A Hugging Face GPT-J state dict (e.g. a pretrained model's) in smp's
    layout, to load into the model smp made of it."""
    return hf_to_smp("gptj", state_dict)
