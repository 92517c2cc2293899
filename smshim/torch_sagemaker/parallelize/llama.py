"""Tensor-parallel plan for Hugging Face Llama (2, 3, 3.1) and Mistral: the same decoder layout."""

from smshim.torch_sagemaker.parallelize.plan import COLWISE, ROWWISE, FamilyPlan

_LAYER = {
    "self_attn.q_proj": COLWISE,
    "self_attn.k_proj": COLWISE,
    "self_attn.v_proj": COLWISE,
    "self_attn.o_proj": ROWWISE,
    "mlp.gate_proj": COLWISE,
    "mlp.up_proj": COLWISE,
    "mlp.down_proj": ROWWISE,
}
_DIVISIBLE = ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size")

LLAMA = FamilyPlan(
    name="llama", model_classes=("LlamaForCausalLM",), layer_class="LlamaDecoderLayer",
    layers="model.layers", embed="model.embed_tokens", head="lm_head", attention="self_attn",
    layer_plan=_LAYER, divisible=_DIVISIBLE,
)

# Mistral with sliding-window attention under CP is not exact (SMP does not support it either);
# api.py refuses it.
MISTRAL = FamilyPlan(
    name="mistral", model_classes=("MistralForCausalLM",), layer_class="MistralDecoderLayer",
    layers="model.layers", embed="model.embed_tokens", head="lm_head", attention="self_attn",
    layer_plan=_LAYER, divisible=_DIVISIBLE,
)
