"""Signed checkpoints (issue 35): a script's own checkpoints resume with no switch, even with numpy
scalars and a transformers config in user_content; a file smshim did not write, or one changed
after writing, is refused as before and runs nothing; SMSHIM_CHECKPOINT_KEY carries one key
across "nodes" (processes with different homes).

Each job is its own process (run_ranks), with its own HOME: a node of a cluster.
"""

import importlib.util
import os
import stat

import pytest
import torch

from smshim.modelparallel.torch.checkpointing import signing
from smshim.testing import run_ranks
from tests.pipeline_models import make_model

needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                        reason="needs transformers (the test extra)")

CLUSTER_KEY = "0123456789abcdef-shared-cluster-secret"


class _RunsCode:
    """Unpickling this calls os.makedirs(marker): what a crafted checkpoint would do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def _as_node(home, key):
    """This process plays a node whose user's home is `home`; `key`: SMSHIM_CHECKPOINT_KEY."""
    os.environ["HOME"] = home
    os.environ.pop("XDG_CONFIG_HOME", None)
    os.environ.pop("SMSHIM_ALLOW_PICKLE", None)
    if key is None:
        os.environ.pop(signing.ENV_KEY, None)
    else:
        os.environ[signing.ENV_KEY] = key


def _setup():
    import smdistributed.modelparallel.torch as smp

    smp.init({"pipeline_parallel_degree": 1})
    model = smp.DistributedModel(make_model("net"))
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01))
    return smp, model, opt


def _job_save(d, home, key):
    """What AWS's GPT-2 script saves: its args (numpy scalars among them), a GPT2Config."""
    import numpy as np
    from transformers import GPT2Config

    _as_node(home, key)
    smp, model, opt = _setup()
    user_content = {
        "cli_args": {"lr": np.float64(1e-3), "max_steps": np.int64(8), "fp16": 0, "note": "hello world"},
        "num_params": np.int64(1234),
        "total_steps": 3,
        "model_config": GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, bos_token_id=0,
                                   eos_token_id=0),
    }
    smp.save_checkpoint(d, "step3", partial=True, model=model, optimizer=opt,
                        user_content=user_content)
    smp.save(user_content, os.path.join(d, "extra.pt"), partial=False)
    path = signing.key_file_path()
    st = os.stat(path) if key is None else None
    return {"key_file": path if key is None else None,
            "key_mode": stat.S_IMODE(st.st_mode) if st else None,
            "dir_mode": stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) if st else None}


def _job_resume(d, home, key):
    _as_node(home, key)
    smp, model, opt = _setup()
    out = {}
    try:
        uc = smp.resume_from_checkpoint(d)
        cfg = uc["model_config"]
        out["resume"] = (type(cfg).__name__, cfg.n_embd, uc["total_steps"],
                         type(uc["cli_args"]["lr"]).__name__, float(uc["cli_args"]["lr"]),
                         uc["cli_args"]["note"])
    except smp.UnsafeCheckpointError as e:
        out["resume"] = f"refused: {e}"
    try:
        out["load"] = int(smp.load(os.path.join(d, "extra.pt"), partial=False)["num_params"])
    except smp.UnsafeCheckpointError as e:
        out["load"] = f"refused: {e}"
    return out


def _save(tmp_path, node="a", key=None):
    d = str(tmp_path / "ckpt")
    return d, run_ranks(_job_save, 1, d, str(tmp_path / f"home_{node}"), key, timeout=120)[0]


def _resume(d, tmp_path, node="a", key=None):
    return run_ranks(_job_resume, 1, d, str(tmp_path / f"home_{node}"), key, timeout=120)[0]


