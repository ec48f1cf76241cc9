"""jaxpar/sharding/mesh.py: ``jp.make_mesh`` (axis names and order, -1 fill, Auto axis types, device subsets, validation),
its hybrid form (the 8 simulated CPU devices grouped into fake hosts, axes split within/across hosts), host
groups, and ``jp.initialize_distributed`` on its own.

The hybrid reference layout is the one the docstring promises, computed here from positions alone: host h holds
devices ``[h*k, (h+1)*k)`` of ``jax.devices()``; along axis ``a`` coordinate ``c`` lies on host-block
``c // per_host[a]`` (hosts row-major over the across-host shape) and at within-host position
``c % per_host[a]`` (row-major over the per-host shape).
"""

from __future__ import annotations

import itertools
import math
import types

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh

import jaxpar as jp
from jaxpar.sharding.mesh import host_groups, make_hybrid_mesh, split_axes


AXES = ("data", "pipe", "fsdp", "context", "tensor")


def test_axes_constant():
    assert jp.AXES == AXES


def test_default_is_all_data(devices):
    mesh = jp.make_mesh()
    assert isinstance(mesh, Mesh)
    assert mesh.axis_names == AXES
    assert dict(mesh.shape) == {"data": 8, "pipe": 1, "fsdp": 1, "context": 1, "tensor": 1}


@pytest.mark.parametrize("kwargs, expected", [
    (dict(data=-1, fsdp=2, tensor=2), (2, 1, 2, 1, 2)),
    (dict(data=2, fsdp=-1, tensor=2), (2, 1, 2, 1, 2)),
    (dict(data=1, tensor=-1), (1, 1, 1, 1, 8)),
    (dict(data=1, pipe=-1, fsdp=2), (1, 4, 2, 1, 1)),
    (dict(data=2, pipe=2, fsdp=2, tensor=1), (2, 2, 2, 1, 1)),
    (dict(data=2, context=-1, tensor=2), (2, 1, 1, 2, 2)),
    (dict(data=1, fsdp=2, context=4), (1, 1, 2, 4, 1)),
])
def test_fill_and_shape(devices, kwargs, expected):
    mesh = jp.make_mesh(**kwargs)
    assert mesh.axis_names == AXES
    assert tuple(mesh.shape[a] for a in AXES) == expected
    assert mesh.devices.shape == expected
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in devices)


def test_tensor_is_innermost(devices):
    """Adjacent devices (fast links) form the tensor axis."""
    mesh = jp.make_mesh(data=2, fsdp=2, tensor=2)
    ids = [[d.id for d in row] for row in mesh.devices.reshape(-1, 2)]
    for row in ids:
        assert abs(row[1] - row[0]) == 1, ids


def test_auto_axis_types_by_default(devices):
    mesh = jp.make_mesh(data=2, fsdp=4)
    assert tuple(mesh.axis_types) == (AxisType.Auto,) * 5


def test_explicit_axis_types_passed_through(devices):
    types = (AxisType.Explicit, AxisType.Auto, AxisType.Explicit, AxisType.Auto, AxisType.Explicit)
    mesh = jp.make_mesh(data=2, fsdp=2, tensor=2, axis_types=types)
    assert tuple(mesh.axis_types) == types
    # the four-axis form of earlier releases (no context): context takes tensor's type
    mesh = jp.make_mesh(data=2, fsdp=2, tensor=2, axis_types=types[:3] + types[4:])
    assert tuple(mesh.axis_types) == types[:3] + (types[4], types[4])


