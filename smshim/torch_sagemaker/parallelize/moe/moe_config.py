"""`torch.sagemaker.moe.moe_config.MoEConfig`: the Mixture-of-Experts settings passed as
`tsm.transform(model, config=MoEConfig(...))` (argument names and defaults as documented by AWS)."""

from __future__ import annotations

from dataclasses import dataclass

LOAD_BALANCING = ("aux_loss", "sinkhorn", "balanced", "none")


@dataclass
class MoEConfig:
    """smp_moe: use the expert-parallel MoE implementation. random_seed: seed for random ops in
    the expert-parallel modules. moe_load_balancing: "aux_loss" (top-k routing plus the
    Switch-style load-balancing loss × moe_aux_loss_coeff), "sinkhorn" (top-k of the
    Sinkhorn-normalised router scores while training), "balanced" (each expert takes at most its
    even share of tokens while training), "none" (plain top-k, no auxiliary loss).
    global_token_shuffle: shuffle tokens across the EP group before dispatch (not supported here:
    accepted only as False). moe_all_to_all_dispatcher: dispatch with all-to-all (the only
    dispatcher here). moe_aux_loss_coeff / moe_z_loss_coeff: weights of the load-balancing and
    router z-losses (added to the loss when moe_load_balancing is not "none").
    use_cpu_initialization: accepted (AWS's example passes it), no effect."""

    smp_moe: bool = True
    random_seed: int = 12345
    moe_load_balancing: str = "sinkhorn"
    global_token_shuffle: bool = False
    moe_all_to_all_dispatcher: bool = True
    moe_aux_loss_coeff: float = 0.001
    moe_z_loss_coeff: float = 0.001
    use_cpu_initialization: bool = False

    def __post_init__(self):
        if self.moe_load_balancing not in LOAD_BALANCING:
            raise ValueError(f"moe_load_balancing must be one of {LOAD_BALANCING}, not "
                             f"{self.moe_load_balancing!r}")
        if self.global_token_shuffle:
            raise NotImplementedError("MoEConfig(global_token_shuffle=True) is not supported by "
                                      "smshim; leave it False")
        if not self.moe_all_to_all_dispatcher:
            raise NotImplementedError("smshim dispatches tokens with all-to-all only: leave "
                                      "moe_all_to_all_dispatcher=True")
