"""tsm.init's configuration and layout: the job's values win, unknown keys are tolerated, bad
values are refused on every rank naming the key; tsm.state's ranks and groups (TP fastest, then
CP); `import torch.sagemaker` by the start-up alias, without touching torch otherwise."""

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest

from smshim.testing import run_ranks
from smshim.torch_sagemaker.config import TsmConfigError, load_config, resolve_degrees


def test_job_values_override_the_argument_and_unknown_keys_warn(tmp_path, caplog):
    path = tmp_path / "smp_config.json"
    path.write_text(json.dumps({"hybrid_shard_degree": 2, "tensor_parallel_degree": 2}))
    env = {"SM_HP_MP_PARAMETERS": json.dumps({"hybrid_shard_degree": 4, "placement_strategy": "cluster"})}
    with caplog.at_level(logging.WARNING):
        cfg = load_config(str(path), env)
    assert cfg.hybrid_shard_degree == 4 and cfg.tensor_parallel_degree == 2
    assert "placement_strategy" in caplog.text
    assert load_config({"sm_activation_offloading": "false"}, {}).sm_activation_offloading is False


@pytest.mark.parametrize("cfg,world,needle", [
    ({"hybrid_shard_degree": 3}, 4, "'hybrid_shard_degree'=3"),
    ({"hybrid_shard_degree": 8}, 4, "'hybrid_shard_degree'=8"),
    ({"tensor_parallel_degree": 3}, 4, "'tensor_parallel_degree'=3"),
    ({"tensor_parallel_degree": 2, "expert_parallel_degree": 2}, 4, "'expert_parallel_degree'=2"),
    ({"context_parallel_degree": 2, "hybrid_shard_degree": 1}, 4, "'context_parallel_degree'=2"),
    ({"tensor_parallel_degree": 2, "hybrid_shard_degree": 4}, 4, "'hybrid_shard_degree'=4"),
    ({"activation_loading_horizon": 0}, 4, "'activation_loading_horizon'=0"),
])
def test_impossible_combinations_name_the_key(cfg, world, needle):
    with pytest.raises(TsmConfigError) as e:
        resolve_degrees(load_config(cfg, {}), world)
    assert needle in str(e.value)


def test_wrong_types_name_the_key():
    with pytest.raises(TsmConfigError, match="'hybrid_shard_degree' must be an integer"):
        load_config({"hybrid_shard_degree": 2.5}, {})
    with pytest.raises(TsmConfigError, match="SM_HP_MP_PARAMETERS"):
        load_config(None, {"SM_HP_MP_PARAMETERS": "{not json"})


def _init_catching(cfg):
    import torch.distributed as dist
    import torch.sagemaker as tsm

    dist.init_process_group("gloo")
    try:
        tsm.init(cfg)
    except ValueError as e:
        dist.barrier()  # nobody is stuck in a collective
        return str(e)
    return None


def test_impossible_degree_is_refused_on_every_rank():
    msgs = run_ranks(_init_catching, 4, {"hybrid_shard_degree": 3}, timeout=60)
    assert all(m and "'hybrid_shard_degree'=3" in m for m in msgs), msgs


def _layout(cfg):
    import torch.distributed as dist
    import torch.sagemaker as tsm

    dist.init_process_group("gloo")
    tsm.init(cfg)
    s = tsm.state
    ranks = lambda g: None if g is None else dist.get_process_group_ranks(g)  # noqa: E731
    tsm.state.tensor_parallel_degree = 1  # writable, as AWS's scripts expect
    return {"tp_rank": s.tp_rank, "cp_rank": s.cp_rank, "tp": ranks(s.tp_process_group),
            "cp": ranks(s.cp_process_group), "rep": ranks(s.rep_rank_process_group),
            "dp_rank": s.dp_rank, "rep_rank": s.ranker.get_rep_rank(s.rank),
            "rep_groups": s.ranker.get_rep_groups(), "tp_size_after": s.tp_size,
            "initialized": tsm.is_initialized(), "world": ranks(s.world_process_group),
            "same_model": tsm.transform is not None}


