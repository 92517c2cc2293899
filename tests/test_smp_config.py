"""smp configuration (SPEC §3) and initialisation: resolve_config in-process, the same bad configs
through smp.init on 2 ranks, SM_HP_MP_PARAMETERS merge, second init, reset, state, Adv rejections."""

from __future__ import annotations

import json
import logging
import time

import pytest
import torch

import smshim.modelparallel.torch as smp
from smshim.modelparallel.torch.config import SMPConfig, SMPConfigError, resolve_config
from smshim.modelparallel.torch.errors import SMPNotInitializedError, SMPUnsupportedError
from smshim.testing import run_ranks

ENV = "SM_HP_MP_PARAMETERS"

# (case id, init config, SM_HP_MP_PARAMETERS value or None, exception type, words the message
# must contain). World size 2 throughout, so every case is valid except for its one fault.
BAD = [
    ("unknown-key", {"microbatch": 4, "ddp": True}, None, SMPConfigError, ["'microbatch'", "microbatches"]),
    ("unknown-key-env", {"ddp": True}, '{"pipline": "simple"}', SMPConfigError, ["'pipline'", ENV]),
    ("env-not-json", {"ddp": True}, "{partitions: 2", SMPConfigError, [ENV, "JSON"]),
    ("env-not-object", {"ddp": True}, "[2]", SMPConfigError, [ENV, "JSON object"]),
    ("config-not-dict", [("partitions", 2)], None, SMPConfigError, ["dict"]),
    ("type-str", {"microbatches": "4", "ddp": True}, None, SMPConfigError, ["'microbatches'", "'4'", "int"]),
    ("type-bool-for-int", {"microbatches": True, "ddp": True}, None, SMPConfigError, ["'microbatches'", "True", "bool"]),
    ("type-float-for-int", {"pipeline_parallel_degree": 2.0}, None, SMPConfigError, ["'pipeline_parallel_degree'", "2.0"]),
    ("type-int-for-bool", {"ddp": 1}, None, SMPConfigError, ["'ddp'", "bool"]),
    ("type-str-for-float", {"memory_weight": "0.5", "ddp": True}, None, SMPConfigError, ["'memory_weight'", "number"]),
    ("range-microbatches", {"microbatches": 0, "ddp": True}, None, SMPConfigError, ["'microbatches'", ">= 1"]),
    ("choice-pipeline", {"pipeline": "gpipe", "ddp": True}, None, SMPConfigError, ["'pipeline'", "'gpipe'", "'interleaved'", "'simple'"]),
    ("choice-optimize", {"optimize": "fast", "ddp": True}, None, SMPConfigError, ["'optimize'", "'speed'", "'memory'"]),
    ("choice-placement", {"placement_strategy": "DPP", "ddp": True}, None, SMPConfigError, ["'placement_strategy'", "'DPP'", "cluster"]),
    ("choice-backend", {"ddp_dist_backend": "mpi", "ddp": True}, None, SMPConfigError, ["'ddp_dist_backend'", "'mpi'", "'gloo'"]),
    ("range-memory-weight", {"memory_weight": 1.5, "ddp": True}, None, SMPConfigError, ["'memory_weight'", "1.5", "[0, 1]"]),
    ("range-active", {"microbatches": 4, "active_microbatches": 5, "ddp": True}, None, SMPConfigError, ["'active_microbatches'", "5", "microbatches=4"]),
    ("range-default-partition", {"partitions": 2, "auto_partition": False, "default_partition": 2}, None, SMPConfigError, ["'default_partition'", "2", "[0, pipeline_parallel_degree=2)"]),
    ("range-ddp-port", {"ddp": True, "ddp_port": 70000}, None, SMPConfigError, ["'ddp_port'", "70000", "65535"]),
    ("range-horizon", {"ddp": True, "activation_loading_horizon": 0}, None, SMPConfigError, ["'activation_loading_horizon'"]),
    ("dep-default-partition", {"partitions": 2, "auto_partition": False}, None, SMPConfigError, ["'auto_partition'", "'default_partition'"]),
    ("dep-ddp-port", {"partitions": 2, "ddp_port": 29999}, None, SMPConfigError, ["'ddp_port'", "29999", "'ddp'"]),
    ("dep-ddp-backend", {"partitions": 2, "ddp_dist_backend": "gloo"}, None, SMPConfigError, ["'ddp_dist_backend'", "'gloo'", "'ddp'"]),
    ("dep-horovod-ddp", {"horovod": True, "ddp": True}, None, SMPConfigError, ["'horovod'", "'ddp'"]),
    ("alias-conflict", {"partitions": 2, "pipeline_parallel_degree": 1}, None, SMPConfigError, ["'partitions'=2", "'pipeline_parallel_degree'=1"]),
    ("alias-conflict-env", {"ddp": True}, '{"partitions": 2, "pipeline_parallel_degree": 1}', SMPConfigError, ["'partitions'", "'pipeline_parallel_degree'", ENV]),
    ("world-not-divisible", {"partitions": 4}, None, SMPConfigError, ["world size 2", "pipeline_parallel_degree 4", "divisible"]),
    ("world-needs-ddp", {}, None, SMPConfigError, ["world size 2", "= 1", "ddp"]),
    ("world-needs-ddp-env", {"ddp": True}, '{"ddp": false}', SMPConfigError, ["world size 2", "ddp"]),
    ("world-not-divisible-tp", {"tensor_parallel_degree": 4}, None, SMPConfigError, ["world size 2", "tensor_parallel_degree 4", "divisible"]),
    ("mp-fp16-bf16", {"partitions": 2, "fp16": True, "bf16": True}, None, SMPConfigError, ["'fp16'", "'bf16'", "both"]),
    ("mp-fp16-bf16-env", {"partitions": 2, "fp16": True}, '{"bf16": true}', SMPConfigError, ["'fp16'", "'bf16'", ENV]),
    ("mp-fp16-params", {"partitions": 2, "fp16_params": True}, None, SMPConfigError, ["'fp16_params'", "'fp16'"]),
    ("dep-shard-ddp", {"partitions": 2, "shard_optimizer_state": True}, None, SMPConfigError, ["'shard_optimizer_state'", "'ddp'"]),
    ("sdp-env-needs-ddp", {"ddp": True}, '{"sharded_data_parallel_degree": 2, "ddp": false}', SMPConfigError, ["world size 2", "ddp"]),
    ("sdp-env-pp", {"ddp": True, "partitions": 2}, '{"sharded_data_parallel_degree": 2}', SMPConfigError, ["'sharded_data_parallel_degree'=2", ENV, "'pipeline_parallel_degree'=2"]),
    ("adv-horovod", {"partitions": 2, "horovod": True}, None, SMPUnsupportedError, ["'horovod'"]),
    ("sdp-shard-optimizer-state", {"ddp": True, "sharded_data_parallel_degree": 2, "shard_optimizer_state": True}, None, SMPConfigError, ["'sharded_data_parallel_degree'=2", "'shard_optimizer_state'=True"]),
    ("sdp-world", {"ddp": True, "sharded_data_parallel_degree": 4}, None, SMPConfigError, ["'sharded_data_parallel_degree'=4", "world size 2"]),
    ("sdp-tp", {"ddp": True, "sharded_data_parallel_degree": 2, "tensor_parallel_degree": 2}, None, SMPUnsupportedError, ["'sharded_data_parallel_degree'=2", "'tensor_parallel_degree'=2"]),
    # The no-effect knobs are still validated (issue 35).
    ("type-offload", {"ddp": True, "offload_activations": 1}, None, SMPConfigError, ["'offload_activations'", "bool"]),
    ("type-delayed", {"ddp": True, "delayed_parameter_initialization": "yes"}, None, SMPConfigError, ["'delayed_parameter_initialization'", "bool"]),
    ("type-fast-mode", {"ddp": True, "fast_mode": 0}, None, SMPConfigError, ["'fast_mode'", "bool"]),
    ("type-static-mode-env", {"ddp": True}, '{"static_mode": "false"}', SMPConfigError, ["'static_mode'", ENV]),
    ("range-sdp-bucket", {"ddp": True, "sdp_reduce_bucket_size": 0}, None, SMPConfigError, ["'sdp_reduce_bucket_size'", ">= 1"]),
    ("type-sdp-bucket", {"ddp": True, "sdp_reduce_bucket_size": 2.5}, None, SMPConfigError, ["'sdp_reduce_bucket_size'", "float"]),
    ("range-sdp-persist", {"ddp": True, "sdp_param_persistence_threshold": -1}, None, SMPConfigError, ["'sdp_param_persistence_threshold'"]),
    ("range-sdp-clip", {"ddp": True, "sdp_gradient_clipping": -0.5}, None, SMPConfigError, ["'sdp_gradient_clipping'", ">= 0"]),
    ("type-sdp-allgather", {"ddp": True, "sdp_hierarchical_allgather": "true"}, None, SMPConfigError, ["'sdp_hierarchical_allgather'", "bool"]),
    ("range-sdp-degree", {"ddp": True, "sharded_data_parallel_degree": 0}, None, SMPConfigError, ["'sharded_data_parallel_degree'", ">= 1"]),
]
assert len(BAD) >= 15


