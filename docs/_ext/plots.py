"""An mkdocs hook: the benchmarks' plots served from where they are, ``benchmarks/results/*.png``.

MkDocs serves only what lies under ``docs/``; the plots stay where the benchmarks write them,
and pages show them by that path (``benchmarks/results/frontier_torch2.14.1_cpu_t1.png`` from
``docs/index.md``, ``../benchmarks/...`` one folder down), which strict builds check like any
link. mkdocs.yml loads it (``hooks:``).
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

PLOTS = "benchmarks/results/*.png"


def on_files(files: Files, config: MkDocsConfig) -> Files:
    root = Path(config.config_file_path).parent
    for plot in sorted(root.glob(PLOTS)):
        files.append(File(plot.relative_to(root).as_posix(), src_dir=str(root), dest_dir=config.site_dir,
                          use_directory_urls=config.use_directory_urls))
    return files
