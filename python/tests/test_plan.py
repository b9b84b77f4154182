"""shardgrad.plan: the step-time model through Python, the probe on threads, the model
readers and the command line (docs/planner.md)."""
import contextlib
import io
import json
import struct

import pytest

import shardgrad as sg
from shardgrad import plan


def _engine_step(comm, shard_ranks, numels, micro, cfg_kw):
    """Per rank: one warm-up step, then the comm counters across one step of `micro`
    micro-batches, flat over comm or hybrid over its splits."""
    r = comm.rank
    shard = replica = None
    if shard_ranks:
        shard = comm.split(r // shard_ranks, r)
        replica = comm.split(r % shard_ranks, r)
    e = sg.Engine(shard or comm, replica_comm=replica, **cfg_kw)
    for i, n in enumerate(numels):
        e.add_param("p%d" % i, (n,))
    e.finalize()

    def step():
        if shard_ranks:
            e.set_microbatches(micro)
        for _ in range(micro):
            for pid in reversed(range(len(numels))):
                e.grad_ptr(pid)
                e.grad_ready(pid)
            e.backward_end()
        e.step()

    step()
    a = [(shard or comm).stats(), replica.stats() if replica else None]
    step()
    b = [(shard or comm).stats(), replica.stats() if replica else None]
    e.close()
    for c in (shard, replica):
        if c:
            c.close()
    d = {"shard_bytes": b[0]["bytes_sent"] - a[0]["bytes_sent"],
         "shard_collectives": b[0]["collectives"] - a[0]["collectives"]}
    d["replica_bytes"] = b[1]["bytes_sent"] - a[1]["bytes_sent"] if replica else 0
    d["replica_collectives"] = b[1]["collectives"] - a[1]["collectives"] if replica else 0
    return d


@pytest.mark.parametrize("world,shard_ranks,bucket,micro,kw", [
    (4, 0, 4096, 1, {}),
    (3, 0, 1 << 20, 2, {"param_dtype": "bf16", "grad_dtype": "bf16"}),
    (4, 2, 4096, 3, {"replica_reduce_dtype": "bf16"}),
    (4, 2, 20000, 1, {"strategy": "shard_opt"}),
    (6, 3, 8192, 2, {"replica_reduce_dtype": "f32", "overlap_param_gather": 0}),
])
def test_bytes_match_the_comm_counters(world, shard_ranks, bucket, micro, kw):
    numels = [300, 17, 4096, 1000, 64, 2500]
    cfg_kw = dict(bucket_bytes=bucket, **kw)
    got = sg.run_threads(world, _engine_step, shard_ranks, numels, micro, cfg_kw)
    hw = plan.Hardware(ranks_per_node=shard_ranks or 1)
    est = plan.estimate_step(numels, world, micro, hw, shard_ranks=shard_ranks, **cfg_kw)
    for r, d in enumerate(got):
        for k, v in d.items():
            assert est[k] == v, (r, k, est[k], v)


def test_parts_add_up_and_links_slow_the_step():
    numels = plan.mlp_numels(256, 4)
    prev = 0.0
    for gbit in (100, 10, 1, 0.1):
        hw = plan.described(2, 2, gbit, 5.0, 10.0, algorithm="host")
        hw.compute_s = 0.01
        hw.handover_s_per_byte = 1e-10
        e = plan.estimate_step(numels, 4, 8, hw, bucket_bytes=1 << 16)
        parts = (e["compute_s"] + e["exposed_node_s"] + e["exposed_net_s"] + e["optim_s"]
                 + e["copy_s"] + e["handover_s"])
        assert parts == pytest.approx(e["step_s"], rel=1e-9)
        assert e["step_s"] >= prev
        prev = e["step_s"]


def test_bad_hardware_is_refused():
    hw = plan.Hardware()
    hw.net_bytes_per_s = 0
    with pytest.raises(sg.InvalidArgumentError, match="link_bytes_per_s"):
        plan.estimate_step([100], 2, 1, hw)
    with pytest.raises(AttributeError):
        hw.no_such_field = 1
    hw = plan.Hardware(backward_fraction=1.5)
    with pytest.raises(sg.InvalidArgumentError, match="backward_fraction"):
        plan.estimate_step([100], 2, 1, hw)
    with pytest.raises(sg.InvalidArgumentError):
        plan.estimate_step([], 2, 1, plan.Hardware())
    # still usable after the errors
    assert plan.estimate_step([100], 2, 1, plan.Hardware())["step_s"] > 0


def test_hardware_json_round_trip(tmp_path):
    hw = plan.described(16, 8, 100, 150, 3350)
    hw.compute_s = 1.5
    p = tmp_path / "hw.json"
    p.write_text(json.dumps(hw.as_dict()))
    back = plan.Hardware.load(str(p))
    assert back.as_dict() == hw.as_dict()


def test_llama_shapes_give_the_published_counts():
    assert sum(plan.llama_numels(*plan.LLAMA["7b"])) == 6738415616
    assert sum(plan.llama_numels(*plan.LLAMA["13b"])) == 13015864320


def test_safetensors_header(tmp_path):
    header = {"a": {"dtype": "F32", "shape": [3, 4], "data_offsets": [0, 48]},
              "b": {"dtype": "BF16", "shape": [5], "data_offsets": [48, 58]},
              "__metadata__": {"format": "pt"}}
    raw = json.dumps(header).encode()
    p = tmp_path / "m.safetensors"
    p.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(58))
    assert sorted(plan.safetensors_numels(str(p))) == [5, 12]