def _env(raw):
    return {} if raw is None else {ENV: raw}


# resolve_config in-process -------------------------------------------------------------------------
@pytest.mark.parametrize("case,config,env,exc,words", BAD, ids=[b[0] for b in BAD])
def test_bad_config_in_process(case, config, env, exc, words):
    with pytest.raises(exc) as info:
        resolve_config(config, 2, env=_env(env))
    for w in words:
        assert w in str(info.value), (case, str(info.value))
    if exc is SMPConfigError:
        assert isinstance(info.value, ValueError)
    else:
        assert isinstance(info.value, NotImplementedError)


def test_defaults():
    cfg = resolve_config(None, 1, env={})
    assert cfg == SMPConfig()
    assert cfg.pipeline_parallel_degree == cfg.partitions == 1
    assert cfg.microbatches == 1 and cfg.pipeline == "interleaved" and cfg.optimize == "speed"
    assert cfg.placement_strategy == "cluster" and cfg.auto_partition and cfg.default_partition == 0
    assert cfg.memory_weight == 0.2 and cfg.active_microbatches == 1
    assert cfg.ddp is False and cfg.ddp_port is None and cfg.ddp_dist_backend == "auto"
    assert not (cfg.fp16 or cfg.bf16 or cfg.shard_optimizer_state or cfg.prescaled_batch)
    assert cfg.tensor_parallel_degree == 1 and cfg.sharded_data_parallel_degree == 1


