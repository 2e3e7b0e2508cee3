"""The drafter registry and what each built-in spec declares (kinds, defaults, capabilities, layouts)."""

from __future__ import annotations

import pytest

from deepspec.drafters.spec import (
    BUILTIN_KINDS,
    drafter_kinds,
    get_drafter_spec,
    register_drafter_spec,
    spec_of_model_type,
)


def test_default_feature_layers_per_kind():
    assert get_drafter_spec("dspark").default_feature_layers(30) == [1, 8, 14, 21, 27]
    # the paper's protocol: every drafter reads the same feature layers (5 spread, the cache default)
    assert get_drafter_spec("eagle3").default_feature_layers(30) == [1, 8, 14, 21, 27]
    assert get_drafter_spec("mtp").default_feature_layers(30) == []


def test_every_builtin_kind_resolves_to_its_own_spec():
    assert set(BUILTIN_KINDS) <= set(drafter_kinds())
    for kind in BUILTIN_KINDS:
        spec = get_drafter_spec(kind)
        assert spec.kind == kind == spec.config_class.drafter_kind == spec.params_class().kind
        assert spec_of_model_type(spec.config_class.model_type) is spec
        assert "hf" in spec.export_layouts


def test_unknown_kind_and_builtin_name_clash_are_refused():
    with pytest.raises(ValueError, match="unknown drafter kind 'nope'"):
        get_drafter_spec("nope")
    with pytest.raises(ValueError, match="is built in"):
        register_drafter_spec(get_drafter_spec("dspark"))


def test_layer_choice_from_the_cache_per_kind():
    cached = [1, 8, 14, 21, 27]
    assert get_drafter_spec("dspark").select_cache_layers(cached, None) == cached
    assert get_drafter_spec("eagle3").select_cache_layers(cached, None) == cached
    assert get_drafter_spec("eagle3").select_cache_layers(cached, [1, 14, 27]) == [1, 14, 27]
    assert get_drafter_spec("mtp").select_cache_layers(cached, None) == []
    with pytest.raises(ValueError, match=r"drafter.target_layer_ids=\[1, 8\] must equal"):
        get_drafter_spec("dflash").select_cache_layers(cached, [1, 8])
    with pytest.raises(ValueError, match=r"layers \[2\] are not in the cache"):
        get_drafter_spec("eagle3").select_cache_layers(cached, [2])