@needs_transformers
def test_own_checkpoint_resumes_without_a_switch_and_stays_a_torch_file(tmp_path):
    d, saved = _save(tmp_path)
    # The per-user key was created on first save, private to the user.
    assert saved["key_file"] == str(tmp_path / "home_a" / ".config" / "smshim" / "checkpoint.key")
    assert saved["key_mode"] == 0o600 and saved["dir_mode"] == 0o700, saved
    out = _resume(d, tmp_path)
    assert out["resume"] == ("GPT2Config", 32, 3, "float64", 1e-3, "hello world"), out
    assert out["load"] == 1234, out
    # The signed files are still plain torch files (the signature is the zip comment).
    sd = torch.load(os.path.join(d, "step3_partial", "model_0_0.pt"), weights_only=True)
    assert set(make_model("net").state_dict()) <= set(sd)
    uc = torch.load(os.path.join(d, "step3_partial", "user_content.pt"), weights_only=False)
    assert uc["total_steps"] == 3
    assert sorted(os.listdir(os.path.join(d, "step3_partial"))) == [
        "model_0_0.pt", "optimizer_0_0.pt", "user_content.pt"]


def _flip_one_byte(path, old=b"hello world", new=b"hellp world"):
    with open(path, "rb") as fh:
        data = fh.read()
    assert data.count(old) == 1
    with open(path, "wb") as fh:
        fh.write(data.replace(old, new))


@needs_transformers
def test_a_file_changed_after_writing_is_refused(tmp_path):
    d, _ = _save(tmp_path)
    for f in (os.path.join(d, "step3_partial", "user_content.pt"), os.path.join(d, "extra.pt")):
        _flip_one_byte(f)
    out = _resume(d, tmp_path)
    for what, name in (("resume", "user_content.pt"), ("load", "extra.pt")):
        msg = out[what]
        assert msg.startswith("refused: ") and name in msg, out
        # Today's refusal text, and why the signature did not help.
        assert "weights_only=False" in msg and "SMSHIM_ALLOW_PICKLE=1" in msg, msg
        assert "changed after smshim wrote it" in msg, msg


def _job_crafted(d, home):
    _as_node(home, None)
    smp, model, opt = _setup()
    marker = os.path.join(d, "code_ran")
    smp.save_checkpoint(d, "t", model=model, optimizer=opt, user_content={"step": 1})
    evil = os.path.join(d, "t_partial", "user_content.pt")
    out = {}
    # 1) An outsider's file in place of smshim's: unsigned.
    torch.save({"payload": _RunsCode(marker)}, evil)
    # 2) The same with a signature made under another key (a forger without this user's key).
    forged = os.path.join(d, "forged.pt")
    with open(forged, "wb") as fh:
        signing.signing_writer(lambda f: torch.save({"payload": _RunsCode(marker)}, f),
                               signing.Key(b"not-the-users-key-at-all", "forger"))(fh)
    for what, load in (("unsigned", lambda: smp.resume_from_checkpoint(d)),
                       ("forged", lambda: smp.load(forged, partial=False))):
        try:
            load()
            out[what] = "loaded"
        except smp.UnsafeCheckpointError as e:
            out[what] = str(e)
        out[what, "ran"] = os.path.exists(marker)
    return out


def test_a_crafted_checkpoint_is_refused_and_runs_nothing(tmp_path):
    d = str(tmp_path / "ckpt")
    out = run_ranks(_job_crafted, 1, d, str(tmp_path / "home"), timeout=120)[0]
    for what in ("unsigned", "forged"):
        assert out[what] != "loaded" and "weights_only=False" in out[what], out
        assert not out[what, "ran"], f"{what}: code ran"
    assert "another key" in out["forged"], out["forged"]
    assert "signature" not in out["unsigned"], out["unsigned"]  # today's text, unchanged


