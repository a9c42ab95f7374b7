"""What importing a module loads, asked of a fresh interpreter: the import rules a test holds
a layer to (placement does no I/O, the read model imports no component, ...)."""

from __future__ import annotations

import subprocess
import sys


def loaded(
    imports: str,
    *,
    packages: tuple[str, ...] = (),
    modules: tuple[str, ...] = (),
    prefixes: tuple[str, ...] = (),
) -> list[str]:
    """The modules that `import <imports>` loads, among the top-level `packages`, the exact
    `modules` and those under `prefixes`, sorted."""
    code = (
        f"import sys, {imports}; "
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {packages!r} "
        f"or m in {modules!r} or m.startswith({prefixes!r})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return eval(out.stdout)  # noqa: S307 - a list of module names printed by the code above
