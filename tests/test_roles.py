"""The role table (asyncrl/roles.py) agrees with the code it names and the lists derived from it."""

import inspect

import pytest

from asyncrl.fleet.child import entry_function
from asyncrl.fleet.config import PlacementConfig
from asyncrl.roles import ROLE_NAMES, ROLES, role, start_order
from asyncrl.wire.endpoints import BOUND_BY, Endpoints


@pytest.mark.parametrize("r", ROLES, ids=ROLE_NAMES)
def test_each_roles_entry_function_exists_and_takes_the_model_as_declared(r):
    params = list(inspect.signature(entry_function(r)).parameters)
    assert params[0] == "ctx"
    assert (len(params) > 1 and params[1] == "model_dir") == r.takes_model, params


def test_every_address_is_bound_by_exactly_one_process():
    bound = [name for names in BOUND_BY.values() for name in names]
    assert sorted(bound) == sorted(Endpoints.model_fields)


def test_every_role_has_a_placement_section():
    assert set(ROLE_NAMES) <= set(PlacementConfig.model_fields)


def test_the_generators_only_connect_and_start_last():
    assert role("generator").binds == () and start_order()[-1].name == "generator"
    assert [r.name for r in start_order() if r.binds] == ["buffer", "reward", "dispatcher", "learner", "reference"]


def test_an_unknown_role_is_named_with_the_rule():
    with pytest.raises(ValueError, match=r"role \('critic'\) must be one of dispatcher, generator"):
        role("critic")