def test_layouts_fit_and_order():
    numels = plan.llama_numels(*plan.LLAMA["7b"])
    hw = plan.described(**plan.PRESETS["a100-2x2-1g"])
    hw.compute_s = 1.0
    rows = plan.layouts(numels, hw, 4, 8, "bf16", "cuda", (32,), device_gib=40, host_gib=256)
    fits = [r for r in rows if r["fits"]]
    assert fits and all(r["fits"] for r in rows[:len(fits)])
    steps = [r["estimate"]["step_s"] for r in fits if not r["runs"]]
    assert steps == sorted(steps)
    # plain data parallel keeps 16+ bytes per parameter: 7B cannot fit in 40 GiB
    assert not any(r["fits"] for r in rows if r["config"]["strategy"] == "no_shard")
    # hybrid with a bf16 wire puts fewer bytes on the 1 Gbit/s link than flat ZeRO-2
    by = {(r["layout"], r["config"]["strategy"], r["config"]["offload_optimizer"]): r
          for r in rows}
    flat = by[("flat", "shard_grad_op", 1)]["estimate"]
    hyb = by[("hybrid bf16", "shard_grad_op", 1)]["estimate"]
    assert hyb["link_net_bytes"] < flat["link_net_bytes"] / 4


def test_slow_links_modes_and_8bit_state_are_layouts():
    """On 2 nodes the codecs and outer steps are rows beside exact hybrid, on CUDA with offload
    too;
    8-bit state shrinks the device state of the same layout, or with offload its host state."""
    numels = plan.llama_numels(*plan.LLAMA["7b"])
    hw = plan.described(**plan.PRESETS["a100-2x2-1g"])
    hw.compute_s = 1.0
    rows = plan.layouts(numels, hw, 4, 8, "bf16", "cuda", (32,), device_gib=40, host_gib=256,
                        states=("f32", "q8"))
    names = {r["layout"] for r in rows}
    assert {"hybrid int8", "hybrid int4", "DiLoCo H=8", "DiLoCo H=32"} <= names
    by = {(r["layout"], r["config"]["strategy"], r["config"]["offload_optimizer"],
           r["config"]["optim_state_dtype"]): r for r in rows}
    # the codecs and outer steps run on CUDA, with an offloaded optimizer too
    for name in ("hybrid int8", "DiLoCo8 int8", "DiLoCo H=8"):
        assert by[(name, "shard_grad_op", 1, "f32")]["runs"] == ""
        assert by[(name, "shard_grad_op", 0, "f32")]["runs"] == ""
    assert by[("hybrid bf16", "shard_grad_op", 1, "f32")]["runs"] == ""
    # fewer link bytes than the exact bf16 wire for int8 (about half); outer steps sync the
    # same bytes once in H steps (the counts are the syncing step's, the time the period's mean)
    e = {k[0]: by[k]["estimate"] for k in by if k[1:] == ("shard_grad_op", 1, "f32")}
    assert e["hybrid int8"]["link_net_bytes"] < 0.6 * e["hybrid bf16"]["link_net_bytes"]
    assert e["DiLoCo H=8"]["exposed_net_s"] < 0.2 * e["hybrid bf16"]["exposed_net_s"]
    q8 = by[("flat", "shard_grad_op", 0, "q8")]["device_gib"]
    assert q8 < by[("flat", "shard_grad_op", 0, "f32")]["device_gib"] - 5
    # 8-bit state with CUDA offload runs: the moments in host memory take a quarter of the
    # fp32 ones' bytes (6 bytes per parameter fewer over W = 4: about 9 GiB per rank for 7B)
    off_q8 = by[("flat", "shard_grad_op", 1, "q8")]
    off_f32 = by[("flat", "shard_grad_op", 1, "f32")]
    assert off_q8["runs"] == ""
    assert off_q8["host_gib"] < off_f32["host_gib"] - 8
    assert abs(off_q8["device_gib"] - off_f32["device_gib"]) < 0.5
    # order: fits and runs, then fits but refused at create, then does not fit
    keys = [(not r["fits"], bool(r["runs"])) for r in rows]
    assert keys == sorted(keys)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        plan.main(["--preset", "a100-2x2-1g", "--llama", "7b", "--dtype", "bf16", "--micro", "8",
                   "--tokens", "4096", "--buckets", "32", "--top", "100"])
    best = out.getvalue().split("best that fits:")[1]
    # 7B fits there only with offload, where the outer steps now run: they are the best
    assert "outer_every=32" in best and "offload_optimizer=1" in best
    # on the CPU device the modes run
    cpu = plan.layouts(numels[:8], hw, 4, 8, "f32", "cpu", (32,))
    assert all(r["runs"] == "" for r in cpu)


