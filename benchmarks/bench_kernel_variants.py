"""How many Triton kernels a model's first converted step compiles on a GPU, counted without one.

    python benchmarks/bench_kernel_variants.py
    python benchmarks/bench_kernel_variants.py --models resnet50 --spec smink0.9+int8

Triton compiles a kernel once per specialization: its constexprs, its arguments' dtypes, and for
each integer argument whether it equals 1 or divides by 16 (pointers: whether the address does),
unless the kernel names that argument in ``do_not_specialize``. Each compile takes about a second
on a GPU's host, the first training step pays them all (Triton's disk cache spares later
processes), and a kernel whose argument is a hash or a stride compiled again whenever the value
happened to divide by 16. This runs one converted training step on the Triton path under Triton's
interpreter (``TRITON_INTERPRET=1``: CPU tensors, small sizes), records every launch, and counts
the distinct specializations a GPU would compile, by kernel. Sizes here are small, so the
divisibility of the sizes differs from a real run's: the count is the order of magnitude, and a
before/after of a change that removes specializations.
"""

from __future__ import annotations

import argparse
import ast
import collections
import inspect
import os
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton loads

import timm  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from common import RESULTS_DIR, header_lines, load_average, write_results  # noqa: E402

import actcomp  # noqa: E402
from actcomp.core.backends import use_backend  # noqa: E402
from actcomp.kernels import triton_runtime  # noqa: E402


def not_specialized(kernel) -> set[str]:
    """The argument names a kernel's ``@triton.jit(do_not_specialize=[...])`` lists, read from
    its source (the interpreter keeps no trace of the option)."""
    source = inspect.getsource(kernel.fn if hasattr(kernel, "fn") else kernel)
    tree = ast.parse(source.lstrip())
    names: set[str] = set()
    for decorator in tree.body[0].decorator_list:
        for keyword in getattr(decorator, "keywords", []):
            if keyword.arg == "do_not_specialize":
                names |= {element.value for element in keyword.value.elts}
    return names


def specialization(kernel, args: tuple, meta: dict) -> tuple:
    """What a GPU launch of ``kernel`` with ``args`` and constexprs ``meta`` compiles by."""
    fn = kernel.fn if hasattr(kernel, "fn") else kernel
    names = list(inspect.signature(fn).parameters)
    skip = not_specialized(kernel)
    key = []
    for name, value in zip(names, args):
        if isinstance(value, torch.Tensor):
            key.append((str(value.dtype), value.data_ptr() % 16 == 0))
        elif isinstance(value, bool) or not isinstance(value, int):
            key.append(type(value).__name__)
        elif name in skip:
            key.append("int")
        else:
            key.append(("int", value == 1, value % 16 == 0))
    return fn.__name__, tuple(key), tuple(sorted(meta.items()))


def count(model_name: str, spec: str, rest: str, img_size: int, seeds: list[int]) -> collections.Counter[str]:
    """Distinct specializations by kernel over one step per seed (the rounding noise's seed mixes
    ``torch.initial_seed()`` in, so a value's divisibility varies from process to process)."""
    keys = set()
    kwargs = {"img_size": img_size} if "vit" in model_name else {}
    for seed in seeds:
        torch.manual_seed(seed)
        model = actcomp.to_compressed(timm.create_model(model_name, num_classes=10, **kwargs), spec, rest=rest)
        images, labels = torch.randn(2, 3, img_size, img_size), torch.randint(0, 10, (2,))
        with use_backend("triton"), triton_runtime.recording(lambda kernel, grid, args, meta:
                                                             keys.add(specialization(kernel, args, meta))):
            F.cross_entropy(model(images), labels).backward()
    return collections.Counter(key[0] for key in keys)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["resnet50", "vit_small_patch16_224"])
    parser.add_argument("--spec", default="mink0.9+int8")
    parser.add_argument("--rest", default="8bit")
    parser.add_argument("--img-size", type=int, default=64)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3],
                        help="a step per seed, their specializations together (what processes with other seeds compile)")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--name", default="kernel_variants")
    args = parser.parse_args(argv)
    started, load_before = time.perf_counter(), load_average()
    import warnings

    rows, body = [], ["Distinct Triton specializations converted training steps launch (each a compile on a "
                      "GPU's first step), by kernel, over one step per seed.", "",
                      "| model | spec | compiles | by kernel |", "|---|---|---:|---|"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the backend's one fallback warning (shape-only codecs)
        for name in args.models:
            counts = count(name, args.spec, args.rest, args.img_size, args.seeds)
            total = sum(counts.values())
            rows.append({"model": name, "spec": f"{args.spec}@{args.rest}", "compiles": total})
            by_kernel = ", ".join(f"`{kernel}` {n}" for kernel, n in counts.most_common())
            body.append(f"| {name} | `{args.spec}@{args.rest}` | {total} | {by_kernel} |")
            print(f"{name}: {total} compiles ({by_kernel})", flush=True)
    header = header_lines(torch.device("cpu"), torch.get_num_threads(), 0, time.perf_counter() - started,
                          {"img_size": args.img_size, "batch": 2, "seeds": " ".join(map(str, args.seeds))}, load_before)
    write_results(args.name, torch.device("cpu"), torch.get_num_threads(), header,
                  "Triton compiles of a first converted step", body, rows, ["model", "spec", "compiles"], args.out_dir)


if __name__ == "__main__":
    main()
