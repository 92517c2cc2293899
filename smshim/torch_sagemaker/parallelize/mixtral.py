"""Plan for Hugging Face Mixtral: expert parallelism (its experts split over the EP group); not
tensor parallelism here (SMP does not combine the two either)."""

from smshim.torch_sagemaker.parallelize.plan import FamilyPlan

MIXTRAL = FamilyPlan(
    name="mixtral", model_classes=("MixtralForCausalLM",), layer_class="MixtralDecoderLayer",
    layers="model.layers", embed="model.embed_tokens", head="lm_head", attention="self_attn",
    supports_tp=False, supports_cp=False, supports_ep=True,
)