def test_derived_defaults():
    assert resolve_config({"optimize": "memory"}, 1, env={}).memory_weight == 0.8
    assert resolve_config({"optimize": "speed"}, 1, env={}).memory_weight == 0.2
    assert resolve_config({"optimize": "memory", "memory_weight": 0.3}, 1, env={}).memory_weight == 0.3
    assert resolve_config({"memory_weight": None}, 1, env={}).memory_weight == 0.2
    assert resolve_config({"partitions": 2, "microbatches": 8}, 2, env={}).active_microbatches == 4
    assert resolve_config({"partitions": 2, "microbatches": 3}, 2, env={}).active_microbatches == 3
    assert resolve_config({"partitions": 4, "microbatches": 16}, 4, env={}).active_microbatches == 6
    assert resolve_config({"ddp": True}, 2, env={"MASTER_PORT": "29411"}).ddp_port == 29411


def test_json_int_for_float_and_numeric_types():
    cfg = resolve_config(None, 1, env={ENV: '{"memory_weight": 1, "microbatches": 2}'})
    assert cfg.memory_weight == 1.0 and isinstance(cfg.memory_weight, float)
    assert resolve_config({"memory_weight": 0}, 1, env={}).memory_weight == 0.0


def test_simple_pipeline():
    cfg = resolve_config({"pipeline": "simple", "microbatches": 8, "partitions": 2}, 2, env={})
    assert cfg.pipeline == "simple" and cfg.active_microbatches == 8
    cfg = resolve_config({"pipeline": "simple", "microbatches": 8, "active_microbatches": 8},
                         1, env={})
    assert cfg.pipeline == "simple"


def test_simple_with_fewer_active_switches_to_interleaved(caplog):
    with caplog.at_level(logging.WARNING, logger="smshim.modelparallel.torch.config"):
        cfg = resolve_config({"pipeline": "simple", "microbatches": 8, "active_microbatches": 3},
                             1, env={})
    assert cfg.pipeline == "interleaved" and cfg.active_microbatches == 3
    assert any("interleaved" in r.getMessage() and "active_microbatches=3" in r.getMessage()
               for r in caplog.records)


def test_alias_and_merge():
    assert resolve_config({"partitions": 2}, 2, env={}).pipeline_parallel_degree == 2
    assert resolve_config({"partitions": 2, "pipeline_parallel_degree": 2}, 2,
                          env={}).pipeline_parallel_degree == 2
    # The environment wins over the init() dict, key by key, alias or not.
    env = {ENV: json.dumps({"partitions": 4, "microbatches": 8})}
    cfg = resolve_config({"pipeline_parallel_degree": 2, "microbatches": 2, "ddp": True}, 8, env=env)
    assert (cfg.pipeline_parallel_degree, cfg.microbatches, cfg.ddp) == (4, 8, True)
    env = {ENV: json.dumps({"ddp": True})}
    assert resolve_config({"ddp": False}, 2, env=env).ddp is True
    assert resolve_config(None, 1, env={ENV: ""}) == SMPConfig()


