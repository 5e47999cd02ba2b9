"""``import actcomp`` loads torch and itself, not torch.compile's machinery: Dynamo and Inductor
cost 1.9 s and 2 s on a 2-core machine, paid before a user's first line ran (the demo showed
nothing for that long)."""

from __future__ import annotations

import subprocess
import sys


def test_importing_actcomp_loads_neither_dynamo_nor_inductor():
    code = ("import sys, actcomp; print(sorted(name for name in ('torch._dynamo', 'torch._inductor') "
            "if name in sys.modules)); actcomp.compress_in_graph; print('torch._inductor' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    # compress_in_graph still loads (and with it Inductor) on first use.
    assert done.stdout.split() == ["[]", "True"], done.stdout
