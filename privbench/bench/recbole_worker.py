"""Worker side of ``privbench bench recbole-sasrec`` (:mod:`privbench.bench.recbole_sasrec`): runs only in the fresh
process the benchmark starts (``privbench.bench._worker``), where RecBole and its shims
(:mod:`privbench.bench.recbole_compat`) are imported.

The data: privbench's own preparation of the bundled ``ml-100k.inter`` (``parse_recbole`` and
``build_sequential_dataset``, what the ``prepare`` stage runs, on the first ``users`` users where the setting says
so) and, for RecBole, the same rows written to a temporary ``.inter`` file with each timestamp replaced by its rank in
time order, ties in file order (:func:`write_inter_file`). RecBole reads timestamps into float32 (min-max scaled
on its bundled file, a resolution of seconds over ml-100k's seven months) and sorts them with an unstable sort,
so on the bundled file its order of equal or nearly equal timestamps is arbitrary: 4 of the 943 test targets, 5
validation targets and 38 test inputs differ from privbench's, which orders equal timestamps by file order. With
the ranks both sides build the same 5-core, the same items and the same validation and test example of every user;
:func:`check_same_split` verifies it on every run before training (a DataError otherwise).

The scoring: after RecBole has trained (its ``Trainer``, early stopping on validation, unchanged) and tested the
best checkpoint (``test_ndcg_at_10``: RecBole's full sort, which for a sequential model masks only the padding
item, so the user's earlier items are ranked), :func:`our_figures` scores that checkpoint with privbench's
evaluation (``core.metrics.rank_of_target``, pessimistic ties, ``SequentialDataset.history_mask``) on privbench's
split, RecBole's item ids mapped to privbench's through their raw tokens (:func:`recbole_item_ids`).
"""

from __future__ import annotations

import math
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from core.data import parse_recbole, recbole_ml100k_path
from core.data.ratings import Interactions
from core.data.sequential import SequentialDataset, Split, build_sequential_dataset
from core.errors import DataError
from core.metrics import PADDING_IDX, TieBreak, hit_from_ranks, ndcg_from_ranks, rank_of_target
from privbench.bench.recbole_sasrec import Setting, recbole_config, recbole_dataset

TOP_K = 10


def first_users(inter: Interactions, users: int | None) -> Interactions:
    """The rows of the first ``users`` distinct users of ``inter`` (file order), all rows for None."""
    if users is None:
        return inter
    _, first = np.unique(inter.users, return_index=True)
    kept = inter.users[np.sort(first)[:users]]
    return inter.take(np.isin(inter.users, kept))


def time_ranks(timestamps: np.ndarray) -> np.ndarray:
    """``(N,)`` int64: each row's 0-based position in time order, equal timestamps in row (file) order."""
    order = np.lexsort((np.arange(len(timestamps)), timestamps))
    ranks = np.empty(len(timestamps), dtype=np.int64)
    ranks[order] = np.arange(len(timestamps))
    return ranks


def write_inter_file(inter: Interactions, target: Path) -> None:
    """``inter`` as RecBole's atomic ``.inter`` file, rows in their order, each timestamp replaced by its
    :func:`time_ranks` (distinct integers below 2**24: exact in RecBole's float32, so its sort by time cannot
    reorder equal or nearly equal timestamps)."""
    ranks = time_ranks(inter.timestamps)
    with target.open("w", encoding="utf-8") as out:
        out.write("user_id:token\titem_id:token\ttimestamp:float\n")
        for user, item, rank in zip(inter.users.tolist(), inter.items.tolist(), ranks.tolist(), strict=True):
            out.write(f"{user}\t{item}\t{rank}\n")


def our_split(ours: SequentialDataset, split: Split, max_len: int) -> dict[str, list[str]]:
    """Each user's ``split`` example in raw tokens, ``{user: [the last max_len input items..., target]}``, as
    privbench's ``train-dp`` stage feeds and scores it (:meth:`SequentialDataset.padded_batch`)."""
    inputs, targets = ours.padded_batch(np.arange(ours.n_users), max_len, split)
    tokens = ["", *(str(t) for t in ours.raw_item_ids)]
    return {
        str(user): [tokens[i] for i in row if i != PADDING_IDX] + [tokens[target]]
        for user, row, target in zip(ours.raw_user_ids, inputs.tolist(), targets.tolist(), strict=True)
    }


