import pytest

from models.config import laplacian_schedule
from models.errors import ConfigError


def test_ramp_from_the_paper():
    spec = {"laplacian_schedule": "ramp", "start_layer": 4, "increment": 1, "max_count": 5}
    assert laplacian_schedule(spec, 12, 12) == [0, 0, 0, 0, 1, 2, 3, 4, 5, 5, 5, 5]


def test_ramp_with_larger_increment_is_capped():
    spec = {"laplacian_schedule": "ramp", "start_layer": 0, "increment": 3, "max_count": 7}
    assert laplacian_schedule(spec, 4, 8) == [3, 6, 7, 7]


def test_uniform_and_explicit_and_shorthands():
    assert laplacian_schedule({"laplacian_schedule": "uniform", "k": 3}, 4, 6) == [3, 3, 3, 3]
    assert laplacian_schedule({}, 2, 6) == [0, 0]
    assert laplacian_schedule(2, 3, 4) == [2, 2, 2]
    assert laplacian_schedule([0, 1, 4], 3, 4) == [0, 1, 4]


@pytest.mark.parametrize(
    "spec, field, message",
    [
        ({"k": 13}, "k", "0..12"),
        ({"k": -1}, "k", "0..12"),
        ({"k": 2.5}, "k", "integer"),
        ({"laplacian_schedule": "explicit", "k_per_layer": [0] * 11}, "k_per_layer", "depth 12"),
        ({"laplacian_schedule": "explicit", "k_per_layer": [0] * 13}, "k_per_layer", "13 entries"),
        ({"laplacian_schedule": "explicit", "k_per_layer": [0, 0, 0, 13] + [0] * 8}, "k_per_layer[3] (layer 3)",
         "got 13"),
        ({"laplacian_schedule": "ramp", "start_layer": 4, "increment": 1, "max_count": 13}, "max_count", "0..12"),
        ({"laplacian_schedule": "ramp", "start_layer": 12, "increment": 1, "max_count": 5}, "start_layer", "0..11"),
        ({"laplacian_schedule": "ramp", "start_layer": 2, "increment": 0, "max_count": 5}, "increment", ">= 1"),
        ({"laplacian_schedule": "ramp", "increment": 1, "max_count": 5}, "start_layer", "required"),
        ({"laplacian_schedule": "ramp", "start_layer": 1, "increment": 1, "max_count": 5, "k": 2}, "k", "not used"),
        ({"laplacian_schedule": "cosine"}, "laplacian_schedule", "uniform, ramp, explicit"),
    ],
)
def test_bad_schedules_name_the_field_and_the_allowed_values(spec, field, message):
    with pytest.raises(ConfigError, match=message) as info:
        laplacian_schedule(spec, 12, 12)
    assert info.value.field == field
