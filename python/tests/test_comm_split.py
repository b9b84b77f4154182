"""Comm.split (sg_comm_split) and Comm.split_nodes (sg_comm_split_nodes) with ranks as threads: new ranks by (key, rank), None for a
negative color, argument errors, and the parts outliving the communicator they came from;
Comm.stats (sg_comm_stats) counting the split's own collectives."""

import pytest

import shardgrad as sg


def split_ranks(comm, world):
    rank = comm.rank
    node = comm.split(rank // 2, key=rank)
    replica = comm.split(rank % 2, key=-rank)  # reversed order
    alone = comm.split(-1 if rank == 0 else 1)
    out = (node.rank, node.size, replica.rank, replica.size, alone)
    node.close()
    replica.close()
    if alone is not None:
        out = out[:4] + (alone.rank,)
        alone.close()
    return out


def test_split_threads():
    got = sg.run_threads(4, split_ranks, 4)
    assert got[0] == (0, 2, 1, 2, None)
    assert got[1] == (1, 2, 1, 2, 0)
    assert got[2] == (0, 2, 0, 2, 1)
    assert got[3] == (1, 2, 0, 2, 2)


def test_split_arguments():
    comms = sg.Comm.local(1)
    try:
        with pytest.raises(TypeError):
            comms[0].split("a")
        with pytest.raises(sg.InvalidArgumentError):
            comms[0].split(2**40)
        with pytest.raises(TypeError):
            comms[0].split_nodes("2")
        with pytest.raises(sg.InvalidArgumentError):
            comms[0].split_nodes(2**40)
        part = comms[0].split(3, key=5)
        assert (part.rank, part.size) == (0, 1)
    finally:
        comms[0].close()
    assert part.rank == 0  # still usable after its parent is closed
    part.close()
    with pytest.raises(sg.InvalidStateError):
        comms[0].split(0)
    with pytest.raises(sg.InvalidStateError):
        comms[0].split_nodes(1)


def test_stats_zero_then_split_counts():
    def body(comm):
        first = comm.stats()
        part = comm.split(0)
        after = comm.stats()
        part.close()
        return first, after

    for first, after in sg.run_threads(2, body):
        assert first == {"bytes_sent": 0, "bytes_received": 0, "collectives": 0}
        # the split all-gathers (color, key) and, on threads, the handles twice: 8, 8 and 8
        # bytes per rank, (W-1)/W of each W-slice buffer
        assert after["collectives"] == 3
        assert after["bytes_sent"] == after["bytes_received"] == 8 + 8 + 8


def split_nodes_ranks(comm, rpn):
    shard, replica = comm.split_nodes(rpn)
    out = (shard.rank, shard.size, replica.rank, replica.size)
    shard.close()
    replica.close()
    return out


@pytest.mark.parametrize("world,rpn", [(4, 2), (6, 3), (6, 2), (4, 1), (4, 4), (4, 0)])
def test_split_nodes_threads(world, rpn):
    k = rpn or world  # 0: by host, and threads share one
    got = sg.run_threads(world, split_nodes_ranks, rpn)
    assert got == [(r % k, k, r // k, world // k) for r in range(world)]


def test_split_nodes_mismatch_on_every_rank():
    def body(comm, rpn):
        err = None
        try:
            comm.split_nodes(rpn(comm.rank))
        except sg.ShardgradError as e:
            err = type(e)
        return err, split_nodes_ranks(comm, 1)  # still usable afterwards

    got = sg.run_threads(3, body, lambda r: 2)  # 3 ranks in nodes of 2
    assert [g[0] for g in got] == [sg.MismatchError] * 3
    assert [g[1] for g in got] == [(0, 1, r, 3) for r in range(3)]
    got = sg.run_threads(2, body, lambda r: -1 if r == 1 else 1)
    assert [g[0] for g in got] == [sg.MismatchError, sg.InvalidArgumentError]

