"""Where packing lives: below the compressors, so a stage used alone needs no pipeline."""

import subprocess
import sys
from pathlib import Path

import actcomp
import actcomp.core.packed
import actcomp.core.pipeline


def test_stages_used_alone_never_import_the_pipeline():
    # The package's __init__ imports everything, the pipeline included; a bare stand-in package
    # shows what the compressors themselves import.
    package = Path(actcomp.__file__).parent
    code = (
        "import sys, types, torch\n"
        f"package = types.ModuleType('actcomp'); package.__path__ = [{str(package)!r}]\n"
        "sys.modules['actcomp'] = package\n"
        "from actcomp.compressors.affine import Int8\n"
        "from actcomp.compressors.mesa import Mesa8\n"
        "for stage in (Int8(), Mesa8()):\n"
        "    stage.decompress(stage.compress(torch.randn(300)))\n"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('actcomp'))))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)

    imported = result.stdout.split()
    assert "actcomp.core.packed" in imported
    assert "actcomp.core.pipeline" not in imported


def test_packed_is_importable_from_where_it_used_to_live():
    assert actcomp.Packed is actcomp.core.pipeline.Packed is actcomp.core.packed.Packed
