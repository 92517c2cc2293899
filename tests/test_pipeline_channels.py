"""The pipeline transport's tensor channels (pipeline/channels.py): which tensors leave their frame
for the device channel, the frame they leave, and the same training results with the device
channel's groups replaced by gloo (SMSHIM_DEVICE_CHANNEL=gloo-test, a test-only switch)."""

import collections
import os
import pickle
import subprocess
import sys
import types

import numpy as np
import pytest
import torch

from smshim.modelparallel.torch.pipeline import channels
from smshim.modelparallel.torch.pipeline.frames import _DTYPE_LIST, _DTYPE_OF, _PREFIX
from smshim.modelparallel.torch.pipeline.messages import VALUE, Message
from smshim.modelparallel.torch.pipeline.transport import Transport
from smshim.runtime.devices import device_backend_for
from smshim.testing import run_ranks


def _fake_cuda(shape=(2, 3), dtype=torch.float32):
    """Stands for a CUDA tensor on a machine without one: what the transport reads of it."""
    shape = torch.Size(shape)
    return types.SimpleNamespace(shape=shape, dtype=dtype, is_cuda=True, numel=shape.numel)


# ---- the choice of path ---------------------------------------------------------------------

def test_a_cuda_tensor_takes_the_device_path_and_a_cpu_tensor_never_does():
    assert channels.takes_device_path(_fake_cuda(), everything=False)
    assert not channels.takes_device_path(torch.ones(3), everything=False)
    assert not channels.takes_device_path(torch.ones(3, dtype=torch.bfloat16), everything=False)
    # The gloo stand-in of the tests takes CPU tensors too.
    assert channels.takes_device_path(torch.ones(3), everything=True)
    # An empty tensor has no bytes to send: it stays in its frame.
    assert not channels.takes_device_path(_fake_cuda((0, 3)), everything=False)
    assert not channels.takes_device_path(torch.ones(0), everything=True)


def test_a_fake_cuda_tensor_of_torch_takes_the_device_path():
    from torch._subclasses.fake_tensor import FakeTensorMode

    try:
        with FakeTensorMode():
            t = torch.empty(4, device="cuda")
    except Exception as e:  # noqa: BLE001  (torch builds that cannot fake a CUDA device)
        pytest.skip(f"no fake CUDA tensor in this torch: {e}")
    assert t.is_cuda and channels.takes_device_path(t, everything=False)


@pytest.mark.parametrize("facts, want", [
    (("nccl", True, True, 2, 2), "nccl"),      # one GPU per rank
    (("smddp", True, True, 8, 8), "nccl"),     # smddp sends CUDA tensors through NCCL
    (("nccl", True, True, 1, 2), None),        # two ranks share a GPU: NCCL refuses them
    (("gloo", True, True, 2, 2), None),        # the job asked for gloo
    (("nccl", True, False, 2, 2), None),       # a torch without NCCL
    (("gloo", False, False, 0, 2), None),      # no GPU
])
def test_device_groups_are_nccl_only_with_a_gpu_per_rank(facts, want):
    assert device_backend_for(*facts) == want


def test_the_switch_chooses_the_device_channels_backend():
    assert channels.channel_backend(None, {}) is None  # CPU: no device channel at all
    assert channels.channel_backend("nccl", {}) == "nccl"
    assert channels.channel_backend("nccl", {channels.ENV: "auto"}) == "nccl"
    assert channels.channel_backend("nccl", {channels.ENV: "host"}) is None
    assert channels.channel_backend(None, {channels.ENV: "gloo-test"}) == "gloo"
    with pytest.raises(ValueError, match=channels.ENV):
        channels.channel_backend(None, {channels.ENV: "nvlink"})


# ---- the frame a CUDA tensor leaves ---------------------------------------------------------

class _Work:
    def wait(self):
        return True


