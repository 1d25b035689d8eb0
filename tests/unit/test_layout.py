"""Rank-layout arithmetic: the DESIGN order pp > dp > tp, groups, pods."""

import itertools

import pytest

from meshtrain.api.layout import ParallelLayout

LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2), (2, 4, 8), (3, 2, 4)]


@pytest.mark.parametrize("data,pipeline,tensor", LAYOUTS)
def test_rank_formula_and_coords_are_inverse(data, pipeline, tensor):
    layout = ParallelLayout(data=data, pipeline=pipeline, tensor=tensor)
    seen = set()
    for pp, dp, tp in itertools.product(range(pipeline), range(data), range(tensor)):
        rank = layout.rank_of(pp, dp, tp)
        assert rank == (pp * data + dp) * tensor + tp
        c = layout.coords(rank)
        assert (c.pp, c.dp, c.tp) == (pp, dp, tp)
        seen.add(rank)
    assert seen == set(range(layout.world_size))


@pytest.mark.parametrize("data,pipeline,tensor", LAYOUTS)
def test_groups_partition_the_world(data, pipeline, tensor):
    layout = ParallelLayout(data=data, pipeline=pipeline, tensor=tensor)
    for axis, size in (("tp", tensor), ("dp", data), ("pp", pipeline)):
        groups = layout.all_groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(layout.world_size))
        assert all(len(g) == size for g in groups)


@pytest.mark.parametrize("data,pipeline,tensor", [*LAYOUTS, (5, 3, 2), (4, 6, 1), (1, 7, 3)])
def test_all_groups_are_each_ranks_own_group_listed_once_in_rank_order(data, pipeline, tensor):
    """The O(world) listing equals collecting ``tp_group``/``dp_group``/``pp_group`` rank by rank."""
    layout = ParallelLayout(data=data, pipeline=pipeline, tensor=tensor)
    member_of = {"tp": layout.tp_group, "dp": layout.dp_group, "pp": layout.pp_group}
    for axis, group_of in member_of.items():
        seen: dict[tuple[int, ...], None] = {}
        for rank in range(layout.world_size):
            seen.setdefault(tuple(group_of(rank)), None)
        assert layout.all_groups(axis) == [list(group) for group in seen]


def test_tensor_groups_are_consecutive_ranks_inside_one_pod():
    layout = ParallelLayout(data=2, pipeline=4, tensor=8)
    for group in layout.all_groups("tp"):
        assert group == list(range(group[0], group[0] + 8))
        assert len({layout.pod_of(r, gpus_per_node=8) for r in group}) == 1


@pytest.mark.parametrize("data,pipeline,tensor", LAYOUTS)
@pytest.mark.parametrize("gpus", [1, 2, 3, 4, 8])
def test_tensor_fits_pod_when_every_tensor_group_stays_in_one_pod(data, pipeline, tensor, gpus):
    layout = ParallelLayout(data=data, pipeline=pipeline, tensor=tensor)
    inside = all(
        len({layout.pod_of(r, gpus) for r in group}) == 1 for group in layout.all_groups("tp")
    )
    assert layout.fills_pods(gpus) == (layout.world_size % gpus == 0)
    if layout.fills_pods(gpus):  # whole pods: the predicate is the group property itself
        assert layout.tensor_fits_pod(gpus) == inside
        assert layout.pods(gpus) * gpus == layout.world_size


def test_pods_hold_contiguous_rank_blocks_and_know_their_stages():
    layout = ParallelLayout(data=2, pipeline=2, tensor=1)
    assert list(layout.ranks_of_pod(1, gpus_per_node=2)) == [2, 3]
    assert layout.stages_of_pod(0, gpus_per_node=2) == [0]
    assert layout.stages_of_pod(1, gpus_per_node=2) == [1]
    assert ParallelLayout(1, 4, 1).stages_of_pod(0, gpus_per_node=4) == [0, 1, 2, 3]


def test_out_of_range_is_refused():
    layout = ParallelLayout(2, 2, 2)
    with pytest.raises(ValueError, match="rank 8"):
        layout.coords(8)
    with pytest.raises(ValueError, match="pp=2"):
        layout.rank_of(2, 0, 0)
    with pytest.raises(ValueError, match="data degree"):
        ParallelLayout(0, 1, 1)


