"""Rating data for sequential recommendation (DPFormer App. E.1, following SASRec, Kang & McAuley 2018).

* :mod:`core.data.ratings` parses MovieLens, RecBole and Amazon rating files into :class:`Interactions`.
* :mod:`core.data.registry` names the formats (:class:`DatasetFormat`) and finds the real ml-100k.
* :mod:`core.data.sequential` filters, sorts and splits them into a :class:`SequentialDataset`.
* :mod:`core.data.synthetic` generates seeded look-alikes in the real file formats.
"""

from core.data.ratings import (
    Interactions,
    parse_amazon_csv,
    parse_amazon_jsonl,
    parse_ml1m,
    parse_ml100k,
    parse_recbole,
)
from core.data.registry import (
    PARSERS,
    DatasetFormat,
    load_recbole_ml100k,
    parse_ratings,
    recbole_ml100k_path,
)
from core.data.sequential import (
    SequentialDataset,
    Split,
    build_sequential_dataset,
    gini,
    kcore_filter,
    top_share,
)
from core.data.synthetic import (
    SyntheticFormat,
    SyntheticSpec,
    amazon_games_shaped,
    generate_interactions,
    ml1m_shaped,
    write_synthetic,
)

__all__ = [
    "PARSERS",
    "DatasetFormat",
    "Interactions",
    "SequentialDataset",
    "Split",
    "SyntheticFormat",
    "SyntheticSpec",
    "amazon_games_shaped",
    "build_sequential_dataset",
    "generate_interactions",
    "gini",
    "kcore_filter",
    "load_recbole_ml100k",
    "ml1m_shaped",
    "parse_amazon_csv",
    "parse_amazon_jsonl",
    "parse_ml1m",
    "parse_ml100k",
    "parse_ratings",
    "parse_recbole",
    "recbole_ml100k_path",
    "top_share",
    "write_synthetic",
]