def test_mixed_precision_and_sharding_accepted():
    cfg = resolve_config({"partitions": 2, "fp16": True, "fp16_params": True}, 2, env={})
    assert cfg.fp16 and cfg.fp16_params and not cfg.bf16
    cfg = resolve_config({"partitions": 2, "bf16": True, "ddp": True,
                          "shard_optimizer_state": True}, 4, env={})
    assert cfg.bf16 and cfg.shard_optimizer_state and cfg.ddp


def test_accepted_adv_values():
    cfg = resolve_config({"prescaled_batch": True, "skip_tracing": True, "contiguous": False,
                          "tensor_parallel_seed": 7, "activation_loading_horizon": 8,
                          "tensor_parallel_degree": 1, "fp16": False, "bf16": False,
                          "sharded_data_parallel_degree": 1, "horovod": False,
                          "deterministic_server": True, "placement_strategy": "tpd",
                          "auto_partition": True, "default_partition": 0}, 1, env={})
    assert cfg.prescaled_batch and cfg.skip_tracing and not cfg.contiguous
    assert cfg.tensor_parallel_seed == 7 and cfg.activation_loading_horizon == 8
    assert cfg.placement_strategy == "TPD" and cfg.deterministic_server


# Every key AWS's GPT-2 example (train_gpt_simple.py) passes to smp.init, with its CLI defaults.
AWS_GPT2_CONFIG = {
    "ddp": True, "tensor_parallel_degree": 1, "pipeline_parallel_degree": 1, "microbatches": 1,
    "shard_optimizer_state": False, "prescaled_batch": True, "fp16": False, "bf16": False,
    "offload_activations": False, "delayed_parameter_initialization": False, "optimize": "speed",
    "placement_strategy": "cluster", "activation_loading_horizon": 4, "skip_tracing": False,
    "auto_partition": True, "default_partition": 0, "static_mode": False, "fast_mode": False,
    "sharded_data_parallel_degree": 1,
}


def test_every_smp_v1_key_is_accepted(caplog):
    import logging

    from smshim.modelparallel.torch import config as config_mod

    on = dict(AWS_GPT2_CONFIG, offload_activations=True, delayed_parameter_initialization=True,
              skip_tracing=True, static_mode=True, fast_mode=True, activation_loading_horizon=2,
              active_microbatches=1, sdp_reduce_bucket_size=5e8, sdp_param_persistence_threshold=1e6,
              sdp_max_live_parameters=int(1e9), sdp_hierarchical_allgather=False,
              sdp_gradient_clipping=0.5, contiguous=True, tensor_parallel_seed=3,
              deterministic_server=False, memory_weight=0.2, fp16_params=False, horovod=False,
              pipeline="interleaved", ddp_dist_backend="auto")
    config_mod._logged_no_effect.clear()
    with caplog.at_level(logging.INFO, logger=config_mod.__name__):
        cfg = resolve_config(on, 2, env={})
        resolve_config(on, 2, env={})  # the same values again: not logged again
    assert cfg.fast_mode and cfg.static_mode and cfg.offload_activations and cfg.skip_tracing
    assert cfg.sdp_reduce_bucket_size == 500_000_000 and isinstance(cfg.sdp_reduce_bucket_size, int)
    assert cfg.sdp_param_persistence_threshold == 1_000_000 and not cfg.sdp_hierarchical_allgather
    assert cfg.activation_loading_horizon == 2 and cfg.sdp_gradient_clipping == 0.5
    lines = [r.getMessage() for r in caplog.records if "no effect" in r.getMessage()]
    assert len(lines) == 1, lines
    for key in config_mod.NO_EFFECT:
        assert f"{key}=" in lines[0], (key, lines[0])
    assert resolve_config(AWS_GPT2_CONFIG, 4, env={}).ddp


