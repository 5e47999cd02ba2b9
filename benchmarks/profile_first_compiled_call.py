"""Where the first compiled call's time goes with compression inside the graph: cProfile of a
cold ``torch.compile`` (Inductor's and AOTAutograd's caches off) of a small ViT's training step,
plain beside ``compress_in_graph("int8", rest="8bit")``.

    python benchmarks/profile_first_compiled_call.py --depth 2          # times only
    python benchmarks/profile_first_compiled_call.py --depth 1 --profile

The profile names the phases (dynamo's trace, AOTAutograd, Inductor's C++ code generation,
its size-variable simplification in sympy); the answer to "why is the first call slow" is read
there, not guessed.
"""

from __future__ import annotations

import cProfile
import pstats
import time

import timm
import torch
from common import benchmark_parser

import actcomp


def first_call_seconds(depth: int, in_graph: bool, profile: bool) -> float:
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", img_size=64, patch_size=16, num_classes=10, depth=depth)
    x = torch.randn(4, 3, 64, 64)
    torch._dynamo.reset()
    with torch._functorch.config.patch(enable_autograd_cache=False), torch._inductor.config.patch(fx_graph_cache=False):
        step = torch.compile(model)
        profiler = cProfile.Profile() if profile else None
        start = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        if in_graph:
            with actcomp.compress_in_graph("int8", rest="8bit"):
                loss = step(x).sum()
        else:
            loss = step(x).sum()
        loss.backward()
        if profiler is not None:
            profiler.disable()
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(60)
        return time.perf_counter() - start


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--depth", type=int, default=2, help="transformer blocks")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--profile", action="store_true", help="print the in-graph call's cProfile")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    plain = first_call_seconds(args.depth, False, False)
    in_graph = first_call_seconds(args.depth, True, args.profile)
    print(f"first call, cold caches, depth {args.depth}: plain {plain:.1f} s, compress_in_graph {in_graph:.1f} s "
          f"({in_graph / plain:.1f}x)")


if __name__ == "__main__":
    main()
