"""The behaviour suite over the distributed families on 2 ranks: the checks of test_behaviour.py, each
rank's observation compared with the plain-torch reference of every rank's batch.

Every case runs in one worker launch (tests/dist_behaviour_workers.py ``matrix``); a test reads its
case from that launch's results.
"""

from __future__ import annotations

import pytest

from behaviour import BEHAVIOURS, cases
from behaviour_checks import verify
from dist_behaviour_workers import DISTRIBUTED, WORLD
from distributed import run_ranks


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    path = tmp_path_factory.mktemp("behaviour")
    return [r["cases"] for r in run_ranks(WORLD, "dist_behaviour_workers:matrix", path / "w", 240, path=str(path))]


@pytest.mark.parametrize("behaviour", BEHAVIOURS)
def test_every_behaviour_is_asked_of_every_distributed_family_or_declared_unaskable(behaviour, observed) -> None:
    ran = {f for b, f in observed[0] if b == behaviour}
    assert ran == {f.name for f in DISTRIBUTED.values() if behaviour not in f.not_applicable}


def _check(behaviour: str, family, observed: list[dict]) -> None:
    verify(behaviour, family, [rank[behaviour, family.name] for rank in observed])


@pytest.mark.parametrize("family", cases("lookup", DISTRIBUTED))
def test_lookup_equals_the_reference(family, observed) -> None:
    _check("lookup", family, observed)


@pytest.mark.parametrize("family", cases("train_step", DISTRIBUTED))
def test_a_training_step_equals_the_reference_or_is_refused(family, observed) -> None:
    _check("train_step", family, observed)


@pytest.mark.parametrize("family", cases("bad_ids", DISTRIBUTED))
def test_bad_ids_on_every_rank_are_refused_naming_them_and_change_nothing(family, observed) -> None:
    _check("bad_ids", family, observed)


@pytest.mark.parametrize("family", cases("bad_ids_one_rank", DISTRIBUTED))
def test_a_bad_id_on_one_rank_is_refused_on_every_rank_and_a_good_step_follows(family, observed) -> None:
    _check("bad_ids_one_rank", family, observed)


@pytest.mark.parametrize("family", cases("bad_inputs", DISTRIBUTED))
def test_bad_inputs_on_every_rank_are_refused_naming_them_and_change_nothing(family, observed) -> None:
    _check("bad_inputs", family, observed)


@pytest.mark.parametrize("family", cases("bad_inputs_one_rank", DISTRIBUTED))
def test_a_bad_input_on_one_rank_is_refused_on_every_rank_and_a_good_step_follows(family, observed) -> None:
    _check("bad_inputs_one_rank", family, observed)


@pytest.mark.parametrize("family", cases("padding", DISTRIBUTED))
def test_padding_idx_reads_zero_and_trains_nothing_or_is_refused(family, observed) -> None:
    _check("padding", family, observed)


@pytest.mark.parametrize("family", cases("empty_bags", DISTRIBUTED))
def test_empty_bags_are_what_torch_makes_of_them(family, observed) -> None:
    _check("empty_bags", family, observed)


@pytest.mark.parametrize("family", cases("per_sample_weights", DISTRIBUTED))
def test_per_sample_weights_weigh_as_the_reference_or_are_refused(family, observed) -> None:
    _check("per_sample_weights", family, observed)


@pytest.mark.parametrize("family", cases("feature_names", DISTRIBUTED))
def test_features_named_apart_from_their_table_read_and_train_it(family, observed) -> None:
    _check("feature_names", family, observed)


@pytest.mark.parametrize("family", cases("save_load", DISTRIBUTED))
def test_saved_and_loaded_into_another_layout_gives_the_same_outputs(family, observed) -> None:
    _check("save_load", family, observed)