def test_sharded_data_parallel_accepted():
    # k == world (FULL_SHARD) and k < world (HYBRID_SHARD over world // k replicas).
    for k, world in ((2, 2), (2, 4), (4, 4)):
        cfg = resolve_config({"ddp": True, "sharded_data_parallel_degree": k}, world, env={})
        assert cfg.sharded_data_parallel_degree == k and cfg.sdp_gradient_clipping == 1.0
    cfg = resolve_config({"ddp": True}, 4, env={ENV: '{"sharded_data_parallel_degree": 2}'})
    assert cfg.sharded_data_parallel_degree == 2


def test_world_size_errors_name_the_numbers():
    with pytest.raises(SMPConfigError, match=r"world size 6 .* pipeline_parallel_degree 4"):
        resolve_config({"partitions": 4, "ddp": True}, 6, env={})
    with pytest.raises(SMPConfigError, match=r"world size 8 > pipeline_parallel_degree 4"):
        resolve_config({"partitions": 4}, 8, env={})
    assert resolve_config({"partitions": 4, "ddp": True}, 8, env={}).ddp


# Before init, Adv entry points (in-process: this process never initialises smp) --------------------
def test_before_init_errors():
    assert not smp.is_initialized()
    for fn in (smp.rank, smp.size, smp.local_rank, smp.pp_rank, smp.dp_size, smp.rdp_rank,
               smp.mp_size, smp.tp_rank, smp.get_pp_group, smp.get_dp_process_group,
               smp.num_microbatches, smp.barrier):
        with pytest.raises(SMPNotInitializedError, match="smp.init"):
            fn()
    with pytest.raises(SMPNotInitializedError, match="smp.init"):
        smp.allgather(1, smp.DP_GROUP)
    with pytest.raises(SMPNotInitializedError, match="smp.state.cfg"):
        smp.state.cfg.fp16


def test_adv_entry_points():
    with smp.tensor_parallelism(enabled=False), smp.delay_param_initialization(enabled=False), \
            smp.model_creation(tensor_parallelism=False, dtype=torch.float32):
        layer = torch.nn.Linear(2, 2)
    smp.set_tensor_parallelism(layer, enabled=False)
    for call, name in [
        (lambda: smp.delay_param_initialization(), "smp.delay_param_initialization"),
    ]:
        with pytest.raises(NotImplementedError, match=name):
            call()
    assert issubclass(smp.nn.DistributedTransformer, torch.nn.Module)


def test_error_classes():
    assert issubclass(smp.SMPConfigError, ValueError) and issubclass(smp.SMPConfigError, smp.SMPError)
    assert issubclass(smp.TensorSplitError, ValueError)
    assert issubclass(smp.FwdExecutionNotInStepFnError, RuntimeError)
    assert issubclass(smp.BwdExecutionNotInStepFnError, RuntimeError)
    for cls in (smp.SMPValidationError, smp.MultipleDistributedModelError,
                smp.InvalidPartitionIDError, smp.SMPRuntimeError, smp.SMPUnsupportedError):
        assert issubclass(cls, smp.SMPError)
    assert smp.errors.SMPConfigError is SMPConfigError


def test_aliases():
    import smdistributed.modelparallel.torch as sm

    assert sm is smp
    assert smp.WORLD == smp.CommGroup.WORLD == 0 and smp.MP_GROUP == 5 and smp.DP_GROUP == 4
    assert [g.name for g in smp.CommGroup] == ["WORLD", "PP_GROUP", "TP_GROUP", "RDP_GROUP",
                                               "DP_GROUP", "MP_GROUP"]
    assert smp.PP_RANK is smp.RankType.PP_RANK and smp.WORLD_RANK == 0


# Through smp.init on 2 ranks ------------------------------------------------------------------------
def _bad_configs_rank(cases):
    import os

    import torch.distributed as dist

    import smshim.modelparallel.torch as smp

    out = []
    for case, config, env, _, _ in cases:
        os.environ.pop(ENV, None)
        if env is not None:
            os.environ[ENV] = env
        t0 = time.monotonic()
        try:
            smp.init(config)
        except Exception as e:  # noqa: BLE001
            out.append((case, type(e).__name__, str(e), time.monotonic() - t0,
                        dist.is_initialized(), smp.is_initialized()))
        else:
            out.append((case, None, "no error", 0.0, dist.is_initialized(), smp.is_initialized()))
            break
    # nccl on a host without CUDA fails in init(), still before any collective.
    os.environ.pop(ENV, None)
    try:
        smp.init({"ddp": True, "ddp_dist_backend": "nccl"})
    except Exception as e:  # noqa: BLE001
        out.append(("nccl-no-cuda", type(e).__name__, str(e), 0.0, dist.is_initialized(),
                    smp.is_initialized()))
    # The ranks are still in step: a valid init and a collective work.
    smp.init({"ddp": True})
    return out, smp.allgather(smp.rank(), smp.WORLD)