@needs_transformers
def test_cluster_key_works_across_nodes(tmp_path):
    # Node a saves with the cluster key; node b (another home) resumes with the same key.
    d, _ = _save(tmp_path, "a", CLUSTER_KEY)
    assert not os.path.exists(tmp_path / "home_a" / ".config")  # no per-user key was needed
    out = _resume(d, tmp_path, "b", CLUSTER_KEY)
    assert out["resume"][:3] == ("GPT2Config", 32, 3) and out["load"] == 1234, out
    # Without it, node b (no key of its own yet) cannot verify node a's files: refused, saying
    # why; once node b has its own per-user key, that one does not verify them either.
    out = _resume(d, tmp_path, "b", None)
    assert "has no signing key" in out["resume"] and SIGNING_ENV in out["resume"], out
    _save(tmp_path / "elsewhere", "b", None)  # creates node b's per-user key
    out = _resume(d, tmp_path / "elsewhere", "b", None)
    assert "another key" in out["resume"] and SIGNING_ENV in out["resume"], out


SIGNING_ENV = signing.ENV_KEY


# The signing module in-process (no smp state) ---------------------------------------------------


def test_key_rules(tmp_path):
    with pytest.raises(Exception, match=f"{SIGNING_ENV} holds 5 characters.*at least 16"):
        signing.load_key(create=True, env={SIGNING_ENV: "short"})
    env = {"XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    assert signing.load_key(create=False, env=env) is None  # loading never creates a key
    k1 = signing.load_key(create=True, env=env)
    k2 = signing.load_key(create=True, env=env)
    assert k1 == k2 and len(k1.secret) == 32
    path = signing.key_file_path(env)
    os.chmod(path, 0o644)  # readable by others: not trusted
    assert signing.load_key(create=True, env=env) is None
    os.chmod(path, 0o600)
    assert signing.load_key(create=False, env=env) == k1


def test_signature_roundtrip_in_memory(tmp_path):
    key = signing.Key(b"k" * 32, "test")
    path = str(tmp_path / "f.pt")
    with open(path, "wb") as fh:
        signing.signing_writer(lambda f: torch.save({"x": torch.arange(4)}, f), key)(fh)
    ok = signing.read_verified(path, key)
    assert ok.data is not None and ok.signed
    assert signing.read_verified(path, signing.Key(b"j" * 32, "other")).data is None
    plain = str(tmp_path / "plain.pt")
    torch.save({"x": 1}, plain)
    v = signing.read_verified(plain, key)
    assert v.data is None and not v.signed
    # A tensor byte changed: the zip is still readable, the signature is not valid.
    with open(path, "rb") as fh:
        data = bytearray(fh.read())
    i = data.find(torch.arange(4).numpy().tobytes())
    data[i] ^= 1
    with open(path, "wb") as fh:
        fh.write(data)
    assert torch.load(path, weights_only=True)["x"][0].item() == 1
    bad = signing.read_verified(path, key)
    assert bad.data is None and bad.signed and "changed after" in bad.problem


def _key_id(config_home):
    os.environ["XDG_CONFIG_HOME"] = config_home
    os.environ.pop(SIGNING_ENV, None)
    return signing.load_key(create=True).key_id


def test_a_key_file_made_by_another_rank_meanwhile_is_the_one_used(tmp_path, monkeypatch):
    # Another rank of the node creates the key file just as this one looks for it: this rank
    # reads that key (no key would leave its checkpoints unsigned).
    env = {"XDG_CONFIG_HOME": str(tmp_path)}
    path = signing.key_file_path(env)
    real_exists = os.path.exists

    def made_meanwhile(p):
        if p == path and not real_exists(p):
            signing._create_key_file(path)
        return real_exists(p)

    monkeypatch.setattr(os.path, "exists", made_meanwhile)
    key = signing.load_key(create=True, env=env)
    monkeypatch.undo()
    assert key is not None and key == signing._read_key_file(path)


def test_ranks_of_one_node_create_one_key(tmp_path):
    # Four ranks sharing a home create the key at the same moment: all end up with the same one.
    ids = run_ranks(_key_id, 4, str(tmp_path / "cfg"), timeout=60)
    assert len(set(ids)) == 1, ids
    assert os.listdir(tmp_path / "cfg" / "smshim") == ["checkpoint.key"]  # no temporary left
