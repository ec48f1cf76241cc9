"""jp.make_mesh: axis names and order, -1 fill, Auto axis types, device subsets, validation."""

from __future__ import annotations

import jax
import pytest
from jax.sharding import AxisType, Mesh

import jaxpar as jp

AXES = ("data", "pipe", "fsdp", "tensor")


def test_axes_constant():
    assert jp.AXES == AXES


def test_default_is_all_data(devices):
    mesh = jp.make_mesh()
    assert isinstance(mesh, Mesh)
    assert mesh.axis_names == AXES
    assert dict(mesh.shape) == {"data": 8, "pipe": 1, "fsdp": 1, "tensor": 1}


@pytest.mark.parametrize("kwargs, expected", [
    (dict(data=-1, fsdp=2, tensor=2), (2, 1, 2, 2)),
    (dict(data=2, fsdp=-1, tensor=2), (2, 1, 2, 2)),
    (dict(data=1, tensor=-1), (1, 1, 1, 8)),
    (dict(data=1, pipe=-1, fsdp=2), (1, 4, 2, 1)),
    (dict(data=2, pipe=2, fsdp=2, tensor=1), (2, 2, 2, 1)),
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
    assert tuple(mesh.axis_types) == (AxisType.Auto,) * 4


def test_explicit_axis_types_passed_through(devices):
    types = (AxisType.Explicit, AxisType.Auto, AxisType.Explicit, AxisType.Auto)
    mesh = jp.make_mesh(data=2, fsdp=2, tensor=2, axis_types=types)
    assert tuple(mesh.axis_types) == types


def test_axis_types_wrong_length(devices):
    with pytest.raises(ValueError, match=r"axis_types has 2 entries"):
        jp.make_mesh(axis_types=(AxisType.Auto, AxisType.Auto))


def test_device_subset(devices):
    subset = devices[:4]
    mesh = jp.make_mesh(data=2, tensor=-1, devices=subset)
    assert dict(mesh.shape) == {"data": 2, "pipe": 1, "fsdp": 1, "tensor": 2}
    assert [d.id for d in mesh.devices.flat] == [d.id for d in subset]
    assert tuple(mesh.axis_types) == (AxisType.Auto,) * 4


def test_single_device_mesh(devices):
    mesh = jp.make_mesh(data=1, devices=jax.devices()[:1])
    assert mesh.devices.size == 1
    assert tuple(mesh.shape[a] for a in AXES) == (1, 1, 1, 1)


def test_describe(devices):
    text = jp.describe(jp.make_mesh(data=2, fsdp=2, tensor=2))
    assert "data=2 pipe=1 fsdp=2 tensor=2" in text
    assert "8 x" in text


@pytest.mark.parametrize("kwargs, pattern", [
    # the message names the sizes, their product and the device count, and suggests a fix
    (dict(data=3, fsdp=2), r"data=3 x pipe=1 x fsdp=2 x tensor=1 multiply to 6, but there are 8 devices.*-1"),
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
