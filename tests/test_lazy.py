"""stager/lazy.py: a module imported on first use, then bound in place of its stand-in."""

from __future__ import annotations

import subprocess
import sys


def test_first_use_imports_the_module_and_rebinds_the_name() -> None:
    """Nothing is imported until an attribute is read; then the name holds the module itself (no
    stand-in left in the way of later uses), and the attribute read is the module's."""
    code = ("import sys; from stager.lazy import on_first_use; ns = {}; "
            "ns['c'] = on_first_use('colorsys', ns, 'c'); before = 'colorsys' in sys.modules; "
            "v = ns['c'].rgb_to_hsv(1.0, 0.0, 0.0); import colorsys; "
            "print(before, v, ns['c'] is colorsys)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split(maxsplit=1)[0] == "False"
    assert out.stdout.strip().endswith("(0.0, 1.0, 1.0) True"), out.stdout