def test_command_line_with_a_preset():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert plan.main(["--preset", "a100-2x2-1g", "--llama", "7b", "--dtype", "bf16",
                          "--micro", "8", "--tokens", "4096", "--buckets", "32"]) == 0
    text = out.getvalue()
    assert "best that fits" in text and "sg.Config(" in text
    assert "assumed" in text  # every number that was not measured says so


def test_probe_on_threads():
    hws = sg.run_threads(2, plan.probe, budget_s=0.02)
    hw = hws[0]
    assert hw.ranks_per_node == 2 and hw.nodes == 1
    assert hw.node_bytes_per_s > 0 and hw.optim_params_per_s > 0
    assert 0 <= hw.node_overlap <= 1 and hw.handover_s_per_byte >= 0
    assert any("between-nodes level is not measured" in n for n in hw.notes)


def test_probe_hybrid_sums_on_threads():
    """2 'nodes' of 2 threads: the probe measures a hybrid engine's sums across them; their rate
    is positive and never above the between-nodes link's."""
    hws = sg.run_threads(4, plan.probe, budget_s=0.02, ranks_per_node=2)
    hw = hws[0]
    assert hw.nodes == 2 and hw.ranks_per_node == 2
    assert 0 < hw.replica_bytes_per_s <= hw.net_bytes_per_s
    back = plan.Hardware.from_dict(hw.as_dict())
    assert back.replica_bytes_per_s == hw.replica_bytes_per_s
    old = hw.as_dict()
    del old["replica_bytes_per_s"]  # a probe file from before the field: the link's rate
    assert plan.Hardware.from_dict(old).replica_bytes_per_s == 0