def test_state_layout_tp_fastest_then_cp():
    res = run_ranks(_layout, 4, {"tensor_parallel_degree": 2, "hybrid_shard_degree": 2}, timeout=60)
    assert [r["tp_rank"] for r in res] == [0, 1, 0, 1]
    assert [r["tp"] for r in res] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["dp_rank"] for r in res] == [0, 0, 1, 1]
    assert res[0]["rep_groups"] == [[0], [1], [2], [3]]  # one replica: 2 (tp) x 2 (shard)
    assert res[0]["tp_size_after"] == 1 and all(r["initialized"] for r in res)
    res = run_ranks(_layout, 4, {"context_parallel_degree": 2, "hybrid_shard_degree": 2}, timeout=60)
    assert [r["cp_rank"] for r in res] == [0, 1, 0, 1]
    assert [r["cp"] for r in res] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["rep_rank"] for r in res] == [0, 0, 1, 1]
    assert res[0]["rep_groups"] == [[0, 2], [1, 3]] and res[0]["rep"] == [0, 1]
    assert [r["dp_rank"] for r in res] == [0, 0, 1, 1]


def _transform_identity():
    import torch
    import torch.distributed as dist
    import torch.sagemaker as tsm

    dist.init_process_group("gloo")
    tsm.init({"hybrid_shard_degree": 2})
    m = torch.nn.Linear(2, 2)
    fallback = tsm.state.tp_process_group is None
    return tsm.transform(m) is m, fallback


def test_transform_with_all_degrees_one_returns_the_model():
    assert run_ranks(_transform_identity, 2, timeout=60) == [(True, False)] * 2


def _py(code, env=None):
    full = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=full, timeout=120)


def test_import_torch_sagemaker_in_a_fresh_interpreter():
    r = _py("""
        import sys
        assert "torch" not in sys.modules, "the alias imported torch at start-up"
        import torch
        assert not hasattr(torch, "sagemaker")
        import importlib.util
        import torch.sagemaker as tsm
        import smshim.torch_sagemaker as ours
        assert tsm is ours and torch.sagemaker is tsm
        from torch.sagemaker.delayed_param import DelayedParamIniter
        from torch.sagemaker.grad_norm import clip_grad_norm_
        from torch.sagemaker.distributed.checkpoint.state_dict_saver import async_save
        from torch.sagemaker.utils.process_group_utils import get_global_ranks
        import torch.sagemaker.state_handler
        assert tsm.state is torch.sagemaker.state_handler.state
        assert ours.__spec__.name == "smshim.torch_sagemaker"
        print("ok")
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_a_genuine_torch_sagemaker_is_not_shadowed(tmp_path):
    # A stand-in torch with its own `sagemaker` subpackage, first on the path.
    pkg = tmp_path / "torch"
    (pkg / "sagemaker").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sagemaker" / "__init__.py").write_text("GENUINE = True\n")
    r = _py("import torch.sagemaker as t; print(getattr(t, 'GENUINE', False))",
            env={"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "True"
    r = _py("import torch, sys; import torch.sagemaker", env={"SMSHIM_ALIAS": "0"})
    assert r.returncode != 0 and "torch.sagemaker" in r.stderr


def _transform_unsupported_tp2():
    import torch
    import torch.distributed as dist
    import torch.sagemaker as tsm

    dist.init_process_group("gloo")
    tsm.init({"tensor_parallel_degree": 2})
    try:
        tsm.transform(torch.nn.Linear(2, 2))
    except TypeError as e:
        return str(e)
    return None


def test_transform_of_an_unsupported_model_names_it_and_the_supported_ones():
    msgs = run_ranks(_transform_unsupported_tp2, 2, timeout=60)
    assert all(m and "Linear" in m and "LlamaForCausalLM" in m for m in msgs), msgs
