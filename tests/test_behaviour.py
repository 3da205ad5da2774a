"""One behaviour suite over every local family (plain, quantized, dynamic): see tests/behaviour.py.

Each test is one behaviour, parametrized over every family it can be asked of; a family that cannot
do it must refuse it as it declares. The distributed twins run the same checks in
test_behaviour_distributed.py.
"""

from __future__ import annotations

import pytest

from behaviour import BEHAVIOURS, KNOWN_DEFECTS, LOCAL, cases
from behaviour_checks import observe, verify
from dist_behaviour_workers import DISTRIBUTED


def run(behaviour: str, family, tmp_path) -> None:
    verify(behaviour, family, [observe(behaviour, family, 0, tmp_path)])


@pytest.mark.parametrize("family", cases("lookup", LOCAL))
def test_lookup_equals_the_reference(family, tmp_path) -> None:
    run("lookup", family, tmp_path)


@pytest.mark.parametrize("family", cases("train_step", LOCAL))
def test_a_training_step_equals_the_reference_or_is_refused(family, tmp_path) -> None:
    run("train_step", family, tmp_path)


@pytest.mark.parametrize("family", cases("bad_ids", LOCAL))
def test_bad_ids_are_refused_naming_them_and_change_nothing(family, tmp_path) -> None:
    run("bad_ids", family, tmp_path)


@pytest.mark.parametrize("family", cases("bad_inputs", LOCAL))
def test_bad_inputs_are_refused_naming_them_and_change_nothing(family, tmp_path) -> None:
    run("bad_inputs", family, tmp_path)


@pytest.mark.parametrize("family", cases("padding", LOCAL))
def test_padding_idx_reads_zero_and_trains_nothing_or_is_refused(family, tmp_path) -> None:
    run("padding", family, tmp_path)


@pytest.mark.parametrize("family", cases("empty_bags", LOCAL))
def test_empty_bags_are_what_torch_makes_of_them(family, tmp_path) -> None:
    run("empty_bags", family, tmp_path)


@pytest.mark.parametrize("family", cases("per_sample_weights", LOCAL))
def test_per_sample_weights_weigh_as_the_reference_or_are_refused(family, tmp_path) -> None:
    run("per_sample_weights", family, tmp_path)


@pytest.mark.parametrize("family", cases("feature_names", LOCAL))
def test_features_named_apart_from_their_table_read_and_train_it(family, tmp_path) -> None:
    run("feature_names", family, tmp_path)


@pytest.mark.parametrize("family", cases("save_load", LOCAL))
def test_saved_and_loaded_into_another_layout_gives_the_same_outputs(family, tmp_path) -> None:
    run("save_load", family, tmp_path)


def test_every_family_answers_every_behaviour_once_and_each_known_defect_is_a_case() -> None:
    """A family has, refuses, or cannot be asked each behaviour (never two of these); a known defect names a case
    that runs, so deleting a family or declaring a behaviour unaskable cannot hide it."""
    families = {**LOCAL, **DISTRIBUTED}
    for family in families.values():
        both = set(family.refuses) & set(family.not_applicable)
        assert not both, f"{family.name} both refuses and cannot be asked {both}"
        assert set(family.refuses) | set(family.not_applicable) <= set(BEHAVIOURS), family.name
    for behaviour, name in KNOWN_DEFECTS:
        assert behaviour in BEHAVIOURS and name in families, (behaviour, name)
        assert behaviour not in families[name].not_applicable, (behaviour, name)
