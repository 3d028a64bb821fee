"""MkDocs hooks: the benchmark plots of the last run, and Sphinx roles in docstrings.

``bash scripts/bench.sh`` writes its PNG plots into ``bench-results/`` (or
``$DRAINER_BENCH_OUT``), which is not committed. A page shows a plot as
``![caption](bench/NAME.png)``: when that run's ``NAME.png`` exists, it is published at
``bench/NAME.png``; when it does not, the page shows ``assets/NAME.png`` (a plot of the
figures the page's tables give) if it is committed, else a line that says how to make
the plot. The site builds (``--strict`` too) with or without a benchmark run.

The docstrings use Sphinx roles (``:class:`Transport```); the API reference shows them as
plain code.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

PREFIX = "bench/"
ASSETS = "assets/"
_ROLE = re.compile(r":(?:class|meth|func|mod|attr|exc|data):(<code>)~?")
_IMAGE = re.compile(r"!\[(?P<alt>[^\]]*)\]\(bench/(?P<name>[\w.-]+\.png)\)")


def _plots_dir(config: Any) -> Path:
    out = os.environ.get("DRAINER_BENCH_OUT")
    if out:
        return Path(out)
    return Path(config.config_file_path).resolve().parent / "bench-results"


def on_files(files: Files, config: Any) -> Files:
    plots = _plots_dir(config)
    if plots.is_dir():
        for png in sorted(plots.glob("*.png")):
            files.append(File.generated(config, PREFIX + png.name, abs_src_path=str(png)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    def replace(match: re.Match[str]) -> str:
        if files.get_file_from_path(PREFIX + match["name"]) is not None:
            return match[0]
        if files.get_file_from_path(ASSETS + match["name"]) is not None:
            return f"![{match['alt']}]({ASSETS}{match['name']})"
        return (
            f"*No plot yet (`{match['name']}`): run `bash scripts/bench.sh`, "
            "then build the docs again.*"
        )

    return _IMAGE.sub(replace, markdown)


def on_page_content(html: str, page: Any, config: Any, files: Files) -> str:
    return _ROLE.sub(r"\1", html)
