"""Tensor-parallel plan for Hugging Face GPT-NeoX. Its fused query_key_value rows are laid out head
by head ([q, k, v] per head), so a contiguous row split gives each rank whole heads."""

from smshim.torch_sagemaker.parallelize.plan import COLWISE, ROWWISE, FamilyPlan

GPT_NEOX = FamilyPlan(
    name="gpt_neox", model_classes=("GPTNeoXForCausalLM",), layer_class="GPTNeoXLayer",
    layers="gpt_neox.layers", embed="gpt_neox.embed_in", head="lm_head", attention="attention",
    layer_plan={
        "attention.query_key_value": COLWISE,
        "attention.dense": ROWWISE,
        "mlp.dense_h_to_4h": COLWISE,
        "mlp.dense_4h_to_h": ROWWISE,
    },
    divisible=("num_attention_heads", "intermediate_size", "vocab_size"),
)