def recbole_split(dataset: Any, item_seq: str, item_seq_len: str) -> dict[str, list[str]]:
    """The same for a split RecBole built (the ``dataset`` of its validation or test loader): its ``item_id_list``
    (the items first, padding after, ``item_length`` of them) and target ``item_id``, in raw tokens."""
    feat, uid, iid = dataset.inter_feat, dataset.uid_field, dataset.iid_field
    user_tokens, item_tokens = dataset.field2id_token[uid], dataset.field2id_token[iid]
    return {
        str(user_tokens[user]): [str(item_tokens[i]) for i in row[:length]] + [str(item_tokens[target])]
        for user, row, length, target in zip(
            feat[uid].tolist(), feat[item_seq].tolist(), feat[item_seq_len].tolist(), feat[iid].tolist(), strict=True
        )
    }


def check_same_split(ours: dict[str, list[str]], recbole: dict[str, list[str]], split: str) -> None:
    """DataError naming the users whose ``split`` example RecBole built differently from privbench."""
    differ = sorted(u for u in ours.keys() | recbole.keys() if ours.get(u) != recbole.get(u))
    if differ:
        u = differ[0]
        raise DataError(
            f"RecBole's {split} split differs from privbench's for {len(differ)} of {len(ours)} users, e.g. user "
            f"{u}: RecBole {recbole.get(u)} vs privbench {ours.get(u)} (inputs..., target); RecBole's model cannot "
            "be scored on privbench's split: check the dataset file written for RecBole (write_inter_file)"
        )


def recbole_item_ids(ours: SequentialDataset, tokens: Sequence[str]) -> torch.Tensor:
    """``(M + 1,)`` long: RecBole's internal id of each privbench item id (0, padding, to RecBole's 0, ``[PAD]``);
    ``tokens`` is RecBole's ``field2id_token`` of the item field. DataError when the two item sets differ."""
    index = {str(t): i for i, t in enumerate(tokens) if i}
    mine = [str(t) for t in ours.raw_item_ids]
    if len(index) != len(mine) or any(t not in index for t in mine):
        missing = sorted(set(mine) - index.keys())[:5]
        extra = sorted(index.keys() - set(mine))[:5]
        raise DataError(
            f"RecBole kept {len(index)} items, privbench {len(mine)} (privbench only, e.g. {missing}; RecBole only, "
            f"e.g. {extra}): the two k-core filters disagree, so their rankings are not over the same candidates"
        )
    return torch.tensor([PADDING_IDX, *(index[t] for t in mine)], dtype=torch.long)


