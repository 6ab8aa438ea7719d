"""The try-it page at ``/``: text in, output out, and the edits highlighted where source and
target share a vocabulary (GEC). One static file, filled in once with the model's name."""

import html
import os
from importlib import resources


def render(model_name: str, generator: str, highlight_edits: bool) -> str:
    template = resources.files("fairseq_pardec.serve").joinpath("page.html").read_text("utf-8")
    return (template.replace("__MODEL__", html.escape(os.path.basename(model_name)))
            .replace("__GENERATOR__", html.escape(generator))
            .replace("__EDITS_CHECKED__", "checked" if highlight_edits else ""))
