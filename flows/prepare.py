"""Stage 1 flow: prepare every dataset, image dataset, text dataset and pretrained model of the profile (in
parallel), recorded under one parent run."""

from __future__ import annotations

from typing import Any

from prefect import unmapped

from flows.recorded import recorded_flow
from pbconfig.data import PrepareConfig
from storage.recording import RunRef
from tasks.prepare import materialize_source, prepare_dataset
from tasks.prepare_images import prepare_image_dataset, prepare_pretrained
from tasks.prepare_texts import prepare_text_dataset
from tasks.records import close_flow_record, open_flow_record

STAGE = "data"


@recorded_flow("prepare", log_prints=True)
def prepare_flow(config: PrepareConfig, profile: str = "quick", parent: RunRef | None = None) -> dict[str, Any]:
    """Materialise each dataset's source, then parse, filter, split and save it, once per content; split,
    resize and save each image dataset; filter, split and save each text dataset; convert and check each
    pretrained model."""
    run = open_flow_record(flow="prepare", stage=STAGE, config=config, profile=profile, parent=parent)
    futures_images = prepare_image_dataset.map(list(config.images), parent=unmapped(run))
    futures_models = prepare_pretrained.map(list(config.models), parent=unmapped(run))
    futures_texts = prepare_text_dataset.map(list(config.texts), parent=unmapped(run))
    sources = materialize_source.map(list(config.datasets)).result()  # a bad source stops here, named
    prepared = prepare_dataset.map(list(config.datasets), sources, parent=unmapped(run)).result()
    images, models, texts = futures_images.result(), futures_models.result(), futures_texts.result()

    def entry(p: Any) -> dict[str, Any]:
        return {"path": p.path, "content_hash": p.content_hash, "cached": p.cached, "stats": p.stats}

    summary = {
        "run_id": run.run_id,
        "datasets": {p.name: entry(p) for p in prepared},
        "images": {p.name: entry(p) for p in images},
        "texts": {p.name: entry(p) for p in texts},
        "models": {p.name: entry(p) for p in models},
    }
    everything = [*prepared, *images, *texts, *models]
    close_flow_record(
        run,
        metrics={
            "n_datasets": len(prepared),
            "n_image_datasets": len(images),
            "n_text_datasets": len(texts),
            "n_models": len(models),
            "n_cached": sum(p.cached for p in everything),
        },
        summary=summary,
    )
    return summary
