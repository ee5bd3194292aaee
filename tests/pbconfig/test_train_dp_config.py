"""The train-dp section names the methods of core's method table: its ``TrainMethod`` and ``PeerMethod`` are
hand-written ``Literal`` s (the config layer does not import ``core.dp.methods``, which loads PyTorch), so a method
added to ``core.dp.methods.METHODS`` is named there too (docs/contributing.md, example A)."""

from __future__ import annotations

from core.dp.methods import METHODS
from pbconfig.train_dp import PEER_METHODS, TRAIN_METHODS


def test_the_config_names_every_method_of_core_once() -> None:
    named = TRAIN_METHODS + PEER_METHODS
    missing = [m for m in METHODS if m not in named]
    assert not missing, (
        f"core.dp.methods.METHODS has {missing}, which pbconfig/train_dp.py does not name: add each to TrainMethod "
        "(the paper's methods, run at every epsilon and without DP) or PeerMethod (other clippers, at peer_epsilons)"
    )
    unknown = [m for m in named if m not in METHODS]
    assert not unknown, f"pbconfig/train_dp.py names {unknown}, which core.dp.methods.METHODS does not define"
    assert len(set(named)) == len(named), f"a method is named twice in TrainMethod and PeerMethod: {named}"
