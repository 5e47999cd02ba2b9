"""The integer quantizer's two formulations, eager and compiled, run eagerly side by side.

``actcomp.kernels.quantize.quantize_affine`` has one formulation for eager code (pad the last
group with its own last value, cast through int16) and one that Inductor fuses well (pad with
+-inf, cast through int32, pack within each group's row). Both give the same codes (checked here
and in the tests); this measures what running the compiled one eagerly would cost, which is the
price of a single formulation (issue 37 asked for fewer ``is_compiling`` branches).

    python benchmarks/bench_quantize_forms.py --threads 1 --rounds 9
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from unittest import mock

import torch
from common import REPO_ROOT, benchmark_parser, header_lines, load_average, time_rounds, write_results

from actcomp.kernels.quantize import quantize_affine

CASES = [(dtype, bits, group) for dtype in (torch.float32, torch.bfloat16, torch.float16)
         for bits, group in ((8, 256), (4, 64))]


def quantized(x: torch.Tensor, bits: int, group: int, compiled_form: bool):
    """``quantize_affine`` with the formulation ``torch.compiler.is_compiling()`` would pick."""
    with mock.patch.object(torch.compiler, "is_compiling", lambda: compiled_form):
        return quantize_affine(x, bits, group)


def same_codes(first: tuple, second: tuple) -> bool:
    return all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(first, second, strict=True))


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--numel", type=int, default=32 * 197 * 384 + 77, help="elements (a partial last group)")
    parser.add_argument("--out-dir", type=str, default=str(REPO_ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before, started = load_average(), time.perf_counter()
    rows = []
    for dtype, bits, group in CASES:
        x = torch.randn(args.numel, dtype=dtype)
        same = same_codes(quantized(x, bits, group, False), quantized(x, bits, group, True))
        times = time_rounds({"eager form": lambda x=x, bits=bits, group=group: quantized(x, bits, group, False),
                             "compiled form": lambda x=x, bits=bits, group=group: quantized(x, bits, group, True)},
                            args.rounds, warmup=1, device=torch.device("cpu"))
        ratio = statistics.median(c / e for c, e in zip(times["compiled form"], times["eager form"]))
        rows.append({"dtype": str(dtype).removeprefix("torch."), "bits": bits, "group": group, "same_codes": same,
                     "eager_form_ms": round(statistics.median(times["eager form"]) * 1e3, 2),
                     "compiled_form_ms": round(statistics.median(times["compiled form"]) * 1e3, 2),
                     "compiled_over_eager": round(ratio, 2)})
        print(rows[-1])
    header = header_lines(torch.device("cpu"), args.threads, 0, time.perf_counter() - started,
                          {"rounds": args.rounds, "numel": args.numel}, load_before)
    body = ["| dtype | bits | group | same codes | eager form ms | compiled form ms | compiled / eager |",
            "|---|---:|---:|---|---:|---:|---:|"]
    body += [f"| {r['dtype']} | {r['bits']} | {r['group']} | {r['same_codes']} | {r['eager_form_ms']} | "
             f"{r['compiled_form_ms']} | {r['compiled_over_eager']}x |" for r in rows]
    write_results("quantize_forms", torch.device("cpu"), args.threads, header,
                  "The quantizer's compiled formulation run eagerly, beside the eager one", body, rows, list(rows[0]),
                  Path(args.out_dir))


if __name__ == "__main__":
    main()
