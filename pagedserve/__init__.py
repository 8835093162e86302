"""pagedserve: the one import name the project installs.

Its subpackages are the repository's top-level folders: `pagedserve.kernels` is kernels/,
`pagedserve.kvstore` kvstore/, `pagedserve.services` services/, `pagedserve.loadgen` loadgen/.
Those folders hold no __init__.py on purpose: a folder at the repository root with an
__init__.py and a name another distribution uses (Hugging Face's `kernels`, which transformers
requires) would shadow that distribution for every Python started at the root. Without one they
are namespace portions, which lose to any regular package of the same name.

An install copies the folders under pagedserve/ (pyproject's package-dir). In a checkout they sit
beside this folder, and the finder below maps exactly those four names onto them, so `python -m
pagedserve.services.cli` works from the root without installing anything (the GPU machine runs so).
"""

import importlib.abc
import importlib.machinery
import os
import sys

FOLDERS = ("kernels", "kvstore", "services", "loadgen")
_checkout_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _CheckoutFolders(importlib.abc.MetaPathFinder):
    """pagedserve.<folder> -> <this checkout's root>/<folder>.

    Asked first: the checkout whose pagedserve/ was imported supplies the folders, even where an
    editable install of another checkout (a git worktree's main) maps the same names elsewhere."""

    def find_spec(self, fullname, path=None, target=None):
        parent, _, child = fullname.rpartition(".")
        if parent != __name__ or child not in FOLDERS:
            return None
        return importlib.machinery.PathFinder.find_spec(fullname, [_checkout_root])


if os.path.isfile(os.path.join(_checkout_root, "pyproject.toml")) \
        and all(os.path.isdir(os.path.join(_checkout_root, f)) for f in FOLDERS) \
        and not any(isinstance(f, _CheckoutFolders) for f in sys.meta_path):
    sys.meta_path.insert(0, _CheckoutFolders())
