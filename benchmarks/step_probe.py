"""One fresh process of ``bench_commits.py``: the plain and the converted training step of a
timm model (or of the GPT-2-shaped model, ``--model gpt2``: token ids in, converted with
``first_layer=None``), timed in interleaved rounds; prints one JSON line (medians in seconds,
which actcomp it imported, and the CPU capability torch's kernels ran with)."""

import argparse
import copy
import json
import statistics
import time

import timm
import torch
from gpt2_shaped import GPT2, GPT2Config, GPT2Model, gpt2_tokens

import actcomp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--spec", required=True)
    parser.add_argument("--rest", required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--img-size", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--seq-len", type=int, default=64, help=f"tokens per sequence for {GPT2!r}")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rest = None if args.rest == "none" else args.rest
    if args.model == GPT2:
        config = GPT2Config()
        plain = GPT2Model(config)
        converted = actcomp.to_compressed(copy.deepcopy(plain), args.spec, rest=rest, first_layer=None)
        x, y = gpt2_tokens(config, args.batch, args.seq_len), gpt2_tokens(config, args.batch, args.seq_len)
    else:
        plain = timm.create_model(args.model, pretrained=False, num_classes=10, img_size=args.img_size) \
            if "vit" in args.model else timm.create_model(args.model, pretrained=False, num_classes=10)
        converted = actcomp.to_compressed(copy.deepcopy(plain), args.spec, rest=rest)
        x = torch.randn(args.batch, 3, args.img_size, args.img_size)
        y = torch.randint(0, 10, (args.batch,))
    models = {"plain": plain.train(), "step": converted.train()}
    optimizers = {name: torch.optim.SGD(model.parameters(), lr=1e-3) for name, model in models.items()}

    def step(name: str) -> float:
        start = time.perf_counter()
        optimizers[name].zero_grad(set_to_none=True)
        # Flattened: (batch, classes) and GPT-2's (batch, tokens, vocab) alike.
        torch.nn.functional.cross_entropy(models[name](x).flatten(0, -2), y.flatten()).backward()
        optimizers[name].step()
        return time.perf_counter() - start

    times = {"plain": [], "step": []}
    for name in models:
        step(name)  # warm-up
    for index in range(args.steps):
        for name in (["plain", "step"] if index % 2 == 0 else ["step", "plain"]):
            times[name].append(step(name))
    print(json.dumps({"plain_s": statistics.median(times["plain"]), "step_s": statistics.median(times["step"]),
                      "actcomp_file": actcomp.__file__, "cpu_capability": torch.backends.cpu.get_cpu_capability()}))


if __name__ == "__main__":
    main()