class _Wire:
    """A gloo group's send/recv as the transport calls them, through a list of buffers."""

    def __init__(self):
        self.buffers = []

    def send(self, tensors, dst, tag):
        self.buffers.append(tensors[0].clone())
        return _Work()

    def recv(self, tensors, src, tag):
        got = self.buffers.pop(0)
        tensors[0][:got.numel()] = got
        return _Work()


class _FakeDeviceChannel:
    """Records what the transport sends apart, and gives it back on receipt."""

    def __init__(self):
        self.sent, self.asked = [], []

    def takes(self, t):
        return channels.takes_device_path(t, everything=False)

    def send(self, peer, tensors):
        self.sent.append((peer, list(tensors)))
        return [_Work()], list(tensors)

    def recv(self, peer, specs):
        self.asked.append((peer, specs))
        return [torch.full(shape, 7.0, dtype=dtype) for shape, dtype in specs]


def _bare_transport(channel):
    """A Transport's frame code without its threads and groups (pp rank 0 of 2)."""
    t = Transport.__new__(Transport)
    wire = _Wire()
    t.me, t.ranks, t.device = 0, [0, 1], torch.device("cpu")
    t._groups, t._group_rank = (wire, wire), {0: 0, 1: 1}
    t._apart, t.sent_apart, t._frames = channel, collections.Counter(), {}
    t.sent_messages, t.sent_bytes = collections.Counter(), collections.Counter()
    return t, wire


def _raw_headers(buffer):
    """A frame's headers as they travel: each message as the tuple of its fields, its tensors'
    dtypes as small ints."""
    header_len = int(buffer[:_PREFIX].numpy().view(np.int64)[0])
    return pickle.loads(buffer[_PREFIX:_PREFIX + header_len].numpy().tobytes())


def _headers(buffer):
    msgs = [Message(*h) for h in _raw_headers(buffer)]
    for m in msgs:
        m.tensors = [(shape, _DTYPE_OF.get(d, d), n) for shape, d, n in m.tensors]
    return msgs


def test_a_frame_sends_its_cuda_tensors_apart_and_keeps_its_cpu_tensors_inside():
    channel = _FakeDeviceChannel()
    t, wire = _bare_transport(channel)
    gpu_a, gpu_b, cpu = _fake_cuda((2, 3)), _fake_cuda((4,), torch.bfloat16), torch.arange(5.0)
    t._post_frame(1, [Message(VALUE, tensors=[gpu_a, cpu]), Message(VALUE, tensors=[gpu_b])])
    # The device tensors leave on the device channel, in header order, after the frame.
    assert channel.sent == [(1, [gpu_a, gpu_b])] and t.sent_apart[1] == 2
    [frame] = wire.buffers
    metas = [m.tensors for m in _headers(frame)]
    assert metas == [[((2, 3), torch.float32, channels.APART), ((5,), torch.float32, 20)],
                     [((4,), torch.bfloat16, channels.APART)]]
    # The receiver reads the CPU tensor from the frame and asks the channel for the others.
    t2, _ = _bare_transport(channel)
    t2._groups = (wire, wire)
    msgs = t2._recv_frame(1)
    assert channel.asked == [(1, [((2, 3), torch.float32), ((4,), torch.bfloat16)])]
    assert torch.equal(msgs[0].tensors[1], cpu)
    assert msgs[0].tensors[0].shape == (2, 3) and msgs[1].tensors[0].dtype == torch.bfloat16


def test_without_a_device_channel_every_tensor_stays_in_its_frame():
    t, wire = _bare_transport(None)
    t._post_frame(1, [Message(VALUE, tensors=[torch.ones(3), torch.zeros(2, dtype=torch.int64)])])
    [frame] = wire.buffers
    assert all(nbytes >= 0 for m in _headers(frame) for _, _, nbytes in m.tensors)
    assert not t.sent_apart


