"""Writes a recorded sysfs tree into a directory, the way the kernel lays it out:
/sys/class/<class>/<name> is a symlink into /sys/devices/..., which is where the files are."""

from __future__ import annotations

from pathlib import Path


def write_tree(root: Path, files: dict[str, str], links: dict[str, str] | None = None) -> Path:
    """`files`: path relative to root -> content; a content of None makes a directory
    where the file would be, which reads as an unreadable attribute. `links`: path ->
    relative symlink target. Returns root, to pass as the `sysfs` argument."""
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if content is None:
            path.mkdir()
        else:
            path.write_text(content)
    for rel, target in (links or {}).items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.symlink_to(target)
    return root
