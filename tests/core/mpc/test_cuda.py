"""CrypTen's CUDA path: two parties on one GPU over gloo, their communication staged through host memory
(``core.mpc.crypten_compat.stage_cuda_communication``). The staging helpers are checked everywhere on a stand-in
for a CUDA tensor; the encrypted generation on the GPU (marked ``gpu``) must give the plaintext tokens and the
CPU run's exact bytes and rounds."""

from __future__ import annotations

import pytest
import torch

from core.mpc import crypten_compat as C
from core.mpc import gpt2 as G
from core.mpc import gpt2_merge as GM
from core.mpc.merge_spec import merge_generate_plain

from .conftest import NEW, require_crypten, tiny_merge_spec

require_crypten()


class FakeDevice:
    type = "cuda"

    def __str__(self) -> str:
        return "cuda:0"


class FakeCudaLong:
    """What the staging sees of CrypTen's CUDALongTensor: is_cuda, device, ``_tensor``, cpu(), data."""

    def __init__(self, t: torch.Tensor) -> None:
        self._tensor = t
        self.is_cuda = True
        self.device = torch.device("cpu")  # where "back to the device" lands in this stand-in

    def cpu(self) -> torch.Tensor:
        return self._tensor.clone()

    @property
    def data(self) -> torch.Tensor:
        return self._tensor


def test_staging_copies_cuda_arguments_to_host_and_results_back_as_their_type() -> None:
    found: list = []
    a, b = FakeCudaLong(torch.arange(3)), FakeCudaLong(torch.ones(2, dtype=torch.long))
    host = C._to_host([a, 5, [b, torch.zeros(1)]], found)
    assert found == [a, b]
    assert type(host[0]) is torch.Tensor and torch.equal(host[0], torch.arange(3)) and host[1] == 5
    assert type(host[2][0]) is torch.Tensor and torch.equal(host[2][1], torch.zeros(1))
    back = C._to_device([torch.tensor([7, 8]), None], a)
    assert isinstance(back[0], FakeCudaLong) and torch.equal(back[0]._tensor, torch.tensor([7, 8])) and back[1] is None
    assert C._to_device(torch.tensor([1]), torch.tensor([0])).device.type == "cpu"  # plain tensor in, plain out


def test_staged_broadcast_writes_in_place_like_gloo() -> None:
    calls = []

    def broadcast(self, input, src, group=None, batched=False):
        calls.append(type(input))
        return input + 10  # what the other party sent

    broadcast.__name__ = "broadcast"
    staged = C._staged(broadcast)
    x = FakeCudaLong(torch.arange(3))
    out = staged(None, x, 0)
    assert out is x and torch.equal(x._tensor, torch.arange(3) + 10) and calls == [torch.Tensor]


def test_staging_is_installed_once() -> None:
    crypten = C.import_crypten()
    C.stage_cuda_communication(crypten)
    from crypten.communicator.distributed_communicator import DistributedCommunicator

    first = DistributedCommunicator.send
    C.stage_cuda_communication(crypten)
    assert DistributedCommunicator.send is first and first._privbench_staged
    assert not hasattr(first.__wrapped__, "_privbench_staged")  # wrapped exactly once


def _generate(ctx, w, ids, spec):
    out = {"device": str(ctx.device)}
    model = G.EncryptedGPT2(w, G.MPCVariant(), rank=ctx.rank, device=ctx.device)
    client_ids = ids if ctx.is_client else None
    for mode in ("vanilla", "vanilla_kv"):
        out[mode] = model.generate(client_ids, NEW, mode=mode, shape=tuple(ids.shape))
    out["merge"] = GM.EncryptedMerge(spec, rank=ctx.rank, device=ctx.device).generate(
        client_ids, NEW, shape=tuple(ids.shape)
    )
    return out


@pytest.mark.gpu
def test_two_parties_on_cuda_generate_the_plaintext_tokens_with_the_cpu_runs_bytes(weights, prefix) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from core.mpc.parties import run_local

    spec = tiny_merge_spec()
    cpu = run_local(_generate, (weights, prefix, spec), timeout_s=600)
    gpu = run_local(_generate, (weights, prefix, spec), device="cuda", timeout_s=600)
    assert gpu[0]["device"].startswith("cuda") and cpu[0]["device"] == "cpu"
    for mode in ("vanilla", "vanilla_kv"):
        want = G.plaintext_reference(weights, G.MPCVariant(), prefix, NEW, mode=mode)
        assert torch.equal(gpu[1][mode].tokens.cpu(), want), mode
    merged = merge_generate_plain(spec, spec.lm_head[prefix], NEW)
    assert torch.equal(gpu[1]["merge"].tokens.cpu(), next(t for t in merged if not t.is_floating_point()))
    for rank in (0, 1):
        for mode in ("vanilla", "vanilla_kv", "merge"):
            assert gpu[rank][mode].comm_bytes == cpu[rank][mode].comm_bytes, (rank, mode)
            assert gpu[rank][mode].rounds == cpu[rank][mode].rounds, (rank, mode)