@pytest.mark.parametrize(
    ("data", "pipeline", "tensor", "gpus"), [(4, 1, 2, 4), (8, 2, 1, 4), (4, 2, 2, 8), (2, 1, 1, 1)]
)
def test_dp_levels_split_every_dp_group_by_pod(data, pipeline, tensor, gpus):
    lay = ParallelLayout(data=data, pipeline=pipeline, tensor=tensor)
    intra, inter = lay.dp_levels(gpus)
    for rank in range(lay.world_size):
        peers = lay.dp_group(rank)
        same_pod = [
            q for q in peers if q // gpus == rank // gpus
        ]  # DESIGN: pod i holds [i g, (i+1) g)
        position = same_pod.index(rank)
        across = [
            q for q in peers if [p for p in peers if p // gpus == q // gpus].index(q) == position
        ]
        assert [g for g in intra if rank in g] == [same_pod]
        assert [g for g in inter if rank in g] == [across]


LAYOUTS_4D = [(1, 1, 1, 2), (2, 1, 2, 2), (2, 2, 1, 4), (3, 2, 4, 2), (1, 2, 2, 3)]


@pytest.mark.parametrize("data,pipeline,tensor,context", LAYOUTS_4D)
def test_context_axis_sits_between_tensor_and_data(data, pipeline, tensor, context):
    """Megatron's tp-cp-dp-pp order: coords invert the rank formula and each group holds the
    ranks that differ in its own coordinate only."""
    layout = ParallelLayout(data=data, pipeline=pipeline, tensor=tensor, context=context)
    assert layout.world_size == data * pipeline * tensor * context
    grid = itertools.product(range(pipeline), range(data), range(context), range(tensor))
    for pp, dp, cp, tp in grid:
        rank = layout.rank_of(pp, dp, tp, cp)
        assert rank == ((pp * data + dp) * context + cp) * tensor + tp
        assert layout.coords(rank) == type(layout.coords(0))(pp=pp, dp=dp, tp=tp, cp=cp)
    member_of = {
        "tp": layout.tp_group,
        "cp": layout.cp_group,
        "dp": layout.dp_group,
        "pp": layout.pp_group,
    }
    for axis, group_of in member_of.items():
        groups = layout.all_groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(layout.world_size))
        for group in groups:
            assert group_of(group[0]) == group
            fixed = [
                {k: getattr(layout.coords(r), k) for k in member_of if k != axis} for r in group
            ]
            assert all(f == fixed[0] for f in fixed)


def test_context_one_is_the_3d_layout_and_names_no_context():
    flat = ParallelLayout(data=2, pipeline=2, tensor=2)
    assert flat == ParallelLayout(data=2, pipeline=2, tensor=2, context=1)
    assert str(flat) == "dp2·pp2·tp2"
    assert str(ParallelLayout(data=2, pipeline=2, tensor=2, context=4)) == "dp2·pp2·cp4·tp2"
    assert ParallelLayout(data=2, pipeline=1, tensor=2, context=2).mesh_shape_4d == (1, 2, 2, 2)
    with pytest.raises(ValueError, match="context"):
        ParallelLayout(data=1, pipeline=1, tensor=1, context=0)


def test_context_groups_span_pods_once_tensor_times_context_exceeds_a_pod():
    inside = ParallelLayout(data=2, pipeline=1, tensor=2, context=2)
    assert all(len({inside.pod_of(r, 4) for r in g}) == 1 for g in inside.all_groups("cp"))
    across = ParallelLayout(data=1, pipeline=1, tensor=4, context=4)
    assert all(len({across.pod_of(r, 8) for r in g}) == 2 for g in across.all_groups("cp"))
    assert across.dp_ranks_per_pod(8) == 1


@pytest.mark.parametrize(
    ("data", "pipeline", "tensor", "context"),
    [(2, 1, 1, 2), (1, 2, 2, 4), (2, 2, 2, 2), (3, 1, 2, 1)],
)
def test_dp_cp_groups_are_the_ranks_of_each_pp_tp_in_rank_order(data, pipeline, tensor, context):
    """The gradient group: every (dp, cp) of one (pp, tp), as the trainer's Mesh.grad_group sums."""
    lay = ParallelLayout(data=data, pipeline=pipeline, tensor=tensor, context=context)
    groups = lay.all_groups("dp_cp")
    assert len(groups) == pipeline * tensor
    assert sorted(r for g in groups for r in g) == list(range(lay.world_size))
    for group in groups:
        assert group == sorted(group) and len(group) == data * context
        coords = [lay.coords(r) for r in group]
        assert {(c.pp, c.tp) for c in coords} == {(coords[0].pp, coords[0].tp)}
        assert {(c.dp, c.cp) for c in coords} == {
            (d, k) for d in range(data) for k in range(context)
        }
        for rank in group:
            assert lay.dp_cp_group(rank) == group
    if context == 1:
        assert groups == lay.all_groups("dp")
