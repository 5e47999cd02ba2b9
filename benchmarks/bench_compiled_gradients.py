"""How close ``compress_in_graph``'s compiled gradients stay to the compiled plain step's, with
and without the partitioner rebuilding in backward what only a matrix product reads there.

    python benchmarks/bench_compiled_gradients.py                 # ~3 minutes on 2 cores
    python benchmarks/bench_compiled_gradients.py --rests 8bit

For each model (resnet18 and ViT-tiny at 64 px, batch 8; a Llama-shaped model, hidden 128, 2
layers, 2 x 128 tokens, with ``actcomp.tools.llm_outliers.add_outliers``' outlier channels and
sink token built in) and each ``rest`` (the spec ``int8`` for ``"8bit"``, ``int4`` for
``"4bit"``), one compiled training step under ``actcomp.compress_in_graph`` against the same
step compiled without hooks: the cosine of all parameter gradients (float64) and the lowest
cosine of any one parameter's. Three partitions of the joint graph:

- ``defaults``: AOTAutograd's own (every value a matrix product reads in backward is kept);
- ``recompute, no pass``: those values may be rebuilt in backward, the compared ones too;
- ``recompute + pass`` (what ``compress_in_graph`` does under a lossy plan): rebuilt, except
  every value compared with a constant (:mod:`actcomp.whole_model.recomputation`).

Deterministic for a given torch and machine; Inductor's caches off, each run compiled afresh.
"""

from __future__ import annotations

import contextlib
import time

import timm
import torch
import torch.nn.functional as F
from common import REPO_ROOT, benchmark_parser, header_lines, load_average, write_results

import actcomp
from actcomp.whole_model import in_graph

PARTITIONS = ["defaults", "recompute, no pass", "recompute + pass"]


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--models", nargs="+", default=["resnet18", "vit_tiny_patch16_224", "llama"])
    parser.add_argument("--rests", nargs="+", default=["8bit", "4bit"], choices=["8bit", "4bit"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start, load_before = time.time(), load_average()
    rows = []
    for name in args.models:
        for rest in args.rests:
            for partition in PARTITIONS:
                whole, lowest = _cosines(name, rest, partition, args.seed)
                rows.append({"model": name, "rest": rest, "partition": partition, "cosine": whole, "lowest": lowest})
                print(f"{name} {rest} {partition}: {whole:.6f} (lowest parameter {lowest:.5f})", flush=True)
    body = ["| model | rest | partition | gradient cosine | lowest parameter's |", "|---|---|---|---:|---:|"]
    body += [f"| {row['model']} | `{row['rest']}` | {row['partition']} | {row['cosine']:.6f} | {row['lowest']:.5f} |"
             for row in rows]
    settings = {"models": " ".join(args.models), "rests": " ".join(args.rests)}
    header = header_lines(torch.device("cpu"), args.threads, args.seed, time.time() - start, settings, load_before)
    write_results("compiled_gradients", torch.device("cpu"), args.threads, header,
                  "Compiled gradients under compress_in_graph against the compiled plain step's", body, rows,
                  list(rows[0]), REPO_ROOT / "benchmarks" / "results")


def _model(name: str, seed: int):
    """The model and one step's loss function."""
    torch.manual_seed(seed)
    if name == "llama":
        import transformers

        from actcomp.tools.llm_outliers import add_outliers

        config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=4, attn_implementation="sdpa")
        model = transformers.LlamaForCausalLM(config)
        add_outliers(model)
        ids = torch.randint(0, 256, (2, 128))
        return model, lambda step: step(input_ids=ids, labels=ids).loss
    kwargs = {"img_size": 64} if "vit" in name else {}
    model = timm.create_model(name, num_classes=10, **kwargs)
    x, y = torch.randn(8, 3, 64, 64), torch.randint(0, 10, (8,))
    return model, lambda step: F.cross_entropy(step(x), y)


def _cosines(name: str, rest: str, partition: str, seed: int) -> tuple[float, float]:
    model, loss_of = _model(name, seed)
    spec = "int8" if rest == "8bit" else "int4"

    def gradients(hooks: bool) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        torch._dynamo.reset()
        step = torch.compile(model)
        with actcomp.compress_in_graph(spec, rest=rest) if hooks else contextlib.nullcontext():
            loss = loss_of(step)
        loss.backward()
        return [parameter.grad.double().flatten() for parameter in model.parameters() if parameter.grad is not None]

    with torch._functorch.config.patch(enable_autograd_cache=False), torch._inductor.config.patch(fx_graph_cache=False), \
            _partition(partition):
        plain, compressed = gradients(False), gradients(True)
    whole = F.cosine_similarity(torch.cat(plain), torch.cat(compressed), dim=0).item()
    lowest = min(F.cosine_similarity(a, b, dim=0).item() for a, b in zip(plain, compressed) if a.norm() > 0)
    return whole, lowest


@contextlib.contextmanager
def _partition(partition: str):
    """compress_in_graph's partitioner setting replaced for the runs the benchmark compares."""
    original = in_graph.recomputing_what_backward_materializes
    if partition == "defaults":
        replacement = lambda joint_pass: contextlib.nullcontext()  # noqa: E731
    elif partition == "recompute, no pass":
        replacement = lambda joint_pass: original(_NoMarks())  # noqa: E731
    else:
        replacement = original
    in_graph.recomputing_what_backward_materializes = replacement
    try:
        yield
    finally:
        in_graph.recomputing_what_backward_materializes = original


class _NoMarks(in_graph.KeepComparedValues):
    """The joint pass that marks nothing (runs the user's own pass only)."""

    def __call__(self, graph) -> None:
        if self.previous is not None:
            self.previous(graph)

    def uuid(self):
        return ("no marks", super().uuid())


if __name__ == "__main__":
    main()
