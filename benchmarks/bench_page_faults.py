"""What a fresh CPU buffer costs to fill, under the allocator setting a converted model runs with.

    python benchmarks/bench_page_faults.py
    python benchmarks/bench_page_faults.py --sizes 1.2 4.8 19.4 --rounds 40

``to_compressed`` maps every buffer of 1 MiB and up on its own (:mod:`actcomp.host_allocator`),
so each decoded activation in backward lands in pages the kernel has not handed out yet: the
first write to each page faults. This times, interleaved round by round (median of per-round
ratios against the reused buffer), filling a float32 buffer of each size MB

- ``reused``: a buffer allocated once and filled again (no fault: the floor);
- ``fresh``: ``torch.empty`` then the fill (a fault per 4 KiB page);
- ``advised``: :func:`actcomp.host_allocator.empty_for_writing` then the fill (its 2 MiB-aligned
  interior advised to transparent huge pages where the kernel offers them on request).

The header records the kernel's transparent-huge-page setting, which decides the third row.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
from common import REPO_ROOT, benchmark_parser, header_lines, load_average, time_rounds, write_results

from actcomp import host_allocator


def fills(count: int) -> dict:
    """The three ways to fill ``count`` float32 values, by name."""
    reused = torch.empty(count)
    return {
        "reused": lambda: reused.fill_(1.0),
        "fresh": lambda: torch.empty(count).fill_(1.0),
        "advised": lambda: host_allocator.empty_for_writing(count, torch.float32).fill_(1.0),
    }


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--sizes", nargs="+", type=float, default=[1.2, 4.8, 19.4], help="buffer sizes in MB")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start, load_before = time.time(), load_average()
    allocator = host_allocator.return_freed_memory()
    rows = []
    for megabytes in args.sizes:
        count = int(megabytes * 1e6) // 4
        times = time_rounds(fills(count), args.rounds, warmup=2, device=torch.device("cpu"))
        row = {"MB": megabytes, "reused_ms": statistics.median(times["reused"]) * 1e3}
        for name in ("fresh", "advised"):
            row[f"{name}_over_reused"] = statistics.median(t / r for t, r in zip(times[name], times["reused"]))
        row["fresh_over_advised"] = statistics.median(f / a for f, a in zip(times["fresh"], times["advised"]))
        rows.append(row)
        print(row, flush=True)
    setting = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    thp = setting.read_text().strip() if setting.exists() else "not Linux"
    header = header_lines(torch.device("cpu"), args.threads, 0, time.time() - start,
                          {"rounds": args.rounds, "return_freed_memory": allocator,
                           "transparent_hugepage/enabled": thp}, load_before)
    body = ["| MB | fill of a reused buffer | fresh / reused | advised / reused | fresh / advised |",
            "|---:|---:|---:|---:|---:|"]
    body += [f"| {r['MB']} | {r['reused_ms']:.3f} ms | {r['fresh_over_reused']:.1f}x | {r['advised_over_reused']:.1f}x | "
             f"**{r['fresh_over_advised']:.2f}x** |" for r in rows]
    print("\n".join(body))
    write_results("page_faults", torch.device("cpu"), args.threads, header, "Filling a fresh CPU buffer: 4 KiB pages "
                  "against huge pages on request", body, rows, list(rows[0]), REPO_ROOT / "benchmarks" / "results")


if __name__ == "__main__":
    main()
