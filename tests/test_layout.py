"""lightning_moe.layout is the one source of layout truth: torch-free, and what ParallelDims and the
planner build their groups from."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

import lightning_moe.layout as layout
from lightning_moe.parallel.dims import ParallelDims
from lightning_moe.planner import Layout, group_ranks


def test_layout_imports_no_torch() -> None:
    """Loaded on its own (the package's __init__ imports torch), layout.py pulls in no torch."""
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('layout', {str(Path(layout.__file__))!r})\n"
        "spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
        "assert 'torch' not in sys.modules, 'lightning_moe/layout.py imports torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_dim_orders() -> None:
    assert layout.MESH_DIMS == ("pp", "dp", "ep", "cp", "tp")
    assert layout.PARALLEL_DIMS == ("tp", "cp", "ep", "dp", "pp")
    assert layout.LAYOUT_KEYS == ("tp", "cp", "ep", "dp", "pp", "etp")
    assert layout.NON_DP_DIMS == ("tp", "cp", "ep", "pp")
    assert layout.EP_NODE_MESH_DIMS == ("pp", "dp", "ep_node", "ep_local", "cp", "tp")


@pytest.mark.parametrize(
    ("tp", "etp", "edp", "etp_span", "order"),
    [
        (2, None, ("dp", "cp"), ("tp",), ("pp", "dp", "cp", "ep", "tp")),
        (2, 2, ("dp", "cp"), ("tp",), ("pp", "dp", "cp", "ep", "tp")),
        (2, 1, ("dp", "cp", "tp"), (), ("pp", "dp", "cp", "tp", "ep")),
        (1, 1, ("dp", "cp"), ("tp",), ("pp", "dp", "cp", "ep", "tp")),
    ],
)
def test_expert_view(
    tp: int, etp: int | None, edp: tuple[str, ...], etp_span: tuple[str, ...], order: tuple[str, ...]
) -> None:
    spans = layout.expert_group_spans(tp, etp)
    assert (spans["edp"], spans["ep"], spans["etp"]) == (edp, ("ep",), etp_span)
    assert layout.expert_view_order(tp, etp) == order


@pytest.mark.parametrize(
    ("tp", "etp", "fold", "edp", "ep", "etp_span"),
    [
        (2, None, ("tp",), ("dp", "cp"), ("ep", "tp"), ()),
        (2, 1, ("tp",), ("dp", "cp"), ("ep", "tp"), ()),
        (2, None, ("cp", "tp"), ("dp",), ("ep", "cp", "tp"), ()),
        (2, None, ("cp",), ("dp",), ("ep", "cp"), ("tp",)),  # experts still split over tp
        (2, 1, ("cp",), ("dp", "tp"), ("ep", "cp"), ()),
    ],
)
def test_folded_expert_view(tp, etp, fold, edp, ep, etp_span) -> None:
    """Folding moves the folded dims from edp (or etp) into ep; the view is still a permutation of the mesh."""
    spans = layout.expert_group_spans(tp, etp, fold)
    assert (spans["edp"], spans["ep"], spans["etp"]) == (edp, ep, etp_span)
    assert sorted(layout.expert_view_order(tp, etp, fold)) == sorted(layout.MESH_DIMS)


def test_fold_sizes() -> None:
    assert layout.normalize_fold_ep(" tp,cp ") == layout.normalize_fold_ep(["cp", "tp"]) == ("cp", "tp")
    assert layout.normalize_fold_ep(None) == layout.normalize_fold_ep("") == ()
    assert layout.unfolded_ep(8, ("tp",), tp=8) == 1 and layout.unfolded_ep(8, ("cp", "tp"), tp=2, cp=2) == 2
    assert layout.default_etp(2, None, ("tp",)) == 1 and layout.default_etp(2, None, ("cp",)) == 2
    assert layout.size_problems(tp=8, ep=8, world_size=8, fold_ep=("tp",), num_experts=8, num_heads=8) == []
    with pytest.raises(ValueError, match=r"fold_ep='dp'.*raise ep instead"):
        layout.normalize_fold_ep("dp")


@pytest.mark.parametrize(
    ("sizes", "facts", "expected"),
    [
        (dict(tp=2, cp=2, ep=2, fold_ep=("cp", "tp")), {},
         "ep=2 is not divisible by the folded cp*tp = 2*2 = 4 (fold_ep=['cp', 'tp']): choose ep as a multiple of 4"),
        (dict(tp=2, ep=2, etp=2, fold_ep=("tp",)), {}, "etp=2 with ep folded over tp: the tp ranks hold different experts"),
        (dict(tp=2, ep=4, dp=1, fold_ep=("tp",)), dict(world_size=2), "world_size 2 != tp*cp*(ep/tp)*dp*pp = 2*1*2*1*1 = 4"),
        (dict(tp=2, ep=4, fold_ep=("tp",)), dict(world_size=6), "world_size 6 is not divisible by tp*cp*(ep/tp)*pp = 2*1*2*1 = 4"),
        (dict(tp=2, ep=4, dp=1, fold_ep=("tp",)), dict(global_batch_size=3),
         "global_batch_size 3 not divisible by micro_batch_size*dp_ep = 1*2 = 2"),  # the mesh's ep splits samples
        (dict(tp=2, etp=3), {}, r"etp=3 must be 1 or equal to tp=2 (expert tensor parallel size)"),
        (dict(ep=2), dict(world_size=3), "world_size 3 is not divisible by tp*cp*ep*pp = 1*1*2*1 = 2"),
        (dict(ep=2, dp=2), dict(world_size=3), "world_size 3 != tp*cp*ep*dp*pp = 1*1*2*2*1 = 4"),
        (dict(tp=2, dp=1), dict(num_kv_heads=1), "num_kv_heads=1 is not divisible by tp=2"),
        (dict(ep=4, dp=1), dict(num_experts=6), "num_experts 6 is not divisible by ep 4"),
        (dict(cp=2, dp=1), dict(seq_len=30), "seq_len 30 not divisible by 2*cp = 4"),
        (dict(dp=2), dict(global_batch_size=12, micro_batch_size=4), "global_batch_size 12 not divisible by micro_batch_size*dp_ep = 4*2 = 8"),
        (dict(pp=2, dp=1), dict(global_batch_size=6, micro_batch_size=2, pp_microbatches=2),
         "global_batch_size 6 not divisible by micro_batch_size*dp_ep*pp_microbatches = 2*1*2 = 4"),
    ],
)  # fmt: skip
def test_size_problems_name_the_fix(sizes: dict, facts: dict, expected: str) -> None:
    problems = layout.size_problems(**sizes, **facts)
    assert len(problems) == 1 and problems[0].startswith(expected), problems


@pytest.mark.parametrize(
    ("problem", "expected"),
    [
        (lambda: layout.world_size_problem(8, tp=2, ep=2), None),
        (lambda: layout.world_size_problem(8, tp=2, ep=2, dp=2), None),
        (lambda: layout.world_size_problem(6, ep=4), "world_size 6 is not divisible by tp*cp*ep*pp = 1*1*4*1 = 4"),
        (lambda: layout.world_size_problem(6, cp=2, dp=2), "world_size 6 != tp*cp*ep*dp*pp = 1*2*1*2*1 = 4"),
        (lambda: layout.heads_problem("num_heads", 8, 4), None),
        (lambda: layout.heads_problem("num_heads", 3, 2), "num_heads=3 is not divisible by tp=2: choose tp dividing num_heads"),
        (lambda: layout.heads_problem("num_kv_heads", 1, 2, owner="layers.0.attn"),
         "layers.0.attn.num_kv_heads=1 is not divisible by tp=2: choose tp dividing num_kv_heads"),
        (lambda: layout.experts_problem(8, 4), None),
        (lambda: layout.experts_problem(6, 4), "num_experts 6 is not divisible by ep 4"),
        (lambda: layout.expert_ffn_problem(30, 4, 1), None),  # experts not split over tp
        (lambda: layout.expert_ffn_problem(30, 1, None), None),
        (lambda: layout.expert_ffn_problem(30, 4, None), "expert ffn_hidden_size 30 is not divisible by etp=4"),
        (lambda: layout.seq_len_problem(32, 4), None),
        (lambda: layout.seq_len_problem(12, 4), "seq_len 12 not divisible by 2*cp = 8: zigzag context parallelism"),
        (lambda: layout.seq_len_problem(12, 4, "contiguous"), None),
        (lambda: layout.seq_len_problem(30, 4, "contiguous"), "seq_len 30 not divisible by cp = 4: contiguous"),
        (lambda: layout.sequence_split_problem(16, 4), None),
        (lambda: layout.sequence_split_problem(6, 4), "seq_len/cp=6 is not divisible by tp=4"),
        (lambda: layout.batch_problem(16, 2, 4, 2), None),
        (lambda: layout.batch_problem(12, 2, 4), "global_batch_size 12 not divisible by micro_batch_size*dp_ep = 2*4 = 8: "),
        (lambda: layout.batch_problem(10, 2, 4, default=True),
         "global_batch_size 10 not divisible by micro_batch_size*dp_ep = 2*4 = 8 (the default, 2 on every layout): "),
        (lambda: layout.batch_problem(8, 2, 2, 4), "global_batch_size 8 not divisible by micro_batch_size*dp_ep*pp_microbatches = 2*2*4 = 16"),
    ],
)  # fmt: skip
def test_each_rule_names_its_fix(problem, expected: str | None) -> None:
    """One function a rule, shared by size_problems and the runtime checks: None when obeyed."""
    found = problem()
    assert found == expected if expected is None else found.startswith(expected), found


def test_rule_helpers() -> None:
    assert [layout.cp_chunks(4), layout.cp_chunks(4, "contiguous")] == [8, 4]
    assert layout.experts_split_over_tp(2, None) and layout.experts_split_over_tp(2, 2)
    assert not layout.experts_split_over_tp(2, 1) and not layout.experts_split_over_tp(1, None)


def test_runtime_checks_raise_the_rules_words() -> None:
    """The sampler, cp sharding and the tensor-parallel head check raise what size_problems says."""
    from torch import nn

    from lightning_moe.cp import check_seq_len
    from lightning_moe.data import resolve_batch_layout
    from lightning_moe.parallel.plans.tensor_parallel import check_head_counts

    with pytest.raises(ValueError) as err:
        resolve_batch_layout(12, 4, 2)
    assert [str(err.value)] == layout.size_problems(dp=2, global_batch_size=12, micro_batch_size=4)
    with pytest.raises(ValueError) as err:
        check_seq_len(30, 2)
    assert [str(err.value)] == layout.size_problems(cp=2, seq_len=30)
    module = nn.Module()
    module.attn = nn.Module()
    module.attn.num_kv_heads = 1
    with pytest.raises(
        ValueError, match=r"^attn\.num_kv_heads=1 is not divisible by tp=2: choose tp dividing num_kv_heads$"
    ):
        check_head_counts(module, 2)


def test_valid_sizes_have_no_problems() -> None:
    facts = dict(world_size=16, num_heads=8, num_kv_heads=2, num_experts=8, seq_len=64, global_batch_size=32)
    assert layout.size_problems(tp=2, cp=2, ep=2, dp=1, pp=2, etp=1, **facts, pp_microbatches=2) == []


LAYOUTS = [
    dict(tp=2, ep=2, dp=2),
    dict(tp=2, cp=2, ep=2, etp=1),
    dict(cp=2, ep=2, pp=2),
    dict(tp=2, dp=2, pp=2, etp=1),
]
# ParallelDims' mesh of each group the planner charges traffic to.
MESHES = {"tp": "tp_mesh", "cp": "cp_mesh", "ep": "ep_mesh", "pp": "pp_mesh", "dense": "dense_grad_mesh",
          "token": "token_mesh", "sequence": "sequence_mesh", "edp": "edp_mesh"}  # fmt: skip


@pytest.mark.parametrize("sizes", LAYOUTS, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_parallel_dims_meshes_match_planner_groups(sizes: dict[str, int]) -> None:
    """Every group of ParallelDims' two views holds the ranks, in order, that the planner's group of
    the same name does, seen from the first and the last rank (torch's fake process group)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("needs a process without a process group")
    world = 8
    planned = Layout(**{**sizes, "dp": sizes.get("dp", 1), "etp": sizes.get("etp", sizes.get("tp", 1))})
    assert planned.world_size == world
    for rank in (0, world - 1):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            dims = ParallelDims(**{k: v for k, v in sizes.items() if k != "dp"}, dp=sizes.get("dp", 1))
            dims.build_mesh("cpu")
            coords = layout.rank_coordinates(planned.mesh_sizes(), rank)
            assert list(dims.mesh.get_coordinate()) == [coords[d] for d in layout.MESH_DIMS]
            for group, mesh in MESHES.items():
                ranks = getattr(dims, mesh).mesh.flatten().tolist()
                assert ranks == group_ranks(planned, group, rank), (group, rank)
            assert dims.expert_mesh.mesh.shape == (planned.ep, planned.size("etp"))
        finally:
            dist.destroy_process_group()


def test_planner_refuses_what_the_rules_refuse() -> None:
    """The planner's layout_problems starts from the same rules, in the same words."""
    from lightning_moe.planner import ModelShape, layout_problems

    model = ModelShape(num_heads=8, num_kv_heads=2, num_experts=6, moe_ffn_hidden_size=30)
    planned = Layout(tp=2, ep=4, dp=1, micro_batch_size=2, microbatches=1)
    facts = dict(num_heads=8, num_kv_heads=2, num_experts=6, expert_ffn_hidden_size=30, seq_len=32, global_batch_size=6)
    expected = layout.size_problems(tp=2, ep=4, dp=1, etp=1, micro_batch_size=2, **facts)
    assert len(expected) == 2  # experts over ep, batch over micro_batch_size*dp_ep
    assert layout_problems(model, planned, seq_len=32, global_batch_size=6)[:2] == expected


@pytest.mark.parametrize(
    ("spans", "sizes", "charged"),
    [
        (("dp", "ep", "cp"), {"dp": 1, "ep": 2, "cp": 2}, "dp"),  # gradient reduction, whatever else it spans
        (("edp",), {}, "dp"),
        (("cp", "tp"), {"cp": 1, "tp": 2}, "tp"),  # the first dim that is more than one rank
        (("cp", "tp"), {"cp": 1, "tp": 1}, "cp"),
        (("ep", "etp"), {"ep": 1, "tp": 2}, "tp"),
        (("ep", "node"), {"ep": 2}, None),  # not a mesh of the dims
    ],
)
def test_accounted_dim(spans: tuple[str, ...], sizes: dict[str, int], charged: str | None) -> None:
    assert layout.accounted_dim(spans, sizes) == charged


def test_a_shared_rank_set_is_charged_to_gradient_reduction_unless_functional() -> None:
    assert layout.accounted_shared_dim(("dp", "ep"), functional=False) == "dp"
    assert layout.accounted_shared_dim(("dp", "ep"), functional=True) == "ep"
    assert layout.accounted_shared_dim(("dp",), functional=True) == "dp"


def test_folding_keeps_the_ep_group_on_a_node() -> None:
    """The ep groups experiments/bench/ep_folding.py compares: tp2·ep4 on 2 nodes of 4 ranks puts half of each
    unfolded ep group on the other node; folded over tp, the group is one node's 4 ranks."""
    unfolded = ParallelDims(tp=2, ep=4, dp=1, ranks_per_node=4)
    unfolded.validate(8)
    folded = ParallelDims(tp=2, ep=4, dp=2, fold_ep="tp", ranks_per_node=4)
    folded.validate(8)
    assert unfolded._ep_group_ranks()[0].tolist() == [0, 2, 4, 6] and unfolded.ep_rank_nodes == [0, 0, 1, 1]
    assert folded._ep_group_ranks()[0].tolist() == [0, 1, 2, 3] and folded.ep_rank_nodes == [0, 0, 0, 0]
    assert (folded.mesh_ep, folded.etp, folded.world_size) == (2, 1, 8)


# -- resolve_layout: the one resolution of a requested layout ------------------------------------------


def test_resolve_layout_infers_dp_unfolds_ep_and_splits_hsdp():
    folded = layout.resolve_layout(2, tp=2, ep=2, fold_ep="tp")
    assert (folded.dp, folded.mesh_ep, folded.etp, folded.fold_ep, folded.world_size) == (1, 1, 1, ("tp",), 2)
    hsdp = layout.resolve_layout(8, ep=2, data_parallel="hsdp", dp_replicate=2)
    assert (hsdp.dp, hsdp.dp_replicate, hsdp.dp_shard, hsdp.dp_ep) == (4, 2, 2, 8)
    assert layout.resolve_layout(None, tp=2, ep=2, dp=2).world_size == 8
    assert layout.resolve_layout(8, tp=2, cp=2).group_size("edp") == 4  # dp2 x cp2 (experts split over tp)
    assert layout.resolve_layout(8, tp=2, cp=2, etp=1).group_size("edp") == 8  # and tp too
    assert layout.resolve_layout(4, ep=2).as_dict() == {"tp": 1, "cp": 1, "ep": 2, "dp": 2, "pp": 1, "etp": 1}
    request = layout.layout_request({"tp": 2, "ep": 2, "fold_ep": "tp", "pp_schedule": "1F1B", "seed": 3})
    assert request == {"tp": 2, "ep": 2, "fold_ep": "tp"}


@pytest.mark.parametrize(
    ("world_size", "requested", "message"),
    [
        (6, {"ep": 4}, "world_size 6 is not divisible by tp*cp*ep*pp = 1*1*4*1 = 4"),
        (2, {"tp": 2, "ep": 3, "fold_ep": "tp"}, "ep=3 is not divisible by the folded tp = 2"),
        (4, {"dp": 4, "dp_replicate": 2, "data_parallel": "fsdp"}, "dp_replicate/dp_shard split dp for HSDP"),
        (4, {"data_parallel": "hsdp"}, "data_parallel='hsdp' needs dp_replicate or dp_shard"),
        (None, {"ep": 2}, "dp='auto' takes the rest of the world size"),
        (4, {"tp": 0}, "tp=0 must be an integer >= 1"),
    ],
)
def test_resolve_layout_names_the_fix(world_size, requested, message):
    with pytest.raises(ValueError) as err:
        layout.resolve_layout(world_size, **requested)
    assert message in str(err.value)


def test_a_second_build_of_a_layout_in_one_world_takes_the_same_process_groups() -> None:
    """A later Trainer of the same layout in the same process creates no new process group (each keeps
    gloo threads for the life of the process); another layout, or a new world, builds its own."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("needs a process without a process group")
    meshes = []
    for rank in (0, 7):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=8)
        try:
            first, second = ParallelDims(tp=2, ep=2), ParallelDims(tp=2, ep=2)
            assert first.build_mesh("cpu") is second.build_mesh("cpu")
            assert second.edp_mesh is first.edp_mesh and second.dp_ep_mesh is first.dp_ep_mesh
            other = ParallelDims(tp=2, ep=2, etp=1)
            assert other.build_mesh("cpu") is not first.mesh and other.edp_mesh is not first.edp_mesh
            meshes.append(first.mesh)
            assert list(first.mesh.get_coordinate()) == ([0, 0, 0, 0, 0] if rank == 0 else [0, 1, 1, 0, 1])
        finally:
            dist.destroy_process_group()
    assert meshes[0] is not meshes[1]
