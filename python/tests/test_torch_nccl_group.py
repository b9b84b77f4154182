"""Comm.from_torch on an NCCL process group (issue 16 item 1, the CUDA half): an NCCL
communicator whose unique id rank 0 of the group makes and the group itself hands to the others
(broadcast_object_list from the group's rank 0, named by its global rank), on torch's current
CUDA device. No GPU here: torch.distributed's functions and the library's NCCL entry points are
replaced by fakes that record what from_torch asks of them, for the ranks of a 2-rank group that
is not the whole world (global ranks 2 and 3 of 4), run one after the other. The NCCL
communicator itself (sg_nccl_unique_id, sg_comm_create_nccl from an id) is tested on the mock
NCCL in C (test_cuda_mock_nccl); tests/gpu runs the real one."""

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import shardgrad as sg  # noqa: E402
import shardgrad.torch.comm as sgt_comm  # noqa: E402

GROUP_RANKS = [2, 3]  # global ranks of the group's ranks 0 and 1


class FakeNcclGroup:
    """The fake process group: its backend, its ranks, and the objects broadcast over it."""

    def __init__(self):
        self.rank = None  # the group rank whose process is calling now
        self.sent = []  # (object list, src, group) of each broadcast_object_list


@pytest.fixture
def fake(monkeypatch):
    g = FakeNcclGroup()
    made, joined = [], []
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: g.rank if group is g else 99)
    monkeypatch.setattr(dist, "get_world_size",
                        lambda group=None: len(GROUP_RANKS) if group is g else 4)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "get_global_rank", lambda group, r: GROUP_RANKS[r])

    def broadcast_object_list(objs, src=None, group=None):
        if g.rank == 0:
            g.sent.append((list(objs), src, group))
        else:  # the others receive what the group's rank 0 sent
            objs[:] = g.sent[-1][0]

    monkeypatch.setattr(dist, "broadcast_object_list", broadcast_object_list)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 5)
    monkeypatch.setattr(sgt_comm, "has_backend", lambda name: name == "nccl")

    def unique_id():
        made.append(g.rank)
        return bytes(range(128))

    def nccl(rank, world, uid, cuda_device=-1):
        joined.append((rank, world, uid, cuda_device))
        return ("nccl comm", rank)

    monkeypatch.setattr(sg.Comm, "nccl_unique_id", staticmethod(unique_id))
    monkeypatch.setattr(sg.Comm, "nccl", staticmethod(nccl))
    return g, made, joined


def test_nccl_group_gives_an_nccl_comm_with_the_id_shared_through_the_group(fake):
    g, made, joined = fake
    got = []
    for r in range(len(GROUP_RANKS)):
        g.rank = r
        got.append(sg.Comm.from_torch(g))
    assert made == [0]  # only the group's rank 0 makes an id
    assert len(g.sent) == 1
    objs, src, group = g.sent[0]
    assert src == GROUP_RANKS[0] and group is g  # from the group's rank 0, through the group
    assert objs == [bytes(range(128))]
    # every rank joins with the same id, its rank in the group, on torch's current device
    assert joined == [(0, 2, bytes(range(128)), 5), (1, 2, bytes(range(128)), 5)]
    assert got == [("nccl comm", 0), ("nccl comm", 1)]


def test_nccl_group_without_nccl_in_the_library(fake, monkeypatch):
    g, made, joined = fake
    monkeypatch.setattr(sgt_comm, "has_backend", lambda name: False)
    g.rank = 0
    with pytest.raises(sg.UnsupportedError, match="built without it"):
        sg.Comm.from_torch(g)
    assert made == [] and joined == [] and g.sent == []  # nothing started, nothing to hang on