def test_bad_configs_through_init_on_every_rank():
    results = run_ranks(_bad_configs_rank, 2, BAD, timeout=120)
    (r0, g0), (r1, g1) = results
    assert g0 == g1 == [0, 1]
    assert [x[:3] for x in r0] == [x[:3] for x in r1]  # identical errors on every rank
    assert len(r0) == len(BAD) + (0 if torch.cuda.is_available() else 1)
    for (case, _, env, exc, words), (got_case, got_type, msg, elapsed, dist_up, smp_up) in zip(BAD, r0):
        assert got_case == case
        assert got_type == exc.__name__, (case, msg)
        for w in words:
            assert w in msg, (case, msg)
        assert elapsed < 5.0, (case, elapsed)
        assert not dist_up and not smp_up, case  # raised before any process group existed
    if not torch.cuda.is_available():
        case, typ, msg, _, dist_up, _ = r0[-1]
        assert case == "nccl-no-cuda" and typ == "SMPConfigError" and "'ddp_dist_backend'" in msg
        assert not dist_up


# Init behaviour -----------------------------------------------------------------------------------
class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        if record.name == "smshim.modelparallel.torch":  # init's own messages
            self.messages.append((record.levelname, record.getMessage()))


def _init_behaviour_rank():
    import smshim.modelparallel.torch as smp

    handler = _Records()
    log = logging.getLogger("smshim.modelparallel.torch")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    calls = []
    smp.state.register_reset_callback(lambda: calls.append("reset"))
    smp.init({"microbatches": 2, "pipeline_parallel_degree": 1, "ddp": True, "prescaled_batch": True})
    cfg = smp.state.cfg
    seen = {
        "initialized": smp.is_initialized(),
        "cfg": (cfg.microbatches, cfg.pipeline_parallel_degree, cfg.ddp, cfg.fp16, cfg.bf16,
                cfg.prescaled_batch, cfg.shard_optimizer_state, cfg.partitions,
                cfg.active_microbatches),
        "num_microbatches": smp.num_microbatches(),
        "translate": list(smp.state.module_manager.translate_functions),
    }
    n_before = len(handler.messages)
    smp.init()
    smp.init({"microbatches": 2, "ddp": True, "prescaled_batch": True})  # resolves the same
    smp.init({"microbatches": 8, "prescaled_batch": False})
    seen["second_init_logs"] = handler.messages[n_before:]
    seen["cfg_after_second"] = smp.state.cfg.microbatches
    smp.state.model, smp.state.optimizer, smp.state.microbatch = object(), object(), 3
    smp.state.module_manager.translate_functions.append(len)
    smp.reset()
    seen["after_reset"] = (smp.state.model, smp.state.optimizer, smp.state.microbatch,
                           smp.state.module_manager.translate_functions, calls,
                           smp.is_initialized(), smp.state.cfg.microbatches)
    seen["still_works"] = smp.allgather(smp.rank(), smp.WORLD)
    log.removeHandler(handler)
    return seen


def test_env_merge_second_init_reset_and_state():
    env = {ENV: json.dumps({"microbatches": 4, "partitions": 2})}
    results = run_ranks(_init_behaviour_rank, 2, env=env, timeout=90)
    for seen in results:
        assert seen["initialized"]
        # SM_HP_MP_PARAMETERS overrides the init() dict: microbatches 4 and pp 2 (alias).
        assert seen["cfg"] == (4, 2, True, False, False, True, False, 2, 4)
        assert seen["num_microbatches"] == 4 and seen["translate"] == []
        logs = seen["second_init_logs"]
        assert len(logs) == 3
        assert logs[0][0] == logs[1][0] == "INFO" and "already initialised" in logs[1][1]
        # microbatches=8 loses to the environment's 4 anyway; prescaled_batch would change.
        assert logs[2][0] == "WARNING" and "ignored" in logs[2][1]
        changes = logs[2][1].split("would have set")[1]
        assert "prescaled_batch=False" in changes and "ddp=False" in changes
        assert "microbatches" not in changes
        assert seen["cfg_after_second"] == 4
        assert seen["after_reset"] == (None, None, 0, [], ["reset"], True, 4)
        assert seen["still_works"] == [0, 1]
