"""`import plait` registers the torch.distributed backend "plait" without importing torch itself:
at once when torch is already imported, else right after torch finishes importing. Programs
that never use torch pay nothing; programs that do can import plait and torch in either order."""

import importlib.abc
import importlib.util
import sys
import warnings


def _register():
    try:
        from .torch import register

        register()
    except Exception as e:  # registration must never break the user's `import torch`
        warnings.warn(f"plait: could not register the torch.distributed backend: {e}", stacklevel=2)


class _AfterTorch(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the loader of the top-level `torch` package so that the
    backend is registered once torch's own __init__ has run."""

    def find_spec(self, name, path, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        inner = spec.loader

        class Loader(importlib.abc.Loader):
            def create_module(self, s):
                return inner.create_module(s)

            def exec_module(self, module):
                inner.exec_module(module)
                _register()

            def __getattr__(self, attr):  # resource readers and the like: torch's own loader
                return getattr(inner, attr)

        spec.loader = Loader()
        return spec


def install():
    if "torch" in sys.modules:
        _register()
    elif importlib.util.find_spec("torch") is not None and not any(isinstance(f, _AfterTorch) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterTorch())