def test_context_is_keyword_only_and_positional_calls_keep_their_meaning(devices):
    """The four-axis positional form ``make_mesh(data, pipe, fsdp, tensor)`` still means what it did; context
    sits between fsdp and tensor in the mesh, so at size 1 the device grid is the four-axis one."""
    mesh = jp.make_mesh(2, 1, 2, 2)
    assert tuple(mesh.shape[a] for a in AXES) == (2, 1, 2, 1, 2)
    old = jax.make_mesh((2, 1, 2, 2), ("data", "pipe", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 4)
    assert [d.id for d in mesh.devices.flat] == [d.id for d in old.devices.flat]
    with pytest.raises(TypeError):
        jp.make_mesh(1, 1, 1, 1, None, None, 8)


def test_axis_types_wrong_length(devices):
    with pytest.raises(ValueError, match=r"axis_types has 2 entries"):
        jp.make_mesh(axis_types=(AxisType.Auto, AxisType.Auto))


def test_device_subset(devices):
    subset = devices[:4]
    mesh = jp.make_mesh(data=2, tensor=-1, devices=subset)
    assert dict(mesh.shape) == {"data": 2, "pipe": 1, "fsdp": 1, "context": 1, "tensor": 2}
    assert [d.id for d in mesh.devices.flat] == [d.id for d in subset]
    assert tuple(mesh.axis_types) == (AxisType.Auto,) * 5


def test_devices_of_another_mesh_as_an_array(devices):
    """``devices=`` takes ``mesh.devices`` (an n-d numpy array of devices) in its flat order."""
    other = jp.make_mesh(data=2, fsdp=2, devices=devices[4:])
    mesh = jp.make_mesh(fsdp=4, devices=other.devices)
    assert list(mesh.devices.flat) == list(other.devices.flat)


def test_single_device_mesh(devices):
    mesh = jp.make_mesh(data=1, devices=jax.devices()[:1])
    assert mesh.devices.size == 1
    assert tuple(mesh.shape[a] for a in AXES) == (1, 1, 1, 1, 1)


def test_describe(devices):
    text = jp.describe(jp.make_mesh(data=2, fsdp=2, tensor=2))
    assert "data=2 pipe=1 fsdp=2 context=1 tensor=2" in text
    assert "8 x" in text


@pytest.mark.parametrize("kwargs, pattern", [
    # the message names the sizes, their product and the device count, and suggests a fix
    (dict(data=3, fsdp=2), r"data=3 x pipe=1 x fsdp=2 x context=1 x tensor=1 multiply to 6, but there are 8 devices.*-1"),
    (dict(data=2, fsdp=2, tensor=4), r"multiply to 16, but there are 8 devices"),
    (dict(data=-1, fsdp=3), r"cannot fill data=-1.*multiply to 3.*does not divide the 8 devices"),
    (dict(data=0), r"data=0 must be positive"),
    (dict(data=1, tensor=0), r"tensor=0 must be positive"),
    (dict(data=-2), r"data=-2 must be positive"),
    (dict(data=-1, fsdp=-1), r"at most one mesh axis may be -1.*\['data', 'fsdp'\]"),
    (dict(data=2.0), r"data=2.0 must be an int"),
    (dict(data=True), r"data=True must be an int"),
])
def test_invalid_sizes(devices, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        jp.make_mesh(**kwargs)


def test_subset_mismatch_mentions_device_count(devices):
    with pytest.raises(ValueError, match=r"multiply to 8, but there are 4 devices"):
        jp.make_mesh(data=8, devices=devices[:4])


def test_empty_devices():
    with pytest.raises(ValueError, match=r"devices= is empty"):
        jp.make_mesh(devices=[])


def test_make_mesh_rejects_duplicated_devices():
    with pytest.raises(ValueError, match="more than once"):
        jp.make_mesh(data=2, devices=[jax.devices()[0]] * 2)


# ------------------------------------------------------------------------------------- the hybrid form

def expected_device_index(coord, per_host, across):
    """Position in ``jax.devices()`` of the device at mesh coordinate ``coord`` (the documented layout)."""
    per, acr = [per_host[a] for a in AXES], [across[a] for a in AXES]
    host = np.ravel_multi_index([c // p for c, p in zip(coord, per)], acr)
    within = np.ravel_multi_index([c % p for c, p in zip(coord, per)], per)
    return int(host) * math.prod(per) + int(within)


def check_layout(mesh, devices, per_host, across):
    per_host = {a: per_host.get(a, 1) for a in AXES}
    across = {a: across.get(a, 1) for a in AXES}
    assert mesh.axis_names == AXES
    assert tuple(mesh.axis_types) == (AxisType.Auto,) * 5
    assert tuple(mesh.shape[a] for a in AXES) == tuple(per_host[a] * across[a] for a in AXES)
    for coord in itertools.product(*(range(n) for n in mesh.devices.shape)):
        assert mesh.devices[coord] == devices[expected_device_index(coord, per_host, across)], coord


def host_of(mesh, k, devices):
    """Mesh-shaped array of fake-host indices (device position // k)."""
    pos = {d: i for i, d in enumerate(devices)}
    return np.vectorize(lambda d: pos[d] // k)(mesh.devices)


def neighbours_share_host(hosts, axis):
    """For each pair of neighbours along ``axis``: whether both lie on one host."""
    a = np.moveaxis(hosts, AXES.index(axis), 0)
    return {bool(x) for x in (a[1:] == a[:-1]).ravel()}


@pytest.mark.parametrize("kwargs, per_host, across", [
    # 2 hosts x 4: data across hosts, fsdp x tensor inside each host
    (dict(data=2, fsdp=2, tensor=2, hosts=2), dict(fsdp=2, tensor=2), dict(data=2)),
    # 4 hosts x 2: tensor fills a host; data and pipe take the hosts
    (dict(data=2, pipe=2, tensor=2, devices_per_host=2), dict(tensor=2), dict(data=2, pipe=2)),
    # fsdp larger than a host spans hosts (MaxText's dcn_fsdp): 2 inside each of 4 hosts
    (dict(data=1, fsdp=8, hosts=4), dict(fsdp=2), dict(fsdp=4)),
    # explicit across_hosts: fsdp split 2 x 2, data inside a host
    (dict(data=2, fsdp=4, hosts=2, across_hosts=dict(fsdp=2)), dict(data=2, fsdp=2), dict(fsdp=2)),
    # across_hosts alone gives the host count
    (dict(data=4, tensor=2, across_hosts=dict(data=4)), dict(tensor=2), dict(data=4)),
])
def test_hybrid_device_order(devices, kwargs, per_host, across):
    mesh = jp.make_mesh(**kwargs)
    check_layout(mesh, devices, per_host, across)
    k = 8 // math.prod(across.values())
    hosts = host_of(mesh, k, devices)
    if mesh.shape["tensor"] > 1:   # tensor neighbours always share a host
        assert neighbours_share_host(hosts, "tensor") == {True}
    for axis in ("data", "pipe"):  # an axis that is only across hosts: every neighbour pair crosses
        if across.get(axis, 1) > 1 and per_host.get(axis, 1) == 1:
            assert neighbours_share_host(hosts, axis) == {False}, axis


def _all(**sizes):
    return {a: sizes.get(a, 1) for a in AXES}


def test_default_split_rules():
    # 1,024 GPUs = 128 nodes x 8: tensor=8 fills a node; FSDP spans the nodes
    assert split_axes(dict(fsdp=128, tensor=8), 128) == (_all(tensor=8), _all(fsdp=128))
    # 64 = 8 nodes x 8: fsdp x tensor inside (4 x 2), data across
    assert split_axes(dict(data=8, fsdp=4, tensor=2), 8) == (_all(fsdp=4, tensor=2), _all(data=8))
    # inner axes first: pipe takes the room fsdp x tensor leave in a node, data and the rest of pipe go across
    assert split_axes(dict(data=4, pipe=4, fsdp=2, tensor=2), 8) == (_all(pipe=2, fsdp=2, tensor=2),
                                                                     _all(data=4, pipe=2))
    # context stays inside a host after tensor (its keys and values move in every layer), before fsdp
    assert split_axes(dict(data=4, fsdp=4, context=4, tensor=2), 8) == (_all(fsdp=2, context=4, tensor=2),
                                                                        _all(data=4, fsdp=2))
    assert split_axes(dict(fsdp=2, context=16, tensor=2), 8) == (_all(context=4, tensor=2), _all(fsdp=2, context=4))


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(data=1, tensor=8, hosts=2), r"tensor=8 cannot stay inside a host of 4 devices"),
    (dict(data=2, tensor=4, devices_per_host=2), r"tensor=4 cannot stay inside a host of 2 devices"),
    (dict(data=4, tensor=2, hosts=2, across_hosts=dict(tensor=2)), r"tensor axis must stay inside a host"),
    (dict(data=8, hosts=3), r"hosts=3 does not divide the 8 devices"),
    (dict(data=8, devices_per_host=3), r"devices_per_host=3 does not divide the 8 devices"),
    (dict(data=8, hosts=4, devices_per_host=4), r"hosts=4 x devices_per_host=4 = 16, but there are 8"),
    (dict(data=8, hosts=2, across_hosts=dict(data=4)), r"multiplies to 4, but there are 2 hosts"),
    (dict(data=2, fsdp=4, hosts=4, across_hosts=dict(data=4)), r"does not divide the axis sizes \(data=2 by 4\)"),
    (dict(data=8, hosts=2, across_hosts=dict(dta=2)), r"unknown axes \['dta'\]"),
    (dict(data=8, hosts=0), r"hosts=0 must be a positive int"),
])
def test_hybrid_errors(devices, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        jp.make_mesh(**kwargs)


def test_planner_helper_on_a_device_subset(devices):
    """make_hybrid_mesh on N of the simulated devices: 2 hosts x (fsdp=1 x tensor=2) from the first 4."""
    mesh = make_hybrid_mesh(dict(tensor=2), dict(data=2), devices=devices[:4])
    check_layout(mesh, devices[:4], dict(tensor=2), dict(data=2))
    with pytest.raises(ValueError, match=r"make 2 x 2 = 4 devices, but there are 8"):
        make_hybrid_mesh(dict(tensor=2), dict(data=2), devices=devices)


def fake_devices(procs):
    """Stand-ins with ``process_index`` (``procs[i]`` devices in process i), ids in order."""
    out, i = [], 0
    for p, n in enumerate(procs):
        for _ in range(n):
            out.append(types.SimpleNamespace(id=i, process_index=p))
            i += 1
    return out


def test_host_groups_follow_processes():
    # one process per node (8 GPUs each), listed interleaved: grouped by process, order kept inside
    devs = fake_devices([8, 8])
    shuffled = [d for pair in zip(devs[:8], devs[8:]) for d in pair]
    assert [[d.id for d in g] for g in host_groups(shuffled, 8)] == [list(range(8)), list(range(8, 16))]
    # one process per GPU: 8 consecutive processes form a node
    groups = host_groups(fake_devices([1] * 16), 8)
    assert [sorted({d.process_index for d in g}) for g in groups] == [list(range(8)), list(range(8, 16))]
    # a process whose devices would straddle two hosts
    with pytest.raises(ValueError, match=r"process 0 has 3 devices.*devices_per_host=2"):
        host_groups(fake_devices([3, 3]), 2)


# ------------------------------------------------------------------------------------------ distributed

def test_initialize_distributed_is_a_no_op_alone(monkeypatch):
    for var in (jp.mesh.ENV_COORDINATOR, "JAX_COORDINATOR_ADDRESS", "SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(jp.mesh, "_cluster_detected", lambda: False)
    assert jp.initialize_distributed() is False
    assert jax.process_count() == 1