def test_a_frame_gives_back_every_dtype_it_carries():
    # The dtypes of frames.py's table travel as small ints, any other as itself: each comes
    # back as it left, with its values (uint16: one outside the table).
    dtypes = list(_DTYPE_LIST) + [torch.uint16]
    sent = [(torch.arange(6).reshape(2, 3) % 2).to(d) for d in dtypes]
    t, wire = _bare_transport(None)
    t._post_frame(1, [Message(VALUE, tensors=sent[:5]), Message(VALUE, tensors=sent[5:])])
    raw = _raw_headers(wire.buffers[0])
    assert [d for h in raw for _, d, _ in h[-1]] == list(range(len(_DTYPE_LIST))) + [torch.uint16]
    t2, _ = _bare_transport(None)
    t2._groups = (wire, wire)
    got = [x for m in t2._recv_frame(1) for x in m.tensors]
    assert [x.dtype for x in got] == dtypes
    assert all(torch.equal(a, b) and a.shape == b.shape for a, b in zip(got, sent))


def test_cpu_tensors_never_reach_a_device_channel():
    channel = _FakeDeviceChannel()
    t, wire = _bare_transport(channel)
    t._post_frame(1, [Message(VALUE, tensors=[torch.ones(3), torch.ones(2, 2)])])
    assert channel.sent == [] and not t.sent_apart
    assert all(nbytes >= 0 for m in _headers(wire.buffers[0]) for _, _, nbytes in m.tensors)


# ---- the device path's equivalence, with gloo standing in for NCCL ----------------------------

GLOO_TEST = {channels.ENV: "gloo-test"}


def _train_counting_apart(*args):
    from smshim.modelparallel.torch.state import state
    from tests.test_pipeline import _train

    result = _train(*args)
    result["apart"] = sum(state.model._pipeline.transport.sent_apart.values())
    return result


@pytest.mark.parametrize("sched", ["simple", "interleaved"])
def test_net_matches_single_process_pp2_with_the_device_channel(sched):
    from tests.test_pipeline import _check

    cfg = {"pipeline_parallel_degree": 2, "microbatches": 4, "pipeline": sched,
           "active_microbatches": 4 if sched == "simple" else 2, "auto_partition": False,
           "default_partition": 0}
    manual = {f"blocks.{i}": (i + 1) % 2 for i in range(4)}
    manual["head"] = 1
    results = run_ranks(_train_counting_apart, 2, "net", cfg, 3, 8, manual, timeout=150,
                        env=GLOO_TEST)
    _check(results, "net")
    # Both ranks sent their activations / gradients on the device channel.
    assert all(r["apart"] > 0 for r in results), [r["apart"] for r in results]


def test_the_unchanged_pipeline_tests_pass_on_the_device_channel(monkeypatch):
    """Two existing equivalence tests, run as they are with the gloo stand-in."""
    from tests import test_pipeline, test_pipeline_data_path

    monkeypatch.setenv(channels.ENV, "gloo-test")  # the ranks inherit it
    test_pipeline.test_net_matches_single_process(2, 8, "interleaved", "auto")
    test_pipeline_data_path.test_a_gradient_sent_to_pp_rank_0_and_passed_on_unread_to_its_owner()


def test_glue_code_across_three_processes_on_the_device_channel(monkeypatch):
    from tests import test_pipeline_data_path

    monkeypatch.setenv(channels.ENV, "gloo-test")
    test_pipeline_data_path.test_glue_code_across_stages_interleaved()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs two CUDA devices (NCCL)")
def test_net_matches_single_process_pp2_on_nccl():
    from tests.test_pipeline import _check

    cfg = {"pipeline_parallel_degree": 2, "microbatches": 4, "pipeline": "interleaved"}
    results = run_ranks(_train_counting_apart, 2, "net", cfg, 3, 8, timeout=300)
    _check([dict(r, params={n: p.cpu() for n, p in r["params"].items()}) for r in results], "net")
    assert all(r["apart"] > 0 for r in results)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without GPU")
def test_gpu_smoke_without_a_gpu_says_so_and_exits_0():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "gpu_smoke.py")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "no CUDA device" in done.stdout and "nothing checked" in done.stdout