def right_aligned(inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """privbench's left-padded inputs ``(B, L)`` as RecBole's ``item_id_list`` (the items first, padding after)
    and ``item_length`` ``(B,)``."""
    width = inputs.shape[1]
    lengths = (inputs != PADDING_IDX).sum(dim=1)
    columns = torch.arange(width)[None, :]
    shifted = inputs.gather(1, (columns + (width - lengths)[:, None]).clamp(max=width - 1))
    return torch.where(columns < lengths[:, None], shifted, PADDING_IDX), lengths


def recbole_scores(model: Any, inputs: torch.Tensor, to_recbole: torch.Tensor, batch_size: int) -> torch.Tensor:
    """``(B, M + 1)`` float32: the scores RecBole's ``model.full_sort_predict`` (in eval mode) gives privbench's
    left-padded ``inputs`` (privbench item ids), in privbench's item columns (column 0, padding, is never ranked)."""
    device = next(model.parameters()).device
    columns = to_recbole.to(device)
    model.eval()
    rows = []
    with torch.no_grad():
        for start in range(0, len(inputs), batch_size):
            seq, lengths = right_aligned(to_recbole[inputs[start : start + batch_size]])
            batch = {model.ITEM_SEQ: seq.to(device), model.ITEM_SEQ_LEN: lengths.to(device)}
            rows.append(model.full_sort_predict(batch)[:, columns].float().cpu())
    return torch.cat(rows)


def ranking_metrics(scores: torch.Tensor, targets: torch.Tensor, history: torch.Tensor) -> dict[str, float]:
    """privbench's full-ranking figures of ``scores (B, M + 1)`` for ``targets (B,)`` (``core.metrics``, as the
    ``train-dp`` stage scores: padding excluded, pessimistic ties), means over the rows: ``ndcg_at_10_ranked`` /
    ``hit_at_10_ranked`` (the user's earlier items compete: ``train-dp``'s ``*_at_10``), ``ndcg_at_10_masked`` /
    ``hit_at_10_masked`` (``history (B, M + 1)``, :meth:`SequentialDataset.history_mask`, excluded: its
    ``*_at_10_masked``), and ``target_ties``: the rows whose target ties another candidate of the ranked
    protocol, where a tie rule matters."""
    ranked = rank_of_target(scores, targets)
    masked = rank_of_target(scores, targets, exclude=history)
    optimistic = rank_of_target(scores, targets, ties=TieBreak.OPTIMISTIC)
    return {
        "ndcg_at_10_ranked": float(ndcg_from_ranks(ranked, k=TOP_K).mean()),
        "hit_at_10_ranked": float(hit_from_ranks(ranked, k=TOP_K).mean()),
        "ndcg_at_10_masked": float(ndcg_from_ranks(masked, k=TOP_K).mean()),
        "hit_at_10_masked": float(hit_from_ranks(masked, k=TOP_K).mean()),
        "target_ties": int((optimistic != ranked).sum()),
    }


def our_figures(model: Any, ours: SequentialDataset, to_recbole: torch.Tensor, s: Setting) -> dict[str, float]:
    """RecBole's trained ``model`` scored by privbench on privbench's validation and test split of every user:
    ``{split}_{metric}_ours`` for each :func:`ranking_metrics` key (``test_ndcg_at_10_ranked_ours``, ...)."""
    users = np.arange(ours.n_users)
    out: dict[str, float] = {}
    for split in ("valid", "test"):
        inputs, targets = ours.padded_batch(users, s.max_len, split)
        scores = recbole_scores(model, inputs, to_recbole, s.eval_batch_size)
        figures = ranking_metrics(scores, targets, ours.history_mask(users, split))
        out.update({f"{split}_{key}_ours": value for key, value in figures.items()})
    return out


def _recbole_data(s: Setting, folder: Path, device: str) -> tuple[Any, Any, tuple[Any, Any, Any], SequentialDataset]:
    """RecBole's config, dataset and (train, valid, test) loaders, and privbench's dataset (as its prepare stage
    builds it from the same rows), checked to hold the same items and the same validation and test examples."""
    from recbole.config import Config
    from recbole.data import create_dataset, data_preparation
    from recbole.utils import init_seed

    from privbench.bench import recbole_compat

    inter = first_users(parse_recbole(recbole_ml100k_path()), s.users)
    ours = build_sequential_dataset(inter, k=s.kcore)
    name = recbole_dataset(s)
    (folder / "data" / name).mkdir(parents=True)
    write_inter_file(inter, folder / "data" / name / f"{name}.inter")
    with recbole_compat.no_command_line():
        config = Config(
            model="SASRec",
            dataset=name,
            config_dict=recbole_config(s, str(folder / "data"), str(folder / "saved"), device),
        )
    init_seed(config["seed"], config["reproducibility"])
    dataset = create_dataset(config)
    loaders = data_preparation(config, dataset)
    recbole_item_ids(ours, dataset.field2id_token[dataset.iid_field])  # the same items
    item_seq = config["ITEM_ID_FIELD"] + config["LIST_SUFFIX"]
    for split, loader in zip(("valid", "test"), loaders[1:], strict=True):
        theirs = recbole_split(loader.dataset, item_seq, config["ITEM_LIST_LENGTH_FIELD"])
        check_same_split(our_split(ours, split, s.max_len), theirs, split)
    return config, dataset, loaders, ours


def recbole_splits(*, setting: dict[str, Any]) -> dict[str, Any]:
    """Worker side, for tests: the validation and test examples RecBole builds for ``setting``'s data
    (:func:`recbole_split`) and its item tokens, without training."""
    from privbench.bench import recbole_compat

    recbole_compat.install()
    import warnings

    warnings.filterwarnings("ignore", module=r"recbole\.")
    s = Setting.model_validate(setting)
    folder = Path(tempfile.mkdtemp(prefix="privbench-recbole-"))
    try:
        config, dataset, loaders, _ = _recbole_data(s, folder, "cpu")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    item_seq = config["ITEM_ID_FIELD"] + config["LIST_SUFFIX"]
    return {
        split: recbole_split(loader.dataset, item_seq, config["ITEM_LIST_LENGTH_FIELD"])
        for split, loader in zip(("valid", "test"), loaders[1:], strict=True)
    } | {"items": [str(t) for t in dataset.field2id_token[dataset.iid_field][1:]]}


def train_and_test(*, setting: dict[str, Any], threads: int, device: str = "cpu") -> dict[str, Any]:
    """Worker side: train RecBole's SASRec with early stopping on validation, test the best checkpoint with
    RecBole's evaluation, then score it with privbench's (:func:`our_figures`)."""
    from privbench.bench import recbole_compat

    stubbed = recbole_compat.install()
    import warnings

    warnings.filterwarnings("ignore", module=r"recbole\.")  # pandas 3 / torch deprecation notices inside RecBole
    from recbole.model.sequential_recommender import SASRec
    from recbole.trainer import Trainer
    from recbole.utils import init_seed

    s = Setting.model_validate(setting)
    torch.set_num_threads(int(threads))
    folder = Path(tempfile.mkdtemp(prefix="privbench-recbole-"))
    try:
        config, dataset, (train_data, valid_data, test_data), ours = _recbole_data(s, folder, device)
        init_seed(config["seed"] + config["local_rank"], config["reproducibility"])
        model = SASRec(config, train_data.dataset).to(config["device"])
        trainer = Trainer(config, model)
        curve: list[float] = []
        t0 = time.perf_counter()
        best_valid, best_result = trainer.fit(
            train_data, valid_data, verbose=False, saved=True, callback_fn=lambda _e, score: curve.append(score)
        )
        train_s = time.perf_counter() - t0
        # torch >= 2.6 loads weights only; RecBole's checkpoint (written just now by this run) pickles its Config
        checkpoint = torch.load(trainer.saved_model_file, map_location="cpu", weights_only=False)
        model.load_state_dict(checkpoint["state_dict"])
        t1 = time.perf_counter()
        test = trainer.evaluate(test_data, load_best_model=False, show_progress=False)
        eval_s = time.perf_counter() - t1
        to_recbole = recbole_item_ids(ours, dataset.field2id_token[dataset.iid_field])
        ours_figures = our_figures(model, ours, to_recbole, s)
        eval_ours_s = time.perf_counter() - t1 - eval_s
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    epochs_run = len(trainer.train_loss_dict)
    return {
        "test_ndcg_at_10": float(test["ndcg@10"]),
        "test_hit_at_10": float(test["hit@10"]),
        "valid_ndcg_at_10": float(best_valid),
        "valid_hit_at_10": float(best_result["hit@10"]),
        **ours_figures,
        "best_epoch": int(checkpoint["epoch"]) + 1,
        "epochs_run": epochs_run,
        "stopped_early": epochs_run < s.epochs,
        "train_s": train_s,
        "eval_s": eval_s,
        "eval_ours_s": eval_ours_s,
        "data": {
            "users": int(dataset.user_num - 1),  # RecBole counts the padding id
            "items": int(dataset.item_num - 1),
            "interactions": int(dataset.inter_num),
        },
        "valid_curve": [float(v) for v in curve],
        "train_loss": [float(v) if math.isfinite(v) else None for v in trainer.train_loss_dict.values()],
        "stubbed_modules": stubbed,
        "trained_on": str(config["device"]),  # what RecBole really used (torch.device)
    }
